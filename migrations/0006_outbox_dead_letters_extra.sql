-- outbox-relay: the dead-letter table keeps the values of the
-- [[outbox.columns.extra]] columns (a JSON object), so a redriven event
-- carries them as the original would have. Safe to run again.

ALTER TABLE public.outbox_dead_letters ADD COLUMN IF NOT EXISTS extra text;
