-- The transactional outbox: emit, and the relay's claim, sent,
-- fail and release steps (consumer/outbox.c via ledger/ledger_outbox.c).
-- Table and trigger: ledger/migrations/0010_outbox.sql. SECURITY DEFINER
-- with the pinned search_path (functions_pin.sql); PUBLIC may not execute
-- them: `idemq migrate --grant ROLE` grants the run role, `--grant-app
-- ROLE` an application that emits (EXECUTE on idemq.emit only; what it
-- emits is published with idemq's broker credentials).

-- Result types changed (r_body_key) and outbox_take took the sealed bodies
-- as parameters: the old signatures go first.
DROP FUNCTION IF EXISTS idemq.outbox_take(text, integer, integer);
DROP FUNCTION IF EXISTS idemq.outbox_claim(text, integer, integer);

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
    /* stamped before COMMIT by idemq.outbox_take (this transaction's rows
     * up to that id): one setting read per row instead of a query */
    v_k := current_setting('idemq.outbox_stamped', true);
    IF split_part(v_k, ':', 1) = v_x::text THEN
        IF NEW.id <= split_part(v_k, ':', 2)::bigint THEN
            RETURN NULL;
        END IF;
    END IF;
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

-- What idemq.emit refuses because it can never be published, so that the
-- emitting transaction fails rather than the relay (consumer/README.md
-- "Outbox", "What a row may carry"): an exchange, routing key or header
-- name (at any depth) over 255 bytes, an AMQP short string (22001); headers
-- over 32 KiB as JSON text or nested over 16 levels (54000: 32 KiB of JSON
-- encodes to at most about 96 KiB of AMQP table, inside one frame of the
-- default frame_max of 128 KiB; 16 levels is what idemq's inputs read); a
-- body over 16 MiB (54000: RabbitMQ 4's default max_message_size).
CREATE OR REPLACE FUNCTION idemq.outbox_check(p_exchange text, p_routing_key text,
                                              p_body_len bigint, p_headers jsonb)
RETURNS void LANGUAGE plpgsql AS $fn$
DECLARE
    v_depth integer;
    v_name  text;
    v_len   integer;
BEGIN
    IF octet_length(p_exchange) > 255 THEN
        RAISE EXCEPTION 'idemq.emit: the exchange name is % bytes; AMQP allows at most 255',
              octet_length(p_exchange) USING ERRCODE = '22001';
    END IF;
    IF octet_length(p_routing_key) > 255 THEN
        RAISE EXCEPTION 'idemq.emit: the routing key is % bytes; AMQP allows at most 255',
              octet_length(p_routing_key) USING ERRCODE = '22001';
    END IF;
    IF p_body_len > 16777216 THEN
        RAISE EXCEPTION 'idemq.emit: the body is % bytes; at most 16777216 (16 MiB) are published',
              p_body_len USING ERRCODE = '54000';
    END IF;
    IF p_headers IS NULL THEN
        RETURN;
    END IF;
    v_len := octet_length(p_headers::text);
    IF v_len > 32768 THEN
        RAISE EXCEPTION 'idemq.emit: the headers are % bytes of JSON; at most 32768 are published',
              v_len USING ERRCODE = '54000';
    END IF;
    IF v_len < 34 THEN
        RETURN; /* too short for 17 levels ({{...}}) or a 256-byte name: no walk */
    END IF;
    WITH RECURSIVE n(v, depth) AS (
        SELECT p_headers, 1
        UNION ALL
        SELECT c.v, n.depth + 1
          FROM n, LATERAL (
                SELECT e.value AS v FROM jsonb_each(CASE WHEN jsonb_typeof(n.v) = 'object'
                                                         THEN n.v END) e
                UNION ALL
                SELECT a.value FROM jsonb_array_elements(CASE WHEN jsonb_typeof(n.v) = 'array'
                                                              THEN n.v END) a) c
         WHERE n.depth <= 16 AND jsonb_typeof(c.v) IN ('object', 'array'))
    SELECT max(n.depth),
           (SELECT k FROM n n2, jsonb_object_keys(CASE WHEN jsonb_typeof(n2.v) = 'object'
                                                       THEN n2.v END) k
             WHERE octet_length(k) > 255 LIMIT 1)
      INTO v_depth, v_name FROM n;
    IF v_name IS NOT NULL THEN
        RAISE EXCEPTION 'idemq.emit: a header name is % bytes; AMQP allows at most 255',
              octet_length(v_name) USING ERRCODE = '22001';
    END IF;
    IF v_depth > 16 THEN
        RAISE EXCEPTION 'idemq.emit: the headers are nested more than 16 levels deep'
              USING ERRCODE = '54000';
    END IF;
END
$fn$;

-- Emits one message in the caller's transaction; returns the row id (the
-- message_id is 'outbox:<id>'). p_key: the emitting idempotency key (an
-- effect passes its key), shown by `jobs show`. Refuses what can never be
-- published (idemq.outbox_check).
CREATE OR REPLACE FUNCTION idemq.emit(p_exchange text, p_routing_key text, p_body bytea,
                                      p_headers jsonb DEFAULT NULL,
                                      p_order_key text DEFAULT NULL,
                                      p_key text DEFAULT NULL)
RETURNS bigint LANGUAGE plpgsql SECURITY DEFINER AS $fn$
DECLARE
    v_id bigint;
    v_tp text := current_setting('idemq.traceparent', true);
    v_ts text := current_setting('idemq.tracestate', true);
BEGIN
    IF p_exchange IS NULL OR p_routing_key IS NULL OR p_body IS NULL THEN
        RAISE EXCEPTION 'idemq.emit: exchange, routing_key and body are required'
              USING ERRCODE = '22004';
    END IF;
    IF p_headers IS NOT NULL AND jsonb_typeof(p_headers) <> 'object' THEN
        RAISE EXCEPTION 'idemq.emit: headers must be a JSON object' USING ERRCODE = '22023';
    END IF;
    -- The trace continues downstream: the job's trace context (set by
    -- idemq.apply_batch for the effect running now) goes into the message's
    -- headers unless the caller set a traceparent itself. Only the shape of
    -- a version-00 traceparent is copied; anything else is ignored.
    IF v_tp ~ '^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$'
       AND NOT coalesce(p_headers ? 'traceparent', false) THEN
        p_headers := coalesce(p_headers, '{}'::jsonb) || jsonb_build_object('traceparent', v_tp);
        IF v_ts <> '' AND octet_length(v_ts) <= 512 AND v_ts !~ '[^\x20-\x7e]' THEN
            p_headers := p_headers || jsonb_build_object('tracestate', v_ts);
        END IF;
    END IF;
    PERFORM idemq.outbox_check(p_exchange, p_routing_key, octet_length(p_body), p_headers);
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

-- A lease is free when it ran out, or when the session that took it is
-- gone (lease_pid, version 18: a relay that died frees its rows at once).
CREATE OR REPLACE FUNCTION idemq.outbox_lease_free(p_until timestamptz, p_pid integer)
RETURNS boolean LANGUAGE sql VOLATILE AS $fn$
    SELECT p_until IS NULL OR p_until < clock_timestamp()
           OR (p_pid IS NOT NULL AND NOT EXISTS (SELECT 1 FROM pg_stat_get_activity(p_pid)));
$fn$;

-- The rows this transaction emitted that are stored as sent (body_key
-- NULL) and not stamped yet: the worker seals their bodies with the active
-- key and hands them to idemq.outbox_take (protection.active). Nothing when
-- the transaction wrote nothing.
CREATE OR REPLACE FUNCTION idemq.outbox_unsealed()
RETURNS TABLE (r_id bigint, r_body bytea)
LANGUAGE sql SECURITY DEFINER AS $fn$
    SELECT o.id, o.body FROM idemq.outbox o
     WHERE o.xact_id = pg_current_xact_id_if_assigned() AND o.commit_seq IS NULL
       AND o.body_key IS NULL
     ORDER BY o.id;
$fn$;

-- The last statement of a worker's batch transaction that may have
-- emitted (relay right after commit: no claim transaction between the
-- commit and the publish). Stamps commit_seq on the transaction's rows
-- now, as idemq.outbox_stamp would at COMMIT, under the same order-key
-- locks (held to the end of the transaction, so commit order per key is
-- kept), and leases to p_holder, for p_lease_ms and this session, what a
-- claim could take once this commits: rows without an order key, and of
-- each order key only its head (no pending row of the key stamped before
-- it), at most p_limit, in id order. r_emitted is how many rows the
-- transaction stamped: the ones not returned wait for a claim
-- (idemq.outbox_claim). When none is leased but some were stamped, one row
-- with r_id NULL carries r_emitted.
--
-- Sealing (protection.active): p_sealed_ids[i] gets body p_sealed[i],
-- sealed by the worker with key p_body_key from what
-- idemq.outbox_unsealed returned, in the same UPDATE (one new row version);
-- only rows of this transaction still stored as sent are replaced. The
-- rows returned carry their body as stored and r_body_key.
CREATE OR REPLACE FUNCTION idemq.outbox_take(p_holder text, p_limit integer, p_lease_ms integer,
                                             p_sealed_ids bigint[] DEFAULT NULL,
                                             p_sealed bytea[] DEFAULT NULL,
                                             p_body_key text DEFAULT NULL)
RETURNS TABLE (r_id bigint, r_key text, r_exchange text, r_routing_key text, r_body bytea,
               r_headers jsonb, r_order_key text, r_message_id text, r_body_key text,
               r_emitted integer)
LANGUAGE plpgsql SECURITY DEFINER AS $fn$
DECLARE
    v_x     xid8 := pg_current_xact_id_if_assigned();
    v_until timestamptz := clock_timestamp() + p_lease_ms * interval '1 millisecond';
    v_all   integer;
    v_last  bigint;
    v_n     integer;
BEGIN
    IF v_x IS NULL THEN
        RETURN; /* the transaction wrote nothing: it emitted nothing */
    END IF;
    /* the head test below must see what committed while it waited for an
     * order key's lock: a statement snapshot, so READ COMMITTED only (at
     * REPEATABLE READ two transactions of one key could both lease a head) */
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        RAISE EXCEPTION 'idemq.outbox_take must run at READ COMMITTED (this transaction: %)',
              current_setting('transaction_isolation') USING ERRCODE = '25000';
    END IF;
    /* the order keys' locks, in key order (as idemq.outbox_stamp) */
    PERFORM pg_advisory_xact_lock(hashtextextended('idemq.outbox:' || k.order_key, 0))
       FROM (SELECT DISTINCT o.order_key FROM idemq.outbox o
              WHERE o.xact_id = v_x AND o.commit_seq IS NULL AND o.order_key IS NOT NULL
              ORDER BY 1) k;
    /* one UPDATE stamps every row and leases the heads: a row without an
     * order key, or the first of its key in this transaction when no
     * committed row of the key is pending; up to p_limit of them */
    SELECT count(*), max(o.id) INTO v_all, v_last FROM idemq.outbox o
     WHERE o.xact_id = v_x AND o.commit_seq IS NULL;
    IF v_all = 0 THEN
        RETURN;
    END IF;
    PERFORM set_config('idemq.outbox_stamped', v_x::text || ':' || v_last::text, true);
    RETURN QUERY
    WITH u AS (
        SELECT o.id, o.order_key,
               row_number() OVER (PARTITION BY o.order_key ORDER BY o.id) AS nth
          FROM idemq.outbox o
         WHERE o.xact_id = v_x AND o.commit_seq IS NULL AND o.id <= v_last),
    h AS (
        SELECT u.id,
               (u.order_key IS NULL
                OR (u.nth = 1 AND NOT EXISTS (
                        SELECT 1 FROM idemq.outbox p
                         WHERE p.order_key = u.order_key AND p.state = 'pending'
                           AND p.commit_seq IS NOT NULL))) AS head
          FROM u),
    n AS (
        SELECT h.id, nextval('idemq.outbox_commit_seq') AS seq,
               h.head AND sum(h.head::integer) OVER (ORDER BY h.id) <= p_limit AS leased,
               s.body AS sealed
          FROM (SELECT * FROM h ORDER BY h.id) h
          LEFT JOIN unnest(p_sealed_ids, p_sealed) AS s(id, body)
                 ON s.id = h.id AND p_body_key IS NOT NULL AND s.body IS NOT NULL),
    w AS (
        UPDATE idemq.outbox o
           SET commit_seq = n.seq,
               lease_holder = CASE WHEN n.leased THEN p_holder ELSE o.lease_holder END,
               lease_until = CASE WHEN n.leased THEN v_until ELSE o.lease_until END,
               lease_pid = CASE WHEN n.leased THEN pg_backend_pid() ELSE o.lease_pid END,
               body = CASE WHEN n.sealed IS NOT NULL AND o.body_key IS NULL THEN n.sealed
                           ELSE o.body END,
               body_key = CASE WHEN n.sealed IS NOT NULL AND o.body_key IS NULL THEN p_body_key
                               ELSE o.body_key END
          FROM n WHERE o.id = n.id AND o.id <= v_last
        RETURNING o.id, o.key, o.exchange, o.routing_key, o.body, o.headers, o.order_key,
                  o.message_id, o.body_key, n.leased)
    SELECT w.id, w.key, w.exchange, w.routing_key, w.body, w.headers, w.order_key,
           w.message_id, w.body_key, v_all FROM w WHERE w.leased ORDER BY w.id;
    GET DIAGNOSTICS v_n = ROW_COUNT;
    IF v_n = 0 THEN
        r_emitted := v_all;
        RETURN NEXT;
    END IF;
END
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
               r_created_at timestamptz, r_body_key text)
LANGUAGE sql SECURITY DEFINER AS $fn$
    WITH heads AS (
        SELECT DISTINCT ON (o.order_key) o.id, o.lease_until, o.lease_pid
          FROM idemq.outbox o
         WHERE o.state = 'pending' AND o.order_key IS NOT NULL
         ORDER BY o.order_key, o.commit_seq),
    cand AS (
        SELECT h.id FROM heads h
         WHERE idemq.outbox_lease_free(h.lease_until, h.lease_pid)
        UNION ALL
        (SELECT o.id FROM idemq.outbox o
          WHERE o.state = 'pending' AND o.order_key IS NULL
            AND idemq.outbox_lease_free(o.lease_until, o.lease_pid)
          ORDER BY o.id LIMIT p_limit)),
    locked AS (
        SELECT o.id FROM idemq.outbox o
         WHERE o.id IN (SELECT c.id FROM cand c) AND o.state = 'pending'
           AND idemq.outbox_lease_free(o.lease_until, o.lease_pid)
         ORDER BY o.id LIMIT p_limit
         FOR UPDATE SKIP LOCKED)
    UPDATE idemq.outbox o
       SET lease_holder = p_holder,
           lease_until = clock_timestamp() + p_lease_ms * interval '1 millisecond',
           lease_pid = pg_backend_pid()
      FROM locked l
     WHERE o.id = l.id
    RETURNING o.id, o.key, o.exchange, o.routing_key, o.body, o.headers, o.order_key,
              o.message_id, o.attempts, o.created_at, o.body_key;
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
                                       last_error, body_key)
        SELECT m.id, m.key, m.exchange, m.routing_key, m.body, m.headers, m.order_key,
               m.message_id, m.created_at, m.commit_seq, m.attempts + 1, clock_timestamp(),
               m.last_error, m.body_key
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
                AND p.proname IN ('emit', 'outbox_check', 'outbox_claim', 'outbox_take', 'outbox_sent',
                                  'outbox_unsealed',
                                  'outbox_failed', 'outbox_lease_free',
                                  'outbox_release', 'outbox_gauges', 'outbox_stamp')
    LOOP
        EXECUTE format('REVOKE EXECUTE ON FUNCTION %s FROM PUBLIC', f);
    END LOOP;
END
$outbox_privileges$;
