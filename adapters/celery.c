/*
 * celery: the Celery task protocol, protocol 1 and 2 with the JSON
 * serializer, read within limits; the job it becomes; the rpc:// result
 * messages. Field names as Celery 5.2 (celery/app/amqp.py as_task_v2 and
 * as_task_v1, celery/backends/rpc.py and base.py) writes them.
 */
#include "celery.h"

#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>

#include "seal.h"

void celery_task_clear(struct celery_task *t)
{
    json_decref(t->args);
    json_decref(t->kwargs);
    memset(t, 0, sizeof *t);
    t->retries = -1;
}

/* ---- time ---- */

/* Days from 1970-01-01 to y-m-d (proleptic Gregorian; H. Hinnant's
 * days_from_civil). */
static long long days_from_civil(long long y, unsigned m, unsigned d)
{
    y -= m <= 2;
    long long era = (y >= 0 ? y : y - 399) / 400;
    unsigned yoe = (unsigned)(y - era * 400);
    unsigned doy = (153 * (m + (m > 2 ? -3 : 9)) + 2) / 5 + d - 1;
    unsigned doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    return era * 146097 + (long long)doe - 719468;
}

/* n decimal digits at *p into *v; advances *p. */
static bool digits(const char **p, int n, int *v)
{
    *v = 0;
    for (int i = 0; i < n; i++) {
        if (!isdigit((unsigned char)(*p)[i]))
            return false;
        *v = *v * 10 + ((*p)[i] - '0');
    }
    *p += n;
    return true;
}

bool celery_parse_time(const char *s, long long *ms)
{
    const char *p = s;
    int y, mo, d, h, mi, sec = 0, frac_ms = 0, zh = 0, zm = 0, sign = 0;
    static const int mdays[12] = {31, 29, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31};

    if (!s || strlen(s) > CELERY_TIME_MAX)
        return false;
    if (!digits(&p, 4, &y) || *p++ != '-' || !digits(&p, 2, &mo) || *p++ != '-' ||
        !digits(&p, 2, &d) || (*p != 'T' && *p != 't' && *p != ' '))
        return false;
    p++;
    if (!digits(&p, 2, &h) || *p++ != ':' || !digits(&p, 2, &mi))
        return false;
    if (*p == ':') {
        p++;
        if (!digits(&p, 2, &sec))
            return false;
        if (*p == '.' || *p == ',') {
            int n = 0;
            p++;
            while (isdigit((unsigned char)*p)) {
                if (n < 3)
                    frac_ms = frac_ms * 10 + (*p - '0');
                n++;
                p++;
            }
            if (n == 0 || n > 9)
                return false;
            for (; n < 3; n++)
                frac_ms *= 10;
        }
    }
    if (*p == 'Z' || *p == 'z') {
        p++;
    } else if (*p == '+' || *p == '-') {
        sign = *p++ == '-' ? -1 : 1;
        if (!digits(&p, 2, &zh))
            return false;
        if (*p == ':')
            p++;
        if (!digits(&p, 2, &zm))
            return false;
    }
    if (*p || y < 1970 || y > 9999 || mo < 1 || mo > 12 || d < 1 || d > mdays[mo - 1] ||
        (mo == 2 && d == 29 && !(y % 4 == 0 && (y % 100 != 0 || y % 400 == 0))) || h > 23 ||
        mi > 59 || sec > 60 || zh > 23 || zm > 59)
        return false;
    *ms = ((days_from_civil(y, (unsigned)mo, (unsigned)d) * 86400LL + h * 3600LL + mi * 60LL +
            sec) - sign * (zh * 3600LL + zm * 60LL)) * 1000LL + frac_ms;
    return true;
}

/* ---- parsing ---- */

#define FAIL(code, ...)                                                                      \
    do {                                                                                     \
        snprintf(reason, rlen, __VA_ARGS__);                                                 \
        err = (code);                                                                        \
        goto fail;                                                                           \
    } while (0)

/* A string field (or null / absent: "") of at most CELERY_STR_MAX bytes
 * into dst. false if v is another type or too long. */
static bool opt_str(const json_t *v, char dst[CELERY_STR_MAX + 1], bool required)
{
    dst[0] = '\0';
    if (!v || json_is_null(v))
        return !required;
    if (!json_is_string(v) || json_string_length(v) > CELERY_STR_MAX ||
        strlen(json_string_value(v)) != json_string_length(v))
        return false;
    memcpy(dst, json_string_value(v), json_string_length(v) + 1);
    return !required || dst[0];
}

/* eta / expires: null or absent, or an ISO 8601 string. */
static bool opt_time(const json_t *v, bool *has, long long *ms, char text[CELERY_TIME_MAX + 1])
{
    *has = false;
    text[0] = '\0';
    if (!v || json_is_null(v))
        return true;
    if (!json_is_string(v) || json_string_length(v) > CELERY_TIME_MAX ||
        !celery_parse_time(json_string_value(v), ms))
        return false;
    snprintf(text, CELERY_TIME_MAX + 1, "%s", json_string_value(v));
    *has = true;
    return true;
}

/* The property prop of props as text, or NULL. */
static const char *prop_str(const json_t *props, const char *name)
{
    const json_t *v = json_object_get(props, name);
    return json_is_string(v) ? json_string_value(v) : NULL;
}

/* Content type without parameters ("application/json; charset=utf-8"). */
static bool type_is(const char *ct, const char *want)
{
    size_t n = strlen(want);
    return strncasecmp(ct, want, n) == 0 && (ct[n] == '\0' || ct[n] == ';' || ct[n] == ' ');
}

static bool compressing(const char *enc)
{
    static const char *const names[] = {"gzip", "x-gzip", "zlib", "deflate", "bzip2",
                                        "x-bz2", "lzma", "xz", "brotli", "zstd",
                                        "application/x-gzip", "application/x-bz2"};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if (strcasecmp(enc, names[i]) == 0)
            return true;
    return false;
}

/* What the serializer and encoding allow: IDEMQ_OK for JSON in UTF-8. */
static idemq_err_t check_format(const json_t *headers, const json_t *props, char *reason,
                                size_t rlen)
{
    const char *ct = prop_str(props, "content_type");
    const char *enc = prop_str(props, "content_encoding");
    const json_t *comp = json_object_get(headers, "compression");

    if (comp && !json_is_null(comp)) {
        snprintf(reason, rlen, "compressed body (compression header %.64s): not read",
                 json_is_string(comp) ? json_string_value(comp) : "of another type");
        return IDEMQ_ERR_CELERY_COMPRESSED;
    }
    if (ct && type_is(ct, "application/x-python-serialize")) {
        snprintf(reason, rlen, "pickle body (content_type %.64s): never decoded; send it "
                 "with serializer='json'", ct);
        return IDEMQ_ERR_CELERY_PICKLE;
    }
    if (ct && !type_is(ct, "application/json")) {
        snprintf(reason, rlen, "content_type %.64s: only the JSON serializer is read "
                 "(application/json)", ct);
        return IDEMQ_ERR_CELERY_SERIALIZER;
    }
    if (enc && strcasecmp(enc, "utf-8") && strcasecmp(enc, "utf8")) {
        snprintf(reason, rlen, "content_encoding %.64s: %s", enc,
                 compressing(enc) ? "compressed, not read" : "only utf-8 is read");
        return compressing(enc) ? IDEMQ_ERR_CELERY_COMPRESSED : IDEMQ_ERR_CELERY_SERIALIZER;
    }
    return IDEMQ_OK;
}

/* The embed members (or protocol 1 fields) that carry work after this task. */
static void note_embed(struct celery_task *t, const json_t *o)
{
    static const char *const names[] = {"callbacks", "errbacks", "chain", "chord"};
    t->embed[0] = '\0';
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        const json_t *v = json_object_get(o, names[i]);
        if (!v || json_is_null(v) || (json_is_array(v) && json_array_size(v) == 0) ||
            (json_is_object(v) && json_object_size(v) == 0))
            continue;
        if (t->embed[0])
            strcat(t->embed, ",");
        strcat(t->embed, names[i]);
    }
}

idemq_err_t celery_parse(const unsigned char *body, size_t len, const json_t *headers,
                         const json_t *props, struct celery_task *t, char *reason, size_t rlen)
{
    json_error_t jerr;
    json_t *root = NULL;
    const json_t *src, *v; /* where the task's fields are: headers (2) or body (1) */
    idemq_err_t err;

    memset(t, 0, sizeof *t);
    t->retries = -1;
    reason[0] = '\0';
    if ((err = check_format(headers, props, reason, rlen)) != IDEMQ_OK)
        return err;
    if (len && memchr(body, 0, len))
        FAIL(IDEMQ_ERR_CELERY_MALFORMED, "invalid JSON: a NUL byte in the body");
    if (!(root = json_loadb((const char *)body, len, JSON_REJECT_DUPLICATES | JSON_DECODE_ANY,
                            &jerr)))
        FAIL(IDEMQ_ERR_CELERY_MALFORMED, "invalid JSON at byte %d: %s", jerr.position, jerr.text);
    if (json_is_object(headers) && json_object_get(headers, "task")) {
        const json_t *args = json_array_get(root, 0), *kwargs = json_array_get(root, 1),
                     *embed = json_array_get(root, 2);
        t->version = 2;
        src = headers;
        if (!json_is_array(root) || json_array_size(root) != 3 || !json_is_array(args) ||
            !json_is_object(kwargs) || !(json_is_object(embed) || json_is_null(embed)))
            FAIL(IDEMQ_ERR_CELERY_MALFORMED, "protocol 2 body must be [args (array), kwargs "
                 "(object), embed (object or null)]");
        t->args = json_incref((json_t *)args);
        t->kwargs = json_incref((json_t *)kwargs);
        if (json_is_object(embed))
            note_embed(t, embed);
    } else {
        t->version = 1;
        src = root;
        if (!json_is_object(root) || !json_object_get(root, "task"))
            FAIL(IDEMQ_ERR_CELERY_MALFORMED, "neither a protocol 2 message (no task header) "
                 "nor a protocol 1 body (an object with task and id)");
        v = json_object_get(root, "args");
        if (v && !json_is_null(v) && !json_is_array(v))
            FAIL(IDEMQ_ERR_CELERY_MALFORMED, "protocol 1 args must be an array");
        t->args = v && json_is_array(v) ? json_incref((json_t *)v) : json_array();
        v = json_object_get(root, "kwargs");
        if (v && !json_is_null(v) && !json_is_object(v))
            FAIL(IDEMQ_ERR_CELERY_MALFORMED, "protocol 1 kwargs must be an object");
        t->kwargs = v && json_is_object(v) ? json_incref((json_t *)v) : json_object();
        if (!t->args || !t->kwargs)
            FAIL(IDEMQ_ERR_NOMEM, "out of memory");
        note_embed(t, root);
    }
    if (json_array_size(t->args) > CELERY_MAX_ARGS ||
        json_object_size(t->kwargs) > CELERY_MAX_KWARGS)
        FAIL(IDEMQ_ERR_CELERY_MALFORMED, "%zu args and %zu kwargs: at most %d and %d",
             json_array_size(t->args), json_object_size(t->kwargs), CELERY_MAX_ARGS,
             CELERY_MAX_KWARGS);
    if (!opt_str(json_object_get(src, "task"), t->task, true))
        FAIL(IDEMQ_ERR_CELERY_MALFORMED, "task name must be a string of 1 to %d bytes",
             CELERY_STR_MAX);
    if (!opt_str(json_object_get(src, "id"), t->id, true))
        FAIL(IDEMQ_ERR_CELERY_MALFORMED, "task id must be a string of 1 to %d bytes",
             CELERY_STR_MAX);
    if (!opt_str(json_object_get(src, "root_id"), t->root_id, false) ||
        !opt_str(json_object_get(src, "parent_id"), t->parent_id, false) ||
        !opt_str(json_object_get(src, "group"), t->group, false) ||
        !opt_str(json_object_get(src, "origin"), t->origin, false))
        FAIL(IDEMQ_ERR_CELERY_MALFORMED, "root_id, parent_id, group and origin must be null or "
             "strings of at most %d bytes", CELERY_STR_MAX);
    v = json_object_get(src, "retries");
    if (v && !json_is_null(v)) {
        if (!json_is_integer(v) || json_integer_value(v) < 0 ||
            json_integer_value(v) > CELERY_RETRIES_MAX)
            FAIL(IDEMQ_ERR_CELERY_MALFORMED, "retries must be an integer from 0 to %d",
                 CELERY_RETRIES_MAX);
        t->retries = (long long)json_integer_value(v);
    }
    if (!opt_time(json_object_get(src, "eta"), &t->has_eta, &t->eta_ms, t->eta) ||
        !opt_time(json_object_get(src, "expires"), &t->has_expires, &t->expires_ms, t->expires))
        FAIL(IDEMQ_ERR_CELERY_MALFORMED, "eta and expires must be null or ISO 8601 date-times "
             "(at most %d bytes)", CELERY_TIME_MAX);
    v = json_object_get(src, "ignore_result");
    if (v && !json_is_null(v) && !json_is_boolean(v))
        FAIL(IDEMQ_ERR_CELERY_MALFORMED, "ignore_result must be a boolean");
    t->ignore_result = json_is_true(v);
    if (!opt_str(json_object_get(props, "reply_to"), t->reply_to, false) ||
        !opt_str(json_object_get(props, "correlation_id"), t->correlation_id, false))
        FAIL(IDEMQ_ERR_CELERY_MALFORMED, "reply_to and correlation_id must be text");
    json_decref(root);
    return IDEMQ_OK;
fail:
    json_decref(root);
    celery_task_clear(t);
    return err;
}

#undef FAIL

/* ---- the job ---- */

/* Reply facts from the headers and properties alone (a body that cannot be
 * read is answered too): the task id of protocol 2, reply_to and
 * correlation_id. */
static void reply_facts(struct job *j)
{
    char id[CELERY_STR_MAX + 1], rt[CELERY_STR_MAX + 1], cid[CELERY_STR_MAX + 1];
    if (!opt_str(json_object_get(j->headers, "id"), id, true) ||
        !opt_str(json_object_get(j->props, "reply_to"), rt, true) ||
        !opt_str(json_object_get(j->props, "correlation_id"), cid, false))
        return;
    if (json_is_true(json_object_get(j->headers, "ignore_result")))
        return;
    snprintf(j->task_id, sizeof j->task_id, "%s", id);
    snprintf(j->reply_to, sizeof j->reply_to, "%s", rt);
    snprintf(j->correlation_id, sizeof j->correlation_id, "%s", cid[0] ? cid : id);
    j->reply = true;
}

static json_t *str_or_null(const char *s) { return s[0] ? json_string(s) : json_null(); }

/* meta.celery and the payload of t. false when out of memory. */
static bool describe(struct job *j, const struct celery_task *t)
{
    json_t *m = json_object(), *p = json_object(), *emb = json_array();
    bool ok = m && p && emb;

    if (ok) {
        char list[sizeof t->embed];
        snprintf(list, sizeof list, "%s", t->embed);
        for (char *save = NULL, *w = strtok_r(list, ",", &save); w; w = strtok_r(NULL, ",", &save))
            json_array_append_new(emb, json_string(w));
        json_object_set_new(m, "task", json_string(t->task));
        json_object_set_new(m, "id", json_string(t->id));
        json_object_set_new(m, "root_id", str_or_null(t->root_id));
        json_object_set_new(m, "parent_id", str_or_null(t->parent_id));
        json_object_set_new(m, "group", str_or_null(t->group));
        json_object_set_new(m, "origin", str_or_null(t->origin));
        json_object_set_new(m, "retries", json_integer(t->retries < 0 ? 0 : t->retries));
        json_object_set_new(m, "eta", str_or_null(t->eta));
        json_object_set_new(m, "expires", str_or_null(t->expires));
        json_object_set_new(m, "protocol", json_integer(t->version));
        json_object_set_new(m, "ignore_result", json_boolean(t->ignore_result));
        json_object_set(m, "embed_not_run", emb);
        json_object_set(p, "args", t->args);
        json_object_set(p, "kwargs", t->kwargs);
        free(j->payload);
        free(j->meta_extra);
        j->payload = json_dumps(p, JSON_COMPACT);
        j->meta_extra = json_dumps(m, JSON_COMPACT);
        ok = j->payload && j->meta_extra;
        j->payload_len = j->payload ? strlen(j->payload) : 0;
    }
    json_decref(m);
    json_decref(p);
    json_decref(emb);
    return ok;
}

static idemq_err_t take_celery_key(struct job *j, const struct conf_input *in,
                                   const struct celery_task *t)
{
    char what[320];
    json_t *v;
    idemq_err_t err;
    switch (in->key_kind) {
    case CONF_KEY_CELERY_KWARG:
        snprintf(what, sizeof what, "kwarg %s of task %s", in->key_name, t->task);
        return job_take_key(j, json_object_get(t->kwargs, in->key_name), what);
    case CONF_KEY_CELERY_ARG:
        snprintf(what, sizeof what, "arg %d of task %s", in->key_arg, t->task);
        return job_take_key(j, json_array_get(t->args, (size_t)in->key_arg), what);
    case CONF_KEY_CELERY_TASK_ID:
    default:
        v = json_string(t->id);
        if (!v)
            return IDEMQ_ERR_NOMEM;
        err = job_take_key(j, v, "task id");
        json_decref(v);
        return err;
    }
}

idemq_err_t celery_decode(struct job *j, const struct conf_input *in, long long now_ms)
{
    struct celery_task t;
    idemq_err_t err = IDEMQ_OK;
    const struct conf_celery_route *route = NULL;

    j->has_key = false;
    j->key[0] = '\0';
    j->effect = -1;
    j->hold_ms = 0;
    j->celery_err = IDEMQ_OK;
    memset(&t, 0, sizeof t);
    reply_facts(j);
    if (j->body_size > (uint64_t)in->max_body_bytes) {
        snprintf(j->reason, sizeof j->reason,
                 "body is %llu bytes, max_body_bytes is %d (a %zu-byte prefix is kept)",
                 (unsigned long long)j->body_size, in->max_body_bytes, j->body_len);
        return j->decode_err = IDEMQ_ERR_BODY_TOO_LARGE;
    }
    if (j->wire_err) { /* headers over the limits: what fit cannot be trusted */
        snprintf(j->reason, sizeof j->reason, "%s", j->wire_reason);
        return j->decode_err = j->wire_err;
    }
    err = celery_parse(j->body, j->body_len, j->headers, j->props, &t, j->reason,
                       sizeof j->reason);
    if (err) {
        j->celery_err = err;
        return j->decode_err = err;
    }
    if (t.version == 1 && t.reply_to[0] && !t.ignore_result) { /* the id is in the body */
        snprintf(j->task_id, sizeof j->task_id, "%s", t.id);
        snprintf(j->reply_to, sizeof j->reply_to, "%s", t.reply_to);
        snprintf(j->correlation_id, sizeof j->correlation_id, "%s",
                 t.correlation_id[0] ? t.correlation_id : t.id);
        j->reply = true;
    }
    for (int i = 0; i < in->n_routes && !route; i++)
        if (strcmp(in->routes[i].task, t.task) == 0)
            route = &in->routes[i];
    err = take_celery_key(j, in, &t); /* a park keeps the key when there is one */
    if (!route) {
        snprintf(j->reason, sizeof j->reason, "task %s has no route in celery_tasks of input %s",
                 t.task, in->name);
        err = j->celery_err = IDEMQ_ERR_CELERY_UNKNOWN_TASK;
    } else if (!err && !describe(j, &t)) {
        snprintf(j->reason, sizeof j->reason, "out of memory");
        err = IDEMQ_ERR_NOMEM;
    }
    if (!err) {
        j->effect = route->effect;
        if (j->has_key && !seal_check_headers(j->headers, j->key, j->reason, sizeof j->reason))
            err = IDEMQ_ERR_FORGED_REDRIVE;
    }
    if (!err && t.has_expires && t.expires_ms <= now_ms) {
        /* a job in every other respect: the batch applies it after all when
         * its key turns out to be claimed already (a redelivery of a task
         * that ran), and parks it otherwise */
        snprintf(j->reason, sizeof j->reason, "task %s %s expired at %s, before it ran: "
                 "revoked, not run", t.task, t.id, t.expires);
        err = j->celery_err = IDEMQ_ERR_CELERY_EXPIRED;
    } else if (!err && t.has_eta && t.eta_ms > now_ms) {
        long long d = t.eta_ms - now_ms;
        j->hold_ms = d > 0x7fffffffLL ? 0x7fffffffL : (long)d;
    }
    celery_task_clear(&t);
    return j->decode_err = err;
}

/* ---- results ---- */

char *celery_reply_body(const char *task_id, const char *status, const json_t *result,
                        const char *exc_type, const char *exc_module, const char *message)
{
    json_t *o = json_object(), *r;
    char done[40], *out = NULL;
    struct timespec ts;
    struct tm tm;

    clock_gettime(CLOCK_REALTIME, &ts);
    gmtime_r(&ts.tv_sec, &tm);
    snprintf(done, sizeof done, "%04d-%02d-%02dT%02d:%02d:%02d.%06ld", tm.tm_year + 1900,
             tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec, ts.tv_nsec / 1000);
    if (!o)
        return NULL;
    if (exc_type) {
        json_t *args = json_array();
        r = json_object();
        if (r && args) {
            json_array_append_new(args, json_string(message ? message : ""));
            json_object_set_new(r, "exc_type", json_string(exc_type));
            json_object_set_new(r, "exc_message", args);
            json_object_set_new(r, "exc_module", exc_module ? json_string(exc_module)
                                                            : json_null());
            args = NULL;
        }
        json_decref(args);
    } else {
        r = result ? json_incref((json_t *)result) : json_null();
    }
    json_object_set_new(o, "task_id", json_string(task_id));
    json_object_set_new(o, "status", json_string(status));
    json_object_set_new(o, "result", r ? r : json_null());
    json_object_set_new(o, "traceback", json_null());
    json_object_set_new(o, "children", json_array());
    json_object_set_new(o, "date_done", json_string(done));
    out = json_dumps(o, JSON_COMPACT);
    json_decref(o);
    return out;
}
