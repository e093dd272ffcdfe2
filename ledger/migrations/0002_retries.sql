-- idemq ledger, version 2: durable retry schedule, redrive generations and
-- dead-letter bookkeeping.
ALTER TABLE idemq.jobs
    ADD COLUMN run_after   timestamptz,
    ADD COLUMN generation  integer NOT NULL DEFAULT 0,
    ADD COLUMN budget_base integer NOT NULL DEFAULT 0;
COMMENT ON COLUMN idemq.jobs.run_after IS
  'retrying jobs: not to be attempted before this time (the durable schedule)';
COMMENT ON COLUMN idemq.jobs.generation IS 'number of redrives of this key';
COMMENT ON COLUMN idemq.jobs.budget_base IS
  'attempts before the last redrive; the attempt budget counts from here';

ALTER TABLE idemq.attempts DROP CONSTRAINT attempts_outcome_check;
ALTER TABLE idemq.attempts ADD CONSTRAINT attempts_outcome_check CHECK (outcome IN
    ('applied', 'duplicate', 'transient_error', 'permanent_error', 'delayed'));
ALTER TABLE idemq.attempts
    ADD COLUMN generation integer NOT NULL DEFAULT 0,
    ADD COLUMN delay_ms   integer;
COMMENT ON COLUMN idemq.attempts.delay_ms IS
  'transient_error: the backoff chosen; delayed: the time still to wait';

ALTER TABLE idemq.parked
    ADD COLUMN generation       integer NOT NULL DEFAULT 0,
    ADD COLUMN attempt_ids      bigint[] NOT NULL DEFAULT '{}',
    ADD COLUMN dlq_published_at timestamptz;
CREATE INDEX parked_class_idx ON idemq.parked (error_class, parked_at);

CREATE TABLE idemq.redrives (
    id          bigserial PRIMARY KEY,
    key         text NOT NULL,
    generation  integer NOT NULL,
    park_id     bigint,
    source      text NOT NULL,
    redriven_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    consumer_id text
);
CREATE INDEX redrives_key_idx ON idemq.redrives (key, id);
COMMENT ON TABLE idemq.redrives IS
  'Every redrive of a parked key: generation, who (source), when.';
