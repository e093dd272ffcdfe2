/*
 * classify: maps SQLSTATEs and idemq errors to the four error classes.
 * Defaults follow PostgreSQL's SQLSTATE classes (Appendix A of its manual).
 */
#include "classify.h"

#include <string.h>

const char *classify_name(enum classify_class c)
{
    switch (c) {
    case CLASS_NONE: return "none";
    case CLASS_TRANSIENT: return "transient";
    case CLASS_PERMANENT: return "permanent";
    case CLASS_FATAL: return "fatal";
    case CLASS_INFRA: return "infrastructure";
    }
    return "none";
}

bool classify_valid_code(const char *s)
{
    size_t n = strlen(s);
    if (n != 2 && n != 5)
        return false;
    for (size_t i = 0; i < n; i++)
        if (!((s[i] >= '0' && s[i] <= '9') || (s[i] >= 'A' && s[i] <= 'Z')))
            return false;
    return true;
}

/* 2 = exact match, 1 = class match, 0 = none. */
static int list_match(const char *const *list, int n, const char *code)
{
    int best = 0;
    for (int i = 0; i < n; i++) {
        size_t len = strlen(list[i]);
        if (len == 5 && strcmp(list[i], code) == 0)
            return 2;
        if (len == 2 && strncmp(list[i], code, 2) == 0)
            best = 1;
    }
    return best;
}

static bool in(const char *code, const char *const *set)
{
    for (; *set; set++)
        if (strncmp(code, *set, strlen(*set)) == 0)
            return true;
    return false;
}

enum classify_class classify_sqlstate(const char *sqlstate, bool conn_lost,
                                      const struct classify_rules *rules)
{
    /* Transient: the same statement can succeed later. */
    static const char *const transient[] = {"08", "40", "53", "55P03", "57014", "57P01",
                                            "57P02", "57P03", "58000", "58030", NULL};
    /* Fatal: the deploy is wrong (missing function/table, privileges,
     * wrong database or schema, broken routine); no job is at fault. */
    static const char *const fatal[] = {"42", "3D", "3F", "28", "2F", "39", NULL};

    if (conn_lost || !sqlstate || strlen(sqlstate) != 5)
        return conn_lost || !sqlstate || !*sqlstate ? CLASS_INFRA : CLASS_PERMANENT;
    if (rules) {
        int p = list_match(rules->park, rules->n_park, sqlstate);
        int r = list_match(rules->retry, rules->n_retry, sqlstate);
        if (p && p >= r)
            return CLASS_PERMANENT;
        if (r)
            return CLASS_TRANSIENT;
    }
    if (in(sqlstate, transient))
        return CLASS_TRANSIENT;
    if (in(sqlstate, fatal))
        return CLASS_FATAL;
    return CLASS_PERMANENT;
}

enum classify_class classify_err(idemq_err_t err)
{
    switch (err) {
    case IDEMQ_OK:
        return CLASS_NONE;
    case IDEMQ_ERR_BODY_TOO_LARGE:
    case IDEMQ_ERR_BAD_JSON:
    case IDEMQ_ERR_NOT_OBJECT:
    case IDEMQ_ERR_KEY_MISSING:
    case IDEMQ_ERR_KEY_EMPTY:
    case IDEMQ_ERR_KEY_TOO_LONG:
    case IDEMQ_ERR_KEY_INVALID:
    case IDEMQ_ERR_SEQUENCE_INVALID:
    case IDEMQ_ERR_EFFECT:
    case IDEMQ_ERR_HEADERS_TOO_DEEP:
    case IDEMQ_ERR_HEADERS_TOO_LARGE:
    case IDEMQ_ERR_DUPLICATE_FIELD:
    case IDEMQ_ERR_KEY_NULL:
    case IDEMQ_ERR_UNDECODABLE:
    case IDEMQ_ERR_DELIVERY_LIMIT:
    case IDEMQ_ERR_UNPROCESSABLE:
    case IDEMQ_ERR_ORIGIN_REFUSED:
    case IDEMQ_ERR_OUTSIDE_WINDOW:
    case IDEMQ_ERR_FORGED_REDRIVE:
    case IDEMQ_ERR_KEY_REUSE:
    case IDEMQ_ERR_CELERY_PICKLE:
    case IDEMQ_ERR_CELERY_SERIALIZER:
    case IDEMQ_ERR_CELERY_COMPRESSED:
    case IDEMQ_ERR_CELERY_MALFORMED:
    case IDEMQ_ERR_CELERY_UNKNOWN_TASK:
    case IDEMQ_ERR_CELERY_EXPIRED:
    case IDEMQ_ERR_UNPUBLISHABLE: /* the message itself cannot be sent */
        return CLASS_PERMANENT;
    case IDEMQ_ERR_KEY_INVALID_HEADER:
    case IDEMQ_ERR_PROVIDER_REJECTED:
    case IDEMQ_ERR_KEY_CONFLICT:
        return CLASS_PERMANENT;
    /* Provider outcomes that are not the job's fault. A park for an
     * uncertain one is recorded with its own class by the ledger
     * (unknown_outcome, no_record: see ledger/functions_provider.sql). */
    case IDEMQ_ERR_PROVIDER_BUSY:
    case IDEMQ_ERR_PROVIDER_UNKNOWN:
    case IDEMQ_ERR_PROVIDER_WAITS:
    case IDEMQ_ERR_PROVIDER_RATE_LIMITED:
    case IDEMQ_ERR_KEY_WINDOW_EXPIRED:
    case IDEMQ_ERR_PROVIDER_NO_RECORD:
    case IDEMQ_ERR_PROVIDER_BAD_RESPONSE:
    case IDEMQ_ERR_PROVIDER_NOT_SENT:
    case IDEMQ_ERR_RETRIES_EXHAUSTED:
        return CLASS_TRANSIENT;
    case IDEMQ_ERR_TIMEOUT:
        return CLASS_TRANSIENT;
    case IDEMQ_ERR_BROKER:
    case IDEMQ_ERR_DB_CONN:
    case IDEMQ_ERR_NOMEM:
        return CLASS_INFRA;
    case IDEMQ_ERR_CONFIG:
    case IDEMQ_ERR_USAGE:
    case IDEMQ_ERR_SQL:
    case IDEMQ_ERR_SHUTDOWN:
    case IDEMQ_ERR_INTERNAL:
        return CLASS_FATAL;
    }
    return CLASS_FATAL;
}
