-- idemq ledger, version 21: an observed key is not an applied one.
--
-- Observe mode claims each new key it sees on a copy of live traffic. The
-- consumer running beside idemq took that message, but idemq cannot know
-- whether it applied it: it may have failed and be retrying it by
-- republishing (a dead-letter + TTL loop, Celery's self.retry()), or have
-- parked it in its own dead-letter queue. Such a key now has its own state,
-- 'observed': observe mode counts a later copy as a duplicate, and the
-- first copy apply mode takes of it is applied once (the claim moves
-- observed -> applied; the effect's meta says it was observed, so an effect
-- that can see the old consumer's own effect may skip it). Keys observed
-- before this version keep state 'applied' (what they were promised);
-- consumer/README.md "Switching to apply mode" gives the statement that
-- turns them into 'observed'. Metadata only: the constraint is added NOT
-- VALID and validated without blocking writes.
SET LOCAL lock_timeout = '10s';

ALTER TABLE idemq.jobs DROP CONSTRAINT jobs_state_check;
ALTER TABLE idemq.jobs ADD CONSTRAINT jobs_state_check CHECK (state IN
    ('pending', 'retrying', 'applied', 'parked', 'deferred', 'stale',
     'provider_pending', 'provider_unknown', 'observed')) NOT VALID;
ALTER TABLE idemq.jobs VALIDATE CONSTRAINT jobs_state_check;

COMMENT ON COLUMN idemq.jobs.observed_by IS
  'set on keys an input in observe mode claimed: the input''s name. State ''observed'' (idemq '
  'ran no effect; the consumer beside idemq took the message, outcome unknown) until apply '
  'mode takes its first copy and applies it once (state ''applied'', observed_by kept). Rows '
  'observed before ledger version 21 are ''applied'' with attempts = 0';
