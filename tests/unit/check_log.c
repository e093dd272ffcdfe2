/* Unit tests of consumer/log: JSON lines parse and carry the stable fields;
 * a hostile key (newlines, quotes, control characters) or a message with
 * invalid UTF-8 cannot forge or break a line, in JSON or in text. */
#include <check.h>

#include "check_run.h"
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "log.h"

static const char *const stable_keys[] = {
    "ts",          "level",    "event",       "msg",  "worker",      "input",
    "key",         "tag",      "attempt",     "outcome", "error_class", "code",
    "sqlstate",    "duration_ms", "consumer", "source"};

/* A key built to forge a second log line in either format. */
static const char hostile_key[] =
    "k\"1\n2024-01-01T00:00:00.000Z idemq[ERROR] forged\r\n{\"level\":\"error\"}\t\x01\x1b[31m\\";

/* Runs fn with stderr sent to a temporary file; returns the file's text. */
static char *capture(void (*fn)(void))
{
    char path[] = "/tmp/check_log_XXXXXX";
    int fd = mkstemp(path), saved = dup(2);
    FILE *f;
    char *buf;
    long n;
    ck_assert_int_ge(fd, 0);
    fflush(stderr);
    dup2(fd, 2);
    fn();
    fflush(stderr);
    dup2(saved, 2);
    close(saved);
    f = fdopen(fd, "rb");
    fseek(f, 0, SEEK_END);
    n = ftell(f);
    fseek(f, 0, SEEK_SET);
    buf = calloc(1, (size_t)n + 1);
    ck_assert_int_eq(fread(buf, 1, (size_t)n, f), n);
    fclose(f);
    unlink(path);
    return buf;
}

static int count_lines(const char *s)
{
    int n = 0;
    for (; *s; s++)
        n += *s == '\n';
    return n;
}

static void emit_three(void)
{
    struct log_fields lf = LOG_FIELDS_NONE;
    log_set_worker(3);
    lf.event = "park";
    lf.input = "payouts";
    lf.key = hostile_key;
    lf.tag = 42;
    lf.attempt = 5;
    lf.outcome = "parked";
    lf.error_class = "transient";
    lf.code = "retries_exhausted";
    lf.sqlstate = "IR001";
    lf.duration_ms = 12.5;
    LOG_FIELDS(LOG_LVL_WARN, &lf, "effect failed: %s", "boom\nforged line");
    log_job(LOG_LVL_INFO, hostile_key, 7, 1, "deferred: %s", "gap");
    log_info("plain \xff\xfe invalid UTF-8 and a quote \" here");
}

START_TEST(test_json_lines)
{
    char *out;
    json_error_t jerr;
    const char *lines[3];
    log_current_level = LOG_LVL_DEBUG;
    log_configure(true, "replica-a:1");
    out = capture(emit_three);
    ck_assert_int_eq(count_lines(out), 3); /* nothing forged a line */
    lines[0] = strtok(out, "\n");
    lines[1] = strtok(NULL, "\n");
    lines[2] = strtok(NULL, "\n");
    for (int i = 0; i < 3; i++) {
        json_t *o;
        ck_assert_ptr_nonnull(lines[i]);
        o = json_loads(lines[i], 0, &jerr);
        ck_assert_msg(o != NULL, "line %d does not parse: %s: %s", i, jerr.text, lines[i]);
        ck_assert(json_is_object(o));
        for (size_t k = 0; k < sizeof stable_keys / sizeof stable_keys[0]; k++)
            ck_assert_msg(json_object_get(o, stable_keys[k]) != NULL, "line %d lacks %s", i,
                          stable_keys[k]);
        ck_assert_int_eq(json_object_size(o), sizeof stable_keys / sizeof stable_keys[0]);
        ck_assert_str_eq(json_string_value(json_object_get(o, "consumer")), "replica-a:1");
        ck_assert_int_eq(json_integer_value(json_object_get(o, "worker")), 3);
        if (i < 2) /* the key comes back byte for byte */
            ck_assert_str_eq(json_string_value(json_object_get(o, "key")), hostile_key);
        if (i == 0) {
            ck_assert_str_eq(json_string_value(json_object_get(o, "level")), "warn");
            ck_assert_str_eq(json_string_value(json_object_get(o, "event")), "park");
            ck_assert_str_eq(json_string_value(json_object_get(o, "input")), "payouts");
            ck_assert_int_eq(json_integer_value(json_object_get(o, "tag")), 42);
            ck_assert_int_eq(json_integer_value(json_object_get(o, "attempt")), 5);
            ck_assert_str_eq(json_string_value(json_object_get(o, "outcome")), "parked");
            ck_assert_str_eq(json_string_value(json_object_get(o, "error_class")), "transient");
            ck_assert_str_eq(json_string_value(json_object_get(o, "code")), "retries_exhausted");
            ck_assert_str_eq(json_string_value(json_object_get(o, "sqlstate")), "IR001");
            ck_assert(json_real_value(json_object_get(o, "duration_ms")) == 12.5);
            ck_assert_str_eq(json_string_value(json_object_get(o, "msg")),
                             "effect failed: boom\nforged line");
        }
        if (i == 1) {
            ck_assert_str_eq(json_string_value(json_object_get(o, "event")), "job");
            ck_assert(json_is_null(json_object_get(o, "outcome")));
        }
        if (i == 2) {
            ck_assert_str_eq(json_string_value(json_object_get(o, "event")), "log");
            ck_assert(json_is_null(json_object_get(o, "key")));
            ck_assert(json_is_null(json_object_get(o, "tag")));
            ck_assert_ptr_nonnull(strstr(json_string_value(json_object_get(o, "msg")), "a quote \""));
        }
        json_decref(o);
    }
    free(out);
}
END_TEST

START_TEST(test_text_lines)
{
    char *out, *line;
    log_current_level = LOG_LVL_DEBUG;
    log_configure(false, NULL);
    out = capture(emit_three);
    ck_assert_int_eq(count_lines(out), 3);
    line = strtok(out, "\n");
    ck_assert_ptr_nonnull(strstr(line, "idemq[WARN] key=k\"1\\n2024"));
    ck_assert_ptr_nonnull(strstr(line, "forged\\r\\n{"));
    ck_assert_ptr_nonnull(strstr(line, "\\t\\x01\\x1b[31m\\\\ tag=42 attempt=5: "));
    ck_assert_ptr_nonnull(strstr(line, "effect failed: boom\\nforged line"));
    ck_assert_ptr_null(strchr(line, '\r'));
    line = strtok(NULL, "\n");
    ck_assert_ptr_nonnull(strstr(line, "idemq[INFO] key=k\"1"));
    ck_assert_ptr_nonnull(strstr(line, "tag=7 attempt=1: deferred: gap"));
    line = strtok(NULL, "\n");
    ck_assert_ptr_nonnull(strstr(line, "idemq[INFO] plain "));
    free(out);
}
END_TEST

START_TEST(test_escape_text)
{
    char buf[16];
    ck_assert_str_eq(log_escape_text("a\nb", buf, sizeof buf), "a\\nb");
    ck_assert_str_eq(log_escape_text("\x7f", buf, sizeof buf), "\\x7f");
    /* cut on a whole escape, never half of one */
    ck_assert_str_eq(log_escape_text("abcdefghijklmn\n", buf, sizeof buf), "abcdefghijklmn");
    ck_assert_str_eq(log_escape_text("abcdefghijklm\n", buf, sizeof buf), "abcdefghijklm\\n");
    ck_assert_str_eq(log_escape_text(NULL, buf, sizeof buf), "");
}
END_TEST

int main(void)
{
    Suite *s = suite_create("log");
    TCase *tc = tcase_create("log");
    tcase_add_test(tc, test_json_lines);
    tcase_add_test(tc, test_text_lines);
    tcase_add_test(tc, test_escape_text);
    suite_add_tcase(s, tc);
    return check_run(s);
}
