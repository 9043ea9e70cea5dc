//! The publication `migrate` needs, put right whatever state it is found in.

use crate::support::*;

/// A publication that names the outbox but publishes no inserts (someone
/// set `publish` to something else): `check` fails, and `migrate` adds
/// inserts to what it publishes, instead of adding the table again (which
/// failed on every run).
#[tokio::test]
async fn a_publication_without_inserts_is_made_to_publish_them() {
    let db = TestDb::new().await;
    let toml = with_mode(&base_toml(&db.url, &rabbit_sink()), Mode::Cdc);
    let config = parse(&toml);
    let publication = config.source.cdc.publication_name(&config.outbox.table);
    let path = config_file(&toml);
    let (code, out, err) = run_cli(&["migrate", "--config", &path], &[]);
    assert_eq!(code, 0, "{out}{err}");
    db.client
        .batch_execute(&format!(
            "ALTER PUBLICATION \"{publication}\" SET (publish = 'update')"
        ))
        .await
        .unwrap();
    let (code, out, _) = run_cli(&["check", "--config", &path], &[]);
    assert!(code == 1 && out.contains("[FAIL] publication"), "{out}");
    let (code, out, err) = run_cli(&["migrate", "--config", &path], &[]);
    assert_eq!(code, 0, "{out}{err}");
    let publishes: (bool, bool) = db
        .client
        .query_one(
            "SELECT pubinsert, pubupdate FROM pg_publication WHERE pubname = $1",
            &[&publication],
        )
        .await
        .map(|r| (r.get(0), r.get(1)))
        .unwrap();
    assert_eq!(publishes, (true, true), "inserts added, updates kept");
    let (code, out, err) = run_cli(&["check", "--config", &path], &[]);
    assert!(!out.contains("[FAIL] publication"), "{code} {out}{err}");
    let (_, out, _) = run_cli(&["migrate", "--config", &path], &[]);
    assert!(out.contains("nothing to do"), "{out}");
}
