/*
 * main: the idemq command line: run, migrate, declare, check-config,
 * publish, and the operator commands (ops.c, reconcile.c, resolve.c). Owns start-up checks and exit codes; the work itself is in
 * worker.c (consuming), ledger/ (the database) and adapters/ (transports).
 */
#include <errno.h>
#include <getopt.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "broker.h"
#include "job.h"
#include "conf.h"
#include "ledger_db.h"
#include "ledger_grants.h"
#include "ledger_migrate.h"
#include "lifecycle.h"
#include "log.h"
#include "rate_gate.h"
#include "run_report.h"
#include "gauges.h"
#include "console.h"
#include "metrics.h"
#include "sdnotify.h"
#include "observe.h"
#include "pgq_worker.h" /* PostgreSQL queue inputs */
#include "ops.h"
#include "effect_http.h"
#include "reconcile.h"
#include "resolve.h"
#include "groups.h"
#include "topology.h"
#include "sig.h"
#include "worker.h"

/* Worker thread stack (see cmd_run): 16 MiB of address space, touched only
 * as deep as the calls go. */
#define WORKER_STACK_BYTES (16u * 1024 * 1024)

/* Exit codes (documented in the README and --help). */
enum {
    EXIT_OK = 0,
    EXIT_RUNTIME = 1,   /* a worker or command failed while running */
    EXIT_USAGE = 2,     /* bad command line */
    EXIT_CONFIG = 3,    /* invalid configuration file */
    EXIT_CONNECT = 4,   /* broker or database unreachable at start-up */
    EXIT_SCHEMA = 5,    /* ledger schema missing or of another version */
    EXIT_TOPOLOGY = 6,  /* queue missing or declared differently */
};

static void usage(FILE *out)
{
    fprintf(out,
            "usage: idemq COMMAND -c FILE [options]\n"
            "\n"
            "commands:\n"
            "  run [--until-idle SECONDS]  consume and apply jobs (until stopped, or until no\n"
            "                              delivery arrived for SECONDS)\n"
            "  migrate [--grant ROLE | --print-grants ROLE]\n"
            "                              apply the ledger schema migrations (idempotent);\n"
            "                              then grant ROLE what `run` needs and nothing more,\n"
            "                              or only print those GRANTs (no database needed)\n"
            "  declare                     declare the exchanges, queues and bindings of the inputs\n"
            "  check-config                validate FILE and print the effective configuration\n"
            "                              (secrets redacted)\n"
            "  publish [--input NAME] [--routing-key KEY]\n"
            "                              publish stdin lines as messages (confirmed) to the\n"
            "                              input's exchange; for demos and tests\n"
            "  jobs show KEY               the full story of one business key, in commit order\n"
            "  parked list [FILTERS]       parked messages and a count by error class\n"
            "  parked groups [FILTERS]     open parks grouped by failure (input, class, code,\n"
            "                              SQLSTATE, reason with keys, numbers and ids masked)\n"
            "  parked redrive [--group ID] [FILTERS] [--dry-run] [--rate N] [--actor NAME]\n"
            "                              redrive the dead-letter copies of the selected parks\n"
            "  parked discard [--group ID] [FILTERS] --reason TEXT [--dry-run] [--rate N]\n"
            "                 [--actor NAME]\n"
            "                              close them as not applied (a redrive of their copy\n"
            "                              is then a duplicate)\n"
            "  parked archive [--group ID] [FILTERS] --reason TEXT [--dry-run] [--rate N]\n"
            "                 [--actor NAME]\n"
            "                              close them, their dead-letter copies stay redrivable;\n"
            "                              actions are recorded (jobs show), N parks per second\n"
            "  redrive [FILTERS] [--dry-run] [--rate N]\n"
            "                              move dead-lettered messages back to their origin\n"
            "                              queue (confirmed, then acked), N per second\n"
            "  FILTERS: --input NAME --key KEY --class CLASS --since TIMESTAMP --limit N\n"
            "  reconcile [--age SECONDS]   look up provider intents left pending or unknown\n"
            "                              longer than provider.reconcile_after_s (or SECONDS)\n"
            "                              and settle them\n"
            "  resolve KEY (--applied REF | --not-applied | --discard) --reason TEXT\n"
            "                              settle a parked provider key by hand (records the\n"
            "                              OS user and the reason)\n"
            "  maintain [--now TIMESTAMP]  ledger maintenance now: partitions ahead, pruning past\n"
            "                              the dedup window, archive, drops (see README)\n"
            "  archive list                history partitions: hot, archived, dropped\n"
            "  archive export --dir DIR [--all]\n"
            "                              archived partitions to DIR as CSV + SHA-256\n"
            "  archive verify --dir DIR    exported files against their SHA-256 and the ledger\n"
            "  observe report [--input NAME] [--since TIMESTAMP]\n"
            "                              the baseline of observe-mode inputs: observed keys,\n"
            "                              duplicates, late replays, would-be parks by code\n"
            "\n"
            "options: -c, --config FILE; -h, --help; -V, --version\n"
            "environment: IDEMQ_AMQP_URL and IDEMQ_PG_DSN override broker.url and database.dsn\n"
            "\n"
            "exit codes: 0 ok, 1 runtime failure, 2 usage, 3 invalid config, 4 broker or\n"
            "database unreachable at start-up, 5 ledger schema not migrated, 6 topology missing\n"
            "or different\n");
}

struct opts {
    const char *cmd;
    const char *sub; /* "show" of "jobs show", "list" of "parked list" */
    const char *arg; /* KEY of "jobs show KEY" */
    const char *config;
    long until_idle_s;
    const char *input;
    const char *routing_key;
    struct ops_filter filter;
    long age_s;              /* reconcile --age; -1 = the config's */
    const char *resolution;  /* resolve: applied, not_applied or discard */
    const char *reference;   /* resolve --applied REF */
    const char *reason;      /* resolve --reason TEXT */
    const char *grant_role; /* migrate --grant ROLE */
    const char *print_role; /* migrate --print-grants ROLE */
    const char *dir; /* archive export/verify */
    bool all;        /* archive export */
    const char *now; /* maintain */
    const char *group; /* parked redrive|discard|archive --group ID */
    const char *actor; /* parked redrive|discard|archive --actor NAME */
};

static int parse_long(const char *opt, const char *s, long min, long max, long *out)
{
    char *end;
    errno = 0;
    *out = strtol(s, &end, 10);
    if (errno || *end || !*s || *out < min || *out > max) {
        fprintf(stderr, "idemq: %s takes a whole number from %ld to %ld\n", opt, min, max);
        return -1;
    }
    return 0;
}

/* Long options without a short form. */
enum { OPT_DIR = 1000, OPT_ALL, OPT_NOW, OPT_GROUP, OPT_ACTOR };

/* parked redrive, discard or archive (issue 20) */
#define PARKED_ACTION(o)                                                                     \
    ((o)->sub && strcmp((o)->cmd, "parked") == 0 && strcmp((o)->sub, "list") != 0 &&        \
     strcmp((o)->sub, "groups") != 0)

static int parse_args(int argc, char **argv, struct opts *o)
{
    static const struct option longopts[] = {
        {"config", required_argument, NULL, 'c'},  {"help", no_argument, NULL, 'h'},
        {"version", no_argument, NULL, 'V'},       {"until-idle", required_argument, NULL, 'i'},
        {"input", required_argument, NULL, 'n'},   {"routing-key", required_argument, NULL, 'r'},
        {"key", required_argument, NULL, 'k'},     {"class", required_argument, NULL, 'C'},
        {"since", required_argument, NULL, 's'},   {"limit", required_argument, NULL, 'l'},
        {"dry-run", no_argument, NULL, 'd'},       {"rate", required_argument, NULL, 'R'},
        /* provider effects (issue 9): reconcile and resolve */
        {"age", required_argument, NULL, 'A'},     {"applied", required_argument, NULL, 'P'},
        {"not-applied", no_argument, NULL, 'N'},   {"discard", no_argument, NULL, 'D'},
        {"reason", required_argument, NULL, 'W'},
        {"grant", required_argument, NULL, 'G'},   {"print-grants", required_argument, NULL, 'Q'},
        /* ledger lifecycle (issue 10): archive and maintain */
        {"dir", required_argument, NULL, OPT_DIR}, {"all", no_argument, NULL, OPT_ALL},
        {"now", required_argument, NULL, OPT_NOW},
        /* failure groups (issue 20) */
        {"group", required_argument, NULL, OPT_GROUP},
        {"actor", required_argument, NULL, OPT_ACTOR}, {NULL, 0, NULL, 0}};
    int c;
    long v;

    memset(o, 0, sizeof o[0]);
    o->age_s = -1;
    while ((c = getopt_long(argc, argv, "c:hV", longopts, NULL)) != -1) {
        switch (c) {
        case 'c': o->config = optarg; break;
        case 'h': usage(stdout); exit(EXIT_OK);
        case 'V': printf("idemq %s\n", IDEMQ_VERSION); exit(EXIT_OK);
        case 'i':
            if (parse_long("--until-idle", optarg, 1, 86400, &o->until_idle_s))
                return -1;
            break;
        case 'n': o->input = o->filter.input = optarg; break;
        case 'r': o->routing_key = optarg; break;
        case 'k': o->filter.key = optarg; break;
        case 'C': o->filter.error_class = optarg; break;
        case 's': o->filter.since = optarg; break;
        case 'l':
            if (parse_long("--limit", optarg, 1, 1000000000L, &o->filter.limit))
                return -1;
            break;
        case 'd': o->filter.dry_run = true; break;
        case 'G': o->grant_role = optarg; break;
        case 'Q': o->print_role = optarg; break;
        case OPT_DIR: o->dir = optarg; break;
        case OPT_ALL: o->all = true; break;
        case OPT_NOW: o->now = optarg; break;
        case OPT_GROUP: o->group = optarg; break;
        case OPT_ACTOR: o->actor = optarg; break;
        case 'R':
            if (parse_long("--rate", optarg, 1, 100000, &v))
                return -1;
            o->filter.rate = (double)v;
            break;
        case 'A':
            if (parse_long("--age", optarg, 0, 86400L * 366, &o->age_s))
                return -1;
            break;
        case 'P':
        case 'N':
        case 'D':
            if (o->resolution) {
                fprintf(stderr, "idemq: give one of --applied REF, --not-applied, --discard\n");
                return -1;
            }
            o->resolution = c == 'P' ? "applied" : c == 'N' ? "not_applied" : "discard";
            o->reference = c == 'P' ? optarg : NULL;
            break;
        case 'W': o->reason = optarg; break;
        default: return -1;
        }
    }
    if (optind >= argc) {
        fprintf(stderr, "idemq: missing command\n");
        return -1;
    }
    o->cmd = argv[optind++];
    if (strcmp(o->cmd, "jobs") == 0 || strcmp(o->cmd, "parked") == 0) {
        const char *want = o->cmd[0] == 'j' ? "show" : "list";
        if (o->cmd[0] == 'p' && optind < argc &&
            (strcmp(argv[optind], "groups") == 0 || strcmp(argv[optind], "redrive") == 0 ||
             strcmp(argv[optind], "discard") == 0 || strcmp(argv[optind], "archive") == 0))
            want = argv[optind];
        if (optind >= argc || strcmp(argv[optind], want) != 0) {
            fprintf(stderr, "idemq: did you mean '%s %s'?\n", o->cmd, want);
            return -1;
        }
        o->sub = argv[optind++];
        if (o->cmd[0] == 'j') {
            if (optind >= argc) {
                fprintf(stderr, "idemq: jobs show needs a KEY\n");
                return -1;
            }
            o->arg = argv[optind++];
        }
    }
    if (strcmp(o->cmd, "resolve") == 0) {
        if (optind >= argc) {
            fprintf(stderr, "idemq: resolve needs a KEY\n");
            return -1;
        }
        o->arg = argv[optind++];
        if (!o->resolution || !o->reason || !*o->reason) {
            fprintf(stderr, "idemq: resolve KEY needs one of --applied REF, --not-applied, "
                            "--discard, and --reason TEXT\n");
            return -1;
        }
    } else if (o->resolution || (o->reason && !PARKED_ACTION(o))) {
        fprintf(stderr, "idemq: --applied, --not-applied, --discard and --reason go with "
                        "resolve\n");
        return -1;
    }
    if ((o->group || o->actor) && !PARKED_ACTION(o)) {
        fprintf(stderr, "idemq: --group and --actor go with parked redrive, discard and "
                        "archive\n");
        return -1;
    }
    if (o->age_s >= 0 && strcmp(o->cmd, "reconcile") != 0) {
        fprintf(stderr, "idemq: --age goes with reconcile\n");
        return -1;
    }
    if (strcmp(o->cmd, "observe") == 0) {
        if (optind >= argc || strcmp(argv[optind], "report") != 0) {
            fprintf(stderr, "idemq: did you mean 'observe report'?\n");
            return -1;
        }
        o->sub = argv[optind++];
    }
    if (strcmp(o->cmd, "archive") == 0) {
        if (optind >= argc || (strcmp(argv[optind], "list") && strcmp(argv[optind], "export") &&
                               strcmp(argv[optind], "verify"))) {
            fprintf(stderr, "idemq: archive takes list, export or verify\n");
            return -1;
        }
        o->sub = argv[optind++];
    }
    if (optind < argc) {
        fprintf(stderr, "idemq: unexpected argument '%s'\n", argv[optind]);
        return -1;
    }
    if (!o->config) {
        fprintf(stderr, "idemq: %s needs -c FILE\n", o->cmd);
        return -1;
    }
    if (o->until_idle_s && strcmp(o->cmd, "run") != 0) {
        fprintf(stderr, "idemq: --until-idle goes with run\n");
        return -1;
    }
    if ((o->grant_role || o->print_role) && strcmp(o->cmd, "migrate") != 0) {
        fprintf(stderr, "idemq: --grant and --print-grants go with migrate\n");
        return -1;
    }
    if (o->grant_role && o->print_role) {
        fprintf(stderr, "idemq: --grant or --print-grants, not both\n");
        return -1;
    }
    if ((o->grant_role && !ledger_grants_role_ok(o->grant_role)) ||
        (o->print_role && !ledger_grants_role_ok(o->print_role))) {
        fprintf(stderr, "idemq: a role name has 1 to 63 characters, none of them control "
                        "characters\n");
        return -1;
    }
    return 0;
}

static PGconn *connect_db(const struct conf *c)
{
    char err[512];
    PGconn *db = ledger_db_connect(c->dsn, "idemq", c->statement_timeout_ms, err, sizeof err);
    if (!db)
        log_error("%s", err);
    return db;
}

static int cmd_migrate(const struct conf *c, const char *grant_role, const char *print_role)
{
    char err[512];
    int applied;
    PGconn *db;

    if (print_role) { /* for review: no database needed */
        ledger_grants_print(c, print_role, stdout);
        return EXIT_OK;
    }
    /* Not the workers' statement_timeout: migrate sets its own timeouts
     * (no statement timeout, a lock_timeout; ledger_migrate_run). */
    if (!(db = ledger_db_connect(c->dsn, "idemq migrate", 0, err, sizeof err)))
        log_error("%s", err);
    if (!db)
        return EXIT_CONNECT;
    if (ledger_migrate_run(db, &applied, err, sizeof err)) {
        log_error("%s", err);
        PQfinish(db);
        return EXIT_SCHEMA;
    }
    printf("ledger schema at version %d (%d migration%s applied)\n", ledger_migrate_latest(),
           applied, applied == 1 ? "" : "s");
    if (lifecycle_migrate_settings(db, c, stdout) != 0) {
        PQfinish(db);
        return EXIT_SCHEMA;
    }
    if (grant_role) {
        if (ledger_grants_apply(db, c, grant_role, err, sizeof err)) {
            int rc = PQstatus(db) == CONNECTION_OK ? EXIT_RUNTIME : EXIT_CONNECT;
            log_error("%s", err);
            PQfinish(db);
            return rc;
        }
        printf("role %s may now run idemq: SELECT on the ledger, EXECUTE on its functions and "
               "on the %d input effect(s); no INSERT, UPDATE, DELETE or DDL\n",
               grant_role, c->n_inputs);
    }
    PQfinish(db);
    return EXIT_OK;
}

static int cmd_declare(const struct conf *c)
{
    char err[512];
    struct broker *b;
    int rc = EXIT_OK;

    if (broker_open(c, "idemq declare", false, &b, err, sizeof err)) {
        log_error("%s", err);
        return EXIT_CONNECT;
    }
    for (int i = 0; i < c->n_inputs && rc == EXIT_OK; i++) {
        if (topology_declare(b, c, &c->inputs[i])) {
            log_error("input %s: %s%s", c->inputs[i].name, broker_error(b),
                      strstr(broker_error(b), "403")
                          ? " (idemq declare needs configure permission on these names: run it "
                            "as an administrator; run itself can do with read and write, with "
                            "topology.verify = \"passive\")"
                          : "");
            rc = EXIT_TOPOLOGY;
        } else if (CONF_INPUT_ORDERED(&c->inputs[i])) {
            const struct conf_input *in = &c->inputs[i];
            printf("input %s: x-consistent-hash exchange %s (hashing %s%s) over %d partition "
                   "queues %s.p0..p%d (%s, single active consumer); retries in place; dead "
                   "letters in %s.dead\n",
                   in->name, in->exchange, in->hash_header[0] ? "header " : "the routing key",
                   in->hash_header, in->partitions, in->queue, in->partitions - 1,
                   in->queue_type, in->queue);
        } else {
            printf("input %s: queue %s (%s)%s%s%s%s; retries via %s.retry.*; dead letters in "
                   "%s.dead\n",
                   c->inputs[i].name, c->inputs[i].queue, c->inputs[i].queue_type,
                   c->inputs[i].exchange[0] ? " bound to " : "", c->inputs[i].exchange,
                   c->inputs[i].exchange[0] ? " with key " : "",
                   c->inputs[i].exchange[0] ? c->inputs[i].routing_key : "", c->inputs[i].queue,
                   c->inputs[i].queue);
        }
    }
    broker_close(b);
    return rc;
}

/* Start-up checks of `run`: reachable services, migrated schema, queues. */
static int preflight(const struct conf *c)
{
    char err[512];
    struct broker *b;
    PGconn *db = connect_db(c);
    int rc = EXIT_OK;

    if (!db)
        return EXIT_CONNECT;
    if (ledger_migrate_check(db, err, sizeof err)) {
        log_error("%s", err);
        rc = PQstatus(db) == CONNECTION_OK ? EXIT_SCHEMA : EXIT_CONNECT;
    } else {
        lifecycle_check_settings(db, c);
    }
    PQfinish(db);
    if (rc || c->n_inputs == 0) /* only PostgreSQL queue inputs: no broker */
        return rc;
    if (broker_open(c, "idemq preflight", false, &b, err, sizeof err)) {
        log_error("%s", err);
        return EXIT_CONNECT;
    }
    for (int i = 0; i < c->n_inputs && rc == EXIT_OK; i++) {
        if (topology_verify(b, c, &c->inputs[i], err, sizeof err)) {
            if (strstr(err, "home node")) { /* a cluster node is down: the workers wait */
                log_warn("%s (a node is down; the workers wait for it)", err);
                continue;
            }
            log_error("%s", err);
            rc = EXIT_TOPOLOGY;
        }
    }
    broker_close(b);
    return rc;
}

static int cmd_run(const struct conf *c, long until_idle_s)
{
    struct worker *ws;
    struct rate_gate *gate = NULL;
    struct metrics_server *metrics = NULL;
    struct console *console = NULL;
    struct gauges *gauges = NULL;
    struct sdnotify *notify = NULL;
    long applied = 0, dups = 0, parked = 0, retried = 0, received = 0, from_ledger = 0,
         deferred = 0;
    int rc;
    /* broker workers only for broker inputs (PostgreSQL queue inputs have
     * their own threads, pgq_worker.h) */
    const int nw = c->n_inputs > 0 ? c->workers : 0;
    struct pgq_workers *pgq = NULL;
    struct pgq_worker_totals pt;

    if ((rc = preflight(c)))
        return rc;
    if (!(ws = calloc((size_t)(nw > 0 ? nw : 1), sizeof *ws)) ||
        (c->max_rate > 0 && !(gate = rate_gate_new(c->max_rate, c->max_rate / 20 + 1)))) {
        log_error("out of memory");
        free(ws);
        return EXIT_RUNTIME;
    }
    {
        struct log_fields lf = LOG_FIELDS_NONE;
        lf.event = "start";
        LOG_FIELDS(LOG_LVL_INFO, &lf, "idemq %s: %d worker(s), %d input(s), batch_max %d, "
                   "consumer %s; worst case of deliveries held per worker %lld MiB",
                   IDEMQ_VERSION, c->workers, c->n_inputs + c->n_pg_inputs, c->batch_max,
                   c->consumer_id,
                   c->buffered_worst / (1024 * 1024));
    }
    /* A known stack size: librabbitmq-c 0.11 decodes nested header tables
     * recursively (fixed in 0.14); a header frame is bounded by frame_max
     * (128 KiB), which bounds that depth to what this stack holds. */
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setstacksize(&attr, WORKER_STACK_BYTES);
    for (int i = 0; i < nw; i++) {
        worker_init(&ws[i], i, c, (int)(until_idle_s * 1000));
        ws[i].gate = gate;
        if (pthread_create(&ws[i].thread, &attr, worker_thread, &ws[i]) != 0) {
            log_error("cannot start worker thread %d", i);
            pthread_attr_destroy(&attr);
            sig_request_stop();
            for (int k = 0; k < i; k++)
                pthread_join(ws[k].thread, NULL);
            free(ws);
            rate_gate_free(gate);
            return EXIT_RUNTIME;
        }
    }
    pthread_attr_destroy(&attr);
    {
        char err[256];
        if (pgq_worker_start(c, until_idle_s * 1000, &pgq, err, sizeof err)) {
            log_error("%s", err);
            rc = EXIT_RUNTIME; /* the broker workers see the stop request */
        }
    }
    if (c->metrics_listen[0]) {
        char err[256];
        if (gauges_start(c, &gauges, err, sizeof err))
            log_error("%s (running without the deferred gauges)", err);
        if (metrics_start(c, ws, nw, gauges, &metrics, err, sizeof err))
            log_error("%s (running without the metrics endpoint)", err);
        else
            log_info("metrics, readiness and liveness on http://%s/metrics, /ready and /live",
                     c->metrics_listen);
    }
    if (c->console_listen[0]) { /* issue 20: the web console */
        char err[256];
        if (console_start(c, ws, nw, gauges, &console, err, sizeof err))
            log_error("%s (running without the console)", err);
        else
            log_info("web console on http://%s/", c->console_listen);
    }
    {
        char err[256];
        if (sdnotify_start(c, ws, nw, &notify, err, sizeof err))
            log_error("%s (running without systemd notifications)", err);
    }
    for (int i = 0; i < nw; i++) {
        pthread_join(ws[i].thread, NULL);
        if (ws[i].result) {
            log_error("worker %d failed: %s", i, ws[i].error);
            rc = EXIT_RUNTIME;
        }
        received += atomic_load(&ws[i].stats.received);
        from_ledger += atomic_load(&ws[i].stats.from_ledger);
        deferred += atomic_load(&ws[i].stats.deferred);
        applied += atomic_load(&ws[i].stats.applied);
        dups += atomic_load(&ws[i].stats.duplicates);
        parked += atomic_load(&ws[i].stats.parked);
        retried += atomic_load(&ws[i].stats.retried);
    }
    pgq_worker_join(pgq, &pt);
    if (pt.failed)
        rc = EXIT_RUNTIME;
    sdnotify_stop(notify);
    if (c->n_pg_inputs) {
        struct log_fields lf = LOG_FIELDS_NONE;
        lf.event = "stopped";
        LOG_FIELDS(LOG_LVL_INFO, &lf,
                   "stopped (PostgreSQL queue inputs): taken %ld, applied %ld, duplicates %ld, "
                   "retried %ld, parked %ld",
                   pt.taken, pt.applied, pt.duplicates, pt.retried, pt.parked);
    }
    {
        struct log_fields lf = LOG_FIELDS_NONE;
        lf.event = "stopped";
        LOG_FIELDS(LOG_LVL_INFO, &lf,
                   "stopped: received %ld (+%ld from the deferred store), applied %ld, "
                   "duplicates %ld, deferred %ld, retried %ld, parked %ld",
                   received, from_ledger, applied, dups, deferred, retried, parked);
    }
    observe_log_summary(c); /* observe-mode inputs (issue 20) */
    run_report_log(ws, nw);
    console_stop(console);
    metrics_stop(metrics);
    gauges_stop(gauges);
    for (int i = 0; i < nw; i++)
        worker_destroy(&ws[i]);
    free(ws);
    rate_gate_free(gate);
    return rc;
}

static int cmd_publish(const struct conf *c, const char *input, const char *routing_key)
{
    const struct conf_input *in = NULL;
    struct broker *b;
    char err[512];
    char *line = NULL;
    size_t cap = 0;
    ssize_t len;
    long sent = 0, window = 0;
    int rc = EXIT_OK;

    for (int i = 0; i < c->n_inputs; i++)
        if (!input || strcmp(c->inputs[i].name, input) == 0) {
            in = &c->inputs[i];
            break;
        }
    if (!in) {
        fprintf(stderr, "idemq: no input named %s\n", input);
        return EXIT_USAGE;
    }
    if (CONF_INPUT_ORDERED(in) && in->hash_header[0]) {
        /* a message without the hash header lands in one fixed partition */
        fprintf(stderr, "idemq: input %s hashes on header %s, which publish does not set\n",
                in->name, in->hash_header);
        return EXIT_USAGE;
    }
    if (broker_open(c, "idemq publish", true, &b, err, sizeof err)) {
        log_error("%s", err);
        return EXIT_CONNECT;
    }
    while ((len = getline(&line, &cap, stdin)) > 0) {
        const char *rk = routing_key ? routing_key : in->routing_key;
        struct job j;
        if (line[len - 1] == '\n')
            line[--len] = '\0';
        if (len == 0)
            continue;
        job_init(&j);
        if (CONF_INPUT_ORDERED(in) && !routing_key && job_set_body(&j, line, (size_t)len) == 0) {
            /* partitioned: hash the ordering key (else the idempotency key) */
            job_decode(&j, in);
            rk = j.has_order_key ? j.order_key : j.has_key ? j.key : rk;
        }
        if (broker_publish(b, in->exchange, rk, line, (size_t)len, NULL)) {
            job_destroy(&j);
            rc = EXIT_RUNTIME;
            break;
        }
        job_destroy(&j);
        sent++;
        if (++window == 500) {
            if (broker_wait_confirms(b, 30000)) {
                rc = EXIT_RUNTIME;
                break;
            }
            window = 0;
        }
    }
    if (rc == EXIT_OK && broker_wait_confirms(b, 30000))
        rc = EXIT_RUNTIME;
    if (rc)
        log_error("publish failed after %ld messages: %s", sent, broker_error(b));
    else
        printf("published %ld messages to exchange '%s' (confirmed)\n", sent, in->exchange);
    free(line);
    broker_close(b);
    return rc;
}

int main(int argc, char **argv)
{
    struct opts o;
    struct conf *c = NULL;
    char err[1024];
    int rc;

    if (parse_args(argc, argv, &o) != 0) {
        usage(stderr);
        return EXIT_USAGE;
    }
    if (strcmp(o.cmd, "run") && strcmp(o.cmd, "migrate") && strcmp(o.cmd, "declare") &&
        strcmp(o.cmd, "check-config") && strcmp(o.cmd, "publish") && strcmp(o.cmd, "jobs") &&
        strcmp(o.cmd, "parked") && strcmp(o.cmd, "redrive") && strcmp(o.cmd, "reconcile") &&
        strcmp(o.cmd, "resolve") && strcmp(o.cmd, "maintain") && strcmp(o.cmd, "archive") &&
        strcmp(o.cmd, "observe")) {
        fprintf(stderr, "idemq: unknown command '%s'\n", o.cmd);
        usage(stderr);
        return EXIT_USAGE;
    }
    if (conf_load(o.config, &c, err, sizeof err)) {
        fprintf(stderr, "idemq: %s\n", err);
        return EXIT_CONFIG;
    }
    log_current_level = log_level_parse(c->log_level);
    log_configure(strcmp(c->log_format, "json") == 0, c->consumer_id);
    sig_install();
    if (strcmp(o.cmd, "run") == 0 || strcmp(o.cmd, "check-config") == 0) {
        for (int i = 0; i < c->n_inputs; i++) { /* insecure provider transport (D14) */
            char warn[512];
            if (conf_input_insecure(&c->inputs[i], warn, sizeof warn))
                log_warn("%s", warn);
        }
    }
    if (strcmp(o.cmd, "check-config") == 0) {
        struct effect_http *h = NULL; /* provider credentials and CA files, issue 9 */
        if (effect_http_new(c, &h, err, sizeof err) != IDEMQ_OK) {
            fprintf(stderr, "idemq: %s: %s\n", o.config, err);
            rc = EXIT_CONFIG;
        } else {
            printf("# %s is valid; effective configuration:\n", o.config);
            conf_warn_consumer_timeout(c, stderr);
            conf_print(c, stdout);
            rc = EXIT_OK;
        }
        effect_http_free(h);
    } else if (strcmp(o.cmd, "migrate") == 0) {
        rc = cmd_migrate(c, o.grant_role, o.print_role);
    } else if (strcmp(o.cmd, "declare") == 0) {
        rc = cmd_declare(c);
    } else if (strcmp(o.cmd, "publish") == 0) {
        rc = cmd_publish(c, o.input, o.routing_key);
    } else if (strcmp(o.cmd, "jobs") == 0) {
        rc = ops_jobs_show(c, o.arg, stdout);
    } else if (strcmp(o.cmd, "parked") == 0) {
        rc = strcmp(o.sub, "list") == 0     ? ops_parked_list(c, &o.filter, stdout)
             : strcmp(o.sub, "groups") == 0 ? groups_list(c, &o.filter, stdout)
                                            : groups_act(c, o.sub, &o.filter, o.group, o.reason,
                                                         o.actor, stdout);
    } else if (strcmp(o.cmd, "redrive") == 0) {
        rc = ops_redrive(c, &o.filter, stdout);
    } else if (strcmp(o.cmd, "reconcile") == 0) {
        rc = reconcile_cmd(c, (int)o.age_s, stdout);
    } else if (strcmp(o.cmd, "resolve") == 0) {
        rc = resolve_cmd(c, o.arg, o.resolution, o.reference, o.reason, stdout);
    } else if (strcmp(o.cmd, "maintain") == 0) {
        rc = lifecycle_maintain(c, o.now, stdout);
    } else if (strcmp(o.cmd, "observe") == 0) {
        rc = observe_report(c, o.filter.input, o.filter.since, stdout);
    } else if (strcmp(o.cmd, "archive") == 0) {
        rc = o.sub[0] == 'l'   ? lifecycle_archive_list(c, stdout)
             : o.sub[0] == 'e' ? lifecycle_archive_export(c, o.dir, o.all, stdout)
                               : lifecycle_archive_verify(c, o.dir, stdout);
    } else {
        rc = cmd_run(c, o.until_idle_s);
    }
    conf_free(c);
    return rc;
}
