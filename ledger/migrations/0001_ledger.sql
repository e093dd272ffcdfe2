-- idemq ledger, version 1: jobs (one row per business key), attempts (one
-- row per processing attempt), parked (messages idemq gave up on), and the
-- claim/apply/record functions the daemon calls.
CREATE SCHEMA IF NOT EXISTS idemq;

CREATE TABLE idemq.jobs (
    key             text PRIMARY KEY CHECK (octet_length(key) BETWEEN 1 AND 256),
    state           text NOT NULL CHECK (state IN ('pending', 'retrying', 'applied', 'parked')),
    source_queue    text NOT NULL,
    payload_sha256  text NOT NULL,
    attempts        integer NOT NULL DEFAULT 0,
    first_seen_at   timestamptz NOT NULL DEFAULT clock_timestamp(),
    last_attempt_at timestamptz,
    applied_at      timestamptz,
    result          jsonb,
    last_error_class text,
    last_sqlstate   text,
    last_error      text
);
COMMENT ON TABLE idemq.jobs IS
  'One row per business idempotency key. applied rows never change again.';

CREATE TABLE idemq.attempts (
    id              bigserial PRIMARY KEY,
    key             text NOT NULL,
    attempt         integer NOT NULL,
    outcome         text NOT NULL CHECK (outcome IN
                      ('applied', 'duplicate', 'transient_error', 'permanent_error')),
    started_at      timestamptz NOT NULL,
    finished_at     timestamptz NOT NULL,
    error_class     text,
    error_code      text,
    sqlstate        text,
    message         text,
    queue           text,
    routing_key     text,
    redelivered     boolean,
    delivery_count  integer,
    consumer_id     text
);
CREATE INDEX attempts_key_idx ON idemq.attempts (key, id);
COMMENT ON TABLE idemq.attempts IS
  'Every processing attempt of every key, including duplicates; never updated.';

CREATE TABLE idemq.parked (
    id              bigserial PRIMARY KEY,
    key             text,
    source_queue    text NOT NULL,
    exchange        text,
    routing_key     text,
    body            bytea NOT NULL,
    headers         jsonb,
    properties      jsonb,
    payload_sha256  text NOT NULL,
    error_class     text NOT NULL,
    error_code      text NOT NULL,
    sqlstate        text,
    reason          text NOT NULL,
    attempts        integer NOT NULL DEFAULT 0,
    first_attempt_at timestamptz,
    last_attempt_at timestamptz,
    parked_at       timestamptz NOT NULL DEFAULT clock_timestamp(),
    consumer_id     text
);
CREATE INDEX parked_key_idx ON idemq.parked (key);
COMMENT ON TABLE idemq.parked IS
  'Messages idemq gave up on, with raw body and reason. idemq never deletes them.';
