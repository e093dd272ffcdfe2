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
#include <sys/stat.h>
#include <unistd.h>

#include "backoff.h"
#include "classify.h"
#include "log.h"
#include "mask.h"

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
    {"broker.url", CT_STRLIST, G(urls), 1, 8, "amqp://guest:guest@127.0.0.1:5672/%2F", 0,
     CF_SENSITIVE, "AMQP URL, or a list tried in order on (re)connect (a comma-separated "
     "string is split into one); the path is the vhost: /%2F is \"/\", while a trailing "
     "\"/\" alone names the empty vhost; IDEMQ_AMQP_URL overrides"},
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
    {"database.keep_error_detail", CT_BOOL, G(keep_error_detail), 0, 1, NULL, 0, 0,
     "log the DETAIL of PostgreSQL notices and warnings (it may quote row values, such as "
     "a constraint's key); stored error texts keep only the primary message"},
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
    /* proof: lost retry copies */
    {"retry.rescue_after_s", CT_INT, G(rescue_after_s), 0, 7 * 86400, NULL, 600, 0,
     "publish a retry again from the ledger when no copy came back this long after its "
     "retry time (one replica at a time); 0 = off"},
    {"metrics.listen", CT_STR, G(metrics_listen), 0, 64, "", 0, 0,
     "numeric IPv4:port (e.g. 127.0.0.1:9187; 0.0.0.0:PORT = every address) for GET "
     "/metrics, /ready and /live of `idemq run`; empty = off"},
    /* the web console (consumer/console.h) */
    {"console.listen", CT_STR, G(console_listen), 0, 64, "", 0, 0,
     "numeric IPv4:port (e.g. 127.0.0.1:9188) of the web console of `idemq run`; empty = "
     "off. Loopback clients read without a secret; other addresses need the token"},
    {"console.token_file", CT_STR, G(console_token_file), 0, 4096, "", 0, 0,
     "file (mode 0600) of named tokens, one \"NAME TOKEN\" per line (TOKEN: 32 to 255 "
     "bytes); every console action, and reading from a non-loopback address, needs one, and "
     "is recorded as done by console:NAME; empty = a read-only console, loopback only"},
    {"console.statement_timeout_ms", CT_INT, G(console_statement_timeout_ms), 100, 600000, NULL,
     5000, 0, "statement_timeout of the console's own database sessions"},
    {"console.hosts", CT_STRLIST, G(console_hosts), 0, 16, "", 0, 0,
     "Host header values (name:port, compared without case) the console answers besides its "
     "listen address and localhost, 127.0.0.1 and [::1] with its port, e.g. the name a "
     "reverse proxy sends; any other Host gets 421 (DNS rebinding reaches nothing)"},
    {"console.operator_broker_url", CT_STR, G(console_operator_broker_url), 0, 1024, "", 0,
     CF_SENSITIVE,
     "AMQP URL of the operator's broker user the console's redrives publish with (write on "
     "amq.default and read on the dead-letter queues; see consumer/OPERATIONS.md \"Roles and "
     "permissions\"), instead of the daemon's broker.url; empty = broker.url"},
    {"console.reads_need_token", CT_BOOL, G(console_reads_need_token), 0, 1, NULL, 0, 0,
     "every request, loopback ones too, needs a token of token_file (HTTP Basic: the token's "
     "name and the token); set it when a reverse proxy or tunnel on the same host makes every "
     "client loopback"},
    {"protection.keys", CT_STRLIST, G(protection_keys), 0, 32, "", 0, 0,
     "keys that seal and open stored payload copies (parked bodies, retry copies, outbox "
     "bodies), as \"id=/path\": each file holds 32 bytes (raw or 64 hex digits) and only "
     "its owner may read it; the key "
     "bytes are never in this file; keep old keys listed to open copies sealed with them "
     "(see docs/data-protection.md)"},
    {"protection.active", CT_STR, G(protection_active), 0, 32, "", 0, 0,
     "id of the key new copies are sealed with (AES-256-GCM); empty = new copies are stored "
     "as they are, listed keys still open old ones"},
    {"log.level", CT_STR, G(log_level), 1, 10, "info", 0, 0, "error, warn, info or debug"},
    /* operations: TLS, least privilege, logs, liveness */
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
    /* ledger lifecycle; `idemq migrate` writes these to the ledger */
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
    /* transactional outbox */
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
    /* tracing (OpenTelemetry) */
    {"tracing.endpoint", CT_STR, G(tracing_endpoint), 0, 2048, "", 0, CF_SENSITIVE,
     "OTLP/HTTP JSON traces URL of a collector, e.g. http://127.0.0.1:4318/v1/traces; empty = "
     "no spans are exported (a producer's trace context is still passed on)"},
    {"tracing.service_name", CT_STR, G(tracing_service_name), 1, 128, "idemq", 0, 0,
     "service.name of the spans' resource"},
    {"tracing.queue_max", CT_INT, G(tracing_queue_max), 16, 1000000, NULL, 8192, 0,
     "spans waiting for export; beyond it a span is dropped and counted, never waited for"},
    {"tracing.batch_max", CT_INT, G(tracing_batch_max), 1, 10000, NULL, 512, 0,
     "spans per export request"},
    {"tracing.flush_ms", CT_INT, G(tracing_flush_ms), 10, 60000, NULL, 1000, 0,
     "a partial batch is exported after this long"},
    {"tracing.timeout_ms", CT_INT, G(tracing_timeout_ms), 100, 60000, NULL, 3000, 0,
     "one export request, connect to answer; a request that fails drops its spans (counted)"},
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
    /* Celery producers */
    {"protocol", CT_STR, I(protocol), 1, 16, "native", 0, 0,
     "native (a JSON object body), or celery (Celery task messages, protocol 1 and 2, JSON "
     "serializer; results to reply_to like the rpc:// backend)"},
    {"celery_tasks", CT_STRLIST, I(celery_tasks), 0, 64, "", 0, 0,
     "protocol = celery: \"task.name=schema.fn\" routes; a task named nowhere is parked as "
     "celery_unknown_task"},
    {"celery_duplicate_reply", CT_STR, I(celery_duplicate_reply), 1, 16, "result", 0, 0,
     "protocol = celery: a task whose key was already applied or parked is answered with the "
     "key's stored result or park reason (result), or only with its status (status: SUCCESS "
     "with a null result, FAILURE naming the park code alone), where producers that share "
     "keys do not trust each other"},
    {"sensitive", CT_STRLIST, I(sensitive), 0, 64, "", 0, 0,
     "payload fields to mask in everything idemq shows or logs (jobs show, parked list and "
     "show, the console, failure groups, error texts): dotted JSON paths such as "
     "\"card.number\"; a path through an array applies to each element"},
    {"deferred_report_after_s", CT_INT, I(deferred_report_after_s), 1, 86400 * 30, NULL, 300, 0,
     "deferred jobs (waiting for a predecessor) older than this are reported"},
    /* provider effects: keep these rows together */
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
    /* operations */
    {"delivery_limit", CT_INT, I(delivery_limit), 1, 1000000, NULL, 100, 0,
     "quorum inputs: x-delivery-limit of the queue, at least 2 x retry.max_attempts"},
    /* PostgreSQL queue inputs */
    {"transport", CT_STR, I(transport), 1, 16, "rabbitmq", 0, 0,
     "rabbitmq (a broker queue), or postgres: jobs are rows producers enqueue with "
     "idemq.enqueue(queue, ...) into the ledger's database, no broker (see adapters/PORT.md); "
     "or sqs: an Amazon SQS queue (queue_url, region)"},
    /* Amazon SQS inputs */
    {"queue_url", CT_STR, I(queue_url), 0, 1024, "", 0, 0,
     "sqs inputs: https://HOST/ACCOUNT/NAME of the queue (a name ending in .fifo is a FIFO "
     "queue); http:// only to a loopback host"},
    {"region", CT_STR, I(region), 0, 32, "", 0, 0,
     "sqs inputs: the AWS region that signs the requests, e.g. eu-west-1"},
    {"endpoint", CT_STR, I(endpoint), 0, 255, "", 0, 0,
     "sqs inputs: http(s)://HOST[:PORT] the requests go to instead of the queue URL's host "
     "(an emulator); http:// only to a loopback host; empty = the queue URL's"},
    {"dead_letter_queue_url", CT_STR, I(dead_letter_queue_url), 0, 1024, "", 0, 0,
     "sqs inputs: queue that receives a parked message with its story (FIFO if the queue is); "
     "empty = the park row only"},
    {"visibility_timeout_s", CT_INT, I(visibility_timeout_s), 5, 43200, NULL, 60, 0,
     "sqs inputs: how long a received message stays hidden from other consumers (its lease); "
     "idemq extends it every half of it while the job is in flight, so a crashed worker's "
     "messages reappear within this"},
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

/* The line of global setting path in the file cfg came from, 0 if it is
 * not there (a default). */
static int line_of(const config_t *cfg, const char *path)
{
    const config_setting_t *s = cfg ? config_lookup(cfg, path) : NULL;
    return s ? (int)config_setting_source_line(s) : 0;
}

/* "FILE:LINE" of global setting path, or "FILE" when it is not in the file. */
static const char *where(char *buf, size_t len, const char *file, const config_t *cfg,
                         const char *path)
{
    int line = line_of(cfg, path);
    if (line > 0)
        snprintf(buf, len, "%s:%d", file, line);
    else
        snprintf(buf, len, "%s", file);
    return buf;
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

/* A Celery input: its key source and task routes. Effect
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
    if (strcmp(in->celery_duplicate_reply, "result") && strcmp(in->celery_duplicate_reply, "status")) {
        errf(errbuf, errlen, "%s:%d: input %s: celery_duplicate_reply must be \"result\" or "
             "\"status\", not \"%s\"", file, line, in->name, in->celery_duplicate_reply);
        return IDEMQ_ERR_CONFIG;
    }
    in->celery_status_only = strcmp(in->celery_duplicate_reply, "status") == 0;
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
    for (int i = 0; i < in->sensitive.n; i++) {
        char why[128];
        if (!in->sensitive.v[i][0] && in->sensitive.n == 1)
            break; /* the default: none */
        if (!mask_path_check(in->sensitive.v[i], why, sizeof why)) {
            errf(errbuf, errlen, "%s:%d: input %s: sensitive[%d] \"%s\" %s", file, line,
                 in->name, i, in->sensitive.v[i], why);
            return IDEMQ_ERR_CONFIG;
        }
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
    if (strcmp(in->celery_duplicate_reply, "result")) {
        errf(errbuf, errlen, "%s:%d: input %s: celery_duplicate_reply needs protocol = \"celery\"",
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

/* The input's mode: apply, or observe (a copy of live traffic,
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
    if (strcmp(in->transport, "sqs") && (in->queue_url[0] || in->region[0] || in->endpoint[0] ||
                                         in->dead_letter_queue_url[0])) {
        errf(errbuf, errlen, "%s:%d: input %s: queue_url, region, endpoint and "
             "dead_letter_queue_url need transport = \"sqs\"", file, line, in->name);
        return IDEMQ_ERR_CONFIG;
    }
    if (strcmp(in->transport, "sqs") == 0)
        return IDEMQ_OK; /* validate_sqs */
    if (strcmp(in->transport, "rabbitmq") == 0) {
        if (strcmp(in->key_source, "key") == 0) {
            errf(errbuf, errlen, "%s:%d: input %s: key_source = \"key\" (the enqueue's key) "
                 "needs transport = \"postgres\"", file, line, in->name);
            return IDEMQ_ERR_CONFIG;
        }
        return IDEMQ_OK;
    }
    if (strcmp(in->transport, "postgres")) {
        errf(errbuf, errlen, "%s:%d: input %s: transport must be \"rabbitmq\", \"postgres\" or "
             "\"sqs\", not \"%s\"", file, line, in->name, in->transport);
        return IDEMQ_ERR_CONFIG;
    }
    if (in->observe) {
        errf(errbuf, errlen, "%s:%d: input %s: a postgres input cannot take mode = \"observe\": "
             "observe mode consumes a copy of live traffic from a queue of its own bound beside "
             "the existing consumer, and a postgres input's rows are idemq's own table, with "
             "no copy to take (every row is taken once). Check a new effect with observe "
             "mode on a broker input, or on a staging database fed the same enqueues",
             file, line, in->name);
        return IDEMQ_ERR_CONFIG;
    }
    if (in->key_kind == CONF_KEY_HEADER || in->exchange[0] || in->routing_key[0] ||
        CONF_INPUT_ORDERED(in) || in->celery ||
        in->emits || strcmp(in->queue_type, "classic")) {
        errf(errbuf, errlen, "%s:%d: input %s: a postgres input takes key_source json:<field> or "
             "key (the enqueue's key), and no exchange, routing_key, queue_type, partitions "
             "(rows with an order key run in order by themselves), protocol = "
             "\"celery\" or emits (not yet)", file, line, in->name);
        return IDEMQ_ERR_CONFIG;
    }
    return IDEMQ_OK;
}

/* Moves the inputs of transport t out of c->inputs into *out (keeping
 * their order). */
static idemq_err_t split_out(struct conf *c, const char *t, struct conf_input **out, int *nout)
{
    int n = c->n_inputs, nb = 0, np = 0;
    for (int i = 0; i < n; i++)
        np += strcmp(c->inputs[i].transport, t) == 0;
    if (!np)
        return IDEMQ_OK;
    if (!(*out = calloc((size_t)np, sizeof **out)))
        return IDEMQ_ERR_NOMEM;
    np = 0;
    for (int i = 0; i < n; i++) {
        if (strcmp(c->inputs[i].transport, t) == 0)
            (*out)[np++] = c->inputs[i];
        else
            c->inputs[nb++] = c->inputs[i];
    }
    c->n_inputs = nb;
    *nout = np;
    return IDEMQ_OK;
}

/* Moves the postgres inputs into c->pg_inputs and the sqs ones into
 * c->sqs_inputs, and numbers the Celery routes' effects again after the
 * broker inputs that stay. */
static idemq_err_t split_transports(struct conf *c)
{
    idemq_err_t err;
    int nb;
    if ((err = split_out(c, "postgres", &c->pg_inputs, &c->n_pg_inputs)) != IDEMQ_OK ||
        (err = split_out(c, "sqs", &c->sqs_inputs, &c->n_sqs_inputs)) != IDEMQ_OK)
        return err;
    nb = c->n_inputs;
    c->n_routes = 0;
    for (int i = 0; i < nb; i++)
        for (int r = 0; r < c->inputs[i].n_routes; r++)
            c->inputs[i].routes[r].effect = nb + c->n_routes++;
    return IDEMQ_OK;
}

/* c with inputs[0..n) as its inputs, no other transport's, no Celery route. */
static struct conf view_of(const struct conf *c, struct conf_input *inputs, int n)
{
    struct conf v = *c;
    v.inputs = inputs;
    v.n_inputs = n;
    v.pg_inputs = NULL;
    v.n_pg_inputs = 0;
    v.sqs_inputs = NULL;
    v.n_sqs_inputs = 0;
    v.n_routes = 0;
    return v;
}

struct conf conf_sqs_view(const struct conf *c)
{
    return view_of(c, c->sqs_inputs, c->n_sqs_inputs);
}

struct conf conf_pg_view(const struct conf *c)
{
    return view_of(c, c->pg_inputs, c->n_pg_inputs);
}

/* ---- provider effects ---- */

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

/* An SQS URL: https://HOST[:PORT] (http:// to a loopback host only, or to
 * any host when plain_ok: a queue URL whose requests go to an endpoint
 * that is itself checked, as an emulator names its queues), then
 * with a path (a queue URL: /ACCOUNT/NAME, NAME of [A-Za-z0-9_-], at most
 * 80 characters with its .fifo) or without one (an endpoint). Sets *fifo
 * for a queue URL. Returns NULL or what is wrong. */
static const char *sqs_url_problem(const char *url, bool queue, bool *fifo, bool plain_ok)
{
    char host[256];
    const char *rest, *acct, *name;
    size_t hl, nl;
    if (strncmp(url, "https://", 8) == 0) {
        rest = url + 8;
    } else if (strncmp(url, "http://", 7) == 0) {
        url_host(url, host, sizeof host);
        if (!plain_ok && !host_loopback(host))
            return "http:// is allowed to a loopback host only (the signed requests and every "
                   "body would travel in clear)";
        rest = url + 7;
    } else {
        return "must start with https://";
    }
    hl = strcspn(rest, "/?#@ ");
    if (hl == 0 || (rest[hl] && strchr("?#@ ", rest[hl])))
        return "needs a host, and no user, query or fragment";
    for (size_t i = 0; i < hl; i++)
        if (!isalnum((unsigned char)rest[i]) && !strchr(".-:[]", rest[i]))
            return "has a character a host cannot hold";
    if (!queue)
        return rest[hl] && strcmp(rest + hl, "/") ? "takes no path (the queue URL has it)"
                                                   : NULL;
    if (rest[hl] != '/')
        return "needs the path /ACCOUNT/NAME";
    acct = rest + hl + 1;
    name = strchr(acct, '/');
    if (!name || name == acct)
        return "needs the path /ACCOUNT/NAME";
    for (const char *p = acct; p < name; p++)
        if (!isalnum((unsigned char)*p))
            return "has an account that is not letters and digits";
    name++;
    nl = strlen(name);
    *fifo = nl > 5 && strcmp(name + nl - 5, ".fifo") == 0;
    if (nl == 0 || nl > 80)
        return "needs a queue name of 1 to 80 characters";
    for (size_t i = 0; i < nl - (*fifo ? 5 : 0); i++)
        if (!isalnum((unsigned char)name[i]) && name[i] != '_' && name[i] != '-')
            return "has a queue name that is not letters, digits, '_' and '-' (and .fifo)";
    return NULL;
}

/* An Amazon SQS input (transport = "sqs"): its settings and what it cannot
 * be. */
static idemq_err_t validate_sqs(struct conf_input *in, int line, const char *file,
                                char *errbuf, size_t errlen)
{
    const char *why;
    bool dlq_fifo = false;
    if (strcmp(in->transport, "sqs"))
        return IDEMQ_OK;
    if (!in->queue_url[0] || !in->region[0]) {
        errf(errbuf, errlen, "%s:%d: input %s: an sqs input needs queue_url and region", file,
             line, in->name);
        return IDEMQ_ERR_CONFIG;
    }
    if ((why = sqs_url_problem(in->queue_url, true, &in->sqs_fifo, in->endpoint[0] != '\0'))) {
        errf(errbuf, errlen, "%s:%d: input %s: queue_url %s", file, line, in->name, why);
        return IDEMQ_ERR_CONFIG;
    }
    for (const char *p = in->region; *p; p++) {
        if (!islower((unsigned char)*p) && !isdigit((unsigned char)*p) && *p != '-') {
            errf(errbuf, errlen, "%s:%d: input %s: region must be lower-case letters, digits "
                 "and '-' (e.g. eu-west-1), not \"%s\"", file, line, in->name, in->region);
            return IDEMQ_ERR_CONFIG;
        }
    }
    if (in->endpoint[0] && (why = sqs_url_problem(in->endpoint, false, &dlq_fifo, false))) {
        errf(errbuf, errlen, "%s:%d: input %s: endpoint %s", file, line, in->name, why);
        return IDEMQ_ERR_CONFIG;
    }
    if (in->dead_letter_queue_url[0]) {
        if ((why = sqs_url_problem(in->dead_letter_queue_url, true, &dlq_fifo,
                                   in->endpoint[0] != '\0'))) {
            errf(errbuf, errlen, "%s:%d: input %s: dead_letter_queue_url %s", file, line,
                 in->name, why);
            return IDEMQ_ERR_CONFIG;
        }
        if (dlq_fifo != in->sqs_fifo || strcmp(in->dead_letter_queue_url, in->queue_url) == 0) {
            errf(errbuf, errlen, "%s:%d: input %s: dead_letter_queue_url must be another queue, "
                 "FIFO (.fifo) exactly when queue_url is", file, line, in->name);
            return IDEMQ_ERR_CONFIG;
        }
    }
    if (in->key_kind != CONF_KEY_JSON || in->exchange[0] || in->routing_key[0] ||
        CONF_INPUT_ORDERED(in) || in->celery || in->observe ||
        in->emits || strcmp(in->queue_type, "classic") || in->order_key_source[0]) {
        errf(errbuf, errlen, "%s:%d: input %s: an sqs input takes key_source json:<field> (a "
             "message id differs between two sends of one job), and no exchange, routing_key, "
             "queue_type, partitions, order_key_source (a FIFO queue's MessageGroupId is the "
             "order key), provider, protocol = \"celery\", mode = \"observe\" or emits (not "
             "yet)", file, line, in->name);
        return IDEMQ_ERR_CONFIG;
    }
    return IDEMQ_OK;
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

        in->line = line;
        in->index = i;
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
        if ((err = validate_transport(in, line, file, errbuf, errlen)) != IDEMQ_OK ||
            (err = validate_sqs(in, line, file, errbuf, errlen)) != IDEMQ_OK)
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

/* Each URL starts with amqp:// or amqps://. The message names the item,
 * never the URL: a value that is not a URL cannot be redacted reliably. */
static idemq_err_t check_url(const char *url, int item, const char *where_, char *errbuf,
                             size_t errlen)
{
    if ((strncmp(url, "amqp://", 7) && strncmp(url, "amqps://", 8)) && item < 0) {
        errf(errbuf, errlen, "%s: the URL must start with amqp:// or amqps:// "
             "(not shown: it may hold a password)", where_);
        return IDEMQ_ERR_CONFIG;
    }
    if (strncmp(url, "amqp://", 7) && strncmp(url, "amqps://", 8)) {
        errf(errbuf, errlen, "%s: broker.url: URL %d must start with amqp:// or amqps:// "
             "(not shown: it may hold a password)", where_, item + 1);
        return IDEMQ_ERR_CONFIG;
    }
    return IDEMQ_OK;
}

/* Splits every entry of l holding commas into its comma-separated URLs (the
 * form IDEMQ_AMQP_URL takes), blanks around them dropped; an empty item is
 * refused. */
static idemq_err_t split_urls(struct conf_strlist *l, const char *where_, char *errbuf,
                              size_t errlen)
{
    struct conf_strlist out = {0};
    idemq_err_t err = IDEMQ_OK;

    for (int i = 0; i < l->n && !err; i++) {
        const char *p = l->v[i];
        for (;;) {
            const char *end = strchr(p, ',');
            size_t n = end ? (size_t)(end - p) : strlen(p);
            char *item;
            while (n && isspace((unsigned char)*p))
                p++, n--;
            while (n && isspace((unsigned char)p[n - 1]))
                n--;
            if (n == 0) {
                errf(errbuf, errlen, "%s: broker.url holds an empty URL (a comma with nothing "
                     "between, before or after it)", where_);
                err = IDEMQ_ERR_CONFIG;
                break;
            }
            if (!(item = strndup(p, n))) {
                err = IDEMQ_ERR_NOMEM;
                break;
            }
            err = strlist_push(&out, item);
            free(item);
            if (err || !end)
                break;
            p = end + 1;
        }
    }
    if (!err && out.n > 8) {
        errf(errbuf, errlen, "%s: broker.url must have 1 to 8 URLs, not %d", where_, out.n);
        err = IDEMQ_ERR_CONFIG;
    }
    if (err) {
        strlist_clear(&out);
        return err;
    }
    strlist_clear(l);
    *l = out;
    return IDEMQ_OK;
}

static idemq_err_t apply_env(struct conf *c, char *errbuf, size_t errlen)
{
    const char *url = getenv("IDEMQ_AMQP_URL");
    const char *dsn = getenv("IDEMQ_PG_DSN");

    if (url && *url) {
        struct conf_strlist env = {0};
        idemq_err_t err = strlist_push(&env, url);
        if (!err)
            err = split_urls(&env, "IDEMQ_AMQP_URL", errbuf, errlen);
        for (int i = 0; !err && i < env.n; i++)
            err = check_url(env.v[i], i, "IDEMQ_AMQP_URL", errbuf, errlen);
        if (err) {
            strlist_clear(&env);
            return err;
        }
        strlist_clear(&c->urls);
        c->urls = env;
    }
    if (dsn && *dsn && set_string(&c->dsn, dsn) != IDEMQ_OK)
        return IDEMQ_ERR_NOMEM;
    return IDEMQ_OK;
}

/* protection.keys entries are id=/absolute/path with unique ids of
 * letters, digits, '-' and '_'; protection.active names one of them. The
 * files are read by protect_load (consumer/protect.h), not here. */
static idemq_err_t validate_protection(const struct conf *c, const char *file, char *errbuf,
                                       size_t errlen)
{
    bool active_found = !c->protection_active[0];
    for (int i = 0; i < c->protection_keys.n; i++) {
        const char *e = c->protection_keys.v[i], *eq = strchr(e, '=');
        size_t idlen = eq ? (size_t)(eq - e) : 0;
        if (!e[0] && c->protection_keys.n == 1)
            break; /* the default: none */
        if (!eq || idlen == 0 || idlen > 32 || strspn(e, "abcdefghijklmnopqrstuvwxyz"
                                                     "ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_") !=
                                                   idlen ||
            eq[1] != '/') {
            errf(errbuf, errlen,
                 "%s: protection.keys[%d] must be \"id=/absolute/path\" (an id of 1 to 32 "
                 "letters, digits, - or _), not \"%s\"",
                 file, i, e);
            return IDEMQ_ERR_CONFIG;
        }
        for (int k = 0; k < i; k++)
            if (strncmp(c->protection_keys.v[k], e, idlen + 1) == 0) {
                errf(errbuf, errlen, "%s: protection.keys names key %.*s twice", file,
                     (int)idlen, e);
                return IDEMQ_ERR_CONFIG;
            }
        if (!active_found && strlen(c->protection_active) == idlen &&
            strncmp(c->protection_active, e, idlen) == 0)
            active_found = true;
    }
    if (!active_found) {
        errf(errbuf, errlen, "%s: protection.active names key \"%s\", which protection.keys "
             "does not list", file, c->protection_active);
        return IDEMQ_ERR_CONFIG;
    }
    return IDEMQ_OK;
}

static idemq_err_t validate_retry(struct conf *c, const config_t *cfg, const char *file,
                                  char *errbuf, size_t errlen)
{
    const struct conf_strlist *lists[2] = {&c->retry_sqlstates, &c->park_sqlstates};
    char at[4200];
    if (c->base_delay_ms > c->max_delay_ms) {
        errf(errbuf, errlen, "%s: retry.base_delay_ms (%d) must not exceed retry.max_delay_ms (%d)",
             where(at, sizeof at, file, cfg,
                   line_of(cfg, "retry.base_delay_ms") ? "retry.base_delay_ms"
                                                       : "retry.max_delay_ms"),
             c->base_delay_ms, c->max_delay_ms);
        return IDEMQ_ERR_CONFIG;
    }
    if ((c->jitter_mode = backoff_jitter_parse(c->jitter)) < 0) {
        errf(errbuf, errlen, "%s: retry.jitter must be none, full or equal, not \"%s\"",
             where(at, sizeof at, file, cfg, "retry.jitter"), c->jitter);
        return IDEMQ_ERR_CONFIG;
    }
    for (int l = 0; l < 2; l++)
        for (int i = 0; i < lists[l]->n; i++)
            if (!classify_valid_code(lists[l]->v[i])) {
                const char *name = l ? "park_sqlstates" : "retry_sqlstates";
                char path[64];
                snprintf(path, sizeof path, "retry.%s", name);
                errf(errbuf, errlen,
                     "%s: retry.%s: \"%s\" is not a SQLSTATE (5 of 0-9A-Z) or class (2)",
                     where(at, sizeof at, file, cfg, path), name, lists[l]->v[i]);
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
static idemq_err_t validate_ledger(struct conf *c, const config_t *cfg, const char *file,
                                   char *errbuf, size_t errlen)
{
    double iv = conf_parse_interval(c->partition_interval);
    char at[4200];
    if (iv < 10) {
        errf(errbuf, errlen, "%s: ledger.partition_interval must read \"N seconds|minutes|hours|"
             "days\" (at least 10 seconds), not \"%s\"",
             where(at, sizeof at, file, cfg, "ledger.partition_interval"), c->partition_interval);
        return IDEMQ_ERR_CONFIG;
    }
    c->partition_interval_s = iv;
    if (c->history_hot_days * 86400.0 < iv) {
        errf(errbuf, errlen, "%s: ledger.history_hot_days (%g) must cover at least one "
             "ledger.partition_interval (%s)",
             where(at, sizeof at, file, cfg,
                   line_of(cfg, "ledger.history_hot_days") ? "ledger.history_hot_days"
                                                           : "ledger.partition_interval"),
             c->history_hot_days, c->partition_interval);
        return IDEMQ_ERR_CONFIG;
    }
    if (c->history_retention_days < c->dedup_window_days ||
        c->history_retention_days < c->history_hot_days) {
        errf(errbuf, errlen, "%s: ledger.history_retention_days (%g) must be at least "
             "ledger.dedup_window_days (%g) and ledger.history_hot_days (%g): the history that "
             "explains a key outlives its claim",
             where(at, sizeof at, file, cfg,
                   line_of(cfg, "ledger.history_retention_days")
                       ? "ledger.history_retention_days"
                       : line_of(cfg, "ledger.dedup_window_days") ? "ledger.dedup_window_days"
                                                                  : "ledger.history_hot_days"),
             c->history_retention_days,
             c->dedup_window_days, c->history_hot_days);
        return IDEMQ_ERR_CONFIG;
    }
    return IDEMQ_OK;
}

/* Operations: TLS, topology verification, log format, the
 * liveness window and quorum delivery limits, checked against each other. */
static idemq_err_t validate_ops(struct conf *c, const config_t *cfg, const char *file,
                                char *errbuf, size_t errlen)
{
    long long stall_ms = (long long)c->live_stall_s * 1000;
    char at[4200];

    if (strcmp(c->tls_verify, "full") && strcmp(c->tls_verify, "none")) {
        errf(errbuf, errlen, "%s: broker.tls.verify must be \"full\" or \"none\", not \"%s\"",
             where(at, sizeof at, file, cfg, "broker.tls.verify"), c->tls_verify);
        return IDEMQ_ERR_CONFIG;
    }
    c->tls_verify_off = strcmp(c->tls_verify, "none") == 0;
    if (!c->tls_cert_file[0] != !c->tls_key_file[0]) {
        errf(errbuf, errlen, "%s: broker.tls.cert_file and broker.tls.key_file go together "
             "(a client certificate needs its key)", where(at, sizeof at, file, cfg, line_of(cfg, "broker.tls.cert_file") ? "broker.tls.cert_file" : "broker.tls.key_file"));
        return IDEMQ_ERR_CONFIG;
    }
    if (strcmp(c->topology_verify, "full") && strcmp(c->topology_verify, "passive")) {
        errf(errbuf, errlen, "%s: topology.verify must be \"full\" or \"passive\", not \"%s\"",
             where(at, sizeof at, file, cfg, "topology.verify"), c->topology_verify);
        return IDEMQ_ERR_CONFIG;
    }
    c->topology_passive = strcmp(c->topology_verify, "passive") == 0;
    if (c->metrics_listen[0]) {
        char ip[16];
        int port;
        if (!conf_listen_parse(c->metrics_listen, ip, &port)) {
            errf(errbuf, errlen, "%s: metrics.listen \"%s\" must be IPv4:port with a numeric "
                 "address, e.g. 127.0.0.1:9187 (or 0.0.0.0:9187 for every address); "
                 "empty = off", where(at, sizeof at, file, cfg, "metrics.listen"), c->metrics_listen);
            return IDEMQ_ERR_CONFIG;
        }
    }
    if (c->console_listen[0]) {
        char ip[16];
        int port;
        if (!conf_listen_parse(c->console_listen, ip, &port)) {
            errf(errbuf, errlen, "%s: console.listen \"%s\" must be IPv4:port with a numeric "
                 "address, e.g. 127.0.0.1:9188; empty = off", where(at, sizeof at, file, cfg, "console.listen"), c->console_listen);
            return IDEMQ_ERR_CONFIG;
        }
        if (strcmp(c->console_listen, c->metrics_listen) == 0) {
            errf(errbuf, errlen, "%s: console.listen and metrics.listen must differ (%s)", where(at, sizeof at, file, cfg, "console.listen"),
                 c->console_listen);
            return IDEMQ_ERR_CONFIG;
        }
    }
    if (c->tracing_endpoint[0] && strncmp(c->tracing_endpoint, "http://", 7) != 0 &&
        strncmp(c->tracing_endpoint, "https://", 8) != 0) {
        errf(errbuf, errlen, "%s: tracing.endpoint must be an http:// or https:// URL (OTLP/HTTP, "
             "e.g. http://127.0.0.1:4318/v1/traces); empty = off",
             where(at, sizeof at, file, cfg, "tracing.endpoint"));
        return IDEMQ_ERR_CONFIG;
    }
    if (c->tracing_batch_max > c->tracing_queue_max) {
        errf(errbuf, errlen, "%s: tracing.batch_max (%d) must not exceed tracing.queue_max (%d)",
             where(at, sizeof at, file, cfg, "tracing.batch_max"), c->tracing_batch_max,
             c->tracing_queue_max);
        return IDEMQ_ERR_CONFIG;
    }
    if (strcmp(c->log_format, "text") && strcmp(c->log_format, "json")) {
        errf(errbuf, errlen, "%s: log.format must be \"text\" or \"json\", not \"%s\"", where(at, sizeof at, file, cfg, "log.format"),
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
                 where(at, sizeof at, file, cfg, "metrics.live_stall_s"), c->live_stall_s, db_ms, c->heartbeat, c->connect_timeout_ms,
                 provider_ms);
            return IDEMQ_ERR_CONFIG;
        }
    }
    for (int i = 0; i < c->n_inputs; i++) {
        const struct conf_input *in = &c->inputs[i];
        if (strcmp(in->queue_type, "quorum") == 0 &&
            (long long)in->delivery_limit < 2LL * c->max_attempts) {
            errf(errbuf, errlen, "%s:%d: input %s: delivery_limit (%d) must be at least twice "
                 "retry.max_attempts (%d), so idemq parks a failing job before the broker "
                 "dead-letters it", file, in->line, in->name, in->delivery_limit,
                 c->max_attempts);
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
    char at[4200];
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
             strcmp(name, "console") && strcmp(name, "tracing") &&
             strcmp(name, "protection"))) {
            errf(errbuf, errlen, "%s:%d: unknown setting %s (top level holds broker, database, "
                 "consumer, retry, metrics, log, topology, ledger, outbox, console, tracing, "
                 "protection and inputs)", file,
                 config_setting_source_line(s), name);
            err = IDEMQ_ERR_CONFIG;
            goto fail;
        }
        err = read_group(s, name, global_keys, N_GLOBAL, c, file, errbuf, errlen);
        if (err)
            goto fail;
    }
    where(at, sizeof at, file, cfg, "broker.url");
    if ((err = split_urls(&c->urls, at, errbuf, errlen)) != IDEMQ_OK)
        goto fail;
    for (int i = 0; i < c->urls.n; i++)
        if ((err = check_url(c->urls.v[i], i, at, errbuf, errlen)) != IDEMQ_OK)
            goto fail;
    if (c->console_operator_broker_url[0] &&
        (err = check_url(c->console_operator_broker_url, -1,
                         where(at, sizeof at, file, cfg, "console.operator_broker_url"), errbuf,
                         errlen)) != IDEMQ_OK)
        goto fail;
    if (log_level_parse(c->log_level) < 0) {
        errf(errbuf, errlen, "%s: log.level must be error, warn, info or debug, not \"%s\"",
             where(at, sizeof at, file, cfg, "log.level"), c->log_level);
        err = IDEMQ_ERR_CONFIG;
        goto fail;
    }
    if ((err = validate_retry(c, cfg, file, errbuf, errlen)) != IDEMQ_OK)
        goto fail;
    if ((err = validate_ledger(c, cfg, file, errbuf, errlen)) != IDEMQ_OK)
        goto fail;
    if ((err = validate_protection(c, file, errbuf, errlen)) != IDEMQ_OK)
        goto fail;
    if ((err = read_inputs(cfg, c, file, errbuf, errlen)) != IDEMQ_OK)
        goto fail;
    if ((err = validate_limits(c, cfg, file, errbuf, errlen)) != IDEMQ_OK)
        goto fail;
    if ((err = apply_env(c, errbuf, errlen)) != IDEMQ_OK)
        goto fail;
    if ((err = validate_ops(c, cfg, file, errbuf, errlen)) != IDEMQ_OK)
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

/* libconfig's syntax in plain words, after its own "syntax error". */
#define CONF_SYNTAX_HELP                                                                     \
    " (libconfig syntax: a setting is name = value; a group is name: { ... }; the inputs "    \
    "are a list ( { ... }, { ... } ) with a ',' between groups; a list of strings is "        \
    "[ \"a\", \"b\" ]; strings need double quotes, numbers and true/false take none; the "    \
    "mistake is often an unquoted string, a missing ',' between inputs, or a quote or brace " \
    "left open on this line or the one before)"

/* Parses text (from_file: a path) into a new config_t and loads it; the
 * conf keeps the config_t for the line numbers of conf_lint. */
static idemq_err_t load_from(const char *text, bool from_file, struct conf **out, char *errbuf,
                             size_t errlen)
{
    const char *file = from_file ? text : "<string>";
    config_t *cfg = malloc(sizeof *cfg);
    idemq_err_t err;

    *out = NULL;
    if (!cfg) {
        errf(errbuf, errlen, "%s: out of memory while loading", file);
        return IDEMQ_ERR_NOMEM;
    }
    config_init(cfg);
    if (!(from_file ? config_read_file(cfg, text) : config_read_string(cfg, text))) {
        if (from_file && config_error_type(cfg) == CONFIG_ERR_FILE_IO)
            errf(errbuf, errlen, "%s: cannot read: %s", file, strerror(errno));
        else
            errf(errbuf, errlen, "%s:%d: syntax error: %s%s", file, config_error_line(cfg),
                 config_error_text(cfg), CONF_SYNTAX_HELP);
        config_destroy(cfg);
        free(cfg);
        return IDEMQ_ERR_CONFIG;
    }
    err = load(cfg, file, out, errbuf, errlen);
    if (err) {
        config_destroy(cfg);
        free(cfg);
    } else {
        (*out)->src = cfg;
    }
    return err;
}

idemq_err_t conf_load(const char *path, struct conf **out, char *errbuf, size_t errlen)
{
    return load_from(path, true, out, errbuf, errlen);
}

idemq_err_t conf_load_string(const char *text, struct conf **out, char *errbuf, size_t errlen)
{
    return load_from(text, false, out, errbuf, errlen);
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
    free_inputs(c->sqs_inputs, c->n_sqs_inputs);
    free_strings(global_keys, N_GLOBAL, c);
    free(c->path);
    if (c->src) {
        config_destroy(c->src);
        free(c->src);
    }
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

/* True if a query parameter name looks like it carries a secret
 * (password, sslpassword, token, api_key, secret, auth, signature, ...). */
static bool secret_param(const char *name, size_t n)
{
    static const char *const words[] = {"pass", "secret", "token", "key", "auth", "sig",
                                         "cred"};
    for (size_t w = 0; w < sizeof words / sizeof words[0]; w++) {
        size_t wl = strlen(words[w]);
        for (size_t i = 0; i + wl <= n; i++)
            if (strncasecmp(name + i, words[w], wl) == 0)
                return true;
    }
    return false;
}

/* Copies the URL s..end (s starts with its scheme, scheme_end is its "://")
 * with the password of user:password@ and the values of secret-looking
 * query parameters replaced by ***. The user information ends at the last
 * '@' of the URL, so a password holding '@' or '/' is covered whole. */
static void redact_url(const char *s, const char *scheme_end, const char *end, char *buf,
                       size_t buflen, size_t *o)
{
    const char *auth = scheme_end + 3;
    const char *at = NULL, *colon = NULL, *p = s, *q;

    for (q = auth; q < end; q++)
        if (*q == '@')
            at = q;
    for (q = auth; at && q < at; q++)
        if (*q == ':') {
            colon = q;
            break;
        }
    if (at && colon) {
        put(buf, buflen, o, s, (size_t)(colon + 1 - s));
        put(buf, buflen, o, "***", 3);
        p = at;
    }
    while (p < end && *p != '?')
        put(buf, buflen, o, p++, 1);
    while (p < end) { /* ?name=value&name=value (or ;) */
        const char *name = ++p - 1, *eq;
        put(buf, buflen, o, name, 1);
        for (eq = p; eq < end && *eq != '=' && *eq != '&' && *eq != ';'; eq++)
            ;
        put(buf, buflen, o, p, (size_t)(eq - p));
        if (eq < end && *eq == '=') {
            bool hide = secret_param(p, (size_t)(eq - p));
            put(buf, buflen, o, "=", 1);
            for (p = eq + 1; p < end && *p != '&' && *p != ';'; p++)
                if (!hide)
                    put(buf, buflen, o, p, 1);
            if (hide)
                put(buf, buflen, o, "***", 3);
        } else {
            p = eq;
        }
    }
}

char *conf_redact(const char *s, char *buf, size_t buflen)
{
    const char *scheme = url_scheme_end(s);
    const char *p = s;
    size_t o = 0;

    if (!buflen)
        return buf;
    if (scheme) { /* a URL, or a comma-separated list of them: each item on its own */
        while (*p) {
            const char *end = strchr(p, ',');
            const char *sch;
            if (!end)
                end = p + strlen(p);
            if ((sch = url_scheme_end(p)) && sch < end)
                redact_url(p, sch, end, buf, buflen, &o);
            else
                put(buf, buflen, &o, p, (size_t)(end - p));
            p = end;
            if (*p)
                put(buf, buflen, &o, p++, 1);
        }
        buf[o] = '\0';
        return buf;
    }
    if (!strchr(s, '=') && strchr(s, '@')) { /* neither a URL nor a DSN: "user:pass@host" */
        const char *at = strrchr(s, '@');
        const char *colon = memchr(s, ':', (size_t)(at - s));
        if (colon) {
            put(buf, buflen, &o, s, (size_t)(colon + 1 - s));
            put(buf, buflen, &o, "***", 3);
            p = at;
        }
    }
    while (*p) { /* key=value DSN: replace the value of password= (and sslpassword=) */
        size_t kw = strncasecmp(p, "password", 8) == 0      ? 8
                    : strncasecmp(p, "sslpassword", 11) == 0 ? 11
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

bool conf_outbox_note(const struct conf *c, char *buf, size_t len)
{
    if (len)
        buf[0] = '\0';
    if (!c->outbox_relay)
        return false;
    snprintf(buf, len,
             "outbox.relay = 1: the broker user of idemq run needs write permission on every "
             "exchange that idemq.emit names (the rows decide it at run time, so it cannot be "
             "listed here; the default exchange '' is amq.default, which that user should not "
             "write: emit to a named exchange); a publish the broker refuses (403 "
             "ACCESS_REFUSED names the exchange) counts an attempt and the row is parked after "
             "outbox.max_attempts (%d) with that reason (idemq parked list)",
             c->outbox_max_attempts);
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
    int nall = c->n_inputs + c->n_pg_inputs + c->n_sqs_inputs;
    for (int j = 0; j < nall; j++) {
        /* broker inputs, then the PostgreSQL queue inputs, then SQS's */
        const struct conf_input *in =
            j < c->n_inputs ? &c->inputs[j]
            : j < c->n_inputs + c->n_pg_inputs ? &c->pg_inputs[j - c->n_inputs]
                                               : &c->sqs_inputs[j - c->n_inputs - c->n_pg_inputs];
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
        fprintf(out, "  }%s\n", j + 1 < nall ? "," : "");
    }
    fprintf(out, ");\n");
}

/* ---- check-config's offline checks (conf_lint) ---- */

/* "FILE:LINE" of global setting path for conf_lint: "FILE (default)" when
 * the file does not hold it. */
static const char *lint_at(const struct conf *c, const char *path, char *buf, size_t len)
{
    int line = line_of(c->src, path);
    if (line > 0)
        snprintf(buf, len, "%s:%d", c->path, line);
    else
        snprintf(buf, len, "%s (default of %s)", c->path, path);
    return buf;
}

/* "FILE:LINE" of setting key of input in, else of the input's group. */
static const char *lint_input_at(const struct conf *c, const struct conf_input *in,
                                 const char *key, char *buf, size_t len)
{
    const config_setting_t *list = c->src ? config_lookup(c->src, "inputs") : NULL;
    config_setting_t *g = list ? config_setting_get_elem(list, (unsigned)in->index) : NULL;
    const config_setting_t *s = g ? config_setting_lookup(g, key) : NULL;
    snprintf(buf, len, "%s:%d", c->path, s ? (int)config_setting_source_line(s) : in->line);
    return buf;
}

/* True if the file sets key in input in. */
static bool lint_input_has(const struct conf *c, const struct conf_input *in, const char *key)
{
    const config_setting_t *list = c->src ? config_lookup(c->src, "inputs") : NULL;
    config_setting_t *g = list ? config_setting_get_elem(list, (unsigned)in->index) : NULL;
    return g && config_setting_lookup(g, key) != NULL;
}

static void lint_error(FILE *out, int *errors, const char *at, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static void lint_error(FILE *out, int *errors, const char *at, const char *fmt, ...)
{
    va_list ap;
    fprintf(out, "idemq: %s: ", at);
    va_start(ap, fmt);
    vfprintf(out, fmt, ap);
    va_end(ap);
    fputc('\n', out);
    (*errors)++;
}

static void lint_warn(FILE *out, const char *at, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void lint_warn(FILE *out, const char *at, const char *fmt, ...)
{
    va_list ap;
    fprintf(out, "# warning: %s: ", at);
    va_start(ap, fmt);
    vfprintf(out, fmt, ap);
    va_end(ap);
    fputc('\n', out);
}

/* A file setting: it must exist and be a regular file; a secret must not
 * be readable by every user (an error) nor by the group (a warning: a
 * service group may be meant). */
static void lint_file(FILE *out, int *errors, const char *at, const char *setting,
                      const char *path, bool secret)
{
    struct stat st;
    if (!path[0])
        return;
    if (stat(path, &st) != 0) {
        lint_error(out, errors, at, "%s: %s: %s", setting, path, strerror(errno));
        return;
    }
    if (!S_ISREG(st.st_mode)) {
        lint_error(out, errors, at, "%s: %s is not a regular file", setting, path);
        return;
    }
    if (secret && (st.st_mode & (S_IROTH | S_IWOTH)))
        lint_error(out, errors, at, "%s: %s holds a secret and every user may read it (mode "
                   "%04o): chmod 600, or 640 with the service's group", setting, path,
                   (unsigned)(st.st_mode & 07777));
    else if (secret && (st.st_mode & (S_IRGRP | S_IWGRP)))
        lint_warn(out, at, "%s: %s holds a secret and its group (gid %u) may read it (mode "
                  "%04o): fine if that group is the service's, else chmod 600", setting, path,
                  (unsigned)st.st_gid, (unsigned)(st.st_mode & 07777));
    if (access(path, R_OK) != 0)
        lint_warn(out, at, "%s: %s is not readable by the user running check-config (%s); "
                  "check that the service's user can read it", setting, path, strerror(errno));
}

/* A header a producer's key can never arrive in: the broker's and idemq's
 * own (a producer's x-idemq-* is stripped or parks as forged). */
static bool header_reserved(const char *h)
{
    return strncasecmp(h, "x-idemq-", 8) == 0 || strcasecmp(h, "x-death") == 0 ||
           strcasecmp(h, "x-delivery-count") == 0 || strcasecmp(h, "x-acquired-count") == 0 ||
           strncasecmp(h, "x-first-death-", 14) == 0 || strncasecmp(h, "x-last-death-", 13) == 0;
}

/* A key or order-key source that can never match what a producer sends. */
static void lint_source(const struct conf *c, const struct conf_input *in, const char *key,
                        const char *src, FILE *out, int *errors)
{
    char at[4200];
    if (strncmp(src, "header:", 7) == 0 && header_reserved(src + 7))
        lint_error(out, errors, lint_input_at(c, in, key, at, sizeof at),
                   "input %s: %s \"%s\": the broker or idemq sets that header, a producer's "
                   "key never arrives in it (every message would park as missing its key)",
                   in->name, key, src);
    else if ((strncmp(src, "json:", 5) == 0 || strncmp(src, "header:", 7) == 0 ||
              strncmp(src, "kwarg:", 6) == 0) &&
             strpbrk(src, " \t\r\n"))
        lint_error(out, errors, lint_input_at(c, in, key, at, sizeof at),
                   "input %s: %s \"%s\" holds a blank: no producer's field or header is named "
                   "so (every message would park as missing its key)", in->name, key, src);
    else if (strncmp(src, "json:", 5) == 0 && strpbrk(src + 5, ".[]"))
        lint_warn(out, lint_input_at(c, in, key, at, sizeof at),
                  "input %s: %s \"%s\" names a top-level field called literally \"%s\"; "
                  "nested fields are not looked up", in->name, key, src, src + 5);
}

/* The binding of an input: keys that can never match a published message. */
static void lint_binding(const struct conf *c, const struct conf_input *in, FILE *out)
{
    char at[4200];
    const char *rk = in->routing_key;
    if (!rk[0] || in->partitions > 0)
        return;
    lint_input_at(c, in, "routing_key", at, sizeof at);
    if (!in->exchange[0])
        lint_warn(out, at, "input %s: routing_key \"%s\" binds nothing: exchange is empty (the "
                  "queue gets only what is published to it by name)", in->name, rk);
    else if (strcmp(in->exchange_type, "fanout") == 0)
        lint_warn(out, at, "input %s: routing_key \"%s\" is ignored by a fanout exchange (every "
                  "message published to %s arrives)", in->name, rk, in->exchange);
    else if (strcmp(in->exchange_type, "direct") == 0 && strpbrk(rk, "*#"))
        lint_warn(out, at, "input %s: routing_key \"%s\" on a direct exchange matches only that "
                  "literal key; '*' and '#' are wildcards of topic exchanges only", in->name, rk);
    else if (strcmp(in->exchange_type, "topic") == 0 &&
             (rk[0] == '.' || rk[strlen(rk) - 1] == '.' || strstr(rk, "..")))
        lint_warn(out, at, "input %s: routing_key \"%s\" has an empty word (a leading, trailing "
                  "or doubled '.'): only keys with that empty word match it", in->name, rk);
}

/* True if host is an IPv4 or IPv6 literal. */
static bool host_is_ip(const char *host)
{
    struct in6_addr a6;
    char h[64];
    if (host[0] == '[')
        return true;
    snprintf(h, sizeof h, "%s", host);
    return inet_pton(AF_INET, h, &a6) == 1 || inet_pton(AF_INET6, h, &a6) == 1;
}

/* The vhost part of an AMQP URL: NULL if the URL has no path (the default
 * vhost "/"), else the text after the '/' that ends the authority, up to '?'. */
static const char *url_vhost(const char *url, size_t *len)
{
    const char *h = strstr(url, "://"), *at, *slash;
    h = h ? h + 3 : url;
    at = strrchr(h, '@');
    if (at)
        h = at + 1;
    slash = strchr(h, '/');
    if (!slash)
        return NULL;
    *len = strcspn(slash + 1, "?#");
    return slash + 1;
}

static void lint_broker(const struct conf *c, FILE *out, int *errors)
{
    char at[4200];
    bool amqps = false;
    lint_at(c, "broker.url", at, sizeof at);
    for (int i = 0; i < c->urls.n; i++) {
        const char *u = c->urls.v[i];
        char host[256];
        size_t vlen = 0;
        const char *vh = url_vhost(u, &vlen);
        url_host(u, host, sizeof host);
        if (strncmp(u, "amqps://", 8) == 0) {
            amqps = true;
            if (!c->tls_verify_off && host_is_ip(host))
                lint_error(out, errors, at, "broker.url: URL %d is amqps:// to the IP address "
                           "%s: librabbitmq-c verifies the host name only against the "
                           "certificate's DNS names, so every connect would fail; use the name "
                           "in the broker's certificate", i + 1, host);
        }
        if (!c->vhost[0] && vh && vlen == 0)
            lint_error(out, errors, at, "broker.url: URL %d (host %s) ends in a bare \"/\", "
                       "which names the empty vhost; RabbitMQ refuses it (530 NOT_ALLOWED): "
                       "write /%%2F for the vhost \"/\", or /NAME", i + 1, host);
    }
    if (amqps) {
        lint_file(out, errors, lint_at(c, "broker.tls.ca_file", at, sizeof at),
                  "broker.tls.ca_file", c->tls_ca_file, false);
        lint_file(out, errors, lint_at(c, "broker.tls.cert_file", at, sizeof at),
                  "broker.tls.cert_file", c->tls_cert_file, false);
        lint_file(out, errors, lint_at(c, "broker.tls.key_file", at, sizeof at),
                  "broker.tls.key_file", c->tls_key_file, true);
    } else if (c->tls_cert_file[0] || c->tls_key_file[0]) {
        lint_warn(out, lint_at(c, "broker.tls.cert_file", at, sizeof at),
                  "broker.tls.cert_file and key_file are set but no broker.url is amqps://: "
                  "they are not used");
    }
}

/* The DSN: a key=value string or a postgresql:// / postgres:// URL. */
static void lint_dsn(const struct conf *c, FILE *out, int *errors)
{
    char at[4200];
    const char *d = c->dsn;
    const char *sch = url_scheme_end(d);
    lint_at(c, "database.dsn", at, sizeof at);
    if (sch) {
        const char *b = d;
        while (dsn_blank(*b))
            b++;
        if (!((sch - b == 10 && strncmp(b, "postgresql", 10) == 0) ||
              (sch - b == 8 && strncmp(b, "postgres", 8) == 0)))
            lint_error(out, errors, at, "database.dsn: the scheme \"%.*s://\" is not one libpq "
                       "knows: write postgresql:// or postgres://", (int)(sch - b), b);
    } else if (d[0] && !strchr(d, '=')) {
        lint_error(out, errors, at, "database.dsn is neither key=value pairs (host=... "
                   "dbname=...) nor a postgresql:// URL (a scheme needs \"://\"); not shown: it "
                   "may hold a password");
    }
}

int conf_lint(const struct conf *c, FILE *out)
{
    char at[4200];
    int errors = 0;
    char ip[16];
    int port;

    lint_broker(c, out, &errors);
    lint_dsn(c, out, &errors);
    if (c->console_listen[0] && conf_listen_parse(c->console_listen, ip, &port) &&
        strncmp(ip, "127.", 4) != 0 && !c->console_token_file[0])
        lint_warn(out, lint_at(c, "console.listen", at, sizeof at),
                  "console.listen %s is beyond loopback but console.token_file is empty: "
                  "the console answers only loopback clients, so nobody elsewhere can use it; "
                  "set a token file, or listen on 127.0.0.1", c->console_listen);
    lint_file(out, &errors, lint_at(c, "console.token_file", at, sizeof at),
              "console.token_file", c->console_token_file, true);
    if (c->prefetch < c->batch_max)
        lint_warn(out, lint_at(c, "broker.prefetch", at, sizeof at),
                  "broker.prefetch (%d) is below consumer.batch_max (%d): a consumer never has "
                  "more than prefetch deliveries, so batches stay smaller than batch_max and "
                  "each waits consumer.batch_wait_ms for deliveries that cannot come",
                  c->prefetch, c->batch_max);
    for (int i = 0; i < c->n_inputs; i++) {
        const struct conf_input *in = &c->inputs[i];
        lint_source(c, in, "key_source", in->key_source, out, &errors);
        if (in->order_key_source[0])
            lint_source(c, in, "order_key_source", in->order_key_source, out, &errors);
        lint_binding(c, in, out);
        if (in->emits && !c->outbox_relay)
            lint_error(out, &errors, lint_input_at(c, in, "emits", at, sizeof at),
                       "input %s: emits = true needs outbox.relay = 1: without a relay the "
                       "messages its effect emits are never published", in->name);
        if (strcmp(in->queue_type, "quorum") != 0 && lint_input_has(c, in, "delivery_limit"))
            lint_warn(out, lint_input_at(c, in, "delivery_limit", at, sizeof at),
                      "input %s: delivery_limit applies to quorum queues only; queue_type is "
                      "\"%s\", so it is ignored", in->name, in->queue_type);
        if (!CONF_INPUT_PROVIDER(in) && lint_input_has(c, in, "provider"))
            lint_warn(out, lint_input_at(c, in, "provider", at, sizeof at),
                      "input %s: the provider group has no url, so the input is no provider "
                      "input and its provider settings are ignored", in->name);
        if (CONF_INPUT_PROVIDER(in)) {
            lint_file(out, &errors, lint_input_at(c, in, "provider.ca_file", at, sizeof at),
                      "provider.ca_file", in->provider.ca_file, false);
            lint_file(out, &errors, lint_input_at(c, in, "provider.auth_file", at, sizeof at),
                      "provider.auth_file", in->provider.auth_file, true);
        }
    }
    return errors;
}

const char **conf_sensitive_paths(const struct conf *c, const char *queue, int *n)
{
    const struct conf_input *only = NULL;
    const char **v;
    int total = 0;

    *n = 0;
    for (int i = 0; i < c->n_inputs && queue; i++)
        if (strcmp(c->inputs[i].queue, queue) == 0)
            only = &c->inputs[i];
    for (int i = 0; i < c->n_inputs; i++)
        if (!only || only == &c->inputs[i])
            total += c->inputs[i].sensitive.n;
    if (total == 0)
        return NULL;
    if (!(v = calloc((size_t)total, sizeof *v))) {
        *n = -1;
        return NULL;
    }
    for (int i = 0; i < c->n_inputs; i++)
        if (!only || only == &c->inputs[i])
            for (int k = 0; k < c->inputs[i].sensitive.n; k++)
                if (c->inputs[i].sensitive.v[k][0])
                    v[(*n)++] = c->inputs[i].sensitive.v[k];
    if (*n == 0) {
        free(v);
        return NULL;
    }
    return v;
}
