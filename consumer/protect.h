/*
 * protect: encryption at rest of the payload copies idemq stores (parked
 * bodies): AES-256-GCM (OpenSSL EVP) under keys read from files named in
 * the config (protection.keys, "id=/path"), each copy stored with the id
 * of the key that sealed it. The active key seals new copies; every listed
 * key opens old ones (rotation). Key bytes live only here: never logged,
 * wiped on free.
 *
 * API: protect_load, protect_free, protect_set_global, protect_global,
 * protect_active, protect_seal, protect_open.
 */
#ifndef IDEMQ_PROTECT_H
#define IDEMQ_PROTECT_H

#include <stdbool.h>
#include <stddef.h>

#include "idemq_err.h"

struct conf;
struct protect;

/* Bytes a sealed copy adds to its plaintext: the nonce and the tag. */
#define PROTECT_OVERHEAD (12 + 16)
/* A key file holds 32 bytes: raw, or 64 hex digits (a newline may follow). */
#define PROTECT_KEY_BYTES 32

/*
 * Reads the keys c names (protection.keys) and notes the active one
 * (protection.active; empty: new copies are stored as they are, listed
 * keys still open old ones). Each file must be a regular file that only
 * its owner may read or write (no group or other permission bits) and
 * hold exactly one key. Returns IDEMQ_OK with *p set (never NULL, also
 * with no keys; the caller protect_frees it), or IDEMQ_ERR_CONFIG with
 * errbuf naming the key id and file (never the key bytes). Startup only.
 */
idemq_err_t protect_load(const struct conf *c, struct protect **p, char *errbuf,
                         size_t errlen) IDEMQ_MUSTCHECK;

/* Wipes the key bytes and frees p (NULL: nothing). */
void protect_free(struct protect *p);

/* The process's keys, for the threads that store or show copies: set once
 * at startup before any thread starts (p stays owned by the caller), read
 * by any thread. protect_global returns NULL until set. */
void protect_set_global(struct protect *p);
const struct protect *protect_global(void);

/* The id new copies are sealed with, or NULL (p NULL, or no active key). */
const char *protect_active(const struct protect *p);

/*
 * Seals in[0..n) with the active key: *out (malloc'd, the caller frees) is
 * nonce || ciphertext || tag, *outlen = n + PROTECT_OVERHEAD; the key id is
 * bound to it as associated data. IDEMQ_ERR_CONFIG without an active key,
 * IDEMQ_ERR_NOMEM, or IDEMQ_ERR_INTERNAL when OpenSSL fails. Any thread.
 */
idemq_err_t protect_seal(const struct protect *p, const unsigned char *in, size_t n,
                         unsigned char **out, size_t *outlen) IDEMQ_MUSTCHECK;

/*
 * For a copy about to be stored: seals in[0..n) with the process's active
 * key (protect_global) into *out (the caller frees) and sets *key_id to
 * that key's id; with no active key, *out and *key_id are NULL and the copy
 * is stored as sent. A copy that cannot be sealed must not be stored: the
 * error is protect_seal's.
 */
idemq_err_t protect_seal_stored(const unsigned char *in, size_t n, unsigned char **out,
                                size_t *outlen, const char **key_id) IDEMQ_MUSTCHECK;

/* What opening a copy gave. */
enum protect_open_result {
    PROTECT_OPENED,   /* *out holds the plaintext */
    PROTECT_NO_KEY,   /* the copy names a key that is not configured */
    PROTECT_BAD_COPY, /* too short, or the tag does not match (altered, wrong key) */
    PROTECT_FAILED    /* out of memory, or OpenSSL failed */
};

/*
 * Opens a copy sealed with key_id: *out (malloc'd, NUL-terminated for
 * convenience, the caller frees) and *outlen on PROTECT_OPENED; *out NULL
 * otherwise. Any thread.
 */
enum protect_open_result protect_open(const struct protect *p, const char *key_id,
                                      const unsigned char *in, size_t n, unsigned char **out,
                                      size_t *outlen);

/* A phrase for r ("key not configured", ...). */
const char *protect_open_str(enum protect_open_result r);

#endif
