-- idemq ledger functions: the claim/apply/record/park transactions.
-- Unlike the versioned migrations (tables), this file is applied as a whole
-- by every `idemq migrate` (CREATE OR REPLACE, inside one transaction), and
-- `idemq run` checks that the database holds this exact text (by SHA-256).
-- A change of a function's result type needs a DROP FUNCTION IF EXISTS
-- before its CREATE here.

-- Applies a batch in one call. p_effects[i] is the signature of input i's
-- effect, e.g. 'public.apply_payout(text,jsonb,jsonb)'; it is resolved via
-- regprocedure, so only an existing function can ever be called.
-- p_jobs is a JSON array of {"k": key, "i": input (1-based), "q": queue,
-- "h": SHA-256 of the raw body (hex), "m": meta object, "p": payload object}. For each job, in order:
--   claim the key (INSERT ... ON CONFLICT on the primary key, which waits for
--   a concurrent claimer to finish); a key already applied or parked is a
--   duplicate (attempt row 'duplicate', no effect); otherwise the effect runs
--   in a subtransaction; success settles the job and records the attempt,
--   an error is returned (job row left claimed) for the caller to classify
--   and record with idemq.record_failure in the same transaction.
CREATE OR REPLACE FUNCTION idemq.apply_batch(p_effects text[], p_jobs jsonb, p_consumer text)
RETURNS TABLE (r_idx integer, r_outcome text, r_attempt integer, r_sqlstate text,
               r_message text, r_started timestamptz, r_finished timestamptz)
LANGUAGE plpgsql AS $fn$
DECLARE
    calls    text[] := '{}';
    j        jsonb;
    v_key    text;
    v_meta   jsonb;
    v_state  text;
    v_att    integer;
    v_sha    text;
    v_result jsonb;
    v_start  timestamptz;
    v_fin    timestamptz;
    v_code   text;
    v_msg    text;
    v_ins    boolean;
    v_failed text[] := '{}';
BEGIN
    FOR n IN 1 .. coalesce(array_length(p_effects, 1), 0) LOOP
        calls[n] := (SELECT format('SELECT %I.%I($1, $2, $3)', ns.nspname, pr.proname)
                       FROM pg_proc pr JOIN pg_namespace ns ON ns.oid = pr.pronamespace
                      WHERE pr.oid = p_effects[n]::regprocedure);
    END LOOP;

    r_idx := 0;
    FOR j IN SELECT e FROM jsonb_array_elements(p_jobs) AS e LOOP
        r_idx := r_idx + 1;
        v_key := j->>'k';
        v_meta := j->'m';
        v_start := clock_timestamp();
        v_sha := j->>'h';

        INSERT INTO idemq.jobs AS t (key, state, source_queue, payload_sha256, first_seen_at)
        VALUES (v_key, 'pending', j->>'q', v_sha, v_start)
        ON CONFLICT (key) DO NOTHING
        RETURNING true INTO v_ins;

        IF v_ins IS NULL THEN
            SELECT t.state, t.attempts INTO v_state, v_att FROM idemq.jobs t WHERE t.key = v_key;
            IF v_state IN ('pending', 'retrying') THEN
                -- Not settled: take the row lock, then look again.
                SELECT t.state, t.attempts INTO v_state, v_att
                  FROM idemq.jobs t WHERE t.key = v_key FOR UPDATE;
            END IF;
            IF v_state IN ('applied', 'parked') THEN
                v_fin := clock_timestamp();
                INSERT INTO idemq.attempts (key, attempt, outcome, started_at, finished_at,
                    queue, routing_key, redelivered, delivery_count, consumer_id)
                VALUES (v_key, v_att, 'duplicate', v_start, v_fin, j->>'q',
                    v_meta->>'routing_key', (v_meta->>'redelivered')::boolean,
                    (v_meta->>'delivery_count')::integer, p_consumer);
                r_outcome := 'duplicate'; r_attempt := v_att; r_sqlstate := NULL; r_message := v_state;
                r_started := v_start; r_finished := v_fin;
                RETURN NEXT;
                CONTINUE;
            END IF;
        ELSE
            v_att := 0;
        END IF;

        v_att := v_att + 1;
        BEGIN
            EXECUTE calls[(j->>'i')::integer] INTO v_result
              USING v_key, j->'p', v_meta || jsonb_build_object('attempt', v_att);
            v_fin := clock_timestamp();
            UPDATE idemq.jobs t SET state = 'applied', attempts = v_att, applied_at = v_fin,
                   last_attempt_at = v_start, result = v_result, payload_sha256 = v_sha
             WHERE t.key = v_key;
            INSERT INTO idemq.attempts (key, attempt, outcome, started_at, finished_at,
                queue, routing_key, redelivered, delivery_count, consumer_id)
            VALUES (v_key, v_att, 'applied', v_start, v_fin, j->>'q',
                v_meta->>'routing_key', (v_meta->>'redelivered')::boolean,
                (v_meta->>'delivery_count')::integer, p_consumer);
            r_outcome := 'applied'; r_attempt := v_att; r_sqlstate := NULL; r_message := NULL;
        EXCEPTION WHEN OTHERS THEN
            GET STACKED DIAGNOSTICS v_code = RETURNED_SQLSTATE, v_msg = MESSAGE_TEXT;
            v_fin := clock_timestamp();
            r_outcome := 'error'; r_attempt := v_att; r_sqlstate := v_code; r_message := v_msg;
            v_failed := v_failed || v_key;
        END;
        r_started := v_start; r_finished := v_fin;
        RETURN NEXT;
    END LOOP;
END
$fn$;

-- Records a failed attempt of a claimed key (inside the batch transaction):
-- the attempt row, the job's last error and state ('retrying', or 'parked'
-- with a park row holding the raw message). Returns the park row id or NULL.
CREATE OR REPLACE FUNCTION idemq.record_failure(
    p_key text, p_attempt integer, p_class text, p_code text, p_sqlstate text,
    p_message text, p_park boolean, p_started timestamptz, p_finished timestamptz,
    p_queue text, p_exchange text, p_routing_key text, p_redelivered boolean,
    p_delivery_count integer, p_consumer text, p_body bytea, p_headers jsonb,
    p_properties jsonb)
RETURNS bigint
LANGUAGE plpgsql AS $fn$
DECLARE
    v_first timestamptz;
    v_id    bigint;
BEGIN
    INSERT INTO idemq.attempts (key, attempt, outcome, started_at, finished_at, error_class,
        error_code, sqlstate, message, queue, routing_key, redelivered, delivery_count,
        consumer_id)
    VALUES (p_key, p_attempt,
        CASE WHEN p_class = 'transient' THEN 'transient_error' ELSE 'permanent_error' END,
        p_started, p_finished, p_class, p_code, p_sqlstate, p_message, p_queue, p_routing_key,
        p_redelivered, p_delivery_count, p_consumer);
    UPDATE idemq.jobs SET
        state = CASE WHEN p_park THEN 'parked' ELSE 'retrying' END,
        attempts = p_attempt, last_attempt_at = p_started, last_error_class = p_class,
        last_sqlstate = p_sqlstate, last_error = p_message
     WHERE key = p_key AND state IN ('pending', 'retrying');
    IF NOT FOUND THEN
        RAISE EXCEPTION 'idemq: key % is not claimed', p_key USING ERRCODE = 'XX000';
    END IF;
    IF p_park THEN
        SELECT min(a.started_at) INTO v_first FROM idemq.attempts a
         WHERE a.key = p_key AND a.outcome <> 'duplicate';
        INSERT INTO idemq.parked (key, source_queue, exchange, routing_key, body, headers,
            properties, payload_sha256, error_class, error_code, sqlstate, reason, attempts,
            first_attempt_at, last_attempt_at, consumer_id)
        VALUES (p_key, p_queue, p_exchange, p_routing_key, p_body, p_headers, p_properties,
            encode(sha256(p_body), 'hex'), p_class, p_code, p_sqlstate, p_message, p_attempt,
            v_first, p_started, p_consumer)
        RETURNING id INTO v_id;
    END IF;
    RETURN v_id;
END
$fn$;

-- Parks a message that could not be decoded into a job (bad JSON, no key,
-- too large): no job row is claimed, the raw message is kept.
CREATE OR REPLACE FUNCTION idemq.park_message(
    p_key text, p_queue text, p_exchange text, p_routing_key text, p_body bytea,
    p_headers jsonb, p_properties jsonb, p_code text, p_reason text, p_consumer text)
RETURNS bigint
LANGUAGE sql AS $fn$
    INSERT INTO idemq.parked (key, source_queue, exchange, routing_key, body, headers,
        properties, payload_sha256, error_class, error_code, reason, attempts,
        first_attempt_at, last_attempt_at, consumer_id)
    VALUES (p_key, p_queue, p_exchange, p_routing_key, p_body, p_headers, p_properties,
        encode(sha256(p_body), 'hex'), 'permanent', p_code, p_reason, 1,
        clock_timestamp(), clock_timestamp(), p_consumer)
    RETURNING id;
$fn$;
