-- idemq ledger, version 20: ANALYZE of the batch history skips the
-- per-job arrays (issue 21, the ledger at production size).
--
-- A batch row holds ~100 jobs' keys, digests, metas and results in
-- TOASTed arrays. ANALYZE detoasted every sampled row to compute
-- statistics no query uses (the history is read by (at, id) only): on a
-- partition of 8,674 batch rows it took 2.1 s, about 240 us per row, and
-- autovacuum re-analyzes a partition after each 10 % it grows, so every
-- plain job paid about 24 us of PostgreSQL CPU for it whatever the ledger
-- size. With statistics target 0 on those columns ANALYZE keeps the
-- statistics of at, id, finished_at and consumer_id and reads no TOAST.
-- SET STATISTICS on the parent reaches its attached partitions;
-- idemq.create_partition copies the targets to each partition it makes,
-- and the ones made but not yet attached are set here.
SET LOCAL lock_timeout = '10s';

ALTER TABLE idemq.batches
    ALTER COLUMN keys SET STATISTICS 0,
    ALTER COLUMN sha256 SET STATISTICS 0,
    ALTER COLUMN metas SET STATISTICS 0,
    ALTER COLUMN meta_idx SET STATISTICS 0,
    ALTER COLUMN results SET STATISTICS 0,
    ALTER COLUMN applied SET STATISTICS 0,
    ALTER COLUMN dups SET STATISTICS 0;

-- the partitions made but not yet attached take the parent's targets, as
-- idemq.create_partition gives them to the ones it makes from now on
DO $$
DECLARE r record;
BEGIN
    FOR r IN SELECT h.relname, a.attname FROM idemq.history_parts h
               JOIN pg_attribute a ON a.attrelid = 'idemq.batches'::regclass
              WHERE h.kind = 'batches' AND NOT h.attached AND h.location = 'hot'
                AND to_regclass(format('idemq.%I', h.relname)) IS NOT NULL
                AND a.attnum > 0 AND NOT a.attisdropped AND a.attstattarget = 0 LOOP
        EXECUTE format('ALTER TABLE idemq.%I ALTER COLUMN %I SET STATISTICS 0', r.relname, r.attname);
    END LOOP;
END
$$;
