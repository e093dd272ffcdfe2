/* Unit tests of adapters/celery: the Celery task protocol read within
 * limits (protocol 1 and 2, JSON only), hostile bodies and headers, the
 * ISO 8601 times, the job a task becomes, the rpc:// result bodies. */
#include <check.h>

#include "check_run.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "celery.h"
#include "celery_reply.h"
#include "conf.h"
#include "job.h"
#include "topology.h"

#define V2_HEADERS                                                                           \
    "{\"lang\":\"py\",\"task\":\"shop.charge\",\"id\":\"tid-1\",\"shadow\":null,"            \
    "\"eta\":null,\"expires\":null,\"group\":null,\"group_index\":null,\"retries\":2,"       \
    "\"timelimit\":[null,null],\"root_id\":\"root-1\",\"parent_id\":null,"                   \
    "\"argsrepr\":\"('x',)\",\"kwargsrepr\":\"{}\",\"origin\":\"gen1@host\","                \
    "\"ignore_result\":false}"
#define V2_BODY "[[\"x\",7],{\"order_id\":\"A-1\",\"amount\":5},{\"callbacks\":null," \
                "\"errbacks\":null,\"chain\":null,\"chord\":null}]"
#define JSON_PROPS "{\"content_type\":\"application/json\",\"content_encoding\":\"utf-8\"," \
                   "\"reply_to\":\"reply-q\",\"correlation_id\":\"tid-1\"}"

static json_t *js(const char *s)
{
    json_error_t e;
    json_t *v = json_loads(s, 0, &e);
    ck_assert_msg(v != NULL, "bad fixture %s: %s", s, e.text);
    return v;
}

/* celery_parse over body with headers and props given as JSON text. */
static idemq_err_t parse(const char *body, const char *headers, const char *props,
                         struct celery_task *t, char *reason)
{
    json_t *h = js(headers), *p = js(props);
    idemq_err_t err = celery_parse((const unsigned char *)body, strlen(body), h, p, t, reason,
                                   256);
    json_decref(h);
    json_decref(p);
    return err;
}

static idemq_err_t parse_v2_with(const char *header_name, const char *value, char *reason)
{
    struct celery_task t;
    json_t *h = js(V2_HEADERS), *p = js(JSON_PROPS);
    idemq_err_t err;
    json_object_set_new(h, header_name, json_loads(value, JSON_DECODE_ANY, NULL));
    err = celery_parse((const unsigned char *)V2_BODY, strlen(V2_BODY), h, p, &t, reason, 256);
    celery_task_clear(&t);
    json_decref(h);
    json_decref(p);
    return err;
}

START_TEST(test_v2)
{
    struct celery_task t;
    char reason[256];
    ck_assert_int_eq(parse(V2_BODY, V2_HEADERS, JSON_PROPS, &t, reason), IDEMQ_OK);
    ck_assert_int_eq(t.version, 2);
    ck_assert_str_eq(t.task, "shop.charge");
    ck_assert_str_eq(t.id, "tid-1");
    ck_assert_str_eq(t.root_id, "root-1");
    ck_assert_str_eq(t.parent_id, "");
    ck_assert_str_eq(t.origin, "gen1@host");
    ck_assert_int_eq(t.retries, 2);
    ck_assert(!t.has_eta && !t.has_expires && !t.ignore_result);
    ck_assert_str_eq(t.reply_to, "reply-q");
    ck_assert_str_eq(t.embed, "");
    ck_assert_int_eq(json_array_size(t.args), 2);
    ck_assert_str_eq(json_string_value(json_object_get(t.kwargs, "order_id")), "A-1");
    celery_task_clear(&t);
    /* no content type and no encoding: read as JSON */
    ck_assert_int_eq(parse(V2_BODY, V2_HEADERS, "{}", &t, reason), IDEMQ_OK);
    celery_task_clear(&t);
    /* embed with work after this task: named, not run */
    ck_assert_int_eq(parse("[[],{},{\"callbacks\":[{\"task\":\"a\"}],\"chain\":[{\"task\":\"b\"}],"
                           "\"errbacks\":[],\"chord\":null}]",
                           V2_HEADERS, JSON_PROPS, &t, reason),
                     IDEMQ_OK);
    ck_assert_str_eq(t.embed, "callbacks,chain");
    celery_task_clear(&t);
    /* embed null is protocol 2 too */
    ck_assert_int_eq(parse("[[],{},null]", V2_HEADERS, JSON_PROPS, &t, reason), IDEMQ_OK);
    celery_task_clear(&t);
}
END_TEST

START_TEST(test_v1)
{
    struct celery_task t;
    char reason[256];
    ck_assert_int_eq(parse("{\"task\":\"shop.charge\",\"id\":\"tid-9\",\"args\":[1],"
                           "\"kwargs\":{\"order_id\":\"B\"},\"retries\":0,\"eta\":null,"
                           "\"expires\":\"2030-01-01T00:00:00\",\"utc\":true,\"callbacks\":null,"
                           "\"errbacks\":null,\"timelimit\":[null,null],\"taskset\":null,"
                           "\"chord\":{\"task\":\"c\"}}",
                           "{}", JSON_PROPS, &t, reason),
                     IDEMQ_OK);
    ck_assert_int_eq(t.version, 1);
    ck_assert_str_eq(t.id, "tid-9");
    ck_assert(t.has_expires);
    ck_assert_str_eq(t.embed, "chord");
    celery_task_clear(&t);
    /* args and kwargs may be left out */
    ck_assert_int_eq(parse("{\"task\":\"t\",\"id\":\"i\"}", "{}", "{}", &t, reason), IDEMQ_OK);
    ck_assert_int_eq(json_array_size(t.args), 0);
    celery_task_clear(&t);
}
END_TEST

START_TEST(test_serializers)
{
    struct celery_task t;
    char reason[256];
    /* a pickle body is never looked at: garbage parks the same way */
    ck_assert_int_eq(parse("\x80\x04\x95garbage", V2_HEADERS,
                           "{\"content_type\":\"application/x-python-serialize\","
                           "\"content_encoding\":\"binary\"}",
                           &t, reason),
                     IDEMQ_ERR_CELERY_PICKLE);
    ck_assert(strstr(reason, "never decoded"));
    ck_assert_ptr_null(t.args);
    ck_assert_int_eq(parse(V2_BODY, V2_HEADERS, "{\"content_type\":\"application/x-yaml\"}", &t,
                           reason),
                     IDEMQ_ERR_CELERY_SERIALIZER);
    ck_assert_int_eq(parse(V2_BODY, V2_HEADERS,
                           "{\"content_type\":\"application/x-msgpack\","
                           "\"content_encoding\":\"binary\"}",
                           &t, reason),
                     IDEMQ_ERR_CELERY_SERIALIZER);
    ck_assert_int_eq(parse(V2_BODY, "{\"task\":\"t\",\"id\":\"i\","
                                    "\"compression\":\"application/x-gzip\"}",
                           JSON_PROPS, &t, reason),
                     IDEMQ_ERR_CELERY_COMPRESSED);
    ck_assert_int_eq(parse(V2_BODY, V2_HEADERS,
                           "{\"content_type\":\"application/json\",\"content_encoding\":\"gzip\"}",
                           &t, reason),
                     IDEMQ_ERR_CELERY_COMPRESSED);
    ck_assert_int_eq(parse(V2_BODY, V2_HEADERS,
                           "{\"content_type\":\"application/json\","
                           "\"content_encoding\":\"binary\"}",
                           &t, reason),
                     IDEMQ_ERR_CELERY_SERIALIZER);
    ck_assert_int_eq(parse(V2_BODY, V2_HEADERS,
                           "{\"content_type\":\"application/json; charset=utf-8\"}", &t, reason),
                     IDEMQ_OK);
    celery_task_clear(&t);
    ck_assert_int_eq(parse(V2_BODY, V2_HEADERS, "{\"content_type\":\"application/jsonx\"}", &t,
                           reason),
                     IDEMQ_ERR_CELERY_SERIALIZER);
}
END_TEST

START_TEST(test_hostile_bodies)
{
    static const char *const bodies[] = {
        "",
        "[",
        "[[],{}]",
        "[[],{},{},{}]",
        "[{},{},{}]",
        "[[],[],{}]",
        "[[],{},[]]",
        "{\"task\":\"t\"}",
        "[[],{\"a\":1,\"a\":2},{}]",
        "\"just a string\"",
        "null",
        "[[],{},{}] trailing",
    };
    struct celery_task t;
    char reason[256];
    for (size_t i = 0; i < sizeof bodies / sizeof bodies[0]; i++) {
        ck_assert_msg(parse(bodies[i], V2_HEADERS, JSON_PROPS, &t, reason) ==
                          IDEMQ_ERR_CELERY_MALFORMED,
                      "body %s", bodies[i]);
        ck_assert(reason[0]);
        ck_assert_ptr_null(t.args);
    }
    /* a NUL byte inside the body */
    {
        json_t *h = js(V2_HEADERS), *p = js(JSON_PROPS);
        const char body[] = "[[],{},{}]\0";
        ck_assert_int_eq(celery_parse((const unsigned char *)body, sizeof body - 1, h, p, &t,
                                      reason, sizeof reason),
                         IDEMQ_ERR_CELERY_MALFORMED);
        json_decref(h);
        json_decref(p);
    }
    /* protocol 1 bodies without a task, with args of the wrong type */
    ck_assert_int_eq(parse("{\"id\":\"i\"}", "{}", JSON_PROPS, &t, reason),
                     IDEMQ_ERR_CELERY_MALFORMED);
    ck_assert_int_eq(parse("{\"task\":\"t\",\"id\":\"i\",\"args\":{}}", "{}", JSON_PROPS, &t,
                           reason),
                     IDEMQ_ERR_CELERY_MALFORMED);
    ck_assert_int_eq(parse("{\"task\":\"t\",\"id\":\"i\",\"kwargs\":[]}", "{}", JSON_PROPS, &t,
                           reason),
                     IDEMQ_ERR_CELERY_MALFORMED);
    ck_assert_int_eq(parse("[[],{},{}]", "{}", JSON_PROPS, &t, reason),
                     IDEMQ_ERR_CELERY_MALFORMED);
}
END_TEST

START_TEST(test_limits)
{
    struct celery_task t;
    char reason[256], big[2048];
    /* the argument count limit */
    size_t o = 0;
    char *body = malloc(8 * (CELERY_MAX_ARGS + 2) + 32);
    ck_assert_ptr_nonnull(body);
    o += (size_t)sprintf(body + o, "[[");
    for (int i = 0; i <= CELERY_MAX_ARGS; i++)
        o += (size_t)sprintf(body + o, i ? ",%d" : "%d", i);
    sprintf(body + o, "],{},{}]");
    ck_assert_int_eq(parse(body, V2_HEADERS, JSON_PROPS, &t, reason),
                     IDEMQ_ERR_CELERY_MALFORMED);
    ck_assert(strstr(reason, "at most"));
    free(body);
    /* a task name and an id over 255 bytes; empty ones; other types */
    memset(big, 'a', 256);
    big[0] = '"';
    big[257] = '"';
    big[258] = '\0';
    big[256] = 'a';
    ck_assert_int_eq(parse_v2_with("task", big, reason), IDEMQ_ERR_CELERY_MALFORMED);
    ck_assert_int_eq(parse_v2_with("id", big, reason), IDEMQ_ERR_CELERY_MALFORMED);
    ck_assert_int_eq(parse_v2_with("root_id", big, reason), IDEMQ_ERR_CELERY_MALFORMED);
    big[256] = '"';
    big[257] = '\0'; /* 255 bytes: allowed */
    ck_assert_int_eq(parse_v2_with("task", big, reason), IDEMQ_OK);
    ck_assert_int_eq(parse_v2_with("task", "\"\"", reason), IDEMQ_ERR_CELERY_MALFORMED);
    ck_assert_int_eq(parse_v2_with("id", "\"\"", reason), IDEMQ_ERR_CELERY_MALFORMED);
    ck_assert_int_eq(parse_v2_with("id", "null", reason), IDEMQ_ERR_CELERY_MALFORMED);
    ck_assert_int_eq(parse_v2_with("task", "7", reason), IDEMQ_ERR_CELERY_MALFORMED);
    ck_assert_int_eq(parse_v2_with("task", "{\"$bytes_hex\":\"ff\"}", reason),
                     IDEMQ_ERR_CELERY_MALFORMED);
    ck_assert_int_eq(parse_v2_with("parent_id", "[]", reason), IDEMQ_ERR_CELERY_MALFORMED);
    ck_assert_int_eq(parse_v2_with("retries", "-1", reason), IDEMQ_ERR_CELERY_MALFORMED);
    ck_assert_int_eq(parse_v2_with("retries", "\"3\"", reason), IDEMQ_ERR_CELERY_MALFORMED);
    ck_assert_int_eq(parse_v2_with("retries", "9223372036854775807", reason),
                     IDEMQ_ERR_CELERY_MALFORMED);
    ck_assert_int_eq(parse_v2_with("retries", "null", reason), IDEMQ_OK);
    ck_assert_int_eq(parse_v2_with("eta", "\"tomorrow\"", reason), IDEMQ_ERR_CELERY_MALFORMED);
    ck_assert_int_eq(parse_v2_with("eta", "1700000000", reason), IDEMQ_ERR_CELERY_MALFORMED);
    ck_assert_int_eq(parse_v2_with("expires", "\"2026-02-30T00:00:00\"", reason),
                     IDEMQ_ERR_CELERY_MALFORMED);
    ck_assert_int_eq(parse_v2_with("ignore_result", "\"yes\"", reason),
                     IDEMQ_ERR_CELERY_MALFORMED);
}
END_TEST

START_TEST(test_times)
{
    long long ms;
    ck_assert(celery_parse_time("1970-01-01T00:00:00Z", &ms) && ms == 0);
    ck_assert(celery_parse_time("1970-01-01T00:00:00", &ms) && ms == 0);
    ck_assert(celery_parse_time("2026-12-01T23:55:51.091621+00:00", &ms) &&
              ms == 1796169351091LL);
    ck_assert(celery_parse_time("2026-12-02T01:55:51.091+02:00", &ms) && ms == 1796169351091LL);
    ck_assert(celery_parse_time("2026-12-01 21:55:51.091-0200", &ms) && ms == 1796169351091LL);
    ck_assert(celery_parse_time("2024-02-29T12:00", &ms));
    ck_assert(!celery_parse_time("2023-02-29T12:00", &ms));
    ck_assert(!celery_parse_time("2026-13-01T00:00:00", &ms));
    ck_assert(!celery_parse_time("2026-12-01T24:00:00", &ms));
    ck_assert(!celery_parse_time("2026-12-01", &ms));
    ck_assert(!celery_parse_time("2026-12-01T00:00:00.", &ms));
    ck_assert(!celery_parse_time("2026-12-01T00:00:00.1234567890", &ms));
    ck_assert(!celery_parse_time("2026-12-01T00:00:00+5", &ms));
    ck_assert(!celery_parse_time("2026-12-01T00:00:00Zjunk", &ms));
    ck_assert(!celery_parse_time("1969-12-31T23:59:59Z", &ms));
    ck_assert(!celery_parse_time("", &ms));
    ck_assert(!celery_parse_time(NULL, &ms));
}
END_TEST

/* A Celery input with two routes and key source ks. */
static void celery_input(struct conf_input *in, struct conf_celery_route routes[2],
                         enum conf_key_kind kind, const char *name, int arg)
{
    memset(in, 0, sizeof *in);
    in->name = "c";
    in->queue = "q";
    in->max_body_bytes = 4096;
    in->celery = true;
    in->key_kind = kind;
    in->key_name = (char *)name;
    in->key_arg = arg;
    routes[0] = (struct conf_celery_route){"shop.charge", "x.charge(text,jsonb,jsonb)", 3};
    routes[1] = (struct conf_celery_route){"shop.refund", "x.refund(text,jsonb,jsonb)", 4};
    in->routes = routes;
    in->n_routes = 2;
}

static void fill(struct job *j, const char *body, const char *headers, const char *props)
{
    json_t *h = js(headers), *p = js(props);
    job_reset(j);
    ck_assert_int_eq(job_set_body(j, body, strlen(body)), IDEMQ_OK);
    json_object_update(j->headers, h);
    json_object_update(j->props, p);
    json_decref(h);
    json_decref(p);
}

START_TEST(test_decode_job)
{
    struct conf_input in;
    struct conf_celery_route routes[2];
    struct job j;
    json_t *payload, *meta;
    long long now = 1796169351000LL;

    job_init(&j);
    celery_input(&in, routes, CONF_KEY_CELERY_KWARG, "order_id", 0);
    fill(&j, V2_BODY, V2_HEADERS, JSON_PROPS);
    ck_assert_int_eq(job_decode(&j, &in), IDEMQ_OK);
    ck_assert_str_eq(j.key, "A-1");
    ck_assert_int_eq(j.effect, 3);
    ck_assert(j.reply);
    ck_assert_str_eq(j.reply_to, "reply-q");
    ck_assert_str_eq(j.correlation_id, "tid-1");
    ck_assert_str_eq(j.task_id, "tid-1");
    payload = js(j.payload);
    ck_assert_int_eq(json_integer_value(json_object_get(json_object_get(payload, "kwargs"),
                                                        "amount")),
                     5);
    ck_assert_int_eq(json_array_size(json_object_get(payload, "args")), 2);
    json_decref(payload);
    meta = js(j.meta_extra);
    ck_assert_str_eq(json_string_value(json_object_get(meta, "id")), "tid-1");
    ck_assert_str_eq(json_string_value(json_object_get(meta, "root_id")), "root-1");
    ck_assert(json_is_null(json_object_get(meta, "parent_id")));
    ck_assert_int_eq(json_integer_value(json_object_get(meta, "retries")), 2);
    ck_assert_str_eq(json_string_value(json_object_get(meta, "origin")), "gen1@host");
    json_decref(meta);

    /* the key from an argument, from the task id; a missing one */
    celery_input(&in, routes, CONF_KEY_CELERY_ARG, NULL, 1);
    fill(&j, V2_BODY, V2_HEADERS, JSON_PROPS);
    ck_assert_int_eq(job_decode(&j, &in), IDEMQ_OK);
    ck_assert_str_eq(j.key, "7");
    celery_input(&in, routes, CONF_KEY_CELERY_ARG, NULL, 5);
    fill(&j, V2_BODY, V2_HEADERS, JSON_PROPS);
    ck_assert_int_eq(job_decode(&j, &in), IDEMQ_ERR_KEY_MISSING);
    celery_input(&in, routes, CONF_KEY_CELERY_TASK_ID, NULL, 0);
    fill(&j, V2_BODY, V2_HEADERS, JSON_PROPS);
    ck_assert_int_eq(job_decode(&j, &in), IDEMQ_OK);
    ck_assert_str_eq(j.key, "tid-1");
    celery_input(&in, routes, CONF_KEY_CELERY_KWARG, "amount_x", 0);
    fill(&j, V2_BODY, V2_HEADERS, JSON_PROPS);
    ck_assert_int_eq(job_decode(&j, &in), IDEMQ_ERR_KEY_MISSING);

    /* an unknown task name keeps its key and is answered */
    celery_input(&in, routes, CONF_KEY_CELERY_KWARG, "order_id", 0);
    fill(&j, V2_BODY,
         "{\"task\":\"shop.nope\",\"id\":\"tid-2\"}", JSON_PROPS);
    ck_assert_int_eq(job_decode(&j, &in), IDEMQ_ERR_CELERY_UNKNOWN_TASK);
    ck_assert(j.has_key);
    ck_assert(j.reply);
    ck_assert_str_eq(j.correlation_id, "tid-1");

    /* a pickle task is answered from its headers and properties alone */
    fill(&j, "\x80\x04garbage", "{\"task\":\"shop.charge\",\"id\":\"tid-3\"}",
         "{\"content_type\":\"application/x-python-serialize\",\"reply_to\":\"r\"}");
    ck_assert_int_eq(job_decode(&j, &in), IDEMQ_ERR_CELERY_PICKLE);
    ck_assert_int_eq(j.celery_err, IDEMQ_ERR_CELERY_PICKLE);
    ck_assert(j.reply);
    ck_assert_str_eq(j.correlation_id, "tid-3"); /* no correlation_id: the task id */
    ck_assert(!j.has_key);

    /* ignore_result: no reply */
    fill(&j, V2_BODY, "{\"task\":\"shop.charge\",\"id\":\"tid-4\",\"ignore_result\":true}",
         JSON_PROPS);
    ck_assert_int_eq(job_decode(&j, &in), IDEMQ_OK);
    ck_assert(!j.reply);

    /* expired (against the real clock: a past date) and eta ahead */
    fill(&j, V2_BODY, "{\"task\":\"shop.charge\",\"id\":\"t5\",\"expires\":\"2001-01-01T00:00\"}",
         JSON_PROPS);
    ck_assert_int_eq(job_decode(&j, &in), IDEMQ_ERR_CELERY_EXPIRED);
    ck_assert_int_eq(j.celery_err, IDEMQ_ERR_CELERY_EXPIRED);
    fill(&j, V2_BODY, "{\"task\":\"shop.charge\",\"id\":\"t6\",\"eta\":\"2026-12-01T23:56:01Z\"}",
         JSON_PROPS);
    ck_assert_int_eq(celery_decode(&j, &in, now), IDEMQ_OK);
    ck_assert_int_eq(j.hold_ms, 10000);
    ck_assert_int_eq(celery_decode(&j, &in, now + 20000), IDEMQ_OK);
    ck_assert_int_eq(j.hold_ms, 0);

    /* the message contract's limits come first */
    in.max_body_bytes = 8;
    fill(&j, V2_BODY, V2_HEADERS, JSON_PROPS);
    ck_assert_int_eq(job_decode(&j, &in), IDEMQ_ERR_BODY_TOO_LARGE);
    job_destroy(&j);
}
END_TEST

START_TEST(test_reply_bodies)
{
    json_t *res = js("{\"charged\":5}"), *o, *r;
    char *s = celery_reply_body("tid-1", "SUCCESS", res, NULL, NULL, NULL);
    ck_assert_ptr_nonnull(s);
    o = js(s);
    ck_assert_str_eq(json_string_value(json_object_get(o, "task_id")), "tid-1");
    ck_assert_str_eq(json_string_value(json_object_get(o, "status")), "SUCCESS");
    ck_assert(json_equal(json_object_get(o, "result"), res));
    ck_assert(json_is_null(json_object_get(o, "traceback")));
    ck_assert(json_is_array(json_object_get(o, "children")));
    ck_assert_int_eq(json_string_length(json_object_get(o, "date_done")), 26);
    json_decref(o);
    free(s);
    s = celery_reply_body("tid-2", "FAILURE", NULL, "IdemqParked", NULL, "celery_pickle: x");
    o = js(s);
    r = json_object_get(o, "result");
    ck_assert_str_eq(json_string_value(json_object_get(r, "exc_type")), "IdemqParked");
    ck_assert(json_is_null(json_object_get(r, "exc_module")));
    ck_assert_str_eq(json_string_value(json_array_get(json_object_get(r, "exc_message"), 0)),
                     "celery_pickle: x");
    json_decref(o);
    free(s);
    s = celery_reply_body("tid-3", "REVOKED", NULL, "TaskRevokedError", "celery.exceptions",
                          "expired");
    o = js(s);
    ck_assert_str_eq(json_string_value(json_object_get(json_object_get(o, "result"),
                                                       "exc_module")),
                     "celery.exceptions");
    json_decref(o);
    free(s);
    json_decref(res);
}
END_TEST

/* The reply queues idemq answers: Celery's rpc:// backend names its queue
 * after its app's thread oid, str(uuid3(...)): 8-4-4-4-12 lowercase hex. */
START_TEST(test_reply_queue_shape)
{
    ck_assert(celery_reply_queue_ok("0f6b5b3c-6a2d-3c39-9d4f-1c2b7e0e9a51"));
    ck_assert(celery_reply_queue_ok("00000000-0000-0000-0000-000000000000"));
    ck_assert(!celery_reply_queue_ok("0F6B5B3C-6A2D-3C39-9D4F-1C2B7E0E9A51")); /* str() is lower */
    ck_assert(!celery_reply_queue_ok("0f6b5b3c6a2d3c399d4f1c2b7e0e9a51"));
    ck_assert(!celery_reply_queue_ok("0f6b5b3c-6a2d-3c39-9d4f-1c2b7e0e9a5"));
    ck_assert(!celery_reply_queue_ok("0f6b5b3c-6a2d-3c39-9d4f-1c2b7e0e9a511"));
    ck_assert(!celery_reply_queue_ok("0f6b5b3c-6a2d-3c39-9d4f_1c2b7e0e9a51"));
    ck_assert(!celery_reply_queue_ok("0f6b5b3c-6a2d-3c39-9d4f-1c2b7e0e9a5g"));
    ck_assert(!celery_reply_queue_ok("victim"));
    ck_assert(!celery_reply_queue_ok("amq.rabbitmq.reply-to"));
    ck_assert(!celery_reply_queue_ok(""));
    ck_assert(!celery_reply_queue_ok(NULL));
}
END_TEST

/* The delay chain as kombu.transport.native_delayed_delivery (Celery 5.5)
 * declares it: names celery_delayed_<level>, queue keys "*." x (27 - level)
 * "1.#", onward keys "... 0.#", celery_delayed_delivery bound to level 0 by
 * "*." x 27 "0.#", an input's exchange and queue by "#.<routing_key>". */
START_TEST(test_celery_delayed_names)
{
    char buf[256], want[256] = "";
    struct conf_input in;

    topology_celery_delayed_exchange(27, buf, sizeof buf);
    ck_assert_str_eq(buf, "celery_delayed_27");
    topology_celery_delayed_exchange(0, buf, sizeof buf);
    ck_assert_str_eq(buf, "celery_delayed_0");
    topology_celery_delayed_key(27, false, buf, sizeof buf);
    ck_assert_str_eq(buf, "1.#");
    topology_celery_delayed_key(27, true, buf, sizeof buf);
    ck_assert_str_eq(buf, "0.#");
    topology_celery_delayed_key(26, false, buf, sizeof buf);
    ck_assert_str_eq(buf, "*.1.#");
    for (int i = 0; i < 27; i++)
        strcat(want, "*.");
    strcat(want, "0.#");
    topology_celery_delayed_key(0, true, buf, sizeof buf);
    ck_assert_str_eq(buf, want);
    memset(&in, 0, sizeof in);
    in.celery = true;
    in.queue_type = "quorum";
    in.exchange_type = "topic";
    in.exchange = "tasks";
    in.routing_key = "shop";
    ck_assert(topology_celery_delayed(&in));
    topology_celery_delayed_binding(&in, buf, sizeof buf);
    ck_assert_str_eq(buf, "#.shop");
    in.routing_key = "#";
    topology_celery_delayed_binding(&in, buf, sizeof buf);
    ck_assert_str_eq(buf, "#");
    in.exchange_type = "direct"; /* Celery sends no delayed task through one */
    ck_assert(!topology_celery_delayed(&in));
    in.exchange_type = "topic";
    in.queue_type = "classic"; /* nor without quorum queues */
    ck_assert(!topology_celery_delayed(&in));
}
END_TEST

int main(void)
{
    Suite *s = suite_create("celery_proto");
    TCase *tc = tcase_create("parse");
    tcase_add_test(tc, test_v2);
    tcase_add_test(tc, test_v1);
    tcase_add_test(tc, test_serializers);
    tcase_add_test(tc, test_hostile_bodies);
    tcase_add_test(tc, test_limits);
    tcase_add_test(tc, test_times);
    tcase_add_test(tc, test_decode_job);
    tcase_add_test(tc, test_reply_bodies);
    tcase_add_test(tc, test_reply_queue_shape);
    tcase_add_test(tc, test_celery_delayed_names);
    suite_add_tcase(s, tc);
    return check_run(s);
}
