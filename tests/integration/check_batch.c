/*
 * Integration tests of batching: failure isolation inside one batch and a
 * crash before a batch's commit, against the real RabbitMQ and PostgreSQL
 * (see itest.h). Correctness, not speed: scripts/bench measures speed.
 */
#include <check.h>

#include "check_run.h"
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "itest.h"

#define EFFECTS_FOR "SELECT count(*) FROM idemq_test.effects WHERE key = $1"
/* Every delivery of a key in its history: attempt rows and, for a plain
 * apply, the batch history (idemq.key_history reads both). */
#define ATTEMPTS_FOR(outcome)                                                                \
    "SELECT count(*) FROM idemq.key_history($1) WHERE outcome = '" outcome "'"
#define STATE_OF "SELECT state FROM idemq.jobs WHERE key = $1"

/* Every delivery of these tests fits one batch: collected for up to 1 s. */
#define ONE_BATCH "batch_max = 50; batch_wait_ms = 1000;"

static void body(char *buf, size_t len, const char *key, const char *extra)
{
    snprintf(buf, len, "{\"job_id\":\"%s\",\"amount_minor\":100%s%s}", key, extra ? "," : "",
             extra ? extra : "");
}

/*
 * One batch: good jobs, a permanent failure, a transient failure and two
 * copies of one key. The good ones commit once each (in delivery order, in
 * the batch's one transaction, beside the failures' records); the second
 * copy is a duplicate; the permanent one is parked; the transient one has a
 * transient_error attempt and is never applied twice (how the broker brings
 * it back is the retry path's business, not asserted here).
 */
START_TEST(test_batch_isolation)
{
    struct itest t;
    char keys[9][128], bodies_buf[9][256], v[64];
    const char *bodies[9];
    /* Publish order: g0 g1 perm g2 trans g3 g2(copy) g4 g5 */
    const char *names[9] = {"g0", "g1", "perm", "g2", "trans", "g3", "g2", "g4", "g5"};
    const char *extra[9] = {NULL, NULL, "\"raise\":\"22023\"", NULL,
                            "\"raise\":\"40001\",\"raise_until\":1", NULL, NULL, NULL,
                            NULL};
    const int good[6] = {0, 1, 3, 5, 7, 8};
    char gkey[128], permkey[128], transkey[128];

    itest_setup(&t, "batch", "idemq_test.record", ONE_BATCH, "");
    for (int i = 0; i < 9; i++) {
        snprintf(keys[i], sizeof keys[i], "%s:%s", t.name, names[i]);
        body(bodies_buf[i], sizeof bodies_buf[i], keys[i], extra[i]);
        bodies[i] = bodies_buf[i];
    }
    snprintf(permkey, sizeof permkey, "%s:perm", t.name);
    snprintf(transkey, sizeof transkey, "%s:trans", t.name);
    itest_publish(&t, bodies, 9);
    itest_run_until_idle(&t, 2);

    for (int g = 0; g < 6; g++) {
        const char *k = keys[good[g]];
        ck_assert_msg(itest_long(&t, EFFECTS_FOR, k) == 1, "%s: effect count", k);
        ck_assert_int_eq(itest_long(&t, ATTEMPTS_FOR("applied"), k), 1);
        ck_assert_str_eq(itest_text(&t, STATE_OF, k, v, sizeof v), "applied");
        ck_assert_int_eq(itest_long(&t, "SELECT attempts FROM idemq.jobs WHERE key = $1", k), 1);
    }
    /* The second copy of g2: recorded as a duplicate, no second effect. */
    ck_assert_int_eq(itest_long(&t, ATTEMPTS_FOR("duplicate"), keys[3]), 1);
    for (int g = 0; g < 6; g++)
        if (good[g] != 3)
            ck_assert_int_eq(itest_long(&t, ATTEMPTS_FOR("duplicate"), keys[good[g]]), 0);
    /* The permanent failure: parked with its reason, never applied. */
    ck_assert_int_eq(itest_long(&t, EFFECTS_FOR, permkey), 0);
    ck_assert_str_eq(itest_text(&t, STATE_OF, permkey, v, sizeof v), "parked");
    ck_assert_int_eq(itest_long(&t, ATTEMPTS_FOR("permanent_error"), permkey), 1);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.parked WHERE key = $1 AND "
                                    "error_class = 'permanent' AND sqlstate = '22023'",
                                permkey),
                     1);
    /* The transient failure: its first attempt failed transiently (and was
     * recorded), and it is never applied twice. */
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.attempts WHERE key = $1 AND "
                                    "attempt = 1 AND outcome = 'transient_error' AND "
                                    "error_class = 'transient' AND sqlstate = '40001'",
                                transkey),
                     1);
    ck_assert_int_le(itest_long(&t, EFFECTS_FOR, transkey), 1);
    ck_assert_int_le(itest_long(&t, ATTEMPTS_FOR("applied"), transkey), 1);
    /* One batch, one transaction: the good jobs' effects and the records of
     * the failures and of the duplicate (written outside any
     * subtransaction) belong to the same top-level transaction. */
    ck_assert_int_eq(itest_long(&t, "SELECT count(DISTINCT x) FROM ("
                                    " SELECT txid % 4294967296 AS x FROM idemq_test.effects"
                                    "  WHERE key LIKE $1 || ':g%'"
                                    " UNION ALL SELECT xmin::text::bigint FROM idemq.attempts"
                                    "  WHERE key LIKE $1 || ':%' AND outcome IN "
                                    "  ('duplicate', 'permanent_error', 'transient_error')"
                                    "  AND attempt = 1) s",
                                t.name),
                     1);
    /* Ordered within the batch: effects ran in delivery order. */
    snprintf(gkey, sizeof gkey, "%s:g", t.name);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM (SELECT key, id, lag(key) OVER "
                                    "(ORDER BY id) AS prev FROM idemq_test.effects WHERE "
                                    "key LIKE $1 || '%') s WHERE prev > key",
                                gkey),
                     0);
    ck_assert_int_eq(itest_queue_ready(&t, t.name), 0);
    itest_teardown(&t);
}
END_TEST

/*
 * A batch killed (SIGKILL) after its statements ran but before COMMIT:
 * nothing of it is in the ledger, every delivery comes back, and a normal
 * rerun applies each key exactly once.
 */
START_TEST(test_batch_crash_before_commit)
{
    struct itest t;
    char keys[8][128], bodies_buf[9][256];
    const char *bodies[9];
    const char *env[] = {"IDEMQ_TEST_CRASH=before_commit", NULL};
    int st;

    itest_setup(&t, "bcrash", "idemq_test.record", ONE_BATCH, "");
    for (int i = 0; i < 8; i++) {
        snprintf(keys[i], sizeof keys[i], "%s:k%d", t.name, i);
        body(bodies_buf[i], sizeof bodies_buf[i], keys[i], NULL);
        bodies[i] = bodies_buf[i];
    }
    bodies[8] = bodies_buf[2]; /* a second copy of k2 in the same batch */
    itest_publish(&t, bodies, 9);
    st = itest_wait(itest_spawn(&t, t.cfg_path, 5, env), itest_ms(30000));
    ck_assert_msg(st != -1 && WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL,
                  "expected the crash hook to SIGKILL idemq, status 0x%x", st);
    /* Not committed: no trace in the ledger or the effects. */
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.jobs WHERE key LIKE $1 || ':%'",
                                t.name),
                     0);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.attempts WHERE key LIKE $1 || "
                                    "':%'",
                                t.name),
                     0);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq_test.effects WHERE key LIKE "
                                    "$1 || ':%'",
                                t.name),
                     0);
    /* Every delivery is back on the queue. */
    for (int i = 0; i < 50 && itest_queue_ready(&t, t.name) != 9; i++)
        usleep(100000);
    ck_assert_int_eq(itest_queue_ready(&t, t.name), 9);

    itest_run_until_idle(&t, 2);
    for (int i = 0; i < 8; i++) {
        ck_assert_int_eq(itest_long(&t, EFFECTS_FOR, keys[i]), 1);
        ck_assert_int_eq(itest_long(&t, ATTEMPTS_FOR("applied"), keys[i]), 1);
        ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.key_history($1) "
                                        "WHERE outcome = 'applied' AND redelivered",
                                    keys[i]),
                         1);
    }
    ck_assert_int_eq(itest_long(&t, ATTEMPTS_FOR("duplicate"), keys[2]), 1);
    ck_assert_int_eq(itest_queue_ready(&t, t.name), 0);
    itest_teardown(&t);
}
END_TEST

/*
 * A larger batch of plain jobs (new keys, copies inside the batch, keys
 * applied by an earlier run) takes the set-based path: one transaction,
 * one effect per key, a duplicate attempt per copy, the effects in
 * delivery order.
 */
START_TEST(test_batch_plain_duplicates)
{
    struct itest t;
    enum { N = 40 };
    char keys[N][128], bodies_buf[N][256], k[128];
    const char *bodies[N];

    itest_setup(&t, "bplain", "idemq_test.record", ONE_BATCH, "");
    /* First run: k0..k9 applied. */
    for (int i = 0; i < 10; i++) {
        snprintf(keys[i], sizeof keys[i], "%s:k%02d", t.name, i);
        body(bodies_buf[i], sizeof bodies_buf[i], keys[i], NULL);
        bodies[i] = bodies_buf[i];
    }
    itest_publish(&t, bodies, 10);
    itest_run_until_idle(&t, 1);
    /* Second run: k0..k29, with every third of k10..k29 sent twice. */
    int n = 0;
    for (int i = 0; i < 30 && n < N; i++) {
        snprintf(keys[n], sizeof keys[n], "%s:k%02d", t.name, i);
        body(bodies_buf[n], sizeof bodies_buf[n], keys[n], NULL);
        bodies[n] = bodies_buf[n];
        n++;
        if (i >= 10 && i % 3 == 0 && n < N) {
            bodies[n] = bodies_buf[n - 1];
            n++;
        }
    }
    itest_publish(&t, bodies, n);
    itest_run_until_idle(&t, 2);
    for (int i = 0; i < 30; i++) {
        long copies = i >= 10 && i % 3 == 0 ? 2 : 1;
        snprintf(k, sizeof k, "%s:k%02d", t.name, i);
        ck_assert_int_eq(itest_long(&t, EFFECTS_FOR, k), 1);
        ck_assert_int_eq(itest_long(&t, ATTEMPTS_FOR("applied"), k), 1);
        ck_assert_int_eq(itest_long(&t, ATTEMPTS_FOR("duplicate"), k), i < 10 ? 1 : copies - 1);
    }
    /* The second run was one transaction. */
    ck_assert_int_eq(itest_long(&t, "SELECT count(DISTINCT txid) FROM idemq_test.effects "
                                    "WHERE key LIKE $1 || ':%' AND key >= $1 || ':k10'",
                                t.name),
                     1);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM (SELECT key, lag(key) OVER (ORDER BY "
                                    "id) AS prev FROM idemq_test.effects WHERE key LIKE $1 || "
                                    "':%') s WHERE prev > key",
                                t.name),
                     0);
    ck_assert_int_eq(itest_queue_ready(&t, t.name), 0);
    itest_teardown(&t);
}
END_TEST

/*
 * consumer.max_rate: one token bucket shared by the workers. 80 jobs at 40
 * jobs/s over 2 workers are applied over about two seconds, not at once.
 */
START_TEST(test_rate_gate)
{
    struct itest t;
    enum { N = 80 };
    char bodies_buf[N][256], k[128];
    const char *bodies[N];
    long spread_ms;

    itest_setup(&t, "rate", "idemq_test.record", "workers = 2; max_rate = 40;", "");
    for (int i = 0; i < N; i++) {
        snprintf(k, sizeof k, "%s:k%02d", t.name, i);
        body(bodies_buf[i], sizeof bodies_buf[i], k, NULL);
        bodies[i] = bodies_buf[i];
    }
    itest_publish(&t, bodies, N);
    itest_run_until_idle(&t, 1);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq_test.effects WHERE key LIKE "
                                    "$1 || ':%'",
                                t.name),
                     N);
    /* (80 - a burst of 3) / 40 per second = 1.9 s at least. */
    spread_ms = itest_long(&t, "SELECT (extract(epoch FROM max(created_at) - min(created_at)) "
                               "* 1000)::bigint FROM idemq_test.effects WHERE key LIKE $1 || ':%'",
                           t.name);
    ck_assert_msg(spread_ms >= 1700, "80 jobs at max_rate 40 took only %ld ms", spread_ms);
    itest_teardown(&t);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("batch");
    TCase *tc = tcase_create("batch");
    tcase_set_timeout(tc, itest_ms(120));
    tcase_add_test(tc, test_batch_isolation);
    tcase_add_test(tc, test_batch_crash_before_commit);
    tcase_add_test(tc, test_batch_plain_duplicates);
    tcase_add_test(tc, test_rate_gate);
    suite_add_tcase(s, tc);
    return check_run(s);
}
