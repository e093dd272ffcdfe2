-- idemq ledger, version 17: sent outbox rows age out with the history
-- partitions (issue 18, lifecycle).
--
-- idemq.outbox keeps only the rows not sent (pending and parked): they are
-- never removed by time. A row confirmed by the broker moves, in the
-- statement that marks it sent (idemq.outbox_sent), to idemq.outbox_sent,
-- partitioned by sent_at like the other history (kind 'outbox' in
-- idemq.history_parts): idemq.maintain creates its partitions ahead,
-- archives them past ledger.history_hot_days and drops them past
-- ledger.history_retention_days. No DELETE ever runs over sent rows by
-- time. `jobs show` reads them through idemq.key_outbox (hot partitions
-- and the archive).
--
-- The sent rows version 10 left in idemq.outbox move here once (the
-- outbox is young: they are the rows sent since version 10).
SET LOCAL lock_timeout = '10s';

CREATE TABLE idemq.outbox_sent (
    id           bigint NOT NULL,
    key          text,
    exchange     text NOT NULL,
    routing_key  text NOT NULL,
    body         bytea NOT NULL,
    headers      jsonb,
    order_key    text,
    message_id   text NOT NULL,
    created_at   timestamptz NOT NULL,
    commit_seq   bigint,
    attempts     integer NOT NULL,
    sent_at      timestamptz NOT NULL,
    last_error   text
) PARTITION BY RANGE (sent_at);
CREATE INDEX outbox_sent_key_idx ON idemq.outbox_sent (key) WHERE key IS NOT NULL;
CREATE INDEX outbox_sent_id_idx ON idemq.outbox_sent (id);
CREATE TABLE idemq.outbox_sent_default PARTITION OF idemq.outbox_sent DEFAULT;
COMMENT ON TABLE idemq.outbox_sent IS
  'Outbox rows published and confirmed (moved from idemq.outbox when marked sent). '
  'Partitioned by sent_at; archived and dropped with the history (idemq.maintain); '
  'never updated.';

ALTER TABLE idemq.history_parts DROP CONSTRAINT history_parts_kind_check;
ALTER TABLE idemq.history_parts ADD CONSTRAINT history_parts_kind_check
    CHECK (kind IN ('attempts', 'batches', 'redrives', 'parks', 'outbox'));

WITH m AS (DELETE FROM idemq.outbox o WHERE o.state = 'sent' RETURNING o.*)
INSERT INTO idemq.outbox_sent (id, key, exchange, routing_key, body, headers, order_key,
                               message_id, created_at, commit_seq, attempts, sent_at,
                               last_error)
SELECT m.id, m.key, m.exchange, m.routing_key, m.body, m.headers, m.order_key, m.message_id,
       m.created_at, m.commit_seq, m.attempts, coalesce(m.sent_at, m.created_at), m.last_error
  FROM m;

ALTER TABLE idemq.outbox DROP CONSTRAINT outbox_state_check;
ALTER TABLE idemq.outbox ADD CONSTRAINT outbox_state_check
    CHECK (state IN ('pending', 'parked'));
COMMENT ON TABLE idemq.outbox IS
  'Messages emitted by transactions (idemq.emit) and not sent yet: pending, or parked '
  '(unroutable, or nacked outbox.max_attempts times). Never removed by time. A row '
  'confirmed by the broker moves to idemq.outbox_sent.';
