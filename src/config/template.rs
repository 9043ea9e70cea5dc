//! Destination templates: `outbox.event.{aggregate_type}` rendered per event.

use serde::Deserialize;
use std::fmt;

/// A field of an event that a template may refer to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Field {
    AggregateType,
    EventType,
}

impl Field {
    const ALL: [(&'static str, Field); 2] = [
        ("aggregate_type", Field::AggregateType),
        ("event_type", Field::EventType),
    ];
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Part {
    Literal(String),
    Field(Field),
}

/// A parsed template: literal text with `{aggregate_type}` and `{event_type}`
/// placeholders. `{{` and `}}` write a literal brace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Template {
    source: String,
    parts: Vec<Part>,
}

/// Why a template could not be parsed.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum TemplateError {
    #[error(
        "unknown placeholder {{{0}}}; the placeholders are {{aggregate_type}} and {{event_type}}"
    )]
    UnknownPlaceholder(String),
    #[error("unclosed '{{' at byte {0}; write '{{{{' for a literal brace")]
    Unclosed(usize),
    #[error("unmatched '}}' at byte {0}; write '}}}}' for a literal brace")]
    Unmatched(usize),
}

impl Template {
    pub fn parse(source: &str) -> Result<Self, TemplateError> {
        let mut parts = Vec::new();
        let mut literal = String::new();
        let mut chars = source.char_indices().peekable();
        while let Some((at, c)) = chars.next() {
            match c {
                '{' if chars.peek().map(|(_, c)| *c) == Some('{') => {
                    chars.next();
                    literal.push('{');
                }
                '{' => {
                    let mut name = String::new();
                    loop {
                        match chars.next() {
                            Some((_, '}')) => break,
                            Some((_, c)) => name.push(c),
                            None => return Err(TemplateError::Unclosed(at)),
                        }
                    }
                    let field = Field::ALL
                        .iter()
                        .find(|(n, _)| *n == name)
                        .map(|(_, f)| *f)
                        .ok_or(TemplateError::UnknownPlaceholder(name))?;
                    if !literal.is_empty() {
                        parts.push(Part::Literal(std::mem::take(&mut literal)));
                    }
                    parts.push(Part::Field(field));
                }
                '}' if chars.peek().map(|(_, c)| *c) == Some('}') => {
                    chars.next();
                    literal.push('}');
                }
                '}' => return Err(TemplateError::Unmatched(at)),
                c => literal.push(c),
            }
        }
        if !literal.is_empty() {
            parts.push(Part::Literal(literal));
        }
        Ok(Template {
            source: source.to_owned(),
            parts,
        })
    }

    /// Renders the template; `value` supplies each placeholder's text.
    pub fn render<'a>(&self, value: impl Fn(Field) -> &'a str) -> String {
        let mut out = String::with_capacity(self.source.len() + 16);
        self.render_into(&mut out, value);
        out
    }

    /// As [`Self::render`], appending to `out`.
    pub fn render_into<'a>(&self, out: &mut String, value: impl Fn(Field) -> &'a str) {
        for part in &self.parts {
            match part {
                Part::Literal(s) => out.push_str(s),
                Part::Field(f) => out.push_str(value(*f)),
            }
        }
    }

    /// The text the template was parsed from.
    pub fn as_str(&self) -> &str {
        &self.source
    }

    /// True when the template has no placeholder (one fixed destination).
    pub fn is_fixed(&self) -> bool {
        self.parts.iter().all(|p| matches!(p, Part::Literal(_)))
    }
}

impl fmt::Display for Template {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.source)
    }
}

impl<'de> Deserialize<'de> for Template {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        Template::parse(&s).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn render(t: &str) -> String {
        Template::parse(t).unwrap().render(|f| match f {
            Field::AggregateType => "order",
            Field::EventType => "OrderPlaced",
        })
    }

    #[test]
    fn renders_placeholders_and_escapes() {
        assert_eq!(
            render("outbox.event.{aggregate_type}"),
            "outbox.event.order"
        );
        assert_eq!(render("{aggregate_type}.{event_type}"), "order.OrderPlaced");
        assert_eq!(render("x{{y}}"), "x{y}");
        assert!(Template::parse("fixed").unwrap().is_fixed());
    }

    #[test]
    fn rejects_bad_templates() {
        assert_eq!(
            Template::parse("a.{aggregate}"),
            Err(TemplateError::UnknownPlaceholder("aggregate".into()))
        );
        assert_eq!(Template::parse("a.{x"), Err(TemplateError::Unclosed(2)));
        assert_eq!(Template::parse("a}"), Err(TemplateError::Unmatched(1)));
    }
}
