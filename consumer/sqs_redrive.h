/*
 * sqs_redrive: `idemq redrive` (and a failure group's redrive) for Amazon
 * SQS inputs. The messages of an input's dead-letter queue that match the
 * filter go back to its queue, through the same idempotent path as any
 * delivery: sent (confirmed by SQS's answer), then deleted from the
 * dead-letter queue. A copy idemq parked carries its sealed story; one the
 * queue's own redrive policy moved (maxReceiveCount) carries none and is
 * adopted first: a park row (error class broker, code max_receive_count),
 * then sealed like idemq's own. A copy whose seal does not hold goes back
 * without its generation, so it cannot reopen a parked key.
 *
 * API: sqs_redrive_input (after ops_load_seal).
 */
#ifndef IDEMQ_SQS_REDRIVE_H
#define IDEMQ_SQS_REDRIVE_H

#include <libpq-fe.h>
#include <stdio.h>

#include "conf.h"
#include "ops.h"

/*
 * Redrives the dead-letter queue of sqs input in into its queue; adds to
 * *moved and *left (what matched nothing, or a dry run, stays: visible
 * again at once). Returns 0, 1 when SQS or a statement failed mid-way
 * (nothing is lost: what was not sent stays in the dead-letter queue), 3
 * without credentials.
 */
int sqs_redrive_input(const struct conf *c, PGconn *db, const struct conf_input *in,
                      const struct ops_filter *f, FILE *out, long *moved, long *left);

#endif
