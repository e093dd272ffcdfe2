-- idemq ledger functions, part 2: the optimistic set-based batch apply.
-- Applied together with functions.sql as one text by every `idemq migrate`
-- (see ledger/embed_sql.cmake); the same rules hold (CREATE OR REPLACE, a
-- result type change needs a DROP FUNCTION IF EXISTS first).

-- Applies a batch like idemq.apply_batch (same arguments, same result rows,
-- same ledger rows), optimistically: a handful of set-based statements for
-- the whole batch inside ONE subtransaction, instead of a subtransaction and
-- several statements per job. It handles the plain cases itself:
--   * a new key: claimed (one INSERT ... ON CONFLICT DO NOTHING for every
--     distinct key of the batch, in key order, so concurrent claimers wait on
--     keys in the same order) and applied, attempt 1;
--   * a key already applied: a duplicate (no effect);
--   * a later copy of a key applied earlier in the same batch: a duplicate.
-- The effects run in delivery order, one dynamic statement per run of
-- consecutive jobs of the same input (not one per job); then one UPDATE
-- settles the applied jobs and one INSERT writes every attempt row.
-- Anything else, a key in another state (retrying, parked, ...) or any error
-- (an effect raising, a deadlock), rolls the subtransaction back and the
-- batch is applied again by idemq.apply_batch, which isolates each job in
-- its own subtransaction and owns every non-plain case. So one bad job costs
-- its batch-mates one extra round inside this same call, never their
-- commit. QUERY_CANCELED (statement timeout) is not caught (WHEN OTHERS
-- excludes it): the whole call fails, as with idemq.apply_batch.
-- Its result columns must stay those of idemq.apply_batch: the fallback
-- returns that function's rows as they are.
-- It never sees ordered-lane jobs: the worker sends those to idemq.apply_batch.
DROP FUNCTION IF EXISTS idemq.apply_batch_fast(text[], jsonb, text);
CREATE OR REPLACE FUNCTION idemq.apply_batch_fast(p_effects text[], p_jobs jsonb, p_consumer text)
RETURNS TABLE (r_idx integer, r_outcome text, r_attempt integer, r_base integer,
               r_sqlstate text, r_message text, r_started timestamptz,
               r_finished timestamptz, r_delay_ms integer, r_park jsonb)
LANGUAGE plpgsql AS $fn$
DECLARE
    v_start     timestamptz := clock_timestamp();
    v_keys      text[];    -- by ordinal (1-based delivery order)
    v_inputs    integer[];
    v_claimed   text[];
    v_unclaimed text[];
    v_seen      jsonb := '{}'; -- unclaimed key -> attempts of its applied row
    v_gens      jsonb := '{}'; -- unclaimed key -> generation of its applied row
    v_other     bigint;
    v_plan      text[];    -- by ordinal: 'apply', 'dup' (copy in batch), 'applied' (before)
    v_att       integer[]; -- by ordinal: attempt number recorded
    v_app_o     integer[] := '{}'; -- the applied jobs in order: ordinal, result, finish
    v_app_r     jsonb[] := '{}';
    v_app_t     timestamptz[] := '{}';
    v_run_o     integer[];
    v_run_r     jsonb[];
    v_run_t     timestamptz[];
    v_call      text;
    v_lo        integer;
    v_hi        integer;
    v_dup_t     timestamptz;
    n           integer;
BEGIN
    BEGIN
        -- 1. Claim every distinct key of the batch, in key order.
        WITH b AS (
            SELECT x.k, x.i, x.q, x.h, x.o
              FROM ROWS FROM (jsonb_to_recordset(p_jobs) AS (k text, i integer, q text, h text))
                   WITH ORDINALITY AS x(k, i, q, h, o)
        ), ins AS (
            INSERT INTO idemq.jobs AS t (key, state, source_queue, payload_sha256, first_seen_at)
            SELECT DISTINCT ON (b.k) b.k, 'pending', b.q, b.h, v_start FROM b ORDER BY b.k, b.o
            ON CONFLICT (key) DO NOTHING
            RETURNING t.key
        )
        SELECT (SELECT array_agg(b.k ORDER BY b.o) FROM b),
               (SELECT array_agg(b.i ORDER BY b.o) FROM b),
               (SELECT coalesce(array_agg(ins.key), '{}') FROM ins)
          INTO v_keys, v_inputs, v_claimed;
        n := coalesce(array_length(v_keys, 1), 0);

        -- 2. A key not claimed now exists already: a plain duplicate if it
        --    is applied; any other state is left to idemq.apply_batch.
        v_unclaimed := ARRAY(SELECT unnest(v_keys) EXCEPT SELECT unnest(v_claimed));
        IF cardinality(v_unclaimed) > 0 THEN
            SELECT coalesce(jsonb_object_agg(t.key, t.attempts)
                              FILTER (WHERE t.state = 'applied'), '{}'),
                   coalesce(jsonb_object_agg(t.key, t.generation)
                              FILTER (WHERE t.state = 'applied'), '{}'),
                   count(*) FILTER (WHERE t.state <> 'applied')
              INTO v_seen, v_gens, v_other
              FROM idemq.jobs t WHERE t.key = ANY (v_unclaimed);
            IF v_other > 0 THEN
                RAISE EXCEPTION 'idemq: batch holds a key that is neither new nor applied';
            END IF;
        END IF;

        -- 3. Plan each job: the first copy of a claimed key is applied
        --    (attempt 1), every other copy is a duplicate.
        SELECT array_agg(CASE WHEN v_seen ? u.k THEN 'applied'
                              WHEN u.first THEN 'apply' ELSE 'dup' END ORDER BY u.o),
               array_agg(coalesce((v_seen->>u.k)::integer, 1) ORDER BY u.o)
          INTO v_plan, v_att
          FROM (SELECT k.k, k.o, row_number() OVER (PARTITION BY k.k ORDER BY k.o) = 1 AS first
                  FROM unnest(v_keys) WITH ORDINALITY AS k(k, o)) u;

        -- 4. Run the effects in delivery order: one statement per run of
        --    consecutive jobs of one input, the function resolved through
        --    regprocedure as in idemq.apply_batch. The target list (the
        --    effect call) is evaluated row by row in ORDER BY order.
        v_lo := 1;
        WHILE v_lo <= n LOOP
            v_hi := v_lo;
            WHILE v_hi < n AND v_inputs[v_hi + 1] = v_inputs[v_lo] LOOP
                v_hi := v_hi + 1;
            END LOOP;
            IF 'apply' = ANY (v_plan[v_lo:v_hi]) THEN
                SELECT format('%I.%I', ns.nspname, pr.proname) INTO STRICT v_call
                  FROM pg_proc pr JOIN pg_namespace ns ON ns.oid = pr.pronamespace
                 WHERE pr.oid = p_effects[v_inputs[v_lo]]::regprocedure;
                EXECUTE format(
                    $q$SELECT array_agg(s.o), array_agg(s.r), array_agg(s.t) FROM (
                         SELECT x.o::integer AS o,
                                %s(x.k, x.p, x.m || jsonb_build_object('attempt', 1, 'generation', 0)) AS r,
                                clock_timestamp() AS t
                           FROM ROWS FROM (jsonb_to_recordset($1) AS (k text, p jsonb, m jsonb))
                                WITH ORDINALITY AS x(k, p, m, o)
                          WHERE x.o BETWEEN $2 AND $3 AND ($4)[x.o] = 'apply'
                          ORDER BY x.o) s$q$, v_call)
                  INTO v_run_o, v_run_r, v_run_t
                  USING p_jobs, v_lo, v_hi, v_plan;
                v_app_o := v_app_o || v_run_o;
                v_app_r := v_app_r || v_run_r;
                v_app_t := v_app_t || v_run_t;
            END IF;
            v_lo := v_hi + 1;
        END LOOP;
        v_dup_t := clock_timestamp();

        -- 5. Settle the applied jobs in one statement. A job's attempt
        --    started when the previous effect finished.
        UPDATE idemq.jobs t
           SET state = 'applied', attempts = 1, applied_at = a.t, last_attempt_at = a.st,
               result = a.r
          FROM (SELECT v_keys[u.o] AS key, u.r, u.t,
                       coalesce(lag(u.t) OVER (ORDER BY u.n), v_start) AS st
                  FROM unnest(v_app_o, v_app_r, v_app_t) WITH ORDINALITY AS u(o, r, t, n)) a
         WHERE t.key = a.key;

        -- 6. One attempt row per job, in delivery order.
        INSERT INTO idemq.attempts (key, attempt, generation, outcome, started_at, finished_at,
            queue, routing_key, redelivered, delivery_count, consumer_id)
        SELECT x.k, v_att[x.o], coalesce((v_gens->>x.k)::integer, 0),
               CASE WHEN v_plan[x.o] = 'apply' THEN 'applied' ELSE 'duplicate' END,
               coalesce(a.st, v_start), coalesce(a.t, v_dup_t), x.q, x.m->>'routing_key',
               (x.m->>'redelivered')::boolean, (x.m->>'delivery_count')::integer, p_consumer
          FROM ROWS FROM (jsonb_to_recordset(p_jobs) AS (k text, q text, m jsonb))
               WITH ORDINALITY AS x(k, q, m, o)
          LEFT JOIN (SELECT u.o, u.t, coalesce(lag(u.t) OVER (ORDER BY u.n), v_start) AS st
                       FROM unnest(v_app_o, v_app_t) WITH ORDINALITY AS u(o, t, n)) a
                 ON a.o = x.o
         ORDER BY x.o;
    EXCEPTION WHEN OTHERS THEN
        -- Not a plain batch, or something failed: all of the above is rolled
        -- back. Apply again with per-job isolation.
        RETURN QUERY SELECT * FROM idemq.apply_batch(p_effects, p_jobs, p_consumer);
        RETURN;
    END;

    RETURN QUERY
    SELECT u.o::integer,
           CASE WHEN v_plan[u.o] = 'apply' THEN 'applied' ELSE 'duplicate' END,
           v_att[u.o], 0, NULL::text,
           CASE WHEN v_plan[u.o] = 'apply' THEN NULL ELSE 'applied' END,
           coalesce(a.st, v_start), coalesce(a.t, v_dup_t), NULL::integer, NULL::jsonb
      FROM generate_series(1, n) AS u(o)
      LEFT JOIN (SELECT x.o, x.t, coalesce(lag(x.t) OVER (ORDER BY x.n), v_start) AS st
                   FROM unnest(v_app_o, v_app_t) WITH ORDINALITY AS x(o, t, n)) a ON a.o = u.o
     ORDER BY u.o;
END
$fn$;
