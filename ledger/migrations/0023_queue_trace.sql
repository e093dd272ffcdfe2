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
