//! Partition bounds the relay reads but never writes: an application's
//! partition open to the past or the future by `-infinity` or `infinity`.

use crate::partitions::{day_partitioned, partitions_of};
use crate::support::*;

/// Infinite bounds count as unbounded: retention makes its partitions
/// ahead, drops the expired one, and keeps those open to the future;
/// `check` reports them (reading them panicked before).
#[tokio::test]
async fn partitions_bounded_by_infinity_are_read_as_unbounded() {
    let db = TestDb::new().await;
    day_partitioned(&db, &[], false).await;
    db.client
        .batch_execute(
            "CREATE TABLE outbox_past PARTITION OF outbox
                 FOR VALUES FROM ('-infinity') TO ('2020-01-01 00:00:00+00');
             CREATE TABLE outbox_future PARTITION OF outbox
                 FOR VALUES FROM ('2100-01-01 00:00:00+00') TO ('infinity');",
        )
        .await
        .unwrap();
    let toml = set(
        &base_toml(&db.url, &rabbit_sink()),
        "retention.mode",
        "\"partitions\"",
    );
    let path = config_file(&toml);
    let (code, out, err) = run_cli(&["migrate", "--config", &path], &[]);
    assert_eq!(code, 0, "{out}{err}");
    let (code, out, err) = run_cli(&["retention", "--once", "--config", &path], &[]);
    assert_eq!(code, 0, "{out}{err}");
    let names = partitions_of(&db).await;
    assert!(
        names.contains(&"outbox_future".to_owned()) && !names.contains(&"outbox_past".to_owned()),
        "the expired empty partition goes, the future one stays: {names:?}"
    );
    assert!(names.len() > 1, "partitions made ahead: {names:?}");
    let (_, out, err) = run_cli(&["check", "--config", &path], &[]);
    assert!(
        out.contains("partitions") && !err.contains("panicked"),
        "{out}{err}"
    );
}
