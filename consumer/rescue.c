/*
 * rescue: one rescuer pass between batches: take the due retry copies
 * (ledger_rescue), publish each to its work queue, wait for the confirms,
 * record, commit.
 */
#include "rescue.h"

#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "broker_admin.h"
#include "ledger_rescue.h"
#include "log.h"
#include "republish.h"
#include "topology.h"

#define CONFIRM_MS 10000 /* well inside the heartbeat window */

static long long now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* Pass interval: a tenth of rescue_after, between 1 and 30 s, plus up to a
 * quarter of it at random (so replicas' passes spread out). */
static long long interval_ms(struct rescue *r, const struct conf *c)
{
    long long base = (long long)c->rescue_after_s * 100;
    if (base < 1000)
        base = 1000;
    if (base > 30000)
        base = 30000;
    if (!r->rng)
        r->rng = (uint64_t)now_ms() * 0x9E3779B97F4A7C15ull | 1;
    r->rng ^= r->rng << 13;
    r->rng ^= r->rng >> 7;
    r->rng ^= r->rng << 17;
    return base + (long long)(r->rng % (uint64_t)(base / 4 + 1));
}

/* Publishes one copy again: through the input's delay exchange into its
 * shortest bucket, which dead-letters it to the work queue itself (a
 * fanout work exchange cannot copy it elsewhere), with the retry's headers
 * (origin, attempt) and x-idemq-rescued. Not through the default exchange:
 * write on amq.default would let the run user publish into any queue of
 * the vhost (consumer/OPERATIONS.md "Roles and permissions"). Confirm pending. */
static idemq_err_t publish_copy(struct broker *b, const struct conf *c,
                                const struct ledger_rescue_copy *x)
{
    const struct conf_input *in = &c->inputs[x->job.input];
    json_t *h = republish_delay_headers(&x->job, in, x->attempt);
    char ex[TOPOLOGY_NAME_MAX], key[32], ttl[32];
    struct broker_props p = {NULL, NULL, h, true, ttl, x->job.props};
    idemq_err_t err;

    if (!h || json_object_set_new(h, "x-idemq-rescued", json_true())) {
        json_decref(h);
        return IDEMQ_ERR_NOMEM;
    }
    topology_delay_exchange(in, ex, sizeof ex);
    snprintf(key, sizeof key, "%ld", topology_bucket(TOPOLOGY_MIN_DELAY_MS));
    snprintf(ttl, sizeof ttl, "%ld", TOPOLOGY_MIN_DELAY_MS);
    err = broker_publish(b, ex, key, x->job.body, x->job.body_len, &p);
    json_decref(h);
    return err;
}

/*
 * Which standard inputs to rescue in this pass: those whose work queue holds
 * at most one batch of ready messages. A retry copy that came back to a
 * queue with a backlog waits at its tail, maybe longer than rescue_after_s;
 * publishing it again then only adds to the backlog (the full chaos run,
 * publishing flat out, made 72,710 such needless rescues before this gate).
 * Once the backlog drains, a copy still missing is not in the queue. The
 * passive declare runs on the consuming channel; librabbitmq-c keeps the
 * deliveries that arrive meanwhile for the next read. RabbitMQ 3.10 answers
 * a quorum queue's count as 0 messages and 0 consumers when its leader does
 * not reply within 250 ms (rabbit_quorum_queue:stat/2), which let 291
 * rescues through during a backlog in a full chaos run; this worker consumes
 * the queue, so a true answer counts at least one consumer, and an answer
 * with none is taken as unknown: no rescue of that queue in this pass.
 * false when the broker failed (why set).
 */
static bool pick_queues(struct broker *b, const struct conf *c, bool *include, char *why,
                        size_t whylen)
{
    for (int i = 0; i < c->n_inputs; i++) {
        uint32_t ready = 0, consumers = 0;
        include[i] = false;
        if (CONF_INPUT_ORDERED(&c->inputs[i]))
            continue;
        if (broker_admin_queue_counts(b, c->inputs[i].queue, &ready, &consumers) != IDEMQ_OK) {
            snprintf(why, whylen, "rescue: cannot count queue %s: %s", c->inputs[i].queue,
                     broker_error(b));
            return false;
        }
        include[i] = consumers > 0 && ready <= (uint32_t)c->batch_max;
        if (!include[i])
            log_debug("rescue: queue %s holds %u ready messages (%u consumers): no rescue "
                      "while a backlog may stand", c->inputs[i].queue, ready, consumers);
    }
    return true;
}

/*
 * Moves the copies whose sealed body cannot be opened (their key no longer
 * listed in protection.keys, or the copy altered) behind the others, each
 * reported (never published empty, never dropped: the copy stays in the
 * ledger and the next pass tries again, so listing the key again rescues
 * it). Returns how many can be published, now copies[0..that).
 */
static int set_aside_unopened(struct rescue *r, struct ledger_rescue_copy *copies, int n)
{
    int k = 0;
    for (int i = 0; i < n; i++) {
        if (copies[i].unopened) {
            log_job(LOG_LVL_ERROR, copies[i].job.key, 0, copies[i].attempt,
                    "the ledger's retry copy is sealed with key \"%s\" and cannot be opened "
                    "(%s): not published again; it stays in the ledger until the key is "
                    "listed in protection.keys", copies[i].body_key, copies[i].unopened);
            r->unopened++;
            continue;
        }
        if (i != k) {
            struct ledger_rescue_copy t = copies[k];
            copies[k] = copies[i];
            copies[i] = t;
        }
        k++;
    }
    return k;
}

idemq_err_t rescue_tick(struct rescue *r, const struct conf *c, PGconn *db, struct broker *b,
                        char *why, size_t whylen)
{
    struct ledger_rescue_copy *copies = NULL;
    struct ledger_db_error e;
    idemq_err_t err = IDEMQ_OK;
    bool commit = false;
    bool *include = NULL;
    int n = 0, recorded = 0;
    long long now = now_ms();

    if (c->rescue_after_s <= 0 || !db || !b || now < r->next_ms)
        return IDEMQ_OK;
    r->next_ms = now + interval_ms(r, c);
    if (!(include = calloc((size_t)c->n_inputs, sizeof *include))) {
        log_warn("rescue: out of memory; trying again in the next pass");
        return IDEMQ_OK;
    }
    if (!pick_queues(b, c, include, why, whylen)) {
        free(include);
        return IDEMQ_ERR_BROKER; /* the channel was reopened without its consumers */
    }
    if (!(copies = calloc(RESCUE_MAX_PER_PASS, sizeof *copies))) {
        log_warn("rescue: out of memory; trying again in the next pass");
        free(include);
        return IDEMQ_OK;
    }
    for (int i = 0; i < RESCUE_MAX_PER_PASS; i++)
        job_init(&copies[i].job);
    /* With no queue to rescue the pass still runs: it cleans up old copies. */
    if ((err = ledger_rescue_take(db, c, include, copies, RESCUE_MAX_PER_PASS, &n, &e)) !=
        IDEMQ_OK)
        goto db_failed;
    n = set_aside_unopened(r, copies, n);
    for (int i = 0; i < n; i++) {
        if ((err = publish_copy(b, c, &copies[i])) != IDEMQ_OK) {
            snprintf(why, whylen, "rescue: republish of %s failed: %s", copies[i].job.key,
                     broker_error(b));
            err = IDEMQ_ERR_BROKER;
            goto out;
        }
    }
    if (n && broker_wait_confirms(b, CONFIRM_MS) != IDEMQ_OK) {
        snprintf(why, whylen, "rescue: republish of %d retry copies not confirmed: %s", n,
                 broker_error(b));
        err = IDEMQ_ERR_BROKER;
        goto out;
    }
    if (n && (err = ledger_rescue_record(db, c, copies, n, &recorded, &e)) != IDEMQ_OK)
        goto db_failed;
    commit = true;
    if ((err = ledger_rescue_finish(db, true, &e)) != IDEMQ_OK) {
        commit = false;
        if (n)
            log_warn("rescue: %d retry copies published again but not recorded (%s %s); a "
                     "later pass may publish them once more", n, e.sqlstate, e.message);
        goto db_failed;
    }
    for (int i = 0; i < n; i++)
        log_job(LOG_LVL_WARN, copies[i].job.key, 0, copies[i].attempt,
                "no copy of this retry came back %d s after its retry time (%s): published "
                "the ledger's copy again to %s",
                c->rescue_after_s, copies[i].run_after, c->inputs[copies[i].job.input].queue);
    r->rescued += recorded;
    goto out;
db_failed:
    if (err == IDEMQ_ERR_DB_CONN) {
        snprintf(why, whylen, "rescue: %s", e.message);
    } else {
        /* A statement failed (e.g. a lock or statement timeout): the next
         * pass tries again; nothing was recorded. */
        log_warn("rescue: pass failed: %s %s; trying again in the next pass", e.sqlstate,
                 e.message);
        err = IDEMQ_OK;
    }
out:
    if (!commit) {
        struct ledger_db_error ignored;
        if (ledger_rescue_finish(db, false, &ignored) != IDEMQ_OK)
            log_debug("rescue: rollback failed");
    }
    for (int i = 0; i < RESCUE_MAX_PER_PASS; i++)
        job_destroy(&copies[i].job);
    free(copies);
    free(include);
    return err;
}
