//! outbox-relay publishes the committed rows of a PostgreSQL outbox table to
//! Kafka or RabbitMQ, in order per aggregate, and marks each row sent only
//! after the broker confirmed it.
//!
//! - [`config`]: the TOML file, environment overrides, validation, and the
//!   value types it holds (table and column names, templates, TLS modes); a leaf.
//! - [`sql`]: quoting for the SQL the relay builds from configured names.
//! - [`outbox`]: the table contract, row decoding.
//! - [`envelope`]: CloudEvents messages and destination templates.
//! - [`source`]: the polling and CDC readers, and the acker that records
//!   progress.
//! - [`replication`]: the replication protocol client and pgoutput decoder.
//! - [`sink`]: Kafka and RabbitMQ, with the delivery contract.
//! - [`relay`]: ownership, the pipeline between source and sink.
//! - [`errors`]: the one kind every error maps to, and the policy per kind.
//! - [`backoff`]: the retry schedule shared by the pipeline and retention.
//! - [`ops`]: the operator commands (`run`, `migrate`, `check`, `status`,
//!   `dlq`, `retention`), each one function over the layers above.
//! - [`cli`]: arguments, and the one mapping from a command's result to its
//!   exit code.
//! - [`shutdown`], [`telemetry`]: signals; logs, metrics and health.

pub mod backoff;
pub mod cli;
pub mod config;
pub mod db;
pub mod dead_letter;
pub mod envelope;
pub mod errors;
pub mod ops;
pub mod outbox;
pub mod relay;
pub mod replication;
pub mod shutdown;
#[cfg(test)]
mod sim;
pub mod sink;
pub mod source;
pub mod sql;
pub mod telemetry;
