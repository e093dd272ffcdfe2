/*
 * seal: the HMAC-SHA256 that proves a redrive is idemq's or its operator's
 *. idemq seals what it puts on a dead-letter copy (key,
 * generation, park id: x-idemq-seal) and what `idemq redrive` adds (who:
 * x-idemq-redrive-seal); a delivery carrying x-idemq-generation without a
 * valid x-idemq-seal is a forged redrive (parked, never applied), and
 * x-idemq-redriven-by counts only with its seal. The secret is the ledger's
 * (idemq.redrive_seal, made by `idemq migrate`, shared by every replica and
 * the operator commands), set once per process with seal_set_secret.
 *
 * API: seal_set_secret -> seal_park / seal_by -> seal_check_headers.
 * Thread-safe.
 */
#ifndef IDEMQ_SEAL_H
#define IDEMQ_SEAL_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>

#define SEAL_HEX 65 /* 64 hex digits and NUL */
#define SEAL_SECRET_MAX 64

/* Sets the process's secret (16..64 bytes); false when the length is out
 * of range. Setting it again (each worker session reads the same value) is
 * harmless. */
bool seal_set_secret(const unsigned char *secret, size_t len);

/* Sets the secret from its hex text (as the ledger returns it: "\\x..." or
 * bare hex); false if it is not 16..64 bytes of hex. */
bool seal_set_secret_hex(const char *hex);

/* True once a secret is set. */
bool seal_ready(void);

/* The seal (hex) of a park copy: key, generation, park id (-1: none).
 * false when no secret is set. */
bool seal_park(const char *key, long long generation, long long park_id, char out[SEAL_HEX]);

/* The seal (hex) of a redrive's who (x-idemq-redriven-by), bound to the
 * same key, generation and park id. false when no secret is set. */
bool seal_by(const char *key, long long generation, long long park_id, const char *by,
             char out[SEAL_HEX]);

/*
 * Checks the redrive headers of a delivery whose key is key, in place:
 * with no x-idemq-generation there is nothing to prove (true). Otherwise
 * true only if x-idemq-seal matches key, x-idemq-generation and
 * x-idemq-park-id; and x-idemq-redriven-by is removed (the redrive is then
 * recorded as "broker") unless x-idemq-redrive-seal matches it. false: a
 * forged redrive (why says which part failed). Constant-time compares.
 */
bool seal_check_headers(json_t *headers, const char *key, char *why, size_t whylen);

/* Adds x-idemq-seal for the key, x-idemq-generation and x-idemq-park-id
 * the headers hold (nothing without a key or generation). false when no
 * secret is set or out of memory. */
bool seal_put_park(json_t *headers, const char *key);

#endif
