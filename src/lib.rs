//! outbox-relay: publishes committed rows of a PostgreSQL outbox table to Kafka or RabbitMQ.
pub mod db;
pub mod source;
