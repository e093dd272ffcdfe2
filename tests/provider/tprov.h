/*
 * tprov: test fixtures around idemq-test-provider (tests/provider/provider.c):
 * start it as a child process on a free loopback port, drive its switches,
 * read its counters. Used by the provider unit and integration tests; it
 * aborts the running Check test on any setup failure.
 *
 * API: tprov_start -> tprov_control / tprov_stat / tprov_http ... -> tprov_stop.
 */
#ifndef IDEMQ_TPROV_H
#define IDEMQ_TPROV_H

#include <stddef.h>
#include <sys/types.h>

struct tprov {
    pid_t pid;
    int port;
    char url[96]; /* "http://127.0.0.1:PORT" (https with --tls-cert) */
};

/*
 * Starts the provider with extra arguments (NULL-terminated list or NULL).
 * It listens on port 0 (any free port) unless IDEMQ_TEST_PROVIDER_PORT is
 * set: then on that port plus a counter per start in this process (pick
 * from 18721-18760 on the shared machine). Fills p; ck_aborts on failure.
 */
void tprov_start(struct tprov *p, const char *const *args);

/* Stops it (SIGTERM, then SIGKILL after 5 s). Harmless on a stopped one. */
void tprov_stop(struct tprov *p);

/* POSTs a JSON object to /_control (e.g. {"fault":"status=503","count":2}). */
void tprov_control(struct tprov *p, const char *json);

/* GET /_stats?key=KEY and returns the integer field (e.g. "key_charges",
 * "charges", "requests"). */
long tprov_stat(struct tprov *p, const char *key, const char *field);

/*
 * One HTTP request with libcurl: method, p->url + path, optional body and
 * extra header lines (NULL-terminated, e.g. "Idempotency-Key: k"). The
 * answer body goes to out (cut to outlen). Returns the HTTP status, 0 when
 * the connection closed without an answer, -1 on other errors.
 */
int tprov_http(struct tprov *p, const char *method, const char *path, const char *body,
               const char *const *headers, char *out, size_t outlen);

#endif
