/* Unit tests of adapters/giveback (a channel's unsettled deliveries back to
 * their queues before the close), on a fake frame source: a socketpair
 * under a real librabbitmq-c connection state. The test reads every byte
 * the connection sends and checks the exact frames: the cancels (nowait),
 * the acks the tracker allows, then one basic.nack(requeue, not multiple)
 * per delivery returned for idemq's reasons and one basic.reject(requeue)
 * for the delivery that failed, which is the only return RabbitMQ 4.3
 * counts toward a quorum queue's delivery limit. No broker. */
#include <check.h>

#include "check_run.h"
#include <amqp.h>
#include <amqp_tcp_socket.h>
#include <fcntl.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "acks.h"
#include "giveback.h"

struct fake {
    int fd[2]; /* [0]: the connection's socket, [1]: the test's end */
    amqp_connection_state_t conn;
};

static void fake_open(struct fake *f)
{
    amqp_socket_t *s;
    amqp_frame_t fr;
    struct timeval tv = {2, 0};
    ck_assert_int_eq(socketpair(AF_UNIX, SOCK_STREAM, 0, f->fd), 0);
    f->conn = amqp_new_connection();
    ck_assert_ptr_nonnull(s = amqp_tcp_socket_new(f->conn));
    amqp_tcp_socket_set_sockfd(s, f->fd[0]);
    /* a protocol header takes the connection state to idle */
    ck_assert_int_eq(write(f->fd[1], "AMQP\0\0\x09\x01", 8), 8);
    ck_assert_int_eq(amqp_simple_wait_frame_noblock(f->conn, &fr, &tv), AMQP_STATUS_OK);
}

static void fake_close(struct fake *f)
{
    amqp_destroy_connection(f->conn);
    close(f->fd[1]);
}

static uint64_t be64(const uint8_t *p)
{
    uint64_t v = 0;
    for (int i = 0; i < 8; i++)
        v = v << 8 | p[i];
    return v;
}

/* Everything sent so far, decoded into one line per frame:
 * "cancel TAG nowait=B", "ack T multiple=B", "nack T multiple=B requeue=B",
 * "reject T requeue=B", or "frame TYPE" for anything else. */
static void sent(struct fake *f, char *out, size_t outlen)
{
    static uint8_t buf[65536];
    size_t n = 0, at = 0, o = 0;
    ssize_t r;
    fcntl(f->fd[1], F_SETFL, O_NONBLOCK);
    while ((r = read(f->fd[1], buf + n, sizeof buf - n)) > 0)
        n += (size_t)r;
    out[0] = '\0';
    while (at + 8 <= n) {
        uint8_t type = buf[at];
        uint32_t size = (uint32_t)buf[at + 3] << 24 | (uint32_t)buf[at + 4] << 16 |
                        (uint32_t)buf[at + 5] << 8 | buf[at + 6];
        const uint8_t *p = buf + at + 7;
        ck_assert_uint_le(at + 8 + size, n);
        ck_assert_uint_eq(p[size], 0xCE);
        ck_assert_uint_eq((unsigned)(buf[at + 1] << 8 | buf[at + 2]), 1); /* channel 1 */
        if (type == 1 && size >= 4) {
            unsigned cls = (unsigned)(p[0] << 8 | p[1]), mth = (unsigned)(p[2] << 8 | p[3]);
            if (cls == 60 && mth == 30) /* basic.cancel: shortstr tag, bits */
                o += (size_t)snprintf(out + o, outlen - o, "cancel %.*s nowait=%d\n", p[4],
                                      (const char *)p + 5, p[5 + p[4]] & 1);
            else if (cls == 60 && mth == 80)
                o += (size_t)snprintf(out + o, outlen - o, "ack %llu multiple=%d\n",
                                      (unsigned long long)be64(p + 4), p[12] & 1);
            else if (cls == 60 && mth == 120)
                o += (size_t)snprintf(out + o, outlen - o, "nack %llu multiple=%d requeue=%d\n",
                                      (unsigned long long)be64(p + 4), p[12] & 1,
                                      (p[12] >> 1) & 1);
            else if (cls == 60 && mth == 90)
                o += (size_t)snprintf(out + o, outlen - o, "reject %llu requeue=%d\n",
                                      (unsigned long long)be64(p + 4), p[12] & 1);
            else
                o += (size_t)snprintf(out + o, outlen - o, "method %u.%u\n", cls, mth);
        } else {
            o += (size_t)snprintf(out + o, outlen - o, "frame %u\n", type);
        }
        ck_assert_uint_lt(o, outlen);
        at += 8 + size;
    }
    ck_assert_uint_eq(at, n); /* whole frames only */
}

/* Deliveries 1..6: 1 and 2 settled (one multiple ack), 3 unsettled (held by
 * a lane), 4 settled (a single ack beyond it), 5 the one whose attempt
 * failed, 6 rejected to the dead-letter path earlier (gone: nothing). */
START_TEST(test_frames_one_at_a_time)
{
    struct fake f;
    struct acks a;
    struct giveback_counts k;
    const char *tags[] = {"idemq.w0.in", "idemq.w0.in.lane1"};
    char out[2048];
    fake_open(&f);
    acks_init(&a);
    for (uint64_t t = 1; t <= 6; t++)
        ck_assert_int_eq(acks_received(&a, t), IDEMQ_OK);
    ck_assert(acks_settle(&a, 1));
    ck_assert(acks_settle(&a, 2));
    ck_assert(acks_settle(&a, 4));
    ck_assert(acks_gone(&a, 6));
    ck_assert_int_eq(giveback_send(f.conn, 1, &a, tags, 2, 5, &k), IDEMQ_OK);
    sent(&f, out, sizeof out);
    ck_assert_str_eq(out, "cancel idemq.w0.in nowait=1\n"
                          "cancel idemq.w0.in.lane1 nowait=1\n"
                          "ack 2 multiple=1\n"
                          "ack 4 multiple=0\n"
                          "nack 3 multiple=0 requeue=1\n"
                          "reject 5 requeue=1\n");
    ck_assert_int_eq(k.cancelled, 2);
    ck_assert_int_eq(k.acked, 2);
    ck_assert_int_eq(k.nacked, 1);
    ck_assert_int_eq(k.rejected, 1);
    ck_assert_uint_eq(acks_outstanding(&a), 0);
    acks_free(&a);
    fake_close(&f);
}
END_TEST

/* Nothing failed (a drain, a database outage): every unsettled delivery is
 * nacked on its own, never with multiple; none is rejected. */
START_TEST(test_no_failure_no_reject)
{
    struct fake f;
    struct acks a;
    struct giveback_counts k;
    char out[2048];
    fake_open(&f);
    acks_init(&a);
    for (uint64_t t = 10; t <= 13; t++)
        ck_assert_int_eq(acks_received(&a, t), IDEMQ_OK);
    ck_assert_int_eq(giveback_send(f.conn, 1, &a, NULL, 0, 0, &k), IDEMQ_OK);
    sent(&f, out, sizeof out);
    ck_assert_str_eq(out, "nack 10 multiple=0 requeue=1\n"
                          "nack 11 multiple=0 requeue=1\n"
                          "nack 12 multiple=0 requeue=1\n"
                          "nack 13 multiple=0 requeue=1\n");
    ck_assert_int_eq(k.nacked, 4);
    ck_assert_int_eq(k.rejected, 0);
    /* a failed tag that is not outstanding (an earlier channel's) is no reject */
    ck_assert_int_eq(acks_received(&a, 14), IDEMQ_OK);
    ck_assert_int_eq(giveback_send(f.conn, 1, &a, NULL, 0, 99, &k), IDEMQ_OK);
    sent(&f, out, sizeof out);
    ck_assert_str_eq(out, "nack 14 multiple=0 requeue=1\n");
    acks_free(&a);
    fake_close(&f);
}
END_TEST

/* A single active consumer's deliveries (an ordered lane's) get no frame:
 * the channel's close returns them and removes the consumer in one step,
 * so a standby replica cannot take later messages first. The caller names
 * only the other consumers to cancel; a lane delivery that failed is no
 * reject either (the close counts it). */
START_TEST(test_single_active_left_to_close)
{
    struct fake f;
    struct acks a;
    struct giveback_counts k;
    const char *tags[] = {"idemq/in/w"};
    char out[2048];
    fake_open(&f);
    acks_init(&a);
    for (uint64_t t = 1; t <= 5; t++)
        ck_assert_int_eq(acks_received(&a, t), IDEMQ_OK);
    ck_assert(acks_mark_with_close(&a, 2));
    ck_assert(acks_mark_with_close(&a, 3));
    ck_assert(acks_mark_with_close(&a, 5));
    ck_assert(!acks_mark_with_close(&a, 9)); /* not outstanding */
    ck_assert(acks_settle(&a, 1));
    ck_assert(acks_settle(&a, 5)); /* settled: acked like any other */
    ck_assert(acks_with_close(&a, 2));
    ck_assert(!acks_with_close(&a, 4));
    ck_assert_int_eq(giveback_send(f.conn, 1, &a, tags, 1, 3, &k), IDEMQ_OK);
    sent(&f, out, sizeof out);
    ck_assert_str_eq(out, "cancel idemq/in/w nowait=1\n"
                          "ack 1 multiple=0\n"
                          "ack 5 multiple=0\n"
                          "nack 4 multiple=0 requeue=1\n");
    ck_assert_int_eq(k.with_close, 2);
    ck_assert_int_eq(k.nacked, 1);
    ck_assert_int_eq(k.rejected, 0);
    ck_assert_uint_eq(acks_outstanding(&a), 0);
    /* a new channel: the mark goes with the reset */
    acks_reset(&a);
    ck_assert_int_eq(acks_received(&a, 2), IDEMQ_OK);
    ck_assert(!acks_with_close(&a, 2));
    acks_free(&a);
    fake_close(&f);
}
END_TEST

/* The peer is gone: the first frame that cannot be sent stops it. */
START_TEST(test_connection_gone)
{
    struct fake f;
    struct acks a;
    struct giveback_counts k;
    fake_open(&f);
    acks_init(&a);
    ck_assert_int_eq(acks_received(&a, 1), IDEMQ_OK);
    close(f.fd[1]);
    f.fd[1] = -1;
    signal(SIGPIPE, SIG_IGN);
    ck_assert_int_eq(giveback_send(f.conn, 1, &a, NULL, 0, 1, &k), IDEMQ_ERR_BROKER);
    acks_free(&a);
    amqp_destroy_connection(f.conn);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("giveback");
    TCase *tc = tcase_create("giveback");
    tcase_add_test(tc, test_frames_one_at_a_time);
    tcase_add_test(tc, test_no_failure_no_reject);
    tcase_add_test(tc, test_single_active_left_to_close);
    tcase_add_test(tc, test_connection_gone);
    suite_add_tcase(s, tc);
    return check_run(s);
}
