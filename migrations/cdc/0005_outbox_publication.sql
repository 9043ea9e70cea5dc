-- outbox-relay, CDC mode only (source.mode = "cdc"): the publication of the
-- outbox's inserts that the relay streams, outbox_relay_outbox (the default
-- source.cdc.publication). Creating it needs ownership of public.outbox.
-- The replication slot is not created here: a slot cannot be created in a
-- transaction that has written, and `outbox-relay run` creates it
-- (source.cdc.create_slot, the default). Safe to run again.

DO $do$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_publication WHERE pubname = 'outbox_relay_outbox') THEN
        CREATE PUBLICATION outbox_relay_outbox FOR TABLE public.outbox WITH (publish = 'insert');
    ELSIF NOT EXISTS (SELECT 1 FROM pg_publication_tables
                      WHERE pubname = 'outbox_relay_outbox' AND schemaname = 'public' AND tablename = 'outbox') THEN
        ALTER PUBLICATION outbox_relay_outbox ADD TABLE public.outbox;
    END IF;
END
$do$;

-- CDC needs no wake-ups (the stream is the wake-up), and a NOTIFY per insert
-- serialises commits: drop the polling trigger of 0002, and its function
-- unless another table's trigger still uses it.
DROP TRIGGER IF EXISTS outbox_relay_notify ON public.outbox;
DO $do$
BEGIN
    IF to_regprocedure('public.outbox_relay_notify()') IS NOT NULL
       AND NOT EXISTS (SELECT 1 FROM pg_trigger
                       WHERE tgfoid = to_regprocedure('public.outbox_relay_notify()')) THEN
        DROP FUNCTION public.outbox_relay_notify();
    END IF;
END
$do$;
