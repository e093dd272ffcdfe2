/*
 * provider_flow: provider jobs from their first transaction to their
 * decision (see provider_flow.h). The ledger decides every step; this
 * module sends what it asks for and reports every answer back.
 */
#include "provider_flow.h"

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "effect_http.h"
#include "ledger_doc.h"
#include "ledger_provider.h"
#include "log.h"
#include "protect.h"
#include "trace_export.h"

#define POLL_BATCH 16
/* The lease of a request or lookup: provider.timeout_ms + this, from the
 * statement that took it (as ledger_provider_opts' lease_ms). */
#define LEASE_EXTRA_MS 5000
/* A request must be over this long before its lease ends: the time to
 * record its answer (transaction 2) while the lease still holds. */
#define LEASE_MARGIN_MS 2000
#define RESULT_TRIES 3 /* transaction 2's tries for one answer */

/* One job between start and decision. */
struct pf_job {
    struct pf_job *next;
    void *cookie;
    int input;
    bool queued; /* waiting for a free slot; transaction 1 not run yet */
    bool orphan; /* its delivery is gone (broker reconnect); cookie NULL; the
                  * call goes on and its answer is recorded, nothing settled */
    int lease;   /* the request or lookup in flight */
    long long step_ms; /* when the statement that gave the last step started */
    char key[CONF_KEY_MAX_BYTES + 1];
    char *doc;   /* one-job ledger document (key, queue, sha, meta, payload) */
    unsigned char *body; /* the raw message */
    size_t body_len;
    char body_sha[65];   /* its SHA-256, hex */
    char *props;         /* its properties, JSON */
    char *req;           /* the request body this copy would send */
    size_t req_len;
    char req_sha[65];
    long long redelivery_tag; /* for log lines: the delivery tag */
    const char *how;          /* how a confirmed reference was found (meta.provider.how) */
    struct trace_job trace;   /* the job's trace: each call is a span under its span */
};

struct provider_flow {
    const struct conf *c;
    int worker_id;
    struct effect_http *http;
    char **opts;          /* by input: ledger_provider_opts, NULL for other inputs */
    int *active;          /* by input: jobs holding a slot (transaction 1 ran) */
    struct pf_job *jobs;  /* started or queued, not decided */
    int n_jobs;
    struct provider_decision *ready; /* decided, not yet polled */
    int n_ready, cap_ready;
    bool crash_after_call; /* test hook: SIGKILL between an answer and transaction 2 */
    bool draining;         /* a stop: start nothing new (provider_flow_drain) */
};

static long long now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

const char *provider_flow_kind_name(enum provider_decision_kind k)
{
    switch (k) {
    case PROVIDER_FLOW_ACK: return "ack";
    case PROVIDER_FLOW_RETRY: return "retry";
    case PROVIDER_FLOW_WAIT: return "wait";
    case PROVIDER_FLOW_PARK: return "park";
    case PROVIDER_FLOW_FAIL: return "fail";
    }
    return "?";
}

void provider_flow_decision_clear(struct provider_decision *d)
{
    json_decref(d->park);
    memset(d, 0, sizeof *d);
}

static void job_free(struct pf_job *p)
{
    if (!p)
        return;
    free(p->doc);
    free(p->body);
    free(p->props);
    free(p->req);
    free(p);
}

struct provider_flow *provider_flow_new(const struct conf *c, int worker_id, char *errbuf,
                                        size_t errlen)
{
    struct provider_flow *f = calloc(1, sizeof *f);

    if (!f || !(f->opts = calloc((size_t)c->n_inputs, sizeof *f->opts)) ||
        !(f->active = calloc((size_t)c->n_inputs, sizeof *f->active))) {
        snprintf(errbuf, errlen, "out of memory");
        goto fail;
    }
    f->c = c;
    f->worker_id = worker_id;
    for (int i = 0; i < c->n_inputs; i++) {
        if (!CONF_INPUT_PROVIDER(&c->inputs[i]))
            continue;
        if (!(f->opts[i] = ledger_provider_opts(c, i))) {
            snprintf(errbuf, errlen, "out of memory");
            goto fail;
        }
    }
    if (effect_http_new(c, &f->http, errbuf, errlen) != IDEMQ_OK)
        goto fail;
#ifdef IDEMQ_TEST_HOOKS
    {
        const char *crash = getenv("IDEMQ_TEST_CRASH");
        f->crash_after_call = crash && strcmp(crash, "provider_after_call") == 0;
    }
#endif
    return f;
fail:
    provider_flow_free(f);
    return NULL;
}

void provider_flow_free(struct provider_flow *f)
{
    if (!f)
        return;
    provider_flow_abandon(f);
    for (int i = 0; i < f->n_ready; i++)
        provider_flow_decision_clear(&f->ready[i]);
    free(f->ready);
    effect_http_free(f->http);
    for (int i = 0; f->opts && i < f->c->n_inputs; i++)
        free(f->opts[i]);
    free(f->opts);
    free(f->active);
    free(f);
}

void provider_flow_abandon(struct provider_flow *f)
{
    char err[128];
    while (f->jobs) {
        struct pf_job *p = f->jobs;
        f->jobs = p->next;
        job_free(p);
    }
    f->n_jobs = 0;
    for (int i = 0; i < f->n_ready; i++) /* their deliveries are gone too */
        provider_flow_decision_clear(&f->ready[i]);
    f->n_ready = 0;
    for (int i = 0; i < f->c->n_inputs; i++)
        f->active[i] = 0;
    /* A new engine drops every request in flight (their answers with it). */
    effect_http_free(f->http);
    f->http = NULL;
    if (effect_http_new(f->c, &f->http, err, sizeof err) != IDEMQ_OK)
        log_error("worker %d: provider engine: %s", f->worker_id, err);
}

void provider_flow_detach(struct provider_flow *f)
{
    struct pf_job **pp = &f->jobs;
    for (int i = 0; i < f->n_ready; i++) /* decided: the redelivery finds what was recorded */
        provider_flow_decision_clear(&f->ready[i]);
    f->n_ready = 0;
    while (*pp) {
        struct pf_job *p = *pp;
        if (p->queued) { /* never claimed: nothing to keep */
            *pp = p->next;
            f->n_jobs--;
            job_free(p);
            continue;
        }
        p->orphan = true;
        p->cookie = NULL;
        pp = &p->next;
    }
}

void provider_flow_drain(struct provider_flow *f)
{
    struct pf_job **pp = &f->jobs;
    int dropped = 0;
    f->draining = true;
    while (*pp) {
        struct pf_job *p = *pp;
        if (p->queued) { /* never claimed: its delivery goes back to the broker */
            *pp = p->next;
            f->n_jobs--;
            job_free(p);
            dropped++;
            continue;
        }
        pp = &p->next;
    }
    if (dropped || f->n_jobs)
        log_info("worker %d: stopping: %d provider job(s) not started go back to the broker; "
                 "waiting for %d call(s) in flight", f->worker_id, dropped, f->n_jobs);
}

void provider_flow_pump(struct provider_flow *f)
{
    struct effect_http_result none;
    if (f->http)
        (void)effect_http_poll(f->http, 0, &none, 0); /* max 0: results stay queued */
}

int provider_flow_pending(const struct provider_flow *f) { return f->n_jobs + f->n_ready; }

/* Unlinks p from the job list. */
static void unlink_job(struct provider_flow *f, struct pf_job *p)
{
    for (struct pf_job **pp = &f->jobs; *pp; pp = &(*pp)->next) {
        if (*pp == p) {
            *pp = p->next;
            f->n_jobs--;
            return;
        }
    }
}

/* Queues the decision of job p and forgets the job. */
static void decide(struct provider_flow *f, struct pf_job *p, enum provider_decision_kind kind,
                   long delay_ms, int attempt, json_t *park, const char *outcome,
                   const char *reason)
{
    struct provider_decision *d;
    char shown_buf[CONF_KEY_MAX_BYTES + 1];
    const char *shown = shown_buf;
    if (f->n_ready == f->cap_ready) {
        int cap = f->cap_ready ? f->cap_ready * 2 : 16;
        struct provider_decision *nr = realloc(f->ready, sizeof *nr * (size_t)cap);
        if (!nr)
            IDEMQ_PANIC("out of memory queueing a provider decision"); /* reserved in start */
        f->ready = nr;
        f->cap_ready = cap;
    }
    d = &f->ready[f->n_ready++]; /* an orphan's too: poll drops it */
    memset(d, 0, sizeof *d);
    d->cookie = p->cookie;
    d->input = p->input;
    snprintf(d->key, sizeof d->key, "%s", p->key);
    d->kind = kind;
    d->delay_ms = delay_ms < 100 && (kind == PROVIDER_FLOW_RETRY || kind == PROVIDER_FLOW_WAIT)
                      ? 100
                      : delay_ms;
    d->attempt = attempt;
    d->park = park ? json_incref(park) : NULL;
    d->fail_class = kind == PROVIDER_FLOW_FAIL ? CLASS_INFRA : CLASS_NONE;
    snprintf(d->outcome, sizeof d->outcome, "%s", outcome);
    snprintf(d->reason, sizeof d->reason, "%s", reason ? reason : "");
    snprintf(shown_buf, sizeof shown_buf, "%s", p->key);
    for (char *c = shown_buf; *c; c++) /* a key can hold CR/LF: keep log lines whole */
        if ((unsigned char)*c < 0x20 || *c == 0x7f)
            *c = '?';
    log_job(kind == PROVIDER_FLOW_PARK || kind == PROVIDER_FLOW_FAIL ? LOG_LVL_WARN
                                                                      : LOG_LVL_INFO,
            shown, (unsigned long long)p->redelivery_tag, attempt,
            "provider: %s (%s)%s%s%s",
            provider_flow_kind_name(kind), outcome, reason && reason[0] ? ": " : "",
            reason ? reason : "",
            p->orphan ? " (its delivery is gone: a redelivery finds what was recorded)" : "");
    if (!p->queued && f->active[p->input] > 0)
        f->active[p->input]--;
    unlink_job(f, p);
    job_free(p);
}

/* A database failure of one of p's statements: nothing was committed. */
static void db_failed(struct provider_flow *f, struct pf_job *p, const char *what,
                      const struct ledger_db_error *e)
{
    enum classify_class cls = classify_sqlstate(e->sqlstate, e->conn_lost, &f->c->rules);
    char why[512];
    snprintf(why, sizeof why, "%s failed: %s %s", what, e->sqlstate, e->message);
    if (cls == CLASS_TRANSIENT) {
        /* Rolled back: the delivery comes back; a lease it took expires and
         * the ledger then looks the request up or resends it. */
        decide(f, p, PROVIDER_FLOW_RETRY, f->c->inputs[p->input].provider.timeout_ms + 5000, 0,
               NULL, "db_transient", why);
        return;
    }
    decide(f, p, PROVIDER_FLOW_FAIL, 0, 0, NULL, cls == CLASS_INFRA ? "db_lost" : "db_fatal",
           why);
    f->ready[f->n_ready - 1].fail_class = cls == CLASS_INFRA ? CLASS_INFRA : CLASS_FATAL;
}

static void act(struct provider_flow *f, PGconn *db, struct pf_job *p,
                struct ledger_provider_step *s);
static void effect_error(struct provider_flow *f, PGconn *db, struct pf_job *p,
                         struct ledger_provider_step *s);

/* Transaction 2b: the reference is committed; the local effect runs in a
 * statement of its own, so nothing it does (a statement timeout, an
 * ASSERT, a deadlock) can lose the reference. Such a failure of the whole
 * statement is the effect's error: a transient one retries only the
 * effect, no new request. */
static void run_confirmed(struct provider_flow *f, PGconn *db, struct pf_job *p,
                          struct ledger_provider_step *s)
{
    struct ledger_db_error e;
    struct ledger_provider_step next;

    if (s->message[0]) /* a second reference: an alarm */
        log_job(LOG_LVL_WARN, p->key, (unsigned long long)p->redelivery_tag, s->attempt,
                "provider: %s", s->message);
    memset(&next, 0, sizeof next);
    if (s->unopened) {
        /* never run on an empty or sealed message: a failed attempt of the
         * effect, retried, then parked; listing the key again lets it run */
        log_error("worker %d: %s: the message is sealed with key '%s' and cannot be opened "
                  "(%s): the local effect did not run", f->worker_id, p->key, s->body_key,
                  s->unopened);
        p->step_ms = now_ms();
        if (ledger_provider_unopened(db, p->key, s, f->opts[p->input], p->doc,
                                     f->c->consumer_id, &next, &e) != IDEMQ_OK) {
            db_failed(f, p, "provider_effect_failed", &e);
            return;
        }
        act(f, db, p, &next);
        ledger_provider_step_clear(&next);
        return;
    }
    if (ledger_provider_confirmed(db, p->key, p->how ? p->how : "local retry",
                                  f->opts[p->input], p->doc, f->c->consumer_id, s, &next,
                                  &e) != IDEMQ_OK) {
        if (classify_sqlstate(e.sqlstate, e.conn_lost, &f->c->rules) == CLASS_INFRA) {
            db_failed(f, p, "provider_confirmed", &e);
            return;
        }
        memset(&next, 0, sizeof next);
        next.action = LEDGER_PROVIDER_EFFECT_ERROR;
        next.attempt = s->attempt;
        snprintf(next.sqlstate, sizeof next.sqlstate, "%s", e.sqlstate);
        snprintf(next.message, sizeof next.message, "%s", e.message);
        effect_error(f, db, p, &next);
        return;
    }
    act(f, db, p, &next);
    ledger_provider_step_clear(&next);
}

static void answered(struct provider_flow *f, PGconn *db, struct effect_http_result *r);

/*
 * Sends the request or lookup the ledger asked for, bounded by its lease
 * (taken by the statement that started at p->step_ms): the transfer ends
 * LEASE_MARGIN_MS before the lease does, so a lease that ran out means no
 * request of it is in flight. When nothing can be sent (a stop is
 * draining, too little lease left, no memory), that is recorded at once as
 * the answer "not_sent" (transaction 2): the intent stays certain and the
 * ledger decides the next step, instead of a lease left to expire as an
 * unknown outcome.
 */
static void submit_step(struct provider_flow *f, PGconn *db, struct pf_job *p,
                        struct ledger_provider_step *s)
{
    struct effect_http_result r;
    char err[256];
    enum effect_http_op op = s->action == LEDGER_PROVIDER_CALL ? EFFECT_HTTP_CALL
                             : s->by_reference                 ? EFFECT_HTTP_LOOKUP_REF
                                                               : EFFECT_HTTP_LOOKUP_KEY;
    const char *body = s->body ? (const char *)s->body : p->req;
    size_t len = s->body ? s->body_len : p->req_len;
    long budget = (long)(p->step_ms + f->c->inputs[p->input].provider.timeout_ms +
                         LEASE_EXTRA_MS - LEASE_MARGIN_MS - now_ms());
    idemq_err_t rc;

    p->lease = s->lease;
    if (f->draining) {
        snprintf(err, sizeof err, "not sent: idemq is stopping");
        rc = IDEMQ_ERR_SHUTDOWN;
    } else if (op == EFFECT_HTTP_CALL && s->unopened) {
        /* Never sent empty or sealed: the ledger hears "not sent" and
         * retries, then parks; listing the key again lets it through. */
        snprintf(err, sizeof err, "not sent: the stored request body is sealed with key "
                 "'%s' and cannot be opened (%s)", s->body_key, s->unopened);
        log_error("worker %d: %s: %s", f->worker_id, p->key, err);
        rc = IDEMQ_ERR_CONFIG;
    } else {
        rc = effect_http_submit_within(f->http, p->input, op, p->key, body, len, p,
                                       budget < 0 ? 0 : budget, err, sizeof err);
    }
    if (rc == IDEMQ_OK)
        return;
    /* Nothing was sent: the ledger hears so now. */
    memset(&r, 0, sizeof r);
    r.cookie = p;
    r.input = p->input;
    r.op = op;
    r.cls = EFFECT_HTTP_NOT_SENT;
    r.retry_after_ms = -1;
    snprintf(r.detail, sizeof r.detail, "%s", err);
    answered(f, db, &r);
}

/* The local effect failed after the provider confirmed. */
static void effect_error(struct provider_flow *f, PGconn *db, struct pf_job *p,
                         struct ledger_provider_step *s)
{
    struct ledger_db_error e;
    struct ledger_provider_step next;
    enum classify_class cls = classify_sqlstate(s->sqlstate, false, &f->c->rules);
    char why[640];

    if (cls == CLASS_FATAL) {
        snprintf(why, sizeof why, "the effect of %s failed with %s %s (a deploy or "
                 "configuration problem; the provider reference is recorded)", p->key,
                 s->sqlstate, s->message);
        decide(f, p, PROVIDER_FLOW_FAIL, 0, s->attempt, NULL, "effect_fatal", why);
        f->ready[f->n_ready - 1].fail_class = CLASS_FATAL;
        return;
    }
    memset(&next, 0, sizeof next);
    p->step_ms = now_ms();
    if (ledger_provider_effect_failed(db, p->key,
                                      cls == CLASS_PERMANENT ? "permanent" : "transient",
                                      idemq_err_name(IDEMQ_ERR_EFFECT), s->sqlstate, s->message,
                                      f->opts[p->input], p->doc, f->c->consumer_id, &next,
                                      &e) != IDEMQ_OK) {
        db_failed(f, p, "provider_effect_failed", &e);
        return;
    }
    act(f, db, p, &next);
    ledger_provider_step_clear(&next);
}

/* Turns the ledger's step for p into a request or a decision. */
static void act(struct provider_flow *f, PGconn *db, struct pf_job *p,
                struct ledger_provider_step *s)
{
    switch (s->action) {
    case LEDGER_PROVIDER_CALL:
    case LEDGER_PROVIDER_LOOKUP:
        submit_step(f, db, p, s);
        return;
    case LEDGER_PROVIDER_APPLIED:
        decide(f, p, PROVIDER_FLOW_ACK, 0, s->attempt, NULL, "applied", s->message);
        return;
    case LEDGER_PROVIDER_DUPLICATE:
        decide(f, p, PROVIDER_FLOW_ACK, 0, s->attempt, NULL, "duplicate", s->message);
        return;
    case LEDGER_PROVIDER_WAIT:
        decide(f, p, PROVIDER_FLOW_WAIT, s->delay_ms, s->attempt, NULL, "wait", s->message);
        return;
    case LEDGER_PROVIDER_RETRY:
        decide(f, p, PROVIDER_FLOW_RETRY, s->delay_ms, s->attempt, NULL, "retry", s->message);
        return;
    case LEDGER_PROVIDER_PARK:
        decide(f, p, PROVIDER_FLOW_PARK, 0, s->attempt, s->park,
               json_string_value(json_object_get(s->park, "error_code"))
                   ? json_string_value(json_object_get(s->park, "error_code"))
                   : "parked",
               json_string_value(json_object_get(s->park, "reason")));
        return;
    case LEDGER_PROVIDER_EFFECT_ERROR:
        effect_error(f, db, p, s);
        return;
    case LEDGER_PROVIDER_CONFIRMED:
        run_confirmed(f, db, p, s);
        return;
    }
    IDEMQ_PANIC("unhandled provider step %d", (int)s->action);
}

/* Parks a message whose key cannot travel as a header (no job is claimed,
 * as for any undecodable message). */
static void park_refused(struct provider_flow *f, PGconn *db, struct pf_job *p,
                         idemq_err_t code, const char *reason)
{
    struct ledger_db_error e;
    json_t *meta = NULL, *doc;
    const char *vals[14];
    int lens[14] = {0}, fmts[14] = {0};
    char *headers = NULL, size[24];
    unsigned char *sealed = NULL;
    size_t sealed_len = 0;
    const char *key_id = NULL;
    idemq_err_t err;
    PGresult *r;

    /* sealed at rest like every park (protection.active), never stored in
     * the clear */
    if ((err = protect_seal_stored(p->body, p->body_len, &sealed, &sealed_len, &key_id)) !=
        IDEMQ_OK) {
        snprintf(e.sqlstate, sizeof e.sqlstate, "XX000");
        snprintf(e.message, sizeof e.message, "cannot seal the message: %s",
                 idemq_err_str(err));
        e.conn_lost = false;
        db_failed(f, p, "park_message", &e);
        return;
    }
    doc = json_loads(p->doc, 0, NULL);
    meta = json_object_get(json_array_get(doc, 0), "m");
    headers = json_dumps(json_object_get(meta, "headers"), JSON_COMPACT | JSON_ENCODE_ANY);
    vals[0] = p->key;
    vals[1] = f->c->inputs[p->input].queue;
    vals[2] = json_string_value(json_object_get(meta, "exchange"));
    vals[3] = json_string_value(json_object_get(meta, "routing_key"));
    vals[4] = sealed ? (const char *)sealed : (const char *)p->body;
    lens[4] = sealed ? (int)sealed_len : (int)p->body_len;
    fmts[4] = 1;
    vals[5] = headers;
    vals[6] = p->props;
    vals[7] = idemq_err_name(code);
    vals[8] = reason;
    vals[9] = f->c->consumer_id;
    snprintf(size, sizeof size, "%zu", p->body_len);
    vals[10] = p->body_sha; /* the whole message's, as held */
    vals[11] = size;
    vals[12] = "true";
    vals[13] = key_id; /* NULL: stored as sent */
    r = ledger_db_exec_params(db,
                              "SELECT idemq.park_message($1, $2, $3, $4, $5::bytea, $6::jsonb, "
                              "$7::jsonb, $8, $9, $10, $11, $12::bigint, $13::boolean, $14)",
                              14, NULL, vals, lens, fmts, 0);
    free(sealed);
    free(headers);
    json_decref(doc);
    if (PQresultStatus(r) != PGRES_TUPLES_OK) {
        ledger_db_error_from(db, r, &e);
        PQclear(r);
        db_failed(f, p, "park_message", &e);
        return;
    }
    {
        json_t *park = json_loads(PQgetvalue(r, 0, 0), 0, NULL);
        PQclear(r);
        decide(f, p, PROVIDER_FLOW_PARK, 0, 1, park, idemq_err_name(code), reason);
        json_decref(park);
    }
}

/* Transaction 1 for a job that has its slot. */
static void begin(struct provider_flow *f, PGconn *db, struct pf_job *p)
{
    struct ledger_db_error e;
    struct ledger_provider_step s;

    p->queued = false;
    f->active[p->input]++;
    if (effect_http_key_check(p->key) != IDEMQ_OK) {
        park_refused(f, db, p, IDEMQ_ERR_KEY_INVALID_HEADER,
                     "the key is not a valid Idempotency-Key header value (control "
                     "characters, CR/LF, non-ASCII bytes or blanks at an end): never sent");
        return;
    }
    memset(&s, 0, sizeof s);
    p->step_ms = now_ms();
    p->how = "local retry"; /* a reference recorded before this delivery */
    if (ledger_provider_begin(db, p->doc, f->opts[p->input], f->c->consumer_id, p->body,
                              p->body_len, p->props, p->req_sha, p->req, p->req_len, &s,
                              &e) != IDEMQ_OK) {
        db_failed(f, p, "provider_begin", &e);
        return;
    }
    act(f, db, p, &s);
    ledger_provider_step_clear(&s);
}

/* Runs transaction 1 for queued jobs whose input has a free slot. */
static void start_queued(struct provider_flow *f, PGconn *db)
{
    bool again = !f->draining;
    while (again) {
        again = false;
        for (struct pf_job *p = f->jobs; p; p = p->next) {
            if (!p->queued ||
                f->active[p->input] >= f->c->inputs[p->input].provider.max_in_flight)
                continue;
            begin(f, db, p); /* may free p: start over */
            again = true;
            break;
        }
    }
}

idemq_err_t provider_flow_start(struct provider_flow *f, PGconn *db, const struct job *j,
                                void *cookie)
{
    const struct conf_input *in;
    struct pf_job *p;
    struct ledger_doc d;
    idemq_err_t err;

    if (j->input < 0 || j->input >= f->c->n_inputs || !f->opts[j->input])
        return IDEMQ_ERR_CONFIG;
    if (!f->http) { /* lost in an abandon that could not make a new one */
        char why[256];
        if (effect_http_new(f->c, &f->http, why, sizeof why) != IDEMQ_OK) {
            log_error("worker %d: provider engine: %s", f->worker_id, why);
            return IDEMQ_ERR_NOMEM;
        }
    }
    in = &f->c->inputs[j->input];
    for (p = f->jobs; p; p = p->next) {
        /* The redelivery of a job whose call went on after a broker
         * reconnect: it takes the job over and settles with its answer. */
        if (p->orphan && p->input == j->input && strcmp(p->key, j->key) == 0 &&
            p->body_len == j->body_len && memcmp(p->body, j->body, j->body_len) == 0) {
            p->orphan = false;
            p->cookie = cookie;
            p->redelivery_tag = (long long)j->tag;
            log_job(LOG_LVL_INFO, p->key, (unsigned long long)j->tag, 0,
                    "provider: redelivered while its call %d is in flight: waits for it",
                    p->lease);
            return IDEMQ_OK;
        }
    }
    if (f->n_ready + f->n_jobs + 1 > f->cap_ready) { /* so decide() never allocates */
        int cap = f->cap_ready ? f->cap_ready * 2 : 16;
        struct provider_decision *nr = realloc(f->ready, sizeof *nr * (size_t)cap);
        if (!nr)
            return IDEMQ_ERR_NOMEM;
        f->ready = nr;
        f->cap_ready = cap;
    }
    if (!(p = calloc(1, sizeof *p)))
        return IDEMQ_ERR_NOMEM;
    p->cookie = cookie;
    p->input = j->input;
    p->queued = true;
    p->redelivery_tag = (long long)j->tag;
    p->trace = j->trace;
    snprintf(p->key, sizeof p->key, "%s", j->key);
    ledger_doc_init(&d);
    ledger_doc_begin(&d);
    ledger_doc_add_job(&d, j, in, j->input, false); /* provider inputs: no window check */
    if (!ledger_doc_end(&d)) {
        ledger_doc_free(&d);
        job_free(p);
        return IDEMQ_ERR_NOMEM;
    }
    p->doc = d.buf; /* taken from the document */
    p->props = json_dumps(j->props, JSON_COMPACT);
    p->body = malloc(j->body_len ? j->body_len : 1);
    err = effect_http_build_body(in, j->key, j->body, j->body_len, &p->req, &p->req_len);
    if (!p->props || !p->body || err == IDEMQ_ERR_NOMEM) {
        job_free(p);
        return IDEMQ_ERR_NOMEM;
    }
    memcpy(p->body, j->body, j->body_len);
    p->body_len = j->body_len;
    snprintf(p->body_sha, sizeof p->body_sha, "%s", j->sha256_hex);
    p->next = f->jobs;
    f->jobs = p;
    f->n_jobs++;
    if (err) { /* cannot happen for a decoded job (a JSON object): park it anyway */
        p->queued = false;
        f->active[p->input]++;
        park_refused(f, db, p, err, "the request body could not be built from the payload");
        return IDEMQ_OK;
    }
    effect_http_request_sha(in, p->req, p->req_len, p->req_sha);
    if (f->active[p->input] < in->provider.max_in_flight)
        begin(f, db, p);
    return IDEMQ_OK;
}

/* Transaction 2 for one answer. */
static void answered(struct provider_flow *f, PGconn *db, struct effect_http_result *r)
{
    struct pf_job *p = r->cookie;
    struct ledger_db_error e;
    struct ledger_provider_step s;
    char *answer;
    const char *op = r->op == EFFECT_HTTP_CALL         ? "call"
                     : r->op == EFFECT_HTTP_LOOKUP_KEY ? "key"
                                                       : "reference";

#ifdef IDEMQ_TEST_HOOKS
    if (f->crash_after_call && r->op == EFFECT_HTTP_CALL) {
        log_warn("test hook: SIGKILL after the provider answered %s, before transaction 2",
                 p->key);
        kill(getpid(), SIGKILL);
    }
#endif
    log_job(LOG_LVL_DEBUG, p->key, (unsigned long long)p->redelivery_tag, 0,
            "provider %s %d: %s (%s, %lld ms)", op, p->lease, effect_http_class_name(r->cls),
            r->detail, r->elapsed_ms);
    if (r->cls != EFFECT_HTTP_NOT_SENT) /* a request went out: its span */
        trace_export_call(&p->trace, &f->c->inputs[p->input],
                          r->op == EFFECT_HTTP_CALL         ? "call"
                          : r->op == EFFECT_HTTP_LOOKUP_KEY ? "lookup by key"
                                                            : "lookup by reference",
                          r->op == EFFECT_HTTP_CALL ? f->c->inputs[p->input].provider.method
                                                    : "GET",
                          effect_http_class_name(r->cls), r->status, r->elapsed_ms);
    if (!(answer = effect_http_answer_json(r))) {
        struct ledger_db_error nomem = {"", "out of memory", false};
        db_failed(f, p, "answer", &nomem);
        return;
    }
    p->how = r->op == EFFECT_HTTP_CALL         ? "answer"
             : r->op == EFFECT_HTTP_LOOKUP_KEY ? "lookup by key"
                                               : "lookup by reference";
    /* The answer exists only here: a transient failure (a deadlock, a lock
     * or statement timeout) is tried again at once, a few times, before it
     * is given up to the lease (then looked up or resent). */
    for (int tries = 1;; tries++) {
        memset(&s, 0, sizeof s);
        p->step_ms = now_ms();
        if (ledger_provider_result(db, p->key, p->lease, op, effect_http_class_name(r->cls),
                                   r->status, answer, r->reference, r->retry_after_ms,
                                   r->detail, f->opts[p->input], p->doc, f->c->consumer_id,
                                   false, &s, &e) == IDEMQ_OK)
            break;
        if (tries == RESULT_TRIES ||
            classify_sqlstate(e.sqlstate, e.conn_lost, &f->c->rules) != CLASS_TRANSIENT) {
            free(answer);
            db_failed(f, p, "provider_result", &e);
            return;
        }
        log_job(LOG_LVL_WARN, p->key, (unsigned long long)p->redelivery_tag, 0,
                "provider_result failed (%s %s): recording the answer again", e.sqlstate,
                e.message);
    }
    free(answer);
    if (s.action == LEDGER_PROVIDER_CALL || s.action == LEDGER_PROVIDER_LOOKUP)
        log_job(LOG_LVL_INFO, p->key, (unsigned long long)p->redelivery_tag, s.attempt,
                "provider: %s answered %s; next: %s", op, effect_http_class_name(r->cls),
                ledger_provider_action_name(s.action));
    act(f, db, p, &s);
    ledger_provider_step_clear(&s);
}

int provider_flow_poll(struct provider_flow *f, PGconn *db, int timeout_ms,
                       struct provider_decision *out, int max)
{
    struct effect_http_result rs[POLL_BATCH];
    int n = 0, got;

    start_queued(f, db);
    if (f->n_ready == 0 && f->http) {
        got = effect_http_poll(f->http, timeout_ms, rs, POLL_BATCH);
        for (int i = 0; i < got; i++) {
            answered(f, db, &rs[i]);
            effect_http_result_clear(&rs[i]);
        }
        start_queued(f, db);
    }
    {
        int taken = 0;
        while (n < max && taken < f->n_ready) {
            struct provider_decision *d = &f->ready[taken++];
            if (!d->cookie) { /* an orphan's: recorded, nothing to settle */
                provider_flow_decision_clear(d);
                continue;
            }
            out[n++] = *d;
        }
        if (taken) {
            memmove(f->ready, f->ready + taken,
                    sizeof *f->ready * (size_t)(f->n_ready - taken));
            f->n_ready -= taken;
        }
    }
    return n;
}
