/*
 * html: the pieces the web console (console.h) builds its pages from, with
 * no daemon dependencies: a capped growable buffer, the HTML escaper every
 * stored string goes through (keys, bodies, reasons and provider answers
 * come from producers), URL encoding, the page frame and its stylesheet,
 * an SVG line plot, and the decoding of a urlencoded form body.
 *
 * API: html_init -> html_text / html_raw / html_printf / html_plot ...
 *      -> html_free. Pure; one buffer per thread.
 */
#ifndef IDEMQ_HTML_H
#define IDEMQ_HTML_H

#include <stdbool.h>
#include <stddef.h>

/* The largest page (bytes); past it the buffer stops growing and says so. */
#define HTML_MAX_BYTES (4u << 20)

struct html {
    char *p;       /* NUL-terminated text (NULL until the first write) */
    size_t n, cap;
    bool full;     /* something was dropped: out of memory or HTML_MAX_BYTES */
};

/* Empties b (no allocation yet). */
void html_init(struct html *b);

/* Frees b's text and empties it. */
void html_free(struct html *b);

/* Appends s as is: for markup the program itself wrote, never stored text. */
void html_raw(struct html *b, const char *s);

/* Appends printf output as is (same rule as html_raw: numbers and the
 * program's own words only). */
void html_printf(struct html *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/*
 * Appends s (NULL: "-") as text safe in an element and in a quoted
 * attribute: & < > " ' as entities; control characters other than tab and
 * newline, DEL, the C1 controls, bytes that are not UTF-8 (overlong forms,
 * surrogates and code points past U+10FFFF included) and U+2028/U+2029 as
 * U+FFFD. Nothing else changes.
 */
void html_text(struct html *b, const char *s);

/* Appends the first len bytes of s (may hold NUL, shown as U+FFFD) like
 * html_text, e.g. a message body. */
void html_text_n(struct html *b, const char *s, size_t len);

/* html_text of at most max bytes of s (cut before a character that does
 * not fit), then an ellipsis when it was cut: long keys and reasons in
 * table cells. */
void html_text_capped(struct html *b, const char *s, size_t max);

/* Appends s percent-encoded for a URL query value (unreserved characters
 * A-Z a-z 0-9 - . _ ~ kept, all else %XX): safe in an href as is. */
void html_url(struct html *b, const char *s);

/* The console's stylesheet (served as /console.css). */
extern const char html_css[];

/*
 * Appends the start of a page: doctype, viewport meta, title (escaped), the
 * stylesheet link, the navigation with `nav` ("overview", "groups",
 * "parked" or "" for none) marked current, and an open <main>.
 */
void html_page_start(struct html *b, const char *title, const char *nav);

/* Closes what html_page_start opened. */
void html_page_end(struct html *b);

/*
 * Appends an SVG line plot of v[0..n) (n >= 2; oldest first, NaN = no data,
 * drawn as a gap), titled `title (unit)` (escaped) with the y axis from 0 to
 * the largest value rounded up (numbers only: the unit is in the title) and the x axis
 * labelled from `xlabel_old` to "now". Pure markup, no script.
 */
void html_plot(struct html *b, const char *title, const double *v, int n, const char *unit,
               const char *xlabel_old);

/*
 * The value of field `name` in the application/x-www-form-urlencoded body
 * (len bytes; + and %XX decoded) into out (at most outlen - 1 bytes).
 * Returns true if found and it fit and decoded to text without NUL; false
 * (out empty) otherwise.
 */
bool html_form_get(const char *body, size_t len, const char *name, char *out, size_t outlen);

#endif
