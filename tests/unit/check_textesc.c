/*
 * Unit tests of textesc: the terminal form of stored text that the CLI
 * prints (`idemq parked groups`, `jobs show`, `parked list`): controls, C1
 * controls, invisible characters and bytes that are not UTF-8 become \xHH
 * of each byte, so what a producer chose as a key or a reason can neither
 * steer the terminal nor hide or reorder what is shown.
 */
#include <check.h>

#include "check_run.h"
#include <string.h>

#include "textesc.h"

static const char *term(const char *s)
{
    static char buf[512];
    return textesc_term(s, buf, sizeof buf);
}

START_TEST(test_plain_and_controls)
{
    ck_assert_str_eq(term("order-17 caf\xc3\xa9 \xe2\x82\xac"), "order-17 caf\xc3\xa9 \xe2\x82\xac");
    ck_assert_str_eq(term("a\x1b[31mb\x7f"), "a\\x1b[31mb\\x7f");
    ck_assert_str_eq(term("l1\nl2\tx\\y"), "l1\\nl2\\tx\\\\y");
    ck_assert_str_eq(term(NULL), "-");
}
END_TEST

/* A C1 control is two bytes in UTF-8: both escaped, never the raw second
 * byte (0x9b alone is a terminal's CSI). */
START_TEST(test_c1_each_byte)
{
    ck_assert_str_eq(term("x\xc2\x9b" "31my"), "x\\xc2\\x9b31my");
    ck_assert_str_eq(term("\xc2\x80\xc2\x9f"), "\\xc2\\x80\\xc2\\x9f");
    ck_assert_str_eq(term("\xc2\xa0"), "\xc2\xa0"); /* U+00A0 is printable */
}
END_TEST

START_TEST(test_invisible)
{
    ck_assert_str_eq(term("k-\xe2\x80\xae" "gnp.exe"), "k-\\xe2\\x80\\xaegnp.exe"); /* RLO */
    ck_assert_str_eq(term("a\xe2\x80\x8b" "b"), "a\\xe2\\x80\\x8bb");                 /* ZWSP */
    ck_assert_str_eq(term("\xe2\x81\xa7" "x"), "\\xe2\\x81\\xa7x");                   /* FSI */
    ck_assert_str_eq(term("\xef\xbb\xbf"), "\\xef\\xbb\\xbf");                        /* BOM */
    ck_assert_str_eq(term("\xe2\x80\xa8"), "\\xe2\\x80\\xa8");                        /* LS */
    ck_assert(textesc_invisible(0x202a) && textesc_invisible(0x2064) &&
              textesc_invisible(0xe007f) && !textesc_invisible(0x2070) &&
              !textesc_invisible('a') && !textesc_invisible(0x200a));
}
END_TEST

/* Bytes that are not UTF-8, and a cut that never splits an escape. */
START_TEST(test_not_utf8_and_cut)
{
    char small[8];
    ck_assert_str_eq(term("\x9b\xc0\xbc\xed\xa0\x80"), "\\x9b\\xc0\\xbc\\xed\\xa0\\x80");
    ck_assert_str_eq(textesc_term("ab\x1b", small, sizeof small), "ab\\x1b");
    ck_assert_str_eq(textesc_term("abcd\x1b", small, sizeof small), "abcd");
}
END_TEST

int main(void)
{
    Suite *s = suite_create("textesc");
    TCase *tc = tcase_create("textesc");
    tcase_add_test(tc, test_plain_and_controls);
    tcase_add_test(tc, test_c1_each_byte);
    tcase_add_test(tc, test_invisible);
    tcase_add_test(tc, test_not_utf8_and_cut);
    suite_add_tcase(s, tc);
    return check_run(s);
}
