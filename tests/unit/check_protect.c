/*
 * Unit tests of protect: sealed copies open only with the key they name,
 * an altered copy or a missing key is reported (never opened), key files
 * are refused when others may read them or they do not hold one key, and
 * the key bytes never appear in an error.
 */
#define _GNU_SOURCE
#include <check.h>

#include "check_run.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "conf.h"
#include "protect.h"

static char k1[128], k2[128];

static void write_key(char *path, size_t len, const char *tag, const char *text, mode_t mode)
{
    FILE *f;
    snprintf(path, len, "/tmp/idemq-ukey-%s-%d", tag, (int)getpid());
    unlink(path);
    ck_assert_ptr_nonnull(f = fopen(path, "w"));
    fputs(text, f);
    fclose(f);
    ck_assert_int_eq(chmod(path, mode), 0);
}

/* Loads keys "k1" (and "k2" when both) with active; returns the error. */
static idemq_err_t load(const char *keys, const char *active, struct protect **p, char *err,
                        size_t len)
{
    char text[1024];
    struct conf *c = NULL;
    idemq_err_t e;
    snprintf(text, sizeof text,
             "protection: { keys = [ %s ]; active = \"%s\"; };\n"
             "inputs = ( { name = \"a\"; queue = \"q\"; effect_function = \"app.f\"; } );",
             keys, active);
    ck_assert_msg(conf_load_string(text, &c, err, len) == IDEMQ_OK, "%s", err);
    e = protect_load(c, p, err, len);
    conf_free(c);
    return e;
}

static void setup(void)
{
    write_key(k1, sizeof k1, "k1",
              "00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff\n", 0600);
    write_key(k2, sizeof k2, "k2", "0123456789abcdef0123456789abcdef", 0400); /* 32 raw bytes */
}

static void teardown(void)
{
    unlink(k1);
    unlink(k2);
}

START_TEST(test_seal_open_rotate)
{
    char keys[400], err[512];
    struct protect *a = NULL, *b = NULL, *c = NULL;
    const unsigned char msg[] = "{\"card\":{\"number\":\"4111111111111111\"}}";
    unsigned char *s1 = NULL, *s2 = NULL, *o = NULL;
    size_t n1, n2, on;

    snprintf(keys, sizeof keys, "\"k1=%s\"", k1);
    ck_assert_msg(load(keys, "k1", &a, err, sizeof err) == IDEMQ_OK, "%s", err);
    ck_assert_str_eq(protect_active(a), "k1");
    ck_assert_int_eq(protect_seal(a, msg, sizeof msg - 1, &s1, &n1), IDEMQ_OK);
    ck_assert_uint_eq(n1, sizeof msg - 1 + PROTECT_OVERHEAD);
    ck_assert_ptr_null(memmem(s1, n1, "4111", 4));
    ck_assert_int_eq(protect_open(a, "k1", s1, n1, &o, &on), PROTECT_OPENED);
    ck_assert_uint_eq(on, sizeof msg - 1);
    ck_assert_mem_eq(o, msg, on);
    free(o);
    /* two seals of one message differ (fresh nonce) */
    ck_assert_int_eq(protect_seal(a, msg, sizeof msg - 1, &s2, &n2), IDEMQ_OK);
    ck_assert(n1 == n2 && memcmp(s1, s2, n1) != 0);
    free(s2);
    /* rotation: k2 active, k1 still opens its copies */
    snprintf(keys, sizeof keys, "\"k1=%s\", \"k2=%s\"", k1, k2);
    ck_assert_msg(load(keys, "k2", &b, err, sizeof err) == IDEMQ_OK, "%s", err);
    ck_assert_str_eq(protect_active(b), "k2");
    ck_assert_int_eq(protect_open(b, "k1", s1, n1, &o, &on), PROTECT_OPENED);
    free(o);
    ck_assert_int_eq(protect_seal(b, msg, 0, &s2, &n2), IDEMQ_OK); /* empty body */
    ck_assert_int_eq(protect_open(b, "k2", s2, n2, &o, &on), PROTECT_OPENED);
    ck_assert_uint_eq(on, 0);
    free(o);
    /* the id is bound: the k2 copy named k1 does not open */
    ck_assert_int_eq(protect_open(b, "k1", s2, n2, &o, &on), PROTECT_BAD_COPY);
    ck_assert_ptr_null(o);
    free(s2);
    /* k1 gone: reported, not opened; decrypt-only (no active key) */
    snprintf(keys, sizeof keys, "\"k2=%s\"", k2);
    ck_assert_msg(load(keys, "", &c, err, sizeof err) == IDEMQ_OK, "%s", err);
    ck_assert_ptr_null(protect_active(c));
    ck_assert_int_eq(protect_seal(c, msg, 1, &s2, &n2), IDEMQ_ERR_CONFIG);
    ck_assert_int_eq(protect_open(c, "k1", s1, n1, &o, &on), PROTECT_NO_KEY);
    ck_assert_int_eq(protect_open(NULL, "k1", s1, n1, &o, &on), PROTECT_NO_KEY);
    /* altered or cut copies */
    s1[n1 / 2] ^= 1;
    ck_assert_int_eq(protect_open(a, "k1", s1, n1, &o, &on), PROTECT_BAD_COPY);
    ck_assert_int_eq(protect_open(a, "k1", s1, PROTECT_OVERHEAD - 1, &o, &on), PROTECT_BAD_COPY);
    ck_assert_ptr_null(o);
    free(s1);
    protect_free(a);
    protect_free(b);
    protect_free(c);
}
END_TEST

START_TEST(test_key_files_refused)
{
    char keys[400], err[512], bad[128];
    struct protect *p = NULL;
    struct conf *c = NULL;

    ck_assert_int_eq(chmod(k1, 0640), 0);
    snprintf(keys, sizeof keys, "\"k1=%s\"", k1);
    ck_assert_int_eq(load(keys, "k1", &p, err, sizeof err), IDEMQ_ERR_CONFIG);
    ck_assert_msg(strstr(err, "chmod 600") && strstr(err, k1) && !strstr(err, "00112233"), "%s",
                  err);
    ck_assert_ptr_null(p);
    write_key(bad, sizeof bad, "short", "0011", 0600);
    snprintf(keys, sizeof keys, "\"k1=%s\"", bad);
    ck_assert_int_eq(load(keys, "k1", &p, err, sizeof err), IDEMQ_ERR_CONFIG);
    ck_assert_msg(strstr(err, "must hold 32 bytes"), "%s", err);
    unlink(bad);
    snprintf(keys, sizeof keys, "\"k1=/nonexistent/idemq.key\"");
    ck_assert_int_eq(load(keys, "k1", &p, err, sizeof err), IDEMQ_ERR_CONFIG);
    ck_assert_msg(strstr(err, "cannot open"), "%s", err);
    /* the config's own checks */
    ck_assert_int_eq(conf_load_string("protection: { keys = [ \"k1=rel/path\" ]; };", &c, err,
                                      sizeof err),
                     IDEMQ_ERR_CONFIG);
    ck_assert_msg(strstr(err, "id=/absolute/path"), "%s", err);
    ck_assert_int_eq(conf_load_string("protection: { keys = [ \"k1=/a\", \"k1=/b\" ]; };", &c,
                                      err, sizeof err),
                     IDEMQ_ERR_CONFIG);
    ck_assert_msg(strstr(err, "names key k1 twice"), "%s", err);
    ck_assert_int_eq(conf_load_string("protection: { keys = [ \"k1=/a\" ]; active = \"k2\"; };",
                                      &c, err, sizeof err),
                     IDEMQ_ERR_CONFIG);
    ck_assert_msg(strstr(err, "protection.active names key \"k2\""), "%s", err);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("protect");
    TCase *tc = tcase_create("protect");
    tcase_add_checked_fixture(tc, setup, teardown);
    tcase_add_test(tc, test_seal_open_rotate);
    tcase_add_test(tc, test_key_files_refused);
    suite_add_tcase(s, tc);
    return check_run(s);
}
