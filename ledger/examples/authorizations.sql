-- Example order-sensitive effect for ordered lanes: the life of a card
-- authorization, authorize -> capture(s) -> refund(s). A capture before its
-- authorization, or a refund of more than was captured (e.g. a refund
-- before its capture), is invalid and raises 22023 (a permanent error, the
-- job parks). Run it on a partitioned input with
--   order_key_source = "json:authorization_id"; sequence_source = "json:seq";
-- Payload: {"job_id", "authorization_id", "seq", "kind": authorize|capture|refund,
--           "amount_minor"}.
CREATE SCHEMA IF NOT EXISTS idemq_demo;

CREATE TABLE IF NOT EXISTS idemq_demo.authorizations (
    authorization_id text PRIMARY KEY,
    authorized_minor bigint NOT NULL CHECK (authorized_minor > 0),
    captured_minor   bigint NOT NULL DEFAULT 0,
    refunded_minor   bigint NOT NULL DEFAULT 0,
    updated_at       timestamptz NOT NULL DEFAULT clock_timestamp(),
    CHECK (captured_minor <= authorized_minor AND refunded_minor <= captured_minor)
);

CREATE TABLE IF NOT EXISTS idemq_demo.authorization_events (
    id               bigserial PRIMARY KEY,
    idempotency_key  text NOT NULL UNIQUE,
    authorization_id text NOT NULL,
    seq              bigint,
    kind             text NOT NULL,
    amount_minor     bigint NOT NULL,
    applied_at       timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX IF NOT EXISTS authorization_events_auth_idx
    ON idemq_demo.authorization_events (authorization_id, id);

CREATE OR REPLACE FUNCTION idemq_demo.apply_authorization(p_key text, p_payload jsonb,
                                                          p_meta jsonb)
RETURNS jsonb LANGUAGE plpgsql AS $fn$
DECLARE
    v_auth   text := p_payload->>'authorization_id';
    v_kind   text := p_payload->>'kind';
    v_amount bigint := (p_payload->>'amount_minor')::bigint;
    a        idemq_demo.authorizations%ROWTYPE;
BEGIN
    IF v_auth IS NULL OR v_amount IS NULL OR v_amount <= 0 THEN
        RAISE EXCEPTION 'authorization_id and a positive amount_minor are required'
              USING ERRCODE = '22023';
    END IF;
    SELECT * INTO a FROM idemq_demo.authorizations WHERE authorization_id = v_auth FOR UPDATE;
    IF v_kind = 'authorize' THEN
        IF FOUND THEN
            RAISE EXCEPTION 'authorization % exists already', v_auth USING ERRCODE = '22023';
        END IF;
        INSERT INTO idemq_demo.authorizations (authorization_id, authorized_minor)
        VALUES (v_auth, v_amount);
    ELSIF v_kind = 'capture' THEN
        IF NOT FOUND THEN
            RAISE EXCEPTION 'capture before authorize of %', v_auth USING ERRCODE = '22023';
        END IF;
        IF a.captured_minor + v_amount > a.authorized_minor THEN
            RAISE EXCEPTION 'capture over the authorized amount of %', v_auth
                  USING ERRCODE = '22023';
        END IF;
        UPDATE idemq_demo.authorizations SET captured_minor = captured_minor + v_amount,
               updated_at = clock_timestamp() WHERE authorization_id = v_auth;
    ELSIF v_kind = 'refund' THEN
        IF NOT FOUND OR a.refunded_minor + v_amount > a.captured_minor THEN
            RAISE EXCEPTION 'refund of % before its capture (or over it)', v_auth
                  USING ERRCODE = '22023';
        END IF;
        UPDATE idemq_demo.authorizations SET refunded_minor = refunded_minor + v_amount,
               updated_at = clock_timestamp() WHERE authorization_id = v_auth;
    ELSE
        RAISE EXCEPTION 'unknown kind %', v_kind USING ERRCODE = '22023';
    END IF;
    INSERT INTO idemq_demo.authorization_events (idempotency_key, authorization_id, seq, kind,
                                                 amount_minor)
    VALUES (p_key, v_auth, (p_payload->>'seq')::bigint, v_kind, v_amount);
    RETURN jsonb_build_object('authorization_id', v_auth, 'kind', v_kind);
END
$fn$;
