/*
 * ops: the operator commands: `jobs show` (the full story of one key),
 * `parked list` (with filters and a count by error class) and `redrive`
 * (dead-lettered messages back to their origin queue, through the same
 * idempotent path as any delivery). jobs show and parked list only read;
 * all three are safe while replicas run.
 */
#ifndef IDEMQ_OPS_H
#define IDEMQ_OPS_H

#include <stdbool.h>
#include <stdio.h>

#include <libpq-fe.h>

#include "conf.h"

struct job;

struct ops_filter {
    const char *input;        /* input name, NULL = all */
    const char *key;          /* exact key, NULL = any */
    const char *error_class;  /* NULL = any */
    const char *since;        /* timestamptz text, NULL = any time */
    long limit;               /* 0 = no limit */
    bool dry_run;             /* redrive: only show what would move */
    double rate;              /* redrive: messages per second, 0 = unlimited */
    /* redrive by failure group (groups.c): only the dead-letter copies of
     * these parks (x-idemq-park-id; sorted ascending), when park_ids is set;
     * on_moved(moved_arg, key or NULL, park id) after each confirmed move. */
    const long long *park_ids;
    size_t n_park_ids;
    void (*on_moved)(void *moved_arg, const char *key, long long park_id);
    void *moved_arg;
    /* groups_act: when set, the selected park ids (ascending, malloc'd; the
     * caller frees them, NULL when none) into *ids_out and their count into
     * *n_ids_out; a set park_ids also restricts its selection to them. */
    long long **ids_out;
    size_t *n_ids_out;
};

/* A session for an operator command: application name app, statement
 * timeout ms (0: none), times printed in UTC. NULL (logged) when the
 * database is unreachable. */
PGconn *ops_connect(const struct conf *c, const char *app, int statement_timeout_ms);

/* Field (row, col) of r as text, "-" for SQL NULL. */
const char *ops_val(const PGresult *r, int row, int col);

/* Escaped copies of stored text made for one command's output. */
struct ops_strs {
    char **v;
    size_t n, cap;
};

/*
 * s made safe for a terminal line (textesc_term_one): control bytes
 * (below 0x20, 0x7f), the C1 controls U+0080..U+009F (a terminal may take
 * U+009B as CSI), invisible characters (bidirectional overrides,
 * zero-width characters: textesc_invisible), bytes that are not UTF-8, and
 * the backslash are written as \n, \r, \t, \\ or \xNN of each byte, so
 * stored text (a key, a provider's answer, a reason) can neither start a
 * line, send an escape sequence nor reorder or hide what is printed. Returns s itself when
 * nothing needs escaping, else a copy owned by a (freed by
 * ops_strs_free); "?" when out of memory. Not thread-safe per a.
 */
const char *ops_text(struct ops_strs *a, const char *s);

/* ops_text of ops_val(r, row, col). */
const char *ops_tval(struct ops_strs *a, const PGresult *r, int row, int col);

/* Frees every copy a holds and empties it. */
void ops_strs_free(struct ops_strs *a);

/* Prints the story of key to out, oldest first. Returns 0, 1 when the
 * ledger knows nothing of the key, 4 when the database is unreachable. */
int ops_jobs_show(const struct conf *c, const char *key, FILE *out);

/* Lists parked messages matching f and a count by error class.
 * Returns 0, 2 for a bad filter, 4 when the database is unreachable. */
int ops_parked_list(const struct conf *c, const struct ops_filter *f, FILE *out);

/*
 * Moves dead-lettered messages matching f from each input's <queue>.dead
 * back to the queue named in their x-idemq-origin-queue header: publish
 * (confirmed), then ack the dead-letter copy. Messages that do not match
 * are left in place. Returns 0, 1 on a broker failure mid-way (nothing is
 * lost: unacknowledged copies stay), 2 for a bad filter, 4 when a service
 * is unreachable.
 */
int ops_redrive(const struct conf *c, const struct ops_filter *f, FILE *out);

/* "idemq redrive (USER@HOST)": who moves a message, for its seal and the
 * audit. */
void ops_who(char *buf, size_t len);

/* Reads the ledger's redrive secret into seal.c. 0, or an exit code (1, 4:
 * database unreachable). */
int ops_load_seal(PGconn *db);

/*
 * Seals the copy j about to be redriven: a copy idemq sealed keeps its
 * seal; one it did not is sealed only while the ledger holds the open park
 * its headers name, else it loses x-idemq-generation (it cannot start a
 * redrive) and *note says so. Then the seal of who redrives it
 * (x-idemq-redrive-seal; the caller adds x-idemq-redriven-by = by). 0, or
 * an exit code.
 */
int ops_seal_copy(PGconn *db, struct job *j, const char *key, const char *by, const char **note);

/*
 * idemq erase KEY --why TEXT: removes the payload copies the ledger holds
 * of key (idemq.erase_key: park bodies and headers, open and resolved; a
 * provider intent's request) keeping its audit facts, recorded as an
 * operator action by the OS user with why. Prints what it erased to out.
 * Returns 0, 2 when the ledger refuses (the key is still in flight), or 4
 * when the database is unreachable.
 */
int ops_erase(const struct conf *c, const char *key, const char *why, FILE *out);

#endif
