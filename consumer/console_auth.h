/*
 * console_auth: the named tokens of the web console (console.token_file,
 * one "NAME TOKEN" per line) and the throttle on guessing them. A token
 * says who acts: the console records its actions as console:NAME.
 *
 * API: console_auth_load -> console_auth_check ... -> console_auth_clear.
 * One thread (the console's) uses a struct console_auth; no lock.
 */
#ifndef IDEMQ_CONSOLE_AUTH_H
#define IDEMQ_CONSOLE_AUTH_H

#include <stdbool.h>
#include <stddef.h>

#include "idemq_err.h"

#define CONSOLE_AUTH_MAX 64        /* tokens in one file */
#define CONSOLE_AUTH_NAME_MAX 64   /* bytes of a name */
#define CONSOLE_AUTH_TOKEN_MIN 32  /* bytes of a token, at least */
#define CONSOLE_AUTH_TOKEN_MAX 255 /* and at most */
#define CONSOLE_AUTH_BURST 10      /* wrong tokens accepted back to back */
#define CONSOLE_AUTH_REFILL_MS 3000 /* then one more per this long */

struct console_auth_token {
    char name[CONSOLE_AUTH_NAME_MAX + 1];
    char token[CONSOLE_AUTH_TOKEN_MAX + 1];
};

struct console_auth {
    int n; /* 0: no token file, nothing can be authorised */
    struct console_auth_token t[CONSOLE_AUTH_MAX];
    double allowance;  /* wrong tokens still accepted now */
    long long last_ms; /* when allowance was last refilled (CLOCK_MONOTONIC) */
};

enum console_auth_result {
    CONSOLE_AUTH_OK,        /* *name set */
    CONSOLE_AUTH_WRONG,     /* no token matches (counted against the throttle) */
    CONSOLE_AUTH_THROTTLED, /* too many wrong tokens lately: not even compared */
};

/*
 * Reads the token file at path into a (zeroed first): lines "NAME TOKEN",
 * blank lines and lines starting with # skipped. NAME: 1 to 64 of
 * [A-Za-z0-9._@-]; TOKEN: 32 to 255 printable bytes without spaces; names
 * and tokens distinct. A line with a token alone (the single-token file of
 * older versions) is refused with a message that says what to write.
 * Returns IDEMQ_OK, or IDEMQ_ERR_CONFIG with errbuf naming the file and
 * line. Warns when others than the owner may read the file.
 */
idemq_err_t console_auth_load(struct console_auth *a, const char *path, char *errbuf,
                              size_t errlen) IDEMQ_MUSTCHECK;

/*
 * Checks token against every token of a (in time that does not depend on
 * which one matches). When user is not NULL it must also equal the
 * matching token's name. OK sets *name (points into a). A wrong token uses
 * up one of CONSOLE_AUTH_BURST tries, refilled one per
 * CONSOLE_AUTH_REFILL_MS; with none left the answer is THROTTLED.
 */
enum console_auth_result console_auth_check(struct console_auth *a, const char *user,
                                            const char *token, const char **name);

/* Overwrites the tokens in memory. */
void console_auth_clear(struct console_auth *a);

#endif
