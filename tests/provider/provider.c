/*
 * idemq-test-provider: a small payments API on libmicrohttpd that behaves
 * like an idempotent provider (Stripe, Adyen style), for idemq's tests and
 * demo. It owns charges, idempotency keys and the fault switches; it is a
 * test tool, not part of the daemon (adapters/README.md "The test
 * provider").
 *
 *   POST /charges                   create a charge; Idempotency-Key dedupes
 *   GET  /charges/by-idempotency-key/KEY   the charge of a key (404, 409 in progress)
 *   GET  /charges?reference=REF     the first charge with that client reference
 *   GET  /_stats[?key=K]            counters (charges and requests of key K)
 *   POST /_control                  switches: faults, mode, key window, reset
 *
 * Faults, per request (header X-Test-Fault) or by switch (POST /_control
 * {"fault": "...", "count": N, "key": K}: the next N requests, of key K
 * when given; several switches may wait, the first match applies;
 * {"fault": ""} clears them), comma-separated:
 *   latency=MS     wait before processing (the key is in flight meanwhile)
 *   hold=MS        apply the charge, then hold the answer (still in flight)
 *   status=NNN     answer NNN without applying anything
 *   status_after=NNN  apply the charge, then answer NNN
 *   rate=S         429 with Retry-After: S, nothing applied
 *   transient      500 with transient-error: true (Adyen), nothing applied
 *   drop           apply the charge, then close the connection unanswered
 */
#include <errno.h>
#include <getopt.h>
#include <jansson.h>
#include <arpa/inet.h>
#include <microhttpd.h>
#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define MAX_BODY (1024 * 1024)
#define FAULT_MAX 256

struct charge {
    char id[32];
    char *key;       /* Idempotency-Key sent with it ("" if none or ignored) */
    char *reference; /* client reference from the body ("" if none) */
    json_int_t amount;
    long long created; /* unix seconds */
};

/* One idempotency key the provider remembers. */
struct key_rec {
    char *key;
    char *body; /* the first request's body */
    size_t body_len;
    long long first_ms; /* CLOCK_MONOTONIC of the first request */
    bool in_flight;
    int charge; /* index into charges, -1 before it is applied */
    int status; /* the stored answer, replayed for the same key and body */
    char *answer;
};

static struct {
    pthread_mutex_t lock;
    struct charge *charges;
    int n_charges, cap_charges;
    struct key_rec *keys;
    int n_keys, cap_keys;
    long requests;
    bool non_idempotent;
    long key_window_ms;
    char ref_field[64];
    char auth[256];        /* --auth: the Authorization value required, "" = none */
    struct {
        char fault[FAULT_MAX];
        char key[256];     /* "" = any request; else only this Idempotency-Key */
        long count;        /* requests left to fault; -1 = until cleared */
    } sw[16];              /* switch faults, the first match applies */
    int n_sw;
    volatile sig_atomic_t stop;
} P = {.lock = PTHREAD_MUTEX_INITIALIZER, .key_window_ms = 86400000L};

struct req {
    char *body;
    size_t len;
    bool too_large;
};

static long long mono_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* Sleeps ms, waking early when the provider stops (held answers end). */
static void nap(long ms)
{
    long long end = mono_ms() + ms;
    while (!P.stop && mono_ms() < end) {
        struct timespec ts = {0, 10 * 1000000L};
        nanosleep(&ts, NULL);
    }
}

static void *xmalloc(size_t n)
{
    void *p = malloc(n ? n : 1);
    if (!p) {
        fprintf(stderr, "idemq-test-provider: out of memory\n");
        exit(1);
    }
    return p;
}

static char *xstrdup(const char *s)
{
    char *d = xmalloc(strlen(s) + 1);
    strcpy(d, s);
    return d;
}

/* Parses a fault list into its parts; unknown words are ignored. */
struct fault {
    long latency_ms, hold_ms, rate_s;
    int status, status_after;
    bool transient, drop;
};

static void parse_fault(const char *text, struct fault *f)
{
    char buf[FAULT_MAX], *save = NULL;
    memset(f, 0, sizeof *f);
    snprintf(buf, sizeof buf, "%s", text ? text : "");
    for (char *w = strtok_r(buf, ", ", &save); w; w = strtok_r(NULL, ", ", &save)) {
        if (strncmp(w, "latency=", 8) == 0)
            f->latency_ms = strtol(w + 8, NULL, 10);
        else if (strncmp(w, "hold=", 5) == 0)
            f->hold_ms = strtol(w + 5, NULL, 10);
        else if (strncmp(w, "status_after=", 13) == 0)
            f->status_after = (int)strtol(w + 13, NULL, 10);
        else if (strncmp(w, "status=", 7) == 0)
            f->status = (int)strtol(w + 7, NULL, 10);
        else if (strncmp(w, "rate=", 5) == 0)
            f->rate_s = strtol(w + 5, NULL, 10);
        else if (strcmp(w, "transient") == 0)
            f->transient = true;
        else if (strcmp(w, "drop") == 0)
            f->drop = true;
    }
}

/* The fault of this request: its header, else the first matching switch
 * (counted down; a spent switch goes). */
static void take_fault(struct MHD_Connection *conn, const char *key, struct fault *f)
{
    const char *h = MHD_lookup_connection_value(conn, MHD_HEADER_KIND, "X-Test-Fault");
    char sw[FAULT_MAX] = "";
    if (h) {
        parse_fault(h, f);
        return;
    }
    pthread_mutex_lock(&P.lock);
    for (int i = 0; i < P.n_sw; i++) {
        if (P.sw[i].key[0] && (!key || strcmp(P.sw[i].key, key) != 0))
            continue;
        snprintf(sw, sizeof sw, "%s", P.sw[i].fault);
        if (P.sw[i].count > 0 && --P.sw[i].count == 0) {
            memmove(&P.sw[i], &P.sw[i + 1], sizeof P.sw[0] * (size_t)(P.n_sw - i - 1));
            P.n_sw--;
        }
        break;
    }
    pthread_mutex_unlock(&P.lock);
    parse_fault(sw, f);
}

static enum MHD_Result answer(struct MHD_Connection *conn, int status, const char *body,
                              const char *h1, const char *v1)
{
    struct MHD_Response *r = MHD_create_response_from_buffer(strlen(body), (void *)body,
                                                             MHD_RESPMEM_MUST_COPY);
    enum MHD_Result ret;
    if (!r)
        return MHD_NO;
    MHD_add_response_header(r, "Content-Type", "application/json");
    if (h1)
        MHD_add_response_header(r, h1, v1);
    ret = MHD_queue_response(conn, (unsigned)status, r);
    MHD_destroy_response(r);
    return ret;
}

static enum MHD_Result answer_json(struct MHD_Connection *conn, int status, json_t *j,
                                   const char *h1, const char *v1)
{
    char *s = json_dumps(j, JSON_COMPACT);
    enum MHD_Result ret = answer(conn, status, s ? s : "{}", h1, v1);
    free(s);
    json_decref(j);
    return ret;
}

/* Caller holds the lock. */
static json_t *charge_json(int i)
{
    const struct charge *c = &P.charges[i];
    return json_pack("{s:s, s:s, s:s, s:s, s:I, s:s, s:I}", "id", c->id, "object", "charge",
                     "idempotency_key", c->key, "reference", c->reference, "amount", c->amount,
                     "status", "succeeded", "created", (json_int_t)c->created);
}

/* Caller holds the lock. A key older than the window is forgotten. */
static struct key_rec *find_key(const char *key)
{
    for (int i = 0; i < P.n_keys; i++) {
        struct key_rec *k = &P.keys[i];
        if (strcmp(k->key, key) == 0)
            return mono_ms() - k->first_ms < P.key_window_ms ? k : NULL;
    }
    return NULL;
}

/* Caller holds the lock. Replaces an expired record of the key, or adds one. */
static struct key_rec *new_key(const char *key, const char *body, size_t len)
{
    struct key_rec *k = NULL;
    for (int i = 0; i < P.n_keys && !k; i++)
        if (strcmp(P.keys[i].key, key) == 0)
            k = &P.keys[i];
    if (k) {
        free(k->key);
        free(k->body);
        free(k->answer);
    } else {
        if (P.n_keys == P.cap_keys) {
            P.cap_keys = P.cap_keys ? P.cap_keys * 2 : 64;
            P.keys = realloc(P.keys, sizeof *P.keys * (size_t)P.cap_keys);
            if (!P.keys)
                exit(1);
        }
        k = &P.keys[P.n_keys++];
    }
    memset(k, 0, sizeof *k);
    k->key = xstrdup(key);
    k->body = xmalloc(len + 1);
    memcpy(k->body, body, len);
    k->body[len] = '\0';
    k->body_len = len;
    k->first_ms = mono_ms();
    k->in_flight = true;
    k->charge = -1;
    return k;
}

/* Caller holds the lock. Creates a charge from a request body. */
static int add_charge(const char *key, const char *body, size_t len)
{
    struct charge *c;
    json_t *root = json_loadb(body, len, 0, NULL);
    const char *ref = json_string_value(json_object_get(root, P.ref_field));
    json_t *amount = json_object_get(root, "amount");

    if (!amount)
        amount = json_object_get(root, "amount_minor");
    if (P.n_charges == P.cap_charges) {
        P.cap_charges = P.cap_charges ? P.cap_charges * 2 : 64;
        P.charges = realloc(P.charges, sizeof *P.charges * (size_t)P.cap_charges);
        if (!P.charges)
            exit(1);
    }
    c = &P.charges[P.n_charges];
    snprintf(c->id, sizeof c->id, "ch_%06d", P.n_charges + 1);
    c->key = xstrdup(key ? key : "");
    c->reference = xstrdup(ref ? ref : "");
    c->amount = json_is_integer(amount) ? json_integer_value(amount) : 0;
    c->created = (long long)time(NULL);
    json_decref(root);
    return P.n_charges++;
}

static enum MHD_Result post_charge(struct MHD_Connection *conn, const struct req *rq)
{
    const char *hkey = MHD_lookup_connection_value(conn, MHD_HEADER_KIND, "Idempotency-Key");
    struct fault f;
    struct key_rec *k = NULL;
    char retry[32];
    int idx;
    bool dedupe;

    take_fault(conn, hkey, &f);
    if (f.rate_s > 0) {
        snprintf(retry, sizeof retry, "%ld", f.rate_s);
        return answer(conn, 429, "{\"error\":\"rate_limited\"}", "Retry-After", retry);
    }
    if (f.transient)
        return answer(conn, 500, "{\"error\":\"transient\"}", "transient-error", "true");
    if (f.status > 0)
        return answer(conn, f.status, "{\"error\":\"injected\"}", NULL, NULL);

    pthread_mutex_lock(&P.lock);
    dedupe = !P.non_idempotent && hkey && hkey[0];
    if (dedupe && (k = find_key(hkey))) {
        enum MHD_Result ret;
        if (k->in_flight) {
            pthread_mutex_unlock(&P.lock);
            return answer(conn, 409, "{\"error\":\"idempotency_key_in_use\"}", NULL, NULL);
        }
        if (k->body_len != rq->len || memcmp(k->body, rq->body, rq->len) != 0) {
            pthread_mutex_unlock(&P.lock);
            return answer(conn, 422, "{\"error\":\"idempotency_key_reused\"}", NULL, NULL);
        }
        ret = answer(conn, k->status, k->answer, "Idempotent-Replayed", "true");
        pthread_mutex_unlock(&P.lock);
        return ret;
    }
    if (dedupe)
        k = new_key(hkey, rq->body, rq->len);
    pthread_mutex_unlock(&P.lock);

    if (f.latency_ms > 0)
        nap(f.latency_ms);

    pthread_mutex_lock(&P.lock);
    if (dedupe)
        k = find_key(hkey); /* the array may have moved */
    idx = add_charge(hkey, rq->body, rq->len);
    if (k) {
        json_t *j = charge_json(idx);
        char *s = json_dumps(j, JSON_COMPACT);
        json_decref(j);
        k->charge = idx;
        k->status = 201; /* replays get the charge; status_after only cuts this answer */
        k->answer = s ? s : xstrdup("{}");
    }
    pthread_mutex_unlock(&P.lock);

    if (f.hold_ms > 0)
        nap(f.hold_ms);

    pthread_mutex_lock(&P.lock);
    if (dedupe && (k = find_key(hkey)))
        k->in_flight = false;
    pthread_mutex_unlock(&P.lock);
    if (f.drop)
        return MHD_NO; /* applied, and the connection closes unanswered */
    if (f.status_after > 0)
        return answer(conn, f.status_after, "{\"error\":\"injected after apply\"}", NULL, NULL);
    {
        json_t *j;
        pthread_mutex_lock(&P.lock);
        j = charge_json(idx);
        pthread_mutex_unlock(&P.lock);
        return answer_json(conn, 201, j, NULL, NULL);
    }
}

static enum MHD_Result get_by_key(struct MHD_Connection *conn, const char *key)
{
    struct key_rec *k;
    json_t *j = NULL;
    int status = 404;

    pthread_mutex_lock(&P.lock);
    k = P.non_idempotent ? NULL : find_key(key);
    if (k && k->charge >= 0) {
        j = charge_json(k->charge);
        status = 200;
    } else if (k) {
        status = 409;
    }
    pthread_mutex_unlock(&P.lock);
    if (j)
        return answer_json(conn, status, j, NULL, NULL);
    return answer(conn, status,
                  status == 409 ? "{\"error\":\"in_progress\"}" : "{\"error\":\"not_found\"}",
                  NULL, NULL);
}

static enum MHD_Result get_by_reference(struct MHD_Connection *conn, const char *ref)
{
    json_t *j = NULL;
    int matches = 0;

    pthread_mutex_lock(&P.lock);
    for (int i = 0; i < P.n_charges; i++) {
        if (strcmp(P.charges[i].reference, ref) != 0)
            continue;
        if (!j)
            j = charge_json(i);
        matches++;
    }
    pthread_mutex_unlock(&P.lock);
    if (!j)
        return answer(conn, 404, "{\"error\":\"not_found\"}", NULL, NULL);
    json_object_set_new(j, "matches", json_integer(matches));
    return answer_json(conn, 200, j, NULL, NULL);
}

static enum MHD_Result get_stats(struct MHD_Connection *conn)
{
    const char *key = MHD_lookup_connection_value(conn, MHD_GET_ARGUMENT_KIND, "key");
    long key_charges = 0;
    json_t *j;

    pthread_mutex_lock(&P.lock);
    for (int i = 0; key && i < P.n_charges; i++)
        if (strcmp(P.charges[i].key, key) == 0 || strcmp(P.charges[i].reference, key) == 0)
            key_charges++;
    j = json_pack("{s:i, s:I, s:I, s:b, s:I, s:i}", "charges", P.n_charges, "requests",
                  (json_int_t)P.requests, "key_charges", (json_int_t)key_charges,
                  "non_idempotent", P.non_idempotent, "key_window_ms",
                  (json_int_t)P.key_window_ms, "switches", P.n_sw);
    pthread_mutex_unlock(&P.lock);
    return answer_json(conn, 200, j, NULL, NULL);
}

static void reset_all(void)
{
    for (int i = 0; i < P.n_charges; i++) {
        free(P.charges[i].key);
        free(P.charges[i].reference);
    }
    for (int i = 0; i < P.n_keys; i++) {
        free(P.keys[i].key);
        free(P.keys[i].body);
        free(P.keys[i].answer);
    }
    P.n_charges = P.n_keys = 0;
    P.requests = 0;
    P.n_sw = 0;
}

static enum MHD_Result post_control(struct MHD_Connection *conn, const struct req *rq)
{
    json_t *root = json_loadb(rq->body ? rq->body : "", rq->len, 0, NULL), *v;
    if (!json_is_object(root)) {
        json_decref(root);
        return answer(conn, 400, "{\"error\":\"a JSON object, please\"}", NULL, NULL);
    }
    pthread_mutex_lock(&P.lock);
    if (json_is_true(json_object_get(root, "reset")))
        reset_all();
    if ((v = json_object_get(root, "fault"))) {
        const char *fault = json_string_value(v) ? json_string_value(v) : "";
        const char *key = json_string_value(json_object_get(root, "key"));
        json_t *count = json_object_get(root, "count");
        if (!fault[0]) {
            P.n_sw = 0; /* "": clears every switch */
        } else if (P.n_sw < (int)(sizeof P.sw / sizeof P.sw[0])) {
            snprintf(P.sw[P.n_sw].fault, sizeof P.sw[0].fault, "%s", fault);
            snprintf(P.sw[P.n_sw].key, sizeof P.sw[0].key, "%s", key ? key : "");
            P.sw[P.n_sw].count = json_is_integer(count) ? (long)json_integer_value(count) : -1;
            P.n_sw++;
        }
    }
    if ((v = json_object_get(root, "non_idempotent")))
        P.non_idempotent = json_is_true(v);
    if ((v = json_object_get(root, "key_window_ms")) && json_is_integer(v))
        P.key_window_ms = (long)json_integer_value(v);
    if (json_is_true(json_object_get(root, "expire_keys")))
        for (int i = 0; i < P.n_keys; i++)
            P.keys[i].first_ms -= P.key_window_ms;
    pthread_mutex_unlock(&P.lock);
    json_decref(root);
    return answer(conn, 200, "{\"ok\":true}", NULL, NULL);
}

static enum MHD_Result handle(void *cls, struct MHD_Connection *conn, const char *url,
                              const char *method, const char *version, const char *upload,
                              size_t *upload_len, void **state)
{
    struct req *rq = *state;
    (void)cls, (void)version;

    if (!rq) { /* first call: headers only */
        rq = calloc(1, sizeof *rq);
        if (!rq)
            return MHD_NO;
        *state = rq;
        return MHD_YES;
    }
    if (*upload_len) { /* a piece of the body */
        if (rq->len + *upload_len > MAX_BODY) {
            rq->too_large = true;
        } else {
            char *nb = realloc(rq->body, rq->len + *upload_len + 1);
            if (!nb)
                return MHD_NO;
            rq->body = nb;
            memcpy(rq->body + rq->len, upload, *upload_len);
            rq->len += *upload_len;
            rq->body[rq->len] = '\0';
        }
        *upload_len = 0;
        return MHD_YES;
    }
    if (rq->too_large)
        return answer(conn, 413, "{\"error\":\"too_large\"}", NULL, NULL);
    if (P.auth[0] && strncmp(url, "/_", 2) != 0) {
        const char *a = MHD_lookup_connection_value(conn, MHD_HEADER_KIND, "Authorization");
        if (!a || strcmp(a, P.auth) != 0)
            return answer(conn, 401, "{\"error\":\"unauthorized\"}", NULL, NULL);
    }
    if (strcmp(method, "POST") == 0 && strcmp(url, "/_control") == 0)
        return post_control(conn, rq);
    if (strcmp(method, "GET") == 0 && strcmp(url, "/_stats") == 0)
        return get_stats(conn);
    if (strcmp(method, "POST") == 0 && strcmp(url, "/charges") == 0) {
        const char *k = MHD_lookup_connection_value(conn, MHD_HEADER_KIND, "Idempotency-Key");
        pthread_mutex_lock(&P.lock);
        P.requests++;
        pthread_mutex_unlock(&P.lock);
        fprintf(stderr, "idemq-test-provider: POST /charges key=%s\n", k ? k : "-");
        return post_charge(conn, rq);
    }
    if (strcmp(method, "GET") == 0 && strncmp(url, "/charges/by-idempotency-key/", 28) == 0)
        return get_by_key(conn, url + 28);
    if (strcmp(method, "GET") == 0 && strcmp(url, "/charges") == 0) {
        const char *ref = MHD_lookup_connection_value(conn, MHD_GET_ARGUMENT_KIND, "reference");
        if (!ref)
            return answer(conn, 400, "{\"error\":\"reference missing\"}", NULL, NULL);
        return get_by_reference(conn, ref);
    }
    return answer(conn, 404, "{\"error\":\"no such route\"}", NULL, NULL);
}

static void completed(void *cls, struct MHD_Connection *conn, void **state,
                      enum MHD_RequestTerminationCode toe)
{
    struct req *rq = *state;
    (void)cls, (void)conn, (void)toe;
    if (rq) {
        free(rq->body);
        free(rq);
    }
    *state = NULL;
}

static char *slurp(const char *path)
{
    FILE *f = fopen(path, "rb");
    char *buf;
    long n;
    if (!f)
        return NULL;
    fseek(f, 0, SEEK_END);
    n = ftell(f);
    fseek(f, 0, SEEK_SET);
    buf = xmalloc((size_t)n + 1);
    if (fread(buf, 1, (size_t)n, f) != (size_t)n) {
        fclose(f);
        free(buf);
        return NULL;
    }
    buf[n] = '\0';
    fclose(f);
    return buf;
}

static void on_signal(int sig)
{
    (void)sig;
    P.stop = 1;
}

static void usage(FILE *out)
{
    fprintf(out,
            "usage: idemq-test-provider [--port N] [--key-window-s N] [--non-idempotent]\n"
            "                           [--reference-field NAME] [--tls-cert PEM --tls-key PEM]\n"
            "                           [--auth VALUE]\n"
            "  --port N           listen on 127.0.0.1:N (0 = any free port; the default)\n"
            "  --key-window-s N   how long an idempotency key is kept (default 86400)\n"
            "  --non-idempotent   ignore Idempotency-Key: every POST is a new charge\n"
            "  --reference-field  body field holding the client reference (default reference)\n"
            "  --tls-cert/--tls-key  serve HTTPS with this certificate\n"
            "  --auth VALUE       answer 401 unless Authorization is VALUE (not on /_ routes)\n"
            "Prints 'listening on URL' on stdout once ready; stops on SIGTERM or SIGINT.\n");
}

int main(int argc, char **argv)
{
    static const struct option longopts[] = {
        {"port", required_argument, NULL, 'p'},
        {"key-window-s", required_argument, NULL, 'w'},
        {"non-idempotent", no_argument, NULL, 'n'},
        {"reference-field", required_argument, NULL, 'r'},
        {"tls-cert", required_argument, NULL, 'c'},
        {"tls-key", required_argument, NULL, 'k'},
        {"auth", required_argument, NULL, 'a'},
        {"help", no_argument, NULL, 'h'},
        {NULL, 0, NULL, 0}};
    struct sockaddr_in sa;
    struct MHD_Daemon *d;
    const union MHD_DaemonInfo *info;
    const char *cert_path = NULL, *key_path = NULL;
    char *cert = NULL, *key = NULL;
    unsigned flags = MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_THREAD_PER_CONNECTION |
                     MHD_USE_ERROR_LOG;
    long port = 0;
    int c;

    snprintf(P.ref_field, sizeof P.ref_field, "reference");
    while ((c = getopt_long(argc, argv, "h", longopts, NULL)) != -1) {
        switch (c) {
        case 'p': port = strtol(optarg, NULL, 10); break;
        case 'w': P.key_window_ms = strtol(optarg, NULL, 10) * 1000L; break;
        case 'n': P.non_idempotent = true; break;
        case 'r': snprintf(P.ref_field, sizeof P.ref_field, "%s", optarg); break;
        case 'c': cert_path = optarg; break;
        case 'k': key_path = optarg; break;
        case 'a': snprintf(P.auth, sizeof P.auth, "%s", optarg); break;
        case 'h': usage(stdout); return 0;
        default: usage(stderr); return 2;
        }
    }
    if (port < 0 || port > 65535 || (!cert_path != !key_path)) {
        usage(stderr);
        return 2;
    }
    signal(SIGPIPE, SIG_IGN);
    signal(SIGTERM, on_signal);
    signal(SIGINT, on_signal);
    memset(&sa, 0, sizeof sa);
    sa.sin_family = AF_INET;
    sa.sin_port = htons((uint16_t)port);
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (cert_path) {
        if (MHD_is_feature_supported(MHD_FEATURE_TLS) != MHD_YES) {
            fprintf(stderr, "idemq-test-provider: this libmicrohttpd has no TLS\n");
            return 1;
        }
        if (!(cert = slurp(cert_path)) || !(key = slurp(key_path))) {
            fprintf(stderr, "idemq-test-provider: cannot read %s or %s\n", cert_path, key_path);
            return 1;
        }
        flags |= MHD_USE_TLS;
        d = MHD_start_daemon(flags, 0, NULL, NULL, handle, NULL, MHD_OPTION_SOCK_ADDR, &sa,
                             MHD_OPTION_NOTIFY_COMPLETED, completed, NULL,
                             MHD_OPTION_HTTPS_MEM_CERT, cert, MHD_OPTION_HTTPS_MEM_KEY, key,
                             MHD_OPTION_END);
    } else {
        d = MHD_start_daemon(flags, 0, NULL, NULL, handle, NULL, MHD_OPTION_SOCK_ADDR, &sa,
                             MHD_OPTION_NOTIFY_COMPLETED, completed, NULL, MHD_OPTION_END);
    }
    if (!d) {
        fprintf(stderr, "idemq-test-provider: cannot listen on 127.0.0.1:%ld: %s\n", port,
                strerror(errno));
        return 1;
    }
    info = MHD_get_daemon_info(d, MHD_DAEMON_INFO_BIND_PORT);
    printf("listening on %s://127.0.0.1:%u\n", cert_path ? "https" : "http",
           info ? (unsigned)info->port : (unsigned)port);
    fflush(stdout);
    while (!P.stop) /* the signal may land on any thread: poll the flag */
        nap(100);
    MHD_stop_daemon(d);
    pthread_mutex_lock(&P.lock);
    reset_all();
    free(P.charges);
    free(P.keys);
    pthread_mutex_unlock(&P.lock);
    free(cert);
    free(key);
    return 0;
}
