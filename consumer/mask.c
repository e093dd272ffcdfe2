/*
 * mask: hides an input's sensitive payload fields in what idemq shows or
 * logs (see mask.h).
 */
#include "mask.h"

#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Nested arrays walked through on the way to a path's next segment, and
 * values collected for one text: bounds against hostile bodies. */
#define NEST_MAX 64
#define VALUES_MAX 256

struct path {
    char buf[MASK_PATH_MAX + 1];
    const char *seg[MASK_PATH_SEGMENTS];
    int n;
};

/* What a walk does at the end of a path. */
struct walk {
    bool collect;            /* false: replace the value by MASK_SHOWN */
    const char *vals[VALUES_MAX];
    char *owned[VALUES_MAX]; /* numbers, dumped */
    int n;
};

bool mask_path_check(const char *path, char *why, size_t whylen)
{
    size_t len = path ? strlen(path) : 0;
    int segs = 1;

    if (len == 0 || len > MASK_PATH_MAX) {
        snprintf(why, whylen, "must be 1 to %d bytes", MASK_PATH_MAX);
        return false;
    }
    if (path[0] == '.' || path[len - 1] == '.' || strstr(path, "..")) {
        snprintf(why, whylen, "has an empty segment (dotted field names, e.g. \"card.number\")");
        return false;
    }
    for (size_t i = 0; i < len; i++)
        segs += path[i] == '.';
    if (segs > MASK_PATH_SEGMENTS) {
        snprintf(why, whylen, "has %d segments (at most %d)", segs, MASK_PATH_SEGMENTS);
        return false;
    }
    return true;
}

static bool split(const char *path, struct path *p)
{
    char *s;
    if (!mask_path_check(path, (char[8]){0}, 8))
        return false;
    snprintf(p->buf, sizeof p->buf, "%s", path);
    p->n = 0;
    p->seg[p->n++] = p->buf;
    for (s = p->buf; *s; s++)
        if (*s == '.') {
            *s = '\0';
            p->seg[p->n++] = s + 1;
        }
    return true;
}

static void collect(struct walk *w, json_t *v, int depth)
{
    if (w->n >= VALUES_MAX || depth > NEST_MAX)
        return;
    if (json_is_string(v)) {
        if (json_string_length(v) >= MASK_TEXT_MIN && !memchr(json_string_value(v), '\0',
                                                                json_string_length(v)))
            w->vals[w->n++] = json_string_value(v);
    } else if (json_is_number(v)) {
        char *s = json_dumps(v, JSON_ENCODE_ANY);
        if (s && strlen(s) >= MASK_TEXT_MIN) {
            w->owned[w->n] = s;
            w->vals[w->n++] = s;
        } else {
            free(s);
        }
    } else if (json_is_array(v)) {
        size_t i;
        json_t *e;
        json_array_foreach(v, i, e) collect(w, e, depth + 1);
    } else if (json_is_object(v)) {
        const char *k;
        json_t *e;
        json_object_foreach(v, k, e) collect(w, e, depth + 1);
    }
}

static void walk_value(json_t *v, const struct path *p, int i, struct walk *w, int depth);

/* node: where segment i is looked up. */
static void walk_object(json_t *node, const struct path *p, int i, struct walk *w, int depth)
{
    json_t *v = json_object_get(node, p->seg[i]);
    if (!v)
        return;
    if (i + 1 < p->n) {
        walk_value(v, p, i + 1, w, depth);
    } else if (w->collect) {
        collect(w, v, 0);
    } else {
        json_t *shown = json_string(MASK_SHOWN);
        if (!shown || json_object_set_new(node, p->seg[i], shown))
            w->n = -1; /* out of memory: the caller shows nothing */
    }
}

static void walk_value(json_t *v, const struct path *p, int i, struct walk *w, int depth)
{
    if (depth > NEST_MAX || w->n < 0)
        return;
    if (json_is_object(v)) {
        walk_object(v, p, i, w, depth);
    } else if (json_is_array(v)) {
        size_t k;
        json_t *e;
        json_array_foreach(v, k, e) walk_value(e, p, i, w, depth + 1);
    }
}

/* The parsed body with each path walked; NULL when it is not JSON or a
 * path could not be masked. */
static json_t *walked(const char *const *paths, int n, const unsigned char *body, size_t len,
                      struct walk *w)
{
    json_t *root = json_loadb((const char *)body, len, JSON_DECODE_ANY, NULL);
    struct path p;

    if (!root)
        return NULL;
    for (int k = 0; k < n && w->n >= 0; k++)
        if (paths[k] && paths[k][0] && split(paths[k], &p))
            walk_value(root, &p, 0, w, 0);
    if (w->n < 0) {
        json_decref(root);
        return NULL;
    }
    return root;
}

static int declared(const char *const *paths, int n)
{
    int d = 0;
    for (int k = 0; k < n; k++)
        d += paths[k] && paths[k][0];
    return d;
}

char *mask_body(const char *const *paths, int n, const unsigned char *body, size_t len,
                bool pretty)
{
    struct walk w = {.collect = false, .n = 0};
    json_t *root;
    char *out = NULL;

    if (declared(paths, n) == 0)
        return NULL;
    root = body ? walked(paths, n, body, len, &w) : NULL;
    if (root)
        out = json_dumps(root, JSON_ENCODE_ANY | (pretty ? JSON_INDENT(2) : JSON_COMPACT));
    json_decref(root);
    if (!out) {
        size_t cap = 160;
        if ((out = malloc(cap)))
            snprintf(out, cap,
                     "(body hidden: %zu bytes that are not a whole JSON document, and its "
                     "input declares sensitive fields)",
                     len);
    }
    return out;
}

char *mask_text(const char *const *paths, int n, const unsigned char *body, size_t len,
                const char *text)
{
    struct walk w = {.collect = true, .n = 0};
    json_t *root;
    char *out = NULL;
    size_t tl, o = 0, cap;

    if (!text || !body || declared(paths, n) == 0)
        return NULL;
    if (!(root = walked(paths, n, body, len, &w)))
        return NULL;
    tl = strlen(text);
    /* MASK_SHOWN is no longer than MASK_TEXT_MIN: the text never grows */
    cap = tl + 1;
    for (int k = 0; k < w.n && !out; k++)
        if (strstr(text, w.vals[k]) && !(out = malloc(cap)))
            goto done;
    if (!out)
        goto done;
    for (size_t i = 0; i < tl;) {
        size_t best = 0;
        for (int k = 0; k < w.n; k++) {
            size_t vl = strlen(w.vals[k]);
            if (vl > best && vl <= tl - i && memcmp(text + i, w.vals[k], vl) == 0)
                best = vl;
        }
        if (best) {
            memcpy(out + o, MASK_SHOWN, sizeof MASK_SHOWN - 1);
            o += sizeof MASK_SHOWN - 1;
            i += best;
        } else {
            out[o++] = text[i++];
        }
    }
    out[o] = '\0';
done:
    for (int k = 0; k < w.n; k++)
        free(w.owned[k]);
    json_decref(root);
    return out;
}
