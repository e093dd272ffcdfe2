/*
 * trace: the W3C Trace Context a producer sends, checked for shape and
 * passed on (see trace.h). https://www.w3.org/TR/trace-context/ sections
 * 3.2 (traceparent) and 3.3 (tracestate).
 */
#include "trace.h"

#include <string.h>

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
