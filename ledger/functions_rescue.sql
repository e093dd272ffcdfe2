-- idemq ledger functions, part 3: retry copies and their rescue.
-- Applied together with functions.sql and functions_batch.sql as one text
-- by every `idemq migrate` (see ledger/embed_sql.cmake); the same rules
-- hold. Every function pins its search_path.
--
-- A retry waits on a broker delay bucket. The bucket's copy can be lost
-- (a classic bucket dead-letters at most once; a bucket can be purged or
-- deleted), which would leave the job 'retrying' with no copy anywhere. So
-- idemq.record_failure keeps the message of a job it schedules for a retry
-- (idemq.keep_retry_copy), and a rescuer (consumer/rescue.c) publishes the
-- copy again when the job is still retrying with that attempt long after its
-- run_after: no delivery of it was processed. One replica at a time per
-- queue: the rescuer holds pg_try_advisory_xact_lock(hashtext('idemq.rescue'),
-- hashtext(queue)) for its whole pass (take, publish, confirm, record).
-- A rescue that was not needed after all (the bucket copy was only slow)
-- only adds a duplicate copy, which the ledger absorbs like any other.

DROP FUNCTION IF EXISTS idemq.keep_retry_copy(text, integer, integer, text, text, text, bytea,
                                               jsonb, jsonb); -- it gained the body's key
DROP FUNCTION IF EXISTS idemq.rescue_take(text[], integer, integer); -- its result gained r_body_key

-- Inside the transaction of a failed attempt that schedules a retry
-- (called by idemq.record_failure): the job's message, for a rescue.
-- p_body_key: p_body is sealed with that key (consumer/protect.h); NULL:
-- p_body is the message's body as sent.
CREATE OR REPLACE FUNCTION idemq.keep_retry_copy(
    p_key text, p_generation integer, p_attempt integer, p_queue text, p_exchange text,
    p_routing_key text, p_body bytea, p_headers jsonb, p_properties jsonb,
    p_body_key text)
RETURNS void
LANGUAGE sql
SET search_path = pg_catalog, idemq AS $fn$
    INSERT INTO idemq.retry_copies AS c (key, generation, attempt, source_queue, exchange,
        routing_key, body, headers, properties, body_key)
    VALUES (p_key, p_generation, p_attempt, p_queue, p_exchange, p_routing_key, p_body,
        p_headers, p_properties, p_body_key)
    ON CONFLICT (key) DO UPDATE SET generation = excluded.generation,
        attempt = excluded.attempt, source_queue = excluded.source_queue,
        exchange = excluded.exchange, routing_key = excluded.routing_key, body = excluded.body,
        headers = excluded.headers, properties = excluded.properties,
        body_key = excluded.body_key,
        stored_at = clock_timestamp(), rescued_at = NULL, rescues = 0;
$fn$;

-- One rescuer pass, inside its own transaction (the advisory locks it takes
-- last until that transaction ends):
--   1. under the cleanup lock (one rescuer of the database at a time), drops
--      at most p_limit copies of jobs no longer retrying with that attempt
--      and untouched for a minute (a copy rewritten meanwhile has a fresh
--      stored_at, which the DELETE rechecks on the row's latest version);
--   2. returns the copies to publish again, of those queues in p_queues
--      whose rescue lock it got: the job still retrying with the copy's
--      generation and attempt, its run_after more than p_after_ms ago, and
--      the copy not rescued within p_after_ms * 2^(its rescues, at most 8)
--      either (a copy that keeps not coming back is published again ever
--      more rarely). At most p_limit rows, oldest run_after first; r_body_key
--      names the key a sealed body needs (NULL: the body as sent).
CREATE OR REPLACE FUNCTION idemq.rescue_take(p_queues text[], p_after_ms integer,
                                             p_limit integer)
RETURNS TABLE (r_key text, r_generation integer, r_attempt integer, r_queue text,
               r_run_after timestamptz, r_body bytea, r_headers jsonb, r_properties jsonb,
               r_exchange text, r_routing_key text, r_body_key text)
LANGUAGE plpgsql
SET search_path = pg_catalog, idemq AS $fn$
DECLARE
    v_locked text[];
    v_after  interval := make_interval(secs => p_after_ms / 1000.0);
BEGIN
    IF pg_try_advisory_xact_lock(hashtext('idemq.rescue'), hashtext('')) THEN
        DELETE FROM idemq.retry_copies c
         WHERE c.key IN (SELECT x.key FROM idemq.retry_copies x
                          WHERE x.stored_at < clock_timestamp() - interval '1 minute'
                            AND NOT EXISTS (SELECT 1 FROM idemq.jobs j
                                             WHERE j.key = x.key AND j.state = 'retrying'
                                               AND j.generation = x.generation
                                               AND j.attempts = x.attempt)
                          LIMIT p_limit)
           AND c.stored_at < clock_timestamp() - interval '1 minute';
    END IF;
    SELECT coalesce(array_agg(q), '{}') INTO v_locked
      FROM unnest(p_queues) AS q
     WHERE q <> '' AND pg_try_advisory_xact_lock(hashtext('idemq.rescue'), hashtext(q));
    IF cardinality(v_locked) = 0 THEN
        RETURN;
    END IF;
    RETURN QUERY
    SELECT c.key, c.generation, c.attempt, c.source_queue, j.run_after, c.body, c.headers,
           c.properties, c.exchange, c.routing_key, c.body_key
      FROM idemq.retry_copies c
      JOIN idemq.jobs j ON j.key = c.key
     WHERE c.source_queue = ANY (v_locked)
       AND j.state = 'retrying' AND j.generation = c.generation AND j.attempts = c.attempt
       AND j.run_after < clock_timestamp() - v_after
       AND (c.rescued_at IS NULL
            OR c.rescued_at < clock_timestamp() - v_after * (2 ^ least(c.rescues, 8)))
     ORDER BY j.run_after
     LIMIT p_limit;
END
$fn$;

-- After the broker confirmed the republish of these copies (same
-- transaction as rescue_take): p_rescued is a JSON array of {"k": key,
-- "g": generation, "a": attempt}. One idemq.retry_rescues row each, and the
-- copy's rescued_at (only where the copy is still that attempt's). Returns
-- the rows recorded.
CREATE OR REPLACE FUNCTION idemq.rescue_record(p_rescued jsonb, p_consumer text)
RETURNS integer
LANGUAGE plpgsql
SET search_path = pg_catalog, idemq AS $fn$
DECLARE
    n integer;
BEGIN
    INSERT INTO idemq.retry_rescues (key, generation, attempt, run_after, queue, consumer_id)
    SELECT c.key, c.generation, c.attempt, j.run_after, c.source_queue, p_consumer
      FROM jsonb_to_recordset(p_rescued) AS r(k text, g integer, a integer)
      JOIN idemq.retry_copies c ON c.key = r.k AND c.generation = r.g AND c.attempt = r.a
      LEFT JOIN idemq.jobs j ON j.key = r.k;
    GET DIAGNOSTICS n = ROW_COUNT;
    UPDATE idemq.retry_copies c SET rescued_at = clock_timestamp(), rescues = c.rescues + 1
      FROM jsonb_to_recordset(p_rescued) AS r(k text, g integer, a integer)
     WHERE c.key = r.k AND c.generation = r.g AND c.attempt = r.a;
    RETURN n;
END
$fn$;
