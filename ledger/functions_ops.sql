-- idemq operator functions, part of the repeatable function text
-- (applied by every `idemq migrate` when the text changed).

-- A message the broker dead-lettered into <queue>.dead on its own (a quorum
-- queue's delivery limit; its x-death header says why) has no park row and
-- no x-idemq-* headers. `idemq redrive` records it here before it moves
-- it, so `idemq jobs show` and `idemq parked list` show it like any parked
-- message (error class 'broker', code = the x-death reason). Idempotent per
-- message (key, body hash and x-death): a redrive that failed half-way and
-- is run again finds the same row. Returns the park id and the key's
-- current generation (0 without a job row), which the redriven copy
-- carries like any redrive (x-idemq-park-id, x-idemq-generation).
DROP FUNCTION IF EXISTS idemq.adopt_dead_letter(text, text, text, text, bytea, jsonb, jsonb,
    text, text, text, integer, text);
CREATE OR REPLACE FUNCTION idemq.adopt_dead_letter(
    p_key text, p_queue text, p_exchange text, p_routing_key text, p_body bytea,
    p_headers jsonb, p_properties jsonb, p_sha text, p_code text, p_reason text,
    p_deliveries integer, p_by text, p_body_key text, p_body_size bigint)
RETURNS TABLE (r_park_id bigint, r_generation integer) LANGUAGE plpgsql AS $fn$
BEGIN
    r_generation := coalesce((SELECT j.generation FROM idemq.jobs j WHERE j.key = p_key), 0);
    SELECT p.id INTO r_park_id
      FROM idemq.parked p
     WHERE p.error_class = 'broker' AND p.key IS NOT DISTINCT FROM p_key
       AND p.payload_sha256 = p_sha
       AND p.headers->'x-death' IS NOT DISTINCT FROM p_headers->'x-death'
     ORDER BY p.id DESC
     LIMIT 1;
    IF r_park_id IS NULL THEN
        INSERT INTO idemq.parked (key, source_queue, exchange, routing_key, body, body_key,
                                  headers, properties, payload_sha256, error_class, error_code,
                                  reason, attempts, dlq_published_at, consumer_id, generation,
                                  body_size)
        VALUES (p_key, p_queue, p_exchange, p_routing_key, p_body, p_body_key, p_headers,
                p_properties, p_sha, 'broker', p_code, p_reason, coalesce(p_deliveries, 0),
                clock_timestamp(), p_by, r_generation,
                coalesce(p_body_size, octet_length(p_body)))
        RETURNING id INTO r_park_id;
    END IF;
    RETURN NEXT;
END
$fn$;

-- `idemq erase KEY --why TEXT`: removes the payload copies the ledger holds
-- of a key (the body, headers and properties of its parks, open and
-- resolved in the hot history; the request body and message of its
-- provider intent) and keeps the audit facts: hashes, sizes, states,
-- times, error texts. An erased open park is no longer redrivable from the
-- ledger. Recorded as an operator action ('erase', who, why) with a row
-- per park (park 0: the intent). Refuses (55000) a key still in flight
-- (pending, retrying or deferred: its message is needed to finish). Returns
-- the action id and how many parks, resolved parks and intents it erased.
CREATE OR REPLACE FUNCTION idemq.erase_key(p_key text, p_by text, p_why text)
RETURNS TABLE (r_action bigint, r_parks integer, r_history integer, r_intents integer)
LANGUAGE plpgsql AS $fn$
DECLARE
    v_state text;
BEGIN
    SELECT j.state INTO v_state FROM idemq.jobs j WHERE j.key = p_key FOR UPDATE;
    IF v_state IN ('pending', 'retrying', 'deferred') THEN
        RAISE EXCEPTION 'key % is %: its message is still needed; erase it once it is applied or parked',
            p_key, v_state USING ERRCODE = '55000';
    END IF;
    INSERT INTO idemq.operator_actions (action, actor, reason, selection)
    VALUES ('erase', p_by, p_why, 'key ' || p_key)
    RETURNING id INTO r_action;
    WITH e AS (
        UPDATE idemq.parked p SET body = ''::bytea, headers = NULL, properties = NULL,
               body_key = NULL, redrivable = false,
               body_size = coalesce(p.body_size, octet_length(p.body))
         WHERE p.key = p_key
        RETURNING p.id)
    INSERT INTO idemq.operator_action_keys (action_id, park_id, key, outcome)
    SELECT r_action, e.id, p_key, 'erased' FROM e;
    GET DIAGNOSTICS r_parks = ROW_COUNT;
    WITH e AS (
        UPDATE idemq.park_history h SET body = ''::bytea,
               park = h.park - 'headers' - 'properties' || jsonb_build_object('erased', true)
         WHERE h.key = p_key
        RETURNING h.id)
    INSERT INTO idemq.operator_action_keys (action_id, park_id, key, outcome)
    SELECT r_action, e.id, p_key, 'erased (resolved park)' FROM e
    ON CONFLICT DO NOTHING;
    GET DIAGNOSTICS r_history = ROW_COUNT;
    UPDATE idemq.intents i SET request_body = ''::bytea, request_body_key = NULL,
           body = ''::bytea, body_key = NULL, headers = NULL
     WHERE i.key = p_key;
    GET DIAGNOSTICS r_intents = ROW_COUNT;
    IF r_intents > 0 THEN
        INSERT INTO idemq.operator_action_keys (action_id, park_id, key, outcome)
        VALUES (r_action, 0, p_key, 'erased (provider intent)')
        ON CONFLICT DO NOTHING;
    END IF;
    UPDATE idemq.operator_actions a
       SET selected = r_parks + r_history + r_intents, done = r_parks + r_history + r_intents,
           finished_at = clock_timestamp()
     WHERE a.id = r_action;
    RETURN NEXT;
END
$fn$;
