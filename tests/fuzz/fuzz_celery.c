/*
 * fuzz_celery: a Celery task message from a hostile producer,
 * from the headers, properties and body idemq took off the wire to the job
 * it becomes. The input is three parts split at the first two NUL bytes:
 *
 *   headers   JSON text of the header table (as adapters/amqp_table makes
 *             it; not an object: no headers)
 *   props     JSON text of the other properties (content_type,
 *             content_encoding, reply_to, correlation_id; same rule)
 *   body      the body, any bytes
 *
 * Each goes through celery_parse and then job_decode against Celery inputs
 * with every key source (kwarg, arg, task_id) and a small max_body_bytes.
 *
 * Checked: every result is IDEMQ_OK or a named decode error with a reason;
 * a parsed task has a non-empty task name and id within CELERY_STR_MAX,
 * args an array and kwargs an object within their limits; a decoded job
 * has a route's effect, a key of UTF-8 of at most 256 bytes, a payload
 * that parses back as {"args": [...], "kwargs": {...}} and a meta object;
 * reply facts are within the AMQP short-string size.
 */
#include <jansson.h>
#include <string.h>

#include "celery.h"
#include "conf.h"
#include "fuzz.h"
#include "idemq_err.h"
#include "job.h"

static struct conf_celery_route routes[2] = {
    {"shop.charge", "x.charge(text,jsonb,jsonb)", 1},
    {"t", "x.t(text,jsonb,jsonb)", 2},
};

static json_t *object_or_empty(const uint8_t *s, size_t n)
{
    json_t *v = json_loadb((const char *)s, n, JSON_REJECT_DUPLICATES, NULL);
    if (!json_is_object(v)) {
        json_decref(v);
        v = json_object();
    }
    return v;
}

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    const uint8_t *a = memchr(data, 0, size), *b;
    json_t *h, *p;
    struct celery_task t;
    char reason[256];
    idemq_err_t err;
    static const enum conf_key_kind kinds[] = {CONF_KEY_CELERY_KWARG, CONF_KEY_CELERY_ARG,
                                               CONF_KEY_CELERY_TASK_ID};

    if (!a)
        return 0;
    b = memchr(a + 1, 0, size - (size_t)(a + 1 - data));
    if (!b)
        return 0;
    h = object_or_empty(data, (size_t)(a - data));
    p = object_or_empty(a + 1, (size_t)(b - a - 1));
    const uint8_t *body = b + 1;
    size_t blen = size - (size_t)(body - data);

    err = celery_parse(body, blen, h, p, &t, reason, sizeof reason);
    if (err == IDEMQ_OK) {
        FUZZ_CHECK(t.task[0] && t.id[0] && strlen(t.task) <= CELERY_STR_MAX &&
                       strlen(t.id) <= CELERY_STR_MAX, "task %s id %s", t.task, t.id);
        FUZZ_CHECK(json_is_array(t.args) && json_array_size(t.args) <= CELERY_MAX_ARGS,
                   "args");
        FUZZ_CHECK(json_is_object(t.kwargs) && json_object_size(t.kwargs) <= CELERY_MAX_KWARGS,
                   "kwargs");
        FUZZ_CHECK(t.version == 1 || t.version == 2, "version %d", t.version);
    } else {
        FUZZ_CHECK(reason[0] && strcmp(idemq_err_name(err), "unknown") != 0, "%s",
                   idemq_err_name(err));
        FUZZ_CHECK(!t.args && !t.kwargs, "cleared on failure");
    }
    celery_task_clear(&t);

    for (size_t k = 0; k < sizeof kinds / sizeof kinds[0]; k++) {
        struct conf_input in;
        struct job j;
        memset(&in, 0, sizeof in);
        in.name = "c";
        in.queue = "q";
        in.celery = true;
        in.max_body_bytes = k == 2 ? 64 : 4096;
        in.key_kind = kinds[k];
        in.key_name = "order_id";
        in.key_arg = 0;
        in.routes = routes;
        in.n_routes = 2;
        job_init(&j);
        FUZZ_CHECK(job_set_body(&j, body, blen) == IDEMQ_OK, "body");
        json_object_update(j.headers, h);
        json_object_update(j.props, p);
        err = job_decode(&j, &in);
        FUZZ_CHECK(err == j.decode_err, "decode_err");
        FUZZ_CHECK(strlen(j.reply_to) < JOB_SHORTSTR && strlen(j.task_id) < JOB_SHORTSTR &&
                       strlen(j.correlation_id) < JOB_SHORTSTR, "reply facts");
        FUZZ_CHECK(!j.reply || (j.reply_to[0] && j.task_id[0] && j.correlation_id[0]),
                   "reply without its facts");
        if (err == IDEMQ_OK) {
            json_t *pl = json_loads(j.payload, 0, NULL), *m = json_loads(j.meta_extra, 0, NULL);
            FUZZ_CHECK(j.effect == 1 || j.effect == 2, "effect %d", j.effect);
            FUZZ_CHECK(j.has_key && j.key[0] && strlen(j.key) <= CONF_KEY_MAX_BYTES &&
                           job_utf8_valid((const unsigned char *)j.key, strlen(j.key)),
                       "key");
            FUZZ_CHECK(json_is_array(json_object_get(pl, "args")) &&
                           json_is_object(json_object_get(pl, "kwargs")),
                       "payload %s", j.payload);
            FUZZ_CHECK(json_is_object(m), "meta %s", j.meta_extra);
            FUZZ_CHECK(j.hold_ms >= 0, "hold");
            json_decref(pl);
            json_decref(m);
        } else {
            FUZZ_CHECK(j.reason[0], "no reason for %s", idemq_err_name(err));
        }
        job_destroy(&j);
    }
    json_decref(h);
    json_decref(p);
    return 0;
}
