/* Unit tests of consumer/latency (the delivery -> ack histogram) and
 * consumer/rate_gate (the shared token bucket). */
#include <check.h>

#include "check_run.h"
#include <stdint.h>
#include <stdlib.h>

#include "latency.h"
#include "rate_gate.h"

START_TEST(test_latency_empty)
{
    struct latency_hist h;
    latency_init(&h);
    ck_assert_uint_eq(latency_percentile_us(&h, 0.5), 0);
    ck_assert_uint_eq(latency_percentile_us(&h, 0.99), 0);
}
END_TEST

/* Uniform 1..100000 us: percentiles within the 1/32 bucket resolution. */
START_TEST(test_latency_uniform)
{
    static struct latency_hist h;
    latency_init(&h);
    for (uint64_t v = 1; v <= 100000; v++)
        latency_record(&h, v);
    ck_assert_uint_eq(h.n, 100000);
    ck_assert_uint_eq(h.max_us, 100000);
    uint64_t p50 = latency_percentile_us(&h, 0.50), p99 = latency_percentile_us(&h, 0.99);
    ck_assert_msg(p50 >= 50000 && p50 <= 50000 + 50000 / 32 + 1, "p50 %llu",
                  (unsigned long long)p50);
    ck_assert_msg(p99 >= 99000 && p99 <= 100000, "p99 %llu", (unsigned long long)p99);
    ck_assert_uint_eq(latency_percentile_us(&h, 1.0), 100000);
}
END_TEST

/* Small values are exact; huge values land in the last bucket and the
 * percentile never exceeds the largest value seen. */
START_TEST(test_latency_edges)
{
    static struct latency_hist h, other;
    latency_init(&h);
    latency_init(&other);
    for (int i = 0; i < 99; i++)
        latency_record(&h, 7);
    latency_record(&other, UINT64_MAX / 2);
    latency_merge(&h, &other);
    ck_assert_uint_eq(h.n, 100);
    ck_assert_uint_eq(latency_percentile_us(&h, 0.5), 7);
    ck_assert_uint_eq(latency_percentile_us(&h, 0.99), 7);
    ck_assert_uint_eq(latency_percentile_us(&h, 1.0), UINT64_MAX / 2);
}
END_TEST

#define MS 1000000LL

/* After idleness a burst passes at once; then reservations queue up at the
 * configured rate, in arrival order. */
START_TEST(test_gate_rate)
{
    struct rate_gate *g = rate_gate_new(1000, 100); /* 1 ms per token */
    int64_t t = 5000 * MS;
    ck_assert_ptr_nonnull(g);
    ck_assert_int_eq(rate_gate_reserve(g, 100, t), 0);     /* the burst */
    ck_assert_int_eq(rate_gate_reserve(g, 50, t), 1 * MS);  /* 1 token late */
    ck_assert_int_eq(rate_gate_reserve(g, 50, t), 51 * MS); /* after those 50 */
    ck_assert_int_eq(rate_gate_reserve(g, 1, t + 101 * MS), 0);
    /* Over a long run, n tokens take n intervals (less the burst). */
    int64_t now = 60000 * MS, waited = 0;
    for (int i = 0; i < 1000; i++) {
        int64_t w = rate_gate_reserve(g, 10, now);
        now += w;
        waited += w;
    }
    ck_assert_msg(waited >= 9880 * MS && waited <= 10000 * MS, "waited %lld ms",
                  (long long)(waited / MS));
    ck_assert_int_eq(rate_gate_reserve(g, 0, now), 0);
    rate_gate_free(g);
}
END_TEST

START_TEST(test_gate_invalid)
{
    ck_assert_ptr_null(rate_gate_new(0, 1));
    ck_assert_ptr_null(rate_gate_new(10, 0.5));
    rate_gate_free(NULL);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("latency");
    TCase *tc = tcase_create("latency");
    tcase_add_test(tc, test_latency_empty);
    tcase_add_test(tc, test_latency_uniform);
    tcase_add_test(tc, test_latency_edges);
    tcase_add_test(tc, test_gate_rate);
    tcase_add_test(tc, test_gate_invalid);
    suite_add_tcase(s, tc);
    return check_run(s);
}
