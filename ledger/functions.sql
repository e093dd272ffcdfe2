-- idemq ledger functions: the claim/apply/record/park transactions.
-- Unlike the versioned migrations (tables), this file is applied as a whole
-- by every `idemq migrate` (CREATE OR REPLACE, inside one transaction), and
-- `idemq run` checks that the database holds this exact text (by SHA-256).
-- A change of a function's result type needs a DROP FUNCTION IF EXISTS
-- before its CREATE here. Every function pins its search_path
-- (pg_catalog, idemq) and names every relation with its schema, so no
-- object a session or role can create elsewhere is ever picked up instead.
-- Effect functions run under that pin too: they must schema-qualify what
-- they use (or pin their own search_path).

DROP FUNCTION IF EXISTS idemq.apply_batch_fast(text[], jsonb, text); -- version 8, replaced by ledger_plain.c
DROP FUNCTION IF EXISTS idemq.apply_batch(text[], jsonb, text);
DROP FUNCTION IF EXISTS idemq.add_attempt(text, integer, integer, text, timestamptz,
    timestamptz, text, jsonb, text, integer);
DROP FUNCTION IF EXISTS idemq.record_failure(text, integer, text, text, text, text, boolean,
    timestamptz, timestamptz, text, text, text, boolean, integer, text, bytea, jsonb, jsonb);
DROP FUNCTION IF EXISTS idemq.park_message(text, text, text, text, bytea, jsonb, jsonb, text,
    text, text);
DROP FUNCTION IF EXISTS idemq.park_message(text, text, text, text, bytea, jsonb, jsonb, text,
    text, text, text, bigint, boolean);
DROP FUNCTION IF EXISTS idemq.park_message(text, text, text, text, bytea, jsonb, jsonb, text,
    text, text, text, bigint, boolean, text);
DROP FUNCTION IF EXISTS idemq.record_failure(text, integer, text, text, text, text, boolean,
    integer, timestamptz, timestamptz, text, text, text, jsonb, text, bytea, jsonb, jsonb);
DROP FUNCTION IF EXISTS idemq.record_failure(text, integer, text, text, text, text, boolean,
    integer, timestamptz, timestamptz, text, text, text, jsonb, text, bytea, jsonb, jsonb, bytea,
    text);

-- What the worker needs to dead-letter a parked message: the park row's
-- facts, as the x-idemq-* headers show them.
CREATE OR REPLACE FUNCTION idemq.park_info(p_id bigint)
RETURNS jsonb
LANGUAGE sql STABLE
SET search_path = pg_catalog, idemq
AS $fn$
    SELECT jsonb_build_object(
        'park_id', p.id, 'key', p.key, 'error_class', p.error_class,
        'error_code', p.error_code, 'sqlstate', p.sqlstate, 'reason', p.reason,
        'attempts', p.attempts, 'generation', p.generation,
        'payload_sha256', p.payload_sha256, 'redrivable', p.redrivable,
        'first_attempt_at', p.first_attempt_at, 'last_attempt_at', p.last_attempt_at,
        'parked_at', p.parked_at)
      FROM idemq.parked p WHERE p.id = p_id;
$fn$;

-- The trace id of a job's meta: the 32 hex digits of its traceparent
-- (checked by idemq when the job came, consumer/trace.h), or NULL.
CREATE OR REPLACE FUNCTION idemq.trace_id_of(m jsonb)
RETURNS text
LANGUAGE sql IMMUTABLE
SET search_path = pg_catalog, idemq
AS $fn$
    SELECT CASE WHEN m->>'traceparent' ~ '^[0-9a-f]{2}-[0-9a-f]{32}-'
                THEN substr(m->>'traceparent', 4, 32) END;
$fn$;

-- Records one attempt row. m is the job's meta (delivery facts).
CREATE OR REPLACE FUNCTION idemq.add_attempt(
    p_key text, p_attempt integer, p_generation integer, p_outcome text,
    p_started timestamptz, p_finished timestamptz, p_queue text, m jsonb, p_consumer text,
    p_delay_ms integer DEFAULT NULL, p_message text DEFAULT NULL)
RETURNS void
LANGUAGE sql
SET search_path = pg_catalog, idemq
AS $fn$
    INSERT INTO idemq.attempts (key, attempt, generation, outcome, started_at, finished_at,
        queue, routing_key, redelivered, delivery_count, acquired_count, consumer_id, delay_ms,
        message, trace_id)
    VALUES (p_key, p_attempt, p_generation, p_outcome, p_started, p_finished, p_queue,
        m->>'routing_key', (m->>'redelivered')::boolean, (m->>'delivery_count')::integer,
        (m->>'acquired_count')::integer,
        p_consumer, p_delay_ms, p_message, idemq.trace_id_of(m));
$fn$;

-- The job's trace context for the effect that runs next, in this
-- transaction's settings idemq.traceparent and idemq.tracestate (idemq.emit
-- copies them into the messages the effect emits; tracing extensions can
-- read them): m's values, checked by idemq (consumer/trace.h), or '' for a
-- job without one. Returns m, so that the plain path sets them in the
-- effect call's own argument list, row by row.
CREATE OR REPLACE FUNCTION idemq.trace_meta(m jsonb)
RETURNS jsonb
LANGUAGE sql VOLATILE
AS $fn$
    SELECT CASE WHEN set_config('idemq.traceparent', coalesce(m->>'traceparent', ''), true)
                     || set_config('idemq.tracestate', coalesce(m->>'tracestate', ''), true)
                     IS NULL THEN NULL ELSE m END;
$fn$;

-- Applies a batch in one call. p_effects[i] is input i's effect as a
-- regprocedure text: its OID (what the worker sends, resolved in its own
-- session) or its signature, e.g. 'public.apply_payout(text,jsonb,jsonb)';
-- so only an existing function can ever be called, by its qualified name.
-- p_jobs is a JSON array of {"k": key, "i": input (1-based), "q": queue,
-- "h": SHA-256 of the raw body (hex), "m": meta object, "p": payload}, and for
-- ordered inputs "l": lane, "o": ordering key, "s": sequence, "d": true when
-- the job comes from idemq.deferred (its id in "di"), not from a delivery.
-- For each job, in order, after claiming the key (INSERT ... ON CONFLICT on
-- the primary key waits for a concurrent claimer to finish):
--   applied            -> 'duplicate' (no effect); r_message 'key_reuse' (and
--                         the attempt's message says so) when the body's
--                         SHA-256 differs from the applied one
--   parked, a redrive of the current generation (x-idemq-generation header)
--                      -> a new generation with a fresh attempt budget, applied
--   parked otherwise   -> 'duplicate', or 'repark' if its dead-letter publish
--                         was never confirmed (the worker publishes it again);
--                         'early' (wait on the broker, look again) while the
--                         park is under 15 s old and its publish not noted:
--                         its own publisher may still be confirming it
--   retrying, run_after still ahead -> 'early' (re-delay, no attempt used)
--   a key claimed now (never claimed, or pruned past the dedup window) whose
--   message is older than the dedup window ("w": true, from its AMQP
--   timestamp) -> 'outside': not applied; the worker parks it as
--   outside_dedup_window (idemq.record_failure), a redrive applies it
--   else the effect runs in a subtransaction: 'applied', or 'error' with its
--   SQLSTATE for the worker to classify and record (idemq.record_failure).
-- A redrive closes the key's open parks (idemq.close_park, 'redriven').
-- Ordered lanes: after a job of lane "l" failed (or is early) in this batch,
-- the lane's later jobs are 'held' (nothing recorded; the worker keeps them
-- in order). The sequence guard, under the idemq.order_keys row lock, turns
-- a job whose sequence was passed into 'duplicate' (message 'stale', state
-- stale), and a job that comes before its predecessor, or whose ordering
-- key is held by a parked job (on_park = hold_key), into 'deferred': the
-- worker stores it with idemq.defer_job and acknowledges it. Applying an
-- ordered job marks the deferred jobs it lets through as due
-- (idemq.deferred.due_at), which is how workers find them
-- (idemq.take_deferred); a deferred job that is still not through is
-- unmarked.
CREATE OR REPLACE FUNCTION idemq.apply_batch(p_effects text[], p_jobs jsonb, p_consumer text)
RETURNS TABLE (r_idx integer, r_outcome text, r_attempt integer, r_base integer,
               r_sqlstate text, r_message text, r_started timestamptz,
               r_finished timestamptz, r_delay_ms integer, r_park jsonb)
LANGUAGE plpgsql
SET search_path = pg_catalog, idemq
AS $fn$
DECLARE
    calls    text[] := '{}';
    j        jsonb;
    v_key    text;
    v_meta   jsonb;
    v_q      text;
    v_state  text;
    v_att    integer;
    v_base   integer;
    v_gen    integer;
    v_after  timestamptz;
    v_sha    text;
    v_result jsonb;
    v_start  timestamptz;
    v_fin    timestamptz;
    v_code   text;
    v_msg    text;
    v_ins    boolean;
    v_park   bigint;
    v_hgen   jsonb;
    v_failed text[] := '{}';
    v_lanes  text[] := '{}';
    v_lane   text;
    v_okey   text;
    v_seq    bigint;
    v_last   bigint;
    v_block  text;
    v_redriven boolean;
    v_why    text;
    v_parked_at timestamptz;
    v_traced boolean := false;
BEGIN
    FOR n IN 1 .. coalesce(array_length(p_effects, 1), 0) LOOP
        calls[n] := (SELECT format('SELECT %I.%I($1, $2, $3)', ns.nspname, pr.proname)
                       FROM pg_catalog.pg_proc pr
                       JOIN pg_catalog.pg_namespace ns ON ns.oid = pr.pronamespace
                      WHERE pr.oid = p_effects[n]::regprocedure
                        AND pg_catalog.has_function_privilege(session_user, pr.oid, 'EXECUTE'));
    END LOOP;

    r_idx := 0;
    FOR j IN SELECT e FROM jsonb_array_elements(p_jobs) AS e LOOP
        r_idx := r_idx + 1;
        v_key := j->>'k';
        v_meta := j->'m';
        v_q := j->>'q';
        v_start := clock_timestamp();
        v_sha := j->>'h';
        r_sqlstate := NULL; r_message := NULL; r_delay_ms := NULL; r_park := NULL;
        r_started := v_start;
        v_lane := j->>'l';
        v_okey := j->>'o';
        v_seq := (j->>'s')::bigint;
        v_redriven := false;

        IF v_lane IS NOT NULL AND v_lane = ANY (v_lanes) THEN
            -- An earlier job of this ordered lane failed in this batch: this
            -- one waits behind it (the worker holds the delivery).
            r_outcome := 'held'; r_attempt := 0; r_base := 0; r_finished := v_start;
            RETURN NEXT;
            CONTINUE;
        END IF;

        IF v_key = ANY (v_failed) THEN
            -- A second copy of a key that failed earlier in this batch: the
            -- first copy's failure path (retry or park) speaks for both.
            PERFORM idemq.add_attempt(v_key, 0, 0, 'duplicate', v_start, v_start, v_q,
                                      v_meta, p_consumer);
            r_outcome := 'duplicate'; r_attempt := 0; r_base := 0; r_message := 'in_batch';
            r_finished := v_start;
            RETURN NEXT;
            CONTINUE;
        END IF;

        INSERT INTO idemq.jobs AS t (key, state, source_queue, payload_sha256, first_seen_at)
        VALUES (v_key, 'pending', v_q, v_sha, v_start)
        ON CONFLICT (key) DO NOTHING
        RETURNING true INTO v_ins;

        IF v_ins IS NULL THEN
            SELECT t.state INTO v_state FROM idemq.jobs t WHERE t.key = v_key;
            IF v_state <> 'applied' THEN
                -- Not settled for good: take the row lock, then look again.
                SELECT t.state INTO v_state FROM idemq.jobs t WHERE t.key = v_key FOR UPDATE;
            END IF;
            SELECT t.attempts, t.budget_base, t.generation, t.run_after
              INTO v_att, v_base, v_gen, v_after
              FROM idemq.jobs t WHERE t.key = v_key;
            IF v_state = 'observed' THEN
                -- Claimed by observe mode: the consumer that ran beside
                -- idemq took the message, but whether it applied it or is
                -- retrying it (its own delay queue, Celery's retry) or
                -- parked it, idemq cannot know. The first copy apply mode
                -- takes is applied, once; the effect is told (meta.observed)
                -- so it can skip what the old consumer's own effect shows.
                UPDATE idemq.jobs t SET state = 'pending' WHERE t.key = v_key
                RETURNING jsonb_build_object('observed', jsonb_build_object(
                              'by', t.observed_by, 'at', t.first_seen_at))
                     INTO v_hgen;
                v_meta := v_meta || v_hgen;
                v_hgen := NULL;
                v_state := 'pending';
            END IF;
            IF v_state = 'parked' THEN
                v_hgen := v_meta->'headers'->'x-idemq-generation';
                IF jsonb_typeof(v_hgen) = 'number' AND v_hgen::text::integer = v_gen THEN
                    -- A redrive (idemq redrive, a shovel, a manual move) of the
                    -- current park: new generation, fresh attempt budget.
                    v_gen := v_gen + 1;
                    v_base := v_att;
                    INSERT INTO idemq.redrives (key, generation, park_id, source, consumer_id)
                    VALUES (v_key, v_gen,
                        CASE WHEN jsonb_typeof(v_meta->'headers'->'x-idemq-park-id') = 'number'
                             THEN (v_meta->'headers'->>'x-idemq-park-id')::bigint END,
                        coalesce(v_meta->'headers'->>'x-idemq-redriven-by', 'broker'),
                        p_consumer);
                    UPDATE idemq.jobs t SET state = 'pending', generation = v_gen,
                           budget_base = v_base, run_after = NULL
                     WHERE t.key = v_key;
                    -- Its parks are dealt with: the message is back in flight.
                    PERFORM idemq.close_park(p.id, 'redriven to generation ' || v_gen,
                        coalesce(v_meta->'headers'->>'x-idemq-redriven-by', 'broker'))
                       FROM idemq.parked p WHERE p.key = v_key AND p.generation < v_gen;
                    v_state := 'pending';
                    v_redriven := true;
                END IF;
            END IF;
            IF v_state = 'deferred' AND NOT coalesce((j->>'d')::boolean, false) THEN
                -- Its first copy waits in idemq.deferred; this copy adds nothing.
                v_fin := clock_timestamp();
                PERFORM idemq.add_attempt(v_key, v_att, v_gen, 'duplicate', v_start, v_fin,
                                          v_q, v_meta, p_consumer, NULL, 'deferred');
                r_outcome := 'duplicate'; r_attempt := v_att; r_base := v_base;
                r_message := v_state; r_finished := v_fin;
                RETURN NEXT;
                CONTINUE;
            END IF;
            IF v_state IN ('applied', 'parked', 'stale') THEN
                -- The same key with another body (a producer bug: payment
                -- APIs answer it with 422): still no effect, but recorded
                -- as key_reuse, which the worker counts (and parks when the
                -- input says on_key_reuse = "park").
                v_why := NULL;
                IF v_state = 'applied' THEN
                    SELECT x.payload_sha256 INTO v_why FROM idemq.job_info(v_key) x;
                    v_why := CASE WHEN v_why IS NOT NULL AND v_why <> (j->>'h')
                                  THEN format('key_reuse: body SHA-256 %s, the applied one %s',
                                              j->>'h', v_why) END;
                END IF;
                r_outcome := 'duplicate';
                IF v_state = 'parked' THEN
                    SELECT p.id, p.parked_at INTO v_park, v_parked_at FROM idemq.parked p
                     WHERE p.key = v_key AND p.generation = v_gen
                     ORDER BY p.id DESC LIMIT 1;
                    IF v_park IS NOT NULL AND NOT EXISTS (SELECT 1 FROM idemq.parked p
                        WHERE p.id = v_park AND p.dlq_published_at IS NOT NULL) THEN
                        r_outcome := 'repark';
                        r_park := idemq.park_info(v_park);
                        IF v_parked_at > clock_timestamp() - interval '15 seconds' THEN
                            -- Parked moments ago (this copy may have waited on
                            -- that transaction's row lock): its publisher may
                            -- still wait for the confirm (up to 10 s) or be
                            -- noting it. Not a second copy yet: wait on the
                            -- broker and look again (a repark only if still
                            -- not noted 15 s after the park).
                            r_delay_ms := greatest(50, least(1000, ceil(extract(epoch FROM
                                v_parked_at + interval '15 seconds' - clock_timestamp()) * 1000)));
                            v_fin := clock_timestamp();
                            PERFORM idemq.add_attempt(v_key, v_att, v_gen, 'delayed', v_start,
                                v_fin, v_q, v_meta, p_consumer, r_delay_ms,
                                'parked: its dead-letter copy may still be publishing');
                            r_outcome := 'early'; r_attempt := v_att; r_base := v_base;
                            r_message := 'parked moments ago: its dead-letter copy may still '
                                         'be publishing';
                            r_park := NULL; r_finished := v_fin;
                            IF v_lane IS NOT NULL THEN
                                v_lanes := v_lanes || v_lane;
                            END IF;
                            RETURN NEXT;
                            CONTINUE;
                        END IF;
                    END IF;
                END IF;
                v_fin := clock_timestamp();
                PERFORM idemq.add_attempt(v_key, v_att, v_gen, 'duplicate', v_start, v_fin,
                                          v_q, v_meta, p_consumer, NULL, v_why);
                r_attempt := v_att; r_base := v_base;
                r_message := CASE WHEN v_why IS NULL THEN v_state ELSE 'key_reuse' END;
                r_finished := v_fin;
                RETURN NEXT;
                CONTINUE;
            END IF;
            IF v_state IN ('provider_pending', 'provider_unknown') THEN
                -- The key belongs to a provider job (another input's kind of
                -- effect): this copy is parked as key_conflict by the worker,
                -- the provider job is not touched and no effect runs.
                v_fin := clock_timestamp();
                r_message := format('key %s belongs to a provider job (%s) of another input: '
                                    'not applied', v_key, v_state);
                PERFORM idemq.add_attempt(v_key, v_att, v_gen, 'duplicate', v_start, v_fin,
                                          v_q, v_meta, p_consumer, NULL,
                                          'key_conflict: a copy from ' || v_q || ' parked');
                r_outcome := 'conflict'; r_attempt := v_att; r_base := v_base;
                r_finished := v_fin;
                RETURN NEXT;
                CONTINUE;
            END IF;
            IF v_state = 'retrying' AND v_after > clock_timestamp() + interval '50 ms' THEN
                -- Back before its time (a duplicate copy, or a redelivery after
                -- a crash): wait the rest on the broker; no attempt is used.
                r_delay_ms := ceil(extract(epoch FROM v_after - clock_timestamp()) * 1000);
                v_fin := clock_timestamp();
                PERFORM idemq.add_attempt(v_key, v_att, v_gen, 'delayed', v_start, v_fin,
                                          v_q, v_meta, p_consumer, r_delay_ms);
                r_outcome := 'early'; r_attempt := v_att; r_base := v_base;
                r_finished := v_fin;
                IF v_lane IS NOT NULL THEN
                    v_lanes := v_lanes || v_lane;
                END IF;
                RETURN NEXT;
                CONTINUE;
            END IF;
        ELSE
            v_att := 0; v_base := 0; v_gen := 0; v_state := 'pending';
            IF coalesce((j->>'w')::boolean, false) THEN
                -- Claimed now, yet its message is older than the dedup
                -- window: the key may have been applied and pruned since.
                -- Not applied blindly: the worker parks it.
                r_outcome := 'outside'; r_attempt := 1; r_base := 0;
                r_message := 'the message is older than the dedup window and its key is not '
                             'claimed (never seen, or pruned): not applied; redrive to apply';
                r_finished := v_start;
                v_failed := v_failed || v_key;
                IF v_lane IS NOT NULL THEN
                    v_lanes := v_lanes || v_lane;
                END IF;
                RETURN NEXT;
                CONTINUE;
            END IF;
        END IF;

        IF v_okey IS NOT NULL THEN
            -- The sequence guard: one row lock per ordering key serialises
            -- every replica's decision for that key.
            INSERT INTO idemq.order_keys (source_queue, order_key) VALUES (v_q, v_okey)
            ON CONFLICT DO NOTHING;
            SELECT k.last_seq, k.blocked_by INTO v_last, v_block FROM idemq.order_keys k
             WHERE k.source_queue = v_q AND k.order_key = v_okey FOR UPDATE;
            v_why := NULL;
            IF v_block IS NOT NULL AND v_block <> v_key THEN
                v_why := format('held: ordering key %s is held by parked job %s', v_okey, v_block);
            ELSIF v_seq IS NULL AND v_block IS DISTINCT FROM v_key
                  AND EXISTS (SELECT 1 FROM idemq.deferred d
                    WHERE d.source_queue = v_q AND d.order_key = v_okey AND d.key <> v_key
                      AND (j->>'di' IS NULL OR d.id < (j->>'di')::bigint)) THEN
                v_why := format('held: earlier jobs of ordering key %s are deferred', v_okey);
            ELSIF v_seq IS NOT NULL AND v_seq <= v_last AND NOT v_redriven THEN
                -- Stale: this sequence was passed already. No effect, ever.
                v_fin := clock_timestamp();
                UPDATE idemq.jobs t SET state = 'stale', last_attempt_at = v_start
                 WHERE t.key = v_key;
                DELETE FROM idemq.deferred d WHERE d.key = v_key;
                PERFORM idemq.add_attempt(v_key, v_att, v_gen, 'duplicate', v_start, v_fin,
                    v_q, v_meta, p_consumer, NULL,
                    format('stale: sequence %s of %s, last applied %s', v_seq, v_okey, v_last));
                r_outcome := 'duplicate'; r_attempt := v_att; r_base := v_base;
                r_message := 'stale'; r_finished := v_fin;
                RETURN NEXT;
                CONTINUE;
            ELSIF v_seq IS NOT NULL AND v_seq > v_last + 1 THEN
                v_why := format('gap: sequence %s of %s waits for %s', v_seq, v_okey, v_last + 1);
            END IF;
            IF v_why IS NOT NULL THEN
                v_fin := clock_timestamp();
                IF NOT coalesce((j->>'d')::boolean, false) THEN
                    UPDATE idemq.jobs t SET state = 'deferred' WHERE t.key = v_key
                       AND t.state = 'pending';
                    PERFORM idemq.add_attempt(v_key, v_att, v_gen, 'deferred', v_start, v_fin,
                                              v_q, v_meta, p_consumer, NULL, v_why);
                ELSE
                    -- Taken as due, but still not through: wait to be marked again.
                    UPDATE idemq.deferred d SET due_at = NULL
                     WHERE d.id = (j->>'di')::bigint;
                END IF;
                r_outcome := 'deferred'; r_attempt := v_att; r_base := v_base;
                r_message := v_why; r_finished := v_fin;
                RETURN NEXT;
                CONTINUE;
            END IF;
        END IF;

        IF calls[(j->>'i')::integer] IS NULL THEN
            -- The effect this session resolved is gone: dropped, or replaced
            -- by DROP + CREATE under a new OID; or its EXECUTE was revoked
            -- from the session's role (checked here because this function
            -- may run with its owner's rights). A deploy error, not the
            -- job's: raised outside the job's subtransaction, it fails the
            -- whole call, nothing is recorded, and the worker reports not
            -- ready and reconnects (resolving the effect again).
            IF EXISTS (SELECT 1 FROM pg_catalog.pg_proc pr
                        WHERE pr.oid = p_effects[(j->>'i')::integer]::regprocedure) THEN
                RAISE EXCEPTION 'role % may not EXECUTE the effect function % of input %',
                                session_user, p_effects[(j->>'i')::integer]::regprocedure,
                                j->>'i'
                      USING ERRCODE = '42501';
            END IF;
            RAISE EXCEPTION 'the effect function of input % (OID %) does not exist: dropped or '
                            'replaced since this session resolved it', j->>'i',
                            p_effects[(j->>'i')::integer]
                  USING ERRCODE = '42883';
        END IF;
        v_att := v_att + 1;
        r_attempt := v_att; r_base := v_base;
        -- the producer's trace context (checked by idemq, trace.h), for
        -- idemq.emit and tracing extensions; cleared for a job without one
        IF v_traced OR v_meta ? 'traceparent' THEN
            PERFORM idemq.trace_meta(v_meta);
            v_traced := v_meta ? 'traceparent';
        END IF;
        BEGIN
            EXECUTE calls[(j->>'i')::integer] INTO v_result
              USING v_key, j->'p',
                    v_meta || jsonb_build_object('attempt', v_att, 'generation', v_gen);
            v_fin := clock_timestamp();
            UPDATE idemq.jobs t SET state = 'applied', attempts = v_att, applied_at = v_fin,
                   last_attempt_at = v_start, result = v_result, payload_sha256 = v_sha,
                   run_after = NULL
             WHERE t.key = v_key;
            PERFORM idemq.add_attempt(v_key, v_att, v_gen, 'applied', v_start, v_fin, v_q,
                                      v_meta, p_consumer);
            IF v_okey IS NOT NULL THEN
                UPDATE idemq.order_keys k
                   SET last_seq = CASE WHEN v_seq IS NULL THEN k.last_seq
                                       ELSE greatest(k.last_seq, v_seq) END,
                       blocked_by = CASE WHEN k.blocked_by = v_key THEN NULL
                                         ELSE k.blocked_by END,
                       updated_at = v_fin
                 WHERE k.source_queue = v_q AND k.order_key = v_okey
                RETURNING k.last_seq INTO v_last;
                DELETE FROM idemq.deferred d WHERE d.key = v_key;
                PERFORM idemq.mark_due(v_q, v_okey, v_last);
            END IF;
            r_outcome := 'applied';
        EXCEPTION WHEN OTHERS THEN
            GET STACKED DIAGNOSTICS v_code = RETURNED_SQLSTATE, v_msg = MESSAGE_TEXT;
            v_fin := clock_timestamp();
            r_outcome := 'error'; r_sqlstate := v_code; r_message := v_msg;
            v_failed := v_failed || v_key;
            IF v_lane IS NOT NULL THEN
                v_lanes := v_lanes || v_lane;
            END IF;
        END;
        r_finished := v_fin;
        RETURN NEXT;
    END LOOP;
END
$fn$;

-- Records a failed attempt of a claimed key (inside the batch transaction):
-- the attempt row and the job's last error; then either the durable retry
-- schedule (state 'retrying', run_after = now + p_delay_ms) or, when p_park,
-- state 'parked' and a park row holding the raw message and a link to every
-- attempt. Returns the park's facts (idemq.park_info) or NULL. p_sealed and
-- p_body_key: the body sealed with that key (consumer/protect.h), stored in
-- the park row or the retry copy instead of p_body (whose hash the row keeps).
CREATE OR REPLACE FUNCTION idemq.record_failure(
    p_key text, p_attempt integer, p_class text, p_code text, p_sqlstate text,
    p_message text, p_park boolean, p_delay_ms integer, p_started timestamptz,
    p_finished timestamptz, p_queue text, p_exchange text, p_routing_key text,
    p_meta jsonb, p_consumer text, p_body bytea, p_headers jsonb, p_properties jsonb,
    p_sealed bytea DEFAULT NULL, p_body_key text DEFAULT NULL)
RETURNS jsonb
LANGUAGE plpgsql
SET search_path = pg_catalog, idemq
AS $fn$
DECLARE
    v_gen   integer;
    v_after timestamptz;
    v_first timestamptz;
    v_ids   bigint[];
    v_id    bigint;
BEGIN
    UPDATE idemq.jobs SET
        state = CASE WHEN p_park THEN 'parked' ELSE 'retrying' END,
        attempts = p_attempt, last_attempt_at = p_started, last_error_class = p_class,
        last_sqlstate = p_sqlstate, last_error = p_message,
        run_after = CASE WHEN p_park THEN NULL
                         ELSE clock_timestamp() + make_interval(secs => p_delay_ms / 1000.0) END
     WHERE key = p_key AND state IN ('pending', 'retrying', 'deferred')
    RETURNING generation, run_after INTO v_gen, v_after;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'idemq: key % is not claimed', p_key USING ERRCODE = 'XX000';
    END IF;
    IF NOT p_park THEN
        -- A deferred job retries from the ledger: due again at run_after.
        UPDATE idemq.deferred d SET due_at = v_after WHERE d.key = p_key;
    END IF;
    INSERT INTO idemq.attempts (key, attempt, generation, outcome, started_at, finished_at,
        error_class, error_code, sqlstate, message, queue, routing_key, redelivered,
        delivery_count, acquired_count, consumer_id, delay_ms, trace_id)
    VALUES (p_key, p_attempt, v_gen,
        CASE WHEN p_class = 'transient' THEN 'transient_error' ELSE 'permanent_error' END,
        p_started, p_finished, p_class, p_code, p_sqlstate, p_message, p_queue,
        p_meta->>'routing_key', (p_meta->>'redelivered')::boolean,
        (p_meta->>'delivery_count')::integer,
        (p_meta->>'acquired_count')::integer, p_consumer,
        CASE WHEN p_park THEN NULL ELSE p_delay_ms END, idemq.trace_id_of(p_meta));
    IF NOT p_park THEN
        -- the message stays in the ledger until the retry came
        -- back (ledger/functions_rescue.sql)
        PERFORM idemq.keep_retry_copy(p_key, v_gen, p_attempt, p_queue, p_exchange,
                                      p_routing_key,
                                      CASE WHEN p_body_key IS NULL THEN p_body ELSE p_sealed END,
                                      p_headers, p_properties, p_body_key);
        RETURN NULL;
    END IF;
    SELECT min(a.started_at) FILTER (WHERE a.generation = v_gen
                                       AND a.outcome IN ('transient_error', 'permanent_error')),
           array_agg(a.id ORDER BY a.id)
      INTO v_first, v_ids
      FROM idemq.key_attempts(p_key) a;
    INSERT INTO idemq.parked (key, source_queue, exchange, routing_key, body, headers,
        properties, payload_sha256, error_class, error_code, sqlstate, reason, attempts,
        first_attempt_at, last_attempt_at, consumer_id, generation, attempt_ids, body_size,
        body_key)
    VALUES (p_key, p_queue, p_exchange, p_routing_key,
        CASE WHEN p_body_key IS NULL THEN p_body ELSE p_sealed END, p_headers, p_properties,
        encode(sha256(p_body), 'hex'), p_class, p_code, p_sqlstate, p_message, p_attempt,
        coalesce(v_first, p_started), p_started, p_consumer, v_gen, coalesce(v_ids, '{}'),
        octet_length(p_body), p_body_key)
    RETURNING id INTO v_id;
    RETURN idemq.park_info(v_id);
END
$fn$;

-- Claims a key whose apply call failed as a whole (e.g. statement timeout,
-- which a PL/pgSQL exception block cannot catch) so the failure can be
-- recorded as its attempt. Returns the state and the next attempt number.
CREATE OR REPLACE FUNCTION idemq.claim_failed(p_key text, p_queue text, p_sha text)
RETURNS TABLE (r_state text, r_attempt integer, r_base integer)
LANGUAGE plpgsql
SET search_path = pg_catalog, idemq
AS $fn$
BEGIN
    INSERT INTO idemq.jobs (key, state, source_queue, payload_sha256)
    VALUES (p_key, 'pending', p_queue, p_sha)
    ON CONFLICT (key) DO NOTHING;
    -- an observed key is claimable: its first apply-mode copy is applied
    UPDATE idemq.jobs t SET state = 'pending' WHERE t.key = p_key AND t.state = 'observed';
    RETURN QUERY SELECT t.state, t.attempts + 1, t.budget_base
                   FROM idemq.jobs t WHERE t.key = p_key FOR UPDATE;
END
$fn$;

-- Parks a message that could not be decoded into a job (bad JSON, no key,
-- too large, undecodable), or a job that failed in every mode
-- (unprocessable): no job row is claimed, what is known of the message is
-- kept: p_body (the whole body, or a prefix when p_body_size is larger),
-- p_sha (SHA-256 of the whole body as received; NULL = of p_body). A
-- forged_redrive park is never redrivable, whatever p_redrivable says: its
-- body is whatever a producer sent with a made-up x-idemq-generation, and
-- its sealed dead-letter copy, redriven, would be applied as the key's
-- redrive. p_body_key: p_body is sealed with that key (consumer/protect.h;
-- p_sha and p_body_size are then the message's own). Returns the park's
-- facts.
CREATE OR REPLACE FUNCTION idemq.park_message(
    p_key text, p_queue text, p_exchange text, p_routing_key text, p_body bytea,
    p_headers jsonb, p_properties jsonb, p_code text, p_reason text, p_consumer text,
    p_sha text, p_body_size bigint, p_redrivable boolean, p_body_key text DEFAULT NULL)
RETURNS jsonb
LANGUAGE sql
SET search_path = pg_catalog, idemq
AS $fn$
    WITH p AS (
        INSERT INTO idemq.parked (key, source_queue, exchange, routing_key, body, headers,
            properties, payload_sha256, error_class, error_code, reason, attempts,
            first_attempt_at, last_attempt_at, consumer_id, body_size, redrivable, body_key)
        VALUES (p_key, p_queue, p_exchange, p_routing_key, p_body, p_headers, p_properties,
            coalesce(p_sha, encode(sha256(p_body), 'hex')), 'permanent', p_code, p_reason, 1,
            clock_timestamp(), clock_timestamp(), p_consumer,
            coalesce(p_body_size, octet_length(p_body)),
            p_redrivable AND p_code IS DISTINCT FROM 'forged_redrive', p_body_key)
        RETURNING *)
    SELECT jsonb_build_object(
        'park_id', p.id, 'key', p.key, 'error_class', p.error_class,
        'error_code', p.error_code, 'sqlstate', p.sqlstate, 'reason', p.reason,
        'attempts', p.attempts, 'generation', p.generation,
        'payload_sha256', p.payload_sha256, 'redrivable', p.redrivable,
        'first_attempt_at', p.first_attempt_at, 'last_attempt_at', p.last_attempt_at,
        'parked_at', p.parked_at)
      FROM p;
$fn$;

-- Marks parks whose dead-letter publish the broker confirmed.
CREATE OR REPLACE FUNCTION idemq.mark_dead_lettered(p_ids bigint[])
RETURNS void
LANGUAGE sql
SET search_path = pg_catalog, idemq
AS $fn$
    UPDATE idemq.parked SET dlq_published_at = clock_timestamp()
     WHERE id = ANY (p_ids) AND dlq_published_at IS NULL;
$fn$;

-- Ordered lanes: stores a job the sequence guard deferred (apply_batch said
-- 'deferred'), with its raw message, so the delivery can be acknowledged.
-- Inside the batch transaction. A second call for the key is a no-op. If
-- its turn came already within this transaction (its predecessor was
-- applied later in the same batch), it is stored due.
CREATE OR REPLACE FUNCTION idemq.defer_job(
    p_key text, p_queue text, p_order_key text, p_seq bigint, p_reason text, p_lane integer,
    p_exchange text, p_routing_key text, p_body bytea, p_headers jsonb, p_properties jsonb)
RETURNS void
LANGUAGE sql
SET search_path = pg_catalog, idemq
AS $fn$
    INSERT INTO idemq.deferred (key, source_queue, order_key, seq, reason, lane, exchange,
        routing_key, body, headers, properties)
    VALUES (p_key, p_queue, p_order_key, p_seq, p_reason, p_lane, p_exchange, p_routing_key,
        p_body, p_headers, p_properties)
    ON CONFLICT (key) DO NOTHING;
    UPDATE idemq.deferred d SET due_at = clock_timestamp()
      FROM idemq.order_keys k
     WHERE d.key = p_key AND d.due_at IS NULL AND k.source_queue = d.source_queue
       AND k.order_key = d.order_key AND k.blocked_by IS NULL
       AND (d.seq IS NULL OR d.seq = k.last_seq + 1);
$fn$;

-- Ordered lanes: after a job of an ordered input parked (inside the same
-- transaction). hold_key: its ordering key is held until the job is
-- redriven and applied. Otherwise (continue) a sequenced key skips the
-- parked sequence so its successors flow (they are marked due). A deferred
-- copy is removed either way (the park row holds the message now).
CREATE OR REPLACE FUNCTION idemq.lane_parked(p_queue text, p_order_key text, p_seq bigint,
                                             p_key text, p_hold boolean)
RETURNS void
LANGUAGE plpgsql
SET search_path = pg_catalog, idemq
AS $fn$
DECLARE
    v_last bigint;
BEGIN
    IF p_order_key IS NOT NULL THEN
        INSERT INTO idemq.order_keys (source_queue, order_key) VALUES (p_queue, p_order_key)
        ON CONFLICT DO NOTHING;
        UPDATE idemq.order_keys k
           SET blocked_by = CASE WHEN p_hold THEN coalesce(k.blocked_by, p_key)
                                 ELSE k.blocked_by END,
               last_seq = CASE WHEN NOT p_hold AND p_seq IS NOT NULL
                               THEN greatest(k.last_seq, p_seq) ELSE k.last_seq END,
               updated_at = clock_timestamp()
         WHERE k.source_queue = p_queue AND k.order_key = p_order_key
        RETURNING k.last_seq INTO v_last;
    END IF;
    DELETE FROM idemq.deferred d WHERE d.key = p_key;
    IF p_order_key IS NOT NULL AND NOT p_hold THEN
        PERFORM idemq.mark_due(p_queue, p_order_key, v_last);
    END IF;
END
$fn$;

-- Ordered lanes: marks as due the deferred jobs of an ordering key that its
-- last applied sequence p_last lets through (the next sequence, and jobs
-- without a sequence, which wait only for their elder ones and holds), so
-- idemq.take_deferred finds them through the due_at index. The guard
-- decides again under the key's lock when they are taken.
CREATE OR REPLACE FUNCTION idemq.mark_due(p_queue text, p_order_key text, p_last bigint)
RETURNS void
LANGUAGE sql
SET search_path = pg_catalog, idemq
AS $fn$
    UPDATE idemq.deferred d SET due_at = clock_timestamp()
     WHERE d.source_queue = p_queue AND d.order_key = p_order_key AND d.due_at IS NULL
       AND (d.seq IS NULL OR d.seq = p_last + 1);
$fn$;

-- Ordered lanes: deferred jobs of these queues whose turn has come: those
-- marked due (idemq.mark_due, or a failed attempt's run_after), found
-- through the due_at index, each followed by the chain of consecutive
-- sequences deferred behind it (one transaction can apply a whole chain).
-- At most p_limit rows, in apply order. Reads only: apply_batch decides
-- again under the ordering key's row lock (and unmarks what is not through).
CREATE OR REPLACE FUNCTION idemq.take_deferred(p_queues text[], p_limit integer)
RETURNS TABLE (r_id bigint, r_key text, r_queue text, r_lane integer, r_exchange text,
               r_routing_key text, r_body bytea, r_headers jsonb, r_properties jsonb)
LANGUAGE sql STABLE
SET search_path = pg_catalog, idemq
AS $fn$
    WITH RECURSIVE due AS (
        SELECT d.id, d.source_queue, d.order_key, d.seq
          FROM idemq.deferred d
         WHERE d.due_at <= clock_timestamp() AND d.source_queue = ANY (p_queues)
         ORDER BY d.due_at
         LIMIT p_limit
    ), chain AS (
        SELECT d.id, d.source_queue, d.order_key, d.seq, 1 AS depth FROM due d
        UNION ALL
        SELECT nx.id, nx.source_queue, nx.order_key, nx.seq, c.depth + 1
          FROM chain c
          CROSS JOIN LATERAL (
              SELECT x.id, x.source_queue, x.order_key, x.seq FROM idemq.deferred x
               WHERE x.source_queue = c.source_queue AND x.order_key = c.order_key
                 AND x.seq = c.seq + 1
               ORDER BY x.id LIMIT 1) nx
         WHERE c.seq IS NOT NULL AND c.depth < p_limit
    )
    SELECT x.id, x.key, x.source_queue, x.lane, x.exchange, x.routing_key, x.body, x.headers,
           x.properties
      FROM (SELECT DISTINCT c.id FROM chain c) c
      JOIN idemq.deferred x ON x.id = c.id
     ORDER BY x.source_queue, x.order_key, x.seq NULLS LAST, x.id
     LIMIT p_limit;
$fn$;

-- Ordered lanes: deferred jobs of p_queue waiting longer than p_age_s and
-- not reported yet; marks them reported and returns them (the worker logs
-- each; `idemq jobs show KEY` shows why a job waits).
CREATE OR REPLACE FUNCTION idemq.report_deferred(p_queue text, p_age_s integer)
RETURNS TABLE (r_key text, r_order_key text, r_seq bigint, r_reason text,
               r_waiting_for bigint, r_blocked_by text, r_deferred_at timestamptz)
LANGUAGE sql
SET search_path = pg_catalog, idemq
AS $fn$
    WITH r AS (
        UPDATE idemq.deferred d SET reported_at = clock_timestamp()
         WHERE d.source_queue = p_queue AND d.reported_at IS NULL
           AND d.deferred_at < clock_timestamp() - make_interval(secs => p_age_s)
        RETURNING d.key, d.source_queue, d.order_key, d.seq, d.reason, d.deferred_at)
    SELECT r.key, r.order_key, r.seq, r.reason, k.last_seq + 1, k.blocked_by, r.deferred_at
      FROM r LEFT JOIN idemq.order_keys k USING (source_queue, order_key)
     ORDER BY r.deferred_at;
$fn$;

