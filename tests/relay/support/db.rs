//! A database of its own for each test, dropped with its slots however the
//! test ends.

use super::proxy::Proxy;
use super::{WAIT, base_toml, connect, parse, pg_admin_url, rabbit_sink, unique, wait_for};
use outbox_relay::config::Config;
use std::collections::{HashMap, HashSet};
use std::time::Duration;
use tokio_postgres::{Client, NoTls};

/// A database of its own for one test.
pub struct TestDb {
    pub name: String,
    pub url: String,
    pub client: Client,
    /// The cluster's maintenance database, where this one is dropped from.
    admin_url: String,
}

impl TestDb {
    /// Shard locks held per instance (told apart by their application_name).
    pub async fn shard_owners(&self) -> HashMap<String, i64> {
        // Only shard locks count (of any shard count up to 16): an instance also
        // holds other advisory locks for a moment, such as the one that makes
        // registrations take turns.
        let base = outbox_relay::outbox::ownership_key(
            &parse(&base_toml(&self.url, &rabbit_sink())).outbox.table,
        );
        self.client
            .query(
                "SELECT a.application_name, count(*) FROM pg_locks l JOIN pg_stat_activity a USING (pid),
                     (SELECT hashtextextended($1 || ':shard:' || i || '/' || n, 0) AS k
                      FROM generate_series(1, 16) AS n, generate_series(0, 15) AS i WHERE i < n) AS s
                 WHERE l.locktype = 'advisory' AND l.objsubid = 1 AND l.granted AND l.mode = 'ExclusiveLock'
                   AND l.classid = ((s.k >> 32) & 4294967295)::oid AND l.objid = (s.k & 4294967295)::oid
                   AND a.datname = current_database()
                   AND a.application_name LIKE 'relay-%'
                 GROUP BY 1",
                &[&base],
            )
            .await
            .unwrap()
            .iter()
            .map(|r| (r.get(0), r.get(1)))
            .collect()
    }

    /// The backend pid and client port of the session holding the
    /// ownership lock in this database, once an instance holds it.
    pub async fn owner_session(&self) -> (i32, u16) {
        wait_for(WAIT, "an instance to hold the ownership lock", || async {
            self.client
                .query_opt(
                    "SELECT a.pid, a.client_port FROM pg_locks l JOIN pg_stat_activity a USING (pid)
                     WHERE l.locktype = 'advisory' AND l.granted AND a.datname = current_database()",
                    &[],
                )
                .await
                .unwrap()
                .map(|r| (r.get::<_, i32>(0), r.get::<_, i32>(1) as u16))
        })
        .await
    }

    /// `toml` with this database reached through a new [`Proxy`], which
    /// can then freeze one of the relay's sessions.
    pub async fn behind_proxy(&self, toml: &str) -> (Proxy, String) {
        let (_, rest) = self.url.split_once('@').expect("a user in the URL");
        let (address, _) = rest.split_once('/').expect("a database in the URL");
        let pg: std::net::SocketAddr = address.parse().expect("host:port");
        let proxy = Proxy::start(pg, true).await;
        let toml = toml.replace(address, &format!("127.0.0.1:{}", proxy.port));
        (proxy, toml)
    }

    pub async fn new() -> TestDb {
        Self::new_on(&pg_admin_url()).await
    }

    /// A database of its own on the cluster of `admin_url` (another PostgreSQL version).
    pub async fn new_on(admin_url: &str) -> TestDb {
        Self::created(admin_url, "").await
    }

    /// A database of its own created `WITH` these options (an encoding, say).
    pub async fn with_options(options: &str) -> TestDb {
        Self::created(&pg_admin_url(), options).await
    }

    async fn created(admin_url: &str, options: &str) -> TestDb {
        let admin = connect(admin_url).await;
        let name = unique("t_");
        admin
            .batch_execute(&format!("CREATE DATABASE {name} {options}"))
            .await
            .expect("create test database");
        let url = admin_url
            .rsplit_once('/')
            .map(|(base, _)| format!("{base}/{name}"))
            .unwrap();
        let client = connect(&url).await;
        TestDb {
            name,
            url,
            client,
            admin_url: admin_url.to_owned(),
        }
    }

    /// The columns the relay reads from the outbox `config` names, as it
    /// resolves them at start.
    pub async fn resolved_columns(&self, config: &Config) -> outbox_relay::config::ResolvedColumns {
        let info = outbox_relay::outbox::inspect::table_info(&self.client, &config.outbox.table)
            .await
            .expect("table info")
            .expect("the outbox exists");
        config.outbox.columns.resolve(&info.names())
    }

    /// Creates the default outbox table through `migrate` (the public contract).
    pub async fn migrate(&self, config: &Config) {
        let mut client = connect(&self.url).await;
        let opts = outbox_relay::ops::migrate::MigrateOptions::from_config(config, false);
        let steps = outbox_relay::ops::migrate::plan(&client, &opts)
            .await
            .expect("plan migration");
        outbox_relay::ops::migrate::apply(&mut client, &steps, &config.database)
            .await
            .expect("apply migration");
    }

    /// Inserts one event with only the contract columns, as an application does.
    pub async fn insert(
        &self,
        id: uuid::Uuid,
        aggregate_type: &str,
        aggregate_id: &str,
        payload: serde_json::Value,
    ) {
        self.client
            .execute(
                "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) VALUES ($1, $2, $3, 'Happened', $4)",
                &[&id, &aggregate_type, &aggregate_id, &payload],
            )
            .await
            .expect("insert event");
    }

    pub async fn count(&self, sql: &str) -> i64 {
        self.client.query_one(sql, &[]).await.expect(sql).get(0)
    }

    /// This database's URL, for `role` instead of the test user.
    pub fn url_as(&self, role: &str) -> String {
        let url = self.url.replacen("postgres@", &format!("{role}@"), 1);
        assert_ne!(url, self.url, "the test database URL names its user");
        url
    }

    /// The server's system identifier, as dead letters record it.
    pub async fn system_identifier(&self) -> String {
        self.client
            .query_one(
                "SELECT system_identifier::text FROM pg_control_system()",
                &[],
            )
            .await
            .expect("system identifier")
            .get(0)
    }

    pub async fn unsent(&self) -> i64 {
        self.count("SELECT count(*) FROM outbox WHERE relay_sent_at IS NULL")
            .await
    }

    /// The ids of the rows not marked sent.
    pub async fn unsent_ids(&self) -> HashSet<String> {
        let sql = "SELECT id::text FROM outbox WHERE relay_sent_at IS NULL";
        let rows = self.client.query(sql, &[]).await.expect(sql);
        rows.iter().map(|r| r.get(0)).collect()
    }

    /// Waits until every row is marked sent.
    pub async fn wait_all_marked(&self) {
        wait_for(WAIT, "all rows marked", || async {
            (self.unsent().await == 0).then_some(())
        })
        .await;
    }
}

/// How long dropping a test database may take before it is left behind
/// (named `t_…`, it harms no other test).
const DROP_WAIT: Duration = Duration::from_secs(30);

impl Drop for TestDb {
    /// Drops the database and its replication slots, when the test passed and
    /// when it panicked. `drop` cannot await and may run while the test's
    /// runtime unwinds, so the work gets a thread and a runtime of its own,
    /// bounded by [`DROP_WAIT`]; failures are ignored, since panicking here
    /// would abort the test binary.
    fn drop(&mut self) {
        let (admin_url, name) = (self.admin_url.clone(), std::mem::take(&mut self.name));
        let (done, finished) = std::sync::mpsc::channel::<()>();
        let dropper = std::thread::Builder::new()
            .name(format!("drop {name}"))
            .spawn(move || {
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build();
                if let Ok(runtime) = runtime {
                    // The timer is made inside the runtime: it needs its clock.
                    runtime.block_on(async {
                        let drop = drop_database_on(&admin_url, &name);
                        let _ = tokio::time::timeout(DROP_WAIT, drop).await;
                    });
                }
                drop(done);
            });
        if dropper.is_ok() {
            // Disconnected when the thread ends, however it ends.
            let _ = finished.recv_timeout(DROP_WAIT + Duration::from_secs(1));
        }
    }
}

/// Drops database `name` of the cluster of `admin_url` with its replication
/// slots, ignoring every failure (see [`TestDb`]'s `Drop`).
async fn drop_database_on(admin_url: &str, name: &str) {
    let mut config: tokio_postgres::Config = match admin_url.parse() {
        Ok(config) => config,
        Err(_) => return,
    };
    config.connect_timeout(Duration::from_secs(10));
    let Ok((admin, conn)) = config.connect(NoTls).await else {
        return;
    };
    tokio::spawn(conn);
    let _ = admin
        .execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = $1",
            &[&name],
        )
        .await;
    // A terminated walsender lets go of its slot a moment later.
    for _ in 0..50 {
        let dropped = admin
            .query_one(
                "SELECT count(pg_drop_replication_slot(slot_name)) FROM pg_replication_slots WHERE database = $1 AND NOT active",
                &[&name],
            )
            .await;
        let left: i64 = admin
            .query_one(
                "SELECT count(*) FROM pg_replication_slots WHERE database = $1",
                &[&name],
            )
            .await
            .map(|r| r.get(0))
            .unwrap_or(0);
        if dropped.is_ok() && left == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let _ = admin
        .batch_execute(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
        .await;
}
