-- idemq ledger, version 18: an outbox lease names the database session
-- that holds it (issue 18, relay right after commit).
--
-- A worker whose batch emitted rows now leases them inside that batch's
-- own transaction (idemq.outbox_take, just before COMMIT), so no separate
-- claim transaction runs between the commit and the publish. A lease is
-- live while its lease_until is ahead AND the session in lease_pid still
-- exists: a relay that died (its connections close with it) frees its rows
-- at once instead of after outbox.lease_s, while a live relay keeps them
-- for the whole lease. NULL (rows leased before version 18): the time alone
-- decides, as before.
SET LOCAL lock_timeout = '10s';

ALTER TABLE idemq.outbox ADD COLUMN lease_pid integer;
COMMENT ON COLUMN idemq.outbox.lease_pid IS
  'pg_backend_pid() of the session holding the lease: the lease ends early when that '
  'session is gone (its relay died)';
