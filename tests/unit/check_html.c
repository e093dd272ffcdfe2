/*
 * Unit tests of html (the web console's escaper, URL encoding, SVG plot
 * and form decoding), with hostile strings a producer could send as a key,
 * a body or a provider's answer.
 */
#include <check.h>

#include "check_run.h"
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "html.h"

static char *esc(struct html *b, const char *s)
{
    html_init(b);
    html_text(b, s);
    ck_assert(!b->full);
    return b->p ? b->p : "";
}

START_TEST(test_escape_markup)
{
    struct html b;
    ck_assert_str_eq(esc(&b, "<script>alert(1)</script>"),
                     "&lt;script&gt;alert(1)&lt;/script&gt;");
    html_free(&b);
    ck_assert_str_eq(esc(&b, "a&b \"q\" 'x'"), "a&amp;b &quot;q&quot; &#39;x&#39;");
    html_free(&b);
    /* an attribute breakout and an entity that must stay text */
    ck_assert_str_eq(esc(&b, "\" onmouseover=\"alert(1)"),
                     "&quot; onmouseover=&quot;alert(1)");
    html_free(&b);
    ck_assert_str_eq(esc(&b, "&lt;b&gt;"), "&amp;lt;b&amp;gt;");
    html_free(&b);
    ck_assert_str_eq(esc(&b, NULL), "-");
    html_free(&b);
    ck_assert_str_eq(esc(&b, ""), "");
    html_free(&b);
    ck_assert_str_eq(esc(&b, "plain key-1.ok/\xc3\xa9\xe2\x82\xac"),
                     "plain key-1.ok/\xc3\xa9\xe2\x82\xac"); /* é € unchanged */
    html_free(&b);
}
END_TEST

START_TEST(test_escape_bytes)
{
    struct html b;
    /* controls (tab and newline kept), DEL, C1, U+2028 */
    ck_assert_str_eq(esc(&b, "a\x01\x1b[31m\tb\nc\x7f"),
                     "a\xef\xbf\xbd\xef\xbf\xbd[31m\tb\nc\xef\xbf\xbd");
    html_free(&b);
    ck_assert_str_eq(esc(&b, "x\xc2\x9by\xe2\x80\xa8z"), "x\xef\xbf\xbdy\\u2028z");
    html_free(&b);
    /* not UTF-8: a lone continuation, an overlong '<' (C0 BC), a surrogate,
     * past U+10FFFF, a truncated sequence: never a raw '<' */
    ck_assert_str_eq(esc(&b, "\x80\xc0\xbc\xed\xa0\x80\xf4\x90\x80\x80\xe2\x82"),
                     "\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd"
                     "\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd");
    html_free(&b);
    /* bytes with NUL in them (a body) */
    html_init(&b);
    html_text_n(&b, "a\0<b", 4);
    ck_assert_str_eq(b.p, "a\xef\xbf\xbd&lt;b");
    html_free(&b);
}
END_TEST

/* Random bytes: the output never holds < > " ' or a control other than
 * tab and newline, and an & always starts one of the five entities. */
START_TEST(test_escape_fuzz)
{
    unsigned seed = 12345;
    for (int round = 0; round < 2000; round++) {
        char in[64];
        struct html b;
        size_t n = (size_t)(rand_r(&seed) % 63);
        for (size_t i = 0; i < n; i++)
            in[i] = (char)(rand_r(&seed) % 256);
        html_init(&b);
        html_text_n(&b, in, n);
        for (const char *p = b.p ? b.p : ""; *p; p++) {
            unsigned char c = (unsigned char)*p;
            ck_assert_msg(c != '<' && c != '>' && c != '"' && c != '\'', "round %d", round);
            ck_assert_msg(c >= 0x20 || c == '\t' || c == '\n', "round %d", round);
            if (c == '&')
                ck_assert(!strncmp(p, "&amp;", 5) || !strncmp(p, "&lt;", 4) ||
                          !strncmp(p, "&gt;", 4) || !strncmp(p, "&quot;", 6) ||
                          !strncmp(p, "&#39;", 5));
        }
        html_free(&b);
    }
}
END_TEST

START_TEST(test_url_and_frame)
{
    struct html b;
    html_init(&b);
    html_url(&b, "a b&c=<d>/\"e\xc3\xa9~_.-");
    ck_assert_str_eq(b.p, "a%20b%26c%3D%3Cd%3E%2F%22e%C3%A9~_.-");
    html_free(&b);
    html_init(&b);
    html_page_start(&b, "</title><script>x</script>", "groups");
    html_page_end(&b);
    ck_assert(strstr(b.p, "&lt;/title&gt;&lt;script&gt;") != NULL);
    ck_assert(strstr(b.p, "<script") == NULL);
    ck_assert(strstr(b.p, "name=\"viewport\"") != NULL);
    ck_assert(strstr(b.p, "href=\"/groups\" aria-current=\"page\"") != NULL);
    ck_assert(strstr(b.p, "href=\"/parked\" aria-current") == NULL);
    html_free(&b);
}
END_TEST

START_TEST(test_plot)
{
    struct html b;
    double v[5] = {0, 10, NAN, 30, 40};
    html_init(&b);
    html_plot(&b, "t<1>", v, 5, "ms", "5 min ago");
    ck_assert(strncmp(b.p, "<svg", 4) == 0);
    ck_assert(strstr(b.p, "t&lt;1&gt;") && !strstr(b.p, "t<1>"));
    /* the gap splits the line in two; the axis top is a round 50 */
    ck_assert_ptr_nonnull(strstr(strstr(b.p, "<polyline") + 1, "<polyline"));
    ck_assert(strstr(b.p, ">50<") != NULL);
    /* the unit is in the title line, not beside the top tick, where the
     * plot's left margin clipped it ("000 /min") */
    ck_assert(strstr(b.p, "t&lt;1&gt; (ms)</text>") != NULL);
    ck_assert(strstr(b.p, " ms<") == NULL);
    ck_assert(strstr(b.p, "<script") == NULL);
    ck_assert(strstr(b.p, "<circle") == NULL);
    html_free(&b);
    /* a point alone between gaps is a dot */
    v[0] = NAN, v[1] = 5, v[2] = NAN;
    html_init(&b);
    html_plot(&b, "t", v, 3, "ms", "3 min ago");
    ck_assert(strstr(b.p, "<circle") != NULL && strstr(b.p, "<polyline") == NULL);
    html_free(&b);
}
END_TEST

START_TEST(test_form)
{
    char out[32];
    const char *body = "csrf=ab12&group=0a1b2c3d4e5f&reason=limit+raised%21&empty=&tok=%3Cx%3E";
    size_t n = strlen(body);
    ck_assert(html_form_get(body, n, "reason", out, sizeof out));
    ck_assert_str_eq(out, "limit raised!");
    ck_assert(html_form_get(body, n, "tok", out, sizeof out));
    ck_assert_str_eq(out, "<x>");
    ck_assert(html_form_get(body, n, "empty", out, sizeof out));
    ck_assert_str_eq(out, "");
    ck_assert(!html_form_get(body, n, "grou", out, sizeof out)); /* no prefix match */
    ck_assert(!html_form_get(body, n, "missing", out, sizeof out));
    ck_assert(!html_form_get("a=%00b", 6, "a", out, sizeof out));  /* NUL refused */
    ck_assert(!html_form_get("a=%4", 4, "a", out, sizeof out));    /* truncated escape */
    ck_assert(!html_form_get("a=%zz", 5, "a", out, sizeof out));
    ck_assert(!html_form_get("a=0123456789", 12, "a", out, 8));   /* too long */
    ck_assert_str_eq(out, "");
}
END_TEST

/* Invisible format characters (a bidirectional override that would show
 * "exe.txt" for "txt.exe", zero-width ones that make two keys look the
 * same) are shown as \u and their hex digits, never as themselves. */
START_TEST(test_escape_invisible)
{
    struct html b;
    ck_assert_str_eq(esc(&b, "order-\xe2\x80\xae" "txt.exe"), "order-\\u202etxt.exe"); /* RLO */
    html_free(&b);
    ck_assert_str_eq(esc(&b, "a\xe2\x80\x8b" "b\xe2\x80\x8f" "c"), "a\\u200bb\\u200fc"); /* ZWSP RLM */
    html_free(&b);
    ck_assert_str_eq(esc(&b, "\xe2\x81\xa6" "x\xe2\x81\xa9"), "\\u2066x\\u2069"); /* LRI PDI */
    html_free(&b);
    ck_assert_str_eq(esc(&b, "\xef\xbb\xbf" "k\xe2\x81\xa0"), "\\ufeffk\\u2060"); /* BOM WJ */
    html_free(&b);
    ck_assert_str_eq(esc(&b, "t\xf3\xa0\x81\x81" "g\xc2\xad"), "t\\ue0041g\\u00ad"); /* tag A, SHY */
    html_free(&b);
    /* visible neighbours stay as they are */
    ck_assert_str_eq(esc(&b, "\xe2\x80\x90\xe2\x80\xaf\xe2\x81\xb0"),
                     "\xe2\x80\x90\xe2\x80\xaf\xe2\x81\xb0"); /* U+2010, U+202F, U+2070 */
    html_free(&b);
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("html");
    TCase *t = tcase_create("html");
    tcase_add_test(t, test_escape_markup);
    tcase_add_test(t, test_escape_bytes);
    tcase_add_test(t, test_escape_invisible);
    tcase_add_test(t, test_escape_fuzz);
    tcase_add_test(t, test_url_and_frame);
    tcase_add_test(t, test_plot);
    tcase_add_test(t, test_form);
    suite_add_tcase(s, t);
    return s;
}


int main(void)
{
    return check_run(suite());
}
