//! The part of the outbox one pipeline owns: `relay.shards` split the
//! outbox by a hash of `aggregate_id` (the pipeline's shard balancing is in
//! `relay::shards`).

/// The part of the outbox one pipeline owns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shard {
    pub index: u32,
    pub count: u32,
}

impl Shard {
    pub fn whole() -> Shard {
        Shard { index: 0, count: 1 }
    }

    /// The advisory-lock key for this shard of `base` (the whole outbox keeps `base`).
    pub fn lock_key(&self, base: &str) -> String {
        if self.count <= 1 {
            base.to_owned()
        } else {
            format!("{base}:shard:{}/{}", self.index, self.count)
        }
    }

    /// The SQL condition selecting this shard's rows by their aggregate id
    /// column (already quoted), or `None` for the whole outbox.
    pub fn condition(&self, aggregate_id_column: &str) -> Option<String> {
        (self.count > 1).then(|| {
            format!(
                "(hashtextextended(coalesce({aggregate_id_column}::text, ''), 0) & 9223372036854775807) % {} = {}",
                self.count, self.index
            )
        })
    }
}
