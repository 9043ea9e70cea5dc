//! End-to-end tests against real PostgreSQL, Kafka (tansu) and RabbitMQ,
//! started by `scripts/services.sh`. Each test has its own database, topics
//! or exchange, and every wait is bounded.

#[path = "../kit/mod.rs"]
mod kit;
#[macro_use]
mod support;

mod alert_metrics;
mod auto;
mod cdc;
mod cdc_backlog;
mod cdc_publication;
mod chaos;
mod cli;
mod column_text;
mod dead_letter_lookups;
mod dead_letter_table;
mod dead_letters;
mod dead_letters_replay;
mod delivery;
mod dlq_commands;
mod duplicates;
mod extra_columns;
mod failures;
mod fencing;
mod handoff;
mod held_stream;
mod logs;
mod lost_slot;
mod marking_default;
mod marking_ranges;
mod memory;
mod messages;
mod migrations;
mod operations;
mod paging;
mod partition_bounds;
mod partition_coverage;
mod partitions;
mod publications;
mod rabbit_alarm;
mod rabbit_exchanges;
mod rabbit_frames;
mod rabbit_refusals;
mod ranges_delivery;
mod ranges_downgrade;
mod ranges_fold;
mod ranges_histories;
mod redrive;
mod relay_xid;
mod retention;
mod retention_ranges;
mod retention_skips;
mod roles;
mod routing;
mod schema;
mod sessions;
mod shard_health;
mod slot_position;
mod tls;
mod tracing;
mod troubleshooting;
mod versions;
mod visibility;
