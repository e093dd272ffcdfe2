/*
 * backoff: the retry delay calculator (exponential, capped, jittered).
 */
#include "backoff.h"

#include <string.h>

int backoff_jitter_parse(const char *s)
{
    if (strcmp(s, "none") == 0)
        return BACKOFF_JITTER_NONE;
    if (strcmp(s, "full") == 0)
        return BACKOFF_JITTER_FULL;
    if (strcmp(s, "equal") == 0)
        return BACKOFF_JITTER_EQUAL;
    return -1;
}

uint64_t backoff_rand(uint64_t *rng)
{
    uint64_t x = *rng ? *rng : 0x9E3779B97F4A7C15ull;
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    *rng = x;
    return x * 0x2545F4914F6CDD1Dull;
}

long backoff_delay_ms(int n, long base_ms, long max_ms, enum backoff_jitter jitter,
                      uint64_t *rng)
{
    long d = base_ms;
    if (n < 1)
        n = 1;
    for (int i = 1; i < n && d < max_ms; i++)
        d = d > max_ms / 2 ? max_ms : d * 2;
    if (d > max_ms)
        d = max_ms;
    switch (jitter) {
    case BACKOFF_JITTER_NONE:
        return d;
    case BACKOFF_JITTER_FULL:
        return (long)(backoff_rand(rng) % (uint64_t)(d + 1));
    case BACKOFF_JITTER_EQUAL:
        return d / 2 + (long)(backoff_rand(rng) % (uint64_t)(d - d / 2 + 1));
    }
    return d;
}
