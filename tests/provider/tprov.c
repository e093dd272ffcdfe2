/*
 * tprov: fixtures around idemq-test-provider (see tprov.h).
 */
#include "tprov.h"

#include <check.h>
#include <curl/curl.h>
#include <errno.h>
#include <jansson.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

static int mult(void)
{
    const char *m = getenv("IDEMQ_TEST_TIMEOUT_MULT");
    int v = m ? atoi(m) : 1;
    return v > 0 ? v : 1;
}

void tprov_start(struct tprov *p, const char *const *args)
{
    static int starts;
    const char *base = getenv("IDEMQ_TEST_PROVIDER_PORT");
    char port[16], line[256];
    const char *argv[32];
    int fds[2], n = 0;
    size_t got = 0;

    memset(p, 0, sizeof *p);
    snprintf(port, sizeof port, "%d", base && *base ? atoi(base) + starts++ : 0);
    argv[n++] = IDEMQ_TEST_PROVIDER;
    argv[n++] = "--port";
    argv[n++] = port;
    for (int i = 0; args && args[i] && n < 30; i++)
        argv[n++] = args[i];
    argv[n] = NULL;
    ck_assert_int_eq(pipe(fds), 0);
    fflush(NULL);
    p->pid = fork();
    ck_assert_int_ge(p->pid, 0);
    if (p->pid == 0) {
        dup2(fds[1], STDOUT_FILENO);
        close(fds[0]);
        close(fds[1]);
        execv(argv[0], (char *const *)argv);
        fprintf(stderr, "exec %s: %s\n", argv[0], strerror(errno));
        _exit(127);
    }
    close(fds[1]);
    /* The first stdout line says where it listens. */
    while (got + 1 < sizeof line && !memchr(line, '\n', got)) {
        struct pollfd pf = {fds[0], POLLIN, 0};
        ssize_t r;
        if (poll(&pf, 1, 10000 * mult()) != 1)
            break;
        if ((r = read(fds[0], line + got, sizeof line - 1 - got)) <= 0)
            break;
        got += (size_t)r;
        line[got] = '\0';
    }
    close(fds[0]);
    line[got] = '\0';
    {
        const char *u = strstr(line, "listening on ");
        char *nl;
        ck_assert_msg(u != NULL, "idemq-test-provider did not start: '%s'", line);
        snprintf(p->url, sizeof p->url, "%s", u + 13);
        if ((nl = strchr(p->url, '\n')))
            *nl = '\0';
        p->port = atoi(strrchr(p->url, ':') + 1);
    }
}

void tprov_stop(struct tprov *p)
{
    int status;
    if (p->pid <= 0)
        return;
    kill(p->pid, SIGTERM);
    for (int i = 0; i < 500; i++) {
        if (waitpid(p->pid, &status, WNOHANG) == p->pid) {
            p->pid = 0;
            return;
        }
        usleep(10000);
    }
    kill(p->pid, SIGKILL);
    waitpid(p->pid, &status, 0);
    p->pid = 0;
}

struct sink {
    char *out;
    size_t len, cap;
};

static size_t sink_write(char *data, size_t size, size_t n, void *arg)
{
    struct sink *s = arg;
    size_t take = size * n;
    if (s->cap && s->len + 1 < s->cap) {
        size_t room = s->cap - 1 - s->len;
        size_t k = take < room ? take : room;
        memcpy(s->out + s->len, data, k);
        s->len += k;
        s->out[s->len] = '\0';
    }
    return take;
}

int tprov_http(struct tprov *p, const char *method, const char *path, const char *body,
               const char *const *headers, char *out, size_t outlen)
{
    char url[512];
    struct curl_slist *hs = NULL;
    struct sink s = {out, 0, outlen};
    CURL *c = curl_easy_init();
    CURLcode rc;
    long status = -1;

    if (out && outlen)
        out[0] = '\0';
    ck_assert_ptr_nonnull(c);
    snprintf(url, sizeof url, "%s%s", p->url, path);
    for (int i = 0; headers && headers[i]; i++)
        hs = curl_slist_append(hs, headers[i]);
    hs = curl_slist_append(hs, "Expect:");
    curl_easy_setopt(c, CURLOPT_URL, url);
    curl_easy_setopt(c, CURLOPT_CUSTOMREQUEST, method);
    curl_easy_setopt(c, CURLOPT_HTTPHEADER, hs);
    curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, sink_write);
    curl_easy_setopt(c, CURLOPT_WRITEDATA, &s);
    curl_easy_setopt(c, CURLOPT_TIMEOUT_MS, 30000L * mult());
    curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(c, CURLOPT_SSL_VERIFYPEER, 0L); /* a test tool talking to its own child */
    curl_easy_setopt(c, CURLOPT_SSL_VERIFYHOST, 0L);
    if (body) {
        curl_easy_setopt(c, CURLOPT_POSTFIELDS, body);
        curl_easy_setopt(c, CURLOPT_POSTFIELDSIZE, (long)strlen(body));
    }
    rc = curl_easy_perform(c);
    if (rc == CURLE_OK)
        curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &status);
    else if (rc == CURLE_GOT_NOTHING)
        status = 0;
    curl_slist_free_all(hs);
    curl_easy_cleanup(c);
    return (int)status;
}

void tprov_control(struct tprov *p, const char *json)
{
    char out[256];
    int st = tprov_http(p, "POST", "/_control", json, NULL, out, sizeof out);
    ck_assert_msg(st == 200, "provider control %s: %d %s", json, st, out);
}

long tprov_stat(struct tprov *p, const char *key, const char *field)
{
    char path[1024], out[1024];
    json_t *root, *v;
    long val;
    char *esc = NULL;
    CURL *c = curl_easy_init();
    ck_assert_ptr_nonnull(c);
    esc = curl_easy_escape(c, key ? key : "", 0);
    snprintf(path, sizeof path, "/_stats?key=%s", esc);
    curl_free(esc);
    curl_easy_cleanup(c);
    ck_assert_int_eq(tprov_http(p, "GET", path, NULL, NULL, out, sizeof out), 200);
    root = json_loads(out, 0, NULL);
    v = json_object_get(root, field);
    ck_assert_msg(json_is_integer(v), "no %s in %s", field, out);
    val = (long)json_integer_value(v);
    json_decref(root);
    return val;
}
