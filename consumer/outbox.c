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

/* A publish the broker refused (returned, nacked, or the channel closed on
 * it): counts an attempt, parks when due. IDEMQ_OK or IDEMQ_ERR_DB_CONN. */
static idemq_err_t refused(const struct outbox *o, const struct conf *c, PGconn *db,
                           const struct outbox_row *r, const char *error, bool park)
{
    struct ledger_db_error e = {{0}, {0}, false};
    bool parked = false;

    atomic_fetch_add(&outbox_stats.failed, 1);
    if (ledger_outbox_failed(db, o->holder, r->id, error, park, c->outbox_max_attempts,
                             NACK_RETRY_MS, &parked, &e)) {
        log_warn("outbox: row %lld was refused by the broker (%s) but that is not recorded: %s",
                 r->id, error, e.message);
        return e.conn_lost ? IDEMQ_ERR_DB_CONN : IDEMQ_OK;
    }
    if (parked) {
        atomic_fetch_add(&outbox_stats.parked, 1);
        log_warn("outbox: parked row %lld (key %s, exchange %s, routing key %s): %s", r->id,
                 r->key ? r->key : "-", r->exchange, r->routing_key, error);
    } else {
        log_info("outbox: row %lld refused (%s); tried again", r->id, error);
    }
    return IDEMQ_OK;
}

/* The first row not confirmed whose exchange the broker's channel.close
 * names as missing ("NOT_FOUND - no exchange 'x' ..."), or -1. */
static int missing_exchange_row(const struct outbox_rows *rows, const enum broker_confirm *st,
                                int published, const char *text)
{
    if (!strstr(text, "NOT_FOUND"))
        return -1;
    for (int i = 0; i < published; i++) {
        char want[300];
        if (st[i] != BROKER_CONFIRM_PENDING || !rows->row[i].exchange[0])
            continue;
        snprintf(want, sizeof want, "no exchange '%s'", rows->row[i].exchange);
        if (strstr(text, want))
            return i;
    }
    return -1;
}

/*
 * Publishes the claimed rows, all of them, then collects their confirms at
 * once (one round trip to the broker, one to PostgreSQL for the sent
 * marks). A claim holds at most one row per order key (the key's head, see
 * idemq.outbox_claim), so no two rows of a batch share an order key: one
 * refused row holds back nothing else of the batch, and the next row of
 * its key is claimed only once it is decided (sent, parked, or pending
 * again after NACK_RETRY_MS). Rows confirmed are marked sent in one
 * statement; returned ones are parked; nacked ones count an attempt; the
 * rest (not published, or not confirmed when the connection failed) are
 * given back.
 */
static idemq_err_t publish_rows(const struct outbox *o, const struct conf *c, PGconn *db,
                                struct broker *b, struct outbox_rows *rows, char *why,
                                size_t whylen)
{
    const char *mids[OUTBOX_CLAIM_MAX];
    enum broker_confirm st[OUTBOX_CLAIM_MAX];
    long long sent_ids[OUTBOX_CLAIM_MAX];
    double latency[OUTBOX_CLAIM_MAX];
    bool give[OUTBOX_CLAIM_MAX];
    struct ledger_db_error e = {{0}, {0}, false};
    int published = 0, n_sent = 0, bad = -1;
    idemq_err_t perr = IDEMQ_OK, werr = IDEMQ_OK;
    char text[512] = "";

    for (int i = 0; i < rows->n && i < OUTBOX_CLAIM_MAX; i++) {
        const struct outbox_row *r = &rows->row[i];
        json_t *h = row_headers(r);
        struct broker_props p = {r->message_id, NULL, h, true, NULL, NULL};

        if (!h) {
            perr = IDEMQ_ERR_NOMEM;
            snprintf(text, sizeof text, "outbox: out of memory");
            break;
        }
        perr = broker_publish(b, r->exchange, r->routing_key, r->body, r->body_len, &p);
        json_decref(h);
        if (perr) {
            snprintf(text, sizeof text, "%s", broker_error(b));
            break;
        }
        mids[published++] = r->message_id;
    }
    for (int i = 0; i < OUTBOX_CLAIM_MAX; i++)
        st[i] = BROKER_CONFIRM_PENDING;
    if (published) {
        werr = broker_wait_confirms_each(b, CONFIRM_MS, mids, st, (size_t)published);
        if (werr && !text[0])
            snprintf(text, sizeof text, "%s", broker_error(b));
    }
#ifdef IDEMQ_TEST_HOOKS
    {
        const char *crash = getenv("IDEMQ_TEST_CRASH");
        if (crash && strcmp(crash, "outbox_after_confirm") == 0 && published &&
            st[0] == BROKER_CONFIRM_ACKED) {
            log_warn("test hook: SIGKILL after the outbox confirm, before marking sent");
            kill(getpid(), SIGKILL);
        }
    }
#endif
    for (int i = 0; i < published; i++)
        if (st[i] == BROKER_CONFIRM_ACKED)
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
    for (int i = 0; i < published; i++) {
        const struct outbox_row *r = &rows->row[i];
        char err[600];
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
    /* the channel or connection failed: a publish to a missing exchange
     * counts an attempt (the broker closed the channel on it), the rest not
     * confirmed goes back */
    if (werr == IDEMQ_ERR_BROKER && (bad = missing_exchange_row(rows, st, published, text)) >= 0)
        if (refused(o, c, db, &rows->row[bad], text, false))
            return IDEMQ_ERR_DB_CONN;
    for (int i = 0; i < rows->n && i < OUTBOX_CLAIM_MAX; i++)
        give[i] = i != bad && (i >= published || st[i] == BROKER_CONFIRM_PENDING);
    snprintf(why, whylen, "outbox: publish failed: %s", text);
    if (give_back(o, db, rows, give, text))
        return IDEMQ_ERR_DB_CONN;
    if (perr == IDEMQ_ERR_NOMEM && !werr)
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
