use super::*;

mod columns;
mod keys;
mod ranges;
mod services;
mod sink;
mod source;

pub(super) const MINIMAL: &str = r#"
[database]
url = "postgres://relay:s3cret@db:5432/app"

[sink]
type = "kafka"
brokers = "k:9092"
"#;

pub(super) fn err(toml: &str) -> String {
    load_str(toml)
        .expect_err("config should be refused")
        .to_string()
}

#[test]
fn every_shipped_example_loads() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("config");
    let mut n = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "toml") {
            let text = std::fs::read_to_string(&path).unwrap();
            load_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            n += 1;
        }
    }
    assert!(n >= 3, "expected the example configs in {}", dir.display());
}

#[test]
fn defaults_apply() {
    let c = load_str(MINIMAL).unwrap();
    assert_eq!(c.outbox.table.to_string(), "public.outbox");
    assert_eq!(c.source.mode, SourceMode::Polling);
    assert_eq!(c.source.batch_size, 500);
    assert_eq!(c.relay.max_in_flight, 8000);
    assert_eq!(c.relay.confirm_timeout, Duration::from_secs(30));
    let SinkConfig::Kafka(k) = &c.sink else {
        panic!()
    };
    assert_eq!(k.topic.as_str(), "outbox.event.{aggregate_type}");
}

#[test]
fn unknown_keys_are_refused_with_their_path() {
    let e = err(&format!(
        "{MINIMAL}\n[source.polling]\npoll_intervall = \"1s\"\n"
    ));
    assert!(e.contains("poll_intervall"), "{e}");
    assert!(e.contains("source.polling"), "{e}");
    let e = err(&format!("{MINIMAL}\n[relay]\nmax_inflight = 3\n"));
    assert!(e.contains("relay") && e.contains("max_inflight"), "{e}");
    let e = err(&MINIMAL.replace("brokers", "broker"));
    assert!(e.contains("broker"), "{e}");
}

#[test]
fn wrong_types_and_durations_name_the_key() {
    let e = err(&format!("{MINIMAL}\n[relay]\nconfirm_timeout = \"soon\"\n"));
    assert!(e.contains("relay.confirm_timeout"), "{e}");
    let e = err(&format!("{MINIMAL}\n[source]\nbatch_size = \"many\"\n"));
    assert!(e.contains("source.batch_size"), "{e}");
    let e = err(&format!("{MINIMAL}\n[source]\nmode = \"tail\"\n"));
    assert!(e.contains("source.mode") && e.contains("polling"), "{e}");
}

#[test]
fn out_of_range_values_are_listed_together() {
    let e = err(&format!(
        "{MINIMAL}\n[source]\nbatch_size = 0\n[relay]\nmax_in_flight = 0\nretry_base = \"10s\"\nretry_max = \"1s\"\n"
    ));
    assert!(e.contains("3 problems") || e.contains("problems"), "{e}");
    assert!(e.contains("source.batch_size: 0 is out of range"), "{e}");
    assert!(e.contains("relay.max_in_flight"), "{e}");
    assert!(
        e.contains("relay.retry_max: 1s is below relay.retry_base (10s); raise it or lower relay.retry_base"),
        "{e}"
    );
    // A base set alone names itself when the default cap falls below it.
    let e = err(&format!(
        "{MINIMAL}\n[relay]\nreject_retry_base = \"10m\"\n"
    ));
    assert!(
        e.contains("relay.reject_retry_max: 5m is below relay.reject_retry_base (10m)"),
        "{e}"
    );
}

#[test]
fn secrets_never_print() {
    let c = load_str(MINIMAL).unwrap();
    let shown = format!("{c:?}");
    assert!(!shown.contains("s3cret"), "{shown}");
    assert!(shown.contains("relay:***@db"), "{shown}");
    let e = err(&MINIMAL.replace(
        "postgres://relay:s3cret@db:5432/app",
        "postgres://relay:s3cret@db:notaport/app",
    ));
    assert!(!e.contains("s3cret"), "{e}");
}

#[test]
fn database_url_problems() {
    let e = err(&MINIMAL.replace(
        "postgres://relay:s3cret@db:5432/app",
        "postgres://db/app?sslmode=verify-full",
    ));
    assert!(
        e.contains("database.url") && e.contains("database.sslmode"),
        "{e}"
    );
    let e = err(&MINIMAL.replace("/app", ""));
    assert!(e.contains("names no database"), "{e}");
}

/// TLS comes from `database.sslmode`: an `sslmode` in the URL that says
/// otherwise is refused, not overridden (a `require` there would quietly
/// become the default `prefer`).
#[test]
fn an_sslmode_in_the_url_must_agree_with_database_sslmode() {
    let url = "postgres://relay:s3cret@db:5432/app";
    let with = |query: &str, sslmode: Option<&str>| {
        let mut toml = MINIMAL.replace(url, &format!("{url}?{query}"));
        if let Some(mode) = sslmode {
            // verify-ca needs a CA of its own (see the test below).
            let root = if mode == "verify-ca" {
                "sslrootcert = \"/etc/ssl/db-ca.pem\"\n"
            } else {
                ""
            };
            toml = toml.replace("[sink]", &format!("sslmode = \"{mode}\"\n{root}\n[sink]"));
        }
        load_str(&toml).map(|c| c.database.sslmode)
    };
    let e = with("sslmode=require", None).unwrap_err().to_string();
    assert!(
        e.contains("database.url: sets sslmode=require")
            && e.contains("database.sslmode (prefer)")
            && e.contains("set database.sslmode = \"require\""),
        "{e}"
    );
    let e = with("sslmode=disable", Some("verify-full"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("sets sslmode=disable"), "{e}");
    for (query, mode, effective) in [
        ("sslmode=require", Some("require"), SslMode::Require),
        ("sslmode=require", Some("verify-full"), SslMode::VerifyFull),
        ("sslmode=disable", Some("disable"), SslMode::Disable),
        ("sslmode=prefer", Some("verify-ca"), SslMode::VerifyCa),
        ("application_name=x", None, SslMode::Prefer),
    ] {
        let got = with(query, mode).unwrap_or_else(|e| panic!("{query} {mode:?}: {e}"));
        assert_eq!(got, effective, "{query} {mode:?}");
    }
}

/// verify-ca checks the chain and not the host name, so with the system's
/// public CAs any publicly issued certificate would pass: refused, as
/// libpq refuses it.
#[test]
fn verify_ca_needs_a_ca_of_its_own() {
    let toml = MINIMAL.replace("[sink]", "sslmode = \"verify-ca\"\n\n[sink]");
    let e = err(&toml);
    assert!(
        e.contains("database.sslmode") && e.contains("set database.sslrootcert"),
        "{e}"
    );
    let with_ca = MINIMAL.replace(
        "[sink]",
        "sslmode = \"verify-ca\"\nsslrootcert = \"/etc/ssl/db-ca.pem\"\n\n[sink]",
    );
    assert!(load_str(&with_ca).is_ok());
}

/// A syntax error says where and what, not the line's text: a password with
/// a backslash in a quoted URL is a bad escape, and the line holds it.
#[test]
fn a_syntax_error_does_not_quote_the_line() {
    let toml = "[database]\nurl = \"postgres://relay:p\\ss@db/app\"\n[sink]\ntype = \"kafka\"\nbrokers = \"k:9092\"\n";
    let e = load_str(toml).unwrap_err().to_string();
    assert!(
        e.contains("line 2, column 27") && e.contains("missing escaped value"),
        "{e}"
    );
    assert!(!e.contains("p\\ss") && !e.contains("relay:p"), "{e}");
}
