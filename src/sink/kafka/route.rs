//! Which topic, key and lane each event goes to.

use crate::config::{Field, Template, destination};
use crate::envelope::routing::{self, Routing};
use crate::outbox::OutboxEvent;
use crate::sink::{Route, SinkError};
use std::collections::HashSet;
use std::sync::{Arc, Mutex, PoisonError};

/// The topic the template names for events of this kind.
pub(super) fn render(
    template: &Template,
    aggregate_type: &str,
    event_type: &str,
) -> Result<String, SinkError> {
    let topic = template.render(|f| match f {
        Field::AggregateType => aggregate_type,
        Field::EventType => event_type,
    });
    destination::kafka_topic(&topic).map_err(SinkError::rejected)?;
    Ok(topic)
}

/// Topics rendered from the template are kept, at most this many: events
/// of one kind then share their topic's name instead of each rendering and
/// checking it again. Past it the names are forgotten and rendered anew.
const KEPT_TOPICS: usize = 1024;

/// Room kept for the name being rendered: Kafka's longest topic name.
const KEPT_NAME_BYTES: usize = 249;

/// The topics events go to: the template, and the topics it rendered.
#[derive(Debug)]
pub(super) struct Topics {
    template: Template,
    rendered: Mutex<Rendered>,
}

#[derive(Debug, Default)]
struct Rendered {
    /// The name being rendered, kept so that a lookup allocates nothing.
    name: String,
    topics: HashSet<Arc<str>>,
}

impl Topics {
    pub(super) fn new(template: Template) -> Self {
        Topics {
            template,
            rendered: Mutex::default(),
        }
    }

    pub(super) fn template(&self) -> &Template {
        &self.template
    }

    /// The topic the template names for events of this kind; a name Kafka
    /// refuses is a refusal of the event, and is not kept.
    fn of(&self, aggregate_type: &str, event_type: &str) -> Result<Arc<str>, SinkError> {
        let mut rendered = self.rendered.lock().unwrap_or_else(PoisonError::into_inner);
        let Rendered { name, topics } = &mut *rendered;
        name.clear();
        self.template.render_into(name, |f| match f {
            Field::AggregateType => aggregate_type,
            Field::EventType => event_type,
        });
        if let Some(topic) = topics.get(name.as_str()) {
            return Ok(Arc::clone(topic));
        }
        if let Err(refused) = destination::kafka_topic(name) {
            // A name past Kafka's limit may be any length: not kept.
            name.clear();
            name.shrink_to(KEPT_NAME_BYTES);
            return Err(SinkError::rejected(refused));
        }
        if topics.len() >= KEPT_TOPICS {
            topics.clear();
        }
        let topic: Arc<str> = Arc::from(name.as_str());
        topics.insert(Arc::clone(&topic));
        Ok(topic)
    }
}

/// The event's topic: its destination column's value, else the template's.
fn topic_of(
    topics: &Topics,
    routing: &Routing,
    event: &OutboxEvent,
) -> Result<Arc<str>, SinkError> {
    let own = routing
        .destination(event, destination::kafka_topic, "sink.topic")
        .map_err(SinkError::rejected)?;
    match own {
        Some(topic) => Ok(Arc::from(topic)),
        None => topics.of(&event.aggregate_type, &event.event_type),
    }
}

/// The event's key column's value, when it has one (else the aggregate id).
fn key_of<'a>(routing: &Routing, event: &'a OutboxEvent) -> Result<Option<&'a str>, SinkError> {
    routing
        .key(event, routing::any_value, "the aggregate id")
        .map_err(SinkError::rejected)
}

/// The event's topic and key. Messages of one aggregate keep their order
/// through a refusal only within one partition: the same topic and the same
/// key, which is the lane. Without a key of its own an event's key is its
/// aggregate id, the same for all of them, so the topic alone names the lane.
pub(super) fn route(
    topics: &Topics,
    routing: &Routing,
    event: &OutboxEvent,
) -> Result<Route, SinkError> {
    let topic = topic_of(topics, routing, event)?;
    let (key, key_from, lane) = match key_of(routing, event)? {
        None => (
            event.aggregate_id.clone(),
            "the aggregate id",
            Arc::clone(&topic),
        ),
        // A NUL cannot occur in a topic name.
        Some(key) => (
            key.to_owned(),
            "the row's outbox.columns.key value",
            Arc::from(format!("{topic}\0{key}")),
        ),
    };
    Ok(Route {
        destination: topic,
        key,
        key_from,
        lane: Some(lane),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Template;

    fn event(aggregate_id: &str, extra: &[(&str, &str)]) -> OutboxEvent {
        OutboxEvent {
            id: "e".into(),
            aggregate_type: "order".into(),
            aggregate_id: aggregate_id.into(),
            event_type: "OrderPlaced".into(),
            event_version: 1,
            payload: serde_json::value::RawValue::from_string("{}".into()).unwrap(),
            headers: vec![],
            created_at: chrono::Utc::now(),
            extra: extra
                .iter()
                .map(|(c, v)| ((*c).to_owned(), (*v).to_owned()))
                .collect(),
        }
    }

    #[test]
    fn the_lane_follows_each_rows_own_topic_and_key() {
        let template = Topics::new(Template::parse("outbox.event.{aggregate_type}").unwrap());
        let routing = Routing::from_columns(&crate::config::ColumnMap {
            destination: Some("topic".into()),
            key: Some("msg_key".into()),
            ..Default::default()
        });
        let lane = |extra: &[(&str, &str)]| {
            route(&template, &routing, &event("o-1", extra))
                .ok()
                .and_then(|r| r.lane)
        };
        // NULL columns: the template's topic, keyed by the aggregate id.
        assert_eq!(lane(&[]).as_deref(), Some("outbox.event.order"));
        // Two events of one aggregate routed to different topics, or keyed
        // differently (other partitions), are in different lanes: one at a time.
        let a = lane(&[("topic", "billing")]);
        let b = lane(&[("topic", "shipping")]);
        assert_eq!(a.as_deref(), Some("billing"));
        assert_ne!(a, b);
        assert_ne!(a, lane(&[("topic", "billing"), ("msg_key", "k")]));
        assert_ne!(lane(&[("msg_key", "k1")]), lane(&[("msg_key", "k2")]));
        assert_eq!(lane(&[("msg_key", "k1")]), lane(&[("msg_key", "k1")]));
        // A refused value has no lane: the event goes alone, and is refused.
        assert_eq!(lane(&[("topic", "no spaces")]), None);
        assert_eq!(lane(&[("msg_key", "")]), None);
        let e = event("o-1", &[("topic", "no spaces")]);
        let Err(SinkError::Rejected(why)) = topic_of(&template, &routing, &e) else {
            panic!("a bad topic value is a refusal");
        };
        assert!(
            why.to_string()
                .contains("column \"topic\" (outbox.columns.destination) holds \"no spaces\""),
            "{why}"
        );
        // Without routing columns the lane is the template's topic, as before.
        let plain = Routing::default();
        let plain_route = route(&template, &plain, &e).unwrap();
        assert_eq!(plain_route.lane.as_deref(), Some("outbox.event.order"));
        assert_eq!(&*plain_route.destination, "outbox.event.order");
        assert_eq!(plain_route.key, "o-1", "keyed by the aggregate id");
        let keyed = route(&template, &routing, &event("o-1", &[("msg_key", "k")])).unwrap();
        assert_eq!(keyed.key, "k");
    }

    fn lock_len(topics: &Topics) -> usize {
        topics.rendered.lock().unwrap().topics.len()
    }

    #[test]
    fn topics_are_rendered_once_and_shared() {
        let topics = Topics::new(Template::parse("shop.{aggregate_type}").unwrap());
        let plain = Routing::default();
        let of = |aggregate_type: &str| {
            let mut e = event("o-1", &[]);
            e.aggregate_type = aggregate_type.into();
            route(&topics, &plain, &e)
        };
        let (a, b) = (of("order").unwrap(), of("order").unwrap());
        assert_eq!(&*a.destination, "shop.order");
        assert!(
            Arc::ptr_eq(&a.destination, &b.destination),
            "one name, shared"
        );
        assert_eq!(a.lane.as_deref(), Some("shop.order"));
        assert_eq!(&*of("invoice").unwrap().destination, "shop.invoice");
        // A name Kafka refuses is a refusal every time, with the reason.
        for _ in 0..2 {
            let Err(SinkError::Rejected(why)) = of("no spaces") else {
                panic!("a topic Kafka refuses is a refusal");
            };
            assert!(why.to_string().contains("no spaces"), "{why}");
        }
        // Past the bound the names are rendered anew, and still right.
        for n in 0..KEPT_TOPICS + 5 {
            let topic = of(&format!("t{n}")).unwrap().destination;
            assert_eq!(&*topic, format!("shop.t{n}"));
        }
        assert!(lock_len(&topics) <= KEPT_TOPICS);
        assert_eq!(&*of("order").unwrap().destination, "shop.order");
    }
}
