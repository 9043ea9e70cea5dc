//! The simulated broker client: a [`Sink`] over the world's broker.

use super::world::{Shared, lock};
use crate::envelope::Message;
use crate::outbox::OutboxEvent;
use crate::sink::{Confirmation, Fence, Route, Sink, SinkError};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

pub struct SimSink {
    world: Shared,
    instance: usize,
    conn: u64,
    reign: u64,
}

impl SimSink {
    pub fn connect(world: &Shared, instance: usize, reign: u64) -> Result<Self, SinkError> {
        let conn = lock(world).connect(instance)?;
        Ok(SimSink {
            world: world.clone(),
            instance,
            conn,
            reign,
        })
    }
}

impl Sink for SimSink {
    fn route(&self, event: &OutboxEvent) -> Result<Route, SinkError> {
        let w = lock(&self.world);
        let topic = w.topic(&event.event_type);
        Ok(Route {
            destination: topic.as_str().into(),
            key: event.aggregate_id.clone(),
            key_from: "the aggregate id",
            lane: w.broker_kind.gapless.then(|| topic.into()),
        })
    }

    async fn send(
        &mut self,
        _route: Route,
        message: Message<'_>,
    ) -> Result<Confirmation, SinkError> {
        // No room in the client: the hand-over waits, as Kafka's does
        // (RabbitMQ's refuses at once while the broker blocks it).
        let room_at = {
            let w = lock(&self.world);
            w.no_room
                .get(&self.instance)
                .copied()
                .filter(|_| w.broker_kind.gapless)
        };
        if let Some(at) = room_at.filter(|at| *at > tokio::time::Instant::now()) {
            lock(&self.world).waited_for_room += 1;
            tokio::time::sleep_until(at).await;
        }
        let rx = lock(&self.world).send(
            self.conn,
            self.reign,
            &message.id,
            &message.key,
            &message.event_type,
        )?;
        Ok(Box::pin(async move {
            rx.await
                .unwrap_or_else(|_| Err(SinkError::Unavailable("sim: connection lost".into())))
        }))
    }

    async fn probe(&mut self) -> Result<(), SinkError> {
        if lock(&self.world).conn_ok(self.conn) {
            Ok(())
        } else {
            Err(SinkError::Unavailable("sim: connection lost".into()))
        }
    }

    async fn close(self) {
        lock(&self.world).close_conn(self.conn);
    }

    fn fence(&self) -> Option<Fence> {
        let (world, conn) = (self.world.clone(), self.conn);
        let gapless = lock(&world).broker_kind.gapless;
        gapless.then(|| {
            Arc::new(move || -> Pin<Box<dyn Future<Output = usize> + Send>> {
                let mut w = lock(&world);
                let unconfirmed = w.unconfirmed_on(conn);
                w.call_back(conn);
                Box::pin(std::future::ready(unconfirmed))
            }) as Fence
        })
    }
}
