-- idemq failure groups, part of the repeatable function text
-- (applied by every `idemq migrate` when the text changed).

-- The reason of a park with what varies from message to message masked, so
-- that parks of one failure fall in one group. In this order:
--   1. the park's own key (literally)              -> <key>
--   2. a quoted string, '...' or "..."              -> <str>
--   3. a UUID (8-4-4-4-12 hex digits)               -> <uuid>
--   4. 0x and hex digits, or a run of 8 or more hex
--      digits holding both a digit and a letter     -> <hex>
--   5. a run of decimal digits                      -> <n>
-- Deterministic (IMMUTABLE): the same reason and key give the same text.
CREATE OR REPLACE FUNCTION idemq.mask_reason(p_reason text, p_key text)
RETURNS text LANGUAGE sql IMMUTABLE AS $fn$
    SELECT regexp_replace(regexp_replace(regexp_replace(regexp_replace(
             CASE WHEN p_key IS NULL OR p_key = '' THEN coalesce(p_reason, '')
                  ELSE replace(coalesce(p_reason, ''), p_key, '<key>') END,
             '''[^'']*''|"[^"]*"', '<str>', 'g'),
             '[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}',
             '<uuid>', 'g'),
             '0[xX][0-9a-fA-F]+|\m(?=[0-9a-fA-F]*[0-9])(?=[0-9a-fA-F]*[a-fA-F])[0-9a-fA-F]{8,}\M',
             '<hex>', 'g'),
             '[0-9]+', '<n>', 'g');
$fn$;

-- The failure group of a park: the first 12 hex digits of the SHA-256 of
-- its fingerprint, the lines source queue (its input), error class, error
-- code, SQLSTATE ('-' if none) and masked reason, joined by newlines.
CREATE OR REPLACE FUNCTION idemq.park_group(p_queue text, p_class text, p_code text,
                                            p_sqlstate text, p_reason text, p_key text)
RETURNS text LANGUAGE sql IMMUTABLE AS $fn$
    SELECT left(encode(sha256(convert_to(concat_ws(E'\n', p_queue, p_class, p_code,
                   coalesce(p_sqlstate, '-'), idemq.mask_reason(p_reason, p_key)), 'UTF8')),
                'hex'), 12);
$fn$;

-- `idemq parked discard|archive`: one bounded step of an operator action
-- (p_action_id, in idemq.operator_actions) on the open parks p_ids. Each
-- park still open is closed (moved to idemq.park_history, kept for `jobs
-- show`) and gets a row in idemq.operator_action_keys:
--   archive: closed as 'archived: REASON'; its dead-letter copy stays
--     redrivable (`idemq redrive --key KEY` still applies it).
--   discard: settled as not applied, for good. A provider key (parked, with
--     an intent) goes through idemq.provider_resolve 'discard' like `idemq
--     resolve --discard`; any other key's park is closed as 'discarded:
--     REASON' and its job row (still parked) moves to the next generation,
--     so a later redrive of the dead-letter copy is a duplicate.
-- A park closed meanwhile (by a redrive, another action) is skipped.
-- Returns how many parks it closed; adds them to the action's done count.
CREATE OR REPLACE FUNCTION idemq.ops_close_parks(p_action_id bigint, p_ids bigint[],
                                                 p_action text, p_by text, p_reason text)
RETURNS integer LANGUAGE plpgsql AS $fn$
DECLARE
    p       record;
    v_state text;
    v_n     integer := 0;
BEGIN
    IF p_action NOT IN ('discard', 'archive') THEN
        RAISE EXCEPTION 'unknown park action %', p_action USING ERRCODE = '22023';
    END IF;
    FOR p IN SELECT k.id, k.key, k.generation FROM idemq.parked k
              WHERE k.id = ANY (p_ids) ORDER BY k.id LOOP
        -- The job row first, then the park: the order apply_batch takes
        -- them in (a redrive being consumed meanwhile waits, or wins).
        SELECT j.state INTO v_state FROM idemq.jobs j WHERE j.key = p.key FOR UPDATE;
        PERFORM 1 FROM idemq.parked k WHERE k.id = p.id FOR UPDATE;
        IF NOT FOUND THEN
            CONTINUE; -- closed meanwhile, or by the provider resolve of an earlier park
        END IF;
        IF p_action = 'discard' AND v_state = 'parked'
           AND EXISTS (SELECT 1 FROM idemq.intents i WHERE i.key = p.key) THEN
            PERFORM idemq.provider_resolve(p.key, 'discard', NULL, p_by, p_reason, '{}'::jsonb);
        ELSE
            PERFORM idemq.close_park(p.id, CASE p_action WHEN 'discard' THEN 'discarded'
                                                         ELSE 'archived' END
                                           || ': ' || coalesce(p_reason, '-'), p_by);
            IF p_action = 'discard' AND v_state = 'parked' THEN
                UPDATE idemq.jobs j SET generation = j.generation + 1
                 WHERE j.key = p.key AND j.generation = p.generation;
            END IF;
        END IF;
        INSERT INTO idemq.operator_action_keys (action_id, park_id, key, outcome)
        VALUES (p_action_id, p.id, p.key,
                CASE p_action WHEN 'discard' THEN 'discarded' ELSE 'archived' END);
        v_n := v_n + 1;
    END LOOP;
    UPDATE idemq.operator_actions a SET done = a.done + v_n WHERE a.id = p_action_id;
    RETURN v_n;
END
$fn$;

-- An operator action begins (`idemq parked redrive|discard|archive`, the
-- console's actions): its row in idemq.operator_actions, before anything
-- is done. Returns its id. The operator's role writes the audit trail only
-- through these functions (SECURITY DEFINER, ledger/privileges.sql).
CREATE OR REPLACE FUNCTION idemq.ops_action_begin(p_action text, p_actor text, p_reason text,
                                                  p_selection text, p_selected integer)
RETURNS bigint LANGUAGE plpgsql AS $fn$
DECLARE
    v_id bigint;
BEGIN
    IF p_action NOT IN ('redrive', 'discard', 'archive') THEN
        RAISE EXCEPTION 'unknown park action %', p_action USING ERRCODE = '22023';
    END IF;
    INSERT INTO idemq.operator_actions (action, actor, reason, selection, selected)
    VALUES (p_action, p_actor, p_reason, p_selection, p_selected)
    RETURNING id INTO v_id;
    RETURN v_id;
END
$fn$;

-- A park of a redrive action moved: its dead-letter copy was published
-- back (confirmed) and acknowledged. One operator_action_keys row per park
-- (a repeat is ignored) and the action's done count. Returns 1 when
-- recorded, 0 when it was already.
CREATE OR REPLACE FUNCTION idemq.ops_action_moved(p_action_id bigint, p_park_id bigint,
                                                  p_key text)
RETURNS integer LANGUAGE plpgsql AS $fn$
DECLARE
    v_n integer;
BEGIN
    PERFORM 1 FROM idemq.operator_actions a
     WHERE a.id = p_action_id AND a.action = 'redrive' AND a.finished_at IS NULL;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'no redrive action % in progress', p_action_id USING ERRCODE = '22023';
    END IF;
    INSERT INTO idemq.operator_action_keys (action_id, park_id, key, outcome)
    VALUES (p_action_id, p_park_id, p_key, 'redriven')
    ON CONFLICT DO NOTHING;
    GET DIAGNOSTICS v_n = ROW_COUNT;
    UPDATE idemq.operator_actions a SET done = a.done + v_n WHERE a.id = p_action_id;
    RETURN v_n;
END
$fn$;

-- An operator action ends (whatever it managed: done says how much).
CREATE OR REPLACE FUNCTION idemq.ops_action_finish(p_action_id bigint)
RETURNS void LANGUAGE sql AS $fn$
    UPDATE idemq.operator_actions SET finished_at = clock_timestamp()
     WHERE id = p_action_id AND finished_at IS NULL;
$fn$;
