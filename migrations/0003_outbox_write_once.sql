-- outbox-relay: refuses an UPDATE that changes an unsent event. The relay
-- publishes a row as inserted when it streams the WAL (CDC) and as it stands
-- when it reads the table (polling, CDC start-up reads), so an updated event
-- would reach consumers in one form or the other. The event columns are the
-- trigger's arguments. Marking a row sent, and any change to a sent row, pass
-- (with the experimental relay.mark = "ranges", sent as the outbox's
-- <outbox>_relay_sent says).
-- Safe to run again.

CREATE OR REPLACE FUNCTION public.outbox_relay_write_once() RETURNS trigger LANGUAGE plpgsql AS $fn$
DECLARE
    old_row jsonb := to_jsonb(OLD);
    new_row jsonb := to_jsonb(NEW);
    outbox_schema text;
    outbox_name text;
    predicate regproc;
    sent boolean;
    i int;
BEGIN
    FOR i IN 0 .. TG_NARGS - 1 LOOP
        IF old_row -> TG_ARGV[i] IS DISTINCT FROM new_row -> TG_ARGV[i] THEN
            SELECT n.nspname, c.relname INTO outbox_schema, outbox_name
            FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
            WHERE c.oid = COALESCE(pg_partition_root(TG_RELID), TG_RELID);
            -- relay.mark = "ranges": relay_sent_at stays NULL; the outbox's predicate knows.
            predicate := to_regproc(format('%I.%I', outbox_schema, right(outbox_name || '_relay_sent', 63)));
            IF predicate IS NOT NULL THEN
                EXECUTE format('SELECT %s($1, $2, $3)', predicate) INTO sent
                    USING OLD.relay_seq, OLD.relay_xid, OLD.relay_sent_at;
                IF sent THEN
                    RETURN NEW;
                END IF;
            END IF;
            RAISE EXCEPTION USING ERRCODE = 'check_violation',
                MESSAGE = format('outbox rows are write-once until sent: this UPDATE changes an unsent event of %I.%I', outbox_schema, outbox_name),
                HINT = 'insert a new event instead; outbox-relay publishes a row as inserted when it streams the WAL and as it stands when it reads the table, so an updated event would reach consumers in one form or the other';
        END IF;
    END LOOP;
    RETURN NEW;
END
$fn$;
DROP TRIGGER IF EXISTS outbox_relay_write_once ON public.outbox;
CREATE TRIGGER outbox_relay_write_once BEFORE UPDATE ON public.outbox FOR EACH ROW
    WHEN (OLD.relay_sent_at IS NULL AND NEW.relay_sent_at IS NULL)
    EXECUTE FUNCTION public.outbox_relay_write_once('id', 'aggregate_type', 'aggregate_id', 'event_type', 'event_version', 'payload', 'headers', 'created_at');
