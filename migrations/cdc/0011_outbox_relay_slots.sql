-- outbox-relay, CDC mode only: where the relay, on a clean stop, saves a
-- snapshot with the slot's last reported position, so that the next start
-- reads from public.outbox only the unsent rows the slot cannot deliver
-- (with relay.mark = "update"; otherwise the table stays empty). Without
-- this table every start reads every unsent row, and the events committed
-- after a backlog wait while the server decodes it again. The relay's role
-- needs SELECT, INSERT, UPDATE and DELETE on it. Safe to run again.

CREATE TABLE IF NOT EXISTS public.outbox_relay_slots (
    slot_name text PRIMARY KEY,
    snapshot pg_snapshot NOT NULL,
    until pg_lsn NOT NULL,
    flushed pg_lsn NOT NULL,
    saved_at timestamptz NOT NULL
);
