/*
 * ledger_doc: a hand-rolled JSON writer for the batch document. Only
 * strings need care (escaping, UTF-8); the payload is the body that
 * job_decode already parsed as a JSON object, appended as it is; headers
 * are dumped by jansson straight into the buffer.
 */
#include "ledger_doc.h"

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

void ledger_doc_add_job(struct ledger_doc *d, const struct job *j, const struct conf_input *in,
                        int input_idx)
{
    char num[48];

    adds(d, d->n++ ? ",{\"k\":" : "{\"k\":");
    add_cstring(d, j->key);
    snprintf(num, sizeof num, ",\"i\":%d,\"q\":", input_idx + 1);
    adds(d, num);
    add_cstring(d, in->queue);
    adds(d, ",\"h\":\"");
    adds(d, j->sha256_hex);
    adds(d, "\",\"m\":{\"queue\":");
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
    if (j->has_message_id) {
        adds(d, ",\"message_id\":");
        add_cstring(d, j->message_id);
    }
    adds(d, "},\"p\":");
    add(d, (const char *)j->body, j->body_len);
    add_lane(d, j);
    adds(d, "}");
}

bool ledger_doc_end(struct ledger_doc *d)
{
    add(d, "]", 1);
    return !d->nomem;
}
