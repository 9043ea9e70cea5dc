//! RabbitMQ with publisher confirms
//! (<https://www.rabbitmq.com/docs/confirms#publisher-confirms>).
//!
//! One channel in confirm mode carries every message, so they are routed in
//! the order sent. `send` queues a message's frames for the client's I/O
//! thread and returns; the write, like the ack, is part of the confirmation
//! (a failed write is `Unavailable`), and the pipeline's in-flight limits
//! bound what is queued. Messages are persistent and published `mandatory`: an
//! unroutable message comes back as `basic.return` before its `basic.ack`, and
//! the relay counts it as refused, not delivered. A `basic.nack` (a full
//! queue with `overflow = reject-publish`, or a broker that could not store
//! the message) is back-pressure, not a verdict on the event: its aggregate
//! waits and is retried with backoff, other aggregates go on, and it is never
//! dead-lettered. Exchanges are checked (or declared) on a second channel before first
//! use, because publishing to a missing exchange would close the publishing
//! channel and make every unconfirmed message's fate unknown.
//!
//! `amqps://` is set up and its failures explained in `tls.rs`; the
//! unconfirmed messages are tracked in `confirms.rs`; lapin's errors are
//! sorted in `error.rs`. The keys and their checks are in
//! `config/sink/rabbitmq.rs` (the configuration layer cannot depend on the
//! sink).

mod confirms;
mod error;
mod tls;

use super::{Confirmation, Pause, Reason, Route, Sink, SinkCheck, SinkError, within_limit};
use crate::config::{Field, Template, destination};
use crate::config::{RabbitMqConfig, redact_url};
use crate::envelope::Message;
use crate::envelope::routing::Routing;
use crate::outbox::OutboxEvent;
use confirms::{Settle, Unconfirmed};
use error::{answer, connect_error, unavailable};
use futures::StreamExt;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions, ExchangeDeclareOptions};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{
    BasicProperties, Channel, Connection, ConnectionProperties, ExchangeKind, PublisherConfirm,
};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::Poll;

pub struct RabbitMqSink {
    unconfirmed: Unconfirmed,
    /// While RabbitMQ blocks this connection's publishers.
    paused: Pause,
    connection: Connection,
    /// Publishing channel, in confirm mode.
    channel: Channel,
    /// Channel for exchange checks; a failed passive declare closes it, so it is reopened.
    admin: Option<Channel>,
    url: String,
    exchange: Template,
    /// The exchange, rendered once when the template has no placeholder.
    fixed_exchange: Option<Arc<str>>,
    routing_key: Template,
    /// Per-row exchange and routing-key columns, when configured.
    routing: Routing,
    declare: bool,
    exchange_kind: ExchangeKind,
    max_bytes: usize,
    known_exchanges: KnownExchanges,
}

/// The exchanges found (or declared) on this connection, which are not
/// checked again. Bounded: exchange names can come from the rows, so past
/// [`KnownExchanges::LIMIT`] names each new one pushes out another (which is
/// checked again when next used, one round trip): rows that rotate through
/// more names than that still find most of them known.
#[derive(Debug, Default)]
struct KnownExchanges(std::collections::HashSet<String>);

impl KnownExchanges {
    const LIMIT: usize = 10_000;

    fn contains(&self, exchange: &str) -> bool {
        self.0.contains(exchange)
    }

    fn insert(&mut self, exchange: &str) {
        if self.0.len() >= Self::LIMIT
            && let Some(out) = self.0.iter().next().cloned()
        {
            self.0.remove(&out);
        }
        self.0.insert(exchange.to_owned());
    }
}

fn short(s: &str, what: &str) -> Result<ShortString, SinkError> {
    ShortString::try_new(s).map_err(|_| {
        SinkError::Rejected(
            format!("{what} {s:?} is over AMQP's 255-byte limit for short strings").into(),
        )
    })
}

/// The longest a connection may take to open with its channel in confirm
/// mode: a broker that accepts TCP and then says nothing (a half-open
/// connection, a broker still starting) must not hold the relay forever.
const CONNECT_LIMIT: std::time::Duration = std::time::Duration::from_secs(15);

/// Follows the connection's `connection.blocked` and `connection.unblocked`
/// (a memory or disk alarm on the broker) in a [`Pause`], and says so in the
/// log. It stops when the connection fails (which ends a pause: what waits
/// then fails as the connection's; a channel's error is not the
/// connection's), with the connection's events, or once nothing reads it.
fn follow_blocks(connection: &Connection, url: &str) -> Pause {
    let mut events = Box::pin(connection.events_listener());
    let status = connection.status().clone();
    let (tx, rx) = tokio::sync::watch::channel(connection.status().blocked());
    let url = url.to_owned();
    tokio::spawn(async move {
        loop {
            let event = tokio::select! {
                () = tx.closed() => return,
                event = events.next() => event,
            };
            match event {
                Some(lapin::Event::ConnectionBlocked(why)) => {
                    tracing::warn!(
                        reason = %why,
                        "RabbitMQ at {url} blocked publishers (a memory or disk alarm); \
                         what is sent waits on this connection until the alarm clears"
                    );
                    tx.send_replace(true);
                }
                Some(lapin::Event::ConnectionUnblocked) => {
                    tracing::info!("RabbitMQ at {url} unblocked publishers");
                    tx.send_replace(false);
                }
                // lapin marks the connection failed before it says so.
                Some(lapin::Event::Error(_)) if !status.connected() => return,
                None => return,
                Some(_) => {}
            }
        }
    });
    Pause::following(rx)
}

impl RabbitMqSink {
    /// A memory or disk alarm: RabbitMQ stops reading from publishers, and
    /// lapin writes nothing more; a message sent now waits for it to clear
    /// (without counting against `relay.confirm_timeout`, see [`Pause`]).
    async fn not_blocked(&self) -> Result<(), SinkError> {
        if self.paused.clone().resumed().await {
            return Ok(());
        }
        Err(SinkError::Unavailable(
            format!(
                "the connection to RabbitMQ at {} closed while it was blocked",
                self.url
            )
            .into(),
        ))
    }

    pub async fn connect(config: &RabbitMqConfig) -> Result<Self, SinkError> {
        let shown = redact_url(config.url.expose());
        match tokio::time::timeout(CONNECT_LIMIT, Self::open(config, &shown)).await {
            Ok(result) => result,
            Err(_) => Err(SinkError::Unavailable(format!(
                "RabbitMQ at {shown} did not complete the connection within {}s (the server accepted it and went silent); \
                 check sink.url points at an AMQP port and that the broker is healthy",
                CONNECT_LIMIT.as_secs()
            ).into())),
        }
    }

    async fn open(config: &RabbitMqConfig, shown: &str) -> Result<Self, SinkError> {
        let shown = shown.to_owned();
        let props = ConnectionProperties::default().with_connection_name("outbox-relay".into());
        let tls = tls::tls_config(config)?;
        let runtime = lapin::runtime::default_runtime().map_err(|e| {
            SinkError::Fatal(Reason::caused_by(
                format!("no runtime for the RabbitMQ client: {e}"),
                e,
            ))
        })?;
        let connection =
            match Connection::connect_with_config(config.url.expose(), props, tls, runtime).await {
                Ok(c) => c,
                Err(e) => return Err(connect_error(config, &shown, &e).await),
            };
        let channel = connection
            .create_channel()
            .await
            .map_err(|e| unavailable("opening a channel", e))?;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .map_err(|e| unavailable("enabling publisher confirms", e))?;
        Ok(RabbitMqSink {
            unconfirmed: Unconfirmed::default(),
            paused: follow_blocks(&connection, &shown),
            connection,
            channel,
            admin: None,
            url: shown,
            exchange: config.exchange.clone(),
            fixed_exchange: config
                .exchange
                .is_fixed()
                .then(|| Arc::from(config.exchange.render(|_| ""))),
            routing_key: config.routing_key.clone(),
            routing: Routing::default(),
            declare: config.declare_exchange,
            exchange_kind: match config.exchange_type.as_str() {
                "direct" => ExchangeKind::Direct,
                "fanout" => ExchangeKind::Fanout,
                "headers" => ExchangeKind::Headers,
                _ => ExchangeKind::Topic,
            },
            max_bytes: config.message_max_bytes,
            known_exchanges: KnownExchanges::default(),
        })
    }

    /// Takes the exchange and routing key of each event from these columns
    /// where the row has a value (`outbox.columns.destination`,
    /// `outbox.columns.key`).
    pub fn with_routing(mut self, routing: Routing) -> Self {
        self.routing = routing;
        self
    }

    /// The event's exchange and routing key: its routing columns' values,
    /// else the templates'; and where the routing key came from, for the
    /// operator to change it.
    fn route_of(&self, event: &OutboxEvent) -> Result<Route, SinkError> {
        let render = |t: &Template| {
            t.render(|f| match f {
                Field::AggregateType => &event.aggregate_type,
                Field::EventType => &event.event_type,
            })
        };
        let exchange = self
            .routing
            .destination(event, destination::rabbitmq_exchange, "sink.exchange")
            .map_err(SinkError::rejected)?
            .map_or_else(
                || match &self.fixed_exchange {
                    Some(fixed) => Arc::clone(fixed),
                    None => Arc::from(render(&self.exchange)),
                },
                Arc::from,
            );
        let own_key = self
            .routing
            .key(event, destination::rabbitmq_routing_key, "sink.routing_key")
            .map_err(SinkError::rejected)?;
        let (routing_key, key_from) = match own_key {
            Some(k) => (k.to_owned(), "the row's outbox.columns.key value"),
            None => (render(&self.routing_key), "sink.routing_key"),
        };
        destination::rabbitmq_exchange(&exchange).map_err(SinkError::rejected)?;
        destination::rabbitmq_routing_key(&routing_key).map_err(SinkError::rejected)?;
        Ok(Route {
            destination: exchange,
            key: routing_key,
            key_from,
            // RabbitMQ can refuse one message (nack, unroutable) and accept
            // the next, so an aggregate has one message in flight at a time.
            lane: None,
        })
    }

    async fn ensure_exchange(&mut self, exchange: &str) -> Result<(), SinkError> {
        // The default exchange always exists and cannot be declared.
        if exchange.is_empty() || self.known_exchanges.contains(exchange) {
            return Ok(());
        }
        let admin = match self.admin.take() {
            Some(ch) if ch.status().connected() => ch,
            _ => self
                .connection
                .create_channel()
                .await
                .map_err(|e| unavailable("opening a channel", e))?,
        };
        let options = ExchangeDeclareOptions {
            passive: !self.declare,
            durable: true,
            ..ExchangeDeclareOptions::default()
        };
        let result = admin
            .exchange_declare(
                short(exchange, "exchange")?,
                self.exchange_kind.clone(),
                options,
                FieldTable::default(),
            )
            .await;
        match result {
            Ok(()) => {
                self.admin = Some(admin);
                self.known_exchanges.insert(exchange);
                Ok(())
            }
            Err(e) if !self.connection.status().connected() => {
                Err(unavailable("exchange check", e))
            }
            // The broker closed the admin channel (404 NOT_FOUND, 403, 406): this exchange's problem only.
            Err(e) if !self.declare => Err(SinkError::Rejected(Reason::caused_by(
                format!(
                    "exchange {exchange:?} does not exist ({e}); declare it, or set sink.declare_exchange = true"
                ),
                e,
            ))),
            Err(e) => Err(SinkError::Rejected(Reason::caused_by(
                format!("cannot declare exchange {exchange:?}: {e}"),
                e,
            ))),
        }
    }
}

/// The size of the frame that carries a message's properties (all its
/// headers): AMQP sends them in one frame, which may not pass the frame
/// size the connection agreed on (RabbitMQ's `frame_max`, 128 KiB by
/// default). A larger one closes the connection, or never leaves the
/// client, on every try: refused instead, so that it is dead-lettered.
fn properties_fit(message: &Message<'_>, frame_max: u32) -> Result<(), SinkError> {
    // Frame header and end, class, weight, body size, flags; delivery
    // mode, timestamp, app id; the strings with their length prefixes.
    let fixed = 8 + 14 + 1 + 8 + (1 + 12) + 4;
    let strings = [&*message.id, message.content_type, &*message.event_type]
        .iter()
        .map(|s| 1 + s.len())
        .sum::<usize>();
    let headers = message
        .headers
        .iter()
        .map(|(k, v)| 1 + k.len() + 1 + 4 + v.len())
        .sum::<usize>();
    let size = fixed + strings + headers;
    if frame_max != 0 && size > frame_max as usize {
        return Err(SinkError::rejected(format!(
            "the message's properties (its headers, with the CloudEvents attributes in binary mode) take \
             {size} bytes, over the {frame_max}-byte frame the connection to RabbitMQ agreed on: shorten \
             them, or raise frame_max on the broker"
        )));
    }
    Ok(())
}

/// A persistent message with the event's id, type and headers.
fn properties(message: &Message<'_>) -> Result<BasicProperties, SinkError> {
    let mut headers = FieldTable::default();
    for (k, v) in &message.headers {
        headers.insert(
            short(k, "header name")?,
            AMQPValue::LongString(LongString::from(v.as_bytes().to_vec())),
        );
    }
    Ok(BasicProperties::default()
        .with_delivery_mode(2)
        .with_message_id(short(&message.id, "event id")?)
        .with_content_type(short(message.content_type, "content type")?)
        .with_type(short(&message.event_type, "event type")?)
        .with_timestamp(message.timestamp_secs)
        .with_app_id("outbox-relay".into())
        .with_headers(headers))
}

/// A `basic_publish` in progress: it resolves once the connection's I/O
/// thread wrote the frames.
type Publish = Pin<Box<dyn Future<Output = lapin::Result<PublisherConfirm>> + Send>>;

/// A persistent, `mandatory` publish of `body` to `(exchange, routing key)`.
fn publish(
    channel: Channel,
    (exchange, routing_key): (ShortString, ShortString),
    body: Vec<u8>,
    properties: BasicProperties,
) -> Publish {
    Box::pin(async move {
        let options = BasicPublishOptions {
            mandatory: true,
            ..BasicPublishOptions::default()
        };
        channel
            .basic_publish(exchange, routing_key, options, &body, properties)
            .await
    })
}

/// A message handed to the I/O thread.
enum Queued {
    Written(PublisherConfirm),
    Writing(Publish),
}

/// Polls `publish` once. That first poll queues the message's frames for
/// the connection's I/O thread, in the order of these calls; the rest only
/// waits for the thread to write them. Awaiting that here would make every
/// message wait for a thread switch before the next is queued, which on busy
/// cores caps the rate, so the wait goes into the confirmation, under
/// relay.confirm_timeout like the ack.
async fn queue(mut publish: Publish) -> lapin::Result<Queued> {
    match std::future::poll_fn(|cx| Poll::Ready(publish.as_mut().poll(cx))).await {
        Poll::Ready(Ok(confirm)) => Ok(Queued::Written(confirm)),
        Poll::Ready(Err(e)) => Err(e),
        Poll::Pending => Ok(Queued::Writing(publish)),
    }
}

impl Sink for RabbitMqSink {
    fn route(&self, event: &OutboxEvent) -> Result<Route, SinkError> {
        self.route_of(event)
    }

    async fn send(
        &mut self,
        route: Route,
        message: Message<'_>,
    ) -> Result<Confirmation, SinkError> {
        self.not_blocked().await?;
        let Route {
            destination: exchange,
            key: routing_key,
            key_from,
            ..
        } = route;
        within_limit(&message, self.max_bytes)?;
        properties_fit(&message, self.connection.configuration().frame_max())?;
        let properties = properties(&message)?;
        self.ensure_exchange(&exchange).await?;
        let names = (
            short(&exchange, "exchange")?,
            short(&routing_key, "routing key")?,
        );
        let body_len = message.body.len();
        let id = message.id.into_owned();
        let Some(tag) = self.unconfirmed.publish(&id) else {
            return Err(SinkError::Busy(format!(
                "another message with event id {id:?} is unconfirmed; this one waits for its answer \
                 (the outbox's id column repeats a value: give it a unique index)"
            ).into()));
        };
        let publish = publish(self.channel.clone(), names, message.body, properties);
        let queued = match queue(publish).await {
            Ok(queued) => queued,
            Err(e) => {
                self.unconfirmed.unpublish(&id, tag);
                // The channel is closed. When the broker closed it over an
                // earlier message, that message's confirmation carries the
                // refusal, and is answered first: this failure comes as a
                // confirmation too, behind it, not as an error of the send
                // that would end the run before the refusal is seen.
                let failed = unavailable("publish", e);
                return Ok(Box::pin(async move {
                    tokio::time::sleep(confirms::SETTLING).await;
                    Err(failed)
                }));
            }
        };
        let settle = Settle {
            unconfirmed: self.unconfirmed.clone(),
            id,
            tag,
        };
        let declare = self.declare;
        Ok(Box::pin(async move {
            let sent = error::Published {
                exchange: &exchange,
                routing_key: &routing_key,
                key_from,
                body_len,
            };
            let answered = match queued {
                Queued::Written(confirm) => Ok(confirm),
                // `settle` forgets the message when dropped.
                Queued::Writing(publish) => publish.await,
            };
            let result = match answered {
                Ok(confirm) => {
                    let (outcome, returned) = confirms::answered(confirm, settle).await;
                    answer(outcome, returned, sent, declare)
                }
                Err(e) => Err(error::confirm_error(e, sent, declare)),
            };
            if matches!(result, Err(SinkError::Unavailable(_))) {
                // The channel or connection failed: a refusal that closed it
                // (another message's confirmation) is answered first.
                tokio::time::sleep(confirms::SETTLING).await;
            }
            result
        }))
    }

    fn pause(&self) -> Pause {
        self.paused.clone()
    }

    async fn probe(&mut self) -> Result<(), SinkError> {
        let open = self.connection.status().connected() && self.channel.status().connected();
        if open && self.connection.status().blocked() {
            Err(SinkError::Unavailable(
                format!(
                    "RabbitMQ at {} has blocked publishers (a memory or disk alarm)",
                    self.url
                )
                .into(),
            ))
        } else if open {
            Ok(())
        } else {
            Err(SinkError::Unavailable(
                format!("the connection to RabbitMQ at {} is closed", self.url).into(),
            ))
        }
    }

    async fn close(self) {
        let _ = self
            .connection
            .close(200, "outbox-relay closing".into())
            .await;
    }
}

impl SinkCheck for RabbitMqSink {
    async fn check_destination(
        &mut self,
        aggregate_type: &str,
        event_type: &str,
    ) -> Result<String, SinkError> {
        let render = |t: &Template| {
            t.render(|f| match f {
                Field::AggregateType => aggregate_type,
                Field::EventType => event_type,
            })
        };
        let (exchange, routing_key) = (render(&self.exchange), render(&self.routing_key));
        destination::rabbitmq_exchange(&exchange).map_err(SinkError::rejected)?;
        destination::rabbitmq_routing_key(&routing_key).map_err(SinkError::rejected)?;
        self.ensure_exchange(&exchange).await?;
        Ok(format!(
            "exchange {exchange:?} (routing key {routing_key:?}; whether a queue is bound shows when publishing)"
        ))
    }

    async fn check_named_destination(&mut self, name: &str) -> Result<String, SinkError> {
        destination::rabbitmq_exchange(name).map_err(SinkError::rejected)?;
        self.ensure_exchange(name).await?;
        Ok(format!("exchange {name:?}"))
    }

    fn fixed_destination(&self) -> bool {
        self.exchange.is_fixed() && self.routing_key.is_fixed()
    }
}

#[cfg(test)]
mod tests {
    use super::KnownExchanges;

    #[test]
    fn known_exchanges_stay_bounded() {
        let mut known = KnownExchanges::default();
        for i in 0..KnownExchanges::LIMIT * 2 {
            known.insert(&format!("exchange-{i}"));
            assert!(known.contains(&format!("exchange-{i}")));
            assert!(known.0.len() <= KnownExchanges::LIMIT);
        }
        assert_eq!(known.0.len(), KnownExchanges::LIMIT, "full, not emptied");
    }
}
