//! Which published messages await their publisher confirm, and which came
//! back unroutable.

use lapin::Confirmation as Ack;
use lapin::message::BasicReturnMessage;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::Notify;

/// Unconfirmed messages of the publishing channel, and which of them came
/// back unroutable.
///
/// `basic.return` names no delivery tag, only the message's properties, and
/// lapin hands each return, in the order they arrived, to whichever
/// confirmation completes next (a multiple ack completes its confirmations
/// in no set order). The sink keeps event ids unique among unconfirmed
/// messages (a second message with an id already unconfirmed is turned away
/// as back-pressure until the first is answered), so a return's message id
/// names exactly one delivery tag, and the return is filed under that tag.
/// See [`answered`] for when a message's own return is sure to be filed.
///
/// Bounded: a new sink (connection) starts empty, and each entry belongs to
/// an unconfirmed message of this connection (removed when its confirmation
/// is answered or dropped).
#[derive(Clone, Default)]
pub(super) struct Unconfirmed(Arc<Shared>);

#[derive(Default)]
struct Shared {
    tags: Mutex<Tags>,
    /// Woken whenever a return is filed.
    filed: Notify,
}

#[derive(Default)]
struct Tags {
    /// One tag per publish, counted from 1 as the channel's delivery tags are.
    last: u64,
    by_id: HashMap<String, u64>,
    returned: HashMap<u64, String>,
}

impl Unconfirmed {
    fn lock(&self) -> std::sync::MutexGuard<'_, Tags> {
        self.0.tags.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Takes the next delivery tag for a message with this id, or `None`
    /// while another message with the id is unconfirmed.
    pub(super) fn publish(&self, id: &str) -> Option<u64> {
        let mut tags = self.lock();
        if tags.by_id.contains_key(id) {
            return None;
        }
        tags.last += 1;
        let tag = tags.last;
        tags.by_id.insert(id.to_owned(), tag);
        Some(tag)
    }

    /// A publish that failed: its connection is done for, so is the message.
    pub(super) fn unpublish(&self, id: &str, tag: u64) {
        self.settle(id, tag);
    }

    /// Files a return; the tag of the message it names, when unconfirmed.
    pub(super) fn file(&self, returned: &BasicReturnMessage) -> Option<u64> {
        let id = returned
            .delivery
            .properties
            .message_id()
            .as_ref()
            .map(|s| s.to_string())
            .unwrap_or_default();
        let why = format!("{} {}", returned.reply_code, returned.reply_text);
        self.file_return(id, why)
    }

    /// Files a return of the message with event id `id` under its tag.
    fn file_return(&self, id: String, why: String) -> Option<u64> {
        let tag = {
            let mut tags = self.lock();
            let tag = tags.by_id.get(&id).copied();
            match tag {
                Some(tag) => {
                    tags.returned.insert(tag, why);
                }
                // Settled as delivered before its return came: lost unless
                // its event is sent again. Not expected (see `answered`).
                None => tracing::error!(
                    event_id = %id,
                    "RabbitMQ returned a message the relay had already counted delivered ({why}); \
                     it did not reach a queue: check that event on the broker and publish it again if needed"
                ),
            }
            tag
        };
        self.0.filed.notify_waiters();
        tag
    }

    fn is_returned(&self, tag: u64) -> bool {
        self.lock().returned.contains_key(&tag)
    }

    /// Waits until the message of `tag` is filed as returned, at most `within`.
    async fn return_filed(&self, tag: u64, within: Duration) {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            let filed = self.0.filed.notified();
            tokio::pin!(filed);
            filed.as_mut().enable();
            if self.is_returned(tag) {
                return;
            }
            tokio::select! {
                () = filed => {}
                () = tokio::time::sleep_until(deadline) => return,
            }
        }
    }

    /// The message's answer is in: forgets it, and says whether it came back.
    pub(super) fn settle(&self, id: &str, tag: u64) -> Option<String> {
        let mut tags = self.lock();
        if tags.by_id.get(id) == Some(&tag) {
            tags.by_id.remove(id);
        }
        tags.returned.remove(&tag)
    }
}

/// How long lapin may take to finish completing the confirmations of one
/// broker answer (an ack, or the channel's close), which it does in one
/// pass under a lock, in microseconds: the wait covers that pass being held
/// off the CPU (a container's CPU quota throttles for up to 100 ms at a
/// time). A message whose answer carried the return of an earlier message
/// waits this long for its own return (see [`answered`]); a failure that
/// may have been caused by another message's refusal waits this long
/// before it is reported, so that the refusal is counted first.
pub(super) const SETTLING: Duration = Duration::from_millis(500);

/// Waits for the broker's answer to one message, files a return the
/// answer carries (for whichever message it names) and tells whether this
/// message came back.
///
/// lapin keeps returns in the order they arrived, which is the order the
/// messages were published, and hands the oldest to each confirmation it
/// completes. RabbitMQ sends a message's return before its ack, and the ack
/// of a returned message no later than those of messages published after
/// it. So when an ack for this message is handled, its return (if any) is
/// waiting, behind at most the returns of earlier messages, each of whose
/// messages lapin completes in the same ack or before: by the end of that
/// ack, this message's return is in the hands of some confirmation the ack
/// completed. That may be a confirmation completed after this one, whose
/// future has not run yet. Hence:
///
/// - An answer that carries no return, or the return of a later message,
///   means the queue was past this message's return: a confirmation
///   completed before this one carries it. Their futures were woken first;
///   one turn at the back of the queue of ready futures (the relay polls
///   every confirmation from one set) lets them file it.
/// - An answer that carries the return of an earlier message means this
///   message's own may still come, with a confirmation the same ack
///   completes next. It waits for it to be filed, up to [`SETTLING`].
pub(super) async fn answered<C>(confirm: C, settle: Settle) -> (lapin::Result<Ack>, Option<String>)
where
    C: std::future::Future<Output = lapin::Result<Ack>>,
{
    let outcome = confirm.await;
    let carried = match &outcome {
        Ok(Ack::Ack(Some(r)) | Ack::Nack(Some(r))) => settle.unconfirmed.file(r),
        _ => None,
    };
    if outcome.is_ok() {
        if carried.is_some_and(|tag| tag < settle.tag) {
            settle.unconfirmed.return_filed(settle.tag, SETTLING).await;
        }
        one_turn().await;
    }
    let returned = settle.unconfirmed.settle(&settle.id, settle.tag);
    (outcome, returned)
}

/// Goes to the back of the queue of ready futures once.
async fn one_turn() {
    let mut turned = false;
    std::future::poll_fn(|cx| {
        if std::mem::replace(&mut turned, true) {
            std::task::Poll::Ready(())
        } else {
            cx.waker().wake_by_ref();
            std::task::Poll::Pending
        }
    })
    .await;
}

/// Settles a message whose confirmation is dropped unanswered (the relay
/// gave up on the connection), so its id and tag do not linger.
pub(super) struct Settle {
    pub(super) unconfirmed: Unconfirmed,
    pub(super) id: String,
    pub(super) tag: u64,
}

impl Drop for Settle {
    fn drop(&mut self) {
        self.unconfirmed.settle(&self.id, self.tag);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::StreamExt;
    use futures::stream::FuturesUnordered;

    /// Message `m` came back unroutable, but the multiple ack that answered
    /// it carried the return on message `x`'s confirmation, and `m`'s
    /// future (pushed last, never polled) runs first: it still finds the
    /// return that `x`'s files.
    #[tokio::test]
    async fn a_return_carried_by_another_confirmation_is_filed_before_the_answer_is_read() {
        let unconfirmed = Unconfirmed::default();
        let x = unconfirmed.publish("x").unwrap();
        let m = unconfirmed.publish("m").unwrap();
        let settle = |id: &str, tag| Settle {
            unconfirmed: unconfirmed.clone(),
            id: id.to_owned(),
            tag,
        };
        type Answer = (String, Option<String>);
        let ready: FuturesUnordered<std::pin::Pin<Box<dyn std::future::Future<Output = Answer>>>> =
            FuturesUnordered::new();
        let m_settle = settle("m", m);
        ready.push(Box::pin(async move {
            (
                "m".to_owned(),
                answered(async { Ok(Ack::Ack(None)) }, m_settle).await.1,
            )
        }));
        let (carrier, x_settle) = (unconfirmed.clone(), settle("x", x));
        ready.push(Box::pin(async move {
            // What `file` does with the return lapin attached to x's answer.
            carrier.file_return("m".into(), "312 NO_ROUTE".into());
            (
                "x".to_owned(),
                answered(async { Ok(Ack::Ack(None)) }, x_settle).await.1,
            )
        }));
        let mut answers: Vec<Answer> = ready.collect().await;
        answers.sort();
        assert_eq!(
            answers,
            [
                ("m".to_owned(), Some("312 NO_ROUTE".to_owned())),
                ("x".to_owned(), None)
            ]
        );
    }

    fn returned(id: &str) -> BasicReturnMessage {
        let mut delivery = lapin::message::Delivery::mock(0, "".into(), "k".into(), false, vec![]);
        delivery.properties = lapin::BasicProperties::default().with_message_id(id.into());
        BasicReturnMessage {
            delivery,
            reply_code: 312,
            reply_text: "NO_ROUTE".into(),
        }
    }

    type Answered = std::pin::Pin<Box<dyn std::future::Future<Output = (String, Option<String>)>>>;

    /// `id`'s answer: an ack carrying `carried`'s return, after `delay`.
    fn answer(
        unconfirmed: &Unconfirmed,
        id: &str,
        tag: u64,
        carried: Option<&str>,
        delay: Duration,
    ) -> Answered {
        let settle = Settle {
            unconfirmed: unconfirmed.clone(),
            id: id.to_owned(),
            tag,
        };
        let (id, carried) = (id.to_owned(), carried.map(returned));
        Box::pin(async move {
            let confirm = async move {
                tokio::time::sleep(delay).await;
                Ok(Ack::Ack(carried))
            };
            (id, answered(confirm, settle).await.1)
        })
    }

    /// Both `x` and then `m` came back; one multiple ack completed `m`'s
    /// confirmation first, handing it the oldest return (`x`'s), and `x`'s
    /// second, with `m`'s. Each is still answered as returned, whether
    /// `x`'s confirmation completes with `m`'s or a moment later.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn returns_swapped_by_one_ack_are_each_filed_under_their_own_message() {
        for late in [Duration::ZERO, Duration::from_millis(20)] {
            let unconfirmed = Unconfirmed::default();
            let x = unconfirmed.publish("x").unwrap();
            let m = unconfirmed.publish("m").unwrap();
            let ready: FuturesUnordered<Answered> = FuturesUnordered::new();
            ready.push(answer(&unconfirmed, "m", m, Some("x"), Duration::ZERO));
            ready.push(answer(&unconfirmed, "x", x, Some("m"), late));
            let mut answers: Vec<_> = ready.collect().await;
            answers.sort();
            let back = Some("312 NO_ROUTE".to_owned());
            assert_eq!(
                answers,
                [("m".to_owned(), back.clone()), ("x".to_owned(), back)],
                "{late:?}"
            );
        }
    }

    /// `m` was delivered, but its answer carried the return of `x`,
    /// published before it: it is answered as delivered once the wait for
    /// a return of its own is over.
    #[tokio::test]
    async fn a_delivered_message_handed_an_earlier_return_is_delivered() {
        let unconfirmed = Unconfirmed::default();
        let x = unconfirmed.publish("x").unwrap();
        let m = unconfirmed.publish("m").unwrap();
        let ready: FuturesUnordered<Answered> = FuturesUnordered::new();
        ready.push(answer(&unconfirmed, "m", m, Some("x"), Duration::ZERO));
        ready.push(answer(&unconfirmed, "x", x, None, Duration::ZERO));
        let started = std::time::Instant::now();
        let mut answers: Vec<_> = ready.collect().await;
        answers.sort();
        assert_eq!(
            answers,
            [
                ("m".to_owned(), None),
                ("x".to_owned(), Some("312 NO_ROUTE".to_owned()))
            ]
        );
        assert!(started.elapsed() < Duration::from_secs(2));
    }
}
