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
#include "protect.h"
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
#include "sqs.h"
#include "sqs_worker.h" /* Amazon SQS inputs */
#include "ops.h"
#include "effect_http.h"
#include "effect_sql.h"
#include "reconcile.h"
#include "resolve.h"
#include "groups.h"
#include "topology.h"
#include "sig.h"
#include "trace_export.h"
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
            "  migrate [--grant ROLE] [--grant-operator ROLE] [--grant-app ROLE]\n"
            "                              apply the ledger schema migrations (idempotent);\n"
            "                              then create each ROLE if missing and grant it what\n"
            "                              `run`, an operator or an application that emits\n"
            "                              needs and nothing more\n"
            "  migrate --print-grants[-operator|-app] ROLE\n"
            "                              only print those statements (no database needed)\n"
            "  declare [--print-permissions]\n"
            "                              declare the exchanges, queues and bindings of the\n"
            "                              inputs; or print the rabbitmqctl commands that give\n"
            "                              the run and operator users their permissions\n"
            "  check-config [--online]     validate FILE and print the effective configuration\n"
            "                              (secrets redacted) and what needs the servers to\n"
            "                              check; --online checks that too: the ledger, the\n"
            "                              effect functions and their EXECUTE grant, the queues\n"
            "                              and their arguments, the broker user's access\n"
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
            "  erase KEY --why TEXT        remove the payload copies the ledger holds of KEY\n"
            "                              (park bodies, headers, a provider request), keep\n"
            "                              its audit facts; recorded as an operator action\n"
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
    const char *grant_role[3]; /* migrate --grant[-operator|-app] ROLE, by ledger_grants_kind */
    const char *print_role[3]; /* migrate --print-grants[-operator|-app] ROLE */
    bool print_permissions; /* declare --print-permissions */
    const char *dir; /* archive export/verify */
    bool all;        /* archive export */
    const char *now; /* maintain */
    const char *group; /* parked redrive|discard|archive --group ID */
    const char *actor; /* parked redrive|discard|archive --actor NAME */
    bool online;       /* check-config --online */
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
enum {
    OPT_DIR = 1000,
    OPT_ALL,
    OPT_NOW,
    OPT_GROUP,
    OPT_ACTOR,
    OPT_GRANT_OPERATOR,
    OPT_GRANT_APP,
    OPT_PRINT_OPERATOR,
    OPT_PRINT_APP,
    OPT_PRINT_PERMISSIONS,
    OPT_ONLINE
};

/* parked redrive, discard or archive */
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
        /* provider effects: reconcile and resolve */
        {"age", required_argument, NULL, 'A'},     {"applied", required_argument, NULL, 'P'},
        {"not-applied", no_argument, NULL, 'N'},   {"discard", no_argument, NULL, 'D'},
        {"reason", required_argument, NULL, 'W'},  {"why", required_argument, NULL, 'W'},
        {"grant", required_argument, NULL, 'G'},   {"print-grants", required_argument, NULL, 'Q'},
        {"grant-operator", required_argument, NULL, OPT_GRANT_OPERATOR},
        {"grant-app", required_argument, NULL, OPT_GRANT_APP},
        {"print-grants-operator", required_argument, NULL, OPT_PRINT_OPERATOR},
        {"print-grants-app", required_argument, NULL, OPT_PRINT_APP},
        {"print-permissions", no_argument, NULL, OPT_PRINT_PERMISSIONS},
        /* ledger lifecycle: archive and maintain */
        {"dir", required_argument, NULL, OPT_DIR}, {"all", no_argument, NULL, OPT_ALL},
        {"now", required_argument, NULL, OPT_NOW},
        /* failure groups */
        {"group", required_argument, NULL, OPT_GROUP},
        {"actor", required_argument, NULL, OPT_ACTOR},
        {"online", no_argument, NULL, OPT_ONLINE}, {NULL, 0, NULL, 0}};
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
        case 'G': o->grant_role[LEDGER_GRANTS_RUN] = optarg; break;
        case 'Q': o->print_role[LEDGER_GRANTS_RUN] = optarg; break;
        case OPT_GRANT_OPERATOR: o->grant_role[LEDGER_GRANTS_OPERATOR] = optarg; break;
        case OPT_GRANT_APP: o->grant_role[LEDGER_GRANTS_APP] = optarg; break;
        case OPT_PRINT_OPERATOR: o->print_role[LEDGER_GRANTS_OPERATOR] = optarg; break;
        case OPT_PRINT_APP: o->print_role[LEDGER_GRANTS_APP] = optarg; break;
        case OPT_PRINT_PERMISSIONS: o->print_permissions = true; break;
        case OPT_DIR: o->dir = optarg; break;
        case OPT_ALL: o->all = true; break;
        case OPT_NOW: o->now = optarg; break;
        case OPT_GROUP: o->group = optarg; break;
        case OPT_ACTOR: o->actor = optarg; break;
        case OPT_ONLINE: o->online = true; break;
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
    } else if (strcmp(o->cmd, "erase") == 0) {
        if (optind >= argc || !o->reason || !*o->reason) {
            fprintf(stderr, "idemq: erase needs a KEY and --why TEXT\n");
            return -1;
        }
        o->arg = argv[optind++];
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
    if (o->online && strcmp(o->cmd, "check-config") != 0) {
        fprintf(stderr, "idemq: --online goes with check-config\n");
        return -1;
    }
    if (o->until_idle_s && strcmp(o->cmd, "run") != 0) {
        fprintf(stderr, "idemq: --until-idle goes with run\n");
        return -1;
    }
    {
        int grants = 0, prints = 0;
        for (int k = 0; k < 3; k++) {
            const char *r = o->grant_role[k] ? o->grant_role[k] : o->print_role[k];
            grants += o->grant_role[k] != NULL;
            prints += o->print_role[k] != NULL;
            if (r && !ledger_grants_role_ok(r)) {
                fprintf(stderr, "idemq: a role name has 1 to 63 characters, none of them "
                                "control characters\n");
                return -1;
            }
        }
        if (o->print_permissions && strcmp(o->cmd, "declare") != 0) {
            fprintf(stderr, "idemq: --print-permissions goes with declare\n");
            return -1;
        }
        if ((grants || prints) && strcmp(o->cmd, "migrate") != 0) {
            fprintf(stderr, "idemq: --grant and --print-grants go with migrate\n");
            return -1;
        }
        if (grants && prints) {
            fprintf(stderr, "idemq: --grant or --print-grants, not both\n");
            return -1;
        }
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

static int cmd_migrate(const struct conf *c, const char *const grant_role[3],
                       const char *const print_role[3])
{
    static const char *const granted[] = {
        [LEDGER_GRANTS_RUN] = "may now run idemq: SELECT on the ledger, EXECUTE on its "
                              "functions and on the inputs' effects",
        [LEDGER_GRANTS_OPERATOR] = "may now run the operator commands: SELECT on the ledger "
                                   "and the archive, EXECUTE on the operator functions",
        [LEDGER_GRANTS_APP] = "may now emit: EXECUTE on idemq.emit and no other function",
    };
    char err[512];
    int applied;
    PGconn *db;
    bool printed = false;

    for (int k = 0; k < 3; k++) /* for review: no database needed */
        if (print_role[k]) {
            ledger_grants_print_kind(c, (enum ledger_grants_kind)k, print_role[k], stdout);
            printed = true;
        }
    if (printed)
        return EXIT_OK;
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
    for (int k = 0; k < 3; k++) {
        bool created = false;
        if (!grant_role[k])
            continue;
        if (ledger_grants_apply_kind(db, c, (enum ledger_grants_kind)k, grant_role[k], &created,
                                     err, sizeof err)) {
            int rc = PQstatus(db) == CONNECTION_OK ? EXIT_RUNTIME : EXIT_CONNECT;
            log_error("%s", err);
            PQfinish(db);
            return rc;
        }
        printf("%s %s role %s %s; no INSERT, UPDATE, DELETE or DDL\n",
               created ? "created" : "existing",
               ledger_grants_kind_name((enum ledger_grants_kind)k), grant_role[k], granted[k]);
    }
    PQfinish(db);
    return EXIT_OK;
}

/* s single-quoted for a POSIX shell into buf. */
static const char *shell_quote(const char *s, char *buf, size_t len)
{
    size_t o = 0;
    buf[o++] = '\'';
    for (; *s && o + 6 < len; s++) {
        if (*s == '\'') {
            memcpy(buf + o, "'\\''", 4);
            o += 4;
        } else {
            buf[o++] = *s;
        }
    }
    buf[o++] = '\'';
    buf[o] = '\0';
    return buf;
}

/* declare --print-permissions: the broker users of consumer/OPERATIONS.md
 * "Roles and permissions" for the inputs of c. No broker needed. */
static int cmd_print_permissions(const struct conf *c)
{
    static const char *const users[] = {"idemq", "idemq-operator"};
    static const char *const what[] = {
        "# idemq run (topology.verify = \"passive\"): no configure, no write on amq.default;\n"
        "# add to its write permission each exchange the effects' idemq.emit names\n",
        "# the operator: idemq declare, parked list, redrives (writes amq.default: keep it\n"
        "# out of the daemon's environment)\n",
    };
    enum { PERM_MAX = 8192 };
    char *buf = malloc(6 * PERM_MAX);
    int rc = EXIT_OK;
    if (!buf)
        return EXIT_RUNTIME;
    for (int u = 0; u < 2 && rc == EXIT_OK; u++) {
        char *cf = buf, *wr = buf + PERM_MAX, *rd = buf + 2 * PERM_MAX;
        char *q1 = buf + 3 * PERM_MAX, *q2 = buf + 4 * PERM_MAX, *q3 = buf + 5 * PERM_MAX;
        if (!topology_permissions(c, u == 0 ? TOPOLOGY_USER_RUN : TOPOLOGY_USER_OPERATOR, cf,
                                  wr, rd, PERM_MAX / 4 - 1)) {
            log_error("declare --print-permissions: the names of the inputs do not fit");
            rc = EXIT_RUNTIME;
            break;
        }
        printf("%srabbitmqctl add_user %s '...'\n"
               "rabbitmqctl set_permissions -p / %s %s %s %s\n",
               what[u], users[u], users[u], shell_quote(cf, q1, PERM_MAX),
               shell_quote(wr, q2, PERM_MAX), shell_quote(rd, q3, PERM_MAX));
    }
    free(buf);
    return rc;
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

/* What check-config cannot check without the servers. */
static void print_offline_limits(FILE *out)
{
    fprintf(out, "# not checked without the servers (idemq check-config --online checks "
                 "them): the database answers and the ledger is migrated; each effect "
                 "function exists as fn(text, jsonb, jsonb) RETURNS jsonb and this user may "
                 "EXECUTE it; each input's queue exists with the configured arguments; this "
                 "broker user may open the vhost and its queues\n");
}

/* check-config --online: the checks of `run`'s start-up, one line each,
 * going on past a failure so that every problem shows. The exit code is
 * the first failure's (4 unreachable, 5 schema, 3 effect, 6 topology). */
static int check_online(const struct conf *c)
{
    char err[512];
    struct broker *b = NULL;
    PGconn *db = connect_db(c);
    int rc = EXIT_OK;

    if (!db) {
        rc = EXIT_CONNECT;
    } else if (ledger_migrate_check(db, err, sizeof err)) {
        fprintf(stderr, "idemq: online: ledger: %s\n", err);
        rc = PQstatus(db) == CONNECTION_OK ? EXIT_SCHEMA : EXIT_CONNECT;
    } else {
        printf("online: database: reachable as %s, ledger migrated\n", PQuser(db));
        for (int i = 0; i < c->n_inputs; i++) {
            const struct conf_input *in = &c->inputs[i];
            struct ledger_db_error e = {0};
            idemq_err_t ferr = effect_sql_check(db, in, err, sizeof err, &e);
            if (ferr == IDEMQ_ERR_CONFIG) {
                fprintf(stderr, "idemq: online: %s\n", err);
                rc = rc ? rc : EXIT_CONFIG;
            } else if (ferr) {
                fprintf(stderr, "idemq: online: input %s: effect check failed: %s %s\n",
                        in->name, e.sqlstate, e.message);
                rc = rc ? rc : EXIT_CONNECT;
            } else if (in->effect_signature || in->n_routes) {
                printf("online: input %s: effect %s%s exists, returns jsonb, %s may EXECUTE "
                       "it\n", in->name, in->effect_signature ? in->effect_signature : "",
                       in->n_routes ? (in->effect_signature ? " and its task routes"
                                                            : "task routes")
                                    : "",
                       PQuser(db));
            }
        }
    }
    for (int i = 0; db && rc == EXIT_OK && i < c->n_sqs_inputs; i++) {
        const struct conf_input *in = &c->sqs_inputs[i];
        struct ledger_db_error e = {0};
        if (effect_sql_check(db, in, err, sizeof err, &e)) {
            fprintf(stderr, "idemq: online: input %s: %s%s%s\n", in->name, err,
                    e.message[0] ? " " : "", e.message);
            rc = EXIT_CONFIG;
        }
    }
    if (db)
        PQfinish(db);
    for (int i = 0; i < c->n_sqs_inputs; i++) { /* each queue answers to these credentials */
        const struct conf_input *in = &c->sqs_inputs[i];
        const char *urls[2] = {in->queue_url, in->dead_letter_queue_url};
        for (int k = 0; k < 2 && urls[k][0]; k++) {
            struct sqs_client_config cfg = {urls[k], in->region, in->endpoint, 10000, 0, NULL};
            struct sqs_client *sc;
            char *arn = NULL;
            enum sqs_status st;
            if (sqs_client_new(&cfg, &sc, err, sizeof err)) {
                fprintf(stderr, "idemq: online: input %s: %s\n", in->name, err);
                rc = rc ? rc : EXIT_CONFIG;
                break;
            }
            st = sqs_queue_attribute(sc, "QueueArn", &arn, err, sizeof err);
            if (st == SQS_OK)
                printf("online: input %s: %s queue %s answers (%s)\n", in->name,
                       k ? "dead-letter" : "its", urls[k], arn ? arn : "no QueueArn");
            else {
                fprintf(stderr, "idemq: online: input %s: %s queue %s: %s (%s)\n", in->name,
                        k ? "dead-letter" : "its", urls[k], sqs_status_name(st), err);
                rc = rc ? rc : st == SQS_DENIED || st == SQS_REFUSED ? EXIT_CONFIG : EXIT_CONNECT;
            }
            free(arn);
            sqs_client_free(sc);
        }
    }
    if (c->n_inputs == 0) /* no broker input: no broker to check */
        return rc;
    if (broker_open(c, "idemq check-config", false, &b, err, sizeof err)) {
        fprintf(stderr, "idemq: online: broker: %s\n", err);
        return rc ? rc : EXIT_CONNECT;
    }
    printf("online: broker: this user opened the vhost\n");
    for (int i = 0; i < c->n_inputs; i++) {
        if (topology_verify(b, c, &c->inputs[i], err, sizeof err)) {
            fprintf(stderr, "idemq: online: %s\n", err);
            rc = rc ? rc : EXIT_TOPOLOGY;
        } else {
            printf("online: input %s: queue %s and its delay and dead-letter queues exist%s\n",
                   c->inputs[i].name, c->inputs[i].queue,
                   c->topology_passive ? " (topology.verify = passive: arguments not compared)"
                                       : " with the configured arguments");
        }
    }
    broker_close(b);
    printf("# not checked online: this broker user's write permission on the delay and "
           "dead-letter exchanges (RabbitMQ answers it only to a publish) and provider "
           "endpoints\n");
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
    struct sqs_workers *sqs = NULL;
    struct sqs_worker_totals st;

    for (int i = 0; i < c->n_sqs_inputs; i++) { /* credentials before anything connects */
        const struct conf_input *in = &c->sqs_inputs[i];
        struct sqs_client_config cfg = {in->queue_url, in->region, in->endpoint, 0, 0, NULL};
        struct sqs_client *sc;
        char err[256];
        if (sqs_client_new(&cfg, &sc, err, sizeof err)) {
            log_error("input %s: %s", in->name, err);
            return EXIT_CONFIG;
        }
        sqs_client_free(sc);
    }
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
                   IDEMQ_VERSION, c->workers, c->n_inputs + c->n_pg_inputs + c->n_sqs_inputs,
                   c->batch_max,
                   c->consumer_id,
                   c->buffered_worst / (1024 * 1024));
    }
    /* A known stack size: librabbitmq-c 0.11 decodes nested header tables
     * recursively (fixed in 0.14); a header frame is bounded by frame_max
     * (128 KiB), which bounds that depth to what this stack holds. */
    {
        char err[256];
        /* before the workers: job_decode gives jobs spans only while it is on */
        if (trace_export_start(c, err, sizeof err) != IDEMQ_OK)
            log_error("%s (running without exporting spans)", err);
        else if (trace_export_on())
            log_info("tracing: exporting spans over OTLP/HTTP (tracing.endpoint)");
    }
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
            trace_export_stop();
            return EXIT_RUNTIME;
        }
    }
    pthread_attr_destroy(&attr);
    {
        char err[256];
        pgq_worker_set_gate(gate); /* consumer.max_rate over every worker */
        if (pgq_worker_start(c, until_idle_s * 1000, &pgq, err, sizeof err)) {
            log_error("%s", err);
            rc = EXIT_RUNTIME; /* the broker workers see the stop request */
        }
        if (!rc && sqs_worker_start(c, until_idle_s * 1000, &sqs, err, sizeof err)) {
            log_error("%s", err);
            sig_request_stop();
            rc = EXIT_RUNTIME;
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
    if (c->console_listen[0]) { /* the web console */
        char err[512];
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
    sqs_worker_join(sqs, &st);
    if (c->n_sqs_inputs) {
        struct log_fields lf = LOG_FIELDS_NONE;
        lf.event = "stopped";
        LOG_FIELDS(LOG_LVL_INFO, &lf,
                   "stopped (SQS inputs): received %ld, applied %ld, duplicates %ld, "
                   "retried %ld, parked %ld, deletes refused %ld, visibility extended %ld",
                   st.received, st.applied, st.duplicates, st.retried, st.parked,
                   st.delete_failed, st.extended);
    }
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
    observe_log_summary(c); /* observe-mode inputs */
    if (c->n_routes) { /* Celery inputs: what became of the replies */
        long rs[4] = {0, 0, 0, 0};
        for (int i = 0; i < nw; i++) {
            rs[0] += atomic_load(&ws[i].stats.celery.sent);
            rs[1] += atomic_load(&ws[i].stats.celery.refused);
            rs[2] += atomic_load(&ws[i].stats.celery.failed);
            rs[3] += atomic_load(&ws[i].stats.celery.observe);
        }
        log_info("celery replies: sent %ld, refused reply_to %ld, failed %ld, not sent in "
                 "observe mode %ld", rs[0], rs[1], rs[2], rs[3]);
    }
    run_report_log(ws, nw);
    trace_export_stop();
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
    struct protect *keys = NULL;
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
        strcmp(o.cmd, "observe") && strcmp(o.cmd, "erase")) {
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
    ledger_db_keep_error_detail(c->keep_error_detail);
    if (protect_load(c, &keys, err, sizeof err) != IDEMQ_OK) {
        fprintf(stderr, "idemq: %s\n", err);
        conf_free(c);
        return EXIT_CONFIG;
    }
    protect_set_global(keys);
    sig_install();
    if (strcmp(o.cmd, "run") == 0 || strcmp(o.cmd, "check-config") == 0) {
        for (int i = 0; i < c->n_inputs; i++) { /* insecure provider transport */
            char warn[512];
            if (conf_input_insecure(&c->inputs[i], warn, sizeof warn))
                log_warn("%s", warn);
        }
        {
            char note[700];
            if (conf_outbox_note(c, note, sizeof note))
                log_info("%s", note);
        }
    }
    if (strcmp(o.cmd, "check-config") == 0) {
        struct effect_http *h = NULL; /* provider credentials and CA files */
        if (effect_http_new(c, &h, err, sizeof err) != IDEMQ_OK) {
            fprintf(stderr, "idemq: %s: %s\n", o.config, err);
            rc = EXIT_CONFIG;
        } else if (conf_lint(c, stderr) > 0) {
            rc = EXIT_CONFIG;
        } else {
            printf("# %s is valid; effective configuration:\n", o.config);
            conf_warn_consumer_timeout(c, stderr);
            conf_print(c, stdout);
            rc = o.online ? check_online(c) : EXIT_OK;
            if (!o.online)
                print_offline_limits(stderr);
        }
        effect_http_free(h);
    } else if (strcmp(o.cmd, "migrate") == 0) {
        rc = cmd_migrate(c, o.grant_role, o.print_role);
    } else if (strcmp(o.cmd, "declare") == 0) {
        rc = o.print_permissions ? cmd_print_permissions(c) : cmd_declare(c);
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
    } else if (strcmp(o.cmd, "erase") == 0) {
        rc = ops_erase(c, o.arg, o.reason, stdout);
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
    protect_set_global(NULL);
    protect_free(keys);
    conf_free(c);
    return rc;
}
