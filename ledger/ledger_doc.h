/*
 * ledger_doc: the batch document idemq.apply_batch[_fast] reads: a JSON
 * array of {"k": key, "i": input (1-based), "q": queue, "h": body SHA-256,
 * "m": meta, "p": payload}, "w": true for a message older than the dedup
 * window, and the ordered-lane fields. Written straight into one reusable buffer, with
 * no allocation per job once the buffer has grown to the batch's size.
 * Strings are escaped here; bytes that are not UTF-8 (a routing key or
 * message_id is any bytes) become U+FFFD, so the document is always valid.
 *
 * API: ledger_doc_init -> [ledger_doc_begin -> ledger_doc_add_job ... ->
 *      ledger_doc_end -> read d->buf]* -> ledger_doc_free.
 */
#ifndef IDEMQ_LEDGER_DOC_H
#define IDEMQ_LEDGER_DOC_H

#include <stdbool.h>
#include <stddef.h>

#include "conf.h"
#include "job.h"

struct ledger_doc {
    char *buf; /* NUL-terminated document; owned */
    size_t len, cap;
    int n;       /* jobs added since ledger_doc_begin */
    bool nomem;  /* an append failed since ledger_doc_begin */
};

/* Prepares an empty document. Cannot fail (memory comes on first use). */
void ledger_doc_init(struct ledger_doc *d);

/* Releases the buffer. */
void ledger_doc_free(struct ledger_doc *d);

/* Starts a new array, keeping the buffer. */
void ledger_doc_begin(struct ledger_doc *d);

/* Appends job j (decoded, with a key) of input in, number input_idx (0-based).
 * Its meta holds queue, exchange, routing_key, redelivered, headers and, when
 * present, delivery_count and message_id, then attempt 1 and generation 0
 * (what the set-based path hands the effect; the isolating path overrides
 * them). old: its AMQP timestamp is older than the dedup window ("w"). */
void ledger_doc_add_job(struct ledger_doc *d, const struct job *j, const struct conf_input *in,
                        int input_idx, bool old);

/* Closes the array. Returns false if any append since ledger_doc_begin ran
 * out of memory (the document is then incomplete). */
bool ledger_doc_end(struct ledger_doc *d);

/* Appends s[0..n) as a JSON string (quoted, escaped; invalid UTF-8 becomes
 * U+FFFD). Also for other JSON documents (trace_export's request bodies). */
void ledger_doc_add_string(struct ledger_doc *d, const char *s, size_t n);

/* Appends s as it is (JSON text the caller vouches for). */
void ledger_doc_add_raw(struct ledger_doc *d, const char *s);

/*
 * The same batch as columns, for the plain statement (ledger_plain): one-dimensional
 * PostgreSQL arrays in binary format (libpq parameter format 1), so the
 * database parses no envelope, only each payload and each distinct meta.
 * By job in delivery order: keys text[], first bool[] (the first copy of
 * its key in the batch), inputs int4[] (1-based), sha: a bytea holding the
 * 32-byte body SHA-256 digests end to end, meta_idx int4[] (1-based into
 * metas) and payloads jsonb[]; metas
 * jsonb[] holds each distinct meta once (a batch mostly carries one: queue,
 * exchange, routing key, redelivered, headers); distinct counts the keys.
 * Each meta is the one ledger_doc_add_job writes.
 *
 * API: ledger_doc_cols_init -> [ledger_doc_cols_begin -> ledger_doc_cols_add_job ... ->
 *      ledger_doc_cols_end -> read c->col[i].buf / .len, c->first, c->distinct]*
 *      -> ledger_doc_cols_free.
 */
enum ledger_col {
    LEDGER_COL_KEYS = 0,
    LEDGER_COL_FIRST,
    LEDGER_COL_INPUTS,
    LEDGER_COL_SHA,
    LEDGER_COL_METAS,
    LEDGER_COL_META_IDX,
    LEDGER_COL_PAYLOADS,
    LEDGER_COL_N,
};

struct ledger_seen;

struct ledger_cols {
    struct ledger_doc col[LEDGER_COL_N]; /* buf/len: the binary arrays; owned */
    int n;                /* jobs added since ledger_doc_cols_begin */
    int distinct;         /* distinct keys among them */
    bool *first;          /* first[i]: job i is the first copy of its key; owned */
    size_t first_cap;
    struct ledger_doc scratch;       /* the meta being added */
    struct ledger_seen *metas_seen;  /* distinct metas (open addressing); owned */
    size_t nmetas_seen;
    struct ledger_seen *keys_seen;   /* distinct keys; owned */
    size_t nkeys_seen;
    bool nomem; /* an append failed since ledger_doc_cols_begin */
};

/* Prepares empty columns. Cannot fail (memory comes on first use). */
void ledger_doc_cols_init(struct ledger_cols *c);

/* Releases every buffer. */
void ledger_doc_cols_free(struct ledger_cols *c);

/* Starts new arrays, keeping the buffers. */
void ledger_doc_cols_begin(struct ledger_cols *c);

/* Appends job j (decoded, with a key) of input in, number input_idx
 * (0-based). */
void ledger_doc_cols_add_job(struct ledger_cols *c, const struct job *j,
                             const struct conf_input *in, int input_idx);

/* Finishes the arrays. Returns false if any append since ledger_doc_cols_begin
 * ran out of memory (the arrays are then unusable). */
bool ledger_doc_cols_end(struct ledger_cols *c);

#endif
