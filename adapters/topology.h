/*
 * topology: the broker objects behind one input and their names:
 *   work:    exchange <exchange> --routing_key--> queue <queue>
 *   delay:   exchange <queue>.retry --"<ms>"--> queues <queue>.retry.<ms>
 *            (per-message TTL, dead-lettering back to <queue> through the
 *            default exchange; of the input's queue type: quorum buckets
 *            dead-letter at least once)
 *   dead:    exchange <queue>.dlx --<queue>--> queue <queue>.dead
 * A partitioned input (partitions = N >= 1, ordered lanes) has instead:
 *   work:    x-consistent-hash exchange <exchange> (hash-header if set)
 *            --weight "1"--> queues <queue>.p0 .. <queue>.pN-1, each with
 *            x-single-active-consumer; no delay objects (lanes retry in place)
 *   dead:    as above.
 * Delay queues are buckets of 100 ms * 2^k; a delay d goes to the bucket
 * B <= d < 2B with expiration d, so it waits at least d and less than 2d.
 */
#ifndef IDEMQ_TOPOLOGY_H
#define IDEMQ_TOPOLOGY_H

#include <stdbool.h>
#include <stddef.h>

#include "broker.h"
#include "conf.h"
#include "idemq_err.h"

#define TOPOLOGY_MIN_DELAY_MS 100L
#define TOPOLOGY_NAME_MAX 300
/* x-delivery-limit of a quorum input's <queue>.dead: tools browse it with
 * get and requeue, which counts as a delivery; effectively no limit. */
#define TOPOLOGY_DLQ_DELIVERY_LIMIT 1000000
/* What RabbitMQ 4.x gives a quorum queue declared without x-delivery-limit
 * (3.x: no limit). */
#define TOPOLOGY_BROKER_DEFAULT_DELIVERY_LIMIT 20

/*
 * The delivery limit the broker itself imposes on queue, as this process
 * found it when declaring or verifying: TOPOLOGY_BROKER_DEFAULT_DELIVERY_LIMIT
 * for a quorum queue accepted in the legacy form (no x-delivery-limit) from a
 * RabbitMQ 4+ broker, else 0 (the queue's own x-delivery-limit, i.e. the
 * input's delivery_limit, or none). A policy may set a lower one; idemq
 * cannot see it. Any thread.
 */
int topology_broker_delivery_limit(const char *queue);

void topology_delay_exchange(const struct conf_input *in, char *buf, size_t len);
void topology_bucket_queue(const struct conf_input *in, long bucket_ms, char *buf, size_t len);
void topology_dlx(const struct conf_input *in, char *buf, size_t len);
void topology_dlq(const struct conf_input *in, char *buf, size_t len);
/* Partition queue k of a partitioned input: "<queue>.p<k>". */
void topology_partition_queue(const struct conf_input *in, int k, char *buf, size_t len);

/*
 * Celery >= 5.5 native delayed delivery (kombu's native_delayed_delivery,
 * names and keys as kombu writes them): a Celery input on a quorum queue
 * behind a topic or fanout exchange (topology_celery_delayed) gets the
 * chain celery_delayed_27 .. celery_delayed_0 (topic exchange + quorum
 * queue of TTL 2^level s each, dead-lettering to the next level, the last
 * to celery_delayed_delivery), and its exchange bound to
 * celery_delayed_delivery with its queue bound to its exchange, both by
 * "#.<routing_key>" (topology_celery_delayed_binding).
 */
#define TOPOLOGY_CELERY_DELAYED_LEVELS 28
#define TOPOLOGY_CELERY_DELAYED_DELIVERY "celery_delayed_delivery"
bool topology_celery_delayed(const struct conf_input *in);
void topology_celery_delayed_exchange(int level, char *buf, size_t len);
/* Binding key of level's queue to its exchange ("*." x (27 - level) "1.#"),
 * or, onward, of the next level's exchange to it (... "0.#"; for level 0,
 * of celery_delayed_delivery). */
void topology_celery_delayed_key(int level, bool onward, char *buf, size_t len);
void topology_celery_delayed_binding(const struct conf_input *in, char *buf, size_t len);

/* Delay actually used for a wanted delay: clamped to [100 ms, max_delay_ms]. */
long topology_clamp_delay(const struct conf *c, long delay_ms);

/* The bucket of a (clamped) delay: 100 * 2^k <= delay < 2 * that. */
long topology_bucket(long delay_ms);

/*
 * Declares the input's work, delay and dead-letter objects (idempotent).
 * Quorum queues get x-delivery-limit (in->delivery_limit) and at-least-once
 * dead-lettering into <queue>.dlx. A queue declared earlier without those
 * arguments is accepted with a warning (a policy sets them; adapters/README.md
 * "Quorum delivery limits").
 * IDEMQ_ERR_BROKER with broker_error(b) naming the object on failure, e.g.
 * an existing queue with other arguments.
 */
idemq_err_t topology_declare(struct broker *b, const struct conf *c,
                             const struct conf_input *in) IDEMQ_MUSTCHECK;

/*
 * Checks before consuming that the input's objects exist (passive). With
 * topology.verify = full it also checks that the queues carry the
 * configured arguments (a redeclare, which the broker refuses on a
 * mismatch) and re-asserts the bindings; with passive it does neither
 * (no configure permission needed) and logs once per process what it did
 * not check. On failure errbuf says what is wrong and to run `idemq
 * declare`. Leaves b usable. Any thread (own b).
 */
idemq_err_t topology_verify(struct broker *b, const struct conf *c, const struct conf_input *in,
                            char *errbuf, size_t errlen) IDEMQ_MUSTCHECK;

/*
 * The RabbitMQ permissions (configure, write, read: anchored regular
 * expressions, rabbitmqctl set_permissions) of a deployment's two broker
 * users for the inputs of c:
 * - TOPOLOGY_USER_RUN, `idemq run` with topology.verify = passive: no
 *   configure; write on each input's <queue>.retry and <queue>.dlx (and,
 *   with a Celery input, the replies exchange idemq.celery.replies and the
 *   UUID-named reply queues it binds); read on its work queue(s) (and the
 *   replies exchange). Never amq.default. Exchanges idemq.emit names are
 *   not in the config: the caller adds them.
 * - TOPOLOGY_USER_OPERATOR, `idemq declare`, `parked list` and the
 *   redrives: configure, write and read on every object of the inputs, and
 *   write on amq.default (a redrive goes to its origin queue by name).
 * False if a regular expression does not fit len. Pure.
 */
enum topology_user { TOPOLOGY_USER_RUN, TOPOLOGY_USER_OPERATOR };
#define TOPOLOGY_CELERY_REPLIES "idemq.celery.replies"
bool topology_permissions(const struct conf *c, enum topology_user who, char *configure,
                          char *write, char *read, size_t len);

/* True if queue (may be NULL) is one of in's own queues: its queue, or one
 * of its partition queues for a partitioned input. */
bool topology_is_input_queue(const struct conf_input *in, const char *queue);

#endif
