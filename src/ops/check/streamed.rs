//! Columns the relay reads that CDC cannot stream (generated ones, ones a
//! publication's column list leaves out) and a publication's row filter.

use super::Mark;
use crate::config::{Config, MarkMode, ResolvedColumns};
use crate::source::cdc::setup;

/// With `source.mode` `cdc` or `auto`, every column the relay reads must be
/// one the publication streams, and it must stream every row: otherwise
/// CDC stops (or auto mode, once it switches to CDC). What is wrong, to
/// report (nothing: all fit).
pub(super) async fn streamed_problems(
    config: &Config,
    client: &tokio_postgres::Client,
    columns: &ResolvedColumns,
) -> Vec<(Mark, String)> {
    if !config.source.mode.may_use_cdc() {
        return Vec::new();
    }
    let table = &config.outbox.table;
    let publication = config.source.cdc.publication_name(table);
    let marks = config.relay.mark != MarkMode::None;
    match setup::streaming_problems(client, &publication, table, columns, marks).await {
        Ok(problems) => problems.into_iter().map(|p| (Mark::Fail, p)).collect(),
        Err(e) => vec![(Mark::Warn, e.to_string())],
    }
}
