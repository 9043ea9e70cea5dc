//! The simulated broker client: a [`Sink`] over the world's broker.

use super::world::{Shared, lock};
use crate::envelope::Message;
use crate::outbox::OutboxEvent;
use crate::sink::{Confirmation, Sink, SinkError};

pub struct SimSink {
    world: Shared,
    conn: u64,
    reign: u64,
}

impl SimSink {
    pub fn connect(world: &Shared, instance: usize, reign: u64) -> Result<Self, SinkError> {
        let conn = lock(world).connect(instance)?;
        Ok(SimSink {
            world: world.clone(),
            conn,
            reign,
        })
    }
}

impl Sink for SimSink {
    async fn send(
        &mut self,
        event: &OutboxEvent,
        _message: Message,
    ) -> Result<Confirmation, SinkError> {
        let rx = lock(&self.world).send(
            self.conn,
            self.reign,
            &event.id,
            &event.aggregate_id,
            &event.event_type,
        )?;
        Ok(Box::pin(async move {
            rx.await
                .unwrap_or_else(|_| Err(SinkError::Unavailable("sim: connection lost".into())))
        }))
    }

    fn lane(&self, event: &OutboxEvent) -> Option<String> {
        let w = lock(&self.world);
        w.broker_kind.gapless.then(|| w.topic(&event.event_type))
    }

    async fn probe(&mut self) -> Result<(), SinkError> {
        if lock(&self.world).conn_ok(self.conn) {
            Ok(())
        } else {
            Err(SinkError::Unavailable("sim: connection lost".into()))
        }
    }

    async fn check_destination(&mut self, _: &str, event_type: &str) -> Result<String, SinkError> {
        Ok(lock(&self.world).topic(event_type))
    }

    async fn check_named_destination(&mut self, name: &str) -> Result<String, SinkError> {
        Ok(name.to_owned())
    }

    fn fixed_destination(&self) -> bool {
        !lock(&self.world).broker_kind.topic_per_type
    }

    async fn close(self) {
        lock(&self.world).kill_conn(self.conn);
    }
}
