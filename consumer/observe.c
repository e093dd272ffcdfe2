/*
 * observe: counters, /metrics lines, `observe report` and the `jobs show`
 * lines of observe mode (see observe.h).
 */
#include "observe.h"

#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "log.h"
#include "ops.h"

#define N_CODES (IDEMQ_ERR_KEY_REUSE + 1)

static atomic_long by_outcome[OBSERVE_MAX_INPUTS][OBSERVE_N_OUTCOMES];
static atomic_long by_code[OBSERVE_MAX_INPUTS][N_CODES];

void observe_count(int input, enum observe_outcome o, idemq_err_t code)
{
    if (input < 0 || input >= OBSERVE_MAX_INPUTS || o <= OBSERVE_NONE || o >= OBSERVE_N_OUTCOMES)
        return;
    atomic_fetch_add(&by_outcome[input][o], 1);
    if (code > IDEMQ_OK && (int)code < N_CODES)
        atomic_fetch_add(&by_code[input][code], 1);
}

long observe_counted(int input, enum observe_outcome o)
{
    if (input < 0 || input >= OBSERVE_MAX_INPUTS || o <= OBSERVE_NONE || o >= OBSERVE_N_OUTCOMES)
        return 0;
    return atomic_load(&by_outcome[input][o]);
}

/* A label value: backslash, double quote and newline escaped. */
static void label(char *dst, size_t n, const char *s)
{
    size_t o = 0;
    for (; *s && o + 3 < n; s++) {
        if (*s == '\\' || *s == '"' || *s == '\n') {
            dst[o++] = '\\';
            dst[o++] = *s == '\n' ? 'n' : *s;
        } else {
            dst[o++] = *s;
        }
    }
    dst[o] = '\0';
}

#define ADD(fmt, ...)                                                                        \
    do {                                                                                     \
        if (off < len)                                                                       \
            off += (size_t)snprintf(buf + off, len - off, fmt, __VA_ARGS__);                 \
    } while (0)

size_t observe_metrics_render(const struct conf *c, char *buf, size_t len)
{
    size_t off = 0;
    int any = 0;
    char name[160];

    for (int i = 0; i < c->n_inputs && i < OBSERVE_MAX_INPUTS; i++)
        any += c->inputs[i].observe ? 1 : 0;
    if (!any || !len)
        return 0;
    ADD("%s", "# HELP idemq_observed_total deliveries of observe-mode inputs by outcome "
              "(no effect ran)\n# TYPE idemq_observed_total counter\n");
    for (int i = 0; i < c->n_inputs && i < OBSERVE_MAX_INPUTS; i++) {
        if (!c->inputs[i].observe)
            continue;
        label(name, sizeof name, c->inputs[i].name);
        for (int o = OBSERVE_NEW; o < OBSERVE_N_OUTCOMES; o++)
            ADD("idemq_observed_total{input=\"%s\",outcome=\"%s\"} %ld\n", name,
                ledger_observe_outcome_name((enum observe_outcome)o), atomic_load(&by_outcome[i][o]));
    }
    ADD("%s", "# HELP idemq_observe_would_park_total deliveries of observe-mode inputs that "
              "apply mode would park, by code (late replays as outside_dedup_window)\n"
              "# TYPE idemq_observe_would_park_total counter\n");
    for (int i = 0; i < c->n_inputs && i < OBSERVE_MAX_INPUTS; i++) {
        if (!c->inputs[i].observe)
            continue;
        label(name, sizeof name, c->inputs[i].name);
        for (int e = IDEMQ_ERR_NOMEM; e < N_CODES; e++) {
            long v = atomic_load(&by_code[i][e]);
            if (v)
                ADD("idemq_observe_would_park_total{input=\"%s\",code=\"%s\"} %ld\n", name,
                    idemq_err_name((idemq_err_t)e), v);
        }
    }
    return off < len ? off : len - 1;
}

void observe_log_summary(const struct conf *c)
{
    for (int i = 0; i < c->n_inputs && i < OBSERVE_MAX_INPUTS; i++) {
        long n[OBSERVE_N_OUTCOMES];
        if (!c->inputs[i].observe)
            continue;
        for (int o = 0; o < OBSERVE_N_OUTCOMES; o++)
            n[o] = atomic_load(&by_outcome[i][o]);
        log_info("observed (input %s, mode = \"observe\", no effect ran): new keys %ld, "
                 "duplicates %ld, late replays %ld, would park %ld, unrecorded %ld",
                 c->inputs[i].name, n[OBSERVE_NEW], n[OBSERVE_DUPLICATE], n[OBSERVE_LATE],
                 n[OBSERVE_WOULD_PARK], n[OBSERVE_UNRECORDED]);
    }
}

int observe_report(const struct conf *c, const char *input, const char *since, FILE *out)
{
    PGconn *db = ops_connect(c, "idemq observe", c->statement_timeout_ms);
    int rc;

    if (!db)
        return 4;
    rc = observe_report_db(db, input, since, out);
    PQfinish(db);
    return rc;
}

int observe_report_db(PGconn *db, const char *input, const char *since, FILE *out)
{
    const char *params[2] = {input, since};
    struct ops_strs a = {NULL, 0, 0};
    PGresult *r;
    int rc = 0, rows;

    r = PQexecParams(db,
                     "SELECT input, outcome, coalesce(code, ''), n, first_at, last_at "
                     "FROM idemq.observe_report($1, $2::timestamptz)",
                     2, NULL, params, NULL, NULL, 0);
    if (PQresultStatus(r) != PGRES_TUPLES_OK) {
        log_error("cannot read the observations: %s", PQerrorMessage(db));
        rc = 4;
        goto out;
    }
    rows = PQntuples(r);
    fprintf(out, "observe baseline%s%s%s%s\n", input ? " of input " : "",
            input ? ops_text(&a, input) : "", since ? " since " : "",
            since ? ops_text(&a, since) : "");
    if (!rows) {
        fprintf(out, "  nothing observed\n");
        rc = 1;
        goto out;
    }
    /* rows come grouped by input, then outcome */
    for (int i = 0; i < rows;) {
        const char *in = PQgetvalue(r, i, 0);
        long long n[OBSERVE_N_OUTCOMES] = {0}, total = 0, reuse = 0;
        const char *first = PQgetvalue(r, i, 4), *last = PQgetvalue(r, i, 5);
        int k = i;
        for (; k < rows && strcmp(PQgetvalue(r, k, 0), in) == 0; k++) {
            enum observe_outcome o = ledger_observe_outcome_parse(PQgetvalue(r, k, 1));
            long long v = atoll(PQgetvalue(r, k, 3));
            const char *code = PQgetvalue(r, k, 2);
            n[o] += v;
            total += v;
            if (o == OBSERVE_DUPLICATE && strcmp(code, "key_reuse") == 0)
                reuse += v;
            if (strcmp(PQgetvalue(r, k, 4), first) < 0)
                first = PQgetvalue(r, k, 4);
            if (strcmp(PQgetvalue(r, k, 5), last) > 0)
                last = PQgetvalue(r, k, 5);
        }
        fprintf(out, "input %s: %lld deliveries, %s to %s\n", ops_text(&a, in), total,
                ops_text(&a, first), ops_text(&a, last));
        fprintf(out, "  observed keys    %lld  (claimed as applied by the consumer beside idemq)\n",
                n[OBSERVE_NEW]);
        fprintf(out, "  duplicates       %lld  (%.1f %% of deliveries; with another body "
                     "(key_reuse) %lld)\n",
                n[OBSERVE_DUPLICATE],
                total ? 100.0 * (double)n[OBSERVE_DUPLICATE] / (double)total : 0.0, reuse);
        fprintf(out, "  late replays     %lld  (older than the dedup window, key not claimed)\n",
                n[OBSERVE_LATE]);
        fprintf(out, "  would be parked  %lld  (late replays included: %lld)\n",
                n[OBSERVE_WOULD_PARK] + n[OBSERVE_LATE], n[OBSERVE_LATE]);
        for (int x = i; x < k; x++) {
            enum observe_outcome o = ledger_observe_outcome_parse(PQgetvalue(r, x, 1));
            if (o == OBSERVE_WOULD_PARK || o == OBSERVE_LATE)
                fprintf(out, "    %-22s %s\n", ops_tval(&a, r, x, 2), PQgetvalue(r, x, 3));
        }
        i = k;
    }
out:
    PQclear(r);
    ops_strs_free(&a);
    return rc;
}

int observe_show(PGconn *db, const char *key, FILE *out)
{
    const char *params[1] = {key};
    struct ops_strs a = {NULL, 0, 0};
    PGresult *job, *obs;
    int lines = 0;

    /* a ledger before version 15 has neither: nothing to say */
    job = PQexecParams(db,
                       "SELECT observed_by, first_seen_at, state, attempts, applied_at "
                       "FROM idemq.jobs WHERE key = $1 AND observed_by IS NOT NULL",
                       1, NULL, params, NULL, NULL, 0);
    obs = PQexecParams(db,
                       "SELECT at, input, queue, outcome, coalesce(code, '-'), "
                       "coalesce(reason, ''), redelivered FROM idemq.observations "
                       "WHERE key = $1 ORDER BY id LIMIT 1000",
                       1, NULL, params, NULL, NULL, 0);
    if (PQresultStatus(job) == PGRES_TUPLES_OK && PQntuples(job) == 1) {
        const char *state = PQgetvalue(job, 0, 2);
        if (strcmp(state, "observed") == 0)
            fprintf(out, "observed only: input %s (mode = \"observe\") claimed it at %s; idemq "
                         "ran no effect for it.\n  The consumer running beside idemq took it, "
                         "with an outcome idemq cannot know: the first copy apply mode takes is "
                         "applied once.\n",
                    ops_tval(&a, job, 0, 0), ops_tval(&a, job, 0, 1));
        else if (strcmp(state, "applied") == 0 && strcmp(PQgetvalue(job, 0, 3), "0") == 0)
            fprintf(out, "observed only: input %s (mode = \"observe\") claimed it at %s as "
                         "applied (a ledger before version 21); idemq ran no effect for it.\n  "
                         "Every later copy is a duplicate, also after the switch to mode = "
                         "\"apply\".\n",
                    ops_tval(&a, job, 0, 0), ops_tval(&a, job, 0, 1));
        else
            fprintf(out, "observed first: input %s (mode = \"observe\") claimed it at %s; "
                         "idemq took it over in apply mode (state %s).\n",
                    ops_tval(&a, job, 0, 0), ops_tval(&a, job, 0, 1), state);
        lines += 2;
    }
    if (PQresultStatus(obs) == PGRES_TUPLES_OK && PQntuples(obs) > 0) {
        fprintf(out, "observations (mode = \"observe\", no effect):\n");
        lines++;
        for (int i = 0; i < PQntuples(obs); i++, lines++)
            fprintf(out, "  %s  %s of input %s (queue %s), code %s%s%s%s\n",
                    ops_tval(&a, obs, i, 0), ops_tval(&a, obs, i, 3), ops_tval(&a, obs, i, 1),
                    ops_tval(&a, obs, i, 2), ops_tval(&a, obs, i, 4),
                    PQgetvalue(obs, i, 5)[0] ? ": " : "", ops_tval(&a, obs, i, 5),
                    strcmp(PQgetvalue(obs, i, 6), "t") == 0 ? " (redelivered)" : "");
    }
    PQclear(job);
    PQclear(obs);
    ops_strs_free(&a);
    return lines;
}
