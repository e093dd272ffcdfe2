/*
 * idemq-bench: the C helper of scripts/bench. It publishes benchmark jobs
 * (persistent, confirmed, optionally at a fixed rate), drains a queue with a
 * consumer that only acknowledges (the broker-only ceiling: same adapter,
 * same prefetch, no database), runs the lean reference consumer (the least
 * an exactly-once consumer can do on this workload, see cmd_lean), and
 * reads a queue's message count. It reuses idemq's own AMQP adapter
 * (adapters/broker.h) and config loader.
 *
 *   idemq-bench publish -c CFG -n N --run ID [--dup-pct P] [--rate R] [--traced]
 *                       [--soak-window S] [--transient-permille T] [--permanent-permille P]
 *                       [--old-keys K --old-pct Q]
 *   idemq-bench drain   -c CFG -n N [--batch B]
 *   idemq-bench lean    -c CFG -n N [--batch B] [--workers W]
 *   idemq-bench count   -c CFG
 *   idemq-bench reset   -c CFG      (delete the input's queue, declare it again)
 *
 * Every command acts on the configuration's first input, or on the one
 * --input NAME names (the outbox case of scripts/bench: its second input
 * consumes what the first one's effect emits).
 *
 * Output is one line of key=value pairs on stdout, for the script to read.
 */
#include <errno.h>
#include <getopt.h>
#include <libpq-fe.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>

#include "broker.h"
#include "broker_admin.h"
#include "topology.h"
#include "conf.h"
#include "job.h"
#include "ledger_db.h"
#include "log.h"

#define CONFIRM_WINDOW 1000 /* publishes between two confirm waits */
#define BODY_TARGET 200     /* approximate body size in bytes */

struct opts {
    const char *cmd;
    const char *config;
    const char *run;
    long n;
    int dup_pct;
    double rate;
    int batch;
    int workers;
    long soak_window;    /* > 0: soak mode (see body_for) */
    int transient_pm;    /* new keys failing once, transiently, per mille */
    int permanent_pm;    /* new keys failing for good (parked), per mille */
    const char *input;   /* --input NAME: the input acted on (NULL: the first) */
    long old_keys;       /* keys scripts/ledger-fill wrote (payout:inv-0 .. K-1) */
    int old_pct;         /* per cent of jobs that are copies of one of them */
    bool traced;         /* a W3C traceparent header on each message */
};

static int sel_input; /* index of the input acted on (main, from --input) */

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static void sleep_until(double t)
{
    double left = t - now_s();
    if (left > 0) {
        struct timespec ts = {(time_t)left, (long)((left - (double)(time_t)left) * 1e9)};
        nanosleep(&ts, NULL);
    }
}

static void usage(void)
{
    fprintf(stderr, "usage: idemq-bench publish -c CFG -n N --run ID [--dup-pct P] [--rate R]\n"
                    "                           [--traced] (a W3C traceparent header each)\n"
                    "                           [--old-keys K --old-pct Q]\n"
                    "       idemq-bench drain -c CFG -n N [--batch B]\n"
                    "       idemq-bench lean -c CFG -n N [--batch B] [--workers W]\n"
                    "       idemq-bench count -c CFG\n"
                    "       idemq-bench reset -c CFG\n"
                    "(every command: [--input NAME], default the first input)\n");
}

static int parse(int argc, char **argv, struct opts *o)
{
    static const struct option longopts[] = {
        {"config", required_argument, NULL, 'c'}, {"jobs", required_argument, NULL, 'n'},
        {"run", required_argument, NULL, 'r'},    {"dup-pct", required_argument, NULL, 'd'},
        {"rate", required_argument, NULL, 'R'},   {"batch", required_argument, NULL, 'b'},
        {"workers", required_argument, NULL, 'w'}, {"soak-window", required_argument, NULL, 's'},
        {"transient-permille", required_argument, NULL, 't'},
        {"permanent-permille", required_argument, NULL, 'p'},
        {"input", required_argument, NULL, 'i'},
        {"old-keys", required_argument, NULL, 'K'}, {"old-pct", required_argument, NULL, 'Q'},
        {"traced", no_argument, NULL, 'T'},
        {NULL, 0, NULL, 0}};
    int c;
    char *end;

    memset(o, 0, sizeof *o);
    o->dup_pct = 10;
    o->batch = 100;
    o->workers = 1;
    while ((c = getopt_long(argc, argv, "c:n:", longopts, NULL)) != -1) {
        errno = 0;
        switch (c) {
        case 'c': o->config = optarg; break;
        case 'n': o->n = strtol(optarg, &end, 10); break;
        case 'r': o->run = optarg; break;
        case 'd': o->dup_pct = (int)strtol(optarg, &end, 10); break;
        case 'R': o->rate = strtod(optarg, &end); break;
        case 'b': o->batch = (int)strtol(optarg, &end, 10); break;
        case 'w': o->workers = (int)strtol(optarg, &end, 10); break;
        case 's': o->soak_window = strtol(optarg, &end, 10); break;
        case 't': o->transient_pm = (int)strtol(optarg, &end, 10); break;
        case 'p': o->permanent_pm = (int)strtol(optarg, &end, 10); break;
        case 'i': o->input = optarg; break;
        case 'K': o->old_keys = strtol(optarg, &end, 10); break;
        case 'Q': o->old_pct = (int)strtol(optarg, &end, 10); break;
        case 'T': o->traced = true; end = (char *)""; break;
        default: return -1;
        }
        if (c != 'c' && c != 'r' && c != 'i' && (errno || *end))
            return -1;
    }
    if (optind != argc - 1 || !o->config)
        return -1;
    o->cmd = argv[optind];
    if (o->dup_pct < 0 || o->dup_pct > 90 || o->batch < 1 || o->rate < 0 || o->workers < 1 ||
        o->workers > 64 || o->soak_window < 0 || (o->soak_window && o->rate <= 0) ||
        o->transient_pm < 0 || o->permanent_pm < 0 || o->transient_pm + o->permanent_pm > 1000 ||
        o->old_keys < 0 || o->old_pct < 0 || o->old_pct > 100 || (o->old_pct && !o->old_keys))
        return -1;
    return 0;
}

/* What body_for chose for a job, for the caller's counts. */
struct job_kind {
    long key;       /* key index */
    bool dup;       /* repeats an earlier key */
    bool old;       /* soak: repeats a key older than the soak window */
    bool prefilled; /* a copy of a key scripts/ledger-fill wrote */
    int fail;       /* 0 none, 1 fails once (transient), 2 fails for good */
};

static unsigned long long mix(unsigned long long x)
{
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    return x;
}

/*
 * Job i of a run: every (100 / dup_pct)-th job repeats the key of an
 * earlier job (spread over the stream, sometimes within one batch), all
 * others carry a new key. *unique counts the new keys so far. In soak mode
 * (soak_window > 0, paced at rate) a repeat is of a key published within
 * the last minute, or, for one repeat in a hundred, of a key older than the
 * soak window (a late replay, carrying its original timestamp); and a new
 * key fails once (transient_pm per mille) or for good (permanent_pm: no
 * account, parked) by its index. With --old-pct Q, Q per cent of the jobs
 * (by a hash of i) are instead copies of a key of a pre-filled ledger
 * (scripts/ledger-fill: payout:inv-0 .. old_keys-1) with the body its
 * digest was made from: duplicates of applied keys anywhere in the ledger.
 */
static int body_for(const struct opts *o, long i, long *unique, char *buf, size_t len,
                    struct job_kind *kind)
{
    long k;
    int n;
    unsigned long long h = (unsigned long long)i * 0x9E3779B97F4A7C15ull;
    bool dup = false;

    memset(kind, 0, sizeof *kind);
    if (o->old_pct > 0 && (long)(mix((unsigned long long)i ^ 0x5bd1e995ull) % 100) < o->old_pct) {
        /* a copy of pre-filled key k, with the body scripts/ledger_fill.sql
         * hashed for it (idemq_fill.body): a duplicate of an applied key */
        k = (long)(mix((unsigned long long)i * 31 + 7) % (unsigned long long)o->old_keys);
        kind->key = k;
        kind->dup = kind->prefilled = true;
        return snprintf(buf, len,
                        "{\"job_id\":\"payout:inv-%ld\",\"account_id\":\"acct-%04ld\","
                        "\"amount_minor\":%ld,\"currency\":\"EUR\"}",
                        k, k % 9973, 100 + k % 100000);
    }
    if (o->dup_pct > 0 && *unique > 0)
        dup = (i * o->dup_pct) / 100 != ((i + 1) * o->dup_pct) / 100;
    if (dup && o->soak_window > 0) {
        long recent = (long)o->rate * 60, window = (long)o->rate * o->soak_window;
        if ((h >> 20) % 100 == 0 && *unique > window + 1) { /* a late replay */
            k = (long)((h >> 27) % (unsigned long long)(*unique - window));
            kind->old = true;
        } else {
            long span = recent < *unique ? recent : *unique;
            k = *unique - 1 - (long)((h >> 40) % (unsigned long long)span);
        }
    } else if (dup && (h & 3) == 0) /* a recent key: often a duplicate inside one batch */
        k = *unique - 1 - (long)((h >> 40) % 50 % (unsigned long long)*unique);
    else if (dup)
        k = (long)((h >> 17) % (unsigned long long)*unique);
    else
        k = (*unique)++;
    kind->key = k;
    kind->dup = dup;
    {
        unsigned long long f = mix((unsigned long long)k) % 1000;
        kind->fail = (int)f < o->permanent_pm                     ? 2
                     : (int)f < o->permanent_pm + o->transient_pm ? 1
                                                                 : 0;
    }
    if (kind->fail == 2)
        n = snprintf(buf, len,
                     "{\"job_id\":\"bench:%s:%08ld\",\"amount_minor\":%ld,\"currency\":\"EUR\","
                     "\"memo\":\"",
                     o->run, k, 100 + k % 100000);
    else
        n = snprintf(buf, len,
                     "{\"job_id\":\"bench:%s:%08ld\",\"account_id\":\"acct-%04ld\","
                     "\"amount_minor\":%ld,\"currency\":\"EUR\",%s\"memo\":\"",
                     o->run, k, k % 9973, 100 + k % 100000,
                     kind->fail == 1 ? "\"simulate_busy_attempts\":1," : "");
    while (n < BODY_TARGET - 2 && (size_t)n + 3 < len) {
        buf[n] = (char)('a' + n % 26);
        n++;
    }
    n += snprintf(buf + n, len - (size_t)n, "\"}");
    return n;
}

static int cmd_publish(const struct conf *c, const struct opts *o)
{
    const struct conf_input *in = &c->inputs[sel_input];
    struct broker *b;
    char err[512], body[512];
    long unique = 0, window = 0, dups = 0, late = 0, transient = 0, permanent = 0, prefilled = 0;
    double t0, t1;
    time_t wall0 = time(NULL);

    if (!o->run || o->n < 1) {
        usage();
        return 2;
    }
    if (broker_open(c, "idemq-bench publish", true, &b, err, sizeof err)) {
        fprintf(stderr, "idemq-bench: %s\n", err);
        return 1;
    }
    t0 = now_s();
    for (long i = 0; i < o->n; i++) {
        struct job_kind kind;
        int len = body_for(o, i, &unique, body, sizeof body, &kind);
        json_t *orig = NULL, *hdr = NULL;
        struct broker_props props = {NULL, "application/json", NULL, true, NULL, NULL};
        if (o->traced) { /* a W3C traceparent per message, as an instrumented producer's */
            char tp[64];
            snprintf(tp, sizeof tp, "00-%016lx%016lx-%016lx-01", (unsigned long)wall0,
                     (unsigned long)i + 1, (unsigned long)i + 1);
            hdr = json_pack("{s:s}", "traceparent", tp);
            props.headers = hdr;
        }
        if (kind.prefilled)
            prefilled++;
        else if (kind.dup) {
            dups++;
            late += kind.old;
        } else {
            transient += kind.fail == 1;
            permanent += kind.fail == 2;
        }
        if (o->soak_window > 0) {
            /* the key's original publish time (a replay keeps it) */
            orig = json_pack("{s:I}", "timestamp",
                             (json_int_t)(wall0 + (time_t)((double)kind.key / o->rate)));
            props.original = orig;
        }
        /* Paced: sleep only when more than 1 ms ahead of the schedule (a
         * sleep per message would cost the machine more than the publish). */
        if (o->rate > 0 && t0 + (double)i / o->rate > now_s() + 0.001)
            sleep_until(t0 + (double)i / o->rate);
        if (broker_publish(b, in->exchange, in->routing_key, body, (size_t)len, &props)) {
            json_decref(orig);
            json_decref(hdr);
            goto fail;
        }
        json_decref(orig);
        json_decref(hdr);
        /* Flat out: wait for the confirms every CONFIRM_WINDOW messages. At
         * a fixed rate: every 10 ms worth of messages, take the confirms that
         * have arrived without blocking on the rest, so the offered load
         * stays smooth instead of stalling and bursting. */
        if (++window >= (o->rate > 0 ? (long)(o->rate / 100) + 1 : CONFIRM_WINDOW)) {
            idemq_err_t e = broker_wait_confirms(b, o->rate > 0 ? 1 : 60000);
            if (e && !(e == IDEMQ_ERR_TIMEOUT && o->rate > 0))
                goto fail;
            window = 0;
        }
    }
    if (broker_wait_confirms(b, 60000))
        goto fail;
    t1 = now_s();
    printf("published=%ld unique=%ld seconds=%.3f rate=%.0f dups=%ld late=%ld transient=%ld "
           "permanent=%ld prefilled=%ld\n",
           o->n, unique, t1 - t0, (double)o->n / (t1 - t0), dups, late, transient, permanent,
           prefilled);
    broker_close(b);
    return 0;
fail:
    fprintf(stderr, "idemq-bench: publish failed: %s\n", broker_error(b));
    broker_close(b);
    return 1;
}

static int cmd_drain(const struct conf *c, const struct opts *o)
{
    const struct conf_input *in = &c->inputs[sel_input];
    struct broker *b;
    struct job j;
    char err[512];
    long got = 0, pending = 0;
    uint64_t last_tag = 0;
    double first = 0, last = 0;
    int rc = 1;

    if (o->n < 1) {
        usage();
        return 2;
    }
    job_init(&j);
    if (broker_open(c, "idemq-bench drain", false, &b, err, sizeof err)) {
        fprintf(stderr, "idemq-bench: %s\n", err);
        job_destroy(&j);
        return 1;
    }
    if (broker_qos(b, c->prefetch) || broker_consume(b, 0, in, "bench"))
        goto fail;
    while (got < o->n) {
        /* Same shape as idemq: collect up to a batch, then one multiple ack. */
        idemq_err_t e = broker_next(b, &j, pending ? c->batch_wait_ms : 30000);
        if (e == IDEMQ_OK) {
            if (!got)
                first = now_s();
            got++;
            pending++;
            last_tag = j.tag;
            if (pending < o->batch && got < o->n)
                continue;
        } else if (e != IDEMQ_ERR_TIMEOUT) {
            goto fail;
        } else if (!pending) {
            fprintf(stderr, "idemq-bench: no delivery for 30 s after %ld messages\n", got);
            goto out;
        }
        if (broker_ack(b, last_tag, true))
            goto fail;
        pending = 0;
        last = now_s();
    }
    printf("drained=%ld seconds=%.3f rate=%.0f prefetch=%d batch=%d\n", got, last - first,
           (double)got / (last - first), c->prefetch, o->batch);
    rc = 0;
    goto out;
fail:
    fprintf(stderr, "idemq-bench: drain failed: %s\n", broker_error(b));
out:
    broker_close(b);
    job_destroy(&j);
    return rc;
}

/*
 * The lean reference consumer: the least an exactly-once consumer can do on
 * this workload, to compare idemq with (scripts/bench prints ratio_to_lean).
 * Each of W threads has its own AMQP connection (same prefetch) and
 * PostgreSQL session; it collects up to B deliveries (waiting batch_wait_ms
 * after the first, like idemq), then runs ONE statement in its own
 * transaction (autocommit: statement and commit in one round trip): claim
 * every distinct key with INSERT ... ON CONFLICT DO NOTHING into a bare key
 * table (bench_lean.keys, key text PRIMARY KEY) and call the same effect
 * function for the keys it claimed; then one multiple ack. No history, no
 * retries, no parking: a failing batch stops the run.
 */
#define LEAN_SQL                                                                              \
    "WITH b AS (SELECT e->>'job_id' AS k, e AS p, x.o FROM jsonb_array_elements($1::jsonb) "  \
    "  WITH ORDINALITY AS x(e, o)), "                                                         \
    "c AS (INSERT INTO bench_lean.keys AS t (key) SELECT DISTINCT b.k FROM b ORDER BY 1 "     \
    "  ON CONFLICT (key) DO NOTHING RETURNING t.key) "                                        \
    "SELECT count(%s(f.k, f.p, '{\"attempt\": 1}'::jsonb)) FROM ("                            \
    "  SELECT DISTINCT ON (b.k) b.k, b.p, b.o FROM b JOIN c ON c.key = b.k "                  \
    "  ORDER BY b.k, b.o) f"

struct lean_shared {
    const struct conf *c;
    const struct opts *o;
    atomic_long done;   /* deliveries acknowledged after their commit, all threads */
    atomic_long applied; /* effects */
    atomic_int failed;
    pthread_mutex_t lock;
    double first, last; /* first delivery, last ack (under lock) */
};

static void *lean_thread(void *arg)
{
    struct lean_shared *sh = arg;
    const struct conf *c = sh->c;
    const struct conf_input *in = &c->inputs[sel_input];
    struct broker *b = NULL;
    PGconn *db = NULL;
    struct job j;
    char err[512], sql[1024];
    char *doc = NULL;
    size_t len = 0, cap = 0;
    long pending = 0;
    uint64_t last_tag = 0;
    double first = 0, last = 0;

    job_init(&j);
    snprintf(sql, sizeof sql, LEAN_SQL, in->effect_function);
    if (!(db = ledger_db_connect(c->dsn, "idemq-bench lean", 0, err, sizeof err)) ||
        broker_open(c, "idemq-bench lean", false, &b, err, sizeof err)) {
        fprintf(stderr, "idemq-bench: %s\n", err);
        goto fail;
    }
    if (broker_qos(b, c->prefetch) || broker_consume(b, 0, in, "lean")) {
        fprintf(stderr, "idemq-bench: %s\n", broker_error(b));
        goto fail;
    }
    while (atomic_load(&sh->done) < sh->o->n && !atomic_load(&sh->failed)) {
        idemq_err_t e = broker_next(b, &j, pending ? c->batch_wait_ms : 200);
        if (e == IDEMQ_OK) {
            if (len + j.body_len + 3 > cap) {
                size_t ncap = cap ? cap * 2 : 65536;
                char *nd;
                while (ncap < len + j.body_len + 3)
                    ncap *= 2;
                if (!(nd = realloc(doc, ncap)))
                    goto fail;
                doc = nd;
                cap = ncap;
            }
            doc[len++] = pending ? ',' : '[';
            memcpy(doc + len, j.body, j.body_len);
            len += j.body_len;
            if (!first)
                first = now_s();
            pending++;
            last_tag = j.tag;
            if (pending < sh->o->batch)
                continue;
        } else if (e != IDEMQ_ERR_TIMEOUT) {
            fprintf(stderr, "idemq-bench: lean: %s\n", broker_error(b));
            goto fail;
        } else if (!pending) {
            continue;
        }
        {
            const char *params[1] = {doc};
            PGresult *r;
            doc[len++] = ']';
            doc[len] = '\0';
            r = PQexecParams(db, sql, 1, NULL, params, NULL, NULL, 0);
            if (PQresultStatus(r) != PGRES_TUPLES_OK) {
                fprintf(stderr, "idemq-bench: lean: %s", PQerrorMessage(db));
                PQclear(r);
                goto fail;
            }
            atomic_fetch_add(&sh->applied, atol(PQgetvalue(r, 0, 0)));
            PQclear(r);
        }
        if (broker_ack(b, last_tag, true)) {
            fprintf(stderr, "idemq-bench: lean: %s\n", broker_error(b));
            goto fail;
        }
        last = now_s();
        atomic_fetch_add(&sh->done, pending);
        pending = 0;
        len = 0;
    }
    goto out;
fail:
    atomic_store(&sh->failed, 1);
out:
    pthread_mutex_lock(&sh->lock);
    if (first && (!sh->first || first < sh->first))
        sh->first = first;
    if (last > sh->last)
        sh->last = last;
    pthread_mutex_unlock(&sh->lock);
    free(doc);
    broker_close(b);
    if (db)
        PQfinish(db);
    job_destroy(&j);
    return NULL;
}

static int cmd_lean(const struct conf *c, const struct opts *o)
{
    struct lean_shared sh;
    pthread_t th[64];
    int started = 0;

    if (o->n < 1) {
        usage();
        return 2;
    }
    memset(&sh, 0, sizeof sh);
    sh.c = c;
    sh.o = o;
    pthread_mutex_init(&sh.lock, NULL);
    for (int i = 0; i < o->workers; i++)
        if (pthread_create(&th[i], NULL, lean_thread, &sh) == 0)
            started++;
    for (int i = 0; i < started; i++)
        pthread_join(th[i], NULL);
    pthread_mutex_destroy(&sh.lock);
    if (atomic_load(&sh.failed) || started != o->workers || sh.last <= sh.first)
        return 1;
    {
        struct rusage ru; /* the whole process, as idemq's perf line counts its own */
        double cpu = 0;
        if (getrusage(RUSAGE_SELF, &ru) == 0)
            cpu = (double)ru.ru_utime.tv_sec + (double)ru.ru_stime.tv_sec +
                  ((double)ru.ru_utime.tv_usec + (double)ru.ru_stime.tv_usec) / 1e6;
        printf("lean=%ld applied=%ld seconds=%.3f rate=%.0f workers=%d batch=%d cpu_s=%.3f\n",
               atomic_load(&sh.done), atomic_load(&sh.applied), sh.last - sh.first,
               (double)atomic_load(&sh.done) / (sh.last - sh.first), o->workers, o->batch, cpu);
    }
    return 0;
}

static int cmd_count(const struct conf *c)
{
    struct broker *b;
    char err[512];
    uint32_t n = 0;
    if (broker_open(c, "idemq-bench count", false, &b, err, sizeof err)) {
        fprintf(stderr, "idemq-bench: %s\n", err);
        return 1;
    }
    if (broker_admin_queue_counts(b, c->inputs[sel_input].queue, &n, NULL)) {
        fprintf(stderr, "idemq-bench: %s\n", broker_error(b));
        broker_close(b);
        return 1;
    }
    printf("messages=%u\n", n);
    broker_close(b);
    return 0;
}

static int cmd_reset(const struct conf *c)
{
    struct broker *b;
    char err[512];
    int rc = 0;
    if (broker_open(c, "idemq-bench reset", false, &b, err, sizeof err)) {
        fprintf(stderr, "idemq-bench: %s\n", err);
        return 1;
    }
    if (broker_admin_delete_queue(b, c->inputs[sel_input].queue) ||
        topology_declare(b, c, &c->inputs[sel_input])) {
        fprintf(stderr, "idemq-bench: %s\n", broker_error(b));
        rc = 1;
    }
    broker_close(b);
    return rc;
}

int main(int argc, char **argv)
{
    struct opts o;
    struct conf *c;
    char err[1024];
    int rc;

    if (parse(argc, argv, &o)) {
        usage();
        return 2;
    }
    if (conf_load(o.config, &c, err, sizeof err)) {
        fprintf(stderr, "idemq-bench: %s\n", err);
        return 3;
    }
    log_current_level = LOG_LVL_WARN;
    if (o.input) {
        sel_input = -1;
        for (int i = 0; i < c->n_inputs && sel_input < 0; i++)
            if (strcmp(c->inputs[i].name, o.input) == 0)
                sel_input = i;
        if (sel_input < 0) {
            fprintf(stderr, "idemq-bench: %s has no input named %s\n", o.config, o.input);
            conf_free(c);
            return 2;
        }
    }
    if (strcmp(o.cmd, "publish") == 0)
        rc = cmd_publish(c, &o);
    else if (strcmp(o.cmd, "drain") == 0)
        rc = cmd_drain(c, &o);
    else if (strcmp(o.cmd, "lean") == 0)
        rc = cmd_lean(c, &o);
    else if (strcmp(o.cmd, "count") == 0)
        rc = cmd_count(c);
    else if (strcmp(o.cmd, "reset") == 0)
        rc = cmd_reset(c);
    else {
        usage();
        rc = 2;
    }
    conf_free(c);
    return rc;
}
