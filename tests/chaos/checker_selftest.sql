-- The checker can fail: on a finished chaos run's ledger (after a PASS),
-- inject one violation of each kind inside a transaction, check that
-- idemq_chaos.check reports each, and roll everything back. Run by
-- scripts/chaos; raises an exception naming any violation it missed.
BEGIN;
SET LOCAL client_min_messages = warning;
DO $$
DECLARE
    v_missed text[] := '{}';
    v_key    text;
    v_bad    text[];
BEGIN
    -- a double application, a lost one, a gap in an attempt history, a job
    -- left retrying, a normal job parked
    SELECT e.key INTO v_key FROM idemq_chaos.effects e ORDER BY e.id LIMIT 1;
    INSERT INTO idemq_chaos.effects (key, attempt) VALUES (v_key, 99);
    DELETE FROM idemq_chaos.effects
     WHERE id = (SELECT max(e.id) FROM idemq_chaos.effects e WHERE e.key <> v_key);
    INSERT INTO idemq.attempts (key, attempt, generation, outcome, started_at, finished_at)
    SELECT j.key, j.attempts + 2, j.generation, 'transient_error', now(), now()
      FROM idemq.jobs j WHERE j.state = 'applied' AND j.key <> v_key LIMIT 1;
    UPDATE idemq.jobs SET state = 'retrying'
     WHERE key = (SELECT m.key FROM idemq_chaos.manifest m WHERE m.kind = 'poison' LIMIT 1);
    UPDATE idemq.jobs SET state = 'parked'
     WHERE key = (SELECT m.key FROM idemq_chaos.manifest m WHERE m.kind = 'normal'
                   ORDER BY m.key DESC LIMIT 1);
    SELECT array_agg(c.invariant) INTO v_bad FROM idemq_chaos.check(5) c WHERE NOT c.ok;
    SELECT array_agg(w) INTO v_missed
      FROM unnest(ARRAY['applied once', 'lost', 'double', 'parked', 'parked by mistake',
                        'attempts contiguous', 'job row matches its history',
                        'jobs settled']) AS w
     WHERE NOT w = ANY (coalesce(v_bad, '{}'));
    IF v_missed IS NOT NULL THEN
        RAISE EXCEPTION 'the chaos checker missed injected violations: %', v_missed;
    END IF;
    RAISE NOTICE 'checker self-test: % injected violation kinds all reported', 8;
END
$$;
ROLLBACK;
