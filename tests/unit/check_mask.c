/*
 * Unit tests of mask: an input's sensitive payload fields never reach what
 * idemq shows or logs. A JSON body is shown re-dumped with each sensitive
 * value replaced (through arrays, at any declared depth); a body that is
 * not a whole JSON document (not JSON, cut, nested past the parser's
 * limit, huge) is hidden behind a placeholder, never shown as sent; error
 * texts lose each sensitive value they quote.
 */
#include <check.h>

#include "check_run.h"
#include <stdlib.h>
#include <string.h>

#include "mask.h"

static const char *const paths[] = {"card.number", "account.iban", "items.pan"};
#define NP 3

static char *body(const char *s, bool pretty)
{
    return mask_body(paths, NP, (const unsigned char *)s, strlen(s), pretty);
}

START_TEST(test_no_paths_shows_as_is)
{
    const char *const none[] = {""};
    ck_assert_ptr_null(mask_body(NULL, 0, (const unsigned char *)"{}", 2, false));
    ck_assert_ptr_null(mask_body(none, 1, (const unsigned char *)"{}", 2, false));
    ck_assert_ptr_null(mask_text(NULL, 0, (const unsigned char *)"{}", 2, "x"));
}
END_TEST

START_TEST(test_masks_paths)
{
    char *s = body("{\"job_id\":\"j1\",\"card\":{\"number\":\"4111111111111111\",\"exp\":\"12/30\"},"
                   "\"account\":{\"iban\":{\"cc\":\"DE\",\"rest\":\"89370400440532013000\"}},"
                   "\"amount\":5}",
                   false);
    ck_assert_ptr_nonnull(s);
    ck_assert_ptr_null(strstr(s, "4111111111111111"));
    ck_assert_ptr_null(strstr(s, "89370400440532013000"));
    ck_assert_ptr_nonnull(strstr(s, "\"number\":\"***\""));
    ck_assert_ptr_nonnull(strstr(s, "\"iban\":\"***\"")); /* a whole object at the path */
    ck_assert_ptr_nonnull(strstr(s, "\"exp\":\"12/30\""));
    ck_assert_ptr_nonnull(strstr(s, "\"amount\":5"));
    free(s);
}
END_TEST

/* A path through arrays applies to every element, nested arrays too; a
 * number is masked like a string; a missing or mistyped step masks
 * nothing and breaks nothing. */
START_TEST(test_arrays_and_types)
{
    char *s = body("{\"items\":[{\"pan\":4111111111111111},[{\"pan\":\"5500005555555559\"}],7,"
                   "{\"other\":1}],\"card\":\"not an object\",\"account\":[1,2]}",
                   true);
    ck_assert_ptr_nonnull(s);
    ck_assert_ptr_null(strstr(s, "4111111111111111"));
    ck_assert_ptr_null(strstr(s, "5500005555555559"));
    ck_assert_ptr_nonnull(strstr(s, "not an object"));
    ck_assert_ptr_nonnull(strstr(s, "\n")); /* pretty */
    free(s);
    s = body("[{\"card\":{\"number\":\"4111111111111111\"}}]", false); /* top-level array */
    ck_assert_ptr_null(strstr(s, "4111111111111111"));
    free(s);
}
END_TEST

/* Hostile bodies: never shown as sent. */
START_TEST(test_hostile_bodies_hidden)
{
    size_t big = 8u << 20, depth = 100000;
    char *huge = malloc(big + 64), *deep = malloc(2 * depth + 64), *s;
    const char *notjson = "card.number=4111111111111111";
    const char *cut = "{\"card\":{\"number\":\"4111111111111111\"}";
    const char *head = "{\"card\":{\"number\":\"4111111111111111\"},\"pad\":\"";
    const char *dup = "{\"card\":{\"number\":\"4111111111111111\"},\"card\":{\"number\":\"x\"}}";

    s = body(notjson, false);
    ck_assert_ptr_nonnull(strstr(s, "body hidden"));
    ck_assert_ptr_null(strstr(s, "4111"));
    free(s);
    s = body(cut, false);
    ck_assert_ptr_nonnull(strstr(s, "body hidden"));
    free(s);
    s = mask_body(paths, NP, NULL, 0, false);
    ck_assert_ptr_nonnull(strstr(s, "body hidden"));
    free(s);
    /* a duplicated key: the shown form is the parsed document, never the bytes */
    s = body(dup, false);
    ck_assert_ptr_null(strstr(s, "4111111111111111"));
    free(s);
    /* embedded NUL in a string: refused by the parser, hidden */
    s = mask_body(paths, NP, (const unsigned char *)"{\"a\":\"\\u0000\"}", 14, false);
    ck_assert_ptr_nonnull(s);
    free(s);
    /* nesting far past the parser's limit */
    for (size_t i = 0; i < depth; i++)
        deep[i] = '[';
    for (size_t i = 0; i < depth; i++)
        deep[depth + i] = ']';
    s = mask_body(paths, NP, (const unsigned char *)deep, 2 * depth, false);
    ck_assert_ptr_nonnull(strstr(s, "body hidden"));
    free(s);
    /* huge: 8 MiB of one string beside a card number */
    memcpy(huge, head, strlen(head));
    memset(huge + strlen(head), 'a', big - 2 - strlen(head));
    memcpy(huge + big - 2, "\"}", 2);
    s = mask_body(paths, NP, (const unsigned char *)huge, big, false);
    ck_assert_ptr_nonnull(s);
    ck_assert_ptr_null(strstr(s, "4111111111111111"));
    ck_assert_ptr_nonnull(strstr(s, "\"***\""));
    free(s);
    free(huge);
    free(deep);
}
END_TEST

START_TEST(test_path_check)
{
    char why[128];
    char longp[MASK_PATH_MAX + 2];
    ck_assert(mask_path_check("card.number", why, sizeof why));
    ck_assert(mask_path_check("a", why, sizeof why));
    ck_assert(!mask_path_check("", why, sizeof why));
    ck_assert(!mask_path_check(".a", why, sizeof why));
    ck_assert(!mask_path_check("a.", why, sizeof why));
    ck_assert(!mask_path_check("a..b", why, sizeof why));
    ck_assert_ptr_nonnull(strstr(why, "empty segment"));
    ck_assert(!mask_path_check("a.b.c.d.e.f.g.h.i.j.k.l.m.n.o.p.q", why, sizeof why));
    memset(longp, 'a', sizeof longp - 1);
    longp[sizeof longp - 1] = '\0';
    ck_assert(!mask_path_check(longp, why, sizeof why));
}
END_TEST

/* Error texts: each sensitive value of the body they quote is replaced;
 * other text, and values too short to search, stay. */
START_TEST(test_text)
{
    const char *b = "{\"card\":{\"number\":\"4111111111111111\"},\"account\":{\"iban\":\"DE89\"},"
                    "\"items\":[{\"pan\":12345},{\"pan\":\"ab\"}]}";
    size_t bl = strlen(b);
    char *t = mask_text(paths, NP, (const unsigned char *)b, bl,
                        "card 4111111111111111 declined for DE89 (item 12345, ab)");
    ck_assert_str_eq(t, "card *** declined for *** (item ***, ab)");
    free(t);
    ck_assert_ptr_null(mask_text(paths, NP, (const unsigned char *)b, bl, "nothing quoted"));
    ck_assert_ptr_null(mask_text(paths, NP, (const unsigned char *)"not json", 8, "not json"));
    /* overlapping values: the longest wins at each place */
    b = "{\"card\":{\"number\":[\"4111\",\"41111111\"]}}";
    t = mask_text(paths, NP, (const unsigned char *)b, strlen(b), "x41111111y4111z");
    ck_assert_str_eq(t, "x***y***z");
    free(t);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("mask");
    TCase *tc = tcase_create("mask");
    tcase_set_timeout(tc, 30);
    tcase_add_test(tc, test_no_paths_shows_as_is);
    tcase_add_test(tc, test_masks_paths);
    tcase_add_test(tc, test_arrays_and_types);
    tcase_add_test(tc, test_hostile_bodies_hidden);
    tcase_add_test(tc, test_path_check);
    tcase_add_test(tc, test_text);
    suite_add_tcase(s, tc);
    return check_run(s);
}
