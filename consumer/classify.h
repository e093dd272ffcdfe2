/*
 * classify: the one place that decides an error's class. The class drives
 * what happens to a job (retry, park, stop consuming, reconnect) and is
 * recorded on every attempt in the ledger.
 */
#ifndef IDEMQ_CLASSIFY_H
#define IDEMQ_CLASSIFY_H

#include <stdbool.h>

#include "idemq_err.h"

enum classify_class {
    CLASS_NONE = 0,  /* no error */
    CLASS_TRANSIENT, /* retry later with backoff */
    CLASS_PERMANENT, /* the job itself is bad: park it now */
    CLASS_FATAL,     /* bad deploy or configuration: stop consuming, park nothing */
    CLASS_INFRA,     /* database or broker unreachable: pause, reconnect, not an attempt */
};

/* User steering from inside the effect: SQLSTATEs (5 characters) or classes
 * (2 characters) that mean retry or park. Checked before the defaults,
 * exact codes before classes, park before retry. */
struct classify_rules {
    const char *const *retry;
    int n_retry;
    const char *const *park;
    int n_park;
};

/* Name stored in the ledger: "transient", "permanent", "fatal",
 * "infrastructure"; "none" for CLASS_NONE. */
const char *classify_name(enum classify_class c);

/*
 * Class of a failed statement. sqlstate may be NULL or empty (no server
 * answer); conn_lost says the connection is gone after the failure, which
 * makes it CLASS_INFRA whatever the code. rules may be NULL. Pure.
 */
enum classify_class classify_sqlstate(const char *sqlstate, bool conn_lost,
                                      const struct classify_rules *rules);

/* Class of an idemq_err_t raised outside SQL (decode errors, I/O). Pure. */
enum classify_class classify_err(idemq_err_t err);

/* True if s is a well-formed SQLSTATE (5 of [0-9A-Z]) or class (2). */
bool classify_valid_code(const char *s);

#endif
