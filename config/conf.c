/*
 * conf: loads idemq's libconfig file through one settings table. Each row
 * names a path, a type, bounds, a default, flags and a description; loading,
 * defaults, unknown-key checks and check-config output all read that table.
 */
#include "conf.h"

#include <arpa/inet.h>
#include <ctype.h>
#include <errno.h>
#include <libconfig.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

#include "backoff.h"
#include "classify.h"
#include "log.h"

/* CT_DAYS: a number of days, integer or fractional (libconfig has no
 * duration type), stored as a double; its row's min, max and default are in
 * minutes. */
enum conf_type { CT_INT, CT_STR, CT_STRLIST, CT_BOOL, CT_DAYS };

#define CF_SENSITIVE 0x1 /* never printed or logged as is */
#define CF_REQUIRED 0x2  /* no default: must be set */

struct conf_key {
    const char *path; /* relative to the root, or to one input */
    enum conf_type type;
    size_t offset;
    long min, max; /* ints: value range; strings: length range */
    const char *def_str;
    long def_int;
    unsigned flags;
    const char *desc;
};

#define G(f) offsetof(struct conf, f)
#define I(f) offsetof(struct conf_input, f)

static const struct conf_key global_keys[] = {
    {"broker.url", CT_STRLIST, G(urls), 1, 8, "amqp://guest:guest@127.0.0.1:5672/", 0,
     CF_SENSITIVE, "AMQP URL, or a list tried in order on (re)connect; IDEMQ_AMQP_URL overrides"},
    {"broker.vhost", CT_STR, G(vhost), 0, 255, "", 0, 0,
     "virtual host; empty takes it from the URL"},
    {"broker.heartbeat", CT_INT, G(heartbeat), 0, 600, NULL, 30, 0,
     "AMQP heartbeat in seconds (0 disables); database work stays well inside it"},
    {"broker.prefetch", CT_INT, G(prefetch), 1, 65535, NULL, 1000, 0,
     "unacknowledged deliveries per consumer (basic.qos, not global): a worker has one "
     "consumer per standard input and per partition"},
    {"broker.connect_timeout_ms", CT_INT, G(connect_timeout_ms), 100, 600000, NULL, 5000, 0,
     "TCP connect timeout per URL"},
    {"broker.reconnect_max_ms", CT_INT, G(reconnect_max_ms), 250, 600000, NULL, 5000, 0,
     "ceiling of the backoff between reconnects (and after giving deliveries back); "
     "a worker resumes within this of the broker or database coming back"},
    {"database.dsn", CT_STR, G(dsn), 1, 4096, "dbname=idemq", 0, CF_SENSITIVE,
     "libpq connection string; IDEMQ_PG_DSN overrides"},
    {"database.statement_timeout_ms", CT_INT, G(statement_timeout_ms), 0, 3600000, NULL, 10000, 0,
     "statement_timeout of each worker session (0 = none)"},
    {"database.client_timeout_ms", CT_INT, G(client_timeout_ms), 0, 3600000, NULL, 0, 0,
     "client-side deadline of each database call: past it the worker abandons the connection "
     "(a frozen or vanished server); 0 = statement_timeout_ms + 5000 (none if that is 0)"},
    {"consumer.workers", CT_INT, G(workers), 1, 64, NULL, 1, 0,
     "worker threads, each with its own AMQP and PostgreSQL connection"},
    {"consumer.batch_max", CT_INT, G(batch_max), 1, 10000, NULL, 100, 0,
     "deliveries claimed and committed in one transaction at most"},
    {"consumer.batch_wait_ms", CT_INT, G(batch_wait_ms), 0, 10000, NULL, 5, 0,
     "how long a worker waits to fill a batch after its first delivery"},
    {"consumer.max_rate", CT_INT, G(max_rate), 0, 10000000, NULL, 0, 0,
     "jobs per second over all workers at most (a shared token bucket); 0 = no limit"},
    {"consumer.max_buffered_mib", CT_INT, G(max_buffered_mib), 1, 1048576, NULL, 4096, 0,
     "refuse a config whose worst-case deliveries held by one worker (broker.prefetch x "
     "consumers x max_body_bytes) exceed this"},
    {"consumer.id", CT_STR, G(consumer_id), 0, 200, "", 0, 0,
     "consumer id recorded on attempts; empty = hostname:pid"},
    {"retry.max_attempts", CT_INT, G(max_attempts), 1, 1000, NULL, 5, 0,
     "attempts of a job that keeps failing transiently before it is parked"},
    {"retry.base_delay_ms", CT_INT, G(base_delay_ms), 100, 86400000, NULL, 1000, 0,
     "backoff before the first retry; doubles per attempt"},
    {"retry.max_delay_ms", CT_INT, G(max_delay_ms), 100, 86400000, NULL, 60000, 0,
     "hard ceiling of the backoff"},
    {"retry.jitter", CT_STR, G(jitter), 1, 8, "equal", 0, 0,
     "none, full (uniform in [0, d]) or equal (d/2 + uniform in [0, d/2])"},
    {"retry.retry_sqlstates", CT_STRLIST, G(retry_sqlstates), 0, 64, "IR001", 0, 0,
     "SQLSTATEs (or 2-character classes) an effect raises to ask for a retry"},
    {"retry.park_sqlstates", CT_STRLIST, G(park_sqlstates), 0, 64, "IP001", 0, 0,
     "SQLSTATEs (or classes) an effect raises to ask for parking at once"},
    /* proof (issue 12): lost retry copies */
    {"retry.rescue_after_s", CT_INT, G(rescue_after_s), 0, 7 * 86400, NULL, 600, 0,
     "publish a retry again from the ledger when no copy came back this long after its "
     "retry time (one replica at a time); 0 = off"},
    {"metrics.listen", CT_STR, G(metrics_listen), 0, 64, "", 0, 0,
     "numeric IPv4:port (e.g. 127.0.0.1:9187; 0.0.0.0:PORT = every address) for GET "
     "/metrics, /ready and /live of `idemq run`; empty = off"},
    /* the web console (issue 20, consumer/console.h) */
    {"console.listen", CT_STR, G(console_listen), 0, 64, "", 0, 0,
     "numeric IPv4:port (e.g. 127.0.0.1:9188) of the web console of `idemq run`; empty = "
     "off. Loopback clients read without a secret; other addresses need the token"},
    {"console.token_file", CT_STR, G(console_token_file), 0, 4096, "", 0, 0,
     "file holding the secret that every console action (and reading from a non-loopback "
     "address) needs; empty = a read-only console, loopback only"},
    {"console.statement_timeout_ms", CT_INT, G(console_statement_timeout_ms), 100, 600000, NULL,
     5000, 0, "statement_timeout of the console's own database sessions"},
    {"log.level", CT_STR, G(log_level), 1, 10, "info", 0, 0, "error, warn, info or debug"},
    /* operations (issue 11): TLS, least privilege, logs, liveness */
    {"broker.tls.ca_file", CT_STR, G(tls_ca_file), 0, 4096, "/etc/ssl/certs/ca-certificates.crt",
     0, 0, "amqps://: PEM file of the CAs the broker's certificate must chain to"},
    {"broker.tls.cert_file", CT_STR, G(tls_cert_file), 0, 4096, "", 0, 0,
     "amqps://: client certificate (PEM); empty = none"},
    {"broker.tls.key_file", CT_STR, G(tls_key_file), 0, 4096, "", 0, 0,
     "amqps://: private key of cert_file (PEM, unencrypted); empty = none"},
    {"broker.tls.verify", CT_STR, G(tls_verify), 1, 8, "full", 0, 0,
     "full (peer and hostname) or none (logged as a warning on every connect)"},
    {"topology.verify", CT_STR, G(topology_verify), 1, 8, "full", 0, 0,
     "run: full (redeclare, rebind; needs configure permission) or passive (existence only)"},
    {"metrics.live_stall_s", CT_INT, G(live_stall_s), 1, 86400, NULL, 60, 0,
     "GET /live and the systemd watchdog fail once a worker made no progress this long"},
    {"log.format", CT_STR, G(log_format), 1, 8, "text", 0, 0,
     "text, or json (one object per line)"},
    {"log.perf_interval_s", CT_INT, G(perf_interval_s), 0, 86400, NULL, 0, 0,
     "> 0: each worker logs a `perf interval:` latency line this often (scripts/soak)"},
    /* ledger lifecycle (issue 10); `idemq migrate` writes these to the ledger */
    {"ledger.dedup_window_days", CT_DAYS, G(dedup_window_days), 1, 36500L * 1440, NULL,
     400L * 1440, 0,
     "how long an applied key stays claimed (a replay within it is a duplicate)"},
    {"ledger.partition_interval", CT_STR, G(partition_interval), 5, 32, "1 day", 0, 0,
     "time span of one history partition: N seconds|minutes|hours|days"},
    {"ledger.history_hot_days", CT_DAYS, G(history_hot_days), 1, 36500L * 1440, NULL,
     90L * 1440, 0, "history newer than this stays in the hot partitions; older is archived"},
    {"ledger.history_retention_days", CT_DAYS, G(history_retention_days), 1, 36500L * 1440,
     NULL, 400L * 1440, 0, "archived history older than this is dropped"},
    {"ledger.maintenance", CT_INT, G(maintenance), 0, 1, NULL, 1, 0,
     "1: this process takes part in maintenance (one replica at a time runs it)"},
    /* transactional outbox (issue 18) */
    {"outbox.relay", CT_INT, G(outbox_relay), 0, 1, NULL, 0, 0,
     "1: relay idemq.outbox rows (right after commit for inputs with emits, and a recovery "
     "poll on worker 0); 0 = off"},
    {"outbox.poll_ms", CT_INT, G(outbox_poll_ms), 100, 600000, NULL, 1000, 0,
     "recovery poll interval: rows of applications and of crashed relays"},
    {"outbox.lease_s", CT_INT, G(outbox_lease_s), 15, 3600, NULL, 30, 0,
     "lease of a claimed row; past it, or once its relay's database session is gone, another relay may publish it again"},
    {"outbox.max_attempts", CT_INT, G(outbox_max_attempts), 1, 1000, NULL, 5, 0,
     "nacked publishes of a row before it is parked (a returned, unroutable row parks at once)"},
    {"outbox.stuck_s", CT_INT, G(outbox_stuck_s), 1, 86400 * 30, NULL, 60, 0,
     "GET /ready fails while the oldest unsent row is older than this (outbox.relay = 1)"},
};

static const struct conf_key input_keys[] = {
    {"name", CT_STR, I(name), 1, 64, NULL, 0, CF_REQUIRED, "input name, used in logs"},
    {"exchange", CT_STR, I(exchange), 0, 255, "", 0, 0,
     "exchange that `idemq declare` creates and binds the queue to; empty = none"},
    {"exchange_type", CT_STR, I(exchange_type), 1, 32, "direct", 0, 0,
     "type of that exchange: direct, topic or fanout"},
    {"queue", CT_STR, I(queue), 1, 255, NULL, 0, CF_REQUIRED, "queue to consume"},
    {"routing_key", CT_STR, I(routing_key), 0, 255, "", 0, 0, "binding key of the queue"},
    {"queue_type", CT_STR, I(queue_type), 1, 16, "classic", 0, 0, "classic or quorum"},
    {"key_source", CT_STR, I(key_source), 1, 300, "json:job_id", 0, 0,
     "idempotency key: json:<field>, header:<name> or message_id; Celery inputs: "
     "kwarg:<name>, arg:<n> or task_id (weaker)"},
    {"max_body_bytes", CT_INT, I(max_body_bytes), 2, 64 * 1024 * 1024, NULL, 256 * 1024, 0,
     "larger bodies are parked as body_too_large"},
    {"effect_function", CT_STR, I(effect_function), 0, 127, "", 0, 0,
     "SQL function fn(key text, payload jsonb, meta jsonb) RETURNS jsonb; required unless "
     "provider.url is set"},
    {"emits", CT_BOOL, I(emits), 0, 1, NULL, 0, 0,
     "the effect calls idemq.emit: the worker relays the outbox right after each commit "
     "(needs outbox.relay = 1)"},
    /* ordered lanes */
    {"partitions", CT_INT, I(partitions), 0, 1024, NULL, 0, 0,
     "0 = standard queue; N >= 1 = consistent-hash exchange over queues <queue>.p0..pN-1"},
    {"hash_header", CT_STR, I(hash_header), 0, 255, "", 0, 0,
     "partitioned inputs: header the exchange hashes; empty = the routing key"},
    {"order_key_source", CT_STR, I(order_key_source), 0, 300, "", 0, 0,
     "ordering key: json:<field>, header:<name> or message_id; empty = none"},
    {"sequence_source", CT_STR, I(sequence_source), 0, 300, "", 0, 0,
     "per-order-key sequence number: json:<field> (a positive integer); empty = none"},
    {"on_park", CT_STR, I(on_park), 1, 16, "continue", 0, 0,
     "after a job of an ordered lane parks: continue, or hold_key (hold its order key)"},
    {"on_key_reuse", CT_STR, I(on_key_reuse), 1, 16, "ack", 0, 0,
     "a delivery of an applied key with another body: ack (recorded as key_reuse), or park"},
    {"mode", CT_STR, I(mode), 1, 16, "apply", 0, 0,
     "apply (run the effect), or observe: claim keys and record duplicates, late replays and "
     "would-be parks of a copy of live traffic, run no effect, park nothing, ack everything "
     "(see consumer/README.md)"},
    /* Celery producers (issue 19) */
    {"protocol", CT_STR, I(protocol), 1, 16, "native", 0, 0,
     "native (a JSON object body), or celery (Celery task messages, protocol 1 and 2, JSON "
     "serializer; results to reply_to like the rpc:// backend)"},
    {"celery_tasks", CT_STRLIST, I(celery_tasks), 0, 64, "", 0, 0,
     "protocol = celery: \"task.name=schema.fn\" routes; a task named nowhere is parked as "
     "celery_unknown_task"},
    {"deferred_report_after_s", CT_INT, I(deferred_report_after_s), 1, 86400 * 30, NULL, 300, 0,
     "deferred jobs (waiting for a predecessor) older than this are reported"},
    /* provider effects (issue 9): keep these rows together */
    {"provider.url", CT_STR, I(provider.url), 0, 1024, "", 0, CF_SENSITIVE,
     "provider base URL (http:// or https://); non-empty makes the effect a provider call"},
    {"provider.name", CT_STR, I(provider.name), 0, 64, "", 0, 0,
     "provider name recorded on intents; empty = the input's name"},
    {"provider.method", CT_STR, I(provider.method), 1, 8, "POST", 0, 0, "POST, PUT or PATCH"},
    {"provider.path", CT_STR, I(provider.path), 0, 1024, "", 0, 0,
     "path appended to the URL for the call (empty or starting with /)"},
    {"provider.body_template", CT_STR, I(provider.body_template), 0, 16384, "", 0, 0,
     "request body; empty = the payload as is; {{key}}, {{payload}}, {{payload.FIELD}} as JSON"},
    {"provider.content_type", CT_STR, I(provider.content_type), 1, 128, "application/json", 0, 0,
     "Content-Type of the request body"},
    {"provider.connect_timeout_ms", CT_INT, I(provider.connect_timeout_ms), 100, 600000, NULL,
     3000, 0, "TCP and TLS connect timeout"},
    {"provider.timeout_ms", CT_INT, I(provider.timeout_ms), 100, 600000, NULL, 10000, 0,
     "the whole call; past it the outcome is unknown"},
    {"provider.ca_file", CT_STR, I(provider.ca_file), 0, 1024, "", 0, 0,
     "PEM file of CAs to verify the provider with; empty = the system store"},
    {"provider.verify_tls", CT_BOOL, I(provider.verify_tls), 0, 1, NULL, 1, 0,
     "verify the provider's certificate and host name (https); false is logged as a warning "
     "at start and by check-config"},
    {"provider.allow_plaintext", CT_BOOL, I(provider.allow_plaintext), 0, 1, NULL, 0, 0,
     "allow an http:// url to a host that is not loopback (the credential and the payload "
     "travel in clear; logged as a warning at start and by check-config)"},
    {"provider.auth_header", CT_STR, I(provider.auth_header), 1, 64, "Authorization", 0, 0,
     "header that carries the credential"},
    {"provider.auth_env", CT_STR, I(provider.auth_env), 0, 128, "", 0, 0,
     "environment variable holding the credential header's value (never logged)"},
    {"provider.auth_file", CT_STR, I(provider.auth_file), 0, 1024, "", 0, 0,
     "file holding the credential header's value (never logged)"},
    {"provider.reference_field", CT_STR, I(provider.reference_field), 1, 128, "id", 0, 0,
     "JSON field (dotted path) of a 2xx answer holding the provider reference"},
    {"provider.key_window_s", CT_INT, I(provider.key_window_s), 60, 366 * 86400, NULL, 86400, 0,
     "how long the provider keeps an idempotency key; older keys are never resent"},
    {"provider.idempotent", CT_BOOL, I(provider.idempotent), 0, 1, NULL, 1, 0,
     "the provider deduplicates on Idempotency-Key; false = never resend after an unknown "
     "outcome"},
    {"provider.lookup_key_path", CT_STR, I(provider.lookup_key_path), 0, 1024, "", 0, 0,
     "GET path with {key} that finds a charge by idempotency key; empty = none"},
    {"provider.lookup_reference_path", CT_STR, I(provider.lookup_reference_path), 0, 1024, "", 0,
     0, "GET path with {key} that finds a charge by the client reference sent; empty = none"},
    {"provider.max_in_flight", CT_INT, I(provider.max_in_flight), 1, 1000, NULL, 8, 0,
     "provider calls in flight per worker at most"},
    {"provider.wait_max", CT_INT, I(provider.wait_max), 1, 1000, NULL, 20, 0,
     "409/429 answers per generation before the job parks (apart from retry.max_attempts)"},
    {"provider.retry_after_max_ms", CT_INT, I(provider.retry_after_max_ms), 100, 86400000, NULL,
     60000, 0, "a 429 asking to wait longer parks the job; at most retry.max_delay_ms"},
    {"provider.reconcile_after_s", CT_INT, I(provider.reconcile_after_s), 1, 30 * 86400, NULL,
     300, 0, "intents left pending/unknown this long are looked up by the reconciler"},
    /* operations (issue 11) */
    {"delivery_limit", CT_INT, I(delivery_limit), 1, 1000000, NULL, 100, 0,
     "quorum inputs: x-delivery-limit of the queue, at least 2 x retry.max_attempts"},
    /* PostgreSQL queue inputs */
    {"transport", CT_STR, I(transport), 1, 16, "rabbitmq", 0, 0,
     "rabbitmq (a broker queue), or postgres: jobs are rows producers enqueue with "
     "idemq.enqueue(queue, ...) into the ledger's database, no broker (see adapters/PORT.md)"},
};

#define N_GLOBAL ((int)(sizeof global_keys / sizeof global_keys[0]))
#define N_INPUT ((int)(sizeof input_keys / sizeof input_keys[0]))

int conf_key_count(void) { return N_GLOBAL + N_INPUT; }

const char *conf_key_path(int i)
{
    static char paths[N_INPUT][64];
    if (i < 0 || i >= N_GLOBAL + N_INPUT)
        return NULL;
    if (i < N_GLOBAL)
        return global_keys[i].path;
    i -= N_GLOBAL;
    if (!paths[i][0])
        snprintf(paths[i], sizeof paths[i], "inputs.[].%s", input_keys[i].path);
    return paths[i];
}

static enum conf_key_type doc_type(enum conf_type t)
{
    switch (t) { /* no default: -Werror names a type without its doc type */
    case CT_INT: return CONF_TYPE_INT;
    case CT_STR: return CONF_TYPE_STR;
    case CT_STRLIST: return CONF_TYPE_STRLIST;
    case CT_BOOL: return CONF_TYPE_BOOL;
    case CT_DAYS: return CONF_TYPE_DAYS;
    }
    return CONF_TYPE_STR;
}

bool conf_key_describe(int i, struct conf_key_info *out)
{
    const struct conf_key *k;
    if (i < 0 || i >= N_GLOBAL + N_INPUT)
        return false;
    k = i < N_GLOBAL ? &global_keys[i] : &input_keys[i - N_GLOBAL];
    out->path = k->path;
    out->input = i >= N_GLOBAL;
    out->type = doc_type(k->type);
    out->min = k->min;
    out->max = k->max;
    out->def_str = k->def_str;
    out->def_int = k->def_int;
    out->sensitive = (k->flags & CF_SENSITIVE) != 0;
    out->required = (k->flags & CF_REQUIRED) != 0;
    out->desc = k->desc;
    return true;
}

static void errf(char *errbuf, size_t errlen, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void errf(char *errbuf, size_t errlen, const char *fmt, ...)
{
    va_list ap;
    if (!errbuf || !errlen)
        return;
    va_start(ap, fmt);
    vsnprintf(errbuf, errlen, fmt, ap);
    va_end(ap);
}

static const char *type_name(int t)
{
    switch (t) {
    case CONFIG_TYPE_GROUP: return "a group";
    case CONFIG_TYPE_INT: case CONFIG_TYPE_INT64: return "an integer";
    case CONFIG_TYPE_FLOAT: return "a float";
    case CONFIG_TYPE_STRING: return "a string";
    case CONFIG_TYPE_BOOL: return "a boolean";
    case CONFIG_TYPE_ARRAY: return "an array";
    case CONFIG_TYPE_LIST: return "a list";
    default: return "a value";
    }
}

/* Full dotted path of a setting ("inputs.[0].queue") for messages. */
static void setting_path(const config_setting_t *s, char *buf, size_t len)
{
    char part[128];
    if (!s || config_setting_is_root(s)) {
        buf[0] = '\0';
        return;
    }
    setting_path(config_setting_parent(s), buf, len);
    if (config_setting_name(s))
        snprintf(part, sizeof part, "%s%s", buf[0] ? "." : "", config_setting_name(s));
    else
        snprintf(part, sizeof part, "[%d]", config_setting_index(s));
    strncat(buf, part, len - strlen(buf) - 1);
}

static char **strlist_slot(void *base, size_t off) { return (char **)((char *)base + off); }

static idemq_err_t set_string(char **slot, const char *v)
{
    char *dup = strdup(v);
    if (!dup)
        return IDEMQ_ERR_NOMEM;
    free(*slot);
    *slot = dup;
    return IDEMQ_OK;
}

static void strlist_clear(struct conf_strlist *l)
{
    for (int i = 0; i < l->n; i++)
        free(l->v[i]);
    free(l->v);
    l->v = NULL;
    l->n = 0;
}

static idemq_err_t strlist_push(struct conf_strlist *l, const char *v)
{
    char **nv = realloc(l->v, sizeof(char *) * (size_t)(l->n + 1));
    if (!nv)
        return IDEMQ_ERR_NOMEM;
    l->v = nv;
    if (!(l->v[l->n] = strdup(v)))
        return IDEMQ_ERR_NOMEM;
    l->n++;
    return IDEMQ_OK;
}

/* Applies a table's defaults to base. */
static idemq_err_t apply_defaults(const struct conf_key *keys, int n, void *base)
{
    for (int i = 0; i < n; i++) {
        const struct conf_key *k = &keys[i];
        void *slot = (char *)base + k->offset;
        if (k->flags & CF_REQUIRED)
            continue;
        switch (k->type) {
        case CT_INT: *(int *)slot = (int)k->def_int; break;
        case CT_BOOL: *(bool *)slot = k->def_int != 0; break;
        case CT_DAYS: *(double *)slot = (double)k->def_int / 1440.0; break;
        case CT_STR:
            if (set_string(strlist_slot(base, k->offset), k->def_str) != IDEMQ_OK)
                return IDEMQ_ERR_NOMEM;
            break;
        case CT_STRLIST:
            if (strlist_push((struct conf_strlist *)slot, k->def_str) != IDEMQ_OK)
                return IDEMQ_ERR_NOMEM;
            break;
        }
    }
    return IDEMQ_OK;
}

static const struct conf_key *find_key(const struct conf_key *keys, int n, const char *path)
{
    for (int i = 0; i < n; i++)
        if (strcmp(keys[i].path, path) == 0)
            return &keys[i];
    return NULL;
}

/* Reads one setting s into base per table row k. */
static idemq_err_t read_value(const struct conf_key *k, const config_setting_t *s, void *base,
                              const char *file, char *errbuf, size_t errlen)
{
    char path[256];
    int line = config_setting_source_line(s);
    int t = config_setting_type(s);
    void *slot = (char *)base + k->offset;

    setting_path(s, path, sizeof path);
    switch (k->type) {
    case CT_INT: {
        long long v;
        if (t != CONFIG_TYPE_INT && t != CONFIG_TYPE_INT64) {
            errf(errbuf, errlen, "%s:%d: %s must be an integer, not %s", file, line, path,
                 type_name(t));
            return IDEMQ_ERR_CONFIG;
        }
        v = config_setting_get_int64(s);
        if (v < k->min || v > k->max) {
            errf(errbuf, errlen, "%s:%d: %s = %lld is out of range [%ld, %ld]", file, line, path,
                 v, k->min, k->max);
            return IDEMQ_ERR_CONFIG;
        }
        *(int *)slot = (int)v;
        return IDEMQ_OK;
    }
    case CT_BOOL:
        if (t != CONFIG_TYPE_BOOL) {
            errf(errbuf, errlen, "%s:%d: %s must be true or false, not %s", file, line, path,
                 type_name(t));
            return IDEMQ_ERR_CONFIG;
        }
        *(bool *)slot = config_setting_get_bool(s) != 0;
        return IDEMQ_OK;
    case CT_DAYS: {
        double v;
        if (t == CONFIG_TYPE_INT || t == CONFIG_TYPE_INT64)
            v = (double)config_setting_get_int64(s);
        else if (t == CONFIG_TYPE_FLOAT)
            v = config_setting_get_float(s);
        else {
            errf(errbuf, errlen, "%s:%d: %s must be a number of days, not %s", file, line, path,
                 type_name(t));
            return IDEMQ_ERR_CONFIG;
        }
        if (!(v * 1440.0 >= (double)k->min - 1e-3 && v * 1440.0 <= (double)k->max)) {
            errf(errbuf, errlen, "%s:%d: %s = %g is out of range [%g, %g] (days)", file, line,
                 path, v, (double)k->min / 1440.0, (double)k->max / 1440.0);
            return IDEMQ_ERR_CONFIG;
        }
        *(double *)slot = v;
        return IDEMQ_OK;
    }
    case CT_STR: {
        const char *v;
        size_t len;
        if (t != CONFIG_TYPE_STRING) {
            errf(errbuf, errlen, "%s:%d: %s must be a string, not %s", file, line, path,
                 type_name(t));
            return IDEMQ_ERR_CONFIG;
        }
        v = config_setting_get_string(s);
        len = strlen(v);
        if ((long)len < k->min || (long)len > k->max) {
            errf(errbuf, errlen, "%s:%d: %s must be %ld to %ld characters long", file, line,
                 path, k->min, k->max);
            return IDEMQ_ERR_CONFIG;
        }
        return set_string(strlist_slot(base, k->offset), v);
    }
    case CT_STRLIST: {
        struct conf_strlist *l = slot;
        strlist_clear(l);
        if (t == CONFIG_TYPE_STRING)
            return strlist_push(l, config_setting_get_string(s));
        if (t != CONFIG_TYPE_ARRAY && t != CONFIG_TYPE_LIST) {
            errf(errbuf, errlen, "%s:%d: %s must be a string or a list of strings", file, line,
                 path);
            return IDEMQ_ERR_CONFIG;
        }
        int n = config_setting_length(s);
        if (n < k->min || n > k->max) {
            errf(errbuf, errlen, "%s:%d: %s must have %ld to %ld entries", file, line, path,
                 k->min, k->max);
            return IDEMQ_ERR_CONFIG;
        }
        for (int i = 0; i < n; i++) {
            const config_setting_t *e = config_setting_get_elem(s, (unsigned)i);
            if (config_setting_type(e) != CONFIG_TYPE_STRING) {
                errf(errbuf, errlen, "%s:%d: %s[%d] must be a string", file, line, path, i);
                return IDEMQ_ERR_CONFIG;
            }
            if (strlist_push(l, config_setting_get_string(e)) != IDEMQ_OK)
                return IDEMQ_ERR_NOMEM;
        }
        return IDEMQ_OK;
    }
    }
    return IDEMQ_ERR_INTERNAL;
}

/*
 * Walks the scalar leaves under group g (prefix = path so far) and reads each
 * into base, refusing any path the table does not have.
 */
static idemq_err_t read_group(const config_setting_t *g, const char *prefix,
                              const struct conf_key *keys, int nkeys, void *base,
                              const char *file, char *errbuf, size_t errlen)
{
    int n = config_setting_length(g);
    for (int i = 0; i < n; i++) {
        const config_setting_t *s = config_setting_get_elem(g, (unsigned)i);
        char rel[256], full[256];
        const struct conf_key *k;
        idemq_err_t err;

        snprintf(rel, sizeof rel, "%s%s%s", prefix, prefix[0] ? "." : "",
                 config_setting_name(s));
        k = find_key(keys, nkeys, rel);
        if (!k && config_setting_type(s) == CONFIG_TYPE_GROUP) {
            err = read_group(s, rel, keys, nkeys, base, file, errbuf, errlen);
            if (err)
                return err;
            continue;
        }
        if (!k) {
            setting_path(s, full, sizeof full);
            errf(errbuf, errlen, "%s:%d: unknown setting %s", file,
                 config_setting_source_line(s), full);
            return IDEMQ_ERR_CONFIG;
        }
        if ((err = read_value(k, s, base, file, errbuf, errlen)) != IDEMQ_OK)
            return err;
    }
    return IDEMQ_OK;
}

static bool is_lower_ident(const char *s, size_t len)
{
    if (len == 0 || len > 63 || !((s[0] >= 'a' && s[0] <= 'z') || s[0] == '_'))
        return false;
    for (size_t i = 1; i < len; i++)
        if (!((s[i] >= 'a' && s[i] <= 'z') || (s[i] >= '0' && s[i] <= '9') || s[i] == '_'))
            return false;
    return true;
}

/* Checks one input's values against each other and derives its fields. */
/* Parses a json:<field> | header:<name> | message_id source into kind and
 * *name (new string, NULL for message_id). false if the text is none. */
static bool parse_source(const char *ks, enum conf_key_kind *kind, char **name)
{
    *name = NULL;
    if (strncmp(ks, "json:", 5) == 0 && ks[5])
        *kind = CONF_KEY_JSON, *name = strdup(ks + 5);
    else if (strncmp(ks, "header:", 7) == 0 && ks[7])
        *kind = CONF_KEY_HEADER, *name = strdup(ks + 7);
    else if (strcmp(ks, "message_id") == 0)
        *kind = CONF_KEY_MESSAGE_ID;
    else
        return false;
    return true;
}

/* The ordered-lane settings of one input and their combinations. */
static idemq_err_t validate_lanes(const struct conf *c, struct conf_input *in, int line,
                                  const char *file, char *errbuf, size_t errlen)
{
    long long wait_ms = (long long)c->max_attempts * c->max_delay_ms;

    in->order_kind = CONF_KEY_NONE;
    if (strcmp(in->on_park, "continue") == 0) {
        in->on_park_mode = CONF_ON_PARK_CONTINUE;
    } else if (strcmp(in->on_park, "hold_key") == 0) {
        in->on_park_mode = CONF_ON_PARK_HOLD_KEY;
    } else {
        errf(errbuf, errlen, "%s:%d: input %s: on_park must be \"continue\" or \"hold_key\", "
             "not \"%s\"", file, line, in->name, in->on_park);
        return IDEMQ_ERR_CONFIG;
    }
    if (strcmp(in->on_key_reuse, "ack") == 0 || strcmp(in->on_key_reuse, "park") == 0) {
        in->key_reuse_parks = strcmp(in->on_key_reuse, "park") == 0;
    } else {
        errf(errbuf, errlen, "%s:%d: input %s: on_key_reuse must be \"ack\" or \"park\", "
             "not \"%s\"", file, line, in->name, in->on_key_reuse);
        return IDEMQ_ERR_CONFIG;
    }
    if (in->order_key_source[0]) {
        if (!parse_source(in->order_key_source, &in->order_kind, &in->order_name)) {
            errf(errbuf, errlen, "%s:%d: input %s: order_key_source must be json:<field>, "
                 "header:<name>, message_id or empty, not \"%s\"", file, line, in->name,
                 in->order_key_source);
            return IDEMQ_ERR_CONFIG;
        }
        if (in->order_kind != CONF_KEY_MESSAGE_ID && !in->order_name)
            return IDEMQ_ERR_NOMEM;
    }
    if (in->sequence_source[0]) {
        if (strncmp(in->sequence_source, "json:", 5) || !in->sequence_source[5]) {
            errf(errbuf, errlen, "%s:%d: input %s: sequence_source must be json:<field> or "
                 "empty, not \"%s\"", file, line, in->name, in->sequence_source);
            return IDEMQ_ERR_CONFIG;
        }
        if (in->order_kind == CONF_KEY_NONE) {
            errf(errbuf, errlen, "%s:%d: input %s: sequence_source needs order_key_source "
                 "(a sequence counts per ordering key)", file, line, in->name);
            return IDEMQ_ERR_CONFIG;
        }
        if (!(in->seq_name = strdup(in->sequence_source + 5)))
            return IDEMQ_ERR_NOMEM;
    }
    if (!CONF_INPUT_ORDERED(in)) {
        if (in->hash_header[0] || in->order_kind != CONF_KEY_NONE ||
            in->on_park_mode != CONF_ON_PARK_CONTINUE) {
            errf(errbuf, errlen, "%s:%d: input %s: hash_header, order_key_source, "
                 "sequence_source and on_park need partitions >= 1", file, line, in->name);
            return IDEMQ_ERR_CONFIG;
        }
        return IDEMQ_OK;
    }
    if (!in->exchange[0]) {
        errf(errbuf, errlen, "%s:%d: input %s: partitions needs a non-empty exchange (the "
             "x-consistent-hash exchange producers publish to)", file, line, in->name);
        return IDEMQ_ERR_CONFIG;
    }
    if (in->on_park_mode == CONF_ON_PARK_HOLD_KEY && in->order_kind == CONF_KEY_NONE) {
        errf(errbuf, errlen, "%s:%d: input %s: on_park = \"hold_key\" needs order_key_source",
             file, line, in->name);
        return IDEMQ_ERR_CONFIG;
    }
    /* An ordered lane retries in place, holding its delivery unacknowledged;
     * RabbitMQ closes the channel after consumer_timeout (30 min by default).
     * Keep the whole in-place wait under half of it. */
    if (wait_ms > 15LL * 60 * 1000) {
        errf(errbuf, errlen, "%s:%d: input %s: partitioned inputs retry in place: "
             "retry.max_attempts * retry.max_delay_ms = %lld ms must stay under 900000 ms "
             "(half of RabbitMQ's default consumer_timeout of 30 min)", file, line, in->name,
             wait_ms);
        return IDEMQ_ERR_CONFIG;
    }
    return IDEMQ_OK;
}

/* A Celery input (issue 19): its key source and task routes. Effect
 * indexes are given later (assign_effects), once every input is read. */
static idemq_err_t validate_celery(struct conf_input *in, int line, const char *file,
                                   char *errbuf, size_t errlen)
{
    const char *ks = in->key_source;
    int n = 0;

    if (strncmp(ks, "kwarg:", 6) == 0 && ks[6]) {
        in->key_kind = CONF_KEY_CELERY_KWARG;
        if (!(in->key_name = strdup(ks + 6)))
            return IDEMQ_ERR_NOMEM;
    } else if (strncmp(ks, "arg:", 4) == 0 && ks[4] >= '0' && ks[4] <= '9' &&
               strspn(ks + 4, "0123456789") == strlen(ks + 4) && strlen(ks + 4) <= 3) {
        in->key_kind = CONF_KEY_CELERY_ARG;
        in->key_arg = atoi(ks + 4);
    } else if (strcmp(ks, "task_id") == 0) {
        in->key_kind = CONF_KEY_CELERY_TASK_ID;
    } else {
        errf(errbuf, errlen, "%s:%d: input %s: a Celery input's key_source must be "
             "kwarg:<name>, arg:<n> (0 to 999) or task_id, not \"%s\"", file, line, in->name, ks);
        return IDEMQ_ERR_CONFIG;
    }
    if (in->effect_function[0] || CONF_INPUT_PROVIDER(in) || CONF_INPUT_ORDERED(in) ||
        in->emits) {
        errf(errbuf, errlen, "%s:%d: input %s: a Celery input names its effects in "
             "celery_tasks (no effect_function, provider, partitions or emits)",
             file, line, in->name);
        return IDEMQ_ERR_CONFIG;
    }
    if (!(in->routes = calloc((size_t)in->celery_tasks.n + 1, sizeof *in->routes)))
        return IDEMQ_ERR_NOMEM;
    for (int i = 0; i < in->celery_tasks.n; i++) {
        const char *e = in->celery_tasks.v[i], *eq = strchr(e, '='), *fn, *dot;
        struct conf_celery_route *r = &in->routes[n];
        char sig[256];
        if (!e[0])
            continue; /* the default (no routes) */
        fn = eq ? eq + 1 : "";
        dot = strchr(fn, '.');
        if (!eq || eq == e || (size_t)(eq - e) > 255 ||
            !(dot ? is_lower_ident(fn, (size_t)(dot - fn)) &&
                        is_lower_ident(dot + 1, strlen(dot + 1))
                  : is_lower_ident(fn, strlen(fn)))) {
            errf(errbuf, errlen, "%s:%d: input %s: celery_tasks[%d] must be "
                 "\"task.name=schema.fn\" (a task name of 1 to 255 bytes, a lowercase SQL "
                 "identifier, optionally schema-qualified), not \"%s\"",
                 file, line, in->name, i, e);
            return IDEMQ_ERR_CONFIG;
        }
        for (int k = 0; k < n; k++)
            if (strlen(in->routes[k].task) == (size_t)(eq - e) &&
                strncmp(in->routes[k].task, e, (size_t)(eq - e)) == 0) {
                errf(errbuf, errlen, "%s:%d: input %s: celery_tasks names task \"%.*s\" twice",
                     file, line, in->name, (int)(eq - e), e);
                return IDEMQ_ERR_CONFIG;
            }
        snprintf(sig, sizeof sig, "%s(text,jsonb,jsonb)", fn);
        if (!(r->task = strndup(e, (size_t)(eq - e))) || !(r->signature = strdup(sig)))
            return IDEMQ_ERR_NOMEM;
        r->effect = -1;
        in->n_routes = ++n;
    }
    if (!n) {
        errf(errbuf, errlen, "%s:%d: input %s: protocol = \"celery\" needs celery_tasks "
             "(\"task.name=schema.fn\", at least one)", file, line, in->name);
        return IDEMQ_ERR_CONFIG;
    }
    return IDEMQ_OK;
}

static idemq_err_t validate_input(struct conf_input *in, int line, const char *file,
                                  char *errbuf, size_t errlen)
{
    const char *ks = in->key_source;
    const char *fn = in->effect_function;
    const char *dot = strchr(fn, '.');
    char sig[256];

    if (strcmp(in->queue_type, "classic") && strcmp(in->queue_type, "quorum")) {
        errf(errbuf, errlen, "%s:%d: input %s: queue_type must be \"classic\" or \"quorum\", not \"%s\"",
             file, line, in->name, in->queue_type);
        return IDEMQ_ERR_CONFIG;
    }
    if (strcmp(in->exchange_type, "direct") && strcmp(in->exchange_type, "topic") &&
        strcmp(in->exchange_type, "fanout")) {
        errf(errbuf, errlen, "%s:%d: input %s: exchange_type must be direct, topic or fanout",
             file, line, in->name);
        return IDEMQ_ERR_CONFIG;
    }
    if (strcmp(in->protocol, "native") && strcmp(in->protocol, "celery")) {
        errf(errbuf, errlen, "%s:%d: input %s: protocol must be \"native\" or \"celery\", "
             "not \"%s\"", file, line, in->name, in->protocol);
        return IDEMQ_ERR_CONFIG;
    }
    in->celery = strcmp(in->protocol, "celery") == 0;
    if (in->celery)
        return validate_celery(in, line, file, errbuf, errlen);
    for (int i = 0; i < in->celery_tasks.n; i++)
        if (in->celery_tasks.v[i][0]) {
            errf(errbuf, errlen, "%s:%d: input %s: celery_tasks needs protocol = \"celery\"",
                 file, line, in->name);
            return IDEMQ_ERR_CONFIG;
        }
    if (strncmp(ks, "json:", 5) == 0 && ks[5]) {
        in->key_kind = CONF_KEY_JSON;
        in->key_name = strdup(ks + 5);
    } else if (strncmp(ks, "header:", 7) == 0 && ks[7]) {
        in->key_kind = CONF_KEY_HEADER;
        in->key_name = strdup(ks + 7);
    } else if (strcmp(ks, "message_id") == 0) {
        in->key_kind = CONF_KEY_MESSAGE_ID;
    } else if (strcmp(ks, "key") == 0 && strcmp(in->transport, "postgres") == 0) {
        in->key_kind = CONF_KEY_MESSAGE_ID; /* the enqueue's key, carried as the message id */
    } else {
        errf(errbuf, errlen,
             "%s:%d: input %s: key_source must be json:<field>, header:<name> or message_id, not \"%s\"",
             file, line, in->name, ks);
        return IDEMQ_ERR_CONFIG;
    }
    if (in->key_kind != CONF_KEY_MESSAGE_ID && !in->key_name)
        return IDEMQ_ERR_NOMEM;
    if (!fn[0]) {
        if (CONF_INPUT_PROVIDER(in))
            return IDEMQ_OK; /* a provider call alone is the effect */
        errf(errbuf, errlen, "%s:%d: input %s: effect_function is required (SQL function "
             "fn(key text, payload jsonb, meta jsonb) RETURNS jsonb) unless provider.url is set",
             file, line, in->name);
        return IDEMQ_ERR_CONFIG;
    }
    if (dot ? !(is_lower_ident(fn, (size_t)(dot - fn)) && is_lower_ident(dot + 1, strlen(dot + 1)))
            : !is_lower_ident(fn, strlen(fn))) {
        errf(errbuf, errlen,
             "%s:%d: input %s: effect_function \"%s\" must be a lowercase SQL identifier, "
             "optionally schema-qualified (e.g. public.apply_payout)",
             file, line, in->name, fn);
        return IDEMQ_ERR_CONFIG;
    }
    snprintf(sig, sizeof sig, "%s(text,jsonb,jsonb)", fn);
    if (!(in->effect_signature = strdup(sig)))
        return IDEMQ_ERR_NOMEM;
    return IDEMQ_OK;
}

/* The input's mode (issue 20): apply, or observe (a copy of live traffic,
 * no effect). Observing ordered lanes is not supported: their holds and
 * deferrals are effects on the ledger's order, not observations. */
static idemq_err_t validate_mode(struct conf_input *in, int line, const char *file,
                                 char *errbuf, size_t errlen)
{
    if (strcmp(in->mode, "apply") == 0) {
        in->observe = false;
    } else if (strcmp(in->mode, "observe") == 0) {
        in->observe = true;
    } else {
        errf(errbuf, errlen, "%s:%d: input %s: mode must be \"apply\" or \"observe\", not \"%s\"",
             file, line, in->name, in->mode);
        return IDEMQ_ERR_CONFIG;
    }
    if (in->observe && CONF_INPUT_ORDERED(in)) {
        errf(errbuf, errlen, "%s:%d: input %s: mode = \"observe\" needs partitions = 0 (ordered "
             "lanes cannot be observed)", file, line, in->name);
        return IDEMQ_ERR_CONFIG;
    }
    return IDEMQ_OK;
}

/* A PostgreSQL queue input (transport = "postgres"): what it cannot be. */
static idemq_err_t validate_transport(const struct conf_input *in, int line, const char *file,
                                      char *errbuf, size_t errlen)
{
    if (strcmp(in->transport, "rabbitmq") == 0) {
        if (strcmp(in->key_source, "key") == 0) {
            errf(errbuf, errlen, "%s:%d: input %s: key_source = \"key\" (the enqueue's key) "
                 "needs transport = \"postgres\"", file, line, in->name);
            return IDEMQ_ERR_CONFIG;
        }
        return IDEMQ_OK;
    }
    if (strcmp(in->transport, "postgres")) {
        errf(errbuf, errlen, "%s:%d: input %s: transport must be \"rabbitmq\" or \"postgres\", "
             "not \"%s\"", file, line, in->name, in->transport);
        return IDEMQ_ERR_CONFIG;
    }
    if (in->key_kind == CONF_KEY_HEADER || in->exchange[0] || in->routing_key[0] ||
        CONF_INPUT_ORDERED(in) || CONF_INPUT_PROVIDER(in) || in->celery || in->observe ||
        in->emits || strcmp(in->queue_type, "classic")) {
        errf(errbuf, errlen, "%s:%d: input %s: a postgres input takes key_source json:<field> or "
             "key (the enqueue's key), and no exchange, routing_key, queue_type, partitions "
             "(rows with an order key run in order by themselves), provider, protocol = "
             "\"celery\", mode = \"observe\" or emits (not yet)", file, line, in->name);
        return IDEMQ_ERR_CONFIG;
    }
    return IDEMQ_OK;
}

/* Moves the postgres inputs out of c->inputs into c->pg_inputs (keeping
 * their order) and numbers the Celery routes' effects again after the
 * broker inputs that stay. */
static idemq_err_t split_transports(struct conf *c)
{
    int n = c->n_inputs, nb = 0, np = 0;
    for (int i = 0; i < n; i++)
        np += strcmp(c->inputs[i].transport, "postgres") == 0;
    if (!np)
        return IDEMQ_OK;
    if (!(c->pg_inputs = calloc((size_t)np, sizeof *c->pg_inputs)))
        return IDEMQ_ERR_NOMEM;
    np = 0;
    for (int i = 0; i < n; i++) {
        if (strcmp(c->inputs[i].transport, "postgres") == 0)
            c->pg_inputs[np++] = c->inputs[i];
        else
            c->inputs[nb++] = c->inputs[i];
    }
    c->n_inputs = nb;
    c->n_pg_inputs = np;
    c->n_routes = 0;
    for (int i = 0; i < nb; i++)
        for (int r = 0; r < c->inputs[i].n_routes; r++)
            c->inputs[i].routes[r].effect = nb + c->n_routes++;
    return IDEMQ_OK;
}

struct conf conf_pg_view(const struct conf *c)
{
    struct conf v = *c;
    v.inputs = c->pg_inputs;
    v.n_inputs = c->n_pg_inputs;
    v.pg_inputs = NULL;
    v.n_pg_inputs = 0;
    v.n_routes = 0;
    return v;
}

/* ---- provider effects (issue 9) ---- */

/* True if a {{...}} placeholder list of a body template is well formed:
 * {{key}}, {{payload}} or {{payload.FIELD}} (FIELD of [A-Za-z0-9_-]). */
static bool template_ok(const char *t, char *bad, size_t badlen)
{
    for (const char *p = strstr(t, "{{"); p; p = strstr(p + 2, "{{")) {
        const char *end = strstr(p + 2, "}}");
        size_t n = end ? (size_t)(end - p - 2) : strlen(p + 2);
        const char *name = p + 2;
        bool ok = end && ((n == 3 && strncmp(name, "key", 3) == 0) ||
                          (n == 7 && strncmp(name, "payload", 7) == 0));
        if (end && !ok && n > 8 && strncmp(name, "payload.", 8) == 0) {
            ok = true;
            for (size_t i = 8; i < n; i++)
                ok = ok && (isalnum((unsigned char)name[i]) || name[i] == '_' || name[i] == '-');
        }
        if (!ok) {
            snprintf(bad, badlen, "%.*s", (int)(n > 40 ? 40 : n) + (end ? 4 : 2), p);
            return false;
        }
    }
    return true;
}

/* A lookup path: empty, or "/..." holding {key} exactly once. */
static bool lookup_path_ok(const char *p)
{
    const char *k = strstr(p, "{key}");
    return !p[0] || (p[0] == '/' && k && !strstr(k + 5, "{key}"));
}

/* An HTTP token (header names, methods). */
static bool http_token(const char *s)
{
    if (!*s)
        return false;
    for (; *s; s++)
        if (!(isalnum((unsigned char)*s) || strchr("!#$%&'*+-.^_`|~", *s)))
            return false;
    return true;
}

/* The host of an http(s) URL into buf (no userinfo, no port; IPv6 with
 * its brackets). */
static void url_host(const char *url, char *buf, size_t len)
{
    const char *h = strstr(url, "://"), *end, *at;
    size_t auth;
    h = h ? h + 3 : url;
    auth = strcspn(h, "/?#");
    at = memchr(h, '@', auth);
    while (at) { /* the last '@' of the authority ends the userinfo */
        h = at + 1;
        auth = strcspn(h, "/?#");
        at = memchr(h, '@', auth);
    }
    end = *h == '[' ? memchr(h, ']', auth) : NULL;
    end = end ? end + 1 : h + strcspn(h, ":/?#");
    snprintf(buf, len, "%.*s", (int)(end - h), h);
}

/* localhost, 127.0.0.0/8 (dotted decimal) or [::1]. */
static bool host_loopback(const char *host)
{
    int dots = 0;
    if (strcasecmp(host, "localhost") == 0 || strcmp(host, "[::1]") == 0)
        return true;
    if (strncmp(host, "127.", 4) != 0)
        return false;
    for (const char *c = host; *c; c++) {
        if (*c == '.')
            dots++;
        else if (!isdigit((unsigned char)*c))
            return false;
    }
    return dots == 3;
}

bool conf_input_insecure(const struct conf_input *in, char *buf, size_t len)
{
    const struct conf_provider *p = &in->provider;
    char host[256];
    buf[0] = '\0';
    if (!CONF_INPUT_PROVIDER(in))
        return false;
    url_host(p->url, host, sizeof host);
    if (strncmp(p->url, "http://", 7) == 0)
        snprintf(buf, len, "input %s: provider.url is plaintext http:// to %s%s: the credential "
                 "(%s) and every payload travel unencrypted and unauthenticated",
                 in->name, host, host_loopback(host) ? " (loopback)"
                                                     : ", allowed by provider.allow_plaintext",
                 p->auth_header);
    else if (!p->verify_tls)
        snprintf(buf, len, "input %s: provider.verify_tls = false: the certificate of %s is not "
                 "checked, the credential (%s) goes to whoever answers", in->name, host,
                 p->auth_header);
    return buf[0] != '\0';
}

/* The provider settings of one input and their combinations. */
static idemq_err_t validate_provider(const struct conf *c, struct conf_input *in, int line,
                                     const char *file, char *errbuf, size_t errlen)
{
    const struct conf_provider *p = &in->provider;
    char bad[64], red[1100];

#define PROVIDER_ERR(...)                                                                    \
    do {                                                                                     \
        errf(errbuf, errlen, __VA_ARGS__);                                                   \
        return IDEMQ_ERR_CONFIG;                                                             \
    } while (0)
    if (!CONF_INPUT_PROVIDER(in))
        return IDEMQ_OK;
    if (strncmp(p->url, "http://", 7) && strncmp(p->url, "https://", 8))
        PROVIDER_ERR("%s:%d: input %s: provider.url \"%s\" must start with http:// or https://",
                     file, line, in->name, conf_redact(p->url, red, sizeof red));
    if (strpbrk(p->url, " \t\r\n") || strpbrk(p->path, " \t\r\n") ||
        strpbrk(p->lookup_key_path, " \t\r\n") || strpbrk(p->lookup_reference_path, " \t\r\n"))
        PROVIDER_ERR("%s:%d: input %s: provider URLs and paths must not contain blanks", file,
                     line, in->name);
    if (strcmp(p->method, "POST") && strcmp(p->method, "PUT") && strcmp(p->method, "PATCH"))
        PROVIDER_ERR("%s:%d: input %s: provider.method must be POST, PUT or PATCH, not \"%s\"",
                     file, line, in->name, p->method);
    if (p->path[0] && p->path[0] != '/')
        PROVIDER_ERR("%s:%d: input %s: provider.path must be empty or start with /", file, line,
                     in->name);
    if (!template_ok(p->body_template, bad, sizeof bad))
        PROVIDER_ERR("%s:%d: input %s: provider.body_template: placeholder %s is not {{key}}, "
                     "{{payload}} or {{payload.FIELD}}", file, line, in->name, bad);
    if (!http_token(p->auth_header))
        PROVIDER_ERR("%s:%d: input %s: provider.auth_header \"%s\" is not a header name", file,
                     line, in->name, p->auth_header);
    if (p->auth_env[0] && p->auth_file[0])
        PROVIDER_ERR("%s:%d: input %s: set provider.auth_env or provider.auth_file, not both",
                     file, line, in->name);
    if (!lookup_path_ok(p->lookup_key_path) || !lookup_path_ok(p->lookup_reference_path))
        PROVIDER_ERR("%s:%d: input %s: provider.lookup_key_path and lookup_reference_path must be "
                     "empty or a path starting with / that holds {key} once", file, line,
                     in->name);
    if (!p->idempotent && p->lookup_key_path[0])
        PROVIDER_ERR("%s:%d: input %s: provider.lookup_key_path needs provider.idempotent = true "
                     "(a provider that ignores keys cannot find a charge by key); use "
                     "lookup_reference_path", file, line, in->name);
    if (p->timeout_ms < p->connect_timeout_ms)
        PROVIDER_ERR("%s:%d: input %s: provider.timeout_ms (%d) must not be below "
                     "provider.connect_timeout_ms (%d)", file, line, in->name, p->timeout_ms,
                     p->connect_timeout_ms);
    if ((long long)p->key_window_s * 1000 <= 2LL * p->timeout_ms)
        PROVIDER_ERR("%s:%d: input %s: provider.key_window_s (%d s) must exceed twice "
                     "provider.timeout_ms", file, line, in->name, p->key_window_s);
    if (p->retry_after_max_ms > c->max_delay_ms)
        PROVIDER_ERR("%s:%d: input %s: provider.retry_after_max_ms (%d) must not exceed "
                     "retry.max_delay_ms (%d): a retry waits in a delay bucket of at most that",
                     file, line, in->name, p->retry_after_max_ms, c->max_delay_ms);
    if ((long long)p->reconcile_after_s * 1000 < p->timeout_ms)
        PROVIDER_ERR("%s:%d: input %s: provider.reconcile_after_s (%d s) must not be below "
                     "provider.timeout_ms (a call in flight is not reconciled)", file, line,
                     in->name, p->reconcile_after_s);
    if (CONF_INPUT_ORDERED(in))
        PROVIDER_ERR("%s:%d: input %s: provider inputs must be standard queues (partitions = 0)",
                     file, line, in->name);
    for (const char *f = p->reference_field; *f; f++)
        if (!(isalnum((unsigned char)*f) || *f == '_' || *f == '-' || *f == '.'))
            PROVIDER_ERR("%s:%d: input %s: provider.reference_field \"%s\" must be a field name "
                         "or a dotted path (data.id)", file, line, in->name, p->reference_field);
    if (strncmp(p->url, "http://", 7) == 0 && !p->allow_plaintext) {
        char host[256];
        url_host(p->url, host, sizeof host);
        if (!host_loopback(host))
            PROVIDER_ERR("%s:%d: input %s: provider.url is plaintext http:// to %s, not a "
                         "loopback address: the credential and every payload would travel in "
                         "clear; use https://, or set provider.allow_plaintext = true", file,
                         line, in->name, host);
    }
#undef PROVIDER_ERR
    return IDEMQ_OK;
}

static idemq_err_t read_inputs(const config_t *cfg, struct conf *c, const char *file,
                               char *errbuf, size_t errlen)
{
    const config_setting_t *list = config_lookup(cfg, "inputs");
    int n;

    if (!list) {
        errf(errbuf, errlen, "%s: inputs is required: a list of at least one input group", file);
        return IDEMQ_ERR_CONFIG;
    }
    if (config_setting_type(list) != CONFIG_TYPE_LIST) {
        errf(errbuf, errlen, "%s:%d: inputs must be a list ( {...}, ... ), not %s", file,
             config_setting_source_line(list), type_name(config_setting_type(list)));
        return IDEMQ_ERR_CONFIG;
    }
    n = config_setting_length(list);
    if (n < 1 || n > 64) {
        errf(errbuf, errlen, "%s:%d: inputs must hold 1 to 64 inputs", file,
             config_setting_source_line(list));
        return IDEMQ_ERR_CONFIG;
    }
    if (!(c->inputs = calloc((size_t)n, sizeof *c->inputs)))
        return IDEMQ_ERR_NOMEM;
    c->n_inputs = n;
    for (int i = 0; i < n; i++) {
        const config_setting_t *g = config_setting_get_elem(list, (unsigned)i);
        struct conf_input *in = &c->inputs[i];
        int line = config_setting_source_line(g);
        idemq_err_t err;

        if (config_setting_type(g) != CONFIG_TYPE_GROUP) {
            errf(errbuf, errlen, "%s:%d: inputs.[%d] must be a group { ... }", file, line, i);
            return IDEMQ_ERR_CONFIG;
        }
        if ((err = apply_defaults(input_keys, N_INPUT, in)) != IDEMQ_OK)
            return err;
        if ((err = read_group(g, "", input_keys, N_INPUT, in, file, errbuf, errlen)) != IDEMQ_OK)
            return err;
        for (int k = 0; k < N_INPUT; k++) {
            if ((input_keys[k].flags & CF_REQUIRED) && !*strlist_slot(in, input_keys[k].offset)) {
                errf(errbuf, errlen, "%s:%d: inputs.[%d].%s is required (%s)", file, line, i,
                     input_keys[k].path, input_keys[k].desc);
                return IDEMQ_ERR_CONFIG;
            }
        }
        if ((err = validate_input(in, line, file, errbuf, errlen)) != IDEMQ_OK)
            return err;
        if ((err = validate_lanes(c, in, line, file, errbuf, errlen)) != IDEMQ_OK)
            return err;
        if ((err = validate_provider(c, in, line, file, errbuf, errlen)) != IDEMQ_OK)
            return err;
        if ((err = validate_mode(in, line, file, errbuf, errlen)) != IDEMQ_OK)
            return err;
        if ((err = validate_transport(in, line, file, errbuf, errlen)) != IDEMQ_OK)
            return err;
        for (int r = 0; r < in->n_routes; r++) /* after every input's own effect */
            in->routes[r].effect = n + c->n_routes++;
        for (int j = 0; j < i; j++) {
            if (strcmp(c->inputs[j].name, in->name) == 0 ||
                strcmp(c->inputs[j].queue, in->queue) == 0) {
                errf(errbuf, errlen, "%s:%d: inputs.[%d] repeats the name or queue of inputs.[%d]",
                     file, line, i, j);
                return IDEMQ_ERR_CONFIG;
            }
        }
    }
    return split_transports(c);
}

static idemq_err_t check_url(const char *url, const char *file, char *errbuf, size_t errlen)
{
    char red[512];
    if (strncmp(url, "amqp://", 7) && strncmp(url, "amqps://", 8)) {
        errf(errbuf, errlen, "%s: broker.url \"%s\" must start with amqp:// or amqps://", file,
             conf_redact(url, red, sizeof red));
        return IDEMQ_ERR_CONFIG;
    }
    return IDEMQ_OK;
}

static idemq_err_t apply_env(struct conf *c, char *errbuf, size_t errlen)
{
    const char *url = getenv("IDEMQ_AMQP_URL");
    const char *dsn = getenv("IDEMQ_PG_DSN");

    if (url && *url) {
        char *copy = strdup(url), *save = NULL;
        idemq_err_t err = IDEMQ_OK;
        if (!copy)
            return IDEMQ_ERR_NOMEM;
        strlist_clear(&c->urls);
        for (char *tok = strtok_r(copy, ",", &save); tok && !err; tok = strtok_r(NULL, ",", &save)) {
            while (*tok == ' ')
                tok++;
            if ((err = check_url(tok, "IDEMQ_AMQP_URL", errbuf, errlen)) == IDEMQ_OK)
                err = strlist_push(&c->urls, tok);
        }
        free(copy);
        if (!err && c->urls.n == 0) {
            errf(errbuf, errlen, "IDEMQ_AMQP_URL holds no URL");
            err = IDEMQ_ERR_CONFIG;
        }
        if (err)
            return err;
    }
    if (dsn && *dsn && set_string(&c->dsn, dsn) != IDEMQ_OK)
        return IDEMQ_ERR_NOMEM;
    return IDEMQ_OK;
}

static idemq_err_t validate_retry(struct conf *c, const char *file, char *errbuf,
                                  size_t errlen)
{
    const struct conf_strlist *lists[2] = {&c->retry_sqlstates, &c->park_sqlstates};
    if (c->base_delay_ms > c->max_delay_ms) {
        errf(errbuf, errlen, "%s: retry.base_delay_ms (%d) must not exceed retry.max_delay_ms (%d)",
             file, c->base_delay_ms, c->max_delay_ms);
        return IDEMQ_ERR_CONFIG;
    }
    if ((c->jitter_mode = backoff_jitter_parse(c->jitter)) < 0) {
        errf(errbuf, errlen, "%s: retry.jitter must be none, full or equal, not \"%s\"", file,
             c->jitter);
        return IDEMQ_ERR_CONFIG;
    }
    for (int l = 0; l < 2; l++)
        for (int i = 0; i < lists[l]->n; i++)
            if (!classify_valid_code(lists[l]->v[i])) {
                errf(errbuf, errlen,
                     "%s: retry.%s: \"%s\" is not a SQLSTATE (5 of 0-9A-Z) or class (2)",
                     file, l ? "park_sqlstates" : "retry_sqlstates", lists[l]->v[i]);
                return IDEMQ_ERR_CONFIG;
            }
    c->rules.retry = (const char *const *)c->retry_sqlstates.v;
    c->rules.n_retry = c->retry_sqlstates.n;
    c->rules.park = (const char *const *)c->park_sqlstates.v;
    c->rules.n_park = c->park_sqlstates.n;
    return IDEMQ_OK;
}

/* Derived limits: the database call deadline, and the memory that
 * unacknowledged deliveries may take in one worker. Prefetch is per
 * consumer (basic.qos global=0: RabbitMQ 4.3 refuses global QoS), and a
 * worker holds one consumer per standard input and per partition. */
static idemq_err_t validate_limits(struct conf *c, const config_t *cfg, const char *file,
                                   char *errbuf, size_t errlen)
{
    long long worst = 0;
    if (c->client_timeout_ms) {
        if (c->statement_timeout_ms && c->client_timeout_ms <= c->statement_timeout_ms) {
            const config_setting_t *s = config_lookup(cfg, "database.client_timeout_ms");
            errf(errbuf, errlen, "%s:%d: database.client_timeout_ms (%d) must exceed "
                 "database.statement_timeout_ms (%d), or the server's own timeout could never "
                 "answer first", file, s ? config_setting_source_line(s) : 0,
                 c->client_timeout_ms, c->statement_timeout_ms);
            return IDEMQ_ERR_CONFIG;
        }
        c->call_timeout_ms = c->client_timeout_ms;
    } else {
        c->call_timeout_ms = c->statement_timeout_ms ? c->statement_timeout_ms + 5000 : 0;
    }
    for (int i = 0; i < c->n_inputs; i++) {
        const struct conf_input *in = &c->inputs[i];
        worst += (long long)c->prefetch * (in->partitions > 0 ? in->partitions : 1) *
                 in->max_body_bytes;
    }
    c->buffered_worst = worst;
    if (worst > (long long)c->max_buffered_mib * 1024 * 1024) {
        const config_setting_t *s = config_lookup(cfg, "broker.prefetch");
        errf(errbuf, errlen, "%s:%d: broker.prefetch (%d) x consumers x max_body_bytes allows "
             "%lld MiB of unacknowledged deliveries in one worker, over "
             "consumer.max_buffered_mib (%d): lower prefetch or max_body_bytes, or raise the "
             "bound", file, s ? config_setting_source_line(s) : 0, c->prefetch,
             worst / (1024 * 1024), c->max_buffered_mib);
        return IDEMQ_ERR_CONFIG;
    }
    return IDEMQ_OK;
}

double conf_parse_interval(const char *text)
{
    static const struct {
        const char *unit;
        double seconds;
    } units[] = {{"second", 1}, {"seconds", 1}, {"minute", 60}, {"minutes", 60},
                 {"hour", 3600}, {"hours", 3600}, {"day", 86400}, {"days", 86400}};
    char *end;
    long n;

    errno = 0;
    n = strtol(text, &end, 10);
    if (errno || end == text || n < 1 || n > 36500L * 86400 || *end != ' ')
        return -1;
    while (*end == ' ')
        end++;
    for (size_t i = 0; i < sizeof units / sizeof units[0]; i++)
        if (strcmp(end, units[i].unit) == 0)
            return (double)n * units[i].seconds;
    return -1;
}

/* The ledger lifecycle settings against each other (the ledger's
 * idemq.retention refuses the same combinations). */
static idemq_err_t validate_ledger(struct conf *c, const char *file, char *errbuf,
                                   size_t errlen)
{
    double iv = conf_parse_interval(c->partition_interval);
    if (iv < 10) {
        errf(errbuf, errlen, "%s: ledger.partition_interval must read \"N seconds|minutes|hours|"
             "days\" (at least 10 seconds), not \"%s\"", file, c->partition_interval);
        return IDEMQ_ERR_CONFIG;
    }
    c->partition_interval_s = iv;
    if (c->history_hot_days * 86400.0 < iv) {
        errf(errbuf, errlen, "%s: ledger.history_hot_days (%g) must cover at least one "
             "ledger.partition_interval (%s)", file, c->history_hot_days, c->partition_interval);
        return IDEMQ_ERR_CONFIG;
    }
    if (c->history_retention_days < c->dedup_window_days ||
        c->history_retention_days < c->history_hot_days) {
        errf(errbuf, errlen, "%s: ledger.history_retention_days (%g) must be at least "
             "ledger.dedup_window_days (%g) and ledger.history_hot_days (%g): the history that "
             "explains a key outlives its claim", file, c->history_retention_days,
             c->dedup_window_days, c->history_hot_days);
        return IDEMQ_ERR_CONFIG;
    }
    return IDEMQ_OK;
}

/* Operations (issue 11): TLS, topology verification, log format, the
 * liveness window and quorum delivery limits, checked against each other. */
static idemq_err_t validate_ops(struct conf *c, const char *file, char *errbuf, size_t errlen)
{
    long long stall_ms = (long long)c->live_stall_s * 1000;

    if (strcmp(c->tls_verify, "full") && strcmp(c->tls_verify, "none")) {
        errf(errbuf, errlen, "%s: broker.tls.verify must be \"full\" or \"none\", not \"%s\"",
             file, c->tls_verify);
        return IDEMQ_ERR_CONFIG;
    }
    c->tls_verify_off = strcmp(c->tls_verify, "none") == 0;
    if (!c->tls_cert_file[0] != !c->tls_key_file[0]) {
        errf(errbuf, errlen, "%s: broker.tls.cert_file and broker.tls.key_file go together "
             "(a client certificate needs its key)", file);
        return IDEMQ_ERR_CONFIG;
    }
    if (strcmp(c->topology_verify, "full") && strcmp(c->topology_verify, "passive")) {
        errf(errbuf, errlen, "%s: topology.verify must be \"full\" or \"passive\", not \"%s\"",
             file, c->topology_verify);
        return IDEMQ_ERR_CONFIG;
    }
    c->topology_passive = strcmp(c->topology_verify, "passive") == 0;
    if (c->metrics_listen[0]) {
        char ip[16];
        int port;
        if (!conf_listen_parse(c->metrics_listen, ip, &port)) {
            errf(errbuf, errlen, "%s: metrics.listen \"%s\" must be IPv4:port with a numeric "
                 "address, e.g. 127.0.0.1:9187 (or 0.0.0.0:9187 for every address); "
                 "empty = off", file, c->metrics_listen);
            return IDEMQ_ERR_CONFIG;
        }
    }
    if (c->console_listen[0]) {
        char ip[16];
        int port;
        if (!conf_listen_parse(c->console_listen, ip, &port)) {
            errf(errbuf, errlen, "%s: console.listen \"%s\" must be IPv4:port with a numeric "
                 "address, e.g. 127.0.0.1:9188; empty = off", file, c->console_listen);
            return IDEMQ_ERR_CONFIG;
        }
        if (strcmp(c->console_listen, c->metrics_listen) == 0) {
            errf(errbuf, errlen, "%s: console.listen and metrics.listen must differ (%s)", file,
                 c->console_listen);
            return IDEMQ_ERR_CONFIG;
        }
    }
    if (strcmp(c->log_format, "text") && strcmp(c->log_format, "json")) {
        errf(errbuf, errlen, "%s: log.format must be \"text\" or \"json\", not \"%s\"", file,
             c->log_format);
        return IDEMQ_ERR_CONFIG;
    }
    /* A worker legitimately waits this long inside one call: a database
     * call until its client-side deadline (or statement timeout), a broker
     * read until a missed heartbeat, a connect attempt, a provider call. */
    {
        long long db_ms = c->call_timeout_ms ? c->call_timeout_ms : c->statement_timeout_ms;
        long long provider_ms = 0;
        for (int i = 0; i < c->n_inputs; i++)
            if (CONF_INPUT_PROVIDER(&c->inputs[i]) &&
                c->inputs[i].provider.timeout_ms > provider_ms)
                provider_ms = c->inputs[i].provider.timeout_ms;
        if (stall_ms <= db_ms || stall_ms <= (long long)c->heartbeat * 1000 ||
            stall_ms <= c->connect_timeout_ms || stall_ms <= provider_ms) {
            errf(errbuf, errlen, "%s: metrics.live_stall_s (%d s) must exceed the database "
                 "call deadline (%lld ms: database.client_timeout_ms, or "
                 "statement_timeout_ms + 5000), broker.heartbeat (%d s), "
                 "broker.connect_timeout_ms (%d ms) and every provider.timeout_ms (%lld ms): "
                 "a worker may wait that long in one call",
                 file, c->live_stall_s, db_ms, c->heartbeat, c->connect_timeout_ms,
                 provider_ms);
            return IDEMQ_ERR_CONFIG;
        }
    }
    for (int i = 0; i < c->n_inputs; i++) {
        const struct conf_input *in = &c->inputs[i];
        if (strcmp(in->queue_type, "quorum") == 0 &&
            (long long)in->delivery_limit < 2LL * c->max_attempts) {
            errf(errbuf, errlen, "%s: input %s: delivery_limit (%d) must be at least twice "
                 "retry.max_attempts (%d), so idemq parks a failing job before the broker "
                 "dead-letters it", file, in->name, in->delivery_limit, c->max_attempts);
            return IDEMQ_ERR_CONFIG;
        }
    }
    return IDEMQ_OK;
}

static idemq_err_t load(config_t *cfg, const char *file, struct conf **out, char *errbuf,
                        size_t errlen)
{
    struct conf *c = calloc(1, sizeof *c);
    const config_setting_t *root = config_root_setting(cfg);
    idemq_err_t err = IDEMQ_ERR_NOMEM;
    int n;

    *out = NULL;
    if (!c || !(c->path = strdup(file)))
        goto fail;
    if ((err = apply_defaults(global_keys, N_GLOBAL, c)) != IDEMQ_OK)
        goto fail;
    /* Top level: known groups and the inputs list only. */
    n = config_setting_length(root);
    for (int i = 0; i < n; i++) {
        const config_setting_t *s = config_setting_get_elem(root, (unsigned)i);
        const char *name = config_setting_name(s);
        if (strcmp(name, "inputs") == 0)
            continue;
        if (config_setting_type(s) != CONFIG_TYPE_GROUP ||
            (strcmp(name, "broker") && strcmp(name, "database") && strcmp(name, "consumer") &&
             strcmp(name, "retry") && strcmp(name, "metrics") && strcmp(name, "log") &&
             strcmp(name, "topology") && strcmp(name, "ledger") && strcmp(name, "outbox") &&
             strcmp(name, "console"))) {
            errf(errbuf, errlen, "%s:%d: unknown setting %s (top level holds broker, database, "
                 "consumer, retry, metrics, log, topology, ledger, outbox, console and inputs)", file,
                 config_setting_source_line(s), name);
            err = IDEMQ_ERR_CONFIG;
            goto fail;
        }
        err = read_group(s, name, global_keys, N_GLOBAL, c, file, errbuf, errlen);
        if (err)
            goto fail;
    }
    for (int i = 0; i < c->urls.n; i++)
        if ((err = check_url(c->urls.v[i], file, errbuf, errlen)) != IDEMQ_OK)
            goto fail;
    if (log_level_parse(c->log_level) < 0) {
        errf(errbuf, errlen, "%s: log.level must be error, warn, info or debug, not \"%s\"", file,
             c->log_level);
        err = IDEMQ_ERR_CONFIG;
        goto fail;
    }
    if ((err = validate_retry(c, file, errbuf, errlen)) != IDEMQ_OK)
        goto fail;
    if ((err = validate_ledger(c, file, errbuf, errlen)) != IDEMQ_OK)
        goto fail;
    if ((err = read_inputs(cfg, c, file, errbuf, errlen)) != IDEMQ_OK)
        goto fail;
    if ((err = validate_limits(c, cfg, file, errbuf, errlen)) != IDEMQ_OK)
        goto fail;
    if ((err = apply_env(c, errbuf, errlen)) != IDEMQ_OK)
        goto fail;
    if ((err = validate_ops(c, file, errbuf, errlen)) != IDEMQ_OK)
        goto fail;
    if (!c->consumer_id[0]) {
        char host[128] = "host", id[200];
        gethostname(host, sizeof host - 1);
        snprintf(id, sizeof id, "%s:%ld", host, (long)getpid());
        if ((err = set_string(&c->consumer_id, id)) != IDEMQ_OK)
            goto fail;
    }
    *out = c;
    return IDEMQ_OK;
fail:
    if (err == IDEMQ_ERR_NOMEM)
        errf(errbuf, errlen, "%s: out of memory while loading", file);
    conf_free(c);
    return err;
}

idemq_err_t conf_load(const char *path, struct conf **out, char *errbuf, size_t errlen)
{
    config_t cfg;
    idemq_err_t err;

    *out = NULL;
    config_init(&cfg);
    if (!config_read_file(&cfg, path)) {
        if (config_error_type(&cfg) == CONFIG_ERR_FILE_IO)
            errf(errbuf, errlen, "%s: cannot read: %s", path, strerror(errno));
        else
            errf(errbuf, errlen, "%s:%d: syntax error: %s", path, config_error_line(&cfg),
                 config_error_text(&cfg));
        config_destroy(&cfg);
        return IDEMQ_ERR_CONFIG;
    }
    err = load(&cfg, path, out, errbuf, errlen);
    config_destroy(&cfg);
    return err;
}

idemq_err_t conf_load_string(const char *text, struct conf **out, char *errbuf, size_t errlen)
{
    config_t cfg;
    idemq_err_t err;

    *out = NULL;
    config_init(&cfg);
    if (!config_read_string(&cfg, text)) {
        errf(errbuf, errlen, "<string>:%d: syntax error: %s", config_error_line(&cfg),
             config_error_text(&cfg));
        config_destroy(&cfg);
        return IDEMQ_ERR_CONFIG;
    }
    err = load(&cfg, "<string>", out, errbuf, errlen);
    config_destroy(&cfg);
    return err;
}

static void free_strings(const struct conf_key *keys, int n, void *base)
{
    for (int i = 0; i < n; i++) {
        if (keys[i].type == CT_STR)
            free(*strlist_slot(base, keys[i].offset));
        else if (keys[i].type == CT_STRLIST)
            strlist_clear((struct conf_strlist *)((char *)base + keys[i].offset));
    }
}

static void free_inputs(struct conf_input *in, int n)
{
    for (int i = 0; i < n; i++) {
        free_strings(input_keys, N_INPUT, &in[i]);
        free(in[i].key_name);
        free(in[i].effect_signature);
        free(in[i].order_name);
        free(in[i].seq_name);
        for (int r = 0; r < in[i].n_routes; r++) {
            free(in[i].routes[r].task);
            free(in[i].routes[r].signature);
        }
        free(in[i].routes);
    }
    free(in);
}

void conf_free(struct conf *c)
{
    if (!c)
        return;
    free_inputs(c->inputs, c->n_inputs);
    free_inputs(c->pg_inputs, c->n_pg_inputs);
    free_strings(global_keys, N_GLOBAL, c);
    free(c->path);
    free(c);
}

static void put(char *buf, size_t buflen, size_t *o, const char *s, size_t n)
{
    while (n-- && *o + 1 < buflen)
        buf[(*o)++] = *s++;
}

/* A blank between libpq's key=value pairs: any C whitespace (libpq uses
 * isspace), not only a space. */
static bool dsn_blank(char ch) { return isspace((unsigned char)ch) != 0; }

/* The "://" of s if s is a URL (leading blanks, then a scheme: a letter and
 * letters, digits, '+', '-' or '.'), else NULL: a key=value DSN whose
 * values hold "://" stays a DSN. */
static const char *url_scheme_end(const char *s)
{
    while (dsn_blank(*s))
        s++;
    if (!isalpha((unsigned char)*s))
        return NULL;
    while (isalnum((unsigned char)*s) || *s == '+' || *s == '-' || *s == '.')
        s++;
    return strncmp(s, "://", 3) == 0 ? s : NULL;
}

bool conf_listen_parse(const char *s, char ip[16], int *port)
{
    const char *colon = strrchr(s, ':');
    struct in_addr a;
    long v = 0;

    if (!colon || colon == s || colon - s > 15 || !colon[1])
        return false;
    for (const char *d = colon + 1; *d; d++) {
        if (!isdigit((unsigned char)*d) || v > 65535)
            return false;
        v = v * 10 + (*d - '0');
    }
    if (v < 1 || v > 65535)
        return false;
    memcpy(ip, s, (size_t)(colon - s));
    ip[colon - s] = '\0';
    if (inet_pton(AF_INET, ip, &a) != 1)
        return false;
    *port = (int)v;
    return true;
}

char *conf_redact(const char *s, char *buf, size_t buflen)
{
    const char *scheme = url_scheme_end(s);
    const char *p = s;
    size_t o = 0;

    if (!buflen)
        return buf;
    if (scheme) { /* URL: drop the password of user:password@ */
        const char *auth = scheme + 3;
        const char *at = strchr(auth, '@');
        const char *slash = strchr(auth, '/');
        const char *colon = strchr(auth, ':');
        if (at && (!slash || at < slash) && colon && colon < at) {
            put(buf, buflen, &o, s, (size_t)(colon - s));
            put(buf, buflen, &o, ":***", 4);
            p = at;
        }
        while (*p) { /* and query parameters password= / sslpassword= */
            size_t kw = strncmp(p, "password=", 9) == 0      ? 9
                        : strncmp(p, "sslpassword=", 12) == 0 ? 12
                                                               : 0;
            if (kw && p > s && (p[-1] == '?' || p[-1] == '&')) {
                put(buf, buflen, &o, p, kw);
                put(buf, buflen, &o, "***", 3);
                p += kw;
                while (*p && *p != '&')
                    p++;
                continue;
            }
            put(buf, buflen, &o, p++, 1);
        }
        buf[o] = '\0';
        return buf;
    }
    while (*p) { /* key=value DSN: replace the value of password= (and sslpassword=) */
        size_t kw = strncmp(p, "password", 8) == 0      ? 8
                    : strncmp(p, "sslpassword", 11) == 0 ? 11
                                                         : 0;
        if ((p == s || dsn_blank(p[-1])) && kw) {
            const char *q = p + kw;
            while (dsn_blank(*q))
                q++;
            if (*q == '=') {
                q++;
                while (dsn_blank(*q))
                    q++;
                if (*q == '\'') {
                    q++;
                    while (*q && *q != '\'')
                        q += (*q == '\\' && q[1]) ? 2 : 1;
                    if (*q)
                        q++;
                } else {
                    while (*q && !dsn_blank(*q))
                        q++;
                }
                put(buf, buflen, &o, p, kw);
                put(buf, buflen, &o, "=***", 4);
                p = q;
                continue;
            }
        }
        put(buf, buflen, &o, p++, 1);
    }
    buf[o] = '\0';
    return buf;
}

/* Writes s as a libconfig string literal: quoted, with \\ and \" escaped. */
static void print_string(FILE *out, const char *s)
{
    fputc('"', out);
    for (; *s; s++) {
        if (*s == '"' || *s == '\\')
            fputc('\\', out);
        fputc(*s, out);
    }
    fputc('"', out);
}

static void print_key(FILE *out, const struct conf_key *k, const void *base, const char *name,
                      const char *indent)
{
    const void *slot = (const char *)base + k->offset;
    char red[4096];
    switch (k->type) {
    case CT_INT:
        fprintf(out, "%s%s = %d;\n", indent, name, *(const int *)slot);
        break;
    case CT_BOOL:
        fprintf(out, "%s%s = %s;\n", indent, name, *(const bool *)slot ? "true" : "false");
        break;
    case CT_DAYS: { /* always with a decimal point: libconfig reads it back as a float */
        char num[64];
        snprintf(num, sizeof num, "%.6g", *(const double *)slot);
        fprintf(out, "%s%s = %s%s;\n", indent, name, num,
                strpbrk(num, ".e") ? "" : ".0");
        break;
    }
    case CT_STR: {
        const char *v = *(char *const *)slot;
        fprintf(out, "%s%s = ", indent, name);
        print_string(out, (k->flags & CF_SENSITIVE) ? conf_redact(v, red, sizeof red) : v);
        fprintf(out, ";\n");
        break;
    }
    case CT_STRLIST: {
        const struct conf_strlist *l = slot;
        fprintf(out, "%s%s = [", indent, name);
        for (int i = 0; i < l->n; i++) {
            fputs(i ? ", " : " ", out);
            print_string(out, (k->flags & CF_SENSITIVE) ? conf_redact(l->v[i], red, sizeof red)
                                                        : l->v[i]);
        }
        fprintf(out, " ];\n");
        break;
    }
    }
}

/* Length of the first path component of p ("broker" of "broker.tls.x"). */
static size_t head_len(const char *p)
{
    const char *dot = strchr(p, '.');
    return dot ? (size_t)(dot - p) : strlen(p);
}

/* True if row i is the first row whose path starts with the same prefix of
 * length len as row i's. */
static bool first_with_prefix(int i, size_t len)
{
    for (int k = 0; k < i; k++)
        if (strncmp(global_keys[k].path, global_keys[i].path, len) == 0 &&
            (global_keys[k].path[len] == '.' || global_keys[k].path[len] == '\0'))
            return false;
    return true;
}

int conf_warn_consumer_timeout(const struct conf *c, FILE *out)
{
    int n = 0;
    for (int i = 0; i < c->n_inputs; i++) {
        const struct conf_input *in = &c->inputs[i];
        long long per, each, rounds, worst;
        const char *what;
        if (CONF_INPUT_PROVIDER(in)) {
            per = in->provider.max_in_flight;
            each = in->provider.timeout_ms;
            what = "provider calls (provider.max_in_flight at a time)";
        } else {
            per = c->batch_max;
            each = c->call_timeout_ms;
            what = "batches (consumer.batch_max each, up to the database call deadline)";
        }
        if (each <= 0) {
            fprintf(out, "# warning: input %s: database.statement_timeout_ms is 0, so a batch "
                    "has no bound: a delivery could be held past RabbitMQ's consumer timeout "
                    "(default %lld min), and the broker would cancel the consumer and "
                    "redeliver\n",
                    in->name, CONF_BROKER_CONSUMER_TIMEOUT_MS / 60000);
            n++;
            continue;
        }
        rounds = (c->prefetch + per - 1) / per;
        worst = rounds * each;
        if (worst < CONF_BROKER_CONSUMER_TIMEOUT_MS)
            continue;
        fprintf(out, "# warning: input %s: the last of broker.prefetch (%d) deliveries may wait "
                "for %lld %s of %lld ms each: %lld ms, at least RabbitMQ's consumer timeout "
                "(default %lld ms), after which the broker cancels the consumer and "
                "redelivers: lower broker.prefetch or the timeouts, or raise the broker's "
                "consumer_timeout\n",
                in->name, c->prefetch, rounds, what, each, worst, CONF_BROKER_CONSUMER_TIMEOUT_MS);
        n++;
    }
    return n;
}

void conf_print(const struct conf *c, FILE *out)
{
    /* Groups (and one level of subgroups, e.g. broker.tls) in order of
     * first appearance in the table, so rows of one group need not be
     * adjacent in it. */
    for (int g = 0; g < N_GLOBAL; g++) {
        const char *gp = global_keys[g].path;
        size_t glen = head_len(gp);
        if (!first_with_prefix(g, glen))
            continue;
        fprintf(out, "%.*s: {\n", (int)glen, gp);
        for (int i = g; i < N_GLOBAL; i++) { /* leaves of the group */
            const char *p = global_keys[i].path;
            if (strncmp(p, gp, glen) || p[glen] != '.' || strchr(p + glen + 1, '.'))
                continue;
            print_key(out, &global_keys[i], c, p + glen + 1, "  ");
        }
        for (int s = g; s < N_GLOBAL; s++) { /* its subgroups */
            const char *sp = global_keys[s].path;
            size_t slen;
            if (strncmp(sp, gp, glen) || sp[glen] != '.' || !strchr(sp + glen + 1, '.'))
                continue;
            slen = glen + 1 + head_len(sp + glen + 1);
            if (!first_with_prefix(s, slen))
                continue;
            fprintf(out, "  %.*s: {\n", (int)(slen - glen - 1), sp + glen + 1);
            for (int i = s; i < N_GLOBAL; i++) {
                const char *p = global_keys[i].path;
                if (strncmp(p, sp, slen) == 0 && p[slen] == '.')
                    print_key(out, &global_keys[i], c, p + slen + 1, "    ");
            }
            fprintf(out, "  };\n");
        }
        fprintf(out, "};\n");
    }
    fprintf(out, "inputs = (\n");
    for (int j = 0; j < c->n_inputs + c->n_pg_inputs; j++) {
        /* broker inputs, then the PostgreSQL queue inputs */
        const struct conf_input *in = j < c->n_inputs ? &c->inputs[j]
                                                      : &c->pg_inputs[j - c->n_inputs];
        fprintf(out, "  {\n");
        for (int i = 0; i < N_INPUT; i++)
            if (strncmp(input_keys[i].path, "provider.", 9) != 0)
                print_key(out, &input_keys[i], in, input_keys[i].path, "    ");
        if (CONF_INPUT_PROVIDER(in)) { /* a nested group, provider inputs only */
            fprintf(out, "    provider: {\n");
            for (int i = 0; i < N_INPUT; i++)
                if (strncmp(input_keys[i].path, "provider.", 9) == 0)
                    print_key(out, &input_keys[i], in, input_keys[i].path + 9, "      ");
            fprintf(out, "    };\n");
        }
        fprintf(out, "  }%s\n", j + 1 < c->n_inputs + c->n_pg_inputs ? "," : "");
    }
    fprintf(out, ");\n");
}
