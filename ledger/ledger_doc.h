/*
 * ledger_doc: the batch document idemq.apply_batch[_fast] reads: a JSON
 * array of {"k": key, "i": input (1-based), "q": queue, "h": body SHA-256,
 * "m": meta, "p": payload}. Written straight into one reusable buffer, with
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
 * present, delivery_count and message_id. */
void ledger_doc_add_job(struct ledger_doc *d, const struct job *j, const struct conf_input *in,
                        int input_idx);

/* Closes the array. Returns false if any append since ledger_doc_begin ran
 * out of memory (the document is then incomplete). */
bool ledger_doc_end(struct ledger_doc *d);

/* Appends s[0..n) as a JSON string (quoted, escaped; invalid UTF-8 becomes
 * U+FFFD). Exposed for tests. */
void ledger_doc_add_string(struct ledger_doc *d, const char *s, size_t n);

#endif
