-- idemq ledger functions, part 2: the ledger lifecycle. Applied
-- with functions.sql as one text by every
-- `idemq migrate`; same rules (CREATE OR REPLACE, search_path pinned to
-- pg_catalog, idemq, every name schema-qualified).
--
-- * idemq.maintain: the one entry point of maintenance. SECURITY DEFINER:
--   it runs as the role that ran `idemq migrate` (the owner of the ledger),
--   so `idemq run` needs no DDL rights, only EXECUTE. It reads the windows
--   from idemq.retention (written by `idemq migrate`, never by its caller),
--   takes an advisory lock so that exactly one replica maintains at a time,
--   and does a bounded amount of work per call: creates partitions ahead,
--   prunes idemq.jobs past the dedup window, drops partitions past the
--   retention, archives (detaches) partitions past the hot window.
-- * idemq.close_park: moves a resolved park to idemq.park_history.
-- * idemq.key_attempts, idemq.key_history, idemq.job_info: the story of one
--   key across hot partitions, the v3 tables and the archive.

-- The windows (idemq.retention) as seconds, for the worker and commands.
CREATE OR REPLACE FUNCTION idemq.ledger_settings()
RETURNS jsonb
LANGUAGE sql STABLE SECURITY DEFINER
SET search_path = pg_catalog, idemq
AS $fn$
    SELECT jsonb_build_object(
        'dedup_window_s', extract(epoch FROM r.dedup_window),
        'partition_interval_s', extract(epoch FROM r.partition_interval),
        'history_hot_s', extract(epoch FROM r.history_hot),
        'history_retention_s', extract(epoch FROM r.history_retention),
        'updated_at', r.updated_at, 'updated_by', r.updated_by)
      FROM idemq.retention r WHERE r.id = 1;
$fn$;

-- Writes the windows (`idemq migrate`, as the ledger's owner: a caller
-- without UPDATE on idemq.retention cannot). Returns true if they changed.
CREATE OR REPLACE FUNCTION idemq.set_retention(p_window interval, p_interval interval,
                                               p_hot interval, p_retention interval,
                                               p_by text)
RETURNS boolean
LANGUAGE plpgsql
SET search_path = pg_catalog, idemq
AS $fn$
BEGIN
    UPDATE idemq.retention r
       SET dedup_window = p_window, partition_interval = p_interval, history_hot = p_hot,
           history_retention = p_retention, updated_at = clock_timestamp(), updated_by = p_by
     WHERE r.id = 1
       AND (r.dedup_window, r.partition_interval, r.history_hot, r.history_retention)
           IS DISTINCT FROM (p_window, p_interval, p_hot, p_retention);
    RETURN FOUND;
END
$fn$;

-- The time maintenance acts at: now, or, for tests and drills, the
-- session's idemq.maintenance_now setting. That is honoured only for a
-- session user who owns the ledger (who could drop its tables anyway), so a
-- role that may only EXECUTE cannot age history early.
CREATE OR REPLACE FUNCTION idemq.maintenance_now()
RETURNS timestamptz
LANGUAGE plpgsql
SET search_path = pg_catalog, idemq
AS $fn$
DECLARE
    v text := current_setting('idemq.maintenance_now', true);
BEGIN
    IF v IS NULL OR v = '' THEN
        RETURN clock_timestamp();
    END IF;
    IF NOT pg_catalog.pg_has_role(session_user,
            (SELECT c.relowner FROM pg_catalog.pg_class c
              WHERE c.oid = 'idemq.retention'::regclass), 'MEMBER') THEN
        RAISE EXCEPTION 'idemq.maintenance_now is honoured only for the owner of the ledger'
              USING ERRCODE = '42501';
    END IF;
    RETURN v::timestamptz;
END
$fn$;

-- The parent table and the partition column of a kind of history.
CREATE OR REPLACE FUNCTION idemq.history_parent(p_kind text, OUT parent text, OUT col text)
LANGUAGE sql IMMUTABLE
SET search_path = pg_catalog, idemq
AS $fn$
    SELECT CASE p_kind WHEN 'attempts' THEN 'attempts' WHEN 'batches' THEN 'batches'
                       WHEN 'redrives' THEN 'redrives' WHEN 'parks' THEN 'park_history'
                       WHEN 'outbox' THEN 'outbox_sent' END,
           CASE p_kind WHEN 'attempts' THEN 'started_at' WHEN 'batches' THEN 'at'
                       WHEN 'redrives' THEN 'redriven_at' WHEN 'parks' THEN 'resolved_at'
                       WHEN 'outbox' THEN 'sent_at' END;
$fn$;

-- The schema a registered history table is in.
CREATE OR REPLACE FUNCTION idemq.history_schema(p_location text)
RETURNS text
LANGUAGE sql IMMUTABLE
SET search_path = pg_catalog, idemq
AS $fn$
    SELECT CASE p_location WHEN 'archive' THEN 'idemq_archive' ELSE 'idemq' END;
$fn$;

-- t aligned down to a multiple of p_step seconds since the epoch.
CREATE OR REPLACE FUNCTION idemq.align_time(p_t timestamptz, p_step double precision)
RETURNS timestamptz
LANGUAGE sql IMMUTABLE
SET search_path = pg_catalog, idemq
AS $fn$
    SELECT pg_catalog.to_timestamp(floor(extract(epoch FROM p_t) / p_step) * p_step);
$fn$;

-- True for a filling partition: created unattached for a past slot whose
-- rows still move out of the default partition (idemq.fill_partition). The
-- other unattached hot tables are the v3 tables (from -infinity).
CREATE OR REPLACE FUNCTION idemq.history_filling(p_attached boolean, p_location text,
                                                 p_lo timestamptz)
RETURNS boolean
LANGUAGE sql IMMUTABLE
SET search_path = pg_catalog, idemq
AS $fn$
    SELECT NOT p_attached AND p_location = 'hot' AND p_lo > '-infinity'::timestamptz;
$fn$;

-- A maintenance step's failure, for the result of idemq.maintain (at most 8
-- kept; the count is in "failed").
CREATE OR REPLACE FUNCTION idemq.maintenance_error(p_errors jsonb, p_step text, p_rel text,
                                                   p_state text, p_message text)
RETURNS jsonb
LANGUAGE sql IMMUTABLE
SET search_path = pg_catalog, idemq
AS $fn$
    SELECT CASE WHEN jsonb_array_length(p_errors) >= 8 THEN p_errors
                ELSE p_errors || jsonb_build_array(jsonb_build_object(
                         'step', p_step, 'rel', p_rel, 'sqlstate', p_state,
                         'message', left(p_message, 300))) END;
$fn$;

-- Maintenance step (inside idemq.maintain): creates partition [p_lo, p_hi)
-- of a kind of history ahead of time (no row of its range exists yet) and
-- attaches it: ATTACH takes only SHARE UPDATE EXCLUSIVE on the parent, so
-- inserts go on.
DROP FUNCTION IF EXISTS idemq.create_partition(text, timestamptz, timestamptz);
CREATE OR REPLACE FUNCTION idemq.create_partition(p_kind text, p_lo timestamptz,
                                                  p_hi timestamptz, p_attach boolean)
RETURNS text
LANGUAGE plpgsql
SET search_path = pg_catalog, idemq
AS $fn$
DECLARE
    v_parent text;
    v_col    text;
    v_name   text;
    v_att    name;
BEGIN
    SELECT h.parent, h.col INTO v_parent, v_col FROM idemq.history_parent(p_kind) h;
    v_name := v_parent || '_p' || to_char(p_lo AT TIME ZONE 'UTC', 'YYYYMMDD"_"HH24MISS');
    IF EXISTS (SELECT 1 FROM idemq.history_parts h WHERE h.relname = v_name) THEN
        v_name := v_name || '_' || (SELECT count(*) FROM idemq.history_parts h
                                     WHERE h.relname LIKE v_name || '%');
    END IF;
    -- with the parent's indexes: a later ATTACH adopts them, builds nothing
    EXECUTE format('CREATE TABLE idemq.%I (LIKE idemq.%I INCLUDING DEFAULTS INCLUDING '
                   'CONSTRAINTS INCLUDING STORAGE INCLUDING COMPRESSION INCLUDING INDEXES)',
                   v_name, v_parent);
    EXECUTE format('ALTER TABLE idemq.%I ADD CONSTRAINT %I CHECK (%I >= %L::timestamptz '
                   'AND %I < %L::timestamptz)', v_name, v_name || '_range', v_col, p_lo,
                   v_col, p_hi);
    -- LIKE does not copy statistics targets: the columns ANALYZE skips
    -- (the batch rows' per-job arrays, migration 20) are skipped here too
    FOR v_att IN SELECT a.attname FROM pg_attribute a
                  WHERE a.attrelid = format('idemq.%I', v_parent)::regclass AND a.attnum > 0
                    AND NOT a.attisdropped AND a.attstattarget = 0 LOOP
        EXECUTE format('ALTER TABLE idemq.%I ALTER COLUMN %I SET STATISTICS 0', v_name, v_att);
    END LOOP;
    IF p_attach THEN
        EXECUTE format('ALTER TABLE idemq.%I ATTACH PARTITION idemq.%I FOR VALUES FROM (%L) '
                       'TO (%L)', v_parent, v_name, p_lo, p_hi);
    END IF;
    INSERT INTO idemq.history_parts (relname, kind, lo, hi, attached, location)
    VALUES (v_name, p_kind, p_lo, p_hi, p_attach, 'hot');
    RETURN v_name;
END
$fn$;

-- Maintenance step: moves at most p_rows rows of [lo, hi) of a filling
-- table p_rel (created unattached for a past slot whose rows wait in the
-- default partition) from the default partition into it, one bounded
-- DELETE ... INSERT by ctid; when none is left it can be attached (no writer
-- inserts into a slot that ended minutes ago; if one did, the ATTACH
-- (idemq.attach_filling, its own step) fails with 23514 and the next call
-- moves that row too). Returns the rows moved.
DROP FUNCTION IF EXISTS idemq.fill_partition(text, integer); -- its return type changed
CREATE OR REPLACE FUNCTION idemq.fill_partition(p_rel text, p_rows integer)
RETURNS bigint
LANGUAGE plpgsql
SET search_path = pg_catalog, idemq
AS $fn$
DECLARE
    h        idemq.history_parts;
    v_parent text;
    v_col    text;
    v_moved  bigint := 0;
BEGIN
    SELECT * INTO STRICT h FROM idemq.history_parts x WHERE x.relname = p_rel;
    SELECT x.parent, x.col INTO v_parent, v_col FROM idemq.history_parent(h.kind) x;
    IF p_rows > 0 THEN
        EXECUTE format('WITH m AS (DELETE FROM idemq.%I d WHERE d.ctid = ANY (ARRAY('
                       'SELECT x.ctid FROM idemq.%I x WHERE x.%I >= $1 AND x.%I < $2 '
                       'LIMIT $3)) RETURNING d.*) INSERT INTO idemq.%I SELECT * FROM m',
                       v_parent || '_default', v_parent || '_default', v_col, v_col, p_rel)
          USING h.lo, h.hi, p_rows;
        GET DIAGNOSTICS v_moved = ROW_COUNT;
    END IF;
    RETURN v_moved;
END
$fn$;

-- Maintenance step: attaches filling partition p_rel once no row of its
-- range is left in the default partition.
CREATE OR REPLACE FUNCTION idemq.attach_filling(p_rel text)
RETURNS void
LANGUAGE plpgsql
SET search_path = pg_catalog, idemq
AS $fn$
DECLARE
    h        idemq.history_parts;
    v_parent text;
BEGIN
    SELECT * INTO STRICT h FROM idemq.history_parts x WHERE x.relname = p_rel;
    SELECT x.parent INTO v_parent FROM idemq.history_parent(h.kind) x;
    EXECUTE format('ALTER TABLE idemq.%I ATTACH PARTITION idemq.%I FOR VALUES FROM (%L) TO (%L)',
                   v_parent, p_rel, h.lo, h.hi);
    UPDATE idemq.history_parts x SET attached = true WHERE x.relname = p_rel;
END
$fn$;

-- Maintenance step: the partitions of one kind of history.
-- * Rows in the default partition (before the first partition, or in a gap
--   left while maintenance did not run) get a partition for their slot
--   only once the slot ended more than 5 minutes before p_now: never one
--   still receiving inserts (an ATTACH over a slot being written makes
--   those inserts fail). The partition is created unattached ("filling"),
--   the rows move into it in bounded batches (at most p_rows this call,
--   continued by the next calls), and it is attached once they are all in.
--   Meanwhile idemq.key_attempts and the other readers of one key read it.
-- * Ahead: contiguously from the last partition, but never from before the
--   slot after the one covering p_now + 30 s, up to p_now + max(4
--   intervals, 1 minute). The slot covering now stays in the default
--   partition when there is no partition for it; its rows move once it is
--   past, as above. Only a new ledger (no partition of the kind yet, an
--   empty default partition) gets one from the slot covering now.
-- Stops at p_deadline. A step that fails (a lock wait, a 23514, a statement
-- timeout, any error) is undone alone, reported, and the others go on.
-- Returns {"created", "rescued": rows moved, "waits", "more": bool,
-- "errors": [...], "failed"}.
DROP FUNCTION IF EXISTS idemq.ensure_partitions(text, interval, timestamptz, timestamptz);
CREATE OR REPLACE FUNCTION idemq.ensure_partitions(p_kind text, p_interval interval,
                                                   p_now timestamptz,
                                                   p_deadline timestamptz, p_rows integer)
RETURNS jsonb
LANGUAGE plpgsql
SET search_path = pg_catalog, idemq
AS $fn$
DECLARE
    v_parent  text;
    v_col     text;
    v_step    double precision := extract(epoch FROM p_interval);
    v_past    timestamptz := p_now - interval '5 minutes';
    v_target  timestamptz;
    v_next    timestamptz;
    v_first   timestamptz;
    v_slot    timestamptz;
    v_lo      timestamptz;
    v_hi      timestamptz;
    v_rel     text;
    v_n       bigint;
    v_rows    integer := greatest(p_rows, 0);
    v_created integer := 0;
    v_rescued bigint := 0;
    v_waits   integer := 0;
    v_failed  integer := 0;
    v_errors  jsonb := '[]';
    v_more    boolean := false;
    v_any     boolean;
    v_filling boolean;
BEGIN
    SELECT h.parent, h.col INTO v_parent, v_col FROM idemq.history_parent(p_kind) h;
    v_target := p_now + make_interval(secs => greatest(4 * v_step, 60));
    -- 1. Past slots with rows in the default partition: new filling
    --    partitions (cut to the free part between existing ones). Looked
    --    for (a scan of the default partition) only when none is filling.
    SELECT EXISTS (SELECT 1 FROM idemq.history_parts h WHERE h.kind = p_kind
                     AND idemq.history_filling(h.attached, h.location, h.lo))
      INTO v_filling;
    FOR v_slot IN EXECUTE format('SELECT DISTINCT idemq.align_time(d.%I, $1) FROM idemq.%I d '
                                 'WHERE d.%I < $2 AND NOT $3 ORDER BY 1', v_col,
                                 v_parent || '_default', v_col)
                    USING v_step, v_past, v_filling LOOP
        EXIT WHEN v_slot + p_interval > v_past;
        SELECT coalesce(max(h.hi) FILTER (WHERE h.hi <= v_slot + p_interval), v_slot),
               coalesce(min(h.lo) FILTER (WHERE h.lo >= v_slot), v_slot + p_interval)
          INTO v_lo, v_hi
          FROM idemq.history_parts h
         WHERE h.kind = p_kind
           AND (h.attached OR idemq.history_filling(h.attached, h.location, h.lo));
        v_lo := greatest(v_lo, v_slot);
        v_hi := least(v_hi, v_slot + p_interval);
        CONTINUE WHEN v_lo >= v_hi OR EXISTS (SELECT 1 FROM idemq.history_parts h
            WHERE h.kind = p_kind
              AND (h.attached OR idemq.history_filling(h.attached, h.location, h.lo))
              AND h.lo < v_hi AND h.hi > v_lo);
        IF clock_timestamp() >= p_deadline THEN
            v_more := true;
            EXIT;
        END IF;
        BEGIN
            PERFORM idemq.create_partition(p_kind, v_lo, v_hi, false);
        EXCEPTION
            WHEN lock_not_available THEN
                v_waits := v_waits + 1;
                v_more := true;
            WHEN query_canceled THEN
                IF SQLERRM NOT LIKE '%statement timeout%' THEN
                    RAISE;
                END IF;
                v_failed := v_failed + 1;
                v_errors := idemq.maintenance_error(v_errors, 'partition', p_kind, SQLSTATE,
                                                    SQLERRM);
            WHEN OTHERS THEN
                v_failed := v_failed + 1;
                v_errors := idemq.maintenance_error(v_errors, 'partition', p_kind, SQLSTATE,
                                                    SQLERRM);
        END;
    END LOOP;
    -- 2. Filling partitions: the next batch of rows, then the ATTACH.
    FOR v_rel IN SELECT h.relname FROM idemq.history_parts h
                  WHERE h.kind = p_kind AND idemq.history_filling(h.attached, h.location, h.lo)
                  ORDER BY h.lo LOOP
        IF clock_timestamp() >= p_deadline OR v_rows <= 0 THEN
            v_more := true;
            EXIT;
        END IF;
        BEGIN
            v_n := idemq.fill_partition(v_rel, v_rows);
            v_rescued := v_rescued + v_n;
            v_rows := v_rows - v_n::integer;
        EXCEPTION
            WHEN lock_not_available THEN
                v_waits := v_waits + 1;
                v_more := true;
                CONTINUE;
            WHEN query_canceled THEN
                IF SQLERRM NOT LIKE '%statement timeout%' THEN
                    RAISE;
                END IF;
                v_failed := v_failed + 1;
                v_more := true;
                v_errors := idemq.maintenance_error(v_errors, 'move', v_rel, SQLSTATE, SQLERRM);
                CONTINUE;
            WHEN OTHERS THEN
                v_failed := v_failed + 1;
                v_more := true;
                v_errors := idemq.maintenance_error(v_errors, 'move', v_rel, SQLSTATE, SQLERRM);
                CONTINUE;
        END;
        IF v_rows <= 0 THEN -- the bound reached: maybe more rows of it wait
            v_more := true;
            CONTINUE;
        END IF;
        BEGIN
            PERFORM idemq.attach_filling(v_rel);
            v_created := v_created + 1;
        EXCEPTION
            WHEN lock_not_available THEN
                v_waits := v_waits + 1;
                v_more := true;
            WHEN query_canceled THEN
                IF SQLERRM NOT LIKE '%statement timeout%' THEN
                    RAISE;
                END IF;
                v_failed := v_failed + 1;
                v_more := true;
                v_errors := idemq.maintenance_error(v_errors, 'attach', v_rel, SQLSTATE,
                                                    SQLERRM);
            WHEN OTHERS THEN
                v_failed := v_failed + 1;
                v_more := true;
                v_errors := idemq.maintenance_error(v_errors, 'attach', v_rel, SQLSTATE,
                                                    SQLERRM);
        END;
    END LOOP;
    -- 3. Ahead, contiguously from the last partition, never over a slot
    --    that may receive inserts while the ATTACH runs.
    SELECT max(h.hi) INTO v_next FROM idemq.history_parts h
     WHERE h.kind = p_kind
       AND (h.attached OR idemq.history_filling(h.attached, h.location, h.lo));
    IF v_next IS NULL THEN
        EXECUTE format('SELECT EXISTS (SELECT 1 FROM idemq.%I)', v_parent || '_default')
           INTO v_any;
    END IF;
    IF v_next IS NULL AND NOT v_any THEN
        -- a new ledger (`idemq migrate`, before any worker wrote history):
        -- from the slot covering now
        v_first := idemq.align_time(p_now, v_step);
    ELSE
        v_first := idemq.align_time(p_now + interval '30 seconds', v_step) + p_interval;
    END IF;
    v_next := greatest(coalesce(v_next, v_first), v_first);
    WHILE v_next < v_target LOOP
        IF clock_timestamp() >= p_deadline THEN
            v_more := true;
            EXIT;
        END IF;
        BEGIN
            PERFORM idemq.create_partition(p_kind, v_next, v_next + p_interval, true);
            v_created := v_created + 1;
        EXCEPTION
            WHEN lock_not_available THEN
                v_waits := v_waits + 1;
                v_more := true;
                EXIT;
            WHEN query_canceled THEN
                IF SQLERRM NOT LIKE '%statement timeout%' THEN
                    RAISE;
                END IF;
                v_failed := v_failed + 1;
                v_errors := idemq.maintenance_error(v_errors, 'ahead', p_kind, SQLSTATE, SQLERRM);
                EXIT;
            WHEN OTHERS THEN
                v_failed := v_failed + 1;
                v_errors := idemq.maintenance_error(v_errors, 'ahead', p_kind, SQLSTATE, SQLERRM);
                EXIT;
        END;
        v_next := v_next + p_interval;
    END LOOP;
    RETURN jsonb_build_object('created', v_created, 'rescued', v_rescued, 'waits', v_waits,
                              'more', v_more, 'failed', v_failed, 'errors', v_errors);
END
$fn$;

-- Maintenance step: reads one history table past the dedup window in
-- chunks of heap blocks (a TID range scan, in the order it was written)
-- and deletes from idemq.jobs the keys it settled that are settled
-- (applied or stale) since before p_cutoff. Bounded DELETEs by key through
-- the primary key; a key that is not settled is never touched. Returns
-- {"pruned": keys deleted, "block": where it stopped, "done": bool}.
CREATE OR REPLACE FUNCTION idemq.prune_part(p_relname text, p_kind text, p_schema text,
                                            p_from bigint, p_cutoff timestamptz,
                                            p_deadline timestamptz)
RETURNS jsonb
LANGUAGE plpgsql
SET search_path = pg_catalog, idemq
AS $fn$
DECLARE
    v_nblocks bigint;
    v_b       bigint := p_from;
    v_to      bigint;
    v_keys    text[];
    v_n       bigint;
    v_pruned  bigint := 0;
    v_sql     text;
BEGIN
    v_nblocks := pg_catalog.pg_relation_size(format('%I.%I', p_schema, p_relname)::regclass)
                 / current_setting('block_size')::bigint;
    IF p_kind = 'batches' THEN
        v_sql := format('SELECT array_agg(k.k) FROM %I.%I b, unnest(b.keys) AS k(k) '
                        'WHERE b.ctid >= $1 AND b.ctid < $2', p_schema, p_relname);
    ELSE
        v_sql := format('SELECT array_agg(a.key) FROM %I.%I a WHERE a.ctid >= $1 '
                        'AND a.ctid < $2 AND (a.outcome = ''applied'' OR '
                        '(a.outcome = ''duplicate'' AND a.message LIKE ''stale%%''))',
                        p_schema, p_relname);
    END IF;
    WHILE v_b < v_nblocks AND clock_timestamp() < p_deadline LOOP
        v_to := v_b + CASE WHEN p_kind = 'batches' THEN 4 ELSE 16 END;
        EXECUTE v_sql INTO v_keys
          USING format('(%s,0)', v_b)::tid, format('(%s,0)', v_to)::tid;
        IF v_keys IS NOT NULL THEN
            -- A provider key's intent in a final state goes with it.
            WITH d AS (
                DELETE FROM idemq.jobs j
                 WHERE j.key = ANY (v_keys) AND j.state IN ('applied', 'stale')
                   AND coalesce(j.applied_at, j.last_attempt_at, j.first_seen_at) < p_cutoff
                RETURNING j.key
            ), di AS (
                DELETE FROM idemq.intents i USING d
                 WHERE i.key = d.key
                   AND i.state IN ('applied', 'rejected', 'not_applied', 'discarded')
            )
            SELECT count(*) INTO v_n FROM d;
            v_pruned := v_pruned + v_n;
        END IF;
        v_b := v_to;
    END LOOP;
    RETURN jsonb_build_object('pruned', v_pruned, 'block', least(v_b, v_nblocks),
                              'done', v_b >= v_nblocks);
END
$fn$;

-- Maintenance, one bounded call (about p_budget_ms; see the top of this
-- file). Exactly one session at a time does it (an advisory lock; a second
-- caller gets {"busy": true} at once). Order: partitions ahead (CREATE and
-- ATTACH: weak locks), pruning of idemq.jobs past the dedup window (small
-- DELETEs by key), drops of detached partitions past the retention, and
-- last, at most one DETACH (archive, or a drop of a partition still
-- attached), which holds ACCESS EXCLUSIVE on its parent until this call
-- commits: as the last statement, that is a few milliseconds. A step that
-- waits longer than lock_timeout for a lock is left for the next call. Rows
-- that wait in a default partition move at most 10,000 per call (the rest
-- in the next calls). A step that fails otherwise (23514, a statement
-- timeout, any error) is undone alone and reported; the other steps run.
-- Returns what it did: {"busy", "created", "rescued" (rows moved out of
-- default partitions), "pruned", "dropped", "archived", "waits", "more"
-- (work is left: call again soon), "failed" (steps), "errors" (the first 8:
-- step, rel, sqlstate, message)}.
CREATE OR REPLACE FUNCTION idemq.maintain(p_who text, p_budget_ms integer DEFAULT 200)
RETURNS jsonb
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, idemq
SET lock_timeout = '100ms'
AS $fn$
DECLARE
    v_t0       timestamptz := clock_timestamp();
    v_now      timestamptz;
    v_deadline timestamptz;
    s          idemq.retention;
    k          text;
    p          record;
    v_res      jsonb;
    v_parent   text;
    v_created  integer := 0;
    v_rescued  bigint := 0;
    v_pruned   bigint := 0;
    v_dropped  integer := 0;
    v_archived integer := 0;
    v_waits    integer := 0;
    v_more     boolean := false;
    v_run      bigint;
    v_out      jsonb;
    v_rows     integer := 10000; -- rows moved out of default partitions per call, at most
    v_failed   integer := 0;
    v_errors   jsonb := '[]';
    v_e        jsonb;
BEGIN
    IF NOT pg_catalog.pg_try_advisory_xact_lock(7164372136) THEN
        RETURN jsonb_build_object('busy', true, 'more', false);
    END IF;
    v_now := idemq.maintenance_now();
    v_deadline := v_t0 + make_interval(secs => least(greatest(p_budget_ms, 10), 60000) / 1000.0);
    SELECT * INTO STRICT s FROM idemq.retention r WHERE r.id = 1;

    -- 1. Partitions ahead (and for rows waiting in a default partition).
    -- (outbox: the sent rows of the transactional outbox, migration 0017)
    FOREACH k IN ARRAY ARRAY['batches', 'attempts', 'redrives', 'parks', 'outbox'] LOOP
        v_res := idemq.ensure_partitions(k, s.partition_interval, v_now, v_deadline,
                                         (v_rows - v_rescued)::integer);
        v_created := v_created + (v_res->>'created')::integer;
        v_rescued := v_rescued + (v_res->>'rescued')::bigint;
        v_waits := v_waits + (v_res->>'waits')::integer;
        v_more := v_more OR (v_res->>'more')::boolean;
        v_failed := v_failed + (v_res->>'failed')::integer;
        FOR v_e IN SELECT e FROM jsonb_array_elements(v_res->'errors') AS e LOOP
            v_errors := idemq.maintenance_error(v_errors, v_e->>'step', v_e->>'rel',
                                                v_e->>'sqlstate', v_e->>'message');
        END LOOP;
    END LOOP;

    -- 2. The dedup set past the window, read from the history that settled it.
    FOR p IN SELECT h.* FROM idemq.history_parts h
              WHERE h.kind IN ('attempts', 'batches') AND h.location <> 'dropped'
                AND NOT idemq.history_filling(h.attached, h.location, h.lo)
                AND h.pruned_at IS NULL AND h.hi <= v_now - s.dedup_window
              ORDER BY h.lo LOOP
        IF clock_timestamp() >= v_deadline THEN
            v_more := true;
            EXIT;
        END IF;
        BEGIN
            v_res := idemq.prune_part(p.relname, p.kind, idemq.history_schema(p.location),
                                      p.prune_block, v_now - s.dedup_window, v_deadline);
        EXCEPTION
            WHEN lock_not_available THEN
                v_waits := v_waits + 1;
                v_more := true;
                EXIT;
            WHEN query_canceled THEN
                IF SQLERRM NOT LIKE '%statement timeout%' THEN
                    RAISE;
                END IF;
                v_failed := v_failed + 1;
                v_errors := idemq.maintenance_error(v_errors, 'prune', p.relname, SQLSTATE,
                                                    SQLERRM);
                CONTINUE;
            WHEN OTHERS THEN
                v_failed := v_failed + 1;
                v_errors := idemq.maintenance_error(v_errors, 'prune', p.relname, SQLSTATE,
                                                    SQLERRM);
                CONTINUE;
        END;
        v_pruned := v_pruned + (v_res->>'pruned')::bigint;
        UPDATE idemq.history_parts h
           SET prune_block = (v_res->>'block')::bigint,
               pruned_at = CASE WHEN (v_res->>'done')::boolean THEN v_now END
         WHERE h.relname = p.relname;
        v_more := v_more OR NOT (v_res->>'done')::boolean;
    END LOOP;

    -- 3. Past the retention: drop (detached tables only here).
    FOR p IN SELECT h.* FROM idemq.history_parts h
              WHERE h.location <> 'dropped' AND NOT h.attached
                AND NOT idemq.history_filling(h.attached, h.location, h.lo)
                AND h.hi <= v_now - s.history_retention
                AND (h.pruned_at IS NOT NULL OR h.kind IN ('redrives', 'parks', 'outbox'))
              ORDER BY h.lo LOOP
        IF clock_timestamp() >= v_deadline THEN
            v_more := true;
            EXIT;
        END IF;
        BEGIN
            EXECUTE format('DROP TABLE %I.%I', idemq.history_schema(p.location), p.relname);
            UPDATE idemq.history_parts h SET location = 'dropped', dropped_at = v_now
             WHERE h.relname = p.relname;
            v_dropped := v_dropped + 1;
        EXCEPTION
            WHEN lock_not_available THEN
                v_waits := v_waits + 1;
                v_more := true;
            WHEN query_canceled THEN
                IF SQLERRM NOT LIKE '%statement timeout%' THEN
                    RAISE;
                END IF;
                v_failed := v_failed + 1;
                v_errors := idemq.maintenance_error(v_errors, 'drop', p.relname, SQLSTATE,
                                                    SQLERRM);
            WHEN OTHERS THEN
                v_failed := v_failed + 1;
                v_errors := idemq.maintenance_error(v_errors, 'drop', p.relname, SQLSTATE,
                                                    SQLERRM);
        END;
    END LOOP;

    -- 4. Past the hot window (or the retention, still attached): one DETACH
    --    into the archive schema, last.
    FOR p IN SELECT h.* FROM idemq.history_parts h
              WHERE h.location = 'hot' AND NOT idemq.history_filling(h.attached, h.location, h.lo)
                AND h.hi <= v_now - s.history_hot
              ORDER BY h.lo LIMIT 1 LOOP
        BEGIN
            IF p.attached THEN
                SELECT h.parent INTO v_parent FROM idemq.history_parent(p.kind) h;
                -- The DETACH queues for ACCESS EXCLUSIVE on the parent, and
                -- every insert into it queues behind: wait at most 10 ms
                -- (then try again on a later call), so the workers never
                -- stall longer than that.
                PERFORM pg_catalog.set_config('lock_timeout', '10ms', true);
                EXECUTE format('ALTER TABLE idemq.%I DETACH PARTITION idemq.%I', v_parent,
                               p.relname);
            END IF;
            EXECUTE format('ALTER TABLE idemq.%I SET SCHEMA idemq_archive', p.relname);
            UPDATE idemq.history_parts h
               SET attached = false, location = 'archive', archived_at = v_now
             WHERE h.relname = p.relname;
            v_archived := 1;
            v_more := v_more OR EXISTS (SELECT 1 FROM idemq.history_parts h
                WHERE h.location = 'hot' AND NOT idemq.history_filling(h.attached, h.location, h.lo)
                  AND h.hi <= v_now - s.history_hot);
        EXCEPTION
            WHEN lock_not_available THEN
                v_waits := v_waits + 1;
                v_more := true;
            WHEN query_canceled THEN
                IF SQLERRM NOT LIKE '%statement timeout%' THEN
                    RAISE;
                END IF;
                v_failed := v_failed + 1;
                v_errors := idemq.maintenance_error(v_errors, 'archive', p.relname, SQLSTATE,
                                                    SQLERRM);
            WHEN OTHERS THEN
                v_failed := v_failed + 1;
                v_errors := idemq.maintenance_error(v_errors, 'archive', p.relname, SQLSTATE,
                                                    SQLERRM);
        END;
    END LOOP;

    v_out := jsonb_build_object('busy', false, 'created', v_created, 'rescued', v_rescued,
                                'pruned', v_pruned, 'dropped', v_dropped,
                                'archived', v_archived, 'waits', v_waits, 'more', v_more,
                                'failed', v_failed, 'errors', v_errors);
    IF v_created + v_rescued + v_pruned + v_dropped + v_archived + v_failed > 0 THEN
        v_run := nextval('idemq.maintenance_runs_seq');
        INSERT INTO idemq.maintenance_runs AS m (slot, run_id, started_at, finished_at, who,
                                                 actions)
        VALUES ((v_run % 1024)::integer, v_run, v_t0, clock_timestamp(), p_who, v_out)
        ON CONFLICT (slot) DO UPDATE
           SET run_id = excluded.run_id, started_at = excluded.started_at,
               finished_at = excluded.finished_at, who = excluded.who,
               actions = excluded.actions;
    END IF;
    RETURN v_out;
END
$fn$;

-- Records the export of an archived partition (`idemq archive export`).
CREATE OR REPLACE FUNCTION idemq.archive_exported(p_relname text, p_file text, p_sha256 text,
                                                  p_rows bigint)
RETURNS void
LANGUAGE sql
SET search_path = pg_catalog, idemq
AS $fn$
    UPDATE idemq.history_parts h
       SET exported_at = clock_timestamp(), export_file = p_file, export_sha256 = p_sha256,
           export_rows = p_rows
     WHERE h.relname = p_relname;
$fn$;

-- Resolves an open park: moves it from idemq.parked to idemq.park_history
-- (same id; the park row, body apart, kept as jsonb), with the resolution
-- and who resolved it. Inside the resolving transaction (a redrive in
-- idemq.apply_batch; `idemq resolve`). Returns false if p_id is not open.
CREATE OR REPLACE FUNCTION idemq.close_park(p_id bigint, p_resolution text, p_by text)
RETURNS boolean
LANGUAGE plpgsql
SET search_path = pg_catalog, idemq
AS $fn$
DECLARE
    v_n integer;
BEGIN
    WITH p AS (DELETE FROM idemq.parked p WHERE p.id = p_id RETURNING p.*)
    INSERT INTO idemq.park_history (id, key, source_queue, generation, parked_at, resolved_at,
                                    resolution, resolved_by, body, park)
    SELECT p.id, p.key, p.source_queue, p.generation, p.parked_at, clock_timestamp(),
           p_resolution, p_by, p.body, to_jsonb(p) - 'body'
      FROM p;
    GET DIAGNOSTICS v_n = ROW_COUNT;
    RETURN v_n > 0;
END
$fn$;

-- Every attempt row of a key: the hot partitions, then the v3 table and the
-- archived partitions (dropped ones are gone). SECURITY DEFINER: `run`
-- (record_failure) and `jobs show` read the archive through it.
CREATE OR REPLACE FUNCTION idemq.key_attempts(p_key text)
RETURNS SETOF idemq.attempts
LANGUAGE plpgsql STABLE SECURITY DEFINER
SET search_path = pg_catalog, idemq
AS $fn$
DECLARE
    r record;
BEGIN
    RETURN QUERY SELECT a.* FROM idemq.attempts a WHERE a.key = p_key;
    FOR r IN SELECT h.relname, h.location FROM idemq.history_parts h
              WHERE h.kind = 'attempts' AND NOT h.attached AND h.location <> 'dropped'
              ORDER BY h.lo LOOP
        RETURN QUERY EXECUTE format(
            'SELECT a.id, a.key, a.attempt, a.outcome, a.started_at, a.finished_at, '
            'a.error_class, a.error_code, a.sqlstate, a.message, a.queue, a.routing_key, '
            'a.redelivered, a.delivery_count, a.consumer_id, a.generation, a.delay_ms, '
            -- acquired_count (0016): tables archived before it have none
            '(to_jsonb(a)->>''acquired_count'')::integer, '
            -- trace_id (0023): likewise
            'to_jsonb(a)->>''trace_id'' '
            'FROM %I.%I a WHERE a.key = $1', idemq.history_schema(r.location), r.relname)
          USING p_key;
    END LOOP;
END
$fn$;

-- A key's plain apply in the batch history, and the later copies of the key
-- in the same batch (duplicates): one row per position, with the batch's
-- facts and the position's SHA-256, meta and result. With p_at (its
-- applied_at) and p_id (its batch_id) through the batch's partition;
-- without them (the claim row is gone: pruned past the dedup window) by
-- scanning every batch partition that is left.
DROP FUNCTION IF EXISTS idemq.key_batches(text, timestamptz, bigint);
CREATE OR REPLACE FUNCTION idemq.key_batches(p_key text, p_at timestamptz, p_id bigint)
RETURNS TABLE (at timestamptz, id bigint, finished_at timestamptz, consumer_id text,
               jobs integer, pos integer, applied boolean, sha256 text, meta jsonb,
               result jsonb)
LANGUAGE plpgsql STABLE SECURITY DEFINER
SET search_path = pg_catalog, idemq
AS $fn$
DECLARE
    r     record;
    v_sel constant text :=
        'SELECT b.at, b.id, b.finished_at, b.consumer_id, cardinality(b.keys), u.o::integer, '
        'u.a, encode(substring(b.sha256 FROM (u.o::integer - 1) * 32 + 1 FOR 32), ''hex''), '
        'b.metas[b.meta_idx[u.o]], b.results[u.o] '
        'FROM %I.%I b CROSS JOIN LATERAL unnest(b.keys, b.applied) WITH ORDINALITY AS u(k, a, o) '
        'WHERE u.k = $1 AND (u.a OR u.o = ANY (b.dups))';
BEGIN
    IF p_at IS NOT NULL THEN
        RETURN QUERY EXECUTE format(v_sel || ' AND b.at = $2 AND b.id = $3', 'idemq', 'batches')
          USING p_key, p_at, p_id;
    ELSE
        RETURN QUERY EXECUTE format(v_sel || ' AND $1 = ANY (b.keys)', 'idemq', 'batches')
          USING p_key;
    END IF;
    FOR r IN SELECT h.relname, h.location FROM idemq.history_parts h
              WHERE h.kind = 'batches' AND NOT h.attached AND h.location <> 'dropped'
                AND (p_at IS NULL OR (h.lo <= p_at AND p_at < h.hi))
              ORDER BY h.lo LOOP
        IF p_at IS NOT NULL THEN
            RETURN QUERY EXECUTE format(v_sel || ' AND b.at = $2 AND b.id = $3',
                                        idemq.history_schema(r.location), r.relname)
              USING p_key, p_at, p_id;
        ELSE
            RETURN QUERY EXECUTE format(v_sel || ' AND $1 = ANY (b.keys)',
                                        idemq.history_schema(r.location), r.relname)
              USING p_key;
        END IF;
    END LOOP;
END
$fn$;

-- The job row of a key with what a plain apply keeps in its batch row
-- (queue, payload SHA-256, result) filled in. No row if the key is not
-- claimed (never seen, or pruned past the dedup window).
CREATE OR REPLACE FUNCTION idemq.job_info(p_key text)
RETURNS TABLE (state text, attempts integer, generation integer, budget_base integer,
               first_seen_at timestamptz, applied_at timestamptz, run_after timestamptz,
               result jsonb, last_error_class text, last_sqlstate text, last_error text,
               source_queue text, payload_sha256 text, batch_id bigint)
LANGUAGE plpgsql STABLE SECURITY DEFINER
SET search_path = pg_catalog, idemq
AS $fn$
DECLARE
    j idemq.jobs;
    b record;
BEGIN
    SELECT * INTO j FROM idemq.jobs t WHERE t.key = p_key;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    SELECT NULL::jsonb AS result, NULL::jsonb AS meta, NULL::text AS sha256 INTO b;
    IF j.batch_id IS NOT NULL THEN
        SELECT x.result, x.meta, x.sha256 INTO b
          FROM idemq.key_batches(p_key, j.applied_at, j.batch_id) x WHERE x.applied LIMIT 1;
    END IF;
    RETURN QUERY SELECT j.state, j.attempts, j.generation, j.budget_base, j.first_seen_at,
           j.applied_at, j.run_after,
           CASE WHEN j.batch_id IS NULL THEN j.result ELSE coalesce(j.result, b.result) END,
           j.last_error_class, j.last_sqlstate, j.last_error,
           CASE WHEN j.batch_id IS NULL THEN j.source_queue
                ELSE coalesce(j.source_queue, b.meta->>'queue') END,
           CASE WHEN j.batch_id IS NULL THEN j.payload_sha256
                ELSE coalesce(j.payload_sha256, b.sha256) END,
           j.batch_id;
END
$fn$;

-- The whole story of a key, every source: attempts (hot, v3, archive), the
-- plain apply and its in-batch copies from the batch history, parks (open
-- and resolved), redrives, and a deferred wait. One row per event, to be
-- ordered by (at, ord, id). kind: attempt, apply, copy, park, redrive or
-- deferred. outcome: the attempt's outcome (apply: applied; copy:
-- duplicate; park: parked or resolved). The delivery facts are those of
-- the attempt or copy; what is the event in words (`idemq jobs show`).
DROP FUNCTION IF EXISTS idemq.key_history(text);
CREATE OR REPLACE FUNCTION idemq.key_history(p_key text)
RETURNS TABLE (at timestamptz, ord integer, id bigint, kind text, outcome text,
               attempt integer, generation integer, queue text, redelivered boolean,
               delivery_count integer, consumer_id text, started_at timestamptz,
               finished_at timestamptz, what text)
LANGUAGE plpgsql STABLE SECURITY DEFINER
SET search_path = pg_catalog, idemq
AS $fn$
DECLARE
    j record;
    r record;
BEGIN
    SELECT t.key, t.applied_at, t.batch_id INTO j FROM idemq.jobs t WHERE t.key = p_key;
    RETURN QUERY
    -- Attempts in id order (the order their transactions committed: a
    -- duplicate waits for the applier's claim), so a duplicate never shows
    -- before the attempt that applied; the running max keeps the sort key
    -- of attempts monotonic in id order.
    SELECT max(a.finished_at) OVER (ORDER BY a.id), 1, a.id, 'attempt'::text, a.outcome,
           a.attempt, a.generation, a.queue,
           a.redelivered, a.delivery_count, a.consumer_id, a.started_at, a.finished_at,
           format('%s%s%s%s%s%s  [started %s, queue %s, redelivered %s%s, %s]',
               CASE WHEN a.outcome = 'duplicate' THEN 'duplicate delivery, no effect'
                    ELSE format('attempt %s (generation %s): %s', a.attempt, a.generation,
                                a.outcome) END,
               coalesce(' ' || a.error_class, ''), coalesce(' ' || a.error_code, ''),
               coalesce(' SQLSTATE ' || a.sqlstate, ''), coalesce(': ' || a.message, '')
               || CASE WHEN a.outcome = 'transient_error' THEN ' (retry in ' || a.delay_ms || ' ms)'
                       WHEN a.outcome = 'delayed' THEN ' (early; waits ' || a.delay_ms || ' ms more)'
                       ELSE '' END,
               CASE WHEN a.outcome = 'applied' THEN '  <== the effect was applied here' ELSE '' END,
               a.started_at, a.queue, a.redelivered,
               coalesce(', delivery count ' || a.delivery_count, '') ||
               coalesce(', acquired ' || a.acquired_count || ' times', ''),
               concat(a.consumer_id, ', trace ' || a.trace_id))
      FROM idemq.key_attempts(p_key) a;
    IF j.batch_id IS NOT NULL OR j.key IS NULL THEN
        RETURN QUERY
        SELECT b.finished_at, 1, b.id, CASE WHEN b.applied THEN 'apply' ELSE 'copy' END,
               CASE WHEN b.applied THEN 'applied' ELSE 'duplicate' END, 1, 0,
               b.meta->>'queue', (b.meta->>'redelivered')::boolean,
               (b.meta->>'delivery_count')::integer, b.consumer_id, b.at, b.finished_at,
               format('%s, batch #%s of %s jobs (position %s)%s  '
                      '[started %s, queue %s, redelivered %s%s, %s]',
                   CASE WHEN b.applied THEN 'attempt 1 (generation 0): applied'
                        ELSE 'duplicate delivery, no effect: a later copy in the same batch' END,
                   b.id, b.jobs, b.pos,
                   CASE WHEN b.applied THEN '  <== the effect was applied here' ELSE '' END,
                   b.at, b.meta->>'queue', b.meta->>'redelivered',
                   coalesce(', delivery count ' || (b.meta->>'delivery_count'), '') ||
                   coalesce(', acquired ' || (b.meta->>'acquired_count') || ' times', ''),
                   concat(b.consumer_id, ', trace ' || idemq.trace_id_of(b.meta)))
          FROM idemq.key_batches(p_key, j.applied_at, j.batch_id) b;
    END IF;
    RETURN QUERY
    SELECT p.parked_at, 2, p.id, 'park'::text, 'parked'::text, p.attempts, p.generation,
           p.source_queue, NULL::boolean, NULL::integer, p.consumer_id, p.first_attempt_at,
           p.last_attempt_at,
           format('parked #%s (generation %s): %s %s%s: %s; %s attempts; dead-lettered %s%s',
               p.id, p.generation, p.error_class, p.error_code,
               coalesce(' SQLSTATE ' || p.sqlstate, ''), p.reason, p.attempts,
               coalesce(p.dlq_published_at::text, 'not confirmed yet'),
               CASE WHEN p.redrivable THEN ''
                    ELSE format('; not redrivable (body %s of %s bytes kept)', octet_length(p.body),
                                coalesce(p.body_size, octet_length(p.body))) END)
      FROM idemq.parked p WHERE p.key = p_key;
    RETURN QUERY
    SELECT h.parked_at, 2, h.id, 'park'::text, 'resolved'::text,
           (h.park->>'attempts')::integer, h.generation, h.source_queue, NULL::boolean,
           NULL::integer, h.park->>'consumer_id', h.parked_at, h.resolved_at,
           format('parked #%s (generation %s): %s %s%s: %s; %s attempts; resolved %s by %s: %s',
               h.id, h.generation, h.park->>'error_class', h.park->>'error_code',
               coalesce(' SQLSTATE ' || (h.park->>'sqlstate'), ''), h.park->>'reason',
               h.park->>'attempts', h.resolved_at, coalesce(h.resolved_by, '-'), h.resolution)
      FROM idemq.park_history h WHERE h.key = p_key;
    RETURN QUERY
    SELECT d.redriven_at, 3, d.id, 'redrive'::text, NULL::text, NULL::integer, d.generation,
           NULL::text, NULL::boolean, NULL::integer, d.consumer_id, d.redriven_at,
           d.redriven_at,
           format('redrive to generation %s by %s (park #%s): fresh attempt budget',
               d.generation, d.source, coalesce(d.park_id::text, '?'))
      FROM idemq.redrives d WHERE d.key = p_key;
    FOR r IN SELECT h.relname, h.kind, h.location FROM idemq.history_parts h
              WHERE h.kind IN ('redrives', 'parks') AND NOT h.attached
                AND h.location <> 'dropped' ORDER BY h.lo LOOP
        IF r.kind = 'redrives' THEN
            RETURN QUERY EXECUTE format(
                'SELECT d.redriven_at, 3, d.id, ''redrive''::text, NULL::text, NULL::integer, '
                'd.generation, NULL::text, NULL::boolean, NULL::integer, d.consumer_id, '
                'd.redriven_at, d.redriven_at, '
                'format(''redrive to generation %%s by %%s (park #%%s): fresh attempt budget'', '
                'd.generation, d.source, coalesce(d.park_id::text, ''?'')) '
                'FROM %I.%I d WHERE d.key = $1', idemq.history_schema(r.location), r.relname)
              USING p_key;
        ELSE
            RETURN QUERY EXECUTE format(
                'SELECT h.parked_at, 2, h.id, ''park''::text, ''resolved''::text, '
                '(h.park->>''attempts'')::integer, h.generation, h.source_queue, '
                'NULL::boolean, NULL::integer, h.park->>''consumer_id'', h.parked_at, '
                'h.resolved_at, '
                'format(''parked #%%s (generation %%s): %%s %%s: %%s; resolved %%s by %%s: %%s'', '
                'h.id, h.generation, h.park->>''error_class'', h.park->>''error_code'', '
                'h.park->>''reason'', h.resolved_at, coalesce(h.resolved_by, ''-''), h.resolution) '
                'FROM %I.%I h WHERE h.key = $1', idemq.history_schema(r.location), r.relname)
              USING p_key;
        END IF;
    END LOOP;
    RETURN QUERY
    SELECT d.deferred_at, 4, d.id, 'deferred'::text, NULL::text, NULL::integer, NULL::integer,
           d.source_queue, NULL::boolean, NULL::integer, NULL::text, d.deferred_at, NULL::timestamptz,
           format('waiting in idemq.deferred (%s): ordering key %s, sequence %s; %s', d.reason,
               d.order_key, coalesce(d.seq::text, '-'),
               coalesce('reported as overdue at ' || d.reported_at, 'not overdue yet'))
      FROM idemq.deferred d WHERE d.key = p_key;
END
$fn$;

-- The plain path (ledger/ledger_plain.c), second statement: jobs whose key a
-- concurrent transaction claimed and committed while the plain statement
-- waited for it, so that statement's snapshot did not show the row. Visible
-- now: if each key is applied, every such delivery is a duplicate (an
-- attempt row each, in order) and true is returned; if one is not (or is
-- gone), nothing is written and false is returned: the worker rolls back and
-- applies the batch through idemq.apply_batch. p_jobs as in apply_batch.
CREATE OR REPLACE FUNCTION idemq.record_raced(p_jobs jsonb, p_consumer text,
                                              p_started timestamptz)
RETURNS boolean
LANGUAGE plpgsql
SET search_path = pg_catalog, idemq
AS $fn$
DECLARE
    j jsonb;
    t record;
BEGIN
    -- One lookup by key each: a handful of keys, never a scan of the table.
    FOR j IN SELECT e FROM jsonb_array_elements(p_jobs) AS e LOOP
        SELECT x.state, x.attempts, x.generation INTO t FROM idemq.jobs x WHERE x.key = j->>'k';
        IF NOT FOUND OR t.state <> 'applied' THEN
            RETURN false;
        END IF;
    END LOOP;
    FOR j IN SELECT e FROM jsonb_array_elements(p_jobs) AS e LOOP
        SELECT x.attempts, x.generation INTO t FROM idemq.jobs x WHERE x.key = j->>'k';
        INSERT INTO idemq.attempts (key, attempt, generation, outcome, started_at, finished_at,
            queue, routing_key, redelivered, delivery_count, acquired_count, consumer_id, message,
            trace_id)
        VALUES (j->>'k', t.attempts, t.generation, 'duplicate', p_started, clock_timestamp(),
            j->'m'->>'queue', j->'m'->>'routing_key', (j->'m'->>'redelivered')::boolean,
            (j->'m'->>'delivery_count')::integer,
            (j->'m'->>'acquired_count')::integer, p_consumer, 'applied',
            idemq.trace_id_of(j->'m'));
    END LOOP;
    RETURN true;
END
$fn$;

-- Only idemq.maintain (as the owner) runs the DDL steps.
REVOKE EXECUTE ON FUNCTION idemq.create_partition(text, timestamptz, timestamptz, boolean)
    FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION idemq.fill_partition(text, integer) FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION idemq.attach_filling(text) FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION idemq.ensure_partitions(text, interval, timestamptz, timestamptz,
                                                   integer)
    FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION idemq.prune_part(text, text, text, bigint, timestamptz, timestamptz)
    FROM PUBLIC;
