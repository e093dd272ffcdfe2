-- The transactional outbox (issue 18): emit, and the relay's claim, sent,
-- fail and release steps (consumer/outbox.c via ledger/ledger_outbox.c).
-- Table and trigger: ledger/migrations/0010_outbox.sql. SECURITY DEFINER
-- with the pinned search_path (functions_pin.sql); PUBLIC may not execute
-- them: `idemq migrate --grant ROLE` grants the run role, an application
-- that emits needs GRANT EXECUTE ON FUNCTION idemq.emit(...) TO its role
-- (what it emits is published with idemq's broker credentials).

-- At COMMIT (deferred constraint trigger, once per row; the first one of a
-- transaction does the work): locks the transaction's order keys in key
-- order, then numbers its rows in id order. Two transactions emitting the
-- same order key pass this point in turn and the first releases its lock
-- only once its commit is visible: commit_seq follows commit order per key.
CREATE OR REPLACE FUNCTION idemq.outbox_stamp() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER AS $fn$
DECLARE
    v_x xid8 := pg_current_xact_id();
    v_k text;
BEGIN
    IF NOT EXISTS (SELECT 1 FROM idemq.outbox o
                    WHERE o.xact_id = v_x AND o.commit_seq IS NULL AND o.id = NEW.id) THEN
        RETURN NULL; /* stamped by an earlier row's trigger */
    END IF;
    FOR v_k IN SELECT DISTINCT o.order_key FROM idemq.outbox o
                WHERE o.xact_id = v_x AND o.commit_seq IS NULL AND o.order_key IS NOT NULL
                ORDER BY 1
    LOOP
        PERFORM pg_advisory_xact_lock(hashtextextended('idemq.outbox:' || v_k, 0));
    END LOOP;
    UPDATE idemq.outbox o SET commit_seq = s.seq
      FROM (SELECT u.id, nextval('idemq.outbox_commit_seq') AS seq
              FROM (SELECT o2.id FROM idemq.outbox o2
                     WHERE o2.xact_id = v_x AND o2.commit_seq IS NULL ORDER BY o2.id) u) s
     WHERE o.id = s.id;
    RETURN NULL;
END
$fn$;

-- Emits one message in the caller's transaction; returns the row id (the
-- message_id is 'outbox:<id>'). p_key: the emitting idempotency key (an
-- effect passes its key), shown by `jobs show`.
CREATE OR REPLACE FUNCTION idemq.emit(p_exchange text, p_routing_key text, p_body bytea,
                                      p_headers jsonb DEFAULT NULL,
                                      p_order_key text DEFAULT NULL,
                                      p_key text DEFAULT NULL)
RETURNS bigint LANGUAGE plpgsql SECURITY DEFINER AS $fn$
DECLARE
    v_id bigint;
BEGIN
    IF p_exchange IS NULL OR p_routing_key IS NULL OR p_body IS NULL THEN
        RAISE EXCEPTION 'idemq.emit: exchange, routing_key and body are required'
              USING ERRCODE = '22004';
    END IF;
    IF p_headers IS NOT NULL AND jsonb_typeof(p_headers) <> 'object' THEN
        RAISE EXCEPTION 'idemq.emit: headers must be a JSON object' USING ERRCODE = '22023';
    END IF;
    INSERT INTO idemq.outbox (key, exchange, routing_key, body, headers, order_key)
    VALUES (p_key, p_exchange, p_routing_key, p_body, p_headers, p_order_key)
    RETURNING id INTO v_id;
    RETURN v_id;
END
$fn$;

-- The same with a text body (sent as its UTF-8 bytes).
CREATE OR REPLACE FUNCTION idemq.emit(p_exchange text, p_routing_key text, p_body text,
                                      p_headers jsonb DEFAULT NULL,
                                      p_order_key text DEFAULT NULL,
                                      p_key text DEFAULT NULL)
RETURNS bigint LANGUAGE sql SECURITY DEFINER AS $fn$
    SELECT idemq.emit(p_exchange, p_routing_key, convert_to(p_body, 'UTF8'), p_headers,
                      p_order_key, p_key);
$fn$;

-- The relay claims up to p_limit publishable rows under a lease of
-- p_lease_ms held by p_holder: unordered pending rows, and of each order
-- key only its head (the pending row with the lowest commit_seq), and that
-- only while no relay holds a live lease on it. Rows are locked with SKIP
-- LOCKED and the lease is checked again on the locked row, so two relays
-- never hold one row.
CREATE OR REPLACE FUNCTION idemq.outbox_claim(p_holder text, p_limit integer, p_lease_ms integer)
RETURNS TABLE (r_id bigint, r_key text, r_exchange text, r_routing_key text, r_body bytea,
               r_headers jsonb, r_order_key text, r_message_id text, r_attempts integer,
               r_created_at timestamptz)
LANGUAGE sql SECURITY DEFINER AS $fn$
    WITH heads AS (
        SELECT DISTINCT ON (o.order_key) o.id, o.lease_until
          FROM idemq.outbox o
         WHERE o.state = 'pending' AND o.order_key IS NOT NULL
         ORDER BY o.order_key, o.commit_seq),
    cand AS (
        SELECT h.id FROM heads h
         WHERE h.lease_until IS NULL OR h.lease_until < clock_timestamp()
        UNION ALL
        (SELECT o.id FROM idemq.outbox o
          WHERE o.state = 'pending' AND o.order_key IS NULL
            AND (o.lease_until IS NULL OR o.lease_until < clock_timestamp())
          ORDER BY o.id LIMIT p_limit)),
    locked AS (
        SELECT o.id FROM idemq.outbox o
         WHERE o.id IN (SELECT c.id FROM cand c) AND o.state = 'pending'
           AND (o.lease_until IS NULL OR o.lease_until < clock_timestamp())
         ORDER BY o.id LIMIT p_limit
         FOR UPDATE SKIP LOCKED)
    UPDATE idemq.outbox o
       SET lease_holder = p_holder,
           lease_until = clock_timestamp() + p_lease_ms * interval '1 millisecond'
      FROM locked l
     WHERE o.id = l.id
    RETURNING o.id, o.key, o.exchange, o.routing_key, o.body, o.headers, o.order_key,
              o.message_id, o.attempts, o.created_at;
$fn$;

-- Confirmed by the broker: sent. The row moves to idemq.outbox_sent (its
-- history, partitioned by sent_at: it ages out with the other history,
-- migration 0017), in this statement. Returns the commit-to-confirm
-- latency of each row marked (ms since created_at).
CREATE OR REPLACE FUNCTION idemq.outbox_sent(p_holder text, p_ids bigint[])
RETURNS TABLE (r_id bigint, r_latency_ms double precision)
LANGUAGE sql SECURITY DEFINER AS $fn$
    WITH m AS (
        DELETE FROM idemq.outbox o
         WHERE o.id = ANY (p_ids) AND o.state = 'pending' AND o.lease_holder = p_holder
        RETURNING o.*),
    i AS (
        INSERT INTO idemq.outbox_sent (id, key, exchange, routing_key, body, headers, order_key,
                                       message_id, created_at, commit_seq, attempts, sent_at,
                                       last_error)
        SELECT m.id, m.key, m.exchange, m.routing_key, m.body, m.headers, m.order_key,
               m.message_id, m.created_at, m.commit_seq, m.attempts + 1, clock_timestamp(),
               m.last_error
          FROM m
        RETURNING id, created_at, sent_at)
    SELECT i.id, extract(epoch FROM (i.sent_at - i.created_at)) * 1000 FROM i;
$fn$;

-- Every outbox row a key emitted, for `jobs show`: the rows not sent
-- (idemq.outbox), the sent ones in the hot partitions of idemq.outbox_sent
-- and in the archived ones (dropped ones are gone). state: pending,
-- parked or sent; at: sent_at or parked_at. Like idemq.key_attempts, not
-- revoked from PUBLIC (a reader needs USAGE on schema idemq).
CREATE OR REPLACE FUNCTION idemq.key_outbox(p_key text)
RETURNS TABLE (id bigint, state text, exchange text, routing_key text, order_key text,
               attempts integer, created_at timestamptz, at timestamptz, last_error text,
               message_id text)
LANGUAGE plpgsql STABLE SECURITY DEFINER AS $fn$
DECLARE
    r record;
BEGIN
    RETURN QUERY SELECT o.id, o.state, o.exchange, o.routing_key, o.order_key, o.attempts,
                        o.created_at, o.parked_at, o.last_error, o.message_id
                   FROM idemq.outbox o WHERE o.key = p_key;
    RETURN QUERY SELECT o.id, 'sent'::text, o.exchange, o.routing_key, o.order_key, o.attempts,
                        o.created_at, o.sent_at, o.last_error, o.message_id
                   FROM idemq.outbox_sent o WHERE o.key = p_key;
    FOR r IN SELECT h.relname, h.location FROM idemq.history_parts h
              WHERE h.kind = 'outbox' AND NOT h.attached AND h.location <> 'dropped'
              ORDER BY h.lo LOOP
        RETURN QUERY EXECUTE format(
            'SELECT o.id, ''sent''::text, o.exchange, o.routing_key, o.order_key, o.attempts, '
            'o.created_at, o.sent_at, o.last_error, o.message_id FROM %I.%I o '
            'WHERE o.key = $1', idemq.history_schema(r.location), r.relname)
          USING p_key;
    END LOOP;
END
$fn$;

-- Returned (unroutable: p_park) or nacked: parked at once when p_park, or
-- once attempts reach p_max; else pending again after p_retry_ms. Returns
-- the new state.
CREATE OR REPLACE FUNCTION idemq.outbox_failed(p_holder text, p_id bigint, p_error text,
                                               p_park boolean, p_max integer,
                                               p_retry_ms integer)
RETURNS text LANGUAGE sql SECURITY DEFINER AS $fn$
    UPDATE idemq.outbox o
       SET attempts = o.attempts + 1,
           last_error = left(p_error, 1000),
           state = CASE WHEN p_park OR o.attempts + 1 >= p_max THEN 'parked' ELSE 'pending' END,
           parked_at = CASE WHEN p_park OR o.attempts + 1 >= p_max THEN clock_timestamp() END,
           lease_holder = CASE WHEN p_park OR o.attempts + 1 >= p_max THEN NULL
                          ELSE o.lease_holder END,
           lease_until = CASE WHEN p_park OR o.attempts + 1 >= p_max THEN NULL
                         ELSE clock_timestamp() + p_retry_ms * interval '1 millisecond' END
     WHERE o.id = p_id AND o.state = 'pending' AND o.lease_holder = p_holder
    RETURNING o.state;
$fn$;

-- Not published (the broker went away before the confirm): the lease is
-- given up, the rows are eligible again at once (nothing counted).
CREATE OR REPLACE FUNCTION idemq.outbox_release(p_holder text, p_ids bigint[], p_error text)
RETURNS integer LANGUAGE sql SECURITY DEFINER AS $fn$
    WITH u AS (
        UPDATE idemq.outbox o
           SET lease_holder = NULL, lease_until = NULL, last_error = left(p_error, 1000)
         WHERE o.id = ANY (p_ids) AND o.state = 'pending' AND o.lease_holder = p_holder
        RETURNING 1)
    SELECT count(*)::integer FROM u;
$fn$;

-- Gauges: rows not sent (pending), parked, and the age in seconds of the
-- oldest pending row (0 when none). Index-only on the partial indexes.
CREATE OR REPLACE FUNCTION idemq.outbox_gauges()
RETURNS TABLE (r_pending bigint, r_parked bigint, r_oldest_s double precision)
LANGUAGE sql SECURITY DEFINER AS $fn$
    SELECT (SELECT count(*) FROM idemq.outbox WHERE state = 'pending'),
           (SELECT count(*) FROM idemq.outbox WHERE state = 'parked'),
           coalesce((SELECT extract(epoch FROM clock_timestamp() - min(created_at))
                       FROM idemq.outbox WHERE state = 'pending'), 0);
$fn$;

DO $outbox_privileges$
DECLARE
    f regprocedure;
BEGIN
    FOR f IN SELECT p.oid::regprocedure FROM pg_proc p
              WHERE p.pronamespace = 'idemq'::regnamespace
                AND p.proname IN ('emit', 'outbox_claim', 'outbox_sent', 'outbox_failed',
                                  'outbox_release', 'outbox_gauges', 'outbox_stamp')
    LOOP
        EXECUTE format('REVOKE EXECUTE ON FUNCTION %s FROM PUBLIC', f);
    END LOOP;
END
$outbox_privileges$;
