/*
 * Tests of the SQS client (adapters/sqs.h) against a real SQS emulator:
 * `check_sqs fauxqs` (npm, tests/node) or `check_sqs moto` (moto's
 * server, Python). The program starts the emulator on loopback itself
 * (port IDEMQ_SQS_PORT, or the first free of 9810, 9812, ... for fauxqs and
 * 9811, 9813, ... for moto) and stops
 * it at the end; it exits 77 (a skip, with the reason) when the emulator
 * or node's packages are absent. Queues and messages are made by a
 * producer on the AWS SDK for JavaScript (tests/node/produce.mjs), as a
 * user's application makes them.
 */
#define _GNU_SOURCE /* strcasestr */
#include <arpa/inet.h>
#include <fcntl.h>
#include <stdbool.h>
#include <check.h>
#include <jansson.h>
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

#include "check_run.h"
#include "itest.h"
#include "sqs.h"

#define NODE_DIR IDEMQ_SOURCE_DIR "/tests/node"

static char endpoint[64];
static const char *emulator;

/* Runs argv, its stdout's first line into out. Returns the exit code. */
static int run_out(char *const argv[], char *out, size_t len)
{
    int fd[2], st = -1;
    pid_t pid;
    ssize_t r;
    size_t n = 0;
    out[0] = '\0';
    if (pipe(fd))
        return -1;
    if ((pid = fork()) == 0) {
        int dn = open("/dev/null", O_WRONLY);
        dup2(fd[1], 1);
        if (dn >= 0)
            dup2(dn, 2);
        close(fd[0]);
        execvp(argv[0], argv);
        _exit(127);
    }
    close(fd[1]);
    while (n + 1 < len && (r = read(fd[0], out + n, len - n - 1)) > 0)
        n += (size_t)r;
    out[n] = '\0';
    out[strcspn(out, "\n")] = '\0';
    close(fd[0]);
    waitpid(pid, &st, 0);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

/* The SDK producer: creates queue name, its URL into url. */
static void create_queue(const char *name, char *url, size_t len)
{
    char *argv[] = {"node", NODE_DIR "/produce.mjs", "create", endpoint, (char *)name, NULL};
    ck_assert_int_eq(run_out(argv, url, len), 0);
    ck_assert_msg(strstr(url, name) != NULL, "no queue URL: %s", url);
}

static void send_sdk(const char *url, const char *body, const char *group, const char *dedup,
                     char *id, size_t len)
{
    char *argv[] = {"node", NODE_DIR "/produce.mjs", "send", endpoint, (char *)url,
                    (char *)body, (char *)group, (char *)dedup, NULL};
    ck_assert_int_eq(run_out(argv, id, len), 0);
    ck_assert_msg(id[0], "no message id");
}

static struct sqs_client *client(const char *url)
{
    struct sqs_client_config cfg = {url, "us-east-1", endpoint, 5000, 0, NULL};
    struct sqs_client *c;
    char err[256];
    ck_assert_msg(sqs_client_new(&cfg, &c, err, sizeof err) == 0, "%s", err);
    return c;
}

static void unique(char *buf, size_t len, const char *what)
{
    snprintf(buf, len, "%s-%ld-%ld", what, (long)getpid(), (long)time(NULL));
}

/* A message an application sent is received with its id, body and receive
 * count, deleted in a batch, and not received again. */
static long long mono_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

START_TEST(test_receive_delete)
{
    char name[96], url[512], id[128], err[256];
    struct sqs_client *c;
    struct sqs_message *m;
    int n, failed[1], nf;
    unique(name, sizeof name, "rd");
    create_queue(name, url, sizeof url);
    send_sdk(url, "{\"job_id\":\"k-1\",\"amount\":5}", NULL, NULL, id, sizeof id);
    c = client(url);
    ck_assert_int_eq(sqs_receive(c, 10, 2, &m, &n, err, sizeof err), SQS_OK);
    ck_assert_int_eq(n, 1);
    ck_assert_str_eq(m[0].id, id);
    ck_assert_str_eq(m[0].body, "{\"job_id\":\"k-1\",\"amount\":5}");
    ck_assert_uint_eq(m[0].body_len, strlen(m[0].body));
    ck_assert_int_eq(m[0].receive_count, 1);
    ck_assert_ptr_null(m[0].group_id);
    {
        const char *r[1] = {m[0].receipt};
        ck_assert_int_eq(sqs_delete_batch(c, r, 1, failed, &nf, err, sizeof err), SQS_OK);
        ck_assert_int_eq(nf, 0);
    }
    sqs_messages_free(m, n);
    ck_assert_int_eq(sqs_receive(c, 10, 1, &m, &n, err, sizeof err), SQS_OK);
    ck_assert_int_eq(n, 0);
    sqs_client_free(c);
}
END_TEST

/* A visibility change holds the message back for its delay; then it comes
 * back with its receive count raised (the retry's hold). */
START_TEST(test_visibility_holds)
{
    char name[96], url[512], id[128], err[256];
    struct sqs_client *c;
    struct sqs_message *m;
    int n;
    unique(name, sizeof name, "vis");
    create_queue(name, url, sizeof url);
    send_sdk(url, "{\"job_id\":\"k-2\"}", NULL, NULL, id, sizeof id);
    c = client(url);
    ck_assert_int_eq(sqs_receive(c, 10, 2, &m, &n, err, sizeof err), SQS_OK);
    ck_assert_int_eq(n, 1);
    ck_assert_int_eq(sqs_change_visibility(c, m[0].receipt, 2, err, sizeof err), SQS_OK);
    sqs_messages_free(m, n);
    ck_assert_int_eq(sqs_receive(c, 10, 0, &m, &n, err, sizeof err), SQS_OK);
    ck_assert_int_eq(n, 0);
    /* back once its 2 s visibility ends: polled (1 s long polls) until it
     * is, within 15 s */
    for (long long end = mono_ms() + 15000;;) {
        ck_assert_int_eq(sqs_receive(c, 10, 1, &m, &n, err, sizeof err), SQS_OK);
        if (n > 0 || mono_ms() >= end)
            break;
        sqs_messages_free(m, n);
        usleep(100 * 1000);
    }
    ck_assert_int_eq(n, 1);
    ck_assert_str_eq(m[0].id, id);
    ck_assert_int_eq(m[0].receive_count, 2);
    sqs_messages_free(m, n);
    sqs_client_free(c);
}
END_TEST

/* A FIFO queue: the group id arrives with each message, in send order. */
START_TEST(test_fifo_group)
{
    char name[96], url[512], id[128], err[256];
    struct sqs_client *c;
    struct sqs_message *m;
    int n;
    unique(name, sizeof name, "fifo");
    strcat(name, ".fifo");
    create_queue(name, url, sizeof url);
    send_sdk(url, "{\"job_id\":\"a\",\"seq\":1}", "g1", "d1", id, sizeof id);
    send_sdk(url, "{\"job_id\":\"b\",\"seq\":2}", "g1", "d2", id, sizeof id);
    c = client(url);
    ck_assert_int_eq(sqs_receive(c, 10, 2, &m, &n, err, sizeof err), SQS_OK);
    ck_assert_int_ge(n, 1);
    ck_assert_str_eq(m[0].group_id, "g1");
    ck_assert_str_eq(m[0].body, "{\"job_id\":\"a\",\"seq\":1}");
    if (n > 1)
        ck_assert_str_eq(m[1].body, "{\"job_id\":\"b\",\"seq\":2}");
    sqs_messages_free(m, n);
    sqs_client_free(c);
}
END_TEST

/* A send to another queue (the dead-letter queue) carries its story in
 * message attributes, confirmed by its message id, and they are read
 * back. */
START_TEST(test_send_with_attributes)
{
    char name[96], url[512], dlq[512], err[256];
    struct sqs_client *c, *d;
    struct sqs_message *m;
    char *mid = NULL;
    int n;
    json_t *attrs = json_pack("{s:s, s:s, s:s}", "idemq-key", "k-9", "idemq-code",
                              "retries_exhausted", "idemq-attempts", "3");
    unique(name, sizeof name, "src");
    create_queue(name, url, sizeof url);
    unique(name, sizeof name, "dlq");
    create_queue(name, dlq, sizeof dlq);
    c = client(url);
    ck_assert_int_eq(sqs_send(c, dlq, "{\"job_id\":\"k-9\"}", NULL, NULL, attrs, &mid, err,
                              sizeof err),
                     SQS_OK);
    ck_assert_ptr_nonnull(mid);
    d = client(dlq);
    ck_assert_int_eq(sqs_receive(d, 10, 2, &m, &n, err, sizeof err), SQS_OK);
    ck_assert_int_eq(n, 1);
    ck_assert_str_eq(m[0].id, mid);
    ck_assert_str_eq(json_string_value(json_object_get(json_object_get(m[0].attributes,
                                                                       "idemq-code"),
                                                       "StringValue")),
                     "retries_exhausted");
    sqs_messages_free(m, n);
    free(mid);
    json_decref(attrs);
    sqs_client_free(c);
    sqs_client_free(d);
}
END_TEST

/* An endpoint that is down is SQS_UNAVAILABLE (back off), a queue that
 * does not exist is SQS_REFUSED; missing credentials are refused at start
 * without a secret in the message. */
START_TEST(test_down_and_refused)
{
    struct sqs_client_config cfg = {"http://127.0.0.1:1/000000000000/none", "us-east-1",
                                    "http://127.0.0.1:1", 2000, 0, NULL};
    struct sqs_client *c;
    struct sqs_message *m;
    char err[256], url[512];
    int n;
    ck_assert_int_eq(sqs_client_new(&cfg, &c, err, sizeof err), 0);
    ck_assert_int_eq(sqs_receive(c, 10, 0, &m, &n, err, sizeof err), SQS_UNAVAILABLE);
    sqs_client_free(c);
    snprintf(url, sizeof url, "%s/000000000000/no-such-queue-%ld", endpoint, (long)getpid());
    c = client(url);
    ck_assert_int_eq(sqs_receive(c, 10, 0, &m, &n, err, sizeof err), SQS_REFUSED);
    sqs_client_free(c);
    setenv("AWS_SECRET_ACCESS_KEY", "", 1);
    setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent", 1);
    ck_assert_int_eq(sqs_client_new(&cfg, &c, err, sizeof err), -1);
    ck_assert_msg(strstr(err, "credentials") != NULL, "%s", err);
    setenv("AWS_SECRET_ACCESS_KEY", "test", 1);
}
END_TEST

/* A stand-in for SQS on loopback that gives every request one canned
 * answer (status line, headers and body): the answers the emulators never
 * give. Returns the child's pid; *port its port. */
static pid_t canned_server(const char *answer, int *port)
{
    struct sockaddr_in a = {.sin_family = AF_INET};
    socklen_t al = sizeof a;
    int ls = socket(AF_INET, SOCK_STREAM, 0);
    pid_t pid;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ck_assert_int_ge(ls, 0);
    ck_assert_int_eq(bind(ls, (struct sockaddr *)&a, sizeof a), 0);
    ck_assert_int_eq(listen(ls, 8), 0);
    ck_assert_int_eq(getsockname(ls, (struct sockaddr *)&a, &al), 0);
    *port = ntohs(a.sin_port);
    if ((pid = fork()) == 0) {
        for (;;) {
            int s = accept(ls, NULL, NULL);
            char req[65536];
            size_t n = 0;
            ssize_t r;
            const char *hend, *cl;
            if (s < 0)
                _exit(0);
            while (n + 1 < sizeof req && (r = read(s, req + n, sizeof req - n - 1)) > 0) {
                req[n += (size_t)r] = '\0';
                if ((hend = strstr(req, "\r\n\r\n")) &&
                    (!(cl = strcasestr(req, "content-length:")) ||
                     (size_t)(hend + 4 - req) + (size_t)atol(cl + 15) <= n))
                    break;
            }
            if (write(s, answer, strlen(answer)) < 0)
                _exit(1);
            close(s);
        }
    }
    close(ls);
    return pid;
}

/* Each answer the emulators never give maps to its status: throttling to
 * throttled, refused credentials to denied, a 5xx to unavailable, an
 * answer that is not the schema or holds more than 10 messages to bad
 * answer (nothing taken). */
START_TEST(test_canned_answers)
{
    static const struct {
        const char *answer;
        enum sqs_status want;
    } cases[] = {
        {"HTTP/1.1 400 Bad Request\r\nContent-Type: application/x-amz-json-1.0\r\n"
         "Content-Length: 76\r\nConnection: close\r\n\r\n"
         "{\"__type\":\"com.amazonaws.sqs#ThrottlingException\",\"message\":\"Rate exceeded\"}",
         SQS_THROTTLED},
        {"HTTP/1.1 400 Bad Request\r\nContent-Length: 52\r\nConnection: close\r\n\r\n"
         "{\"__type\":\"AWS.SimpleQueueService.RequestThrottled\"}", SQS_THROTTLED},
        {"HTTP/1.1 403 Forbidden\r\nContent-Length: 65\r\nConnection: close\r\n\r\n"
         "{\"__type\":\"com.amazonaws.sqs#InvalidClientTokenId\",\"message\":\"x\"}",
         SQS_DENIED},
        /* a clock skewed past what SigV4 allows */
        {"HTTP/1.1 400 Bad Request\r\nContent-Length: 78\r\nConnection: close\r\n\r\n"
         "{\"__type\":\"com.amazonaws.sqs#RequestExpired\",\"message\":\"Request has expired.\"}",
         SQS_DENIED},
        {"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}",
         SQS_UNAVAILABLE},
        {"HTTP/1.1 200 OK\r\nContent-Length: 9\r\nConnection: close\r\n\r\nnot json!",
         SQS_BAD_ANSWER},
        {"HTTP/1.1 200 OK\r\nContent-Length: 52\r\nConnection: close\r\n\r\n"
         "{\"Messages\":[{\"MessageId\":\"m\",\"ReceiptHandle\":\"r\"}]}", SQS_BAD_ANSWER},
        {"HTTP/1.1 200 OK\r\nContent-Length: 38\r\nConnection: close\r\n\r\n"
         "{\"Messages\":[1,2,3,4,5,6,7,8,9,10,11]}", SQS_BAD_ANSWER},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        int port;
        char ep[64], url[128], err[256];
        pid_t pid = canned_server(cases[i].answer, &port);
        struct sqs_client_config cfg = {url, "us-east-1", ep, 3000, 0, NULL};
        struct sqs_client *c;
        struct sqs_message *m;
        int n;
        snprintf(ep, sizeof ep, "http://127.0.0.1:%d", port);
        snprintf(url, sizeof url, "%s/000000000000/q", ep);
        ck_assert_int_eq(sqs_client_new(&cfg, &c, err, sizeof err), 0);
        ck_assert_msg(sqs_receive(c, 10, 0, &m, &n, err, sizeof err) == cases[i].want,
                      "case %zu: %s, not %s (%s)", i, sqs_status_name(sqs_receive(c, 10, 0, &m,
                      &n, err, sizeof err)), sqs_status_name(cases[i].want), err);
        ck_assert_ptr_null(m);
        ck_assert_int_eq(n, 0);
        sqs_client_free(c);
        kill(pid, SIGKILL);
        waitpid(pid, NULL, 0);
    }
}
END_TEST


/* ---- the worker: `idemq run` on an SQS input, the ledger in PostgreSQL ---- */

/* Sends each line "GROUP<TAB>BODY" of lines through the SDK, in order. */
static void send_lines(const char *url, const char *lines)
{
    char path[128], cmd[1024];
    FILE *f;
    snprintf(path, sizeof path, "/tmp/sqs-lines-%ld.txt", (long)getpid());
    ck_assert_ptr_nonnull(f = fopen(path, "w"));
    fputs(lines, f);
    fclose(f);
    snprintf(cmd, sizeof cmd, "node %s/produce.mjs lines %s '%s' < %s > /dev/null", NODE_DIR,
             endpoint, url, path);
    ck_assert_int_eq(system(cmd), 0);
    unlink(path);
}

/* A config of one sqs input named t->name on url (dlq: its dead-letter
 * queue) with workers workers; extra: more settings of the input. */
static void write_sqs_config(struct itest *t, const char *path, const char *url, const char *dlq,
                             int workers, const char *extra)
{
    FILE *f = fopen(path, "w");
    ck_assert_ptr_nonnull(f);
    fprintf(f,
            "retry: { base_delay_ms = 1000; max_delay_ms = 2000; jitter = \"none\"; "
            "max_attempts = 4; };\n"
            "consumer: { id = \"%s\"; workers = %d; };\n"
            "log: { level = \"info\"; };\n"
            "inputs = ( { name = \"%s\"; transport = \"sqs\"; queue = \"%s\"; queue_url = \"%s\";\n"
            "  region = \"us-east-1\"; endpoint = \"%s\"; dead_letter_queue_url = \"%s\";\n"
            "  key_source = \"json:job_id\"; effect_function = \"idemq_test.record\"; %s } );\n",
            t->name, workers, t->name, t->name, url, endpoint, dlq, extra ? extra : "");
    fclose(f);
}

/* `idemq run` to idleness with its log in log; asserts exit 0. */
static void run_sqs(const char *cfg, int idle_s, const char *log)
{
    pid_t pid = itest_spawn_log(cfg, idle_s, NULL, log);
    int st = itest_wait(pid, itest_ms(90000));
    ck_assert_msg(st != -1 && WIFEXITED(st) && WEXITSTATUS(st) == 0, "idemq run failed: %d (%s)",
                  st, log);
}

/* Messages still in the queue at url (each taken once; they stay hidden
 * for the queue's visibility timeout). */
static int left_in(const char *url, struct sqs_message **all)
{
    struct sqs_client *c = client(url);
    struct sqs_message *m;
    int n, total = 0;
    char err[256];
    if (all)
        *all = NULL;
    for (;;) {
        ck_assert_int_eq(sqs_receive(c, 10, 1, &m, &n, err, sizeof err), SQS_OK);
        if (n == 0)
            break;
        if (all && !*all) {
            *all = m; /* the first batch, for the caller */
        } else {
            sqs_messages_free(m, n);
        }
        total += n;
    }
    sqs_client_free(c);
    return total;
}

static const char *attr(const struct sqs_message *m, const char *name)
{
    return json_string_value(
        json_object_get(json_object_get(m->attributes, name), "StringValue"));
}

/* Keys applied once each though some are sent twice (another message id);
 * the ApproximateReceiveCount recorded with the attempt; a body that is not
 * JSON and a permanent failure parked in the ledger and sent to the
 * dead-letter queue with their story, sealed; nothing left in the queue. */
START_TEST(test_worker_effects_once)
{
    struct itest t;
    char name[96], url[512], dlq[512], cfg[300], log[300], lines[8192] = "";
    struct sqs_message *m;
    int n;
    itest_setup(&t, "sqs_once", "idemq_test.record", "", "");
    unique(name, sizeof name, "once");
    create_queue(name, url, sizeof url);
    strcat(name, "-dlq");
    create_queue(name, dlq, sizeof dlq);
    for (int i = 0; i < 20; i++)
        snprintf(lines + strlen(lines), sizeof lines - strlen(lines),
                 "\t{\"job_id\":\"%s:%d\",\"amount\":%d}\n", t.name, i, i);
    for (int i = 0; i < 5; i++) /* the same jobs sent again */
        snprintf(lines + strlen(lines), sizeof lines - strlen(lines),
                 "\t{\"job_id\":\"%s:%d\",\"amount\":%d}\n", t.name, i, i);
    snprintf(lines + strlen(lines), sizeof lines - strlen(lines),
             "\tnot json\n\t{\"job_id\":\"%s:perm\",\"raise\":\"22023\"}\n", t.name);
    send_lines(url, lines);
    snprintf(cfg, sizeof cfg, "/tmp/%s.sqs.cfg", t.name);
    snprintf(log, sizeof log, "/tmp/%s.sqs.log", t.name);
    write_sqs_config(&t, cfg, url, dlq, 1, NULL);
    {   /* with metrics on: scraped once the 20 effects are in */
        char mcfg[300], murl[64], page[16384];
        int port = itest_free_port(), st;
        pid_t pid;
        FILE *f;
        snprintf(mcfg, sizeof mcfg, "%s.metrics", cfg);
        write_sqs_config(&t, mcfg, url, dlq, 1, NULL);
        ck_assert_ptr_nonnull(f = fopen(mcfg, "a"));
        fprintf(f, "metrics: { listen = \"127.0.0.1:%d\"; };\n", port);
        fclose(f);
        pid = itest_spawn_log(mcfg, 4, NULL, log);
        snprintf(murl, sizeof murl, "http://127.0.0.1:%d/metrics", port);
        /* polled until every message is counted (the parks last: after
         * their commit), within 30 s */
        for (long long end = mono_ms() + 30000;;) {
            bool all = itest_http_get(murl, page, sizeof page) == 200 &&
                       strstr(page, "idemq_sqs_messages_total{outcome=\"received\"} 27\n") &&
                       strstr(page, "idemq_sqs_messages_total{outcome=\"applied\"} 20\n") &&
                       strstr(page, "idemq_sqs_messages_total{outcome=\"duplicate\"} 5\n") &&
                       strstr(page, "idemq_sqs_messages_total{outcome=\"parked\"} 2\n");
            if (all)
                break;
            ck_assert_msg(mono_ms() < end, "metrics never counted every message: %s", page);
            usleep(100 * 1000);
        }
        st = itest_wait(pid, itest_ms(60000));
        ck_assert_msg(st != -1 && WIFEXITED(st) && WEXITSTATUS(st) == 0, "idemq run: %d", st);
    }
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq_test.effects WHERE key LIKE $1 "
                                    "|| ':%'", t.name), 20);
    ck_assert_int_eq(itest_long(&t, "SELECT count(DISTINCT key) FROM idemq_test.effects WHERE "
                                    "key LIKE $1 || ':%'", t.name), 20);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.jobs WHERE key LIKE $1 || ':%' "
                                    "AND state = 'applied'", t.name), 20);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.parked WHERE source_queue = $1",
                                t.name), 2);
    /* the second messages of keys 0-4, each with its receive count */
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.attempts WHERE key LIKE $1 || "
                                    "':%' AND outcome = 'duplicate' AND delivery_count = 1",
                                t.name), 5);
    ck_assert_int_eq(itest_count_lines(log, "duplicates 5, retried 0, parked 2"), 1);
    ck_assert_int_eq(left_in(url, NULL), 0);
    n = left_in(dlq, &m);
    ck_assert_int_eq(n, 2);
    ck_assert_ptr_nonnull(m);
    for (int i = 0; i < 2 && i < n; i++) {
        const char *code = attr(&m[i], "x-idemq-error-code");
        ck_assert_ptr_nonnull(code);
        ck_assert_ptr_nonnull(attr(&m[i], "x-idemq-park-id"));
        if (strcmp(code, "bad_json") == 0) {
            ck_assert_str_eq(m[i].body, "not json");
        } else {
            char key[128];
            snprintf(key, sizeof key, "%s:perm", t.name);
            ck_assert_str_eq(code, "effect_error");
            ck_assert_str_eq(attr(&m[i], "x-idemq-key"), key);
            ck_assert_ptr_nonnull(attr(&m[i], "x-idemq-seal"));
        }
    }
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.parked WHERE source_queue = $1 "
                                    "AND dlq_published_at IS NOT NULL", t.name), 2);
    sqs_messages_free(m, n > 10 ? 10 : n);
    itest_teardown(&t);
}
END_TEST

/* A transient failure is retried through the message's visibility: the
 * effect fails on attempts 1 and 2 and applies on 3, each attempt kept
 * with its receive count; the message is deleted only then. */
START_TEST(test_worker_retry_via_visibility)
{
    struct itest t;
    char name[96], url[512], dlq[512], cfg[300], log[300], lines[512];
    itest_setup(&t, "sqs_retry", "idemq_test.record", "", "");
    unique(name, sizeof name, "retry");
    create_queue(name, url, sizeof url);
    strcat(name, "-dlq");
    create_queue(name, dlq, sizeof dlq);
    snprintf(lines, sizeof lines, "\t{\"job_id\":\"%s:r\",\"raise\":\"53400\",\"raise_until\":2}\n",
             t.name);
    send_lines(url, lines);
    snprintf(cfg, sizeof cfg, "/tmp/%s.sqs.cfg", t.name);
    snprintf(log, sizeof log, "/tmp/%s.sqs.log", t.name);
    write_sqs_config(&t, cfg, url, dlq, 1, NULL);
    run_sqs(cfg, 5, log);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq_test.effects WHERE key = $1 "
                                    "|| ':r'", t.name), 1);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.attempts WHERE key = $1 || ':r'",
                                t.name), 3);
    /* each attempt with the receive count SQS gave it: 1, 2, 3 */
    ck_assert_int_eq(itest_long(&t, "SELECT (string_agg(delivery_count::text, ',' ORDER BY "
                                    "attempt) = '1,2,3')::int FROM idemq.attempts WHERE key = $1 || "
                                    "':r'", t.name), 1);
    ck_assert_int_eq(itest_count_lines(log, "retried 2, parked 0"), 1);
    ck_assert_int_eq(left_in(url, NULL), 0);
    ck_assert_int_eq(left_in(dlq, NULL), 0);
    itest_teardown(&t);
}
END_TEST

/* An effect slower than the visibility timeout (8 s against 5 s), with a
 * second worker polling the queue: the lease is extended while the job
 * runs, so the message never comes back to the other worker (one attempt,
 * no duplicate). Without the extension it reappears at 5 s and the second
 * worker records a duplicate attempt. */
START_TEST(test_worker_visibility_extended)
{
    struct itest t;
    char name[96], url[512], dlq[512], cfg[300], log[300], lines[512];
    itest_setup(&t, "sqs_lease", "idemq_test.record", "", "");
    unique(name, sizeof name, "lease");
    create_queue(name, url, sizeof url);
    strcat(name, "-dlq");
    create_queue(name, dlq, sizeof dlq);
    snprintf(lines, sizeof lines, "\t{\"job_id\":\"%s:slow\",\"sleep_ms\":8000}\n", t.name);
    send_lines(url, lines);
    snprintf(cfg, sizeof cfg, "/tmp/%s.sqs.cfg", t.name);
    snprintf(log, sizeof log, "/tmp/%s.sqs.log", t.name);
    write_sqs_config(&t, cfg, url, dlq, 2, "visibility_timeout_s = 5;");
    run_sqs(cfg, 10, log); /* the second worker polls all along */
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq_test.effects WHERE key = $1 "
                                    "|| ':slow'", t.name), 1);
    /* one attempt: none of a second receive (a duplicate) */
    ck_assert_int_eq(itest_long(&t, "SELECT attempts FROM idemq.jobs WHERE key = $1 || ':slow'",
                                t.name), 1);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.attempts WHERE key = $1 || "
                                    "':slow'", t.name), 0);
    ck_assert_int_eq(itest_count_lines(log, "received 1, applied 1, duplicates 0"), 1);
    ck_assert_int_eq(itest_count_lines(log, "visibility extended 0"), 0);
    ck_assert_int_eq(left_in(url, NULL), 0);
    itest_teardown(&t);
}
END_TEST

/* A FIFO queue with two `idemq run` replicas: each MessageGroupId's jobs
 * apply in send order, every key once. */
START_TEST(test_worker_fifo_order)
{
    struct itest t;
    char name[96], url[512], dlq[512], cfg[300], log1[300], log2[300], lines[8192] = "";
    pid_t a, b;
    int st;
    itest_setup(&t, "sqs_fifo", "idemq_test.record", "", "");
    unique(name, sizeof name, "ord");
    snprintf(name + strlen(name), sizeof name - strlen(name), ".fifo");
    create_queue(name, url, sizeof url);
    unique(name, sizeof name, "ord-dlq");
    snprintf(name + strlen(name), sizeof name - strlen(name), ".fifo");
    create_queue(name, dlq, sizeof dlq);
    for (int s = 1; s <= 6; s++)
        for (int g = 0; g < 3; g++)
            snprintf(lines + strlen(lines), sizeof lines - strlen(lines),
                     "g%d\t{\"job_id\":\"%s:g%d:%d\",\"group\":\"g%d\",\"seq\":%d,"
                     "\"sleep_ms\":30}\n", g, t.name, g, s, g, s);
    send_lines(url, lines);
    snprintf(cfg, sizeof cfg, "/tmp/%s.sqs.cfg", t.name);
    snprintf(log1, sizeof log1, "/tmp/%s.sqs1.log", t.name);
    snprintf(log2, sizeof log2, "/tmp/%s.sqs2.log", t.name);
    write_sqs_config(&t, cfg, url, dlq, 1, NULL);
    a = itest_spawn_log(cfg, 3, NULL, log1);
    b = itest_spawn_log(cfg, 3, NULL, log2);
    st = itest_wait(a, itest_ms(90000));
    ck_assert_msg(st != -1 && WIFEXITED(st) && WEXITSTATUS(st) == 0, "replica 1: %d", st);
    st = itest_wait(b, itest_ms(90000));
    ck_assert_msg(st != -1 && WIFEXITED(st) && WEXITSTATUS(st) == 0, "replica 2: %d", st);
    ck_assert_int_eq(itest_long(&t, "SELECT count(DISTINCT key) FROM idemq_test.effects WHERE "
                                    "key LIKE $1 || ':%'", t.name), 18);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq_test.effects WHERE key LIKE $1 "
                                    "|| ':%'", t.name), 18);
    /* in each group, effect ids rise with seq */
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM (SELECT payload->>'group' g, "
                                    "(payload->>'seq')::int s, lag((payload->>'seq')::int) OVER "
                                    "(PARTITION BY payload->>'group' ORDER BY id) p FROM "
                                    "idemq_test.effects WHERE key LIKE $1 || ':%') x WHERE p IS "
                                    "NOT NULL AND s <> p + 1", t.name), 0);
    ck_assert_int_eq(left_in(url, NULL), 0);
    itest_teardown(&t);
}
END_TEST


/* Runs `idemq ARGS` on cfg; its output into out; returns the exit code. */
static int idemq_cmd(const char *cfg, const char *args, char *out, size_t len)
{
    char cmd[2048], lp[1024];
    FILE *p;
    size_t n;
    /* least-privilege mode: as the role the command runs under */
    snprintf(cmd, sizeof cmd, "%s%s %s -c %s 2>&1", itest_lp_env_prefix(args, lp, sizeof lp),
             IDEMQ_BINARY, args, cfg);
    ck_assert_ptr_nonnull(p = popen(cmd, "r"));
    n = fread(out, 1, len - 1, p);
    out[n] = '\0';
    return WEXITSTATUS(pclose(p));
}

/* A park sent to the dead-letter queue goes back with `idemq redrive` once
 * its cause is fixed and applies; a message the queue's redrive policy
 * moved there (no story of idemq's) is adopted as a park first, then
 * redriven and applied; a message claiming a redrive generation without
 * idemq's seal is parked as a forged redrive, never applied. */
START_TEST(test_worker_park_redrive)
{
    struct itest t;
    char name[96], url[512], dlq[512], cfg[300], log[300], lines[1024], id[128], out[8192];
    char body[256], gen[64];
    itest_setup(&t, "sqs_redrive", "idemq_test.record", "", "");
    unique(name, sizeof name, "rdv");
    create_queue(name, url, sizeof url);
    strcat(name, "-dlq");
    create_queue(name, dlq, sizeof dlq);
    snprintf(lines, sizeof lines, "INSERT INTO idemq_test.failing VALUES ('%s:fix', '22023')",
             t.name);
    itest_sql(&t, lines);
    snprintf(lines, sizeof lines, "\t{\"job_id\":\"%s:fix\"}\n", t.name);
    send_lines(url, lines);
    /* what SQS's redrive policy would have moved: the bare message */
    snprintf(body, sizeof body, "{\"job_id\":\"%s:moved\"}", t.name);
    send_sdk(dlq, body, NULL, NULL, id, sizeof id);
    {   /* a forged redrive: a generation without a seal */
        char *argv[] = {"node", NODE_DIR "/produce.mjs", "attrs", endpoint, url, body,
                        gen, NULL};
        snprintf(body, sizeof body, "{\"job_id\":\"%s:forged\"}", t.name);
        snprintf(gen, sizeof gen, "x-idemq-generation=1");
        ck_assert_int_eq(run_out(argv, id, sizeof id), 0);
    }
    snprintf(cfg, sizeof cfg, "/tmp/%s.sqs.cfg", t.name);
    snprintf(log, sizeof log, "/tmp/%s.sqs.log", t.name);
    write_sqs_config(&t, cfg, url, dlq, 1, NULL);
    /* check-config --online asks both queues; a queue that does not exist
     * is a configuration error */
    ck_assert_int_eq(idemq_cmd(cfg, "check-config --online", out, sizeof out), 0);
    ck_assert_msg(strstr(out, "its queue") && strstr(out, "dead-letter queue") &&
                      strstr(out, "answers"), "%s", out);
    {
        char bad[300], nope[600];
        snprintf(bad, sizeof bad, "%s.bad", cfg);
        snprintf(nope, sizeof nope, "%s-nope", url);
        write_sqs_config(&t, bad, nope, dlq, 1, NULL);
        ck_assert_int_eq(idemq_cmd(bad, "check-config --online", out, sizeof out), 3);
        ck_assert_msg(strstr(out, "refused"), "%s", out);
        unlink(bad);
    }
    run_sqs(cfg, 3, log);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.parked WHERE key = $1 || ':fix'",
                                t.name), 1);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.parked WHERE key = $1 || "
                                    "':forged' AND error_code = 'forged_redrive'", t.name), 1);
    snprintf(lines, sizeof lines, "DELETE FROM idemq_test.failing WHERE key = '%s:fix'", t.name);
    itest_sql(&t, lines);
    /* a dry run moves nothing; then the fixed one and the one SQS moved go
     * back, each by its class, and the forged one stays */
    snprintf(lines, sizeof lines, "redrive --input %s --dry-run", t.name);
    ck_assert_int_eq(idemq_cmd(cfg, lines, out, sizeof out), 0);
    ck_assert_msg(strstr(out, "would redrive 3 parks") && strstr(out, ":fix (permanent)") &&
                  strstr(out, ":forged (permanent)") && strstr(out, ":moved (moved by SQS)"),
                  "%s", out);
    snprintf(lines, sizeof lines, "redrive --input %s --class permanent --key %s:fix", t.name,
             t.name);
    ck_assert_int_eq(idemq_cmd(cfg, lines, out, sizeof out), 0);
    ck_assert_msg(strstr(out, ":fix to ") && !strstr(out, ":forged to "), "%s", out);
    snprintf(lines, sizeof lines, "redrive --input %s --class broker", t.name);
    ck_assert_int_eq(idemq_cmd(cfg, lines, out, sizeof out), 0);
    ck_assert_msg(strstr(out, ":moved (moved by SQS; now recorded in idemq.parked)"), "%s", out);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.parked WHERE key = $1 || "
                                    "':moved' AND error_class = 'broker' AND error_code = "
                                    "'max_receive_count'", t.name), 1);
    run_sqs(cfg, 3, log);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq_test.effects WHERE key IN ($1 || "
                                    "':fix', $1 || ':moved')", t.name), 2);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.jobs WHERE key IN ($1 || "
                                    "':fix', $1 || ':moved') AND state = 'applied'", t.name), 2);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq_test.effects WHERE key = $1 || "
                                    "':forged'", t.name), 0);
    ck_assert_int_eq(left_in(url, NULL), 0);
    ck_assert_int_eq(left_in(dlq, NULL), 1); /* the forged one */
    itest_teardown(&t);
}
END_TEST


/* Two workers SIGKILLed five times mid-stream (visibility 5 s): every key's
 * effect exactly once, nothing left in the queue. A killed worker's
 * messages come back after their visibility and are applied or found
 * applied (its transaction either committed or rolled back). */
START_TEST(test_worker_kill_loop)
{
    struct itest t;
    char name[96], url[512], dlq[512], cfg[300], log[300];
    static char lines[40000];
    lines[0] = '\0';
    itest_setup(&t, "sqs_kill", "idemq_test.record", "", "");
    unique(name, sizeof name, "kill");
    create_queue(name, url, sizeof url);
    strcat(name, "-dlq");
    create_queue(name, dlq, sizeof dlq);
    for (int i = 0; i < 300; i++)
        snprintf(lines + strlen(lines), sizeof lines - strlen(lines),
                 "\t{\"job_id\":\"%s:%d\",\"sleep_ms\":15}\n", t.name, i);
    send_lines(url, lines);
    snprintf(cfg, sizeof cfg, "/tmp/%s.sqs.cfg", t.name);
    snprintf(log, sizeof log, "/tmp/%s.sqs.log", t.name);
    write_sqs_config(&t, cfg, url, dlq, 2, "visibility_timeout_s = 5;");
    for (int k = 0; k < 5; k++) {
        long before = itest_long(&t, "SELECT count(*) FROM idemq_test.effects WHERE key LIKE "
                                     "$1 || ':%'", t.name);
        pid_t pid = itest_spawn_log(cfg, 60, NULL, log);
        /* killed once it applied 20 more (mid-stream), polled within 30 s */
        for (long long end = mono_ms() + 30000;
             itest_long(&t, "SELECT count(*) FROM idemq_test.effects WHERE key LIKE $1 || ':%'",
                        t.name) < before + 20;) {
            ck_assert_msg(mono_ms() < end, "replica %d applied nothing within 30 s", k);
            usleep(20 * 1000);
        }
        kill(pid, SIGKILL);
        ck_assert_int_ne(itest_wait(pid, itest_ms(10000)), -1);
    }
    ck_assert_int_lt(itest_long(&t, "SELECT count(*) FROM idemq_test.effects WHERE key LIKE $1 "
                                    "|| ':%'", t.name), 300); /* the kills came mid-stream */
    run_sqs(cfg, 8, log); /* longer than the visibility: the killed ones come back */
    ck_assert_int_eq(itest_long(&t, "SELECT count(DISTINCT key) FROM idemq_test.effects WHERE "
                                    "key LIKE $1 || ':%'", t.name), 300);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq_test.effects WHERE key LIKE $1 "
                                    "|| ':%'", t.name), 300);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.jobs WHERE key LIKE $1 || ':%' "
                                    "AND state = 'applied'", t.name), 300);
    ck_assert_int_eq(left_in(url, NULL), 0);
    itest_teardown(&t);
}
END_TEST


/* At out: the line "\t" BODY "\n" of send_lines, BODY the JSON object
 * {"job_id":"NAME:SUFFIX","pad":"xx..."} of exactly size bytes. */
static void big_line(char *out, const char *name, const char *suffix, size_t size)
{
    int head = sprintf(out, "\t{\"job_id\":\"%s:%s\",\"pad\":\"", name, suffix);
    size_t pad = size - (size_t)(head - 1) - 2; /* the body less its head and "} */
    memset(out + head, 'x', pad);
    strcpy(out + head + pad, "\"}\n");
}

/* Bodies over 256 KiB (SQS takes up to 1 MiB): one over max_body_bytes is
 * parked alone (body_too_large), whole in the dead-letter queue, while the
 * messages received with it are applied; with max_body_bytes raised, a
 * body of nearly 1 MiB is applied. */
START_TEST(test_worker_large_bodies)
{
    struct itest t;
    char name[96], url[512], dlq[512], cfg[300], log[300];
    size_t cap = 2200000, big1 = 300000, big2 = 1000000;
    char *lines = malloc(cap);
    struct sqs_message *m = NULL;
    int n;
    ck_assert_ptr_nonnull(lines);
    lines[0] = '\0';
    itest_setup(&t, "sqs_large", "idemq_test.record", "", "");
    unique(name, sizeof name, "large");
    create_queue(name, url, sizeof url);
    strcat(name, "-dlq");
    create_queue(name, dlq, sizeof dlq);
    for (int i = 0; i < 3; i++)
        snprintf(lines + strlen(lines), cap - strlen(lines),
                 "\t{\"job_id\":\"%s:%d\",\"amount\":%d}\n", t.name, i, i);
    /* {"job_id":"NAME:big","pad":"xxx..."} of big1 bytes */
    big_line(lines + strlen(lines), t.name, "big", big1);
    send_lines(url, lines);
    snprintf(cfg, sizeof cfg, "/tmp/%s.sqs.cfg", t.name);
    snprintf(log, sizeof log, "/tmp/%s.sqs.log", t.name);
    write_sqs_config(&t, cfg, url, dlq, 1, NULL);
    run_sqs(cfg, 3, log);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq_test.effects WHERE key LIKE $1 "
                                    "|| ':%'", t.name), 3);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.parked WHERE source_queue = $1 "
                                    "AND error_code = 'body_too_large' AND dlq_published_at IS "
                                    "NOT NULL", t.name), 1);
    ck_assert_int_eq(left_in(url, NULL), 0);
    n = left_in(dlq, &m);
    ck_assert_int_eq(n, 1);
    ck_assert_ptr_nonnull(m);
    ck_assert_str_eq(attr(&m[0], "x-idemq-error-code"), "body_too_large");
    ck_assert_uint_eq(m[0].body_len, big1); /* whole: nothing of it lost */
    sqs_messages_free(m, n);

    /* raised: a body of nearly 1 MiB is applied */
    big_line(lines, t.name, "huge", big2);
    send_lines(url, lines);
    write_sqs_config(&t, cfg, url, dlq, 1, "max_body_bytes = 1048576;");
    run_sqs(cfg, 3, log);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq_test.effects WHERE key = $1 "
                                    "|| ':huge'", t.name), 1);
    ck_assert_int_eq(left_in(url, NULL), 0);
    free(lines);
    itest_teardown(&t);
}
END_TEST


/* A FIFO group whose first job fails once (transient): the group waits
 * for its retry (head-of-line) and its later jobs, received in the same
 * batch, never overtake it; another group goes on meanwhile. */
START_TEST(test_worker_fifo_retry_holds_group)
{
    struct itest t;
    char name[96], url[512], dlq[512], cfg[300], log[300], lines[4096] = "";
    itest_setup(&t, "sqs_hol", "idemq_test.record", "", "");
    unique(name, sizeof name, "hol");
    snprintf(name + strlen(name), sizeof name - strlen(name), ".fifo");
    create_queue(name, url, sizeof url);
    unique(name, sizeof name, "hol-dlq");
    snprintf(name + strlen(name), sizeof name - strlen(name), ".fifo");
    create_queue(name, dlq, sizeof dlq);
    for (int s = 1; s <= 3; s++) {
        snprintf(lines + strlen(lines), sizeof lines - strlen(lines),
                 "h\t{\"job_id\":\"%s:h:%d\",\"group\":\"h\",\"seq\":%d%s}\n", t.name, s, s,
                 s == 1 ? ",\"raise\":\"53400\",\"raise_until\":1" : "");
        snprintf(lines + strlen(lines), sizeof lines - strlen(lines),
                 "o\t{\"job_id\":\"%s:o:%d\",\"group\":\"o\",\"seq\":%d}\n", t.name, s, s);
    }
    send_lines(url, lines);
    snprintf(cfg, sizeof cfg, "/tmp/%s.sqs.cfg", t.name);
    snprintf(log, sizeof log, "/tmp/%s.sqs.log", t.name);
    write_sqs_config(&t, cfg, url, dlq, 1, NULL);
    run_sqs(cfg, 4, log);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq_test.effects WHERE key LIKE $1 "
                                    "|| ':%'", t.name), 6);
    ck_assert_int_eq(itest_long(&t, "SELECT attempts FROM idemq.jobs WHERE key = $1 || ':h:1'",
                                t.name), 2);
    /* in each group, effect ids rise with seq */
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM (SELECT (payload->>'seq')::int s, "
                                    "lag((payload->>'seq')::int) OVER (PARTITION BY "
                                    "payload->>'group' ORDER BY id) p FROM idemq_test.effects "
                                    "WHERE key LIKE $1 || ':%') x WHERE p IS NOT NULL AND s <> "
                                    "p + 1", t.name), 0);
    ck_assert_int_eq(left_in(url, NULL), 0);
    itest_teardown(&t);
}
END_TEST

/* SQS throttling the receive: NOT READY with the reason, no job, and a
 * clean stop on SIGTERM. */
START_TEST(test_worker_throttled)
{
    struct itest t;
    char cfg[300], log[300], url[128], ep[64], murl[64], page[256];
    int port, st, mport;
    pid_t srv, pid;
    FILE *f;
    srv = canned_server("HTTP/1.1 400 Bad Request\r\nContent-Type: application/x-amz-json-1.0\r\n"
                        "Content-Length: 76\r\nConnection: close\r\n\r\n"
                        "{\"__type\":\"com.amazonaws.sqs#ThrottlingException\",\"message\":"
                        "\"Rate exceeded\"}", &port);
    itest_setup(&t, "sqs_thr", "idemq_test.record", "", "");
    snprintf(ep, sizeof ep, "http://127.0.0.1:%d", port);
    snprintf(url, sizeof url, "%s/000000000000/q", ep);
    snprintf(cfg, sizeof cfg, "/tmp/%s.sqs.cfg", t.name);
    snprintf(log, sizeof log, "/tmp/%s.sqs.log", t.name);
    ck_assert_ptr_nonnull(f = fopen(cfg, "w"));
    mport = itest_free_port();
    fprintf(f, "consumer: { id = \"%s\"; };\nmetrics: { listen = \"127.0.0.1:%d\"; };\n"
               "inputs = ( { name = \"%s\"; transport = \"sqs\"; "
               "queue = \"%s\"; queue_url = \"%s\"; region = \"us-east-1\"; endpoint = \"%s\"; "
               "key_source = \"json:job_id\"; effect_function = \"idemq_test.record\"; } );\n",
            t.name, mport, t.name, t.name, url, ep);
    fclose(f);
    pid = itest_spawn_log(cfg, 30, NULL, log);
    snprintf(murl, sizeof murl, "http://127.0.0.1:%d/ready", mport);
    /* polled within 10 s: a slow (sanitizer) build may still be starting */
    for (long long end = mono_ms() + 10000;
         (itest_http_get(murl, page, sizeof page) != 503 ||
          itest_count_lines(log, "NOT READY: input") < 1) && mono_ms() < end;)
        usleep(100 * 1000);
    ck_assert_int_eq(itest_http_get(murl, page, sizeof page), 503);
    ck_assert_msg(strstr(page, "not ready: an SQS worker backs off"), "%s", page);
    kill(pid, SIGTERM);
    st = itest_wait(pid, itest_ms(20000));
    kill(srv, SIGKILL);
    waitpid(srv, NULL, 0);
    ck_assert_msg(st != -1 && WIFEXITED(st) && WEXITSTATUS(st) == 0, "idemq run: %d", st);
    ck_assert_int_eq(itest_count_lines(log, "NOT READY: input"), 1);
    ck_assert_int_ge(itest_count_lines(log, "ThrottlingException"), 1);
    ck_assert_int_eq(itest_count_lines(log, "received 0, applied 0"), 1);
    itest_teardown(&t);
}
END_TEST

/* Tracing (the OTLP receiver of tests/trace, OpenTelemetry's protocol
 * definitions): a message sent with a traceparent message attribute is
 * applied under a span that continues the producer's trace, a child of its
 * span, with messaging.system aws_sqs. */
START_TEST(test_worker_traced)
{
    struct itest t;
    char name[96], url[512], dlq[512], cfg[300], log[300], out[300], body[200], port_s[16];
    char err[256], buf[65536], *mid = NULL;
    const char *tid = "7bf92f3577b34da6a3ce929d0e0e4736", *psid = "00f067aa0ba902b7";
    int port = itest_free_port(), found = 0, receive = 0, del = 0, st;
    struct sqs_client *c;
    json_t *attrs;
    pid_t recv;
    FILE *f;

    if (access(IDEMQ_SOURCE_DIR "/tests/trace/node_modules/@opentelemetry/otlp-transformer",
               R_OK) != 0)
        ck_abort_msg("the tracing test needs tests/trace/node_modules: run scripts/setup");
    itest_setup(&t, "sqs_trace", "idemq_test.record", "", "");
    unique(name, sizeof name, "trace");
    create_queue(name, url, sizeof url);
    strcat(name, "-dlq");
    create_queue(name, dlq, sizeof dlq);
    c = client(url);
    attrs = json_pack("{s:s}", "traceparent", "00-7bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01");
    snprintf(body, sizeof body, "{\"job_id\":\"%s:1\"}", t.name);
    ck_assert_int_eq(sqs_send(c, url, body, NULL, NULL, attrs, &mid, err, sizeof err), SQS_OK);
    free(mid);
    json_decref(attrs);
    sqs_client_free(c);

    snprintf(out, sizeof out, "/tmp/%s.otlp.jsonl", t.name);
    unlink(out);
    snprintf(port_s, sizeof port_s, "%d", port);
    if ((recv = fork()) == 0) {
        if (chdir(IDEMQ_SOURCE_DIR "/tests/trace") != 0)
            _exit(127);
        execlp("node", "node", "otel.mjs", "receive", port_s, out, (char *)NULL);
        _exit(127);
    }
    for (int i = 0; i < itest_ms(15000) / 50 && access(out, F_OK) != 0; i++)
        usleep(50 * 1000);
    ck_assert_msg(access(out, F_OK) == 0, "the OTLP receiver did not start");

    snprintf(cfg, sizeof cfg, "/tmp/%s.sqs.cfg", t.name);
    snprintf(log, sizeof log, "/tmp/%s.sqs.log", t.name);
    write_sqs_config(&t, cfg, url, dlq, 1, NULL);
    ck_assert_ptr_nonnull(f = fopen(cfg, "a"));
    fprintf(f, "tracing: { endpoint = \"http://127.0.0.1:%d/v1/traces\"; flush_ms = 100; };\n",
            port);
    fclose(f);
    run_sqs(cfg, 2, log);
    kill(recv, SIGTERM);
    st = itest_wait(recv, itest_ms(10000));
    ck_assert_msg(st != -1 && WIFEXITED(st) && WEXITSTATUS(st) == 0, "receiver 0x%x", st);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq_test.effects WHERE key = $1 || ':1'",
                                t.name),
                     1);

    ck_assert_ptr_nonnull(f = fopen(out, "r"));
    while (fgets(buf, sizeof buf, f)) {
        json_t *sp = json_loads(buf, 0, NULL), *a;
        const char *sys = NULL, *outcome = NULL;
        size_t i;
        ck_assert_msg(sp && !json_object_get(sp, "invalid"), "receiver line: %s", buf);
        json_array_foreach(json_object_get(sp, "attributes"), i, a) {
            const char *k = json_string_value(json_object_get(a, "key"));
            const char *v =
                json_string_value(json_object_get(json_object_get(a, "value"), "stringValue"));
            if (strcmp(k, "messaging.system") == 0)
                sys = v;
            else if (strcmp(k, "idemq.outcome") == 0)
                outcome = v;
        }
        {   /* the batch's receive and settle (delete) spans link the producer's */
            json_t *l = json_array_get(json_object_get(sp, "links"), 0);
            const char *op = NULL;
            json_array_foreach(json_object_get(sp, "attributes"), i, a) {
                if (strcmp(json_string_value(json_object_get(a, "key")),
                           "messaging.operation.name") == 0)
                    op = json_string_value(
                        json_object_get(json_object_get(a, "value"), "stringValue"));
            }
            if (l && strcmp(json_string_value(json_object_get(l, "traceId")), tid) == 0 &&
                strcmp(json_string_value(json_object_get(l, "spanId")), psid) == 0) {
                ck_assert_int_eq(json_integer_value(json_object_get(sp, "kind")), 3);
                ck_assert_str_eq(sys, "aws_sqs");
                ck_assert_ptr_nonnull(op);
                receive += strcmp(op, "receive") == 0;
                del += strcmp(op, "delete") == 0;
            }
        }
        if (strcmp(json_string_value(json_object_get(sp, "traceId")), tid) == 0 &&
            json_object_get(sp, "parentSpanId") &&
            strcmp(json_string_value(json_object_get(sp, "parentSpanId")), psid) == 0) {
            ck_assert_int_eq(json_integer_value(json_object_get(sp, "kind")), 5);
            ck_assert_str_eq(sys, "aws_sqs");
            ck_assert_str_eq(outcome, "applied");
            found++;
        }
        json_decref(sp);
    }
    fclose(f);
    ck_assert_int_eq(found, 1);
    ck_assert_int_eq(receive, 1);
    ck_assert_int_eq(del, 1);
    /* the effect ran under idemq's span, in the producer's trace */
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq_test.effects WHERE key = $1 ||"
                                    " ':1' AND substr(meta->>'traceparent', 4, 32) ="
                                    " '7bf92f3577b34da6a3ce929d0e0e4736'",
                                t.name),
                     1);
    unlink(out);
    unlink(cfg);
    unlink(log);
    itest_teardown(&t);
}
END_TEST

static bool port_open(int port)
{
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    int s = socket(AF_INET, SOCK_STREAM, 0);
    bool ok;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ok = s >= 0 && connect(s, (struct sockaddr *)&a, sizeof a) == 0;
    if (s >= 0)
        close(s);
    return ok;
}

int main(int argc, char **argv)
{
    pid_t emu;
    int port, rc;
    char portstr[16];
    struct stat st;
    Suite *s;
    TCase *tc;

    emulator = argc > 1 ? argv[1] : "fauxqs";
    port = getenv("IDEMQ_SQS_PORT") ? atoi(getenv("IDEMQ_SQS_PORT"))
           : strcmp(emulator, "moto") == 0 ? 9811 : 9810;
    /* another run beside this one (a second pair, the sanitizer builds):
     * the next free port of 40 */
    for (int i = 0; !getenv("IDEMQ_SQS_PORT") && i < 40 && port_open(port); i++)
        port += 2;
    snprintf(portstr, sizeof portstr, "%d", port);
    snprintf(endpoint, sizeof endpoint, "http://127.0.0.1:%d", port);
    if (stat(NODE_DIR "/node_modules/@aws-sdk/client-sqs", &st) ||
        system("node --version >/dev/null 2>&1")) {
        printf("SKIP: node or tests/node/node_modules (npm install in tests/node, done by "
               "scripts/setup) absent: the SDK producer cannot run\n");
        return 77;
    }
    if (strcmp(emulator, "moto") == 0 &&
        system("python3 -c 'import moto.server' >/dev/null 2>&1")) {
        printf("SKIP: moto's server (python3 -m moto.server) is not installed\n");
        return 77;
    }
    if (strcmp(emulator, "moto") && stat(NODE_DIR "/node_modules/fauxqs/dist/cli.js", &st)) {
        printf("SKIP: fauxqs is not installed in tests/node\n");
        return 77;
    }
    if (port_open(port)) {
        printf("FAIL: port %d is taken: set IDEMQ_SQS_PORT\n", port);
        return 1;
    }
    setenv("AWS_ACCESS_KEY_ID", "test", 1);
    setenv("AWS_SECRET_ACCESS_KEY", "test", 1);
    setenv("AWS_REGION", "us-east-1", 1);
    unsetenv("AWS_SESSION_TOKEN");
    if ((emu = fork()) == 0) {
        int dn = open("/dev/null", O_WRONLY);
        setpgid(0, 0);
        dup2(dn, 1);
        dup2(dn, 2);
        if (strcmp(emulator, "moto") == 0) {
            execlp("python3", "python3", "-m", "moto.server", "-H", "127.0.0.1", "-p", portstr,
                   (char *)NULL);
        } else {
            execlp("node", "node", NODE_DIR "/fauxqs-loopback.mjs", portstr, (char *)NULL);
        }
        _exit(127);
    }
    for (int i = 0; i < 300 && !port_open(port); i++)
        usleep(100000);
    if (!port_open(port)) {
        printf("FAIL: %s did not listen on %d within 30 s\n", emulator, port);
        kill(-emu, SIGTERM);
        kill(emu, SIGTERM);
        waitpid(emu, NULL, 0);
        return 1;
    }
    s = suite_create("sqs");
    tc = tcase_create(emulator);
    tcase_set_timeout(tc, 60);
    tcase_add_test(tc, test_receive_delete);
    tcase_add_test(tc, test_visibility_holds);
    tcase_add_test(tc, test_fifo_group);
    tcase_add_test(tc, test_send_with_attributes);
    tcase_add_test(tc, test_down_and_refused);
    tcase_add_test(tc, test_canned_answers);
    suite_add_tcase(s, tc);
    if (getenv("IDEMQ_PG_DSN") && getenv("IDEMQ_AMQP_URL")) {
        tc = tcase_create("worker");
        tcase_set_timeout(tc, 120);
        tcase_add_test(tc, test_worker_effects_once);
        tcase_add_test(tc, test_worker_retry_via_visibility);
        tcase_add_test(tc, test_worker_visibility_extended);
        tcase_add_test(tc, test_worker_fifo_order);
        tcase_add_test(tc, test_worker_fifo_retry_holds_group);
        tcase_add_test(tc, test_worker_park_redrive);
        tcase_add_test(tc, test_worker_kill_loop);
        tcase_add_test(tc, test_worker_throttled);
        tcase_add_test(tc, test_worker_large_bodies);
        suite_add_tcase(s, tc);
        /* least-privilege mode (scripts/test): these again, as the deployment's roles */
        tc = tcase_create("tracing");
        tcase_set_timeout(tc, 120);
        tcase_add_test(tc, test_worker_traced);
        suite_add_tcase(s, tc);
        itest_lp_tcase(s, (const TTest *const[]){test_worker_effects_once,
                                                 test_worker_retry_via_visibility,
                                                 test_worker_park_redrive, NULL});
    } else {
        printf("note: the worker tests need IDEMQ_PG_DSN and IDEMQ_AMQP_URL (scripts/services)\n");
    }
    rc = check_run(s);
    kill(-emu, SIGTERM);
    kill(emu, SIGTERM);
    waitpid(emu, NULL, 0);
    return rc;
}
