-- Example effect for a provider input: after the payments provider
-- confirmed a payout, idemq calls idemq_demo.record_provider_payout(key,
-- payload, meta) in the same transaction that marks the job applied, with
-- the provider's answer in meta.provider. It records the payout and the
-- provider's reference in the application's own table. Load with
--   psql "$IDEMQ_PG_DSN" -f ledger/examples/provider_payouts.sql
-- Names are schema-qualified: idemq runs provider effects with
-- search_path = pg_catalog, idemq.
CREATE SCHEMA IF NOT EXISTS idemq_demo;

CREATE TABLE IF NOT EXISTS idemq_demo.provider_payouts (
    id              bigserial PRIMARY KEY,
    idempotency_key text NOT NULL UNIQUE,
    account_id      text NOT NULL,
    amount_minor    bigint NOT NULL CHECK (amount_minor > 0),
    provider_ref    text NOT NULL,
    confirmed_in_ms bigint,
    recorded_at     timestamptz NOT NULL DEFAULT clock_timestamp()
);

CREATE OR REPLACE FUNCTION idemq_demo.record_provider_payout(p_key text, p_payload jsonb,
                                                             p_meta jsonb)
RETURNS jsonb
LANGUAGE plpgsql AS $fn$
DECLARE
    v_id bigint;
BEGIN
    IF coalesce(p_payload->>'account_id', '') = '' THEN
        RAISE EXCEPTION 'payout % has no account_id', p_key USING ERRCODE = '22023';
    END IF;
    INSERT INTO idemq_demo.provider_payouts (idempotency_key, account_id, amount_minor,
                                             provider_ref, confirmed_in_ms)
    VALUES (p_key, p_payload->>'account_id', (p_payload->>'amount_minor')::bigint,
            p_meta->'provider'->>'reference', (p_meta->'provider'->>'latency_ms')::bigint)
    RETURNING id INTO v_id;
    RETURN jsonb_build_object('payout_id', v_id, 'provider_ref', p_meta->'provider'->>'reference');
END
$fn$;
