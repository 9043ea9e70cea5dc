//! A row reads alike whichever reader reads it: the polling query, the
//! CDC start-up read and the CDC stream give the same text for columns
//! whose cast to text is not their type's output function (`character(n)`,
//! `boolean`, `inet`), so the event, its key and its aggregate are the
//! same in both modes. And a generated column the relay reads, which
//! pgoutput does not stream, is refused before CDC or auto mode starts,
//! while polling reads it.

use crate::support::*;
use outbox_relay::config::{Config, ResolvedColumns};
use outbox_relay::outbox::{OutboxEvent, Shard};
use outbox_relay::replication::Lsn;
use outbox_relay::source::Reader;
use outbox_relay::source::cdc::{
    CdcReader, CdcServer, CdcSettings, PgServer, Progress, SKIP_MEMORY,
};
use outbox_relay::source::polling::PollingReader;
use std::sync::{Arc, Mutex};
use uuid::Uuid;

/// `flag` as a header, `addr` as an attribute.
const EXTRA: &str = r#"
[[outbox.columns.extra]]
column = "flag"
header = "flag"

[[outbox.columns.extra]]
column = "addr"
attribute = "addr"
"#;

/// A migrated CDC outbox whose aggregate columns are `character(n)`, with
/// a `boolean` and an `inet` extra column; its configuration.
async fn padded_outbox() -> (TestDb, String) {
    let db = TestDb::new().await;
    let sink = format!(
        "[sink]\ntype = \"rabbitmq\"\nurl = \"{}\"\nexchange = \"amq.topic\"\n",
        amqp_url()
    );
    let toml = with_mode(&base_toml(&db.url, &sink), Mode::Cdc);
    // The slot exists from here on: the stream carries every later row.
    db.migrate(&parse(&toml)).await;
    db.client
        .batch_execute(
            "ALTER TABLE outbox ALTER COLUMN aggregate_type TYPE character(12),
                                ALTER COLUMN aggregate_id TYPE character(10),
                                ADD COLUMN flag boolean, ADD COLUMN addr inet",
        )
        .await
        .expect("alter the outbox");
    (db, format!("{toml}\n{EXTRA}"))
}

/// What a reader made of a row: every field as text.
type Read = (
    String,
    String,
    String,
    String,
    i32,
    String,
    Vec<(String, String)>,
    String,
    Vec<(String, String)>,
);

fn read(e: &OutboxEvent) -> Read {
    (
        e.id.clone(),
        e.aggregate_type.clone(),
        e.aggregate_id.clone(),
        e.event_type.clone(),
        e.event_version,
        e.payload.get().to_owned(),
        e.headers.clone(),
        e.created_at.to_rfc3339(),
        e.extra.clone(),
    )
}

/// The events `reader` hands over until there are `n`.
async fn events<R: Reader>(reader: &mut R, n: usize) -> Vec<Read> {
    let mut got = Vec::new();
    while got.len() < n {
        let batch = tokio::time::timeout(WAIT, reader.next_batch(100, usize::MAX))
            .await
            .expect("events within the wait")
            .expect("a read without error");
        got.extend(
            batch
                .iter()
                .map(|e| read(e.event.as_ref().expect("a well-formed row"))),
        );
    }
    got
}

/// The rows as polling reads them, and as the CDC start-up read does.
async fn read_from_the_table(config: &Config, columns: &ResolvedColumns) -> (Vec<Read>, Vec<Read>) {
    let mut polling = PollingReader::connect(
        &config.database,
        &config.outbox.table,
        columns,
        &config.source.polling,
        Shard::whole(),
        config.relay.mark,
    )
    .await
    .expect("connect the polling reader");
    let polled = events(&mut polling, 3).await;

    let (mut server, _) = PgServer::connect(
        &config.database,
        &config.outbox.table,
        columns,
        CdcSettings::from_config(config),
    )
    .await
    .expect("connect");
    server.prepare().await.expect("prepare the slot");
    server.begin_table_read().await.expect("begin the read");
    let rows = server.table_page(0, 100, usize::MAX).await.expect("a page");
    server.end_table_read().await.expect("end the read");
    let startup = rows
        .into_iter()
        .map(|r| read(&r.raw.decode(chrono::Utc::now()).expect("a well-formed row")))
        .collect();
    (polled, startup)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn polling_the_startup_read_and_the_stream_read_a_row_alike() {
    let (db, toml) = padded_outbox().await;
    db.client
        .batch_execute(
            "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload, flag, addr) VALUES
               (gen_random_uuid(), 'order', '42', 'Placed', '{}', true, '10.0.0.1'),
               (gen_random_uuid(), 'order', 'a b', 'Placed', '{}', false, '::1'),
               (gen_random_uuid(), 'order', '7', 'Placed', '{}', NULL, '10.0.0.0/8')",
        )
        .await
        .expect("insert rows");

    let marked = parse(&toml);
    let columns = db.resolved_columns(&marked).await;
    let (polled, startup) = read_from_the_table(&marked, &columns).await;

    // The CDC stream: without marking there is no start-up read, and the
    // slot, older than the rows, streams them all.
    let streaming = parse(&set(&toml, "relay.mark", "\"none\""));
    let progress = Arc::new(Mutex::new(Progress::new(Lsn::default(), SKIP_MEMORY)));
    let mut reader = CdcReader::connect(&streaming, &columns, progress)
        .await
        .expect("connect the CDC reader");
    let streamed = events(&mut reader, 3).await;
    reader.close().await;

    // The `::text` forms, as polling has always read them (extra columns
    // by name).
    let values = |r: &Read| (r.1.clone(), r.2.clone(), r.8.clone());
    let pair = |a: &str, b: &str| (a.to_owned(), b.to_owned());
    assert_eq!(
        polled.iter().map(values).collect::<Vec<_>>(),
        [
            (
                "order".into(),
                "42".into(),
                vec![pair("addr", "10.0.0.1/32"), pair("flag", "true")]
            ),
            (
                "order".into(),
                "a b".into(),
                vec![pair("addr", "::1/128"), pair("flag", "false")]
            ),
            ("order".into(), "7".into(), vec![pair("addr", "10.0.0.0/8")]),
        ]
    );
    assert_eq!(startup, polled, "the start-up read reads as polling does");
    assert_eq!(streamed, polled, "the stream reads as polling does");
}

/// `tenant`, generated from the aggregate id, as a header.
const GENERATED: &str = r#"
[[outbox.columns.extra]]
column = "tenant"
header = "tenant"
"#;

/// A migrated outbox in `mode` with the generated `tenant` column and one
/// row; its broker and configuration.
async fn generated_outbox(mode: Mode, sets: &[(&str, &str)]) -> (TestDb, Broker, String) {
    let (db, broker, toml) = setup(mode, Kind::Rabbit, &[], sets).await;
    db.client
        .batch_execute(
            "ALTER TABLE outbox ADD COLUMN tenant text GENERATED ALWAYS AS ('t-' || aggregate_id) STORED",
        )
        .await
        .expect("add the generated column");
    db.insert(Uuid::new_v4(), "order", "42", serde_json::json!({}))
        .await;
    (db, broker, format!("{toml}\n{GENERATED}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_generated_column_is_refused_where_cdc_may_read_and_read_by_polling() {
    let refusal =
        "column \"tenant\" (outbox.columns.extra, destination or key) is a generated column";
    // Auto mode with no slot it may create polls now: it is refused all
    // the same, as it would stop once it switched to CDC.
    let polls_now = [
        ("source.mode", "\"auto\""),
        ("source.cdc.create_slot", "false"),
    ];
    for sets in [&[][..], &[("source.mode", "\"auto\"")][..], &polls_now[..]] {
        let (db, _broker, toml) = generated_outbox(Mode::Cdc, sets).await;
        if sets.len() == 2 {
            db.client
                .execute(
                    "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = $1",
                    &[&slot_of(&toml)],
                )
                .await
                .expect("drop the slot");
        }
        let path = config_file(&toml);
        let (code, out, err) = run_cli(&["check", "--config", &path], &[]);
        assert!(code != 0 && out.contains(refusal), "{sets:?}: {out}{err}");
        assert!(
            !out.contains("privileges fit"),
            "{sets:?}: a refused column does not fit: {out}"
        );
        let relay = ChildRelay::start_logged(&toml);
        wait_for(WAIT, "the generated column to be refused", || async {
            relay.logged(refusal).then_some(())
        })
        .await;
        assert!(relay.logged("make it a plain column"), "{sets:?}");
        assert_eq!(db.unsent().await, 1, "{sets:?}: nothing relayed");
    }

    let (db, broker, toml) = generated_outbox(Mode::Polling, &[]).await;
    let path = config_file(&toml);
    let (code, out, err) = run_cli(&["check", "--config", &path], &[]);
    assert!(
        code == 0 && !out.contains(refusal) && out.contains("privileges fit"),
        "polling: {out}{err}"
    );
    let relay = InProcess::start(parse(&toml));
    let got = broker.inbox().wait_len(1, WAIT).await;
    assert_eq!(got[0].header("tenant"), Some("t-42"));
    db.wait_all_marked().await;
    relay.stop().await;
}

/// A database with `server_encoding = SQL_ASCII` stores any bytes as text,
/// and the server refuses to send a value that is not UTF-8 to the relay:
/// `check` warns of it, naming the error such a row would stop the relay with.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_warns_of_a_database_that_stores_any_bytes_as_text() {
    let db =
        TestDb::with_options("ENCODING 'SQL_ASCII' LC_COLLATE 'C' LC_CTYPE 'C' TEMPLATE template0")
            .await;
    let broker = Broker::new(Kind::Rabbit, &[]).await;
    let toml = with_mode(&base_toml(&db.url, &broker.sink_toml()), Mode::Polling);
    db.migrate(&parse(&toml)).await;
    let (_, out, err) = run_cli(&["check", "--config", &config_file(&toml)], &[]);
    assert!(
        out.contains("[warn] database       server_encoding is SQL_ASCII")
            && out.contains("invalid byte sequence for encoding UTF8"),
        "{out}{err}"
    );
    let utf8 = TestDb::new().await;
    let toml = with_mode(&base_toml(&utf8.url, &broker.sink_toml()), Mode::Polling);
    utf8.migrate(&parse(&toml)).await;
    let (_, out, _) = run_cli(&["check", "--config", &config_file(&toml)], &[]);
    assert!(!out.contains("SQL_ASCII"), "{out}");
}
