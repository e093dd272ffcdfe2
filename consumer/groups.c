/*
 * groups: parked groups, and redrive, discard and archive by group or
 * filter (see groups.h).
 */
#include "groups.h"

#include <pwd.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "log.h"
#include "textesc.h"

/* s in its terminal form (textesc_term: controls, C1 controls, invisible
 * characters and bytes that are not UTF-8 as \xHH of each byte; keys and
 * reasons come from producers) into buf. */
static const char *esc(const char *s, char *buf, size_t len)
{
    return textesc_term(s, buf, len);
}

/* The input name of a source queue (the queue itself if no input has it). */
static const char *input_of(const struct conf *c, const char *queue)
{
    for (int i = 0; i < c->n_inputs; i++)
        if (strcmp(c->inputs[i].queue, queue) == 0)
            return c->inputs[i].name;
    for (int i = 0; i < c->n_pg_inputs; i++)
        if (strcmp(c->pg_inputs[i].queue, queue) == 0)
            return c->pg_inputs[i].name;
    return queue;
}

/* The input's queue into queue (empty: all); -1 if no input has that name. */
static int queue_of(const struct conf *c, const char *input, char *queue, size_t len)
{
    queue[0] = '\0';
    if (!input)
        return 0;
    for (int i = 0; i < c->n_inputs; i++)
        if (strcmp(c->inputs[i].name, input) == 0)
            snprintf(queue, len, "%s", c->inputs[i].queue);
    for (int i = 0; i < c->n_pg_inputs; i++) /* PostgreSQL queue inputs */
        if (strcmp(c->pg_inputs[i].name, input) == 0)
            snprintf(queue, len, "%s", c->pg_inputs[i].queue);
    for (int i = 0; i < c->n_sqs_inputs; i++) /* Amazon SQS inputs */
        if (strcmp(c->sqs_inputs[i].name, input) == 0)
            snprintf(queue, len, "%s", c->sqs_inputs[i].queue);
    if (!queue[0]) {
        fprintf(stderr, "idemq: no input named %s\n", input);
        return -1;
    }
    return 0;
}

PGresult *groups_select(PGconn *db, const char *key, const char *error_class, const char *since,
                        const char *queue, long limit)
{
    char lim[24];
    const char *params[6] = {key, error_class, since, queue, NULL, lim};
    snprintf(lim, sizeof lim, "%ld", limit > 0 ? limit : 1000000000L);
    return PQexecParams(db,
                        "SELECT g, count(*), min(parked_at), max(parked_at),"
                        " (array_agg(key ORDER BY id) FILTER (WHERE key IS NOT NULL))[1],"
                        " (array_agg(key ORDER BY id) FILTER (WHERE key IS NOT NULL))[2],"
                        " (array_agg(key ORDER BY id) FILTER (WHERE key IS NOT NULL))[3],"
                        " count(*) FILTER (WHERE redrivable), source_queue, error_class,"
                        " error_code, coalesce(sqlstate, '-'), m, count(DISTINCT key)" GROUPS_FROM
                        " GROUP BY g, source_queue, error_class, error_code, sqlstate, m"
                        " ORDER BY count(*) DESC, g LIMIT $6::bigint",
                        6, NULL, params, NULL, NULL, 0);
}

/* The outbox rows parked (refused by the broker, or not encodable), by
 * exchange and masked reason, as the console's groups page shows them; the
 * rows themselves are in `idemq parked list`. Returns 0, or 2 / 4 as
 * groups_list does. */
static int outbox_groups(PGconn *db, const struct ops_filter *f, FILE *out)
{
    char b1[512], b2[1024];
    const char *params[2] = {f->key, f->since};
    long rows = 0;
    PGresult *r = PQexecParams(db,
                               "SELECT exchange, count(*), min(parked_at), max(parked_at),"
                               " idemq.mask_reason(last_error, key) FROM idemq.outbox"
                               " WHERE state = 'parked' AND ($1::text IS NULL OR key = $1)"
                               " AND ($2::timestamptz IS NULL OR parked_at >= $2)"
                               " GROUP BY 1, 5 ORDER BY 2 DESC, 1, 5 LIMIT 200",
                               2, NULL, params, NULL, NULL, 0);
    int rc = 0;
    if (PQresultStatus(r) != PGRES_TUPLES_OK) {
        log_error("cannot group the outbox rows parked: %s", PQerrorMessage(db));
        rc = PQstatus(db) == CONNECTION_OK ? 2 : 4;
    } else {
        for (int i = 0; i < PQntuples(r); i++) {
            rows += atol(PQgetvalue(r, i, 1));
            fprintf(out, "outbox exchange %s: %s row%s parked\n",
                    esc(PQgetvalue(r, i, 0), b1, sizeof b1), PQgetvalue(r, i, 1),
                    strcmp(PQgetvalue(r, i, 1), "1") == 0 ? "" : "s");
            fprintf(out, "  first park %s, last park %s\n", PQgetvalue(r, i, 2),
                    PQgetvalue(r, i, 3));
            fprintf(out, "  reason: %s\n", esc(PQgetvalue(r, i, 4), b2, sizeof b2));
        }
        if (rows > 0)
            fprintf(out, "%d outbox group%s, %ld outbox row%s parked (`idemq parked list` "
                         "shows each row)\n",
                    PQntuples(r), PQntuples(r) == 1 ? "" : "s", rows, rows == 1 ? "" : "s");
    }
    PQclear(r);
    return rc;
}

int groups_list(const struct conf *c, const struct ops_filter *f, FILE *out)
{
    char queue[300], b1[512], b2[512], b3[512], b4[1024];
    PGconn *db;
    PGresult *r;
    long parks = 0;
    int rc = 0;

    if (queue_of(c, f->input, queue, sizeof queue))
        return 2;
    if (!(db = ops_connect(c, "idemq parked groups", c->statement_timeout_ms)))
        return 4;
    r = groups_select(db, f->key, f->error_class, f->since, queue[0] ? queue : NULL, f->limit);
    if (PQresultStatus(r) != PGRES_TUPLES_OK) {
        log_error("cannot group parked messages: %s", PQerrorMessage(db));
        rc = PQstatus(db) == CONNECTION_OK ? 2 : 4;
        goto out;
    }
    for (int i = 0; i < PQntuples(r); i++) {
        long n = atol(PQgetvalue(r, i, 1)), red = atol(PQgetvalue(r, i, 7));
        char redr[64];
        if (red == n)
            snprintf(redr, sizeof redr, "yes");
        else if (red == 0)
            snprintf(redr, sizeof redr, "no");
        else
            snprintf(redr, sizeof redr, "%ld of %ld", red, n);
        parks += n;
        fprintf(out, "group %s: %ld park%s, %s key%s; input %s; %s %s SQLSTATE %s; "
                     "redrivable %s\n",
                PQgetvalue(r, i, 0), n, n == 1 ? "" : "s", PQgetvalue(r, i, 13),
                strcmp(PQgetvalue(r, i, 13), "1") == 0 ? "" : "s",
                esc(input_of(c, PQgetvalue(r, i, 8)), b1, sizeof b1), PQgetvalue(r, i, 9),
                esc(PQgetvalue(r, i, 10), b2, sizeof b2), PQgetvalue(r, i, 11), redr);
        fprintf(out, "  first park %s, last park %s\n", PQgetvalue(r, i, 2),
                PQgetvalue(r, i, 3));
        fprintf(out, "  reason: %s\n", esc(PQgetvalue(r, i, 12), b4, sizeof b4));
        fprintf(out, "  keys: %s", PQgetisnull(r, i, 4) ? "(none)"
                                                        : esc(PQgetvalue(r, i, 4), b1, sizeof b1));
        if (!PQgetisnull(r, i, 5))
            fprintf(out, ", %s", esc(PQgetvalue(r, i, 5), b2, sizeof b2));
        if (!PQgetisnull(r, i, 6))
            fprintf(out, ", %s", esc(PQgetvalue(r, i, 6), b3, sizeof b3));
        if (atol(PQgetvalue(r, i, 13)) > 3)
            fprintf(out, ", ...");
        fprintf(out, "\n");
    }
    fprintf(out, "%d group%s, %ld open park%s (messages the broker dead-lettered by itself "
                 "join a group once `idemq redrive` records them)\n",
            PQntuples(r), PQntuples(r) == 1 ? "" : "s", parks, parks == 1 ? "" : "s");
    if (!f->input && !f->error_class)
        rc = outbox_groups(db, f, out);
out:
    PQclear(r);
    PQfinish(db);
    return rc;
}

/* The operator: --actor, else $SUDO_USER, else the OS user. */
static void actor_of(const char *opt, char *buf, size_t len)
{
    const char *sudo = getenv("SUDO_USER");
    struct passwd *pw;
    if (opt && *opt) {
        snprintf(buf, len, "%s", opt);
    } else if (sudo && *sudo) {
        snprintf(buf, len, "%s", sudo);
    } else {
        pw = getpwuid(getuid());
        snprintf(buf, len, "%s", pw ? pw->pw_name : "?");
    }
}

struct moved {
    PGconn *db;
    const char *action_id;
    long recorded;
};

/* ops_redrive's on_moved: one row per redriven park, and the done count. */
static void record_moved(void *arg, const char *key, long long park_id)
{
    struct moved *m = arg;
    char id[24];
    const char *params[3] = {m->action_id, id, key};
    PGresult *r;
    snprintf(id, sizeof id, "%lld", park_id);
    r = PQexecParams(m->db, "SELECT idemq.ops_action_moved($1::bigint, $2::bigint, $3)", 3,
                     NULL, params, NULL, NULL, 0);
    if (PQresultStatus(r) != PGRES_TUPLES_OK)
        log_warn("redriven park #%s not recorded in operator action #%s: %s", id, m->action_id,
                 PQerrorMessage(m->db));
    else
        m->recorded++;
    PQclear(r);
}

/* ids[0..n) as a PostgreSQL array literal into out (n * 21 + 3 bytes). */
static void ids_literal(const long long *ids, size_t n, char *out)
{
    char *p = out;
    *p++ = '{';
    for (size_t j = 0; j < n; j++)
        p += sprintf(p, "%s%lld", j ? "," : "", ids[j]);
    *p++ = '}';
    *p = '\0';
}

/* Sleeps until `done` parks at `rate` per second have had their time since t0. */
static void pace(const struct timespec *t0, long done, double rate)
{
    struct timespec now, d;
    double due = (double)done / rate, el;
    clock_gettime(CLOCK_MONOTONIC, &now);
    el = (double)(now.tv_sec - t0->tv_sec) + (double)(now.tv_nsec - t0->tv_nsec) / 1e9;
    if (due <= el)
        return;
    d.tv_sec = (time_t)(due - el);
    d.tv_nsec = (long)((due - el - (double)d.tv_sec) * 1e9);
    nanosleep(&d, NULL);
}

int groups_act(const struct conf *c, const char *action, const struct ops_filter *f,
               const char *group, const char *reason, const char *actor, FILE *out)
{
    char queue[300], limit[24], who[256], sel[1024], b1[512], b2[512], action_id[24] = "";
    char *only = NULL; /* f->park_ids as an array literal */
    const char *params[7];
    long long *ids = NULL;
    PGconn *db;
    PGresult *r = NULL;
    double rate = f->rate > 0 ? f->rate : GROUPS_DEFAULT_RATE;
    long n = 0, done = 0;
    int rc = 0;
    bool redrive = strcmp(action, "redrive") == 0;

    if (!redrive && strcmp(action, "discard") && strcmp(action, "archive")) {
        fprintf(stderr, "idemq: parked takes list, groups, redrive, discard or archive\n");
        return 2;
    }
    if (!redrive && (!reason || !*reason)) {
        fprintf(stderr, "idemq: parked %s needs --reason TEXT\n", action);
        return 2;
    }
    if (!group && !f->input && !f->key && !f->error_class && !f->since && !f->park_ids) {
        fprintf(stderr, "idemq: parked %s needs --group ID or a filter (--input, --key, "
                        "--class, --since)\n", action);
        return 2;
    }
    if (group && (strlen(group) != 12 || strspn(group, "0123456789abcdef") != 12)) {
        fprintf(stderr, "idemq: --group takes a group id of 12 hex digits (idemq parked "
                        "groups)\n");
        return 2;
    }
    if (queue_of(c, f->input, queue, sizeof queue))
        return 2;
    if (!(db = ops_connect(c, "idemq parked", c->statement_timeout_ms)))
        return 4;
    actor_of(actor, who, sizeof who);
    snprintf(sel, sizeof sel, "group %s; input %s; key %s; class %s; since %s; limit %ld",
             group ? group : "any", f->input ? f->input : "any", f->key ? f->key : "any",
             f->error_class ? f->error_class : "any", f->since ? f->since : "any", f->limit);
    snprintf(limit, sizeof limit, "%ld", f->limit > 0 ? f->limit : 1000000000L);
    params[0] = f->key;
    params[1] = f->error_class;
    params[2] = f->since;
    params[3] = queue[0] ? queue : NULL;
    params[4] = group;
    params[5] = limit;
    if (f->park_ids) {
        if (!(only = malloc(f->n_park_ids * 21 + 3))) {
            log_error("out of memory");
            rc = 1;
            goto out;
        }
        ids_literal(f->park_ids, f->n_park_ids, only);
        snprintf(sel + strlen(sel), sizeof sel - strlen(sel), "; the %zu parks of a dry run",
                 f->n_park_ids);
    }
    params[6] = only;
    r = PQexecParams(db, "SELECT id, key, redrivable" GROUPS_FROM
                         " AND ($7::bigint[] IS NULL OR id = ANY ($7::bigint[]))"
                         " ORDER BY id LIMIT $6::bigint",
                     7, NULL, params, NULL, NULL, 0);
    if (PQresultStatus(r) != PGRES_TUPLES_OK) {
        log_error("cannot select parked messages: %s", PQerrorMessage(db));
        rc = PQstatus(db) == CONNECTION_OK ? 2 : 4;
        goto out;
    }
    n = PQntuples(r);
    if (n > 0 && !(ids = malloc((size_t)n * sizeof *ids))) {
        log_error("out of memory");
        rc = 1;
        goto out;
    }
    for (long i = 0; i < n; i++)
        ids[i] = atoll(PQgetvalue(r, (int)i, 0)); /* ascending: ORDER BY id */
    if (f->ids_out && n > 0) {
        if (!(*f->ids_out = malloc((size_t)n * sizeof **f->ids_out))) {
            log_error("out of memory");
            rc = 1;
            goto out;
        }
        memcpy(*f->ids_out, ids, (size_t)n * sizeof *ids);
        *f->n_ids_out = (size_t)n;
    }
    fprintf(out, "%s selects %ld open park%s (%s)\n", group ? "the group" : "the filter", n,
            n == 1 ? "" : "s", sel);
    if (n == 0)
        goto out;
    if (f->dry_run && !redrive) {
        for (long i = 0; i < n; i++)
            fprintf(out, "would %s park #%s key %s%s\n", action, PQgetvalue(r, (int)i, 0),
                    PQgetisnull(r, (int)i, 1) ? "(no key)"
                                              : esc(PQgetvalue(r, (int)i, 1), b1, sizeof b1),
                    strcmp(action, "discard") == 0
                        ? " (closed as not applied; a redrive of it is then a duplicate)"
                        : " (closed; its dead-letter copy stays redrivable)");
        fprintf(out, "would %s %ld park%s, in %ld step%s of at most %d, at %.0f parks/s, by "
                     "%s: %s (dry run: nothing was changed)\n",
                action, n, n == 1 ? "" : "s", (n + GROUPS_STEP - 1) / GROUPS_STEP,
                n > GROUPS_STEP ? "s" : "", GROUPS_STEP, rate, esc(who, b1, sizeof b1),
                esc(reason, b2, sizeof b2));
        goto out;
    }
    if (!f->dry_run) {
        char selected[24];
        const char *ap[5] = {action, who, reason, sel, selected};
        PGresult *a;
        snprintf(selected, sizeof selected, "%ld", n);
        a = PQexecParams(db, "SELECT idemq.ops_action_begin($1, $2, $3, $4, $5::integer)", 5,
                         NULL, ap, NULL, NULL, 0);
        if (PQresultStatus(a) != PGRES_TUPLES_OK) {
            log_error("cannot record the action (nothing done): %s", PQerrorMessage(db));
            PQclear(a);
            rc = PQstatus(db) == CONNECTION_OK ? 1 : 4;
            goto out;
        }
        snprintf(action_id, sizeof action_id, "%s", PQgetvalue(a, 0, 0));
        PQclear(a);
    }
    if (redrive) {
        /* The existing redrive, restricted to the dead-letter copies of the
         * selected parks. */
        struct ops_filter rf = *f;
        struct moved m = {db, action_id, 0};
        rf.key = NULL; /* the park ids already say it */
        rf.error_class = NULL;
        rf.since = NULL;
        rf.limit = 0;
        rf.rate = rate;
        rf.park_ids = ids;
        rf.n_park_ids = (size_t)n;
        rf.on_moved = f->dry_run ? NULL : record_moved;
        rf.moved_arg = &m;
        rc = ops_redrive(c, &rf, out);
        done = m.recorded;
    } else {
        struct timespec t0;
        clock_gettime(CLOCK_MONOTONIC, &t0);
        for (long i = 0; i < n; i += GROUPS_STEP) {
            long k = n - i < GROUPS_STEP ? n - i : GROUPS_STEP;
            char *arr = malloc((size_t)k * 21 + 3);
            const char *sp[5] = {action_id, NULL, action, who, reason};
            PGresult *s;
            if (!arr) {
                log_error("out of memory");
                rc = 1;
                break;
            }
            ids_literal(ids + i, (size_t)k, arr);
            sp[1] = arr;
            s = PQexecParams(db,
                             "SELECT idemq.ops_close_parks($1::bigint, $2::bigint[], $3, $4, $5)",
                             5, NULL, sp, NULL, NULL, 0);
            free(arr);
            if (PQresultStatus(s) != PGRES_TUPLES_OK) {
                log_error("step %ld of %s failed (the steps before it are done and recorded): "
                          "%s", i / GROUPS_STEP + 1, action, PQerrorMessage(db));
                rc = PQstatus(db) == CONNECTION_OK ? 1 : 4;
                PQclear(s);
                break;
            }
            done += atol(PQgetvalue(s, 0, 0));
            PQclear(s);
            pace(&t0, i + k, rate);
        }
        fprintf(out, "%s %ld of %ld park%s%s by %s: %s\n",
                strcmp(action, "discard") == 0 ? "discarded" : "archived", done, n,
                n == 1 ? "" : "s", done < n ? " (the others were closed meanwhile)" : "",
                esc(who, b1, sizeof b1), esc(reason, b2, sizeof b2));
    }
    if (action_id[0]) {
        const char *fp[1] = {action_id};
        PGresult *e = PQexecParams(db, "SELECT idemq.ops_action_finish($1::bigint)", 1, NULL,
                                   fp, NULL, NULL, 0);
        if (PQresultStatus(e) != PGRES_TUPLES_OK)
            log_warn("operator action #%s: its end not recorded: %s", action_id,
                     PQerrorMessage(db));
        PQclear(e);
        fprintf(out, "recorded as operator action #%s (%s, %ld of %ld parks)\n", action_id,
                action, done, n);
    }
out:
    free(only);
    free(ids);
    PQclear(r);
    PQfinish(db);
    return rc;
}

void groups_show(PGconn *db, const char *key, FILE *out)
{
    const char *params[1] = {key};
    char b1[512], b2[1024], b3[1024];
    PGresult *r = PQexecParams(db, "SELECT count(*) FROM idemq.key_history($1) WHERE kind = "
                                   "'redrive'",
                               1, NULL, params, NULL, NULL, 0);
    if (PQresultStatus(r) == PGRES_TUPLES_OK && PQntuples(r) == 1)
        fprintf(out, "redriven %s time(s)\n", PQgetvalue(r, 0, 0));
    PQclear(r);
    r = PQexecParams(db,
                     "SELECT k.at, a.id, a.action, k.outcome, k.park_id, a.actor,"
                     " coalesce(a.reason, '-'), a.selection"
                     " FROM idemq.operator_action_keys k"
                     " JOIN idemq.operator_actions a ON a.id = k.action_id"
                     " WHERE k.key = $1 ORDER BY k.at, a.id",
                     1, NULL, params, NULL, NULL, 0);
    if (PQresultStatus(r) == PGRES_TUPLES_OK)
        for (int i = 0; i < PQntuples(r); i++)
            fprintf(out, "operator action #%s at %s: %s, park #%s %s, by %s: %s [%s]\n",
                    PQgetvalue(r, i, 1), PQgetvalue(r, i, 0), PQgetvalue(r, i, 2),
                    PQgetvalue(r, i, 4), PQgetvalue(r, i, 3),
                    esc(PQgetvalue(r, i, 5), b1, sizeof b1),
                    esc(PQgetvalue(r, i, 6), b2, sizeof b2),
                    esc(PQgetvalue(r, i, 7), b3, sizeof b3));
    PQclear(r);
}
