/*
 * Integration test of idemq's threads working at once: four
 * worker threads sharing the rate gate, the metrics thread answering
 * /metrics and /ready all the while, duplicates, retries and parks in the
 * mix. In the plain build it checks the counters stay consistent under
 * concurrency; `scripts/test --tsan` runs it under ThreadSanitizer, which is
 * what it is mostly for. Real RabbitMQ and PostgreSQL (see itest.h).
 */
#include <check.h>

#include "check_run.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "itest.h"

#define JOBS 2000
#define WORKERS_CONF "workers = 4; max_rate = 3000; batch_max = 50;"

/* Value of a metric line "name value" in a scrape, or -1. */
static long metric(const char *body, const char *name)
{
    char pat[128];
    const char *at;
    snprintf(pat, sizeof pat, "\n%s ", name);
    at = strstr(body, pat);
    return at ? atol(at + strlen(pat)) : -1;
}

START_TEST(test_workers_metrics_rate_gate)
{
    struct itest t;
    char metrics_conf[128], url_metrics[160], url_ready[160], body[16384];
    char **bodies = calloc(JOBS, sizeof *bodies);
    int port = itest_free_port(), good = 0, bad = 0, flaky = 0, scrapes = 0;
    long last_applied = 0, last_completed = 0;
    pid_t pid;
    int st = -1;

    ck_assert_ptr_nonnull(bodies);
    snprintf(metrics_conf, sizeof metrics_conf, "metrics: { listen = \"127.0.0.1:%d\"; };", port);
    snprintf(url_metrics, sizeof url_metrics, "http://127.0.0.1:%d/metrics", port);
    snprintf(url_ready, sizeof url_ready, "http://127.0.0.1:%d/ready", port);
    itest_extra_conf = metrics_conf;
    itest_retry_conf = "base_delay_ms = 100; max_delay_ms = 400;";
    itest_setup(&t, "threads", "idemq_test.record", WORKERS_CONF, "");
    itest_extra_conf = NULL;
    for (int i = 0; i < JOBS; i++) {
        /* every 10th a copy of the one before; every 100th parks (22023);
         * every 50th fails once (40001), then applies */
        int k = i % 10 == 9 ? i - 1 : i;
        bodies[i] = malloc(200);
        ck_assert_ptr_nonnull(bodies[i]);
        snprintf(bodies[i], 200, "{\"job_id\":\"%s:%d\"%s}", t.name, k,
                 k % 100 == 7   ? ",\"raise\":\"22023\""
                 : k % 50 == 3  ? ",\"raise\":\"40001\",\"raise_until\":1"
                                : "");
        if (k == i) {
            if (k % 100 == 7)
                bad++;
            else
                good++;
            if (k % 50 == 3 && k % 100 != 7)
                flaky++;
        }
    }
    itest_publish(&t, (const char *const *)bodies, JOBS);
    pid = itest_spawn(&t, t.cfg_path, 3, NULL);
    /* Scrape both endpoints while the workers run: counters never go back. */
    for (int i = 0; i < itest_ms(60000) / 20; i++) {
        pid_t r = waitpid(pid, &st, WNOHANG);
        if (r == pid)
            break;
        if (itest_http_get(url_metrics, body, sizeof body) == 200) {
            long applied = metric(body, "idemq_applied_total");
            long completed = metric(body, "idemq_completed_total");
            ck_assert_msg(applied >= last_applied && completed >= last_completed,
                          "counters went back: applied %ld -> %ld, completed %ld -> %ld",
                          last_applied, applied, last_completed, completed);
            ck_assert_int_le(applied, good);
            last_applied = applied;
            last_completed = completed;
            scrapes++;
        }
        (void)itest_http_get(url_ready, body, sizeof body);
        usleep(20000);
    }
    if (st == -1)
        st = itest_wait(pid, itest_ms(1000));
    ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0, "idemq exited with status 0x%x", st);
    ck_assert_int_ge(scrapes, 5);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq_test.effects WHERE key LIKE $1 "
                                    "|| ':%'",
                                t.name),
                     good);
    ck_assert_int_eq(itest_long(&t, "SELECT count(DISTINCT key) FROM idemq_test.effects WHERE key "
                                    "LIKE $1 || ':%'",
                                t.name),
                     good);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.jobs WHERE key LIKE $1 || ':%' "
                                    "AND state = 'parked'",
                                t.name),
                     bad);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.jobs WHERE key LIKE $1 || ':%' "
                                    "AND state = 'applied' AND attempts = 2",
                                t.name),
                     flaky);
    ck_assert_int_eq(itest_queue_ready(&t, t.name), 0);
    for (int i = 0; i < JOBS; i++)
        free(bodies[i]);
    free(bodies);
    itest_teardown(&t);
    itest_retry_conf = NULL;
}
END_TEST

int main(void)
{
    Suite *s = suite_create("threads");
    TCase *tc = tcase_create("threads");
    tcase_set_timeout(tc, itest_ms(180));
    tcase_add_test(tc, test_workers_metrics_rate_gate);
    suite_add_tcase(s, tc);
    return check_run(s);
}
