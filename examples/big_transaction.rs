//! `big_transaction`: how long after COMMIT a CDC relay receives a large
//! transaction's first change and its commit message, with the pgoutput
//! protocol the relay uses (version 1, where PostgreSQL sends a transaction
//! only once it committed). This bounds what streaming in-progress
//! transactions (protocol 2+) could save: with streaming, changes would
//! arrive before COMMIT, but could not be published before it.
//!
//! ```text
//! cargo run --release --example big_transaction -- --rows 10000,100000 --runs 3
//! ```
//!
//! It creates a database of its own on the server of `--url` (default
//! `OUTBOX_RELAY_TEST_PG`, else the services' cluster on port 55432) with
//! the outbox, publication and slot `outbox-relay migrate` makes in CDC mode,
//! streams from the slot with the relay's own replication client and
//! decoder, and commits one transaction of `--rows` outbox rows (256-byte
//! payloads, 100 aggregates, inserted server-side) per run. It reads the
//! stream as fast as it comes, publishing nothing: the figures are the
//! server's share, a floor under what the relay sees. The database and its
//! slot are dropped at the end. Results: BENCHMARKS.md.

use anyhow::{Context, Result, anyhow, bail};
use clap::Parser;
use outbox_relay::config::TlsOptions;
use outbox_relay::replication::Lsn;
use outbox_relay::replication::pgoutput::{LogicalMessage, decode};
use outbox_relay::replication::protocol::{
    ReplicationClient, ReplicationMessage, ReplicationStream, publication_names,
};
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

#[derive(Debug, Parser)]
#[command(
    name = "big_transaction",
    about = "Times from COMMIT to a CDC stream's first change and commit message for one large transaction."
)]
struct Cli {
    /// A superuser URL of the server to measure (a database is created there).
    #[arg(
        long,
        env = "OUTBOX_RELAY_TEST_PG",
        default_value = "postgres://postgres@127.0.0.1:55432/postgres"
    )]
    url: String,
    /// Transaction sizes, in outbox rows.
    #[arg(long, value_delimiter = ',', default_value = "10000,100000")]
    rows: Vec<u64>,
    /// Runs per size; the median is printed with every run.
    #[arg(long, default_value_t = 3)]
    runs: usize,
}

/// When the stream delivered one transaction, and how many rows it held.
#[derive(Debug)]
struct Received {
    first_change: Instant,
    commit: Instant,
    inserts: u64,
}

/// The limit on one run: writing, committing and streaming the transaction.
const RUN_LIMIT: Duration = Duration::from_secs(600);

#[tokio::main]
async fn main() -> Result<()> {
    let cli = Cli::parse();
    let db = format!("outbox_relay_bigtx_{}", std::process::id());
    let admin = connect(&cli.url).await?;
    admin
        .batch_execute(&format!("CREATE DATABASE {db}"))
        .await
        .context("creating the database")?;
    let result = measure(&cli, &db).await;
    // The slot must go before its database can.
    let url = with_database(&cli.url, &db)?;
    let drop_slot = async {
        let client = connect(&url).await?;
        for _ in 0..100 {
            let dropped = client
                .batch_execute("SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE database = current_database()")
                .await;
            if dropped.is_ok() {
                return Ok::<_, anyhow::Error>(());
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        Err(anyhow!("the slot stayed busy"))
    };
    if let Err(e) = drop_slot.await {
        eprintln!("big_transaction: cannot drop the slot of {db}: {e:#}");
    }
    admin
        .batch_execute(&format!("DROP DATABASE IF EXISTS {db} WITH (FORCE)"))
        .await
        .context("dropping the database")?;
    result
}

async fn measure(cli: &Cli, db: &str) -> Result<()> {
    let url = with_database(&cli.url, db)?;
    let toml = format!(
        "[database]\nurl = \"{url}\"\n[source]\nmode = \"cdc\"\n[sink]\ntype = \"rabbitmq\"\nurl = \"amqp://127.0.0.1:5672/%2f\"\nexchange = \"outbox\"\n"
    );
    let config = outbox_relay::config::load_str(&toml).map_err(|e| anyhow!("{e}"))?;
    let mut app = connect(&url).await?;
    let opts = outbox_relay::ops::migrate::MigrateOptions::from_config(&config, false);
    let steps = outbox_relay::ops::migrate::plan(&app, &opts).await?;
    outbox_relay::ops::migrate::apply(&mut app, &steps, &config.database).await?;
    let settings: Vec<String> = app
        .query(
            "SELECT name || ' = ' || setting || coalesce(unit, '') FROM pg_settings
             WHERE name IN ('logical_decoding_work_mem', 'server_version', 'shared_buffers')
             ORDER BY name",
            &[],
        )
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect();
    println!("server: {}", settings.join(", "));

    let slot = config.source.cdc.slot_name(&config.outbox.table);
    let publication = config.source.cdc.publication_name(&config.outbox.table);
    let pg: tokio_postgres::Config = url.parse()?;
    let client = ReplicationClient::connect(&pg, &TlsOptions::default()).await?;
    let names = publication_names(&[&publication]);
    // The options the relay starts its stream with (messages left out: no
    // logical messages are written here).
    let options = [
        ("proto_version", "1"),
        ("publication_names", names.as_str()),
    ];
    let stream = client
        .start_logical_replication(&slot, Lsn(0), &options)
        .await?;
    let (tx, mut rx) = mpsc::channel(4);
    let reader = tokio::spawn(read(stream, tx));

    println!(
        "rows\trun\tinsert_ms\tcommit_ms\tfirst_change_after_commit_ms\tcommit_msg_after_commit_ms"
    );
    for &rows in &cli.rows {
        let mut first = Vec::new();
        let mut whole = Vec::new();
        for run in 1..=cli.runs {
            let started = Instant::now();
            app.batch_execute("BEGIN").await?;
            app.execute(
                "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload)
                 SELECT gen_random_uuid(), 'order', 'a' || (i % 100), 'Happened',
                        jsonb_build_object('i', i, 'pad', repeat('x', 240))
                 FROM generate_series(1, $1::bigint) i",
                &[&i64::try_from(rows)?],
            )
            .await?;
            let inserted = Instant::now();
            app.batch_execute("COMMIT").await?;
            let committed = Instant::now();
            let got = tokio::time::timeout(RUN_LIMIT, rx.recv())
                .await
                .context("the transaction did not arrive in time")?
                .ok_or_else(|| anyhow!("the stream ended"))??;
            if got.inserts != rows {
                bail!("received {} of {rows} rows", got.inserts);
            }
            let ms = |later: Instant, earlier: Instant| signed_ms(later, earlier);
            let f = ms(got.first_change, committed);
            let w = ms(got.commit, committed);
            println!(
                "{rows}\t{run}\t{:.0}\t{:.1}\t{f:.1}\t{w:.1}",
                ms(inserted, started),
                ms(committed, inserted)
            );
            first.push(f);
            whole.push(w);
        }
        println!(
            "{rows}\tmedian\t\t\t{:.1}\t{:.1}",
            median(&mut first),
            median(&mut whole)
        );
    }
    reader.abort();
    Ok(())
}

/// Reads the stream, acknowledging each transaction once received, and
/// sends when each one's first change and commit came.
async fn read(mut stream: ReplicationStream, tx: mpsc::Sender<Result<Received>>) {
    let mut first: Option<Instant> = None;
    let mut inserts = 0u64;
    loop {
        let message = match stream.next().await {
            Ok(Some(m)) => m,
            Ok(None) => return,
            Err(e) => {
                let _ = tx.send(Err(e.into())).await;
                return;
            }
        };
        let now = Instant::now();
        match message {
            ReplicationMessage::XLogData { data, .. } => match decode(data) {
                Ok(LogicalMessage::Begin(_)) => {
                    first = None;
                    inserts = 0;
                }
                Ok(LogicalMessage::Insert(_)) => {
                    first.get_or_insert(now);
                    inserts += 1;
                }
                Ok(LogicalMessage::Commit(c)) => {
                    if inserts > 0 {
                        let got = Received {
                            first_change: first.unwrap_or(now),
                            commit: now,
                            inserts,
                        };
                        if tx.send(Ok(got)).await.is_err() {
                            return;
                        }
                    }
                    if stream
                        .send_standby_status(c.end_lsn, c.end_lsn, c.end_lsn, false)
                        .await
                        .is_err()
                    {
                        return;
                    }
                }
                Ok(_) => {}
                Err(e) => {
                    let _ = tx.send(Err(e.into())).await;
                    return;
                }
            },
            ReplicationMessage::PrimaryKeepalive {
                wal_end,
                reply_requested: true,
                ..
            } => {
                // Nothing unacknowledged is in flight between transactions.
                let ack = if inserts == 0 { wal_end } else { Lsn(0) };
                if stream
                    .send_standby_status(ack, ack, ack, false)
                    .await
                    .is_err()
                {
                    return;
                }
            }
            ReplicationMessage::PrimaryKeepalive { .. } => {}
        }
    }
}

fn signed_ms(later: Instant, earlier: Instant) -> f64 {
    match later.checked_duration_since(earlier) {
        Some(d) => d.as_secs_f64() * 1000.0,
        None => -(earlier.duration_since(later).as_secs_f64() * 1000.0),
    }
}

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    values.get(values.len() / 2).copied().unwrap_or(f64::NAN)
}

async fn connect(url: &str) -> Result<tokio_postgres::Client> {
    let (client, connection) = tokio_postgres::connect(url, tokio_postgres::NoTls)
        .await
        .with_context(|| format!("connecting to {}", outbox_relay::config::redact_url(url)))?;
    tokio::spawn(connection);
    Ok(client)
}

/// `url` with its database replaced by `db`.
fn with_database(url: &str, db: &str) -> Result<String> {
    let (base, _) = url
        .rsplit_once('/')
        .ok_or_else(|| anyhow!("{url}: expected postgres://host:port/database"))?;
    Ok(format!("{base}/{db}"))
}
