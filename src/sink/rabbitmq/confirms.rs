//! Which published messages await their publisher confirm, and which came
//! back unroutable.

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
/// before its ack, lapin attaches it to a confirmation that completes no
/// later than the message's own, and confirmations are handled in the order
/// they complete: the return is filed before the message's own ack is
/// looked at.
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
