/*
 * rate_gate: virtual scheduling. `tat` is the theoretical arrival time of
 * the next token: the moment the bucket is empty again if nothing else
 * arrives. A reservation of n starts at max(tat - burst interval, now) and
 * moves tat on by n intervals.
 */
#include "rate_gate.h"

#include <pthread.h>
#include <stdlib.h>

struct rate_gate {
    pthread_mutex_t mu;
    double interval_ns; /* 1e9 / rate */
    double burst_ns;    /* (burst - 1) intervals of tolerance */
    double tat;         /* ns; 0 = never used */
};

struct rate_gate *rate_gate_new(double rate, double burst)
{
    struct rate_gate *g;
    if (rate <= 0 || burst < 1 || !(g = calloc(1, sizeof *g)))
        return NULL;
    pthread_mutex_init(&g->mu, NULL);
    g->interval_ns = 1e9 / rate;
    g->burst_ns = (burst - 1) * g->interval_ns;
    return g;
}

void rate_gate_free(struct rate_gate *g)
{
    if (!g)
        return;
    pthread_mutex_destroy(&g->mu);
    free(g);
}

int64_t rate_gate_reserve(struct rate_gate *g, int n, int64_t now_ns)
{
    double now = (double)now_ns, start;
    int64_t wait;

    if (n < 1)
        return 0;
    pthread_mutex_lock(&g->mu);
    /* Tokens left unused while idle are lost beyond the burst. */
    if (g->tat < now - g->burst_ns)
        g->tat = now - g->burst_ns;
    start = g->tat;
    g->tat += (double)n * g->interval_ns;
    pthread_mutex_unlock(&g->mu);
    wait = start > now ? (int64_t)(start - now) : 0;
    return wait;
}
