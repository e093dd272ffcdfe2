-- idemq ledger, version 14: the secret that seals redrives (review D9).
--
-- idemq puts an HMAC-SHA256 seal (consumer/seal.c) on what it publishes to
-- <queue>.dead (key, generation, park id) and `idemq redrive` seals who
-- redrove it; a delivery that claims a redrive (x-idemq-generation) without
-- a valid seal is parked as forged_redrive. The secret lives here, so every
-- replica and the operator commands share it without a file to deploy; a
-- producer never reaches the database. 32 bytes from two version-4 UUIDs
-- (gen_random_uuid draws from the server's strong random source: 244
-- random bits). Rotating it: UPDATE the row (copies sealed before then are
-- re-sealed by `idemq redrive` when their park is still open).
CREATE TABLE idemq.redrive_seal (
    id         integer PRIMARY KEY CHECK (id = 1),
    secret     bytea NOT NULL CHECK (octet_length(secret) BETWEEN 16 AND 64),
    created_at timestamptz NOT NULL DEFAULT clock_timestamp()
);
INSERT INTO idemq.redrive_seal (id, secret)
VALUES (1, decode(replace(gen_random_uuid()::text || gen_random_uuid()::text, '-', ''), 'hex'));
COMMENT ON TABLE idemq.redrive_seal IS
  'The HMAC secret of redrive seals (x-idemq-seal, x-idemq-redrive-seal); read by idemq run '
  'and idemq redrive. Whoever can read it can forge a redrive: grant SELECT only to idemq''s '
  'roles.';
