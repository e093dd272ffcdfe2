/*
 * delivery: reads the content of one AMQP message (its content header and
 * body frames) into a struct job, within limits. The body's size is known
 * from the content header before any body frame is read: a body over the
 * input's max_body_bytes is streamed through SHA-256 and only a prefix is
 * kept. Properties and headers go through amqp_table with its limits. (The
 * frames are read here rather than by amqp_read_message, whose properties
 * clone refuses a table field with an empty name that RabbitMQ accepts.) A
 * content header the library's frame decoder refuses leaves the connection
 * unable to read further; the job then carries IDEMQ_ERR_UNDECODABLE and
 * what the method frame told.
 *
 * API: delivery_reader_init -> [delivery_read]* -> delivery_reader_free.
 * delivery_props_to_job is pure (used by delivery_read, tests and fuzzing).
 * One thread (the connection's owner).
 */
#ifndef IDEMQ_DELIVERY_H
#define IDEMQ_DELIVERY_H

#include <amqp.h>
#include <stddef.h>

#include "amqp_table.h"
#include "idemq_err.h"
#include "job.h"

/* Body bytes kept of a message over max_body_bytes (and of a message parked
 * because nothing else could be done with it). */
#define DELIVERY_PREFIX_BYTES 4096

struct delivery_reader {
    void *md;  /* EVP_MD (SHA-256), fetched once */
    void *ctx; /* EVP_MD_CTX, reused */
    struct amqp_table_limits limits;
};

/* Prepares r; IDEMQ_ERR_NOMEM if the hash cannot be set up. */
idemq_err_t delivery_reader_init(struct delivery_reader *r) IDEMQ_MUSTCHECK;
void delivery_reader_free(struct delivery_reader *r);

/*
 * Reads the content that follows a basic.deliver, basic.get-ok or
 * basic.return method frame just read on channel ch, waiting up to
 * timeout_ms for each frame. With j, fills its properties, headers, body
 * (all of it when body_size <= max_body, else a DELIVERY_PREFIX_BYTES
 * prefix), body_size, sha256_hex of the whole body and, when a limit was
 * hit, wire_err/wire_reason; with j NULL the content is read and dropped.
 * Returns IDEMQ_OK; IDEMQ_ERR_UNDECODABLE when the library could not decode
 * the content header (j->wire_err set too; the connection cannot be read
 * any more, but can still send); IDEMQ_ERR_NOMEM; or IDEMQ_ERR_BROKER when
 * the connection failed or the broker broke the framing (errbuf says why).
 */
idemq_err_t delivery_read(struct delivery_reader *r, amqp_connection_state_t conn,
                          amqp_channel_t ch, struct job *j, size_t max_body, int timeout_ms,
                          char *errbuf, size_t errlen) IDEMQ_MUSTCHECK;

/*
 * Copies message properties into j: string properties and the headers
 * table into j->props / j->headers as JSON (within lim), message_id,
 * x-delivery-count and x-acquired-count (RabbitMQ 4.3), each only when it is
 * an integer in 0..DELIVERY_COUNT_MAX (otherwise -1, the header stays in
 * j->headers as data). A header table over a limit sets j->wire_err
 * (IDEMQ_ERR_HEADERS_TOO_DEEP / _TOO_LARGE) and j->wire_reason and keeps
 * what fit. Returns IDEMQ_ERR_NOMEM or IDEMQ_OK. Pure.
 */
#define DELIVERY_COUNT_MAX 1000000000 /* a larger count is not the broker's */

idemq_err_t delivery_props_to_job(const amqp_basic_properties_t *p, struct job *j,
                                  const struct amqp_table_limits *lim) IDEMQ_MUSTCHECK;

#endif
