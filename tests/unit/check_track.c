/* Unit tests of adapters/acks (settled deliveries -> the acks that may be
 * sent) and adapters/confirms (publisher confirms per sequence number),
 * driven by scripted and randomized frame orders against a model of what
 * the broker holds. */
#include <check.h>

#include "check_run.h"
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "acks.h"
#include "backoff.h"
#include "confirms.h"

/* ---- acks ---- */

/* The broker's view: which tags are unacked on the channel. */
#define MAXT 600
struct model {
    bool unacked[MAXT + 1]; /* broker holds it unacknowledged */
    enum acks_state st[MAXT + 1];
    bool known[MAXT + 1];
    int acked_count[MAXT + 1];
};

/* Sends every op the tracker hands out to the model broker, checking that
 * no ack covers a delivery that is not settled. */
static void flush(struct acks *a, struct model *m)
{
    struct acks_op op;
    while (acks_next(a, &op)) {
        ck_assert_uint_gt(op.tag, 0);
        ck_assert_uint_le(op.tag, MAXT);
        ck_assert_msg(m->unacked[op.tag], "ack of tag %llu the broker no longer holds",
                      (unsigned long long)op.tag);
        for (uint64_t t = op.multiple ? 1 : op.tag; t <= op.tag; t++) {
            if (!m->unacked[t])
                continue;
            ck_assert_msg(m->st[t] == ACKS_SETTLED, "ack %llu%s covers unsettled tag %llu",
                          (unsigned long long)op.tag, op.multiple ? " (multiple)" : "",
                          (unsigned long long)t);
            m->unacked[t] = false;
            m->acked_count[t]++;
        }
    }
}

START_TEST(test_acks_prefix_and_gap)
{
    struct acks a;
    struct acks_op op;
    acks_init(&a);
    for (uint64_t t = 1; t <= 6; t++)
        ck_assert_int_eq(acks_received(&a, t), IDEMQ_OK);
    /* 1, 2 settled, 3 held, 4 gone (rejected), 5 settled, 6 unsettled */
    ck_assert(acks_settle(&a, 1));
    ck_assert(acks_settle(&a, 2));
    ck_assert(acks_gone(&a, 4));
    ck_assert(acks_settle(&a, 5));
    ck_assert(!acks_settle(&a, 5)); /* twice: refused */
    ck_assert(!acks_settle(&a, 99)); /* unknown: refused */
    ck_assert(acks_next(&a, &op));
    ck_assert_uint_eq(op.tag, 2);
    ck_assert(op.multiple); /* 1..2 */
    ck_assert(acks_next(&a, &op));
    ck_assert_uint_eq(op.tag, 5); /* beyond the held 3: alone */
    ck_assert(!op.multiple);
    ck_assert(!acks_next(&a, &op));
    ck_assert_uint_eq(acks_first_unsettled(&a), 3);
    ck_assert_uint_eq(acks_outstanding(&a), 2); /* 3 and 6 */
    /* 3 settles: 3 (and gone 4) form the prefix up to the unsettled 6 */
    ck_assert(acks_settle(&a, 3));
    ck_assert(acks_next(&a, &op));
    ck_assert_uint_eq(op.tag, 3);
    ck_assert(!op.multiple);
    ck_assert(!acks_next(&a, &op));
    ck_assert_uint_eq(acks_outstanding(&a), 1);
    /* tags must increase: a repeat is a broker fault */
    ck_assert_int_eq(acks_received(&a, 6), IDEMQ_ERR_BROKER);
    acks_reset(&a);
    ck_assert_uint_eq(acks_outstanding(&a), 0);
    ck_assert_int_eq(acks_received(&a, 1), IDEMQ_OK); /* a new channel starts at 1 */
    acks_free(&a);
}
END_TEST

/* Random interleavings of deliveries, settlements (in any order, as lanes,
 * isolation and failures settle them), rejects, held deliveries and
 * flushes: never an ack past an unsettled tag, every settled delivery
 * acked exactly once, rejected ones never. */
START_TEST(test_acks_random)
{
    uint64_t rng = 0x9e3779b97f4a7c15ULL + (uint64_t)_i;
    for (int round = 0; round < 20; round++) {
        static struct model m;
        struct acks a;
        uint64_t next = 1;
        memset(&m, 0, sizeof m);
        acks_init(&a);
        while (next <= MAXT || acks_outstanding(&a)) {
            unsigned r = (unsigned)(backoff_rand(&rng) % 100);
            if (r < 35 && next <= MAXT) { /* a delivery arrives */
                ck_assert_int_eq(acks_received(&a, next), IDEMQ_OK);
                m.unacked[next] = m.known[next] = true;
                m.st[next] = ACKS_UNSETTLED;
                next++;
            } else if (r < 80 && next > 1) { /* settle or reject a random one */
                uint64_t t = 1 + backoff_rand(&rng) % (next - 1);
                bool gone = backoff_rand(&rng) % 10 == 0;
                bool ok = gone ? acks_gone(&a, t) : acks_settle(&a, t);
                ck_assert_int_eq(ok, m.known[t] && m.st[t] == ACKS_UNSETTLED);
                if (ok) {
                    m.st[t] = gone ? ACKS_GONE : ACKS_SETTLED;
                    if (gone)
                        m.unacked[t] = false; /* basic.reject */
                }
            } else if (r < 95) {
                flush(&a, &m);
            } else if (next > MAXT) { /* the end: settle everything left */
                for (uint64_t t = 1; t < next; t++)
                    if (m.st[t] == ACKS_UNSETTLED && acks_settle(&a, t))
                        m.st[t] = ACKS_SETTLED;
                flush(&a, &m);
            }
        }
        for (uint64_t t = 1; t <= MAXT; t++) {
            ck_assert_msg(!m.unacked[t], "tag %llu never acked", (unsigned long long)t);
            ck_assert_int_eq(m.acked_count[t], m.st[t] == ACKS_SETTLED ? 1 : 0);
        }
        acks_free(&a);
    }
}
END_TEST

/* Tools ack by hand (broker_ack): the tracker forgets those tags. */
START_TEST(test_acks_drop)
{
    struct acks a;
    struct acks_op op;
    acks_init(&a);
    for (uint64_t t = 1; t <= 5; t++)
        ck_assert_int_eq(acks_received(&a, t), IDEMQ_OK);
    acks_drop(&a, 3, true);
    ck_assert_uint_eq(acks_outstanding(&a), 2);
    acks_drop(&a, 5, false);
    ck_assert_uint_eq(acks_outstanding(&a), 1);
    ck_assert(acks_settle(&a, 4));
    ck_assert(acks_next(&a, &op));
    ck_assert_uint_eq(op.tag, 4);
    acks_free(&a);
}
END_TEST

/* ---- confirms ---- */

START_TEST(test_confirms_out_of_order)
{
    struct confirms c;
    uint64_t s1, s2, s3;
    confirms_init(&c);
    confirms_reset(&c);
    ck_assert_int_eq(confirms_publish(&c, &s1), IDEMQ_OK);
    ck_assert_int_eq(confirms_publish(&c, &s2), IDEMQ_OK);
    ck_assert_int_eq(confirms_publish(&c, &s3), IDEMQ_OK);
    ck_assert_uint_eq(s1, 1);
    ck_assert_uint_eq(s3, 3);
    /* seq 3 confirmed before 1 and 2 (a delay bucket and a quorum .dead):
     * the range is not done */
    confirms_ack(&c, 3, false);
    ck_assert_int_eq(confirms_range(&c, 1, 3), CONFIRMS_PENDING);
    confirms_ack(&c, 1, false);
    ck_assert_int_eq(confirms_range(&c, 1, 3), CONFIRMS_PENDING);
    /* a late nack of 2 fails the range it belongs to */
    confirms_nack(&c, 2, false);
    ck_assert_int_eq(confirms_range(&c, 1, 3), CONFIRMS_FAILED);
    ck_assert_int_eq(confirms_range(&c, 3, 3), CONFIRMS_ACKED);
    /* a later range is not touched by it */
    confirms_forget_below(&c, 4);
    ck_assert_int_eq(confirms_publish(&c, &s1), IDEMQ_OK);
    confirms_ack(&c, 4, true);
    ck_assert_int_eq(confirms_range(&c, 4, 4), CONFIRMS_ACKED);
    confirms_free(&c);
}
END_TEST

START_TEST(test_confirms_multiple_and_return)
{
    struct confirms c;
    uint64_t s;
    confirms_init(&c);
    confirms_reset(&c);
    for (int i = 0; i < 5; i++)
        ck_assert_int_eq(confirms_publish(&c, &s), IDEMQ_OK);
    confirms_ack(&c, 4, true); /* 1..4 */
    ck_assert_int_eq(confirms_range(&c, 1, 4), CONFIRMS_ACKED);
    ck_assert_int_eq(confirms_range(&c, 1, 5), CONFIRMS_PENDING);
    /* a basic.return precedes the confirm of the publish it names */
    confirms_return(&c);
    confirms_ack(&c, 5, false);
    ck_assert_int_eq(confirms_range(&c, 5, 5), CONFIRMS_FAILED);
    /* a multiple ack does not undo a failure */
    ck_assert_int_eq(confirms_publish(&c, &s), IDEMQ_OK);
    confirms_nack(&c, 6, false);
    confirms_ack(&c, 6, true);
    ck_assert_int_eq(confirms_range(&c, 6, 6), CONFIRMS_FAILED);
    /* confirms of sequence numbers never published are counted, ignored */
    confirms_ack(&c, 99, true);
    ck_assert_uint_eq(c.strays, 1);
    confirms_free(&c);
}
END_TEST

/* Per publish (what the outbox relay reads): a nack marks only its tag; a
 * multiple ack right after a basic.return marks what it covers
 * RETURN_ACKED (the caller tells the returned one by message_id), the
 * publishes after it stay pending, and nothing outside the table is
 * vouched for. */
START_TEST(test_confirms_seq_state)
{
    struct confirms c;
    uint64_t s;
    confirms_init(&c);
    confirms_reset(&c);
    for (int i = 0; i < 6; i++)
        ck_assert_int_eq(confirms_publish(&c, &s), IDEMQ_OK);
    confirms_nack(&c, 2, false);
    confirms_return(&c);
    confirms_ack(&c, 4, true); /* 1, 3, 4 (2 stays nacked) */
    ck_assert_int_eq(confirms_seq_state(&c, 1), CONFIRMS_SEQ_RETURN_ACKED);
    ck_assert_int_eq(confirms_seq_state(&c, 2), CONFIRMS_SEQ_NACKED);
    ck_assert_int_eq(confirms_seq_state(&c, 3), CONFIRMS_SEQ_RETURN_ACKED);
    ck_assert_int_eq(confirms_seq_state(&c, 4), CONFIRMS_SEQ_RETURN_ACKED);
    ck_assert_int_eq(confirms_seq_state(&c, 5), CONFIRMS_SEQ_PENDING);
    ck_assert_int_eq(confirms_range(&c, 1, 1), CONFIRMS_FAILED);
    confirms_ack(&c, 6, true); /* no return before it: plain acks */
    ck_assert_int_eq(confirms_seq_state(&c, 5), CONFIRMS_SEQ_ACKED);
    ck_assert_int_eq(confirms_seq_state(&c, 6), CONFIRMS_SEQ_ACKED);
    ck_assert_int_eq(confirms_range(&c, 5, 6), CONFIRMS_ACKED);
    ck_assert_int_eq(confirms_seq_state(&c, 7), CONFIRMS_SEQ_UNTRACKED);
    confirms_forget_below(&c, 3);
    ck_assert_int_eq(confirms_seq_state(&c, 2), CONFIRMS_SEQ_UNTRACKED);
    confirms_free(&c);
}
END_TEST

/* fuzz_track's find (build-fuzz/artifacts, 2026-12-02): a return, then an
 * ack naming a publish that was already acked. Before the relay kept
 * "acked after a return" apart, that ack failed the publish it names (a
 * failure is never undone, and uncertain means failed); the new state
 * must keep that rule, not leave it ACKED. */
START_TEST(test_confirms_return_then_repeated_ack)
{
    struct confirms c;
    uint64_t s;
    confirms_init(&c);
    confirms_reset(&c);
    for (int i = 0; i < 8; i++)
        ck_assert_int_eq(confirms_publish(&c, &s), IDEMQ_OK);
    confirms_ack(&c, 4, true); /* 1..4 acked */
    confirms_return(&c);
    confirms_ack(&c, 4, true); /* the returned publish's ack names 4 again */
    ck_assert_int_eq(confirms_range(&c, 4, 4), CONFIRMS_FAILED);
    ck_assert_int_eq(confirms_seq_state(&c, 4), CONFIRMS_SEQ_RETURN_ACKED);
    ck_assert_int_eq(confirms_range(&c, 1, 3), CONFIRMS_ACKED);
    /* a nack is not turned into a returned ack */
    confirms_nack(&c, 6, false);
    confirms_return(&c);
    confirms_ack(&c, 6, false);
    ck_assert_int_eq(confirms_seq_state(&c, 6), CONFIRMS_SEQ_NACKED);
    confirms_free(&c);
}
END_TEST

/* Random batches published and confirmed by a fake broker in random order,
 * with random multiple flags, nacks and returns: a batch is ACKED exactly
 * when every publish of it was acked, and FAILED whenever one was not; it
 * never reads ACKED while a confirm is missing. */
START_TEST(test_confirms_random)
{
    uint64_t rng = 0x1234567ULL + (uint64_t)_i;
    for (int round = 0; round < 50; round++) {
        struct confirms c;
        uint64_t first, last, s;
        int n = 1 + (int)(backoff_rand(&rng) % 40);
        uint8_t truth[64]; /* 0 pending, 1 acked, 2 failed, by seq */
        confirms_init(&c);
        confirms_reset(&c);
        memset(truth, 0, sizeof truth);
        first = confirms_next_seq(&c);
        for (int i = 0; i < n; i++)
            ck_assert_int_eq(confirms_publish(&c, &s), IDEMQ_OK);
        last = s;
        for (;;) {
            bool pending = false, failed = false;
            uint64_t t;
            for (uint64_t q = first; q <= last; q++) {
                pending = pending || truth[q] == 0;
                failed = failed || truth[q] == 2;
            }
            enum confirms_result r = confirms_range(&c, first, last);
            if (failed)
                ck_assert_int_eq(r, CONFIRMS_FAILED);
            else if (pending)
                ck_assert_int_eq(r, CONFIRMS_PENDING);
            else
                ck_assert_int_eq(r, CONFIRMS_ACKED);
            if (!pending)
                break;
            /* the broker confirms a random pending seq, maybe multiple */
            do
                t = first + backoff_rand(&rng) % (uint64_t)n;
            while (truth[t] != 0);
            bool multiple = backoff_rand(&rng) % 3 == 0;
            unsigned kind = (unsigned)(backoff_rand(&rng) % 20); /* 0 nack, 1 return */
            if (kind == 1)
                confirms_return(&c);
            if (kind == 0)
                confirms_nack(&c, t, multiple);
            else
                confirms_ack(&c, t, multiple);
            /* multiple: every publish up to t still pending gets the same */
            for (uint64_t q = multiple ? first : t; q <= t; q++)
                if (truth[q] == 0 || q == t)
                    truth[q] = kind == 0 ? 2 : kind == 1 && q == t ? 2 : 1;
        }
        confirms_free(&c);
    }
}
END_TEST

int main(void)
{
    Suite *s = suite_create("track");
    TCase *tc = tcase_create("track");
    tcase_set_timeout(tc, 60);
    tcase_add_test(tc, test_acks_prefix_and_gap);
    tcase_add_loop_test(tc, test_acks_random, 0, 5);
    tcase_add_test(tc, test_acks_drop);
    tcase_add_test(tc, test_confirms_out_of_order);
    tcase_add_test(tc, test_confirms_multiple_and_return);
    tcase_add_test(tc, test_confirms_seq_state);
    tcase_add_test(tc, test_confirms_return_then_repeated_ack);
    tcase_add_loop_test(tc, test_confirms_random, 0, 5);
    suite_add_tcase(s, tc);
    return check_run(s);
}
