-- The Celery demo effect (config/celery.cfg): task shop.charge
-- with kwargs {order_id, amount_minor} records one charge per order and
-- returns it; the Celery client reads that as the task's result. A charge
-- without an amount is a permanent error (22023): parked, answered FAILURE.
CREATE SCHEMA IF NOT EXISTS idemq_demo;
CREATE TABLE IF NOT EXISTS idemq_demo.shop_charges (
    id           bigserial PRIMARY KEY,
    order_id     text NOT NULL UNIQUE,
    amount_minor bigint NOT NULL,
    task_id      text NOT NULL,
    created_at   timestamptz NOT NULL DEFAULT now()
);
CREATE OR REPLACE FUNCTION idemq_demo.shop_charge(p_key text, p_payload jsonb, p_meta jsonb)
RETURNS jsonb LANGUAGE plpgsql AS $fn$
DECLARE
    v_amount bigint;
    v_id     bigint;
BEGIN
    IF jsonb_typeof(p_payload->'kwargs'->'amount_minor') IS DISTINCT FROM 'number' THEN
        RAISE EXCEPTION 'charge % has no amount_minor', p_key USING ERRCODE = '22023';
    END IF;
    v_amount := (p_payload->'kwargs'->>'amount_minor')::bigint;
    INSERT INTO idemq_demo.shop_charges (order_id, amount_minor, task_id)
    VALUES (p_key, v_amount, p_meta->'celery'->>'id')
    RETURNING id INTO v_id;
    RETURN jsonb_build_object('charge_id', v_id, 'order_id', p_key, 'amount_minor', v_amount);
END $fn$;
