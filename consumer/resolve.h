/*
 * resolve: `idemq resolve -c FILE KEY (--applied REF | --not-applied |
 * --discard) --reason TEXT`, the operator's one command for settling a
 * parked provider key by hand, and the provider part of `idemq
 * jobs show` (the intent, its requests and its resolutions). Every
 * resolution records the OS user and the reason, durably, in
 * idemq.resolutions and in the key's attempt history.
 */
#ifndef IDEMQ_RESOLVE_H
#define IDEMQ_RESOLVE_H

#include <libpq-fe.h>
#include <stdbool.h>
#include <stdio.h>

#include "conf.h"

/*
 * Settles parked provider key `key`: action "applied" (ref = the provider's
 * reference; the input's SQL effect runs with it, all or nothing),
 * "not_applied" (a redrive then sends it again under the same key) or
 * "discard" (a redrive is a duplicate). reason is required. Prints what
 * happened to out. Returns the exit code: 0, 1 (the ledger refused: unknown
 * key, not a provider job, not parked, the effect failed), 2 (bad
 * arguments), 4 (database unreachable).
 */
int resolve_cmd(const struct conf *c, const char *key, const char *action, const char *ref,
                const char *reason, FILE *out);

/* Writes the intent of key (state, provider, requests, reference, last
 * answer, resolutions) to out, nothing when key has none. For jobs show;
 * read only. */
void resolve_show(PGconn *db, const char *key, FILE *out);

/* s in single quotes for a POSIX shell (a quote inside becomes '\\''),
 * into buf. false (buf unusable) when s holds a byte outside 0x20..0x7e
 * (a control byte would break or forge the pasted line) or buf is too
 * small. Pure. */
bool resolve_shell_quote(const char *s, char *buf, size_t len);

/* The OS user running this process, with host (and SUDO_USER when set):
 * "alice@host" or "root@host (sudo by alice)". */
void resolve_who(char *buf, size_t len);

#endif
