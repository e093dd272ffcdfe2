-- idemq ledger, version 10: the transactional outbox (issue 18).
--
-- idemq.emit() (ledger/functions_outbox.sql) writes a row here inside the
-- caller's transaction: an idemq effect or an application's own SQL. The
-- row commits or rolls back with that transaction. The relay
-- (consumer/outbox.c) publishes committed rows (mandatory, confirmed) and
-- marks them sent, or parks them with their story.
--
-- Order: a deferred constraint trigger stamps commit_seq at COMMIT, after
-- taking a transaction-scoped advisory lock per order key of the
-- transaction (in key order): transactions that emit the same order key
-- pass their commit in turn, so commit_seq order is their commit order
-- (the lock is released only once the commit is visible). xact_id (the
-- writing transaction) is kept for the story and to find the rows of the
-- committing transaction.
CREATE SEQUENCE idemq.outbox_commit_seq;
CREATE TABLE idemq.outbox (
    id           bigserial PRIMARY KEY,
    key          text,
    exchange     text NOT NULL,
    routing_key  text NOT NULL,
    body         bytea NOT NULL,
    headers      jsonb CHECK (headers IS NULL OR jsonb_typeof(headers) = 'object'),
    order_key    text,
    message_id   text GENERATED ALWAYS AS ('outbox:' || id::text) STORED,
    created_at   timestamptz NOT NULL DEFAULT clock_timestamp(),
    xact_id      xid8 NOT NULL DEFAULT pg_current_xact_id(),
    commit_seq   bigint,
    state        text NOT NULL DEFAULT 'pending' CHECK (state IN ('pending', 'sent', 'parked')),
    attempts     integer NOT NULL DEFAULT 0,
    lease_holder text,
    lease_until  timestamptz,
    sent_at      timestamptz,
    parked_at    timestamptz,
    last_error   text
);
COMMENT ON TABLE idemq.outbox IS
  'Messages emitted by transactions (idemq.emit), relayed by idemq run after commit: '
  'pending -> sent, or parked (unroutable, or nacked outbox.max_attempts times).';
-- Unordered pending rows, oldest first.
CREATE INDEX outbox_pending_idx ON idemq.outbox (id)
    WHERE state = 'pending' AND order_key IS NULL;
-- Ordered pending rows: the head of each order key.
CREATE INDEX outbox_pending_order_idx ON idemq.outbox (order_key, commit_seq)
    WHERE state = 'pending' AND order_key IS NOT NULL;
-- Rows of a transaction not yet stamped (only while it commits: tiny).
CREATE INDEX outbox_unstamped_idx ON idemq.outbox (xact_id) WHERE commit_seq IS NULL;
CREATE INDEX outbox_key_idx ON idemq.outbox (key) WHERE key IS NOT NULL;
CREATE INDEX outbox_parked_idx ON idemq.outbox (id) WHERE state = 'parked';

-- The trigger function is defined again (the current text) in
-- functions_outbox.sql; this first text lets the trigger be created here.
CREATE FUNCTION idemq.outbox_stamp() RETURNS trigger LANGUAGE plpgsql AS $fn$
BEGIN
    RETURN NULL;
END
$fn$;
CREATE CONSTRAINT TRIGGER outbox_stamp AFTER INSERT ON idemq.outbox
    DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION idemq.outbox_stamp();
