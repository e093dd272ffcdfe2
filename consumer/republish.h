/*
 * republish: the two ways idemq puts a delivery back on the broker before
 * acknowledging it: to a delay bucket (a retry, held on the broker) and to
 * the input's dead-letter exchange (a park). It owns the x-idemq-* headers.
 * Publishes are mandatory and confirmed; the caller waits for the confirms
 * (broker_wait_confirms) and acknowledges the originals only after that.
 *
 * Dead-letter headers: x-idemq-key, -error-class, -error-code, -sqlstate,
 * -error (at most 256 bytes), -attempts, -generation, -park-id,
 * -payload-sha256, -first-attempt-at, -last-attempt-at, -parked-at,
 * -origin-exchange, -origin-queue, -origin-routing-key, -seal (seal.h: the
 * proof a redrive of the copy is idemq's); and, when the park
 * does not hold the whole message (body over max_body_bytes), -redrivable
 * (false) and -body-size: `idemq redrive` refuses those.
 */
#ifndef IDEMQ_REPUBLISH_H
#define IDEMQ_REPUBLISH_H

#include <jansson.h>
#include <stdbool.h>

#include "broker.h"
#include "conf.h"
#include "idemq_err.h"
#include "job.h"

#define REPUBLISH_ERROR_TEXT_MAX 256

/* True for a header the broker acts on when a message is published (CC,
 * BCC, dead-letter history, plugin controls; see republish.c): no copy
 * idemq publishes carries one, so a producer's headers never steer a
 * publish made with idemq's credentials. Pure. */
bool republish_broker_header(const char *name);

/* Removes those headers from the object h, in place. */
void republish_strip_broker_headers(json_t *h);

/* Headers for a delayed retry of j: its own headers without the ones the
 * broker interprets and stale x-idemq-* facts, plus origin and attempt.
 * New object. */
json_t *republish_delay_headers(const struct job *j, const struct conf_input *in, int attempt);

/* Headers for the dead-letter copy of j parked as park (idemq.park_info).
 * New object. */
json_t *republish_dead_headers(const struct job *j, const struct conf_input *in,
                               const json_t *park);

/* Publishes j to the delay bucket of delay_ms (already clamped) with that
 * per-message TTL. Confirm pending. */
idemq_err_t republish_delay(struct broker *b, const struct conf_input *in, const struct job *j,
                            long delay_ms, int attempt) IDEMQ_MUSTCHECK;

/* Publishes j to the input's dead-letter exchange. Confirm pending. */
idemq_err_t republish_dead(struct broker *b, const struct conf_input *in, const struct job *j,
                           const json_t *park) IDEMQ_MUSTCHECK;

#endif
