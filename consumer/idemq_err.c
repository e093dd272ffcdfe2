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
    case IDEMQ_ERR_HEADERS_TOO_DEEP: return "headers_too_deep";
    case IDEMQ_ERR_HEADERS_TOO_LARGE: return "headers_too_large";
    case IDEMQ_ERR_DUPLICATE_FIELD: return "duplicate_field";
    case IDEMQ_ERR_KEY_NULL: return "key_null";
    case IDEMQ_ERR_UNDECODABLE: return "undecodable";
    case IDEMQ_ERR_DELIVERY_LIMIT: return "delivery_limit";
    case IDEMQ_ERR_UNPROCESSABLE: return "unprocessable";
    case IDEMQ_ERR_ORIGIN_REFUSED: return "origin_refused";
    case IDEMQ_ERR_KEY_INVALID_HEADER: return "key_invalid_header";
    case IDEMQ_ERR_PROVIDER_BUSY: return "provider_busy";
    case IDEMQ_ERR_PROVIDER_REJECTED: return "provider_rejected";
    case IDEMQ_ERR_PROVIDER_UNKNOWN: return "provider_unknown";
    case IDEMQ_ERR_PROVIDER_WAITS: return "provider_waits_exhausted";
    case IDEMQ_ERR_PROVIDER_RATE_LIMITED: return "provider_rate_limited";
    case IDEMQ_ERR_KEY_WINDOW_EXPIRED: return "key_window_expired";
    case IDEMQ_ERR_PROVIDER_NO_RECORD: return "provider_no_record";
    case IDEMQ_ERR_PROVIDER_BAD_RESPONSE: return "provider_bad_response";
    case IDEMQ_ERR_PROVIDER_NOT_SENT: return "provider_not_sent";
    case IDEMQ_ERR_KEY_CONFLICT: return "key_conflict";
    case IDEMQ_ERR_OUTSIDE_WINDOW: return "outside_dedup_window";
    case IDEMQ_ERR_FORGED_REDRIVE: return "forged_redrive";
    case IDEMQ_ERR_KEY_REUSE: return "key_reuse";
    case IDEMQ_ERR_CELERY_PICKLE: return "celery_pickle";
    case IDEMQ_ERR_CELERY_SERIALIZER: return "celery_serializer";
    case IDEMQ_ERR_CELERY_COMPRESSED: return "celery_compressed";
    case IDEMQ_ERR_CELERY_MALFORMED: return "celery_malformed";
    case IDEMQ_ERR_CELERY_UNKNOWN_TASK: return "celery_unknown_task";
    case IDEMQ_ERR_CELERY_EXPIRED: return "celery_expired";
    case IDEMQ_ERR_UNPUBLISHABLE: return "unpublishable";
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
    case IDEMQ_ERR_HEADERS_TOO_DEEP: return "message headers nest deeper than the limit";
    case IDEMQ_ERR_HEADERS_TOO_LARGE: return "message headers exceed the field or byte limit";
    case IDEMQ_ERR_DUPLICATE_FIELD: return "message body has a duplicate field name";
    case IDEMQ_ERR_KEY_NULL: return "idempotency key is null";
    case IDEMQ_ERR_UNDECODABLE: return "the AMQP client library could not decode the delivery";
    case IDEMQ_ERR_DELIVERY_LIMIT:
        return "the last delivery the queue's delivery limit allows (past it the broker "
               "dead-letters or drops the message)";
    case IDEMQ_ERR_UNPROCESSABLE: return "the job failed in every processing mode";
    case IDEMQ_ERR_ORIGIN_REFUSED: return "dead letter names an origin queue that is not a configured input";
    case IDEMQ_ERR_KEY_INVALID_HEADER:
        return "idempotency key is not a valid HTTP header value (control, non-ASCII or edge blank)";
    case IDEMQ_ERR_PROVIDER_BUSY: return "the input's provider calls in flight are at the cap";
    case IDEMQ_ERR_PROVIDER_REJECTED: return "the provider rejected the request (4xx)";
    case IDEMQ_ERR_PROVIDER_UNKNOWN: return "the provider call's outcome is unknown";
    case IDEMQ_ERR_PROVIDER_WAITS: return "the provider kept answering 409/429 past the wait ceiling";
    case IDEMQ_ERR_PROVIDER_RATE_LIMITED: return "the provider asked to wait longer than allowed";
    case IDEMQ_ERR_KEY_WINDOW_EXPIRED:
        return "the key's first request is older than the provider's key window";
    case IDEMQ_ERR_PROVIDER_NO_RECORD: return "the provider has no record of the request";
    case IDEMQ_ERR_PROVIDER_BAD_RESPONSE: return "the provider answered 2xx without a reference";
    case IDEMQ_ERR_PROVIDER_NOT_SENT: return "the request never reached the provider";
    case IDEMQ_ERR_KEY_CONFLICT: return "the key belongs to a job of a non-provider input";
    case IDEMQ_ERR_OUTSIDE_WINDOW:
        return "message older than the dedup window whose key is no longer claimed";
    case IDEMQ_ERR_FORGED_REDRIVE:
        return "a redrive header (x-idemq-generation) without idemq's seal";
    case IDEMQ_ERR_KEY_REUSE: return "the key is applied with another body";
    case IDEMQ_ERR_CELERY_PICKLE: return "a pickle Celery body (never decoded)";
    case IDEMQ_ERR_CELERY_SERIALIZER: return "a Celery body in a serializer other than JSON";
    case IDEMQ_ERR_CELERY_COMPRESSED: return "a compressed Celery body";
    case IDEMQ_ERR_CELERY_MALFORMED: return "not a Celery task message of protocol 1 or 2";
    case IDEMQ_ERR_CELERY_UNKNOWN_TASK: return "no route for the Celery task name";
    case IDEMQ_ERR_CELERY_EXPIRED: return "the Celery task expired before it ran (revoked)";
    case IDEMQ_ERR_UNPUBLISHABLE:
        return "the message cannot be encoded for AMQP (a name over 255 bytes, or headers "
               "over the frame size)";
    }
    return "unknown error";
}
