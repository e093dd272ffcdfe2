/*
 * Integration tests of running idemq in production, against the
 * real RabbitMQ and PostgreSQL of scripts/services:
 *   1. JSON logs parse and carry their fields; a hostile key cannot forge a
 *      line; no password appears in logs or check-config output;
 *   2. GET /live turns 503 while this run's PostgreSQL is stopped (SIGSTOP)
 *      and 200 after SIGCONT; the systemd watchdog pings stop meanwhile;
 *      the notifications arrive in order on a socket standing in for
 *      NOTIFY_SOCKET; promtool accepts a live scrape, and the alert rules
 *      (unit-tested) and the Grafana dashboard name only its metrics;
 *   3. run under a RabbitMQ user without configure permission and a
 *      PostgreSQL role without DDL rights applies, retries and parks jobs;
 *      the same user cannot run declare;
 *   4. a consumer cancelled by the broker (its queue deleted and declared
 *      again) is noticed at once, readiness says why, consumption resumes
 *      and nothing is applied twice; the deliveries another input's
 *      consumer held on the same channel go back one by one before a clean
 *      close, not through a connection loss (4b);
 *   5. a quorum input's broker-side delivery limit (a tiny one, by policy)
 *      dead-letters into <queue>.dead; parked list shows it, redrive moves
 *      it back, it is applied once and jobs show audits it;
 *   6. a quorum queue declared by an older idemq is accepted with a
 *      warning that names the policy path.
 */
#include <check.h>

#include "check_run.h"
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <arpa/inet.h>
#include <jansson.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "itest.h"
#include "resolve.h"
#include "topology.h"

#define EFFECTS_FOR "SELECT count(*) FROM idemq_test.effects WHERE key = $1"

static long long now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* A loopback port nobody listens on now (the kernel picks it). */
static int free_port(void)
{
    struct sockaddr_in sa;
    socklen_t len = sizeof sa;
    int fd = socket(AF_INET, SOCK_STREAM, 0), port;
    ck_assert_int_ge(fd, 0);
    memset(&sa, 0, sizeof sa);
    sa.sin_family = AF_INET;
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ck_assert_int_eq(bind(fd, (struct sockaddr *)&sa, sizeof sa), 0);
    ck_assert_int_eq(getsockname(fd, (struct sockaddr *)&sa, &len), 0);
    port = ntohs(sa.sin_port);
    close(fd);
    return port;
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

/*
 * Starts `idemq ARGV...` with stderr (and stdout) into log_path and extra
 * environment (NULL-terminated "K=V" list, or NULL). Returns the pid.
 */
static pid_t spawn_logged(const char *const *argv, const char *log_path, const char *const *env)
{
    pid_t pid;
    fflush(NULL);
    pid = fork();
    ck_assert_int_ge(pid, 0);
    if (pid == 0) {
        int fd = open(log_path, O_WRONLY | O_CREAT | O_TRUNC, 0600);
        char *args[16];
        int n = 0;
        if (fd < 0)
            _exit(126);
        dup2(fd, 1);
        dup2(fd, 2);
        close(fd);
        for (int i = 0; env && env[i]; i++)
            putenv((char *)env[i]);
        args[n++] = (char *)IDEMQ_BINARY;
        for (int i = 0; argv[i] && n < 15; i++)
            args[n++] = (char *)argv[i];
        args[n] = NULL;
        execv(IDEMQ_BINARY, args);
        _exit(127);
    }
    return pid;
}

/* Polls url until it answers want (or the deadline); returns the last status. */
static int wait_http(const char *url, int want, int ms, char *body, size_t len)
{
    long long end = now_ms() + itest_ms(ms);
    int code;
    do {
        code = itest_http_get(url, body, len);
        if (code == want)
            return code;
        usleep(100000);
    } while (now_ms() < end);
    return code;
}

/* Runs a shell command; returns its exit status. */
static int sh(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static int sh(const char *fmt, ...)
{
    char cmd[4096];
    va_list ap;
    int st;
    va_start(ap, fmt);
    vsnprintf(cmd, sizeof cmd, fmt, ap);
    va_end(ap);
    st = system(cmd);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

/* The management API of this run's RabbitMQ: METHOD PATH [JSON]; returns
 * the HTTP status. */
static int mgmt(const char *method, const char *path, const char *json)
{
    char cmd[2048], out[64];
    FILE *p;
    const char *base = getenv("IDEMQ_RABBIT_MGMT_URL");
    ck_assert_msg(base != NULL, "IDEMQ_RABBIT_MGMT_URL is not set");
    snprintf(cmd, sizeof cmd,
             "curl -s -o /dev/null -w '%%{http_code}' -u guest:guest -X %s "
             "-H 'content-type: application/json' %s%s%s '%s/api/%s'",
             method, json ? "-d '" : "", json ? json : "", json ? "'" : "", base, path);
    p = popen(cmd, "r");
    ck_assert_ptr_nonnull(p);
    out[0] = '\0';
    if (!fgets(out, sizeof out, p))
        out[0] = '\0';
    pclose(p);
    return atoi(out);
}

/* ---- this run's PostgreSQL, stopped and continued by pid ---- */

/* The postmaster of $IDEMQ_STATE_DIR's PostgreSQL (scripts/services). */
static pid_t postmaster_pid(void)
{
    const char *state = getenv("IDEMQ_STATE_DIR");
    char path[1024], dir[900] = "";
    FILE *f;
    long pid = 0;
    ck_assert_msg(state != NULL, "IDEMQ_STATE_DIR is not set (source the services env file)");
    snprintf(path, sizeof path, "%s/pg-dir", state);
    f = fopen(path, "r");
    ck_assert_msg(f != NULL, "cannot read %s", path);
    ck_assert(fgets(dir, sizeof dir, f) != NULL);
    fclose(f);
    dir[strcspn(dir, "\n")] = '\0';
    snprintf(path, sizeof path, "%s/data/postmaster.pid", dir);
    f = fopen(path, "r");
    ck_assert_msg(f != NULL, "cannot read %s", path);
    ck_assert(fscanf(f, "%ld", &pid) == 1);
    fclose(f);
    ck_assert_int_gt(pid, 1);
    return (pid_t)pid;
}

/* Sends sig to the postmaster and all its children (backends, and the
 * background processes), never to anything else. */
static void signal_postgres(int sig)
{
    pid_t pm = postmaster_pid();
    DIR *d = opendir("/proc");
    struct dirent *de;
    ck_assert_ptr_nonnull(d);
    while ((de = readdir(d))) {
        char path[300], stat[512];
        FILE *f;
        long ppid = 0;
        char *p;
        if (de->d_name[0] < '0' || de->d_name[0] > '9')
            continue;
        snprintf(path, sizeof path, "/proc/%s/stat", de->d_name);
        if (!(f = fopen(path, "r")))
            continue;
        if (fgets(stat, sizeof stat, f) && (p = strrchr(stat, ')')))
            sscanf(p + 2, "%*c %ld", &ppid);
        fclose(f);
        if (ppid == pm)
            kill((pid_t)atol(de->d_name), sig);
    }
    closedir(d);
    kill(pm, sig);
}

/* Unchecked teardown (runs in the runner even when a test failed): never
 * leave this run's PostgreSQL stopped. */
static void continue_postgres(void)
{
    if (getenv("IDEMQ_STATE_DIR"))
        signal_postgres(SIGCONT);
}

/* ---- a socket standing in for systemd's NOTIFY_SOCKET ---- */

struct notify_sock {
    int fd;
    char path[108];
    char log[16384]; /* every message, in order, separated by '|' */
};

static void notify_open(struct notify_sock *n)
{
    struct sockaddr_un sa;
    memset(n, 0, sizeof *n);
    snprintf(n->path, sizeof n->path, "/tmp/idemq-notify-%d-%lld.sock", (int)getpid(), now_ms());
    n->fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    ck_assert_int_ge(n->fd, 0);
    memset(&sa, 0, sizeof sa);
    sa.sun_family = AF_UNIX;
    snprintf(sa.sun_path, sizeof sa.sun_path, "%s", n->path);
    unlink(n->path);
    ck_assert_int_eq(bind(n->fd, (struct sockaddr *)&sa, sizeof sa), 0);
}

/* Reads what arrived within ms; returns the number of messages. */
static int notify_read(struct notify_sock *n, int ms)
{
    long long end = now_ms() + ms;
    int got = 0;
    for (;;) {
        struct pollfd p = {n->fd, POLLIN, 0};
        long long left = end - now_ms();
        char msg[2048];
        ssize_t r;
        if (poll(&p, 1, left > 0 ? (int)left : 0) <= 0)
            return got;
        r = recv(n->fd, msg, sizeof msg - 1, 0);
        if (r <= 0)
            return got;
        msg[r] = '\0';
        strncat(n->log, msg, sizeof n->log - strlen(n->log) - 2);
        strcat(n->log, "|");
        got++;
    }
}

static void notify_close(struct notify_sock *n)
{
    close(n->fd);
    unlink(n->path);
}

/* Position of the first occurrence of s in the notify log, or -1. */
static long notify_pos(const struct notify_sock *n, const char *s)
{
    const char *p = strstr(n->log, s);
    return p ? (long)(p - n->log) : -1;
}

/* Position of the last occurrence of s in the notify log, or -1. */
static long notify_last(const struct notify_sock *n, const char *s)
{
    long pos = -1;
    for (const char *p = n->log; (p = strstr(p, s)); p++)
        pos = (long)(p - n->log);
    return pos;
}

/* Assignments (lines of the messages) that start with s. */
static int notify_lines(const struct notify_sock *n, const char *s)
{
    int c = 0;
    size_t len = strlen(s);
    for (const char *p = n->log; *p;) {
        size_t line = strcspn(p, "\n|");
        if (line >= len && strncmp(p, s, len) == 0)
            c++;
        p += line;
        if (*p)
            p++;
    }
    return c;
}

static int count_of(const char *hay, const char *needle)
{
    int c = 0;
    for (const char *p = hay; (p = strstr(p, needle)); p += strlen(needle))
        c++;
    return c;
}

/* ------------------------------------------------------------ tests */

/* 1. JSON logs with a hostile key; no secret in logs or check-config. */
START_TEST(test_json_logs_no_secrets)
{
    struct itest t;
    char user[64], amqp_pw[64], pg_pw[64], body[64], path[128], url[512], dsn[512], env_url[600],
        env_dsn[600], hostile_key[256], out[16384];
    char *hostile_body;
    const char *amqp = getenv("IDEMQ_AMQP_URL");
    const char *port;
    char *log, *line, *save = NULL;
    json_error_t jerr;
    int lines = 0, parked_lines = 0, st;
    pid_t pid;

    itest_log_conf = "format = \"json\";";
    itest_setup(&t, "json", "idemq_test.record", "", "");
    itest_log_conf = NULL;
    snprintf(user, sizeof user, "%s_u", t.name);
    snprintf(amqp_pw, sizeof amqp_pw, "AmqpSecret-%d-%lld", (int)getpid(), now_ms());
    snprintf(pg_pw, sizeof pg_pw, "PgSecret-%d-%lld", (int)getpid(), now_ms());
    snprintf(path, sizeof path, "users/%s", user);
    snprintf(body, sizeof body, "{\"password\":\"%s\",\"tags\":\"\"}", amqp_pw);
    ck_assert_int_lt(mgmt("PUT", path, body), 300);
    snprintf(path, sizeof path, "permissions/%%2F/%s", user);
    ck_assert_int_lt(mgmt("PUT", path, "{\"configure\":\".*\",\"write\":\".*\",\"read\":\".*\"}"),
                     300);
    port = strrchr(amqp, ':');
    snprintf(url, sizeof url, "amqp://%s:%s@127.0.0.1%s", user, amqp_pw, port);
    /* trust authentication never asks for it: the password only has to stay
     * out of every line */
    snprintf(dsn, sizeof dsn, "%s password=%s", getenv("IDEMQ_PG_DSN"), pg_pw);
    snprintf(env_url, sizeof env_url, "IDEMQ_AMQP_URL=%s", url);
    snprintf(env_dsn, sizeof env_dsn, "IDEMQ_PG_DSN=%s", dsn);

    /* a key built to forge a line in either format */
    snprintf(hostile_key, sizeof hostile_key,
             "%s:hk\n2030-01-01T00:00:00.000Z idemq[ERROR] forged\r{\"level\":\"error\"}"
             "\x01\x1b[31m",
             t.name);
    {
        json_t *o = json_pack("{s:s,s:s}", "job_id", hostile_key, "raise", "22023");
        hostile_body = json_dumps(o, JSON_COMPACT);
        json_decref(o);
        ck_assert_ptr_nonnull(hostile_body);
    }
    /* a job that applies, and one with the hostile key that parks */
    {
        char ok[256];
        const char *bodies[2] = {ok, hostile_body};
        snprintf(ok, sizeof ok, "{\"job_id\":\"%s:ok\"}", t.name);
        itest_publish(&t, bodies, 2);
    }
    {
        char logp[128];
        const char *argv[] = {"run", "-c", t.cfg_path, "--until-idle", "2", NULL};
        const char *env[] = {env_url, env_dsn, NULL};
        snprintf(logp, sizeof logp, "/tmp/%s.log", t.name);
        pid = spawn_logged(argv, logp, env);
        st = itest_wait(pid, itest_ms(60000));
        ck_assert_msg(st != -1 && WIFEXITED(st) && WEXITSTATUS(st) == 0, "status 0x%x", st);
        log = slurp(logp);
        unlink(logp);
    }
    ck_assert_ptr_null(strstr(log, amqp_pw));
    ck_assert_ptr_null(strstr(log, pg_pw));
    for (line = strtok_r(log, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
        json_t *o = json_loads(line, 0, &jerr);
        const char *key;
        ck_assert_msg(o != NULL, "a log line is not JSON (%s): %s", jerr.text, line);
        ck_assert_msg(json_object_get(o, "ts") && json_object_get(o, "level") &&
                          json_object_get(o, "event") && json_object_get(o, "msg") &&
                          json_object_get(o, "consumer") && json_object_get(o, "worker") &&
                          json_object_get(o, "key") && json_object_get(o, "outcome") &&
                          json_object_get(o, "duration_ms") && json_object_get(o, "sqlstate"),
                      "fields missing: %s", line);
        ck_assert_str_eq(json_string_value(json_object_get(o, "consumer")), t.name);
        key = json_string_value(json_object_get(o, "key"));
        if (key && strstr(key, "forged")) {
            /* the key comes back whole, inside one line */
            ck_assert_str_eq(key, hostile_key);
            ck_assert_str_eq(json_string_value(json_object_get(o, "event")), "park");
            ck_assert_str_eq(json_string_value(json_object_get(o, "outcome")), "parked");
            ck_assert_str_eq(json_string_value(json_object_get(o, "error_class")), "permanent");
            ck_assert_str_eq(json_string_value(json_object_get(o, "sqlstate")), "22023");
            ck_assert_str_eq(json_string_value(json_object_get(o, "input")), t.name);
            ck_assert(json_is_integer(json_object_get(o, "worker")));
            ck_assert(json_is_integer(json_object_get(o, "tag")));
            ck_assert(json_is_number(json_object_get(o, "duration_ms")));
            parked_lines++;
        }
        json_decref(o);
        lines++;
    }
    ck_assert_int_ge(lines, 3);
    ck_assert_int_eq(parked_lines, 1);
    free(log);
    free(hostile_body);

    /* check-config prints the effective config: secrets redacted */
    setenv("IDEMQ_AMQP_URL", url, 1);
    setenv("IDEMQ_PG_DSN", dsn, 1);
    ck_assert_int_eq(itest_idemq(&t, "check-config", out, sizeof out), 0);
    ck_assert_ptr_nonnull(strstr(out, user));
    ck_assert_ptr_null(strstr(out, amqp_pw));
    ck_assert_ptr_null(strstr(out, pg_pw));
    /* and a failing start names the broker without its password */
    snprintf(url, sizeof url, "amqp://%s:%s@127.0.0.1:1/%%2F", user, amqp_pw);
    setenv("IDEMQ_AMQP_URL", url, 1);
    ck_assert_int_eq(itest_idemq(&t, "run --until-idle 1", out, sizeof out), 4);
    ck_assert_ptr_nonnull(strstr(out, "127.0.0.1:1"));
    ck_assert_ptr_null(strstr(out, amqp_pw));
    ck_assert_ptr_null(strstr(out, pg_pw));
    setenv("IDEMQ_AMQP_URL", amqp, 1);

    snprintf(path, sizeof path, "users/%s", user);
    mgmt("DELETE", path, NULL);
    itest_teardown(&t);
}
END_TEST

/* 2. /live and the watchdog follow a worker blocked in PostgreSQL; the
 * notifications come in order; promtool accepts a live scrape. */
START_TEST(test_liveness_and_systemd)
{
    struct itest t;
    char live[128], ready[128], metrics[128], body[32768], key[128], b[256],
        notify_env[200], scrape[128];
    const char *bodies[1] = {b};
    const char *env[3];
    struct notify_sock ns;
    int port = free_port(), st;
    long before_stop, pings_stuck;
    pid_t pid;
    FILE *f;

    itest_setup(&t, "live", "idemq_test.record", "", "");
    /* its own config: a short heartbeat, statement timeout and stall limit */
    f = fopen(t.cfg_path, "w");
    ck_assert_ptr_nonnull(f);
    fprintf(f,
            "broker: { heartbeat = 2; connect_timeout_ms = 1000; };\n"
            "database: { statement_timeout_ms = 1000; client_timeout_ms = 2000; };\n"
            "metrics: { listen = \"127.0.0.1:%d\"; live_stall_s = 3; };\n"
            "consumer: { id = \"%s\"; };\n"
            "inputs = ( { name = \"%s\"; exchange = \"%s\"; queue = \"%s\"; routing_key = \"%s\";\n"
            "  effect_function = \"idemq_test.record\"; } );\n",
            port, t.name, t.name, t.name, t.name, t.name);
    fclose(f);
    snprintf(live, sizeof live, "http://127.0.0.1:%d/live", port);
    snprintf(ready, sizeof ready, "http://127.0.0.1:%d/ready", port);
    snprintf(metrics, sizeof metrics, "http://127.0.0.1:%d/metrics", port);
    notify_open(&ns);
    snprintf(notify_env, sizeof notify_env, "NOTIFY_SOCKET=%s", ns.path);
    env[0] = notify_env;
    env[1] = "WATCHDOG_USEC=600000"; /* a ping every 0.3 s while live */
    env[2] = NULL;
    pid = itest_spawn(&t, t.cfg_path, 600, env);

    ck_assert_int_eq(wait_http(ready, 200, 20000, body, sizeof body), 200);
    ck_assert_int_eq(wait_http(live, 200, 5000, body, sizeof body), 200);
    notify_read(&ns, 1000);
    ck_assert_msg(notify_pos(&ns, "READY=1") >= 0, "%s", ns.log);
    ck_assert_msg(notify_pos(&ns, "STATUS=starting") == 0, "%s", ns.log);
    ck_assert_msg(notify_last(&ns, "WATCHDOG=1") > notify_pos(&ns, "READY=1"), "%s", ns.log);
    ck_assert_msg(strstr(ns.log, "STATUS=consuming with 1 worker(s)") != NULL, "%s", ns.log);

    /* promtool reads a live scrape (after one job, so counters move) */
    snprintf(key, sizeof key, "%s:first", t.name);
    snprintf(b, sizeof b, "{\"job_id\":\"%s\"}", key);
    itest_publish(&t, bodies, 1);
    for (int i = 0; i < 100 && itest_long(&t, EFFECTS_FOR, key) < 1; i++)
        usleep(50000);
    ck_assert_int_eq(itest_long(&t, EFFECTS_FOR, key), 1);
    ck_assert_int_eq(itest_http_get(metrics, body, sizeof body), 200);
    ck_assert_ptr_nonnull(strstr(body, "idemq_applied_total 1"));
    snprintf(scrape, sizeof scrape, "/tmp/%s.prom", t.name);
    f = fopen(scrape, "w");
    ck_assert_ptr_nonnull(f);
    fputs(body, f);
    fclose(f);
    ck_assert_msg(sh("promtool check metrics < %s", scrape) == 0,
                  "promtool check metrics refused the scrape:\n%s", body);
    /* the alert rules (checked, unit-tested) and the dashboard name only
     * metrics this scrape declares */
    ck_assert_msg(sh("%s/scripts/check-monitoring %s", IDEMQ_SOURCE_DIR, scrape) == 0,
                  "scripts/check-monitoring failed (its output is above)");
    unlink(scrape);

    /* PostgreSQL stops: the next job blocks the worker inside the database */
    signal_postgres(SIGSTOP);
    snprintf(key, sizeof key, "%s:blocked", t.name);
    snprintf(b, sizeof b, "{\"job_id\":\"%s\"}", key);
    itest_publish(&t, bodies, 1);
    ck_assert_int_eq(wait_http(live, 503, 15000, body, sizeof body), 503);
    ck_assert_msg(strstr(body, "not live: worker 0: no progress for"), "%s", body);
    /* /metrics still answers (the ledger gauges do not block a scrape) */
    ck_assert_int_eq(itest_http_get(metrics, body, sizeof body), 200);
    /* the watchdog pings stopped: none arrive while stuck */
    notify_read(&ns, 100);
    before_stop = count_of(ns.log, "WATCHDOG=1");
    notify_read(&ns, 1500);
    pings_stuck = count_of(ns.log, "WATCHDOG=1") - before_stop;
    ck_assert_int_eq(itest_http_get(live, body, sizeof body), 503);
    ck_assert_msg(pings_stuck == 0, "%ld watchdog pings while stuck: %s", pings_stuck, ns.log);
    ck_assert_msg(strstr(ns.log, "STATUS=STUCK: worker 0") != NULL, "%s", ns.log);

    signal_postgres(SIGCONT);
    itest_reconnect_db(&t);
    ck_assert_int_eq(wait_http(live, 200, 30000, body, sizeof body), 200);
    for (int i = 0; i < 300 && itest_long(&t, EFFECTS_FOR, key) < 1; i++)
        usleep(100000);
    ck_assert_int_eq(itest_long(&t, EFFECTS_FOR, key), 1); /* applied once */
    notify_read(&ns, 1000);
    ck_assert_int_gt(count_of(ns.log, "WATCHDOG=1"), before_stop); /* pings again */

    /* a worker status quoting a hostile key cannot add assignments of its
     * own: a fatal error (42501) pauses the worker, STATUS= says why */
    snprintf(key, sizeof key, "%s:k\nREADY=1\nSTATUS=forged", t.name);
    {
        json_t *o = json_pack("{s:s}", "job_id", key);
        char *txt = json_dumps(o, JSON_COMPACT);
        const char *params[1] = {key};
        PGresult *r = PQexecParams(t.db, "INSERT INTO idemq_test.failing VALUES ($1, '42501')",
                                   1, NULL, params, NULL, NULL, 0);
        ck_assert_int_eq(PQresultStatus(r), PGRES_COMMAND_OK);
        PQclear(r);
        snprintf(b, sizeof b, "%s", txt);
        free(txt);
        json_decref(o);
    }
    itest_publish(&t, bodies, 1);
    for (int i = 0; i < 100 && !strstr(ns.log, "forged"); i++)
        notify_read(&ns, 100);
    ck_assert_msg(strstr(ns.log, "STATUS=not ready: worker 0: ") != NULL, "%s", ns.log);
    ck_assert_int_eq(notify_lines(&ns, "READY=1"), 1);
    ck_assert_int_eq(notify_lines(&ns, "STATUS=forged"), 0);
    {
        const char *params[1] = {key};
        PGresult *r = PQexecParams(t.db, "DELETE FROM idemq_test.failing WHERE key = $1", 1,
                                   NULL, params, NULL, NULL, 0);
        ck_assert_int_eq(PQresultStatus(r), PGRES_COMMAND_OK);
        PQclear(r);
    }
    for (int i = 0; i < 300 && itest_long(&t, EFFECTS_FOR, key) < 1; i++)
        usleep(100000);
    ck_assert_int_eq(itest_long(&t, EFFECTS_FOR, key), 1);

    /* SIGTERM drains: STOPPING=1, then the last status */
    kill(pid, SIGTERM);
    st = itest_wait(pid, itest_ms(30000));
    ck_assert_msg(st != -1 && WIFEXITED(st) && WEXITSTATUS(st) == 0, "status 0x%x", st);
    notify_read(&ns, 500);
    ck_assert_msg(notify_pos(&ns, "STOPPING=1") > notify_pos(&ns, "READY=1"), "%s", ns.log);
    ck_assert_msg(strlen(ns.log) > 15 &&
                      strcmp(ns.log + strlen(ns.log) - 15, "STATUS=stopped|") == 0,
                  "%s", ns.log);
    ck_assert_int_eq(notify_lines(&ns, "READY=1"), 1);
    ck_assert_int_eq(notify_lines(&ns, "STOPPING=1"), 1);
    notify_close(&ns);
    itest_teardown(&t);
}
END_TEST

/* 2b. The probe server (D18): idle connections from one address cannot take
 * /live away from another (a per-address limit), the server closes them
 * after its connection timeout, and /ready says only "not ready" when a
 * job key is the cause (the key and the error stay in the log). */
START_TEST(test_probe_server_limits)
{
    enum { IDLE = 1100 }; /* beyond what select() serves (FD_SETSIZE) */
    struct itest t;
    char live[128], ready[128], body[4096], key[128], b[256];
    const char *bodies[1] = {b};
    static int fds[IDLE];
    struct sockaddr_in src, dst;
    struct rlimit rl;
    int port = free_port(), st, opened = 0;
    long long t0;
    pid_t pid;
    FILE *f;

    ck_assert_int_eq(getrlimit(RLIMIT_NOFILE, &rl), 0);
    if (rl.rlim_cur < IDLE + 100 && rl.rlim_max >= IDLE + 100) {
        rl.rlim_cur = IDLE + 100;
        ck_assert_int_eq(setrlimit(RLIMIT_NOFILE, &rl), 0);
    }
    ck_assert_msg(rl.rlim_cur >= IDLE + 100, "RLIMIT_NOFILE %ld is too low for this test",
                  (long)rl.rlim_cur);
    itest_setup(&t, "probe", "idemq_test.record", "", "");
    f = fopen(t.cfg_path, "w");
    ck_assert_ptr_nonnull(f);
    fprintf(f,
            "metrics: { listen = \"127.0.0.1:%d\"; };\n"
            "consumer: { id = \"%s\"; };\n"
            "inputs = ( { name = \"%s\"; exchange = \"%s\"; queue = \"%s\"; routing_key = \"%s\";\n"
            "  effect_function = \"idemq_test.record\"; } );\n",
            port, t.name, t.name, t.name, t.name, t.name);
    fclose(f);
    snprintf(live, sizeof live, "http://127.0.0.1:%d/live", port);
    snprintf(ready, sizeof ready, "http://127.0.0.1:%d/ready", port);
    pid = itest_spawn(&t, t.cfg_path, 600, NULL);
    ck_assert_int_eq(wait_http(ready, 200, 20000, body, sizeof body), 200);
    ck_assert_str_eq(body, "ready\n");

    /* IDLE connections from 127.0.0.2 that never send a request */
    memset(&src, 0, sizeof src);
    src.sin_family = AF_INET;
    inet_pton(AF_INET, "127.0.0.2", &src.sin_addr);
    memset(&dst, 0, sizeof dst);
    dst.sin_family = AF_INET;
    dst.sin_port = htons((uint16_t)port);
    inet_pton(AF_INET, "127.0.0.1", &dst.sin_addr);
    for (int i = 0; i < IDLE; i++) {
        fds[i] = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
        ck_assert_int_ge(fds[i], 0);
        ck_assert_int_eq(bind(fds[i], (struct sockaddr *)&src, sizeof src), 0);
        if (connect(fds[i], (struct sockaddr *)&dst, sizeof dst) == 0 || errno == EINPROGRESS)
            opened++;
    }
    ck_assert_int_ge(opened, IDLE / 2);
    /* /live from 127.0.0.1 still answers, at once */
    t0 = now_ms();
    ck_assert_int_eq(wait_http(live, 200, 3000, body, sizeof body), 200);
    ck_assert_str_eq(body, "live\n");
    ck_assert_msg(now_ms() - t0 < itest_ms(3000), "/live answered after %lld ms", now_ms() - t0);
    /* and the server closes an idle connection after its timeout */
    {
        struct pollfd pf = {fds[0], POLLIN, 0};
        char c;
        int n = poll(&pf, 1, itest_ms(15000));
        ck_assert_msg(n == 1, "an idle connection is still open after 15 s");
        ck_assert_int_le(read(fds[0], &c, 1), 0);
    }
    for (int i = 0; i < IDLE; i++)
        close(fds[i]);

    /* a fatal error (42501) on a job pauses the worker: /ready is 503 and
     * its body names neither the key nor the database's text */
    snprintf(key, sizeof key, "%s:secret-key-7731", t.name);
    snprintf(b, sizeof b, "{\"job_id\":\"%s\"}", key);
    {
        const char *params[1] = {key};
        PGresult *r = PQexecParams(t.db, "INSERT INTO idemq_test.failing VALUES ($1, '42501')",
                                   1, NULL, params, NULL, NULL, 0);
        ck_assert_int_eq(PQresultStatus(r), PGRES_COMMAND_OK);
        PQclear(r);
    }
    itest_publish(&t, bodies, 1);
    ck_assert_int_eq(wait_http(ready, 503, 20000, body, sizeof body), 503);
    ck_assert_msg(strstr(body, "secret-key-7731") == NULL, "/ready shows the key: %s", body);
    ck_assert_msg(strstr(body, "marked failing") == NULL, "/ready shows the error: %s", body);
    ck_assert_str_eq(body, "not ready\n");
    {
        const char *params[1] = {key};
        PGresult *r = PQexecParams(t.db, "DELETE FROM idemq_test.failing WHERE key = $1", 1,
                                   NULL, params, NULL, NULL, 0);
        ck_assert_int_eq(PQresultStatus(r), PGRES_COMMAND_OK);
        PQclear(r);
    }
    for (int i = 0; i < 300 && itest_long(&t, EFFECTS_FOR, key) < 1; i++)
        usleep(100000);
    ck_assert_int_eq(itest_long(&t, EFFECTS_FOR, key), 1);
    kill(pid, SIGTERM);
    st = itest_wait(pid, itest_ms(30000));
    ck_assert_msg(st != -1 && WIFEXITED(st) && WEXITSTATUS(st) == 0, "status 0x%x", st);
    itest_teardown(&t);
}
END_TEST

/* 3. Least privilege on both servers. */
START_TEST(test_least_privilege)
{
    struct itest t;
    char user[64], pw[64], role[64], path[160], json[512], url[512], dsn[512], sql[512],
        out[16384], keys[3][128], bufs[3][256];
    const char *bodies[3] = {bufs[0], bufs[1], bufs[2]};
    const char *amqp = getenv("IDEMQ_AMQP_URL");
    PGconn *db;
    PGresult *r;

    itest_retry_conf = "base_delay_ms = 200; max_delay_ms = 400; jitter = \"none\";";
    itest_extra_conf = "topology: { verify = \"passive\"; };";
    itest_setup(&t, "lp", "idemq_test.record", "", "");
    itest_retry_conf = NULL;
    itest_extra_conf = NULL;
    snprintf(user, sizeof user, "%s_amqp", t.name);
    snprintf(pw, sizeof pw, "Lp-%lld", now_ms());
    snprintf(role, sizeof role, "%s_run", t.name);

    /* RabbitMQ: read and write on the input's names (as consumer/OPERATIONS.md
     * "Roles and permissions" shows it), no configure */
    snprintf(path, sizeof path, "users/%s", user);
    snprintf(json, sizeof json, "{\"password\":\"%s\",\"tags\":\"\"}", pw);
    ck_assert_int_lt(mgmt("PUT", path, json), 300);
    snprintf(path, sizeof path, "permissions/%%2F/%s", user);
    snprintf(json, sizeof json,
             "{\"configure\":\"^$\",\"write\":\"^(amq\\\\.default|%s.*)$\","
             "\"read\":\"^%s.*$\"}",
             t.name, t.name);
    ck_assert_int_lt(mgmt("PUT", path, json), 300);
    snprintf(url, sizeof url, "amqp://%s:%s@127.0.0.1%s", user, pw, strrchr(amqp, ':'));

    /* PostgreSQL: a login role granted by idemq migrate --grant */
    snprintf(sql, sizeof sql, "CREATE ROLE %s LOGIN", role);
    itest_sql(&t, sql);
    snprintf(out, sizeof out, "migrate --print-grants %s", role);
    ck_assert_int_eq(itest_idemq(&t, out, out, sizeof out), 0);
    ck_assert_ptr_nonnull(strstr(out, "GRANT EXECUTE ON FUNCTION idemq_test.record"));
    ck_assert_ptr_null(strstr(out, "GRANT INSERT"));
    ck_assert_ptr_null(strstr(out, "GRANT ALL"));
    ck_assert_ptr_null(strstr(out, "CREATE ON"));
    snprintf(out, sizeof out, "migrate --grant %s", role);
    ck_assert_int_eq(itest_idemq(&t, out, out, sizeof out), 0);
    ck_assert_msg(strstr(out, "may now run idemq") != NULL, "%s", out);
    snprintf(dsn, sizeof dsn, "%s", getenv("IDEMQ_PG_DSN"));
    {
        char *u = strstr(dsn, "user=");
        ck_assert_ptr_nonnull(u);
        snprintf(u, sizeof dsn - (size_t)(u - dsn), "user=%s", role);
    }
    /* the role has no DDL and writes nothing directly */
    db = PQconnectdb(dsn);
    ck_assert_msg(PQstatus(db) == CONNECTION_OK, "%s", PQerrorMessage(db));
    r = PQexec(db, "CREATE TABLE idemq.intruder (i int)");
    ck_assert_str_eq(PQresultErrorField(r, PG_DIAG_SQLSTATE), "42501");
    PQclear(r);
    r = PQexec(db, "CREATE TABLE public.intruder (i int)");
    ck_assert_str_eq(PQresultErrorField(r, PG_DIAG_SQLSTATE), "42501");
    PQclear(r);
    r = PQexec(db, "UPDATE idemq.jobs SET state = 'applied' WHERE false");
    ck_assert_str_eq(PQresultErrorField(r, PG_DIAG_SQLSTATE), "42501");
    PQclear(r);
    r = PQexec(db, "DELETE FROM idemq.parked WHERE false");
    ck_assert_str_eq(PQresultErrorField(r, PG_DIAG_SQLSTATE), "42501");
    PQclear(r);
    PQfinish(db);

    /* run under both: one job applies, one retries once, one parks */
    for (int i = 0; i < 3; i++)
        snprintf(keys[i], sizeof keys[i], "%s:%d", t.name, i);
    snprintf(bufs[0], sizeof bufs[0], "{\"job_id\":\"%s\"}", keys[0]);
    snprintf(bufs[1], sizeof bufs[1], "{\"job_id\":\"%s\",\"raise\":\"40001\",\"raise_until\":1}",
             keys[1]);
    snprintf(bufs[2], sizeof bufs[2], "{\"job_id\":\"%s\",\"raise\":\"22023\"}", keys[2]);
    itest_publish(&t, bodies, 3);
    setenv("IDEMQ_AMQP_URL", url, 1);
    setenv("IDEMQ_PG_DSN", dsn, 1);
    ck_assert_int_eq(itest_idemq(&t, "run --until-idle 3", out, sizeof out), 0);
    ck_assert_msg(strstr(out, "topology.verify = passive") && strstr(out, "NOT checked"), "%s",
                  out);
    ck_assert_ptr_null(strstr(out, pw));
    ck_assert_int_eq(itest_long(&t, EFFECTS_FOR, keys[0]), 1);
    ck_assert_int_eq(itest_long(&t, EFFECTS_FOR, keys[1]), 1);
    ck_assert_int_eq(itest_long(&t, EFFECTS_FOR, keys[2]), 0);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.attempts WHERE key = $1 "
                                    "AND outcome = 'transient_error'",
                                keys[1]),
                     1);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.parked WHERE key = $1", keys[2]),
                     1);
    {
        char dlq[TOPOLOGY_NAME_MAX];
        topology_dlq(&t.conf->inputs[0], dlq, sizeof dlq);
        ck_assert_int_eq(itest_queue_ready(&t, dlq), 1);
    }
    /* the operator commands work for the role too (they only read) */
    snprintf(sql, sizeof sql, "parked list --input %s", t.name);
    ck_assert_int_eq(itest_idemq(&t, sql, out, sizeof out), 0);
    ck_assert_msg(strstr(out, keys[2]) != NULL, "%s", out);

    /* full verification needs configure permission: refused, with a hint */
    itest_write_config(&t, t.cfg_path, t.name, "idemq_test.record", "", "");
    ck_assert_int_eq(itest_idemq(&t, "run --until-idle 1", out, sizeof out), 6);
    ck_assert_msg(strstr(out, "403") && strstr(out, "topology.verify"), "%s", out);
    /* and declare is an administrator's job */
    ck_assert_int_eq(itest_idemq(&t, "declare", out, sizeof out), 6);
    ck_assert_msg(strstr(out, "ACCESS_REFUSED") && strstr(out, "configure permission"), "%s",
                  out);
    setenv("IDEMQ_AMQP_URL", amqp, 1);

    snprintf(path, sizeof path, "users/%s", user);
    mgmt("DELETE", path, NULL);
    snprintf(sql, sizeof sql, "DROP OWNED BY %s; DROP ROLE %s", role, role);
    itest_sql(&t, sql);
    itest_teardown(&t);
}
END_TEST

/* 4. The input queue deleted and declared again under a running idemq. */
START_TEST(test_consumer_cancelled)
{
    struct itest t;
    char ready[128], body[4096], extra[128], keys[40][128], bufs[40][256], log[160];
    const char *bodies[40];
    struct broker *b;
    char err[512];
    int port = free_port(), st;
    long long t0;
    pid_t pid;

    snprintf(extra, sizeof extra, "metrics: { listen = \"127.0.0.1:%d\"; };", port);
    snprintf(ready, sizeof ready, "http://127.0.0.1:%d/ready", port);
    itest_extra_conf = extra;
    itest_setup(&t, "cancel", "idemq_test.record", "batch_max = 5;", "");
    itest_extra_conf = NULL;
    for (int i = 0; i < 40; i++) {
        snprintf(keys[i], sizeof keys[i], "%s:%d", t.name, i);
        /* the first 20 are slow: some are still held unacknowledged when
         * their queue goes */
        snprintf(bufs[i], sizeof bufs[i], "{\"job_id\":\"%s\"%s}", keys[i],
                 i < 20 ? ",\"sleep_ms\":100" : "");
        bodies[i] = bufs[i];
    }
    snprintf(log, sizeof log, "/tmp/%s.log", t.name);
    pid = itest_spawn_log(t.cfg_path, 600, NULL, log);
    ck_assert_int_eq(wait_http(ready, 200, 20000, body, sizeof body), 200);
    itest_publish(&t, bodies, 20);
    for (int i = 0; i < 100 && itest_long(&t, EFFECTS_FOR, keys[0]) < 1; i++)
        usleep(20000);

    ck_assert(broker_open(t.conf, "itest", false, &b, err, sizeof err) == IDEMQ_OK);
    ck_assert(broker_admin_delete_queue(b, t.name) == IDEMQ_OK);
    t0 = now_ms();
    ck_assert_int_eq(wait_http(ready, 503, 5000, body, sizeof body), 503);
    ck_assert_msg(now_ms() - t0 < itest_ms(3000), "noticed after %lld ms", now_ms() - t0);
    /* /ready is terse (D18); the log says why, naming the queue */
    ck_assert_str_eq(body, "not ready\n");
    {
        int found = 0;
        for (int i = 0; i < 50 && !found; i++) {
            found = sh("grep 'NOT READY' %s | grep -q -- '%s'", log, t.name) == 0;
            if (!found)
                usleep(100000);
        }
        ck_assert_msg(found, "no NOT READY line naming %s in %s", t.name, log);
    }
    /* back: declared again (as an operator would), consumption resumes */
    ck_assert(topology_declare(b, t.conf, &t.conf->inputs[0]) == IDEMQ_OK);
    broker_close(b);
    ck_assert_int_eq(wait_http(ready, 200, 60000, body, sizeof body), 200);
    itest_publish(&t, bodies + 20, 20);
    for (int i = 20; i < 40; i++)
        for (int k = 0; k < 200 && itest_long(&t, EFFECTS_FOR, keys[i]) < 1; k++)
            usleep(50000);
    for (int i = 0; i < 40; i++) /* none twice; every one published after, once */
        ck_assert_int_eq(itest_long(&t, EFFECTS_FOR, keys[i]) > 1, 0);
    for (int i = 20; i < 40; i++)
        ck_assert_int_eq(itest_long(&t, EFFECTS_FOR, keys[i]), 1);
    kill(pid, SIGTERM);
    st = itest_wait(pid, itest_ms(30000));
    ck_assert_msg(st != -1 && WIFEXITED(st) && WEXITSTATUS(st) == 0, "status 0x%x", st);
    unlink(log);
    itest_teardown(&t);
}
END_TEST

/* The broker's record of the connections named "idemq <id> worker N"
 * (from its log under $IDEMQ_STATE_DIR): how many it closed, and how many
 * of those the client dropped without a close (a connection loss, which
 * returns every delivery the connection held as a failure). */
static void worker_closes(const char *id, int *closed, int *lost)
{
    char cmd[1024], out[64] = "";
    FILE *p;
    snprintf(cmd, sizeof cmd,
             "cat \"$IDEMQ_STATE_DIR\"/rabbit*/log/*.log 2>/dev/null | awk -v n='- idemq %s "
             "worker ' '/closing AMQP connection/ && index($0, n) { c[$4] = 1; closed++ } "
             "/client unexpectedly closed TCP connection/ && ($4 in c) { lost++ } "
             "END { print closed + 0, lost + 0 }'",
             id);
    ck_assert_ptr_nonnull(p = popen(cmd, "r"));
    ck_assert_ptr_nonnull(fgets(out, sizeof out, p));
    pclose(p);
    ck_assert_int_eq(sscanf(out, "%d %d", closed, lost), 2);
}

/* 4b. The broker cancels one input's consumer (its queue deleted, with
 * deliveries the worker read from it) while another input's consumer on
 * the same channel (a quorum queue) holds deliveries: a batch still
 * filling (batch_wait_ms) when the cancel is read. The worker pauses as for any other reason: the other consumer's
 * deliveries go back one by one on the open channel, which is then closed,
 * not through a connection loss (which RabbitMQ 4.3 counts toward the
 * quorum delivery limit, and a single basic.nack not). */
START_TEST(test_broker_cancel_gives_back_others)
{
    struct itest t;
    char extra[512], held[128], log[160], err[512], order[1024];
    struct broker *b;
    const int n = 5;
    int st, closed = 0, lost = 0;
    pid_t pid;

    itest_setup(&t, "bcancel", "idemq_test.record", "", "");
    snprintf(held, sizeof held, "%s_held", t.name);
    snprintf(extra, sizeof extra,
             "}, { name = \"%s\"; exchange = \"%s\"; queue = \"%s\"; routing_key = \"%s\"; "
             "effect_function = \"idemq_test.record\"; queue_type = \"quorum\";",
             held, held, held, held);
    itest_write_config(&t, t.cfg_path, t.name, "idemq_test.record",
                       "batch_max = 50; batch_wait_ms = 5000;", extra);
    conf_free(t.conf);
    ck_assert_msg(conf_load(t.cfg_path, &t.conf, err, sizeof err) == IDEMQ_OK, "%s", err);
    ck_assert_int_eq(t.conf->n_inputs, 2);
    ck_assert(broker_open(t.conf, "itest", false, &b, err, sizeof err) == IDEMQ_OK);
    ck_assert_msg(topology_declare(b, t.conf, &t.conf->inputs[1]) == IDEMQ_OK, "%s",
                  broker_error(b));
    broker_close(b);
    snprintf(log, sizeof log, "/tmp/%s.log", t.name);
    pid = itest_spawn_log(t.cfg_path, 600, NULL, log);
    for (int i = 0; i < itest_ms(200) && (itest_queue_consumers(&t, held) < 1 ||
                                          itest_queue_consumers(&t, t.name) < 1);
         i++)
        usleep(50000);
    ck_assert_int_eq(itest_queue_consumers(&t, held), 1);
    /* the worker reads these into a batch that waits up to 5 s to fill ... */
    for (int i = 0; i < n; i++) {
        char body[256];
        snprintf(body, sizeof body, "{\"job_id\":\"%s:%d\"}", held, i);
        itest_publish_to(&t, held, held, body, NULL, NULL);
    }
    for (int i = 0; i < 3; i++) { /* and these, lost with their queue */
        char body[256];
        snprintf(body, sizeof body, "{\"job_id\":\"%s:gone%d\"}", t.name, i);
        itest_publish_to(&t, t.name, t.name, body, NULL, NULL);
    }
    /* ... when the broker cancels the other input's consumer */
    ck_assert(broker_open(t.conf, "itest", false, &b, err, sizeof err) == IDEMQ_OK);
    ck_assert(broker_admin_delete_queue(b, t.name) == IDEMQ_OK);
    for (int i = 0; i < 100 && sh("grep -q 'broker cancelled consumer' %s", log) != 0; i++)
        usleep(50000);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq_test.effects WHERE key LIKE $1 || "
                                    "':%'",
                                held),
                     0);
    ck_assert_msg(topology_declare(b, t.conf, &t.conf->inputs[0]) == IDEMQ_OK, "%s",
                  broker_error(b));
    broker_close(b);
    for (int i = 0; i < itest_ms(600) && itest_long(&t, "SELECT count(DISTINCT key) FROM "
                                                        "idemq_test.effects WHERE key LIKE $1 || "
                                                        "':%'",
                                                    held) < n;
         i++)
        usleep(50000);
    kill(pid, SIGTERM);
    st = itest_wait(pid, itest_ms(30000));
    ck_assert_msg(st != -1 && WIFEXITED(st) && WEXITSTATUS(st) == 0, "status 0x%x", st);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq_test.effects WHERE key LIKE $1 || "
                                    "':%'",
                                held),
                     n);
    itest_text(&t, "SELECT string_agg(coalesce(meta->>'delivery_count', '-') || '/' || "
                   "(meta->>'redelivered'), ' ' ORDER BY id) FROM idemq_test.effects WHERE key "
                   "LIKE $1 || ':%'",
               held, order, sizeof order);
    /* the worker held them at the pause: they came back */
    ck_assert_msg(itest_long(&t, "SELECT count(*) FROM idemq_test.effects WHERE key LIKE $1 || "
                                 "':%' AND meta->>'redelivered' = 'true'",
                             held) == n,
                  "not all returned (delivery count/redelivered: %s)", order);
    for (int i = 0; i < 50 && (worker_closes(t.name, &closed, &lost), closed < 2); i++)
        usleep(100000); /* the node writes its log a moment later */
    ck_assert_msg(closed >= 2, "the broker logged %d closes of the worker's connections", closed);
    ck_assert_msg(lost == 0,
                  "%d of the worker's %d connections were lost, not closed (delivery "
                  "count/redelivered of the held input's jobs: %s)",
                  lost, closed, order);
    unlink(log);
    itest_delete_topology(&t, &t.conf->inputs[1]);
    itest_teardown(&t);
}
END_TEST

/* 5. The broker's delivery limit of a quorum input, set tiny by policy.
 * With protection.active, the park recorded for it holds its body sealed. */
START_TEST(test_quorum_delivery_limit)
{
    struct itest t;
    char key[128], b[256], path[256], policy[512], dlq[TOPOLOGY_NAME_MAX], out[16384];
    char k1[128], extra[300];
    const char *bodies[1] = {b};
    const char *crash[] = {"IDEMQ_TEST_CRASH=before_commit", NULL};
    int st;

    itest_key_file(k1, sizeof k1, "qdl", 0x30);
    snprintf(extra, sizeof extra, "protection: { keys = [ \"k1=%s\" ]; active = \"k1\"; };", k1);
    itest_extra_conf = extra;
    itest_setup(&t, "qdl", "idemq_test.record", "", "queue_type = \"quorum\";");
    itest_extra_conf = NULL;
    topology_dlq(&t.conf->inputs[0], dlq, sizeof dlq);
    snprintf(path, sizeof path, "policies/%%2F/%s", t.name);
    snprintf(policy, sizeof policy,
             "{\"pattern\":\"^%s$\",\"definition\":{\"delivery-limit\":1},"
             "\"apply-to\":\"queues\",\"priority\":10}",
             t.name);
    ck_assert_int_lt(mgmt("PUT", path, policy), 300);
    usleep(500000); /* policies apply asynchronously */
    snprintf(key, sizeof key, "%s:limit", t.name);
    snprintf(b, sizeof b, "{\"job_id\":\"%s\"}", key);
    itest_publish(&t, bodies, 1);
    /* two deliveries, each ending in a crash before the commit */
    for (int i = 0; i < 2; i++) {
        st = itest_wait(itest_spawn(&t, t.cfg_path, 5, crash), itest_ms(30000));
        ck_assert_msg(st != -1 && WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL,
                      "run %d: expected the crash hook, status 0x%x", i, st);
    }
    for (int i = 0; i < 100 && itest_queue_ready(&t, dlq) < 1; i++)
        usleep(50000);
    ck_assert_int_eq(itest_queue_ready(&t, dlq), 1); /* dead-lettered by the broker */
    ck_assert_int_eq(itest_queue_ready(&t, t.name), 0);
    ck_assert_int_eq(itest_long(&t, EFFECTS_FOR, key), 0);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.parked WHERE key = $1", key), 0);
    mgmt("DELETE", path, NULL);

    /* listed like a parked message (and left in place) */
    snprintf(path, sizeof path, "parked list --input %s", t.name);
    ck_assert_int_eq(itest_idemq(&t, path, out, sizeof out), 0);
    ck_assert_msg(strstr(out, "dead-lettered by the broker") && strstr(out, key) &&
                      strstr(out, "delivery_limit") && strstr(out, "broker(not yet recorded)=1"),
                  "%s", out);
    ck_assert_int_eq(itest_queue_ready(&t, dlq), 1);
    /* filters apply to it too */
    snprintf(path, sizeof path, "parked list --input %s --class permanent", t.name);
    ck_assert_int_eq(itest_idemq(&t, path, out, sizeof out), 0);
    ck_assert_ptr_null(strstr(out, key));

    /* redriven: recorded in the ledger, moved back, applied once */
    ck_assert_int_eq(itest_idemq(&t, "redrive", out, sizeof out), 0);
    ck_assert_msg(strstr(out, "dead-lettered by the broker; now recorded") != NULL, "%s", out);
    ck_assert_int_eq(itest_queue_ready(&t, dlq), 0);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.parked WHERE key = $1 AND "
                                    "error_class = 'broker' AND error_code = 'delivery_limit'",
                                key),
                     1);
    /* sealed at rest: no byte of the key in the clear, the message's own size */
    snprintf(policy, sizeof policy,
             "SELECT count(*) FROM idemq.parked WHERE key = $1 AND body_key = 'k1' AND "
             "position(convert_to($1, 'UTF8') IN body) = 0 AND body_size = %zu AND "
             "octet_length(body) = %zu",
             strlen(b), strlen(b) + 28);
    ck_assert_int_eq(itest_long(&t, policy, key), 1);
    itest_run_until_idle(&t, 2);
    ck_assert_int_eq(itest_long(&t, EFFECTS_FOR, key), 1);
    /* audited */
    snprintf(path, sizeof path, "jobs show '%s'", key);
    ck_assert_int_eq(itest_idemq(&t, path, out, sizeof out), 0);
    ck_assert_msg(strstr(out, "broker delivery_limit") &&
                      strstr(out, "dead-lettered by the broker") && strstr(out, ": applied"),
                  "%s", out);
    snprintf(path, sizeof path, "parked list --input %s", t.name);
    ck_assert_int_eq(itest_idemq(&t, path, out, sizeof out), 0);
    ck_assert_msg(strstr(out, "broker=1") && !strstr(out, "not yet recorded"), "%s", out);
    unlink(k1);
    itest_teardown(&t);
}
END_TEST

/* 6. A quorum queue declared before delivery limits existed is accepted,
 * with a warning that names the policy path. */
START_TEST(test_legacy_quorum_queue)
{
    struct itest t;
    char q[128], cfg[256], out[16384];
    struct broker *b;
    char err[512];
    json_t *legacy = json_pack("{s:s}", "x-queue-type", "quorum");

    itest_setup(&t, "legacy", "idemq_test.record", "", "");
    snprintf(q, sizeof q, "%s_old", t.name);
    ck_assert(broker_open(t.conf, "itest", false, &b, err, sizeof err) == IDEMQ_OK);
    ck_assert(broker_admin_declare_queue(b, q, legacy, false) == IDEMQ_OK);
    snprintf(cfg, sizeof cfg, "/tmp/%s_old.cfg", t.name);
    itest_write_config(&t, cfg, q, "idemq_test.record", "", "queue_type = \"quorum\";");
    snprintf(out, sizeof out, "%s declare -c %s 2>&1", IDEMQ_BINARY, cfg);
    {
        FILE *p = popen(out, "r");
        size_t n = fread(out, 1, sizeof out - 1, p);
        int rc;
        out[n] = '\0';
        rc = pclose(p);
        ck_assert_msg(WIFEXITED(rc) && WEXITSTATUS(rc) == 0, "%s", out);
    }
    ck_assert_msg(strstr(out, "by an older idemq") &&
                      strstr(out, "Quorum delivery limits"),
                  "%s", out);
    broker_close(b);
    {
        struct conf *old;
        ck_assert(conf_load(cfg, &old, err, sizeof err) == IDEMQ_OK);
        itest_delete_topology(&t, &old->inputs[0]);
        conf_free(old);
    }
    unlink(cfg);
    json_decref(legacy);
    itest_teardown(&t);
}
END_TEST

/* D17: stored text a producer or provider chose (here a key with ESC, a
 * newline and U+009B, the C1 CSI) reaches the operator's terminal escaped
 * in `jobs show` and `parked list`: no escape sequence runs, no forged line
 * starts. */
START_TEST(test_operator_output_escaped)
{
    struct itest t;
    char key[160], body[400], args[400], out[16384];
    const char *bodies[1] = {body};
    itest_setup(&t, "esc", "idemq_test.record", "", "");
    /* the key as bytes, and as JSON escapes in the body */
    snprintf(key, sizeof key, "%s:e\x1b[2J\nforged line \xc2\x9b", t.name);
    snprintf(body, sizeof body,
             "{\"job_id\":\"%s:e\\u001b[2J\\nforged line \\u009b\",\"raise\":\"23505\"}",
             t.name);
    itest_publish(&t, bodies, 1);
    itest_run_until_idle(&t, 2);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.jobs WHERE key = $1 AND state "
                                    "= 'parked'",
                                key),
                     1);
    snprintf(args, sizeof args, "jobs show '%s'", key);
    ck_assert_int_eq(itest_idemq(&t, args, out, sizeof out), 0);
    ck_assert_msg(!strchr(out, '\x1b') && !strstr(out, "\xc2\x9b") &&
                      !strstr(out, "\nforged line"),
                  "jobs show printed raw control bytes:\n%s", out);
    ck_assert_msg(strstr(out, "e\\x1b[2J\\nforged line \\xc2\\x9b") != NULL, "%s", out);
    snprintf(args, sizeof args, "parked list --key '%s'", key);
    ck_assert_int_eq(itest_idemq(&t, args, out, sizeof out), 0);
    ck_assert_msg(!strchr(out, '\x1b') && !strstr(out, "\xc2\x9b") &&
                      !strstr(out, "\nforged line"),
                  "parked list printed raw control bytes:\n%s", out);
    itest_teardown(&t);
}
END_TEST

/* D17: the command `idemq resolve` prints for a redrive quotes the
 * producer's key for the shell: what sh reads back is the key itself, and
 * a key with a control byte gets no command at all. */
START_TEST(test_resolve_shell_quote)
{
    const char *keys[] = {"plain", "a'b; touch /tmp/idemq-pwned-$$ #", "''", "$(id) `id` \\",
                          NULL};
    char q[600], cmd[800], got[600];
    for (int i = 0; keys[i]; i++) {
        FILE *p;
        size_t n;
        ck_assert(resolve_shell_quote(keys[i], q, sizeof q));
        snprintf(cmd, sizeof cmd, "printf '%%s' %s", q);
        ck_assert_ptr_nonnull(p = popen(cmd, "r"));
        n = fread(got, 1, sizeof got - 1, p);
        got[n] = '\0';
        ck_assert_int_eq(pclose(p), 0);
        ck_assert_str_eq(got, keys[i]);
    }
    ck_assert(!resolve_shell_quote("a\nb", q, sizeof q));
    ck_assert(!resolve_shell_quote("a\x1b[2Jb", q, sizeof q));
    ck_assert(!resolve_shell_quote("caf\xc3\xa9", q, sizeof q));
    ck_assert(!resolve_shell_quote("x'y'z", q, 8)); /* too small */
}
END_TEST

/* dsn of IDEMQ_PG_DSN with user= replaced by role */
static void dsn_as(const char *role, char *dsn, size_t len)
{
    char *u;
    snprintf(dsn, len, "%s", getenv("IDEMQ_PG_DSN"));
    u = strstr(dsn, "user=");
    ck_assert_ptr_nonnull(u);
    snprintf(u, len - (size_t)(u - dsn), "user=%s", role);
}

/* An application that emits to the outbox has USAGE on schema idemq and
 * EXECUTE on idemq.emit. That must not let it read any key's story or
 * result (job_info, key_history, key_batches, key_attempts, key_outbox) or
 * run maintenance: every other function of the schema is closed to it. */
START_TEST(test_application_role_reads_nothing)
{
    struct itest t;
    char role[128], sql[512], dsn[512], out[4096];
    static const char *const denied[] = {
        "SELECT * FROM idemq.job_info('k')",
        "SELECT * FROM idemq.key_history('k')",
        "SELECT * FROM idemq.key_attempts('k')",
        "SELECT * FROM idemq.key_batches('k', now(), 1)",
        "SELECT * FROM idemq.key_outbox('k')",
        "SELECT idemq.maintain('intruder', 10)",
        "SELECT * FROM idemq.ledger_settings()",
        "SELECT count(*) FROM idemq.jobs",
    };
    PGconn *db;
    PGresult *r;

    itest_setup(&t, "app", "idemq_test.record", "", "");
    /* by hand, as an application that emits used to be given it; then by
     * idemq migrate --grant-app, which also creates the role */
    for (int way = 0; way < 2; way++) {
        snprintf(role, sizeof role, "%s_app%d", t.name, way);
        if (way == 0) {
            snprintf(sql, sizeof sql,
                     "CREATE ROLE %s LOGIN; GRANT USAGE ON SCHEMA idemq TO %s; "
                     "GRANT EXECUTE ON FUNCTION idemq.emit(text, text, text, jsonb, text, text) "
                     "TO %s; "
                     "GRANT EXECUTE ON FUNCTION idemq.emit(text, text, bytea, jsonb, text, text) "
                     "TO %s",
                     role, role, role, role);
            itest_sql(&t, sql);
        } else {
            snprintf(sql, sizeof sql, "migrate --grant-app %s", role);
            ck_assert_int_eq(itest_idemq(&t, sql, out, sizeof out), 0);
            ck_assert_msg(strstr(out, "created app role") != NULL, "%s", out);
        }
        snprintf(sql, sizeof sql,
                 "SELECT count(*) FROM pg_proc WHERE pronamespace = 'idemq'::regnamespace "
                 "AND proname NOT IN ('emit', 'enqueue', 'enqueue_raw') "
                 "AND has_function_privilege('%s', oid, 'EXECUTE')",
                 role);
        ck_assert_int_eq(itest_long(&t, sql, NULL), 0);
        if (way == 1) { /* --grant-app: it may enqueue into PostgreSQL queue inputs too */
            snprintf(sql, sizeof sql,
                     "SELECT has_function_privilege('%s', 'idemq.enqueue(text, jsonb, text, "
                     "text, timestamptz, integer)', 'EXECUTE')::int",
                     role);
            ck_assert_int_eq(itest_long(&t, sql, NULL), 1);
        }

        dsn_as(role, dsn, sizeof dsn);
        db = PQconnectdb(dsn);
        ck_assert_msg(PQstatus(db) == CONNECTION_OK, "%s", PQerrorMessage(db));
        for (size_t i = 0; i < sizeof denied / sizeof denied[0]; i++) {
            r = PQexec(db, denied[i]);
            ck_assert_msg(PQresultStatus(r) == PGRES_FATAL_ERROR, "allowed: %s", denied[i]);
            ck_assert_str_eq(PQresultErrorField(r, PG_DIAG_SQLSTATE), "42501");
            PQclear(r);
        }
        /* and it can emit, through the COMMIT (the outbox's deferred trigger) */
        snprintf(sql, sizeof sql,
                 "BEGIN; SELECT idemq.emit('x', 'rk', '{}'::text, NULL, '%s:app'); COMMIT",
                 t.name);
        r = PQexec(db, sql);
        ck_assert_msg(PQresultStatus(r) == PGRES_COMMAND_OK, "%s", PQerrorMessage(db));
        PQclear(r);
        PQfinish(db);
        snprintf(sql, sizeof sql, "DELETE FROM idemq.outbox WHERE order_key = '%s:app'", t.name);
        itest_sql(&t, sql);
        snprintf(sql, sizeof sql, "DROP OWNED BY %s; DROP ROLE %s", role, role);
        itest_sql(&t, sql);
    }
    itest_teardown(&t);
}
END_TEST

/* The operator role of idemq migrate --grant-operator reads a key's story,
 * and cannot write the ledger, apply a batch or emit. */
START_TEST(test_operator_role)
{
    struct itest t;
    char role[128], sql[512], dsn[512], out[8192];
    static const char *const denied[] = {
        "UPDATE idemq.jobs SET state = 'applied' WHERE false",
        "INSERT INTO idemq.operator_actions SELECT * FROM idemq.operator_actions WHERE false",
        "SELECT idemq.emit('x', 'rk', '{}'::text)",
        "SELECT * FROM idemq.apply_batch(NULL::text[], NULL::jsonb, NULL::text)",
        "CREATE TABLE idemq.intruder (i int)",
    };
    PGconn *db;
    PGresult *r;

    itest_setup(&t, "opr", "idemq_test.record", "", "");
    snprintf(role, sizeof role, "%s_op", t.name);
    snprintf(sql, sizeof sql, "migrate --print-grants-operator %s", role);
    ck_assert_int_eq(itest_idemq(&t, sql, out, sizeof out), 0);
    ck_assert_msg(strstr(out, "'job_info'") && !strstr(out, "GRANT INSERT") &&
                      !strstr(out, "ALL FUNCTIONS"),
                  "%s", out);
    snprintf(sql, sizeof sql, "migrate --grant-operator %s", role);
    ck_assert_int_eq(itest_idemq(&t, sql, out, sizeof out), 0);
    ck_assert_msg(strstr(out, "created operator role") != NULL, "%s", out);
    /* a second time: the role exists */
    ck_assert_int_eq(itest_idemq(&t, sql, out, sizeof out), 0);
    ck_assert_msg(strstr(out, "existing operator role") != NULL, "%s", out);
    dsn_as(role, dsn, sizeof dsn);
    db = PQconnectdb(dsn);
    ck_assert_msg(PQstatus(db) == CONNECTION_OK, "%s", PQerrorMessage(db));
    r = PQexec(db, "SELECT * FROM idemq.job_info('k'), idemq.key_history('k')");
    ck_assert_msg(PQresultStatus(r) == PGRES_TUPLES_OK, "%s", PQerrorMessage(db));
    PQclear(r);
    for (size_t i = 0; i < sizeof denied / sizeof denied[0]; i++) {
        r = PQexec(db, denied[i]);
        ck_assert_msg(PQresultStatus(r) == PGRES_FATAL_ERROR, "allowed: %s", denied[i]);
        ck_assert_str_eq(PQresultErrorField(r, PG_DIAG_SQLSTATE), "42501");
        PQclear(r);
    }
    PQfinish(db);
    snprintf(sql, sizeof sql, "DROP OWNED BY %s; DROP ROLE %s", role, role);
    itest_sql(&t, sql);
    itest_teardown(&t);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("ops");
    TCase *tc = tcase_create("ops");
    tcase_set_timeout(tc, 180);
    tcase_add_unchecked_fixture(tc, NULL, continue_postgres);
    tcase_add_test(tc, test_json_logs_no_secrets);
    tcase_add_test(tc, test_liveness_and_systemd);
    tcase_add_test(tc, test_probe_server_limits);
    tcase_add_test(tc, test_least_privilege);
    tcase_add_test(tc, test_consumer_cancelled);
    tcase_add_test(tc, test_quorum_delivery_limit);
    tcase_add_test(tc, test_legacy_quorum_queue);
    suite_add_tcase(s, tc);
    /* a broker-sent basic.cancel (CK_RUN_CASE=cancel runs it alone) */
    tc = tcase_create("cancel");
    tcase_set_timeout(tc, itest_ms(120));
    tcase_add_unchecked_fixture(tc, NULL, continue_postgres);
    tcase_add_test(tc, test_broker_cancel_gives_back_others);
    suite_add_tcase(s, tc);
    /* what a producer's data must not reach */
    tc = tcase_create("producers");
    tcase_set_timeout(tc, itest_ms(120));
    tcase_add_test(tc, test_operator_output_escaped);
    tcase_add_test(tc, test_resolve_shell_quote);
    suite_add_tcase(s, tc);
    /* the roles of a deployment */
    tc = tcase_create("roles");
    tcase_set_timeout(tc, itest_ms(60));
    tcase_add_test(tc, test_application_role_reads_nothing);
    tcase_add_test(tc, test_operator_role);
    suite_add_tcase(s, tc);
    return check_run(s);
}
