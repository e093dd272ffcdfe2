-- idemq ledger, version 3: ordered lanes. The sequence guard (last applied
-- sequence per ordering key), the keys held after a park (on_park =
-- hold_key), and deferred jobs: messages that arrived before their
-- predecessor, kept durably (body and delivery facts) and acknowledged.
ALTER TABLE idemq.jobs DROP CONSTRAINT jobs_state_check;
ALTER TABLE idemq.jobs ADD CONSTRAINT jobs_state_check CHECK (state IN
    ('pending', 'retrying', 'applied', 'parked', 'deferred', 'stale'));
COMMENT ON COLUMN idemq.jobs.state IS
  'deferred: kept in idemq.deferred until its predecessor is applied; '
  'stale: its sequence was already passed, no effect (settled like applied)';

ALTER TABLE idemq.attempts DROP CONSTRAINT attempts_outcome_check;
ALTER TABLE idemq.attempts ADD CONSTRAINT attempts_outcome_check CHECK (outcome IN
    ('applied', 'duplicate', 'transient_error', 'permanent_error', 'delayed', 'deferred'));

CREATE TABLE idemq.order_keys (
    source_queue text NOT NULL,
    order_key    text NOT NULL,
    last_seq     bigint NOT NULL DEFAULT 0,
    blocked_by   text,
    updated_at   timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (source_queue, order_key)
);
COMMENT ON TABLE idemq.order_keys IS
  'Per ordering key of an ordered input: the last applied sequence (0 = none) '
  'and, with on_park = hold_key, the parked job key that holds it.';

CREATE TABLE idemq.deferred (
    id           bigserial PRIMARY KEY,
    key          text NOT NULL UNIQUE,
    source_queue text NOT NULL,
    order_key    text NOT NULL,
    seq          bigint,
    reason       text NOT NULL CHECK (reason IN ('gap', 'held')),
    lane         integer,
    exchange     text,
    routing_key  text,
    body         bytea NOT NULL,
    headers      jsonb,
    properties   jsonb,
    deferred_at  timestamptz NOT NULL DEFAULT clock_timestamp(),
    reported_at  timestamptz
);
CREATE INDEX deferred_order_idx ON idemq.deferred (source_queue, order_key, seq, id);
COMMENT ON TABLE idemq.deferred IS
  'Jobs of ordered inputs waiting for a predecessor (gap) or a parked key '
  '(held). A row goes when its job is applied or parked.';
