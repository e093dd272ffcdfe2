/*
 * Integration test of Celery inputs: Debian's real Celery 5.2
 * (tests/integration/celery_producer.py, send_task / apply_async with the
 * rpc:// backend) against the real idemq, RabbitMQ and PostgreSQL. Every
 * task is applied once, duplicates are answered with the first result, a
 * pickle task, an unknown task name and a refused task are parked and
 * answered FAILURE, an expired task is revoked (parked, answered REVOKED,
 * not run), a countdown is held on the broker, ignore_result gets no reply,
 * and a client configured for task protocol 1 is answered as well.
 */
#include <amqp.h>
#include <check.h>

#include "check_run.h"
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "celery.h"
#include "itest.h"
#include "job.h"
#include "topology.h"

#define PYTHON "/usr/bin/python3"
#define CELERY_INPUT                                                                         \
    "protocol = \"celery\"; key_source = \"kwarg:order_id\"; "                               \
    "celery_tasks = [\"shop.charge=idemq_test.celery_charge\", "                             \
    "\"shop.refuse=idemq_test.celery_refuse\"];"

static long effects_of(struct itest *t, const char *key)
{
    return itest_long(t, "SELECT count(*) FROM idemq_test.effects WHERE key = $1", key);
}

static long parked_as(struct itest *t, const char *key, const char *code)
{
    char q[256];
    snprintf(q, sizeof q,
             "SELECT count(*) FROM idemq.parked WHERE key = $1 AND error_code = '%s'", code);
    return itest_long(t, q, key);
}


/* scripts/services ctl ARGS (rabbitmqctl of the test broker) */
static void ctl(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void ctl(const char *fmt, ...)
{
    char args[600], what[700];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(args, sizeof args, fmt, ap);
    va_end(ap);
    snprintf(what, sizeof what, "ctl %s", args);
    ck_assert_msg(itest_services(what) == 0, "scripts/services %s failed", what);
}

/* A protocol 2 Celery task as Celery writes it (headers task and id,
 * body [args, kwargs, embed]), shop.charge of order key, answered to
 * reply_to (NULL: none), through the raw publisher. extra_header: one more
 * integer header (e.g. x-delivery-count), or NULL. */
/* When set, raw_task adds it as the task's traceparent header. */
static const char *task_traceparent;

static void raw_task(struct itest_raw *raw, struct itest *t, const char *id, const char *key,
                     const char *reply_to, const char *extra_header, int extra_value)
{
    amqp_basic_properties_t p;
    amqp_table_entry_t h[4];
    char body[512];
    int nh = 2;

    memset(&p, 0, sizeof p);
    h[0].key = amqp_cstring_bytes("task");
    h[0].value.kind = AMQP_FIELD_KIND_UTF8;
    h[0].value.value.bytes = amqp_cstring_bytes("shop.charge");
    h[1].key = amqp_cstring_bytes("id");
    h[1].value.kind = AMQP_FIELD_KIND_UTF8;
    h[1].value.value.bytes = amqp_cstring_bytes(id);
    if (extra_header) {
        h[2].key = amqp_cstring_bytes(extra_header);
        h[2].value.kind = AMQP_FIELD_KIND_I32;
        h[2].value.value.i32 = extra_value;
        nh = 3;
    }
    if (task_traceparent) {
        h[nh].key = amqp_cstring_bytes("traceparent");
        h[nh].value.kind = AMQP_FIELD_KIND_UTF8;
        h[nh].value.value.bytes = amqp_cstring_bytes(task_traceparent);
        nh++;
    }
    p._flags = AMQP_BASIC_HEADERS_FLAG | AMQP_BASIC_CONTENT_TYPE_FLAG |
               AMQP_BASIC_CONTENT_ENCODING_FLAG | AMQP_BASIC_CORRELATION_ID_FLAG;
    p.headers.num_entries = nh;
    p.headers.entries = h;
    p.content_type = amqp_cstring_bytes("application/json");
    p.content_encoding = amqp_cstring_bytes("utf-8");
    p.correlation_id = amqp_cstring_bytes(id);
    if (reply_to) {
        p._flags |= AMQP_BASIC_REPLY_TO_FLAG;
        p.reply_to = amqp_cstring_bytes(reply_to);
    }
    snprintf(body, sizeof body, "[[], {\"order_id\": \"%s\", \"amount\": 1}, null]", key);
    itest_raw_publish(raw, t->name, t->name, strlen(t->name), body, strlen(body), &p);
}

/* A UUID in Python's str() form, as Celery names its reply queues. */
static void uuid_name(char *buf, size_t len, unsigned seed)
{
    snprintf(buf, len, "%08x-%04x-4%03x-8%03x-%012x", seed * 2654435761u, (seed >> 3) & 0xffff,
             (unsigned)getpid() & 0xfff, seed & 0xfff, (unsigned)time(NULL));
}

/* The traceparent header of the last message take_one took ("" if none). */
static char taken_traceparent[64];

/* One message off queue (auto-ack) into body; false when it is empty. */
static bool take_one(struct itest *t, const char *queue, char *body, size_t len, char *corr,
                     size_t corrlen)
{
    struct broker *b;
    struct job j;
    char err[512];
    idemq_err_t r;
    ck_assert_int_eq(broker_open(t->conf, "itest take", false, &b, err, sizeof err), IDEMQ_OK);
    job_init(&j);
    r = broker_get(b, queue, &j, true);
    if (r == IDEMQ_OK) {
        const char *c = json_string_value(json_object_get(j.props, "correlation_id"));
        const char *tp = json_string_value(json_object_get(j.headers, "traceparent"));
        snprintf(taken_traceparent, sizeof taken_traceparent, "%s", tp ? tp : "");
        snprintf(body, len, "%.*s", (int)j.body_len, (const char *)j.body);
        snprintf(corr, corrlen, "%s", c ? c : "");
    }
    job_destroy(&j);
    broker_close(b);
    return r == IDEMQ_OK;
}

START_TEST(test_celery_producer)
{
    struct itest t;
    char cmd[2048], key[160], out[4096] = "";
    FILE *p;
    pid_t pid;
    int rc;
    struct timespec t0, t1;

    if (access("/usr/lib/python3/dist-packages/celery/__init__.py", R_OK) != 0) {
        fprintf(stderr, "check_celery: python3-celery is not installed (scripts/setup)\n");
        ck_abort_msg("python3-celery missing");
    }
    itest_setup(&t, "celery", "", "", CELERY_INPUT);
    pid = itest_spawn(&t, t.cfg_path, 60, NULL);
    clock_gettime(CLOCK_MONOTONIC, &t0);
    snprintf(cmd, sizeof cmd, "%s %s/tests/integration/celery_producer.py '%s' '%s' '%s' '%s'",
             PYTHON, IDEMQ_SOURCE_DIR, getenv("IDEMQ_AMQP_URL"), t.name, t.name, t.name);
    p = popen(cmd, "r");
    ck_assert_ptr_nonnull(p);
    while (fgets(out, sizeof out, p)) /* the last line is the summary */
        fprintf(stderr, "producer: %s", out);
    rc = pclose(p);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    fprintf(stderr, "check_celery: producer took %.1f s\n",
            (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) / 1e9);
    ck_assert_msg(WIFEXITED(rc) && WEXITSTATUS(rc) == 0, "the Celery producer failed (%d)", rc);

    /* ignore_result: no reply to wait on, so wait for its effect here */
    snprintf(key, sizeof key, "%s-I", t.name);
    for (int ms = 0; ms < itest_ms(10000) && effects_of(&t, key) == 0; ms += 50)
        usleep(50000);
    ck_assert_int_eq(effects_of(&t, key), 1);
    kill(pid, SIGTERM);
    rc = itest_wait(pid, itest_ms(15000));
    ck_assert_msg(WIFEXITED(rc) && WEXITSTATUS(rc) == 0, "idemq exited with %d", rc);

    /* applied once each, whatever the copies */
    snprintf(key, sizeof key, "%s-A", t.name);
    ck_assert_int_eq(effects_of(&t, key), 1);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.attempts WHERE key = $1 AND "
                                    "outcome = 'duplicate'", key) +
                         itest_long(&t, "SELECT count(*) FROM idemq.key_history($1) "
                                        "WHERE kind = 'copy'", key),
                     2);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq_test.effects WHERE key = $1 "
                                    "AND meta->'celery'->>'task' = 'shop.charge' "
                                    "AND meta->'celery'->>'protocol' = '2' "
                                    "AND payload->'args' = '[\"x\"]'",
                                key),
                     1);
    snprintf(key, sizeof key, "%s-B", t.name);
    ck_assert_int_eq(effects_of(&t, key), 1);
    /* protocol 1, from the client with task_protocol = 1: once, as 1 */
    snprintf(key, sizeof key, "%s-V1", t.name);
    ck_assert_int_eq(effects_of(&t, key), 1);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq_test.effects WHERE key = $1 "
                                    "AND meta->'celery'->>'protocol' = '1' "
                                    "AND payload->'args' = '[\"y\"]'",
                                key),
                     1);
    snprintf(key, sizeof key, "%s-C", t.name);
    ck_assert_int_eq(effects_of(&t, key), 1);
    /* parked, never run */
    snprintf(key, sizeof key, "%s-E", t.name);
    ck_assert_int_eq(effects_of(&t, key), 0);
    ck_assert_int_eq(parked_as(&t, key, "celery_expired"), 1);
    snprintf(key, sizeof key, "%s-U", t.name);
    ck_assert_int_eq(effects_of(&t, key), 0);
    ck_assert_int_eq(parked_as(&t, key, "celery_unknown_task"), 1);
    snprintf(key, sizeof key, "%s-R", t.name);
    ck_assert_int_eq(effects_of(&t, key), 0);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.jobs WHERE key = $1 AND "
                                    "state = 'parked'", key),
                     1);
    snprintf(key, sizeof key, "%s-P", t.name);
    ck_assert_int_eq(effects_of(&t, key), 0);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.parked WHERE source_queue = $1 "
                                    "AND error_code = 'celery_pickle' AND key IS NULL",
                                t.name),
                     1);
    itest_teardown(&t);
}
END_TEST

/* idemq is killed after the commit of a task's batch, before its reply and
 * its ack; started again, it answers the waiting client with the first
 * result (the redelivery is a duplicate) and the effect ran once. */
START_TEST(test_kill_between_commit_and_reply)
{
    struct itest t;
    char cmd[2048], key[160], out[4096] = "";
    const char *crash_env[] = {"IDEMQ_TEST_CRASH=after_commit", NULL};
    FILE *p;
    pid_t pid;
    int rc;

    itest_setup(&t, "celery_kill", "", "", CELERY_INPUT);
    pid = itest_spawn(&t, t.cfg_path, 60, crash_env);
    snprintf(cmd, sizeof cmd,
             "%s %s/tests/integration/celery_producer.py '%s' '%s' '%s' '%s' one",
             PYTHON, IDEMQ_SOURCE_DIR, getenv("IDEMQ_AMQP_URL"), t.name, t.name, t.name);
    p = popen(cmd, "r");
    ck_assert_ptr_nonnull(p);
    rc = itest_wait(pid, itest_ms(30000));
    ck_assert_msg(WIFSIGNALED(rc) && WTERMSIG(rc) == SIGKILL, "idemq was not killed (%d)", rc);
    snprintf(key, sizeof key, "%s-K", t.name);
    ck_assert_int_eq(effects_of(&t, key), 1); /* committed, not acknowledged, not answered */
    pid = itest_spawn(&t, t.cfg_path, 60, NULL);
    while (fgets(out, sizeof out, p))
        fprintf(stderr, "producer: %s", out);
    rc = pclose(p);
    ck_assert_msg(WIFEXITED(rc) && WEXITSTATUS(rc) == 0, "the Celery producer failed (%d)", rc);
    ck_assert_ptr_nonnull(strstr(out, "\"charged\": 9"));
    kill(pid, SIGTERM);
    rc = itest_wait(pid, itest_ms(15000));
    ck_assert_msg(WIFEXITED(rc) && WEXITSTATUS(rc) == 0, "idemq exited with %d", rc);
    ck_assert_int_eq(effects_of(&t, key), 1);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.attempts WHERE key = $1 AND "
                                    "outcome = 'duplicate'", key),
                     1);
    itest_teardown(&t);
}
END_TEST

/* Declares a durable queue (admin) with x-max-length 0 and reject-publish
 * when full is true: the broker then nacks every publish to it. */
static void declare_queue(struct itest *t, const char *name, bool full)
{
    struct broker *b;
    char err[512];
    json_t *args = full ? json_pack("{s:i, s:s}", "x-max-length", 0, "x-overflow",
                                    "reject-publish")
                        : NULL;
    ck_assert_int_eq(broker_open(t->conf, "itest declare", false, &b, err, sizeof err), IDEMQ_OK);
    ck_assert_msg(broker_admin_declare_queue(b, name, args, false) == IDEMQ_OK, "%s",
                  broker_error(b));
    broker_close(b);
    json_decref(args);
}

static void delete_queue(struct itest *t, const char *name)
{
    struct broker *b;
    char err[512];
    ck_assert_int_eq(broker_open(t->conf, "itest delete", false, &b, err, sizeof err), IDEMQ_OK);
    ck_assert_int_eq(broker_admin_delete_queue(b, name), IDEMQ_OK);
    broker_close(b);
}

/*
 * No producer chooses where idemq publishes. Under a run user with exactly
 * the broker permissions of consumer/OPERATIONS.md (no amq.default; write
 * on the replies exchange and on UUID-named queues, read on the replies
 * exchange), tasks whose reply_to names an unrelated application queue,
 * another input's queue, idemq's own work queue or its dead-letter queue are
 * applied once and not answered: those queues receive nothing, and each
 * attempt is logged and counted. A Celery-shaped reply queue (a UUID) is
 * answered through the replies exchange; one that refuses every message
 * (x-max-length 0, reject-publish: the broker nacks) costs its reply only.
 * The broker itself refuses the run user a bind of a non-UUID queue.
 */
START_TEST(test_reply_to_only_celery_queues)
{
    struct itest t;
    char run_user[96], pw[64], run_url[300], env_url[340], log[300], app[128], in2[128],
        dlq[TOPOLOGY_NAME_MAX], good[64], full[64], ids[6][64], keys[6][128], body[4096],
        corr[256], err[512];
    const char *targets[6];
    const char *env[] = {env_url, NULL};
    char *admin_url = strdup(getenv("IDEMQ_AMQP_URL"));
    struct itest_raw *raw;
    struct conf *rc;
    struct broker *b;
    int st;

    itest_extra_conf = "topology: { verify = \"passive\"; };";
    itest_setup(&t, "celery_rt", "", "", CELERY_INPUT);
    itest_extra_conf = NULL;
    topology_dlq(&t.conf->inputs[0], dlq, sizeof dlq);
    snprintf(app, sizeof app, "%s_app", t.name);
    snprintf(in2, sizeof in2, "%s_in2", t.name);
    uuid_name(good, sizeof good, 1);
    uuid_name(full, sizeof full, 2);
    declare_queue(&t, app, false);
    declare_queue(&t, in2, false);
    declare_queue(&t, good, false);
    declare_queue(&t, full, true);
    snprintf(run_user, sizeof run_user, "%s_run", t.name);
    snprintf(pw, sizeof pw, "Cr-%d", (int)getpid());
    /* exactly as consumer/OPERATIONS.md "Roles and permissions" writes them */
    ctl("add_user %s %s", run_user, pw);
    ctl("set_permissions -p / %s '^$' "
        "'^(%s\\.(retry|dlx)|idemq\\.celery\\.replies|"
        "[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12})$' "
        "'^(%s|idemq\\.celery\\.replies)$'",
        run_user, t.name, t.name);
    snprintf(run_url, sizeof run_url, "amqp://%s:%s@127.0.0.1%s", run_user, pw,
             strrchr(admin_url, ':'));
    snprintf(env_url, sizeof env_url, "IDEMQ_AMQP_URL=%s", run_url);

    targets[0] = app;    /* an unrelated application queue */
    targets[1] = in2;    /* another input's queue */
    targets[2] = t.name; /* idemq's own work queue */
    targets[3] = dlq;    /* idemq's dead-letter queue */
    targets[4] = good;   /* a Celery client's reply queue */
    targets[5] = full;   /* one that refuses every message */
    raw = itest_raw_open();
    for (int i = 0; i < 6; i++) {
        snprintf(ids[i], sizeof ids[i], "%s-t%d", t.name, i);
        snprintf(keys[i], sizeof keys[i], "%s-k%d", t.name, i);
        raw_task(raw, &t, ids[i], keys[i], targets[i], NULL, 0);
    }
    itest_raw_close(raw);

    snprintf(log, sizeof log, "/tmp/%s.log", t.name);
    st = itest_wait(itest_spawn_log(t.cfg_path, 2, env, log), itest_ms(30000));
    ck_assert_msg(st != -1 && WIFEXITED(st) && WEXITSTATUS(st) == 0,
                  "idemq under the run user did not finish (status 0x%x, log %s)", st, log);
    for (int i = 0; i < 6; i++)
        ck_assert_msg(effects_of(&t, keys[i]) == 1, "%s applied %ld times", keys[i],
                      effects_of(&t, keys[i]));
    ck_assert_int_eq(itest_queue_ready(&t, app), 0);
    ck_assert_int_eq(itest_queue_ready(&t, in2), 0);
    ck_assert_int_eq(itest_queue_ready(&t, t.name), 0);
    ck_assert_int_eq(itest_queue_ready(&t, dlq), 0);
    ck_assert_int_eq(itest_queue_ready(&t, full), 0);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.parked WHERE source_queue = $1",
                                t.name),
                     0);
    ck_assert_msg(take_one(&t, good, body, sizeof body, corr, sizeof corr),
                  "the Celery reply queue got no answer (log %s)", log);
    ck_assert_str_eq(corr, ids[4]);
    ck_assert_msg(strstr(body, "\"SUCCESS\"") && strstr(body, ids[4]), "%s", body);
    ck_assert_int_eq(itest_count_lines(log, "is not a Celery rpc:// reply queue"), 4);
    ck_assert_msg(itest_count_lines(log, "celery replies: sent 1, refused reply_to 4, failed 1") ==
                      1,
                  "no reply summary (log %s)", log);
    ck_assert_int_eq(itest_count_lines(log, "refused by the broker"), 1);

    /* the broker refuses the run user a bind of any non-UUID queue */
    setenv("IDEMQ_AMQP_URL", run_url, 1);
    ck_assert_msg(conf_load(t.cfg_path, &rc, err, sizeof err) == IDEMQ_OK, "%s", err);
    ck_assert_msg(broker_open(rc, "itest bind", true, &b, err, sizeof err) == IDEMQ_OK, "%s",
                  err);
    ck_assert_int_ne(broker_bind_aside(b, app, CELERY_REPLIES_EXCHANGE, app), IDEMQ_OK);
    ck_assert_msg(strstr(broker_error(b), "403"), "%s", broker_error(b));
    ck_assert_int_ne(broker_bind_aside(b, t.name, CELERY_REPLIES_EXCHANGE, t.name), IDEMQ_OK);
    ck_assert_int_eq(broker_bind_aside(b, good, CELERY_REPLIES_EXCHANGE, good), IDEMQ_OK);
    broker_close(b);
    conf_free(rc);
    setenv("IDEMQ_AMQP_URL", admin_url, 1);
    free(admin_url);
    ctl("delete_user %s", run_user);
    delete_queue(&t, app);
    delete_queue(&t, in2);
    delete_queue(&t, good);
    delete_queue(&t, full);
    unlink(log);
    itest_teardown(&t);
}
END_TEST

/*
 * A committed task's reply is best effort: a reply queue that refuses it
 * (the broker nacks: x-max-length 0, reject-publish), or one that is gone
 * (the bind is refused, on a channel of its own), costs that reply only.
 * The batch's deliveries are acknowledged, nothing is redelivered or
 * answered twice, the queue drains, and the failure is counted. The
 * answered task's traceparent continues on its result.
 */
START_TEST(test_refused_reply_holds_nothing)
{
    struct itest t;
    char log[300], good[64], full[64], gone[64], body[4096], corr[256], id[96], key[128],
        id2[96], key2[128], id3[96], key3[128];
    struct itest_raw *raw;
    int st;

    itest_setup(&t, "celery_nack", "", "", CELERY_INPUT);
    uuid_name(good, sizeof good, 3);
    uuid_name(full, sizeof full, 4);
    declare_queue(&t, good, false);
    declare_queue(&t, full, true);
    snprintf(id, sizeof id, "%s-full", t.name);
    snprintf(key, sizeof key, "%s-kf", t.name);
    snprintf(id2, sizeof id2, "%s-good", t.name);
    snprintf(key2, sizeof key2, "%s-kg", t.name);
    uuid_name(gone, sizeof gone, 5); /* a client that went away: no such queue */
    snprintf(id3, sizeof id3, "%s-gone", t.name);
    snprintf(key3, sizeof key3, "%s-kx", t.name);
    raw = itest_raw_open();
    raw_task(raw, &t, id, key, full, NULL, 0);
    raw_task(raw, &t, id3, key3, gone, NULL, 0);
    /* the answered task carries a trace context: its result continues it */
    task_traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
    raw_task(raw, &t, id2, key2, good, NULL, 0);
    task_traceparent = NULL;
    itest_raw_close(raw);
    snprintf(log, sizeof log, "/tmp/%s.log", t.name);
    st = itest_wait(itest_spawn_log(t.cfg_path, 2, NULL, log), itest_ms(30000));
    ck_assert_msg(st != -1 && WIFEXITED(st) && WEXITSTATUS(st) == 0,
                  "idemq did not finish (status 0x%x, log %s)", st, log);
    ck_assert_int_eq(effects_of(&t, key), 1);
    ck_assert_int_eq(effects_of(&t, key2), 1);
    ck_assert_int_eq(effects_of(&t, key3), 1);
    ck_assert_int_eq(itest_queue_ready(&t, t.name), 0);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.attempts WHERE key = $1 AND "
                                    "outcome = 'duplicate'", key),
                     0);
    ck_assert_msg(take_one(&t, good, body, sizeof body, corr, sizeof corr), "no reply (log %s)",
                  log);
    ck_assert_str_eq(corr, id2);
    ck_assert_str_eq(taken_traceparent, "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01");
    ck_assert_msg(!take_one(&t, good, body, sizeof body, corr, sizeof corr),
                  "answered twice: %s", body);
    ck_assert_msg(itest_count_lines(log, "celery replies: sent 1, refused reply_to 0, failed 2") ==
                      1,
                  "no reply summary (log %s)", log);
    ck_assert_int_eq(itest_count_lines(log, "404 NOT_FOUND"), 1); /* the bind, aside */
    delete_queue(&t, good);
    delete_queue(&t, full);
    unlink(log);
    itest_teardown(&t);
}
END_TEST

/* Runs celery_producer.py in mode against t's input; returns its exit
 * status after echoing its output. */
static FILE *producer(struct itest *t, const char *mode)
{
    char cmd[2048];
    FILE *p;
    snprintf(cmd, sizeof cmd, "%s %s/tests/integration/celery_producer.py '%s' '%s' '%s' '%s' %s",
             PYTHON, IDEMQ_SOURCE_DIR, getenv("IDEMQ_AMQP_URL"), t->name, t->name, t->name,
             mode);
    p = popen(cmd, "r");
    ck_assert_ptr_nonnull(p);
    return p;
}

static int producer_done(FILE *p)
{
    char out[4096];
    int rc;
    while (fgets(out, sizeof out, p))
        fprintf(stderr, "producer: %s", out);
    rc = pclose(p);
    return WIFEXITED(rc) ? WEXITSTATUS(rc) : 128;
}

/*
 * `expires` applies only to a task whose key is not claimed yet: a task
 * committed, then idemq killed before its ack, comes back after its
 * expires; it is a duplicate of the applied key, answered with the stored
 * result (not REVOKED), and nothing is parked.
 */
START_TEST(test_expired_redelivery_gets_its_result)
{
    struct itest t;
    char key[160];
    const char *crash_env[] = {"IDEMQ_TEST_CRASH=after_commit", NULL};
    FILE *p;
    pid_t pid;
    int rc;

    itest_setup(&t, "celery_exp", "", "", CELERY_INPUT);
    pid = itest_spawn(&t, t.cfg_path, 60, crash_env);
    p = producer(&t, "expiring");
    rc = itest_wait(pid, itest_ms(30000));
    ck_assert_msg(WIFSIGNALED(rc) && WTERMSIG(rc) == SIGKILL, "idemq was not killed (%d)", rc);
    snprintf(key, sizeof key, "%s-X", t.name);
    ck_assert_int_eq(effects_of(&t, key), 1);
    usleep((useconds_t)itest_ms(4000) * 1000); /* past its expires (3 s) */
    pid = itest_spawn(&t, t.cfg_path, 60, NULL);
    ck_assert_int_eq(producer_done(p), 0);
    kill(pid, SIGTERM);
    rc = itest_wait(pid, itest_ms(15000));
    ck_assert_msg(WIFEXITED(rc) && WEXITSTATUS(rc) == 0, "idemq exited with %d", rc);
    ck_assert_int_eq(effects_of(&t, key), 1);
    ck_assert_int_eq(parked_as(&t, key, "celery_expired"), 0);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.attempts WHERE key = $1 AND "
                                    "outcome = 'duplicate'", key),
                     1);
    itest_teardown(&t);
}
END_TEST

/*
 * A Celery input on a quorum queue parks the last delivery its limit allows
 * (here 2: the copy returned twice by crashes), as every quorum input does,
 * instead of trying it once more.
 */
START_TEST(test_quorum_last_delivery_parked)
{
    struct itest t;
    char key[160], id[96];
    const char *crash[] = {"IDEMQ_TEST_CRASH=before_commit", NULL};
    struct itest_raw *raw;
    int st;

    itest_retry_conf = "max_attempts = 1;";
    itest_setup(&t, "celery_qdl", "", "",
                CELERY_INPUT " queue_type = \"quorum\"; delivery_limit = 2;");
    itest_retry_conf = NULL;
    snprintf(key, sizeof key, "%s-Q", t.name);
    snprintf(id, sizeof id, "%s-q", t.name);
    raw = itest_raw_open();
    raw_task(raw, &t, id, key, NULL, NULL, 0);
    itest_raw_close(raw);
    for (int i = 0; i < 2; i++) { /* x-delivery-count 0 and 1: a crash each */
        st = itest_wait(itest_spawn(&t, t.cfg_path, 5, crash), itest_ms(30000));
        ck_assert_msg(st != -1 && WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL,
                      "run %d: expected the crash hook, status 0x%x", i, st);
    }
    itest_run_until_idle(&t, 2); /* x-delivery-count 2: the last the limit allows */
    ck_assert_int_eq(effects_of(&t, key), 0);
    ck_assert_int_eq(parked_as(&t, key, "delivery_limit"), 1);
    itest_teardown(&t);
}
END_TEST

/*
 * Observe mode on a Celery input has no effect on the clients: a real
 * Celery client waiting on a claimed task and on an unroutable one gets no
 * answer from idemq (the real worker answers); both are observed.
 */
START_TEST(test_observe_never_replies)
{
    struct itest t;
    char key[160], log[300];
    FILE *p;
    pid_t pid;
    int rc;

    itest_setup(&t, "celery_obs", "", "", CELERY_INPUT " mode = \"observe\";");
    snprintf(log, sizeof log, "/tmp/%s.log", t.name);
    pid = itest_spawn_log(t.cfg_path, 60, NULL, log);
    p = producer(&t, "observe");
    ck_assert_int_eq(producer_done(p), 0);
    kill(pid, SIGTERM);
    rc = itest_wait(pid, itest_ms(15000));
    ck_assert_msg(WIFEXITED(rc) && WEXITSTATUS(rc) == 0, "idemq exited with %d", rc);
    snprintf(key, sizeof key, "%s-O1", t.name);
    ck_assert_int_eq(effects_of(&t, key), 0);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.observations WHERE input = $1",
                                t.name),
                     2);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.parked WHERE source_queue = $1",
                                t.name),
                     0);
    ck_assert_msg(itest_count_lines(log, "not sent in observe mode 2") == 1, "log %s", log);
    unlink(log);
    itest_teardown(&t);
}
END_TEST

/*
 * celery_duplicate_reply = "status": where producers that share keys do
 * not trust each other, a duplicate is told SUCCESS or FAILURE (with the
 * park's code) but not the first sender's result or reason.
 */
START_TEST(test_duplicate_status_only)
{
    struct itest t;
    FILE *p;
    pid_t pid;
    int rc;

    itest_setup(&t, "celery_st", "", "", CELERY_INPUT " celery_duplicate_reply = \"status\";");
    pid = itest_spawn(&t, t.cfg_path, 60, NULL);
    p = producer(&t, "status");
    ck_assert_int_eq(producer_done(p), 0);
    kill(pid, SIGTERM);
    rc = itest_wait(pid, itest_ms(15000));
    ck_assert_msg(WIFEXITED(rc) && WEXITSTATUS(rc) == 0, "idemq exited with %d", rc);
    itest_teardown(&t);
}
END_TEST

/*
 * Celery >= 5.5 with quorum queues sends a countdown/ETA task to
 * celery_delayed_27 with the countdown's 28 bits in front of its routing key
 * (kombu's calculate_routing_key); the chain of delay queues brings it to
 * celery_delayed_delivery, bound by the Celery worker back to the task
 * queue. idemq replaces that worker: `idemq declare` declares the chain and
 * the input's bindings, so such a task reaches the input after its
 * countdown and is applied once. The message is published as Celery 5.5
 * does (Debian 12's Celery 5.2 has no native delayed delivery).
 */
START_TEST(test_native_delayed_delivery)
{
    struct itest t;
    char key[160], id[96], rk[400];
    struct itest_raw *raw;
    amqp_basic_properties_t p;
    amqp_table_entry_t h[2];
    char body[512];
    struct timespec t0, t1;
    int countdown = 2;

    itest_setup(&t, "celery_ndd", "", "",
                CELERY_INPUT " queue_type = \"quorum\"; exchange_type = \"topic\";");
    ck_assert(topology_celery_delayed(&t.conf->inputs[0]));
    snprintf(key, sizeof key, "%s-D", t.name);
    snprintf(id, sizeof id, "%s-d", t.name);
    /* '.'.join(f'{countdown:028b}') + '.' + routing_key */
    rk[0] = '\0';
    for (int bit = 27; bit >= 0; bit--)
        strcat(rk, (countdown >> bit) & 1 ? "1." : "0.");
    strcat(rk, t.name);
    memset(&p, 0, sizeof p);
    h[0].key = amqp_cstring_bytes("task");
    h[0].value.kind = AMQP_FIELD_KIND_UTF8;
    h[0].value.value.bytes = amqp_cstring_bytes("shop.charge");
    h[1].key = amqp_cstring_bytes("id");
    h[1].value.kind = AMQP_FIELD_KIND_UTF8;
    h[1].value.value.bytes = amqp_cstring_bytes(id);
    p._flags = AMQP_BASIC_HEADERS_FLAG | AMQP_BASIC_CONTENT_TYPE_FLAG |
               AMQP_BASIC_DELIVERY_MODE_FLAG;
    p.headers.num_entries = 2;
    p.headers.entries = h;
    p.content_type = amqp_cstring_bytes("application/json");
    p.delivery_mode = 2;
    snprintf(body, sizeof body, "[[], {\"order_id\": \"%s\", \"amount\": 1}, null]", key);
    raw = itest_raw_open();
    clock_gettime(CLOCK_MONOTONIC, &t0);
    itest_raw_publish(raw, "celery_delayed_27", rk, strlen(rk), body, strlen(body), &p);
    itest_raw_close(raw);
    ck_assert_int_eq(itest_queue_ready(&t, t.name), 0); /* held in the delay chain */
    for (int ms = 0; ms < itest_ms(15000) && itest_queue_ready(&t, t.name) == 0; ms += 100)
        usleep(100000);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    ck_assert_int_eq(itest_queue_ready(&t, t.name), 1);
    ck_assert_msg(t1.tv_sec - t0.tv_sec >= countdown - 1, "arrived after %ld s",
                  (long)(t1.tv_sec - t0.tv_sec));
    itest_run_until_idle(&t, 2);
    ck_assert_int_eq(effects_of(&t, key), 1);
    itest_teardown(&t);
}
END_TEST

/*
 * The same with a real Celery >= 5.5 client (send_task with a countdown to
 * a quorum queue behind a topic exchange), run in a root that has it
 * (IDEMQ_CELERY55_ROOT, e.g. `debootstrap --variant=minbase
 * --include=python3-celery trixie DIR`: Debian 13's Celery 5.5). Without
 * that root the case says so and checks nothing.
 */
START_TEST(test_native_delayed_delivery_celery55)
{
    struct itest t;
    const char *root = getenv("IDEMQ_CELERY55_ROOT");
    char cmd[2048], key[160], out[4096] = "";
    FILE *p;
    pid_t pid;
    int rc;

    if (!root || !root[0]) {
        fprintf(stderr, "check_celery: IDEMQ_CELERY55_ROOT is not set: the Celery 5.5 client "
                        "case is not run\n");
        return;
    }
    itest_setup(&t, "celery_c55", "", "",
                CELERY_INPUT " queue_type = \"quorum\"; exchange_type = \"topic\";");
    snprintf(cmd, sizeof cmd, "mkdir -p '%s/tmp/idemq' && cp %s/tests/integration/celery_producer.py "
             "'%s/tmp/idemq/'", root, IDEMQ_SOURCE_DIR, root);
    ck_assert_int_eq(system(cmd), 0);
    pid = itest_spawn(&t, t.cfg_path, 60, NULL);
    snprintf(cmd, sizeof cmd, "chroot '%s' /usr/bin/python3 /tmp/idemq/celery_producer.py "
             "'%s' '%s' '%s' '%s' delayed 2>&1", root, getenv("IDEMQ_AMQP_URL"), t.name, t.name,
             t.name);
    ck_assert_ptr_nonnull(p = popen(cmd, "r"));
    while (fgets(out, sizeof out, p))
        fprintf(stderr, "producer: %s", out);
    rc = pclose(p);
    ck_assert_msg(WIFEXITED(rc) && WEXITSTATUS(rc) == 0, "the Celery 5.5 producer failed (%d)",
                  rc);
    ck_assert_msg(strstr(out, "\"celery\": \"5.") && strstr(out, "\"failures\": []"), "%s", out);
    kill(pid, SIGTERM);
    rc = itest_wait(pid, itest_ms(15000));
    ck_assert_msg(WIFEXITED(rc) && WEXITSTATUS(rc) == 0, "idemq exited with %d", rc);
    snprintf(key, sizeof key, "%s-N", t.name);
    ck_assert_int_eq(effects_of(&t, key), 1);
    itest_teardown(&t);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("celery");
    TCase *tc = tcase_create("producer");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, test_celery_producer);
    tcase_add_test(tc, test_kill_between_commit_and_reply);
    tcase_add_test(tc, test_reply_to_only_celery_queues);
    tcase_add_test(tc, test_refused_reply_holds_nothing);
    tcase_add_test(tc, test_expired_redelivery_gets_its_result);
    tcase_add_test(tc, test_quorum_last_delivery_parked);
    tcase_add_test(tc, test_observe_never_replies);
    tcase_add_test(tc, test_duplicate_status_only);
    tcase_add_test(tc, test_native_delayed_delivery);
    tcase_add_test(tc, test_native_delayed_delivery_celery55);
    suite_add_tcase(s, tc);
    /* least-privilege mode (scripts/test): these again, as the deployment's roles */
    itest_lp_tcase(s, (const TTest *const[]){test_celery_producer, NULL});
    return check_run(s);
}
