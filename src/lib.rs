//! outbox-relay publishes the committed rows of a PostgreSQL outbox table to
//! Kafka or RabbitMQ, in order per aggregate, and marks each row sent only
//! after the broker confirmed it.
//!
//! The modules in layers, lowest first; each imports only its own layer and
//! those below (`tests/architecture.rs` checks it):
//!
//! - leaves: [`config`] (the TOML file, environment overrides, validation,
//!   and the values it holds: table and column names, templates, TLS
//!   modes), [`errors`] (the one kind every error maps to, and the policy
//!   per kind), [`backoff`] (the retry schedule), [`shutdown`] (signals),
//!   [`sql`] (quoting).
//! - [`outbox`] (the table contract, row decoding), [`envelope`]
//!   (CloudEvents messages), [`db`] (connections, TLS), [`replication`] (the
//!   replication protocol client and pgoutput decoder), [`dead_letter`] (the
//!   dead-letter table), [`telemetry`] (logs, metrics, typed events, health,
//!   traces).
//! - [`source`] (the polling and CDC readers, and the acker that records
//!   progress) and [`sink`] (Kafka and RabbitMQ, with the delivery
//!   contract), which never import each other.
//! - [`relay`]: ownership, the pipeline between source and sink.
//! - [`ops`]: the operator commands (`run`, `migrate`, `check`, `status`,
//!   `dlq`, `retention`), each one function over the layers below.
//! - [`cli`]: arguments, and the one mapping from a command's result to its
//!   exit code.

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
