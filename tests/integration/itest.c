/*
 * itest: integration-test fixtures (see itest.h). No mocks: everything goes
 * to the real servers and the real idemq binary.
 */
#include "itest.h"

#include <check.h>
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <amqp.h>
#include <amqp_tcp_socket.h>
#include <dirent.h>
#include <fcntl.h>

#include "ledger_db.h"
#include "ledger_migrate.h"
#include "topology.h"

#define LP_RUN_ROLE "idemq_lp_run"
#define LP_OPERATOR_ROLE "idemq_lp_operator"
#define LP_APP_ROLE "idemq_lp_app"

extern char **environ;

const char *itest_retry_conf;
const char *itest_extra_conf;
const char *itest_broker_conf;
const char *itest_log_conf;

int itest_ms(int ms)
{
    const char *m = getenv("IDEMQ_TEST_TIMEOUT_MULT");
    int mult = m ? atoi(m) : 1;
    return ms * (mult > 0 ? mult : 1);
}

long long itest_mono_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* Test ports come from 17000-24999: below the kernel's ephemeral range
 * (32768 and up), so no client socket holds one, and clear of what
 * scripts/services derives from its ports (AMQP + 10000/20000/21000/22000,
 * PostgreSQL at 14xxx-15xxx). A process walks the range from a point its
 * pid picks, one step per call, so two calls never answer the same port. */
#define ITEST_PORT_LO 17000
#define ITEST_PORT_SPAN 8000

int itest_free_port(void)
{
    static int step = -1;
    if (step < 0)
        step = (int)(((unsigned)getpid() * 2654435761u) % ITEST_PORT_SPAN);
    for (int tries = 0; tries < ITEST_PORT_SPAN; tries++) {
        struct sockaddr_in sa;
        int port = ITEST_PORT_LO + step, fd = socket(AF_INET, SOCK_STREAM, 0), ok;
        step = (step + 1) % ITEST_PORT_SPAN;
        ck_assert_int_ge(fd, 0);
        memset(&sa, 0, sizeof sa);
        sa.sin_family = AF_INET;
        sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        sa.sin_port = htons((uint16_t)port);
        ok = bind(fd, (struct sockaddr *)&sa, sizeof sa) == 0;
        close(fd);
        if (ok)
            return port;
    }
    ck_abort_msg("no free port in %d-%d", ITEST_PORT_LO, ITEST_PORT_LO + ITEST_PORT_SPAN - 1);
    return -1;
}

static char *slurp(const char *path)
{
    FILE *f = fopen(path, "rb");
    char *buf;
    long n;
    ck_assert_msg(f != NULL, "cannot open %s", path);
    fseek(f, 0, SEEK_END);
    n = ftell(f);
    fseek(f, 0, SEEK_SET);
    buf = calloc(1, (size_t)n + 1);
    ck_assert_ptr_nonnull(buf);
    ck_assert_int_eq(fread(buf, 1, (size_t)n, f), n);
    fclose(f);
    return buf;
}

void itest_sql(struct itest *t, const char *sql)
{
    PGresult *r = PQexec(t->db, sql);
    ck_assert_msg(PQresultStatus(r) == PGRES_COMMAND_OK || PQresultStatus(r) == PGRES_TUPLES_OK,
                  "SQL failed: %s\n%s", PQerrorMessage(t->db), sql);
    PQclear(r);
}


/* ---- least-privilege mode ---- */

bool itest_lp(void)
{
    const char *v = getenv("IDEMQ_TEST_LEAST_PRIVILEGE");
    return v && strcmp(v, "1") == 0;
}

void itest_lp_tcase(Suite *s, const TTest *const *tests)
{
    TCase *tc;
    if (!itest_lp())
        return;
    tc = tcase_create("least_privilege");
    tcase_set_timeout(tc, itest_ms(240));
    for (int i = 0; tests[i]; i++) {
        /* IDEMQ_TEST_LP_PENDING: names of tests left out (space-separated) */
        const char *pending = getenv("IDEMQ_TEST_LP_PENDING"), *hit;
        size_t n = strlen(tests[i]->name);
        bool skip = false;
        for (hit = pending; hit && (hit = strstr(hit, tests[i]->name)) != NULL; hit += n)
            skip = skip || ((hit == pending || hit[-1] == ' ') && (hit[n] == ' ' || !hit[n]));
        if (skip)
            fprintf(stderr, "least-privilege mode: %s is pending (IDEMQ_TEST_LP_PENDING)\n",
                    tests[i]->name);
        else
            _tcase_add_test(tc, tests[i], 0, 0, 0, 1);
    }
    suite_add_tcase(s, tc);
}

const char *itest_lp_topology(void)
{
    return itest_lp() ? "topology: { verify = \"passive\"; };" : "";
}

/* 0 owner (setup), 1 run, 2 operator */
static int lp_kind(const char *command)
{
    static const char *const owner[] = {"migrate", "declare", "publish", "check-config"};
    size_t n = strcspn(command, " ");
    if (n == 3 && strncmp(command, "run", 3) == 0)
        return 1;
    for (size_t i = 0; i < sizeof owner / sizeof owner[0]; i++)
        if (n == strlen(owner[i]) && strncmp(command, owner[i], n) == 0)
            return 0;
    return 2;
}

/* IDEMQ_PG_DSN with the value of user= replaced by role (the rest kept: a
 * test may append a dbname) */
static void lp_dsn(const char *role, char *dsn, size_t len)
{
    const char *base = getenv("IDEMQ_PG_DSN"), *u = base ? strstr(base, "user=") : NULL;
    ck_assert_msg(u != NULL, "IDEMQ_PG_DSN names no user=");
    snprintf(dsn, len, "%.*suser=%s%s", (int)(u - base), base, role, u + strcspn(u, " "));
}

static const char *lp_url(int kind)
{
    const char *v = getenv(kind == 1 ? "IDEMQ_TEST_LP_RUN_URL" : "IDEMQ_TEST_LP_OPERATOR_URL");
    ck_assert_msg(v && *v, "least-privilege mode needs IDEMQ_TEST_LP_RUN_URL and "
                           "IDEMQ_TEST_LP_OPERATOR_URL (scripts/test sets them)");
    return v;
}

void itest_lp_child_env(const char *command)
{
    char dsn[512];
    int kind;
    if (!itest_lp() || (kind = lp_kind(command)) == 0)
        return;
    lp_dsn(kind == 1 ? LP_RUN_ROLE : LP_OPERATOR_ROLE, dsn, sizeof dsn);
    setenv("IDEMQ_PG_DSN", dsn, 1);
    setenv("IDEMQ_AMQP_URL", lp_url(kind), 1);
}

const char *itest_lp_env_prefix(const char *command, char *buf, size_t len)
{
    char dsn[512];
    int kind;
    buf[0] = '\0';
    if (!itest_lp() || (kind = lp_kind(command)) == 0)
        return buf;
    lp_dsn(kind == 1 ? LP_RUN_ROLE : LP_OPERATOR_ROLE, dsn, sizeof dsn);
    /* neither holds a single quote (scripts/test's users, the services' DSN) */
    snprintf(buf, len, "env IDEMQ_PG_DSN='%s' IDEMQ_AMQP_URL='%s' ", dsn, lp_url(kind));
    return buf;
}

/* The user part of an amqp:// URL ("amqp://USER:PW@...") into buf. */
static void lp_url_user(const char *url, char *buf, size_t len)
{
    const char *u = strstr(url, "://"), *end;
    ck_assert_ptr_nonnull(u);
    u += 3;
    end = u + strcspn(u, ":@");
    snprintf(buf, len, "%.*s", (int)(end - u), u);
}

static void lp_put_permissions(const char *user, const char *cf, const char *wr, const char *rd)
{
    const char *base = getenv("IDEMQ_RABBIT_MGMT_URL");
    json_t *body = json_pack("{s:s, s:s, s:s}", "configure", cf, "write", wr, "read", rd);
    char *text = json_dumps(body, JSON_COMPACT), path[256], cmd[1024], out[64] = "";
    FILE *f, *p;
    ck_assert_msg(base != NULL, "IDEMQ_RABBIT_MGMT_URL is not set");
    snprintf(path, sizeof path, "/tmp/itest-lp-perm-%d.json", (int)getpid());
    f = fopen(path, "w");
    ck_assert_ptr_nonnull(f);
    fputs(text, f);
    fclose(f);
    snprintf(cmd, sizeof cmd,
             "curl -s -o /dev/null -w '%%{http_code}' -u guest:guest -X PUT "
             "-H 'content-type: application/json' --data-binary @%s '%s/api/permissions/%%2F/%s'",
             path, base, user);
    p = popen(cmd, "r");
    ck_assert_ptr_nonnull(p);
    if (!fgets(out, sizeof out, p))
        out[0] = '\0';
    pclose(p);
    unlink(path);
    ck_assert_msg(atoi(out) >= 200 && atoi(out) < 300, "setting %s's permissions: HTTP %s", user,
                  out);
    free(text);
    json_decref(body);
}

/* The permissions given so far in this test: each config's added as one
 * more anchored alternative, so that processes of several configs of one
 * test keep theirs. Reset by itest_setup. */
enum { LP_PERM_MAX = 16384 };
static char lp_given[2][3][LP_PERM_MAX];

static void lp_union(char *acc, const char *add)
{
    if (strcmp(add, "^$") == 0 || strstr(acc, add))
        return;
    if (acc[0] && strlen(acc) + 1 + strlen(add) + 1 < LP_PERM_MAX)
        strcat(acc, "|");
    if (strlen(acc) + strlen(add) + 1 < LP_PERM_MAX)
        strcat(acc, add);
}

void itest_lp_permit(const struct conf *c)
{
    enum { LEN = 4096 };
    static char p[3][LEN];
    char user[128];
    if (!itest_lp())
        return;
    for (int k = 0; k < 2; k++) {
        bool changed = false;
        ck_assert(topology_permissions(c, k == 0 ? TOPOLOGY_USER_RUN : TOPOLOGY_USER_OPERATOR,
                                       p[0], p[1], p[2], LEN));
        for (int i = 0; i < 3; i++) {
            size_t before = strlen(lp_given[k][i]);
            lp_union(lp_given[k][i], p[i]);
            changed = changed || strlen(lp_given[k][i]) != before;
        }
        if (!changed)
            continue;
        lp_url_user(lp_url(k == 0 ? 1 : 2), user, sizeof user);
        lp_put_permissions(user, lp_given[k][0][0] ? lp_given[k][0] : "^$",
                           lp_given[k][1][0] ? lp_given[k][1] : "^$",
                           lp_given[k][2][0] ? lp_given[k][2] : "^$");
    }
}

void itest_lp_permit_emit(const char *exchange)
{
    char re[600], user[128];
    size_t o = 0;
    if (!itest_lp())
        return;
    re[o++] = '^';
    for (const char *p = exchange; *p && o + 4 < sizeof re; p++) {
        if (strchr(".^$*+?()[]{}|\\", *p))
            re[o++] = '\\';
        re[o++] = *p;
    }
    re[o++] = '$';
    re[o] = '\0';
    lp_union(lp_given[0][1], re);
    lp_url_user(lp_url(1), user, sizeof user);
    lp_put_permissions(user, "^$", lp_given[0][1], lp_given[0][2][0] ? lp_given[0][2] : "^$");
}

/* The roles, by the project's command (as the owner): run's grants follow
 * the config's effects, which a test may create after itest_setup, so
 * this runs before each idemq process a test starts. */
static void lp_grant(const char *cfg_path)
{
    char cmd[1024], out[4096];
    FILE *p;
    int st;
    size_t n;
    snprintf(cmd, sizeof cmd, "%s migrate -c %s --grant %s --grant-operator %s --grant-app %s 2>&1",
             IDEMQ_BINARY, cfg_path, LP_RUN_ROLE, LP_OPERATOR_ROLE, LP_APP_ROLE);
    p = popen(cmd, "r");
    ck_assert_ptr_nonnull(p);
    n = fread(out, 1, sizeof out - 1, p);
    out[n] = '\0';
    st = pclose(p);
    ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0, "%s\n%s", cmd, out);
}

/* Before an idemq process of a deployment's role starts with cfg_path:
 * its roles granted and its broker users permitted. */
static void lp_prepare(const char *command, const char *cfg_path)
{
    struct conf *c = NULL;
    char err[512];
    if (!itest_lp() || lp_kind(command) == 0)
        return;
    lp_grant(cfg_path);
    ck_assert_msg(conf_load(cfg_path, &c, err, sizeof err) == IDEMQ_OK, "%s", err);
    itest_lp_permit(c);
    conf_free(c);
}

void itest_write_config(struct itest *t, const char *path, const char *queue,
                        const char *effect, const char *extra_consumer, const char *extra_input)
{
    FILE *f = fopen(path, "w");
    ck_assert_ptr_nonnull(f);
    fprintf(f,
            "broker: { heartbeat = 10; %s };\n"
            "retry: { %s };\n%s\n%s\n"
            "consumer: { id = \"%s\"; %s };\n"
            "log: { level = \"info\"; %s };\n"
            "inputs = ( { name = \"%s\"; exchange = \"%s\"; queue = \"%s\"; routing_key = \"%s\";\n"
            "  effect_function = \"%s\"; %s } );\n",
            itest_broker_conf ? itest_broker_conf : "",
            itest_retry_conf ? itest_retry_conf : "", itest_extra_conf ? itest_extra_conf : "",
            itest_extra_conf && strstr(itest_extra_conf, "topology") ? "" : itest_lp_topology(),
            t->name,
            extra_consumer ? extra_consumer : "", itest_log_conf ? itest_log_conf : "", queue,
            t->name, queue, queue, effect,
            extra_input ? extra_input : "");
    fclose(f);
}

static void load_sql_file(struct itest *t, const char *path)
{
    char *sql = slurp(path);
    itest_sql(t, sql);
    free(sql);
}

void itest_setup(struct itest *t, const char *tag, const char *effect, const char *extra_consumer,
                 const char *extra_input)
{
    static int seq;
    char err[1024];
    int applied;
    struct broker *b;
    struct timespec ts;

    memset(t, 0, sizeof *t);
    ck_assert_msg(getenv("IDEMQ_AMQP_URL") && getenv("IDEMQ_PG_DSN"),
                  "IDEMQ_AMQP_URL and IDEMQ_PG_DSN must point at real servers "
                  "(run scripts/test, or source the env file of scripts/services start)");
    clock_gettime(CLOCK_REALTIME, &ts);
    snprintf(t->name, sizeof t->name, "it_%s_%d_%ld_%d", tag, (int)getpid(),
             (long)(ts.tv_nsec / 1000) % 100000, seq++);
    snprintf(t->cfg_path, sizeof t->cfg_path, "/tmp/%s.cfg", t->name);
    t->db = ledger_db_connect(getenv("IDEMQ_PG_DSN"), "itest", 0, err, sizeof err);
    ck_assert_msg(t->db != NULL, "%s", err);
    itest_sql(t, "SET client_min_messages = warning");
    ck_assert_msg(ledger_migrate_run(t->db, &applied, err, sizeof err) == IDEMQ_OK, "%s", err);
    /* Effects are created under an advisory lock: tests may run in parallel. */
    itest_sql(t, "SELECT pg_advisory_lock(4242)");
    load_sql_file(t, IDEMQ_SOURCE_DIR "/ledger/examples/payouts.sql");
    load_sql_file(t, IDEMQ_SOURCE_DIR "/ledger/examples/authorizations.sql");
    load_sql_file(t, IDEMQ_SOURCE_DIR "/tests/integration/effects.sql");
    itest_sql(t, "SELECT pg_advisory_unlock(4242)");
    itest_write_config(t, t->cfg_path, t->name, effect, extra_consumer, extra_input);
    ck_assert_msg(conf_load(t->cfg_path, &t->conf, err, sizeof err) == IDEMQ_OK, "%s", err);
    ck_assert_msg(broker_open(t->conf, "itest setup", false, &b, err, sizeof err) == IDEMQ_OK,
                  "%s", err);
    ck_assert_msg(topology_declare(b, t->conf, &t->conf->inputs[0]) == IDEMQ_OK, "%s",
                  broker_error(b));
    if (CONF_INPUT_ORDERED(&t->conf->inputs[0])) {
        for (int k = 0; k < t->conf->inputs[0].partitions; k++) {
            char q[TOPOLOGY_NAME_MAX];
            topology_partition_queue(&t->conf->inputs[0], k, q, sizeof q);
            ck_assert(broker_admin_purge(b, q) == IDEMQ_OK);
        }
    } else {
        ck_assert(broker_admin_purge(b, t->conf->inputs[0].queue) == IDEMQ_OK);
    }
    broker_close(b);
    memset(lp_given, 0, sizeof lp_given); /* a new test */
}

void itest_delete_topology(struct itest *t, const struct conf_input *in)
{
    struct broker *b;
    char err[512], name[TOPOLOGY_NAME_MAX];
    if (broker_open(t->conf, "itest teardown", false, &b, err, sizeof err) != 0)
        return;
    for (long bucket = TOPOLOGY_MIN_DELAY_MS; bucket <= t->conf->max_delay_ms; bucket *= 2) {
        topology_bucket_queue(in, bucket, name, sizeof name);
        if (broker_admin_delete_queue(b, name) != IDEMQ_OK)
            fprintf(stderr, "teardown: %s\n", broker_error(b));
    }
    topology_dlq(in, name, sizeof name);
    if (broker_admin_delete_queue(b, name) != IDEMQ_OK)
        fprintf(stderr, "teardown: %s\n", broker_error(b));
    if (broker_admin_delete_queue(b, in->queue) != IDEMQ_OK)
        fprintf(stderr, "teardown: %s\n", broker_error(b));
    for (int k = 0; k < in->partitions + 1; k++) { /* one more: ring changes */
        topology_partition_queue(in, k, name, sizeof name);
        if (broker_admin_delete_queue(b, name) != IDEMQ_OK)
            fprintf(stderr, "teardown: %s\n", broker_error(b));
    }
    topology_delay_exchange(in, name, sizeof name);
    if (broker_admin_delete_exchange(b, name) != IDEMQ_OK)
        fprintf(stderr, "teardown: %s\n", broker_error(b));
    topology_dlx(in, name, sizeof name);
    if (broker_admin_delete_exchange(b, name) != IDEMQ_OK)
        fprintf(stderr, "teardown: %s\n", broker_error(b));
    if (in->exchange[0] && broker_admin_delete_exchange(b, in->exchange) != IDEMQ_OK)
        fprintf(stderr, "teardown: %s\n", broker_error(b));
    broker_close(b);
}

void itest_teardown(struct itest *t)
{
    if (t->conf)
        itest_delete_topology(t, &t->conf->inputs[0]);
    unlink(t->cfg_path);
    conf_free(t->conf);
    if (t->db)
        PQfinish(t->db);
    memset(t, 0, sizeof *t);
}

void itest_publish_to(struct itest *t, const char *exchange, const char *rk, const char *body,
                      json_t *headers, const char *message_id)
{
    struct broker *b;
    char err[512];
    struct broker_props p = {message_id, NULL, headers, true, NULL, NULL};
    ck_assert_msg(broker_open(t->conf, "itest publish", true, &b, err, sizeof err) == 0, "%s",
                  err);
    ck_assert_msg(broker_publish(b, exchange, rk, body, strlen(body), &p) == IDEMQ_OK, "%s",
                  broker_error(b));
    ck_assert_msg(broker_wait_confirms(b, itest_ms(10000)) == IDEMQ_OK, "%s", broker_error(b));
    broker_close(b);
}

void itest_publish(struct itest *t, const char *const *bodies, int n)
{
    struct broker *b;
    char err[512];
    const struct conf_input *in = &t->conf->inputs[0];
    ck_assert_msg(broker_open(t->conf, "itest publish", true, &b, err, sizeof err) == 0, "%s",
                  err);
    for (int i = 0; i < n; i++)
        ck_assert_msg(broker_publish(b, in->exchange, in->routing_key, bodies[i],
                                     strlen(bodies[i]), NULL) == IDEMQ_OK,
                      "%s", broker_error(b));
    ck_assert_msg(broker_wait_confirms(b, itest_ms(10000)) == IDEMQ_OK, "%s", broker_error(b));
    broker_close(b);
}

pid_t itest_spawn(struct itest *t, const char *cfg_path, int idle_s, const char *const *env)
{
    pid_t pid;
    char idle[16];
    (void)t;
    snprintf(idle, sizeof idle, "%d", idle_s);
    lp_prepare("run", cfg_path);
    fflush(NULL);
    pid = fork();
    ck_assert_int_ge(pid, 0);
    if (pid == 0) {
        itest_lp_child_env("run");
        for (int i = 0; env && env[i]; i++)
            putenv((char *)env[i]);
        execl(IDEMQ_BINARY, IDEMQ_BINARY, "run", "-c", cfg_path, "--until-idle", idle,
              (char *)NULL);
        fprintf(stderr, "exec %s: %s\n", IDEMQ_BINARY, strerror(errno));
        _exit(127);
    }
    return pid;
}

int itest_wait(pid_t pid, int ms)
{
    int status;
    for (int waited = 0; waited < ms; waited += 20) {
        pid_t r = waitpid(pid, &status, WNOHANG);
        if (r == pid)
            return status;
        usleep(20000);
    }
    kill(pid, SIGKILL);
    waitpid(pid, &status, 0);
    return -1;
}

void itest_run_until_idle(struct itest *t, int idle_s)
{
    pid_t pid = itest_spawn(t, t->cfg_path, idle_s, NULL);
    int st = itest_wait(pid, itest_ms(60000));
    ck_assert_msg(st != -1, "idemq did not finish in time");
    ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0, "idemq exited with status 0x%x", st);
}

long itest_long(struct itest *t, const char *sql, const char *p1)
{
    const char *params[1] = {p1};
    PGresult *r = PQexecParams(t->db, sql, p1 ? 1 : 0, NULL, params, NULL, NULL, 0);
    long v;
    ck_assert_msg(PQresultStatus(r) == PGRES_TUPLES_OK && PQntuples(r) == 1,
                  "query failed: %s\n%s", PQerrorMessage(t->db), sql);
    v = PQgetisnull(r, 0, 0) ? -1 : atol(PQgetvalue(r, 0, 0));
    PQclear(r);
    return v;
}

char *itest_text(struct itest *t, const char *sql, const char *p1, char *buf, size_t len)
{
    const char *params[1] = {p1};
    PGresult *r = PQexecParams(t->db, sql, p1 ? 1 : 0, NULL, params, NULL, NULL, 0);
    ck_assert_msg(PQresultStatus(r) == PGRES_TUPLES_OK && PQntuples(r) == 1,
                  "query failed: %s\n%s", PQerrorMessage(t->db), sql);
    snprintf(buf, len, "%s", PQgetisnull(r, 0, 0) ? "" : PQgetvalue(r, 0, 0));
    PQclear(r);
    return buf;
}

long itest_queue_ready(struct itest *t, const char *queue)
{
    struct broker *b;
    char err[512];
    uint32_t n = 0;
    ck_assert_msg(broker_open(t->conf, "itest counts", false, &b, err, sizeof err) == 0, "%s",
                  err);
    ck_assert_msg(broker_admin_queue_counts(b, queue, &n, NULL) == IDEMQ_OK, "%s", broker_error(b));
    broker_close(b);
    return (long)n;
}

void itest_reconnect_db(struct itest *t)
{
    for (int i = 0; i < 100; i++) {
        PQreset(t->db);
        if (PQstatus(t->db) == CONNECTION_OK)
            return;
        usleep(100000);
    }
    ck_abort_msg("cannot reconnect to PostgreSQL: %s", PQerrorMessage(t->db));
}

/* Quiet when it works; when it fails, the test's stderr gets the script's
 * words (a failed start in CI said nothing else). */
int itest_services(const char *what)
{
    char cmd[1024], out[8192];
    size_t n = 0;
    int st;
    FILE *p;
    snprintf(cmd, sizeof cmd, "%s/scripts/services %s 2>&1", IDEMQ_SOURCE_DIR, what);
    p = popen(cmd, "r");
    if (p == NULL)
        return -1;
    while (!feof(p) && !ferror(p)) {
        size_t got = fread(out + n, 1, sizeof out - 1 - n, p);
        n += got;
        if (n == sizeof out - 1) /* keep the last part: the error is at the end */
            memmove(out, out + n / 2, n - n / 2), n -= n / 2;
        if (got == 0)
            break;
    }
    out[n] = '\0';
    st = pclose(p);
    if (st != 0)
        fprintf(stderr, "itest: scripts/services %s failed (status 0x%x):\n%s\n", what, st, out);
    return st;
}

long itest_queue_consumers(struct itest *t, const char *queue)
{
    struct broker *b;
    char err[512];
    uint32_t n = 0;
    ck_assert_msg(broker_open(t->conf, "itest counts", false, &b, err, sizeof err) == 0, "%s",
                  err);
    ck_assert_msg(broker_admin_queue_counts(b, queue, NULL, &n) == IDEMQ_OK, "%s", broker_error(b));
    broker_close(b);
    return (long)n;
}

/* Starts cmd, reads its whole output into out (cut to outlen), returns the
 * stream for pclose. */
static FILE *read_command(const char *cmd, char *out, size_t outlen)
{
    FILE *p = popen(cmd, "r");
    size_t n = 0;
    ck_assert_ptr_nonnull(p);
    while (n + 1 < outlen) {
        size_t r = fread(out + n, 1, outlen - n - 1, p);
        if (r == 0)
            break;
        n += r;
    }
    out[n] = '\0';
    return p;
}

int itest_idemq(struct itest *t, const char *args, char *out, size_t outlen)
{
    char cmd[3072], env[1024];
    FILE *p;
    int st;
    lp_prepare(args, t->cfg_path);
    snprintf(cmd, sizeof cmd, "%s%s %s -c %s 2>&1", itest_lp_env_prefix(args, env, sizeof env),
             IDEMQ_BINARY, args, t->cfg_path);
    p = read_command(cmd, out, outlen);
    st = pclose(p);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

int itest_http_get(const char *url, char *out, size_t outlen)
{
    char cmd[1024];
    FILE *p;
    int code = -1;
    snprintf(cmd, sizeof cmd, "curl -s -m 5 -w '\\n%%{http_code}' '%s'", url);
    p = read_command(cmd, out, outlen);
    pclose(p);
    {
        char *nl = strrchr(out, '\n');
        if (nl) {
            code = atoi(nl + 1);
            *nl = '\0';
        }
    }
    return code;
}

pid_t itest_spawn_log(const char *cfg_path, int idle_s, const char *const *env,
                      const char *log_path)
{
    pid_t pid;
    char idle[16];
    snprintf(idle, sizeof idle, "%d", idle_s);
    lp_prepare("run", cfg_path);
    fflush(NULL);
    pid = fork();
    ck_assert_int_ge(pid, 0);
    if (pid == 0) {
        int fd = open(log_path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
        if (fd >= 0) {
            dup2(fd, 1);
            dup2(fd, 2);
            close(fd);
        }
        itest_lp_child_env("run");
        for (int i = 0; env && env[i]; i++)
            putenv((char *)env[i]);
        execl(IDEMQ_BINARY, IDEMQ_BINARY, "run", "-c", cfg_path, "--until-idle", idle,
              (char *)NULL);
        fprintf(stderr, "exec %s: %s\n", IDEMQ_BINARY, strerror(errno));
        _exit(127);
    }
    return pid;
}

int itest_count_lines(const char *path, const char *needle)
{
    FILE *f = fopen(path, "r");
    char line[8192];
    int n = 0;
    if (!f)
        return 0;
    while (fgets(line, sizeof line, f))
        n += strstr(line, needle) != NULL;
    fclose(f);
    return n;
}

struct itest_raw {
    amqp_connection_state_t conn;
    uint64_t seq;
};

struct itest_raw *itest_raw_open(void)
{
    struct itest_raw *r = calloc(1, sizeof *r);
    struct amqp_connection_info ci;
    char *url = strdup(getenv("IDEMQ_AMQP_URL")), *comma;
    amqp_socket_t *sock;
    amqp_rpc_reply_t rep;

    ck_assert_ptr_nonnull(r);
    ck_assert_ptr_nonnull(url);
    if ((comma = strchr(url, ',')))
        *comma = '\0';
    amqp_default_connection_info(&ci);
    ck_assert_int_eq(amqp_parse_url(url, &ci), AMQP_STATUS_OK);
    r->conn = amqp_new_connection();
    sock = amqp_tcp_socket_new(r->conn);
    ck_assert_int_eq(amqp_socket_open(sock, ci.host, ci.port), AMQP_STATUS_OK);
    rep = amqp_login(r->conn, ci.vhost, 0, AMQP_DEFAULT_FRAME_SIZE, 0, AMQP_SASL_METHOD_PLAIN,
                     ci.user, ci.password);
    ck_assert_int_eq(rep.reply_type, AMQP_RESPONSE_NORMAL);
    amqp_channel_open(r->conn, 1);
    ck_assert_int_eq(amqp_get_rpc_reply(r->conn).reply_type, AMQP_RESPONSE_NORMAL);
    amqp_confirm_select(r->conn, 1);
    ck_assert_int_eq(amqp_get_rpc_reply(r->conn).reply_type, AMQP_RESPONSE_NORMAL);
    free(url);
    return r;
}

void itest_raw_publish(struct itest_raw *r, const char *exchange, const void *rk, size_t rklen,
                       const void *body, size_t len, const void *props)
{
    amqp_bytes_t key = {rklen, (void *)rk}, data = {len, (void *)body};
    amqp_frame_t f;
    ck_assert_int_eq(amqp_basic_publish(r->conn, 1, amqp_cstring_bytes(exchange), key, 0, 0,
                                        props, data),
                     AMQP_STATUS_OK);
    r->seq++;
    /* wait for this publish's confirm (one at a time keeps it simple) */
    for (;;) {
        struct timeval tv = {10, 0};
        ck_assert_int_eq(amqp_simple_wait_frame_noblock(r->conn, &f, &tv), AMQP_STATUS_OK);
        if (f.frame_type == AMQP_FRAME_METHOD && f.payload.method.id == AMQP_BASIC_ACK_METHOD)
            break;
        ck_assert_msg(!(f.frame_type == AMQP_FRAME_METHOD &&
                        f.payload.method.id == AMQP_BASIC_NACK_METHOD),
                      "raw publish nacked");
        ck_assert_msg(!(f.frame_type == AMQP_FRAME_METHOD &&
                        (f.payload.method.id == AMQP_CHANNEL_CLOSE_METHOD ||
                         f.payload.method.id == AMQP_CONNECTION_CLOSE_METHOD)),
                      "raw publish: broker closed the channel");
    }
    amqp_maybe_release_buffers(r->conn);
}

void itest_raw_close(struct itest_raw *r)
{
    amqp_channel_close(r->conn, 1, AMQP_REPLY_SUCCESS);
    amqp_connection_close(r->conn, AMQP_REPLY_SUCCESS);
    amqp_destroy_connection(r->conn);
    free(r);
}

int itest_pg_signal(int sig)
{
    char path[600], dir[512] = "", pidfile[700];
    FILE *f;
    long pm = 0;
    int n = 0;
    DIR *proc;
    struct dirent *de;

    snprintf(path, sizeof path, "%s/pg-dir", getenv("IDEMQ_STATE_DIR"));
    ck_assert_msg((f = fopen(path, "r")) != NULL, "cannot read %s", path);
    ck_assert_ptr_nonnull(fgets(dir, sizeof dir, f));
    fclose(f);
    dir[strcspn(dir, "\n")] = '\0';
    snprintf(pidfile, sizeof pidfile, "%s/data/postmaster.pid", dir);
    ck_assert_msg((f = fopen(pidfile, "r")) != NULL, "cannot read %s", pidfile);
    ck_assert_int_eq(fscanf(f, "%ld", &pm), 1);
    fclose(f);
    /* the postmaster, then every process whose parent it is */
    n += kill((pid_t)pm, sig) == 0;
    proc = opendir("/proc");
    ck_assert_ptr_nonnull(proc);
    while ((de = readdir(proc))) {
        char stat[300], buf[512];
        long pid = atol(de->d_name), ppid = 0;
        FILE *sf;
        char *close_paren;
        if (pid <= 0)
            continue;
        snprintf(stat, sizeof stat, "/proc/%ld/stat", pid);
        if (!(sf = fopen(stat, "r")))
            continue;
        if (fgets(buf, sizeof buf, sf) && (close_paren = strrchr(buf, ')')))
            sscanf(close_paren + 2, "%*c %ld", &ppid);
        fclose(sf);
        if (ppid == pm)
            n += kill((pid_t)pid, sig) == 0;
    }
    closedir(proc);
    return n;
}


void itest_key_file(char *path, size_t len, const char *tag, unsigned char fill)
{
    FILE *f;
    snprintf(path, len, "/tmp/idemq-key-%s-%d", tag, (int)getpid());
    unlink(path);
    ck_assert_ptr_nonnull(f = fopen(path, "w"));
    for (int i = 0; i < 32; i++)
        fprintf(f, "%02x", (unsigned char)(fill + i));
    fputc('\n', f);
    fclose(f);
    ck_assert_int_eq(chmod(path, 0600), 0);
}
