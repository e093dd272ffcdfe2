-- Example effect for idemq: one payout intent per job.
-- idemq calls idemq_demo.apply_payout(key, payload, meta) inside the claim
-- transaction and stores the returned jsonb on the job row. Load with
--   psql "$IDEMQ_PG_DSN" -f ledger/examples/payouts.sql
CREATE SCHEMA IF NOT EXISTS idemq_demo;

CREATE TABLE IF NOT EXISTS idemq_demo.ledger_intents (
    id              bigserial PRIMARY KEY,
    idempotency_key text NOT NULL UNIQUE,
    account_id      text NOT NULL,
    amount_minor    bigint NOT NULL CHECK (amount_minor > 0),
    currency        text NOT NULL DEFAULT 'EUR',
    state           text NOT NULL DEFAULT 'intent',
    created_at      timestamptz NOT NULL DEFAULT clock_timestamp()
);

-- Raises 22023 (invalid_parameter_value, a permanent error) when the
-- payload lacks an account or a positive amount. For the demo, a payload
-- with "simulate_busy_attempts": N fails with 40001 (serialization failure,
-- a transient error) on its first N attempts.
CREATE OR REPLACE FUNCTION idemq_demo.apply_payout(p_key text, p_payload jsonb, p_meta jsonb)
RETURNS jsonb
LANGUAGE plpgsql AS $fn$
DECLARE
    v_account text := p_payload->>'account_id';
    v_amount  bigint;
    v_id      bigint;
BEGIN
    IF (p_meta->>'attempt')::integer <= coalesce((p_payload->>'simulate_busy_attempts')::integer, 0)
    THEN
        RAISE EXCEPTION 'simulated serialization failure for % (attempt %)', p_key,
              p_meta->>'attempt' USING ERRCODE = '40001';
    END IF;
    IF v_account IS NULL OR v_account = '' THEN
        RAISE EXCEPTION 'payout % has no account_id', p_key USING ERRCODE = '22023';
    END IF;
    IF jsonb_typeof(p_payload->'amount_minor') IS DISTINCT FROM 'number' THEN
        RAISE EXCEPTION 'payout % has no numeric amount_minor', p_key USING ERRCODE = '22023';
    END IF;
    v_amount := (p_payload->>'amount_minor')::bigint;
    INSERT INTO idemq_demo.ledger_intents (idempotency_key, account_id, amount_minor, currency)
    VALUES (p_key, v_account, v_amount, coalesce(p_payload->>'currency', 'EUR'))
    RETURNING id INTO v_id;
    RETURN jsonb_build_object('intent_id', v_id, 'account_id', v_account,
                              'amount_minor', v_amount, 'attempt', p_meta->'attempt');
END
$fn$;
