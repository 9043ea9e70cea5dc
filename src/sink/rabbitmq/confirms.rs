//! Which published messages await their publisher confirm, and which came
//! back unroutable.

use lapin::Confirmation as Ack;
use lapin::message::BasicReturnMessage;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// Unconfirmed messages of the publishing channel, and which of them came
/// back unroutable.
///
/// `basic.return` names no delivery tag, only the message's properties, and
/// lapin hands it to whichever confirmation completes next. The sink keeps
/// event ids unique among unconfirmed messages (a second message with an id
/// already unconfirmed is turned away as back-pressure until the first is
/// answered), so a return's message id names exactly one delivery tag, and
/// the return is filed under that tag. RabbitMQ sends a message's return
/// before its ack, and lapin attaches it to a confirmation that completes
/// no later than the message's own; [`answered`] sees that the return is
/// filed before the message's own ack is looked at.
///
/// Bounded: a new sink (connection) starts empty, and each entry belongs to
/// an unconfirmed message of this connection (removed when its confirmation
/// is answered or dropped).
#[derive(Clone, Default)]
pub(super) struct Unconfirmed(Arc<Mutex<Tags>>);

#[derive(Default)]
struct Tags {
    /// One tag per publish, counted from 1 as the channel's delivery tags are.
    last: u64,
    by_id: HashMap<String, u64>,
    returned: HashMap<u64, String>,
}

impl Unconfirmed {
    fn lock(&self) -> std::sync::MutexGuard<'_, Tags> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
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

    pub(super) fn file(&self, returned: &BasicReturnMessage) {
        let id = returned
            .delivery
            .properties
            .message_id()
            .as_ref()
            .map(|s| s.to_string())
            .unwrap_or_default();
        let why = format!("{} {}", returned.reply_code, returned.reply_text);
        self.file_return(id, why);
    }

    /// Files a return of the message with event id `id` under its tag.
    fn file_return(&self, id: String, why: String) {
        let mut tags = self.lock();
        match tags.by_id.get(&id).copied() {
            Some(tag) => {
                tags.returned.insert(tag, why);
            }
            None => tracing::warn!(
                message_id = %id,
                "RabbitMQ returned a message that is not unconfirmed on this channel ({why}); ignored"
            ),
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

/// Waits for the broker's answer to one message, files a return the
/// answer carries (for whichever message it names) and tells whether this
/// message came back.
///
/// A multiple ack completes several confirmations at once, in no set order,
/// and lapin attaches a pending return to the first of them, not
/// necessarily the returned message's own. Their futures are woken in the
/// order they complete, but one pushed and not yet polled is ahead of them
/// all, and would find its answer with no return filed yet: it would count
/// an unroutable message delivered. So an answer without a return first
/// takes one turn at the back of the queue of futures ready to run, behind
/// those completed with it, which file what they carry.
pub(super) async fn answered<C>(confirm: C, settle: Settle) -> (lapin::Result<Ack>, Option<String>)
where
    C: std::future::Future<Output = lapin::Result<Ack>>,
{
    let outcome = confirm.await;
    match &outcome {
        Ok(Ack::Ack(Some(r)) | Ack::Nack(Some(r))) => settle.unconfirmed.file(r),
        Ok(_) => {
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
        Err(_) => {}
    }
    let returned = settle.unconfirmed.settle(&settle.id, settle.tag);
    (outcome, returned)
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
}
