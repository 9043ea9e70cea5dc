//! Values that must never reach a log line or an error message.

use serde::Deserialize;
use std::fmt;

/// A secret string (a password, a connection URL with credentials).
///
/// `Debug` and `Display` print `***`; the value is only reachable through
/// [`Secret::expose`], which makes every use greppable.
#[derive(Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(transparent)]
pub struct Secret(String);

impl Secret {
    pub fn new(value: impl Into<String>) -> Self {
        Secret(value.into())
    }

    pub fn expose(&self) -> &str {
        &self.0
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("***")
    }
}

impl fmt::Display for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("***")
    }
}

/// A connection URL whose password is hidden when printed.
///
/// Operators need to see *where* the relay connects (host, port, database, user)
/// in logs and in `check`, but never the password.
#[derive(Clone, PartialEq, Eq, Deserialize)]
#[serde(transparent)]
pub struct SecretUrl(String);

impl SecretUrl {
    pub fn new(value: impl Into<String>) -> Self {
        SecretUrl(value.into())
    }

    pub fn expose(&self) -> &str {
        &self.0
    }

    /// The URL with any password replaced by `***`.
    pub fn redacted(&self) -> String {
        redact_url(&self.0)
    }
}

impl fmt::Debug for SecretUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", self.redacted())
    }
}

impl fmt::Display for SecretUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.redacted())
    }
}

/// Hides the password of a `scheme://user:password@host/...` URL, and of a
/// libpq key/value string (`password=...`). Text that is neither is returned
/// with everything after the scheme hidden, so an unparseable URL cannot leak.
pub fn redact_url(raw: &str) -> String {
    // Without `//` a URL has no user or password field: `amqp:user:pw@host`
    // parses as an opaque path, which would be shown whole.
    if let Ok(mut url) = url::Url::parse(raw)
        && !url.cannot_be_a_base()
    {
        if url.password().is_some() {
            // set_password only fails for URLs that cannot have credentials.
            let _ = url.set_password(Some("***"));
        }
        let mut out = url.to_string();
        // Query parameters may also carry a password (libpq accepts ?password=).
        if let Some(q) = url.query()
            && q.to_ascii_lowercase().contains("password")
        {
            let base = out.split('?').next().unwrap_or_default().to_owned();
            out = format!("{base}?***");
        }
        return out;
    }
    if raw.contains('=') && !raw.contains("://") {
        return redact_key_values(raw);
    }
    match raw.split_once("://") {
        Some((scheme, _)) => format!("{scheme}://***"),
        None => "***".to_owned(),
    }
}

/// libpq's key/value form: `key = value` pairs, a value bare or
/// single-quoted (with `\\` escapes, so it may hold spaces). A password's
/// value is hidden; after anything that is not a pair, so is the rest.
fn redact_key_values(raw: &str) -> String {
    let mut pairs = Vec::new();
    let mut rest = raw.trim_start();
    while !rest.is_empty() {
        let key_end = rest
            .find(|c: char| c == '=' || c.is_whitespace())
            .unwrap_or(rest.len());
        let key = &rest[..key_end];
        let Some(after_eq) = rest[key_end..].trim_start().strip_prefix('=') else {
            pairs.push(format!("{key} ***"));
            break;
        };
        let value = after_eq.trim_start();
        let len = value_len(value);
        if key.eq_ignore_ascii_case("password") {
            pairs.push(format!("{key}=***"));
        } else {
            pairs.push(format!("{key}={}", &value[..len]));
        }
        rest = value[len..].trim_start();
    }
    pairs.join(" ")
}

/// The length of a key/value string's value at the start of `value`: up
/// to the closing quote of a quoted one (all of it when unclosed), else up
/// to the first space.
fn value_len(value: &str) -> usize {
    if let Some(quoted) = value.strip_prefix('\'') {
        let mut escaped = false;
        for (i, c) in quoted.char_indices() {
            match c {
                _ if escaped => escaped = false,
                '\\' => escaped = true,
                '\'' => return i + 2,
                _ => {}
            }
        }
        return value.len();
    }
    value.find(char::is_whitespace).unwrap_or(value.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_are_hidden() {
        assert_eq!(
            redact_url("postgres://relay:s3cret@db:5432/app"),
            "postgres://relay:***@db:5432/app"
        );
        assert_eq!(
            redact_url("amqp://guest:guest@127.0.0.1:5672/%2f"),
            "amqp://guest:***@127.0.0.1:5672/%2f"
        );
        assert_eq!(
            redact_url("postgres://db/app?user=x&password=s3cret"),
            "postgres://db/app?***"
        );
        assert_eq!(
            redact_url("host=db user=relay password=s3cret"),
            "host=db user=relay password=***"
        );
        assert!(!redact_url("postgres://relay:s3cret@[::1").contains("s3cret"));
        // No `//`: no password field, the whole text after the scheme hidden.
        assert!(!redact_url("amqp:relay:s3cret@rabbit").contains("s3cret"));
        // libpq allows spaces around `=` and quoted values with spaces.
        assert_eq!(
            redact_url("host=db password = s3cret user=relay"),
            "host=db password=*** user=relay"
        );
        assert_eq!(
            redact_url(r"host = db PASSWORD='s3 \'cret\\' dbname='my app'"),
            "host=db PASSWORD=*** dbname='my app'"
        );
        assert_eq!(
            redact_url("host=db password='s3 cret"),
            "host=db password=***"
        );
        assert_eq!(redact_url("host=db oops s3cret"), "host=db oops ***");
        assert_eq!(format!("{:?}", Secret::new("s3cret")), "***");
        assert!(!format!("{:?}", SecretUrl::new("amqp://a:s3cret@h")).contains("s3cret"));
    }

    #[test]
    fn urls_without_password_are_unchanged() {
        assert_eq!(
            redact_url("postgres://relay@127.0.0.1:5432/app"),
            "postgres://relay@127.0.0.1:5432/app"
        );
    }
}
