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

-- Depth and oldest ready age of each queue (metrics, `queue` status), the
-- rows leased now (a provider call in flight) and the leases that ran out
-- and were taken again since the queue's first (a counter).
DROP FUNCTION IF EXISTS idemq.queue_gauges(); -- its result gained the leases
CREATE OR REPLACE FUNCTION idemq.queue_gauges()
RETURNS TABLE (r_queue text, r_depth bigint, r_ready bigint, r_oldest_ready_s double precision,
               r_retrying bigint, r_leased bigint, r_leases_expired bigint)
LANGUAGE sql SECURITY DEFINER AS $fn$
    SELECT g.queue, coalesce(g.depth, 0), coalesce(g.ready, 0), coalesce(g.oldest, 0),
           coalesce(g.retrying, 0), coalesce(g.leased, 0), coalesce(x.expired, 0)
      FROM (SELECT q.queue, count(*) AS depth,
                   count(*) FILTER (WHERE q.run_after <= clock_timestamp()) AS ready,
                   extract(epoch FROM clock_timestamp()
                       - min(q.run_after) FILTER (WHERE q.run_after <= clock_timestamp()))
                       AS oldest,
                   count(*) FILTER (WHERE q.attempts > 0) AS retrying,
                   count(*) FILTER (WHERE q.lease_until > clock_timestamp()) AS leased
              FROM idemq.queue_jobs q GROUP BY q.queue) g
      FULL JOIN idemq.queue_lease_expiries x ON x.queue = g.queue
     ORDER BY coalesce(g.queue, x.queue);
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

-- Provider inputs (effects that outlive a transaction): takes up to
-- p_limit ready rows of p_queue as queue_take does, and leases them to
-- p_holder for p_lease_ms in the same statement: leased_by, lease_until,
-- and run_after set to the lease's end, so no take sees them while the
-- lease lasts. The statement is its own transaction: it commits before
-- the worker calls the provider, and no transaction stays open during the
-- call. A row whose lease ran out (its holder died or hung: nothing
-- extended it) is ready again by itself, like any row whose run_after
-- passed; r_expired_holder names that holder, and each such take counts in
-- idemq.queue_lease_expiries.
DROP FUNCTION IF EXISTS idemq.queue_lease(text, integer, text, integer);
CREATE OR REPLACE FUNCTION idemq.queue_lease(p_queue text, p_limit integer, p_holder text,
                                             p_lease_ms integer)
RETURNS TABLE (r_id bigint, r_key text, r_order_key text, r_payload bytea,
               r_attempts integer, r_redrive_gen integer, r_park_id bigint,
               r_enqueued_at timestamptz, r_traceparent text, r_tracestate text,
               r_expired_holder text)
LANGUAGE sql SECURITY DEFINER AS $fn$
    WITH taken AS (
        SELECT q.id, q.leased_by AS was
          FROM idemq.queue_jobs q
         WHERE q.queue = p_queue AND q.run_after <= clock_timestamp()
           AND (q.order_key IS NULL OR NOT EXISTS (
                   SELECT 1 FROM idemq.queue_jobs h
                    WHERE h.queue = q.queue AND h.order_key = q.order_key AND h.id < q.id))
         ORDER BY q.run_after, q.priority, q.id
         LIMIT greatest(1, least(p_limit, 1000))
           FOR UPDATE OF q SKIP LOCKED),
    leased AS (
        UPDATE idemq.queue_jobs q
           SET leased_by = left(p_holder, 200),
               lease_until = clock_timestamp()
                             + make_interval(secs => greatest(p_lease_ms, 1000) / 1000.0),
               run_after = clock_timestamp()
                           + make_interval(secs => greatest(p_lease_ms, 1000) / 1000.0)
          FROM taken t
         WHERE q.id = t.id
        RETURNING q.id, q.key, q.order_key, q.payload, q.attempts, q.redrive_gen, q.park_id,
                  q.enqueued_at, q.traceparent, q.tracestate, t.was),
    counted AS (
        INSERT INTO idemq.queue_lease_expiries AS x (queue, expired)
        SELECT p_queue, count(*) FROM taken t WHERE t.was IS NOT NULL HAVING count(*) > 0
        ON CONFLICT (queue) DO UPDATE SET expired = x.expired + excluded.expired)
    SELECT l.id, l.key, l.order_key, l.payload, l.attempts, l.redrive_gen, l.park_id,
           l.enqueued_at, l.traceparent, l.tracestate, l.was
      FROM leased l ORDER BY l.id;
$fn$;

-- The holder extends the leases of its rows p_ids (a call in flight) to
-- p_lease_ms from now; returns the ids it still held (a row whose lease ran
-- out and that another worker took is not extended, nor returned).
CREATE OR REPLACE FUNCTION idemq.queue_lease_extend(p_ids bigint[], p_holder text,
                                                    p_lease_ms integer)
RETURNS SETOF bigint LANGUAGE sql SECURITY DEFINER AS $fn$
    UPDATE idemq.queue_jobs q
       SET lease_until = clock_timestamp()
                         + make_interval(secs => greatest(p_lease_ms, 1000) / 1000.0),
           run_after = clock_timestamp()
                       + make_interval(secs => greatest(p_lease_ms, 1000) / 1000.0)
     WHERE q.id = ANY (p_ids) AND q.leased_by = left(p_holder, 200)
    RETURNING q.id;
$fn$;

-- The end of a leased row, in its own transaction after the provider
-- flow recorded its decision: 'done' deletes it (applied, a duplicate;
-- with p_park_id, parked: the park holds the payload and is noted as
-- dead-lettered), 'retry' and 'wait' give it back ready after p_delay_ms
-- ('retry' counts an attempt and keeps p_error), the lease cleared. Only
-- while p_holder still holds it: false (nothing done) when its lease ran
-- out and another worker took it, or the row is gone; that worker's take
-- goes through the ledger, which holds what this one recorded.
CREATE OR REPLACE FUNCTION idemq.queue_lease_settle(p_id bigint, p_holder text, p_action text,
                                                    p_delay_ms integer, p_error text,
                                                    p_park_id bigint)
RETURNS boolean LANGUAGE plpgsql SECURITY DEFINER AS $fn$
DECLARE
    v_key text;
BEGIN
    IF p_action NOT IN ('done', 'retry', 'wait') THEN
        RAISE EXCEPTION 'idemq.queue_lease_settle: action must be done, retry or wait, not %',
              p_action USING ERRCODE = '22023';
    END IF;
    IF p_action = 'done' THEN
        DELETE FROM idemq.queue_jobs q WHERE q.id = p_id AND q.leased_by = left(p_holder, 200)
        RETURNING q.key INTO v_key;
        IF NOT FOUND THEN
            RETURN false;
        END IF;
        IF p_park_id IS NOT NULL THEN
            PERFORM idemq.mark_dead_lettered(ARRAY[p_park_id]);
        END IF;
        RETURN true;
    END IF;
    UPDATE idemq.queue_jobs q
       SET run_after = clock_timestamp()
                       + make_interval(secs => greatest(coalesce(p_delay_ms, 0), 0) / 1000.0),
           attempts = q.attempts + CASE WHEN p_action = 'retry' THEN 1 ELSE 0 END,
           last_error = CASE WHEN p_action = 'retry' THEN left(p_error, 1024)
                             ELSE q.last_error END,
           leased_by = NULL, lease_until = NULL, redrive_gen = NULL, park_id = NULL
     WHERE q.id = p_id AND q.leased_by = left(p_holder, 200);
    RETURN FOUND;
END
$fn$;

-- A stopping holder gives back the leases of rows it took and never
-- started (ready at once, nothing counted).
CREATE OR REPLACE FUNCTION idemq.queue_lease_release(p_ids bigint[], p_holder text)
RETURNS integer LANGUAGE plpgsql SECURITY DEFINER AS $fn$
DECLARE
    v_n integer;
BEGIN
    UPDATE idemq.queue_jobs q
       SET run_after = clock_timestamp(), leased_by = NULL, lease_until = NULL
     WHERE q.id = ANY (p_ids) AND q.leased_by = left(p_holder, 200);
    GET DIAGNOSTICS v_n = ROW_COUNT;
    RETURN v_n;
END
$fn$;

-- The leased rows of a business key (`idemq jobs show`, the console's job
-- page): the row its provider intent came from, or rows enqueued with the
-- key as their key argument, while a lease is written in them; r_expired
-- when the lease ran out (its holder died or hung) and no worker took the
-- row again yet.
CREATE OR REPLACE FUNCTION idemq.queue_lease_of(p_key text)
RETURNS TABLE (r_queue text, r_id bigint, r_leased_by text, r_lease_until timestamptz,
               r_expired boolean)
LANGUAGE sql STABLE SECURITY DEFINER AS $fn$
    SELECT q.queue, q.id, q.leased_by, q.lease_until, q.lease_until <= clock_timestamp()
      FROM idemq.queue_jobs q
     WHERE q.leased_by IS NOT NULL
       AND (q.key = p_key
            OR q.id = (SELECT CASE WHEN i.properties->>'queue_row' ~ '^[0-9]{1,18}$'
                                   THEN (i.properties->>'queue_row')::bigint END
                         FROM idemq.intents i
                        WHERE i.key = p_key AND i.properties->>'transport' = 'postgres'))
     ORDER BY q.id;
$fn$;

DO $queue_privileges$
DECLARE
    f regprocedure;
BEGIN
    FOR f IN SELECT p.oid::regprocedure FROM pg_proc p
              WHERE p.pronamespace = 'idemq'::regnamespace
                AND p.proname IN ('enqueue', 'enqueue_raw', 'queue_take', 'queue_take_after',
                                  'queue_take_row',
                                  'queue_settle', 'queue_lease', 'queue_lease_extend',
                                  'queue_lease_settle', 'queue_lease_release', 'queue_lease_of',
                                  'queue_redrive', 'queue_gauges', 'queue_next_due')
    LOOP
        EXECUTE format('REVOKE EXECUTE ON FUNCTION %s FROM PUBLIC', f);
    END LOOP;
END
$queue_privileges$;
