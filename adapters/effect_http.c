/*
 * effect_http: provider calls on libcurl's multi interface (see
 * effect_http.h). Each request is one easy handle with its own copy of the
 * body, header list and answer buffer; finished ones are classified and
 * queued until the caller polls them.
 */
#include "effect_http.h"

#include <ctype.h>
#include <curl/curl.h>
#include <errno.h>
#include <jansson.h>
#include <openssl/evp.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "job.h"
#include "log.h"

#ifndef IDEMQ_VERSION
#define IDEMQ_VERSION "dev"
#endif

/* A submit waits this long at most for its request to start going out. */
#define SEND_WAIT_MS 100

/* One request in flight. */
struct call {
    struct call *next;
    CURL *easy;
    struct curl_slist *headers;
    struct effect_http_result r; /* filled as the answer comes */
    size_t cap;                  /* of r.body */
    long long started_ms;
    char errbuf[CURL_ERROR_SIZE];
};

/* What the engine keeps per provider input. */
struct provider {
    bool on;
    char *auth_line; /* "Header: value" (secret; wiped on free) */
    int in_flight;
};

struct effect_http {
    const struct conf *conf;
    CURLM *multi;
    struct provider *p; /* by input index */
    struct call *active;
    int n_active;
    struct effect_http_result *done; /* finished, not yet polled */
    int n_done, cap_done;            /* cap_done >= n_done + n_active, always */
};

static pthread_once_t global_once = PTHREAD_ONCE_INIT;
static CURLcode global_rc;

static void global_init(void) { global_rc = curl_global_init(CURL_GLOBAL_DEFAULT); }

static long long now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

const char *effect_http_class_name(enum effect_http_class cls)
{
    switch (cls) {
    case EFFECT_HTTP_SUCCESS: return "success";
    case EFFECT_HTTP_PERMANENT: return "permanent";
    case EFFECT_HTTP_CONFLICT: return "conflict";
    case EFFECT_HTTP_RATE_LIMITED: return "rate_limited";
    case EFFECT_HTTP_UNKNOWN: return "unknown";
    case EFFECT_HTTP_NOT_SENT: return "not_sent";
    case EFFECT_HTTP_NOT_FOUND: return "not_found";
    }
    return "?";
}

/* Wipes a secret before freeing it (a plain memset may be optimised away). */
static void free_secret(char *s)
{
    if (!s)
        return;
    for (volatile char *p = s; *p; p++)
        *p = '\0';
    free(s);
}

/* Reads the credential header value of one input. "" when none is configured. */
static idemq_err_t read_credential(const struct conf_input *in, char **value, char *errbuf,
                                   size_t errlen)
{
    const struct conf_provider *p = &in->provider;
    *value = NULL;
    if (p->auth_env[0]) {
        const char *v = getenv(p->auth_env);
        if (!v || !*v) {
            snprintf(errbuf, errlen, "input %s: provider.auth_env names %s, which is not set",
                     in->name, p->auth_env);
            return IDEMQ_ERR_CONFIG;
        }
        *value = strdup(v);
    } else if (p->auth_file[0]) {
        FILE *f = fopen(p->auth_file, "r");
        char buf[4096];
        size_t n;
        if (!f) {
            snprintf(errbuf, errlen, "input %s: provider.auth_file %s: %s", in->name,
                     p->auth_file, strerror(errno));
            return IDEMQ_ERR_CONFIG;
        }
        n = fread(buf, 1, sizeof buf - 1, f);
        fclose(f);
        buf[n] = '\0';
        buf[strcspn(buf, "\r\n")] = '\0'; /* the first line; a trailing newline is usual */
        if (!buf[0]) {
            snprintf(errbuf, errlen, "input %s: provider.auth_file %s is empty", in->name,
                     p->auth_file);
            return IDEMQ_ERR_CONFIG;
        }
        *value = strdup(buf);
        for (volatile char *q = buf; *q; q++)
            *q = '\0';
    } else {
        *value = strdup("");
    }
    if (!*value) {
        snprintf(errbuf, errlen, "out of memory");
        return IDEMQ_ERR_NOMEM;
    }
    for (const char *q = *value; *q; q++) {
        if ((unsigned char)*q < 0x20 || *q == 0x7f) {
            free_secret(*value);
            *value = NULL;
            snprintf(errbuf, errlen, "input %s: the credential from provider.%s holds control "
                     "characters", in->name, p->auth_env[0] ? "auth_env" : "auth_file");
            return IDEMQ_ERR_CONFIG;
        }
    }
    return IDEMQ_OK;
}

idemq_err_t effect_http_new(const struct conf *c, struct effect_http **out, char *errbuf,
                            size_t errlen)
{
    struct effect_http *h;
    idemq_err_t err = IDEMQ_ERR_NOMEM;

    *out = NULL;
    pthread_once(&global_once, global_init);
    if (global_rc != CURLE_OK) {
        snprintf(errbuf, errlen, "libcurl: %s", curl_easy_strerror(global_rc));
        return IDEMQ_ERR_CONFIG;
    }
    if (!(h = calloc(1, sizeof *h)) || !(h->p = calloc((size_t)c->n_inputs + 1, sizeof *h->p)) ||
        !(h->multi = curl_multi_init())) {
        snprintf(errbuf, errlen, "out of memory");
        goto fail;
    }
    h->conf = c;
    for (int i = 0; i < c->n_inputs; i++) {
        const struct conf_input *in = &c->inputs[i];
        char *value;
        if (!CONF_INPUT_PROVIDER(in))
            continue;
        if (in->provider.ca_file[0]) {
            FILE *f = fopen(in->provider.ca_file, "r");
            if (!f) {
                snprintf(errbuf, errlen, "input %s: provider.ca_file %s: %s", in->name,
                         in->provider.ca_file, strerror(errno));
                err = IDEMQ_ERR_CONFIG;
                goto fail;
            }
            fclose(f);
        }
        if ((err = read_credential(in, &value, errbuf, errlen)) != IDEMQ_OK)
            goto fail;
        if (value[0]) {
            size_t n = strlen(in->provider.auth_header) + strlen(value) + 3;
            if (!(h->p[i].auth_line = malloc(n))) {
                free_secret(value);
                snprintf(errbuf, errlen, "out of memory");
                err = IDEMQ_ERR_NOMEM;
                goto fail;
            }
            snprintf(h->p[i].auth_line, n, "%s: %s", in->provider.auth_header, value);
        }
        free_secret(value);
        h->p[i].on = true;
    }
    *out = h;
    return IDEMQ_OK;
fail:
    effect_http_free(h);
    return err;
}

static void call_free(struct call *k)
{
    if (!k)
        return;
    if (k->easy)
        curl_easy_cleanup(k->easy);
    for (struct curl_slist *l = k->headers; l; l = l->next) /* one holds the credential */
        for (volatile char *c = l->data; c && *c; c++)
            *c = '\0';
    curl_slist_free_all(k->headers);
    effect_http_result_clear(&k->r);
    free(k);
}

void effect_http_free(struct effect_http *h)
{
    if (!h)
        return;
    while (h->active) {
        struct call *k = h->active;
        h->active = k->next;
        curl_multi_remove_handle(h->multi, k->easy);
        call_free(k);
    }
    for (int i = 0; i < h->n_done; i++)
        effect_http_result_clear(&h->done[i]);
    free(h->done);
    if (h->multi)
        curl_multi_cleanup(h->multi);
    for (int i = 0; h->p && i < h->conf->n_inputs; i++)
        free_secret(h->p[i].auth_line);
    free(h->p);
    free(h);
}

idemq_err_t effect_http_key_check(const char *key)
{
    size_t n = key ? strlen(key) : 0;
    if (n == 0 || n > 255 || key[0] == ' ' || key[n - 1] == ' ')
        return IDEMQ_ERR_KEY_INVALID_HEADER;
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)key[i];
        if (c < 0x20 || c > 0x7e)
            return IDEMQ_ERR_KEY_INVALID_HEADER;
    }
    return IDEMQ_OK;
}

/* ---- request bodies ---- */

struct buf {
    char *s;
    size_t len, cap;
    bool nomem;
};

static void put(struct buf *b, const char *s, size_t n)
{
    if (b->nomem)
        return;
    if (b->len + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        char *ns;
        while (cap < b->len + n + 1)
            cap *= 2;
        if (!(ns = realloc(b->s, cap))) {
            b->nomem = true;
            return;
        }
        b->s = ns;
        b->cap = cap;
    }
    memcpy(b->s + b->len, s, n);
    b->len += n;
    b->s[b->len] = '\0';
}

static void put_json(struct buf *b, const json_t *v)
{
    char *s = v ? json_dumps(v, JSON_ENCODE_ANY | JSON_COMPACT) : NULL;
    if (v && !s) {
        b->nomem = true;
        return;
    }
    put(b, s ? s : "null", s ? strlen(s) : 4);
    free(s);
}

idemq_err_t effect_http_build_body(const struct conf_input *in, const char *key,
                                   const void *payload, size_t len, char **out, size_t *outlen)
{
    const char *t = in->provider.body_template;
    struct buf b = {NULL, 0, 0, false};
    json_t *root = NULL;
    idemq_err_t err = IDEMQ_OK;

    *out = NULL;
    *outlen = 0;
    if (!t[0]) {
        put(&b, payload, len);
        if (!b.s)
            put(&b, "", 0);
        goto out;
    }
    if (strstr(t, "{{payload.") && !(root = json_loadb(payload, len, 0, NULL))) {
        err = IDEMQ_ERR_BAD_JSON;
        goto out;
    }
    while (*t) {
        const char *open = strstr(t, "{{");
        const char *close = open ? strstr(open + 2, "}}") : NULL;
        if (!open || !close) {
            put(&b, t, strlen(t));
            break;
        }
        put(&b, t, (size_t)(open - t));
        if ((size_t)(close - open) == 5 && strncmp(open + 2, "key", 3) == 0) {
            json_t *k = json_string(key);
            put_json(&b, k);
            json_decref(k);
        } else if ((size_t)(close - open) == 9 && strncmp(open + 2, "payload", 7) == 0) {
            put(&b, payload, len);
        } else if (strncmp(open + 2, "payload.", 8) == 0) {
            char field[256];
            snprintf(field, sizeof field, "%.*s", (int)(close - open - 10), open + 10);
            put_json(&b, json_object_get(root, field));
        } else { /* conf validation refuses other placeholders: keep the text */
            put(&b, open, (size_t)(close - open) + 2);
        }
        t = close + 2;
    }
out:
    json_decref(root);
    if (b.nomem) {
        free(b.s);
        return IDEMQ_ERR_NOMEM;
    }
    if (err) {
        free(b.s);
        return err;
    }
    *out = b.s;
    *outlen = b.len;
    return IDEMQ_OK;
}

void effect_http_request_sha(const struct conf_input *in, const char *body, size_t len,
                             char out[65])
{
    static const char hex[] = "0123456789abcdef";
    unsigned char md[EVP_MAX_MD_SIZE];
    unsigned int mdlen = 0;
    EVP_MD_CTX *ctx = EVP_MD_CTX_new();

    out[0] = '\0';
    if (!ctx)
        return;
    if (EVP_DigestInit_ex(ctx, EVP_sha256(), NULL) == 1 &&
        EVP_DigestUpdate(ctx, in->provider.method, strlen(in->provider.method)) == 1 &&
        EVP_DigestUpdate(ctx, " ", 1) == 1 &&
        EVP_DigestUpdate(ctx, in->provider.url, strlen(in->provider.url)) == 1 &&
        EVP_DigestUpdate(ctx, in->provider.path, strlen(in->provider.path)) == 1 &&
        EVP_DigestUpdate(ctx, "\n", 1) == 1 && EVP_DigestUpdate(ctx, body, len) == 1 &&
        EVP_DigestFinal_ex(ctx, md, &mdlen) == 1) {
        for (unsigned int i = 0; i < mdlen && i < 32; i++) {
            out[2 * i] = hex[md[i] >> 4];
            out[2 * i + 1] = hex[md[i] & 15];
        }
        out[2 * (mdlen < 32 ? mdlen : 32)] = '\0';
    }
    EVP_MD_CTX_free(ctx);
}

/* ---- answers ---- */

static size_t on_body(char *data, size_t size, size_t n, void *arg)
{
    struct call *k = arg;
    size_t take = size * n, room;
    if (k->r.body_len >= EFFECT_HTTP_MAX_RESPONSE) {
        k->r.body_truncated = true;
        return take; /* keep reading, keep nothing: the status still counts */
    }
    room = EFFECT_HTTP_MAX_RESPONSE - k->r.body_len;
    if (take > room) {
        k->r.body_truncated = true;
        take = room;
    }
    if (k->r.body_len + take + 1 > k->cap) {
        size_t cap = k->cap ? k->cap : 1024;
        char *nb;
        while (cap < k->r.body_len + take + 1)
            cap *= 2;
        if (!(nb = realloc(k->r.body, cap)))
            return 0; /* aborts the transfer: an unknown outcome, which is safe */
        k->r.body = nb;
        k->cap = cap;
    }
    memcpy(k->r.body + k->r.body_len, data, take);
    k->r.body_len += take;
    k->r.body[k->r.body_len] = '\0';
    return size * n;
}

/* Case-insensitive "Name:" prefix of a header line; returns the value. */
static const char *header_value(const char *line, size_t len, const char *name, size_t *vlen)
{
    size_t n = strlen(name);
    const char *v, *end = line + len;
    if (len <= n || strncasecmp(line, name, n) != 0 || line[n] != ':')
        return NULL;
    v = line + n + 1;
    while (v < end && (*v == ' ' || *v == '\t'))
        v++;
    while (end > v && (end[-1] == '\r' || end[-1] == '\n' || end[-1] == ' '))
        end--;
    *vlen = (size_t)(end - v);
    return v;
}

long effect_http_retry_after_ms(const char *value, long long now_s)
{
    const long max = EFFECT_HTTP_RETRY_AFTER_MAX_MS;
    if (value[0] && strspn(value, "0123456789") == strlen(value)) {
        long long s = 0;
        for (const char *d = value; *d; d++) { /* no overflow: stops at the cap */
            s = s * 10 + (*d - '0');
            if (s > max / 1000)
                return max;
        }
        return (long)(s * 1000);
    } else {
        time_t when = curl_getdate(value, NULL);
        if (when != -1) {
            long long ahead = (long long)when - now_s;
            return ahead <= 0 ? 0 : ahead > max / 1000 ? max : (long)(ahead * 1000);
        }
    }
    return -1;
}

static size_t on_header(char *line, size_t size, size_t n, void *arg)
{
    struct call *k = arg;
    size_t len = size * n, vlen;
    const char *v;
    char val[128];

    if ((v = header_value(line, len, "Retry-After", &vlen))) {
        long ms;
        snprintf(val, sizeof val, "%.*s", (int)(vlen < sizeof val ? vlen : sizeof val - 1), v);
        if ((ms = effect_http_retry_after_ms(val, (long long)time(NULL))) >= 0)
            k->r.retry_after_ms = ms;
    } else if ((v = header_value(line, len, "transient-error", &vlen))) {
        k->r.transient_header = vlen == 4 && strncasecmp(v, "true", 4) == 0;
    }
    return len;
}

/* The configured field (a dotted path) of a JSON answer, as text; "" when
 * absent or when it does not fit out (never cut: returns false then). */
static bool find_reference(const char *path, const char *body, size_t len, char *out,
                           size_t outlen)
{
    int w = 0;
    json_t *root = json_loadb(body ? body : "", len, 0, NULL), *v = root;
    char part[128];
    const char *p = path;

    out[0] = '\0';
    while (v && *p) {
        size_t n = strcspn(p, ".");
        snprintf(part, sizeof part, "%.*s", (int)(n < sizeof part ? n : sizeof part - 1), p);
        v = json_is_object(v) ? json_object_get(v, part) : NULL;
        p += n + (p[n] == '.');
    }
    if (json_is_string(v))
        w = snprintf(out, outlen, "%s", json_string_value(v));
    else if (json_is_integer(v))
        w = snprintf(out, outlen, "%" JSON_INTEGER_FORMAT, json_integer_value(v));
    json_decref(root);
    if (w < 0 || (size_t)w >= outlen) {
        out[0] = '\0';
        return false;
    }
    return true;
}

static bool is_lookup(enum effect_http_op op) { return op != EFFECT_HTTP_CALL; }

enum effect_http_class effect_http_failure_class(int curl_code, long long pretransfer_us,
                                                 long request_size)
{
    /* Once the transfer began (connection and TLS up: the pretransfer time
     * is set just before the first byte is written), the request may have
     * reached the provider, whatever the code. The byte counters prove
     * nothing: a first write that takes 0 bytes leaves request_size at 0. */
    if (pretransfer_us > 0 || request_size > 0)
        return EFFECT_HTTP_UNKNOWN;
    /* Before that no byte of the request was written: a DNS, connect or
     * TLS failure (certificate, handshake), a connect timeout, a refused
     * URL. The code itself proves nothing either way. */
    (void)curl_code;
    return EFFECT_HTTP_NOT_SENT;
}

/* Sorts a finished request into its class. */
static void classify(struct effect_http *h, struct call *k, CURLcode rc)
{
    struct effect_http_result *r = &k->r;
    const struct conf_input *in = &h->conf->inputs[r->input];
    long sent = 0;

    r->elapsed_ms = now_ms() - k->started_ms;
    if (rc != CURLE_OK) {
        curl_off_t pre = 0;
        curl_easy_getinfo(k->easy, CURLINFO_REQUEST_SIZE, &sent);
        curl_easy_getinfo(k->easy, CURLINFO_PRETRANSFER_TIME_T, &pre);
        r->status = 0;
        snprintf(r->detail, sizeof r->detail, "%s", k->errbuf[0] ? k->errbuf
                                                                 : curl_easy_strerror(rc));
        r->cls = effect_http_failure_class((int)rc, (long long)pre, sent);
        return;
    }
    curl_easy_getinfo(k->easy, CURLINFO_RESPONSE_CODE, &r->status);
    if (!r->body) { /* an empty answer: still a NUL-terminated body */
        if ((r->body = calloc(1, 1)))
            k->cap = 1;
    }
    if (r->status >= 200 && r->status < 300) {
        r->cls = EFFECT_HTTP_SUCCESS;
        if (!find_reference(in->provider.reference_field, r->body, r->body_len, r->reference,
                            sizeof r->reference))
            snprintf(r->detail, sizeof r->detail, "HTTP %ld: %s is longer than %zu bytes",
                     r->status, in->provider.reference_field, sizeof r->reference - 1);
        else if (!r->reference[0])
            snprintf(r->detail, sizeof r->detail, "HTTP %ld without %s in the answer", r->status,
                     in->provider.reference_field);
    } else if (is_lookup(r->op) && (r->status == 404 || r->status == 410)) {
        r->cls = EFFECT_HTTP_NOT_FOUND;
    } else if (r->status == 409) {
        r->cls = EFFECT_HTTP_CONFLICT;
    } else if (r->status == 429) {
        r->cls = EFFECT_HTTP_RATE_LIMITED;
    } else if (r->transient_header) {
        r->cls = EFFECT_HTTP_UNKNOWN;
        snprintf(r->detail, sizeof r->detail, "HTTP %ld with transient-error: true", r->status);
    } else if (r->status >= 400 && r->status < 500) {
        r->cls = EFFECT_HTTP_PERMANENT;
    } else {
        r->cls = EFFECT_HTTP_UNKNOWN;
    }
    if (!r->detail[0])
        snprintf(r->detail, sizeof r->detail, "HTTP %ld", r->status);
}

static void collect(struct effect_http *h);

/*
 * Sends k now: the caller may be busy for seconds before its next poll, and
 * the lease was taken already. Drives the transfers until k's request is
 * going out (its transfer began: connection and TLS up), k finished, or
 * SEND_WAIT_MS passed (a slow connect or handshake then goes on at the next
 * poll; the timeout bounds it either way). The first step also starts
 * libcurl's clock for CURLOPT_TIMEOUT_MS. Finished transfers wait in the
 * done queue for the next poll.
 */
static void send_now(struct effect_http *h, struct call *k)
{
    long long end = now_ms() + SEND_WAIT_MS;
    for (;;) {
        int running = 0;
        curl_off_t pre = 0;
        bool active = false;
        long long left;
        curl_multi_perform(h->multi, &running);
        curl_easy_getinfo(k->easy, CURLINFO_PRETRANSFER_TIME_T, &pre);
        if (pre > 0)
            return;
        collect(h); /* may free k: look for it before touching it again */
        for (struct call *a = h->active; a && !active; a = a->next)
            active = a == k;
        if (!active || (left = end - now_ms()) <= 0)
            return;
        curl_multi_poll(h->multi, NULL, 0, (int)left, NULL);
    }
}

/* Builds the URL of a request into a new string. */
static char *request_url(const struct conf_input *in, enum effect_http_op op, const char *key,
                         CURL *easy)
{
    const char *path = op == EFFECT_HTTP_CALL         ? in->provider.path
                       : op == EFFECT_HTTP_LOOKUP_KEY ? in->provider.lookup_key_path
                                                      : in->provider.lookup_reference_path;
    const char *mark = strstr(path, "{key}");
    char *esc = NULL, *url;
    size_t n;

    if (op != EFFECT_HTTP_CALL && !mark)
        return NULL;
    if (mark && !(esc = curl_easy_escape(easy, key, 0)))
        return NULL;
    n = strlen(in->provider.url) + strlen(path) + (esc ? strlen(esc) : 0) + 1;
    if ((url = malloc(n))) {
        if (mark)
            snprintf(url, n, "%s%.*s%s%s", in->provider.url, (int)(mark - path), path, esc,
                     mark + 5);
        else
            snprintf(url, n, "%s%s", in->provider.url, path);
    }
    curl_free(esc);
    return url;
}

idemq_err_t effect_http_submit(struct effect_http *h, int input, enum effect_http_op op,
                               const char *key, const char *body, size_t body_len, void *cookie,
                               char *errbuf, size_t errlen)
{
    return effect_http_submit_within(h, input, op, key, body, body_len, cookie, -1, errbuf,
                                     errlen);
}

idemq_err_t effect_http_submit_within(struct effect_http *h, int input, enum effect_http_op op,
                                      const char *key, const char *body, size_t body_len,
                                      void *cookie, long budget_ms, char *errbuf, size_t errlen)
{
    const struct conf_input *in;
    const struct conf_provider *p;
    struct call *k = NULL;
    char *url = NULL, line[300];
    idemq_err_t err = IDEMQ_ERR_NOMEM;
    struct curl_slist *hs;

    if (input < 0 || input >= h->conf->n_inputs || !h->p[input].on) {
        snprintf(errbuf, errlen, "input %d is not a provider input", input);
        return IDEMQ_ERR_CONFIG;
    }
    in = &h->conf->inputs[input];
    p = &in->provider;
    if (effect_http_key_check(key) != IDEMQ_OK) {
        snprintf(errbuf, errlen, "input %s: the key is not a valid Idempotency-Key header "
                 "value (control characters, CR/LF, non-ASCII or edge blanks): not sent",
                 in->name);
        return IDEMQ_ERR_KEY_INVALID_HEADER;
    }
    if (budget_ms >= 0 && budget_ms < EFFECT_HTTP_MIN_CALL_MS) {
        snprintf(errbuf, errlen, "input %s: %ld ms left of the lease, below %d ms: not sent",
                 in->name, budget_ms, EFFECT_HTTP_MIN_CALL_MS);
        return IDEMQ_ERR_TIMEOUT;
    }
    if (h->p[input].in_flight >= p->max_in_flight) {
        snprintf(errbuf, errlen, "input %s: %d provider calls in flight (provider.max_in_flight)",
                 in->name, h->p[input].in_flight);
        return IDEMQ_ERR_PROVIDER_BUSY;
    }
    if (h->n_done + h->n_active + 1 > h->cap_done) { /* so collect() never allocates */
        int cap = h->cap_done ? h->cap_done * 2 : 16;
        struct effect_http_result *nd = realloc(h->done, sizeof *nd * (size_t)cap);
        if (!nd)
            goto nomem;
        h->done = nd;
        h->cap_done = cap;
    }
    if (!(k = calloc(1, sizeof *k)) || !(k->easy = curl_easy_init()))
        goto nomem;
    if (!(url = request_url(in, op, key, k->easy))) {
        if (op != EFFECT_HTTP_CALL && !strstr(op == EFFECT_HTTP_LOOKUP_KEY ? p->lookup_key_path
                                                                          : p->lookup_reference_path,
                                              "{key}")) {
            snprintf(errbuf, errlen, "input %s: no provider.%s configured", in->name,
                     op == EFFECT_HTTP_LOOKUP_KEY ? "lookup_key_path" : "lookup_reference_path");
            err = IDEMQ_ERR_CONFIG;
            goto fail;
        }
        goto nomem;
    }
    k->r.cookie = cookie;
    k->r.input = input;
    k->r.op = op;
    k->r.retry_after_ms = -1;
    snprintf(line, sizeof line, "Accept: application/json");
    if (!(hs = curl_slist_append(NULL, line)))
        goto nomem;
    k->headers = hs;
    if (!curl_slist_append(k->headers, "Expect:") ||
        !curl_slist_append(k->headers, "User-Agent: idemq/" IDEMQ_VERSION))
        goto nomem;
    if (op == EFFECT_HTTP_CALL) {
        snprintf(line, sizeof line, "Idempotency-Key: %s", key);
        if (!curl_slist_append(k->headers, line))
            goto nomem;
        snprintf(line, sizeof line, "Content-Type: %s", p->content_type);
        if (!curl_slist_append(k->headers, line))
            goto nomem;
    }
    if (h->p[input].auth_line && !curl_slist_append(k->headers, h->p[input].auth_line))
        goto nomem;

    curl_easy_setopt(k->easy, CURLOPT_URL, url);
    curl_easy_setopt(k->easy, CURLOPT_PROTOCOLS_STR, "http,https");
    curl_easy_setopt(k->easy, CURLOPT_FOLLOWLOCATION, 0L);
    curl_easy_setopt(k->easy, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(k->easy, CURLOPT_HTTPHEADER, k->headers);
    /* The whole transfer, from the first perform below, stays inside the
     * budget (the lease that covers it), so once the lease is over no
     * request of it is in flight. */
    curl_easy_setopt(k->easy, CURLOPT_CONNECTTIMEOUT_MS, (long)p->connect_timeout_ms);
    curl_easy_setopt(k->easy, CURLOPT_TIMEOUT_MS,
                     budget_ms >= 0 && budget_ms < p->timeout_ms ? budget_ms
                                                                 : (long)p->timeout_ms);
    curl_easy_setopt(k->easy, CURLOPT_SSL_VERIFYPEER, p->verify_tls ? 1L : 0L);
    curl_easy_setopt(k->easy, CURLOPT_SSL_VERIFYHOST, p->verify_tls ? 2L : 0L);
    if (p->ca_file[0])
        curl_easy_setopt(k->easy, CURLOPT_CAINFO, p->ca_file);
    /* A call goes out on a connection of its own: on a reused connection
     * that turns out dead, libcurl would resend the request by itself, a
     * request the ledger never hears of (and that a provider without keys
     * would apply twice). Lookups are plain GETs and may reuse. */
    if (op == EFFECT_HTTP_CALL) {
        curl_easy_setopt(k->easy, CURLOPT_FRESH_CONNECT, 1L);
        curl_easy_setopt(k->easy, CURLOPT_FORBID_REUSE, 1L);
    }
    curl_easy_setopt(k->easy, CURLOPT_WRITEFUNCTION, on_body);
    curl_easy_setopt(k->easy, CURLOPT_WRITEDATA, k);
    curl_easy_setopt(k->easy, CURLOPT_HEADERFUNCTION, on_header);
    curl_easy_setopt(k->easy, CURLOPT_HEADERDATA, k);
    curl_easy_setopt(k->easy, CURLOPT_ERRORBUFFER, k->errbuf);
    curl_easy_setopt(k->easy, CURLOPT_PRIVATE, k);
    if (op == EFFECT_HTTP_CALL) {
        curl_easy_setopt(k->easy, CURLOPT_POSTFIELDSIZE, (long)body_len);
        if (curl_easy_setopt(k->easy, CURLOPT_COPYPOSTFIELDS, body ? body : "") != CURLE_OK)
            goto nomem;
        curl_easy_setopt(k->easy, CURLOPT_CUSTOMREQUEST, p->method);
    } else {
        curl_easy_setopt(k->easy, CURLOPT_HTTPGET, 1L);
    }
    if (curl_multi_add_handle(h->multi, k->easy) != CURLM_OK)
        goto nomem;
    free(url);
    k->started_ms = now_ms();
    k->next = h->active;
    h->active = k;
    h->n_active++;
    h->p[input].in_flight++;
    send_now(h, k);
    return IDEMQ_OK;
nomem:
    snprintf(errbuf, errlen, "out of memory starting a provider request");
    err = IDEMQ_ERR_NOMEM;
fail:
    free(url);
    call_free(k);
    return err;
}

/* Moves finished transfers to the done queue (room is reserved by submit). */
static void collect(struct effect_http *h)
{
    CURLMsg *m;
    int left;
    while ((m = curl_multi_info_read(h->multi, &left))) {
        struct call *k = NULL, **pp;
        if (m->msg != CURLMSG_DONE)
            continue;
        curl_easy_getinfo(m->easy_handle, CURLINFO_PRIVATE, (char **)&k);
        if (!k)
            continue;
        classify(h, k, m->data.result);
        curl_multi_remove_handle(h->multi, k->easy);
        IDEMQ_ASSERT(h->n_done < h->cap_done);
        h->p[k->r.input].in_flight--;
        h->done[h->n_done++] = k->r; /* the result's body moves with it */
        memset(&k->r, 0, sizeof k->r);
        for (pp = &h->active; *pp && *pp != k; pp = &(*pp)->next)
            ;
        if (*pp)
            *pp = k->next;
        h->n_active--;
        call_free(k);
    }
}

int effect_http_poll(struct effect_http *h, int timeout_ms, struct effect_http_result *out,
                     int max)
{
    long long deadline = now_ms() + (timeout_ms > 0 ? timeout_ms : 0);
    int n = 0;

    for (;;) {
        int running = 0;
        long long left;
        curl_multi_perform(h->multi, &running);
        collect(h);
        if (h->n_done > 0 || !h->active)
            break;
        left = deadline - now_ms();
        if (left <= 0)
            break;
        curl_multi_poll(h->multi, NULL, 0, (int)(left > 1000 ? 1000 : left), NULL);
    }
    while (n < max && n < h->n_done) {
        out[n] = h->done[n];
        n++;
    }
    if (n) {
        memmove(h->done, h->done + n, sizeof *h->done * (size_t)(h->n_done - n));
        h->n_done -= n;
    }
    return n;
}

int effect_http_in_flight(const struct effect_http *h, int input)
{
    int n = 0;
    if (input >= 0)
        return input < h->conf->n_inputs ? h->p[input].in_flight : 0;
    for (int i = 0; i < h->conf->n_inputs; i++)
        n += h->p[i].in_flight;
    return n;
}

char *effect_http_answer_json(const struct effect_http_result *r)
{
    json_t *body = NULL, *o;
    char *s;

    if (r->body && r->body_len)
        body = json_loadb(r->body, r->body_len, JSON_DECODE_ANY, NULL);
    if (!body && r->body && r->body_len) {
        char *copy = strndup(r->body, r->body_len);
        if (!copy)
            return NULL;
        job_utf8_sanitize(copy);
        body = json_string(copy);
        free(copy);
    }
    o = json_pack("{s:i, s:o*, s:s, s:s, s:b, s:I, s:I, s:b}", "status", (int)r->status, "body",
                  body, "detail", r->detail, "class", effect_http_class_name(r->cls),
                  "truncated", r->body_truncated, "elapsed_ms", (json_int_t)r->elapsed_ms,
                  "retry_after_ms", (json_int_t)r->retry_after_ms, "transient_error",
                  r->transient_header);
    s = o ? json_dumps(o, JSON_COMPACT) : NULL;
    json_decref(o);
    return s;
}

void effect_http_result_clear(struct effect_http_result *r)
{
    free(r->body);
    memset(r, 0, sizeof *r);
}
