//! The relay's own objects beside the outbox: the owners table, and the
//! names they all take from the outbox's.

use super::{Mark, Report};
use crate::config::Config;
use crate::db;

/// The table of ownership claims (see `relay::handoff`): without it every
/// takeover waits the lease; without the privileges the relay cannot start.
pub(super) async fn check_owners_table(
    config: &Config,
    client: &tokio_postgres::Client,
    r: &mut Report,
) {
    let owners = crate::outbox::names::owners_table(&config.outbox.table);
    let row = client
        .query_one(
            // With a list, has_table_privilege asks for any one of them.
            "SELECT to_regclass($1) IS NOT NULL,
                    to_regclass($1) IS NOT NULL
                    AND has_table_privilege(to_regclass($1), 'SELECT')
                    AND has_table_privilege(to_regclass($1), 'INSERT')
                    AND has_table_privilege(to_regclass($1), 'UPDATE')",
            &[&owners.quoted()],
        )
        .await;
    match row {
        Ok(row) if !row.get::<_, bool>(0) => r.add(
            Mark::Warn,
            "owners",
            format!("{owners} is missing, so a new owner always waits relay.ownership_lease before publishing: run outbox-relay migrate"),
        ),
        Ok(row) if !row.get::<_, bool>(1) => r.add(
            Mark::Fail,
            "owners",
            format!("the relay cannot claim ownership: GRANT SELECT, INSERT, UPDATE ON {owners} TO <relay role>"),
        ),
        Ok(_) => r.add(
            Mark::Ok,
            "owners",
            format!("{owners} is ready: after a clean stop the next owner publishes at once"),
        ),
        Err(e) => r.add(Mark::Warn, "owners", db::error_text(&e)),
    }
}

/// Another outbox of the schema whose relay objects would take these names
/// (`migrate` and the relay refuse it), or whose relay uses this one's slot
/// by default (`migrate` refuses it); see `outbox::names`.
pub(super) async fn check_shared_names(
    config: &Config,
    client: &tokio_postgres::Client,
    r: &mut Report,
) {
    for problem in crate::outbox::names::problems(client, config).await {
        match problem {
            Ok(None) => {}
            Ok(Some(problem)) => r.add(Mark::Fail, "names", problem),
            Err(e) => r.add(Mark::Warn, "names", db::error_text(&e)),
        }
    }
}
