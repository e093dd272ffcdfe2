/*
 * republish: builds x-idemq-* headers and publishes retries to delay buckets
 * and parks to the dead-letter exchange.
 */
#include "republish.h"

#include <stdio.h>
#include <string.h>

#include "seal.h"
#include "topology.h"

/*
 * Headers RabbitMQ (or a plugin) acts on when a message is published or
 * moved: sender-selected distribution (CC, BCC: exact, case-sensitive
 * names; they add routing keys, so on the default exchange they name any
 * queue), dead-letter history (cycle detection), the quorum delivery and
 * acquired counts (4.3),
 * federation's hop record, stream filters, MQTT and AMQP 1.0 annotations
 * (x-cc is AMQP 1.0's CC), the delayed-message and deduplication plugins.
 * Exact names, then prefixes.
 */
static const char *const broker_names[] = {
    "CC", "BCC", "x-cc", "x-death", "x-delivery-count", "x-acquired-count", "x-received-from",
    "x-stream-filter", "x-stream-filter-value", "x-delay", "x-deduplication-header",
    "x-cache-ttl", NULL};
static const char *const broker_prefixes[] = {"x-first-death-", "x-last-death-", "x-opt-",
                                              "x-amqp-1.0-", "x-mqtt-", NULL};

bool republish_broker_header(const char *name)
{
    for (int i = 0; broker_names[i]; i++)
        if (strcmp(name, broker_names[i]) == 0)
            return true;
    for (int i = 0; broker_prefixes[i]; i++)
        if (strncmp(name, broker_prefixes[i], strlen(broker_prefixes[i])) == 0)
            return true;
    return false;
}

void republish_strip_broker_headers(json_t *h)
{
    const char *k;
    json_t *v;
    void *tmp;
    json_object_foreach_safe(h, tmp, k, v)
    {
        if (republish_broker_header(k))
            json_object_del(h, k);
    }
}

/* Copy of j's headers without what the broker interprets and idemq's own
 * facts, keeping the origin of the first delivery. */
static json_t *clean_headers(const struct job *j, const struct conf_input *in)
{
    json_t *h = json_object();
    const char *k;
    json_t *v;

    if (!h)
        return NULL;
    json_object_foreach(j->headers, k, v)
    {
        if (republish_broker_header(k) ||
            (strncmp(k, "x-idemq-", 8) == 0 && strncmp(k, "x-idemq-origin-", 15) != 0))
            continue;
        json_object_set(h, k, v);
    }
    if (!topology_is_input_queue(in, json_string_value(json_object_get(h,
                                                                       "x-idemq-origin-queue")))) {
        /* None yet, or one a producer made up: the origin is where this
         * delivery came from. */
        char origin[TOPOLOGY_NAME_MAX];
        /* An ordered input's jobs go back to their partition queue (a job
         * taken from idemq.deferred remembers its lane; the sequence guard
         * keeps order whichever partition a redrive lands in). */
        if (CONF_INPUT_ORDERED(in))
            topology_partition_queue(in, j->lane >= 0 && j->lane < in->partitions ? j->lane : 0,
                                     origin, sizeof origin);
        else
            snprintf(origin, sizeof origin, "%s", in->queue);
        json_object_set_new(h, "x-idemq-origin-exchange", json_string(j->exchange));
        json_object_set_new(h, "x-idemq-origin-routing-key", json_string(j->routing_key));
        json_object_set_new(h, "x-idemq-origin-queue", json_string(origin));
    }
    return h;
}

json_t *republish_delay_headers(const struct job *j, const struct conf_input *in, int attempt)
{
    json_t *h = clean_headers(j, in);
    if (h)
        json_object_set_new(h, "x-idemq-attempt", json_integer(attempt));
    return h;
}

static void copy_field(json_t *h, const char *name, const json_t *park, const char *field)
{
    json_t *v = json_object_get(park, field);
    if (v && !json_is_null(v))
        json_object_set(h, name, v);
}

json_t *republish_dead_headers(const struct job *j, const struct conf_input *in,
                               const json_t *park)
{
    json_t *h = clean_headers(j, in);
    const char *reason = json_string_value(json_object_get(park, "reason"));
    char text[REPUBLISH_ERROR_TEXT_MAX + 1];
    size_t n;

    if (!h)
        return NULL;
    copy_field(h, "x-idemq-key", park, "key");
    copy_field(h, "x-idemq-error-class", park, "error_class");
    copy_field(h, "x-idemq-error-code", park, "error_code");
    copy_field(h, "x-idemq-sqlstate", park, "sqlstate");
    copy_field(h, "x-idemq-attempts", park, "attempts");
    copy_field(h, "x-idemq-generation", park, "generation");
    copy_field(h, "x-idemq-park-id", park, "park_id");
    copy_field(h, "x-idemq-payload-sha256", park, "payload_sha256");
    copy_field(h, "x-idemq-first-attempt-at", park, "first_attempt_at");
    copy_field(h, "x-idemq-last-attempt-at", park, "last_attempt_at");
    copy_field(h, "x-idemq-parked-at", park, "parked_at");
    /* A redrive of this copy (idemq redrive, a shovel) proves it is idemq's. */
    if (!seal_put_park(h, json_string_value(json_object_get(park, "key")))) {
        json_decref(h);
        return NULL;
    }
    if (json_is_false(json_object_get(park, "redrivable"))) {
        /* the copy holds a prefix of the body (or nothing): never redriven */
        json_object_set_new(h, "x-idemq-redrivable", json_false());
        json_object_set_new(h, "x-idemq-body-size", json_integer((json_int_t)j->body_size));
    }
    if (reason) {
        /* Cut on a UTF-8 boundary: the header must stay valid text. */
        n = strlen(reason);
        if (n > REPUBLISH_ERROR_TEXT_MAX) {
            n = REPUBLISH_ERROR_TEXT_MAX;
            while (n > 0 && ((unsigned char)reason[n] & 0xC0) == 0x80)
                n--;
        }
        memcpy(text, reason, n);
        text[n] = '\0';
        json_object_set_new(h, "x-idemq-error", json_string(text));
    }
    return h;
}

idemq_err_t republish_delay(struct broker *b, const struct conf_input *in, const struct job *j,
                            long delay_ms, int attempt)
{
    char ex[TOPOLOGY_NAME_MAX], key[32], ttl[32];
    json_t *h = republish_delay_headers(j, in, attempt);
    struct broker_props p = {NULL, NULL, h, true, ttl, j->props};
    idemq_err_t err;

    if (!h)
        return IDEMQ_ERR_NOMEM;
    topology_delay_exchange(in, ex, sizeof ex);
    snprintf(key, sizeof key, "%ld", topology_bucket(delay_ms));
    snprintf(ttl, sizeof ttl, "%ld", delay_ms);
    err = broker_publish(b, ex, key, j->body, j->body_len, &p);
    json_decref(h);
    return err;
}

idemq_err_t republish_dead(struct broker *b, const struct conf_input *in, const struct job *j,
                           const json_t *park)
{
    char ex[TOPOLOGY_NAME_MAX];
    json_t *h = republish_dead_headers(j, in, park);
    struct broker_props p = {NULL, NULL, h, true, NULL, j->props};
    idemq_err_t err;

    if (!h)
        return IDEMQ_ERR_NOMEM;
    topology_dlx(in, ex, sizeof ex);
    err = broker_publish(b, ex, in->queue, j->body, j->body_len, &p);
    json_decref(h);
    return err;
}
