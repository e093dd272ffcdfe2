/*
 * amqp_table: AMQP field tables <-> JSON, with limits. Headers come from
 * producers idemq does not control, so reading a table is bounded in
 * nesting depth, number of fields and total bytes; what lies beyond a
 * limit is left out and reported, never followed. Writing turns a JSON
 * object back into a table for a publish. Pure: no sockets.
 *
 * Conversions: strings that are valid UTF-8 (without NUL) stay strings,
 * other bytes become {"$bytes_hex": "..."}; integers and timestamps become
 * JSON integers, floats JSON reals (non-finite ones null), decimals
 * {"decimals": d, "value": v}, void null; fields whose name is not valid
 * UTF-8 are left out (and counted).
 */
#ifndef IDEMQ_AMQP_TABLE_H
#define IDEMQ_AMQP_TABLE_H

#include <amqp.h>
#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>

#include "idemq_err.h"

/* Limits on reading a table (each > 0). */
struct amqp_table_limits {
    int max_depth;     /* tables/arrays nested at most this deep (top = 1) */
    int max_fields;    /* fields and array elements over the whole table */
    size_t max_bytes;  /* bytes of names and string values over the table */
};

/* The defaults documented in adapters/README.md "Message contract". */
#define AMQP_TABLE_MAX_DEPTH 16
#define AMQP_TABLE_MAX_FIELDS 1024
#define AMQP_TABLE_MAX_BYTES (64 * 1024)

/* What reading a table came to. */
struct amqp_table_report {
    idemq_err_t err;   /* IDEMQ_OK, IDEMQ_ERR_HEADERS_TOO_DEEP or
                        * IDEMQ_ERR_HEADERS_TOO_LARGE (the first limit hit) */
    int depth;         /* deepest nesting seen (capped at max_depth + 1) */
    int fields;        /* fields converted */
    size_t bytes;      /* bytes converted */
    int skipped_names; /* fields left out for a name that is not UTF-8 */
};

/* Fills l with the defaults above. */
void amqp_table_default_limits(struct amqp_table_limits *l);

/*
 * Converts t into a new JSON object within lim (NULL = the defaults),
 * leaving out what lies beyond a limit; *rep says what happened. Returns
 * NULL only when out of memory. The caller owns the result.
 */
json_t *amqp_table_to_json(const amqp_table_t *t, const struct amqp_table_limits *lim,
                           struct amqp_table_report *rep);

/* Converts bytes as a string or {"$bytes_hex": ...} (see above). NULL when
 * out of memory. */
json_t *amqp_table_bytes_to_json(amqp_bytes_t b);

/*
 * Converts a JSON object (strings, integers, booleans, reals, objects,
 * arrays; anything else becomes void) into *t, allocating in pool. Strings
 * and names point into v: keep v alive until the table has been sent.
 * Returns 0, or -1 when the pool cannot allocate. NULL or {} gives an empty
 * table.
 */
int amqp_table_from_json(json_t *v, amqp_table_t *t, amqp_pool_t *pool);

/*
 * The bytes t takes on the wire (its 4-byte length included), as
 * amqp_encode_table would write it, and in *longest_name the longest field
 * name at any depth: a name over 255 bytes cannot be encoded (the client
 * library would write a wrong length byte). Pure; for the checks before a
 * publish (a header frame must fit in frame_max).
 */
size_t amqp_table_wire_size(const amqp_table_t *t, size_t *longest_name);

#endif
