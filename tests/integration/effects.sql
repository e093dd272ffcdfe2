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

-- Keys listed here fail with their SQLSTATE until the row is deleted (a
-- cause that an operator fixes).
CREATE TABLE IF NOT EXISTS idemq_test.failing (
    key      text PRIMARY KEY,
    sqlstate text NOT NULL
);

-- The payload switches every test effect obeys, to widen races and inject
-- failures: sleep_ms sleeps first; raise fails with that SQLSTATE (only while
-- meta.attempt <= raise_until when given); a key listed in
-- idemq_test.failing fails with its SQLSTATE.
CREATE OR REPLACE FUNCTION idemq_test.switches(p_key text, p_payload jsonb, p_meta jsonb)
RETURNS void LANGUAGE plpgsql AS $fn$
DECLARE
    v_code text;
BEGIN
    IF p_payload ? 'sleep_ms' THEN
        PERFORM pg_sleep((p_payload->>'sleep_ms')::numeric / 1000);
    END IF;
    IF p_payload ? 'raise' AND (NOT p_payload ? 'raise_until'
        OR (p_meta->>'attempt')::integer <= (p_payload->>'raise_until')::integer) THEN
        RAISE EXCEPTION 'requested failure % on attempt %', p_payload->>'raise',
              p_meta->>'attempt' USING ERRCODE = p_payload->>'raise';
    END IF;
    SELECT f.sqlstate INTO v_code FROM idemq_test.failing f WHERE f.key = p_key;
    IF FOUND THEN
        RAISE EXCEPTION 'key % is marked failing', p_key USING ERRCODE = v_code;
    END IF;
END
$fn$;

-- Records every call (no unique constraint: a second call would show up as
-- a second row). Payload switches, to widen races and inject failures:
--   sleep_ms: sleep first;  raise: fail with that SQLSTATE
--   raise_until: only while meta.attempt <= raise_until
CREATE OR REPLACE FUNCTION idemq_test.record(p_key text, p_payload jsonb, p_meta jsonb)
RETURNS jsonb LANGUAGE plpgsql AS $fn$
DECLARE
    v_id bigint;
BEGIN
    PERFORM idemq_test.switches(p_key, p_payload, p_meta);
    INSERT INTO idemq_test.effects (key, payload, meta) VALUES (p_key, p_payload, p_meta)
    RETURNING id INTO v_id;
    RETURN jsonb_build_object('effect_id', v_id, 'attempt', p_meta->'attempt');
END
$fn$;

-- Ordered lanes: the authorizations example behind the same failure
-- switches as record (raise / raise_until in the payload, idemq_test.failing
-- by key). Needs ledger/examples/authorizations.sql.
CREATE OR REPLACE FUNCTION idemq_test.authorization(p_key text, p_payload jsonb, p_meta jsonb)
RETURNS jsonb LANGUAGE plpgsql AS $fn$
BEGIN
    PERFORM idemq_test.switches(p_key, p_payload, p_meta);
    RETURN idemq_demo.apply_authorization(p_key, p_payload, p_meta);
END
$fn$;

-- Celery inputs (check_celery): the effect of task shop.charge
-- records the call and returns a result the Python client reads back;
-- shop.refuse raises a permanent error (22023) and is parked.
CREATE OR REPLACE FUNCTION idemq_test.celery_charge(p_key text, p_payload jsonb, p_meta jsonb)
RETURNS jsonb LANGUAGE plpgsql AS $fn$
DECLARE v_id bigint;
BEGIN
    INSERT INTO idemq_test.effects (key, payload, meta) VALUES (p_key, p_payload, p_meta)
    RETURNING id INTO v_id;
    RETURN jsonb_build_object('charged', p_payload->'kwargs'->'amount', 'key', p_key,
                              'task', p_meta->'celery'->>'task', 'effect_row', v_id,
                              'args', p_payload->'args');
END $fn$;
CREATE OR REPLACE FUNCTION idemq_test.celery_refuse(p_key text, p_payload jsonb, p_meta jsonb)
RETURNS jsonb LANGUAGE plpgsql AS $fn$
BEGIN
    RAISE EXCEPTION 'card declined for %', p_key USING ERRCODE = '22023';
END $fn$;
