/* Tests of adapters/effect_http against the real idemq-test-provider process
 * (no broker, no database): classification of every answer, the key header
 * check, request bodies, the in-flight cap, credentials and TLS. */
#include <check.h>
#include <curl/curl.h>
#include <limits.h>
#include <time.h>

#include "check_run.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "conf.h"
#include "effect_http.h"
#include "tprov.h"

static struct tprov P;

static int mult(void)
{
    const char *m = getenv("IDEMQ_TEST_TIMEOUT_MULT");
    return m && atoi(m) > 0 ? atoi(m) : 1;
}

/* A config with one provider input at url; extra = more provider lines. */
static struct conf *provider_conf(const char *url, const char *extra)
{
    char text[4096], err[512], timeout[64] = "";
    struct conf *c = NULL;
    if (!extra || !strstr(extra, "timeout_ms ="))
        snprintf(timeout, sizeof timeout, "timeout_ms = %d;", 10000 * mult());
    snprintf(text, sizeof text,
             "retry: { max_delay_ms = 120000; };\n"
             "inputs = ( { name = \"pay\"; queue = \"q\"; provider: { url = \"%s\"; "
             "path = \"/charges\"; %s lookup_reference_path = \"/charges?reference={key}\"; "
             "%s %s }; } );\n",
             url, extra && strstr(extra, "idempotent = false") ? ""
                  : "lookup_key_path = \"/charges/by-idempotency-key/{key}\";",
             timeout, extra ? extra : "");
    ck_assert_msg(conf_load_string(text, &c, err, sizeof err) == IDEMQ_OK, "%s", err);
    return c;
}

static struct effect_http *engine(const struct conf *c)
{
    struct effect_http *h = NULL;
    char err[512];
    ck_assert_msg(effect_http_new(c, &h, err, sizeof err) == IDEMQ_OK, "%s", err);
    return h;
}

/* Submits one request and waits for its result. */
static void call1(struct effect_http *h, enum effect_http_op op, const char *key,
                  const char *body, struct effect_http_result *r)
{
    char err[256];
    int n = 0;
    ck_assert_msg(effect_http_submit(h, 0, op, key, body, body ? strlen(body) : 0, (void *)key,
                                     err, sizeof err) == IDEMQ_OK,
                  "%s", err);
    for (int i = 0; i < 300 && n == 0; i++)
        n = effect_http_poll(h, 100, r, 1);
    ck_assert_int_eq(n, 1);
    ck_assert_ptr_eq(r->cookie, (void *)key);
}

static void setup(void) { tprov_start(&P, NULL); }
static void teardown(void) { tprov_stop(&P); }

START_TEST(test_key_check)
{
    ck_assert_int_eq(effect_http_key_check("payout:inv-1"), IDEMQ_OK);
    ck_assert_int_eq(effect_http_key_check("a b"), IDEMQ_OK);
    ck_assert_int_eq(effect_http_key_check("a\r\nX-Evil: 1"), IDEMQ_ERR_KEY_INVALID_HEADER);
    ck_assert_int_eq(effect_http_key_check("a\nb"), IDEMQ_ERR_KEY_INVALID_HEADER);
    ck_assert_int_eq(effect_http_key_check("tab\there"), IDEMQ_ERR_KEY_INVALID_HEADER);
    ck_assert_int_eq(effect_http_key_check("del\x7f"), IDEMQ_ERR_KEY_INVALID_HEADER);
    ck_assert_int_eq(effect_http_key_check("caf\xc3\xa9"), IDEMQ_ERR_KEY_INVALID_HEADER);
    ck_assert_int_eq(effect_http_key_check(" lead"), IDEMQ_ERR_KEY_INVALID_HEADER);
    ck_assert_int_eq(effect_http_key_check("trail "), IDEMQ_ERR_KEY_INVALID_HEADER);
    ck_assert_int_eq(effect_http_key_check(""), IDEMQ_ERR_KEY_INVALID_HEADER);
    {
        char long_key[300];
        memset(long_key, 'k', sizeof long_key - 1);
        long_key[sizeof long_key - 1] = '\0';
        ck_assert_int_eq(effect_http_key_check(long_key), IDEMQ_ERR_KEY_INVALID_HEADER);
        long_key[255] = '\0';
        ck_assert_int_eq(effect_http_key_check(long_key), IDEMQ_OK);
    }
}
END_TEST

START_TEST(test_build_body)
{
    struct conf *c = provider_conf("http://127.0.0.1:9", NULL);
    struct conf *t = provider_conf(
        "http://127.0.0.1:9",
        "body_template = \"{\\\"amount\\\": {{payload.amount_minor}}, \\\"reference\\\": {{key}}, "
        "\\\"missing\\\": {{payload.nope}}, \\\"all\\\": {{payload}}}\";");
    const char *payload = "{\"job_id\":\"k\\\"1\",\"amount_minor\":250}";
    char *out;
    size_t len;
    ck_assert_int_eq(effect_http_build_body(&c->inputs[0], "k\"1", payload, strlen(payload), &out,
                                            &len),
                     IDEMQ_OK);
    ck_assert_str_eq(out, payload);
    ck_assert_uint_eq(len, strlen(payload));
    free(out);
    ck_assert_int_eq(effect_http_build_body(&t->inputs[0], "k\"1", payload, strlen(payload), &out,
                                            &len),
                     IDEMQ_OK);
    ck_assert_str_eq(out, "{\"amount\": 250, \"reference\": \"k\\\"1\", \"missing\": null, "
                          "\"all\": {\"job_id\":\"k\\\"1\",\"amount_minor\":250}}");
    free(out);
    ck_assert_int_eq(effect_http_build_body(&t->inputs[0], "k", "not json", 8, &out, &len),
                     IDEMQ_ERR_BAD_JSON);
    ck_assert_ptr_null(out);
    {
        char a[65], b[65];
        effect_http_request_sha(&c->inputs[0], "x", 1, a);
        effect_http_request_sha(&c->inputs[0], "y", 1, b);
        ck_assert_uint_eq(strlen(a), 64);
        ck_assert_str_ne(a, b);
    }
    conf_free(c);
    conf_free(t);
}
END_TEST

/* 2xx with the reference; the same key and body again: the same charge,
 * one charge at the provider; another body under the key: 422 permanent. */
START_TEST(test_success_replay_and_422)
{
    struct conf *c = provider_conf(P.url, NULL);
    struct effect_http *h = engine(c);
    struct effect_http_result r;

    call1(h, EFFECT_HTTP_CALL, "k1", "{\"amount\":5}", &r);
    ck_assert_int_eq(r.cls, EFFECT_HTTP_SUCCESS);
    ck_assert_int_eq(r.status, 201);
    ck_assert_str_eq(r.reference, "ch_000001");
    effect_http_result_clear(&r);
    call1(h, EFFECT_HTTP_CALL, "k1", "{\"amount\":5}", &r);
    ck_assert_int_eq(r.cls, EFFECT_HTTP_SUCCESS);
    ck_assert_str_eq(r.reference, "ch_000001");
    effect_http_result_clear(&r);
    ck_assert_int_eq(tprov_stat(&P, "k1", "key_charges"), 1);
    call1(h, EFFECT_HTTP_CALL, "k1", "{\"amount\":6}", &r);
    ck_assert_int_eq(r.cls, EFFECT_HTTP_PERMANENT);
    ck_assert_int_eq(r.status, 422);
    ck_assert_ptr_nonnull(strstr(r.body, "idempotency_key_reused"));
    effect_http_result_clear(&r);
    ck_assert_int_eq(tprov_stat(&P, "k1", "key_charges"), 1);
    ck_assert_int_eq(effect_http_in_flight(h, -1), 0);
    effect_http_free(h);
    conf_free(c);
}
END_TEST

/* A second request while the first is in flight: 409 conflict. Polling
 * with a short timeout returns with nothing while the first waits. */
START_TEST(test_conflict_while_in_flight)
{
    struct conf *c = provider_conf(P.url, NULL);
    struct effect_http *h = engine(c);
    struct effect_http_result r[2];
    char err[256];
    int n = 0;

    tprov_control(&P, "{\"fault\":\"latency=1500\",\"count\":1}");
    ck_assert_int_eq(effect_http_submit(h, 0, EFFECT_HTTP_CALL, "k2", "{}", 2, "first", err,
                                        sizeof err),
                     IDEMQ_OK);
    ck_assert_int_eq(effect_http_poll(h, 300, r, 2), 0); /* the first is held */
    ck_assert_int_eq(effect_http_in_flight(h, 0), 1);
    ck_assert_int_eq(effect_http_submit(h, 0, EFFECT_HTTP_CALL, "k2", "{}", 2, "second", err,
                                        sizeof err),
                     IDEMQ_OK);
    for (int i = 0; i < 300 && n < 2; i++)
        n += effect_http_poll(h, 100, r + n, 2 - n);
    ck_assert_int_eq(n, 2);
    ck_assert_str_eq((const char *)r[0].cookie, "second");
    ck_assert_int_eq(r[0].cls, EFFECT_HTTP_CONFLICT);
    ck_assert_int_eq(r[0].status, 409);
    ck_assert_int_eq(r[1].cls, EFFECT_HTTP_SUCCESS);
    ck_assert_int_eq(tprov_stat(&P, "k2", "key_charges"), 1);
    effect_http_result_clear(&r[0]);
    effect_http_result_clear(&r[1]);
    effect_http_free(h);
    conf_free(c);
}
END_TEST

START_TEST(test_rate_limited_and_unknowns)
{
    struct conf *c = provider_conf(P.url, NULL);
    struct effect_http *h = engine(c);
    struct effect_http_result r;

    tprov_control(&P, "{\"fault\":\"rate=3\",\"count\":1}");
    call1(h, EFFECT_HTTP_CALL, "k3", "{}", &r);
    ck_assert_int_eq(r.cls, EFFECT_HTTP_RATE_LIMITED);
    ck_assert_int_eq(r.retry_after_ms, 3000);
    effect_http_result_clear(&r);

    tprov_control(&P, "{\"fault\":\"status=503\",\"count\":1}");
    call1(h, EFFECT_HTTP_CALL, "k3", "{}", &r);
    ck_assert_int_eq(r.cls, EFFECT_HTTP_UNKNOWN);
    ck_assert_int_eq(r.status, 503);
    effect_http_result_clear(&r);

    tprov_control(&P, "{\"fault\":\"transient\",\"count\":1}");
    call1(h, EFFECT_HTTP_CALL, "k3", "{}", &r);
    ck_assert_int_eq(r.cls, EFFECT_HTTP_UNKNOWN);
    ck_assert(r.transient_header);
    effect_http_result_clear(&r);

    tprov_control(&P, "{\"fault\":\"status=400\",\"count\":1}");
    call1(h, EFFECT_HTTP_CALL, "k3", "{}", &r);
    ck_assert_int_eq(r.cls, EFFECT_HTTP_PERMANENT);
    effect_http_result_clear(&r);
    ck_assert_int_eq(tprov_stat(&P, "k3", "key_charges"), 0); /* none of these applied */

    /* applied, then the connection closes without an answer: unknown, and
     * libcurl did not resend it on its own (a call never reuses a
     * connection, where libcurl would retry a dead one silently) */
    tprov_control(&P, "{\"fault\":\"drop\",\"count\":1}");
    {
        long before = tprov_stat(&P, NULL, "requests");
        call1(h, EFFECT_HTTP_CALL, "k4", "{}", &r);
        ck_assert_int_eq(tprov_stat(&P, NULL, "requests"), before + 1);
    }
    ck_assert_int_eq(r.cls, EFFECT_HTTP_UNKNOWN);
    ck_assert_int_eq(r.status, 0);
    ck_assert_int_eq(tprov_stat(&P, "k4", "key_charges"), 1);
    effect_http_result_clear(&r);
    /* the same key again: the provider's first answer, still one charge */
    call1(h, EFFECT_HTTP_CALL, "k4", "{}", &r);
    ck_assert_int_eq(r.cls, EFFECT_HTTP_SUCCESS);
    ck_assert_str_eq(r.reference, "ch_000001");
    ck_assert_int_eq(tprov_stat(&P, "k4", "key_charges"), 1);
    effect_http_result_clear(&r);

    /* 2xx without the reference field */
    effect_http_free(h);
    conf_free(c);
    c = provider_conf(P.url, "reference_field = \"data.id\";");
    h = engine(c);
    call1(h, EFFECT_HTTP_CALL, "k5", "{}", &r);
    ck_assert_int_eq(r.cls, EFFECT_HTTP_SUCCESS);
    ck_assert_str_eq(r.reference, "");
    ck_assert_ptr_nonnull(strstr(r.detail, "without data.id"));
    effect_http_result_clear(&r);
    effect_http_free(h);
    conf_free(c);
}
END_TEST

/* A provider that ignores keys: a dropped answer stays unknown and is never
 * resent by libcurl on its own (no connection reuse). */
START_TEST(test_non_idempotent_drop_not_resent)
{
    const char *args[] = {"--non-idempotent", NULL};
    struct tprov n;
    struct conf *c;
    struct effect_http *h;
    struct effect_http_result r;

    tprov_start(&n, args);
    c = provider_conf(n.url, "idempotent = false;");
    h = engine(c);
    call1(h, EFFECT_HTTP_CALL, "n1", "{}", &r); /* opens a connection */
    ck_assert_int_eq(r.cls, EFFECT_HTTP_SUCCESS);
    effect_http_result_clear(&r);
    tprov_control(&n, "{\"fault\":\"drop\",\"count\":1}");
    call1(h, EFFECT_HTTP_CALL, "n2", "{}", &r);
    ck_assert_int_eq(r.cls, EFFECT_HTTP_UNKNOWN);
    effect_http_result_clear(&r);
    ck_assert_int_eq(tprov_stat(&n, "n2", "key_charges"), 1);
    ck_assert_int_eq(tprov_stat(&n, NULL, "requests"), 2);
    effect_http_free(h);
    conf_free(c);
    tprov_stop(&n);
}
END_TEST

/* A timeout after sending is unknown; a refused connection is not sent. */
START_TEST(test_timeout_and_not_sent)
{
    char extra[128];
    struct conf *c;
    struct effect_http *h;
    struct effect_http_result r;
    struct tprov dead;

    snprintf(extra, sizeof extra, "timeout_ms = %d; connect_timeout_ms = 300;", 600 * mult());
    c = provider_conf(P.url, extra);
    h = engine(c);
    tprov_control(&P, "{\"fault\":\"latency=3000\",\"count\":1}");
    call1(h, EFFECT_HTTP_CALL, "k6", "{}", &r);
    ck_assert_int_eq(r.cls, EFFECT_HTTP_UNKNOWN);
    ck_assert_int_eq(r.status, 0);
    effect_http_result_clear(&r);
    effect_http_free(h);
    conf_free(c);

    tprov_start(&dead, NULL);
    tprov_stop(&dead); /* its port now refuses connections */
    c = provider_conf(dead.url, NULL);
    h = engine(c);
    call1(h, EFFECT_HTTP_CALL, "k7", "{}", &r);
    ck_assert_int_eq(r.cls, EFFECT_HTTP_NOT_SENT);
    ck_assert_int_eq(r.status, 0);
    effect_http_result_clear(&r);
    effect_http_free(h);
    conf_free(c);
}
END_TEST

START_TEST(test_lookups)
{
    struct conf *c = provider_conf(
        P.url, "body_template = \"{\\\"reference\\\": {{key}}, \\\"amount\\\": 7}\";");
    struct effect_http *h = engine(c);
    struct effect_http_result r;
    char *body;
    size_t len;

    call1(h, EFFECT_HTTP_LOOKUP_KEY, "pay:1/x", NULL, &r);
    ck_assert_int_eq(r.cls, EFFECT_HTTP_NOT_FOUND);
    effect_http_result_clear(&r);
    ck_assert_int_eq(effect_http_build_body(&c->inputs[0], "pay:1/x", "{}", 2, &body, &len),
                     IDEMQ_OK);
    call1(h, EFFECT_HTTP_CALL, "pay:1/x", body, &r);
    ck_assert_int_eq(r.cls, EFFECT_HTTP_SUCCESS);
    effect_http_result_clear(&r);
    free(body);
    call1(h, EFFECT_HTTP_LOOKUP_KEY, "pay:1/x", NULL, &r);
    ck_assert_int_eq(r.cls, EFFECT_HTTP_SUCCESS);
    ck_assert_str_eq(r.reference, "ch_000001");
    effect_http_result_clear(&r);
    call1(h, EFFECT_HTTP_LOOKUP_REF, "pay:1/x", NULL, &r);
    ck_assert_int_eq(r.cls, EFFECT_HTTP_SUCCESS);
    ck_assert_str_eq(r.reference, "ch_000001");
    effect_http_result_clear(&r);
    call1(h, EFFECT_HTTP_LOOKUP_REF, "pay:2", NULL, &r);
    ck_assert_int_eq(r.cls, EFFECT_HTTP_NOT_FOUND);
    effect_http_result_clear(&r);
    effect_http_free(h);
    conf_free(c);
}
END_TEST

/* Refusals before anything is sent: a bad key, the in-flight cap. */
START_TEST(test_refusals)
{
    struct conf *c = provider_conf(P.url, "max_in_flight = 2;");
    struct effect_http *h = engine(c);
    struct effect_http_result r[2];
    char err[256];
    int n = 0;

    ck_assert_int_eq(effect_http_submit(h, 0, EFFECT_HTTP_CALL, "bad\r\nX-Injected: 1", "{}", 2,
                                        NULL, err, sizeof err),
                     IDEMQ_ERR_KEY_INVALID_HEADER);
    ck_assert_ptr_nonnull(strstr(err, "not sent"));
    ck_assert_int_eq(tprov_stat(&P, NULL, "requests"), 0);
    tprov_control(&P, "{\"fault\":\"latency=500\",\"count\":2}");
    ck_assert_int_eq(effect_http_submit(h, 0, EFFECT_HTTP_CALL, "c1", "{}", 2, NULL, err,
                                        sizeof err), IDEMQ_OK);
    ck_assert_int_eq(effect_http_submit(h, 0, EFFECT_HTTP_CALL, "c2", "{}", 2, NULL, err,
                                        sizeof err), IDEMQ_OK);
    ck_assert_int_eq(effect_http_submit(h, 0, EFFECT_HTTP_CALL, "c3", "{}", 2, NULL, err,
                                        sizeof err), IDEMQ_ERR_PROVIDER_BUSY);
    ck_assert_int_eq(effect_http_submit(h, 1, EFFECT_HTTP_CALL, "c3", "{}", 2, NULL, err,
                                        sizeof err), IDEMQ_ERR_CONFIG);
    for (int i = 0; i < 300 && n < 2; i++)
        n += effect_http_poll(h, 100, r + n, 2 - n);
    ck_assert_int_eq(n, 2);
    effect_http_result_clear(&r[0]);
    effect_http_result_clear(&r[1]);
    ck_assert_int_eq(effect_http_in_flight(h, 0), 0);
    ck_assert_int_eq(effect_http_submit(h, 0, EFFECT_HTTP_CALL, "c3", "{}", 2, NULL, err,
                                        sizeof err), IDEMQ_OK);
    effect_http_free(h); /* with one in flight: cancelled, nothing leaks */
    conf_free(c);
}
END_TEST

/* The credential comes from an environment variable or a file. */
START_TEST(test_credentials)
{
    const char *args[] = {"--auth", "Bearer s3cret-value", NULL};
    struct tprov a;
    struct conf *c;
    struct effect_http *h = NULL;
    struct effect_http_result r;
    char err[512], path[] = "/tmp/idemq-auth-XXXXXX";
    int fd;

    tprov_start(&a, args);
    unsetenv("IDEMQ_TEST_TOKEN");
    c = provider_conf(a.url, "auth_env = \"IDEMQ_TEST_TOKEN\";");
    ck_assert_int_eq(effect_http_new(c, &h, err, sizeof err), IDEMQ_ERR_CONFIG);
    ck_assert_ptr_nonnull(strstr(err, "IDEMQ_TEST_TOKEN, which is not set"));
    setenv("IDEMQ_TEST_TOKEN", "Bearer wrong", 1);
    h = engine(c);
    call1(h, EFFECT_HTTP_CALL, "a1", "{}", &r);
    ck_assert_int_eq(r.status, 401);
    ck_assert_int_eq(r.cls, EFFECT_HTTP_PERMANENT);
    effect_http_result_clear(&r);
    effect_http_free(h);
    setenv("IDEMQ_TEST_TOKEN", "Bearer s3cret-value", 1);
    h = engine(c);
    call1(h, EFFECT_HTTP_CALL, "a1", "{}", &r);
    ck_assert_int_eq(r.cls, EFFECT_HTTP_SUCCESS);
    ck_assert_ptr_null(strstr(r.detail, "s3cret"));
    effect_http_result_clear(&r);
    effect_http_free(h);
    conf_free(c);
    unsetenv("IDEMQ_TEST_TOKEN");

    fd = mkstemp(path);
    ck_assert_int_ge(fd, 0);
    ck_assert_int_eq(write(fd, "Bearer s3cret-value\n", 20), 20);
    close(fd);
    {
        char extra[128];
        snprintf(extra, sizeof extra, "auth_file = \"%s\";", path);
        c = provider_conf(a.url, extra);
    }
    h = engine(c);
    call1(h, EFFECT_HTTP_CALL, "a2", "{}", &r);
    ck_assert_int_eq(r.cls, EFFECT_HTTP_SUCCESS);
    effect_http_result_clear(&r);
    effect_http_free(h);
    unlink(path);
    ck_assert_int_eq(effect_http_new(c, &h, err, sizeof err), IDEMQ_ERR_CONFIG);
    ck_assert_ptr_nonnull(strstr(err, "provider.auth_file"));
    conf_free(c);
    tprov_stop(&a);
}
END_TEST

/* TLS: verification is on by default; a self-signed provider is not sent
 * to, until its certificate is given as provider.ca_file. */
START_TEST(test_tls_verification)
{
    const char *dir = "/tmp/idemq-tls-test";
    char cmd[1024], cert[256], key[256], url[128], extra[512];
    const char *args[] = {"--tls-cert", cert, "--tls-key", key, NULL};
    struct tprov s;
    struct conf *c;
    struct effect_http *h;
    struct effect_http_result r;

    snprintf(cert, sizeof cert, "%s-%d.crt", dir, (int)getpid());
    snprintf(key, sizeof key, "%s-%d.key", dir, (int)getpid());
    snprintf(cmd, sizeof cmd,
             "openssl req -x509 -newkey rsa:2048 -nodes -keyout %s -out %s -days 1 "
             "-subj /CN=localhost -addext subjectAltName=DNS:localhost >/dev/null 2>&1",
             key, cert);
    ck_assert_int_eq(system(cmd), 0);
    tprov_start(&s, args);
    snprintf(url, sizeof url, "https://localhost:%d", s.port);

    c = provider_conf(url, NULL);
    h = engine(c);
    call1(h, EFFECT_HTTP_CALL, "t1", "{}", &r);
    ck_assert_int_eq(r.cls, EFFECT_HTTP_NOT_SENT);
    ck_assert_int_eq(r.status, 0);
    effect_http_result_clear(&r);
    effect_http_free(h);
    conf_free(c);
    ck_assert_int_eq(tprov_stat(&s, NULL, "requests"), 0);

    snprintf(extra, sizeof extra, "ca_file = \"%s\";", cert);
    c = provider_conf(url, extra);
    h = engine(c);
    call1(h, EFFECT_HTTP_CALL, "t1", "{}", &r);
    ck_assert_int_eq(r.cls, EFFECT_HTTP_SUCCESS);
    ck_assert_str_eq(r.reference, "ch_000001");
    effect_http_result_clear(&r);
    effect_http_free(h);
    conf_free(c);

    c = provider_conf(url, "verify_tls = false;");
    h = engine(c);
    call1(h, EFFECT_HTTP_CALL, "t1", "{}", &r);
    ck_assert_int_eq(r.cls, EFFECT_HTTP_SUCCESS);
    effect_http_result_clear(&r);
    effect_http_free(h);
    conf_free(c);
    tprov_stop(&s);
    unlink(cert);
    unlink(key);
}
END_TEST

/* "possibly sent" is decided from whether the transfer began, never
 * from the byte counters: a first write of 0 bytes (EAGAIN) leaves
 * CURLINFO_REQUEST_SIZE at 0 while the request goes out later. */
START_TEST(test_failure_class_conservative)
{
    /* a timeout or reset once the transfer began: unknown, even at 0 bytes */
    ck_assert_int_eq(effect_http_failure_class(CURLE_OPERATION_TIMEDOUT, 420, 0),
                     EFFECT_HTTP_UNKNOWN);
    ck_assert_int_eq(effect_http_failure_class(CURLE_SEND_ERROR, 380, 0), EFFECT_HTTP_UNKNOWN);
    ck_assert_int_eq(effect_http_failure_class(CURLE_RECV_ERROR, 380, 153), EFFECT_HTTP_UNKNOWN);
    ck_assert_int_eq(effect_http_failure_class(CURLE_GOT_NOTHING, 380, 0), EFFECT_HTTP_UNKNOWN);
    /* nothing began (a connect timeout, no connection): not sent */
    ck_assert_int_eq(effect_http_failure_class(CURLE_OPERATION_TIMEDOUT, 0, 0),
                     EFFECT_HTTP_NOT_SENT);
    /* connect, DNS and TLS failures prove it */
    ck_assert_int_eq(effect_http_failure_class(CURLE_COULDNT_CONNECT, 0, 0), EFFECT_HTTP_NOT_SENT);
    ck_assert_int_eq(effect_http_failure_class(CURLE_COULDNT_RESOLVE_HOST, 0, 0),
                     EFFECT_HTTP_NOT_SENT);
    ck_assert_int_eq(effect_http_failure_class(CURLE_PEER_FAILED_VERIFICATION, 0, 0),
                     EFFECT_HTTP_NOT_SENT);
    /* bytes counted but no transfer time: still possibly sent */
    ck_assert_int_eq(effect_http_failure_class(CURLE_PARTIAL_FILE, 0, 200), EFFECT_HTTP_UNKNOWN);
    /* once the transfer began, no code proves "not sent" */
    ck_assert_int_eq(effect_http_failure_class(CURLE_SSL_CONNECT_ERROR, 380, 0),
                     EFFECT_HTTP_UNKNOWN);
}
END_TEST

/* a Retry-After never exceeds what the ledger takes (int4 ms), in
 * either form, however large; the provider's 429 end to end too. */
START_TEST(test_retry_after_clamped)
{
    struct conf *c;
    struct effect_http *h;
    struct effect_http_result r;
    long long now = (long long)time(NULL);

    ck_assert_int_eq(effect_http_retry_after_ms("120", now), 120000);
    ck_assert_int_eq(effect_http_retry_after_ms("0", now), 0);
    ck_assert_int_eq(effect_http_retry_after_ms("2147483", now), 2147483000L);
    ck_assert_int_eq(effect_http_retry_after_ms("2147484", now), EFFECT_HTTP_RETRY_AFTER_MAX_MS);
    ck_assert_int_eq(effect_http_retry_after_ms("2592000", now), EFFECT_HTTP_RETRY_AFTER_MAX_MS);
    ck_assert_int_eq(effect_http_retry_after_ms("99999999999999999999999", now),
                     EFFECT_HTTP_RETRY_AFTER_MAX_MS);
    ck_assert_int_eq(effect_http_retry_after_ms("Sun, 06 Nov 1994 08:49:37 GMT", now), 0);
    ck_assert_int_eq(effect_http_retry_after_ms("Fri, 31 Dec 2055 23:59:59 GMT", now),
                     EFFECT_HTTP_RETRY_AFTER_MAX_MS);
    {
        char date[64];
        time_t when = (time_t)now + 3600;
        struct tm tm;
        long ms;
        gmtime_r(&when, &tm);
        strftime(date, sizeof date, "%a, %d %b %Y %H:%M:%S GMT", &tm);
        ms = effect_http_retry_after_ms(date, now);
        ck_assert_msg(ms >= 3599000 && ms <= 3600000, "%s: %ld", date, ms);
    }
    ck_assert_int_eq(effect_http_retry_after_ms("soon", now), -1);
    ck_assert_int_eq(effect_http_retry_after_ms("", now), -1);

    c = provider_conf(P.url, NULL);
    h = engine(c);
    tprov_control(&P, "{\"fault\":\"rate=2592000\",\"count\":1}");
    call1(h, EFFECT_HTTP_CALL, "ra1", "{}", &r);
    ck_assert_int_eq(r.cls, EFFECT_HTTP_RATE_LIMITED);
    ck_assert_int_eq(r.retry_after_ms, EFFECT_HTTP_RETRY_AFTER_MAX_MS);
    ck_assert_int_le(r.retry_after_ms, INT_MAX);
    effect_http_result_clear(&r);
    effect_http_free(h);
    conf_free(c);
}
END_TEST

/* Waits up to ms for the provider to have counted want requests in all,
 * without polling the engine. */
static long wait_requests(long want, int ms)
{
    long n = tprov_stat(&P, NULL, "requests");
    for (int i = 0; i < ms / 20 && n < want; i++) {
        struct timespec ts = {0, 20 * 1000000L};
        nanosleep(&ts, NULL);
        n = tprov_stat(&P, NULL, "requests");
    }
    return n;
}

/* the request leaves at submit, not at the next poll (the caller may
 * be busy for seconds before it polls); and a bounded call never outlives
 * its budget, or is refused unsent when too little of it is left. */
START_TEST(test_sent_at_submit_and_bounded)
{
    struct conf *c = provider_conf(P.url, NULL);
    struct effect_http *h = engine(c);
    struct effect_http_result r;
    char err[256];
    long before;
    int n = 0;

    tprov_control(&P, "{\"fault\":\"latency=1500\",\"count\":1}");
    before = tprov_stat(&P, NULL, "requests");
    ck_assert_int_eq(effect_http_submit(h, 0, EFFECT_HTTP_CALL, "s1", "{}", 2, (void *)"s1", err,
                                        sizeof err),
                     IDEMQ_OK);
    /* nobody polls the engine meanwhile */
    ck_assert_int_eq(wait_requests(before + 1, 1000 * mult()), before + 1);
    for (int i = 0; i < 300 && n == 0; i++)
        n = effect_http_poll(h, 100, &r, 1);
    ck_assert_int_eq(n, 1);
    ck_assert_int_eq(r.cls, EFFECT_HTTP_SUCCESS);
    effect_http_result_clear(&r);

    /* too little budget left: refused, nothing sent */
    before = tprov_stat(&P, NULL, "requests");
    ck_assert_int_eq(effect_http_submit_within(h, 0, EFFECT_HTTP_CALL, "s2", "{}", 2,
                                               (void *)"s2", EFFECT_HTTP_MIN_CALL_MS - 1, err,
                                               sizeof err),
                     IDEMQ_ERR_TIMEOUT);
    ck_assert_int_eq(effect_http_in_flight(h, 0), 0);
    ck_assert_int_eq(effect_http_poll(h, 0, &r, 1), 0);
    ck_assert_int_eq(tprov_stat(&P, NULL, "requests"), before);

    /* a budget below provider.timeout_ms (10 s) bounds the call */
    tprov_control(&P, "{\"fault\":\"latency=6000\",\"count\":1}");
    ck_assert_int_eq(effect_http_submit_within(h, 0, EFFECT_HTTP_CALL, "s3", "{}", 2,
                                               (void *)"s3", 1000 * mult(), err, sizeof err),
                     IDEMQ_OK);
    n = 0;
    for (int i = 0; i < 300 && n == 0; i++)
        n = effect_http_poll(h, 100, &r, 1);
    ck_assert_int_eq(n, 1);
    ck_assert_int_eq(r.cls, EFFECT_HTTP_UNKNOWN);
    ck_assert_msg(r.elapsed_ms < 1000 * mult() + 500, "elapsed %lld ms", r.elapsed_ms);
    effect_http_result_clear(&r);
    effect_http_free(h);
    conf_free(c);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("effect_http");
    TCase *tc = tcase_create("effect_http");
    tcase_set_timeout(tc, 60 * mult());
    tcase_add_checked_fixture(tc, setup, teardown);
    tcase_add_test(tc, test_key_check);
    tcase_add_test(tc, test_build_body);
    tcase_add_test(tc, test_success_replay_and_422);
    tcase_add_test(tc, test_conflict_while_in_flight);
    tcase_add_test(tc, test_rate_limited_and_unknowns);
    tcase_add_test(tc, test_timeout_and_not_sent);
    tcase_add_test(tc, test_non_idempotent_drop_not_resent);
    tcase_add_test(tc, test_lookups);
    tcase_add_test(tc, test_refusals);
    tcase_add_test(tc, test_credentials);
    tcase_add_test(tc, test_tls_verification);
    tcase_add_test(tc, test_failure_class_conservative);
    tcase_add_test(tc, test_retry_after_clamped);
    tcase_add_test(tc, test_sent_at_submit_and_bounded);
    suite_add_tcase(s, tc);
    return check_run(s);
}
