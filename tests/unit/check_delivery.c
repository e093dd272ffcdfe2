/* Unit tests of adapters/delivery (a message's content frames into a job,
 * within limits), fed by a fake frame source: a socketpair whose other end
 * this test writes raw AMQP frames into, under a real librabbitmq-c
 * connection state. No broker. */
#include <check.h>

#include "check_run.h"
#include <amqp.h>
#include <amqp_tcp_socket.h>
#include <openssl/evp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "delivery.h"
#include "job.h"

struct fake {
    int fd[2]; /* [0]: the connection's socket, [1]: what the test writes */
    amqp_connection_state_t conn;
    struct delivery_reader rd;
};

static void put(struct fake *f, const void *p, size_t n)
{
    ck_assert_int_eq(write(f->fd[1], p, n), (ssize_t)n);
}

static void frame(struct fake *f, uint8_t type, uint16_t ch, const void *payload, uint32_t n)
{
    uint8_t h[7] = {type, (uint8_t)(ch >> 8), (uint8_t)ch, (uint8_t)(n >> 24),
                    (uint8_t)(n >> 16), (uint8_t)(n >> 8), (uint8_t)n};
    uint8_t end = 0xCE;
    put(f, h, 7);
    if (n)
        put(f, payload, n);
    put(f, &end, 1);
}

static void fake_open(struct fake *f)
{
    amqp_socket_t *s;
    amqp_frame_t fr;
    struct timeval tv = {2, 0};
    ck_assert_int_eq(socketpair(AF_UNIX, SOCK_STREAM, 0, f->fd), 0);
    /* room for a few hundred KB in flight without a reader */
    {
        int sz = 1 << 20;
        setsockopt(f->fd[1], SOL_SOCKET, SO_SNDBUF, &sz, sizeof sz);
        setsockopt(f->fd[0], SOL_SOCKET, SO_RCVBUF, &sz, sizeof sz);
    }
    f->conn = amqp_new_connection();
    ck_assert_ptr_nonnull(s = amqp_tcp_socket_new(f->conn));
    amqp_tcp_socket_set_sockfd(s, f->fd[0]);
    /* a protocol header first takes the connection state to idle */
    put(f, "AMQP\0\0\x09\x01", 8);
    ck_assert_int_eq(amqp_simple_wait_frame_noblock(f->conn, &fr, &tv), AMQP_STATUS_OK);
    ck_assert_int_eq(delivery_reader_init(&f->rd), IDEMQ_OK);
}

static void fake_close(struct fake *f)
{
    delivery_reader_free(&f->rd);
    amqp_destroy_connection(f->conn); /* closes fd[0] */
    close(f->fd[1]);
}

/* A content header: class 60, body size, then flags and encoded properties. */
static size_t header(uint8_t *buf, uint64_t body_size, uint16_t flags, const uint8_t *props,
                     size_t plen)
{
    size_t n = 0;
    buf[n++] = 0;
    buf[n++] = 60;
    buf[n++] = 0;
    buf[n++] = 0;
    for (int i = 7; i >= 0; i--)
        buf[n++] = (uint8_t)(body_size >> (8 * i));
    buf[n++] = (uint8_t)(flags >> 8);
    buf[n++] = (uint8_t)flags;
    if (plen)
        memcpy(buf + n, props, plen);
    return n + plen;
}

static void hexsha(const void *d, size_t n, char out[65])
{
    unsigned char md[32];
    unsigned int len;
    static const char hx[] = "0123456789abcdef";
    EVP_Digest(d, n, md, &len, EVP_sha256(), NULL);
    for (int i = 0; i < 32; i++) {
        out[2 * i] = hx[md[i] >> 4];
        out[2 * i + 1] = hx[md[i] & 15];
    }
    out[64] = '\0';
}

START_TEST(test_whole_message)
{
    struct fake f;
    struct job j;
    uint8_t buf[256], props[64];
    char err[256], sha[65];
    size_t n = 0;
    /* content_type "a/b" (flag 0x8000) and headers {"k": "v"} (0x2000) */
    props[n++] = 3;
    memcpy(props + n, "a/b", 3);
    n += 3;
    {
        uint8_t tbl[] = {0, 0, 0, 7, 1, 'k', 'S', 0, 0, 0, 1, 'v'};
        tbl[3] = sizeof tbl - 4;
        memcpy(props + n, tbl, sizeof tbl);
        n += sizeof tbl;
    }
    fake_open(&f);
    job_init(&j);
    frame(&f, 2, 1, buf, (uint32_t)header(buf, 10, 0x8000 | 0x2000, props, n));
    frame(&f, 3, 1, "01234", 5);
    frame(&f, 3, 1, "56789", 5);
    ck_assert_int_eq(delivery_read(&f.rd, f.conn, 1, &j, 1000, 2000, err, sizeof err), IDEMQ_OK);
    ck_assert_int_eq(j.body_len, 10);
    ck_assert_int_eq(j.body_size, 10);
    ck_assert_mem_eq(j.body, "0123456789", 10);
    hexsha("0123456789", 10, sha);
    ck_assert_str_eq(j.sha256_hex, sha);
    ck_assert_str_eq(json_string_value(json_object_get(j.props, "content_type")), "a/b");
    ck_assert_str_eq(json_string_value(json_object_get(j.headers, "k")), "v");
    ck_assert_int_eq(j.wire_err, IDEMQ_OK);
    job_destroy(&j);
    fake_close(&f);
}
END_TEST

/* The size comes from the content header: over the limit, the body is
 * hashed whole but only a prefix is kept (never body_size bytes
 * allocated). */
START_TEST(test_oversized_body)
{
    struct fake f;
    struct job j;
    uint8_t hdr[64];
    char err[256], sha[65];
    size_t n = 50000;
    char *body = malloc(n);
    for (size_t i = 0; i < n; i++)
        body[i] = (char)('a' + i % 26);
    hexsha(body, n, sha);
    fake_open(&f);
    job_init(&j);
    frame(&f, 2, 1, hdr, (uint32_t)header(hdr, n, 0, NULL, 0));
    for (size_t off = 0; off < n; off += 20000)
        frame(&f, 3, 1, body + off, (uint32_t)(n - off < 20000 ? n - off : 20000));
    ck_assert_int_eq(delivery_read(&f.rd, f.conn, 1, &j, 1000, 2000, err, sizeof err), IDEMQ_OK);
    ck_assert_int_eq(j.body_size, n);
    ck_assert_int_eq(j.body_len, DELIVERY_PREFIX_BYTES);
    ck_assert_uint_le(j.body_cap, DELIVERY_PREFIX_BYTES + 1);
    ck_assert_mem_eq(j.body, body, DELIVERY_PREFIX_BYTES);
    ck_assert_str_eq(j.sha256_hex, sha);
    /* job_decode then parks it by size, keeping the transport's hash */
    {
        struct conf_input in;
        memset(&in, 0, sizeof in);
        in.key_kind = CONF_KEY_JSON;
        in.key_name = "job_id";
        in.max_body_bytes = 1000;
        ck_assert_int_eq(job_decode(&j, &in), IDEMQ_ERR_BODY_TOO_LARGE);
        ck_assert_str_eq(j.sha256_hex, sha);
    }
    free(body);
    job_destroy(&j);
    fake_close(&f);
}
END_TEST

/* RabbitMQ 4.3's headers of a quorum queue delivery as they come on the
 * wire: x-delivery-count (failures) and x-acquired-count (hand-outs) as
 * signed 64-bit fields ('l'); a second delivery carries x-acquired-count as
 * a long string (what a producer could send a classic queue): not a count. */
START_TEST(test_acquired_count_in_frame)
{
    struct fake f;
    struct job j;
    uint8_t hdr[128];
    uint8_t tbl[] = {0, 0, 0, 0,
                     16, 'x', '-', 'd', 'e', 'l', 'i', 'v', 'e', 'r', 'y', '-', 'c', 'o', 'u', 'n',
                     't', 'l', 0, 0, 0, 0, 0, 0, 0, 2,
                     16, 'x', '-', 'a', 'c', 'q', 'u', 'i', 'r', 'e', 'd', '-', 'c', 'o', 'u', 'n',
                     't', 'l', 0, 0, 0, 0, 0, 0, 0, 5};
    uint8_t bad[] = {0, 0, 0, 0, 16, 'x', '-', 'a', 'c', 'q', 'u', 'i', 'r', 'e', 'd', '-',
                     'c', 'o', 'u', 'n', 't', 'S', 0, 0, 0, 1, '9'};
    char err[256];
    fake_open(&f);
    job_init(&j);
    tbl[3] = sizeof tbl - 4;
    bad[3] = sizeof bad - 4;
    frame(&f, 2, 1, hdr, (uint32_t)header(hdr, 2, 0x2000, tbl, sizeof tbl));
    frame(&f, 3, 1, "{}", 2);
    ck_assert_int_eq(delivery_read(&f.rd, f.conn, 1, &j, 1000, 2000, err, sizeof err), IDEMQ_OK);
    ck_assert_int_eq(j.delivery_count, 2);
    ck_assert_int_eq(j.acquired_count, 5);
    job_reset(&j);
    frame(&f, 2, 1, hdr, (uint32_t)header(hdr, 2, 0x2000, bad, sizeof bad));
    frame(&f, 3, 1, "{}", 2);
    ck_assert_int_eq(delivery_read(&f.rd, f.conn, 1, &j, 1000, 2000, err, sizeof err), IDEMQ_OK);
    ck_assert_int_eq(j.acquired_count, -1);
    ck_assert_str_eq(json_string_value(json_object_get(j.headers, "x-acquired-count")), "9");
    job_destroy(&j);
    fake_close(&f);
}
END_TEST

/* A content header the library's decoder refuses (an unknown field type in
 * the headers table): the job says undecodable, the read side is done. */
START_TEST(test_undecodable_header)
{
    struct fake f;
    struct job j;
    uint8_t hdr[64];
    uint8_t tbl[] = {0, 0, 0, 4, 1, 'k', 'Z', 0};
    char err[256];
    fake_open(&f);
    job_init(&j);
    tbl[3] = sizeof tbl - 4;
    frame(&f, 2, 1, hdr, (uint32_t)header(hdr, 2, 0x2000, tbl, sizeof tbl));
    frame(&f, 3, 1, "{}", 2);
    ck_assert_int_eq(delivery_read(&f.rd, f.conn, 1, &j, 1000, 2000, err, sizeof err),
                     IDEMQ_ERR_UNDECODABLE);
    ck_assert_int_eq(j.wire_err, IDEMQ_ERR_UNDECODABLE);
    ck_assert_ptr_nonnull(strstr(j.wire_reason, "cannot decode"));
    ck_assert_ptr_nonnull(strstr(err, "cannot read further"));
    {
        struct conf_input in;
        memset(&in, 0, sizeof in);
        in.key_kind = CONF_KEY_JSON;
        in.key_name = "job_id";
        in.max_body_bytes = 1000;
        ck_assert_int_eq(job_decode(&j, &in), IDEMQ_ERR_UNDECODABLE);
        ck_assert(!j.has_key);
    }
    job_destroy(&j);
    fake_close(&f);
}
END_TEST

/* Framing the broker broke (a body on another channel, a method frame
 * where the header belongs, a body frame past the announced size): a
 * connection failure, not the message's. */
START_TEST(test_broken_framing)
{
    uint8_t hdr[64];
    char err[256];
    for (int c = 0; c < 3; c++) {
        struct fake f;
        struct job j;
        fake_open(&f);
        job_init(&j);
        if (c == 1) {
            /* a method frame (basic.ack, tag 1) where the header belongs */
            uint8_t m[13] = {0, 60, 0, 80, 0, 0, 0, 0, 0, 0, 0, 1, 0};
            frame(&f, 1, 1, m, 13);
        } else {
            frame(&f, 2, 1, hdr, (uint32_t)header(hdr, 4, 0, NULL, 0));
            if (c == 0)
                frame(&f, 3, 2, "abcd", 4); /* wrong channel */
            else
                frame(&f, 3, 1, "abcdefgh", 8); /* past body_size */
        }
        ck_assert_int_eq(delivery_read(&f.rd, f.conn, 1, &j, 1000, 2000, err, sizeof err),
                         IDEMQ_ERR_BROKER);
        job_destroy(&j);
        fake_close(&f);
    }
}
END_TEST

/* Headers over the depth limit within one frame: kept truncated, flagged. */
START_TEST(test_deep_headers_in_frame)
{
    struct fake f;
    struct job j;
    uint8_t *tbl = malloc(4096), *hdr = malloc(8192);
    size_t n = 0;
    int depth = 40;
    char err[256];
    /* {"n": {"n": ... {"n": 1}}}: each level is a 4-byte table length, the
     * name "n" and a type ('F' table, innermost 'I'); the lengths are
     * filled in on the way back out */
    size_t starts[64];
    for (int d = 0; d < depth; d++) {
        starts[d] = n;
        n += 4; /* table length, filled below */
        tbl[n++] = 1;
        tbl[n++] = 'n';
        tbl[n++] = d == depth - 1 ? 'I' : 'F';
    }
    tbl[n++] = 0;
    tbl[n++] = 0;
    tbl[n++] = 0;
    tbl[n++] = 1;
    for (int d = depth - 1; d >= 0; d--) {
        uint32_t len = (uint32_t)(n - starts[d] - 4);
        tbl[starts[d]] = (uint8_t)(len >> 24);
        tbl[starts[d] + 1] = (uint8_t)(len >> 16);
        tbl[starts[d] + 2] = (uint8_t)(len >> 8);
        tbl[starts[d] + 3] = (uint8_t)len;
    }
    fake_open(&f);
    job_init(&j);
    frame(&f, 2, 1, hdr, (uint32_t)header(hdr, 2, 0x2000, tbl, n));
    frame(&f, 3, 1, "{}", 2);
    ck_assert_int_eq(delivery_read(&f.rd, f.conn, 1, &j, 1000, 2000, err, sizeof err), IDEMQ_OK);
    ck_assert_int_eq(j.wire_err, IDEMQ_ERR_HEADERS_TOO_DEEP);
    ck_assert_ptr_nonnull(json_object_get(j.headers, "n"));
    free(tbl);
    free(hdr);
    job_destroy(&j);
    fake_close(&f);
}
END_TEST

/* a wire timestamp of 2^63 or more is kept as its 64 bits (it goes
 * back out unchanged on copies) and reads as no timestamp, without a
 * signed overflow anywhere (the sanitizer build aborts on one). */
START_TEST(test_timestamp_out_of_range)
{
    const uint64_t wire[] = {1ULL << 63, UINT64_MAX, 0};
    const json_int_t stored[] = {INT64_MIN, -1, 0};
    struct amqp_table_limits lim;
    amqp_table_default_limits(&lim);
    for (int i = 0; i < 3; i++) {
        amqp_basic_properties_t p;
        struct job j;
        long long ts;
        memset(&p, 0, sizeof p);
        p._flags = AMQP_BASIC_TIMESTAMP_FLAG;
        p.timestamp = wire[i];
        job_init(&j);
        ck_assert_int_eq(delivery_props_to_job(&p, &j, &lim), IDEMQ_OK);
        ck_assert(json_integer_value(json_object_get(j.props, "timestamp")) == stored[i]);
        ck_assert((uint64_t)json_integer_value(json_object_get(j.props, "timestamp")) == wire[i]);
        ck_assert(!job_timestamp(&j, 1780000000LL, &ts));
        ck_assert_int_eq(job_age_s(&j, 1780000000LL), -1);
        job_destroy(&j);
    }
}
END_TEST

int main(void)
{
    Suite *s = suite_create("delivery");
    TCase *tc = tcase_create("delivery");
    tcase_add_test(tc, test_whole_message);
    tcase_add_test(tc, test_oversized_body);
    tcase_add_test(tc, test_undecodable_header);
    tcase_add_test(tc, test_acquired_count_in_frame);
    tcase_add_test(tc, test_broken_framing);
    tcase_add_test(tc, test_deep_headers_in_frame);
    tcase_add_test(tc, test_timestamp_out_of_range);
    suite_add_tcase(s, tc);
    return check_run(s);
}
