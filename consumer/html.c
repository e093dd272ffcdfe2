/*
 * html: escaper, buffer, page frame, plot and form decoding of the web
 * console (see html.h).
 */
#include "html.h"
#include "textesc.h"

#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define REPLACEMENT "\xef\xbf\xbd" /* U+FFFD */

void html_init(struct html *b)
{
    memset(b, 0, sizeof *b);
}

void html_free(struct html *b)
{
    free(b->p);
    html_init(b);
}

/* Room for `more` bytes and the NUL; false (b->full set) if it cannot be. */
static bool room(struct html *b, size_t more)
{
    size_t want = b->n + more + 1, cap;
    char *p;
    if (b->full)
        return false;
    if (want <= b->cap)
        return true;
    if (want > HTML_MAX_BYTES) {
        b->full = true;
        return false;
    }
    cap = b->cap ? b->cap : 4096;
    while (cap < want)
        cap *= 2;
    if (cap > HTML_MAX_BYTES)
        cap = HTML_MAX_BYTES;
    if (!(p = realloc(b->p, cap))) {
        b->full = true;
        return false;
    }
    b->p = p;
    b->cap = cap;
    return true;
}

static void put(struct html *b, const char *s, size_t len)
{
    if (!room(b, len))
        return;
    memcpy(b->p + b->n, s, len);
    b->n += len;
    b->p[b->n] = '\0';
}

void html_raw(struct html *b, const char *s)
{
    put(b, s, strlen(s));
}

void html_printf(struct html *b, const char *fmt, ...)
{
    va_list ap;
    int k;
    char small[512];
    va_start(ap, fmt);
    k = vsnprintf(small, sizeof small, fmt, ap);
    va_end(ap);
    if (k < 0)
        return;
    if ((size_t)k < sizeof small) {
        put(b, small, (size_t)k);
        return;
    }
    if (!room(b, (size_t)k))
        return;
    va_start(ap, fmt);
    vsnprintf(b->p + b->n, (size_t)k + 1, fmt, ap);
    va_end(ap);
    b->n += (size_t)k;
}

void html_text_n(struct html *b, const char *s, size_t len)
{
    const unsigned char *p = (const unsigned char *)s;
    size_t i = 0, run = 0; /* bytes at p[i - run .. i) to copy as they are */
    while (i < len) {
        uint32_t cp = 0;
        size_t k = textesc_utf8(p + i, len - i, &cp);
        const char *rep = NULL;
        char inv[16];
        if (k == 0) {
            rep = REPLACEMENT;
            k = 1;
        } else if (cp == '&') {
            rep = "&amp;";
        } else if (cp == '<') {
            rep = "&lt;";
        } else if (cp == '>') {
            rep = "&gt;";
        } else if (cp == '"') {
            rep = "&quot;";
        } else if (cp == '\'') {
            rep = "&#39;";
        } else if ((cp < 0x20 && cp != '\t' && cp != '\n') || (cp >= 0x7f && cp <= 0x9f)) {
            rep = REPLACEMENT;
        } else if (textesc_invisible(cp)) { /* shown, as \u and its hex digits */
            snprintf(inv, sizeof inv, "\\u%04x", (unsigned)cp);
            rep = inv;
        }
        if (rep) {
            put(b, (const char *)p + i - run, run);
            run = 0;
            html_raw(b, rep);
        } else {
            run += k;
        }
        i += k;
    }
    put(b, (const char *)p + i - run, run);
}

void html_text(struct html *b, const char *s)
{
    if (!s)
        s = "-";
    html_text_n(b, s, strlen(s));
}

void html_text_capped(struct html *b, const char *s, size_t max)
{
    size_t n = s ? strlen(s) : 0;
    if (n <= max) {
        html_text(b, s);
        return;
    }
    while (max > 0 && ((unsigned char)s[max] & 0xc0) == 0x80)
        max--;
    html_text_n(b, s, max);
    html_raw(b, "&hellip;");
}

void html_url(struct html *b, const char *s)
{
    static const char hex[] = "0123456789ABCDEF";
    for (const unsigned char *p = (const unsigned char *)(s ? s : ""); *p; p++) {
        char e[4] = {(char)*p, 0, 0, 0};
        if (!((*p >= 'A' && *p <= 'Z') || (*p >= 'a' && *p <= 'z') || (*p >= '0' && *p <= '9') ||
              *p == '-' || *p == '.' || *p == '_' || *p == '~')) {
            e[0] = '%';
            e[1] = hex[*p >> 4];
            e[2] = hex[*p & 15];
        }
        html_raw(b, e);
    }
}

/* Small, no web fonts, one column on a phone. */
const char html_css[] =
    ":root{--fg:#1d2430;--mut:#5b6575;--bg:#f6f7f9;--card:#fff;--line:#d9dde3;"
    "--acc:#2456a6;--bad:#a32020;--ok:#1f7a3a}"
    "*{box-sizing:border-box}"
    "body{margin:0;font:15px/1.45 system-ui,-apple-system,'Segoe UI',Roboto,sans-serif;"
    "color:var(--fg);background:var(--bg)}"
    "header{background:#1d2430;color:#fff;padding:.5rem 1rem;display:flex;flex-wrap:wrap;"
    "gap:.25rem 1rem;align-items:center}"
    "header b{font-size:1.1rem;margin-right:.5rem}"
    "header a{color:#cfe0ff;text-decoration:none;padding:.2rem .4rem;border-radius:4px}"
    "header a[aria-current]{background:#3a4a66;color:#fff}"
    "main{max-width:72rem;margin:0 auto;padding:1rem}"
    "h1{font-size:1.3rem;margin:.2rem 0 1rem}h2{font-size:1.1rem;margin:1.2rem 0 .5rem}"
    ".cards{display:grid;grid-template-columns:repeat(auto-fit,minmax(16rem,1fr));gap:1rem}"
    ".card{background:var(--card);border:1px solid var(--line);border-radius:6px;padding:.8rem;"
    "overflow-x:auto}"
    "table{border-collapse:collapse;width:100%;background:var(--card)}"
    "th,td{text-align:left;padding:.35rem .5rem;border-bottom:1px solid var(--line);"
    "vertical-align:top}"
    "th{font-size:.85rem;color:var(--mut);font-weight:600}"
    ".wrap{overflow-x:auto;border:1px solid var(--line);border-radius:6px}"
    "td.k,code,pre{font-family:ui-monospace,Menlo,Consolas,monospace;font-size:.85rem;"
    "word-break:break-all}"
    "pre{white-space:pre-wrap;background:var(--card);border:1px solid var(--line);"
    "border-radius:6px;padding:.8rem;margin:0}"
    ".ok{color:var(--ok);font-weight:600}.bad{color:var(--bad);font-weight:600}"
    ".mut{color:var(--mut)}"
    "td{overflow-wrap:break-word}td.k,td.txt,td .txt,td .mut{overflow-wrap:anywhere}"
    "td.k{max-width:22rem}td.keys{min-width:10rem}td.txt{min-width:14rem}"
    "td.gid{font-family:ui-monospace,Menlo,Consolas,monospace;font-size:.85rem;white-space:nowrap}"
    "td.act{white-space:nowrap;width:1%}"
    ".actions{display:flex;flex-wrap:wrap;gap:.3rem;margin:.6rem 0}"
    "table.kv th{width:11rem;white-space:nowrap}"
    "pre.body{max-height:32rem;overflow:auto;margin-bottom:1rem}"
    ".tag{display:inline-block;padding:0 .4rem;border-radius:4px;background:#e8ecf2;"
    "font-size:.8rem;white-space:nowrap}.tag.ok{background:#e2f3e7}.tag.bad{background:#f7e1e1}"
    "form.inline{display:inline}"
    "form.filters{display:flex;flex-wrap:wrap;gap:.5rem;align-items:end;margin-bottom:1rem}"
    "label{display:flex;flex-direction:column;font-size:.85rem;color:var(--mut)}"
    "input,select{font:inherit;padding:.35rem .45rem;border:1px solid var(--line);"
    "border-radius:4px;min-width:8rem}"
    "button{font:inherit;padding:.35rem .7rem;border-radius:4px;border:1px solid var(--acc);"
    "background:var(--acc);color:#fff;cursor:pointer;margin:.1rem 0}"
    "button.sec{background:#fff;color:var(--acc)}button.danger{background:var(--bad);"
    "border-color:var(--bad)}"
    ".pager{display:flex;gap:1rem;margin:.8rem 0}"
    ".note{background:#fff8e1;border:1px solid #e8d48a;border-radius:6px;padding:.6rem .8rem;"
    "margin:.8rem 0}"
    "svg{width:100%;height:auto;display:block}"
    "svg text{font:11px system-ui,sans-serif;fill:#5b6575}"
    "@media (max-width:40rem){main{padding:.6rem}th,td{padding:.3rem}"
    ".hide-s{display:none}input,select{min-width:0;width:100%}label{flex:1 1 45%}"
    /* a phone: each row of a long table becomes a card of stacked cells */
    "table.rows,table.rows tbody,table.rows tr,table.rows td{display:block;width:100%}"
    "table.rows tr:first-child{display:none}table.rows tr{border-bottom:2px solid var(--line);"
    "padding:.3rem 0}table.rows td{border:0;padding:.1rem .5rem}}";

void html_page_start(struct html *b, const char *title, const char *nav)
{
    static const char *const items[][2] = {
        {"overview", "/"},       {"groups", "/groups"},   {"parked", "/parked"},
        {"retrying", "/retrying"}, {"observe", "/observe"}};
    html_raw(b, "<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\">"
                "<meta name=\"viewport\" content=\"width=device-width,initial-scale=1\">"
                "<title>");
    html_text(b, title);
    html_raw(b, " - idemq</title><link rel=\"stylesheet\" href=\"/console.css\"></head><body>"
                "<header><b>idemq</b><nav>");
    for (size_t i = 0; i < sizeof items / sizeof items[0]; i++)
        html_printf(b, "<a href=\"%s\"%s>%s</a> ", items[i][1],
                    nav && strcmp(nav, items[i][0]) == 0 ? " aria-current=\"page\"" : "",
                    items[i][0]);
    html_raw(b, "</nav><form class=\"inline\" action=\"/key\" method=\"get\">"
                "<input name=\"k\" placeholder=\"key\" aria-label=\"key\" required>"
                " <button class=\"sec\">show</button></form></header><main>");
}

void html_page_end(struct html *b)
{
    html_raw(b, "</main></body></html>\n");
}

/* A round number at or above v for the top of an axis: 1, 2 or 5 times a
 * power of ten. */
static double nice_top(double v)
{
    double p;
    if (!(v > 0))
        return 1;
    p = pow(10, floor(log10(v)));
    if (v <= p)
        return p;
    if (v <= 2 * p)
        return 2 * p;
    if (v <= 5 * p)
        return 5 * p;
    return 10 * p;
}

void html_plot(struct html *b, const char *title, const double *v, int n, const char *unit,
               const char *xlabel_old)
{
    const double W = 600, H = 180, L = 48, R = 8, T = 22, B = 22;
    double max = 0, top;
    bool open = false;
    for (int i = 0; i < n; i++)
        if (!isnan(v[i]) && v[i] > max)
            max = v[i];
    top = nice_top(max);
    html_printf(b, "<svg viewBox=\"0 0 %.0f %.0f\" role=\"img\" aria-label=\"", W, H);
    html_text(b, title);
    html_raw(b, "\"><title>");
    html_text(b, title);
    html_printf(b, "</title><text x=\"%.0f\" y=\"14\" font-weight=\"600\">", L);
    html_text(b, title);
    if (unit && unit[0]) { /* here, not beside the top tick: the margin would clip it */
        html_raw(b, " (");
        html_text(b, unit);
        html_raw(b, ")");
    }
    html_raw(b, "</text>");
    /* grid: 0, half, top */
    for (int g = 0; g <= 2; g++) {
        double y = T + (H - T - B) * (1 - g / 2.0);
        html_printf(b, "<line x1=\"%.0f\" y1=\"%.1f\" x2=\"%.0f\" y2=\"%.1f\" stroke=\"#d9dde3\"/>"
                       "<text x=\"%.0f\" y=\"%.1f\" text-anchor=\"end\">%g</text>",
                    L, y, W - R, y, L - 4, y + 4, top * g / 2.0);
    }
    html_printf(b, "<text x=\"%.0f\" y=\"%.0f\">", L, H - 6);
    html_text(b, xlabel_old);
    html_printf(b, "</text><text x=\"%.0f\" y=\"%.0f\" text-anchor=\"end\">now</text>", W - R,
                H - 6);
    if (n >= 2) {
        for (int i = 0; i < n; i++) {
            double x = L + (W - L - R) * i / (n - 1), y;
            if (isnan(v[i])) {
                if (open)
                    html_raw(b, "\"/>");
                open = false;
                continue;
            }
            y = T + (H - T - B) * (1 - v[i] / top);
            if ((i == 0 || isnan(v[i - 1])) && (i == n - 1 || isnan(v[i + 1]))) {
                /* a point alone between gaps: a dot, or it would not show */
                html_printf(b, "<circle cx=\"%.1f\" cy=\"%.1f\" r=\"2.5\" fill=\"#2456a6\"/>",
                            x, y);
                continue;
            }
            if (!open)
                html_raw(b, "<polyline fill=\"none\" stroke=\"#2456a6\" stroke-width=\"2\" "
                            "points=\"");
            html_printf(b, "%s%.1f,%.1f", open ? " " : "", x, y);
            open = true;
        }
        if (open)
            html_raw(b, "\"/>");
    }
    html_raw(b, "</svg>");
}

static int hexval(int c)
{
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    if (c >= 'A' && c <= 'F')
        return c - 'A' + 10;
    return -1;
}

bool html_form_get(const char *body, size_t len, const char *name, char *out, size_t outlen)
{
    size_t nl = strlen(name), i = 0;
    if (outlen == 0)
        return false;
    out[0] = '\0';
    while (i < len) {
        size_t end = i, o = 0;
        while (end < len && body[end] != '&')
            end++;
        if (end - i > nl && memcmp(body + i, name, nl) == 0 && body[i + nl] == '=') {
            for (size_t k = i + nl + 1; k < end; k++) {
                int c = (unsigned char)body[k];
                if (c == '+') {
                    c = ' ';
                } else if (c == '%') {
                    int h, l;
                    if (k + 2 >= end || (h = hexval(body[k + 1])) < 0 ||
                        (l = hexval(body[k + 2])) < 0) {
                        out[0] = '\0';
                        return false;
                    }
                    c = h * 16 + l;
                    k += 2;
                }
                if (c == 0 || o + 1 >= outlen) {
                    out[0] = '\0';
                    return false;
                }
                out[o++] = (char)c;
            }
            out[o] = '\0';
            return true;
        }
        if (end - i == nl && memcmp(body + i, name, nl) == 0)
            return true; /* "name" alone: empty value */
        i = end + 1;
    }
    return false;
}
