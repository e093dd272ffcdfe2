/*
 * conf: idemq's configuration: one settings table drives loading (libconfig),
 * defaults, validation with line numbers, unknown-key rejection, environment
 * overrides and the redacted effective-config print of `check-config`.
 *
 * API: conf_load / conf_load_string -> use struct conf -> conf_free;
 *      conf_print for `check-config`; conf_redact for secrets in logs;
 *      conf_key_describe for the generated reference (config/conf_doc.c).
 */
#ifndef IDEMQ_CONF_H
#define IDEMQ_CONF_H

#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>

#include "classify.h"
#include "idemq_err.h"

#define CONF_KEY_MAX_BYTES 256

struct conf_strlist {
    char **v;
    int n;
};

/* Where the business idempotency key of a message comes from. */
enum conf_key_kind {
    CONF_KEY_JSON = 0,   /* json:<field>: a top-level field of the body */
    CONF_KEY_HEADER,     /* header:<name>: an AMQP header */
    CONF_KEY_MESSAGE_ID, /* message_id: the producer-set AMQP property */
    CONF_KEY_NONE,       /* "": not configured (order_key_source, sequence_source) */
    /* Celery inputs (adapters/celery.h) */
    CONF_KEY_CELERY_KWARG,   /* kwarg:<name>: a keyword argument of the task */
    CONF_KEY_CELERY_ARG,     /* arg:<n>: the n-th positional argument (0-based) */
    CONF_KEY_CELERY_TASK_ID, /* task_id: Celery's task id (weaker: a re-send is a new id) */
};

/* One task route of a Celery input: task name -> effect function. */
struct conf_celery_route {
    char *task;      /* Celery task name, e.g. "payments.charge" */
    char *signature; /* "schema.fn(text,jsonb,jsonb)" */
    int effect;      /* index in the effects list (conf_effect_count): after the inputs' */
};

/* What an ordered lane does after one of its jobs parked. */
enum conf_on_park {
    CONF_ON_PARK_CONTINUE = 0, /* later jobs of the lane keep flowing */
    CONF_ON_PARK_HOLD_KEY,     /* later jobs of the same order key wait in the ledger */
};

/*
 * Provider effect settings of one input: the job's effect is an
 * HTTP call to a payments provider with `Idempotency-Key: <business key>`,
 * see adapters/effect_http.h and consumer/provider_flow.h. An input is a
 * provider input when url is not empty.
 */
struct conf_provider {
    char *url;             /* base URL, http:// or https:// ("" = not a provider input) */
    char *name;            /* recorded on intents; "" = the input's name */
    char *method;          /* POST, PUT or PATCH */
    char *path;            /* appended to url for the call */
    char *body_template;   /* "" = the payload as is; else {{key}} {{payload}} {{payload.F}} */
    char *content_type;
    int connect_timeout_ms;
    int timeout_ms;        /* the whole call */
    char *ca_file;         /* "" = the system CA store */
    bool verify_tls;
    bool allow_plaintext;  /* http:// to a host that is not loopback is refused without it */
    char *auth_header;     /* header name of the credential */
    char *auth_env;        /* environment variable holding the header value */
    char *auth_file;       /* file holding the header value */
    char *reference_field; /* JSON field (dotted path) of the answer: the provider reference */
    int key_window_s;      /* how long the provider keeps an idempotency key */
    bool idempotent;       /* false: the provider ignores Idempotency-Key */
    char *lookup_key_path;       /* GET path with {key}: a charge by idempotency key */
    char *lookup_reference_path; /* GET path with {key}: a charge by client reference */
    int max_in_flight;     /* calls in flight per worker at most */
    int wait_max;          /* 409/429 waits per generation before parking */
    int retry_after_max_ms; /* a longer Retry-After parks the job */
    int reconcile_after_s; /* intents left pending/unknown this long are reconciled */
};

/* True for an input whose effect is a provider call. */
#define CONF_INPUT_PROVIDER(in) ((in)->provider.url && (in)->provider.url[0] != '\0')

/* One configured input: a queue and how its messages become effects. */
struct conf_input {
    char *name;
    char *exchange;
    char *exchange_type;
    char *queue;
    char *routing_key;
    char *queue_type; /* "classic" or "quorum" */
    char *key_source;
    int max_body_bytes;
    char *effect_function;
    /* ordered lanes: partitions = 0 is a standard queue */
    int partitions;
    bool emits; /* outbox: its effects call idemq.emit: relay after commit */
    char *hash_header;
    char *order_key_source;
    char *sequence_source;
    char *on_park;
    char *on_key_reuse; /* "ack" or "park" */
    char *mode;         /* "apply" or "observe" */
    int deferred_report_after_s;
    /* provider effects */
    struct conf_provider provider;
    /* operations: quorum inputs declare x-delivery-limit */
    int delivery_limit;
    /* the transport: "rabbitmq", or "postgres" (a PostgreSQL queue input,
     * adapters/pgq.h); a postgres input is kept in conf.pg_inputs */
    char *transport;
    /* Amazon SQS inputs (transport = "sqs"; adapters/PORT.md): the queue's
     * URL, its region, an endpoint override (emulators), the dead-letter
     * queue's URL ("" = none). Credentials come only from the AWS
     * environment variables or the shared credentials file, never from
     * here. */
    char *queue_url;
    char *region;
    char *endpoint;
    char *dead_letter_queue_url;
    int visibility_timeout_s; /* the lease of a received message */
    bool sqs_fifo; /* derived: the queue's name ends in .fifo */
    /* derived by validation */
    enum conf_key_kind key_kind;
    char *key_name;        /* field or header name; NULL for message_id */
    char *effect_signature; /* "schema.fn(text,jsonb,jsonb)"; NULL for a provider
                             * input without effect_function */
    enum conf_key_kind order_kind; /* CONF_KEY_NONE if no order_key_source */
    char *order_name;              /* field or header name, or NULL */
    char *seq_name;                /* json field of sequence_source, or NULL */
    enum conf_on_park on_park_mode;
    bool key_reuse_parks; /* on_key_reuse = "park" */
    bool observe;         /* mode = "observe": claim and record, no effect, ack */
    /* Celery producers */
    char *protocol;                   /* "native" or "celery" */
    struct conf_strlist celery_tasks; /* "task.name=schema.fn" entries */
    struct conf_strlist sensitive;    /* payload fields masked when shown (mask.h) */
    bool celery;                      /* derived: protocol = "celery" */
    int key_arg;                      /* CONF_KEY_CELERY_ARG: the argument's index */
    struct conf_celery_route *routes; /* derived from celery_tasks */
    int n_routes;
    int line; /* line of the input's group in the file */
    int index; /* position in inputs */
    char *celery_duplicate_reply;     /* "result" or "status" */
    bool celery_status_only;          /* derived: celery_duplicate_reply = "status" */
};

/* True for an input in observe mode. */
#define CONF_INPUT_OBSERVE(in) ((in)->observe)

/* True for a partitioned (ordered) input. */
#define CONF_INPUT_ORDERED(in) ((in)->partitions > 0)

struct conf {
    char *path; /* file it came from, or "<string>" */
    void *src;  /* the parsed file (libconfig's config_t): line numbers for conf_lint */
    int n_routes; /* Celery task routes of all inputs: effects
                   * n_inputs .. n_inputs + n_routes - 1 */
    /* broker */
    struct conf_strlist urls;
    char *vhost; /* "" = take it from the URL */
    int heartbeat;
    int prefetch;
    int connect_timeout_ms;
    int reconnect_max_ms; /* ceiling of the reconnect backoff */
    /* database */
    char *dsn;
    int statement_timeout_ms;
    bool keep_error_detail; /* log PostgreSQL notices' DETAIL */
    int client_timeout_ms; /* as configured; 0 = derived */
    int call_timeout_ms;   /* derived: client-side deadline of each database call
                            * (statement_timeout_ms + 5000 by default; 0 = none) */
    /* consumer */
    int workers;
    int batch_max;
    int batch_wait_ms;
    int max_rate; /* jobs/s over all workers; 0 = no limit */
    int max_buffered_mib; /* bound of prefetch x consumers x max_body_bytes per worker */
    long long buffered_worst; /* derived: that product, in bytes */
    char *consumer_id;
    /* retry */
    int max_attempts;
    int base_delay_ms;
    int max_delay_ms;
    char *jitter;
    struct conf_strlist retry_sqlstates;
    struct conf_strlist park_sqlstates;
    int rescue_after_s;         /* republish a lost retry copy after this; 0 = off */
    int jitter_mode;            /* enum backoff_jitter, derived */
    struct classify_rules rules; /* derived from the two lists */
    /* metrics */
    char *metrics_listen;
    /* the web console */
    char *console_listen;            /* "" = off */
    char *console_token_file;        /* "" = read-only */
    int console_statement_timeout_ms;
    struct conf_strlist console_hosts; /* extra Host values answered */
    /* stored payload copies (consumer/protect.h) */
    struct conf_strlist protection_keys; /* "id=/path" entries */
    char *protection_active;             /* "" = new copies not sealed */
    bool console_reads_need_token;     /* loopback reads need a token too */
    char *console_operator_broker_url; /* redrives of the console, "" = urls */
    /* log */
    char *log_level;
    /* operations */
    char *tls_ca_file;     /* amqps:// trust anchors (PEM) */
    char *tls_cert_file;   /* client certificate (PEM), "" = none */
    char *tls_key_file;    /* its private key (PEM), "" = none */
    char *tls_verify;      /* "full" or "none" */
    char *topology_verify; /* "full" or "passive" */
    int live_stall_s;      /* GET /live and the systemd watchdog */
    char *log_format;      /* "text" or "json" */
    bool tls_verify_off;   /* derived: tls_verify == "none" */
    bool topology_passive; /* derived: topology_verify == "passive" */
    int perf_interval_s; /* > 0: per-worker latency lines this often */
    /* ledger lifecycle */
    double dedup_window_days;
    char *partition_interval;   /* "N seconds|minutes|hours|days" */
    double history_hot_days;
    double history_retention_days;
    int maintenance;            /* 1: take part in maintenance */
    double partition_interval_s; /* derived */
    /* transactional outbox */
    int outbox_relay;           /* 1: this process relays idemq.outbox rows */
    int outbox_poll_ms;         /* recovery poll interval */
    int outbox_lease_s;         /* a claimed row's lease */
    int outbox_max_attempts;    /* nacks before a row is parked */
    int outbox_stuck_s;         /* /ready fails while a row waits longer */
    /* tracing: OTLP/HTTP JSON export of spans (consumer/trace_export.h) */
    char *tracing_endpoint;     /* "" = off */
    char *tracing_service_name;
    int tracing_queue_max;      /* spans waiting for export; beyond, dropped */
    int tracing_batch_max;      /* spans per request */
    int tracing_flush_ms;       /* a partial batch waits at most this long */
    int tracing_timeout_ms;     /* one export request, whole */
    /* inputs: the broker's (transport = "rabbitmq"); a configuration may
     * hold none when every input is a PostgreSQL queue input */
    struct conf_input *inputs;
    int n_inputs;
    /* PostgreSQL queue inputs (transport = "postgres"), apart from the
     * broker's so that nothing written for a broker input meets one; their
     * workers see them as the inputs of a conf of their own
     * (conf_pg_view) */
    struct conf_input *pg_inputs;
    int n_pg_inputs;
    /* Amazon SQS inputs (transport = "sqs"), apart from both */
    struct conf_input *sqs_inputs;
    int n_sqs_inputs;
};

/* A shallow copy of c whose inputs are c's PostgreSQL queue inputs (and no
 * Celery routes): what the PostgreSQL input's workers and ledger session
 * see. Shares every pointer with c, which must outlive it; nothing to free.
 * Pure. */
struct conf conf_pg_view(const struct conf *c);

/* The same for c's Amazon SQS inputs (consumer/sqs_worker.h). Pure. */
struct conf conf_sqs_view(const struct conf *c);

/*
 * Loads and validates a configuration file, then applies the environment
 * overrides IDEMQ_AMQP_URL (comma-separated list allowed) and IDEMQ_PG_DSN.
 * Returns IDEMQ_OK and a new conf in *out (free with conf_free), or
 * IDEMQ_ERR_CONFIG with a message naming the file, the setting and its line
 * in errbuf; *out is NULL then. Any thread; touches no global state.
 */
idemq_err_t conf_load(const char *path, struct conf **out, char *errbuf,
                      size_t errlen) IDEMQ_MUSTCHECK;

/* As conf_load, from text in memory (tests, defaults). */
idemq_err_t conf_load_string(const char *text, struct conf **out, char *errbuf,
                             size_t errlen) IDEMQ_MUSTCHECK;

/* Frees a conf and everything it owns. NULL is fine. */
void conf_free(struct conf *c);

/* Writes the effective configuration in libconfig syntax, with every
 * sensitive value redacted. */
void conf_print(const struct conf *c, FILE *out);

/*
 * `check-config`: the checks of what fails only at run time that need no
 * server: files that do not exist or are readable by others, keys and
 * bindings that can never match, settings that defeat each other, URLs and
 * DSNs that cannot connect. Writes "idemq: FILE:LINE: ..." for an error and
 * "# warning: FILE:LINE: ..." for a warning to out, each naming the line of
 * the setting (or "(default)"), never a secret. Returns the number of
 * errors. Any thread.
 */
int conf_lint(const struct conf *c, FILE *out);

/* RabbitMQ's default consumer_timeout (rabbitmq.conf; 3.12+ also per queue). */
#define CONF_BROKER_CONSUMER_TIMEOUT_MS 1800000LL

/*
 * `check-config`: writes one "# warning: ..." line to out for each input
 * whose deliveries could be held unacknowledged longer than the broker's
 * consumer timeout: the last of broker.prefetch deliveries waits for the
 * batches before it (each up to the database call deadline), or for the
 * provider calls before it (max_in_flight at a time, each up to
 * provider.timeout_ms). Past the timeout the broker cancels the consumer
 * (or closes the channel) and redelivers. Returns how many lines.
 */
int conf_warn_consumer_timeout(const struct conf *c, FILE *out);

/*
 * With outbox.relay = 1: one line for `check-config` and the start of `run`
 * on the broker permission the relay needs (write on each exchange the
 * rows name, which the rows decide at run time) and what a refusal does.
 * True with buf set; false (buf "") without the relay. Pure.
 */
bool conf_outbox_note(const struct conf *c, char *buf, size_t len);

/*
 * Copies s into buf with any password removed: the userinfo password of an
 * amqp(s):// or postgres(ql):// URL and `password=` in a libpq key/value DSN.
 * Returns buf. Truncates to buflen.
 */
char *conf_redact(const char *s, char *buf, size_t buflen);

/*
 * True when provider input in sends its credential and payload without the
 * protection of verified TLS: an http:// URL (loopback, or allowed by
 * provider.allow_plaintext) or provider.verify_tls = false. buf then holds
 * one line naming the input and the setting (never the URL's userinfo) for
 * a warning at start and in `check-config`. False (buf "") otherwise and
 * for other inputs. Pure.
 */
bool conf_input_insecure(const struct conf_input *in, char *buf, size_t len);

/*
 * metrics.listen: true if s is "A.B.C.D:PORT" (a numeric IPv4 address and a
 * decimal port 1..65535, nothing else), with the address in ip and the port
 * in *port. The one check of check-config (conf_load) and of `run`'s probe
 * server: ":PORT", "PORT" and host names are refused, never guessed. Pure.
 */
bool conf_listen_parse(const char *s, char ip[16], int *port);

/* Seconds in "N seconds|minutes|hours|days" (singular or plural unit, one
 * space), or -1 if the text is not of that form. Pure. */
double conf_parse_interval(const char *text);

/* The settings table, for tests and docs: number of rows and each path
 * ("broker.heartbeat", "inputs.[].queue"). */
int conf_key_count(void);
const char *conf_key_path(int i);

/* The type of a setting, as the docs name it. */
enum conf_key_type {
    CONF_TYPE_INT,     /* an integer; min..max is its range */
    CONF_TYPE_STR,     /* a string; min..max is its length in bytes */
    CONF_TYPE_STRLIST, /* a string or a list of strings; min..max entries */
    CONF_TYPE_BOOL,    /* true or false */
    CONF_TYPE_DAYS,    /* a number of days, may be fractional; min..max in minutes */
};

/* One row of the settings table as it is documented (config/conf_doc.c). */
struct conf_key_info {
    const char *path;    /* as in the table: "broker.heartbeat", or "queue" of an input */
    bool input;          /* a key of each inputs[] group */
    enum conf_key_type type;
    long min, max;       /* see enum conf_key_type */
    const char *def_str; /* default of strings and string lists */
    long def_int;        /* default of integers and booleans; of days, in minutes */
    bool sensitive;      /* never printed or logged as is */
    bool required;       /* no default */
    const char *desc;
};

/* Fills *out with row i (0 .. conf_key_count() - 1, in table order: the
 * global rows, then the input rows); false if i is out of range. The
 * strings are the table's (static). Pure. */
bool conf_key_describe(int i, struct conf_key_info *out);

/*
 * The sensitive payload paths that apply to a copy taken from queue: its
 * input's, or, when no input consumes queue (renamed since), every input's.
 * Returns a malloc'd array of *n pointers into c (the caller frees the
 * array only; NULL with *n = 0 when there are none or memory ran out,
 * *n = -1 then). Any thread.
 */
const char **conf_sensitive_paths(const struct conf *c, const char *queue, int *n);

#endif
