-- idemq ledger, version 6: provider effects (issue 9). An intent is the
-- durable record of one key's call to an external provider: the request
-- (hash and body), whether it may be in flight (pending, with a lease), an
-- unknown outcome, the provider's reference once confirmed, and every
-- operator resolution. Two durable job states go with it. The functions
-- are in ledger/functions_provider.sql.
SET LOCAL lock_timeout = '5s';

-- provider_pending: a request may be at the provider (the intent holds a
-- lease); provider_unknown: the last request's outcome is unknown, or the
-- provider asked to wait (409/429), and the job waits for its next step.
ALTER TABLE idemq.jobs DROP CONSTRAINT jobs_state_check;
ALTER TABLE idemq.jobs ADD CONSTRAINT jobs_state_check CHECK (state IN
    ('pending', 'retrying', 'applied', 'parked', 'deferred', 'stale',
     'provider_pending', 'provider_unknown')) NOT VALID;
ALTER TABLE idemq.jobs VALIDATE CONSTRAINT jobs_state_check;

-- provider_request: a request was sent (or is about to be); provider_unknown:
-- its outcome is unknown; provider_wait: 409, 429 or not sent, retried
-- later; provider_lookup: the provider was asked what became of it;
-- resolved: an operator settled the key (idemq resolve).
ALTER TABLE idemq.attempts DROP CONSTRAINT attempts_outcome_check;
ALTER TABLE idemq.attempts ADD CONSTRAINT attempts_outcome_check CHECK (outcome IN
    ('applied', 'duplicate', 'transient_error', 'permanent_error', 'delayed', 'deferred',
     'provider_request', 'provider_unknown', 'provider_wait', 'provider_lookup',
     'resolved')) NOT VALID;
ALTER TABLE idemq.attempts VALIDATE CONSTRAINT attempts_outcome_check;

CREATE TABLE idemq.intents (
    key              text PRIMARY KEY,
    input            text NOT NULL,
    provider         text NOT NULL,
    source_queue     text NOT NULL,
    idempotent       boolean NOT NULL,
    state            text NOT NULL CHECK (state IN ('pending', 'unknown', 'waiting',
                       'confirmed', 'applied', 'rejected', 'parked', 'not_applied',
                       'discarded')),
    generation       integer NOT NULL DEFAULT 0,
    request_sha256   text NOT NULL,
    request_body     bytea NOT NULL,
    lease_no         integer NOT NULL DEFAULT 0,
    requests         integer NOT NULL DEFAULT 0,
    unknowns         integer NOT NULL DEFAULT 0,
    waits            integer NOT NULL DEFAULT 0,
    failures         integer NOT NULL DEFAULT 0,
    lookups          integer NOT NULL DEFAULT 0,
    uncertain        boolean NOT NULL DEFAULT false,
    first_request_at timestamptz,
    last_request_at  timestamptz,
    lease_until      timestamptz,
    run_after        timestamptz,
    confirmed_at     timestamptz,
    provider_ref     text,
    last_status      integer,
    last_class       text,
    last_response    jsonb,
    body             bytea NOT NULL,
    exchange         text,
    routing_key      text,
    headers          jsonb,
    properties       jsonb,
    created_at       timestamptz NOT NULL DEFAULT clock_timestamp(),
    updated_at       timestamptz NOT NULL DEFAULT clock_timestamp(),
    resolved_by      text,
    resolved_at      timestamptz,
    resolve_reason   text
);
CREATE INDEX intents_open_idx ON idemq.intents (input, updated_at)
    WHERE state IN ('pending', 'unknown', 'waiting', 'confirmed');
CREATE INDEX intents_confirmed_idx ON idemq.intents (confirmed_at)
    WHERE confirmed_at IS NOT NULL;
COMMENT ON TABLE idemq.intents IS
  'One row per key of a provider input: the request, its lease while it may be in flight, '
  'unknown outcomes, the provider reference once confirmed. idemq never deletes them.';
COMMENT ON COLUMN idemq.intents.state IS
  'pending: a request or lookup may be in flight until lease_until; unknown: the outcome is '
  'unknown; waiting: 409/429/not sent, nothing applied by it; confirmed: the provider '
  'reference is recorded, the local effect not yet committed; applied; rejected: 4xx; '
  'parked: given up with the outcome uncertain (settle with idemq resolve); not_applied: '
  'certainly not applied (redrivable); discarded: an operator dropped it';
COMMENT ON COLUMN idemq.intents.lease_no IS
  'fencing token: incremented by every request or lookup; a late answer of an older one '
  'cannot move the intent';
COMMENT ON COLUMN idemq.intents.uncertain IS
  'a request of this generation may have applied without an answer: look it up (or '
  'resend under the key) before anything else';
COMMENT ON COLUMN idemq.intents.first_request_at IS
  'the first request under this key: the provider key window counts from here';

CREATE TABLE idemq.resolutions (
    id           bigserial PRIMARY KEY,
    key          text NOT NULL,
    action       text NOT NULL CHECK (action IN ('applied', 'not_applied', 'discard')),
    provider_ref text,
    prior_state  text NOT NULL,
    resolved_by  text NOT NULL,
    reason       text NOT NULL,
    resolved_at  timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX resolutions_key_idx ON idemq.resolutions (key, id);
COMMENT ON TABLE idemq.resolutions IS
  'Every operator settlement of a parked provider key (idemq resolve): who, why, when.';
