-- Effect functions used only by the integration tests.
CREATE SCHEMA IF NOT EXISTS idemq_test;

CREATE TABLE IF NOT EXISTS idemq_test.effects (
    id         bigserial PRIMARY KEY,
    key        text NOT NULL,
    payload    jsonb NOT NULL,
    meta       jsonb NOT NULL,
    created_at timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX IF NOT EXISTS effects_key_idx ON idemq_test.effects (key);
-- The top-level transaction that ran the effect (txid_current() is the
-- parent's id even inside a subtransaction): which jobs committed together.
ALTER TABLE idemq_test.effects ADD COLUMN IF NOT EXISTS txid bigint DEFAULT txid_current();

-- Records every call (no unique constraint: a second call would show up as
-- a second row). Sleeps payload.sleep_ms first when given, to widen races.
-- payload.raise = SQLSTATE makes it raise that error; with
-- payload.raise_until_attempt = N only while meta.attempt <= N (a transient
-- failure that a retry gets past).
CREATE OR REPLACE FUNCTION idemq_test.record(p_key text, p_payload jsonb, p_meta jsonb)
RETURNS jsonb LANGUAGE plpgsql AS $fn$
DECLARE v_id bigint;
BEGIN
    IF p_payload ? 'sleep_ms' THEN
        PERFORM pg_sleep((p_payload->>'sleep_ms')::numeric / 1000);
    END IF;
    IF p_payload ? 'raise' AND (NOT p_payload ? 'raise_until_attempt'
            OR (p_meta->>'attempt')::integer <= (p_payload->>'raise_until_attempt')::integer) THEN
        RAISE EXCEPTION 'requested failure %', p_payload->>'raise'
              USING ERRCODE = p_payload->>'raise';
    END IF;
    INSERT INTO idemq_test.effects (key, payload, meta) VALUES (p_key, p_payload, p_meta)
    RETURNING id INTO v_id;
    RETURN jsonb_build_object('effect_id', v_id, 'attempt', p_meta->'attempt');
END
$fn$;
