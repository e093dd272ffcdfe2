/*
 * idemq_err: the one error enum of idemq and its names and texts.
 * 0 is success; codes are appended, never renumbered (they are stored in
 * the ledger by name, see idemq_err_name()).
 */
#ifndef IDEMQ_ERR_H
#define IDEMQ_ERR_H

#define IDEMQ_MUSTCHECK __attribute__((warn_unused_result))

typedef enum {
    IDEMQ_OK = 0,
    IDEMQ_ERR_NOMEM,          /* allocation failed */
    IDEMQ_ERR_CONFIG,         /* invalid configuration */
    IDEMQ_ERR_USAGE,          /* bad command line */
    IDEMQ_ERR_TIMEOUT,        /* nothing happened within the wait */
    IDEMQ_ERR_BODY_TOO_LARGE, /* message body over max_body_bytes */
    IDEMQ_ERR_BAD_JSON,       /* body is not valid JSON (or not UTF-8) */
    IDEMQ_ERR_NOT_OBJECT,     /* body is JSON but not an object */
    IDEMQ_ERR_KEY_MISSING,    /* key source absent */
    IDEMQ_ERR_KEY_EMPTY,      /* key present but empty */
    IDEMQ_ERR_KEY_TOO_LONG,   /* key over 256 bytes */
    IDEMQ_ERR_KEY_INVALID,    /* key of the wrong type, not UTF-8, or NUL */
    IDEMQ_ERR_BROKER,         /* AMQP connection or channel failure */
    IDEMQ_ERR_DB_CONN,        /* PostgreSQL connection failure */
    IDEMQ_ERR_SQL,            /* a statement failed; see its SQLSTATE */
    IDEMQ_ERR_EFFECT,         /* the effect function raised an error */
    IDEMQ_ERR_SHUTDOWN,       /* stopping on request */
    IDEMQ_ERR_INTERNAL,       /* an invariant failed */
    IDEMQ_ERR_RETRIES_EXHAUSTED, /* transient failures used the whole attempt budget */
    IDEMQ_ERR_SEQUENCE_INVALID,  /* sequence_source absent or not a positive integer */
    IDEMQ_ERR_HEADERS_TOO_DEEP,      /* header tables nested deeper than the limit */
    IDEMQ_ERR_HEADERS_TOO_LARGE,     /* headers over the field or byte limit */
    IDEMQ_ERR_DUPLICATE_FIELD,       /* JSON body names a field twice */
    IDEMQ_ERR_KEY_NULL,              /* key field present but null */
    IDEMQ_ERR_UNDECODABLE,           /* delivery the client library cannot decode */
    IDEMQ_ERR_DELIVERY_LIMIT,        /* last delivery a quorum queue's delivery limit allows */
    IDEMQ_ERR_UNPROCESSABLE,         /* job failed as a whole in every mode */
    IDEMQ_ERR_ORIGIN_REFUSED,        /* redrive origin not a configured input */
    /* provider effects */
    IDEMQ_ERR_KEY_INVALID_HEADER, /* key is not a valid Idempotency-Key header value */
    IDEMQ_ERR_PROVIDER_BUSY,      /* the input's provider calls in flight are at the cap */
    IDEMQ_ERR_PROVIDER_REJECTED,  /* provider answered 4xx (not 409/429): not applied */
    IDEMQ_ERR_PROVIDER_UNKNOWN,   /* outcome unknown (timeout, reset, 5xx) and no way to settle it */
    IDEMQ_ERR_PROVIDER_WAITS,     /* 409/429 waits used their own ceiling */
    IDEMQ_ERR_PROVIDER_RATE_LIMITED, /* 429 asked to wait longer than retry_after_max_ms */
    IDEMQ_ERR_KEY_WINDOW_EXPIRED, /* first request older than the provider's key window */
    IDEMQ_ERR_PROVIDER_NO_RECORD, /* the provider has no record of the request after the deadline */
    IDEMQ_ERR_PROVIDER_BAD_RESPONSE, /* 2xx without the configured reference field */
    IDEMQ_ERR_PROVIDER_NOT_SENT,  /* the request never reached the provider (connect, TLS) */
    IDEMQ_ERR_KEY_CONFLICT,       /* the key belongs to a job of a non-provider input */
    IDEMQ_ERR_OUTSIDE_WINDOW,    /* message older than the dedup window, key not claimed */
    IDEMQ_ERR_FORGED_REDRIVE,    /* x-idemq-generation without a valid x-idemq-seal */
    IDEMQ_ERR_KEY_REUSE,         /* an applied key with another body (on_key_reuse = park) */
    /* Celery inputs */
    IDEMQ_ERR_CELERY_PICKLE,       /* a pickle body: never decoded */
    IDEMQ_ERR_CELERY_SERIALIZER,   /* YAML, msgpack or another serializer than JSON */
    IDEMQ_ERR_CELERY_COMPRESSED,   /* a compressed body (kombu's compression header) */
    IDEMQ_ERR_CELERY_MALFORMED,    /* not a Celery task message of protocol 1 or 2 */
    IDEMQ_ERR_CELERY_UNKNOWN_TASK, /* no celery_tasks route for the task name */
    IDEMQ_ERR_CELERY_EXPIRED,      /* expires passed before it ran: revoked, not run */
    IDEMQ_ERR_UNPUBLISHABLE, /* a publish the AMQP client cannot encode (nothing sent) */
} idemq_err_t;

/* Stable snake_case name ("bad_json"), stored in the ledger. Never NULL. */
const char *idemq_err_name(idemq_err_t err);

/* One-sentence human text. Never NULL. */
const char *idemq_err_str(idemq_err_t err);

#endif
