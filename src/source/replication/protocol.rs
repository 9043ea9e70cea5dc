//! Replication-mode connection (in progress).
