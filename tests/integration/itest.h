/*
 * itest: fixtures for integration tests against the real RabbitMQ and
 * PostgreSQL that scripts/services started (IDEMQ_AMQP_URL, IDEMQ_PG_DSN).
 * Each test gets unique queue, exchange and key names, writes its own
 * config file and runs the real idemq binary as a child process.
 */
#ifndef IDEMQ_ITEST_H
#define IDEMQ_ITEST_H

#include <check.h>
#include <libpq-fe.h>
#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>

#include "broker.h"
#include "broker_admin.h"
#include "conf.h"

struct itest {
    char name[64];   /* unique per test: queue/exchange/key prefix */
    char cfg_path[256];
    struct conf *conf;
    PGconn *db;
};

/* Extra lines for the retry group of configs written from now on (e.g.
 * "base_delay_ms = 200; jitter = \"none\";"), or NULL. */
extern const char *itest_retry_conf;
/* Extra top-level config lines (e.g. a metrics group), or NULL. */
extern const char *itest_extra_conf;

/* Writes a protection key file (32 bytes as hex, fill, fill+1, ...; mode
 * 0600) named after tag into path, for protection.keys. */
void itest_key_file(char *path, size_t len, const char *tag, unsigned char fill);
/* Extra lines inside the broker group (e.g. a tls group), or NULL. */
extern const char *itest_broker_conf;
/* Extra lines inside the log group (e.g. format = "json";), or NULL. */
extern const char *itest_log_conf;

/*
 * Least-privilege mode (IDEMQ_TEST_LEAST_PRIVILEGE=1, scripts/test): the
 * idemq processes a test starts run as a deployment's roles and users
 * (consumer/OPERATIONS.md "Roles and permissions"), not as the owner and
 * the broker's administrator: `idemq run` with the run role
 * (idemq_lp_run) and the run broker user (IDEMQ_TEST_LP_RUN_URL), the
 * operator commands with the operator role (idemq_lp_operator) and user
 * (IDEMQ_TEST_LP_OPERATOR_URL); migrate, declare, publish and the test's
 * own fixtures stay with the owner. itest_setup grants the roles with
 * `idemq migrate --grant/--grant-operator/--grant-app` (which create
 * them) and gives the two broker users (created by scripts/test with
 * `scripts/services ctl add_user`) the permissions `idemq declare
 * --print-permissions` prints for the test's config (topology_permissions,
 * through the management API); configs get topology.verify = "passive".
 */
bool itest_lp(void);
/* In LP mode, a tcase "least_privilege" of tests (NULL-terminated) added
 * to s (run with CK_RUN_CASE=least_privilege); otherwise nothing. */
void itest_lp_tcase(Suite *s, const TTest *const *tests);
/* In LP mode: the broker users' permissions for the inputs of c (a config a
 * test wrote itself; itest_setup does it for its own). */
void itest_lp_permit(const struct conf *c);
/* In LP mode: the run user may also write exchange, one an effect's or an
 * application's idemq.emit names (the outbox relay publishes there, as
 * consumer/OPERATIONS.md "Roles and permissions" says); call it after
 * itest_setup, before the run starts. */
void itest_lp_permit_emit(const char *exchange);
/* "topology: { verify = \"passive\"; };" in LP mode, else "": for configs
 * a test writes itself. */
const char *itest_lp_topology(void);
/* In a child about to exec `idemq ARGS`: IDEMQ_PG_DSN and IDEMQ_AMQP_URL
 * of the role of the command (run, operator, or unchanged for the owner's
 * setup commands); nothing outside LP mode. */
void itest_lp_child_env(const char *command);
/* For a shell command line: "env IDEMQ_PG_DSN='..' IDEMQ_AMQP_URL='..' "
 * for the command, or "" (buf). */
const char *itest_lp_env_prefix(const char *command, char *buf, size_t len);

/* GET url with curl; the body goes to out; returns the HTTP status or -1. */
int itest_http_get(const char *url, char *out, size_t outlen);

/* Timeout multiplier from IDEMQ_TEST_TIMEOUT_MULT (sanitizer builds). */
int itest_ms(int ms);

/* Milliseconds of CLOCK_MONOTONIC: deadlines of the tests' polling loops. */
long long itest_mono_ms(void);

/* A TCP port on 127.0.0.1 that was free a moment ago, below the kernel's
 * ephemeral range, e.g. for metrics.listen (a bind to port 0 would answer an
 * ephemeral port, which a client socket may take before the test binds it). */
int itest_free_port(void);

/*
 * Prepares a test: unique names, migrated ledger, the demo and test effect
 * functions loaded, a config file whose single input uses queue <name> and
 * effect_function `effect` (extra_global/extra_input are libconfig lines
 * added to the consumer group and the input, may be ""), queue declared and
 * empty. Fails the test (ck_abort) on any setup problem.
 */
void itest_setup(struct itest *t, const char *tag, const char *effect, const char *extra_consumer,
                 const char *extra_input);
void itest_teardown(struct itest *t);

/* Publishes bodies to the test input's exchange (confirmed). */
void itest_publish(struct itest *t, const char *const *bodies, int n);
/* Publishes one body to an exchange with a routing key and optional headers
 * (JSON object or NULL) and message_id (or NULL). */
void itest_publish_to(struct itest *t, const char *exchange, const char *rk, const char *body,
                      json_t *headers, const char *message_id);

/* Starts `idemq run -c cfg --until-idle idle_s` with extra environment
 * (NULL-terminated "K=V" list or NULL). Returns the pid. */
pid_t itest_spawn(struct itest *t, const char *cfg_path, int idle_s, const char *const *env);

/* Waits for pid up to ms; returns the raw wait status, or -1 on timeout
 * (the child is then killed). */
int itest_wait(pid_t pid, int ms);

/* Runs idemq to idleness and asserts exit code 0. */
void itest_run_until_idle(struct itest *t, int idle_s);

/* First column of the first row of a query as a long (params: text). */
long itest_long(struct itest *t, const char *sql, const char *p1);
/* Same, as text copied into buf. */
char *itest_text(struct itest *t, const char *sql, const char *p1, char *buf, size_t len);

/* Ready messages in a queue (passive declare). */
long itest_queue_ready(struct itest *t, const char *queue);

/* Writes a config file at path like the test's own, with another queue. */
void itest_write_config(struct itest *t, const char *path, const char *queue,
                        const char *effect, const char *extra_consumer, const char *extra_input);

/* Deletes an input's queues and exchanges (work, delay, dead-letter). */
void itest_delete_topology(struct itest *t, const struct conf_input *in);

/* Runs SQL (no result) on the test database; aborts the test on error. */
void itest_sql(struct itest *t, const char *sql);

/* Reconnects the test's database session (after a PostgreSQL restart). */
void itest_reconnect_db(struct itest *t);

/* Runs scripts/services WHAT (e.g. "pg-stop"); returns system()'s status. */
int itest_services(const char *what);

/* Consumers on a queue (passive declare). */
long itest_queue_consumers(struct itest *t, const char *queue);

/* Runs `idemq ARGS -c <test config>`, capturing stdout+stderr into out;
 * returns the exit code. */
int itest_idemq(struct itest *t, const char *args, char *out, size_t outlen);

/* Starts `idemq run -c cfg --until-idle idle_s` like itest_spawn, with
 * stdout and stderr written to log_path. */
pid_t itest_spawn_log(const char *cfg_path, int idle_s, const char *const *env,
                      const char *log_path);

/* Lines of file path that contain needle (0 if the file is missing). */
int itest_count_lines(const char *path, const char *needle);

/* A raw AMQP publisher (librabbitmq-c directly, not idemq's adapter), for
 * hostile messages idemq itself would never build: any properties, any
 * header table, any routing key bytes. Publishes are confirmed. */
struct itest_raw;
struct itest_raw *itest_raw_open(void);
void itest_raw_publish(struct itest_raw *r, const char *exchange, const void *rk, size_t rklen,
                       const void *body, size_t len,
                       const void *props /* amqp_basic_properties_t */);
void itest_raw_close(struct itest_raw *r);

/* Sends sig to every process of the test PostgreSQL (postmaster and
 * backends), found from $IDEMQ_STATE_DIR/pg-dir. Returns how many. */
int itest_pg_signal(int sig);

#endif
