-- outbox-relay: wakes a polling relay when rows are inserted (NOTIFY
-- outbox_relay_outbox once per INSERT statement, the default
-- source.polling.notify_channel). Only polling uses it; with notify = false or
-- in CDC mode it is harmless. Safe to run again.

CREATE OR REPLACE FUNCTION public.outbox_relay_notify() RETURNS trigger LANGUAGE plpgsql AS $fn$
BEGIN
    PERFORM pg_notify(TG_ARGV[0], '');
    RETURN NULL;
END
$fn$;

-- DROP and CREATE rather than CREATE OR REPLACE TRIGGER, which needs PostgreSQL 14.
DROP TRIGGER IF EXISTS outbox_relay_notify ON public.outbox;
CREATE TRIGGER outbox_relay_notify AFTER INSERT ON public.outbox
    FOR EACH STATEMENT EXECUTE FUNCTION public.outbox_relay_notify('outbox_relay_outbox');
