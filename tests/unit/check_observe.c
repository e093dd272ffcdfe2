/* Unit tests of observe mode's pure parts: the observe_batch
 * document (ledger/ledger_observe.c) holds what apply mode would decide
 * from, decoded or not; outcome and code names round-trip; the /metrics
 * lines (consumer/observe.c) are labelled per observe input only. */
#include <check.h>

#include "check_run.h"
#include <jansson.h>
#include <stdlib.h>
#include <string.h>

#include "conf.h"
#include "job.h"
#include "ledger_observe.h"
#include "observe.h"

#define CFG                                                                                  \
    "inputs = ( { name = \"apply\"; queue = \"q\"; effect_function = \"f\"; },\n"            \
    "  { name = \"ob\\\"s\"; queue = \"q.observe\"; effect_function = \"f\"; mode = "        \
    "\"observe\"; on_key_reuse = \"park\"; } );"

static struct conf *load(void)
{
    struct conf *c = NULL;
    char err[1024];
    ck_assert_msg(conf_load_string(CFG, &c, err, sizeof err) == IDEMQ_OK, "%s", err);
    return c;
}

static void set(struct job *j, int input, const char *body)
{
    job_init(j);
    j->input = input;
    ck_assert_int_eq(job_set_body(j, body, strlen(body)), IDEMQ_OK);
}

START_TEST(test_doc)
{
    struct conf *c = load();
    struct job jobs[3];
    struct job *ptrs[3] = {&jobs[0], &jobs[1], &jobs[2]};
    bool old[3] = {false, true, false};
    json_t *v, *o;
    char *doc;

    set(&jobs[0], 1, "{\"job_id\":\"k1\",\"a\":1}");
    set(&jobs[1], 1, "{\"job_id\":\"k2\"}");
    set(&jobs[2], 1, "{\"job_id\":\"k3\", bad");
    jobs[1].redelivered = true;
    for (int i = 0; i < 3; i++)
        job_decode(&jobs[i], &c->inputs[1]);
    ck_assert_int_eq(jobs[2].decode_err, IDEMQ_ERR_BAD_JSON);
    ck_assert_ptr_nonnull(doc = ledger_observe_doc(c, ptrs, old, 3));
    ck_assert_ptr_nonnull(v = json_loads(doc, 0, NULL));
    ck_assert_int_eq(json_array_size(v), 3);
    o = json_array_get(v, 0);
    ck_assert_str_eq(json_string_value(json_object_get(o, "n")), "ob\"s");
    ck_assert_str_eq(json_string_value(json_object_get(o, "q")), "q.observe");
    ck_assert_str_eq(json_string_value(json_object_get(o, "k")), "k1");
    ck_assert_str_eq(json_string_value(json_object_get(o, "h")), jobs[0].sha256_hex);
    ck_assert(json_is_false(json_object_get(o, "w")));
    ck_assert(json_is_true(json_object_get(o, "kp")));
    ck_assert(json_is_false(json_object_get(o, "rd")));
    ck_assert_ptr_null(json_object_get(o, "c")); /* decoded: the ledger decides */
    o = json_array_get(v, 1);
    ck_assert(json_is_true(json_object_get(o, "w")));
    ck_assert(json_is_true(json_object_get(o, "rd")));
    o = json_array_get(v, 2); /* what apply would park it as, with its reason */
    ck_assert_str_eq(json_string_value(json_object_get(o, "c")), "bad_json");
    ck_assert_str_eq(json_string_value(json_object_get(o, "r")), jobs[2].reason);
    json_decref(v);
    free(doc);
    for (int i = 0; i < 3; i++)
        job_destroy(&jobs[i]);
    conf_free(c);
}
END_TEST

START_TEST(test_names)
{
    for (int o = OBSERVE_NEW; o < OBSERVE_N_OUTCOMES; o++)
        ck_assert_int_eq(ledger_observe_outcome_parse(ledger_observe_outcome_name((enum observe_outcome)o)), o);
    ck_assert_int_eq(ledger_observe_outcome_parse("applied"), OBSERVE_NONE);
    ck_assert_int_eq(ledger_observe_outcome_parse(NULL), OBSERVE_NONE);
    ck_assert_str_eq(ledger_observe_outcome_name(OBSERVE_LATE), "late_replay");
    ck_assert_int_eq(ledger_observe_code_parse("outside_dedup_window"), IDEMQ_ERR_OUTSIDE_WINDOW);
    ck_assert_int_eq(ledger_observe_code_parse("key_reuse"), IDEMQ_ERR_KEY_REUSE);
    ck_assert_int_eq(ledger_observe_code_parse("bad_json"), IDEMQ_ERR_BAD_JSON);
    ck_assert_int_eq(ledger_observe_code_parse(""), IDEMQ_OK);
    ck_assert_int_eq(ledger_observe_code_parse(NULL), IDEMQ_OK);
    ck_assert_int_eq(ledger_observe_code_parse("nonsense"), IDEMQ_OK);
}
END_TEST

START_TEST(test_metrics)
{
    struct conf *c = load();
    char buf[8192];
    size_t n;

    observe_count(1, OBSERVE_NEW, IDEMQ_OK);
    observe_count(1, OBSERVE_NEW, IDEMQ_OK);
    observe_count(1, OBSERVE_WOULD_PARK, IDEMQ_ERR_KEY_MISSING);
    observe_count(1, OBSERVE_LATE, IDEMQ_ERR_OUTSIDE_WINDOW);
    observe_count(-1, OBSERVE_NEW, IDEMQ_OK);                 /* ignored */
    observe_count(OBSERVE_MAX_INPUTS, OBSERVE_NEW, IDEMQ_OK); /* ignored */
    ck_assert_int_eq(observe_counted(1, OBSERVE_NEW), 2);
    n = observe_metrics_render(c, buf, sizeof buf);
    ck_assert_uint_eq(n, strlen(buf));
    ck_assert_msg(strstr(buf, "idemq_observed_total{input=\"ob\\\"s\",outcome=\"observed\"} 2\n"),
                  "%s", buf);
    ck_assert_msg(strstr(buf, "idemq_observed_total{input=\"ob\\\"s\",outcome=\"duplicate\"} 0\n"),
                  "%s", buf);
    ck_assert_msg(strstr(buf, "idemq_observe_would_park_total{input=\"ob\\\"s\",code=\"key_missing\"} 1\n"),
                  "%s", buf);
    ck_assert_msg(strstr(buf, "code=\"outside_dedup_window\"} 1\n"), "%s", buf);
    ck_assert_msg(!strstr(buf, "input=\"apply\""), "%s", buf); /* apply inputs: none */
    ck_assert_msg(strstr(buf, "# TYPE idemq_observed_total counter\n"), "%s", buf);
    /* a small buffer is never overrun */
    ck_assert_uint_lt(observe_metrics_render(c, buf, 40), 40);
    conf_free(c);
    /* no observe input: nothing at all */
    ck_assert_int_eq(conf_load_string("inputs = ( { name = \"a\"; queue = \"q\"; effect_function "
                                      "= \"f\"; } );", &c, buf, sizeof buf), IDEMQ_OK);
    ck_assert_uint_eq(observe_metrics_render(c, buf, sizeof buf), 0);
    conf_free(c);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("observe");
    TCase *tc = tcase_create("observe");
    tcase_add_test(tc, test_doc);
    tcase_add_test(tc, test_names);
    tcase_add_test(tc, test_metrics);
    suite_add_tcase(s, tc);
    return check_run(s);
}
