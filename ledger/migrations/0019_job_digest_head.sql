-- idemq ledger, version 19: a plain job row keeps the first 8 bytes of its
-- body's SHA-256 (issue 21, the ledger at production size).
--
-- A copy of a key applied on the plain path is checked against the first
-- copy's body: was it the same job, or a key reused for another body? The
-- digest lived only in the batch row (idemq.batches.sha256, 32 bytes per
-- job end to end), so every copy of an old key read that row too: its
-- partition's id index, the row, the TOAST of its key array and digests,
-- 20 of the 27 buffers of such a lookup at 50 M keys. With the head in the
-- job row the lookup stops at the key index and the row.
--
-- Why 8 bytes: the check tells a duplicate from a reused key. A second
-- body with the same 64-bit SHA-256 prefix as a given first one is a
-- second-preimage search of about 2^64 digests; the full digest stays in
-- the batch row for the audit (idemq job, idemq.job_info). Rows without a
-- head (written before version 19, or by the isolating path, which keeps
-- the whole digest in payload_sha256) are checked as before.
--
-- The column is NULL-able without a default: adding it rewrites nothing.
SET LOCAL lock_timeout = '10s';

ALTER TABLE idemq.jobs ADD COLUMN sha256_head bytea;
COMMENT ON COLUMN idemq.jobs.sha256_head IS
  'First 8 bytes of the body''s SHA-256 of a job applied on the plain path (the whole digest '
  'is in its batch row); compared with a later copy''s to tell a duplicate from a reused key';
