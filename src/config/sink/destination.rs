//! Rules for broker destination names, applied to every rendered template so
//! a bad name is refused before it reaches the broker.

use crate::config::{Field, Template};

/// Kafka topic names: 1 to 249 of `[a-zA-Z0-9._-]`, not `.` or `..`.
pub fn kafka_topic(name: &str) -> Result<(), String> {
    if name.is_empty() {
        return Err("the topic name is empty; Kafka needs 1 to 249 characters".to_owned());
    }
    if name.len() > 249 {
        // Not quoted: a per-row value may be long.
        return Err(format!(
            "topic name of {} characters is over Kafka's 249-character limit",
            name.len()
        ));
    }
    if name == "." || name == ".." {
        return Err(format!("topic {name:?} is not allowed"));
    }
    if let Some(c) = name
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')))
    {
        return Err(format!(
            "topic {name:?} contains {c:?}; Kafka allows only letters, digits, '.', '_' and '-'"
        ));
    }
    Ok(())
}

/// RabbitMQ exchange names: at most 255 bytes of letters, digits, `-_.:`;
/// empty is the default exchange.
pub fn rabbitmq_exchange(name: &str) -> Result<(), String> {
    if name.len() > 255 {
        return Err(format!(
            "exchange name of {} bytes is over the 255-byte limit",
            name.len()
        ));
    }
    if let Some(c) = name
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | ':')))
    {
        return Err(format!(
            "exchange {name:?} contains {c:?}; RabbitMQ allows only letters, digits, '-', '_', '.' and ':'"
        ));
    }
    Ok(())
}

/// RabbitMQ routing keys: at most 255 bytes.
pub fn rabbitmq_routing_key(key: &str) -> Result<(), String> {
    if key.len() > 255 {
        return Err(format!(
            "routing key of {} bytes is over the 255-byte limit",
            key.len()
        ));
    }
    Ok(())
}

/// Checks a template's fixed text with a rule, by rendering it with a harmless
/// value in each placeholder: a bad literal makes every event fail, so it is
/// a configuration error rather than a per-event one.
pub fn check_template_literals(
    template: &Template,
    rule: fn(&str) -> Result<(), String>,
) -> Result<(), String> {
    rule(&template.render(|_: Field| "x"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kafka_topic_rules() {
        assert!(kafka_topic("outbox.event.order").is_ok());
        assert!(
            kafka_topic("outbox.event.my order")
                .unwrap_err()
                .contains("' '")
        );
        assert!(kafka_topic("").is_err());
        assert!(kafka_topic(&"a".repeat(250)).is_err());
        assert!(kafka_topic("..").is_err());
    }

    #[test]
    fn rabbitmq_rules() {
        assert!(rabbitmq_exchange("").is_ok());
        assert!(rabbitmq_exchange("outbox:events").is_ok());
        assert!(rabbitmq_exchange("out box").is_err());
        assert!(rabbitmq_routing_key(&"k".repeat(256)).is_err());
    }

    #[test]
    fn template_literals_are_checked() {
        let t = Template::parse("bad topic.{aggregate_type}").unwrap();
        assert!(check_template_literals(&t, kafka_topic).is_err());
        let t = Template::parse("outbox.event.{aggregate_type}").unwrap();
        assert!(check_template_literals(&t, kafka_topic).is_ok());
    }
}
