/* Unit tests of consumer/classify (the one place that decides error
 * classes) and consumer/backoff. */
#include <check.h>

#include "check_run.h"
#include <stdint.h>

#include "backoff.h"
#include "classify.h"

START_TEST(test_defaults)
{
    ck_assert_int_eq(classify_sqlstate("40001", false, NULL), CLASS_TRANSIENT);
    ck_assert_int_eq(classify_sqlstate("40P01", false, NULL), CLASS_TRANSIENT);
    ck_assert_int_eq(classify_sqlstate("55P03", false, NULL), CLASS_TRANSIENT);
    ck_assert_int_eq(classify_sqlstate("57014", false, NULL), CLASS_TRANSIENT);
    ck_assert_int_eq(classify_sqlstate("53300", false, NULL), CLASS_TRANSIENT);
    ck_assert_int_eq(classify_sqlstate("08006", false, NULL), CLASS_TRANSIENT);
    ck_assert_int_eq(classify_sqlstate("23505", false, NULL), CLASS_PERMANENT);
    ck_assert_int_eq(classify_sqlstate("22023", false, NULL), CLASS_PERMANENT);
    ck_assert_int_eq(classify_sqlstate("P0001", false, NULL), CLASS_PERMANENT);
    ck_assert_int_eq(classify_sqlstate("55000", false, NULL), CLASS_PERMANENT);
    ck_assert_int_eq(classify_sqlstate("42883", false, NULL), CLASS_FATAL);
    ck_assert_int_eq(classify_sqlstate("42501", false, NULL), CLASS_FATAL);
    ck_assert_int_eq(classify_sqlstate("42P01", false, NULL), CLASS_FATAL);
    ck_assert_int_eq(classify_sqlstate("3F000", false, NULL), CLASS_FATAL);
    ck_assert_int_eq(classify_sqlstate("23505", true, NULL), CLASS_INFRA);
    ck_assert_int_eq(classify_sqlstate("", false, NULL), CLASS_INFRA);
    ck_assert_int_eq(classify_sqlstate(NULL, false, NULL), CLASS_INFRA);
}
END_TEST

START_TEST(test_user_rules)
{
    static const char *const retry[] = {"IR001", "23"};
    static const char *const park[] = {"40001", "IP001"};
    struct classify_rules r = {retry, 2, park, 2};
    ck_assert_int_eq(classify_sqlstate("IR001", false, &r), CLASS_TRANSIENT);
    ck_assert_int_eq(classify_sqlstate("IP001", false, &r), CLASS_PERMANENT);
    ck_assert_int_eq(classify_sqlstate("23505", false, &r), CLASS_TRANSIENT);
    ck_assert_int_eq(classify_sqlstate("40001", false, &r), CLASS_PERMANENT);
    ck_assert_int_eq(classify_sqlstate("40P01", false, &r), CLASS_TRANSIENT);
    ck_assert_int_eq(classify_sqlstate("42883", false, &r), CLASS_FATAL);
    ck_assert(classify_valid_code("IR001"));
    ck_assert(classify_valid_code("23"));
    ck_assert(!classify_valid_code("ir001"));
    ck_assert(!classify_valid_code("2350"));
}
END_TEST

START_TEST(test_err_classes)
{
    ck_assert_int_eq(classify_err(IDEMQ_ERR_BAD_JSON), CLASS_PERMANENT);
    ck_assert_int_eq(classify_err(IDEMQ_ERR_KEY_TOO_LONG), CLASS_PERMANENT);
    ck_assert_int_eq(classify_err(IDEMQ_ERR_DB_CONN), CLASS_INFRA);
    ck_assert_int_eq(classify_err(IDEMQ_ERR_CONFIG), CLASS_FATAL);
    ck_assert_str_eq(classify_name(CLASS_INFRA), "infrastructure");
    ck_assert_str_eq(classify_name(CLASS_TRANSIENT), "transient");
}
END_TEST

START_TEST(test_backoff)
{
    uint64_t rng = 42;
    ck_assert_int_eq(backoff_delay_ms(1, 100, 5000, BACKOFF_JITTER_NONE, &rng), 100);
    ck_assert_int_eq(backoff_delay_ms(2, 100, 5000, BACKOFF_JITTER_NONE, &rng), 200);
    ck_assert_int_eq(backoff_delay_ms(4, 100, 5000, BACKOFF_JITTER_NONE, &rng), 800);
    ck_assert_int_eq(backoff_delay_ms(50, 100, 5000, BACKOFF_JITTER_NONE, &rng), 5000);
    ck_assert_int_eq(backoff_delay_ms(1000, 100, 5000, BACKOFF_JITTER_NONE, &rng), 5000);
    for (int n = 1; n < 20; n++) {
        long full = backoff_delay_ms(n, 100, 5000, BACKOFF_JITTER_FULL, &rng);
        long eq = backoff_delay_ms(n, 100, 5000, BACKOFF_JITTER_EQUAL, &rng);
        long cap = backoff_delay_ms(n, 100, 5000, BACKOFF_JITTER_NONE, &rng);
        ck_assert_int_ge(full, 0);
        ck_assert_int_le(full, cap);
        ck_assert_int_ge(eq, cap / 2);
        ck_assert_int_le(eq, cap);
    }
    ck_assert_int_eq(backoff_jitter_parse("equal"), BACKOFF_JITTER_EQUAL);
    ck_assert_int_eq(backoff_jitter_parse("bogus"), -1);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("classify");
    TCase *tc = tcase_create("classify");
    tcase_add_test(tc, test_defaults);
    tcase_add_test(tc, test_user_rules);
    tcase_add_test(tc, test_err_classes);
    tcase_add_test(tc, test_backoff);
    suite_add_tcase(s, tc);
    return check_run(s);
}
