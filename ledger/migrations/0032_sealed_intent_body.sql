-- The message a provider input keeps with its intent (idemq.intents.body:
-- what its parks copy, and what the local effect reads) sealed at rest like
-- every other payload copy: with protection.active set it is AES-256-GCM
-- ciphertext (nonce || ciphertext || tag) under the key body_key names;
-- NULL: stored as it came. body_sha256 and body_size are then those of the
-- message itself, for its parks. idemq opens it before the local effect
-- runs (the worker, the reconciler, idemq resolve) and passes the opened
-- message in. Adding nullable columns only touches the catalog.
ALTER TABLE idemq.intents ADD COLUMN body_key text,
                          ADD COLUMN body_sha256 text,
                          ADD COLUMN body_size bigint;
COMMENT ON COLUMN idemq.intents.body_key IS
  'id of the key (protection.keys) whose AES-256-GCM sealed body; NULL = stored as sent';
COMMENT ON COLUMN idemq.intents.body_sha256 IS
  'SHA-256 (hex) of the message itself when body is sealed; NULL = of body';
COMMENT ON COLUMN idemq.intents.body_size IS
  'size in bytes of the message itself when body is sealed; NULL = of body';
