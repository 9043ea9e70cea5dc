-- outbox-relay: ownership claims, one row per ownership lock. An owner that
-- stops cleanly (everything it sent confirmed, its broker connection closed)
-- records it here, so the next owner starts publishing at once instead of
-- waiting out relay.ownership_lease. Without this table every takeover waits.
-- The relay's role needs SELECT, INSERT and UPDATE on it. Safe to run again.

CREATE TABLE IF NOT EXISTS public.outbox_relay_owners (
    lock_key text PRIMARY KEY,
    shards integer NOT NULL,
    owner text NOT NULL,
    claimed_at timestamptz NOT NULL,
    stopped_at timestamptz
);
