/*
 * reconcile: the sweep over overdue provider intents, `idemq reconcile`,
 * and the provider gauges (see reconcile.h).
 */
#include "reconcile.h"

#include <pthread.h>
#include <stdarg.h>
#include <pwd.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "classify.h"
#include <jansson.h>
#include "effect_http.h"
#include "ledger_provider.h"
#include "log.h"
#include "sig.h"

#define SWEEP_TAKE 16      /* intents taken per input and scan at most */
#define POLL_BATCH 16
#define CMD_DEADLINE_MS (10 * 60 * 1000)

/* One request of the sweep in flight. */
struct pending {
    struct pending *next;
    int input;
    int lease;
    char key[CONF_KEY_MAX_BYTES + 1];
};

struct reconcile_sweep {
    const struct conf *c;
    struct effect_http *http;
    char **opts; /* by input; NULL for non-provider inputs */
    char who[256];
    FILE *out;
    int age_override; /* < 0: each input's reconcile_after_s */
    long long last_scan_ms;
    bool more;        /* the last scan took a full batch */
    struct pending *inflight;
};

static long long now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* One line per key: to the command's output, else the log. */
static void event(struct reconcile_sweep *s, const char *key, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void event(struct reconcile_sweep *s, const char *key, const char *fmt, ...)
{
    char line[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    if (s->out)
        fprintf(s->out, "  %s: %s\n", key, line);
    else
        log_info("reconcile: key=%s: %s", key, line);
}

struct reconcile_sweep *reconcile_sweep_new(const struct conf *c, const char *who, FILE *out,
                                            char *errbuf, size_t errlen)
{
    struct reconcile_sweep *s = calloc(1, sizeof *s);
    if (!s || !(s->opts = calloc((size_t)c->n_inputs, sizeof *s->opts))) {
        snprintf(errbuf, errlen, "out of memory");
        goto fail;
    }
    s->c = c;
    s->out = out;
    s->age_override = -1;
    snprintf(s->who, sizeof s->who, "%s", who);
    for (int i = 0; i < c->n_inputs; i++) {
        if (CONF_INPUT_PROVIDER(&c->inputs[i]) && !(s->opts[i] = ledger_provider_opts(c, i))) {
            snprintf(errbuf, errlen, "out of memory");
            goto fail;
        }
    }
    if (effect_http_new(c, &s->http, errbuf, errlen) != IDEMQ_OK)
        goto fail;
    return s;
fail:
    reconcile_sweep_free(s);
    return NULL;
}

void reconcile_sweep_free(struct reconcile_sweep *s)
{
    if (!s)
        return;
    effect_http_free(s->http);
    while (s->inflight) {
        struct pending *p = s->inflight;
        s->inflight = p->next;
        free(p);
    }
    for (int i = 0; s->opts && i < s->c->n_inputs; i++)
        free(s->opts[i]);
    free(s->opts);
    free(s);
}

void reconcile_sweep_set_age(struct reconcile_sweep *s, int age_s) { s->age_override = age_s; }

bool reconcile_sweep_busy(const struct reconcile_sweep *s) { return s->inflight || s->more; }

static idemq_err_t act(struct reconcile_sweep *s, PGconn *db, int input,
                       struct ledger_provider_step *st, struct reconcile_counts *n,
                       struct ledger_db_error *e);

/* Sends what the ledger asked for. */
static void send_step(struct reconcile_sweep *s, int input, struct ledger_provider_step *st,
                      struct reconcile_counts *n)
{
    struct pending *p = calloc(1, sizeof *p);
    enum effect_http_op op = st->action == LEDGER_PROVIDER_CALL ? EFFECT_HTTP_CALL
                             : st->by_reference                 ? EFFECT_HTTP_LOOKUP_REF
                                                                : EFFECT_HTTP_LOOKUP_KEY;
    char err[256];

    if (!p) {
        event(s, st->key, "out of memory: left for the next sweep (its lease runs out)");
        n->left++;
        return;
    }
    p->input = input;
    p->lease = st->lease;
    snprintf(p->key, sizeof p->key, "%s", st->key);
    if (op == EFFECT_HTTP_CALL && st->unopened) {
        /* never sent empty or sealed; its lease runs out, the next sweep
         * tries again (list the key again to let it through) */
        event(s, st->key, "not sent: the stored request body is sealed with key '%s' and "
              "cannot be opened (%s): left for the next sweep", st->body_key, st->unopened);
        free(p);
        n->left++;
        return;
    }
    if (effect_http_submit(s->http, input, op, st->key, (const char *)st->body, st->body_len, p,
                           err, sizeof err) != IDEMQ_OK) {
        event(s, st->key, "not sent (%s): left for the next sweep", err);
        free(p);
        n->left++;
        return;
    }
    if (op == EFFECT_HTTP_CALL)
        n->resent++;
    else
        n->looked_up++;
    p->next = s->inflight;
    s->inflight = p;
}

/* The local effect failed after the provider confirmed. */
static idemq_err_t effect_error(struct reconcile_sweep *s, PGconn *db, int input,
                                struct ledger_provider_step *st, struct reconcile_counts *n,
                                struct ledger_db_error *e)
{
    enum classify_class cls = classify_sqlstate(st->sqlstate, false, &s->c->rules);
    struct ledger_provider_step next;
    idemq_err_t err;

    memset(&next, 0, sizeof next);
    snprintf(next.key, sizeof next.key, "%s", st->key);
    if (cls == CLASS_FATAL) {
        event(s, st->key, "the effect failed with %s %s (deploy or configuration): left",
              st->sqlstate, st->message);
        n->left++;
        return IDEMQ_OK;
    }
    err = ledger_provider_effect_failed(db, st->key,
                                        cls == CLASS_PERMANENT ? "permanent" : "transient",
                                        idemq_err_name(IDEMQ_ERR_EFFECT), st->sqlstate,
                                        st->message, s->opts[input], NULL, s->who, &next, e);
    if (err == IDEMQ_OK) {
        snprintf(next.key, sizeof next.key, "%s", st->key);
        err = act(s, db, input, &next, n, e);
    }
    ledger_provider_step_clear(&next);
    return err;
}

/* The reference is committed: the local effect runs in its own statement;
 * a failure of that whole statement (a statement timeout, an ASSERT) is
 * the effect's error, the reference stays recorded. */
static idemq_err_t run_confirmed(struct reconcile_sweep *s, PGconn *db, int input,
                                 struct ledger_provider_step *st, struct reconcile_counts *n,
                                 struct ledger_db_error *e)
{
    struct ledger_provider_step next;
    idemq_err_t err;

    if (st->message[0])
        event(s, st->key, "%s", st->message); /* a second reference: an alarm */
    memset(&next, 0, sizeof next);
    if (st->unopened) { /* a failed attempt of the effect, as the worker records it */
        event(s, st->key, "the message is sealed with key '%s' and cannot be opened (%s): the "
              "local effect did not run", st->body_key, st->unopened);
        err = ledger_provider_unopened(db, st->key, st, s->opts[input], NULL, s->who, &next, e);
        if (err == IDEMQ_OK) {
            snprintf(next.key, sizeof next.key, "%s", st->key);
            err = act(s, db, input, &next, n, e);
        }
        ledger_provider_step_clear(&next);
        return err;
    }
    err = ledger_provider_confirmed(db, st->key, "reconciler", s->opts[input], NULL, s->who,
                                    st, &next, e);
    if (err != IDEMQ_OK && classify_sqlstate(e->sqlstate, e->conn_lost, &s->c->rules) !=
                               CLASS_INFRA) {
        memset(&next, 0, sizeof next);
        next.action = LEDGER_PROVIDER_EFFECT_ERROR;
        snprintf(next.sqlstate, sizeof next.sqlstate, "%s", e->sqlstate);
        snprintf(next.message, sizeof next.message, "%s", e->message);
        err = IDEMQ_OK;
    }
    if (err == IDEMQ_OK) {
        snprintf(next.key, sizeof next.key, "%s", st->key);
        err = act(s, db, input, &next, n, e);
    }
    ledger_provider_step_clear(&next);
    return err;
}

/* Turns one ledger step into a request, or counts its outcome. */
static idemq_err_t act(struct reconcile_sweep *s, PGconn *db, int input,
                       struct ledger_provider_step *st, struct reconcile_counts *n,
                       struct ledger_db_error *e)
{
    switch (st->action) {
    case LEDGER_PROVIDER_CALL:
    case LEDGER_PROVIDER_LOOKUP:
        send_step(s, input, st, n);
        return IDEMQ_OK;
    case LEDGER_PROVIDER_APPLIED:
        event(s, st->key, "applied: converged on the provider's reference");
        n->applied++;
        return IDEMQ_OK;
    case LEDGER_PROVIDER_PARK:
        event(s, st->key, "parked %s %s: %s",
              json_string_value(json_object_get(st->park, "error_class")),
              json_string_value(json_object_get(st->park, "error_code")),
              json_string_value(json_object_get(st->park, "reason")));
        n->parked++;
        return IDEMQ_OK;
    case LEDGER_PROVIDER_EFFECT_ERROR:
        return effect_error(s, db, input, st, n, e);
    case LEDGER_PROVIDER_CONFIRMED:
        return run_confirmed(s, db, input, st, n, e);
    case LEDGER_PROVIDER_DUPLICATE:
    case LEDGER_PROVIDER_WAIT:
    case LEDGER_PROVIDER_RETRY:
        event(s, st->key, "left for later (%s%s%s)", ledger_provider_action_name(st->action),
              st->message[0] ? ": " : "", st->message);
        n->left++;
        return IDEMQ_OK;
    }
    IDEMQ_PANIC("unhandled provider step %d", (int)st->action);
}

/* Takes overdue intents of every provider input and starts them. */
static idemq_err_t scan(struct reconcile_sweep *s, PGconn *db, struct reconcile_counts *n,
                        struct ledger_db_error *e)
{
    struct ledger_provider_step steps[SWEEP_TAKE];
    idemq_err_t err = IDEMQ_OK;

    s->more = false;
    for (int i = 0; i < s->c->n_inputs && err == IDEMQ_OK; i++) {
        const struct conf_provider *p = &s->c->inputs[i].provider;
        int room, got = 0;
        if (!s->opts[i])
            continue;
        room = p->max_in_flight - effect_http_in_flight(s->http, i);
        if (room > SWEEP_TAKE)
            room = SWEEP_TAKE;
        if (room <= 0)
            continue;
        err = ledger_provider_sweep(db, s->opts[i],
                                    s->age_override >= 0 ? s->age_override : p->reconcile_after_s,
                                    room, s->who, steps, &got, e);
        if (err)
            break;
        if (got == room)
            s->more = true;
        n->taken += got;
        for (int k = 0; k < got; k++) {
            if (err == IDEMQ_OK)
                err = act(s, db, i, &steps[k], n, e);
            ledger_provider_step_clear(&steps[k]);
        }
    }
    if (err == IDEMQ_OK)
        err = reconcile_gauges_refresh(db, s->c, e);
    return err;
}

idemq_err_t reconcile_sweep_step(struct reconcile_sweep *s, PGconn *db, int scan_ms,
                                 int budget_ms, struct reconcile_counts *counts,
                                 struct ledger_db_error *e)
{
    struct reconcile_counts ignore;
    struct effect_http_result rs[POLL_BATCH];
    idemq_err_t err = IDEMQ_OK;
    int got;

    if (!counts) {
        memset(&ignore, 0, sizeof ignore);
        counts = &ignore;
    }
    if (!s->inflight && (scan_ms <= 0 || now_ms() - s->last_scan_ms >= scan_ms)) {
        s->last_scan_ms = now_ms();
        if ((err = scan(s, db, counts, e)) != IDEMQ_OK)
            return err;
    }
    got = effect_http_poll(s->http, budget_ms, rs, POLL_BATCH);
    for (int i = 0; i < got; i++) {
        struct effect_http_result *r = &rs[i];
        struct pending *p = r->cookie, **pp;
        struct ledger_provider_step st;
        char *answer = NULL;
        const char *op = r->op == EFFECT_HTTP_CALL         ? "call"
                         : r->op == EFFECT_HTTP_LOOKUP_KEY ? "key"
                                                           : "reference";
        for (pp = &s->inflight; *pp && *pp != p; pp = &(*pp)->next)
            ;
        if (*pp)
            *pp = p->next;
        memset(&st, 0, sizeof st);
        if (err == IDEMQ_OK) {
            if (!(answer = effect_http_answer_json(r))) {
                event(s, p->key, "out of memory recording the answer: left");
                counts->left++;
            } else {
                if (r->op != EFFECT_HTTP_CALL)
                    event(s, p->key, "looked up by %s: %s%s%s", op, effect_http_class_name(r->cls),
                          r->reference[0] ? ", reference " : "", r->reference);
                err = ledger_provider_result(db, p->key, p->lease, op,
                                             effect_http_class_name(r->cls), r->status, answer,
                                             r->reference, r->retry_after_ms, r->detail,
                                             s->opts[p->input], NULL, s->who, true, &st, e);
                if (err == IDEMQ_OK) {
                    snprintf(st.key, sizeof st.key, "%s", p->key);
                    err = act(s, db, p->input, &st, counts, e);
                }
            }
        }
        free(answer);
        ledger_provider_step_clear(&st);
        effect_http_result_clear(r);
        free(p);
    }
    return err;
}

/* ---- the command ---- */

static void who_am_i(char *buf, size_t len)
{
    char host[128] = "host";
    struct passwd *pw = getpwuid(getuid());
    gethostname(host, sizeof host - 1);
    snprintf(buf, len, "idemq reconcile (%s@%s)", pw ? pw->pw_name : "?", host);
}

int reconcile_cmd(const struct conf *c, int age_s, FILE *out)
{
    struct reconcile_sweep *s;
    struct reconcile_counts n;
    struct ledger_db_error e;
    char err[512], who[300];
    long long deadline = now_ms() + CMD_DEADLINE_MS;
    PGconn *db;
    int inputs = 0, rc = 0;

    for (int i = 0; i < c->n_inputs; i++)
        inputs += CONF_INPUT_PROVIDER(&c->inputs[i]) ? 1 : 0;
    if (!inputs) {
        fprintf(out, "no provider input in %s: nothing to reconcile\n", c->path);
        return 0;
    }
    who_am_i(who, sizeof who);
    if (!(s = reconcile_sweep_new(c, who, out, err, sizeof err))) {
        log_error("%s", err);
        return 3;
    }
    if (age_s >= 0)
        reconcile_sweep_set_age(s, age_s);
    if (!(db = ledger_db_connect(c->dsn, "idemq reconcile", c->statement_timeout_ms, err,
                                 sizeof err))) {
        log_error("%s", err);
        reconcile_sweep_free(s);
        return 4;
    }
    for (int i = 0; i < c->n_inputs; i++)
        if (CONF_INPUT_PROVIDER(&c->inputs[i]))
            fprintf(out, "input %s: intents pending or unknown for more than %d s past their "
                         "due time\n",
                    c->inputs[i].name, age_s >= 0 ? age_s : c->inputs[i].provider.reconcile_after_s);
    memset(&n, 0, sizeof n);
    do {
        if (reconcile_sweep_step(s, db, 0, 200, &n, &e) != IDEMQ_OK) {
            log_error("reconcile: %s %s", e.sqlstate, e.message);
            rc = e.conn_lost ? 4 : 1;
            break;
        }
    } while (reconcile_sweep_busy(s) && !sig_stop_requested() && now_ms() < deadline);
    if (rc == 0 && reconcile_sweep_busy(s)) {
        fprintf(out, "stopped with requests in flight: their keys are taken again by the next "
                     "sweep once their leases run out\n");
        rc = 1;
    }
    fprintf(out, "reconciled %ld intent%s: %ld applied, %ld parked, %ld left for later "
                 "(%ld lookups, %ld requests resent under the same key)\n",
            n.taken, n.taken == 1 ? "" : "s", n.applied, n.parked, n.left, n.looked_up,
            n.resent);
    PQfinish(db);
    reconcile_sweep_free(s);
    return rc;
}

/* ---- gauges ---- */

#define GAUGE_ROWS 64

static struct {
    pthread_mutex_t lock;
    bool have;
    int n_state, n_lat;
    struct {
        char input[65], state[16];
        long count;
        double oldest_s;
    } state[GAUGE_ROWS];
    struct {
        char input[65];
        long count;
        double p50, p99, max;
    } lat[GAUGE_ROWS];
} gauges = {.lock = PTHREAD_MUTEX_INITIALIZER};

idemq_err_t reconcile_gauges_refresh(PGconn *db, const struct conf *c,
                                     struct ledger_db_error *e)
{
    json_t *names = json_array();
    char *list = NULL;
    const char *params[1];
    PGresult *a, *b;

    for (int i = 0; names && i < c->n_inputs; i++)
        if (CONF_INPUT_PROVIDER(&c->inputs[i]))
            json_array_append_new(names, json_string(c->inputs[i].name));
    if (!names || !(list = json_dumps(names, JSON_COMPACT))) {
        json_decref(names);
        snprintf(e->sqlstate, sizeof e->sqlstate, "%s", "");
        snprintf(e->message, sizeof e->message, "out of memory");
        e->conn_lost = false;
        return IDEMQ_ERR_NOMEM;
    }
    json_decref(names);
    params[0] = list;
    a = ledger_db_query(db,
                        "SELECT r_input, r_state, r_count, r_oldest_s FROM idemq.provider_gauges() "
                        "WHERE r_input IN (SELECT jsonb_array_elements_text($1::jsonb))",
                        1, params, e);
    if (!a) {
        free(list);
        return ledger_db_err(e);
    }
    b = ledger_db_query(db,
                        "SELECT r_input, r_count, r_p50_s, r_p99_s, r_max_s "
                        "FROM idemq.provider_latency(600) "
                        "WHERE r_input IN (SELECT jsonb_array_elements_text($1::jsonb))",
                        1, params, e);
    free(list);
    if (!b) {
        PQclear(a);
        return ledger_db_err(e);
    }
    pthread_mutex_lock(&gauges.lock);
    gauges.have = true;
    gauges.n_state = PQntuples(a) < GAUGE_ROWS ? PQntuples(a) : GAUGE_ROWS;
    for (int i = 0; i < gauges.n_state; i++) {
        snprintf(gauges.state[i].input, sizeof gauges.state[i].input, "%s", PQgetvalue(a, i, 0));
        snprintf(gauges.state[i].state, sizeof gauges.state[i].state, "%s", PQgetvalue(a, i, 1));
        gauges.state[i].count = atol(PQgetvalue(a, i, 2));
        gauges.state[i].oldest_s = strtod(PQgetvalue(a, i, 3), NULL);
    }
    gauges.n_lat = PQntuples(b) < GAUGE_ROWS ? PQntuples(b) : GAUGE_ROWS;
    for (int i = 0; i < gauges.n_lat; i++) {
        snprintf(gauges.lat[i].input, sizeof gauges.lat[i].input, "%s", PQgetvalue(b, i, 0));
        gauges.lat[i].count = atol(PQgetvalue(b, i, 1));
        gauges.lat[i].p50 = strtod(PQgetvalue(b, i, 2), NULL);
        gauges.lat[i].p99 = strtod(PQgetvalue(b, i, 3), NULL);
        gauges.lat[i].max = strtod(PQgetvalue(b, i, 4), NULL);
    }
    pthread_mutex_unlock(&gauges.lock);
    PQclear(a);
    PQclear(b);
    return IDEMQ_OK;
}

/* Appends a whole line or nothing: a cut line would break the text format. */
#define ADD(...)                                                                             \
    do {                                                                                     \
        if (!full) {                                                                         \
            int w_ = snprintf(buf + off, len - off, __VA_ARGS__);                            \
            if (w_ < 0 || (size_t)w_ >= len - off) {                                         \
                buf[off] = '\0';                                                             \
                full = true;                                                                 \
            } else {                                                                         \
                off += (size_t)w_;                                                           \
            }                                                                                \
        }                                                                                    \
    } while (0)

/* A label value with \, " and newlines escaped (Prometheus text format). */
static const char *label(const char *v, char *out, size_t outlen)
{
    size_t o = 0;
    for (; *v && o + 3 < outlen; v++) {
        if (*v == '\\' || *v == '"') {
            out[o++] = '\\';
            out[o++] = *v;
        } else if (*v == '\n') {
            out[o++] = '\\';
            out[o++] = 'n';
        } else {
            out[o++] = *v;
        }
    }
    out[o] = '\0';
    return out;
}

size_t reconcile_metrics_render(char *buf, size_t len)
{
    char l[160];
    size_t off = 0;
    bool full = false;
    if (!len)
        return 0;
    buf[0] = '\0';
    pthread_mutex_lock(&gauges.lock);
    if (gauges.have) {
        ADD("# HELP idemq_provider_intents provider intents not settled yet, by state\n"
            "# TYPE idemq_provider_intents gauge\n");
        for (int i = 0; i < gauges.n_state; i++)
            ADD("idemq_provider_intents{input=\"%s\",state=\"%s\"} %ld\n",
                label(gauges.state[i].input, l, sizeof l), gauges.state[i].state,
                gauges.state[i].count);
        ADD("# HELP idemq_provider_intent_oldest_seconds age of the oldest unsettled intent "
            "since its last change, by state\n"
            "# TYPE idemq_provider_intent_oldest_seconds gauge\n");
        for (int i = 0; i < gauges.n_state; i++)
            ADD("idemq_provider_intent_oldest_seconds{input=\"%s\",state=\"%s\"} %.3f\n",
                label(gauges.state[i].input, l, sizeof l), gauges.state[i].state,
                gauges.state[i].oldest_s);
        ADD("# HELP idemq_provider_confirmed_recent provider references confirmed in the last "
            "10 minutes\n# TYPE idemq_provider_confirmed_recent gauge\n");
        for (int i = 0; i < gauges.n_lat; i++)
            ADD("idemq_provider_confirmed_recent{input=\"%s\"} %ld\n",
                label(gauges.lat[i].input, l, sizeof l), gauges.lat[i].count);
        ADD("# HELP idemq_provider_confirm_latency_seconds first provider request to the "
            "recorded reference (p50, p99, max) of the intents confirmed in the last 10 "
            "minutes\n# TYPE idemq_provider_confirm_latency_seconds gauge\n");
        for (int i = 0; i < gauges.n_lat; i++) {
            label(gauges.lat[i].input, l, sizeof l);
            ADD("idemq_provider_confirm_latency_seconds{input=\"%s\",stat=\"p50\"} %.3f\n", l,
                gauges.lat[i].p50);
            ADD("idemq_provider_confirm_latency_seconds{input=\"%s\",stat=\"p99\"} %.3f\n", l,
                gauges.lat[i].p99);
            ADD("idemq_provider_confirm_latency_seconds{input=\"%s\",stat=\"max\"} %.3f\n", l,
                gauges.lat[i].max);
        }
    }
    pthread_mutex_unlock(&gauges.lock);
    return off < len ? off : len - 1;
}
