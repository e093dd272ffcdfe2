-- The W3C trace context of a PostgreSQL queue job (adapters/pgq.c), as
-- the broker's messages carry it in their headers: idemq.enqueue stores
-- the enqueuing transaction's settings idemq.traceparent and
-- idemq.tracestate (set by the producer, or by idemq itself when an effect
-- enqueues the next job), and the worker checks their shape when it takes
-- the row (consumer/trace.h) exactly as it checks a header. NULL: none.
-- Nullable columns without a default: adding them rewrites nothing.
ALTER TABLE idemq.queue_jobs
    ADD COLUMN traceparent text,
    ADD COLUMN tracestate  text;

-- The trace id of each attempt (the 32 hex digits of the job's
-- traceparent, as its meta carried it), so `idemq jobs show` and the
-- console name the trace of every attempt of a key. A plain apply keeps
-- its meta, traceparent included, in its batch row already. NULL: the job
-- came without a trace context (or before this version).
ALTER TABLE idemq.attempts ADD COLUMN trace_id text;
COMMENT ON COLUMN idemq.attempts.trace_id IS
  'W3C trace id (32 lowercase hex digits) of the job''s trace context; NULL when it had none.';

-- Partition tables made for a past slot but not attached yet were made
-- LIKE the old parent: give them the column too, or their ATTACH would fail.
DO $mig$
DECLARE
    r record;
BEGIN
    FOR r IN SELECT h.relname FROM idemq.history_parts h
              WHERE h.kind = 'attempts' AND NOT h.attached AND h.location = 'hot'
                AND to_regclass('idemq.' || quote_ident(h.relname)) IS NOT NULL LOOP
        EXECUTE format('ALTER TABLE idemq.%I ADD COLUMN IF NOT EXISTS trace_id text', r.relname);
    END LOOP;
END
$mig$;
