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
    v_rows   bigint;
BEGIN
    -- a double application, a lost one, a gap in an attempt history, a job
    -- left retrying, a normal job parked
    SELECT e.key INTO v_key FROM idemq_chaos.effects e ORDER BY e.id LIMIT 1;
    INSERT INTO idemq_chaos.effects (key, attempt) VALUES (v_key, 99);
    DELETE FROM idemq_chaos.effects
     WHERE id = (SELECT max(e.id) FROM idemq_chaos.effects e WHERE e.key <> v_key);
    -- the gap goes on a chaos-input key: the checker leaves the provider
    -- input's attempt histories to check_provider, so an arbitrary applied
    -- job (LIMIT 1 without an order once picked a provider key) hid it
    INSERT INTO idemq.attempts (key, attempt, generation, outcome, started_at, finished_at)
    SELECT j.key, j.attempts + 2, j.generation, 'transient_error', now(), now()
      FROM idemq.jobs j JOIN idemq_chaos.manifest m ON m.key = j.key
     WHERE m.kind = 'normal' AND j.state = 'applied' AND j.key <> v_key
     ORDER BY j.key LIMIT 1;
    GET DIAGNOSTICS v_rows = ROW_COUNT;
    IF v_rows <> 1 THEN
        RAISE EXCEPTION 'checker self-test: no applied normal job to give an attempt gap';
    END IF;
    UPDATE idemq.jobs SET state = 'retrying'
     WHERE key = (SELECT m.key FROM idemq_chaos.manifest m WHERE m.kind = 'poison' LIMIT 1);
    UPDATE idemq.jobs SET state = 'parked'
     WHERE key = (SELECT m.key FROM idemq_chaos.manifest m WHERE m.kind = 'normal'
                   ORDER BY m.key DESC LIMIT 1);
    -- the provider input: a key charged twice, one never charged, a payout
    -- row missing, one with another reference, a stray charge
    UPDATE idemq_chaos.charges SET charges = 2
     WHERE key = (SELECT min(c.key) FROM idemq_chaos.charges c);
    UPDATE idemq_chaos.charges SET charges = 0
     WHERE key = (SELECT max(c.key) FROM idemq_chaos.charges c);
    DELETE FROM idemq_chaos.payouts WHERE id = (SELECT max(p.id) FROM idemq_chaos.payouts p);
    UPDATE idemq_chaos.payouts SET reference = 'ch_other'
     WHERE id = (SELECT min(p.id) FROM idemq_chaos.payouts p);
    SELECT array_agg(c.invariant) INTO v_bad
      FROM (SELECT * FROM idemq_chaos.check(5)
            UNION ALL
            SELECT * FROM idemq_chaos.check_provider(
                (SELECT count(*) + 1 FROM idemq_chaos.pay_manifest))) c
     WHERE NOT c.ok;
    SELECT array_agg(w) INTO v_missed
      FROM unnest(ARRAY['applied once', 'lost', 'double', 'parked', 'parked by mistake',
                        'attempts contiguous', 'job row matches its history',
                        'jobs settled', 'provider charged once', 'double charges',
                        'provider lost', 'provider charges in all', 'payout recorded once',
                        'payout reference is the intent''s']) AS w
     WHERE NOT w = ANY (coalesce(v_bad, '{}'));
    IF v_missed IS NOT NULL THEN
        RAISE EXCEPTION 'the chaos checker missed injected violations: %', v_missed;
    END IF;
    RAISE NOTICE 'checker self-test: % injected violation kinds all reported', 14;
END
$$;
ROLLBACK;
