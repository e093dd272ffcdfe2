/*
 * Integration tests of observe mode ("Adoption: observe before
 * switching"), against the real RabbitMQ and PostgreSQL (see itest.h).
 *
 * The test's own input stands for the existing consumer's queue; an
 * observe-mode input consumes a copy of the same traffic from its own queue
 * bound beside it (same exchange, same routing key). Observe mode claims
 * keys and records duplicates, a key reuse, a late replay and two messages
 * apply mode would park, runs no effect, parks nothing and acknowledges
 * everything; the report, /metrics (promtool) and jobs show tell it. Then
 * the same queue's copies are consumed in apply mode: each key observe mode
 * claimed is applied once (observed is not applied: the old consumer never
 * took these copies), a new key is applied, and the poison messages and the
 * late replay are parked. An old consumer that retries a job through its
 * own TTL queue during the switch gets that job applied by idemq, once.
 */
#include <check.h>

#include "check_run.h"
#include <amqp.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "itest.h"
#include "job.h"
#include "tprov.h"

#define EFFECTS_FOR "SELECT count(*) FROM idemq_test.effects WHERE key = $1"
#define EFFECTS_LIKE "SELECT count(*) FROM idemq_test.effects WHERE key LIKE $1 || ':%'"
#define OBSERVED(outcome)                                                                    \
    "SELECT count(*) FROM idemq.observations WHERE input = $1 AND outcome = '" outcome "'"

/* Runs a shell command, its stdout+stderr into out; returns its exit code. */
static int sh_out(char *out, size_t outlen, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static int sh_out(char *out, size_t outlen, const char *fmt, ...)
{
    char cmd[2048];
    size_t n = 0, got;
    va_list ap;
    FILE *p;
    int st;

    va_start(ap, fmt);
    vsnprintf(cmd, sizeof cmd, fmt, ap);
    va_end(ap);
    strncat(cmd, " 2>&1", sizeof cmd - strlen(cmd) - 1);
    ck_assert_ptr_nonnull(p = popen(cmd, "r"));
    while (n + 1 < outlen && (got = fread(out + n, 1, outlen - n - 1, p)) > 0)
        n += got;
    out[n] = '\0';
    st = pclose(p);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

static void sleep_ms(int ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

/* A metric line's value in a scrape, or -1 when absent. */
static long metric(const char *scrape, const char *series)
{
    const char *p = strstr(scrape, series);
    return p ? atol(p + strlen(series)) : -1;
}

START_TEST(test_observe_then_apply)
{
    struct itest t;
    char obs_cfg[256], obsq[160], oname[160], keys[6][128], b[9][256], out[16384],
        scrape[32768], url[320], path[200], series[256], v[64];
    struct conf *oc = NULL;
    char err[1024];
    struct itest_raw *raw;
    amqp_basic_properties_t now_p, old_p;
    int port = itest_free_port(), cport = itest_free_port(), st;
    char lpenv[1024] = "";
    pid_t pid;
    FILE *f;

    while (cport == port)
        cport = itest_free_port();
    itest_setup(&t, "observe", "idemq_test.record", "batch_max = 50; batch_wait_ms = 300;", "");
    /* the observe input: its own queue, bound beside the test input's */
    snprintf(obsq, sizeof obsq, "%s.observe", t.name);
    snprintf(oname, sizeof oname, "%s_obs", t.name);
    snprintf(obs_cfg, sizeof obs_cfg, "/tmp/%s.observe.cfg", t.name);
    ck_assert_ptr_nonnull(f = fopen(obs_cfg, "w"));
    fprintf(f,
            "broker: { heartbeat = 10; };\n%s\n"
            "metrics: { listen = \"127.0.0.1:%d\"; };\n"
            "console: { listen = \"127.0.0.1:%d\"; };\n"
            "consumer: { id = \"%s-obs\"; batch_max = 50; batch_wait_ms = 300; };\n"
            "inputs = ( { name = \"%s\"; exchange = \"%s\"; queue = \"%s\"; routing_key = \"%s\";\n"
            "  effect_function = \"idemq_test.record\"; mode = \"observe\"; } );\n",
            itest_lp_topology(), port, cport, t.name, oname, t.name, obsq, t.name);
    fclose(f);
    ck_assert_msg(conf_load(obs_cfg, &oc, err, sizeof err) == IDEMQ_OK, "%s", err);
    ck_assert_msg(sh_out(out, sizeof out, "%s declare -c %s", IDEMQ_BINARY, obs_cfg) == 0, "%s",
                  out);

    /* live traffic: k0..k3 new, a copy of k1, k3 again with another body,
     * bad JSON, no key, and a late replay (produced 500 days ago) */
    for (int i = 0; i < 6; i++)
        snprintf(keys[i], sizeof keys[i], "%s:k%d", t.name, i);
    for (int i = 0; i < 4; i++)
        snprintf(b[i], sizeof b[i], "{\"job_id\":\"%s\",\"amount_minor\":100}", keys[i]);
    snprintf(b[4], sizeof b[4], "%s", b[1]);
    snprintf(b[5], sizeof b[5], "{\"job_id\":\"%s\",\"amount_minor\":999}", keys[3]);
    snprintf(b[6], sizeof b[6], "{\"job_id\": not json");
    snprintf(b[7], sizeof b[7], "{\"amount_minor\":1}");
    snprintf(b[8], sizeof b[8], "{\"job_id\":\"%s\",\"amount_minor\":100}", keys[4]);
    memset(&now_p, 0, sizeof now_p);
    memset(&old_p, 0, sizeof old_p);
    old_p._flags = AMQP_BASIC_TIMESTAMP_FLAG;
    old_p.timestamp = (uint64_t)time(NULL) - 500LL * 86400;
    raw = itest_raw_open();
    for (int i = 0; i < 9; i++)
        itest_raw_publish(raw, t.name, t.name, strlen(t.name), b[i], strlen(b[i]),
                          i == 8 ? &old_p : &now_p);
    itest_raw_close(raw);
    ck_assert_int_eq(itest_queue_ready(&t, t.name), 9);

    /* observe: scrape /metrics while it runs */
    snprintf(path, sizeof path, "/tmp/%s.observe.log", t.name);
    pid = itest_spawn_log(obs_cfg, 5, NULL, path);
    snprintf(url, sizeof url, "http://127.0.0.1:%d/metrics", port);
    snprintf(series, sizeof series, "idemq_observed_total{input=\"%s\",outcome=\"would_park\"} ",
             oname);
    scrape[0] = '\0';
    for (int waited = 0; waited < itest_ms(15000); waited += 100) {
        if (itest_http_get(url, scrape, sizeof scrape) == 200 && metric(scrape, series) == 2)
            break;
        sleep_ms(100);
    }
    ck_assert_msg(metric(scrape, series) == 2, "scrape:\n%s", scrape);
    /* the baseline on the console's /observe page, while it runs (escaped
     * text of the same report; a since that is no timestamp is refused) */
    snprintf(url, sizeof url, "http://127.0.0.1:%d/observe?input=%s", cport, oname);
    for (int waited = 0; waited < itest_ms(10000); waited += 100) {
        if (itest_http_get(url, out, sizeof out) == 200 && strstr(out, "9 deliveries"))
            break;
        sleep_ms(100);
    }
    ck_assert_msg(strstr(out, "9 deliveries") && strstr(out, "observed keys    4") &&
                  strstr(out, "would be parked  3  (late replays included: 1)") &&
                  strstr(out, "outside_dedup_window") && strstr(out, "observing now: "),
                  "%s", out);
    ck_assert_msg(strstr(out, oname), "%s", out);
    snprintf(url, sizeof url, "http://127.0.0.1:%d/observe?since=2999-01-01", cport);
    ck_assert_int_eq(itest_http_get(url, out, sizeof out), 200);
    ck_assert_msg(strstr(out, "nothing observed"), "%s", out);
    snprintf(url, sizeof url, "http://127.0.0.1:%d/observe?since=now()%%3Bdrop", cport);
    ck_assert_int_eq(itest_http_get(url, out, sizeof out), 400);
#define SERIES(o) (snprintf(series, sizeof series, "idemq_observed_total{input=\"%s\",outcome=\"" o "\"} ", oname), series)
    ck_assert_int_eq(metric(scrape, SERIES("observed")), 4);
    ck_assert_int_eq(metric(scrape, SERIES("duplicate")), 2);
    ck_assert_int_eq(metric(scrape, SERIES("late_replay")), 1);
    snprintf(series, sizeof series, "idemq_observe_would_park_total{input=\"%s\",code=\"bad_json\"} ",
             oname);
    ck_assert_int_eq(metric(scrape, series), 1);
    snprintf(series, sizeof series,
             "idemq_observe_would_park_total{input=\"%s\",code=\"outside_dedup_window\"} ", oname);
    ck_assert_int_eq(metric(scrape, series), 1);
    /* nothing of apply mode's counters moved */
    ck_assert_msg(strstr(scrape, "idemq_applied_total 0\n") && strstr(scrape, "idemq_parked_total 0\n"),
                  "%s", scrape);
    snprintf(path, sizeof path, "/tmp/%s.prom", t.name);
    ck_assert_ptr_nonnull(f = fopen(path, "w"));
    fputs(scrape, f);
    fclose(f);
    ck_assert_msg(sh_out(out, sizeof out, "promtool check metrics < %s", path) == 0,
                  "promtool refused the scrape: %s\n%s", out, scrape);
    unlink(path);
    st = itest_wait(pid, itest_ms(20000));
    ck_assert_msg(st != -1 && WIFEXITED(st) && WEXITSTATUS(st) == 0, "observe run: status %d", st);
    snprintf(path, sizeof path, "/tmp/%s.observe.log", t.name);
    ck_assert_int_eq(itest_count_lines(path, "no effect ran): new keys 4, duplicates 2, late "
                                             "replays 1, would park 2, unrecorded 0"), 1);
    ck_assert_int_eq(itest_count_lines(path, "applied 0, duplicates 0, deferred 0, retried 0, "
                                             "parked 0"), 1);
    unlink(path);

    /* no effect, no park, no dead letter; every copy acknowledged */
    ck_assert_int_eq(itest_long(&t, EFFECTS_LIKE, t.name), 0);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.parked WHERE source_queue = $1",
                                obsq), 0);
    ck_assert_int_eq(itest_queue_ready(&t, obsq), 0);
    snprintf(path, sizeof path, "%s.dead", obsq);
    ck_assert_int_eq(itest_queue_ready(&t, path), 0);
    /* claimed as observed (not applied: whether the old consumer applied
     * them idemq cannot know), by this input */
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.jobs WHERE observed_by = $1 "
                                    "AND state = 'observed' AND attempts = 0", oname), 4);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.jobs WHERE key = $1", keys[4]), 0);
    ck_assert_int_eq(itest_long(&t, OBSERVED("observed"), oname), 4);
    ck_assert_int_eq(itest_long(&t, OBSERVED("duplicate"), oname), 2);
    ck_assert_int_eq(itest_long(&t, OBSERVED("late_replay"), oname), 1);
    ck_assert_int_eq(itest_long(&t, OBSERVED("would_park"), oname), 2);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.observations WHERE key = $1 "
                                    "AND code = 'key_reuse'", keys[3]), 1);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.observations WHERE input = $1 "
                                    "AND code IN ('bad_json', 'key_missing')", oname), 2);

    /* the baseline (an operator's commands) */
    itest_lp_env_prefix("observe", lpenv, sizeof lpenv);
    ck_assert_msg(sh_out(out, sizeof out, "%s%s observe report -c %s --input %s", lpenv,
                         IDEMQ_BINARY,
                         obs_cfg, oname) == 0, "%s", out);
    ck_assert_msg(strstr(out, "9 deliveries"), "%s", out);
    ck_assert_msg(strstr(out, "observed keys    4"), "%s", out);
    ck_assert_msg(strstr(out, "duplicates       2  (22.2 % of deliveries; with another body "
                              "(key_reuse) 1)"), "%s", out);
    ck_assert_msg(strstr(out, "late replays     1"), "%s", out);
    ck_assert_msg(strstr(out, "would be parked  3  (late replays included: 1)"), "%s", out);
    ck_assert_msg(strstr(out, "bad_json") && strstr(out, "key_missing") &&
                  strstr(out, "outside_dedup_window"), "%s", out);
    ck_assert_int_eq(sh_out(out, sizeof out, "%s%s observe report -c %s --input %s --since "
                            "'2999-01-01'", lpenv, IDEMQ_BINARY, obs_cfg, oname), 1);
    ck_assert_msg(strstr(out, "nothing observed"), "%s", out);
    /* jobs show: observed only */
    ck_assert_int_eq(sh_out(out, sizeof out, "%s%s jobs show -c %s %s", lpenv, IDEMQ_BINARY, obs_cfg,
                            keys[1]), 0);
    ck_assert_msg(strstr(out, "observed only: input") && strstr(out, "idemq ran no effect") &&
                  strstr(out, "duplicate of input"), "%s", out);
    ck_assert_int_eq(sh_out(out, sizeof out, "%s%s jobs show -c %s %s", lpenv, IDEMQ_BINARY, obs_cfg,
                            keys[4]), 0);
    ck_assert_msg(strstr(out, "late_replay of input") && !strstr(out, "observed only"), "%s",
                  out);

    /* the switch: the old consumer's queue consumed in apply mode, plus a
     * new key published now */
    snprintf(b[0], sizeof b[0], "{\"job_id\":\"%s\",\"amount_minor\":100}", keys[5]);
    {
        const char *nb[1] = {b[0]};
        itest_publish(&t, nb, 1);
    }
    itest_run_until_idle(&t, 2);
    for (int i = 0; i < 4; i++) {
        /* observed: the old consumer never took these copies (they are
         * still in its queue), so the first copy apply mode takes is
         * applied, once, and the effect is told it was observed */
        ck_assert_msg(itest_long(&t, EFFECTS_FOR, keys[i]) == 1, "%s applied %ld times",
                      keys[i], itest_long(&t, EFFECTS_FOR, keys[i]));
        ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq_test.effects WHERE key = $1 "
                                        "AND meta->'observed'->>'by' IS NOT NULL", keys[i]),
                         1);
        ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.key_history($1) "
                                        "WHERE outcome = 'duplicate'", keys[i]),
                         i == 1 || i == 3 ? 1 : 0);
        ck_assert_str_eq(itest_text(&t, "SELECT observed_by FROM idemq.jobs WHERE key = $1",
                                    keys[i], v, sizeof v), oname);
        ck_assert_str_eq(itest_text(&t, "SELECT state FROM idemq.jobs WHERE key = $1", keys[i],
                                    v, sizeof v), "applied");
    }
    ck_assert_int_eq(itest_long(&t, EFFECTS_FOR, keys[5]), 1); /* new: applied */
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.jobs WHERE key = $1 AND "
                                    "observed_by IS NULL AND state = 'applied'", keys[5]), 1);
    /* what observe mode said would park, parks, with the same codes */
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.parked WHERE source_queue = $1 "
                                    "AND error_code IN ('bad_json', 'key_missing', "
                                    "'outside_dedup_window')", t.name), 3);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.parked WHERE key = $1 AND "
                                    "error_code = 'outside_dedup_window'", keys[4]), 1);

    /* a batch the plain path takes (in the window, standard input): fresh
     * copies of observed keys (one with another body) and a new key */
    {
        char nb3[3][256], k6[128];
        const char *nb[3] = {nb3[0], nb3[1], nb3[2]};
        snprintf(k6, sizeof k6, "%s:k6", t.name);
        snprintf(nb3[0], sizeof nb3[0], "{\"job_id\":\"%s\",\"amount_minor\":100}", keys[0]);
        snprintf(nb3[1], sizeof nb3[1], "{\"job_id\":\"%s\",\"amount_minor\":7}", keys[2]);
        snprintf(nb3[2], sizeof nb3[2], "{\"job_id\":\"%s\",\"amount_minor\":100}", k6);
        itest_publish(&t, nb, 3);
        itest_run_until_idle(&t, 2);
        ck_assert_int_eq(itest_long(&t, EFFECTS_FOR, keys[0]), 1);
        ck_assert_int_eq(itest_long(&t, EFFECTS_FOR, keys[2]), 1);
        ck_assert_int_eq(itest_long(&t, EFFECTS_FOR, k6), 1);
        ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.key_history($1) "
                                        "WHERE outcome = 'duplicate'", keys[0]), 1);
        ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.key_history($1) "
                                        "WHERE outcome = 'duplicate' AND what LIKE '%key_reuse%'",
                                    keys[2]), 1);
    }

    itest_delete_topology(&t, &oc->inputs[0]);
    conf_free(oc);
    unlink(obs_cfg);
    itest_teardown(&t);
}
END_TEST

/* A provider input in observe mode: no provider request at all, no intent;
 * keys claimed and duplicates found as for an SQL effect. */
START_TEST(test_observe_provider_input)
{
    struct itest t;
    struct tprov p;
    char input[1024], k1[128], k2[128], b1[256], b2[256], v[64];
    const char *bodies[3] = {b1, b1, b2};

    tprov_start(&p, NULL);
    snprintf(input, sizeof input,
             "mode = \"observe\"; provider: { url = \"%s\"; path = \"/charges\"; };", p.url);
    itest_setup(&t, "observep", "idemq_test.record", "", input);
    snprintf(k1, sizeof k1, "%s:p1", t.name);
    snprintf(k2, sizeof k2, "%s:p2", t.name);
    snprintf(b1, sizeof b1, "{\"job_id\":\"%s\",\"amount_minor\":500}", k1);
    snprintf(b2, sizeof b2, "{\"job_id\":\"%s\",\"amount_minor\":500}", k2);
    itest_publish(&t, bodies, 3);
    itest_run_until_idle(&t, 2);
    ck_assert_int_eq(tprov_stat(&p, k1, "requests"), 0);
    ck_assert_int_eq(tprov_stat(&p, k1, "key_charges"), 0);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.intents WHERE key IN ($1, $1 || "
                                    "'x')", k1), 0);
    ck_assert_int_eq(itest_long(&t, EFFECTS_LIKE, t.name), 0);
    ck_assert_str_eq(itest_text(&t, "SELECT observed_by FROM idemq.jobs WHERE key = $1", k2, v,
                                sizeof v), t.name);
    ck_assert_int_eq(itest_long(&t, OBSERVED("duplicate"), t.name), 1);
    ck_assert_int_eq(itest_long(&t, OBSERVED("observed"), t.name), 2);
    ck_assert_int_eq(itest_queue_ready(&t, t.name), 0);
    itest_teardown(&t);
    tprov_stop(&p);
}
END_TEST

/*
 * The switch while the old consumer retries a job by republishing it (a
 * dead-letter + TTL queue back to its work queue, as Spring AMQP,
 * MassTransit or Celery's self.retry() do): idemq observed the job, the old
 * consumer failed it and moved it to its delay queue (so its work queue is
 * drained), the switch procedure runs, and the retry comes back into the
 * queue idemq now consumes in apply mode. It is applied, once, not
 * acknowledged as a duplicate of the observation.
 */
START_TEST(test_switch_during_old_consumer_retry)
{
    struct itest t;
    char obs_cfg[256], obsq[160], oname[160], retryq[160], key[128], body[256], out[4096],
        err[1024], v[64];
    const char *bodies[1] = {body};
    struct conf *oc = NULL;
    struct broker *b;
    struct job j;
    struct broker_props props = {NULL, "application/json", NULL, true, NULL, NULL};
    json_t *args;
    FILE *f;

    itest_setup(&t, "obsretry", "idemq_test.record", "", "");
    snprintf(obsq, sizeof obsq, "%s.observe", t.name);
    snprintf(oname, sizeof oname, "%s_obs", t.name);
    snprintf(retryq, sizeof retryq, "%s.oldretry", t.name);
    snprintf(obs_cfg, sizeof obs_cfg, "/tmp/%s.observe.cfg", t.name);
    ck_assert_ptr_nonnull(f = fopen(obs_cfg, "w"));
    fprintf(f,
            "consumer: { id = \"%s-obs\"; };\n"
            "inputs = ( { name = \"%s\"; exchange = \"%s\"; queue = \"%s\"; routing_key = \"%s\";\n"
            "  effect_function = \"idemq_test.record\"; mode = \"observe\"; } );\n",
            t.name, oname, t.name, obsq, t.name);
    fclose(f);
    ck_assert_msg(conf_load(obs_cfg, &oc, err, sizeof err) == IDEMQ_OK, "%s", err);
    ck_assert_msg(sh_out(out, sizeof out, "%s declare -c %s", IDEMQ_BINARY, obs_cfg) == 0, "%s",
                  out);
    /* the old consumer's delay queue: 1.5 s, then back to its work queue */
    ck_assert_int_eq(broker_open(t.conf, "old consumer", true, &b, err, sizeof err), IDEMQ_OK);
    args = json_pack("{s:i, s:s, s:s}", "x-message-ttl", 1500, "x-dead-letter-exchange", "",
                     "x-dead-letter-routing-key", t.name);
    ck_assert_int_eq(broker_admin_declare_queue(b, retryq, args, false), IDEMQ_OK);
    json_decref(args);

    snprintf(key, sizeof key, "%s:retried", t.name);
    snprintf(body, sizeof body, "{\"job_id\":\"%s\",\"amount_minor\":100}", key);
    itest_publish(&t, bodies, 1); /* to both queues */
    /* idemq observes it */
    ck_assert_int_eq(sh_out(out, sizeof out, "%s run -c %s --until-idle 1", IDEMQ_BINARY,
                            obs_cfg), 0);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.jobs WHERE key = $1 AND "
                                    "state = 'observed'", key), 1);
    /* the old consumer takes it, fails, and republishes it to its delay queue */
    job_init(&j);
    ck_assert_int_eq(broker_get(b, t.name, &j, true), IDEMQ_OK);
    ck_assert_int_eq(broker_publish(b, "", retryq, j.body, j.body_len, &props), IDEMQ_OK);
    ck_assert_int_eq(broker_wait_confirms(b, 5000), IDEMQ_OK);
    job_destroy(&j);
    broker_close(b);
    /* the switch: observing stopped, the old queue drained, the old
     * consumer stopped; idemq in apply mode on the old queue, long enough
     * for the retry to come back */
    ck_assert_int_eq(itest_queue_ready(&t, t.name), 0);
    itest_run_until_idle(&t, 4);
    ck_assert_int_eq(itest_long(&t, EFFECTS_FOR, key), 1);
    ck_assert_str_eq(itest_text(&t, "SELECT meta->'observed'->>'by' FROM idemq_test.effects "
                                    "WHERE key = $1", key, v, sizeof v), oname);
    ck_assert_str_eq(itest_text(&t, "SELECT state FROM idemq.jobs WHERE key = $1", key, v,
                                sizeof v), "applied");
    ck_assert_int_eq(sh_out(out, sizeof out, "%s jobs show -c %s '%s'", IDEMQ_BINARY,
                            t.cfg_path, key), 0);
    ck_assert_msg(strstr(out, "observed first: input") && strstr(out, "applied"), "%s", out);

    ck_assert_int_eq(broker_open(t.conf, "cleanup", false, &b, err, sizeof err), IDEMQ_OK);
    ck_assert_int_eq(broker_admin_delete_queue(b, retryq), IDEMQ_OK);
    broker_close(b);
    itest_delete_topology(&t, &oc->inputs[0]);
    conf_free(oc);
    unlink(obs_cfg);
    itest_teardown(&t);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("observe");
    TCase *tc = tcase_create("observe");
    tcase_set_timeout(tc, itest_ms(120));
    tcase_add_test(tc, test_observe_then_apply);
    tcase_add_test(tc, test_observe_provider_input);
    tcase_add_test(tc, test_switch_during_old_consumer_retry);
    suite_add_tcase(s, tc);
    /* least-privilege mode (scripts/test): these again, as the deployment's roles */
    itest_lp_tcase(s, (const TTest *const[]){test_observe_then_apply, NULL});
    return check_run(s);
}
