/*
 * mask: hides an input's sensitive payload fields (dotted JSON paths such
 * as "card.number") in what idemq shows or logs: a body is shown as its
 * JSON with each such value replaced, never as the bytes the producer
 * sent; an error text has each sensitive value of its body replaced.
 * Pure (jansson only); no state.
 *
 * API: mask_path_check, mask_body, mask_text.
 */
#ifndef IDEMQ_MASK_H
#define IDEMQ_MASK_H

#include <stdbool.h>
#include <stddef.h>

/* What a masked value becomes. */
#define MASK_SHOWN "***"
/* Path limits: segments and bytes. */
#define MASK_PATH_SEGMENTS 16
#define MASK_PATH_MAX 255
/* Values shorter than this are not searched for in error texts (a one- or
 * two-character value would mask every such character of the text). */
#define MASK_TEXT_MIN 3

/*
 * True when path is a usable sensitive path: 1 to MASK_PATH_MAX bytes,
 * 1 to MASK_PATH_SEGMENTS segments separated by single dots, none empty.
 * Otherwise false with why (a phrase) in why[whylen].
 */
bool mask_path_check(const char *path, char *why, size_t whylen);

/*
 * The form of body[0..len) that may be shown, given the n sensitive paths
 * (n = 0: none declared). Returns NULL when the body may be shown as it is
 * (no paths). Otherwise a malloc'd NUL-terminated text the caller frees:
 * the body parsed as JSON and dumped again (indented when pretty) with the
 * value at each path replaced by MASK_SHOWN (a path through an array
 * applies to each element), or, when the body is not JSON (or is cut,
 * nested too deep, or memory runs out), a placeholder naming its size and
 * why it is hidden. Never returns the producer's bytes themselves.
 */
char *mask_body(const char *const *paths, int n, const unsigned char *body, size_t len,
                bool pretty);

/*
 * text with every sensitive value of body (each string, or number as JSON
 * writes it, of MASK_TEXT_MIN or more bytes found at or under a sensitive
 * path) replaced by MASK_SHOWN. Returns NULL when nothing was replaced (no
 * paths, body not JSON, no value in text), else a malloc'd text the caller
 * frees.
 */
char *mask_text(const char *const *paths, int n, const unsigned char *body, size_t len,
                const char *text);

#endif
