/*
 * settle: carries out the plans of a committed batch on the broker (see
 * settle.h for the rules and the state table).
 */
#include "settle.h"

#include <stdio.h>
#include <string.h>

void settle_plan_clear(struct plan *p)
{
    json_decref(p->park);
    memset(p, 0, sizeof *p);
}

static bool republished(enum settle_how h) { return h == SETTLE_DELAY || h == SETTLE_DEAD; }

enum settle_result settle_batch(const struct settle_io *io, struct job *jobs,
                                const struct plan *plans, int n, char *why, size_t whylen)
{
    int pubs = 0;
    idemq_err_t err;

    /* 1. What needs no republish is settled now: acks wait for the flush,
     * rejects go at once (the broker dead-letters them). */
    for (int i = 0; i < n; i++) {
        if (!jobs[i].tag)
            continue; /* a job taken from the ledger: no delivery */
        if (plans[i].how == SETTLE_ACK)
            err = io->settle(io->ctx, jobs[i].tag);
        else if (plans[i].how == SETTLE_REJECT)
            err = io->reject(io->ctx, jobs[i].tag);
        else
            continue;
        if (err)
            goto failed;
    }
    /* 2. Republish, each mandatory and confirmed. A park of a job from the
     * ledger still gets its dead-letter copy. */
    for (int i = 0; i < n; i++) {
        if (plans[i].how == SETTLE_DELAY && jobs[i].tag)
            err = io->publish_delay(io->ctx, &jobs[i], plans[i].delay_ms, plans[i].attempt);
        else if (plans[i].how == SETTLE_DEAD)
            err = io->publish_dead(io->ctx, &jobs[i], plans[i].park);
        else
            continue;
        pubs++;
        if (err) {
            snprintf(why, whylen, "republish of delivery %llu failed",
                     (unsigned long long)jobs[i].tag);
            goto unconfirmed;
        }
    }
    /* 3. Republished deliveries are settled only when every confirm of the
     * batch arrived. */
    if (pubs && io->wait_confirms(io->ctx)) {
        snprintf(why, whylen, "republish not confirmed: originals left unacknowledged for "
                              "redelivery");
        goto unconfirmed;
    }
    for (int i = 0; i < n; i++)
        if (jobs[i].tag && republished(plans[i].how) && io->settle(io->ctx, jobs[i].tag))
            goto failed;
    if (io->flush(io->ctx))
        goto failed;
    return SETTLE_DONE;
unconfirmed:
    /* The settled ones are still acknowledged (their transaction committed);
     * the republished ones return to the queue with the connection. */
    if (io->flush(io->ctx))
        return SETTLE_BROKER_FAILED;
    return SETTLE_UNCONFIRMED;
failed:
    snprintf(why, whylen, "settling after commit failed");
    return SETTLE_BROKER_FAILED;
}
