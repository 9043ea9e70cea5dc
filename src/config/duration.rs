//! Durations written as text (`"500ms"`, `"30s"`, `"5m"`, `"1h"`), with an
//! error that shows the accepted units: a newcomer who writes `"5 parsecs"` or
//! a bare `5` learns what to write instead.

use serde::de::{self, Deserializer, Visitor};
use std::fmt;
use std::time::Duration;

/// What the error messages say a duration looks like.
pub const ACCEPTED: &str =
    "a number and a unit, like \"500ms\", \"30s\", \"5m\" or \"1h\" (units: ms, s, m, h, d)";

struct DurationVisitor;

impl Visitor<'_> for DurationVisitor {
    type Value = Duration;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "a duration: {ACCEPTED}")
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Duration, E> {
        humantime::parse_duration(v).map_err(|e| {
            // humantime's own list of units is long; ours follows.
            let e = e.to_string();
            let reason = e.split(", supported units").next().unwrap_or_default();
            E::custom(format!(
                "{v:?} is not a duration ({reason}); write {ACCEPTED}"
            ))
        })
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Duration, E> {
        Err(E::custom(format!(
            "{v} has no unit; write {ACCEPTED}, e.g. \"{v}s\""
        )))
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Duration, E> {
        Err(E::custom(format!(
            "{v} has no unit; write {ACCEPTED}, e.g. \"{v}s\""
        )))
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Duration, E> {
        Err(E::custom(format!("{v} has no unit; write {ACCEPTED}")))
    }
}

/// For `#[serde(with = "duration")]` on a `Duration`.
pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
    d.deserialize_any(DurationVisitor)
}

/// For `#[serde(default, with = "duration::option")]` on an `Option<Duration>`.
pub mod option {
    use super::DurationVisitor;
    use serde::de::{self, Deserializer, Visitor};
    use std::fmt;
    use std::time::Duration;

    struct OptionVisitor;

    impl<'de> Visitor<'de> for OptionVisitor {
        type Value = Option<Duration>;

        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            DurationVisitor.expecting(f)
        }

        fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
            Ok(None)
        }

        fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
            Ok(None)
        }

        fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
            super::deserialize(d).map(Some)
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
        d.deserialize_option(OptionVisitor)
    }
}
