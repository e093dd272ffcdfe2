/*
 * lifecycle: the operator commands of the ledger's lifecycle: `maintain`
 * (run maintenance now, until nothing is left), `archive list` (the history
 * partitions and where they are), `archive export` (archived partitions to
 * CSV files with SHA-256 checksums, recorded in the ledger) and `archive
 * verify` (the files against their checksums and the ledger). Also the
 * settings step of `migrate` and the settings check of `run`.
 */
#ifndef IDEMQ_LIFECYCLE_H
#define IDEMQ_LIFECYCLE_H

#include <stdbool.h>
#include <stdio.h>

#include "conf.h"
#include "ledger_db.h"

/* After the migrations (`idemq migrate`, as the ledger's owner): writes c's
 * ledger.* settings into the ledger and runs one maintenance call (the first
 * partitions). Returns 0, or 5 with the reason logged. */
int lifecycle_migrate_settings(PGconn *db, const struct conf *c, FILE *out);

/* `run` start-up: logs a warning when c's ledger.* settings differ from the
 * ledger's (which apply: `idemq migrate` writes them). Never fails. */
void lifecycle_check_settings(PGconn *db, const struct conf *c);

/* `idemq maintain [--now TS]`: maintenance calls until none reports work
 * left (at most 10,000), one line per call that did something, then a
 * summary. now: NULL or the time to act at (owner only). Returns 0, 1 when
 * a call failed, 4 when the database is unreachable. */
int lifecycle_maintain(const struct conf *c, const char *now, FILE *out);

/* `idemq archive list`: every history partition of the register. Returns 0
 * or 4. */
int lifecycle_archive_list(const struct conf *c, FILE *out);

/* `idemq archive export --dir DIR [--all]`: each archived partition not
 * exported yet (all with all) to DIR/<name>.csv (COPY, CSV with a header)
 * and DIR/<name>.csv.sha256 (sha256sum format), then records file, SHA-256
 * and rows in the ledger. Returns 0, 1 on a failed export (the partition
 * stays unexported), 2 for a bad directory, 4 when unreachable. */
int lifecycle_archive_export(const struct conf *c, const char *dir, bool all, FILE *out);

/* `idemq archive verify --dir DIR`: for every export the ledger recorded,
 * the file's SHA-256 against the ledger and the .sha256 file, and the row
 * count against the partition while it exists. Returns 0 when all match, 1
 * otherwise (each failure printed), 4 when unreachable. */
int lifecycle_archive_verify(const struct conf *c, const char *dir, FILE *out);

#endif
