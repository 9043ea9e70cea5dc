-- outbox-relay: refuses an UPDATE that changes an unsent event. The relay
-- publishes a row as inserted when it streams the WAL (CDC) and as it stands
-- when it reads the table (polling, CDC start-up reads), so an updated event
-- would reach consumers in one form or the other. The event columns are the
-- trigger's arguments. Marking a row sent, and any change to a sent row, pass.
-- Safe to run again.

CREATE OR REPLACE FUNCTION public.outbox_relay_write_once() RETURNS trigger LANGUAGE plpgsql AS $fn$
DECLARE
    old_row jsonb := to_jsonb(OLD);
    new_row jsonb := to_jsonb(NEW);
    i int;
BEGIN
    FOR i IN 0 .. TG_NARGS - 1 LOOP
        IF old_row -> TG_ARGV[i] IS DISTINCT FROM new_row -> TG_ARGV[i] THEN
            RAISE EXCEPTION USING ERRCODE = 'check_violation', MESSAGE = 'outbox rows are write-once until sent: this UPDATE changes an unsent event of public.outbox', HINT = 'insert a new event instead; outbox-relay publishes a row as inserted when it streams the WAL and as it stands when it reads the table, so an updated event would reach consumers in one form or the other';
        END IF;
    END LOOP;
    RETURN NEW;
END
$fn$;

DROP TRIGGER IF EXISTS outbox_relay_write_once ON public.outbox;
CREATE TRIGGER outbox_relay_write_once BEFORE UPDATE ON public.outbox FOR EACH ROW
    WHEN (OLD.relay_sent_at IS NULL AND NEW.relay_sent_at IS NULL)
    EXECUTE FUNCTION public.outbox_relay_write_once('id', 'aggregate_type', 'aggregate_id', 'event_type', 'event_version', 'payload', 'headers', 'created_at');
