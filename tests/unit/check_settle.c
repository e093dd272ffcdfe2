/* Unit tests of consumer/settle (a committed batch's plans carried out on
 * the broker) with a fake broker: the real ack tracker (adapters/acks) in
 * front of a model of what the broker holds, and confirms that succeed or
 * fail at random. Randomized interleavings of batches, lanes holding
 * deliveries across batches, rejects, releases and failed confirms check
 * the invariants after every step: never an ack past an unsettled
 * delivery, never the original of an unconfirmed republish acknowledged,
 * never a held or released delivery acknowledged. */
#include <check.h>

#include "check_run.h"
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "acks.h"
#include "backoff.h"
#include "settle.h"

#define MAXT 4000

struct fake {
    struct acks acks;
    uint64_t rng;
    bool unacked[MAXT + 1];   /* the broker holds it unacknowledged */
    bool ackable[MAXT + 1];   /* its plan allows an ack (set by the test) */
    bool republished[MAXT + 1]; /* ...but only after a successful wait */
    bool waited_ok;           /* a wait of the current batch succeeded */
    int acked[MAXT + 1];
    bool rejected[MAXT + 1];
    int pubs, pubs_since_wait;
    int confirm_fail_pct;     /* chance that a wait fails */
    bool last_wait_failed;
};

static idemq_err_t f_delay(void *ctx, const struct job *j, long delay_ms, int attempt)
{
    struct fake *f = ctx;
    (void)j, (void)delay_ms, (void)attempt;
    f->pubs++;
    f->pubs_since_wait++;
    return IDEMQ_OK;
}

static idemq_err_t f_dead(void *ctx, const struct job *j, const json_t *park)
{
    return f_delay(ctx, j, 0, park ? 1 : 0);
}

static idemq_err_t f_wait(void *ctx)
{
    struct fake *f = ctx;
    ck_assert_int_gt(f->pubs_since_wait, 0);
    f->pubs_since_wait = 0;
    f->last_wait_failed = (int)(backoff_rand(&f->rng) % 100) < f->confirm_fail_pct;
    f->waited_ok = !f->last_wait_failed;
    return f->last_wait_failed ? IDEMQ_ERR_BROKER : IDEMQ_OK;
}

static idemq_err_t f_settle(void *ctx, uint64_t tag)
{
    struct fake *f = ctx;
    ck_assert_msg(f->ackable[tag], "settled %llu whose plan forbids an ack",
                  (unsigned long long)tag);
    ck_assert_msg(!f->republished[tag] || f->waited_ok,
                  "settled republished %llu before its confirms", (unsigned long long)tag);
    return acks_settle(&f->acks, tag) ? IDEMQ_OK : IDEMQ_ERR_INTERNAL;
}

static idemq_err_t f_reject(void *ctx, uint64_t tag)
{
    struct fake *f = ctx;
    ck_assert(acks_gone(&f->acks, tag));
    ck_assert(f->unacked[tag]);
    f->unacked[tag] = false;
    f->rejected[tag] = true;
    return IDEMQ_OK;
}

/* The broker side of basic.ack: every delivery it covers must be one the
 * test allowed to be acknowledged. */
static idemq_err_t f_flush(void *ctx)
{
    struct fake *f = ctx;
    struct acks_op op;
    while (acks_next(&f->acks, &op)) {
        ck_assert_msg(f->unacked[op.tag], "ack of %llu the broker no longer holds",
                      (unsigned long long)op.tag);
        for (uint64_t t = op.multiple ? 1 : op.tag; t <= op.tag; t++) {
            if (!f->unacked[t])
                continue;
            ck_assert_msg(f->ackable[t], "ack %llu%s covers %llu, which is not settled",
                          (unsigned long long)op.tag, op.multiple ? " (multiple)" : "",
                          (unsigned long long)t);
            f->unacked[t] = false;
            f->acked[t]++;
        }
    }
    return IDEMQ_OK;
}

static struct settle_io io_for(struct fake *f)
{
    struct settle_io io = {f, f_delay, f_dead, f_wait, f_settle, f_reject, f_flush};
    return io;
}

/* A scripted case: a held lane delivery (tag 1) and a released one (3)
 * must not be covered by the multiple ack of the others. */
START_TEST(test_held_not_covered)
{
    static struct fake f;
    struct settle_io io;
    struct job jobs[5];
    struct plan plans[5];
    char why[128];
    memset(&f, 0, sizeof f);
    acks_init(&f.acks);
    io = io_for(&f);
    memset(jobs, 0, sizeof jobs);
    memset(plans, 0, sizeof plans);
    for (int i = 0; i < 5; i++) {
        ck_assert_int_eq(acks_received(&f.acks, (uint64_t)i + 1), IDEMQ_OK);
        f.unacked[i + 1] = true;
        jobs[i].tag = (uint64_t)i + 1;
    }
    plans[0].how = SETTLE_HOLD;
    jobs[0].tag = 0; /* moved back into its lane by the caller */
    plans[1].how = SETTLE_ACK;
    plans[2].how = SETTLE_RELEASE;
    plans[3].how = SETTLE_ACK;
    plans[4].how = SETTLE_REJECT;
    f.ackable[2] = f.ackable[4] = true;
    ck_assert_int_eq(settle_batch(&io, jobs, plans, 5, why, sizeof why), SETTLE_DONE);
    ck_assert(f.unacked[1] && f.unacked[3]);
    ck_assert_int_eq(f.acked[2], 1);
    ck_assert_int_eq(f.acked[4], 1);
    ck_assert(f.rejected[5]);
    ck_assert_uint_eq(acks_first_unsettled(&f.acks), 1);
    acks_free(&f.acks);
}
END_TEST

/* A republish that is not confirmed: its original stays unacknowledged
 * (the broker redelivers it), the others are still acknowledged. */
START_TEST(test_unconfirmed_republish)
{
    static struct fake f;
    struct settle_io io;
    struct job jobs[3];
    struct plan plans[3];
    char why[128];
    memset(&f, 0, sizeof f);
    acks_init(&f.acks);
    io = io_for(&f);
    f.confirm_fail_pct = 100;
    memset(jobs, 0, sizeof jobs);
    memset(plans, 0, sizeof plans);
    for (int i = 0; i < 3; i++) {
        ck_assert_int_eq(acks_received(&f.acks, (uint64_t)i + 1), IDEMQ_OK);
        f.unacked[i + 1] = true;
        jobs[i].tag = (uint64_t)i + 1;
    }
    plans[0].how = SETTLE_ACK;
    plans[1].how = SETTLE_DELAY;
    plans[2].how = SETTLE_DEAD;
    f.ackable[1] = true;
    ck_assert_int_eq(settle_batch(&io, jobs, plans, 3, why, sizeof why), SETTLE_UNCONFIRMED);
    ck_assert_int_eq(f.acked[1], 1);
    ck_assert(f.unacked[2] && f.unacked[3]);
    ck_assert_int_eq(f.pubs, 2);
    acks_free(&f.acks);
}
END_TEST

/*
 * Random interleavings: deliveries from several lanes arrive; batches are
 * taken in lane order (not tag order, as lane_take_ready does), some
 * deliveries are held back in their lane for later batches, some released,
 * rejected, retried or parked; confirms fail at random (the connection is
 * then dropped: everything outstanding returns to the queue). The fake
 * broker checks every ack against what was allowed.
 */
START_TEST(test_random_lanes)
{
    uint64_t rng = 0xdeadbeefULL + (uint64_t)_i * 7919;
    for (int round = 0; round < 8; round++) {
        static struct fake f;
        static uint64_t held[8][MAXT];
        struct settle_io io;
        uint64_t next = 1;
        int nheld[8] = {0};
        memset(&f, 0, sizeof f);
        acks_init(&f.acks);
        f.rng = rng;
        f.confirm_fail_pct = (int)(backoff_rand(&rng) % 30);
        io = io_for(&f);
        while (next < MAXT - 64) {
            static struct job jobs[MAXT];
            static struct plan plans[MAXT];
            static int lane_of[MAXT];
            bool lane_held[8] = {false}, released = false;
            int n = 0, arrive = 1 + (int)(backoff_rand(&rng) % 40);
            char why[128];
            enum settle_result res;

            f.waited_ok = false;
            /* held deliveries first, lane by lane (lane_take_ready's order,
             * not tag order), then new deliveries from random lanes */
            for (int l = 0; l < 8; l++) {
                for (int h = 0; h < nheld[l]; h++) {
                    memset(&jobs[n], 0, sizeof jobs[n]);
                    jobs[n].tag = held[l][h];
                    lane_of[n++] = l;
                }
                nheld[l] = 0;
            }
            for (int k = 0; k < arrive; k++) {
                ck_assert_int_eq(acks_received(&f.acks, next), IDEMQ_OK);
                f.unacked[next] = true;
                memset(&jobs[n], 0, sizeof jobs[n]);
                jobs[n].tag = next++;
                lane_of[n++] = (int)(backoff_rand(&rng) % 8);
            }
            /* plans: once a delivery of a lane holds, the rest of it holds */
            for (int i = 0; i < n; i++) {
                unsigned r = (unsigned)(backoff_rand(&rng) % 100);
                uint64_t t = jobs[i].tag;
                memset(&plans[i], 0, sizeof plans[i]);
                if (lane_held[lane_of[i]] || r < 10) {
                    plans[i].how = SETTLE_HOLD;
                    lane_held[lane_of[i]] = true;
                    held[lane_of[i]][nheld[lane_of[i]]++] = t;
                    jobs[i].tag = 0; /* moved into its lane by the caller */
                    continue;
                }
                plans[i].how = r < 55   ? SETTLE_ACK
                               : r < 70 ? SETTLE_DELAY
                               : r < 82 ? SETTLE_DEAD
                               : r < 90 ? SETTLE_REJECT
                                        : SETTLE_RELEASE;
                f.ackable[t] = plans[i].how == SETTLE_ACK || plans[i].how == SETTLE_DELAY ||
                               plans[i].how == SETTLE_DEAD;
                f.republished[t] = plans[i].how == SETTLE_DELAY || plans[i].how == SETTLE_DEAD;
                released = released || plans[i].how == SETTLE_RELEASE;
            }
            res = settle_batch(&io, jobs, plans, n, why, sizeof why);
            for (int i = 0; i < n; i++) {
                uint64_t t = jobs[i].tag;
                if (!t)
                    continue;
                if (plans[i].how == SETTLE_RELEASE)
                    ck_assert(f.unacked[t]);
                if (f.republished[t] && f.last_wait_failed)
                    ck_assert_msg(f.unacked[t], "republished %llu acked though its confirm "
                                                "failed", (unsigned long long)t);
                if (plans[i].how == SETTLE_ACK)
                    ck_assert_int_eq(res == SETTLE_DONE || res == SETTLE_UNCONFIRMED, 1);
            }
            for (int l = 0; l < 8; l++)
                for (int h = 0; h < nheld[l]; h++)
                    ck_assert(f.unacked[held[l][h]]); /* held: never acked */
            if (res != SETTLE_DONE || released) {
                /* the caller drops the connection: what is outstanding
                 * returns to the queue, a new channel starts */
                if (res != SETTLE_DONE)
                    ck_assert_int_eq(res, SETTLE_UNCONFIRMED);
                acks_reset(&f.acks);
                memset(f.unacked, 0, sizeof f.unacked);
                memset(nheld, 0, sizeof nheld);
            }
            f.last_wait_failed = false;
        }
        for (uint64_t t = 1; t < next; t++)
            ck_assert_int_le(f.acked[t], 1);
        acks_free(&f.acks);
        rng = f.rng ^ rng;
    }
}
END_TEST

int main(void)
{
    Suite *s = suite_create("settle");
    TCase *tc = tcase_create("settle");
    tcase_set_timeout(tc, 60);
    tcase_add_test(tc, test_held_not_covered);
    tcase_add_test(tc, test_unconfirmed_republish);
    tcase_add_loop_test(tc, test_random_lanes, 0, 4);
    suite_add_tcase(s, tc);
    return check_run(s);
}
