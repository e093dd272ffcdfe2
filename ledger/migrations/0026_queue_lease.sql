-- The visible lease of a PostgreSQL queue row whose effect outlives a
-- transaction (a provider call, adapters/PORT.md "Provider inputs"): the
-- worker takes the row with FOR UPDATE SKIP LOCKED, writes who holds it
-- and until when, and commits before the call. While the lease lasts the
-- row's run_after is the lease's end, so every take passes it by; a holder
-- that dies stops extending it, and the row is ready again by itself when
-- the lease ends. NULL: not leased (or a lease given back).
-- Nullable columns without a default: adding them rewrites nothing.
ALTER TABLE idemq.queue_jobs
    ADD COLUMN leased_by   text,
    ADD COLUMN lease_until timestamptz;
COMMENT ON COLUMN idemq.queue_jobs.leased_by IS
  'Who holds the row''s lease (host:pid:worker) while its provider call runs; NULL when none.';
COMMENT ON COLUMN idemq.queue_jobs.lease_until IS
  'When the lease ends unless its holder extends it; the row is taken again after it.';

-- Leases that ran out (their holder died or hung) and whose rows were
-- taken again, by queue: the counter behind
-- idemq_queue_leases_expired_total. One row per queue, written only when
-- a take finds an expired lease.
CREATE TABLE idemq.queue_lease_expiries (
    queue   text PRIMARY KEY,
    expired bigint NOT NULL DEFAULT 0
);
REVOKE ALL ON idemq.queue_lease_expiries FROM PUBLIC;
