-- idemq ledger, version 16: x-acquired-count with each attempt (issue 17).
--
-- RabbitMQ 4.3 counts a quorum queue message's failed returns in
-- x-delivery-count (basic.reject with requeue, a lost channel) and every
-- hand-out to a consumer in x-acquired-count. idemq records the second with
-- the attempt it belongs to, so `jobs show` tells "handed out 7 times" from
-- "failed 7 times". Data only: a producer can send the header to a classic
-- queue with any value; idemq takes it only as an integer in 0..10^9 and
-- never acts on it. NULL on brokers before 4.3 and on classic queues.
ALTER TABLE idemq.attempts ADD COLUMN acquired_count integer;
COMMENT ON COLUMN idemq.attempts.acquired_count IS
  'x-acquired-count of the delivery (RabbitMQ 4.3+: times the message was handed to a consumer); '
  'NULL when absent. Recorded, never used for control.';

-- Partition tables made for a past slot but not attached yet (they fill
-- from the default partition first) were made LIKE the old parent: give
-- them the column too, or their ATTACH would fail.
DO $mig$
DECLARE
    r record;
BEGIN
    FOR r IN SELECT h.relname FROM idemq.history_parts h
              WHERE h.kind = 'attempts' AND NOT h.attached AND h.location = 'hot'
                AND to_regclass('idemq.' || quote_ident(h.relname)) IS NOT NULL LOOP
        EXECUTE format('ALTER TABLE idemq.%I ADD COLUMN IF NOT EXISTS acquired_count integer',
                       r.relname);
    END LOOP;
END
$mig$;
