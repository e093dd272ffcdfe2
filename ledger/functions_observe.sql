-- idemq observe mode, part of the repeatable function text.
--
-- idemq.observe_batch takes the jobs of one batch of observe-mode inputs
-- (as the worker decoded them, in delivery order) and, inside the batch's
-- transaction, decides for each what the apply path would have done with
-- it, without running any effect:
--   * a delivery that did not decode (code c): would_park with that code;
--     no key is claimed (apply parks it without claiming either).
--   * a key already claimed (also by an earlier copy in this batch, as in
--     apply mode): duplicate (code key_reuse when the claim's
--     body SHA-256 differs: would_park key_reuse if the input parks reuse).
--   * a key not claimed whose message is older than the dedup window (w):
--     late_replay, code outside_dedup_window, not claimed (apply would park
--     it so: never applied blindly).
--   * otherwise: claimed as 'observed' (attempts 0, observed_by = the
--     input): the running consumer took it, with an outcome idemq cannot
--     know; a later copy in observe mode is a duplicate, and the first copy
--     apply mode takes is applied once (idemq.apply_batch).
-- Each delivery leaves one idemq.observations row. Returns per job its
-- 1-based index, the outcome and the code.
-- p_jobs: [{"n": input, "q": queue, "k": key or null, "h": body SHA-256,
--          "w": older than the window, "c": decode code or null,
--          "r": reason, "kp": on_key_reuse = park, "rd": redelivered}]
CREATE OR REPLACE FUNCTION idemq.observe_batch(p_jobs jsonb, p_consumer text)
RETURNS TABLE (r_idx integer, r_outcome text, r_code text)
LANGUAGE plpgsql
SET search_path = pg_catalog, idemq
AS $fn$
DECLARE
    j       jsonb;
    v_key   text;
    v_sha   text;
    v_state text;
    v_prior text;
    v_ins   boolean;
    v_why   text;
BEGIN
    r_idx := 0;
    FOR j IN SELECT e FROM jsonb_array_elements(p_jobs) AS e LOOP
        r_idx := r_idx + 1;
        v_key := j->>'k';
        v_sha := j->>'h';
        r_code := NULL;
        v_why := NULL;
        IF j->>'c' IS NOT NULL THEN
            r_outcome := 'would_park';
            r_code := j->>'c';
            v_why := j->>'r';
        ELSE
            v_ins := NULL;
            IF NOT coalesce((j->>'w')::boolean, false) THEN
                INSERT INTO idemq.jobs AS t (key, state, source_queue, payload_sha256, attempts,
                                             first_seen_at, applied_at, observed_by)
                VALUES (v_key, 'observed', j->>'q', v_sha, 0, clock_timestamp(),
                        NULL, j->>'n')
                ON CONFLICT (key) DO NOTHING
                RETURNING true INTO v_ins;
            END IF;
            IF v_ins THEN
                r_outcome := 'observed';
            ELSE
                SELECT t.state INTO v_state FROM idemq.jobs t WHERE t.key = v_key;
                IF v_state IS NULL THEN
                    -- not claimed, older than the window: apply parks it
                    r_outcome := 'late_replay';
                    r_code := 'outside_dedup_window';
                    v_why := 'the message is older than the dedup window and its key is not '
                             'claimed: apply mode would park it, not apply it';
                ELSE
                    r_outcome := 'duplicate';
                    v_why := 'the key is ' || v_state;
                    IF v_state IN ('applied', 'observed') THEN
                        SELECT x.payload_sha256 INTO v_prior FROM idemq.job_info(v_key) x;
                        IF v_prior IS NOT NULL AND v_prior <> v_sha THEN
                            r_code := 'key_reuse';
                            v_why := format('key_reuse: body SHA-256 %s, the claimed one %s',
                                            v_sha, v_prior);
                            IF coalesce((j->>'kp')::boolean, false) THEN
                                r_outcome := 'would_park';
                            END IF;
                        END IF;
                    END IF;
                END IF;
            END IF;
        END IF;
        INSERT INTO idemq.observations (input, queue, key, outcome, code, reason,
                                        payload_sha256, redelivered, consumer_id)
        VALUES (j->>'n', j->>'q', v_key, r_outcome, r_code, v_why, v_sha,
                (j->>'rd')::boolean, p_consumer);
        RETURN NEXT;
    END LOOP;
END
$fn$;

-- The baseline of `idemq observe report`: counts by input, outcome and code
-- since p_since (NULL = all), for input p_input (NULL = all).
CREATE OR REPLACE FUNCTION idemq.observe_report(p_input text, p_since timestamptz)
RETURNS TABLE (input text, outcome text, code text, n bigint, first_at timestamptz,
               last_at timestamptz)
LANGUAGE sql STABLE
SET search_path = pg_catalog, idemq
AS $fn$
    SELECT o.input, o.outcome, o.code, count(*), min(o.at), max(o.at)
      FROM idemq.observations o
     WHERE (p_input IS NULL OR o.input = p_input)
       AND (p_since IS NULL OR o.at >= p_since)
     GROUP BY o.input, o.outcome, o.code
     ORDER BY o.input, o.outcome, count(*) DESC, o.code NULLS FIRST;
$fn$;
