/*
 * textesc: UTF-8 decoding, invisible characters and the terminal escaping
 * of stored text (see textesc.h).
 */
#include "textesc.h"

#include <stdio.h>
#include <string.h>

size_t textesc_utf8(const unsigned char *s, size_t left, uint32_t *cp)
{
    size_t len;
    uint32_t c, min;
    if (s[0] < 0x80) {
        *cp = s[0];
        return 1;
    } else if ((s[0] & 0xe0) == 0xc0) {
        len = 2, c = s[0] & 0x1f, min = 0x80;
    } else if ((s[0] & 0xf0) == 0xe0) {
        len = 3, c = s[0] & 0x0f, min = 0x800;
    } else if ((s[0] & 0xf8) == 0xf0) {
        len = 4, c = s[0] & 0x07, min = 0x10000;
    } else {
        return 0;
    }
    if (len > left)
        return 0;
    for (size_t i = 1; i < len; i++) {
        if ((s[i] & 0xc0) != 0x80)
            return 0;
        c = (c << 6) | (s[i] & 0x3f);
    }
    if (c < min || c > 0x10ffff || (c >= 0xd800 && c <= 0xdfff))
        return 0;
    *cp = c;
    return len;
}

bool textesc_invisible(uint32_t cp)
{
    /* Unicode 15's General_Category=Cf, and Zl, Zp */
    static const uint32_t ranges[][2] = {
        {0x00ad, 0x00ad},   {0x0600, 0x0605},   {0x061c, 0x061c},   {0x06dd, 0x06dd},
        {0x070f, 0x070f},   {0x0890, 0x0891},   {0x08e2, 0x08e2},   {0x180e, 0x180e},
        {0x200b, 0x200f},   {0x2028, 0x202e},   {0x2060, 0x2064},   {0x2066, 0x206f},
        {0xfeff, 0xfeff},   {0xfff9, 0xfffb},   {0x110bd, 0x110bd}, {0x110cd, 0x110cd},
        {0x13430, 0x1343f}, {0x1bca0, 0x1bca3}, {0x1d173, 0x1d17a}, {0xe0001, 0xe0001},
        {0xe0020, 0xe007f},
    };
    for (size_t i = 0; i < sizeof ranges / sizeof ranges[0]; i++)
        if (cp >= ranges[i][0] && cp <= ranges[i][1])
            return true;
    return false;
}

size_t textesc_term_one(const unsigned char *s, size_t n, size_t *k, char *out)
{
    char tmp[20];
    uint32_t cp = 0;
    size_t len = textesc_utf8(s, n, &cp), w = 0;
    *k = len ? len : 1;
    if (len == 1 && cp >= 0x20 && cp != 0x7f && cp != '\\') {
        if (out)
            out[0] = (char)cp;
        return 1;
    }
    if (len > 1 && cp >= 0xa0 && !textesc_invisible(cp)) {
        if (out)
            memcpy(out, s, len);
        return len;
    }
    if (len == 1 && (cp == '\n' || cp == '\r' || cp == '\t' || cp == '\\'))
        w = (size_t)snprintf(tmp, sizeof tmp, "\\%c",
                             cp == '\n' ? 'n' : cp == '\r' ? 'r' : cp == '\t' ? 't' : '\\');
    else /* a control, an invisible character, a byte that is not UTF-8 */
        for (size_t i = 0; i < *k; i++)
            w += (size_t)snprintf(tmp + w, sizeof tmp - w, "\\x%02x", s[i]);
    if (out)
        memcpy(out, tmp, w);
    return w;
}

const char *textesc_term(const char *s, char *buf, size_t len)
{
    const unsigned char *u = (const unsigned char *)(s ? s : "-");
    size_t n = strlen((const char *)u), o = 0, k;
    char one[20];
    for (size_t i = 0; i < n; i += k) {
        size_t w = textesc_term_one(u + i, n - i, &k, one);
        if (o + w + 1 > len)
            break;
        memcpy(buf + o, one, w);
        o += w;
    }
    buf[o] = '\0';
    return buf;
}
