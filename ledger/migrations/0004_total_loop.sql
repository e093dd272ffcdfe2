-- idemq ledger, version 4: park rows for what could not be taken whole.
-- A body over max_body_bytes is parked with a prefix (body), its full size
-- (body_size) and the SHA-256 of the whole body (payload_sha256); a message
-- the client library could not decode has no body at all. Such parks are
-- not redrivable: their dead-letter copy is incomplete (or the broker's own).
-- Adding a column with a constant default only touches the catalog; the
-- migration runs under idemq migrate's lock_timeout.
ALTER TABLE idemq.parked
    ADD COLUMN body_size  bigint,
    ADD COLUMN redrivable boolean NOT NULL DEFAULT true;
COMMENT ON COLUMN idemq.parked.body_size IS
  'size of the whole message body on the wire; body holds a prefix when larger';
COMMENT ON COLUMN idemq.parked.redrivable IS
  'false when the park does not hold the whole message (body over the limit, '
  'undecodable delivery): redrive refuses it';
