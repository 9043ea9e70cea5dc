//! Columns the relay reads that CDC cannot stream (generated ones).

use super::{Mark, Report};
use crate::config::{Config, ResolvedColumns};
use crate::source::cdc::setup;

/// With `source.mode` `cdc` or `auto`, every column the relay reads must be
/// one the publication streams: a generated one stops CDC (or auto mode,
/// once it switches to CDC).
pub(super) async fn check_streamed(
    config: &Config,
    client: &tokio_postgres::Client,
    columns: &ResolvedColumns,
    r: &mut Report,
) {
    if !config.source.mode.may_use_cdc() {
        return;
    }
    let table = &config.outbox.table;
    let publication = config.source.cdc.publication_name(table);
    match setup::generated_problems(client, &publication, table, columns).await {
        Ok(problems) => {
            for p in problems {
                r.add(Mark::Fail, "outbox table", p);
            }
        }
        Err(e) => r.add(Mark::Warn, "outbox table", e.to_string()),
    }
}
