/*
 * console_auth: the console's named tokens and their guess throttle (see
 * console_auth.h).
 */
#include "console_auth.h"

#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "log.h"

#define FILE_MAX 65536

static long long now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* a and b equal, in time that depends on their lengths only. */
static bool same_secret(const char *a, const char *b)
{
    size_t la = strlen(a), lb = strlen(b);
    unsigned char d = la != lb;
    for (size_t i = 0; i < la && i < lb; i++)
        d |= (unsigned char)(a[i] ^ b[i]);
    return d == 0 && la > 0;
}

static bool name_ok(const char *s, size_t n)
{
    if (n < 1 || n > CONSOLE_AUTH_NAME_MAX)
        return false;
    for (size_t i = 0; i < n; i++)
        if (!strchr("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._@-", s[i]))
            return false;
    return true;
}

static bool token_ok(const char *s, size_t n)
{
    if (n < CONSOLE_AUTH_TOKEN_MIN || n > CONSOLE_AUTH_TOKEN_MAX)
        return false;
    for (size_t i = 0; i < n; i++)
        if ((unsigned char)s[i] <= 0x20 || (unsigned char)s[i] >= 0x7f)
            return false;
    return true;
}

/* One line (NUL-terminated, no newline) into a; false with errbuf set. */
static bool load_line(struct console_auth *a, const char *path, int no, char *line,
                      char *errbuf, size_t errlen)
{
    char *p = line, *name, *tok;
    size_t nl, tl;
    while (*p == ' ' || *p == '\t')
        p++;
    nl = strlen(p);
    while (nl > 0 && (p[nl - 1] == ' ' || p[nl - 1] == '\t' || p[nl - 1] == '\r'))
        p[--nl] = '\0';
    if (!*p || *p == '#')
        return true;
    name = p;
    nl = strcspn(name, " \t");
    tok = name + nl;
    while (*tok == ' ' || *tok == '\t')
        tok++;
    tl = strlen(tok);
    if (!*tok) {
        snprintf(errbuf, errlen, "console.token_file %s line %d holds one field: write one "
                 "\"NAME TOKEN\" per line, the name recorded as the actor of what the token "
                 "does (a single-token file of an older version: put a name before its token)",
                 path, no);
        return false;
    }
    if (!name_ok(name, nl) || !token_ok(tok, tl)) {
        snprintf(errbuf, errlen, "console.token_file %s line %d: NAME (1 to %d of "
                 "A-Z a-z 0-9 . _ @ -) and TOKEN (%d to %d printable bytes, no spaces) "
                 "expected, e.g. head -c 32 /dev/urandom | base64",
                 path, no, CONSOLE_AUTH_NAME_MAX, CONSOLE_AUTH_TOKEN_MIN,
                 CONSOLE_AUTH_TOKEN_MAX);
        return false;
    }
    if (a->n == CONSOLE_AUTH_MAX) {
        snprintf(errbuf, errlen, "console.token_file %s: more than %d tokens", path,
                 CONSOLE_AUTH_MAX);
        return false;
    }
    name[nl] = '\0';
    for (int i = 0; i < a->n; i++)
        if (strcmp(a->t[i].name, name) == 0 || strcmp(a->t[i].token, tok) == 0) {
            snprintf(errbuf, errlen, "console.token_file %s line %d: the name or the token "
                     "of an earlier line again", path, no);
            return false;
        }
    snprintf(a->t[a->n].name, sizeof a->t[a->n].name, "%s", name);
    snprintf(a->t[a->n].token, sizeof a->t[a->n].token, "%s", tok);
    a->n++;
    return true;
}

idemq_err_t console_auth_load(struct console_auth *a, const char *path, char *errbuf,
                              size_t errlen)
{
    static char buf[FILE_MAX + 1];
    struct stat st;
    ssize_t got;
    char *line, *next;
    int no = 0, fd;
    idemq_err_t rc = IDEMQ_ERR_CONFIG;

    memset(a, 0, sizeof *a);
    a->allowance = CONSOLE_AUTH_BURST;
    a->last_ms = now_ms();
    if ((fd = open(path, O_RDONLY | O_CLOEXEC)) < 0) {
        snprintf(errbuf, errlen, "console.token_file %s cannot be read", path);
        return IDEMQ_ERR_CONFIG;
    }
    if (fstat(fd, &st) == 0 && (st.st_mode & 077))
        log_warn("console.token_file %s can be read by others than its owner (chmod 600)",
                 path);
    got = read(fd, buf, FILE_MAX + 1);
    close(fd);
    if (got < 0 || got > FILE_MAX || memchr(buf, '\0', (size_t)got)) {
        snprintf(errbuf, errlen, "console.token_file %s: unreadable, over %d bytes or holding "
                 "a NUL", path, FILE_MAX);
        goto out;
    }
    buf[got] = '\0';
    for (line = buf; line; line = next) {
        next = strchr(line, '\n');
        if (next)
            *next++ = '\0';
        if (!load_line(a, path, ++no, line, errbuf, errlen))
            goto out;
    }
    if (a->n == 0) {
        snprintf(errbuf, errlen, "console.token_file %s holds no \"NAME TOKEN\" line", path);
        goto out;
    }
    rc = IDEMQ_OK;
out:
    memset(buf, 0, sizeof buf);
    if (rc)
        console_auth_clear(a);
    return rc;
}

enum console_auth_result console_auth_check(struct console_auth *a, const char *user,
                                            const char *token, const char **name)
{
    long long now = now_ms();
    int hit = -1;
    a->allowance += (double)(now - a->last_ms) / CONSOLE_AUTH_REFILL_MS;
    if (a->allowance > CONSOLE_AUTH_BURST)
        a->allowance = CONSOLE_AUTH_BURST;
    a->last_ms = now;
    if (a->allowance < 1.0)
        return CONSOLE_AUTH_THROTTLED;
    for (int i = 0; i < a->n; i++) /* every token compared, whichever matches */
        if (token && same_secret(token, a->t[i].token))
            hit = i;
    if (hit >= 0 && (!user || strcmp(user, a->t[hit].name) == 0)) {
        *name = a->t[hit].name;
        return CONSOLE_AUTH_OK;
    }
    a->allowance -= 1.0;
    log_warn("console: a wrong token (%.0f more tries before the throttle)", a->allowance);
    return CONSOLE_AUTH_WRONG;
}

void console_auth_clear(struct console_auth *a)
{
    volatile unsigned char *p = (volatile unsigned char *)a->t;
    for (size_t i = 0; i < sizeof a->t; i++)
        p[i] = 0;
    a->n = 0;
}
