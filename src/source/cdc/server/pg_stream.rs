//! The stream of a replication connection, as the reader consumes it.

use super::{CdcStream, StreamMessage};
use crate::replication::Lsn;
use crate::replication::pgoutput;
use crate::replication::protocol::{ReplicationMessage, ReplicationStream};
use crate::source::SourceError;

/// A pgoutput stream on a replication connection.
pub struct PgStream {
    stream: ReplicationStream,
    /// See [`CdcStream::slot_confirmed`].
    slot_confirmed: Lsn,
}

impl PgStream {
    pub(super) fn new(stream: ReplicationStream, slot_confirmed: Lsn) -> Self {
        PgStream {
            stream,
            slot_confirmed,
        }
    }
}

impl CdcStream for PgStream {
    async fn next(&mut self) -> Result<Option<StreamMessage>, SourceError> {
        Ok(match self.stream.next().await? {
            None => None,
            Some(ReplicationMessage::PrimaryKeepalive {
                wal_end,
                reply_requested,
                ..
            }) => Some(StreamMessage::Keepalive {
                wal_end,
                reply_requested,
            }),
            Some(ReplicationMessage::XLogData { data, .. }) => {
                Some(StreamMessage::Change(pgoutput::decode(data)?))
            }
        })
    }

    async fn send_status(&mut self, write: Lsn, flushed: Lsn) -> Result<(), SourceError> {
        self.stream
            .send_standby_status(write, flushed, flushed, true)
            .await?;
        Ok(())
    }

    async fn finish(self) {
        if let Err(e) = self.stream.finish().await {
            tracing::debug!(error = %e, "ending the replication stream");
        }
    }

    fn slot_confirmed(&self) -> Lsn {
        self.slot_confirmed
    }
}
