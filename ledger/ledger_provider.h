/*
 * ledger_provider: how idemq calls the provider-effect functions of the
 * ledger (ledger/functions_provider.sql), with parameters only: transaction
 * 1 (provider_begin), transaction 2 (provider_result, then
 * provider_confirmed for the local effect), a failed local effect after a
 * confirmed reference, the reconciler's sweep, operator
 * resolutions, and the observability queries. Each call is one statement,
 * so one transaction of its own (autocommit): none may run inside an open
 * transaction.
 */
#ifndef IDEMQ_LEDGER_PROVIDER_H
#define IDEMQ_LEDGER_PROVIDER_H

#include <jansson.h>
#include <libpq-fe.h>
#include <stdbool.h>
#include <stddef.h>

#include "conf.h"
#include "idemq_err.h"
#include "ledger_db.h"

/* What the ledger asks for next (see the top of functions_provider.sql). */
enum ledger_provider_action {
    LEDGER_PROVIDER_CALL = 0,   /* send the request; lease is its token */
    LEDGER_PROVIDER_LOOKUP,     /* ask the provider; by_reference says which route */
    LEDGER_PROVIDER_APPLIED,    /* the reference and the local effect committed */
    LEDGER_PROVIDER_DUPLICATE,  /* nothing to do for this copy */
    LEDGER_PROVIDER_WAIT,       /* come back after delay_ms; no attempt used */
    LEDGER_PROVIDER_RETRY,      /* an attempt failed; come back after delay_ms */
    LEDGER_PROVIDER_PARK,       /* parked; park holds the facts */
    LEDGER_PROVIDER_EFFECT_ERROR, /* the local effect raised sqlstate: classify it */
    LEDGER_PROVIDER_CONFIRMED,  /* the reference is committed: run the local effect next
                                 * (ledger_provider_confirmed); message: an alarm or "" */
};

struct ledger_provider_step {
    char key[CONF_KEY_MAX_BYTES + 1]; /* the sweep fills it; others leave it */
    enum ledger_provider_action action;
    int attempt;
    int lease;            /* CALL, LOOKUP: the fencing token to report back */
    bool by_reference;    /* LOOKUP: by client reference, else by idempotency key */
    long delay_ms;        /* WAIT, RETRY */
    json_t *park;         /* PARK: owned */
    char message[512];
    char sqlstate[6];     /* EFFECT_ERROR */
    unsigned char *body;  /* CALL: the request body to send when the ledger's differs
                           * from the caller's (or for the sweep); CONFIRMED: the
                           * intent's message when it is sealed at rest (NULL: stored
                           * as sent). Opened when it was sealed; owned, may be NULL */
    size_t body_len;
    bool body_opened;     /* body is an opened copy (wiped and freed on clear) */
    char body_key[64];    /* the key the stored body was sealed with ("": as sent) */
    const char *unopened; /* non-NULL: the stored body is sealed with body_key and could
                           * not be opened (protect_open_str); body is NULL: never send */
};

/* Name of an action ("call", "lookup", ...). */
const char *ledger_provider_action_name(enum ledger_provider_action a);

/* Releases what a step owns and zeroes it. */
void ledger_provider_step_clear(struct ledger_provider_step *s);

/* The provider settings of input i as the JSON object the functions read
 * (p_opts). Returns a new string (caller frees) or NULL on no memory. */
char *ledger_provider_opts(const struct conf *c, int i);

/*
 * Transaction 1 for one delivery. doc is the one-job array ledger_doc wrote
 * for it; body/body_len the raw message and props its properties (JSON
 * text); request_sha/req_body what this copy would send. The message and
 * the request are stored sealed with the process's active key, if any (the
 * hashes stay those of the message and the request themselves). Fills *s.
 * Returns IDEMQ_OK, or IDEMQ_ERR_DB_CONN / IDEMQ_ERR_SQL with e filled
 * (nothing committed; also when a copy cannot be sealed: it is never
 * stored in the clear).
 */
idemq_err_t ledger_provider_begin(PGconn *db, const char *doc, const char *opts,
                                  const char *consumer, const void *body, size_t body_len,
                                  const char *props, const char *request_sha,
                                  const void *req_body, size_t req_len,
                                  struct ledger_provider_step *s,
                                  struct ledger_db_error *e) IDEMQ_MUSTCHECK;

/* The longest provider reference idemq records, in bytes. */
#define LEDGER_PROVIDER_REF_MAX 255

/*
 * Transaction 2: the answer to request or lookup `lease` of key. op is
 * "call", "key" or "reference"; cls an effect_http class name; answer the
 * answer as JSON text ({"status", "body", ...}); ref the reference found
 * ("" if none; one longer than LEDGER_PROVIDER_REF_MAX bytes or not UTF-8
 * counts as none, with the reason as detail); retry_after_ms above INT_MAX
 * counts as INT_MAX. doc: the delivery's one-job array, or NULL for the
 * reconciler (sweep = true). Fills *s; same errors as ledger_provider_begin.
 */
idemq_err_t ledger_provider_result(PGconn *db, const char *key, int lease, const char *op,
                                   const char *cls, long status, const char *answer,
                                   const char *ref, long retry_after_ms, const char *detail,
                                   const char *opts, const char *doc, const char *consumer,
                                   bool sweep, struct ledger_provider_step *s,
                                   struct ledger_db_error *e) IDEMQ_MUSTCHECK;

/*
 * After LEDGER_PROVIDER_CONFIRMED (the step `confirmed`, whose body is the
 * opened message when it is sealed at rest; when its `unopened` is set,
 * call ledger_provider_unopened instead): transaction 2b, the local effect
 * of key, whose reference is committed; how says how it was found
 * ("answer", "lookup by key", "local retry", "reconciler"). Fills *s
 * (APPLIED, EFFECT_ERROR or DUPLICATE). On IDEMQ_ERR_SQL the statement
 * failed as a whole (a statement timeout, an ASSERT, a deadlock in the
 * effect): the reference stays recorded; classify e->sqlstate as the
 * effect's error. doc as for ledger_provider_result.
 */
idemq_err_t ledger_provider_confirmed(PGconn *db, const char *key, const char *how,
                                      const char *opts, const char *doc, const char *consumer,
                                      const struct ledger_provider_step *confirmed,
                                      struct ledger_provider_step *s,
                                      struct ledger_db_error *e) IDEMQ_MUSTCHECK;

/*
 * After LEDGER_PROVIDER_CONFIRMED whose sealed message does not open (its
 * key is not listed, or the copy was altered): the local effect cannot run,
 * which is recorded as a transient failure of it naming the key (code
 * "config"); the reference stays recorded, retry.max_attempts of them park
 * the key. Fills *s (RETRY or PARK) as ledger_provider_effect_failed.
 */
idemq_err_t ledger_provider_unopened(PGconn *db, const char *key,
                                     const struct ledger_provider_step *confirmed,
                                     const char *opts, const char *doc, const char *consumer,
                                     struct ledger_provider_step *s,
                                     struct ledger_db_error *e) IDEMQ_MUSTCHECK;

/* After LEDGER_PROVIDER_EFFECT_ERROR: records the local effect's failure
 * with its class ("transient" or "permanent") and code; fills *s (RETRY or
 * PARK). doc as for ledger_provider_result. */
idemq_err_t ledger_provider_effect_failed(PGconn *db, const char *key, const char *cls,
                                          const char *code, const char *sqlstate,
                                          const char *message, const char *opts,
                                          const char *doc, const char *consumer,
                                          struct ledger_provider_step *s,
                                          struct ledger_db_error *e) IDEMQ_MUSTCHECK;

/*
 * The reconciler: takes up to max intents of the input of opts left pending
 * or unknown for longer than age_s (skipping keys other sessions hold) and
 * writes one step per key to out (with key filled). *n receives the count.
 * Same errors as ledger_provider_begin.
 */
idemq_err_t ledger_provider_sweep(PGconn *db, const char *opts, int age_s, int max,
                                  const char *consumer, struct ledger_provider_step *out,
                                  int *n, struct ledger_db_error *e) IDEMQ_MUSTCHECK;

/*
 * idemq resolve: action "applied" (with ref), "not_applied" or "discard";
 * by is the OS user, reason the operator's text; msg/msg_len the intent's
 * message opened when it is sealed at rest (NULL: the stored one is read as
 * it is). prior receives the intent's state before. IDEMQ_ERR_SQL with e
 * filled when the ledger refuses (not a provider job, not parked, the
 * effect failed).
 */
idemq_err_t ledger_provider_resolve(PGconn *db, const char *key, const char *action,
                                    const char *ref, const char *by, const char *reason,
                                    const char *opts, const void *msg, size_t msg_len,
                                    char *prior, size_t priorlen,
                                    struct ledger_db_error *e) IDEMQ_MUSTCHECK;

#endif
