-- idemq ledger functions, part 3: provider effects. Applied with
-- functions.sql and functions_batch.sql as one text by every `idemq migrate`
-- (same rules: CREATE OR REPLACE; a result type change needs a DROP first).
-- Every function pins search_path; an input's SQL effect, called from
-- idemq.provider_apply, therefore runs with search_path pg_catalog, idemq
-- unless it sets its own (qualify names in effects, as the examples do).
--
-- The per-key state machine of a provider job lives here, under the job
-- row's lock (then the intent's, always in that order). The worker's side
-- (consumer/provider_flow.c) sends the HTTP requests these functions ask
-- for and reports every answer back. Each function is one statement, so
-- one transaction, from the caller's side.
--
-- Every function that decides returns the same row: r_action is one of
--   call      send the request (r_lease is its fencing token; r_body the
--             request body to send when the stored one differs from the
--             caller's, or for the reconciler: as stored, so sealed with key
--             r_body_key when that is not NULL; the caller opens it first)
--   lookup    ask the provider (r_lookup: 'key' or 'reference')
--   applied   the provider's reference and the local effect committed
--   duplicate nothing to do for this copy
--   wait      another request holds the key, or its time has not come:
--             come back after r_delay_ms (no attempt used)
--   retry     an attempt failed: come back after r_delay_ms, same key
--   park      parked (r_park: the park's facts, as idemq.park_info)
--   confirmed the provider's reference is recorded (committed): run the
--             local effect next with idemq.provider_confirmed (r_message: a
--             second-reference alarm, if any; r_body: the intent's message
--             when it is sealed at rest, with the key r_body_key: the
--             caller opens it and passes it in as p_body)
--   effect_error  the local effect raised r_sqlstate: classify it, then
--             call idemq.provider_effect_failed
--   leave     (reconciler) nothing to do now

DROP FUNCTION IF EXISTS idemq.provider_begin(jsonb, jsonb, text, bytea, jsonb, text, bytea);
DROP FUNCTION IF EXISTS idemq.provider_result(text, integer, text, text, integer, jsonb, text,
    integer, text, jsonb, jsonb, text, boolean);
DROP FUNCTION IF EXISTS idemq.provider_effect_failed(text, text, text, text, text, jsonb, jsonb,
    text);
DROP FUNCTION IF EXISTS idemq.provider_sweep(text, jsonb, integer, text);
DROP FUNCTION IF EXISTS idemq.provider_step(text, jsonb, jsonb, text, boolean);
DROP FUNCTION IF EXISTS idemq.provider_apply(text, text, jsonb, text, jsonb, jsonb, text);
DROP FUNCTION IF EXISTS idemq.provider_resolve(text, text, text, text, text, jsonb);
-- The step row gained r_body_key (the key that sealed r_body), and
-- provider_begin the key of its sealed request body.
DROP FUNCTION IF EXISTS idemq.provider_confirmed(text, text, jsonb, jsonb, text);
DROP FUNCTION IF EXISTS idemq.provider_sweep(jsonb, integer, integer, text);
-- provider_begin gained the key of the sealed message and its size.
DROP FUNCTION IF EXISTS idemq.provider_begin(jsonb, jsonb, text, bytea, jsonb, text, bytea, text);

-- One attempt row of a provider key (never updated, like every attempt).
CREATE OR REPLACE FUNCTION idemq.provider_note(
    p_key text, p_outcome text, p_started timestamptz, p_class text, p_code text,
    p_message text, p_delay_ms integer, p_meta jsonb, p_consumer text)
RETURNS bigint
LANGUAGE sql SET search_path = pg_catalog, idemq AS $fn$
    INSERT INTO idemq.attempts (key, attempt, generation, outcome, started_at, finished_at,
        error_class, error_code, message, queue, routing_key, redelivered, delivery_count,
        acquired_count, consumer_id, delay_ms, trace_id)
    SELECT j.key, j.attempts, j.generation, p_outcome, p_started, clock_timestamp(), p_class,
        p_code, left(p_message, 2000), j.source_queue, p_meta->>'routing_key',
        (p_meta->>'redelivered')::boolean, (p_meta->>'delivery_count')::integer,
        (p_meta->>'acquired_count')::integer, p_consumer,
        p_delay_ms, idemq.trace_id_of(p_meta)
      FROM idemq.jobs j WHERE j.key = p_key
    RETURNING id;
$fn$;

-- Backoff for the n-th wait or failure: min(max, base * 2^(n-1)), equal
-- jitter, at least 100 ms (the smallest delay bucket).
CREATE OR REPLACE FUNCTION idemq.provider_backoff(p_n integer, p_opts jsonb)
RETURNS integer
LANGUAGE sql VOLATILE SET search_path = pg_catalog, idemq AS $fn$
    SELECT greatest(100, (d / 2 + random() * d / 2)::integer)
      FROM (SELECT least((p_opts->>'max_delay_ms')::numeric,
                         (p_opts->>'base_delay_ms')::numeric
                           * power(2::numeric, least(greatest(p_n, 1) - 1, 30))) AS d) x;
$fn$;

-- The short text of an answer for reasons and notes.
CREATE OR REPLACE FUNCTION idemq.provider_answer_text(p_answer jsonb)
RETURNS text
LANGUAGE sql IMMUTABLE SET search_path = pg_catalog, idemq AS $fn$
    SELECT CASE WHEN p_answer IS NULL THEN 'no answer'
                WHEN coalesce((p_answer->>'status')::integer, 0) = 0
                  THEN 'no answer: ' || coalesce(p_answer->>'detail', '?')
                ELSE 'HTTP ' || (p_answer->>'status') || ': '
                     || left(coalesce(CASE jsonb_typeof(p_answer->'body')
                                        WHEN 'string' THEN p_answer->>'body'
                                        ELSE (p_answer->'body')::text END, ''), 300)
           END;
$fn$;

-- Parks a provider job (locks held): the park row keeps the message the
-- intent stored (sealed as it is stored, with the message's own hash and
-- size), the job becomes parked, the intent p_state (NULL keeps it).
-- Returns the park's facts.
CREATE OR REPLACE FUNCTION idemq.provider_park(
    p_key text, p_class text, p_code text, p_reason text, p_state text, p_consumer text,
    p_meta jsonb)
RETURNS jsonb
LANGUAGE plpgsql SET search_path = pg_catalog, idemq AS $fn$
DECLARE
    v_now   timestamptz := clock_timestamp();
    v_gen   integer;
    v_att   integer;
    v_first timestamptz;
    v_ids   bigint[];
    v_id    bigint;
BEGIN
    UPDATE idemq.jobs j SET state = 'parked', last_error_class = p_class, last_error = p_reason,
           last_sqlstate = NULL, run_after = NULL, last_attempt_at = v_now
     WHERE j.key = p_key
    RETURNING j.generation, j.attempts INTO v_gen, v_att;
    UPDATE idemq.intents i SET state = coalesce(p_state, i.state), lease_until = NULL,
           run_after = NULL, updated_at = v_now
     WHERE i.key = p_key;
    PERFORM idemq.provider_note(p_key, 'permanent_error', v_now, p_class, p_code, p_reason,
                                NULL, p_meta, p_consumer);
    SELECT min(a.started_at) FILTER (WHERE a.generation = v_gen), array_agg(a.id ORDER BY a.id)
      INTO v_first, v_ids
      FROM idemq.attempts a WHERE a.key = p_key;
    INSERT INTO idemq.parked (key, source_queue, exchange, routing_key, body, headers,
        properties, payload_sha256, error_class, error_code, reason, attempts,
        first_attempt_at, last_attempt_at, consumer_id, generation, attempt_ids, body_key,
        body_size)
    SELECT i.key, i.source_queue, i.exchange, i.routing_key, i.body, i.headers, i.properties,
           coalesce(i.body_sha256, encode(sha256(i.body), 'hex')), p_class, p_code,
           left(p_reason, 2000), v_att, coalesce(v_first, v_now), v_now, p_consumer, v_gen,
           coalesce(v_ids, '{}'), i.body_key, coalesce(i.body_size, octet_length(i.body))
      FROM idemq.intents i WHERE i.key = p_key
    RETURNING id INTO v_id;
    RETURN idemq.park_info(v_id);
END
$fn$;

-- The key's job was settled by an input of another kind (a SQL input
-- applied it while this intent was open): the intent parks as key_conflict
-- with its message in a park row of its own; the job is not touched (locks
-- held). Returns the park's facts.
CREATE OR REPLACE FUNCTION idemq.provider_conflict(p_key text, p_reason text, p_meta jsonb,
                                                   p_consumer text)
RETURNS jsonb
LANGUAGE plpgsql SET search_path = pg_catalog, idemq AS $fn$
DECLARE
    v_now  timestamptz := clock_timestamp();
    v_park jsonb;
BEGIN
    UPDATE idemq.intents i SET state = 'parked', lease_until = NULL, run_after = NULL,
           updated_at = v_now
     WHERE i.key = p_key;
    PERFORM idemq.provider_note(p_key, 'permanent_error', v_now, 'permanent', 'key_conflict',
                                p_reason, NULL, p_meta, p_consumer);
    SELECT idemq.park_message(i.key, i.source_queue, i.exchange, i.routing_key, i.body,
                              i.headers, i.properties, 'key_conflict', left(p_reason, 2000),
                              p_consumer, i.body_sha256, i.body_size, true, i.body_key)
      INTO v_park FROM idemq.intents i WHERE i.key = p_key;
    RETURN v_park;
END
$fn$;

-- A copy of a parked key: its park is published again when the first
-- dead-letter publish was never confirmed, else it is a duplicate.
CREATE OR REPLACE FUNCTION idemq.provider_parked_copy(p_key text, p_meta jsonb,
                                                      p_consumer text, p_why text)
RETURNS TABLE (r_action text, r_park jsonb)
LANGUAGE plpgsql SET search_path = pg_catalog, idemq AS $fn$
DECLARE
    v_park bigint;
BEGIN
    SELECT p.id INTO v_park FROM idemq.parked p JOIN idemq.jobs j ON j.key = p.key
     WHERE p.key = p_key AND p.generation = j.generation ORDER BY p.id DESC LIMIT 1;
    PERFORM idemq.provider_note(p_key, 'duplicate', clock_timestamp(), NULL, NULL,
                                'parked: ' || p_why, NULL, p_meta, p_consumer);
    IF v_park IS NOT NULL AND NOT EXISTS (SELECT 1 FROM idemq.parked p
                                           WHERE p.id = v_park AND p.dlq_published_at IS NOT NULL)
    THEN
        r_action := 'park';
        r_park := idemq.park_info(v_park);
    ELSE
        r_action := 'duplicate';
    END IF;
    RETURN NEXT;
END
$fn$;

-- Records the provider's reference p_ref (locks held): the intent becomes
-- 'confirmed'. A reference already recorded is never replaced: a different
-- p_ref is a second charge at the provider, written to the key's history
-- as an alarm, which is returned (NULL when there is none).
CREATE OR REPLACE FUNCTION idemq.provider_confirm(
    p_key text, p_ref text, p_answer jsonb, p_how text, p_meta jsonb, p_consumer text)
RETURNS text
LANGUAGE plpgsql SET search_path = pg_catalog, idemq AS $fn$
DECLARE
    v_now   timestamptz := clock_timestamp();
    v_first text;
    v_alarm text;
BEGIN
    SELECT i.provider_ref INTO v_first FROM idemq.intents i WHERE i.key = p_key;
    IF v_first IS NOT NULL AND p_ref IS DISTINCT FROM v_first THEN
        v_alarm := format('%s: provider reference %s, but %s is recorded for this key: CHECK '
                          'THE PROVIDER FOR A SECOND CHARGE', p_how, p_ref, v_first);
        PERFORM idemq.provider_note(p_key, 'duplicate', v_now, NULL, 'second_reference',
                                    v_alarm, NULL, p_meta, p_consumer);
    END IF;
    UPDATE idemq.intents i SET state = 'confirmed', provider_ref = coalesce(i.provider_ref, p_ref),
           confirmed_at = coalesce(i.confirmed_at, v_now),
           last_response = CASE WHEN v_alarm IS NULL THEN coalesce(p_answer, i.last_response)
                                ELSE i.last_response END,
           lease_until = NULL, run_after = NULL, updated_at = v_now
     WHERE i.key = p_key;
    RETURN v_alarm;
END
$fn$;

-- Records the provider's reference (idemq.provider_confirm) and, in a
-- subtransaction, runs the input's SQL effect (p_opts.effect, a
-- regprocedure text; none = no effect) with the provider's answer in
-- meta.provider, then marks the job and the intent applied. Locks held. An
-- effect error rolls back only the subtransaction: the reference stays
-- recorded (intent 'confirmed') and the error is returned for the caller
-- to classify; r_message holds a second-reference alarm on success. Errors
-- WHEN OTHERS does not catch (57014, P0004) roll back the whole statement:
-- the worker's answers therefore commit the reference first
-- (provider_result) and run the effect in a statement of its own
-- (provider_confirmed); only idemq resolve runs both at once. p_body: the
-- intent's message opened by the caller when it is sealed at rest (NULL:
-- the stored one, as sent); an effect never gets one that does not match
-- the message's hash (22023, an effect error).
CREATE OR REPLACE FUNCTION idemq.provider_apply(
    p_key text, p_ref text, p_answer jsonb, p_how text, p_opts jsonb, p_meta jsonb,
    p_consumer text, p_body bytea)
RETURNS TABLE (r_ok boolean, r_sqlstate text, r_message text)
LANGUAGE plpgsql SET search_path = pg_catalog, idemq AS $fn$
DECLARE
    v_now    timestamptz := clock_timestamp();
    v_int    idemq.intents;
    v_job    idemq.jobs;
    v_call   text;
    v_result jsonb;
    v_meta   jsonb;
    v_alarm  text;
    v_ref    text;
BEGIN
    v_alarm := idemq.provider_confirm(p_key, p_ref, p_answer, p_how, p_meta, p_consumer);
    SELECT * INTO v_int FROM idemq.intents i WHERE i.key = p_key;
    v_ref := v_int.provider_ref; -- the first reference is the job's
    SELECT * INTO v_job FROM idemq.jobs j WHERE j.key = p_key;
    v_meta := coalesce(p_meta, '{}'::jsonb) || jsonb_build_object(
        'attempt', v_job.attempts, 'generation', v_job.generation,
        'provider', jsonb_build_object(
            'name', v_int.provider, 'reference', v_ref, 'how', p_how,
            'answer', v_int.last_response, 'requests', v_int.requests,
            'first_request_at', v_int.first_request_at, 'confirmed_at', v_int.confirmed_at,
            'latency_ms', (extract(epoch FROM v_int.confirmed_at - v_int.first_request_at)
                           * 1000)::bigint));
    -- the producer's trace context, as idemq.apply_batch sets it
    PERFORM idemq.trace_meta(coalesce(p_meta, '{}'::jsonb));
    IF p_opts->>'effect' IS NOT NULL THEN
        SELECT format('SELECT %I.%I($1, $2, $3)', ns.nspname, pr.proname) INTO v_call
          FROM pg_proc pr JOIN pg_namespace ns ON ns.oid = pr.pronamespace
         WHERE pr.oid = (p_opts->>'effect')::regprocedure;
    END IF;
    BEGIN
        IF v_call IS NOT NULL AND v_int.body_key IS NOT NULL
           AND (p_body IS NULL
                OR encode(sha256(p_body), 'hex') IS DISTINCT FROM v_int.body_sha256) THEN
            RAISE EXCEPTION 'the message of % is sealed with key % and was not opened for the '
                            'local effect', p_key, v_int.body_key USING ERRCODE = '22023';
        END IF;
        IF v_call IS NOT NULL THEN
            EXECUTE v_call INTO v_result
              USING p_key, convert_from(CASE WHEN v_int.body_key IS NULL THEN v_int.body
                                             ELSE p_body END, 'UTF8')::jsonb, v_meta;
        END IF;
        UPDATE idemq.jobs j SET state = 'applied', applied_at = v_now, last_attempt_at = v_now,
               run_after = NULL,
               result = coalesce(v_result, jsonb_build_object('provider_reference', v_ref))
         WHERE j.key = p_key;
        UPDATE idemq.intents i SET state = 'applied', updated_at = v_now WHERE i.key = p_key;
        PERFORM idemq.provider_note(p_key, 'applied', v_now, NULL, NULL,
            format('provider reference %s (%s)', v_ref, p_how), NULL, p_meta, p_consumer);
        r_ok := true;
        r_message := v_alarm;
    EXCEPTION WHEN OTHERS THEN
        GET STACKED DIAGNOSTICS r_sqlstate = RETURNED_SQLSTATE, r_message = MESSAGE_TEXT;
        r_ok := false;
    END;
    RETURN NEXT;
END
$fn$;

-- Transaction 2b: the local effect of key p_key, whose reference is
-- recorded and committed (intent 'confirmed'). p_how says how the
-- reference was found ('answer', 'lookup by key', 'local retry', ...).
-- Returns applied, effect_error (classify it, then provider_effect_failed),
-- or duplicate when the key was settled meanwhile. When the statement
-- fails as a whole (a statement timeout, an ASSERT), the reference stays
-- recorded: the caller classifies that error as the effect's.
CREATE OR REPLACE FUNCTION idemq.provider_confirmed(p_key text, p_how text, p_opts jsonb,
                                                    p_meta jsonb, p_consumer text,
                                                    p_body bytea DEFAULT NULL)
RETURNS TABLE (r_action text, r_attempt integer, r_lease integer, r_delay_ms integer,
               r_park jsonb, r_message text, r_lookup text, r_sqlstate text, r_body bytea,
               r_body_key text)
LANGUAGE plpgsql SET search_path = pg_catalog, idemq AS $fn$
DECLARE
    v_int idemq.intents;
    v_ok  boolean;
BEGIN
    SELECT j.attempts INTO r_attempt FROM idemq.jobs j WHERE j.key = p_key FOR UPDATE;
    SELECT * INTO v_int FROM idemq.intents i WHERE i.key = p_key FOR UPDATE;
    IF v_int.key IS NULL OR v_int.state <> 'confirmed' THEN
        r_action := 'duplicate';
        r_message := format('the intent is %s', coalesce(v_int.state, 'gone'));
        RETURN NEXT;
        RETURN;
    END IF;
    SELECT a.r_ok, a.r_sqlstate, a.r_message INTO v_ok, r_sqlstate, r_message
      FROM idemq.provider_apply(p_key, v_int.provider_ref, NULL, p_how, p_opts, p_meta,
                                p_consumer, p_body) a;
    r_action := CASE WHEN v_ok THEN 'applied' ELSE 'effect_error' END;
    RETURN NEXT;
END
$fn$;

-- The next step of a due intent (locks held; state unknown or waiting; a
-- pending one whose lease ran out is counted as an unknown outcome first).
-- p_sweep: the reconciler asks (no message at hand; it sends requests
-- itself).
CREATE OR REPLACE FUNCTION idemq.provider_step(p_key text, p_opts jsonb, p_meta jsonb,
                                               p_consumer text, p_sweep boolean)
RETURNS TABLE (r_action text, r_attempt integer, r_lease integer, r_delay_ms integer,
               r_park jsonb, r_message text, r_lookup text, r_sqlstate text, r_body bytea,
               r_body_key text)
LANGUAGE plpgsql SET search_path = pg_catalog, idemq AS $fn$
DECLARE
    v_now       timestamptz := clock_timestamp();
    v_int       idemq.intents;
    v_lease     interval := make_interval(secs => (p_opts->>'lease_ms')::numeric / 1000);
    v_window    interval := make_interval(secs => (p_opts->>'key_window_s')::numeric);
    v_timeout   interval := make_interval(secs => (p_opts->>'timeout_ms')::numeric / 1000);
    v_max       integer := (p_opts->>'max_attempts')::integer;
    v_uncertain boolean;
    v_open      boolean;
    v_key_ok    boolean;
    v_att       integer;
    v_jstate    text;
BEGIN
    SELECT * INTO v_int FROM idemq.intents i WHERE i.key = p_key;
    SELECT j.attempts, j.state INTO r_attempt, v_jstate FROM idemq.jobs j WHERE j.key = p_key;
    IF v_jstate IN ('applied', 'stale') THEN
        -- Another input's effect settled the key: never turned back into a
        -- provider state, nothing sent.
        r_park := idemq.provider_conflict(p_key, format('key %s is %s by another (non-provider) '
            'input while its provider intent was %s: nothing sent. A request of this key may '
            'have applied at %s: check the provider (keys are business keys: keep them apart '
            'per input)', p_key, v_jstate, v_int.state, v_int.provider), p_meta, p_consumer);
        r_action := 'park';
        RETURN NEXT;
        RETURN;
    END IF;
    IF v_int.state = 'pending' THEN
        -- No answer was recorded before the lease ran out: a crash, a lost
        -- connection, or an abandoned call. The request may have applied.
        UPDATE idemq.intents i SET state = 'unknown', unknowns = i.unknowns + 1,
               uncertain = true, last_class = 'lease_expired', lease_until = NULL,
               updated_at = v_now
         WHERE i.key = p_key RETURNING * INTO v_int;
        UPDATE idemq.jobs j SET state = 'provider_unknown' WHERE j.key = p_key;
        PERFORM idemq.provider_note(p_key, 'provider_unknown', v_now, 'unknown_outcome',
            'lease_expired', format('no answer recorded for lease %s before its deadline '
            '(a crash or a lost connection)%s', v_int.lease_no,
            CASE WHEN p_sweep THEN ' - reconciler' ELSE '' END), NULL, p_meta, p_consumer);
    END IF;
    IF v_int.state = 'confirmed' THEN
        -- The provider confirmed, the local effect has not committed yet:
        -- the caller runs it next (idemq.provider_confirmed), with the
        -- message opened when it is sealed.
        r_action := 'confirmed';
        r_body := CASE WHEN v_int.body_key IS NOT NULL THEN v_int.body END;
        r_body_key := v_int.body_key;
        RETURN NEXT;
        RETURN;
    END IF;

    v_uncertain := v_int.uncertain;
    v_open := v_int.idempotent AND v_now + v_timeout < v_int.first_request_at + v_window;
    -- A lookup by key is only trusted while the provider still keeps the key.
    v_key_ok := v_int.idempotent AND (p_opts->>'lookup_key')::boolean
                AND v_now < v_int.first_request_at + v_window;

    IF v_uncertain AND (v_key_ok OR (p_opts->>'lookup_ref')::boolean) THEN
        r_lookup := CASE WHEN v_key_ok THEN 'key' ELSE 'reference' END;
        UPDATE idemq.intents i SET state = 'pending', lease_no = i.lease_no + 1,
               lookups = i.lookups + 1, lease_until = v_now + v_lease, run_after = NULL,
               updated_at = v_now
         WHERE i.key = p_key RETURNING * INTO v_int;
        UPDATE idemq.jobs j SET state = 'provider_pending', run_after = NULL WHERE j.key = p_key;
        PERFORM idemq.provider_note(p_key, 'provider_lookup', v_now, NULL, NULL,
            format('looking up by %s (lease %s)%s', r_lookup, v_int.lease_no,
                   CASE WHEN p_sweep THEN ' - reconciler' ELSE '' END), NULL, p_meta,
            p_consumer);
        r_action := 'lookup'; r_lease := v_int.lease_no;
        RETURN NEXT;
        RETURN;
    END IF;

    IF v_uncertain AND v_int.idempotent AND NOT v_open THEN
        -- Past the provider's key window a resend would be a new request,
        -- and an earlier one may have applied: never resent.
        r_park := idemq.provider_park(p_key, 'unknown_outcome', 'key_window_expired',
            format('the outcome is unknown and the first request (%s) is older than the '
                   'provider''s key window (%s s); no lookup can settle it: not resent. Check '
                   'the provider, then idemq resolve.', v_int.first_request_at,
                   p_opts->>'key_window_s'),
            'parked', p_consumer, p_meta);
        r_action := 'park';
        RETURN NEXT;
        RETURN;
    END IF;
    IF v_uncertain AND NOT v_int.idempotent THEN
        -- A provider without keys is never sent a request twice blindly.
        r_park := idemq.provider_park(p_key, 'unknown_outcome', 'provider_unknown',
            format('the outcome of the request is unknown (%s) and the provider neither '
                   'deduplicates nor can be looked up: not resent. Check the provider, then '
                   'idemq resolve.', idemq.provider_answer_text(v_int.last_response)),
            'parked', p_consumer, p_meta);
        r_action := 'park';
        RETURN NEXT;
        RETURN;
    END IF;
    IF v_int.unknowns + v_int.failures >= v_max THEN
        r_park := idemq.provider_park(p_key,
            CASE WHEN v_uncertain THEN 'unknown_outcome' ELSE 'transient' END,
            CASE WHEN v_uncertain THEN 'provider_unknown' ELSE 'retries_exhausted' END,
            format('%s unknown outcomes and %s unsent requests in this generation '
                   '(retry.max_attempts %s); last: %s', v_int.unknowns, v_int.failures, v_max,
                   idemq.provider_answer_text(v_int.last_response)),
            CASE WHEN v_uncertain THEN 'parked' ELSE 'not_applied' END, p_consumer, p_meta);
        r_action := 'park';
        RETURN NEXT;
        RETURN;
    END IF;
    -- Send (again) under the same key.
    UPDATE idemq.jobs j SET state = 'provider_pending', attempts = j.attempts + 1,
           last_attempt_at = v_now, run_after = NULL
     WHERE j.key = p_key RETURNING j.attempts INTO v_att;
    -- Nothing applied under the key so far (not uncertain): past the key
    -- window this request starts a new one.
    UPDATE idemq.intents i SET state = 'pending', lease_no = i.lease_no + 1,
           requests = i.requests + 1, last_request_at = v_now,
           first_request_at = CASE WHEN v_int.idempotent AND NOT v_open THEN v_now
                                   ELSE coalesce(i.first_request_at, v_now) END,
           lease_until = v_now + v_lease, run_after = NULL, updated_at = v_now
     WHERE i.key = p_key RETURNING * INTO v_int;
    PERFORM idemq.provider_note(p_key, 'provider_request', v_now, NULL, NULL,
        format('request %s to %s (lease %s, same key)%s', v_int.requests, v_int.provider,
               v_int.lease_no, CASE WHEN p_sweep THEN ' - reconciler' ELSE '' END),
        NULL, p_meta, p_consumer);
    r_action := 'call'; r_lease := v_int.lease_no; r_attempt := v_att;
    r_body := v_int.request_body; r_body_key := v_int.request_body_key;
    RETURN NEXT;
END
$fn$;

-- Transaction 1 of a delivery of a provider input. p_job is the job as
-- idemq.apply_batch reads it ({"k","i","q","h","m","p"}); p_opts holds the
-- input's provider settings (see consumer/provider_flow.c); p_body and
-- p_props the raw message (kept for parking and the local effect; p_body
-- sealed with key p_body_key when that is not NULL, p_body_size then the
-- message's own size and p_job.h its hash); p_request_sha/p_request_body
-- what this copy would send (p_request_body sealed with key
-- p_request_body_key when that is not NULL; p_request_sha is the hash of
-- the request itself). Claims the key, records the intent as pending
-- on first sight, and says what to do (see the top of this file).
CREATE OR REPLACE FUNCTION idemq.provider_begin(
    p_job jsonb, p_opts jsonb, p_consumer text, p_body bytea, p_props jsonb,
    p_request_sha text, p_request_body bytea, p_request_body_key text, p_body_key text,
    p_body_size bigint)
RETURNS TABLE (r_action text, r_attempt integer, r_lease integer, r_delay_ms integer,
               r_park jsonb, r_message text, r_lookup text, r_sqlstate text, r_body bytea,
               r_body_key text)
LANGUAGE plpgsql SET search_path = pg_catalog, idemq AS $fn$
DECLARE
    v_key   text := p_job->>'k';
    v_q     text := p_job->>'q';
    v_meta  jsonb := p_job->'m';
    v_now   timestamptz := clock_timestamp();
    v_lease interval := make_interval(secs => (p_opts->>'lease_ms')::numeric / 1000);
    v_new   boolean;
    v_job   idemq.jobs;
    v_int   idemq.intents;
    v_hgen  jsonb;
    v_note  text;
BEGIN
    INSERT INTO idemq.jobs (key, state, source_queue, payload_sha256, first_seen_at, attempts,
                            last_attempt_at)
    VALUES (v_key, 'provider_pending', v_q, p_job->>'h', v_now, 1, v_now)
    ON CONFLICT (key) DO NOTHING
    RETURNING true INTO v_new;
    IF v_new THEN
        INSERT INTO idemq.intents (key, input, provider, source_queue, idempotent, state,
            request_sha256, request_body, request_body_key, lease_no, requests,
            first_request_at, last_request_at, lease_until, body, exchange, routing_key,
            headers, properties, body_key, body_sha256, body_size)
        VALUES (v_key, p_opts->>'input', p_opts->>'provider', v_q,
            (p_opts->>'idempotent')::boolean, 'pending', p_request_sha, p_request_body,
            p_request_body_key, 1, 1,
            v_now, v_now, v_now + v_lease, p_body, v_meta->>'exchange', v_meta->>'routing_key',
            v_meta->'headers', p_props, p_body_key,
            CASE WHEN p_body_key IS NOT NULL THEN p_job->>'h' END,
            CASE WHEN p_body_key IS NOT NULL THEN p_body_size END);
        PERFORM idemq.provider_note(v_key, 'provider_request', v_now, NULL, NULL,
            format('request 1 to %s (lease 1)', p_opts->>'provider'), NULL, v_meta, p_consumer);
        r_action := 'call'; r_attempt := 1; r_lease := 1;
        RETURN NEXT;
        RETURN;
    END IF;

    SELECT * INTO v_job FROM idemq.jobs j WHERE j.key = v_key FOR UPDATE;
    SELECT * INTO v_int FROM idemq.intents i WHERE i.key = v_key FOR UPDATE;
    r_attempt := v_job.attempts;
    IF v_job.state IN ('applied', 'stale') THEN
        PERFORM idemq.provider_note(v_key, 'duplicate', v_now, NULL, NULL,
            CASE WHEN v_int.provider_ref IS NOT NULL
                 THEN 'applied: provider reference ' || v_int.provider_ref
                 ELSE 'applied' END, NULL, v_meta, p_consumer);
        r_action := 'duplicate';
        RETURN NEXT;
        RETURN;
    END IF;
    IF v_int.key IS NULL THEN
        IF v_job.state = 'parked' THEN
            RETURN QUERY SELECT c.r_action, v_job.attempts, NULL::integer, NULL::integer,
                c.r_park, NULL::text, NULL::text, NULL::text, NULL::bytea, NULL::text
              FROM idemq.provider_parked_copy(v_key, v_meta, p_consumer,
                                              'not a provider job') c;
            RETURN;
        END IF;
        -- The key belongs to a job of a non-provider input: park this copy
        -- without touching that job.
        r_park := idemq.park_message(v_key, v_q, v_meta->>'exchange', v_meta->>'routing_key',
            p_body, v_meta->'headers', p_props, 'key_conflict',
            format('key %s belongs to a %s job of another (non-provider) input', v_key,
                   v_job.state), p_consumer,
            CASE WHEN p_body_key IS NOT NULL THEN p_job->>'h' END,
            CASE WHEN p_body_key IS NOT NULL THEN p_body_size END, true, p_body_key);
        r_action := 'park';
        RETURN NEXT;
        RETURN;
    END IF;

    IF v_job.state = 'parked' THEN
        v_hgen := v_meta->'headers'->'x-idemq-generation';
        IF NOT coalesce(jsonb_typeof(v_hgen) = 'number'
                        AND v_hgen::text::integer = v_job.generation, false) THEN
            RETURN QUERY SELECT c.r_action, v_job.attempts, NULL::integer, NULL::integer,
                c.r_park, NULL::text, NULL::text, NULL::text, NULL::bytea, NULL::text
              FROM idemq.provider_parked_copy(v_key, v_meta, p_consumer, v_int.state) c;
            RETURN;
        END IF;
        -- A redrive of the current park.
        IF v_int.state = 'discarded' THEN
            PERFORM idemq.provider_note(v_key, 'duplicate', v_now, NULL, NULL,
                'redrive of a key an operator discarded: dropped', NULL, v_meta, p_consumer);
            r_action := 'duplicate';
            RETURN NEXT;
            RETURN;
        END IF;
        IF v_int.provider_ref IS NULL AND v_int.state <> 'not_applied'
           AND (v_int.state = 'parked' OR v_int.uncertain)
           AND NOT ((p_opts->>'lookup_key')::boolean OR (p_opts->>'lookup_ref')::boolean) THEN
            -- Uncertain and nothing can settle it: back to the dead letters.
            RETURN QUERY SELECT 'park'::text, v_job.attempts, NULL::integer, NULL::integer,
                idemq.park_info(p.id), 'the outcome is unknown: settle it with idemq resolve '
                'before a redrive'::text, NULL::text, NULL::text, NULL::bytea, NULL::text
              FROM idemq.parked p WHERE p.key = v_key AND p.generation = v_job.generation
             ORDER BY p.id DESC LIMIT 1;
            PERFORM idemq.provider_note(v_key, 'duplicate', v_now, NULL, NULL,
                'redrive refused: the outcome is unknown; settle it with idemq resolve',
                NULL, v_meta, p_consumer);
            RETURN;
        END IF;
        INSERT INTO idemq.redrives (key, generation, park_id, source, consumer_id)
        VALUES (v_key, v_job.generation + 1,
            CASE WHEN jsonb_typeof(v_meta->'headers'->'x-idemq-park-id') = 'number'
                 THEN (v_meta->'headers'->>'x-idemq-park-id')::bigint END,
            coalesce(v_meta->'headers'->>'x-idemq-redriven-by', 'broker'), p_consumer);
        -- Its parks are dealt with: the message is back in flight (as for a
        -- SQL key, functions.sql); a new park of this generation is a new row.
        PERFORM idemq.close_park(p.id, 'redriven to generation ' || (v_job.generation + 1),
            coalesce(v_meta->'headers'->>'x-idemq-redriven-by', 'broker'))
           FROM idemq.parked p WHERE p.key = v_key AND p.generation <= v_job.generation;
        UPDATE idemq.jobs j SET generation = j.generation + 1, budget_base = j.attempts,
               state = 'provider_unknown', run_after = NULL
         WHERE j.key = v_key;
        UPDATE idemq.intents i SET generation = i.generation + 1, unknowns = 0, waits = 0,
               failures = 0, updated_at = v_now, run_after = NULL,
               -- a recorded reference: the local effect runs again; uncertain
               -- parks are looked up first (or refused above); the others
               -- are resent
               uncertain = (i.provider_ref IS NULL AND i.state <> 'not_applied'
                            AND (i.state = 'parked' OR i.uncertain)),
               state = CASE WHEN i.provider_ref IS NOT NULL THEN 'confirmed'
                            WHEN i.state = 'parked' THEN 'unknown' ELSE 'waiting' END
         WHERE i.key = v_key;
        RETURN QUERY SELECT * FROM idemq.provider_step(v_key, p_opts, v_meta, p_consumer, false);
        RETURN;
    END IF;

    IF v_int.request_sha256 <> p_request_sha THEN
        -- Another payload under the same key: the first request is the one
        -- the provider knows; only it is ever sent under this key.
        v_note := format('this copy''s request differs (sha256 %s); the first request '
                            '(sha256 %s) is the one sent', left(p_request_sha, 12),
                            left(v_int.request_sha256, 12));
    END IF;
    IF v_int.state = 'pending' AND v_int.lease_until > v_now THEN
        r_delay_ms := greatest(100, ceil(extract(epoch FROM v_int.lease_until - v_now) * 1000));
        PERFORM idemq.provider_note(v_key, 'delayed', v_now, NULL, NULL,
            format('lease %s of %s in flight until %s: this copy waits', v_int.lease_no,
                   v_int.provider, v_int.lease_until), r_delay_ms, v_meta, p_consumer);
        r_action := 'wait';
        RETURN NEXT;
        RETURN;
    END IF;
    IF v_int.state <> 'pending' AND coalesce(v_int.run_after, '-infinity') > v_now + interval '50 ms'
    THEN
        r_delay_ms := least(2147483647, ceil(extract(epoch FROM v_int.run_after - v_now) * 1000));
        PERFORM idemq.provider_note(v_key, 'delayed', v_now, NULL, NULL,
            format('intent %s: next step at %s', v_int.state, v_int.run_after), r_delay_ms,
            v_meta, p_consumer);
        r_action := 'wait';
        RETURN NEXT;
        RETURN;
    END IF;
    RETURN QUERY SELECT s.r_action, s.r_attempt, s.r_lease, s.r_delay_ms, s.r_park,
        coalesce(s.r_message, v_note), s.r_lookup, s.r_sqlstate,
        CASE WHEN v_int.request_sha256 <> p_request_sha OR s.r_action = 'confirmed'
             THEN s.r_body END,
        CASE WHEN v_int.request_sha256 <> p_request_sha OR s.r_action = 'confirmed'
             THEN s.r_body_key END
      FROM idemq.provider_step(v_key, p_opts, v_meta, p_consumer, false) s;
END
$fn$;

-- Transaction 2: what became of request or lookup p_lease of key p_key.
-- p_class is effect_http's class name (success, permanent, conflict,
-- rate_limited, unknown, not_sent, not_found), p_answer {"status",
-- "body", "detail", ...}, p_ref the reference found ("" if none),
-- p_retry_after_ms the 429's Retry-After (-1 if none). p_sweep: the
-- reconciler's request (no message at hand).
CREATE OR REPLACE FUNCTION idemq.provider_result(
    p_key text, p_lease integer, p_op text, p_class text, p_status integer, p_answer jsonb,
    p_ref text, p_retry_after_ms integer, p_detail text, p_opts jsonb, p_meta jsonb,
    p_consumer text, p_sweep boolean)
RETURNS TABLE (r_action text, r_attempt integer, r_lease integer, r_delay_ms integer,
               r_park jsonb, r_message text, r_lookup text, r_sqlstate text, r_body bytea,
               r_body_key text)
LANGUAGE plpgsql SET search_path = pg_catalog, idemq AS $fn$
DECLARE
    v_now       timestamptz := clock_timestamp();
    v_job       idemq.jobs;
    v_int       idemq.intents;
    v_uncertain boolean;
    v_what      text := CASE WHEN p_op = 'call' THEN 'request' ELSE 'lookup' END;
    v_text      text := idemq.provider_answer_text(p_answer);
    v_wait_max  integer := (p_opts->>'wait_max')::integer;
    v_deadline  timestamptz;
    v_quiet     timestamptz;
BEGIN
    SELECT * INTO v_job FROM idemq.jobs j WHERE j.key = p_key FOR UPDATE;
    SELECT * INTO v_int FROM idemq.intents i WHERE i.key = p_key FOR UPDATE;
    IF v_int.key IS NULL THEN
        RAISE EXCEPTION 'idemq: no intent for key %', p_key USING ERRCODE = 'XX000';
    END IF;
    r_attempt := v_job.attempts;

    IF v_job.state IN ('applied', 'stale') AND v_int.state <> 'applied' THEN
        -- Another input's effect settled the key meanwhile: a reference is
        -- still recorded (a fact), the job is not touched.
        IF p_class = 'success' AND p_ref <> '' THEN
            r_message := idemq.provider_confirm(p_key, p_ref, p_answer,
                CASE WHEN p_op = 'call' THEN 'answer' ELSE 'lookup by ' || p_op END,
                p_meta, p_consumer);
        END IF;
        v_text := format('key %s is %s by another (non-provider) input; the provider '
            'answered %s %s: %s%s. Check the provider', p_key, v_job.state, v_what, p_lease,
            v_text, CASE WHEN p_ref <> '' THEN ' (reference ' || p_ref || ')' ELSE '' END);
        IF v_int.state IN ('parked', 'discarded') THEN -- parked already: noted only
            UPDATE idemq.intents i SET state = v_int.state WHERE i.key = p_key;
            PERFORM idemq.provider_note(p_key, 'duplicate', v_now, NULL, 'key_conflict', v_text,
                                        NULL, p_meta, p_consumer);
            r_action := 'duplicate';
        ELSE
            r_park := idemq.provider_conflict(p_key, v_text, p_meta, p_consumer);
            r_action := 'park';
        END IF;
        RETURN NEXT;
        RETURN;
    END IF;

    IF p_class = 'success' AND p_ref <> '' THEN
        -- A confirmed reference is a fact, whichever request it answers.
        IF v_int.state = 'applied' THEN
            r_message := CASE WHEN v_int.provider_ref IS DISTINCT FROM p_ref
                     THEN format('%s %s answered reference %s, but %s is applied: CHECK THE '
                                 'PROVIDER FOR A SECOND CHARGE', v_what, p_lease, p_ref,
                                 v_int.provider_ref)
                     ELSE format('late answer of %s %s: already applied', v_what, p_lease) END;
            PERFORM idemq.provider_note(p_key, 'duplicate', v_now, NULL, NULL, r_message, NULL,
                                        p_meta, p_consumer);
            r_action := 'duplicate';
            RETURN NEXT;
            RETURN;
        END IF;
        IF v_job.state = 'parked' THEN
            UPDATE idemq.intents i SET provider_ref = coalesce(i.provider_ref, p_ref),
                   last_response = p_answer, updated_at = v_now WHERE i.key = p_key;
            RETURN QUERY SELECT c.r_action, v_job.attempts, NULL::integer, NULL::integer,
                c.r_park, NULL::text, NULL::text, NULL::text, NULL::bytea, NULL::text
              FROM idemq.provider_parked_copy(p_key, p_meta, p_consumer,
                format('late success: provider reference %s; settle with idemq resolve %s '
                       '--applied %s', p_ref, p_key, p_ref)) c;
            RETURN;
        END IF;
        IF p_op <> 'call' THEN
            PERFORM idemq.provider_note(p_key, 'provider_lookup', v_now, NULL, NULL,
                format('lookup %s found provider reference %s', p_lease, p_ref), NULL, p_meta,
                p_consumer);
        END IF;
        -- Recorded and committed before the local effect runs (its own
        -- statement, idemq.provider_confirmed): nothing the effect does can
        -- lose the reference.
        r_message := idemq.provider_confirm(p_key, p_ref, p_answer,
                                            CASE WHEN p_op = 'call' THEN 'answer'
                                                 ELSE 'lookup by ' || p_op END,
                                            p_meta, p_consumer);
        r_action := 'confirmed';
        r_body := CASE WHEN v_int.body_key IS NOT NULL THEN v_int.body END;
        r_body_key := v_int.body_key;
        RETURN NEXT;
        RETURN;
    END IF;

    IF v_int.state <> 'pending' OR v_int.lease_no <> p_lease THEN
        -- A late answer of a request that no longer holds the intent.
        PERFORM idemq.provider_note(p_key,
            CASE WHEN p_class IN ('unknown', 'success') THEN 'provider_unknown'
                 ELSE 'provider_wait' END, v_now, p_class, 'stale_lease',
            format('late answer of %s %s (intent %s, lease %s): %s', v_what, p_lease,
                   v_int.state, v_int.lease_no, v_text), NULL, p_meta, p_consumer);
        IF v_job.state = 'parked' THEN
            RETURN QUERY SELECT c.r_action, v_job.attempts, NULL::integer, NULL::integer,
                c.r_park, NULL::text, NULL::text, NULL::text, NULL::bytea, NULL::text
              FROM idemq.provider_parked_copy(p_key, p_meta, p_consumer, v_int.state) c;
            RETURN;
        END IF;
        r_action := 'wait';
        r_delay_ms := least(2147483647, greatest(100, ceil(extract(epoch FROM
            greatest(coalesce(v_int.lease_until, v_now), coalesce(v_int.run_after, v_now)) - v_now)
            * 1000)));
        RETURN NEXT;
        RETURN;
    END IF;

    UPDATE idemq.intents i SET last_status = nullif(p_status, 0), last_class = p_class,
           last_response = p_answer, lease_until = NULL, updated_at = v_now
     WHERE i.key = p_key RETURNING * INTO v_int;
    v_uncertain := v_int.uncertain;

    IF p_op = 'call' AND p_class = 'success' THEN
        r_park := idemq.provider_park(p_key, 'unknown_outcome', 'provider_bad_response',
            format('the provider answered %s without a usable reference field %s (%s): the '
                   'charge probably happened. Find it, then idemq resolve %s --applied REF',
                   v_text, p_opts->>'reference_field', coalesce(nullif(p_detail, ''), 'absent'),
                   p_key), 'parked', p_consumer, p_meta);
        r_action := 'park';
    ELSIF p_op = 'call' AND p_class = 'permanent' AND v_uncertain THEN
        -- A 4xx to a resend says nothing about the earlier request of this
        -- key (a 401 during a credential rotation, a WAF, a changed path):
        -- it may have applied. The intent stays uncertain; only an answer
        -- about this key, or an operator, settles it.
        r_park := idemq.provider_park(p_key, 'unknown_outcome', 'provider_rejected',
            format('the provider rejected the resend (%s), but an earlier request of this key '
                   'may have applied: the outcome is unknown. Check the provider, then idemq '
                   'resolve.', v_text), 'parked', p_consumer, p_meta);
        r_action := 'park';
    ELSIF p_op = 'call' AND p_class = 'permanent' THEN
        r_park := idemq.provider_park(p_key, 'permanent', 'provider_rejected',
            'the provider rejected the request: ' || v_text, 'rejected', p_consumer, p_meta);
        r_action := 'park';
    ELSIF p_class IN ('conflict', 'rate_limited') THEN
        -- A 409 from a provider with keys: a request under this key is in
        -- progress there, so one may apply: uncertain from now on.
        UPDATE idemq.intents i SET waits = i.waits + 1,
               uncertain = i.uncertain OR (p_class = 'conflict' AND i.idempotent)
         WHERE i.key = p_key
        RETURNING * INTO v_int;
        v_uncertain := v_int.uncertain;
        r_delay_ms := CASE WHEN p_class = 'rate_limited' AND p_retry_after_ms >= 0
                           THEN greatest(100, p_retry_after_ms)
                           ELSE idemq.provider_backoff(v_int.waits, p_opts) END;
        IF p_class = 'rate_limited' AND p_retry_after_ms > (p_opts->>'retry_after_max_ms')::integer
        THEN
            r_park := idemq.provider_park(p_key,
                CASE WHEN v_uncertain THEN 'unknown_outcome' ELSE 'transient' END,
                'provider_rate_limited',
                format('the provider asked to wait %s ms (Retry-After), more than '
                       'provider.retry_after_max_ms %s', p_retry_after_ms,
                       p_opts->>'retry_after_max_ms'),
                CASE WHEN v_uncertain THEN 'parked' ELSE 'not_applied' END, p_consumer, p_meta);
            r_action := 'park';
        ELSIF v_int.waits >= v_wait_max THEN
            r_park := idemq.provider_park(p_key,
                CASE WHEN v_uncertain OR p_class = 'conflict' THEN 'unknown_outcome'
                     ELSE 'transient' END,
                'provider_waits_exhausted',
                format('%s 409/429 answers in this generation (provider.wait_max %s); last: %s',
                       v_int.waits, v_wait_max, v_text),
                CASE WHEN v_uncertain OR p_class = 'conflict' THEN 'parked'
                     ELSE 'not_applied' END, p_consumer, p_meta);
            r_action := 'park';
        ELSE
            UPDATE idemq.intents i
               SET state = CASE WHEN v_uncertain THEN 'unknown' ELSE 'waiting' END,
                   run_after = v_now + make_interval(secs => r_delay_ms / 1000.0)
             WHERE i.key = p_key;
            UPDATE idemq.jobs j SET state = 'provider_unknown',
                   run_after = v_now + make_interval(secs => r_delay_ms / 1000.0)
             WHERE j.key = p_key;
            PERFORM idemq.provider_note(p_key, 'provider_wait', v_now, 'transient', p_class,
                format('%s %s: %s; wait %s of %s', v_what, p_lease, v_text, v_int.waits,
                       v_wait_max), r_delay_ms, p_meta, p_consumer);
            r_action := 'retry';
        END IF;
    ELSIF p_op = 'call' AND p_class = 'unknown' THEN
        UPDATE idemq.intents i SET unknowns = i.unknowns + 1, uncertain = true, state = 'unknown'
         WHERE i.key = p_key RETURNING * INTO v_int;
        UPDATE idemq.jobs j SET state = 'provider_unknown' WHERE j.key = p_key;
        PERFORM idemq.provider_note(p_key, 'provider_unknown', v_now, 'unknown_outcome', p_class,
            format('request %s: %s', p_lease, v_text), NULL, p_meta, p_consumer);
        IF NOT v_int.idempotent AND NOT (p_opts->>'lookup_ref')::boolean THEN
            RETURN QUERY SELECT * FROM idemq.provider_step(p_key, p_opts, p_meta, p_consumer,
                                                           p_sweep);
            RETURN;
        END IF;
        r_delay_ms := idemq.provider_backoff(v_int.unknowns, p_opts);
        UPDATE idemq.intents i SET run_after = v_now + make_interval(secs => r_delay_ms / 1000.0)
         WHERE i.key = p_key;
        UPDATE idemq.jobs j SET run_after = v_now + make_interval(secs => r_delay_ms / 1000.0)
         WHERE j.key = p_key;
        r_action := 'retry';
    ELSIF p_op = 'call' AND p_class = 'not_sent' THEN
        UPDATE idemq.intents i SET failures = i.failures + 1,
               state = CASE WHEN v_uncertain THEN 'unknown' ELSE 'waiting' END
         WHERE i.key = p_key RETURNING * INTO v_int;
        r_delay_ms := idemq.provider_backoff(v_int.failures, p_opts);
        PERFORM idemq.provider_note(p_key, 'provider_wait', v_now, 'transient', 'provider_not_sent',
            format('request %s never reached the provider: %s', p_lease, v_text), r_delay_ms,
            p_meta, p_consumer);
        IF v_int.unknowns + v_int.failures >= (p_opts->>'max_attempts')::integer THEN
            RETURN QUERY SELECT * FROM idemq.provider_step(p_key, p_opts, p_meta, p_consumer,
                                                           p_sweep);
            RETURN;
        END IF;
        UPDATE idemq.intents i SET run_after = v_now + make_interval(secs => r_delay_ms / 1000.0)
         WHERE i.key = p_key;
        UPDATE idemq.jobs j SET state = 'provider_unknown',
               run_after = v_now + make_interval(secs => r_delay_ms / 1000.0)
         WHERE j.key = p_key;
        r_action := 'retry';
    ELSIF p_op <> 'call' AND p_class = 'not_found' THEN
        PERFORM idemq.provider_note(p_key, 'provider_lookup', v_now, NULL, 'not_found',
            format('lookup %s: the provider has no record (%s)', p_lease, v_text), NULL, p_meta,
            p_consumer);
        v_deadline := v_int.last_request_at
                      + make_interval(secs => (p_opts->>'reconcile_after_s')::numeric);
        -- A request of this generation may still be on its way to the
        -- provider (or in its queue) until its lease and a call's timeout
        -- have passed: "no record" proves nothing before that.
        v_quiet := v_int.last_request_at
                   + make_interval(secs => ((p_opts->>'lease_ms')::numeric
                                            + (p_opts->>'timeout_ms')::numeric) / 1000);
        IF v_int.uncertain AND v_now < v_quiet THEN
            r_delay_ms := greatest(100, ceil(extract(epoch FROM v_quiet - v_now) * 1000));
            UPDATE idemq.intents i SET state = 'unknown', run_after = v_quiet WHERE i.key = p_key;
            UPDATE idemq.jobs j SET state = 'provider_unknown', run_after = v_quiet
             WHERE j.key = p_key;
            r_action := 'retry';
            r_message := format('the provider has no record yet, but the request of %s may '
                                'still be in flight: looked up again after %s',
                                v_int.last_request_at, v_quiet);
        ELSIF v_int.idempotent AND v_now + make_interval(secs => (p_opts->>'timeout_ms')::numeric
                                                        / 1000)
                                < v_int.first_request_at
                                  + make_interval(secs => (p_opts->>'key_window_s')::numeric)
        THEN
            -- Nothing applied under the key, still inside its window: send
            -- (again) under the same key; safe whatever happens meanwhile.
            UPDATE idemq.intents i SET state = 'waiting', uncertain = false WHERE i.key = p_key;
            RETURN QUERY SELECT * FROM idemq.provider_step(p_key, p_opts, p_meta, p_consumer,
                                                           p_sweep);
            RETURN;
        ELSIF p_sweep OR v_now >= v_deadline THEN
            r_park := idemq.provider_park(p_key, 'no_record', 'provider_no_record',
                format('the provider has no record of the request %s after its last request at '
                       '%s (not applied as far as the provider knows): resend it with idemq '
                       'resolve %s --not-applied and a redrive', CASE WHEN v_int.idempotent
                       THEN '(key window over)' ELSE '(by client reference)' END,
                       v_int.last_request_at, p_key),
                'not_applied', p_consumer, p_meta);
            r_action := 'park';
        ELSE
            r_delay_ms := least(2147483647,  -- a deadline up to 30 days ahead
                                greatest(100, ceil(extract(epoch FROM v_deadline - v_now) * 1000)));
            UPDATE idemq.intents i SET state = 'unknown', run_after = v_deadline
             WHERE i.key = p_key;
            UPDATE idemq.jobs j SET state = 'provider_unknown', run_after = v_deadline
             WHERE j.key = p_key;
            r_action := 'retry';
            r_message := 'the provider has no record yet: looked up again after '
                         || v_deadline::text;
        END IF;
    ELSE
        -- A lookup that did not answer (unknown, not sent, conflict, 4xx, or
        -- 2xx without the reference): try again later, bounded by wait_max.
        UPDATE idemq.intents i SET waits = i.waits + 1, state = 'unknown' WHERE i.key = p_key
        RETURNING * INTO v_int;
        PERFORM idemq.provider_note(p_key, 'provider_lookup', v_now, 'transient', p_class,
            format('lookup %s did not settle it: %s', p_lease, v_text), NULL, p_meta,
            p_consumer);
        IF v_int.waits >= v_wait_max THEN
            r_park := idemq.provider_park(p_key, 'unknown_outcome', 'provider_unknown',
                format('the outcome is unknown and %s lookups did not settle it; last: %s',
                       v_int.waits, v_text), 'parked', p_consumer, p_meta);
            r_action := 'park';
        ELSE
            r_delay_ms := idemq.provider_backoff(v_int.waits, p_opts);
            UPDATE idemq.intents i SET run_after = v_now + make_interval(secs => r_delay_ms / 1000.0)
             WHERE i.key = p_key;
            UPDATE idemq.jobs j SET state = 'provider_unknown',
                   run_after = v_now + make_interval(secs => r_delay_ms / 1000.0)
             WHERE j.key = p_key;
            r_action := 'retry';
        END IF;
    END IF;
    RETURN NEXT;
END
$fn$;

-- After provider_apply returned an effect error (the reference is
-- recorded): the caller's class decides. A transient error retries the
-- local effect later (no new request); a permanent one, or the last of
-- retry.max_attempts, parks the job with the reference in its reason.
CREATE OR REPLACE FUNCTION idemq.provider_effect_failed(
    p_key text, p_class text, p_code text, p_sqlstate text, p_message text, p_opts jsonb,
    p_meta jsonb, p_consumer text)
RETURNS TABLE (r_action text, r_attempt integer, r_lease integer, r_delay_ms integer,
               r_park jsonb, r_message text, r_lookup text, r_sqlstate text, r_body bytea,
               r_body_key text)
LANGUAGE plpgsql SET search_path = pg_catalog, idemq AS $fn$
DECLARE
    v_now timestamptz := clock_timestamp();
    v_int idemq.intents;
BEGIN
    PERFORM 1 FROM idemq.jobs j WHERE j.key = p_key FOR UPDATE;
    UPDATE idemq.intents i SET failures = i.failures + 1, updated_at = v_now
     WHERE i.key = p_key AND i.state = 'confirmed'
    RETURNING * INTO v_int;
    IF v_int.key IS NULL THEN
        RAISE EXCEPTION 'idemq: key % has no confirmed intent', p_key USING ERRCODE = 'XX000';
    END IF;
    UPDATE idemq.jobs j SET last_sqlstate = p_sqlstate, last_error = p_message,
           last_error_class = p_class
     WHERE j.key = p_key RETURNING j.attempts INTO r_attempt;
    IF p_class <> 'transient' OR v_int.failures >= (p_opts->>'max_attempts')::integer THEN
        -- The intent parks with its reference kept: a redrive runs the local
        -- effect again (no request), idemq resolve --applied settles it.
        r_park := idemq.provider_park(p_key, p_class, p_code,
            format('provider reference %s is recorded, but the local effect failed: %s %s. '
                   'Fix it, then redrive, or idemq resolve %s --applied %s', v_int.provider_ref,
                   p_sqlstate, p_message, p_key, v_int.provider_ref), 'parked', p_consumer,
            p_meta);
        UPDATE idemq.parked p SET sqlstate = p_sqlstate WHERE p.id = (r_park->>'park_id')::bigint;
        r_park := r_park || jsonb_build_object('sqlstate', p_sqlstate);
        r_action := 'park';
    ELSE
        r_delay_ms := idemq.provider_backoff(v_int.failures, p_opts);
        UPDATE idemq.intents i SET run_after = v_now + make_interval(secs => r_delay_ms / 1000.0)
         WHERE i.key = p_key;
        UPDATE idemq.jobs j SET state = 'provider_unknown',
               run_after = v_now + make_interval(secs => r_delay_ms / 1000.0)
         WHERE j.key = p_key;
        INSERT INTO idemq.attempts (key, attempt, generation, outcome, started_at, finished_at,
            error_class, error_code, sqlstate, message, queue, routing_key, redelivered,
            delivery_count, acquired_count, consumer_id, delay_ms, trace_id)
        SELECT j.key, j.attempts, j.generation, 'transient_error', v_now, clock_timestamp(),
            p_class, p_code, p_sqlstate,
            format('provider reference %s is recorded; the local effect failed: %s',
                   v_int.provider_ref, p_message), j.source_queue, p_meta->>'routing_key',
            (p_meta->>'redelivered')::boolean, (p_meta->>'delivery_count')::integer,
            (p_meta->>'acquired_count')::integer,
            p_consumer, r_delay_ms, idemq.trace_id_of(p_meta)
          FROM idemq.jobs j WHERE j.key = p_key;
        r_action := 'retry';
    END IF;
    RETURN NEXT;
END
$fn$;

-- The reconciler: takes up to p_limit intents of input p_opts.input left
-- pending (lease over) or unknown/waiting/confirmed for longer than
-- reconcile_after_s past their due time, skipping keys another session
-- holds, and returns one step per key (lookup, call, park, applied,
-- effect_error). The caller sends what is asked for and reports back with
-- provider_result(..., p_sweep => true).
CREATE OR REPLACE FUNCTION idemq.provider_sweep(p_opts jsonb, p_age_s integer, p_limit integer,
                                                p_consumer text)
RETURNS TABLE (r_key text, r_action text, r_attempt integer, r_lease integer,
               r_delay_ms integer, r_park jsonb, r_message text, r_lookup text,
               r_sqlstate text, r_body bytea, r_body_key text)
LANGUAGE plpgsql SET search_path = pg_catalog, idemq AS $fn$
DECLARE
    v_now  timestamptz := clock_timestamp();
    v_age  interval := make_interval(secs => p_age_s);
    v_key  text;
    v_int  idemq.intents;
    v_meta jsonb;
BEGIN
    FOR v_key IN
        SELECT i.key FROM idemq.intents i JOIN idemq.jobs j ON j.key = i.key
         WHERE i.input = p_opts->>'input' AND j.state <> 'parked'
           AND i.state IN ('pending', 'unknown', 'waiting', 'confirmed')
           AND ((i.state = 'pending' AND i.lease_until < v_now
                 AND greatest(i.last_request_at, i.updated_at) < v_now - v_age)
                OR (i.state <> 'pending'
                    AND coalesce(i.run_after, i.updated_at) < v_now - v_age))
         ORDER BY i.updated_at
         LIMIT p_limit
    LOOP
        -- Locks in the order every other path takes them: job, then intent.
        PERFORM 1 FROM idemq.jobs j WHERE j.key = v_key FOR UPDATE SKIP LOCKED;
        IF NOT FOUND THEN
            CONTINUE;
        END IF;
        SELECT * INTO v_int FROM idemq.intents i WHERE i.key = v_key FOR UPDATE;
        IF NOT (v_int.state IN ('pending', 'unknown', 'waiting', 'confirmed')
                AND coalesce(v_int.lease_until, '-infinity') < v_now) THEN
            CONTINUE; -- settled or taken meanwhile
        END IF;
        v_meta := jsonb_build_object('routing_key', v_int.routing_key, 'exchange',
                                     v_int.exchange, 'queue', v_int.source_queue,
                                     'reconciler', true);
        RETURN QUERY SELECT v_key, s.r_action, s.r_attempt, s.r_lease, s.r_delay_ms, s.r_park,
            s.r_message, s.r_lookup, s.r_sqlstate, s.r_body, s.r_body_key
          FROM idemq.provider_step(v_key, p_opts, v_meta, p_consumer, true) s;
    END LOOP;
END
$fn$;

-- idemq resolve: an operator settles a parked provider key. 'applied'
-- records p_ref as the provider's reference and runs the input's effect
-- (all or nothing); 'not_applied' makes the key redrivable (a redrive
-- sends it again under the same key); 'discard' drops it for good (a
-- redrive is a duplicate). Records who and why. p_body: the intent's
-- message, opened by the caller when it is sealed (provider_apply). Returns
-- the prior state.
CREATE OR REPLACE FUNCTION idemq.provider_resolve(p_key text, p_action text, p_ref text,
                                                  p_by text, p_reason text, p_opts jsonb,
                                                  p_body bytea DEFAULT NULL)
RETURNS text
LANGUAGE plpgsql SET search_path = pg_catalog, idemq AS $fn$
DECLARE
    v_now   timestamptz := clock_timestamp();
    v_job   idemq.jobs;
    v_int   idemq.intents;
    v_ok    boolean;
    v_state text;
    v_msg   text;
    v_meta  jsonb;
BEGIN
    SELECT * INTO v_job FROM idemq.jobs j WHERE j.key = p_key FOR UPDATE;
    SELECT * INTO v_int FROM idemq.intents i WHERE i.key = p_key FOR UPDATE;
    IF v_int.key IS NULL THEN
        RAISE EXCEPTION 'key % is not a provider job (idemq resolve settles provider intents)',
              p_key USING ERRCODE = 'P0002';
    END IF;
    IF v_job.state <> 'parked' THEN
        RAISE EXCEPTION 'key % is %, not parked: nothing to resolve', p_key, v_job.state
              USING ERRCODE = '55000';
    END IF;
    IF p_action NOT IN ('applied', 'not_applied', 'discard') THEN
        RAISE EXCEPTION 'unknown resolution %', p_action USING ERRCODE = '22023';
    END IF;
    v_state := v_int.state;
    v_meta := jsonb_build_object('routing_key', v_int.routing_key, 'queue', v_int.source_queue,
                                 'resolved_by', p_by, 'reason', p_reason);
    IF p_action = 'applied' THEN
        SELECT a.r_ok, a.r_message INTO v_ok, v_msg
          FROM idemq.provider_apply(p_key, p_ref,
                   jsonb_build_object('resolved_by', p_by, 'reason', p_reason),
                   'resolved by ' || p_by, p_opts, v_meta, 'idemq resolve', p_body) a;
        IF NOT v_ok THEN
            RAISE EXCEPTION 'the effect of % failed: %', p_key, v_msg USING ERRCODE = 'P0001';
        END IF;
    ELSE
        UPDATE idemq.intents i SET state = CASE p_action WHEN 'discard' THEN 'discarded'
                                                         ELSE 'not_applied' END,
               updated_at = v_now
         WHERE i.key = p_key;
    END IF;
    UPDATE idemq.intents i SET resolved_by = p_by, resolved_at = v_now, resolve_reason = p_reason
     WHERE i.key = p_key;
    INSERT INTO idemq.resolutions (key, action, provider_ref, prior_state, resolved_by, reason)
    VALUES (p_key, p_action, CASE WHEN p_action = 'applied' THEN p_ref END, v_state, p_by,
            p_reason);
    -- Settled for good (applied, or discarded): the key's open parks move to
    -- idemq.park_history and age out with the history. A park
    -- resolved as not_applied stays open: it waits for its redrive.
    IF p_action IN ('applied', 'discard') THEN
        PERFORM idemq.close_park(p.id, 'resolved ' || p_action || ': ' || p_reason, p_by)
           FROM idemq.parked p WHERE p.key = p_key;
    END IF;
    PERFORM idemq.provider_note(p_key, 'resolved', v_now, NULL, p_action,
        format('resolved %s%s by %s (was %s): %s', p_action,
               CASE WHEN p_action = 'applied' THEN ' with reference ' || p_ref ELSE '' END,
               p_by, v_state, p_reason), NULL, v_meta, 'idemq resolve');
    RETURN v_state;
END
$fn$;

-- Observability: intents not settled yet, by input and state, with the age
-- of the oldest (since its last change).
CREATE OR REPLACE FUNCTION idemq.provider_gauges()
RETURNS TABLE (r_input text, r_state text, r_count bigint, r_oldest_s double precision)
LANGUAGE sql STABLE SET search_path = pg_catalog, idemq AS $fn$
    SELECT i.input, i.state, count(*),
           coalesce(extract(epoch FROM clock_timestamp() - min(i.updated_at)), 0)::float8
      FROM idemq.intents i
     WHERE i.state IN ('pending', 'unknown', 'waiting', 'confirmed')
     GROUP BY 1, 2 ORDER BY 1, 2;
$fn$;

-- Observability: request -> confirmation latency (first request to the
-- recorded reference) of the intents confirmed in the last p_window_s.
CREATE OR REPLACE FUNCTION idemq.provider_latency(p_window_s integer)
RETURNS TABLE (r_input text, r_count bigint, r_p50_s double precision,
               r_p99_s double precision, r_max_s double precision)
LANGUAGE sql STABLE SET search_path = pg_catalog, idemq AS $fn$
    SELECT i.input, count(*),
           percentile_cont(0.5) WITHIN GROUP (ORDER BY x.s),
           percentile_cont(0.99) WITHIN GROUP (ORDER BY x.s), max(x.s)
      FROM idemq.intents i
      CROSS JOIN LATERAL (SELECT extract(epoch FROM i.confirmed_at - i.first_request_at)::float8
                          AS s) x
     WHERE i.confirmed_at > clock_timestamp() - make_interval(secs => p_window_s)
     GROUP BY 1 ORDER BY 1;
$fn$;
