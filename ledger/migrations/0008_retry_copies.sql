-- idemq ledger, version 8 (issue 12): retry copies. A job that waits for a
-- retry on a broker delay bucket keeps its message here, so that if the
-- bucket's copy is lost (a classic bucket's node crashing as it dead-letters
-- the message, a purged or deleted bucket) one replica at a time can publish
-- it again (consumer/rescue.c; functions in ledger/functions_rescue.sql).
-- New tables only: nothing existing is altered, so nothing existing is
-- locked or scanned. Their constraints are inline (an empty table has
-- nothing to validate).
SET LOCAL lock_timeout = '5s';

CREATE TABLE idemq.retry_copies (
    key          text PRIMARY KEY,
    generation   integer NOT NULL,
    attempt      integer NOT NULL CHECK (attempt >= 1),
    source_queue text NOT NULL,
    exchange     text,
    routing_key  text,
    body         bytea NOT NULL,
    headers      jsonb,
    properties   jsonb,
    stored_at    timestamptz NOT NULL DEFAULT clock_timestamp(),
    rescued_at   timestamptz,
    rescues      integer NOT NULL DEFAULT 0 CHECK (rescues >= 0)
);
COMMENT ON TABLE idemq.retry_copies IS
  'The message of each job waiting for a retry on a delay bucket (the copy of '
  'its last failed attempt). Stored with the failed attempt; removed by the '
  'rescuer once the job is no longer retrying with that attempt.';
COMMENT ON COLUMN idemq.retry_copies.rescued_at IS
  'last time the rescuer published this copy again (NULL: never)';

CREATE TABLE idemq.retry_rescues (
    id          bigserial PRIMARY KEY,
    key         text NOT NULL,
    generation  integer NOT NULL,
    attempt     integer NOT NULL,
    run_after   timestamptz,
    queue       text NOT NULL,
    rescued_at  timestamptz NOT NULL DEFAULT clock_timestamp(),
    consumer_id text
);
CREATE INDEX retry_rescues_key_idx ON idemq.retry_rescues (key, id);
COMMENT ON TABLE idemq.retry_rescues IS
  'Every republish of a retry copy whose bucket copy did not come back in time '
  '(the failed attempt it retries, its run_after, where it went, who).';
