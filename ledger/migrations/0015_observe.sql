-- idemq ledger, version 15: observe mode (issue 20, "Adoption: observe
-- before switching").
--
-- An input with mode = "observe" consumes a copy of live traffic while the
-- existing consumer keeps applying it. It claims each new key in
-- idemq.jobs as settled (state 'applied', attempts 0, observed_by = the
-- input): the consumer that ran then applied it, idemq never did. So a
-- later copy, in observe mode or after the switch to apply mode, finds the
-- claim and is a duplicate, exactly as in apply mode: an observed key is
-- never applied by idemq. Every observed delivery leaves one row in
-- idemq.observations: a first sighting, a duplicate, a late replay (older
-- than the dedup window, key not claimed) or what the apply path would
-- have parked (with its code). Both statements change metadata or create
-- something new: no table is scanned or rewritten.
SET LOCAL lock_timeout = '10s';

ALTER TABLE idemq.jobs ADD COLUMN observed_by text;
COMMENT ON COLUMN idemq.jobs.observed_by IS
  'set only on keys an input in observe mode claimed: the input''s name. Such a key is '
  '''applied'' (by the consumer that ran beside idemq; idemq ran no effect), applied_at is '
  'when it was observed; later copies are duplicates, also after the switch to apply mode';

CREATE TABLE idemq.observations (
    id              bigserial PRIMARY KEY,
    at              timestamptz NOT NULL DEFAULT clock_timestamp(),
    input           text NOT NULL,
    queue           text NOT NULL,
    key             text,
    outcome         text NOT NULL CHECK (outcome IN
                      ('observed', 'duplicate', 'late_replay', 'would_park')),
    code            text,
    reason          text,
    payload_sha256  text,
    redelivered     boolean,
    consumer_id     text
);
CREATE INDEX observations_at_idx ON idemq.observations (at);
CREATE INDEX observations_key_idx ON idemq.observations (key, id) WHERE key IS NOT NULL;
COMMENT ON TABLE idemq.observations IS
  'One row per delivery an input in observe mode took: observed (first sighting, key claimed), '
  'duplicate (code key_reuse when the body differs), '
  'late_replay (older than the dedup window and not claimed: apply would park it as '
  'outside_dedup_window) or would_park (code = what apply would park it as). Read by idemq '
  'observe report and idemq jobs show. Not pruned by maintenance: a rollout table, delete '
  'what the baseline no longer needs.';
