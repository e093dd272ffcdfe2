/*
 * idemq_err: names and texts for idemq_err_t. Both switches have no default
 * case so that -Werror (-Wswitch) refuses a code without text.
 */
#include "idemq_err.h"

const char *idemq_err_name(idemq_err_t err)
{
    switch (err) {
    case IDEMQ_OK: return "ok";
    case IDEMQ_ERR_NOMEM: return "nomem";
    case IDEMQ_ERR_CONFIG: return "config";
    case IDEMQ_ERR_USAGE: return "usage";
    case IDEMQ_ERR_TIMEOUT: return "timeout";
    case IDEMQ_ERR_BODY_TOO_LARGE: return "body_too_large";
    case IDEMQ_ERR_BAD_JSON: return "bad_json";
    case IDEMQ_ERR_NOT_OBJECT: return "not_object";
    case IDEMQ_ERR_KEY_MISSING: return "key_missing";
    case IDEMQ_ERR_KEY_EMPTY: return "key_empty";
    case IDEMQ_ERR_KEY_TOO_LONG: return "key_too_long";
    case IDEMQ_ERR_KEY_INVALID: return "key_invalid";
    case IDEMQ_ERR_BROKER: return "broker";
    case IDEMQ_ERR_DB_CONN: return "db_connection";
    case IDEMQ_ERR_SQL: return "sql_error";
    case IDEMQ_ERR_EFFECT: return "effect_error";
    case IDEMQ_ERR_SHUTDOWN: return "shutdown";
    case IDEMQ_ERR_INTERNAL: return "internal";
    case IDEMQ_ERR_RETRIES_EXHAUSTED: return "retries_exhausted";
    case IDEMQ_ERR_SEQUENCE_INVALID: return "sequence_invalid";
    case IDEMQ_ERR_OUTSIDE_WINDOW: return "outside_dedup_window";
    }
    return "unknown";
}

const char *idemq_err_str(idemq_err_t err)
{
    switch (err) {
    case IDEMQ_OK: return "success";
    case IDEMQ_ERR_NOMEM: return "out of memory";
    case IDEMQ_ERR_CONFIG: return "invalid configuration";
    case IDEMQ_ERR_USAGE: return "invalid command line";
    case IDEMQ_ERR_TIMEOUT: return "timed out";
    case IDEMQ_ERR_BODY_TOO_LARGE: return "message body exceeds max_body_bytes";
    case IDEMQ_ERR_BAD_JSON: return "message body is not valid UTF-8 JSON";
    case IDEMQ_ERR_NOT_OBJECT: return "message body is not a JSON object";
    case IDEMQ_ERR_KEY_MISSING: return "idempotency key is missing";
    case IDEMQ_ERR_KEY_EMPTY: return "idempotency key is empty";
    case IDEMQ_ERR_KEY_TOO_LONG: return "idempotency key is longer than 256 bytes";
    case IDEMQ_ERR_KEY_INVALID: return "idempotency key has the wrong type or bytes";
    case IDEMQ_ERR_BROKER: return "broker connection or channel failed";
    case IDEMQ_ERR_DB_CONN: return "database connection failed";
    case IDEMQ_ERR_SQL: return "SQL statement failed";
    case IDEMQ_ERR_EFFECT: return "effect function failed";
    case IDEMQ_ERR_SHUTDOWN: return "shutting down";
    case IDEMQ_ERR_INTERNAL: return "internal invariant failed";
    case IDEMQ_ERR_RETRIES_EXHAUSTED: return "transient failures used the whole attempt budget";
    case IDEMQ_ERR_SEQUENCE_INVALID: return "sequence number absent or not a positive integer";
    case IDEMQ_ERR_OUTSIDE_WINDOW:
        return "message older than the dedup window whose key is no longer claimed";
    }
    return "unknown error";
}
