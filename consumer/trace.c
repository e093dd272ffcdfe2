/*
 * trace: the W3C Trace Context a producer sends, checked for shape and
 * passed on (see trace.h). https://www.w3.org/TR/trace-context/ sections
 * 3.2 (traceparent) and 3.3 (tracestate).
 */
#include "trace.h"

#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/random.h>

static bool lhex(char ch)
{
    return (ch >= '0' && ch <= '9') || (ch >= 'a' && ch <= 'f');
}

/* n lowercase hex digits at s, not all '0' when nonzero is set */
static bool hexrun(const char *s, size_t n, bool nonzero)
{
    bool any = false;
    for (size_t i = 0; i < n; i++) {
        if (!lhex(s[i]))
            return false;
        any = any || s[i] != '0';
    }
    return any || !nonzero;
}

bool trace_parent_valid(const char *s, size_t n)
{
    if (!s || n < TRACE_PARENT_LEN)
        return false;
    if (!hexrun(s, 2, false) || (s[0] == 'f' && s[1] == 'f'))
        return false;
    if (s[2] != '-' || s[35] != '-' || s[52] != '-')
        return false;
    if (!hexrun(s + 3, 32, true) || !hexrun(s + 36, 16, true) || !hexrun(s + 53, 2, false))
        return false;
    if (s[0] == '0' && s[1] == '0')
        return n == TRACE_PARENT_LEN;
    /* a later version: what follows the version-00 fields starts with '-' */
    return n == TRACE_PARENT_LEN || s[TRACE_PARENT_LEN] == '-';
}

bool trace_state_valid(const char *s, size_t n)
{
    int members = 1;
    bool key = false;
    if (!s || n == 0 || n > TRACE_STATE_MAX)
        return false;
    for (size_t i = 0; i < n; i++) {
        unsigned char ch = (unsigned char)s[i];
        if (ch < 0x20 || ch > 0x7e)
            return false;
        if (ch == ',') {
            members++;
            key = false;
        } else if (ch == '=') {
            if (!key)
                return false; /* "=value" with no key */
        } else if (ch != ' ' && ch != '\t') {
            key = true;
        }
    }
    return members <= 32;
}

bool trace_from_headers(const json_t *headers, struct trace_ctx *c)
{
    const json_t *p = json_is_object(headers) ? json_object_get(headers, "traceparent") : NULL;
    const json_t *st = json_is_object(headers) ? json_object_get(headers, "tracestate") : NULL;
    c->parent[0] = '\0';
    c->state[0] = '\0';
    if (!json_is_string(p) || !trace_parent_valid(json_string_value(p), json_string_length(p)))
        return false;
    memcpy(c->parent, json_string_value(p), TRACE_PARENT_LEN);
    c->parent[TRACE_PARENT_LEN] = '\0';
    if (json_is_string(st) && trace_state_valid(json_string_value(st), json_string_length(st)))
        memcpy(c->state, json_string_value(st), json_string_length(st) + 1);
    return true;
}

static int unhex(char ch)
{
    return ch <= '9' ? ch - '0' : ch - 'a' + 10;
}

static void from_hex(const char *s, unsigned char *b, size_t n)
{
    for (size_t i = 0; i < n; i++)
        b[i] = (unsigned char)(unhex(s[2 * i]) << 4 | unhex(s[2 * i + 1]));
}

void trace_hex(const unsigned char *b, size_t n, char *out)
{
    static const char digits[] = "0123456789abcdef";
    for (size_t i = 0; i < n; i++) {
        out[2 * i] = digits[b[i] >> 4];
        out[2 * i + 1] = digits[b[i] & 15];
    }
    out[2 * n] = '\0';
}

/* splitmix64: a thread's id stream, seeded once from the kernel (ids must
 * be unique, not secret; a system call per id costs more than the span) */
static uint64_t next_u64(void)
{
    static __thread uint64_t state;
    static __thread bool seeded;
    uint64_t z;
    if (!seeded) {
        size_t got = 0;
        while (got < sizeof state) {
            ssize_t r = getrandom((unsigned char *)&state + got, sizeof state - got, 0);
            if (r > 0)
                got += (size_t)r;
        }
        seeded = true;
    }
    z = (state += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

/* n random bytes (8 or 16), not all zero (ids of all zeros are invalid) */
static void random_id(unsigned char *b, size_t n)
{
    bool any = false;
    while (!any) {
        for (size_t i = 0; i < n; i += 8) {
            uint64_t v = next_u64();
            memcpy(b + i, &v, n - i < 8 ? n - i : 8);
        }
        for (size_t i = 0; i < n; i++)
            any = any || b[i];
    }
}

void trace_new_span_id(unsigned char id[8])
{
    random_id(id, 8);
}

void trace_job_begin(struct trace_job *t, const json_t *headers, bool span)
{
    bool have = trace_from_headers(headers, &t->in);
    t->span = span;
    t->flags = 1;
    if (!span)
        return;
    if (have) {
        from_hex(t->in.parent + 3, t->trace_id, 16);
        from_hex(t->in.parent + 36, t->parent_id, 8);
        from_hex(t->in.parent + 53, &t->flags, 1);
        if (!(t->flags & 1)) { /* the producer did not sample it: neither does idemq */
            t->span = false;
            return;
        }
    } else {
        random_id(t->trace_id, sizeof t->trace_id);
        memset(t->parent_id, 0, sizeof t->parent_id);
    }
    random_id(t->span_id, sizeof t->span_id);
}

void trace_job_parent(const struct trace_job *t, char *out)
{
    char tid[33], sid[17];
    if (!t->span) {
        memcpy(out, t->in.parent, sizeof t->in.parent);
        return;
    }
    trace_hex(t->trace_id, 16, tid);
    trace_hex(t->span_id, 8, sid);
    snprintf(out, TRACE_PARENT_LEN + 1, "00-%s-%s-%02x", tid, sid, t->flags);
}
