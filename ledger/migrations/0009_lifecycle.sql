-- idemq ledger, version 9: the ledger lifecycle (issue 10).
--
-- * idemq.jobs stays the dedup set (global unique key), in place. Its rows
--   become compact: a plain applied job keeps key, state, times and the id
--   of the batch that applied it; the payload hash, queue and result go to
--   the batch history. Pruned past ledger.dedup_window_days by idemq.maintain.
-- * History becomes partitioned by time (native range partitioning):
--   idemq.attempts, idemq.redrives, the new idemq.batches (one row per
--   set-based batch: what a plain applied job used to write as an attempt)
--   and idemq.park_history (parks once resolved). Partitions are created
--   ahead, archived (detached into schema idemq_archive) and dropped by
--   idemq.maintain (ledger/functions_retention.sql); idemq.history_parts is
--   their register.
-- * The history tables of versions 3 to 8 keep every row, under new names
--   (attempts_v3, redrives_v3), registered as one partition-like entry each, read by
--   `jobs show` and aged out like any partition. Nothing is copied and no
--   large table is scanned or rewritten: every statement here changes
--   metadata only or creates something new (the two indexes on
--   idemq.deferred, a working table, are the exception), so the ACCESS
--   EXCLUSIVE locks taken below are short. lock_timeout bounds the wait for
--   them behind running transactions.
-- * idemq.deferred gets a due time and an index on it: deferred jobs are
--   found through it, not by a scan of the whole table.
SET LOCAL lock_timeout = '10s';

-- The dedup set: compact rows.
ALTER TABLE idemq.jobs
    ALTER COLUMN source_queue DROP NOT NULL,
    ALTER COLUMN payload_sha256 DROP NOT NULL,
    ADD COLUMN batch_id bigint;
COMMENT ON COLUMN idemq.jobs.batch_id IS
  'applied by the set-based path: the idemq.batches row (same time as applied_at) '
  'that holds its queue, payload SHA-256, delivery facts and result';
-- Pruning deletes settled keys every day; vacuum them sooner than the 20 %
-- default so the table stays near its steady size.
ALTER TABLE idemq.jobs SET (autovacuum_vacuum_scale_factor = 0.02);

-- The v3 history keeps its rows under new names. Their sequences outlive
-- them (the new tables draw ids from the same ones).
ALTER TABLE idemq.attempts RENAME TO attempts_v3;
ALTER INDEX idemq.attempts_pkey RENAME TO attempts_v3_pkey;
ALTER INDEX idemq.attempts_key_idx RENAME TO attempts_v3_key_idx;
ALTER SEQUENCE idemq.attempts_id_seq OWNED BY NONE;
ALTER TABLE idemq.redrives RENAME TO redrives_v3;
ALTER INDEX idemq.redrives_pkey RENAME TO redrives_v3_pkey;
ALTER INDEX idemq.redrives_key_idx RENAME TO redrives_v3_key_idx;
ALTER SEQUENCE idemq.redrives_id_seq OWNED BY NONE;

CREATE TABLE idemq.attempts (
    id              bigint NOT NULL DEFAULT nextval('idemq.attempts_id_seq'),
    key             text NOT NULL,
    attempt         integer NOT NULL,
    outcome         text NOT NULL CHECK (outcome IN ('applied', 'duplicate', 'transient_error',
                      'permanent_error', 'delayed', 'deferred', 'provider_request',
                      'provider_unknown', 'provider_wait', 'provider_lookup', 'resolved')),
    started_at      timestamptz NOT NULL,
    finished_at     timestamptz NOT NULL,
    error_class     text,
    error_code      text,
    sqlstate        text,
    message         text,
    queue           text,
    routing_key     text,
    redelivered     boolean,
    delivery_count  integer,
    consumer_id     text,
    generation      integer NOT NULL DEFAULT 0,
    delay_ms        integer
) PARTITION BY RANGE (started_at);
CREATE INDEX attempts_key_id_idx ON idemq.attempts (key, id);
CREATE TABLE idemq.attempts_default PARTITION OF idemq.attempts DEFAULT;
COMMENT ON TABLE idemq.attempts IS
  'Every attempt that is not a plain first apply (those are in idemq.batches): '
  'duplicates, failures, delays, deferrals, and every apply of the isolating path. '
  'Partitioned by started_at; never updated.';

CREATE TABLE idemq.redrives (
    id          bigint NOT NULL DEFAULT nextval('idemq.redrives_id_seq'),
    key         text NOT NULL,
    generation  integer NOT NULL,
    park_id     bigint,
    source      text NOT NULL,
    redriven_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    consumer_id text
) PARTITION BY RANGE (redriven_at);
CREATE INDEX redrives_key_id_idx ON idemq.redrives (key, id);
CREATE TABLE idemq.redrives_default PARTITION OF idemq.redrives DEFAULT;
COMMENT ON TABLE idemq.redrives IS
  'Every redrive of a parked key: generation, who (source), when. Partitioned by redriven_at.';

-- One row per batch the set-based path applied: the history of plain
-- applied jobs, per job in delivery order (arrays), compressed with lz4.
-- sha256 holds the 32-byte body digests end to end (stored as they are:
-- digests do not compress); metas holds each distinct delivery meta once,
-- meta_idx points into it.
-- applied marks the jobs applied (results holds their results, NULL
-- elsewhere); dups lists the positions of later copies of a key applied in
-- the same batch (duplicates recorded nowhere else); a job neither applied
-- nor in dups is a copy of a key claimed before, with its own attempt row.
CREATE SEQUENCE idemq.batches_id_seq;
CREATE TABLE idemq.batches (
    id          bigint NOT NULL,
    at          timestamptz NOT NULL,
    finished_at timestamptz NOT NULL,
    consumer_id text,
    keys        text[] COMPRESSION lz4 NOT NULL,
    sha256      bytea NOT NULL,
    metas       jsonb[] COMPRESSION lz4 NOT NULL,
    meta_idx    integer[] COMPRESSION lz4 NOT NULL,
    results     jsonb[] COMPRESSION lz4 NOT NULL,
    applied     boolean[] NOT NULL,
    dups        integer[] NOT NULL
) PARTITION BY RANGE (at);
ALTER TABLE idemq.batches ALTER COLUMN sha256 SET STORAGE EXTERNAL;
CREATE INDEX batches_id_idx ON idemq.batches (id);
CREATE TABLE idemq.batches_default PARTITION OF idemq.batches DEFAULT;
COMMENT ON TABLE idemq.batches IS
  'One row per batch applied by the plain path (ledger/ledger_plain.c): at '
  '(= jobs.applied_at of its keys), and per job in delivery order its key, body '
  'SHA-256 (bytes 32i-31..32i of sha256), delivery meta (metas[meta_idx[i]]), whether '
  'it was applied and its result; dups: later copies of a key within the batch. '
  'Partitioned by at; never updated.';

-- Parks once resolved (redriven, applied, or settled by an operator). The
-- park row as it was (body apart) is kept as jsonb, so columns later
-- migrations add to idemq.parked come along.
CREATE TABLE idemq.park_history (
    id           bigint NOT NULL,
    key          text,
    source_queue text NOT NULL,
    generation   integer NOT NULL,
    parked_at    timestamptz NOT NULL,
    resolved_at  timestamptz NOT NULL,
    resolution   text NOT NULL,
    resolved_by  text,
    body         bytea NOT NULL,
    park         jsonb NOT NULL
) PARTITION BY RANGE (resolved_at);
CREATE INDEX park_history_key_idx ON idemq.park_history (key);
CREATE INDEX park_history_id_idx ON idemq.park_history (id);
CREATE TABLE idemq.park_history_default PARTITION OF idemq.park_history DEFAULT;
COMMENT ON TABLE idemq.park_history IS
  'Parks that were resolved (moved out of idemq.parked in the resolving transaction). '
  'Partitioned by resolved_at.';
COMMENT ON TABLE idemq.parked IS
  'Open parks: messages idemq gave up on, with raw body and reason, until resolved '
  '(then moved to idemq.park_history). Never removed by time.';

-- Deferred jobs: a due time (set when a predecessor is applied, a hold is
-- released or a failed attempt''s run_after is known) and indexes, so
-- workers read only the due ones. Existing rows start due (-infinity): the
-- guard re-decides each once.
ALTER TABLE idemq.deferred ADD COLUMN due_at timestamptz DEFAULT '-infinity';
ALTER TABLE idemq.deferred ALTER COLUMN due_at DROP DEFAULT;
CREATE INDEX deferred_due_idx ON idemq.deferred (due_at) WHERE due_at IS NOT NULL;
CREATE INDEX deferred_report_idx ON idemq.deferred (source_queue, deferred_at)
    WHERE reported_at IS NULL;
COMMENT ON COLUMN idemq.deferred.due_at IS
  'when the job may be taken again (NULL: waits for a predecessor or a hold)';

-- The register of history partitions, hot, archived or dropped.
CREATE SCHEMA IF NOT EXISTS idemq_archive;
COMMENT ON SCHEMA idemq_archive IS
  'History partitions older than ledger.history_hot_days, detached from their '
  'parents; idemq jobs show still reads them. Dropped past ledger.history_retention_days.';
CREATE TABLE idemq.history_parts (
    relname       text PRIMARY KEY,
    kind          text NOT NULL CHECK (kind IN ('attempts', 'batches', 'redrives', 'parks')),
    lo            timestamptz NOT NULL,
    hi            timestamptz NOT NULL,
    attached      boolean NOT NULL,
    location      text NOT NULL CHECK (location IN ('hot', 'archive', 'dropped')),
    created_at    timestamptz NOT NULL DEFAULT clock_timestamp(),
    archived_at   timestamptz,
    dropped_at    timestamptz,
    prune_block   bigint NOT NULL DEFAULT 0,
    pruned_at     timestamptz,
    exported_at   timestamptz,
    export_file   text,
    export_sha256 text,
    export_rows   bigint
);
CREATE INDEX history_parts_kind_idx ON idemq.history_parts (kind, lo);
COMMENT ON TABLE idemq.history_parts IS
  'Every history partition: kind, time range [lo, hi), where it is (hot: schema idemq, '
  'archive: schema idemq_archive, dropped), how far pruning of idemq.jobs has read it, '
  'and its export (file, SHA-256, rows).';
INSERT INTO idemq.history_parts (relname, kind, lo, hi, attached, location)
VALUES ('attempts_v3', 'attempts', '-infinity', clock_timestamp(), false, 'hot'),
       ('redrives_v3', 'redrives', '-infinity', clock_timestamp(), false, 'hot');

-- The windows, in the database so that every replica applies the same ones
-- and `run` needs no say over them: `idemq migrate` writes the ledger.*
-- settings of its configuration here.
CREATE TABLE idemq.retention (
    id                 integer PRIMARY KEY CHECK (id = 1),
    dedup_window       interval NOT NULL DEFAULT '400 days',
    partition_interval interval NOT NULL DEFAULT '1 day',
    history_hot        interval NOT NULL DEFAULT '90 days',
    history_retention  interval NOT NULL DEFAULT '400 days',
    updated_at         timestamptz NOT NULL DEFAULT clock_timestamp(),
    updated_by         text,
    CHECK (dedup_window >= interval '1 minute' AND partition_interval >= interval '1 second'
           AND history_hot >= partition_interval AND history_retention >= dedup_window
           AND history_retention >= history_hot)
);
INSERT INTO idemq.retention (id) VALUES (1);

-- The last maintenance runs that did something (a ring of 1024 slots).
CREATE TABLE idemq.maintenance_runs (
    slot        integer PRIMARY KEY,
    run_id      bigint NOT NULL,
    started_at  timestamptz NOT NULL,
    finished_at timestamptz NOT NULL,
    who         text,
    actions     jsonb NOT NULL
);
CREATE SEQUENCE idemq.maintenance_runs_seq;
