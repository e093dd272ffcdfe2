/*
 * giveback: a channel's unsettled deliveries back to their queues, one
 * frame each (see giveback.h for the order and why).
 */
#include "giveback.h"

#include <stdbool.h>
#include <string.h>

idemq_err_t giveback_send(amqp_connection_state_t conn, amqp_channel_t ch, struct acks *a,
                          const char *const *consumer_tags, int n_tags, uint64_t failed_tag,
                          struct giveback_counts *counts)
{
    struct giveback_counts k;
    struct acks_op op;

    memset(&k, 0, sizeof k);
    for (int i = 0; i < n_tags; i++) {
        amqp_basic_cancel_t req;
        req.consumer_tag = amqp_cstring_bytes(consumer_tags[i]);
        req.nowait = 1;
        if (amqp_send_method(conn, ch, AMQP_BASIC_CANCEL_METHOD, &req) != AMQP_STATUS_OK)
            goto failed;
        k.cancelled++;
    }
    while (acks_next(a, &op)) {
        if (amqp_basic_ack(conn, ch, op.tag, op.multiple) != AMQP_STATUS_OK)
            goto failed;
        k.acked++;
    }
    /* What is left is unsettled (or gone, which acks_next skips): give each
     * back on its own, lowest tag first, except a single active consumer's,
     * which the channel's close returns. */
    while (acks_outstanding(a)) {
        uint64_t tag = acks_first_unsettled(a);
        bool with_close;
        int rc;
        if (!tag)
            break;
        with_close = acks_with_close(a, tag);
        acks_drop(a, tag, false);
        if (with_close) {
            k.with_close++;
            continue;
        }
        if (tag == failed_tag) {
            rc = amqp_basic_reject(conn, ch, tag, 1);
            k.rejected++;
        } else {
            rc = amqp_basic_nack(conn, ch, tag, 0, 1);
            k.nacked++;
        }
        if (rc != AMQP_STATUS_OK)
            goto failed;
    }
    acks_reset(a);
    if (counts)
        *counts = k;
    return IDEMQ_OK;
failed:
    if (counts)
        *counts = k;
    return IDEMQ_ERR_BROKER;
}
