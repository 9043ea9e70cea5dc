-- outbox-relay: the dead-letter table (dead_letter.enabled, the default):
-- events the broker kept refusing, kept out of the way and never dropped.
-- `outbox-relay dlq` lists, redrives and drops them. Safe to run again.

CREATE TABLE IF NOT EXISTS public.outbox_dead_letters (
    dead_letter_id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    id text NOT NULL,
    outbox_seq bigint,
    aggregate_type text,
    aggregate_id text,
    event_type text,
    event_version text,
    payload text,
    headers text,
    created_at text,
    reason text NOT NULL,
    attempts integer NOT NULL,
    first_failed_at timestamptz NOT NULL,
    last_failed_at timestamptz NOT NULL,
    dead_lettered_at timestamptz NOT NULL DEFAULT now(),
    resolution text CHECK (resolution IN ('redriven', 'dropped')),
    resolved_at timestamptz,
    redrive_requested_at timestamptz,
    source_lsn pg_lsn,
    source_index bigint
);

-- Open dead letters per aggregate, in order.
CREATE INDEX IF NOT EXISTS outbox_dead_letters_open
    ON public.outbox_dead_letters (aggregate_id, dead_letter_id) WHERE resolution IS NULL;
