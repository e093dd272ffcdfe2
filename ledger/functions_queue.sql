-- PostgreSQL queue inputs: enqueue, and the claim, settle and redrive steps
-- of the transport (adapters/pgq.c). Table: ledger/migrations/0022_queue.sql.
-- SECURITY DEFINER with the pinned search_path (functions_pin.sql); PUBLIC
-- may not execute them (the block at the end). `idemq migrate --grant ROLE`
-- grants the run role; an application that enqueues needs
--   GRANT EXECUTE ON FUNCTION
--     idemq.enqueue(text, jsonb, text, text, timestamptz, integer),
--     idemq.enqueue_raw(text, bytea, text, text, timestamptz, integer) TO app;
-- and nothing on the table.

-- Enqueues one job in the caller's transaction and returns its row id: the
-- job exists if and only if that transaction commits (the NOTIFY that wakes
-- an idle worker is delivered at commit, and only then). Limits, each with
-- its SQLSTATE:
--   queue NULL, empty, over 255 bytes or with control characters  22023
--   payload NULL                                                    22004
--   payload over 1 MiB                                              54000
--   key or order_key empty                                          22023
--   key or order_key over 255 bytes                                 22001
--   run_after more than 366 days ahead                              22008
--   priority outside -32768 .. 32767                                22003
-- The job's trace context is the enqueuing transaction's: the settings
-- idemq.traceparent and idemq.tracestate (a producer sets them with
-- set_config(..., true) before it enqueues; inside an idemq effect they
-- hold the running job's, so a job enqueued by an effect continues its
-- trace). Stored as they are, for idemq to check when it takes the row
-- like a message header; a value over 256 (traceparent) or 512
-- (tracestate) bytes is not stored, and an empty one is none.
-- Rows of one order key are numbered in commit order: the enqueue waits
-- for a transaction-scoped advisory lock on (queue, order_key) before it
-- takes its id, so a second transaction enqueueing the same order key
-- passes that point only once the first one has ended.
CREATE OR REPLACE FUNCTION idemq.enqueue_raw(p_queue text, p_payload bytea,
                                             p_key text DEFAULT NULL,
                                             p_order_key text DEFAULT NULL,
                                             p_run_after timestamptz DEFAULT now(),
                                             p_priority integer DEFAULT 0)
RETURNS bigint LANGUAGE plpgsql SECURITY DEFINER AS $fn$
DECLARE
    v_id bigint;
    v_tp text := nullif(current_setting('idemq.traceparent', true), '');
    v_ts text := nullif(current_setting('idemq.tracestate', true), '');
BEGIN
    IF p_queue IS NULL OR p_queue = '' OR octet_length(p_queue) > 255
       OR p_queue ~ '[[:cntrl:]]' THEN
        RAISE EXCEPTION 'idemq.enqueue: queue must be 1 to 255 bytes without control characters'
              USING ERRCODE = '22023';
    END IF;
    IF p_payload IS NULL THEN
        RAISE EXCEPTION 'idemq.enqueue: payload is required' USING ERRCODE = '22004';
    END IF;
    IF octet_length(p_payload) > 1048576 THEN
        RAISE EXCEPTION 'idemq.enqueue: payload of % bytes is over 1 MiB',
              octet_length(p_payload) USING ERRCODE = '54000';
    END IF;
    IF p_key = '' OR p_order_key = '' THEN
        RAISE EXCEPTION 'idemq.enqueue: key and order_key are NULL or not empty'
              USING ERRCODE = '22023';
    END IF;
    IF octet_length(p_key) > 255 OR octet_length(p_order_key) > 255 THEN
        RAISE EXCEPTION 'idemq.enqueue: key and order_key hold at most 255 bytes'
              USING ERRCODE = '22001';
    END IF;
    IF p_run_after > now() + interval '366 days' THEN
        RAISE EXCEPTION 'idemq.enqueue: run_after % is more than 366 days ahead', p_run_after
              USING ERRCODE = '22008';
    END IF;
    IF p_priority IS NOT NULL AND (p_priority < -32768 OR p_priority > 32767) THEN
        RAISE EXCEPTION 'idemq.enqueue: priority % is outside -32768 .. 32767', p_priority
              USING ERRCODE = '22003';
    END IF;
    IF p_order_key IS NOT NULL THEN
        PERFORM pg_advisory_xact_lock(
            hashtextextended('idemq.queue:' || p_queue || ':' || p_order_key, 0));
    END IF;
    IF octet_length(v_tp) > 256 THEN
        v_tp := NULL;
    END IF;
    IF v_tp IS NULL OR octet_length(v_ts) > 512 THEN
        v_ts := NULL;
    END IF;
    INSERT INTO idemq.queue_jobs (queue, key, order_key, priority, run_after, payload,
                                  traceparent, tracestate)
    VALUES (p_queue, p_key, p_order_key, coalesce(p_priority, 0)::smallint,
            coalesce(p_run_after, now()), p_payload, v_tp, v_ts)
    RETURNING id INTO v_id;
    PERFORM pg_notify('idemq_queue', p_queue);
    RETURN v_id;
END
$fn$;

-- The same with a JSON payload (stored as its text, UTF-8).
CREATE OR REPLACE FUNCTION idemq.enqueue(p_queue text, p_payload jsonb,
                                         p_key text DEFAULT NULL,
                                         p_order_key text DEFAULT NULL,
                                         p_run_after timestamptz DEFAULT now(),
                                         p_priority integer DEFAULT 0)
RETURNS bigint LANGUAGE sql SECURITY DEFINER AS $fn$
    SELECT idemq.enqueue_raw(p_queue, convert_to(p_payload::text, 'UTF8'), p_key, p_order_key,
                             p_run_after, p_priority);
$fn$;

DROP FUNCTION IF EXISTS idemq.queue_take(text, integer); -- its result gained the trace context
DROP FUNCTION IF EXISTS idemq.queue_take_row(bigint);

-- Inside the worker's transaction: takes up to p_limit ready rows of
-- p_queue (run_after passed), in (run_after, priority, id) order, locking
-- them with FOR UPDATE SKIP LOCKED: a row another worker holds is skipped,
-- never waited for. A row with an order key is taken only when it is the
-- head of its key (no row of the key with a smaller id, held or not), so a
-- key runs one job at a time, in enqueue order. The row lock is the lease:
-- it lasts until the transaction ends, and a crashed worker's rows are
-- free again when its transaction is rolled back.
CREATE OR REPLACE FUNCTION idemq.queue_take(p_queue text, p_limit integer)
RETURNS TABLE (r_id bigint, r_key text, r_order_key text, r_payload bytea,
               r_attempts integer, r_redrive_gen integer, r_park_id bigint,
               r_enqueued_at timestamptz, r_traceparent text, r_tracestate text)
LANGUAGE sql SECURITY DEFINER AS $fn$
    SELECT q.id, q.key, q.order_key, q.payload, q.attempts, q.redrive_gen, q.park_id,
           q.enqueued_at, q.traceparent, q.tracestate
      FROM idemq.queue_jobs q
     WHERE q.queue = p_queue AND q.run_after <= clock_timestamp()
       AND (q.order_key IS NULL OR NOT EXISTS (
               SELECT 1 FROM idemq.queue_jobs h
                WHERE h.queue = q.queue AND h.order_key = q.order_key AND h.id < q.id))
     ORDER BY q.run_after, q.priority, q.id
     LIMIT greatest(1, least(p_limit, 1000))
       FOR UPDATE OF q SKIP LOCKED;
$fn$;

-- queue_take from a position on: only rows after (p_run_after, p_priority,
-- p_id) in the claim's order, with each row's run_after and priority
-- returned, so the worker can pass the last one back. A worker that has
-- just taken rows starts its next take where the last one ended instead
-- of at the head of the index, which would walk again past every entry of
-- the rows settled before, and which no vacuum may remove while some
-- transaction holds the xmin horizon. Rows that become ready behind the
-- position (a producer whose transaction began before the position was
-- taken, a row another worker skipped and gave back) are taken by the
-- worker's next take from the head: it takes one whenever a take from a
-- position finds nothing, and at least once a second (pgq_worker).
DROP FUNCTION IF EXISTS idemq.queue_take_after(text, integer, timestamptz, smallint, bigint);
CREATE OR REPLACE FUNCTION idemq.queue_take_after(p_queue text, p_limit integer,
                                                  p_run_after timestamptz,
                                                  p_priority smallint, p_id bigint)
RETURNS TABLE (r_id bigint, r_key text, r_order_key text, r_payload bytea,
               r_attempts integer, r_redrive_gen integer, r_park_id bigint,
               r_enqueued_at timestamptz, r_traceparent text, r_tracestate text,
               r_run_after timestamptz, r_priority smallint)
LANGUAGE sql SECURITY DEFINER AS $fn$
    SELECT q.id, q.key, q.order_key, q.payload, q.attempts, q.redrive_gen, q.park_id,
           q.enqueued_at, q.traceparent, q.tracestate, q.run_after, q.priority
      FROM idemq.queue_jobs q
     WHERE q.queue = p_queue AND q.run_after <= clock_timestamp()
       AND (q.run_after, q.priority, q.id) > (p_run_after, p_priority, p_id)
       AND (q.order_key IS NULL OR NOT EXISTS (
               SELECT 1 FROM idemq.queue_jobs h
                WHERE h.queue = q.queue AND h.order_key = q.order_key AND h.id < q.id))
     ORDER BY q.run_after, q.priority, q.id
     LIMIT greatest(1, least(p_limit, 1000))
       FOR UPDATE OF q SKIP LOCKED;
$fn$;

-- Inside the worker's transaction: takes row p_id again, if it is still
-- there and no other worker holds it (nothing otherwise): the row whose
-- apply call failed as a whole, for recording that failure as its attempt.
CREATE OR REPLACE FUNCTION idemq.queue_take_row(p_id bigint)
RETURNS TABLE (r_id bigint, r_key text, r_order_key text, r_payload bytea,
               r_attempts integer, r_redrive_gen integer, r_park_id bigint,
               r_enqueued_at timestamptz, r_traceparent text, r_tracestate text)
LANGUAGE sql SECURITY DEFINER AS $fn$
    SELECT q.id, q.key, q.order_key, q.payload, q.attempts, q.redrive_gen, q.park_id,
           q.enqueued_at, q.traceparent, q.tracestate
      FROM idemq.queue_jobs q WHERE q.id = p_id
       FOR UPDATE SKIP LOCKED;
$fn$;

-- Inside the worker's transaction, its last step before COMMIT: deletes the
-- rows that are done (applied, duplicates, parked: a park holds the
-- payload), holds a retry in its row (run_after = now + the delay,
-- attempts + 1 when p_counts says the attempt counted, last_error) and
-- drops the ledger's retry copy of those keys (the row is the copy), and
-- notes the parks as dead-lettered (their park row is the dead letter).
CREATE OR REPLACE FUNCTION idemq.queue_settle(p_done bigint[], p_retry bigint[],
                                              p_delay_ms integer[], p_counts boolean[],
                                              p_errors text[], p_retry_keys text[],
                                              p_parks bigint[])
RETURNS void LANGUAGE plpgsql SECURITY DEFINER AS $fn$
BEGIN
    -- Planned on each call (EXECUTE), not once per session: a plan cached
    -- while the table and its indexes were small scans the whole claim
    -- index for these ids, which is slow once the index holds the entries
    -- of rows deleted before (while some transaction holds the xmin
    -- horizon, no vacuum removes them); planned with the index's size of
    -- the moment it takes the primary key.
    IF cardinality(p_done) > 0 THEN
        EXECUTE 'DELETE FROM idemq.queue_jobs q WHERE q.id = ANY ($1)' USING p_done;
    END IF;
    IF cardinality(p_retry) > 0 THEN
        EXECUTE 'UPDATE idemq.queue_jobs q'
                '   SET run_after = clock_timestamp() + make_interval(secs => r.ms / 1000.0),'
                '       attempts = q.attempts + CASE WHEN r.counts THEN 1 ELSE 0 END,'
                '       last_error = left(r.err, 1024), redrive_gen = NULL, park_id = NULL'
                '  FROM unnest($1, $2, $3, $4) AS r(id, ms, counts, err)'
                ' WHERE q.id = r.id' USING p_retry, p_delay_ms, p_counts, p_errors;
        DELETE FROM idemq.retry_copies c WHERE c.key = ANY (p_retry_keys);
    END IF;
    IF cardinality(p_parks) > 0 THEN
        PERFORM idemq.mark_dead_lettered(p_parks);
    END IF;
END
$fn$;

-- Redrives an open park of a PostgreSQL queue input back into its queue:
-- one new row with the parked payload, key and order key. A park of a job
-- the ledger holds as parked is applied again as a new generation (the row
-- carries the park's generation; the worker presents it as a redrive, and
-- the ledger closes the park when the job is taken); a park of a message
-- that never became a job (it did not decode) is closed here. Returns the
-- new row's id. Errors: no such open park (P0002), a park of another
-- transport or without the whole message (22023).
CREATE OR REPLACE FUNCTION idemq.queue_redrive(p_park_id bigint, p_by text)
RETURNS bigint LANGUAGE plpgsql SECURITY DEFINER AS $fn$
DECLARE
    p    idemq.parked%ROWTYPE;
    v_id bigint;
    v_state text;
BEGIN
    SELECT * INTO p FROM idemq.parked x WHERE x.id = p_park_id FOR UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'idemq.queue_redrive: no open park %', p_park_id USING ERRCODE = 'P0002';
    END IF;
    IF p.properties->>'transport' IS DISTINCT FROM 'postgres' THEN
        RAISE EXCEPTION 'idemq.queue_redrive: park % came from a broker input (idemq redrive)',
              p_park_id USING ERRCODE = '22023';
    END IF;
    IF NOT coalesce(p.redrivable, true) THEN
        RAISE EXCEPTION 'idemq.queue_redrive: park % does not hold the whole message', p_park_id
              USING ERRCODE = '22023';
    END IF;
    SELECT j.state INTO v_state FROM idemq.jobs j WHERE j.key = p.key;
    INSERT INTO idemq.queue_jobs (queue, key, order_key, payload, redrive_gen, park_id,
                                  enqueued_by, traceparent, tracestate)
    VALUES (p.properties->>'queue', p.properties->>'enqueue_key',
            p.properties->>'order_key', p.body,
            CASE WHEN v_state = 'parked' THEN p.generation END, p.id,
            coalesce(p_by, session_user),
            -- the trace the parked job was in (checked again when taken)
            CASE WHEN octet_length(p.headers->>'traceparent') <= 256
                 THEN p.headers->>'traceparent' END,
            CASE WHEN octet_length(p.headers->>'tracestate') <= 512
                 THEN p.headers->>'tracestate' END)
    RETURNING id INTO v_id;
    IF v_state IS DISTINCT FROM 'parked' THEN
        PERFORM idemq.close_park(p.id, 'redriven into queue row ' || v_id, coalesce(p_by, session_user));
    END IF;
    PERFORM pg_notify('idemq_queue', p.properties->>'queue');
    RETURN v_id;
END
$fn$;

-- Depth and oldest ready age of each queue (metrics, `queue` status).
CREATE OR REPLACE FUNCTION idemq.queue_gauges()
RETURNS TABLE (r_queue text, r_depth bigint, r_ready bigint, r_oldest_ready_s double precision,
               r_retrying bigint)
LANGUAGE sql SECURITY DEFINER AS $fn$
    SELECT q.queue, count(*), count(*) FILTER (WHERE q.run_after <= clock_timestamp()),
           coalesce(extract(epoch FROM clock_timestamp()
                    - min(q.run_after) FILTER (WHERE q.run_after <= clock_timestamp())), 0),
           count(*) FILTER (WHERE q.attempts > 0)
      FROM idemq.queue_jobs q GROUP BY q.queue ORDER BY q.queue;
$fn$;

-- Milliseconds until the earliest row of these queues is due (0: one is
-- ready; NULL: none), so an idle worker knows when to look again without
-- a notification (a retry held in its row sends none).
CREATE OR REPLACE FUNCTION idemq.queue_next_due(p_queues text[])
RETURNS bigint LANGUAGE sql SECURITY DEFINER AS $fn$
    -- (greatest ignores a NULL: an empty queue must answer NULL, not 0)
    SELECT CASE WHEN min(q.run_after) IS NOT NULL THEN greatest(0, ceil(extract(epoch FROM
               min(q.run_after) - clock_timestamp()) * 1000))::bigint END
      FROM idemq.queue_jobs q WHERE q.queue = ANY (p_queues);
$fn$;

DO $queue_privileges$
DECLARE
    f regprocedure;
BEGIN
    FOR f IN SELECT p.oid::regprocedure FROM pg_proc p
              WHERE p.pronamespace = 'idemq'::regnamespace
                AND p.proname IN ('enqueue', 'enqueue_raw', 'queue_take', 'queue_take_after',
                                  'queue_take_row',
                                  'queue_settle',
                                  'queue_redrive', 'queue_gauges', 'queue_next_due')
    LOOP
        EXECUTE format('REVOKE EXECUTE ON FUNCTION %s FROM PUBLIC', f);
    END LOOP;
END
$queue_privileges$;
