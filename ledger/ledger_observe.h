/*
 * ledger_observe: the pure half of observe mode on the ledger
 * side: the document idemq.observe_batch reads (one entry per delivery of
 * an observe-mode input, decoded or not) and the names of its outcomes.
 * ledger_txn_observe (ledger_txn.h) sends it inside the batch transaction.
 *
 * Document: a JSON array of {"n": input name, "q": queue, "k": key or
 * null, "h": body SHA-256, "w": older than the dedup window, "c": the
 * code apply mode would park it with (decode errors) or null, "r": reason,
 * "kp": on_key_reuse = park, "rd": redelivered}. Every string is valid
 * UTF-8 (bytes that are not become '?').
 */
#ifndef IDEMQ_LEDGER_OBSERVE_H
#define IDEMQ_LEDGER_OBSERVE_H

#include <stdbool.h>

#include "conf.h"
#include "idemq_err.h"
#include "job.h"

/* What an observed delivery came to (idemq.observations.outcome). */
enum observe_outcome {
    OBSERVE_NONE = 0,
    OBSERVE_NEW,        /* "observed": first sighting, key claimed as applied */
    OBSERVE_DUPLICATE,  /* "duplicate": key claimed before (also earlier in its batch) */
    OBSERVE_LATE,       /* "late_replay": older than the dedup window, not claimed */
    OBSERVE_WOULD_PARK, /* "would_park": apply mode would park it (code) */
    OBSERVE_UNRECORDED, /* "unrecorded": the observation itself could not be
                         * stored (acknowledged anyway: it is only a copy) */
    OBSERVE_N_OUTCOMES
};

/* The stored name of an outcome ("observed", ...); "none" for OBSERVE_NONE. */
const char *ledger_observe_outcome_name(enum observe_outcome o);

/* The outcome of a stored name; OBSERVE_NONE for anything else. */
enum observe_outcome ledger_observe_outcome_parse(const char *name);

/* The idemq_err_t whose idemq_err_name is name (a would-park code), or
 * IDEMQ_OK when name is none of them (NULL, ""). */
idemq_err_t ledger_observe_code_parse(const char *name);

/*
 * The observe_batch document for jobs[0..n) of c's inputs (each decoded by
 * job_decode); old[i]: the message is older than the dedup window. Returns
 * a malloc'd NUL-terminated string, or NULL when out of memory.
 */
char *ledger_observe_doc(const struct conf *c, struct job *const *jobs, const bool *old, int n);

#endif
