-- PostgreSQL queue inputs: the queue table producers enqueue into with
-- idemq.enqueue (ledger/functions_queue.sql) and `idemq run` claims with
-- FOR UPDATE SKIP LOCKED (adapters/pgq.c). A row is the job until it is
-- done: applied, a duplicate or parked, it is deleted in the transaction
-- that settled it; a retry updates it in place (attempts, run_after,
-- last_error). So the table holds only the work still to do, and what it
-- churns is dead tuples: fillfactor leaves room for the retry's update on
-- the same page, and autovacuum is told to visit it after a small number
-- of dead rows instead of a fraction of a table that is small by design.
-- See adapters/PORT.md "The table under churn" for what an operator watches.
CREATE TABLE idemq.queue_jobs (
    id          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    queue       text NOT NULL,
    key         text,               -- the enqueue's key argument (key_source = "key")
    order_key   text,               -- rows of one order key run one at a time, in id order
    priority    smallint NOT NULL DEFAULT 0,
    run_after   timestamptz NOT NULL DEFAULT now(),
    payload     bytea NOT NULL,     -- the body, as a broker delivery would carry it
    attempts    integer NOT NULL DEFAULT 0,  -- failed attempts held here (retries)
    last_error  text,
    redrive_gen integer,            -- set only by idemq.queue_redrive: a redrive of that generation
    park_id     bigint,             -- the park a redrive came from
    enqueued_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    enqueued_by text NOT NULL DEFAULT session_user
) WITH (fillfactor = 80, autovacuum_vacuum_scale_factor = 0,
        autovacuum_vacuum_threshold = 1000, autovacuum_vacuum_cost_delay = 0);
-- The claim's order: ready rows of a queue by (run_after, priority, id).
CREATE INDEX queue_jobs_ready_idx ON idemq.queue_jobs (queue, run_after, priority, id);
-- The head of each order key.
CREATE INDEX queue_jobs_order_idx ON idemq.queue_jobs (queue, order_key, id)
    WHERE order_key IS NOT NULL;
COMMENT ON TABLE idemq.queue_jobs IS
  'Jobs of PostgreSQL queue inputs still to do; enqueue with idemq.enqueue. Settled rows are deleted.';
REVOKE ALL ON idemq.queue_jobs FROM PUBLIC;
