-- A provider call's request body sealed at rest like parked bodies: with
-- protection.active set, idemq.intents.request_body is AES-256-GCM
-- ciphertext (nonce || ciphertext || tag) under the key request_body_key
-- names; NULL: stored as sent. request_sha256 stays the hash of the
-- request itself. The worker and the reconciler open it with that key
-- before they send it again. Adding a nullable column only touches the
-- catalog.
ALTER TABLE idemq.intents ADD COLUMN request_body_key text;
COMMENT ON COLUMN idemq.intents.request_body_key IS
  'id of the key (protection.keys) whose AES-256-GCM sealed request_body; NULL = stored as sent';
