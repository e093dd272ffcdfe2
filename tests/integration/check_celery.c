/*
 * Integration test of Celery inputs (issue 19): Debian's real Celery 5.2
 * (tests/integration/celery_producer.py, send_task / apply_async with the
 * rpc:// backend) against the real idemq, RabbitMQ and PostgreSQL. Every
 * task is applied once, duplicates are answered with the first result, a
 * pickle task, an unknown task name and a refused task are parked and
 * answered FAILURE, an expired task is revoked (parked, answered REVOKED,
 * not run), a countdown is held on the broker, ignore_result gets no reply,
 * and a client configured for task protocol 1 is answered as well.
 */
#include <check.h>

#include "check_run.h"
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "itest.h"

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

int main(void)
{
    Suite *s = suite_create("celery");
    TCase *tc = tcase_create("producer");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, test_celery_producer);
    tcase_add_test(tc, test_kill_between_commit_and_reply);
    suite_add_tcase(s, tc);
    /* least-privilege mode (scripts/test): these again, as the deployment's roles */
    itest_lp_tcase(s, (const TTest *const[]){test_celery_producer, NULL});
    return check_run(s);
}
