-- outbox-relay, with the experimental relay.mark = "ranges" only
-- (PostgreSQL 14 or later: the progress rows are multiranges): the tables
-- that record which rows of public.outbox were sent, the predicate's
-- function, and the index that finds rows by transaction. Apply after the
-- common files. The relay's role needs SELECT, INSERT, UPDATE and DELETE on
-- the three tables. On a large existing table, build the index with
-- CREATE INDEX CONCURRENTLY outside a transaction instead (migrate does).
-- Safe to run again.

-- One row of relay_seq ranges per confirmed batch.
CREATE TABLE IF NOT EXISTS public.outbox_relay_progress (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    seqs int8multirange NOT NULL,
    recorded_at timestamptz NOT NULL DEFAULT now()
);

-- The snapshots the fold moved the frontier to; the newest is the frontier.
CREATE TABLE IF NOT EXISTS public.outbox_relay_frontier (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    snapshot pg_snapshot NOT NULL,
    max_seq bigint NOT NULL,
    last_recorded_at timestamptz,
    folded_at timestamptz NOT NULL DEFAULT now()
);

-- Rows the frontier passed before they were recorded.
CREATE TABLE IF NOT EXISTS public.outbox_relay_held (
    relay_seq bigint PRIMARY KEY,
    held_at timestamptz NOT NULL DEFAULT now()
);

-- Whether a row (its relay_seq, relay_xid, relay_sent_at) was sent.
CREATE OR REPLACE FUNCTION public.outbox_relay_sent(bigint, xid8, timestamptz) RETURNS boolean
LANGUAGE sql STABLE AS $fn$
SELECT $3 IS NOT NULL
    OR COALESCE($1 <@ (SELECT range_agg(r) FROM "public"."outbox_relay_progress", unnest(seqs) r), false)
    OR (COALESCE(pg_visible_in_snapshot($2, (SELECT snapshot FROM "public"."outbox_relay_frontier" ORDER BY id DESC LIMIT 1)), false)
        AND NOT EXISTS (SELECT 1 FROM "public"."outbox_relay_held" h WHERE h.relay_seq = $1))
$fn$;

-- Rows by transaction, for the fold and the reads.
CREATE INDEX IF NOT EXISTS outbox_relay_xid_outbox ON public.outbox (relay_xid) INCLUDE (relay_seq);
