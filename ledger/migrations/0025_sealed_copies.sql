-- Payload copies sealed at rest: a park's body may be AES-256-GCM
-- ciphertext (nonce || ciphertext || tag) under the key body_key names
-- (protection.keys in the config; the key bytes never reach the ledger).
-- NULL: the body is stored as it came. payload_sha256 and body_size stay
-- those of the message itself. A resolved park keeps body_key in
-- idemq.park_history.park (the row as it was, body apart).
-- Adding a nullable column only touches the catalog.
ALTER TABLE idemq.parked ADD COLUMN body_key text;
COMMENT ON COLUMN idemq.parked.body_key IS
  'id of the key (protection.keys) whose AES-256-GCM sealed body; NULL = body stored as sent';

-- `idemq erase KEY --why TEXT` removes a key's stored payload copies and is
-- recorded like the other operator actions (who, why, when, which parks).
ALTER TABLE idemq.operator_actions DROP CONSTRAINT IF EXISTS operator_actions_action_check;
ALTER TABLE idemq.operator_actions ADD CONSTRAINT operator_actions_action_check
    CHECK (action IN ('redrive', 'discard', 'archive', 'erase'));
