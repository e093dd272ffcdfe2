/* Unit tests of config/conf: data-driven good/bad files, defaults,
 * environment overrides, redaction, the sample config. */
#include <check.h>

#include "check_run.h"
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "conf.h"
#include "topology.h"

#define CASES IDEMQ_SOURCE_DIR "/tests/unit/conf"

static char *read_all(const char *path)
{
    FILE *f = fopen(path, "rb");
    char *buf;
    long n;
    if (!f)
        return NULL;
    fseek(f, 0, SEEK_END);
    n = ftell(f);
    fseek(f, 0, SEEK_SET);
    buf = calloc(1, (size_t)n + 1);
    if (buf && fread(buf, 1, (size_t)n, f) != (size_t)n) {
        free(buf);
        buf = NULL;
    }
    fclose(f);
    return buf;
}

START_TEST(test_case_files)
{
    DIR *d = opendir(CASES);
    struct dirent *de;
    int n = 0;

    unsetenv("IDEMQ_AMQP_URL");
    unsetenv("IDEMQ_PG_DSN");
    ck_assert_ptr_nonnull(d);
    while ((de = readdir(d))) {
        char path[1024], err[1024] = "", expect[512];
        char *text, *nl;
        struct conf *c = NULL;
        idemq_err_t rc;

        if (!strstr(de->d_name, ".cfg"))
            continue;
        snprintf(path, sizeof path, "%s/%s", CASES, de->d_name);
        text = read_all(path);
        ck_assert_ptr_nonnull(text);
        ck_assert_msg(strncmp(text, "# expect: ", 10) == 0, "%s lacks '# expect:'", path);
        snprintf(expect, sizeof expect, "%s", text + 10);
        if ((nl = strchr(expect, '\n')))
            *nl = '\0';
        free(text);
        rc = conf_load(path, &c, err, sizeof err);
        if (strcmp(expect, "ok") == 0) {
            ck_assert_msg(rc == IDEMQ_OK, "%s: expected ok, got: %s", de->d_name, err);
            ck_assert_ptr_nonnull(c);
        } else {
            ck_assert_msg(rc == IDEMQ_ERR_CONFIG, "%s: expected an error", de->d_name);
            ck_assert_ptr_null(c);
            ck_assert_msg(strstr(err, expect) != NULL, "%s: error '%s' lacks '%s'", de->d_name,
                          err, expect);
        }
        conf_free(c);
        n++;
    }
    closedir(d);
    ck_assert_int_ge(n, 10);
}
END_TEST

START_TEST(test_defaults_and_derived)
{
    struct conf *c;
    char err[512];
    unsetenv("IDEMQ_AMQP_URL");
    unsetenv("IDEMQ_PG_DSN");
    ck_assert_int_eq(conf_load(CASES "/good_minimal.cfg", &c, err, sizeof err), IDEMQ_OK);
    ck_assert_int_eq(c->heartbeat, 30);
    ck_assert_int_eq(c->prefetch, 1000);
    ck_assert_int_eq(c->workers, 1);
    ck_assert_int_eq(c->urls.n, 1);
    ck_assert_int_eq(c->inputs[0].max_body_bytes, 262144);
    ck_assert_int_eq(c->inputs[0].key_kind, CONF_KEY_JSON);
    ck_assert_str_eq(c->inputs[0].key_name, "job_id");
    ck_assert_str_eq(c->inputs[0].queue_type, "classic");
    ck_assert_str_eq(c->inputs[0].effect_signature, "public.apply_payout(text,jsonb,jsonb)");
    ck_assert_ptr_nonnull(strchr(c->consumer_id, ':'));
    /* operations: safe defaults */
    ck_assert_str_eq(c->tls_ca_file, "/etc/ssl/certs/ca-certificates.crt");
    ck_assert(!c->tls_verify_off);
    ck_assert(!c->topology_passive);
    ck_assert_str_eq(c->log_format, "text");
    ck_assert_int_eq(c->live_stall_s, 60);
    ck_assert_int_eq(c->inputs[0].delivery_limit, 100);
    conf_free(c);

    ck_assert_int_eq(conf_load(CASES "/good_ops.cfg", &c, err, sizeof err), IDEMQ_OK);
    ck_assert(c->tls_verify_off);
    ck_assert(c->topology_passive);
    ck_assert_str_eq(c->tls_key_file, "/x/c.key");
    ck_assert_int_eq(c->live_stall_s, 3);
    ck_assert_int_eq(c->inputs[0].delivery_limit, 10);
    /* the ledger's windows (ledger/README.md "Retention") */
    ck_assert(c->dedup_window_days == 400.0);
    ck_assert(c->history_hot_days == 90.0);
    ck_assert(c->history_retention_days == 400.0);
    ck_assert_str_eq(c->partition_interval, "1 day");
    ck_assert(c->partition_interval_s == 86400.0);
    ck_assert_int_eq(c->maintenance, 1);
    conf_free(c);

    ck_assert_int_eq(conf_load(CASES "/good_ledger.cfg", &c, err, sizeof err), IDEMQ_OK);
    ck_assert(c->dedup_window_days > 0.0034 && c->dedup_window_days < 0.0036);
    ck_assert(c->partition_interval_s == 60.0);
    ck_assert_int_eq(c->maintenance, 0);
    conf_free(c);

    ck_assert_int_eq(conf_load(CASES "/good_full.cfg", &c, err, sizeof err), IDEMQ_OK);
    ck_assert_int_eq(c->urls.n, 2);
    ck_assert_int_eq(c->n_inputs, 2);
    ck_assert_int_eq(c->inputs[0].key_kind, CONF_KEY_HEADER);
    ck_assert_str_eq(c->inputs[0].key_name, "idempotency-key");
    ck_assert_int_eq(c->inputs[1].key_kind, CONF_KEY_MESSAGE_ID);
    ck_assert_str_eq(c->consumer_id, "replica-a");
    ck_assert_int_eq(c->max_attempts, 3);
    conf_free(c);
}
END_TEST

START_TEST(test_parse_interval)
{
    ck_assert(conf_parse_interval("1 day") == 86400.0);
    ck_assert(conf_parse_interval("5 minutes") == 300.0);
    ck_assert(conf_parse_interval("10 seconds") == 10.0);
    ck_assert(conf_parse_interval("2 hours") == 7200.0);
    ck_assert(conf_parse_interval("1day") < 0);
    ck_assert(conf_parse_interval("0 days") < 0);
    ck_assert(conf_parse_interval("-1 days") < 0);
    ck_assert(conf_parse_interval("1 week") < 0);
    ck_assert(conf_parse_interval("") < 0);
}
END_TEST

START_TEST(test_env_overrides)
{
    struct conf *c;
    char err[512];
    setenv("IDEMQ_AMQP_URL", "amqp://a:b@127.0.0.1:1/, amqp://a:b@127.0.0.1:2/", 1);
    setenv("IDEMQ_PG_DSN", "host=127.0.0.1 port=9 dbname=x", 1);
    ck_assert_int_eq(conf_load(CASES "/good_full.cfg", &c, err, sizeof err), IDEMQ_OK);
    ck_assert_int_eq(c->urls.n, 2);
    ck_assert_str_eq(c->urls.v[1], "amqp://a:b@127.0.0.1:2/");
    ck_assert_str_eq(c->dsn, "host=127.0.0.1 port=9 dbname=x");
    conf_free(c);
    setenv("IDEMQ_AMQP_URL", "tcp://nope", 1);
    ck_assert_int_eq(conf_load(CASES "/good_full.cfg", &c, err, sizeof err), IDEMQ_ERR_CONFIG);
    ck_assert_ptr_nonnull(strstr(err, "IDEMQ_AMQP_URL"));
    unsetenv("IDEMQ_AMQP_URL");
    unsetenv("IDEMQ_PG_DSN");
}
END_TEST

START_TEST(test_redact)
{
    char buf[256];
    ck_assert_str_eq(conf_redact("amqp://guest:secret@h:5672/v", buf, sizeof buf),
                     "amqp://guest:***@h:5672/v");
    ck_assert_str_eq(conf_redact("amqp://h:5672/v", buf, sizeof buf), "amqp://h:5672/v");
    ck_assert_str_eq(conf_redact("postgresql://u:pw@h/db", buf, sizeof buf),
                     "postgresql://u:***@h/db");
    ck_assert_str_eq(conf_redact("host=h password=abc dbname=d", buf, sizeof buf),
                     "host=h password=*** dbname=d");
    ck_assert_str_eq(conf_redact("password = 'a b\\' c' host=h", buf, sizeof buf),
                     "password=*** host=h");
    ck_assert_str_eq(conf_redact("host=h mypassword=x", buf, sizeof buf), "host=h mypassword=x");
    ck_assert_str_eq(conf_redact("host=h sslpassword=k3y sslmode=verify-full", buf, sizeof buf),
                     "host=h sslpassword=*** sslmode=verify-full");
    ck_assert_str_eq(conf_redact("postgresql://h/db?sslmode=require&password=pw&x=1", buf,
                                 sizeof buf),
                     "postgresql://h/db?sslmode=require&password=***&x=1");
    ck_assert_str_eq(conf_redact("postgresql://u@h/db?sslpassword=pw", buf, sizeof buf),
                     "postgresql://u@h/db?sslpassword=***");
}
END_TEST

/* password= after any blank libpq accepts (tab, newline, ...), a
 * "://" inside a key=value value, and provider.url with user:password in
 * check-config and in its error message. */
START_TEST(test_redact_blanks_and_provider_url)
{
    char buf[256], err[1024] = "";
    struct conf *c = NULL;
    char *out = NULL;
    size_t len = 0;
    FILE *f;

    ck_assert_str_eq(conf_redact("host=h\tpassword=abc dbname=d", buf, sizeof buf),
                     "host=h\tpassword=*** dbname=d");
    ck_assert_str_eq(conf_redact("host=h\npassword\t=\tabc\ndbname=d", buf, sizeof buf),
                     "host=h\npassword=***\ndbname=d");
    ck_assert_str_eq(conf_redact("host=h\r\n\v\fsslpassword=k dbname=d", buf, sizeof buf),
                     "host=h\r\n\v\fsslpassword=*** dbname=d");
    ck_assert_str_eq(conf_redact("  postgresql://u:pw@h/db", buf, sizeof buf),
                     "  postgresql://u:***@h/db");
    ck_assert_str_eq(conf_redact("postgres://u:pw@h1:5432,h2/db", buf, sizeof buf),
                     "postgres://u:***@h1:5432,h2/db");
    /* a key=value DSN whose values happen to hold "://" is still a DSN */
    ck_assert_str_eq(conf_redact("sslrootcert=file://x password=pw", buf, sizeof buf),
                     "sslrootcert=file://x password=***");
    ck_assert_str_eq(conf_redact("password=a://b@c host=h", buf, sizeof buf),
                     "password=*** host=h");
    ck_assert_str_eq(conf_redact("https://user:pw@api.example.com/v1", buf, sizeof buf),
                     "https://user:***@api.example.com/v1");

    unsetenv("IDEMQ_AMQP_URL");
    unsetenv("IDEMQ_PG_DSN");
    ck_assert_int_eq(conf_load_string("inputs = ( { name = \"a\"; queue = \"q\"; provider: "
                                      "{ url = \"ftp://u:hunter2@x\"; }; } );",
                                      &c, err, sizeof err),
                     IDEMQ_ERR_CONFIG);
    ck_assert_msg(strstr(err, "hunter2") == NULL, "%s", err);
    ck_assert_msg(strstr(err, "ftp://u:***@x") != NULL, "%s", err);
    ck_assert_int_eq(conf_load_string("inputs = ( { name = \"a\"; queue = \"q\"; provider: "
                                      "{ url = \"https://u:hunter2@api.example.com\"; }; } );",
                                      &c, err, sizeof err),
                     IDEMQ_OK);
    ck_assert_str_eq(c->inputs[0].provider.url, "https://u:hunter2@api.example.com");
    f = open_memstream(&out, &len);
    conf_print(c, f);
    fclose(f);
    ck_assert_msg(strstr(out, "hunter2") == NULL, "%s", out);
    ck_assert_ptr_nonnull(strstr(out, "url = \"https://u:***@api.example.com\";"));
    free(out);
    conf_free(c);
}
END_TEST

/* No input makes check-config print a secret: each form below holds the
 * secret S3CRET in a sensitive setting; neither the load error, nor the
 * printed configuration, nor a warning about it may show it. */
START_TEST(test_no_secret_printed)
{
    static const char *const forms[] = {
        /* broker.url: user:pass@, a comma list in one string (IDEMQ_AMQP_URL's form),
         * a list, '/' or '@' inside the password, query parameters, no scheme */
        "broker: { url = \"amqp://u:S3CRET@h:5672/%2F\"; };",
        "broker: { url = \"amqp://u:S3CRET@h1/%2F,amqp://v:S3CRET@h2/%2F\"; };",
        "broker: { url = \"amqp://u:S3CRET@h1/%2F, amqps://v:S3CRET@h2/%2F\"; };",
        "broker: { url = [ \"amqp://a:S3CRET@h1/%2F\", \"amqp://b:S3CRET@h2/%2F\" ]; };",
        "broker: { url = \"amqp://u:S3CRET/x@h/%2F\"; };",
        "broker: { url = \"amqp://u:pre@S3CRET@h/%2F\"; };",
        "broker: { url = \"amqps://h/%2F?password=S3CRET\"; };",
        "broker: { url = \"amqp://h/%2F?heartbeat=5&token=S3CRET\"; };",
        "broker: { url = \"amqp://u:S3CRET@h/%2F amqp://v:S3CRET@h2/%2F\"; };",
        "broker: { url = \"u:S3CRET@h/%2F\"; };",
        "broker: { url = \"http://u:S3CRET@h/\"; };",
        "broker: { url = \"amqp://u:S3CRET@h/%2F,\"; };",
        /* database.dsn: password=, quoted, upper case, URL forms, a misspelt scheme */
        "database: { dsn = \"host=h password=S3CRET dbname=d\"; };",
        "database: { dsn = \"host=h password='S3 CRET' dbname=d\"; };",
        "database: { dsn = \"host=h PASSWORD=S3CRET\"; };",
        "database: { dsn = \"postgresql://u:S3CRET@h/db\"; };",
        "database: { dsn = \"postgres://h/db?password=S3CRET\"; };",
        "database: { dsn = \"postgress://u:S3CRET@h/db\"; };",
        "database: { dsn = \"postgresql:/u:S3CRET@h/db\"; };",
    };
    static const char *const provider_forms[] = {
        "https://u:S3CRET@api.example.com/v1",
        "https://api.example.com/v1?api_key=S3CRET",
        "https://api.example.com/v1?x=1&access_token=S3CRET",
        "http://u:S3CRET@10.0.0.1/v1",
        "http://u:S3CRET@127.0.0.1/v1",
    };
    const char *input = "inputs = ( { name = \"a\"; queue = \"q\"; "
                        "effect_function = \"public.f\"; } );\n";
    int n = (int)(sizeof forms / sizeof forms[0]);
    int np = (int)(sizeof provider_forms / sizeof provider_forms[0]);

    unsetenv("IDEMQ_AMQP_URL");
    unsetenv("IDEMQ_PG_DSN");
    for (int i = 0; i < n + np; i++) {
        char text[2048], err[2048] = "", warn[1024] = "";
        char *out = NULL;
        size_t len = 0;
        struct conf *c = NULL;
        FILE *f;
        if (i < n)
            snprintf(text, sizeof text, "%s\n%s", forms[i], input);
        else
            snprintf(text, sizeof text,
                     "inputs = ( { name = \"a\"; queue = \"q\"; provider: { url = \"%s\"; }; } );\n",
                     provider_forms[i - n]);
        f = open_memstream(&out, &len);
        if (conf_load_string(text, &c, err, sizeof err) == IDEMQ_OK) {
            conf_print(c, f);
            conf_lint(c, f);
            for (int k = 0; k < c->n_inputs; k++)
                if (conf_input_insecure(&c->inputs[k], warn, sizeof warn))
                    fprintf(f, "%s\n", warn);
        }
        fprintf(f, "%s\n", err);
        fclose(f);
        ck_assert_msg(strstr(out, "S3CRET") == NULL && strstr(out, "S3 CRET") == NULL,
                      "form %d (%s) printed the secret:\n%s", i, text, out);
        free(out);
        conf_free(c);
    }
}
END_TEST

/* check-config's offline checks: each mistake is an error (counted) or a
 * warning, on the line of the setting that causes it. */
START_TEST(test_lint)
{
    static const struct {
        const char *text;   /* the config; inputs[0] is on line 1 unless the text says */
        const char *expect; /* substring of the output */
        int errors;         /* errors conf_lint counts */
    } cases[] = {
        {"broker: {\n url = \"amqp://u:p@h/\";\n};\n", "<string>:2: broker.url: URL 1", 1},
        {"broker: {\n url = \"amqp://u:p@h:5672/%2F\";\n};\n", "", 0},
        {"broker: {\n url = \"amqp://u:p@h\";\n};\n", "", 0},
        {"broker: { vhost = \"v\";\n url = \"amqp://u:p@h/\"; };\n", "", 0},
        {"broker: {\n url = \"amqps://u:p@10.1.2.3:5671/%2F\"; tls: { ca_file = \"/etc/hostname\"; }; };\n",
         "<string>:2: broker.url: URL 1 is amqps:// to the IP address 10.1.2.3", 1},
        {"broker: {\n url = \"amqps://u:p@[::1]:5671/%2F\"; tls: { ca_file = \"/etc/hostname\"; }; };\n",
         "IP address [::1]", 1},
        {"broker: { url = \"amqps://u:p@10.1.2.3:5671/%2F\"; tls: { verify = \"none\"; "
         "ca_file = \"/etc/hostname\"; }; };\n", "", 0},
        {"broker: { url = \"amqps://b.example:5671/%2F\";\n tls: {\n ca_file = \"/nonexistent/ca.pem\"; }; };\n",
         "<string>:3: broker.tls.ca_file: /nonexistent/ca.pem: No such file", 1},
        {"database: {\n dsn = \"postgress://u:p@h/db\";\n};\n",
         "<string>:2: database.dsn: the scheme \"postgress://\"", 1},
        {"database: {\n dsn = \"postgres://u:p@h/db\";\n};\n", "", 0},
        {"database: {\n dsn = \"postgresql:/h/db\";\n};\n", "<string>:2: database.dsn is neither", 1},
        {"console: {\n listen = \"0.0.0.0:9188\";\n};\n",
         "# warning: <string>:2: console.listen 0.0.0.0:9188 is beyond loopback", 0},
        {"console: {\n token_file = \"/nonexistent/token\";\n};\n",
         "<string>:2: console.token_file: /nonexistent/token", 1},
        {"broker: {\n prefetch = 50;\n};\n", "# warning: <string>:2: broker.prefetch (50) is below "
         "consumer.batch_max (100)", 0},
        {"inputs = ( {\n name = \"a\"; queue = \"q\"; effect_function = \"public.f\";\n"
         " emits = true;\n} );\n", "<string>:3: input a: emits = true needs outbox.relay = 1", 1},
        {"outbox: { relay = 1; };\ninputs = ( {\n name = \"a\"; queue = \"q\"; "
         "effect_function = \"public.f\";\n emits = true;\n} );\n", "", 0},
        {"inputs = ( {\n name = \"a\"; queue = \"q\"; effect_function = \"public.f\";\n"
         " key_source = \"header:x-death\";\n} );\n", "<string>:3: input a: key_source \"header:x-death\"", 1},
        {"inputs = ( {\n name = \"a\"; queue = \"q\"; effect_function = \"public.f\";\n"
         " key_source = \"header:X-Idemq-Key\";\n} );\n", "the broker or idemq sets that header", 1},
        {"inputs = ( {\n name = \"a\"; queue = \"q\"; effect_function = \"public.f\";\n"
         " key_source = \"json:job id\";\n} );\n", "<string>:3: input a: key_source \"json:job id\" holds a blank", 1},
        {"inputs = ( {\n name = \"a\"; queue = \"q\"; effect_function = \"public.f\";\n"
         " key_source = \"json:payload.id\";\n} );\n", "# warning: <string>:3: input a: key_source \"json:payload.id\" names a top-level", 0},
        {"inputs = ( {\n name = \"a\"; queue = \"q\"; effect_function = \"public.f\";\n"
         " exchange = \"x\";\n routing_key = \"pay.*\";\n} );\n",
         "# warning: <string>:4: input a: routing_key \"pay.*\" on a direct exchange", 0},
        {"inputs = ( {\n name = \"a\"; queue = \"q\"; effect_function = \"public.f\";\n"
         " exchange = \"x\"; exchange_type = \"fanout\";\n routing_key = \"pay\";\n} );\n",
         "# warning: <string>:4: input a: routing_key \"pay\" is ignored by a fanout", 0},
        {"inputs = ( {\n name = \"a\"; queue = \"q\"; effect_function = \"public.f\";\n"
         " exchange = \"x\"; exchange_type = \"topic\";\n routing_key = \"pay..eu\";\n} );\n",
         "# warning: <string>:4: input a: routing_key \"pay..eu\" has an empty word", 0},
        {"inputs = ( {\n name = \"a\"; queue = \"q\"; effect_function = \"public.f\";\n"
         " routing_key = \"pay\";\n} );\n", "# warning: <string>:3: input a: routing_key \"pay\" binds nothing", 0},
        {"inputs = ( {\n name = \"a\"; queue = \"q\"; effect_function = \"public.f\";\n"
         " delivery_limit = 50;\n} );\n", "# warning: <string>:3: input a: delivery_limit applies to quorum", 0},
        {"inputs = ( {\n name = \"a\"; queue = \"q\"; effect_function = \"public.f\";\n"
         " provider: {\n timeout_ms = 5000; }; } );\n", "# warning: <string>:3: input a: the provider group has no url", 0},
        {"inputs = ( {\n name = \"a\"; queue = \"q\"; provider: {\n url = \"https://api.example\";\n"
         " auth_file = \"/nonexistent/auth\"; }; } );\n", "<string>:4: provider.auth_file: /nonexistent/auth", 1},
    };
    const char *input = "inputs = ( { name = \"a\"; queue = \"q\"; "
                        "effect_function = \"public.f\"; } );\n";

    unsetenv("IDEMQ_AMQP_URL");
    unsetenv("IDEMQ_PG_DSN");
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char text[2048], err[2048] = "", *out = NULL;
        size_t len = 0;
        struct conf *c = NULL;
        FILE *f;
        int errors;
        snprintf(text, sizeof text, "%s%s", cases[i].text,
                 strstr(cases[i].text, "inputs") ? "" : input);
        ck_assert_msg(conf_load_string(text, &c, err, sizeof err) == IDEMQ_OK, "case %zu: %s",
                      i, err);
        f = open_memstream(&out, &len);
        errors = conf_lint(c, f);
        fclose(f);
        ck_assert_msg(errors == cases[i].errors, "case %zu: %d errors, want %d:\n%s", i, errors,
                      cases[i].errors, out);
        if (cases[i].expect[0])
            ck_assert_msg(strstr(out, cases[i].expect) != NULL, "case %zu: '%s' lacks '%s'", i,
                          out, cases[i].expect);
        else
            ck_assert_msg(strstr(out, "broker.url") == NULL && strstr(out, "dsn") == NULL &&
                              strstr(out, "emits") == NULL,
                          "case %zu: unexpected '%s'", i, out);
        free(out);
        conf_free(c);
    }
}
END_TEST

/* A secret file readable by every user is an error, by the group a warning. */
START_TEST(test_lint_secret_file_mode)
{
    char path[] = "/tmp/idemq-lint-XXXXXX", text[1024], err[1024], *out = NULL;
    size_t len = 0;
    struct conf *c;
    FILE *f;
    int fd = mkstemp(path);
    ck_assert_int_ge(fd, 0);
    ck_assert_int_eq(write(fd, "Zq9secret\n", 10), 10);
    close(fd);
    snprintf(text, sizeof text, "console: {\n token_file = \"%s\";\n};\n"
             "inputs = ( { name = \"a\"; queue = \"q\"; effect_function = \"public.f\"; } );\n",
             path);
    unsetenv("IDEMQ_AMQP_URL");
    unsetenv("IDEMQ_PG_DSN");
    ck_assert_msg(conf_load_string(text, &c, err, sizeof err) == IDEMQ_OK, "%s", err);
    for (int round = 0; round < 3; round++) {
        mode_t mode = round == 0 ? 0600 : round == 1 ? 0640 : 0644;
        ck_assert_int_eq(chmod(path, mode), 0);
        out = NULL;
        f = open_memstream(&out, &len);
        ck_assert_int_eq(conf_lint(c, f), round == 2 ? 1 : 0);
        fclose(f);
        if (round == 0)
            ck_assert_msg(strstr(out, "token_file") == NULL, "%s", out);
        else
            ck_assert_msg(strstr(out, round == 1 ? "# warning: <string>:2: console.token_file"
                                                 : "idemq: <string>:2: console.token_file") &&
                              strstr(out, "holds a secret") && strstr(out, "Zq9secret") == NULL,
                          "%s", out);
        free(out);
    }
    conf_free(c);
    unlink(path);
}
END_TEST

/* Every load error names its line; a syntax error explains the syntax. */
START_TEST(test_error_lines)
{
    static const struct {
        const char *text, *expect;
    } cases[] = {
        {"retry: {\n jitter = \"half\";\n};\n", "<string>:2: retry.jitter"},
        {"retry: {\n base_delay_ms = 5000;\n max_delay_ms = 1000;\n};\n", "<string>:2: retry.base_delay_ms"},
        {"retry: {\n park_sqlstates = [ \"bad\" ];\n};\n", "<string>:2: retry.park_sqlstates"},
        {"ledger: {\n partition_interval = \"1 fortnight\";\n};\n", "<string>:2: ledger.partition_interval"},
        {"log: {\n format = \"xml\";\n};\n", "<string>:2: log.format"},
        {"log: {\n level = \"loud\";\n};\n", "<string>:2: log.level"},
        {"topology: {\n verify = \"some\";\n};\n", "<string>:2: topology.verify"},
        {"broker: { tls: {\n verify = \"half\"; }; };\n", "<string>:2: broker.tls.verify"},
        {"metrics: {\n live_stall_s = 1;\n};\n", "<string>:2: metrics.live_stall_s"},
        {"broker: {\n url = \"amqp://h/%2F,,amqp://g/%2F\";\n};\n", "<string>:2: broker.url holds an empty URL"},
        {"broker: {\n url = \"amqp://h/%2F, http://u:pw@g/\";\n};\n", "<string>:2: broker.url: URL 2 must start"},
        {"broker: {\n heartbeat = ;\n};\n", "<string>:2: syntax error"},
        {"broker: {\n url = amqp://h/;\n};\n", "<string>:2: syntax error"},
    };
    const char *input = "inputs = ( { name = \"a\"; queue = \"q\"; "
                        "effect_function = \"public.f\"; } );\n";
    unsetenv("IDEMQ_AMQP_URL");
    unsetenv("IDEMQ_PG_DSN");
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char text[2048], err[2048] = "";
        struct conf *c = NULL;
        snprintf(text, sizeof text, "%s%s", cases[i].text, input);
        ck_assert_msg(conf_load_string(text, &c, err, sizeof err) == IDEMQ_ERR_CONFIG,
                      "case %zu loaded", i);
        ck_assert_msg(strstr(err, cases[i].expect) != NULL, "case %zu: '%s' lacks '%s'", i, err,
                      cases[i].expect);
        ck_assert_msg(strstr(err, "pw") == NULL, "case %zu printed a secret: %s", i, err);
    }
    {
        char err[2048] = "";
        struct conf *c = NULL;
        ck_assert_int_eq(conf_load_string("inputs = (\n { name = \"a\"; }\n { name = \"b\"; }\n);\n",
                                          &c, err, sizeof err),
                         IDEMQ_ERR_CONFIG);
        ck_assert_msg(strstr(err, "<string>:3: syntax error") && strstr(err, "missing ','"),
                      "%s", err);
    }
    {   /* a comma list in broker.url is split into its URLs */
        char err[1024] = "";
        struct conf *c = NULL;
        ck_assert_msg(conf_load_string("broker: { url = \"amqp://a@h1/%2F , amqp://b@h2/v\"; };\n"
                                       "inputs = ( { name = \"a\"; queue = \"q\"; "
                                       "effect_function = \"public.f\"; } );\n",
                                       &c, err, sizeof err) == IDEMQ_OK, "%s", err);
        ck_assert_int_eq(c->urls.n, 2);
        ck_assert_str_eq(c->urls.v[0], "amqp://a@h1/%2F");
        ck_assert_str_eq(c->urls.v[1], "amqp://b@h2/v");
        conf_free(c);
    }
}
END_TEST

/* metrics.listen: one validation for check-config and run. A numeric IPv4
 * address and a port 1..65535 are served; ":PORT", "PORT", a host name
 * ("localhost:PORT") or a bad port are refused (exit 3, naming the setting)
 * by check-config and by run alike, never a run without probes. */
START_TEST(test_metrics_listen)
{
    static const char *const good[] = {"127.0.0.1:9187", "0.0.0.0:1", "10.1.2.3:65535"};
    static const char *const bad[] = {":9187", "9187", "localhost:9187", "127.0.0.1",
                                      "127.0.0.1:0", "127.0.0.1:65536", "127.0.0.1:9x",
                                      "127.0.0.1:", "[::1]:9187", "127.0.0.1: 9187"};
    char text[512], err[1024], ip[16];
    int port;
    struct conf *c;

    unsetenv("IDEMQ_AMQP_URL");
    unsetenv("IDEMQ_PG_DSN");
    for (size_t i = 0; i < sizeof good / sizeof good[0]; i++) {
        snprintf(text, sizeof text,
                 "metrics: { listen = \"%s\"; };\ninputs = ( { name = \"a\"; queue = \"q\"; "
                 "effect_function = \"public.f\"; } );",
                 good[i]);
        c = NULL;
        ck_assert_msg(conf_load_string(text, &c, err, sizeof err) == IDEMQ_OK, "%s: %s", good[i],
                      err);
        ck_assert(conf_listen_parse(good[i], ip, &port));
        ck_assert_int_eq(port, atoi(strrchr(good[i], ':') + 1));
        conf_free(c);
    }
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        snprintf(text, sizeof text,
                 "metrics: { listen = \"%s\"; };\ninputs = ( { name = \"a\"; queue = \"q\"; "
                 "effect_function = \"public.f\"; } );",
                 bad[i]);
        c = NULL;
        err[0] = '\0';
        ck_assert_msg(conf_load_string(text, &c, err, sizeof err) == IDEMQ_ERR_CONFIG,
                      "metrics.listen \"%s\" was accepted", bad[i]);
        ck_assert_ptr_null(c);
        ck_assert_msg(strstr(err, "metrics.listen") != NULL, "%s", err);
        ck_assert(!conf_listen_parse(bad[i], ip, &port));
    }
}
END_TEST

/* console: off by default, the same listen rule, never the
 * metrics address; the sample config has it on loopback. */
START_TEST(test_console_listen)
{
    static const char *const cases[][2] = {
        {"console: { listen = \"127.0.0.1:9188\"; token_file = \"/t\"; };", NULL},
        {"console: { listen = \"localhost:9188\"; };", "console.listen"},
        {"console: { listen = \"127.0.0.1:0\"; };", "console.listen"},
        {"console: { statement_timeout_ms = 10; };", "console.statement_timeout_ms"},
        {"console: { colour = 1; };", "colour"},
        {"metrics: { listen = \"127.0.0.1:9187\"; };\n"
         "console: { listen = \"127.0.0.1:9187\"; };", "must differ"},
    };
    char text[512], err[1024];
    struct conf *c = NULL;

    unsetenv("IDEMQ_AMQP_URL");
    unsetenv("IDEMQ_PG_DSN");
    ck_assert(conf_load_string("inputs = ( { name = \"a\"; queue = \"q\"; effect_function = "
                               "\"public.f\"; } );", &c, err, sizeof err) == IDEMQ_OK);
    ck_assert_str_eq(c->console_listen, "");
    ck_assert_str_eq(c->console_token_file, "");
    ck_assert_int_eq(c->console_statement_timeout_ms, 5000);
    conf_free(c);
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        snprintf(text, sizeof text,
                 "%s\ninputs = ( { name = \"a\"; queue = \"q\"; effect_function = "
                 "\"public.f\"; } );", cases[i][0]);
        c = NULL;
        err[0] = '\0';
        if (!cases[i][1]) {
            ck_assert_msg(conf_load_string(text, &c, err, sizeof err) == IDEMQ_OK, "%s", err);
            ck_assert_str_eq(c->console_listen, "127.0.0.1:9188");
            ck_assert_str_eq(c->console_token_file, "/t");
            conf_free(c);
        } else {
            ck_assert_msg(conf_load_string(text, &c, err, sizeof err) == IDEMQ_ERR_CONFIG,
                          "accepted: %s", cases[i][0]);
            ck_assert_msg(strstr(err, cases[i][1]) != NULL, "%s", err);
        }
    }
    ck_assert(conf_load(IDEMQ_SOURCE_DIR "/config/idemq.cfg", &c, err, sizeof err) == IDEMQ_OK);
    ck_assert_str_eq(c->console_listen, "127.0.0.1:9188");
    conf_free(c);
}
END_TEST

/* The binary agrees: check-config and run both exit 3 on ":PORT", naming
 * metrics.listen (run before it connects anywhere). */
START_TEST(test_metrics_listen_run)
{
    char dir[] = "/tmp/idemq_conf_XXXXXX", cfg[256], cmd[1024], out[4096];
    const char *const cmds[] = {"check-config", "run"};
    FILE *f;

    ck_assert_ptr_nonnull(mkdtemp(dir));
    snprintf(cfg, sizeof cfg, "%s/listen.cfg", dir);
    f = fopen(cfg, "w");
    ck_assert_ptr_nonnull(f);
    fprintf(f, "broker: { url = \"amqp://guest:guest@127.0.0.1:1/\"; };\n"
               "database: { dsn = \"host=127.0.0.1 port=1 dbname=x\"; };\n"
               "metrics: { listen = \":9187\"; };\n"
               "inputs = ( { name = \"a\"; queue = \"q\"; effect_function = \"public.f\"; } );\n");
    fclose(f);
    for (size_t i = 0; i < 2; i++) {
        size_t n;
        int st;
        FILE *p;
        snprintf(cmd, sizeof cmd,
                 "timeout 20 env -u IDEMQ_AMQP_URL -u IDEMQ_PG_DSN -u AWS_ACCESS_KEY_ID "
                 "-u AWS_PROFILE AWS_SECRET_ACCESS_KEY=sekrit-4711 "
                 "AWS_SHARED_CREDENTIALS_FILE=%s/none %s %s -c %s 2>&1",
                 dir, IDEMQ_BINARY, cmds[i], cfg);
        p = popen(cmd, "r");
        ck_assert_ptr_nonnull(p);
        n = fread(out, 1, sizeof out - 1, p);
        out[n] = '\0';
        st = pclose(p);
        ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 3, "%s: status %d: %s", cmds[i], st,
                      out);
        ck_assert_msg(strstr(out, "metrics.listen") != NULL, "%s: %s", cmds[i], out);
    }
    unlink(cfg);
    rmdir(dir);
}
END_TEST

/* The binary: check-config accepts an sqs input and prints it back; run
 * without AWS credentials refuses to start (exit 3, naming the input and
 * what is missing) before it connects anywhere, and never prints the
 * secret it did find. */
START_TEST(test_sqs_run_refused)
{
    char dir[] = "/tmp/idemq_conf_XXXXXX", cfg[256], cmd[1024], out[8192];
    const char *const cmds[] = {"check-config", "run"};
    const int want[] = {0, 3};
    FILE *f;

    ck_assert_ptr_nonnull(mkdtemp(dir));
    snprintf(cfg, sizeof cfg, "%s/sqs.cfg", dir);
    f = fopen(cfg, "w");
    ck_assert_ptr_nonnull(f);
    fprintf(f, "broker: { url = \"amqp://guest:guest@127.0.0.1:1/%%2F\"; };\n"
               "database: { dsn = \"host=127.0.0.1 port=1 dbname=x\"; };\n"
               "inputs = ( { name = \"payouts\"; transport = \"sqs\"; queue = \"payouts\"; "
               "effect_function = \"public.f\"; key_source = \"json:id\"; queue_url = "
               "\"https://sqs.eu-west-1.amazonaws.com/123456789012/payouts\"; region = "
               "\"eu-west-1\"; } );\n");
    fclose(f);
    for (size_t i = 0; i < 2; i++) {
        size_t n;
        int st;
        FILE *p;
        snprintf(cmd, sizeof cmd,
                 "timeout 20 env -u IDEMQ_AMQP_URL -u IDEMQ_PG_DSN -u AWS_ACCESS_KEY_ID "
                 "-u AWS_PROFILE AWS_SECRET_ACCESS_KEY=sekrit-4711 "
                 "AWS_SHARED_CREDENTIALS_FILE=%s/none %s %s -c %s 2>&1",
                 dir, IDEMQ_BINARY, cmds[i], cfg);
        p = popen(cmd, "r");
        ck_assert_ptr_nonnull(p);
        n = fread(out, 1, sizeof out - 1, p);
        out[n] = '\0';
        st = pclose(p);
        ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == want[i], "%s: status %d: %s", cmds[i],
                      st, out);
        ck_assert_msg(strstr(out, i == 0 ? "region = \"eu-west-1\""
                                         : "input payouts: no AWS credentials") != NULL,
                      "%s: %s", cmds[i], out);
        ck_assert_msg(strstr(out, "sekrit") == NULL, "%s printed the secret: %s", cmds[i], out);
    }
    unlink(cfg);
    rmdir(dir);
}
END_TEST

/* check-config output hides secrets and is itself a valid config. */
START_TEST(test_print_roundtrip)
{
    struct conf *c, *c2;
    char err[512];
    char *out = NULL;
    size_t len = 0;
    FILE *f;
    unsetenv("IDEMQ_AMQP_URL");
    unsetenv("IDEMQ_PG_DSN");
    ck_assert_int_eq(conf_load(CASES "/good_full.cfg", &c, err, sizeof err), IDEMQ_OK);
    f = open_memstream(&out, &len);
    conf_print(c, f);
    fclose(f);
    ck_assert_ptr_null(strstr(out, "secret"));
    ck_assert_ptr_null(strstr(out, "hunter2"));
    ck_assert_ptr_nonnull(strstr(out, "password=***"));
    ck_assert_int_eq(conf_load_string(out, &c2, err, sizeof err), IDEMQ_OK);
    ck_assert_int_eq(c2->heartbeat, c->heartbeat);
    ck_assert_int_eq(c2->n_inputs, 2);
    ck_assert_str_eq(c2->tls_ca_file, c->tls_ca_file); /* the nested broker.tls group */
    ck_assert_str_eq(c2->inputs[1].effect_function, "ledger.post");
    conf_free(c2);
    conf_free(c);
    free(out);
}
END_TEST

/* Provider inputs: defaults, booleans, an optional effect_function,
 * and a check-config print that is itself a valid config. */
START_TEST(test_provider_settings)
{
    struct conf *c, *c2;
    char err[512];
    char *out = NULL;
    size_t len = 0;
    FILE *f;
    unsetenv("IDEMQ_AMQP_URL");
    unsetenv("IDEMQ_PG_DSN");
    ck_assert_msg(conf_load(CASES "/good_provider.cfg", &c, err, sizeof err) == IDEMQ_OK, "%s", err);
    ck_assert(CONF_INPUT_PROVIDER(&c->inputs[0]));
    ck_assert_ptr_null(c->inputs[0].effect_signature);
    ck_assert_str_eq(c->inputs[0].provider.method, "POST");
    ck_assert_str_eq(c->inputs[0].provider.reference_field, "data.id");
    ck_assert(c->inputs[0].provider.idempotent);
    ck_assert(c->inputs[0].provider.verify_tls);
    ck_assert_int_eq(c->inputs[0].provider.timeout_ms, 10000);
    ck_assert_int_eq(c->inputs[0].provider.max_in_flight, 8);
    ck_assert_int_eq(c->inputs[0].provider.wait_max, 20);
    ck_assert_int_eq(c->inputs[0].provider.reconcile_after_s, 300);
    ck_assert(!c->inputs[1].provider.idempotent);
    ck_assert_str_eq(c->inputs[1].effect_signature, "public.record_payout(text,jsonb,jsonb)");
    f = open_memstream(&out, &len);
    conf_print(c, f);
    fclose(f);
    ck_assert_ptr_nonnull(strstr(out, "    provider: {\n      url = \"https://api.example.com\";"));
    ck_assert_ptr_nonnull(strstr(out, "idempotent = false;"));
    ck_assert_msg(conf_load_string(out, &c2, err, sizeof err) == IDEMQ_OK, "%s\n%s", err, out);
    ck_assert_str_eq(c2->inputs[0].provider.body_template, c->inputs[0].provider.body_template);
    ck_assert_str_eq(c2->inputs[1].provider.lookup_reference_path, "/charges?reference={key}");
    ck_assert(!c2->inputs[1].provider.idempotent);
    conf_free(c2);
    free(out);
    out = NULL;
    conf_free(c);
    /* a standard input prints no provider group */
    ck_assert_int_eq(conf_load(CASES "/good_minimal.cfg", &c, err, sizeof err), IDEMQ_OK);
    ck_assert(!CONF_INPUT_PROVIDER(&c->inputs[0]));
    f = open_memstream(&out, &len);
    conf_print(c, f);
    fclose(f);
    ck_assert_ptr_null(strstr(out, "provider"));
    free(out);
    conf_free(c);
}
END_TEST

/* check-config's consumer-timeout warning: a delivery waits for
 * the batches (or provider calls) before it; past RabbitMQ's consumer
 * timeout (30 min by default) the broker cancels the consumer. */
START_TEST(test_consumer_timeout_warning)
{
    struct conf *c;
    char err[512], *out = NULL;
    size_t len = 0;
    FILE *f;
    const char *base = "inputs = ( { name = \"payouts\"; queue = \"q.payouts\"; "
                       "effect_function = \"public.apply_payout\"; } );\n";
    char text[1024];

    /* the defaults: 10 batches of 100 x 15 s = 150 s, no warning */
    ck_assert_int_eq(conf_load_string(base, &c, err, sizeof err), IDEMQ_OK);
    f = open_memstream(&out, &len);
    ck_assert_int_eq(conf_warn_consumer_timeout(c, f), 0);
    fclose(f);
    ck_assert_str_eq(out, "");
    free(out);
    conf_free(c);
    /* prefetch 5000, batches of 10, 10 min statements: 500 x 605 s */
    snprintf(text, sizeof text,
             "broker: { prefetch = 5000; }; consumer: { batch_max = 10; };\n"
             "database: { statement_timeout_ms = 600000; }; metrics: { live_stall_s = 700; };\n%s",
             base);
    ck_assert_msg(conf_load_string(text, &c, err, sizeof err) == IDEMQ_OK, "%s", err);
    out = NULL;
    f = open_memstream(&out, &len);
    ck_assert_int_eq(conf_warn_consumer_timeout(c, f), 1);
    fclose(f);
    ck_assert_msg(strstr(out, "input payouts") && strstr(out, "broker.prefetch (5000)") &&
                      strstr(out, "302500000 ms") && strstr(out, "consumer timeout"),
                  "%s", out);
    free(out);
    conf_free(c);
    /* no statement timeout: a batch may run for ever */
    snprintf(text, sizeof text, "database: { statement_timeout_ms = 0; };\n%s", base);
    ck_assert_msg(conf_load_string(text, &c, err, sizeof err) == IDEMQ_OK, "%s", err);
    out = NULL;
    f = open_memstream(&out, &len);
    ck_assert_int_eq(conf_warn_consumer_timeout(c, f), 1);
    fclose(f);
    ck_assert_msg(strstr(out, "no bound"), "%s", out);
    free(out);
    conf_free(c);
}
END_TEST

/* The shipped sample loads and documents every setting of the table. */
START_TEST(test_sample_documents_every_key)
{
    struct conf *c;
    char err[512];
    char *text = read_all(IDEMQ_SOURCE_DIR "/config/idemq.cfg");
    unsetenv("IDEMQ_AMQP_URL");
    unsetenv("IDEMQ_PG_DSN");
    ck_assert_ptr_nonnull(text);
    ck_assert_msg(conf_load(IDEMQ_SOURCE_DIR "/config/idemq.cfg", &c, err, sizeof err) == IDEMQ_OK,
                  "%s", err);
    conf_free(c);
    for (int i = 0; i < conf_key_count(); i++) {
        const char *path = conf_key_path(i);
        const char *leaf = strrchr(path, '.') + 1;
        char needle[128];
        snprintf(needle, sizeof needle, "%s =", leaf);
        ck_assert_msg(strstr(text, needle) != NULL, "sample config does not show %s", path);
    }
    free(text);
}
END_TEST

/* Amazon SQS inputs: the settings each needs, the URLs it takes (https://,
 * http:// to loopback only), FIFO from the name, a DLQ of the same kind, and
 * what such an input cannot be; the SQS settings on another transport. */
START_TEST(test_sqs_settings)
{
#define SQS_IN(extra)                                                                             \
    "inputs = ({ name = \"s\"; transport = \"sqs\"; queue = \"s\"; effect_function = \"f\"; "  \
    "key_source = \"json:id\"; " extra " });"
    static const char *const bad[] = {
        SQS_IN(""),
        SQS_IN("region = \"eu-west-1\";"),
        SQS_IN("queue_url = \"https://sqs.eu-west-1.amazonaws.com/1/q\";"),
        SQS_IN("queue_url = \"http://sqs.example.com/1/q\"; region = \"eu-west-1\";"),
        SQS_IN("queue_url = \"ftp://h/1/q\"; region = \"eu-west-1\";"),
        SQS_IN("queue_url = \"https://h/q\"; region = \"eu-west-1\";"),
        SQS_IN("queue_url = \"https://u:p@h/1/q\"; region = \"eu-west-1\";"),
        SQS_IN("queue_url = \"https://h/1/q?x=1\"; region = \"eu-west-1\";"),
        SQS_IN("queue_url = \"https://h/1/q.x\"; region = \"eu-west-1\";"),
        SQS_IN("queue_url = \"https://h/1/q\"; region = \"EU West\";"),
        SQS_IN("queue_url = \"https://h/1/q\"; region = \"eu-west-1\"; endpoint = "
               "\"http://sqs.example.com\";"),
        SQS_IN("queue_url = \"https://h/1/q\"; region = \"eu-west-1\"; endpoint = "
               "\"http://127.0.0.1:9810/x\";"),
        SQS_IN("queue_url = \"https://h/1/q.fifo\"; region = \"eu-west-1\"; "
               "dead_letter_queue_url = \"https://h/1/d\";"),
        SQS_IN("queue_url = \"https://h/1/q\"; region = \"eu-west-1\"; "
               "dead_letter_queue_url = \"https://h/1/q\";"),
        SQS_IN("queue_url = \"https://h/1/q\"; region = \"eu-west-1\"; exchange = \"x\";"),
        SQS_IN("queue_url = \"https://h/1/q\"; region = \"eu-west-1\"; partitions = 2;"),
        SQS_IN("queue_url = \"https://h/1/q\"; region = \"eu-west-1\"; mode = \"observe\";"),
        SQS_IN("queue_url = \"https://h/1/q\"; region = \"eu-west-1\"; order_key_source = "
               "\"json:o\";"),
        "inputs = ({ name = \"s\"; transport = \"sqs\"; queue = \"s\"; effect_function = \"f\"; "
        "key_source = \"message_id\"; queue_url = \"https://h/1/q\"; region = \"eu-west-1\"; });",
        /* SQS settings on a broker or postgres input */
        "inputs = ({ name = \"b\"; queue = \"b\"; effect_function = \"f\"; region = "
        "\"eu-west-1\"; });",
        "inputs = ({ name = \"p\"; transport = \"postgres\"; queue = \"p\"; effect_function = "
        "\"f\"; queue_url = \"https://h/1/q\"; });",
        /* credentials never come from the file */
        SQS_IN("queue_url = \"https://h/1/q\"; region = \"eu-west-1\"; aws_secret_access_key = "
               "\"S3CRET\";"),
    };
    struct conf *c = NULL;
    char err[512];
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        ck_assert_msg(conf_load_string(bad[i], &c, err, sizeof err) == IDEMQ_ERR_CONFIG,
                      "accepted: %s", bad[i]);
        ck_assert_ptr_null(c);
        ck_assert_msg(strstr(err, "S3CRET") == NULL, "secret in the error: %s", err);
    }
    /* a standard queue on an emulator beside a broker input, a FIFO one
     * with its FIFO DLQ */
    ck_assert_msg(conf_load_string(
                      "inputs = ({ name = \"b\"; queue = \"b\"; effect_function = \"f\"; }, "
                      "{ name = \"s\"; transport = \"sqs\"; queue = \"s\"; effect_function = "
                      "\"g\"; key_source = \"json:id\"; queue_url = "
                      "\"http://127.0.0.1:9810/000000000000/s\"; region = \"us-east-1\"; "
                      "endpoint = \"http://127.0.0.1:9810\"; }, "
                      "{ name = \"f\"; transport = \"sqs\"; queue = \"f\"; effect_function = "
                      "\"g\"; key_source = \"json:id\"; queue_url = "
                      "\"https://sqs.eu-west-1.amazonaws.com/123456789012/f.fifo\"; region = "
                      "\"eu-west-1\"; dead_letter_queue_url = "
                      "\"https://sqs.eu-west-1.amazonaws.com/123456789012/f-dlq.fifo\"; });",
                      &c, err, sizeof err) == IDEMQ_OK,
                  "%s", err);
    ck_assert_int_eq(c->n_inputs, 1);
    ck_assert_int_eq(c->n_pg_inputs, 0);
    ck_assert_int_eq(c->n_sqs_inputs, 2);
    ck_assert_str_eq(c->inputs[0].name, "b");
    ck_assert_str_eq(c->sqs_inputs[0].name, "s");
    ck_assert(!c->sqs_inputs[0].sqs_fifo);
    ck_assert_str_eq(c->sqs_inputs[0].endpoint, "http://127.0.0.1:9810");
    ck_assert(c->sqs_inputs[1].sqs_fifo);
    ck_assert_str_eq(c->sqs_inputs[1].region, "eu-west-1");
    ck_assert_int_eq(conf_pg_view(c).n_sqs_inputs, 0);
    conf_free(c);
#undef SQS_IN
}
END_TEST

/* plaintext and unverified provider transport. http:// is refused
 * unless the host is loopback or provider.allow_plaintext says so; what is
 * accepted is reported by conf_input_insecure (a warning at start and in
 * check-config) without the URL's userinfo. */
static struct conf *provider_url_conf(const char *url, const char *extra, char *err, size_t len)
{
    char text[1024];
    struct conf *c = NULL;
    snprintf(text, sizeof text,
             "inputs = ( { name = \"pay\"; queue = \"q\"; provider: { url = \"%s\"; %s }; } );\n",
             url, extra ? extra : "");
    err[0] = '\0';
    if (conf_load_string(text, &c, err, len) != IDEMQ_OK)
        return NULL;
    return c;
}

START_TEST(test_provider_transport)
{
    char err[1024], warn[512];
    struct conf *c;
    const char *loop[] = {"http://127.0.0.1:8080", "http://localhost/api", "http://[::1]:9",
                          "http://127.3.2.1", "http://LOCALHOST:1"};
    const char *remote[] = {"http://pay.example.com", "http://127.0.0.1.evil.example",
                            "http://127.0.0.1@evil.example/x", "http://10.0.0.7:80",
                            "http://[::2]:9"};

    for (size_t i = 0; i < sizeof remote / sizeof *remote; i++) {
        c = provider_url_conf(remote[i], NULL, err, sizeof err);
        ck_assert_msg(c == NULL, "%s accepted", remote[i]);
        ck_assert_msg(strstr(err, "provider.allow_plaintext = true") != NULL, "%s: %s", remote[i],
                      err);
        ck_assert_msg(strstr(err, "127.0.0.1@") == NULL, "userinfo shown: %s", err);
        c = provider_url_conf(remote[i], "allow_plaintext = true;", err, sizeof err);
        ck_assert_msg(c != NULL, "%s: %s", remote[i], err);
        ck_assert(conf_input_insecure(&c->inputs[0], warn, sizeof warn));
        ck_assert_msg(strstr(warn, "plaintext http://") && strstr(warn, "allow_plaintext"), "%s",
                      warn);
        conf_free(c);
    }
    for (size_t i = 0; i < sizeof loop / sizeof *loop; i++) {
        c = provider_url_conf(loop[i], NULL, err, sizeof err);
        ck_assert_msg(c != NULL, "%s: %s", loop[i], err);
        ck_assert(conf_input_insecure(&c->inputs[0], warn, sizeof warn));
        ck_assert_msg(strstr(warn, "(loopback)") != NULL, "%s", warn);
        conf_free(c);
    }
    c = provider_url_conf("http://user:secret@pay.example.com", "allow_plaintext = true;", err,
                          sizeof err);
    ck_assert_ptr_nonnull(c);
    ck_assert(conf_input_insecure(&c->inputs[0], warn, sizeof warn));
    ck_assert_msg(strstr(warn, "secret") == NULL && strstr(warn, "pay.example.com"), "%s", warn);
    conf_free(c);

    c = provider_url_conf("https://pay.example.com", "verify_tls = false;", err, sizeof err);
    ck_assert_msg(c != NULL, "%s", err);
    ck_assert(conf_input_insecure(&c->inputs[0], warn, sizeof warn));
    ck_assert_msg(strstr(warn, "provider.verify_tls = false") != NULL, "%s", warn);
    conf_free(c);

    c = provider_url_conf("https://pay.example.com", NULL, err, sizeof err);
    ck_assert_msg(c != NULL, "%s", err);
    ck_assert(!conf_input_insecure(&c->inputs[0], warn, sizeof warn));
    ck_assert_str_eq(warn, "");
    ck_assert(!c->inputs[0].provider.allow_plaintext);
    conf_free(c);
}
END_TEST

/* mode: apply by default; observe sets the derived flag */
START_TEST(test_observe_mode)
{
    struct conf *c = NULL;
    char err[1024];
    ck_assert_msg(conf_load_string("inputs = ( { name = \"a\"; queue = \"q\"; effect_function = "
                                   "\"f\"; }, { name = \"b\"; queue = \"q2\"; effect_function = "
                                   "\"f\"; mode = \"observe\"; } );",
                                   &c, err, sizeof err) == IDEMQ_OK, "%s", err);
    ck_assert_str_eq(c->inputs[0].mode, "apply");
    ck_assert(!CONF_INPUT_OBSERVE(&c->inputs[0]));
    ck_assert_str_eq(c->inputs[1].mode, "observe");
    ck_assert(CONF_INPUT_OBSERVE(&c->inputs[1]));
    conf_free(c);
}
END_TEST

/* Celery inputs: routes get effect indexes after every input's
 * own, key sources of their own, and a check-config print that loads. */
START_TEST(test_celery_settings)
{
    struct conf *c, *c2;
    char err[512], text[1024];
    char *out = NULL;
    size_t len = 0;
    FILE *f;
    static const char *const bad[] = {
        "protocol = \"celery\"; key_source = \"kwarg:id\";",
        "protocol = \"celery\"; key_source = \"kwarg:id\"; celery_tasks = [\"a.b\"];",
        "protocol = \"celery\"; key_source = \"kwarg:id\"; celery_tasks = [\"=f\"];",
        "protocol = \"celery\"; key_source = \"kwarg:id\"; celery_tasks = [\"a=F; drop\"];",
        "protocol = \"celery\"; key_source = \"kwarg:id\"; celery_tasks = [\"a=f\", \"a=g\"];",
        "protocol = \"celery\"; key_source = \"json:id\"; celery_tasks = [\"a=f\"];",
        "protocol = \"celery\"; key_source = \"arg:x\"; celery_tasks = [\"a=f\"];",
        "protocol = \"celery\"; key_source = \"arg:1000\"; celery_tasks = [\"a=f\"];",
        "protocol = \"celery\"; key_source = \"task_id\"; celery_tasks = [\"a=f\"]; "
        "effect_function = \"g\";",
        "protocol = \"amqp10\"; effect_function = \"g\";",
        "effect_function = \"g\"; celery_tasks = [\"a=f\"];",
    };
    unsetenv("IDEMQ_AMQP_URL");
    unsetenv("IDEMQ_PG_DSN");
    ck_assert_msg(conf_load_string(
                      "inputs = ( { name = \"n\"; queue = \"qn\"; effect_function = \"f\"; },\n"
                      "  { name = \"c\"; queue = \"qc\"; protocol = \"celery\";\n"
                      "    key_source = \"arg:2\";\n"
                      "    celery_tasks = [\"shop.charge=app.charge\", \"shop.refund=refund\"]; } );",
                      &c, err, sizeof err) == IDEMQ_OK,
                  "%s", err);
    ck_assert_int_eq(c->n_routes, 2);
    ck_assert(c->inputs[1].celery && !c->inputs[0].celery);
    ck_assert_int_eq(c->inputs[1].key_kind, CONF_KEY_CELERY_ARG);
    ck_assert_int_eq(c->inputs[1].key_arg, 2);
    ck_assert_str_eq(c->inputs[1].routes[0].task, "shop.charge");
    ck_assert_str_eq(c->inputs[1].routes[0].signature, "app.charge(text,jsonb,jsonb)");
    ck_assert_int_eq(c->inputs[1].routes[0].effect, 2);
    ck_assert_int_eq(c->inputs[1].routes[1].effect, 3);
    ck_assert_ptr_null(c->inputs[1].effect_signature);
    f = open_memstream(&out, &len);
    conf_print(c, f);
    fclose(f);
    ck_assert_msg(conf_load_string(out, &c2, err, sizeof err) == IDEMQ_OK, "%s\n%s", err, out);
    ck_assert_int_eq(c2->n_routes, 2);
    ck_assert_str_eq(c2->inputs[1].routes[1].task, "shop.refund");
    conf_free(c2);
    conf_free(c);
    free(out);
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        snprintf(text, sizeof text, "inputs = ( { name = \"c\"; queue = \"qc\"; %s } );", bad[i]);
        ck_assert_msg(conf_load_string(text, &c, err, sizeof err) == IDEMQ_ERR_CONFIG,
                      "accepted: %s", bad[i]);
    }
}
END_TEST

/* The broker users' permissions (idemq declare --print-permissions): run
 * has no configure and no amq.default, writes only the retry and dead-letter
 * exchanges (and the Celery replies), reads only the work queues; names are
 * regex-escaped. */
START_TEST(test_broker_permissions)
{
    struct conf *c = NULL;
    char err[512], cf[2048], wr[2048], rd[2048];
    ck_assert_int_eq(conf_load(CASES "/good_permissions.cfg", &c, err, sizeof err), IDEMQ_OK);
    ck_assert(topology_permissions(c, TOPOLOGY_USER_RUN, cf, wr, rd, sizeof cf));
    ck_assert_str_eq(cf, "^$");
    ck_assert_str_eq(wr, "^(q\\.pay\\|x\\.retry|q\\.pay\\|x\\.dlx|q\\.auth\\.dlx|q\\.cel\\.retry|"
                         "q\\.cel\\.dlx|idemq\\.celery\\.replies|[0-9a-f]{8}-[0-9a-f]{4}-"
                         "[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12})$");
    ck_assert_str_eq(rd, "^(q\\.pay\\|x|q\\.auth\\.p[0-9]+|q\\.cel|idemq\\.celery\\.replies)$");
    ck_assert(topology_permissions(c, TOPOLOGY_USER_OPERATOR, cf, wr, rd, sizeof cf));
    ck_assert_ptr_nonnull(strstr(wr, "|amq\\.default)$"));
    ck_assert_ptr_nonnull(strstr(cf, "q\\.pay\\|x(\\.p[0-9]+|\\.retry(\\.[0-9]+)?|\\.dlx|\\.dead)?"));
    ck_assert_ptr_nonnull(strstr(rd, "|x\\.auth|"));
    ck_assert_ptr_null(strstr(cf, "amq"));
    /* too small: refused, not cut */
    ck_assert(!topology_permissions(c, TOPOLOGY_USER_RUN, cf, wr, rd, 40));
    conf_free(c);
}
END_TEST

/* sensitive: dotted JSON paths, each checked; the errors name the input,
 * the entry and what is wrong. */
START_TEST(test_sensitive_paths)
{
    struct conf *c = NULL;
    char err[512];
    static const struct {
        const char *list, *want;
    } bad[] = {
        {"[ \"card.number\", \"\" ]", "sensitive[1] \"\" must be 1 to 255 bytes"},
        {"[ \"card..number\" ]", "sensitive[0] \"card..number\" has an empty segment"},
        {"[ \".iban\" ]", "has an empty segment"},
        {"[ \"a.b.c.d.e.f.g.h.i.j.k.l.m.n.o.p.q\" ]", "has 17 segments (at most 16)"},
        {"[ 3 ]", "sensitive[0] must be a string"},
    };
    char text[512];

    ck_assert_msg(conf_load_string("inputs = ( { name = \"a\"; queue = \"q\"; effect_function = "
                                   "\"app.f\"; sensitive = [ \"card.number\", "
                                   "\"account.iban\" ]; } );\ndatabase: { keep_error_detail = "
                                   "true; };",
                                   &c, err, sizeof err) == IDEMQ_OK,
                  "%s", err);
    ck_assert_int_eq(c->inputs[0].sensitive.n, 2);
    ck_assert_str_eq(c->inputs[0].sensitive.v[1], "account.iban");
    ck_assert(c->keep_error_detail);
    conf_free(c);
    ck_assert_msg(conf_load_string("inputs = ( { name = \"a\"; queue = \"q\"; effect_function = "
                                   "\"app.f\"; } );",
                                   &c, err, sizeof err) == IDEMQ_OK,
                  "%s", err);
    ck_assert(!c->keep_error_detail);
    ck_assert(c->inputs[0].sensitive.n == 0 ||
              (c->inputs[0].sensitive.n == 1 && !c->inputs[0].sensitive.v[0][0]));
    conf_free(c);
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        snprintf(text, sizeof text,
                 "inputs = ( { name = \"a\"; queue = \"q\"; effect_function = \"app.f\"; "
                 "sensitive = %s; } );",
                 bad[i].list);
        c = NULL;
        ck_assert_msg(conf_load_string(text, &c, err, sizeof err) == IDEMQ_ERR_CONFIG, "%s",
                      bad[i].list);
        ck_assert_msg(strstr(err, bad[i].want) != NULL,
                      "%s: %s", bad[i].list, err);
    }
}
END_TEST

int main(void)
{
    Suite *s = suite_create("conf");
    TCase *tc = tcase_create("conf");
    tcase_add_test(tc, test_case_files);
    tcase_add_test(tc, test_broker_permissions);
    tcase_add_test(tc, test_defaults_and_derived);
    tcase_add_test(tc, test_env_overrides);
    tcase_add_test(tc, test_parse_interval);
    tcase_add_test(tc, test_redact);
    tcase_add_test(tc, test_redact_blanks_and_provider_url);
    tcase_add_test(tc, test_no_secret_printed);
    tcase_add_test(tc, test_lint);
    tcase_add_test(tc, test_lint_secret_file_mode);
    tcase_add_test(tc, test_error_lines);
    tcase_add_test(tc, test_metrics_listen);
    tcase_add_test(tc, test_console_listen);
    tcase_add_test(tc, test_metrics_listen_run);
    tcase_add_test(tc, test_print_roundtrip);
    tcase_add_test(tc, test_sample_documents_every_key);
    tcase_add_test(tc, test_provider_settings);
    tcase_add_test(tc, test_provider_transport);
    tcase_add_test(tc, test_consumer_timeout_warning);
    tcase_add_test(tc, test_observe_mode);
    tcase_add_test(tc, test_celery_settings);
    tcase_add_test(tc, test_sensitive_paths);
    tcase_add_test(tc, test_sqs_settings);
    tcase_add_test(tc, test_sqs_run_refused);
    suite_add_tcase(s, tc);
    return check_run(s);
}
