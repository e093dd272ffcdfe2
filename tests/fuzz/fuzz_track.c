/*
 * fuzz_track: the confirm/ack trackers (adapters/acks.c, adapters/confirms.c)
 * driven by a program of events, each checked against a plain model kept
 * here. The input is read two bytes at a time, an opcode and an argument:
 *
 *   acks      0 received (arg & 3: tags skipped before it; arg 255: a tag
 *               that does not increase, refused), 1 settle a recent tag,
 *             2 settle the lowest unsettled tag (a slow delivery finishing),
 *             3 gone (rejected) a recent tag, 4 drop (the caller acked or
 *               rejected itself; arg & 1 multiple), 5 one acks_next,
 *             6 acks_next until it has nothing, 7 acks_reset (new channel)
 *   confirms  8 publish 1-8 messages, 9 basic.ack, 10 basic.nack (arg & 1
 *               multiple, the tag counted back from the last publish, some
 *               strays beyond it), 11 basic.return, 12 ask about a range,
 *             13 forget below a seq, 14 confirms_reset (new channel)
 *
 * The model is the broker's view. Acks: which tags the broker still holds
 * unacknowledged, and their state as the worker decided it. Confirms: what
 * each publish got (nothing, ack, failure), never forgotten.
 *
 * Invariants (abort on violation):
 *  - an ack never covers a tag the broker holds that is not settled, and
 *    never names a tag the broker does not hold (a 406 that closes the
 *    channel);
 *  - every settled delivery is acked at most once, and acks_next stops only
 *    when no settled delivery is left to ack (nothing held back);
 *  - outstanding count, first unsettled tag and the state of each tag match;
 *  - a range is ACKED only if every publish in it was acked, FAILED if any
 *    was nacked or returned (or lies outside what is tracked), PENDING
 *    otherwise.
 */
#include <stdbool.h>
#include <string.h>

#include "acks.h"
#include "confirms.h"
#include "fuzz.h"
#include "idemq_err.h"

#define MAXT 20000 /* tags the model keeps */
#define MAXS 4096  /* sequence numbers the model keeps */

/* ---- acks model ---- */
enum { M_NONE = 0, M_UNSETTLED, M_SETTLED, M_GONE, M_DONE };

static uint8_t mst[MAXT + 1];   /* per tag: M_* (M_DONE: acked or dropped) */
static uint8_t macked[MAXT + 1]; /* acks received by the broker per tag */
static uint64_t mlast;          /* highest tag registered */
/* Kept so a step costs O(1) amortized, not a scan of every tag: */
static size_t mheld;            /* tags UNSETTLED or SETTLED */
static uint64_t mfloor;         /* below it: no tag UNSETTLED or SETTLED */
static uint64_t mfu;            /* below it: no tag UNSETTLED */

/* ---- confirms model ---- */
enum { C_NONE = 0, C_ACKED, C_FAILED };

static uint8_t cst[MAXS + 1];
static uint64_t cnext, cbase;
static uint64_t cfloor; /* below it: no publish without a confirm */
static bool creturn;

static void acks_model_reset(void)
{
    memset(mst, 0, sizeof mst);
    memset(macked, 0, sizeof macked);
    mlast = 0;
    mheld = 0;
    mfloor = mfu = 1;
}

/* Moves a held tag to state st, keeping the counters. */
static void mset(uint64_t t, uint8_t st)
{
    bool was = mst[t] == M_UNSETTLED || mst[t] == M_SETTLED;
    bool is = st == M_UNSETTLED || st == M_SETTLED;
    mst[t] = st;
    mheld += is;
    mheld -= was;
    while (mfloor <= mlast && mst[mfloor] != M_UNSETTLED && mst[mfloor] != M_SETTLED)
        mfloor++;
    while (mfu <= mlast && mst[mfu] != M_UNSETTLED)
        mfu++;
}

static void confirms_model_reset(void)
{
    memset(cst, 0, sizeof cst);
    cnext = cbase = cfloor = 1;
    creturn = false;
}

/* A tag the program means: one of the last 64 registered (or 0, or one
 * past the last), so long programs still reach their own tags. */
static uint64_t recent(uint8_t arg)
{
    uint64_t back = arg % 66;
    return back > mlast + 1 ? 0 : mlast + 1 - back;
}

static void apply_ack(const struct acks_op *op)
{
    FUZZ_CHECK(op->tag >= 1 && op->tag <= mlast, "ack of tag %llu never delivered (last %llu)",
               (unsigned long long)op->tag, (unsigned long long)mlast);
    FUZZ_CHECK(mst[op->tag] == M_SETTLED, "ack %llu names a tag in model state %d",
               (unsigned long long)op->tag, mst[op->tag]);
    for (uint64_t t = op->multiple ? mfloor : op->tag; t <= op->tag; t++) {
        if (mst[t] == M_UNSETTLED)
            FUZZ_CHECK(false, "ack %llu%s covers unsettled tag %llu", (unsigned long long)op->tag,
                       op->multiple ? " (multiple)" : "", (unsigned long long)t);
        if (mst[t] == M_SETTLED) {
            macked[t]++;
            FUZZ_CHECK(macked[t] == 1, "tag %llu acked twice", (unsigned long long)t);
            mset(t, M_DONE);
        }
    }
}

static void check_acks(const struct acks *a, uint64_t probe)
{
    size_t held = mheld;
    uint64_t first = mfu <= mlast ? mfu : 0;
    enum acks_state st;
    bool known;

    FUZZ_CHECK(acks_outstanding(a) == held, "outstanding %zu, model %zu", acks_outstanding(a),
               held);
    FUZZ_CHECK(acks_first_unsettled(a) == first, "first unsettled %llu, model %llu",
               (unsigned long long)acks_first_unsettled(a), (unsigned long long)first);
    if (probe < 1 || probe > mlast)
        return;
    known = acks_state_of(a, probe, &st);
    switch (mst[probe]) {
    case M_UNSETTLED:
        FUZZ_CHECK(known && st == ACKS_UNSETTLED, "tag %llu should be unsettled",
                   (unsigned long long)probe);
        break;
    case M_SETTLED:
        FUZZ_CHECK(known && st == ACKS_SETTLED, "tag %llu should be settled",
                   (unsigned long long)probe);
        break;
    case M_GONE: /* may still sit in the window until it reaches the front */
        FUZZ_CHECK(!known || st == ACKS_GONE, "tag %llu should be gone",
                   (unsigned long long)probe);
        break;
    default:
        FUZZ_CHECK(!known, "tag %llu is done but still tracked", (unsigned long long)probe);
    }
}

static void drain(struct acks *a)
{
    struct acks_op op;
    while (acks_next(a, &op))
        apply_ack(&op);
    for (uint64_t t = mfloor; t <= mlast; t++)
        FUZZ_CHECK(mst[t] != M_SETTLED, "settled tag %llu held back", (unsigned long long)t);
}

/* The model's answer for confirms_range. */
static enum confirms_result model_range(uint64_t first, uint64_t last)
{
    bool pending = false;
    if (first > last)
        return CONFIRMS_ACKED;
    if (first < cbase || last >= cnext)
        return CONFIRMS_FAILED;
    for (uint64_t s = first; s <= last; s++) {
        if (cst[s] == C_FAILED)
            return CONFIRMS_FAILED;
        pending = pending || cst[s] == C_NONE;
    }
    return pending ? CONFIRMS_PENDING : CONFIRMS_ACKED;
}

/* A confirm as the broker sent it: a multiple one covers every publish not
 * confirmed yet up to tag; tag itself may be confirmed again (a broker
 * fault), and then a failure wins; the confirm right after a return is a
 * failure of what it covers. */
static void model_confirm(uint64_t tag, bool multiple, uint8_t st)
{
    if (creturn) {
        st = C_FAILED;
        creturn = false;
    }
    if (tag == 0 || tag >= cnext)
        return;
    if (multiple)
        for (uint64_t s = cfloor; s < tag; s++)
            if (cst[s] == C_NONE)
                cst[s] = st;
    if (st == C_FAILED || cst[tag] == C_NONE)
        cst[tag] = st;
    while (cfloor < cnext && cst[cfloor] != C_NONE)
        cfloor++;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    struct acks a;
    struct confirms c;

    acks_init(&a);
    confirms_init(&c);
    confirms_reset(&c);
    acks_model_reset();
    confirms_model_reset();

    for (size_t i = 0; i + 1 < size; i += 2) {
        uint8_t op = data[i] % 15, arg = data[i + 1];
        uint64_t probe = 0;

        switch (op) {
        case 0: { /* received */
            uint64_t tag = mlast + 1 + (arg & 3);
            if (arg == 255) {
                uint64_t bad = mlast; /* repeats the last tag (or is 0) */
                FUZZ_CHECK(acks_received(&a, bad) == IDEMQ_ERR_BROKER,
                           "tag %llu that does not increase accepted", (unsigned long long)bad);
                break;
            }
            if (tag > MAXT)
                break;
            FUZZ_CHECK(acks_received(&a, tag) == IDEMQ_OK, "received %llu refused",
                       (unsigned long long)tag);
            mlast = tag;
            mset(tag, M_UNSETTLED);
            probe = tag;
            break;
        }
        case 1:
        case 3: { /* settle / gone a recent tag */
            uint64_t tag = recent(arg);
            bool want = tag >= 1 && tag <= mlast && mst[tag] == M_UNSETTLED;
            bool got = op == 1 ? acks_settle(&a, tag) : acks_gone(&a, tag);
            FUZZ_CHECK(got == want, "%s(%llu) returned %d, model says %d",
                       op == 1 ? "settle" : "gone", (unsigned long long)tag, got, want);
            if (got)
                mset(tag, op == 1 ? M_SETTLED : M_GONE);
            probe = tag;
            break;
        }
        case 2: { /* the lowest unsettled one settles */
            uint64_t tag = acks_first_unsettled(&a);
            if (!tag)
                break;
            FUZZ_CHECK(acks_settle(&a, tag), "settle of first unsettled %llu refused",
                       (unsigned long long)tag);
            mset(tag, M_SETTLED);
            probe = tag;
            break;
        }
        case 4: { /* the caller acked / rejected tag itself */
            uint64_t tag = recent(arg >> 1);
            bool multiple = arg & 1;
            acks_drop(&a, tag, multiple);
            for (uint64_t t = multiple ? mfloor : tag; t >= 1 && t <= tag && t <= mlast; t++)
                if (mst[t] != M_NONE)
                    mset(t, M_DONE);
            probe = tag;
            break;
        }
        case 5: {
            struct acks_op o;
            if (acks_next(&a, &o)) {
                apply_ack(&o);
                probe = o.tag;
            }
            break;
        }
        case 6:
            drain(&a);
            break;
        case 7: /* channel gone: the broker requeues what it held */
            acks_reset(&a);
            acks_model_reset();
            break;
        case 8: /* publish */
            for (int k = 0; k <= (arg & 7) && cnext <= MAXS; k++) {
                uint64_t seq = 0;
                FUZZ_CHECK(confirms_publish(&c, &seq) == IDEMQ_OK, "publish refused");
                FUZZ_CHECK(seq == cnext, "publish got seq %llu, model %llu",
                           (unsigned long long)seq, (unsigned long long)cnext);
                FUZZ_CHECK(confirms_next_seq(&c) == cnext + 1, "next seq");
                cst[cnext++] = C_NONE;
            }
            break;
        case 9:
        case 10: { /* basic.ack / basic.nack: tag counted back from the last
                    * publish; arg >= 240 gives a stray beyond it */
            bool multiple = arg & 1;
            uint64_t back = (arg >> 1) % 120;
            uint64_t tag = arg >= 240 ? cnext + (arg & 3) : back >= cnext ? 0 : cnext - 1 - back;
            if (op == 9)
                confirms_ack(&c, tag, multiple);
            else
                confirms_nack(&c, tag, multiple);
            model_confirm(tag, multiple, op == 9 ? C_ACKED : C_FAILED);
            break;
        }
        case 11:
            confirms_return(&c);
            creturn = true;
            break;
        case 12: { /* a range: its start counted back, its length from arg */
            uint64_t len = arg & 15, back = (arg >> 4) * 3;
            uint64_t first = back + len >= cnext ? 1 : cnext - back - len;
            uint64_t last = first + len - 1; /* len 0: empty range */
            enum confirms_result got = confirms_range(&c, first, last);
            enum confirms_result want = model_range(first, last);
            FUZZ_CHECK(got == want, "range %llu..%llu is %d, model %d", (unsigned long long)first,
                       (unsigned long long)last, got, want);
            break;
        }
        case 13: { /* forget decided ranges below seq */
            uint64_t back = arg % 70;
            uint64_t seq = back >= cnext ? 0 : cnext - back;
            confirms_forget_below(&c, seq);
            if (seq > cbase)
                cbase = seq > cnext ? cnext : seq;
            break;
        }
        case 14:
            confirms_reset(&c);
            confirms_model_reset();
            break;
        }
        if (op <= 7)
            check_acks(&a, probe);
    }
    /* The end of every program: whatever is settled gets acked, and every
     * tracked range answers as the model does. */
    drain(&a);
    check_acks(&a, 0);
    for (uint64_t s = cbase; s < cnext; s++)
        FUZZ_CHECK(confirms_range(&c, s, s) == model_range(s, s), "seq %llu",
                   (unsigned long long)s);
    FUZZ_CHECK(confirms_range(&c, cbase, cnext - 1) == model_range(cbase, cnext - 1),
               "whole range");
    acks_free(&a);
    confirms_free(&c);
    return 0;
}
