/*
 * outbox: the relay of idemq.outbox rows (see outbox.h).
 */
#include "outbox.h"

#include <jansson.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "ledger_outbox.h"
#include "log.h"

#define CONFIRM_MS 10000 /* well inside the heartbeat window and any lease */
#define NACK_RETRY_MS 1000 /* a nacked row is tried again after this */

struct outbox_stats outbox_stats;
/* CLOCK_MONOTONIC ms until which a row refused in this process waits for
 * its next attempt (outbox_retry_pending) */
static atomic_llong retry_until_ms;
const double outbox_latency_bounds_ms[6] = {5, 10, 25, 50, 100, 500};

static long long now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

void outbox_init(struct outbox *o, int worker_id)
{
    char host[64] = "";
    if (gethostname(host, sizeof host - 1) != 0)
        snprintf(host, sizeof host, "unknown");
    snprintf(o->holder, sizeof o->holder, "%s:%ld:w%d", host, (long)getpid(), worker_id);
    o->next_poll_ms = 0;
}

static void note_latency(double ms)
{
    if (ms < 0)
        return;
    atomic_fetch_add(&outbox_stats.latency_count, 1);
    atomic_fetch_add(&outbox_stats.latency_us_sum, (long long)(ms * 1000));
    for (int i = 0; i < 6; i++)
        if (ms <= outbox_latency_bounds_ms[i])
            atomic_fetch_add(&outbox_stats.latency_le[i], 1);
}

/* Properties of a row's message: its headers plus x-idemq-key and
 * x-idemq-outbox-id. NULL when out of memory. */
static json_t *row_headers(const struct outbox_row *r)
{
    json_t *h = NULL;
    if (r->headers)
        h = json_loads(r->headers, JSON_DECODE_ANY, NULL);
    if (!json_is_object(h)) {
        json_decref(h);
        h = json_object();
    }
    if (!h)
        return NULL;
    if (r->key)
        json_object_set_new(h, "x-idemq-key", json_string(r->key));
    json_object_set_new(h, "x-idemq-outbox-id", json_integer((json_int_t)r->id));
    return h;
}

/* Gives back the rows of rows->row whose give[i] is set: not published,
 * or not known to be confirmed. */
static idemq_err_t give_back(const struct outbox *o, PGconn *db, struct outbox_rows *rows,
                             const bool *give, const char *error)
{
    struct ledger_db_error e = {{0}, {0}, false};
    long long ids[OUTBOX_CLAIM_MAX];
    int n = 0;
    for (int i = 0; i < rows->n && n < OUTBOX_CLAIM_MAX; i++)
        if (give[i])
            ids[n++] = rows->row[i].id;
    if (n && ledger_outbox_release(db, o->holder, ids, n, error, &e)) {
        log_warn("outbox: cannot give back %d rows (%s); they are published again once their "
                 "lease passed", n, e.message);
        return e.conn_lost ? IDEMQ_ERR_DB_CONN : IDEMQ_OK;
    }
    return IDEMQ_OK;
}

/* A publish the broker refused (returned, nacked, or the side channel
 * closed on it) or the client cannot encode: counts an attempt on r, parks
 * it when park or when due. IDEMQ_OK or IDEMQ_ERR_DB_CONN. */
static idemq_err_t refused(const struct outbox *o, const struct conf *c, PGconn *db,
                           const struct outbox_row *r, const char *error, bool park)
{
    struct ledger_db_error e = {{0}, {0}, false};
    bool parked = false;

    atomic_fetch_add(&outbox_stats.failed, 1);
    if (ledger_outbox_failed(db, o->holder, r->id, error, park, c->outbox_max_attempts,
                             NACK_RETRY_MS, &parked, &e)) {
        log_warn("outbox: row %lld was refused (%s) but that is not recorded: %s", r->id, error,
                 e.message);
        return e.conn_lost ? IDEMQ_ERR_DB_CONN : IDEMQ_OK;
    }
    if (parked) {
        atomic_fetch_add(&outbox_stats.parked, 1);
        log_warn("outbox: parked row %lld (key %s, exchange '%s', routing key %.80s): %s", r->id,
                 r->key ? r->key : "-", r->exchange, r->routing_key, error);
    } else {
        long long until = now_ms() + NACK_RETRY_MS + c->outbox_poll_ms;
        log_info("outbox: row %lld refused: %s; tried again", r->id, error);
        if (until > atomic_load(&retry_until_ms))
            atomic_store(&retry_until_ms, until);
    }
    return IDEMQ_OK;
}

bool outbox_retry_pending(void) { return now_ms() < atomic_load(&retry_until_ms); }

/* Publishes row r on the side channel (see publish_rows). */
static idemq_err_t publish_row(struct broker *b, const struct outbox_row *r)
{
    json_t *h = row_headers(r);
    struct broker_props p = {r->message_id, NULL, h, true, NULL, NULL};
    idemq_err_t err;
    if (!h)
        return IDEMQ_ERR_NOMEM;
    err = broker_side_publish(b, r->exchange, r->routing_key, r->body, r->body_len, &p, true);
    json_decref(h);
    return err;
}

/* The broker closed the side channel (a refusal), the connection is fine. */
static bool side_refused(struct broker *b, idemq_err_t err)
{
    return err == IDEMQ_ERR_BROKER && broker_readable(b);
}

/* After the side channel was closed under a batch: publishes the rows
 * idx[0..published) whose st is still PENDING one at a time, each
 * confirmed before the next, so the row the broker refuses is known: it
 * counts an attempt (done set) and the next one goes on a new side
 * channel. A row the broker took before the close may go out twice (same
 * message_id). Sets st[] of the others; IDEMQ_OK, IDEMQ_ERR_DB_CONN,
 * IDEMQ_ERR_TIMEOUT, IDEMQ_ERR_NOMEM or IDEMQ_ERR_BROKER (the connection
 * failed; the rest stays PENDING), text set on failure. */
static idemq_err_t one_by_one(const struct outbox *o, const struct conf *c, PGconn *db,
                              struct broker *b, const struct outbox_rows *rows, const int *idx,
                              int published, enum broker_confirm *st, bool *done, char *text,
                              size_t textlen)
{
    for (int k = 0; k < published; k++) {
        int i = idx[k];
        const struct outbox_row *r = &rows->row[i];
        const char *mid = r->message_id;
        enum broker_confirm one = BROKER_CONFIRM_PENDING;
        idemq_err_t err;
        if (st[i] != BROKER_CONFIRM_PENDING)
            continue;
        err = publish_row(b, r);
        if (!err)
            err = broker_side_wait_confirms_each(b, CONFIRM_MS, &mid, &one, 1);
        if (side_refused(b, err) && one == BROKER_CONFIRM_PENDING) {
            char why[600];
            snprintf(why, sizeof why, "%s (exchange '%s')", broker_error(b), r->exchange);
            done[i] = true;
            if (refused(o, c, db, r, why, false))
                return IDEMQ_ERR_DB_CONN;
            continue;
        }
        st[i] = one;
        if (err) {
            snprintf(text, textlen, "%s", broker_error(b));
            return err == IDEMQ_ERR_NOMEM || err == IDEMQ_ERR_TIMEOUT ? err : IDEMQ_ERR_BROKER;
        }
    }
    return IDEMQ_OK;
}

/*
 * Publishes the claimed rows, all of them, on the broker's side channel,
 * then collects their confirms at once (one round trip to the broker, one
 * to PostgreSQL for the sent marks). A claim holds at most one row per
 * order key (the key's head, see idemq.outbox_claim), so no two rows of a
 * batch share an order key: one refused row holds back nothing else of the
 * batch, and the next row of its key is claimed only once it is decided
 * (sent, parked, or pending again after NACK_RETRY_MS).
 *
 * Every outcome of a row: its sealed body cannot be opened (its key is not
 * listed, or the copy was altered) -> not published, logged and counted,
 * left under its lease (claimed again once it passed: the order key's
 * later rows wait behind it); confirmed -> marked sent (in one statement);
 * returned -> parked; nacked -> an attempt; one the client cannot encode
 * -> parked at once (it never could be sent); the side channel closed by
 * the broker (403, 404, 406, ...) -> the rows it did not confirm are
 * published again one at a time to find the refused one, which counts an
 * attempt; a confirm timeout -> the rows not confirmed are given back (the
 * side channel is closed, the worker's connection stays); the connection
 * lost -> the rest is given back and the worker reconnects.
 */
static idemq_err_t publish_rows(const struct outbox *o, const struct conf *c, PGconn *db,
                                struct broker *b, struct outbox_rows *rows, char *why,
                                size_t whylen)
{
    const char *mids[OUTBOX_CLAIM_MAX];
    int idx[OUTBOX_CLAIM_MAX]; /* row of the k-th publish */
    enum broker_confirm pst[OUTBOX_CLAIM_MAX], st[OUTBOX_CLAIM_MAX];
    long long sent_ids[OUTBOX_CLAIM_MAX] = {0}; /* gcc cannot see n_sent bound it */
    double latency[OUTBOX_CLAIM_MAX];
    bool give[OUTBOX_CLAIM_MAX], done[OUTBOX_CLAIM_MAX];
    struct ledger_db_error e = {{0}, {0}, false};
    int n = rows->n < OUTBOX_CLAIM_MAX ? rows->n : OUTBOX_CLAIM_MAX;
    int published = 0, n_sent = 0;
    idemq_err_t perr = IDEMQ_OK, werr = IDEMQ_OK;
    char text[512] = "";

    for (int i = 0; i < n; i++) {
        st[i] = BROKER_CONFIRM_PENDING;
        done[i] = false;
    }
    for (int i = 0; i < n; i++) {
        const struct outbox_row *r = &rows->row[i];
        if (r->unopened) { /* never published empty or garbled, never dropped */
            done[i] = true;
            atomic_fetch_add(&outbox_stats.unopened, 1);
            log_error("outbox: row %lld (key %s) is sealed with key \"%s\" and cannot be opened "
                      "(%s): not published; it stays pending and is tried again once its lease "
                      "passed; list the key in protection.keys",
                      r->id, r->key ? r->key : "-", r->body_key, r->unopened);
            continue;
        }
        perr = publish_row(b, r);
        if (perr == IDEMQ_ERR_UNPUBLISHABLE) { /* nothing was written: the channel is fine */
            done[i] = true;
            if (refused(o, c, db, r, broker_error(b), true))
                return IDEMQ_ERR_DB_CONN;
            perr = IDEMQ_OK;
            continue;
        }
        if (perr) {
            snprintf(text, sizeof text, "%s", perr == IDEMQ_ERR_NOMEM ? "outbox: out of memory"
                                                                    : broker_error(b));
            break;
        }
        idx[published] = i;
        mids[published++] = r->message_id;
    }
    if (published) {
        werr = broker_side_wait_confirms_each(b, CONFIRM_MS, mids, pst, (size_t)published);
        for (int k = 0; k < published; k++)
            st[idx[k]] = pst[k];
        if (werr && !text[0])
            snprintf(text, sizeof text, "%s", broker_error(b));
    }
#ifdef IDEMQ_TEST_HOOKS
    {
        const char *crash = getenv("IDEMQ_TEST_CRASH");
        if (crash && strcmp(crash, "outbox_after_confirm") == 0 && published &&
            st[idx[0]] == BROKER_CONFIRM_ACKED) {
            log_warn("test hook: SIGKILL after the outbox confirm, before marking sent");
            kill(getpid(), SIGKILL);
        }
    }
#endif
    /* the broker closed the side channel on one of them: find it */
    if (side_refused(b, werr)) {
        log_info("outbox: %s; the rows not confirmed go again one at a time", text);
        werr = one_by_one(o, c, db, b, rows, idx, published, st, done, text, sizeof text);
        if (werr == IDEMQ_ERR_DB_CONN)
            return IDEMQ_ERR_DB_CONN;
    }
    for (int i = 0; i < n; i++)
        if (!done[i] && st[i] == BROKER_CONFIRM_ACKED)
            sent_ids[n_sent++] = rows->row[i].id;
    if (ledger_outbox_sent(db, o->holder, sent_ids, n_sent, latency, &e)) {
        snprintf(why, whylen, "outbox: %d rows confirmed but not marked sent: %s", n_sent,
                 e.message);
        if (e.conn_lost)
            return IDEMQ_ERR_DB_CONN; /* published again after their lease */
        log_warn("%s", why);
    } else {
        for (int i = 0; i < n_sent; i++)
            if (latency[i] >= 0) {
                atomic_fetch_add(&outbox_stats.relayed, 1);
                note_latency(latency[i]);
            }
    }
    for (int i = 0; i < n; i++) {
        const struct outbox_row *r = &rows->row[i];
        char err[600];
        if (done[i])
            continue;
        if (st[i] == BROKER_CONFIRM_RETURNED) {
            snprintf(err, sizeof err,
                     "message returned as unroutable: 312 NO_ROUTE (exchange '%s', routing key %s)",
                     r->exchange, r->routing_key);
            if (refused(o, c, db, r, err, true))
                return IDEMQ_ERR_DB_CONN;
        } else if (st[i] == BROKER_CONFIRM_NACKED) {
            snprintf(err, sizeof err, "broker nacked the publish (exchange '%s', routing key %s)",
                     r->exchange, r->routing_key);
            if (refused(o, c, db, r, err, false))
                return IDEMQ_ERR_DB_CONN;
        }
    }
    if (!perr && !werr)
        return IDEMQ_OK;
    /* not published, or not known to be confirmed: given back */
    for (int i = 0; i < n; i++)
        give[i] = !done[i] && st[i] == BROKER_CONFIRM_PENDING;
    snprintf(why, whylen, "outbox: publish failed: %s", text);
    if (give_back(o, db, rows, give, text))
        return IDEMQ_ERR_DB_CONN;
    if (werr == IDEMQ_ERR_TIMEOUT)
        return IDEMQ_ERR_TIMEOUT; /* the side channel is closed; the connection stays */
    if (werr == IDEMQ_ERR_NOMEM || (perr == IDEMQ_ERR_NOMEM && !werr))
        return IDEMQ_ERR_NOMEM;
    return IDEMQ_ERR_BROKER;
}

idemq_err_t outbox_relay(struct outbox *o, const struct conf *c, PGconn *db, struct broker *b,
                         bool *more, char *why, size_t whylen)
{
    *more = false;
    if (!c->outbox_relay || !db || !b)
        return IDEMQ_OK;
    for (int round = 0; round < OUTBOX_ROUNDS; round++) {
        struct outbox_rows rows;
        struct ledger_db_error e = {{0}, {0}, false};
        idemq_err_t err;

        if ((err = ledger_outbox_claim(db, o->holder, OUTBOX_CLAIM_MAX,
                                       c->outbox_lease_s * 1000, &rows, &e))) {
            snprintf(why, whylen, "outbox: claim failed: %s", e.message);
            if (err == IDEMQ_ERR_DB_CONN)
                return err;
            log_warn("%s", why);
            return IDEMQ_OK;
        }
        if (rows.n == 0) {
            ledger_outbox_rows_free(&rows);
            return IDEMQ_OK;
        }
        err = publish_rows(o, c, db, b, &rows, why, whylen);
        ledger_outbox_rows_free(&rows);
        if (err == IDEMQ_ERR_TIMEOUT) { /* given back; the next poll tries again */
            log_warn("%s", why);
            return IDEMQ_OK;
        }
        if (err)
            return err;
    }
    *more = true;
    return IDEMQ_OK;
}

idemq_err_t outbox_publish_taken(struct outbox *o, const struct conf *c, PGconn *db,
                                 struct broker *b, struct outbox_rows *rows, char *why,
                                 size_t whylen)
{
    idemq_err_t err = IDEMQ_OK;
    if (rows->n > 0 && c->outbox_relay && db && b)
        err = publish_rows(o, c, db, b, rows, why, whylen);
    ledger_outbox_rows_free(rows);
    if (err == IDEMQ_ERR_TIMEOUT) { /* given back: the recovery poll takes them */
        log_warn("%s", why);
        return IDEMQ_OK;
    }
    return err;
}

idemq_err_t outbox_tick(struct outbox *o, const struct conf *c, PGconn *db, struct broker *b,
                        char *why, size_t whylen)
{
    long long now = now_ms();
    bool more = false;
    idemq_err_t err;

    if (!c->outbox_relay || now < o->next_poll_ms)
        return IDEMQ_OK;
    err = outbox_relay(o, c, db, b, &more, why, whylen);
    o->next_poll_ms = more ? now : now + c->outbox_poll_ms;
    return err;
}
