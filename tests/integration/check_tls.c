/*
 * Integration tests of TLS to both servers, against the TLS-enabled pair
 * that `IDEMQ_TLS=1 scripts/services start` runs (scripts/test starts it and
 * sources its env file before this program: the plain URL and DSN of that
 * pair set up each test; IDEMQ_AMQPS_URL, IDEMQ_PG_TLS_DSN and the
 * IDEMQ_TLS_* certificate paths are what idemq uses).
 *   1. consume over amqps with peer and hostname verification and a client
 *      certificate, with PostgreSQL over sslmode=verify-full;
 *   2. refuse a broker whose certificate does not verify (unknown CA, or a
 *      name the certificate does not carry): clear error, exit code 4;
 *   3. refuse a PostgreSQL server that does not verify (exit 4), and name
 *      the switch when verification is off.
 */
#include <check.h>

#include "check_run.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "itest.h"

#define EFFECTS_FOR "SELECT count(*) FROM idemq_test.effects WHERE key = $1"

static const char *need(const char *var)
{
    const char *v = getenv(var);
    ck_assert_msg(v && *v, "%s is not set: scripts/test starts the TLS pair with "
                           "IDEMQ_TLS=1 scripts/services start and sources its env file",
                  var);
    return v;
}

/* The broker group lines for TLS with the given CA and the client pair. */
static void tls_conf(char *buf, size_t len, const char *ca, bool client_cert, const char *verify)
{
    snprintf(buf, len,
             "connect_timeout_ms = 3000; tls: { ca_file = \"%s\"; cert_file = \"%s\"; "
             "key_file = \"%s\"; verify = \"%s\"; };",
             ca, client_cert ? need("IDEMQ_TLS_CERT_FILE") : "",
             client_cert ? need("IDEMQ_TLS_KEY_FILE") : "", verify);
}

/* Runs `idemq ARGS -c cfg` with IDEMQ_AMQP_URL=url and IDEMQ_PG_DSN=dsn;
 * output into out; returns the exit code. */
static int run_with(struct itest *t, const char *args, const char *url, const char *dsn,
                    char *out, size_t len)
{
    int rc;
    setenv("IDEMQ_AMQP_URL", url, 1);
    setenv("IDEMQ_PG_DSN", dsn, 1);
    rc = itest_idemq(t, args, out, len);
    return rc;
}

/* A second throwaway CA that signed nothing the servers use. */
static const char *other_ca(void)
{
    static char path[128];
    char cmd[512];
    snprintf(path, sizeof path, "/tmp/idemq-check-tls-%d-ca.pem", (int)getpid());
    snprintf(cmd, sizeof cmd,
             "openssl req -x509 -new -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes "
             "-keyout /tmp/idemq-check-tls-%d-ca.key -out %s -days 1 -subj '/CN=not the CA' "
             ">/dev/null 2>&1",
             (int)getpid(), path);
    ck_assert_int_eq(system(cmd), 0);
    return path;
}

static void drop_other_ca(void)
{
    char p[128];
    snprintf(p, sizeof p, "/tmp/idemq-check-tls-%d-ca.pem", (int)getpid());
    unlink(p);
    snprintf(p, sizeof p, "/tmp/idemq-check-tls-%d-ca.key", (int)getpid());
    unlink(p);
}

/* 1. amqps with verification and a client certificate, PostgreSQL with
 * verify-full and a client certificate: jobs are applied. */
START_TEST(test_consume_over_tls)
{
    struct itest t;
    char broker[1024], key[128], out[8192];
    const char *bodies[3];
    char bufs[3][256];

    tls_conf(broker, sizeof broker, need("IDEMQ_TLS_CA_FILE"), true, "full");
    itest_broker_conf = broker;
    itest_setup(&t, "tls", "idemq_test.record", "", "");
    itest_broker_conf = NULL;
    for (int i = 0; i < 3; i++) {
        snprintf(key, sizeof key, "%s:%d", t.name, i);
        snprintf(bufs[i], sizeof bufs[i], "{\"job_id\":\"%s\"}", key);
        bodies[i] = bufs[i];
    }
    itest_publish(&t, bodies, 3);
    ck_assert_int_eq(run_with(&t, "run --until-idle 2", need("IDEMQ_AMQPS_URL"),
                              need("IDEMQ_PG_TLS_DSN"), out, sizeof out),
                     0);
    ck_assert_msg(strstr(out, "stopped: received 3 (") && strstr(out, "applied 3,"), "%s", out);
    for (int i = 0; i < 3; i++) {
        snprintf(key, sizeof key, "%s:%d", t.name, i);
        ck_assert_int_eq(itest_long(&t, EFFECTS_FOR, key), 1);
    }
    ck_assert_int_eq(itest_queue_ready(&t, t.name), 0);
    /* the ledger session really was TLS: PostgreSQL says so for a session
     * opened with the same DSN (the server requires a client certificate on
     * TLS connections, and verify-full checked the server) */
    {
        PGconn *db = PQconnectdb(need("IDEMQ_PG_TLS_DSN"));
        PGresult *r;
        ck_assert_msg(PQstatus(db) == CONNECTION_OK, "%s", PQerrorMessage(db));
        r = PQexec(db, "SELECT ssl, client_dn FROM pg_stat_ssl WHERE pid = pg_backend_pid()");
        ck_assert_int_eq(PQresultStatus(r), PGRES_TUPLES_OK);
        ck_assert_str_eq(PQgetvalue(r, 0, 0), "t");
        ck_assert_msg(strstr(PQgetvalue(r, 0, 1), "CN=idemq") != NULL, "%s",
                      PQgetvalue(r, 0, 1));
        PQclear(r);
        PQfinish(db);
    }
    itest_teardown(&t);
}
END_TEST

/* 2. A broker certificate that does not verify is refused at start-up with
 * exit code 4 and a message that says why; nothing is consumed. */
START_TEST(test_refuse_unverified_broker)
{
    struct itest t;
    char broker[1024], out[8192], url[512], key[128], b[256];
    const char *bodies[1] = {b};
    const char *ca = other_ca();

    tls_conf(broker, sizeof broker, ca, true, "full");
    itest_broker_conf = broker;
    itest_setup(&t, "tlsbad", "idemq_test.record", "", "");
    itest_broker_conf = NULL;
    snprintf(key, sizeof key, "%s:1", t.name);
    snprintf(b, sizeof b, "{\"job_id\":\"%s\"}", key);
    itest_publish(&t, bodies, 1);

    /* unknown CA */
    ck_assert_int_eq(run_with(&t, "run --until-idle 1", need("IDEMQ_AMQPS_URL"),
                              need("IDEMQ_PG_DSN"), out, sizeof out),
                     4);
    ck_assert_msg(strstr(out, "SSL peer cert verification failed") &&
                      strstr(out, "does not chain to a CA in broker.tls.ca_file"),
                  "%s", out);

    /* the right CA, but the URL names 127.0.0.1: the certificate is for
     * DNS:localhost and IP addresses are not matched */
    tls_conf(broker, sizeof broker, need("IDEMQ_TLS_CA_FILE"), true, "full");
    itest_broker_conf = broker;
    itest_write_config(&t, t.cfg_path, t.name, "idemq_test.record", "", "");
    itest_broker_conf = NULL;
    {
        const char *amqps = need("IDEMQ_AMQPS_URL");
        const char *h = strstr(amqps, "@localhost:");
        ck_assert_ptr_nonnull(h);
        snprintf(url, sizeof url, "%.*s@127.0.0.1:%s", (int)(h - amqps), amqps, h + 11);
    }
    ck_assert_int_eq(run_with(&t, "run --until-idle 1", url, need("IDEMQ_PG_DSN"), out,
                              sizeof out),
                     4);
    ck_assert_msg(strstr(out, "SSL hostname verification failed") &&
                      strstr(out, "IP addresses are not matched"),
                  "%s", out);

    /* no client certificate: the broker refuses it, and the message says so */
    tls_conf(broker, sizeof broker, need("IDEMQ_TLS_CA_FILE"), false, "full");
    itest_broker_conf = broker;
    itest_write_config(&t, t.cfg_path, t.name, "idemq_test.record", "", "");
    itest_broker_conf = NULL;
    ck_assert_int_eq(run_with(&t, "run --until-idle 1", need("IDEMQ_AMQPS_URL"),
                              need("IDEMQ_PG_DSN"), out, sizeof out),
                     4);
    /* (OpenSSL's "tlsv13 alert certificate required" comes along when the
     * alert arrives before the connection closes; the hint always does) */
    ck_assert_msg(strstr(out, "login: a SSL error occurred") &&
                      strstr(out, "if the broker requires a client certificate, set "
                                  "broker.tls.cert_file and key_file"),
                  "%s", out);

    /* verification switched off explicitly: it connects, and says loudly
     * that it does not verify */
    tls_conf(broker, sizeof broker, ca, true, "none");
    itest_broker_conf = broker;
    itest_write_config(&t, t.cfg_path, t.name, "idemq_test.record", "", "");
    itest_broker_conf = NULL;
    ck_assert_int_eq(run_with(&t, "run --until-idle 1", need("IDEMQ_AMQPS_URL"),
                              need("IDEMQ_PG_DSN"), out, sizeof out),
                     0);
    ck_assert_msg(strstr(out, "broker.tls.verify = \"none\"") &&
                      strstr(out, "NOT verified"),
                  "%s", out);
    ck_assert_int_eq(itest_long(&t, EFFECTS_FOR, key), 1);
    drop_other_ca();
    itest_teardown(&t);
}
END_TEST

/* 3. PostgreSQL: verify-full refuses a server certificate of another CA and
 * a host name the certificate does not carry (exit 4). */
START_TEST(test_refuse_unverified_database)
{
    struct itest t;
    char broker[1024], out[8192], dsn[1024];
    const char *ca = other_ca();
    const char *good = need("IDEMQ_PG_TLS_DSN");

    tls_conf(broker, sizeof broker, need("IDEMQ_TLS_CA_FILE"), true, "full");
    itest_broker_conf = broker;
    itest_setup(&t, "tlspg", "idemq_test.record", "", "");
    itest_broker_conf = NULL;
    ck_assert_int_eq(run_with(&t, "migrate", need("IDEMQ_AMQPS_URL"), good, out, sizeof out), 0);

    snprintf(dsn, sizeof dsn, "%s sslrootcert=%s", good, ca); /* the last one wins */
    ck_assert_int_eq(run_with(&t, "migrate", need("IDEMQ_AMQPS_URL"), dsn, out, sizeof out), 4);
    ck_assert_msg(strstr(out, "certificate verify failed") != NULL, "%s", out);

    snprintf(dsn, sizeof dsn, "%s host=127.0.0.1", good);
    ck_assert_int_eq(run_with(&t, "migrate", need("IDEMQ_AMQPS_URL"), dsn, out, sizeof out), 4);
    ck_assert_msg(strstr(out, "does not match host name") != NULL, "%s", out);

    /* and a run over both TLS connections refuses the bad database too */
    ck_assert_int_eq(run_with(&t, "run --until-idle 1", need("IDEMQ_AMQPS_URL"), dsn, out,
                              sizeof out),
                     4);
    drop_other_ca();
    itest_teardown(&t);
}
END_TEST

/* Exports the variables of the TLS pair's env file (lines
 * export NAME='value', as scripts/services writes them), so the plain URL
 * and DSN of that pair replace those of the default pair. */
static void load_env_file(void)
{
    const char *path = getenv("IDEMQ_TLS_ENV_FILE");
    char line[2048];
    FILE *f;
    if (!path || !*path)
        return; /* the tests say what is missing */
    if (!(f = fopen(path, "r"))) {
        fprintf(stderr, "check_tls: cannot read IDEMQ_TLS_ENV_FILE=%s\n", path);
        return;
    }
    while (fgets(line, sizeof line, f)) {
        char *eq, *val, *end;
        if (strncmp(line, "export ", 7) || !(eq = strchr(line, '=')))
            continue;
        *eq = '\0';
        val = eq + 1;
        if (*val == '\'')
            val++;
        end = val + strcspn(val, "'\n");
        *end = '\0';
        setenv(line + 7, val, 1);
    }
    fclose(f);
}

int main(void)
{
    load_env_file();
    Suite *s = suite_create("tls");
    TCase *tc = tcase_create("tls");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, test_consume_over_tls);
    tcase_add_test(tc, test_refuse_unverified_broker);
    tcase_add_test(tc, test_refuse_unverified_database);
    suite_add_tcase(s, tc);
    return check_run(s);
}
