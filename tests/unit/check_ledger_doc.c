/* Unit tests of ledger/ledger_doc: the batch document is valid JSON whatever
 * bytes the delivery carried, and holds what idemq.apply_batch reads. */
#include <check.h>

#include "check_run.h"
#include <jansson.h>
#include <stdlib.h>
#include <string.h>

#include "ledger_doc.h"

static json_t *parse(const struct ledger_doc *d)
{
    json_error_t e;
    json_t *v = json_loads(d->buf, 0, &e);
    ck_assert_msg(v != NULL, "invalid JSON (%s): %s", e.text, d->buf);
    return v;
}

START_TEST(test_string_escapes)
{
    struct ledger_doc d;
    const char raw[] = "q\"b\\s\n\x01 caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80";
    json_t *v;
    ledger_doc_init(&d);
    ledger_doc_begin(&d);
    ledger_doc_add_string(&d, raw, sizeof raw - 1);
    ck_assert(ledger_doc_end(&d));
    v = parse(&d);
    ck_assert_str_eq(json_string_value(json_array_get(v, 0)), raw);
    json_decref(v);
    ledger_doc_free(&d);
}
END_TEST

/* Bytes that are not UTF-8 (a stray byte, an overlong form, a surrogate, a
 * truncated sequence) become U+FFFD: the document stays valid. */
START_TEST(test_string_invalid_utf8)
{
    struct ledger_doc d;
    const char raw[] = "a\xff" "b\xc0\xaf" "c\xed\xa0\x80" "d\xe2\x82";
    json_t *v;
    ledger_doc_init(&d);
    ledger_doc_begin(&d);
    ledger_doc_add_string(&d, raw, sizeof raw - 1);
    ck_assert(ledger_doc_end(&d));
    v = parse(&d);
    ck_assert_str_eq(json_string_value(json_array_get(v, 0)),
                     "a\xef\xbf\xbd" "b\xef\xbf\xbd\xef\xbf\xbd" "c\xef\xbf\xbd\xef\xbf\xbd"
                     "\xef\xbf\xbd" "d\xef\xbf\xbd\xef\xbf\xbd");
    json_decref(v);
    ledger_doc_free(&d);
}
END_TEST

START_TEST(test_jobs)
{
    struct ledger_doc d;
    struct conf_input in;
    struct job j;
    json_t *v, *m;
    const char body[] = "{\"job_id\":\"k1\",\"n\":1}";

    memset(&in, 0, sizeof in);
    in.queue = "q.payouts";
    job_init(&j);
    ck_assert_int_eq(job_set_body(&j, body, sizeof body - 1), IDEMQ_OK);
    strcpy(j.key, "k\"1");
    j.has_key = true;
    strcpy(j.sha256_hex, "ab");
    strcpy(j.exchange, "x");
    strcpy(j.routing_key, "rk\xff");
    j.redelivered = true;
    j.delivery_count = 2;
    j.acquired_count = 9;
    strcpy(j.message_id, "mid");
    j.has_message_id = true;
    json_object_set_new(j.headers, "h", json_integer(5));

    ledger_doc_init(&d);
    for (int round = 0; round < 2; round++) { /* the buffer is reused */
        ledger_doc_begin(&d);
        ledger_doc_add_job(&d, &j, &in, 1, false);
        ledger_doc_add_job(&d, &j, &in, 0, true);
        ck_assert(ledger_doc_end(&d));
        v = parse(&d);
        ck_assert_int_eq(json_array_size(v), 2);
        ck_assert_str_eq(json_string_value(json_object_get(json_array_get(v, 0), "k")), "k\"1");
        ck_assert_int_eq(json_integer_value(json_object_get(json_array_get(v, 0), "i")), 2);
        ck_assert_int_eq(json_integer_value(json_object_get(json_array_get(v, 1), "i")), 1);
        ck_assert_str_eq(json_string_value(json_object_get(json_array_get(v, 0), "q")),
                         "q.payouts");
        ck_assert_str_eq(json_string_value(json_object_get(json_array_get(v, 0), "h")), "ab");
        ck_assert_int_eq(
            json_integer_value(json_object_get(json_object_get(json_array_get(v, 0), "p"), "n")),
            1);
        m = json_object_get(json_array_get(v, 0), "m");
        ck_assert_str_eq(json_string_value(json_object_get(m, "queue")), "q.payouts");
        ck_assert_str_eq(json_string_value(json_object_get(m, "exchange")), "x");
        ck_assert_str_eq(json_string_value(json_object_get(m, "routing_key")), "rk\xef\xbf\xbd");
        ck_assert(json_is_true(json_object_get(m, "redelivered")));
        ck_assert_int_eq(json_integer_value(json_object_get(m, "delivery_count")), 2);
        ck_assert_int_eq(json_integer_value(json_object_get(m, "acquired_count")), 9);
        ck_assert_str_eq(json_string_value(json_object_get(m, "message_id")), "mid");
        ck_assert_int_eq(json_integer_value(json_object_get(json_object_get(m, "headers"), "h")),
                         5);
        /* the set-based path hands this meta to the effect as it is */
        ck_assert_int_eq(json_integer_value(json_object_get(m, "attempt")), 1);
        ck_assert_int_eq(json_integer_value(json_object_get(m, "generation")), 0);
        /* only the job marked old carries "w" */
        ck_assert_ptr_null(json_object_get(json_array_get(v, 0), "w"));
        ck_assert(json_is_true(json_object_get(json_array_get(v, 1), "w")));
        json_decref(v);
    }
    /* Without the optional facts. */
    j.delivery_count = -1;
    j.acquired_count = -1;
    j.has_message_id = false;
    json_object_clear(j.headers);
    ledger_doc_begin(&d);
    ledger_doc_add_job(&d, &j, &in, 0, false);
    ck_assert(ledger_doc_end(&d));
    v = parse(&d);
    m = json_object_get(json_array_get(v, 0), "m");
    ck_assert_ptr_null(json_object_get(m, "delivery_count"));
    ck_assert_ptr_null(json_object_get(m, "acquired_count"));
    ck_assert_ptr_null(json_object_get(m, "message_id"));
    ck_assert_int_eq(json_object_size(json_object_get(m, "headers")), 0);
    json_decref(v);
    ledger_doc_free(&d);
    job_destroy(&j);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("ledger_doc");
    TCase *tc = tcase_create("ledger_doc");
    tcase_add_test(tc, test_string_escapes);
    tcase_add_test(tc, test_string_invalid_utf8);
    tcase_add_test(tc, test_jobs);
    suite_add_tcase(s, tc);
    return check_run(s);
}
