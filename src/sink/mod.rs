//! Sinks: where messages go, and what a confirmation means.
//!
//! # The delivery contract
//!
//! [`Sink::route`] says where an event goes (rendered once, before its
//! message is built); [`Sink::send`] hands one message to the broker client
//! and returns a
//! [`Confirmation`] future; it may wait for room in the client's buffer
//! (backpressure) but never for the broker's answer. The future resolves:
//!
//! - `Ok(())` only when the broker has durably accepted the message: a Kafka
//!   delivery report from the idempotent producer with `acks=all`; a RabbitMQ
//!   publisher-confirm `basic.ack` for a persistent, routed message. Only then
//!   may the source mark the row sent or acknowledge its WAL position.
//! - `Err(SinkError::Rejected)` when the broker (or the sink's own checks, before
//!   anything was sent) refused *this* message: too large, an invalid or
//!   missing destination, unroutable. Retrying it unchanged is not expected to
//!   help soon; other messages are unaffected.
//! - `Err(SinkError::Busy)` when the broker turned *this* message away for
//!   now (RabbitMQ's `basic.nack`: a full queue with `reject-publish`). Like a
//!   refusal it holds back only its aggregate, but it is retried with backoff
//!   for as long as it takes and never dead-lettered.
//! - `Err(SinkError::Unavailable)` when the outcome is unknown: the connection
//!   died, a timeout passed. The message may or may not have arrived; the relay
//!   re-sends it (a duplicate, never a loss).
//!
//! Ordering: messages handed to one sink in a given order reach the broker in
//! that order for each key (Kafka: one partition per key and an idempotent
//! producer that never reorders on retry; RabbitMQ: one channel). Duplicates
//! arise only from re-sending after `Unavailable` or a restart.
//!
//! Lanes: when a [`Route`]'s lane names one, the sink promises more: among
//! messages of one key in that lane, a refused message fails every later one
//! (none of them is confirmed), so the relay may keep several of an
//! aggregate's messages in flight there. Kafka's lane is the topic (with the
//! aggregate id as key, one partition; with a key column, the topic and the
//! row's key), kept by the idempotent producer's gapless guarantee. The
//! topic is each row's own when a destination column sets one, so events of
//! an aggregate routed to different topics never share a lane. RabbitMQ has
//! none: each message's outcome stands alone.
//!
//! Pauses: a broker may stop reading from a connection as a whole for a
//! while (RabbitMQ's `connection.blocked` during a memory or disk alarm).
//! [`Sink::pause`] says so; `send` then waits for the pause to end, and the
//! relay does not count the time paused against `relay.confirm_timeout`
//! (see [`Pause`]).
//!
//! Fencing: once the ownership lease runs out with messages unconfirmed,
//! the [`Fence`] of [`Sink::fence`] calls back what the broker client still
//! holds to write, or to write again (Kafka's queue, and its retries after
//! a lost connection or a leader's move): a new owner may publish soon, and
//! those would reach the broker after its messages. The run then ends, and
//! they are sent again by the next owner. A run that ends for any other
//! reason calls them back too.

mod error;
mod kafka;
mod pause;
mod rabbitmq;

pub use error::{Reason, SinkError};
pub use kafka::KafkaSink;
pub use pause::Pause;
pub use rabbitmq::RabbitMqSink;

use crate::envelope::Message;
use crate::envelope::routing::Routing;
use crate::outbox::OutboxEvent;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

/// Calls back what a broker client holds unwritten or to write again, and
/// says how many messages it held unconfirmed (0: nothing was called back).
pub type Fence = Arc<dyn Fn() -> Pin<Box<dyn Future<Output = usize> + Send>> + Send + Sync>;

/// A broker's confirmation of one message; see the module docs for what each outcome means.
pub type Confirmation = Pin<Box<dyn Future<Output = Result<(), SinkError>> + Send>>;

/// Refuses a message over `sink.message_max_bytes` before anything is sent.
fn within_limit(message: &Message<'_>, max_bytes: usize) -> Result<(), SinkError> {
    let size = message.size();
    if size > max_bytes {
        return Err(SinkError::rejected(format!(
            "message is {size} bytes, over sink.message_max_bytes ({max_bytes})"
        )));
    }
    Ok(())
}

/// Where one event goes, as [`Sink::route`] rendered it from the templates
/// and the row's routing columns, checked by the broker's naming rules.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Route {
    /// The topic (Kafka) or exchange (RabbitMQ; empty for the default one).
    pub destination: Arc<str>,
    /// The message key (Kafka) or routing key (RabbitMQ).
    pub key: String,
    /// Where `key` came from (a config key or the row's key column), for a
    /// refusal's reason.
    pub key_from: &'static str,
    /// The lane the message goes in, when the sink keeps order within it
    /// even when a message fails (see the module docs); `None` when it does
    /// not: then an aggregate has one message in flight at a time.
    pub lane: Option<Arc<str>>,
}

impl Route {
    /// The destination as the broker names it (RabbitMQ calls the default
    /// exchange `amq.default`), for spans and logs.
    pub fn destination_name(&self) -> &str {
        if self.destination.is_empty() {
            "amq.default"
        } else {
            &self.destination
        }
    }
}

/// A broker the relay publishes to. See the module docs for the contract.
pub trait Sink: Send {
    /// Where `event` goes. `Err(Rejected)` when a template or a routing
    /// column gives a name the broker would refuse: the event is refused
    /// without anything being sent.
    fn route(&self, event: &OutboxEvent) -> Result<Route, SinkError>;

    /// Hands `message` to the broker client, to go where `route` says.
    ///
    /// A synchronous `Err(Rejected)` means nothing was sent. `Err(Unavailable)`
    /// means the sink is broken and must be rebuilt.
    fn send(
        &mut self,
        route: Route,
        message: Message<'_>,
    ) -> impl Future<Output = Result<Confirmation, SinkError>> + Send;

    /// Checks that the broker is reachable and the sink can publish; for
    /// readiness, and for `check`.
    fn probe(&mut self) -> impl Future<Output = Result<(), SinkError>> + Send;

    /// Closes connections; unconfirmed messages are abandoned (their rows stay unsent).
    fn close(self) -> impl Future<Output = ()> + Send;

    /// What calls back the messages the client holds (see the module docs),
    /// usable while the sink is busy; `None` for a client that writes each
    /// message at once, with nothing to call back.
    fn fence(&self) -> Option<Fence> {
        None
    }

    /// Whether the broker pauses this sink's publishing (see the module
    /// docs); never, for a broker that cannot.
    fn pause(&self) -> Pause {
        Pause::default()
    }
}

/// What `outbox-relay check` asks a broker about destinations, beside the
/// publishing path.
pub trait SinkCheck: Sink {
    /// Renders the destination of events of this kind and checks that it
    /// exists (topic, exchange); returns it for display.
    fn check_destination(
        &mut self,
        aggregate_type: &str,
        event_type: &str,
    ) -> impl Future<Output = Result<String, SinkError>> + Send;

    /// Checks that a destination a row names itself (`outbox.columns.destination`)
    /// is valid and exists; returns it for display.
    fn check_named_destination(
        &mut self,
        name: &str,
    ) -> impl Future<Output = Result<String, SinkError>> + Send;

    /// True when every event goes to one destination (no placeholder in the templates).
    fn fixed_destination(&self) -> bool;
}

/// The broker named in the configuration, behind one type.
pub enum AnySink {
    Kafka(Box<KafkaSink>),
    RabbitMq(Box<RabbitMqSink>),
}

impl AnySink {
    pub async fn connect(config: &crate::config::SinkConfig) -> Result<Self, SinkError> {
        Ok(match config {
            crate::config::SinkConfig::Kafka(k) => {
                AnySink::Kafka(Box::new(KafkaSink::connect(k).await?))
            }
            crate::config::SinkConfig::RabbitMq(r) => {
                AnySink::RabbitMq(Box::new(RabbitMqSink::connect(r).await?))
            }
        })
    }
}

impl AnySink {
    /// Routes each event by its routing columns where the row has values
    /// (see [`crate::envelope::routing`]).
    pub fn with_routing(self, routing: Routing) -> Self {
        match self {
            AnySink::Kafka(s) => AnySink::Kafka(Box::new((*s).with_routing(routing))),
            AnySink::RabbitMq(s) => AnySink::RabbitMq(Box::new((*s).with_routing(routing))),
        }
    }
}

impl Sink for AnySink {
    fn route(&self, event: &OutboxEvent) -> Result<Route, SinkError> {
        match self {
            AnySink::Kafka(s) => s.route(event),
            AnySink::RabbitMq(s) => s.route(event),
        }
    }

    async fn send(
        &mut self,
        route: Route,
        message: Message<'_>,
    ) -> Result<Confirmation, SinkError> {
        match self {
            AnySink::Kafka(s) => s.send(route, message).await,
            AnySink::RabbitMq(s) => s.send(route, message).await,
        }
    }

    async fn probe(&mut self) -> Result<(), SinkError> {
        match self {
            AnySink::Kafka(s) => s.probe().await,
            AnySink::RabbitMq(s) => s.probe().await,
        }
    }

    async fn close(self) {
        match self {
            AnySink::Kafka(s) => s.close().await,
            AnySink::RabbitMq(s) => s.close().await,
        }
    }

    fn fence(&self) -> Option<Fence> {
        match self {
            AnySink::Kafka(s) => s.fence(),
            AnySink::RabbitMq(s) => s.fence(),
        }
    }

    fn pause(&self) -> Pause {
        match self {
            AnySink::Kafka(s) => s.pause(),
            AnySink::RabbitMq(s) => s.pause(),
        }
    }
}

impl SinkCheck for AnySink {
    async fn check_destination(
        &mut self,
        aggregate_type: &str,
        event_type: &str,
    ) -> Result<String, SinkError> {
        match self {
            AnySink::Kafka(s) => s.check_destination(aggregate_type, event_type).await,
            AnySink::RabbitMq(s) => s.check_destination(aggregate_type, event_type).await,
        }
    }

    async fn check_named_destination(&mut self, name: &str) -> Result<String, SinkError> {
        match self {
            AnySink::Kafka(s) => s.check_named_destination(name).await,
            AnySink::RabbitMq(s) => s.check_named_destination(name).await,
        }
    }

    fn fixed_destination(&self) -> bool {
        match self {
            AnySink::Kafka(s) => s.fixed_destination(),
            AnySink::RabbitMq(s) => s.fixed_destination(),
        }
    }
}
