-- outbox-relay, CDC mode with events written as logical messages
-- (source.cdc.messages = true, after cdc/0005): the function applications
-- call to write one, public.outbox_relay_emit_outbox(...), for the default
-- prefix outbox_relay_outbox (source.cdc.message_prefix). It writes a
-- transactional pg_logical_emit_message and returns the event id. Needs
-- PostgreSQL 14 or later for the relay to read the messages. Safe to run again.

CREATE OR REPLACE FUNCTION "public"."outbox_relay_emit_outbox"(
    aggregate_type text,
    aggregate_id text,
    event_type text,
    payload jsonb,
    headers jsonb DEFAULT NULL,
    event_version integer DEFAULT 1,
    extra jsonb DEFAULT NULL,
    id uuid DEFAULT gen_random_uuid()
) RETURNS uuid VOLATILE LANGUAGE plpgsql AS $fn$
BEGIN
    PERFORM pg_logical_emit_message(true, 'outbox_relay_outbox', (
        coalesce(extra, '{}'::jsonb) || jsonb_build_object(
            'id', id,
            'aggregate_type', aggregate_type,
            'aggregate_id', aggregate_id,
            'event_type', event_type,
            'event_version', event_version,
            'payload', payload,
            'headers', headers)
    )::text);
    RETURN id;
END
$fn$;
