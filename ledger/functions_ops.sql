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
CREATE OR REPLACE FUNCTION idemq.adopt_dead_letter(
    p_key text, p_queue text, p_exchange text, p_routing_key text, p_body bytea,
    p_headers jsonb, p_properties jsonb, p_sha text, p_code text, p_reason text,
    p_deliveries integer, p_by text)
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
        INSERT INTO idemq.parked (key, source_queue, exchange, routing_key, body, headers,
                                  properties, payload_sha256, error_class, error_code, reason,
                                  attempts, dlq_published_at, consumer_id, generation)
        VALUES (p_key, p_queue, p_exchange, p_routing_key, p_body, p_headers, p_properties,
                p_sha, 'broker', p_code, p_reason, coalesce(p_deliveries, 0),
                clock_timestamp(), p_by, r_generation)
        RETURNING id INTO r_park_id;
    END IF;
    RETURN NEXT;
END
$fn$;
