-- Outbox bodies sealed at rest like parked bodies and retry copies: with
-- protection.active set, the worker seals the body of every row its batch
-- transaction emitted before that transaction commits (idemq.outbox_take),
-- and idemq.outbox.body is then AES-256-GCM ciphertext (nonce || ciphertext
-- || tag) under the key body_key names; NULL: stored as sent. The relay
-- opens it with that key before it publishes. A sent row keeps its sealed
-- body and key in idemq.outbox_sent. Adding a nullable column only touches
-- the catalog.
ALTER TABLE idemq.outbox ADD COLUMN body_key text;
COMMENT ON COLUMN idemq.outbox.body_key IS
  'id of the key (protection.keys) whose AES-256-GCM sealed body; NULL = body stored as sent';
ALTER TABLE idemq.outbox_sent ADD COLUMN body_key text;
COMMENT ON COLUMN idemq.outbox_sent.body_key IS
  'id of the key (protection.keys) whose AES-256-GCM sealed body; NULL = body stored as sent';

-- The history tables of idemq.outbox_sent that are not attached (filling
-- ones, not yet attached; archived ones, detached) get the column too: the
-- maintenance moves rows into them with SELECT *, and a restore attaches
-- them again, both of which need the parent's columns.
DO $sealed_outbox$
DECLARE
    r record;
BEGIN
    FOR r IN SELECT h.relname,
                    CASE h.location WHEN 'archive' THEN 'idemq_archive' ELSE 'idemq' END AS nsp
               FROM idemq.history_parts h
              WHERE h.kind = 'outbox' AND NOT h.attached AND h.location <> 'dropped'
    LOOP
        IF to_regclass(format('%I.%I', r.nsp, r.relname)) IS NOT NULL THEN
            EXECUTE format('ALTER TABLE %I.%I ADD COLUMN IF NOT EXISTS body_key text',
                           r.nsp, r.relname);
        END IF;
    END LOOP;
END
$sealed_outbox$;
