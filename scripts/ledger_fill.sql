-- scripts/ledger_fill.sql: the pre-fill of scripts/ledger-fill.
-- Loaded into a migrated ledger; writes, with generated SQL and no broker,
-- the rows idemq itself would have written for N settled keys spread over
-- the past days, in chunks of its own transactions (a procedure that
-- commits after each chunk: never one huge transaction, and a run that is
-- stopped keeps what it committed):
--   * key i (0-based) is `payout:inv-<i>`: a plain applied job of the
--     set-based path, as ledger/ledger_plain.c writes it: an idemq.jobs row
--     (state applied, attempt 1, first_seen_at = applied_at = its batch's
--     time, batch_id, the first 8 bytes of its digest in sha256_head) and
--     its place in one idemq.batches row per 100 keys
--     (keys, the 32-byte SHA-256 of its body, one delivery meta, the
--     demo effect's result, applied, no dups). Its body is
--     idemq_fill.body(i), what `idemq-bench publish --old-keys` sends for a
--     copy of it, so a copy is an ordinary duplicate (same digest), not a
--     reused key.
--   * one key in 20 (i % 20 = 7) had a copy delivered a second later: an
--     idemq.attempts row, outcome duplicate, as the plain path writes it.
--   * one key in 10,000 (i % 10000 = 9999) also has a parked sibling,
--     `payout:bad-<i>` (state parked, a permanent_error attempt row and an
--     open idemq.parked row with its 200-byte body), the share of parks.
-- Times run linearly over [lo, hi) by key index out of nmax (the largest
-- size the caller will fill to), so a ledger grown in steps (0, 1 M,
-- 10 M, ...) ends up with the same spread as one filled at once; the
-- history partitions of [lo, hi) (one per ledger.partition_interval) are
-- made first by idemq.create_partition, attached, registered in
-- idemq.history_parts like the ones idemq.maintain makes, so nothing lands
-- in a default partition. batch ids are reserved from idemq.batches_id_seq
-- once (nmax / 100 of them).
SET client_min_messages = warning;
CREATE SCHEMA IF NOT EXISTS idemq_fill;
CREATE TABLE IF NOT EXISTS idemq_fill.state (
    id     integer PRIMARY KEY CHECK (id = 1),
    filled bigint NOT NULL,      -- keys 0 .. filled-1 are in the ledger
    nmax   bigint NOT NULL,      -- the time spread's denominator
    lo     timestamptz NOT NULL, -- the spread: [lo, hi)
    hi     timestamptz NOT NULL,
    bid0   bigint NOT NULL       -- batch id of keys 0..99; key i is in bid0 + i / 100
);

-- The body of pre-filled key i (and of a copy of it published by
-- `idemq-bench publish --old-keys`; scripts/bench_tool.c old_body).
CREATE OR REPLACE FUNCTION idemq_fill.body(i bigint) RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT '{"job_id":"payout:inv-' || i || '","account_id":"acct-'
             || lpad((i % 9973)::text, 4, '0') || '","amount_minor":' || (100 + i % 100000)
             || ',"currency":"EUR"}' $$;

-- Prepares the spread on the first call (p_nmax keys over the p_days days
-- before the start of today's partition slot), makes the partitions.
CREATE OR REPLACE PROCEDURE idemq_fill.prepare(p_nmax bigint, p_days integer)
LANGUAGE plpgsql
AS $fn$
DECLARE
    v_step double precision;
    v_hi   timestamptz;
    v_t    timestamptz;
    v_kind text;
BEGIN
    IF EXISTS (SELECT 1 FROM idemq_fill.state) THEN
        RETURN;
    END IF;
    IF p_nmax < 100 OR p_nmax % 100 <> 0 OR p_days < 1 THEN
        RAISE EXCEPTION 'ledger fill: nmax must be a positive multiple of 100, days >= 1';
    END IF;
    SELECT extract(epoch FROM r.partition_interval) INTO STRICT v_step
      FROM idemq.retention r WHERE r.id = 1;
    v_hi := idemq.align_time(clock_timestamp(), v_step);
    -- the slots of [hi - days, hi) that no partition covers yet
    FOREACH v_kind IN ARRAY ARRAY['batches', 'attempts'] LOOP
        v_t := v_hi - make_interval(days => p_days);
        WHILE v_t < v_hi LOOP
            IF NOT EXISTS (SELECT 1 FROM idemq.history_parts h
                            WHERE h.kind = v_kind AND h.attached AND h.lo < v_t + make_interval(secs => v_step)
                              AND h.hi > v_t) THEN
                PERFORM idemq.create_partition(v_kind, v_t, v_t + make_interval(secs => v_step), true);
            END IF;
            v_t := v_t + make_interval(secs => v_step);
        END LOOP;
    END LOOP;
    INSERT INTO idemq_fill.state (id, filled, nmax, lo, hi, bid0)
    VALUES (1, 0, p_nmax, v_hi - make_interval(days => p_days), v_hi - interval '1 minute',
            nextval('idemq.batches_id_seq'));
    PERFORM setval('idemq.batches_id_seq', currval('idemq.batches_id_seq') + p_nmax / 100);
    COMMIT;
END
$fn$;

-- Fills keys filled .. p_to - 1, p_chunk keys per transaction.
CREATE OR REPLACE PROCEDURE idemq_fill.fill(p_to bigint, p_chunk bigint DEFAULT 500000)
LANGUAGE plpgsql
AS $fn$
DECLARE
    s    idemq_fill.state;
    v_lo bigint;
    v_hi bigint;
    v_t0 timestamptz := clock_timestamp();
BEGIN
    SELECT * INTO STRICT s FROM idemq_fill.state WHERE id = 1;
    IF p_to > s.nmax OR p_to % 100 <> 0 THEN
        RAISE EXCEPTION 'ledger fill: % keys: a multiple of 100, at most %', p_to, s.nmax;
    END IF;
    p_chunk := greatest(p_chunk / 100 * 100, 100);
    v_lo := s.filled;
    WHILE v_lo < p_to LOOP
        v_hi := least(v_lo + p_chunk, p_to);
        -- the applied keys and their batch rows
        WITH k AS MATERIALIZED (
            SELECT i, 'payout:inv-' || i AS key, s.bid0 + i / 100 AS bid,
                   s.lo + (s.hi - s.lo) * ((i / 100 * 100)::double precision / s.nmax) AS at,
                   sha256(convert_to(idemq_fill.body(i), 'UTF8')) AS sha
              FROM generate_series(v_lo, v_hi - 1) AS i
        ), j AS (
            INSERT INTO idemq.jobs (key, state, attempts, first_seen_at, applied_at, batch_id,
                                    sha256_head)
            SELECT k.key, 'applied', 1, k.at, k.at, k.bid, substring(k.sha FOR 8)
              FROM k ORDER BY k.key
        )
        INSERT INTO idemq.batches (id, at, finished_at, consumer_id, keys, sha256, metas,
                                   meta_idx, results, applied, dups)
        SELECT k.bid, k.at, k.at + interval '15 milliseconds', 'bench',
               array_agg(k.key ORDER BY k.i),
               string_agg(k.sha, ''::bytea ORDER BY k.i),
               ARRAY['{"queue": "idemq.bench.classic", "attempt": 1, "headers": {}, '
                     '"exchange": "idemq.bench", "generation": 0, "redelivered": false, '
                     '"routing_key": "bench.classic"}'::jsonb],
               array_agg(1 ORDER BY k.i),
               array_agg(jsonb_build_object('attempt', 1, 'intent_id', k.i + 1,
                                            'account_id', 'acct-' || lpad((k.i % 9973)::text, 4, '0'),
                                            'amount_minor', 100 + k.i % 100000) ORDER BY k.i),
               array_agg(true ORDER BY k.i), '{}'::integer[]
          FROM k GROUP BY k.bid, k.at;
        -- a copy of one key in 20, a second later
        INSERT INTO idemq.attempts (key, attempt, generation, outcome, started_at, finished_at,
                                    queue, routing_key, redelivered, consumer_id, message)
        SELECT 'payout:inv-' || i, 1, 0, 'duplicate', t + interval '1 second',
               t + interval '1015 milliseconds', 'idemq.bench.classic', 'bench.classic', false,
               'bench', 'applied'
          FROM generate_series(v_lo + (27 - v_lo % 20) % 20, v_hi - 1, 20) AS i,
               LATERAL (SELECT s.lo + (s.hi - s.lo) * ((i / 100 * 100)::double precision / s.nmax)) AS x(t);
        -- one park in 10,000: its job row, its attempt, the open park
        WITH p AS MATERIALIZED (
            SELECT i, 'payout:bad-' || i AS key,
                   s.lo + (s.hi - s.lo) * ((i / 100 * 100)::double precision / s.nmax) AS t,
                   convert_to(rpad('{"job_id":"payout:bad-' || i || '","amount_minor":' || (100 + i % 100000)
                                   || ',"currency":"EUR","memo":"', 198, 'x') || '"}', 'UTF8') AS body
              FROM generate_series(v_lo + (19999 - v_lo % 10000) % 10000, v_hi - 1, 10000) AS i
        ), j AS (
            INSERT INTO idemq.jobs (key, state, source_queue, payload_sha256, attempts, first_seen_at,
                                    last_attempt_at, last_error_class, last_sqlstate, last_error)
            SELECT p.key, 'parked', 'idemq.bench.classic', encode(sha256(p.body), 'hex'), 1, p.t, p.t,
                   'permanent', '22023', 'payout ' || p.key || ' has no account_id'
              FROM p
        ), a AS (
            INSERT INTO idemq.attempts (key, attempt, generation, outcome, started_at, finished_at,
                                        error_class, error_code, sqlstate, message, queue,
                                        routing_key, redelivered, consumer_id)
            SELECT p.key, 1, 0, 'permanent_error', p.t, p.t + interval '2 milliseconds',
                   'permanent', 'effect_error', '22023', 'payout ' || p.key || ' has no account_id',
                   'idemq.bench.classic', 'bench.classic', false, 'bench'
              FROM p
            RETURNING id, key
        )
        INSERT INTO idemq.parked (key, source_queue, exchange, routing_key, body, headers, properties,
                                  payload_sha256, error_class, error_code, sqlstate, reason, attempts,
                                  first_attempt_at, last_attempt_at, parked_at, consumer_id,
                                  attempt_ids, body_size)
        SELECT p.key, 'idemq.bench.classic', 'idemq.bench', 'bench.classic', p.body, '{}',
               '{"content_type": "application/json", "delivery_mode": 2}', encode(sha256(p.body), 'hex'),
               'permanent', 'effect_error', '22023', 'payout ' || p.key || ' has no account_id', 1,
               p.t, p.t, p.t + interval '3 milliseconds', 'bench', ARRAY[a.id], octet_length(p.body)
          FROM p JOIN a ON a.key = p.key;
        UPDATE idemq_fill.state SET filled = v_hi WHERE id = 1;
        COMMIT;
        RAISE NOTICE 'ledger fill: % keys (% s)', v_hi,
            round(extract(epoch FROM clock_timestamp() - v_t0)::numeric, 1);
        v_lo := v_hi;
    END LOOP;
END
$fn$;
