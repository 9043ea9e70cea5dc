//! Feeds arbitrary bytes to the pgoutput decoder: it must return, never panic.
#![no_main]

use bytes::Bytes;
use libfuzzer_sys::fuzz_target;
use outbox_relay::replication::pgoutput::{LogicalMessage, RelationCache, decode};

fuzz_target!(|data: &[u8]| {
    let Ok(message) = decode(Bytes::copy_from_slice(data)) else {
        return;
    };
    // Exercise the lookups the CDC source makes on what the decoder accepted.
    if let LogicalMessage::Relation(relation) = message {
        let mut cache = RelationCache::new();
        let id = relation.id;
        let first = relation.columns.first().map(|column| column.name.clone());
        cache.apply(relation);
        if let (Some(relation), Some(name)) = (cache.get(id), first) {
            assert_eq!(relation.column_index(&name), Some(0));
        }
    }
});
