/*
 * groups: failure groups of parked messages. `idemq parked
 * groups` groups the open parks by a fingerprint (input, error class, code,
 * SQLSTATE and the reason with keys, numbers, ids, UUIDs, hex and quoted
 * strings masked: idemq.mask_reason in ledger/functions_groups.sql), and
 * `idemq parked redrive|discard|archive` act on a group or a filter, in
 * bounded steps at a rate, each action recorded in idemq.operator_actions
 * and per park in idemq.operator_action_keys (shown by `jobs show`).
 */
#ifndef IDEMQ_GROUPS_H
#define IDEMQ_GROUPS_H

#include <libpq-fe.h>
#include <stdio.h>

#include "conf.h"
#include "ops.h"

/* Parks closed per transaction by discard and archive. */
#define GROUPS_STEP 500
/* Default pace of an action, in parks per second (--rate N). */
#define GROUPS_DEFAULT_RATE 1000.0

/* The open parks a selection covers, as SQL text after a select list (each
 * row is a park of idemq.parked with g = its group id and m = its masked
 * reason): $1 key, $2 class, $3 since, $4 queue, $5 group (each NULL = any). */
#define GROUPS_FROM                                                                          \
    " FROM (SELECT p.*, idemq.park_group(p.source_queue, p.error_class, p.error_code,"     \
    "  p.sqlstate, p.reason, p.key) AS g, idemq.mask_reason(p.reason, p.key) AS m"          \
    "  FROM idemq.parked p) x"                                                              \
    " WHERE ($1::text IS NULL OR key = $1) AND ($2::text IS NULL OR error_class = $2)"      \
    " AND ($3::timestamptz IS NULL OR parked_at >= $3) AND ($4::text IS NULL OR"            \
    " source_queue = $4) AND ($5::text IS NULL OR g = $5)"

/*
 * The failure groups of the open parks matching key, error_class, since
 * and queue (each NULL = any), at most limit (0 = all), largest first. The
 * result (the caller PQclears it, also on error) has the columns: 0 group
 * id, 1 count, 2 first park, 3 last park, 4-6 up to 3 sample keys (NULL),
 * 7 how many are redrivable, 8 source queue, 9 class, 10 code, 11 SQLSTATE
 * ('-'), 12 masked reason, 13 distinct keys. Any thread owning db.
 */
PGresult *groups_select(PGconn *db, const char *key, const char *error_class, const char *since,
                        const char *queue, long limit);

/*
 * Prints the failure groups of the open parks matching f (input, key,
 * class, since; limit = at most that many groups), largest first: id,
 * count, first and last park, up to 3 keys, whether redrivable, and the
 * fingerprint. Returns 0, 2 for a bad filter, 4 when the database is
 * unreachable.
 */
int groups_list(const struct conf *c, const struct ops_filter *f, FILE *out);

/*
 * `idemq parked ACTION`: action "redrive", "discard" or "archive" on the
 * open parks matching f and, unless group is NULL, of failure group
 * `group` (12 hex digits). reason: required for discard and archive.
 * actor: the operator's name, NULL = $SUDO_USER, else the OS user. With
 * f->dry_run, prints what would happen and changes nothing (nothing is
 * recorded); else records the action, acts in steps of GROUPS_STEP parks at
 * f->rate parks per second (0: GROUPS_DEFAULT_RATE) and prints the counts.
 * Returns 0, 1 when it failed part-way (what was done is recorded), 2 for
 * bad arguments, 4 when a service is unreachable.
 */
int groups_act(const struct conf *c, const char *action, const struct ops_filter *f,
               const char *group, const char *reason, const char *actor, FILE *out);

/* Writes key's redrive count and the operator actions that touched it to
 * out (for jobs show). Prints nothing of what the ledger cannot tell. */
void groups_show(PGconn *db, const char *key, FILE *out);

#endif
