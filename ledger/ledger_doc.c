/*
 * ledger_doc: a hand-rolled JSON writer for the batch document. Only
 * strings need care (escaping, UTF-8); the payload is the body that
 * job_decode already parsed as a JSON object, appended as it is; headers
 * are dumped by jansson straight into the buffer.
 */
#include "ledger_doc.h"

#include "trace.h"

#include <arpa/inet.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void ledger_doc_init(struct ledger_doc *d) { memset(d, 0, sizeof *d); }

void ledger_doc_free(struct ledger_doc *d)
{
    free(d->buf);
    memset(d, 0, sizeof *d);
}

/* Makes room for more bytes plus the NUL; false (and d->nomem) if not. */
static bool reserve(struct ledger_doc *d, size_t more)
{
    size_t cap;
    char *nb;
    if (d->nomem)
        return false;
    if (d->len + more + 1 <= d->cap)
        return true;
    cap = d->cap ? d->cap : 16384;
    while (cap < d->len + more + 1)
        cap *= 2;
    if (!(nb = realloc(d->buf, cap))) {
        d->nomem = true;
        return false;
    }
    d->buf = nb;
    d->cap = cap;
    return true;
}

static void add(struct ledger_doc *d, const char *s, size_t n)
{
    if (!reserve(d, n))
        return;
    memcpy(d->buf + d->len, s, n);
    d->len += n;
    d->buf[d->len] = '\0';
}

static void adds(struct ledger_doc *d, const char *s) { add(d, s, strlen(s)); }

void ledger_doc_add_raw(struct ledger_doc *d, const char *s) { adds(d, s); }

void ledger_doc_add_string(struct ledger_doc *d, const char *str, size_t n)
{
    static const char hex[] = "0123456789abcdef";
    const unsigned char *s = (const unsigned char *)str;
    char *o;

    /* Worst case: every byte becomes \ufffd (6 bytes), plus the quotes. */
    if (!reserve(d, 6 * n + 2))
        return;
    o = d->buf + d->len;
    *o++ = '"';
    for (size_t i = 0; i < n;) {
        unsigned char c = s[i];
        if (c >= 0x20 && c < 0x80 && c != '"' && c != '\\') {
            *o++ = (char)c;
            i++;
        } else if (c == '"' || c == '\\') {
            *o++ = '\\';
            *o++ = (char)c;
            i++;
        } else if (c < 0x20) {
            memcpy(o, "\\u00", 4);
            o[4] = hex[c >> 4];
            o[5] = hex[c & 15];
            o += 6;
            i++;
        } else {
            size_t k = job_utf8_seq(s + i, n - i);
            if (k) {
                memcpy(o, s + i, k);
                o += k;
                i += k;
            } else {
                memcpy(o, "\\ufffd", 6);
                o += 6;
                i++;
            }
        }
    }
    *o++ = '"';
    d->len = (size_t)(o - d->buf);
    d->buf[d->len] = '\0';
}

static void add_cstring(struct ledger_doc *d, const char *s) { ledger_doc_add_string(d, s, strlen(s)); }

static int dump_cb(const char *buf, size_t size, void *data)
{
    struct ledger_doc *d = data;
    add(d, buf, size);
    return d->nomem ? -1 : 0;
}

/* Ordered lanes: the job's lane, ordering key, sequence and deferred id. A
 * delivery's lane is "<input>:<partition>"; a job taken from idemq.deferred
 * is held behind a failed job of its ordering key instead ("o:<key>"). */
static void add_lane(struct ledger_doc *d, const struct job *j)
{
    char num[64];
    if (!j->has_order_key && j->lane < 0)
        return;
    if (j->deferred_id > 0 && j->has_order_key) {
        char lane[2 + sizeof j->order_key];
        snprintf(lane, sizeof lane, "o:%s", j->order_key);
        adds(d, ",\"l\":");
        add_cstring(d, lane);
    } else if (j->lane >= 0) {
        snprintf(num, sizeof num, ",\"l\":\"%d:%d\"", j->input, j->lane);
        adds(d, num);
    }
    if (j->has_order_key) {
        adds(d, ",\"o\":");
        add_cstring(d, j->order_key);
    }
    if (j->has_seq) {
        snprintf(num, sizeof num, ",\"s\":%lld", j->seq);
        adds(d, num);
    }
    if (j->deferred_id > 0) {
        snprintf(num, sizeof num, ",\"d\":true,\"di\":%lld", j->deferred_id);
        adds(d, num);
    }
}

void ledger_doc_begin(struct ledger_doc *d)
{
    d->len = 0;
    d->n = 0;
    d->nomem = false;
    add(d, "[", 1);
}

/* The effect's meta object of job j of input in. */
static void add_meta(struct ledger_doc *d, const struct job *j, const struct conf_input *in)
{
    char num[48];

    adds(d, "{\"queue\":");
    add_cstring(d, in->queue);
    adds(d, ",\"exchange\":");
    add_cstring(d, j->exchange);
    adds(d, ",\"routing_key\":");
    add_cstring(d, j->routing_key);
    adds(d, j->redelivered ? ",\"redelivered\":true,\"headers\":"
                           : ",\"redelivered\":false,\"headers\":");
    if (!j->headers || json_object_size(j->headers) == 0)
        adds(d, "{}");
    else if (json_dump_callback(j->headers, dump_cb, d, JSON_COMPACT) != 0)
        d->nomem = true;
    if (j->delivery_count >= 0) {
        snprintf(num, sizeof num, ",\"delivery_count\":%d", j->delivery_count);
        adds(d, num);
    }
    if (j->acquired_count >= 0) {
        snprintf(num, sizeof num, ",\"acquired_count\":%d", j->acquired_count);
        adds(d, num);
    }
    if (j->has_message_id) {
        adds(d, ",\"message_id\":");
        add_cstring(d, j->message_id);
    }
    {
        /* the job's trace context (trace.h): idemq's span when spans are
         * exported, else the producer's when it is valid; the effect reads
         * it here, idemq.emit from idemq.traceparent */
        char tp[TRACE_PARENT_LEN + 1];
        trace_job_parent(&j->trace, tp);
        if (tp[0]) {
            adds(d, ",\"traceparent\":");
            add_cstring(d, tp);
            if (j->trace.in.state[0]) {
                adds(d, ",\"tracestate\":");
                add_cstring(d, j->trace.in.state);
            }
        }
    }
    if (j->meta_extra) { /* a Celery task's facts */
        adds(d, ",\"celery\":");
        adds(d, j->meta_extra);
    }
    /* What the set-based path passes on as it is (a plain job is a new key:
     * attempt 1 of generation 0); the isolating path sets its own. */
    adds(d, ",\"attempt\":1,\"generation\":0}");
}

void ledger_doc_add_job(struct ledger_doc *d, const struct job *j, const struct conf_input *in,
                        int input_idx, bool old)
{
    char num[48];

    adds(d, d->n++ ? ",{\"k\":" : "{\"k\":");
    add_cstring(d, j->key);
    /* a Celery task's effect is its route's, else the input's */
    snprintf(num, sizeof num, ",\"i\":%d,\"q\":", (j->effect >= 0 ? j->effect : input_idx) + 1);
    adds(d, num);
    add_cstring(d, in->queue);
    adds(d, ",\"h\":\"");
    adds(d, j->sha256_hex);
    adds(d, "\",\"m\":");
    add_meta(d, j, in);
    adds(d, ",\"p\":");
    if (j->payload)
        add(d, j->payload, j->payload_len);
    else
        add(d, (const char *)j->body, j->body_len);
    add_lane(d, j);
    adds(d, old ? ",\"w\":true}" : "}");
}

bool ledger_doc_end(struct ledger_doc *d)
{
    add(d, "]", 1);
    return !d->nomem;
}

/* ---- the batch as binary-format arrays (ledger_plain's statement) ---- */

/* Type OIDs of the array elements (fixed in PostgreSQL's catalog). */
#define OID_BOOL 16
#define OID_INT4 23
#define OID_TEXT 25
#define OID_JSONB 3802
#define ARRAY_HEADER 20 /* ndim, flags, element type, length, lower bound */

/* A value seen in this batch: its bytes at off/len in a column buffer. */
struct ledger_seen {
    uint32_t hash;
    int idx; /* 1-based; 0 = free slot */
    size_t off;
    size_t len;
};

static void put32(struct ledger_doc *d, uint32_t v)
{
    uint32_t be = htonl(v);
    add(d, (const char *)&be, 4);
}

static void array_begin(struct ledger_doc *d, uint32_t elemtype)
{
    d->len = 0;
    d->n = 0;
    d->nomem = false;
    put32(d, 1); /* ndim */
    put32(d, 0); /* no NULLs */
    put32(d, elemtype);
    put32(d, 0); /* length: patched by array_end */
    put32(d, 1); /* lower bound */
}

static void array_end(struct ledger_doc *d)
{
    uint32_t be = htonl((uint32_t)d->n);
    if (!d->nomem && d->len >= ARRAY_HEADER)
        memcpy(d->buf + 12, &be, 4);
}

/* One element of n bytes; jsonb elements start with their version byte. */
static void array_add(struct ledger_doc *d, const char *s, size_t n, bool jsonb)
{
    put32(d, (uint32_t)(n + (jsonb ? 1 : 0)));
    if (jsonb)
        add(d, "\x01", 1);
    add(d, s, n);
    d->n++;
}

static void array_add_int(struct ledger_doc *d, uint32_t v)
{
    put32(d, 4);
    put32(d, v);
    d->n++;
}

static uint32_t fnv1a(const char *s, size_t n)
{
    uint32_t h = 2166136261u;
    for (size_t i = 0; i < n; i++)
        h = (h ^ (unsigned char)s[i]) * 16777619u;
    return h;
}

/* Makes room for one more value in a seen-set of count values (open
 * addressing, at most half full). false when out of memory. */
static bool seen_reserve(struct ledger_seen **slots, size_t *nslots, int count)
{
    size_t nn, i;
    struct ledger_seen *ns;
    if ((size_t)(count + 1) * 2 <= *nslots)
        return true;
    nn = *nslots ? *nslots * 2 : 256;
    if (!(ns = calloc(nn, sizeof *ns)))
        return false;
    for (size_t k = 0; k < *nslots; k++) {
        if (!(*slots)[k].idx)
            continue;
        for (i = (*slots)[k].hash & (nn - 1); ns[i].idx; i = (i + 1) & (nn - 1))
            ;
        ns[i] = (*slots)[k];
    }
    free(*slots);
    *slots = ns;
    *nslots = nn;
    return true;
}

/* The slot of s[0..n) in a seen-set whose values live in base: a taken slot
 * (idx > 0) if s was seen, else the free slot to record it in. */
static struct ledger_seen *seen_find(struct ledger_seen *slots, size_t nslots, const char *base,
                                     const char *s, size_t n, uint32_t h)
{
    size_t i;
    for (i = h & (nslots - 1); slots[i].idx; i = (i + 1) & (nslots - 1))
        if (slots[i].hash == h && slots[i].len == n && memcmp(base + slots[i].off, s, n) == 0)
            break;
    return &slots[i];
}

void ledger_doc_cols_init(struct ledger_cols *c) { memset(c, 0, sizeof *c); }

void ledger_doc_cols_free(struct ledger_cols *c)
{
    for (int i = 0; i < LEDGER_COL_N; i++)
        ledger_doc_free(&c->col[i]);
    ledger_doc_free(&c->scratch);
    free(c->metas_seen);
    free(c->keys_seen);
    free(c->first);
    memset(c, 0, sizeof *c);
}

void ledger_doc_cols_begin(struct ledger_cols *c)
{
    static const uint32_t types[LEDGER_COL_N] = {OID_TEXT,  OID_BOOL, OID_INT4, 0,
                                                 OID_JSONB, OID_INT4, OID_JSONB};
    for (int i = 0; i < LEDGER_COL_N; i++) {
        if (i == LEDGER_COL_SHA) { /* a bytea: the digests end to end */
            c->col[i].len = 0;
            c->col[i].n = 0;
            c->col[i].nomem = false;
        } else {
            array_begin(&c->col[i], types[i]);
        }
    }
    if (c->metas_seen)
        memset(c->metas_seen, 0, c->nmetas_seen * sizeof *c->metas_seen);
    if (c->keys_seen)
        memset(c->keys_seen, 0, c->nkeys_seen * sizeof *c->keys_seen);
    c->n = 0;
    c->distinct = 0;
    c->nomem = false;
}

void ledger_doc_cols_add_job(struct ledger_cols *c, const struct job *j,
                             const struct conf_input *in, int input_idx)
{
    struct ledger_doc *metas = &c->col[LEDGER_COL_METAS], *keys = &c->col[LEDGER_COL_KEYS];
    struct ledger_seen *slot;
    size_t klen = strlen(j->key);
    uint32_t h;
    bool first;
    int mi;

    if (c->nomem)
        return;
    if ((size_t)c->n >= c->first_cap) {
        size_t cap = c->first_cap ? c->first_cap * 2 : 128;
        bool *nf = realloc(c->first, cap * sizeof *nf);
        if (!nf)
            goto nomem;
        c->first = nf;
        c->first_cap = cap;
    }
    /* the meta: each distinct one once */
    c->scratch.len = 0;
    c->scratch.nomem = false;
    add_meta(&c->scratch, j, in);
    if (c->scratch.nomem || !seen_reserve(&c->metas_seen, &c->nmetas_seen, metas->n) ||
        !seen_reserve(&c->keys_seen, &c->nkeys_seen, c->distinct))
        goto nomem;
    h = fnv1a(c->scratch.buf, c->scratch.len);
    slot = seen_find(c->metas_seen, c->nmetas_seen, metas->buf, c->scratch.buf, c->scratch.len, h);
    if (!slot->idx) {
        array_add(metas, c->scratch.buf, c->scratch.len, true);
        slot->hash = h;
        slot->idx = metas->n;
        slot->off = metas->len - c->scratch.len;
        slot->len = c->scratch.len;
    }
    mi = slot->idx;
    /* the key, and whether it is its first copy in the batch */
    h = fnv1a(j->key, klen);
    slot = seen_find(c->keys_seen, c->nkeys_seen, keys->buf, j->key, klen, h);
    first = !slot->idx;
    array_add(keys, j->key, klen, false);
    if (first) {
        slot->hash = h;
        slot->idx = ++c->distinct;
        slot->off = keys->len - klen;
        slot->len = klen;
    }
    c->first[c->n] = first;
    put32(&c->col[LEDGER_COL_FIRST], 1);
    add(&c->col[LEDGER_COL_FIRST], first ? "\x01" : "\x00", 1);
    c->col[LEDGER_COL_FIRST].n++;
    array_add_int(&c->col[LEDGER_COL_INPUTS], (uint32_t)(input_idx + 1));
    {
        char digest[32];
        for (int k = 0; k < 32; k++) {
            char hx[3] = {j->sha256_hex[2 * k], j->sha256_hex[2 * k + 1], 0};
            digest[k] = (char)strtoul(hx, NULL, 16);
        }
        add(&c->col[LEDGER_COL_SHA], digest, sizeof digest);
        c->col[LEDGER_COL_SHA].n++;
    }
    array_add_int(&c->col[LEDGER_COL_META_IDX], (uint32_t)mi);
    array_add(&c->col[LEDGER_COL_PAYLOADS], (const char *)j->body, j->body_len, true);
    c->n++;
    return;
nomem:
    c->nomem = true;
}

bool ledger_doc_cols_end(struct ledger_cols *c)
{
    for (int i = 0; i < LEDGER_COL_N; i++) {
        if (i != LEDGER_COL_SHA)
            array_end(&c->col[i]);
        c->nomem = c->nomem || c->col[i].nomem;
    }
    return !c->nomem;
}
