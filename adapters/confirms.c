/*
 * confirms: per-sequence-number publisher confirm states (see confirms.h).
 * state[i] belongs to seq base + i; the table holds base .. next-1.
 */
#include "confirms.h"

#include <stdlib.h>
#include <string.h>

enum {
    ST_PENDING = CONFIRMS_SEQ_PENDING,
    ST_ACKED = CONFIRMS_SEQ_ACKED,
    ST_FAILED = CONFIRMS_SEQ_NACKED,
    ST_RETURN_ACKED = CONFIRMS_SEQ_RETURN_ACKED,
};

void confirms_init(struct confirms *c)
{
    memset(c, 0, sizeof *c);
    c->base = c->next = 1;
}

void confirms_free(struct confirms *c)
{
    free(c->state);
    memset(c, 0, sizeof *c);
}

void confirms_reset(struct confirms *c)
{
    c->base = c->next = 1;
    c->return_seen = false;
}

uint64_t confirms_next_seq(const struct confirms *c) { return c->next; }

idemq_err_t confirms_publish(struct confirms *c, uint64_t *seq)
{
    size_t used = (size_t)(c->next - c->base);
    if (used == c->cap) {
        size_t cap = c->cap ? c->cap * 2 : 64;
        uint8_t *st = realloc(c->state, cap);
        if (!st)
            return IDEMQ_ERR_NOMEM;
        c->state = st;
        c->cap = cap;
    }
    c->state[used] = ST_PENDING;
    *seq = c->next++;
    return IDEMQ_OK;
}

static void confirm(struct confirms *c, uint64_t tag, bool multiple, uint8_t st)
{
    uint64_t lo, hi;
    if (c->return_seen) { /* the confirm of a returned publish: it failed */
        if (st == ST_ACKED)
            st = ST_RETURN_ACKED;
        c->return_seen = false;
    }
    if (tag == 0 || tag >= c->next) { /* never published on this channel */
        c->strays++;
        return;
    }
    if (tag < c->base) /* already forgotten: decided long ago */
        return;
    hi = tag;
    lo = multiple ? c->base : tag;
    for (uint64_t s = lo; s <= hi; s++) {
        uint8_t *p = &c->state[s - c->base];
        /* A multiple confirm covers only what was still pending; a failure
         * (a nack, the ack of a returned publish) fails the publish it
         * names even if it was acked before, and is never undone by a
         * later ack nor turned into the other kind. */
        if (*p == ST_PENDING || (st != ST_ACKED && s == tag && *p == ST_ACKED))
            *p = st;
    }
}

void confirms_ack(struct confirms *c, uint64_t tag, bool multiple)
{
    confirm(c, tag, multiple, ST_ACKED);
}

void confirms_nack(struct confirms *c, uint64_t tag, bool multiple)
{
    confirm(c, tag, multiple, ST_FAILED);
}

void confirms_return(struct confirms *c) { c->return_seen = true; }

enum confirms_result confirms_range(const struct confirms *c, uint64_t first, uint64_t last)
{
    bool pending = false;
    if (first > last)
        return CONFIRMS_ACKED;
    if (first < c->base || last >= c->next)
        return CONFIRMS_FAILED; /* not tracked: cannot be vouched for */
    for (uint64_t s = first; s <= last; s++) {
        uint8_t st = c->state[s - c->base];
        if (st == ST_FAILED || st == ST_RETURN_ACKED)
            return CONFIRMS_FAILED;
        pending = pending || st == ST_PENDING;
    }
    return pending ? CONFIRMS_PENDING : CONFIRMS_ACKED;
}

enum confirms_seq confirms_seq_state(const struct confirms *c, uint64_t seq)
{
    if (seq < c->base || seq >= c->next)
        return CONFIRMS_SEQ_UNTRACKED;
    return (enum confirms_seq)c->state[seq - c->base];
}

void confirms_forget_below(struct confirms *c, uint64_t seq)
{
    size_t drop;
    if (seq <= c->base)
        return;
    if (seq > c->next)
        seq = c->next;
    drop = (size_t)(seq - c->base);
    memmove(c->state, c->state + drop, (size_t)(c->next - seq));
    c->base = seq;
}
