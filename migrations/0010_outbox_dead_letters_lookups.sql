-- outbox-relay: indexes for the relay's periodic look at the dead-letter
-- table (every dead_letter.refresh_interval), so that it costs a few index
-- probes per dead aggregate however many letters wait behind one. Safe to
-- run again. On a large table, run each statement as CREATE INDEX
-- CONCURRENTLY outside a transaction to keep the relay writing meanwhile.

-- Open dead letters nobody asked to redrive, per aggregate.
CREATE INDEX IF NOT EXISTS outbox_dead_letters_waiting
    ON public.outbox_dead_letters (aggregate_id, dead_letter_id)
    WHERE resolution IS NULL AND redrive_requested_at IS NULL;
-- Dead letters an operator asked to redrive, in order.
CREATE INDEX IF NOT EXISTS outbox_dead_letters_requested
    ON public.outbox_dead_letters (dead_letter_id)
    WHERE resolution IS NULL AND redrive_requested_at IS NOT NULL;
-- Where each aggregate's earliest open dead letter is in the WAL.
CREATE INDEX IF NOT EXISTS outbox_dead_letters_placed
    ON public.outbox_dead_letters (aggregate_id, source_system, source_lsn NULLS FIRST, source_index NULLS FIRST)
    WHERE resolution IS NULL;
