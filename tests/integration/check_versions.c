/*
 * check_versions: what changed in RabbitMQ 4, against the
 * servers of scripts/services IDEMQ_RABBITMQ=4.0. On another broker version
 * (IDEMQ_SERVER_RABBITMQ of the env file) every case is skipped with a
 * message and the program passes, except for the cases that need no 4.x
 * feature (marked "any version"), which run on every pair.
 *
 *   1. A quorum input whose queue was declared without x-delivery-limit (by
 *      an older idemq): RabbitMQ 4.0 gives it a delivery limit of 20 and,
 *      without a dead-letter exchange, drops a message returned once more
 *      (shown on a control queue). A job on its last allowed delivery is
 *      parked by idemq with its key and story, never applied, never lost.
 *   2. (any version) x-acquired-count, RabbitMQ 4.3's count of hand-outs,
 *      is recorded with the attempt and shown by `jobs show`; a value that
 *      is no sane integer (a producer's text) is recorded as unknown.
 *   3. (any version) PostgreSQL 17's transaction_timeout bounds a worker
 *      session's transactions (twice the call deadline): set and enforced
 *      on 17, absent on 15 where the same session works without it.
 *   4. What RabbitMQ 4.3 removes is refused by this 4.0 node
 *      (scripts/services sets deprecated_features.permit.global_qos,
 *      .transient_nonexcl_queues and .queue_master_locator to false): a
 *      transient non-exclusive queue fails and a global basic.qos is logged
 *      as not permitted (4.0 still answers qos-ok; 4.3 refuses it), while
 *      idemq's own declares of a classic, a quorum and an ordered (lanes)
 *      input and `idemq declare` succeed, with no x-queue-version or
 *      x-queue-mode on any queue.
 */
#include <amqp.h>
#include <check.h>

#include "check_run.h"
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "broker_admin.h"
#include "itest.h"
#include "ledger_db.h"
#include "topology.h"

#define EFFECTS_FOR "SELECT count(*) FROM idemq_test.effects WHERE key = $1"

/* Takes the head of queue with basic.get and gives it back with
 * basic.reject(requeue): one counted return on RabbitMQ 4.0. false when the
 * queue was empty. */
static bool get_and_return(struct broker *b, const char *queue)
{
    amqp_connection_state_t c = broker_amqp(b);
    amqp_rpc_reply_t r = amqp_basic_get(c, BROKER_CHANNEL, amqp_cstring_bytes(queue), 0);
    amqp_message_t m;
    uint64_t tag;
    ck_assert_int_eq(r.reply_type, AMQP_RESPONSE_NORMAL);
    if (r.reply.id == AMQP_BASIC_GET_EMPTY_METHOD)
        return false;
    ck_assert_int_eq(r.reply.id, AMQP_BASIC_GET_OK_METHOD);
    tag = ((amqp_basic_get_ok_t *)r.reply.decoded)->delivery_tag;
    r = amqp_read_message(c, BROKER_CHANNEL, &m, 0);
    ck_assert_int_eq(r.reply_type, AMQP_RESPONSE_NORMAL);
    amqp_destroy_message(&m);
    ck_assert_int_eq(amqp_basic_reject(c, BROKER_CHANNEL, tag, 1), 0);
    return true;
}

/* Ready messages of queue, polled until it is want or the deadline passes
 * (the broker's counts settle asynchronously). */
static long ready_settled(struct itest *t, const char *queue, long want)
{
    long n = itest_queue_ready(t, queue);
    for (int i = 0; i < 100 && n != want; i++) {
        usleep(50000);
        n = itest_queue_ready(t, queue);
    }
    return n;
}

/* 1. The 4.0 default delivery limit of a quorum queue without x-delivery-limit. */
START_TEST(test_default_delivery_limit)
{
    struct itest t;
    char q[128], ctl[160], cfg[256], out[16384], key[160], body[256], reason[512];
    struct broker *b;
    struct conf *old;
    char err[512];
    json_t *legacy = json_pack("{s:s}", "x-queue-type", "quorum");
    int st, returns;

    itest_setup(&t, "dlim", "idemq_test.record", "", "");
    snprintf(q, sizeof q, "%s_old", t.name);
    snprintf(ctl, sizeof ctl, "%s_ctl", t.name);
    ck_assert(broker_open(t.conf, "itest", false, &b, err, sizeof err) == IDEMQ_OK);
    ck_assert(broker_admin_declare_queue(b, q, legacy, false) == IDEMQ_OK);
    ck_assert(broker_admin_declare_queue(b, ctl, legacy, false) == IDEMQ_OK);
    snprintf(cfg, sizeof cfg, "/tmp/%s_old.cfg", t.name);
    itest_write_config(&t, cfg, q, "idemq_test.record", "", "queue_type = \"quorum\";");
    ck_assert(conf_load(cfg, &old, err, sizeof err) == IDEMQ_OK);
    snprintf(out, sizeof out, "%s declare -c %s 2>&1", IDEMQ_BINARY, cfg);
    {
        FILE *p = popen(out, "r");
        size_t n = fread(out, 1, sizeof out - 1, p);
        out[n] = '\0';
        st = pclose(p);
        ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0, "%s", out);
    }
    ck_assert_msg(strstr(out, "by an older idemq"), "%s", out); /* accepted, with the warning */

    /* The control: 21 returns of a message on such a queue lose it. */
    itest_publish_to(&t, "", ctl, "{\"control\":1}", NULL, NULL);
    ck_assert_int_eq(ready_settled(&t, ctl, 1), 1);
    for (returns = 0; returns < 21; returns++)
        ck_assert_msg(get_and_return(b, ctl), "control message gone after %d returns", returns);
    ck_assert_int_eq(ready_settled(&t, ctl, 0), 0);
    ck_assert(!get_and_return(b, ctl)); /* dropped by the broker: the 4.0 default of 20 */

    /* The job: returned 20 times, so the next delivery is its last. */
    snprintf(key, sizeof key, "%s:last", t.name);
    snprintf(body, sizeof body, "{\"job_id\":\"%s\"}", key);
    itest_publish_to(&t, old->inputs[0].exchange, old->inputs[0].routing_key, body, NULL, NULL);
    ck_assert_int_eq(ready_settled(&t, q, 1), 1);
    for (returns = 0; returns < 20; returns++)
        ck_assert(get_and_return(b, q));
    ck_assert_int_eq(ready_settled(&t, q, 1), 1);

    st = itest_wait(itest_spawn(&t, cfg, 3, NULL), itest_ms(60000));
    ck_assert_msg(st != -1 && WIFEXITED(st) && WEXITSTATUS(st) == 0, "status 0x%x", st);
    ck_assert_int_eq(itest_long(&t, EFFECTS_FOR, key), 0); /* not tried */
    ck_assert_int_eq(itest_long(&t,
                                "SELECT count(*) FROM idemq.parked WHERE key = $1 "
                                "AND error_code = 'delivery_limit'",
                                key),
                     1);
    ck_assert_ptr_nonnull(itest_text(&t, "SELECT reason FROM idemq.parked WHERE key = $1", key,
                                     reason, sizeof reason));
    ck_assert_msg(strstr(reason, "x-delivery-count 20") && strstr(reason, "limit 20"), "%s",
                  reason);
    ck_assert_int_eq(itest_queue_ready(&t, q), 0);

    ck_assert(broker_admin_delete_queue(b, ctl) == IDEMQ_OK);
    broker_close(b);
    itest_delete_topology(&t, &old->inputs[0]);
    conf_free(old);
    unlink(cfg);
    json_decref(legacy);
    itest_teardown(&t);
}
END_TEST

/* 2. (any version) x-acquired-count with the attempt. No 4.3 broker here:
 * the header is what a 4.3 quorum queue adds to a delivery, sent by the
 * test on a classic input (which is also how a producer could forge it:
 * recorded, never acted on). */
START_TEST(test_acquired_count_recorded)
{
    struct itest t;
    char key[160], bad[160], body[256], args[256], out[16384];
    json_t *h;

    itest_setup(&t, "acq", "idemq_test.record", "", "");
    snprintf(key, sizeof key, "%s:acq", t.name);
    snprintf(bad, sizeof bad, "%s:text", t.name);
    /* attempt 1 fails (a transient error: an attempt row), attempt 2 applies */
    snprintf(body, sizeof body, "{\"job_id\":\"%s\",\"raise\":\"40001\",\"raise_until\":1}",
             key);
    h = json_pack("{s:I}", "x-acquired-count", (json_int_t)4);
    itest_publish_to(&t, t.conf->inputs[0].exchange, t.conf->inputs[0].routing_key, body, h,
                     NULL);
    json_decref(h);
    snprintf(body, sizeof body, "{\"job_id\":\"%s\",\"raise\":\"40001\",\"raise_until\":1}",
             bad);
    h = json_pack("{s:s}", "x-acquired-count", "999999999999");
    itest_publish_to(&t, t.conf->inputs[0].exchange, t.conf->inputs[0].routing_key, body, h,
                     NULL);
    json_decref(h);
    itest_run_until_idle(&t, 2);
    ck_assert_int_eq(itest_long(&t, EFFECTS_FOR, key), 1);
    ck_assert_int_eq(itest_long(&t, EFFECTS_FOR, bad), 1);
    ck_assert_int_eq(itest_long(&t,
                                "SELECT count(*) FROM idemq.attempts WHERE key = $1 "
                                "AND outcome = 'transient_error' AND acquired_count = 4",
                                key),
                     1);
    ck_assert_int_eq(itest_long(&t,
                                "SELECT count(*) FROM idemq.attempts WHERE key = $1 "
                                "AND outcome = 'transient_error' AND acquired_count IS NULL",
                                bad),
                     1);
    snprintf(args, sizeof args, "jobs show %s", key);
    ck_assert_int_eq(itest_idemq(&t, args, out, sizeof out), 0);
    ck_assert_msg(strstr(out, "acquired 4 times"), "%s", out);
    itest_teardown(&t);
}
END_TEST

/* 3. (any version) transaction_timeout on PostgreSQL 17, none before. A
 * session opened like a worker's (statement_timeout 250 ms, call deadline
 * 600 ms: transaction_timeout 1200 ms on 17) leaves a transaction open
 * 1.5 s: 17 ends the session, 15 keeps it. */
START_TEST(test_transaction_timeout)
{
    const char *dsn = getenv("IDEMQ_PG_DSN");
    char err[512];
    PGconn *db;
    PGresult *r;
    bool v17;

    ck_assert_ptr_nonnull(dsn);
    ledger_db_set_call_timeout(600);
    db = ledger_db_connect(dsn, "itest txn_timeout", 250, err, sizeof err);
    ck_assert_msg(db, "%s", err);
    v17 = PQserverVersion(db) >= 170000;
    printf("check_versions: PostgreSQL %d\n", PQserverVersion(db));
    r = ledger_db_exec_raw(db, "SELECT current_setting('transaction_timeout', true)");
    ck_assert_int_eq(PQresultStatus(r), PGRES_TUPLES_OK);
    if (v17)
        ck_assert_str_eq(PQgetvalue(r, 0, 0), "1200ms");
    else
        ck_assert(PQgetisnull(r, 0, 0)); /* no such setting before 17 */
    PQclear(r);
    r = ledger_db_exec_raw(db, "BEGIN");
    ck_assert_int_eq(PQresultStatus(r), PGRES_COMMAND_OK);
    PQclear(r);
    usleep(1500000);
    r = ledger_db_exec_raw(db, "SELECT 1");
    if (v17)
        ck_assert(PQresultStatus(r) != PGRES_TUPLES_OK || PQstatus(db) == CONNECTION_BAD);
    else
        ck_assert_int_eq(PQresultStatus(r), PGRES_TUPLES_OK);
    PQclear(r);
    PQfinish(db);

    /* tools' sessions (no statement_timeout, no call deadline) get none */
    ledger_db_set_call_timeout(0);
    db = ledger_db_connect(dsn, "itest txn_timeout tool", 0, err, sizeof err);
    ck_assert_msg(db, "%s", err);
    r = ledger_db_exec_raw(db, "SELECT coalesce(current_setting('transaction_timeout', true), "
                               "'none')");
    ck_assert_int_eq(PQresultStatus(r), PGRES_TUPLES_OK);
    ck_assert_str_eq(PQgetvalue(r, 0, 0), v17 ? "0" : "none");
    PQclear(r);
    PQfinish(db);
}
END_TEST

/* One raw RPC on a fresh connection; true when the broker accepted it. */
static bool raw_ok(struct itest *t, int what, const char *name)
{
    struct broker *b;
    char err[512];
    amqp_rpc_reply_t r;
    bool ok;
    ck_assert(broker_open(t->conf, "itest removed", false, &b, err, sizeof err) == IDEMQ_OK);
    if (what == 0)
        amqp_basic_qos(broker_amqp(b), BROKER_CHANNEL, 0, 10, 1); /* global */
    else
        amqp_queue_declare(broker_amqp(b), BROKER_CHANNEL, amqp_cstring_bytes(name), 0, 0, 0, 0,
                           amqp_empty_table); /* transient, not exclusive */
    r = amqp_get_rpc_reply(broker_amqp(b));
    ok = r.reply_type == AMQP_RESPONSE_NORMAL;
    if (!ok && r.reply_type == AMQP_RESPONSE_SERVER_EXCEPTION &&
        r.reply.id == AMQP_CHANNEL_CLOSE_METHOD) {
        amqp_channel_close_t *c = r.reply.decoded;
        printf("check_versions: refused: %u %.*s\n", c->reply_code, (int)c->reply_text.len,
               (char *)c->reply_text.bytes);
    }
    broker_close(b);
    return ok;
}

/* Queue arguments through the management API carry neither x-queue-version
 * nor x-queue-mode, and the queue is durable. */
static void no_v1_args(struct itest *t, const char *queue)
{
    char cmd[1024], out[8192];
    FILE *p;
    size_t n;
    (void)t;
    snprintf(cmd, sizeof cmd,
             "curl -sf -u guest:guest '%s/api/queues/%%2F/%s?columns=durable,exclusive,"
             "auto_delete,arguments'",
             getenv("IDEMQ_RABBIT_MGMT_URL"), queue);
    ck_assert_ptr_nonnull(p = popen(cmd, "r"));
    n = fread(out, 1, sizeof out - 1, p);
    out[n] = '\0';
    ck_assert_int_eq(pclose(p), 0);
    ck_assert_msg(strstr(out, "\"durable\":true") && strstr(out, "\"exclusive\":false"), "%s: %s",
                  queue, out);
    ck_assert_msg(!strstr(out, "x-queue-version") && !strstr(out, "x-queue-mode"), "%s: %s",
                  queue, out);
}

/* Lines of the node's log naming a deprecated feature's use (the node logs
 * the first use of each, and every refusal). */
static long not_permitted_lines(void)
{
    char cmd[1024];
    long n = -1;
    FILE *p;
    snprintf(cmd, sizeof cmd,
             "cat '%s'/rabbit-4.0/log/*.log 2>/dev/null | grep -c 'is deprecated'",
             getenv("IDEMQ_STATE_DIR"));
    ck_assert_ptr_nonnull(p = popen(cmd, "r"));
    ck_assert_int_eq(fscanf(p, "%ld", &n), 1);
    pclose(p);
    return n;
}

START_TEST(test_removed_features_unused)
{
    struct itest t, tq, tl;
    char q[200], out[16384];
    long before, after;
    ck_assert_ptr_nonnull(getenv("IDEMQ_RABBIT_MGMT_URL"));
    ck_assert_ptr_nonnull(getenv("IDEMQ_STATE_DIR"));
    before = not_permitted_lines();
    itest_setup(&t, "rmc", "idemq_test.record", "", "");
    itest_setup(&tq, "rmq", "idemq_test.record", "", "queue_type = \"quorum\";");
    itest_setup(&tl, "rml", "idemq_test.record", "",
                "queue_type = \"quorum\"; partitions = 2; order_key_source = \"json:k\";");
    /* what idemq declares is accepted: itest_setup declared each input,
     * `idemq declare` again (the CLI path), and idemq sets per-consumer QoS */
    ck_assert_int_eq(itest_idemq(&t, "declare", out, sizeof out), 0);
    ck_assert_int_eq(itest_idemq(&tq, "declare", out, sizeof out), 0);
    ck_assert_int_eq(itest_idemq(&tl, "declare", out, sizeof out), 0);
    ck_assert_int_eq(itest_idemq(&tl, "run --until-idle 1", out, sizeof out), 0);
    no_v1_args(&t, t.name);
    snprintf(q, sizeof q, "%s.dead", t.name);
    no_v1_args(&t, q);
    no_v1_args(&tq, tq.name);
    topology_partition_queue(&tl.conf->inputs[0], 1, q, sizeof q);
    no_v1_args(&tl, q);
    /* none of that used a deprecated feature (the log would name it) */
    usleep(500000);
    ck_assert_int_eq(not_permitted_lines(), before);
    /* while the node refuses a transient non-exclusive queue, and logs the
     * refusal; a global basic.qos 4.0 only logs as not permitted (once per
     * node) and still answers qos-ok (4.3 refuses it) */
    snprintf(q, sizeof q, "%s_transient", t.name);
    ck_assert(!raw_ok(&t, 1, q));
    after = not_permitted_lines();
    for (int i = 0; i < 100 && after == before; i++) {
        usleep(50000);
        after = not_permitted_lines();
    }
    ck_assert_int_gt(after, before);
    printf("check_versions: a global basic.qos on this node: %s\n",
           raw_ok(&t, 0, NULL) ? "qos-ok (logged as not permitted)" : "refused");
    itest_teardown(&tl);
    itest_teardown(&tq);
    itest_teardown(&t);
}
END_TEST

int main(void)
{
    const char *v = getenv("IDEMQ_SERVER_RABBITMQ");
    bool v4 = v && strncmp(v, "4.", 2) == 0;
    Suite *s;
    TCase *tc;
    if (!v4)
        printf("check_versions: the RabbitMQ 4 cases skipped: they need RabbitMQ 4.x "
               "(scripts/services IDEMQ_RABBITMQ=4.0); this env file's broker is %s\n",
               v ? v : "3.10 (IDEMQ_SERVER_RABBITMQ unset)");
    s = suite_create("versions");
    tc = tcase_create("versions");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, test_acquired_count_recorded);
    tcase_add_test(tc, test_transaction_timeout);
    if (v4)
        tcase_add_test(tc, test_default_delivery_limit);
    if (v4)
        tcase_add_test(tc, test_removed_features_unused);
    suite_add_tcase(s, tc);
    return check_run(s);
}
