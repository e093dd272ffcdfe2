/*
 * textesc: what stored text (keys, reasons, answers: producers chose them)
 * may show as it is, on a terminal or a web page. Decodes UTF-8, names the
 * invisible characters (Unicode format characters such as the
 * bidirectional overrides, and the line and paragraph separators), and
 * escapes text for a terminal. Pure; no state.
 *
 * API: textesc_utf8, textesc_invisible, textesc_term_one, textesc_term.
 */
#ifndef IDEMQ_TEXTESC_H
#define IDEMQ_TEXTESC_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* The length (1 to 4) of the valid UTF-8 sequence at s (of at most left
 * bytes, left > 0) with its code point in *cp, or 0 when it is not one
 * (overlong, surrogate, past U+10FFFF, truncated, a lone continuation). */
size_t textesc_utf8(const unsigned char *s, size_t left, uint32_t *cp);

/* True for a code point that changes how text around it shows while
 * showing nothing itself: Unicode's format characters (category Cf: soft
 * hyphen, Arabic and Syriac marks, U+180E, U+200B-200F, U+202A-202E,
 * U+2060-2064, U+2066-206F, U+FEFF, U+FFF9-FFFB, tag characters...) and
 * U+2028, U+2029. */
bool textesc_invisible(uint32_t cp);

/* The terminal form of the sequence at s (n > 0 bytes left): *k its length
 * in s; returns the bytes of its form, written to out (16 bytes at most)
 * when out is not NULL. Printable text is itself; \n \r \t and the
 * backslash are \n \r \t \\; other C0 controls, DEL, C1 controls, bytes
 * that are not UTF-8 and invisible characters are \xHH of each byte. */
size_t textesc_term_one(const unsigned char *s, size_t n, size_t *k, char *out);

/* The terminal form of s (NULL: "-") into buf of len bytes (len > 0),
 * cut at a whole sequence when it does not fit. Returns buf. */
const char *textesc_term(const char *s, char *buf, size_t len);

#endif
