/*
 * latency: log-linear bucketing. Values below 2^SUB_BITS get one bucket
 * each; above, every power of two is split into 2^SUB_BITS equal buckets.
 */
#include "latency.h"

#include <string.h>

#define SUB (1u << LATENCY_SUB_BITS)

void latency_init(struct latency_hist *h) { memset(h, 0, sizeof *h); }

static unsigned bucket_of(uint64_t v)
{
    unsigned e, idx;
    if (v < SUB)
        return (unsigned)v;
    e = 63u - (unsigned)__builtin_clzll(v); /* 2^e <= v < 2^(e+1), e >= SUB_BITS */
    if (e >= LATENCY_MAX_EXP)
        return LATENCY_BUCKETS - 1;
    idx = ((e - LATENCY_SUB_BITS + 1) << LATENCY_SUB_BITS) +
          (unsigned)((v >> (e - LATENCY_SUB_BITS)) & (SUB - 1));
    return idx < LATENCY_BUCKETS ? idx : LATENCY_BUCKETS - 1;
}

/* Largest value that falls into bucket i. */
static uint64_t bucket_top(unsigned i)
{
    unsigned e, sub;
    if (i < SUB)
        return i;
    e = (i >> LATENCY_SUB_BITS) + LATENCY_SUB_BITS - 1;
    sub = i & (SUB - 1);
    return ((uint64_t)(SUB + sub + 1) << (e - LATENCY_SUB_BITS)) - 1;
}

void latency_record(struct latency_hist *h, uint64_t us)
{
    h->count[bucket_of(us)]++;
    h->n++;
    if (us > h->max_us)
        h->max_us = us;
}

void latency_merge(struct latency_hist *dst, const struct latency_hist *src)
{
    for (unsigned i = 0; i < LATENCY_BUCKETS; i++)
        dst->count[i] += src->count[i];
    dst->n += src->n;
    if (src->max_us > dst->max_us)
        dst->max_us = src->max_us;
}

uint64_t latency_percentile_us(const struct latency_hist *h, double p)
{
    uint64_t rank, seen = 0;
    if (!h->n)
        return 0;
    if (p <= 0)
        p = 1e-9;
    if (p > 1)
        p = 1;
    rank = (uint64_t)(p * (double)h->n + 0.999999);
    if (rank < 1)
        rank = 1;
    for (unsigned i = 0; i < LATENCY_BUCKETS; i++) {
        seen += h->count[i];
        if (seen >= rank) {
            uint64_t top = i == LATENCY_BUCKETS - 1 ? h->max_us : bucket_top(i);
            return top < h->max_us ? top : h->max_us;
        }
    }
    return h->max_us;
}
