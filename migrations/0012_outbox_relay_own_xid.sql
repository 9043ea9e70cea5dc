-- outbox-relay: refuses an INSERT that gives relay_xid a value other than the
-- inserting transaction's id (an INSERT ... SELECT * from a copy of the
-- outbox), and any UPDATE that changes it. The relay tells by relay_xid which
-- transactions it has read: with relay.mark = "ranges" a row naming an
-- earlier transaction counts as sent and would never be published, and a
-- polling relay would pass it over until it restarts. The conditions run
-- without calling the function, so an INSERT that leaves relay_xid to its
-- default pays one comparison. A row inserted with relay_sent_at set is sent
-- whatever its relay_xid, so it passes. A session that moves rows to another
-- partition, or restores them, keeps their relay_xid with
-- SET outbox_relay.keep_xid = on.
-- Safe to run again.

CREATE OR REPLACE FUNCTION public.outbox_relay_own_xid() RETURNS trigger LANGUAGE plpgsql AS $fn$
-- Called by outbox_relay_own_xid (BEFORE INSERT, WHEN NEW.relay_sent_at IS NULL AND
-- NEW.relay_xid IS DISTINCT FROM pg_current_xact_id()) and outbox_relay_own_xid_update
-- (BEFORE UPDATE OF relay_xid, WHEN NEW.relay_xid IS DISTINCT FROM OLD.relay_xid).
DECLARE
    outbox regclass := COALESCE(pg_partition_root(TG_RELID), TG_RELID::regclass);
BEGIN
    IF current_setting('outbox_relay.keep_xid', true) = 'on' THEN
        RETURN NEW;
    END IF;
    IF TG_OP = 'INSERT' THEN
        RAISE EXCEPTION USING ERRCODE = 'generated_always',
            MESSAGE = format('%s.relay_xid is set by its default to the inserting transaction''s id: this INSERT gives it %s, in transaction %s', outbox, NEW.relay_xid, pg_current_xact_id()),
            HINT = 'leave relay_seq, relay_xid and relay_sent_at to their defaults (an INSERT ... SELECT * copies them): outbox-relay tells by relay_xid which transaction wrote a row, and a row naming an earlier transaction can count as sent and never be published; to move rows to another partition, or to restore them, with the relay_xid they have, SET outbox_relay.keep_xid = on in that session first';
    END IF;
    RAISE EXCEPTION USING ERRCODE = 'generated_always',
        MESSAGE = format('%s.relay_xid is the inserting transaction''s id: this UPDATE changes it from %s to %s', outbox, OLD.relay_xid, NEW.relay_xid),
        HINT = 'leave relay_seq, relay_xid and relay_sent_at to their defaults (an INSERT ... SELECT * copies them): outbox-relay tells by relay_xid which transaction wrote a row, and a row naming an earlier transaction can count as sent and never be published; to move rows to another partition, or to restore them, with the relay_xid they have, SET outbox_relay.keep_xid = on in that session first';
END
$fn$;
DROP TRIGGER IF EXISTS outbox_relay_own_xid ON public.outbox;
CREATE TRIGGER outbox_relay_own_xid BEFORE INSERT ON public.outbox FOR EACH ROW
    WHEN (NEW.relay_sent_at IS NULL AND NEW.relay_xid IS DISTINCT FROM pg_current_xact_id())
    EXECUTE FUNCTION public.outbox_relay_own_xid();
DROP TRIGGER IF EXISTS outbox_relay_own_xid_update ON public.outbox;
CREATE TRIGGER outbox_relay_own_xid_update BEFORE UPDATE OF relay_xid ON public.outbox FOR EACH ROW
    WHEN (NEW.relay_xid IS DISTINCT FROM OLD.relay_xid)
    EXECUTE FUNCTION public.outbox_relay_own_xid();
