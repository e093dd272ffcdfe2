/*
 * backoff: exponential backoff with jitter and a hard ceiling. Generic: no
 * daemon dependencies, pure apart from the caller's random state.
 */
#ifndef IDEMQ_BACKOFF_H
#define IDEMQ_BACKOFF_H

#include <stdint.h>

enum backoff_jitter {
    BACKOFF_JITTER_NONE = 0, /* base * 2^(n-1), capped */
    BACKOFF_JITTER_FULL,     /* uniform in [0, that] */
    BACKOFF_JITTER_EQUAL,    /* half of it plus uniform in [0, half] */
};

/* Parses "none", "full", "equal"; -1 otherwise. */
int backoff_jitter_parse(const char *s);

/*
 * Delay in ms before retry number n (n >= 1 is the first retry) with the
 * given base and ceiling (max_ms >= base_ms > 0). *rng is a caller-owned
 * xorshift state (any non-zero seed). Never exceeds max_ms.
 */
long backoff_delay_ms(int n, long base_ms, long max_ms, enum backoff_jitter jitter,
                      uint64_t *rng);

/* Next value of the xorshift64* generator in *rng. */
uint64_t backoff_rand(uint64_t *rng);

#endif
