-- idemq ledger functions, part 2: the lean set-based batch apply.
-- Applied together with functions.sql and functions_retention.sql as one
-- text by every `idemq migrate` (see ledger/embed_sql.cmake); the same rules
-- hold (CREATE OR REPLACE, a result type change needs a DROP FUNCTION IF
-- EXISTS first, search_path pinned, names schema-qualified).

-- Applies a batch like idemq.apply_batch, writing close to the least an
-- exactly-once apply needs: for a plain batch of new keys, ONE claim row per
-- key, inserted already settled (state 'applied', attempt 1, the batch's id
-- and time: the claim and the effect share the transaction, so nothing
-- outside it ever sees the row before the effect committed), the effects'
-- own rows, and ONE idemq.batches row that holds, per job in delivery
-- order, its key, body SHA-256, delivery meta, whether it was applied and
-- its result, and the positions of later copies of a key within the batch
-- (duplicates): the story of the
-- first delivery and of those copies, which `idemq jobs show` reads through
-- jobs.batch_id. A delivery of a key claimed before this batch (a duplicate
-- across batches, found through its own key) writes one idemq.attempts row
-- ('duplicate'). No settling UPDATE, no per-job attempt row.
-- The batch comes as parallel arrays in delivery order (the worker sends
-- them in binary form, so only payloads and metas are parsed, as jsonb):
-- p_keys; p_first (true for the first copy of its key in the batch) and
-- p_distinct (how many keys are distinct); p_inputs (1-based into
-- p_effects); p_sha (body SHA-256, hex); p_meta_idx (1-based into p_metas,
-- which holds each distinct meta once: the effect's meta, attempt 1 and
-- generation 0, as a plain job is a new key); p_payloads. It handles:
--   * a new key: claimed (one INSERT ... ON CONFLICT DO NOTHING for every
--     distinct key of the batch, in key order, so concurrent claimers wait on
--     keys in the same order) and applied, attempt 1;
--   * a key already applied: a duplicate (no effect);
--   * a later copy of a key within the batch: a duplicate.
-- The effects run in delivery order, one dynamic statement per run of
-- consecutive jobs of the same input (not one per job). p_effects holds
-- OIDs (or signatures) of the effects, resolved through regprocedure and
-- called by their qualified names.
-- Anything else, a key in another state (retrying, parked, ...) or any
-- error (an effect raising, a deadlock), rolls the subtransaction back and
-- the batch is applied again by idemq.apply_batch (from the same arrays as
-- its JSON document), which isolates each job in its own subtransaction and
-- owns every non-plain case. So one bad job costs its batch-mates one extra
-- round inside this same call, never their commit. QUERY_CANCELED
-- (statement timeout) is not caught (WHEN OTHERS excludes it): the whole
-- call fails, as with idemq.apply_batch.
-- Its result columns are those of idemq.apply_batch: the fallback returns
-- that function's rows (one per job) as they are. A plain batch returns ONE
-- summary row instead: r_idx 0, r_outcome 'batch', and r_message '' when
-- every first copy was applied (the later copies are the duplicates), else
-- the 1-based positions of every job not applied. Formatting a row per job
-- cost the database more than several of the steps above.
-- It never sees ordered-lane jobs, nor a message older than the dedup
-- window: the worker sends those to idemq.apply_batch.
DROP FUNCTION IF EXISTS idemq.apply_batch_fast(text[], jsonb, text);
DROP FUNCTION IF EXISTS idemq.apply_batch_fast(text[], text[], boolean[], integer, integer[],
                                               text[], jsonb[], integer[], jsonb[], text);
CREATE OR REPLACE FUNCTION idemq.apply_batch_fast(p_effects text[], p_keys text[],
                                                  p_first boolean[], p_distinct integer,
                                                  p_inputs integer[], p_sha text[],
                                                  p_metas jsonb[], p_meta_idx integer[],
                                                  p_payloads jsonb[], p_consumer text)
RETURNS TABLE (r_idx integer, r_outcome text, r_attempt integer, r_base integer,
               r_sqlstate text, r_message text, r_started timestamptz,
               r_finished timestamptz, r_delay_ms integer, r_park jsonb)
LANGUAGE plpgsql
SET search_path = pg_catalog, idemq
AS $fn$
DECLARE
    v_start     timestamptz := clock_timestamp();
    v_fin       timestamptz;
    v_batch     bigint;
    n           integer := coalesce(cardinality(p_keys), 0);
    v_claimed   text[];   -- keys claimed by this batch
    v_unclaimed text[];   -- keys claimed before this batch
    v_seen      jsonb;    -- those keys -> [attempts, generation] of their applied rows
    v_other     bigint;
    v_apply     boolean[]; -- by position: true for an applied job
    v_dups      integer[]; -- positions of later copies of a key applied here
    v_skipped   text := ''; -- positions not applied, when some key was claimed before
    v_res       jsonb[] := '{}'; -- by position: the effect's result (NULL if not applied)
    v_run       jsonb[];
    v_call      text;
    v_lo        integer;
    v_hi        integer;
BEGIN
    BEGIN
        v_batch := nextval('idemq.batches_id_seq');

        -- 1. Claim every distinct key of the batch, in key order, settled.
        WITH ins AS (
            INSERT INTO idemq.jobs AS t (key, state, attempts, first_seen_at, applied_at,
                                         batch_id)
            SELECT u.k, 'applied', 1, v_start, v_start, v_batch
              FROM unnest(p_keys, p_first) AS u(k, f) WHERE u.f ORDER BY 1
            ON CONFLICT (key) DO NOTHING
            RETURNING t.key
        )
        SELECT array_agg(ins.key) INTO v_claimed FROM ins;

        IF coalesce(cardinality(v_claimed), 0) = p_distinct THEN
            -- 2a. Every key is new: the first copies are applied, later
            --     copies are duplicates.
            v_apply := p_first;
            v_dups := array_positions(p_first, false);
        ELSE
            -- 2b. Some key was claimed before: a plain duplicate if it is
            --     applied; any other state is left to idemq.apply_batch.
            v_unclaimed := ARRAY(SELECT u.k FROM unnest(p_keys, p_first) AS u(k, f) WHERE u.f
                                 EXCEPT ALL SELECT unnest(v_claimed));
            SELECT coalesce(jsonb_object_agg(t.key, jsonb_build_array(t.attempts, t.generation))
                              FILTER (WHERE t.state = 'applied'), '{}'),
                   count(*) FILTER (WHERE t.state <> 'applied')
              INTO v_seen, v_other
              FROM idemq.jobs t WHERE t.key = ANY (v_unclaimed);
            IF v_other > 0 THEN
                RAISE EXCEPTION 'idemq: batch holds a key that is neither new nor applied';
            END IF;
            SELECT array_agg(u.f AND NOT u.old ORDER BY u.o),
                   coalesce(array_agg(u.o) FILTER (WHERE NOT u.f AND NOT u.old), '{}'),
                   coalesce(string_agg(u.o::text, ',' ORDER BY u.o)
                              FILTER (WHERE NOT u.f OR u.old), '')
              INTO v_apply, v_dups, v_skipped
              FROM (SELECT x.o::integer AS o, x.f, x.k = ANY (v_unclaimed) AS old
                      FROM unnest(p_keys, p_first) WITH ORDINALITY AS x(k, f, o)) u;
        END IF;

        -- 3. Run the effects in delivery order: one statement per run of
        --    consecutive jobs of one input. A function scan of unnest()
        --    yields its rows in array order, so the effects run, and their
        --    results are aggregated (NULL where not applied), in delivery order.
        v_lo := 1;
        WHILE v_lo <= n LOOP
            v_hi := v_lo;
            WHILE v_hi < n AND p_inputs[v_hi + 1] = p_inputs[v_lo] LOOP
                v_hi := v_hi + 1;
            END LOOP;
            SELECT format('%I.%I', ns.nspname, pr.proname) INTO STRICT v_call
              FROM pg_catalog.pg_proc pr
              JOIN pg_catalog.pg_namespace ns ON ns.oid = pr.pronamespace
             WHERE pr.oid = p_effects[p_inputs[v_lo]]::regprocedure;
            EXECUTE format(
                $q$SELECT array_agg(CASE WHEN ($6)[x.o] THEN %s(x.k, x.p, ($7)[x.mi]) END)
                     FROM unnest($1, $2, $3) WITH ORDINALITY AS x(k, p, mi, o)
                    WHERE x.o BETWEEN $4 AND $5$q$, v_call)
              INTO v_run
              USING p_keys, p_payloads, p_meta_idx, v_lo, v_hi, v_apply, p_metas;
            v_res := v_res || v_run;
            v_lo := v_hi + 1;
        END LOOP;
        v_fin := clock_timestamp();

        -- 4. The batch's history row: every job's delivery, the results of
        --    the applied ones, the positions of the copies.
        IF true = ANY (v_apply) THEN
            INSERT INTO idemq.batches (id, at, finished_at, consumer_id, keys, sha256, metas,
                                       meta_idx, results, applied, dups)
            VALUES (v_batch, v_start, v_fin, p_consumer, p_keys, p_sha, p_metas, p_meta_idx,
                    v_res, v_apply, v_dups);
        END IF;

        -- 5. One attempt row per delivery of a key claimed before the batch.
        IF v_unclaimed IS NOT NULL THEN
            INSERT INTO idemq.attempts (key, attempt, generation, outcome, started_at,
                finished_at, queue, routing_key, redelivered, delivery_count, consumer_id,
                message)
            SELECT x.k, (v_seen->x.k->>0)::integer, (v_seen->x.k->>1)::integer, 'duplicate',
                   v_start, v_fin, p_metas[x.mi]->>'queue', p_metas[x.mi]->>'routing_key',
                   (p_metas[x.mi]->>'redelivered')::boolean,
                   (p_metas[x.mi]->>'delivery_count')::integer, p_consumer, 'applied'
              FROM unnest(p_keys, p_meta_idx) WITH ORDINALITY AS x(k, mi, o)
             WHERE x.k = ANY (v_unclaimed)
             ORDER BY x.o;
        END IF;
    EXCEPTION WHEN OTHERS THEN
        -- Not a plain batch, or something failed: all of the above is rolled
        -- back. Apply again with per-job isolation, from the same jobs.
        RETURN QUERY SELECT * FROM idemq.apply_batch(p_effects,
            (SELECT jsonb_agg(jsonb_build_object('k', x.k, 'i', x.i,
                        'q', p_metas[x.mi]->>'queue', 'h', x.h, 'm', p_metas[x.mi], 'p', x.p)
                        ORDER BY x.o)
               FROM unnest(p_keys, p_inputs, p_sha, p_meta_idx, p_payloads)
                    WITH ORDINALITY AS x(k, i, h, mi, p, o)),
            p_consumer);
        RETURN;
    END;

    r_idx := 0; r_outcome := 'batch'; r_attempt := 1; r_base := 0; r_message := v_skipped;
    r_started := v_start; r_finished := v_fin;
    RETURN NEXT;
END
$fn$;
