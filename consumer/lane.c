/*
 * lane: per-lane FIFOs of held deliveries (struct job by value) with the
 * time each lane may go on.
 */
#include "lane.h"

#include <stdlib.h>
#include <string.h>

#include "log.h"

struct lane {
    struct job *q; /* held deliveries, oldest first */
    int n, cap;
    int putback;   /* insertion point of the current settle */
    long long not_before;
};

struct lane_set {
    const struct conf *c;
    int *first;    /* by input: index of its lane 0, or -1 */
    struct lane *lanes;
    int n;
};

struct lane_set *lane_set_new(const struct conf *c)
{
    struct lane_set *ls = calloc(1, sizeof *ls);
    int n = 0;
    if (!ls || !(ls->first = calloc((size_t)c->n_inputs, sizeof *ls->first)))
        goto fail;
    ls->c = c;
    for (int i = 0; i < c->n_inputs; i++) {
        ls->first[i] = CONF_INPUT_ORDERED(&c->inputs[i]) ? n : -1;
        n += c->inputs[i].partitions;
    }
    if (n && !(ls->lanes = calloc((size_t)n, sizeof *ls->lanes)))
        goto fail;
    ls->n = n;
    return ls;
fail:
    lane_set_free(ls);
    return NULL;
}

void lane_clear(struct lane_set *ls)
{
    for (int i = 0; ls && i < ls->n; i++) {
        for (int k = 0; k < ls->lanes[i].n; k++)
            job_destroy(&ls->lanes[i].q[k]);
        ls->lanes[i].n = 0;
        ls->lanes[i].putback = 0;
        ls->lanes[i].not_before = 0;
    }
}

void lane_set_free(struct lane_set *ls)
{
    if (!ls)
        return;
    lane_clear(ls);
    for (int i = 0; i < ls->n; i++)
        free(ls->lanes[i].q);
    free(ls->lanes);
    free(ls->first);
    free(ls);
}

static struct lane *lane_of(const struct lane_set *ls, const struct job *j)
{
    if (j->deferred_id > 0 || j->lane < 0 || j->input < 0 || j->input >= ls->c->n_inputs ||
        ls->first[j->input] < 0 || j->lane >= ls->c->inputs[j->input].partitions)
        return NULL;
    return &ls->lanes[ls->first[j->input] + j->lane];
}

bool lane_blocked(const struct lane_set *ls, const struct job *j, long long now_ms)
{
    const struct lane *l = lane_of(ls, j);
    return l && (l->n > 0 || l->not_before > now_ms);
}

static idemq_err_t insert(struct lane *l, struct job *j, int at)
{
    if (l->n == l->cap) {
        int cap = l->cap ? l->cap * 2 : 16;
        struct job *nq = realloc(l->q, (size_t)cap * sizeof *nq);
        if (!nq)
            return IDEMQ_ERR_NOMEM;
        l->q = nq;
        l->cap = cap;
    }
    memmove(&l->q[at + 1], &l->q[at], (size_t)(l->n - at) * sizeof *l->q);
    l->q[at] = *j; /* the lane owns its buffers now */
    l->n++;
    job_init(j);
    return IDEMQ_OK;
}

idemq_err_t lane_append(struct lane_set *ls, struct job *j)
{
    struct lane *l = lane_of(ls, j);
    if (!l)
        IDEMQ_PANIC("delivery tag %llu has no lane", (unsigned long long)j->tag);
    return insert(l, j, l->n);
}

void lane_settle_begin(struct lane_set *ls)
{
    for (int i = 0; i < ls->n; i++)
        ls->lanes[i].putback = 0;
}

idemq_err_t lane_putback(struct lane_set *ls, struct job *j, long long not_before_ms)
{
    struct lane *l = lane_of(ls, j);
    idemq_err_t err;
    if (!l)
        IDEMQ_PANIC("delivery tag %llu has no lane", (unsigned long long)j->tag);
    if ((err = insert(l, j, l->putback)) != IDEMQ_OK)
        return err;
    l->putback++;
    if (not_before_ms > l->not_before)
        l->not_before = not_before_ms;
    return IDEMQ_OK;
}

int lane_take_ready(struct lane_set *ls, struct job *dst, int max, long long now_ms)
{
    int n = 0;
    for (int i = 0; i < ls->n && n < max; i++) {
        struct lane *l = &ls->lanes[i];
        int k = 0;
        if (!l->n || l->not_before > now_ms)
            continue;
        while (k < l->n && n < max) {
            job_destroy(&dst[n]);
            dst[n++] = l->q[k++];
        }
        memmove(l->q, &l->q[k], (size_t)(l->n - k) * sizeof *l->q);
        l->n -= k;
    }
    return n;
}

long long lane_next_ready(const struct lane_set *ls)
{
    long long t = 0;
    for (int i = 0; i < ls->n; i++)
        if (ls->lanes[i].n && (!t || ls->lanes[i].not_before < t))
            t = ls->lanes[i].not_before ? ls->lanes[i].not_before : 1;
    return t;
}

int lane_held(const struct lane_set *ls)
{
    int n = 0;
    for (int i = 0; i < ls->n; i++)
        n += ls->lanes[i].n;
    return n;
}

uint64_t lane_min_tag(const struct lane_set *ls)
{
    uint64_t t = 0;
    for (int i = 0; i < ls->n; i++)
        for (int k = 0; k < ls->lanes[i].n; k++)
            if (!t || ls->lanes[i].q[k].tag < t)
                t = ls->lanes[i].q[k].tag;
    return t;
}
