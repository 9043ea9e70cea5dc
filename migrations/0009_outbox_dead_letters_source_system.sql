-- outbox-relay: the dead-letter table records whose WAL a letter's
-- source_lsn is in (the server's system identifier), so a place recorded by
-- another server (the database restored or moved) is never compared with
-- this one's WAL. Safe to run again.

ALTER TABLE public.outbox_dead_letters ADD COLUMN IF NOT EXISTS source_system text;
