/*
 * acks: the settled-delivery tracker of one channel (see acks.h). The
 * outstanding deliveries are a window v[head .. head+n) in tag order;
 * entries leave from the front (contiguous settled prefix) or from the
 * middle (settled beyond a gap, gone), so the window is compacted when its
 * front holes pile up.
 */
#include "acks.h"

#include <stdlib.h>
#include <string.h>

void acks_init(struct acks *a)
{
    memset(a, 0, sizeof *a);
}

void acks_free(struct acks *a)
{
    free(a->v);
    memset(a, 0, sizeof *a);
}

void acks_reset(struct acks *a)
{
    a->head = a->n = 0;
    a->last_tag = 0;
}

idemq_err_t acks_received(struct acks *a, uint64_t tag)
{
    if (tag == 0 || tag <= a->last_tag)
        return IDEMQ_ERR_BROKER;
    if (a->head + a->n == a->cap) {
        if (a->head > 0) { /* slide the window to the front */
            memmove(a->v, a->v + a->head, a->n * sizeof *a->v);
            a->head = 0;
        } else {
            size_t cap = a->cap ? a->cap * 2 : 256;
            struct acks_entry *v = realloc(a->v, cap * sizeof *v);
            if (!v)
                return IDEMQ_ERR_NOMEM;
            a->v = v;
            a->cap = cap;
        }
    }
    a->v[a->head + a->n].tag = tag;
    a->v[a->head + a->n].state = ACKS_UNSETTLED;
    a->v[a->head + a->n].with_close = false;
    a->n++;
    a->last_tag = tag;
    return IDEMQ_OK;
}

/* Index (into v) of tag, or -1. Binary search: tags increase. */
static long find(const struct acks *a, uint64_t tag)
{
    size_t lo = a->head, hi = a->head + a->n;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (a->v[mid].tag < tag)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo < a->head + a->n && a->v[lo].tag == tag ? (long)lo : -1;
}

static bool mark(struct acks *a, uint64_t tag, enum acks_state st)
{
    long i = find(a, tag);
    if (i < 0 || a->v[i].state != ACKS_UNSETTLED)
        return false;
    a->v[i].state = st;
    return true;
}

bool acks_settle(struct acks *a, uint64_t tag) { return mark(a, tag, ACKS_SETTLED); }

bool acks_gone(struct acks *a, uint64_t tag) { return mark(a, tag, ACKS_GONE); }

bool acks_mark_with_close(struct acks *a, uint64_t tag)
{
    long i = find(a, tag);
    if (i < 0)
        return false;
    a->v[i].with_close = true;
    return true;
}

bool acks_with_close(const struct acks *a, uint64_t tag)
{
    long i = find(a, tag);
    return i >= 0 && a->v[i].with_close;
}

bool acks_state_of(const struct acks *a, uint64_t tag, enum acks_state *out)
{
    long i = find(a, tag);
    if (i < 0)
        return false;
    *out = a->v[i].state;
    return true;
}

/* Removes v[i] (i inside the window), keeping the order. */
static void remove_at(struct acks *a, size_t i)
{
    size_t end = a->head + a->n;
    if (i == a->head) {
        a->head++;
    } else {
        memmove(a->v + i, a->v + i + 1, (end - i - 1) * sizeof *a->v);
    }
    a->n--;
    if (a->n == 0)
        a->head = 0;
}

bool acks_next(struct acks *a, struct acks_op *op)
{
    size_t end, run = 0, last_settled = 0;
    bool any = false;

    /* Gone entries at the front need nothing: drop them. */
    while (a->n && a->v[a->head].state == ACKS_GONE)
        remove_at(a, a->head);
    if (!a->n)
        return false;
    end = a->head + a->n;
    /* The contiguous prefix of settled (or gone) deliveries: one multiple
     * ack up to its last settled tag covers exactly them. */
    while (a->head + run < end && a->v[a->head + run].state != ACKS_UNSETTLED) {
        if (a->v[a->head + run].state == ACKS_SETTLED) {
            last_settled = a->head + run;
            any = true;
        }
        run++;
    }
    if (any) {
        op->tag = a->v[last_settled].tag;
        op->multiple = last_settled > a->head;
        a->head += run;
        a->n -= run;
        if (a->n == 0)
            a->head = 0;
        return true;
    }
    /* The front is unsettled: settled ones beyond it go one by one. */
    for (size_t i = a->head; i < end; i++) {
        if (a->v[i].state == ACKS_SETTLED) {
            op->tag = a->v[i].tag;
            op->multiple = false;
            remove_at(a, i);
            return true;
        }
    }
    return false;
}

void acks_drop(struct acks *a, uint64_t tag, bool multiple)
{
    long i;
    if (multiple) {
        while (a->n && a->v[a->head].tag <= tag)
            remove_at(a, a->head);
        return;
    }
    if ((i = find(a, tag)) >= 0)
        remove_at(a, (size_t)i);
}

size_t acks_outstanding(const struct acks *a)
{
    size_t k = 0;
    for (size_t i = a->head; i < a->head + a->n; i++)
        k += a->v[i].state != ACKS_GONE;
    return k;
}

uint64_t acks_first_unsettled(const struct acks *a)
{
    for (size_t i = a->head; i < a->head + a->n; i++)
        if (a->v[i].state == ACKS_UNSETTLED)
            return a->v[i].tag;
    return 0;
}
