-- The chaos run's effect and its invariant checker (scripts/chaos). Loaded
-- into the run's own database after `idemq migrate`; safe to load again.
--
--   idemq_chaos.apply     the effect: one row in idemq_chaos.effects per
--                         committed call (no unique constraint, so a second
--                         application of a key shows as a second row)
--   idemq_chaos.manifest  what was published (scripts/chaos_tool.c writes it;
--                         \copy loads it): key, kind, confirmed copies
--   idemq_chaos.check(max_attempts)  one row per invariant: name, expected,
--                         actual, ok and an example key when it fails
--   idemq_chaos.pending() how many published jobs are not settled yet
--   idemq_chaos.record_payout  the provider input's local effect: one row in
--                         idemq_chaos.payouts per committed call (no unique
--                         constraint either)
--   idemq_chaos.pay_manifest   the provider input's published keys
--   idemq_chaos.charges   charges per provider key as the test provider
--                         counts them (GET /_stats?key=K), loaded at the end
--   idemq_chaos.check_provider(total_charges)  the provider invariants, in
--                         the same shape as check()
-- The checker reads only idemq.jobs, idemq.attempts, idemq.parked and the
-- tables above, so any test that loads a manifest can reuse it.
CREATE SCHEMA IF NOT EXISTS idemq_chaos;

CREATE TABLE IF NOT EXISTS idemq_chaos.effects (
    id         bigserial PRIMARY KEY,
    key        text NOT NULL,
    attempt    integer NOT NULL,
    created_at timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX IF NOT EXISTS effects_key_idx ON idemq_chaos.effects (key);

CREATE TABLE IF NOT EXISTS idemq_chaos.manifest (
    key        text PRIMARY KEY,  -- the business key; for badjson the whole body
    kind       text NOT NULL CHECK (kind IN ('normal', 'transient', 'poison', 'badjson')),
    copies     integer NOT NULL,  -- confirmed publishes of it
    fail_until integer NOT NULL DEFAULT 0
);

CREATE TABLE IF NOT EXISTS idemq_chaos.pay_manifest (
    key    text PRIMARY KEY,
    copies integer NOT NULL
);

CREATE TABLE IF NOT EXISTS idemq_chaos.payouts (
    id         bigserial PRIMARY KEY,
    key        text NOT NULL,
    reference  text,
    created_at timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX IF NOT EXISTS payouts_key_idx ON idemq_chaos.payouts (key);

CREATE TABLE IF NOT EXISTS idemq_chaos.charges (
    key     text PRIMARY KEY,
    charges integer NOT NULL
);

-- The provider input's effect: runs after the provider confirmed, in the
-- transaction that marks the job applied.
CREATE OR REPLACE FUNCTION idemq_chaos.record_payout(p_key text, p_payload jsonb, p_meta jsonb)
RETURNS jsonb LANGUAGE plpgsql
SET search_path = pg_catalog, idemq_chaos AS $fn$
BEGIN
    INSERT INTO idemq_chaos.payouts (key, reference)
    VALUES (p_key, p_meta->'provider'->>'reference');
    RETURN jsonb_build_object('reference', p_meta->'provider'->>'reference');
END
$fn$;

-- payload.poison: a permanent error (22023, parked at once);
-- payload.fail_until = n: IR001 (retry) while meta.attempt <= n.
CREATE OR REPLACE FUNCTION idemq_chaos.apply(p_key text, p_payload jsonb, p_meta jsonb)
RETURNS jsonb LANGUAGE plpgsql
SET search_path = pg_catalog, idemq_chaos AS $fn$
BEGIN
    IF p_payload ? 'poison' THEN
        RAISE EXCEPTION 'chaos: poison job %', p_key USING ERRCODE = '22023';
    END IF;
    IF p_payload ? 'fail_until'
       AND (p_meta->>'attempt')::integer <= (p_payload->>'fail_until')::integer THEN
        RAISE EXCEPTION 'chaos: transient failure of % on attempt %', p_key, p_meta->>'attempt'
              USING ERRCODE = 'IR001';
    END IF;
    INSERT INTO idemq_chaos.effects (key, attempt) VALUES (p_key, (p_meta->>'attempt')::integer);
    RETURN jsonb_build_object('attempt', p_meta->'attempt');
END
$fn$;

-- Published jobs not settled yet: keyed jobs not applied/parked, bad bodies
-- without a park row.
CREATE OR REPLACE FUNCTION idemq_chaos.pending()
RETURNS bigint LANGUAGE sql STABLE
SET search_path = pg_catalog, idemq_chaos AS $fn$
    SELECT (SELECT count(*) FROM idemq_chaos.manifest m
              LEFT JOIN idemq.jobs j ON j.key = m.key
             WHERE m.kind <> 'badjson' AND j.state IS DISTINCT FROM 'applied'
               AND j.state IS DISTINCT FROM 'parked')
         + (SELECT count(*) FROM idemq_chaos.manifest m
             WHERE m.kind = 'badjson'
               AND NOT EXISTS (SELECT 1 FROM idemq.parked p
                                WHERE p.key IS NULL AND p.error_code = 'bad_json'
                                  AND p.payload_sha256 = encode(sha256(convert_to(m.key, 'UTF8')), 'hex')))
         + (SELECT count(*) FROM idemq_chaos.pay_manifest m
              LEFT JOIN idemq.jobs j ON j.key = m.key
             WHERE j.state IS DISTINCT FROM 'applied' AND j.state IS DISTINCT FROM 'parked');
$fn$;

CREATE OR REPLACE FUNCTION idemq_chaos.check(p_max_attempts integer)
RETURNS TABLE (invariant text, expected bigint, actual bigint, ok boolean, example text)
LANGUAGE plpgsql
SET search_path = pg_catalog, idemq_chaos AS $fn$
BEGIN
    CREATE TEMP TABLE IF NOT EXISTS chaos_eff ON COMMIT DROP AS
        SELECT e.key, count(*) AS n FROM idemq_chaos.effects e GROUP BY e.key;
    -- Attempt history per key: outcomes that use an attempt number.
    CREATE TEMP TABLE IF NOT EXISTS chaos_att ON COMMIT DROP AS
        SELECT a.key, a.generation, count(*) AS n, count(DISTINCT a.attempt) AS nd,
               min(a.attempt) AS lo, max(a.attempt) AS hi,
               count(*) FILTER (WHERE a.outcome = 'applied') AS applied,
               max(a.attempt) FILTER (WHERE a.outcome = 'applied') AS applied_at
          FROM idemq.attempts a
         WHERE a.outcome IN ('applied', 'transient_error', 'permanent_error')
           AND NOT EXISTS (SELECT 1 FROM idemq_chaos.pay_manifest pm WHERE pm.key = a.key)
         GROUP BY a.key, a.generation;

    -- 1. every normal and transient key: one effect row, job applied
    RETURN QUERY
    SELECT 'applied once'::text, count(*),
           count(*) FILTER (WHERE e.n = 1 AND j.state = 'applied'),
           count(*) = count(*) FILTER (WHERE e.n = 1 AND j.state = 'applied'),
           min(m.key) FILTER (WHERE e.n IS DISTINCT FROM 1 OR j.state IS DISTINCT FROM 'applied')
      FROM idemq_chaos.manifest m
      LEFT JOIN chaos_eff e ON e.key = m.key LEFT JOIN idemq.jobs j ON j.key = m.key
     WHERE m.kind IN ('normal', 'transient');
    -- 2. lost: a normal or transient key without an effect
    RETURN QUERY
    SELECT 'lost', 0::bigint, count(*), count(*) = 0, min(m.key)
      FROM idemq_chaos.manifest m LEFT JOIN chaos_eff e ON e.key = m.key
     WHERE m.kind IN ('normal', 'transient') AND e.key IS NULL;
    -- 3. double: any key applied more than once
    RETURN QUERY
    SELECT 'double', 0::bigint, count(*), count(*) = 0, min(e.key)
      FROM chaos_eff e WHERE e.n > 1;
    -- 4. effects of keys never published, or of poison keys
    RETURN QUERY
    SELECT 'stray effects', 0::bigint, count(*), count(*) = 0, min(e.key)
      FROM chaos_eff e LEFT JOIN idemq_chaos.manifest m ON m.key = e.key
     WHERE m.key IS NULL OR m.kind <> 'normal' AND m.kind <> 'transient';
    -- 5. parked = poison keys (job parked, a park row) + bad bodies (a park
    --    row per distinct body); and nothing else parked
    RETURN QUERY
    SELECT 'parked', x.e, x.a, x.e = x.a, NULL::text
      FROM (SELECT (SELECT count(*) FROM idemq_chaos.manifest m2
                     WHERE m2.kind IN ('poison', 'badjson')) AS e,
                   (SELECT count(*) FROM idemq_chaos.manifest m
                      JOIN idemq.jobs j ON j.key = m.key
                     WHERE m.kind = 'poison' AND j.state = 'parked'
                       AND EXISTS (SELECT 1 FROM idemq.parked p WHERE p.key = m.key))
                 + (SELECT count(DISTINCT p.payload_sha256) FROM idemq.parked p
                      JOIN idemq_chaos.manifest m
                        ON p.payload_sha256 = encode(sha256(convert_to(m.key, 'UTF8')), 'hex')
                     WHERE m.kind = 'badjson' AND p.key IS NULL
                       AND p.error_code = 'bad_json') AS a) x;
    RETURN QUERY
    SELECT 'parked by mistake', 0::bigint, count(*), count(*) = 0, min(j.key)
      FROM idemq.jobs j LEFT JOIN idemq_chaos.manifest m ON m.key = j.key
     WHERE j.state = 'parked' AND m.kind IS DISTINCT FROM 'poison';
    RETURN QUERY
    SELECT 'park rows of unknown messages', 0::bigint, count(*), count(*) = 0,
           min(coalesce(p.key, p.payload_sha256))
      FROM idemq.parked p
     WHERE NOT EXISTS (SELECT 1 FROM idemq_chaos.manifest m
                        WHERE (p.key IS NOT NULL AND m.key = p.key AND m.kind = 'poison')
                           OR (p.key IS NULL AND m.kind = 'badjson' AND p.payload_sha256 =
                               encode(sha256(convert_to(m.key, 'UTF8')), 'hex')));
    -- 6. every transient key applied, after exactly fail_until failed attempts
    --    at least (it cannot have succeeded earlier)
    RETURN QUERY
    SELECT 'transient applied', count(*),
           count(*) FILTER (WHERE j.state = 'applied' AND a.applied_at > m.fail_until),
           count(*) = count(*) FILTER (WHERE j.state = 'applied' AND a.applied_at > m.fail_until),
           min(m.key) FILTER (WHERE j.state IS DISTINCT FROM 'applied'
                               OR a.applied_at IS NULL OR a.applied_at <= m.fail_until)
      FROM idemq_chaos.manifest m
      LEFT JOIN idemq.jobs j ON j.key = m.key
      LEFT JOIN chaos_att a ON a.key = m.key AND a.generation = j.generation
     WHERE m.kind = 'transient';
    -- 7. attempt history: per key and generation the numbers of applied and
    --    error outcomes are distinct and contiguous, the first generation
    --    starts at 1, at most max_attempts of them, at most one applied and
    --    it is the last; the job row holds the highest number
    RETURN QUERY
    SELECT 'attempts contiguous', 0::bigint, count(*), count(*) = 0,
           min(a.key || ' gen ' || a.generation || ': attempts ' || a.lo || '..' || a.hi
               || ' (' || a.n || ' rows, ' || a.nd || ' distinct)')
      FROM chaos_att a
     WHERE a.n <> a.nd OR a.hi - a.lo + 1 <> a.n OR (a.generation = 0 AND a.lo <> 1);
    RETURN QUERY
    SELECT 'attempts within ceiling', 0::bigint, count(*), count(*) = 0,
           min(a.key || ': ' || a.n || ' attempts')
      FROM chaos_att a WHERE a.n > p_max_attempts;
    RETURN QUERY
    SELECT 'applied attempt is the last, once', 0::bigint, count(*), count(*) = 0, min(a.key)
      FROM chaos_att a
     WHERE a.applied > 1 OR (a.applied = 1 AND a.applied_at <> a.hi);
    RETURN QUERY
    SELECT 'job row matches its history', 0::bigint, count(*), count(*) = 0, min(j.key)
      FROM idemq.jobs j
      JOIN (SELECT x.key, max(x.hi) AS hi FROM chaos_att x GROUP BY x.key) a ON a.key = j.key
     WHERE j.attempts <> a.hi;
    -- 8. nothing left half-done in the ledger
    RETURN QUERY
    SELECT 'jobs settled', 0::bigint, count(*), count(*) = 0, min(j.key || ' ' || j.state)
      FROM idemq.jobs j WHERE j.state NOT IN ('applied', 'parked');
    RETURN QUERY
    SELECT 'published jobs settled', 0::bigint, idemq_chaos.pending(),
           idemq_chaos.pending() = 0, NULL::text;
    DROP TABLE chaos_eff;
    DROP TABLE chaos_att;
END
$fn$;

-- The provider input's invariants, one row each like check(): every key
-- published to it charged exactly once at the provider (none lost, none
-- charged twice, no charge of an unknown key: p_total_charges is the
-- provider's count of all charges), its job applied with one payout row
-- whose reference is the job's, nothing of it parked.
CREATE OR REPLACE FUNCTION idemq_chaos.check_provider(p_total_charges bigint)
RETURNS TABLE (invariant text, expected bigint, actual bigint, ok boolean, example text)
LANGUAGE plpgsql
SET search_path = pg_catalog, idemq_chaos AS $fn$
BEGIN
    RETURN QUERY
    SELECT 'provider charged once'::text, count(*), count(*) FILTER (WHERE c.charges = 1),
           count(*) = count(*) FILTER (WHERE c.charges = 1),
           min(m.key || ': ' || coalesce(c.charges::text, 'not counted') || ' charges')
               FILTER (WHERE c.charges IS DISTINCT FROM 1)
      FROM idemq_chaos.pay_manifest m LEFT JOIN idemq_chaos.charges c ON c.key = m.key;
    RETURN QUERY
    SELECT 'double charges', 0::bigint, count(*), count(*) = 0, min(c.key)
      FROM idemq_chaos.charges c WHERE c.charges > 1;
    RETURN QUERY
    SELECT 'provider lost', 0::bigint, count(*), count(*) = 0, min(m.key)
      FROM idemq_chaos.pay_manifest m LEFT JOIN idemq_chaos.charges c ON c.key = m.key
     WHERE coalesce(c.charges, 0) = 0;
    RETURN QUERY
    SELECT 'provider charges in all', (SELECT count(*) FROM idemq_chaos.pay_manifest),
           p_total_charges, p_total_charges = (SELECT count(*) FROM idemq_chaos.pay_manifest),
           NULL::text;
    RETURN QUERY
    SELECT 'payout recorded once', count(*),
           count(*) FILTER (WHERE x.n = 1 AND j.state = 'applied'),
           count(*) = count(*) FILTER (WHERE x.n = 1 AND j.state = 'applied'),
           min(m.key || ' (' || coalesce(x.n, 0) || ' rows, job ' || coalesce(j.state, 'none')
               || ')') FILTER (WHERE x.n IS DISTINCT FROM 1 OR j.state IS DISTINCT FROM 'applied')
      FROM idemq_chaos.pay_manifest m
      LEFT JOIN (SELECT p.key, count(*) AS n FROM idemq_chaos.payouts p GROUP BY p.key) x
        ON x.key = m.key
      LEFT JOIN idemq.jobs j ON j.key = m.key;
    RETURN QUERY
    SELECT 'payout reference is the intent''s', 0::bigint, count(*), count(*) = 0, min(p.key)
      FROM idemq_chaos.payouts p JOIN idemq.intents i ON i.key = p.key
     WHERE p.reference IS DISTINCT FROM i.provider_ref;
    RETURN QUERY
    SELECT 'stray payouts', 0::bigint, count(*), count(*) = 0, min(p.key)
      FROM idemq_chaos.payouts p
     WHERE NOT EXISTS (SELECT 1 FROM idemq_chaos.pay_manifest m WHERE m.key = p.key);
    RETURN QUERY
    SELECT 'provider parked', 0::bigint, count(*), count(*) = 0, min(m.key || ' ' || j.state)
      FROM idemq_chaos.pay_manifest m JOIN idemq.jobs j ON j.key = m.key
     WHERE j.state <> 'applied';
END
$fn$;
