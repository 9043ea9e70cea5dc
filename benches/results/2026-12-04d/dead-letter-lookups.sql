-- The relay's look at the dead-letter table (dead_letter.refresh_interval),
-- before (statements reading every open letter) and after (lookups.rs, with
-- the table named dl and the origin 'sys'), on 1,000,000 open followers of
-- one aggregate and 100 other dead aggregates, nothing requested.
-- Run: psql -h 127.0.0.1 -p 55432 -U postgres -f dead-letter-lookups.sql
-- Prints each statement's time, three runs each.
DROP TABLE IF EXISTS dl;
CREATE TABLE dl (
    dead_letter_id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    id text NOT NULL, outbox_seq bigint, aggregate_type text, aggregate_id text, event_type text,
    event_version text, payload text, headers text, created_at text, reason text NOT NULL,
    attempts integer NOT NULL, first_failed_at timestamptz NOT NULL, last_failed_at timestamptz NOT NULL,
    dead_lettered_at timestamptz NOT NULL DEFAULT now(), resolution text, resolved_at timestamptz,
    redrive_requested_at timestamptz, source_lsn pg_lsn, source_index bigint, extra text, source_system text);
SET synchronous_commit = off;
INSERT INTO dl (id, aggregate_id, payload, reason, attempts, first_failed_at, last_failed_at, source_lsn, source_index, source_system)
SELECT 'e'||g, 'hot', repeat('x', 256), 'follows', 0, now(), now(), ('0/'||to_hex(g*100))::pg_lsn, 0, 'sys' FROM generate_series(1, 1000000) g;
INSERT INTO dl (id, aggregate_id, payload, reason, attempts, first_failed_at, last_failed_at, source_lsn, source_index, source_system)
SELECT 'f'||g, 'a'||g, repeat('x', 256), 'poison', 5, now(), now(), NULL, NULL, NULL FROM generate_series(1, 100) g;
VACUUM ANALYZE dl;

CREATE INDEX dl_open ON dl (aggregate_id, dead_letter_id) WHERE resolution IS NULL;
SET max_parallel_workers_per_gather = 0; -- one backend's time, as a relay's connection gets when the machine is busy
\timing on
\echo before: open aggregates, extending requests, requested letters
\o /dev/null
SELECT DISTINCT ON (aggregate_id) aggregate_id, lsn::text, index
  FROM (SELECT aggregate_id, CASE WHEN source_system = 'sys' THEN source_lsn END AS lsn,
               CASE WHEN source_system = 'sys' THEN source_index END AS index
        FROM dl WHERE resolution IS NULL) open
  ORDER BY aggregate_id, lsn NULLS FIRST, index NULLS FIRST;
\o
\o /dev/null
SELECT DISTINCT ON (aggregate_id) aggregate_id, lsn::text, index
  FROM (SELECT aggregate_id, CASE WHEN source_system = 'sys' THEN source_lsn END AS lsn,
               CASE WHEN source_system = 'sys' THEN source_index END AS index
        FROM dl WHERE resolution IS NULL) open
  ORDER BY aggregate_id, lsn NULLS FIRST, index NULLS FIRST;
\o
\o /dev/null
SELECT DISTINCT ON (aggregate_id) aggregate_id, lsn::text, index
  FROM (SELECT aggregate_id, CASE WHEN source_system = 'sys' THEN source_lsn END AS lsn,
               CASE WHEN source_system = 'sys' THEN source_index END AS index
        FROM dl WHERE resolution IS NULL) open
  ORDER BY aggregate_id, lsn NULLS FIRST, index NULLS FIRST;
\o
\o /dev/null
BEGIN;
UPDATE dl l SET redrive_requested_at = now()
  WHERE l.resolution IS NULL AND l.redrive_requested_at IS NULL
    AND EXISTS (SELECT 1 FROM dl r WHERE r.resolution IS NULL AND r.redrive_requested_at IS NOT NULL
                AND r.aggregate_id IS NOT DISTINCT FROM l.aggregate_id AND r.dead_letter_id < l.dead_letter_id
                AND NOT EXISTS (SELECT 1 FROM dl e WHERE e.resolution IS NULL AND e.redrive_requested_at IS NULL
                                AND e.aggregate_id IS NOT DISTINCT FROM r.aggregate_id AND e.dead_letter_id < r.dead_letter_id));
ROLLBACK;
\o
\o /dev/null
BEGIN;
UPDATE dl l SET redrive_requested_at = now()
  WHERE l.resolution IS NULL AND l.redrive_requested_at IS NULL
    AND EXISTS (SELECT 1 FROM dl r WHERE r.resolution IS NULL AND r.redrive_requested_at IS NOT NULL
                AND r.aggregate_id IS NOT DISTINCT FROM l.aggregate_id AND r.dead_letter_id < l.dead_letter_id
                AND NOT EXISTS (SELECT 1 FROM dl e WHERE e.resolution IS NULL AND e.redrive_requested_at IS NULL
                                AND e.aggregate_id IS NOT DISTINCT FROM r.aggregate_id AND e.dead_letter_id < r.dead_letter_id));
ROLLBACK;
\o
\o /dev/null
BEGIN;
UPDATE dl l SET redrive_requested_at = now()
  WHERE l.resolution IS NULL AND l.redrive_requested_at IS NULL
    AND EXISTS (SELECT 1 FROM dl r WHERE r.resolution IS NULL AND r.redrive_requested_at IS NOT NULL
                AND r.aggregate_id IS NOT DISTINCT FROM l.aggregate_id AND r.dead_letter_id < l.dead_letter_id
                AND NOT EXISTS (SELECT 1 FROM dl e WHERE e.resolution IS NULL AND e.redrive_requested_at IS NULL
                                AND e.aggregate_id IS NOT DISTINCT FROM r.aggregate_id AND e.dead_letter_id < r.dead_letter_id));
ROLLBACK;
\o
\o /dev/null
SELECT l.dead_letter_id, l.id, l.aggregate_type, l.aggregate_id, l.event_type, l.event_version,
       l.payload, l.headers, l.created_at, l.extra
  FROM dl l
  WHERE l.resolution IS NULL AND l.redrive_requested_at IS NOT NULL
    AND NOT EXISTS (SELECT 1 FROM dl e WHERE e.resolution IS NULL AND e.redrive_requested_at IS NULL
                    AND e.aggregate_id IS NOT DISTINCT FROM l.aggregate_id AND e.dead_letter_id < l.dead_letter_id)
  ORDER BY l.dead_letter_id LIMIT 500;
\o
\o /dev/null
SELECT l.dead_letter_id, l.id, l.aggregate_type, l.aggregate_id, l.event_type, l.event_version,
       l.payload, l.headers, l.created_at, l.extra
  FROM dl l
  WHERE l.resolution IS NULL AND l.redrive_requested_at IS NOT NULL
    AND NOT EXISTS (SELECT 1 FROM dl e WHERE e.resolution IS NULL AND e.redrive_requested_at IS NULL
                    AND e.aggregate_id IS NOT DISTINCT FROM l.aggregate_id AND e.dead_letter_id < l.dead_letter_id)
  ORDER BY l.dead_letter_id LIMIT 500;
\o
\o /dev/null
SELECT l.dead_letter_id, l.id, l.aggregate_type, l.aggregate_id, l.event_type, l.event_version,
       l.payload, l.headers, l.created_at, l.extra
  FROM dl l
  WHERE l.resolution IS NULL AND l.redrive_requested_at IS NOT NULL
    AND NOT EXISTS (SELECT 1 FROM dl e WHERE e.resolution IS NULL AND e.redrive_requested_at IS NULL
                    AND e.aggregate_id IS NOT DISTINCT FROM l.aggregate_id AND e.dead_letter_id < l.dead_letter_id)
  ORDER BY l.dead_letter_id LIMIT 500;
\o
\timing off
CREATE INDEX dl_waiting ON dl (aggregate_id, dead_letter_id) WHERE resolution IS NULL AND redrive_requested_at IS NULL;
CREATE INDEX dl_requested ON dl (dead_letter_id) WHERE resolution IS NULL AND redrive_requested_at IS NOT NULL;
CREATE INDEX dl_placed ON dl (aggregate_id, source_system, source_lsn NULLS FIRST, source_index NULLS FIRST) WHERE resolution IS NULL;
VACUUM ANALYZE dl;
\timing on
\echo after: open aggregates, extending requests, requested letters
\o /dev/null
WITH RECURSIVE g(a) AS (
             SELECT min(aggregate_id) FROM dl WHERE resolution IS NULL
           UNION ALL
             SELECT (SELECT min(aggregate_id) FROM dl WHERE resolution IS NULL AND aggregate_id > g.a)
             FROM g WHERE g.a IS NOT NULL
         )
         SELECT g.a, p.lsn::text, p.index
         FROM g LEFT JOIN LATERAL (
             SELECT f.source_lsn AS lsn, f.source_index AS index FROM dl f
             WHERE f.resolution IS NULL AND f.aggregate_id = g.a AND f.source_system = 'sys'
             ORDER BY f.source_system, f.source_lsn NULLS FIRST, f.source_index NULLS FIRST LIMIT 1
         ) p ON NOT EXISTS (SELECT 1 FROM dl u WHERE u.resolution IS NULL AND u.aggregate_id = g.a AND u.source_system IS NULL) AND NOT EXISTS (SELECT 1 FROM dl u WHERE u.resolution IS NULL AND u.aggregate_id = g.a AND u.source_system < 'sys') AND NOT EXISTS (SELECT 1 FROM dl u WHERE u.resolution IS NULL AND u.aggregate_id = g.a AND u.source_system > 'sys')
         WHERE g.a IS NOT NULL;
\o
\o /dev/null
WITH RECURSIVE g(a) AS (
             SELECT min(aggregate_id) FROM dl WHERE resolution IS NULL
           UNION ALL
             SELECT (SELECT min(aggregate_id) FROM dl WHERE resolution IS NULL AND aggregate_id > g.a)
             FROM g WHERE g.a IS NOT NULL
         )
         SELECT g.a, p.lsn::text, p.index
         FROM g LEFT JOIN LATERAL (
             SELECT f.source_lsn AS lsn, f.source_index AS index FROM dl f
             WHERE f.resolution IS NULL AND f.aggregate_id = g.a AND f.source_system = 'sys'
             ORDER BY f.source_system, f.source_lsn NULLS FIRST, f.source_index NULLS FIRST LIMIT 1
         ) p ON NOT EXISTS (SELECT 1 FROM dl u WHERE u.resolution IS NULL AND u.aggregate_id = g.a AND u.source_system IS NULL) AND NOT EXISTS (SELECT 1 FROM dl u WHERE u.resolution IS NULL AND u.aggregate_id = g.a AND u.source_system < 'sys') AND NOT EXISTS (SELECT 1 FROM dl u WHERE u.resolution IS NULL AND u.aggregate_id = g.a AND u.source_system > 'sys')
         WHERE g.a IS NOT NULL;
\o
\o /dev/null
WITH RECURSIVE g(a) AS (
             SELECT min(aggregate_id) FROM dl WHERE resolution IS NULL
           UNION ALL
             SELECT (SELECT min(aggregate_id) FROM dl WHERE resolution IS NULL AND aggregate_id > g.a)
             FROM g WHERE g.a IS NOT NULL
         )
         SELECT g.a, p.lsn::text, p.index
         FROM g LEFT JOIN LATERAL (
             SELECT f.source_lsn AS lsn, f.source_index AS index FROM dl f
             WHERE f.resolution IS NULL AND f.aggregate_id = g.a AND f.source_system = 'sys'
             ORDER BY f.source_system, f.source_lsn NULLS FIRST, f.source_index NULLS FIRST LIMIT 1
         ) p ON NOT EXISTS (SELECT 1 FROM dl u WHERE u.resolution IS NULL AND u.aggregate_id = g.a AND u.source_system IS NULL) AND NOT EXISTS (SELECT 1 FROM dl u WHERE u.resolution IS NULL AND u.aggregate_id = g.a AND u.source_system < 'sys') AND NOT EXISTS (SELECT 1 FROM dl u WHERE u.resolution IS NULL AND u.aggregate_id = g.a AND u.source_system > 'sys')
         WHERE g.a IS NOT NULL;
\o
\o /dev/null
BEGIN;
WITH RECURSIVE g(a, first) AS (
             (SELECT aggregate_id, dead_letter_id FROM dl
              WHERE resolution IS NULL AND aggregate_id IS NOT NULL
              ORDER BY aggregate_id, dead_letter_id LIMIT 1)
           UNION ALL
             SELECT n.aggregate_id, n.dead_letter_id FROM g, LATERAL (
                 SELECT aggregate_id, dead_letter_id FROM dl
                 WHERE resolution IS NULL AND aggregate_id > g.a
                 ORDER BY aggregate_id, dead_letter_id LIMIT 1) n
         ),
         asked AS (
             SELECT g.a FROM g JOIN dl f ON f.dead_letter_id = g.first
             WHERE f.redrive_requested_at IS NOT NULL
         ),
         named AS (
             UPDATE dl l SET redrive_requested_at = now() FROM asked
             WHERE l.aggregate_id = asked.a AND l.resolution IS NULL AND l.redrive_requested_at IS NULL
             RETURNING 1
         ),
         unnamed AS (
             UPDATE dl l SET redrive_requested_at = now()
             WHERE l.aggregate_id IS NULL AND l.resolution IS NULL AND l.redrive_requested_at IS NULL
               AND (SELECT f.redrive_requested_at IS NOT NULL FROM dl f
                    WHERE f.resolution IS NULL AND f.aggregate_id IS NULL
                    ORDER BY f.aggregate_id, f.dead_letter_id LIMIT 1)
             RETURNING 1
         )
         SELECT (SELECT count(*) FROM named) + (SELECT count(*) FROM unnamed);
ROLLBACK;
\o
\o /dev/null
BEGIN;
WITH RECURSIVE g(a, first) AS (
             (SELECT aggregate_id, dead_letter_id FROM dl
              WHERE resolution IS NULL AND aggregate_id IS NOT NULL
              ORDER BY aggregate_id, dead_letter_id LIMIT 1)
           UNION ALL
             SELECT n.aggregate_id, n.dead_letter_id FROM g, LATERAL (
                 SELECT aggregate_id, dead_letter_id FROM dl
                 WHERE resolution IS NULL AND aggregate_id > g.a
                 ORDER BY aggregate_id, dead_letter_id LIMIT 1) n
         ),
         asked AS (
             SELECT g.a FROM g JOIN dl f ON f.dead_letter_id = g.first
             WHERE f.redrive_requested_at IS NOT NULL
         ),
         named AS (
             UPDATE dl l SET redrive_requested_at = now() FROM asked
             WHERE l.aggregate_id = asked.a AND l.resolution IS NULL AND l.redrive_requested_at IS NULL
             RETURNING 1
         ),
         unnamed AS (
             UPDATE dl l SET redrive_requested_at = now()
             WHERE l.aggregate_id IS NULL AND l.resolution IS NULL AND l.redrive_requested_at IS NULL
               AND (SELECT f.redrive_requested_at IS NOT NULL FROM dl f
                    WHERE f.resolution IS NULL AND f.aggregate_id IS NULL
                    ORDER BY f.aggregate_id, f.dead_letter_id LIMIT 1)
             RETURNING 1
         )
         SELECT (SELECT count(*) FROM named) + (SELECT count(*) FROM unnamed);
ROLLBACK;
\o
\o /dev/null
BEGIN;
WITH RECURSIVE g(a, first) AS (
             (SELECT aggregate_id, dead_letter_id FROM dl
              WHERE resolution IS NULL AND aggregate_id IS NOT NULL
              ORDER BY aggregate_id, dead_letter_id LIMIT 1)
           UNION ALL
             SELECT n.aggregate_id, n.dead_letter_id FROM g, LATERAL (
                 SELECT aggregate_id, dead_letter_id FROM dl
                 WHERE resolution IS NULL AND aggregate_id > g.a
                 ORDER BY aggregate_id, dead_letter_id LIMIT 1) n
         ),
         asked AS (
             SELECT g.a FROM g JOIN dl f ON f.dead_letter_id = g.first
             WHERE f.redrive_requested_at IS NOT NULL
         ),
         named AS (
             UPDATE dl l SET redrive_requested_at = now() FROM asked
             WHERE l.aggregate_id = asked.a AND l.resolution IS NULL AND l.redrive_requested_at IS NULL
             RETURNING 1
         ),
         unnamed AS (
             UPDATE dl l SET redrive_requested_at = now()
             WHERE l.aggregate_id IS NULL AND l.resolution IS NULL AND l.redrive_requested_at IS NULL
               AND (SELECT f.redrive_requested_at IS NOT NULL FROM dl f
                    WHERE f.resolution IS NULL AND f.aggregate_id IS NULL
                    ORDER BY f.aggregate_id, f.dead_letter_id LIMIT 1)
             RETURNING 1
         )
         SELECT (SELECT count(*) FROM named) + (SELECT count(*) FROM unnamed);
ROLLBACK;
\o
\o /dev/null
SELECT l.dead_letter_id, l.id, l.aggregate_type, l.aggregate_id, l.event_type, l.event_version,
                l.payload, l.headers, l.created_at, l.extra
         FROM dl l
         WHERE l.resolution IS NULL AND l.redrive_requested_at IS NOT NULL
           AND NOT EXISTS (SELECT 1 FROM dl e WHERE e.resolution IS NULL AND e.redrive_requested_at IS NULL
                         AND e.aggregate_id = l.aggregate_id AND e.dead_letter_id < l.dead_letter_id)
           AND (l.aggregate_id IS NOT NULL OR NOT EXISTS (SELECT 1 FROM dl e WHERE e.resolution IS NULL AND e.redrive_requested_at IS NULL
                         AND e.aggregate_id IS NULL AND e.dead_letter_id < l.dead_letter_id))
         ORDER BY l.dead_letter_id LIMIT 500;
\o
\o /dev/null
SELECT l.dead_letter_id, l.id, l.aggregate_type, l.aggregate_id, l.event_type, l.event_version,
                l.payload, l.headers, l.created_at, l.extra
         FROM dl l
         WHERE l.resolution IS NULL AND l.redrive_requested_at IS NOT NULL
           AND NOT EXISTS (SELECT 1 FROM dl e WHERE e.resolution IS NULL AND e.redrive_requested_at IS NULL
                         AND e.aggregate_id = l.aggregate_id AND e.dead_letter_id < l.dead_letter_id)
           AND (l.aggregate_id IS NOT NULL OR NOT EXISTS (SELECT 1 FROM dl e WHERE e.resolution IS NULL AND e.redrive_requested_at IS NULL
                         AND e.aggregate_id IS NULL AND e.dead_letter_id < l.dead_letter_id))
         ORDER BY l.dead_letter_id LIMIT 500;
\o
\o /dev/null
SELECT l.dead_letter_id, l.id, l.aggregate_type, l.aggregate_id, l.event_type, l.event_version,
                l.payload, l.headers, l.created_at, l.extra
         FROM dl l
         WHERE l.resolution IS NULL AND l.redrive_requested_at IS NOT NULL
           AND NOT EXISTS (SELECT 1 FROM dl e WHERE e.resolution IS NULL AND e.redrive_requested_at IS NULL
                         AND e.aggregate_id = l.aggregate_id AND e.dead_letter_id < l.dead_letter_id)
           AND (l.aggregate_id IS NOT NULL OR NOT EXISTS (SELECT 1 FROM dl e WHERE e.resolution IS NULL AND e.redrive_requested_at IS NULL
                         AND e.aggregate_id IS NULL AND e.dead_letter_id < l.dead_letter_id))
         ORDER BY l.dead_letter_id LIMIT 500;
\o
DROP TABLE dl;
