-- Retry copies sealed at rest like parked bodies: with protection.active
-- set, idemq.retry_copies.body is AES-256-GCM ciphertext (nonce ||
-- ciphertext || tag) under the key body_key names; NULL: stored as sent.
-- The rescuer opens it with that key before it publishes the copy again.
-- Adding a nullable column only touches the catalog.
ALTER TABLE idemq.retry_copies ADD COLUMN body_key text;
COMMENT ON COLUMN idemq.retry_copies.body_key IS
  'id of the key (protection.keys) whose AES-256-GCM sealed body; NULL = body stored as sent';
