/* Unit tests of consumer/job: decoding and key extraction, every bad-input
 * case of the message contract. */
#include <check.h>

#include "check_run.h"
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "conf.h"
#include "job.h"
#include "seal.h"

static struct conf_input input(enum conf_key_kind kind, const char *name, int max_body)
{
    struct conf_input in;
    memset(&in, 0, sizeof in);
    in.name = "t";
    in.queue = "q";
    in.key_kind = kind;
    in.key_name = (char *)name;
    in.max_body_bytes = max_body;
    return in;
}

static idemq_err_t decode(struct job *j, const struct conf_input *in, const char *body)
{
    ck_assert_int_eq(job_set_body(j, body, strlen(body)), IDEMQ_OK);
    return job_decode(j, in);
}

START_TEST(test_json_key)
{
    struct job j;
    struct conf_input in = input(CONF_KEY_JSON, "job_id", 1024);
    job_init(&j);
    ck_assert_int_eq(decode(&j, &in, "{\"job_id\":\"payout:inv-123\",\"amount\":10.25}"), IDEMQ_OK);
    ck_assert(j.has_key);
    ck_assert_str_eq(j.key, "payout:inv-123");
    ck_assert_int_eq(strlen(j.sha256_hex), 64);
    job_reset(&j);
    ck_assert_int_eq(decode(&j, &in, "{\"job_id\":12345}"), IDEMQ_OK);
    ck_assert_str_eq(j.key, "12345");
    job_destroy(&j);
}
END_TEST

START_TEST(test_sha256_of_raw_body)
{
    struct job j;
    struct conf_input in = input(CONF_KEY_JSON, "job_id", 1024);
    job_init(&j);
    decode(&j, &in, "abc");
    /* SHA-256("abc"), FIPS 180-2 test vector */
    ck_assert_str_eq(j.sha256_hex,
                     "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
    job_destroy(&j);
}
END_TEST

START_TEST(test_bad_bodies)
{
    struct job j;
    struct conf_input in = input(CONF_KEY_JSON, "job_id", 64);
    char big[200];
    job_init(&j);
    ck_assert_int_eq(decode(&j, &in, "{not json"), IDEMQ_ERR_BAD_JSON);
    ck_assert_ptr_nonnull(strstr(j.reason, "invalid JSON"));
    ck_assert_int_eq(decode(&j, &in, ""), IDEMQ_ERR_BAD_JSON);
    ck_assert_int_eq(decode(&j, &in, "[1,2]"), IDEMQ_ERR_NOT_OBJECT);
    /* valid JSON that is not an object is not_object, not bad_json */
    ck_assert_int_eq(decode(&j, &in, "\"str\""), IDEMQ_ERR_NOT_OBJECT);
    ck_assert_ptr_nonnull(strstr(j.reason, "a string"));
    ck_assert_int_eq(decode(&j, &in, "null"), IDEMQ_ERR_NOT_OBJECT);
    ck_assert_int_eq(decode(&j, &in, "12.5"), IDEMQ_ERR_NOT_OBJECT);
    ck_assert_int_eq(decode(&j, &in, "true"), IDEMQ_ERR_NOT_OBJECT);
    ck_assert_int_eq(decode(&j, &in, "{\"job_id\":\"a\"} trailing"), IDEMQ_ERR_BAD_JSON);
    memset(big, 'x', sizeof big - 1);
    big[sizeof big - 1] = '\0';
    ck_assert_int_eq(decode(&j, &in, big), IDEMQ_ERR_BODY_TOO_LARGE);
    ck_assert_ptr_nonnull(strstr(j.reason, "max_body_bytes is 64"));
    /* invalid UTF-8 inside a JSON string */
    ck_assert_int_eq(job_set_body(&j, "{\"job_id\":\"\xff\"}", 15), IDEMQ_OK);
    ck_assert_int_eq(job_decode(&j, &in), IDEMQ_ERR_BAD_JSON);
    /* NUL escapes are refused: PostgreSQL text cannot hold them */
    ck_assert_int_eq(decode(&j, &in, "{\"job_id\":\"a\\u0000b\"}"), IDEMQ_ERR_BAD_JSON);
    job_destroy(&j);
}
END_TEST

START_TEST(test_bad_keys)
{
    struct job j;
    struct conf_input in = input(CONF_KEY_JSON, "job_id", 4096);
    char body[600];
    job_init(&j);
    ck_assert_int_eq(decode(&j, &in, "{\"other\":1}"), IDEMQ_ERR_KEY_MISSING);
    ck_assert_ptr_nonnull(strstr(j.reason, "field job_id is missing"));
    /* present but null is not "missing" */
    ck_assert_int_eq(decode(&j, &in, "{\"job_id\":null}"), IDEMQ_ERR_KEY_NULL);
    ck_assert_ptr_nonnull(strstr(j.reason, "field job_id is null"));
    ck_assert_int_eq(decode(&j, &in, "{\"job_id\":\"\"}"), IDEMQ_ERR_KEY_EMPTY);
    ck_assert_int_eq(decode(&j, &in, "{\"job_id\":{\"a\":1}}"), IDEMQ_ERR_KEY_INVALID);
    ck_assert_int_eq(decode(&j, &in, "{\"job_id\":1.5}"), IDEMQ_ERR_KEY_INVALID);
    ck_assert_int_eq(decode(&j, &in, "{\"job_id\":true}"), IDEMQ_ERR_KEY_INVALID);
    strcpy(body, "{\"job_id\":\"");
    memset(body + strlen(body), 'k', 257);
    strcpy(body + 11 + 257, "\"}");
    ck_assert_int_eq(decode(&j, &in, body), IDEMQ_ERR_KEY_TOO_LONG);
    body[11 + 256] = '"';
    body[11 + 257] = '}';
    body[11 + 258] = '\0';
    ck_assert_int_eq(decode(&j, &in, body), IDEMQ_OK); /* exactly 256 bytes is fine */
    ck_assert_int_eq(strlen(j.key), 256);
    ck_assert(!j.has_key == 0);
    job_destroy(&j);
}
END_TEST

START_TEST(test_header_and_message_id_keys)
{
    struct job j;
    struct conf_input hin = input(CONF_KEY_HEADER, "idempotency-key", 64);
    struct conf_input min = input(CONF_KEY_MESSAGE_ID, NULL, 64);
    job_init(&j);
    json_object_set_new(j.headers, "idempotency-key", json_string("acct:9"));
    ck_assert_int_eq(decode(&j, &hin, "{}"), IDEMQ_OK);
    ck_assert_str_eq(j.key, "acct:9");
    /* body errors still keep the key for the park row */
    ck_assert_int_eq(decode(&j, &hin, "nope"), IDEMQ_ERR_BAD_JSON);
    ck_assert(j.has_key);
    ck_assert_str_eq(j.key, "acct:9");
    json_object_clear(j.headers);
    ck_assert_int_eq(decode(&j, &hin, "{}"), IDEMQ_ERR_KEY_MISSING);
    ck_assert_ptr_nonnull(strstr(j.reason, "header idempotency-key"));
    json_object_set_new(j.headers, "idempotency-key", json_pack("{s:s}", "$bytes_hex", "ff"));
    ck_assert_int_eq(decode(&j, &hin, "{}"), IDEMQ_ERR_KEY_INVALID);

    job_reset(&j);
    ck_assert_int_eq(decode(&j, &min, "{}"), IDEMQ_ERR_KEY_MISSING);
    strcpy(j.message_id, "m-1");
    j.has_message_id = true;
    ck_assert_int_eq(decode(&j, &min, "{}"), IDEMQ_OK);
    ck_assert_str_eq(j.key, "m-1");
    strcpy(j.message_id, "\xc3\x28");
    ck_assert_int_eq(decode(&j, &min, "{}"), IDEMQ_ERR_KEY_INVALID);
    j.message_id[0] = '\0';
    ck_assert_int_eq(decode(&j, &min, "{}"), IDEMQ_ERR_KEY_EMPTY);
    job_destroy(&j);
}
END_TEST

/* Ordered inputs: ordering key and sequence; a missing or bad one is a
 * named permanent decode error. Standard inputs ignore them. */
START_TEST(test_order_key_and_sequence)
{
    struct job j;
    struct conf_input in = {.max_body_bytes = 1024, .key_kind = CONF_KEY_JSON,
                            .key_name = "job_id", .partitions = 4,
                            .order_kind = CONF_KEY_JSON, .order_name = "auth",
                            .seq_name = "seq"};
    job_init(&j);
    ck_assert_int_eq(decode(&j, &in, "{\"job_id\":\"k\",\"auth\":\"a1\",\"seq\":3}"),
                     IDEMQ_OK);
    ck_assert(j.has_order_key && j.has_seq);
    ck_assert_str_eq(j.order_key, "a1");
    ck_assert_int_eq(j.seq, 3);
    ck_assert_int_eq(decode(&j, &in, "{\"job_id\":\"k\",\"seq\":3}"), IDEMQ_ERR_KEY_MISSING);
    ck_assert_ptr_nonnull(strstr(j.reason, "ordering key field auth"));
    ck_assert_int_eq(decode(&j, &in, "{\"job_id\":\"k\",\"auth\":\"a1\",\"seq\":0}"),
                     IDEMQ_ERR_SEQUENCE_INVALID);
    ck_assert_int_eq(decode(&j, &in, "{\"job_id\":\"k\",\"auth\":\"a1\",\"seq\":\"2\"}"),
                     IDEMQ_ERR_SEQUENCE_INVALID);
    ck_assert_int_eq(decode(&j, &in, "{\"job_id\":\"k\",\"auth\":\"a1\"}"),
                     IDEMQ_ERR_SEQUENCE_INVALID);
    in.partitions = 0; /* a standard input never reads them */
    ck_assert_int_eq(decode(&j, &in, "{\"job_id\":\"k\"}"), IDEMQ_OK);
    ck_assert(!j.has_order_key);
    job_destroy(&j);
}
END_TEST

START_TEST(test_utf8)
{
    ck_assert(job_utf8_valid((const unsigned char *)"h\xc3\xa9llo", 6));
    ck_assert(job_utf8_valid((const unsigned char *)"\xf0\x9f\x98\x80", 4));
    ck_assert(!job_utf8_valid((const unsigned char *)"\xc3", 1));
    ck_assert(!job_utf8_valid((const unsigned char *)"\xc0\xaf", 2));       /* overlong */
    ck_assert(!job_utf8_valid((const unsigned char *)"\xed\xa0\x80", 3));   /* surrogate */
    ck_assert(!job_utf8_valid((const unsigned char *)"a\0b", 3));
    {
        char rk[] = "ok.\xff\xc3\xa9.\xed\xa0\x80";
        job_utf8_sanitize(rk);
        ck_assert_str_eq(rk, "ok.?\xc3\xa9.???");
        ck_assert(job_utf8_valid((unsigned char *)rk, strlen(rk)));
    }
}
END_TEST

/* A key field named twice would make the business key depend on which
 * parser reads the body: refused, with a named code and no key. */
START_TEST(test_duplicate_field)
{
    struct job j;
    struct conf_input in = input(CONF_KEY_JSON, "job_id", 4096);
    job_init(&j);
    ck_assert_int_eq(decode(&j, &in, "{\"job_id\":\"A\",\"job_id\":\"B\"}"),
                     IDEMQ_ERR_DUPLICATE_FIELD);
    ck_assert(!j.has_key);
    ck_assert_ptr_nonnull(strstr(j.reason, "duplicate field name"));
    ck_assert_str_eq(idemq_err_name(j.decode_err), "duplicate_field");
    /* nested duplicates too */
    ck_assert_int_eq(decode(&j, &in, "{\"job_id\":\"A\",\"m\":{\"x\":1,\"x\":2}}"),
                     IDEMQ_ERR_DUPLICATE_FIELD);
    job_destroy(&j);
}
END_TEST

/* What the transport could not take comes first: the size from the content
 * header (only a prefix held), headers over the limits (key still taken),
 * a delivery the library could not decode (nothing trusted). */
/* A raw NUL byte right after a number or a literal: jansson 2.14 skips it
 * and accepts the body, but the body then travels in the batch document, a
 * C string to PostgreSQL, cut at the NUL; the whole batch failed and the job
 * was parked as an effect error (22P02), not as bad_json. Found by
 * tests/fuzz/fuzz_delivery (corpus file nul_after_number). */
START_TEST(test_nul_byte_in_body)
{
#define BODY(text) {text, sizeof text - 1}
    static const struct {
        const char *s;
        size_t n;
    } bodies[] = {
        BODY("{\"job_id\":42,\"seq\":9007199254740\0}"), /* after a number */
        BODY("{\"job_id\":\"a\",\"ok\":true\0}"),          /* after a literal */
        BODY("{\"job_id\":\"a\",\"n\":null\0,\"m\":1}"),
        BODY("{\"job_id\":\"a\"}\0"), /* after the object */
    };
#undef BODY
    struct job j;
    struct conf_input in = input(CONF_KEY_JSON, "job_id", 1024);
    job_init(&j);
    for (size_t i = 0; i < sizeof bodies / sizeof bodies[0]; i++) {
        ck_assert_ptr_nonnull(memchr(bodies[i].s, 0, bodies[i].n));
        ck_assert_int_eq(job_set_body(&j, bodies[i].s, bodies[i].n), IDEMQ_OK);
        ck_assert_msg(job_decode(&j, &in) == IDEMQ_ERR_BAD_JSON, "body %zu decoded as %s", i,
                      idemq_err_name(j.decode_err));
        ck_assert_ptr_nonnull(strstr(j.reason, "NUL"));
        job_reset(&j);
    }
    job_destroy(&j);
}
END_TEST

START_TEST(test_wire_errors)
{
    struct job j;
    struct conf_input in = input(CONF_KEY_JSON, "job_id", 64);
    unsigned char md[32] = {0xab};
    job_init(&j);
    ck_assert_int_eq(job_set_body(&j, "{\"job_id\":\"k\"}", 14), IDEMQ_OK);
    j.body_size = 1u << 30; /* the content header said 1 GiB; a prefix was kept */
    job_set_digest(&j, md);
    ck_assert_int_eq(job_decode(&j, &in), IDEMQ_ERR_BODY_TOO_LARGE);
    ck_assert_ptr_nonnull(strstr(j.reason, "body is 1073741824 bytes"));
    ck_assert(strncmp(j.sha256_hex, "ab00", 4) == 0); /* the transport's hash stays */

    job_reset(&j);
    ck_assert_int_eq(job_set_body(&j, "{\"job_id\":\"k2\"}", 15), IDEMQ_OK);
    j.wire_err = IDEMQ_ERR_HEADERS_TOO_DEEP;
    snprintf(j.wire_reason, sizeof j.wire_reason, "headers nest deeper than 16 levels");
    ck_assert_int_eq(job_decode(&j, &in), IDEMQ_ERR_HEADERS_TOO_DEEP);
    ck_assert(j.has_key); /* parked with its key */
    ck_assert_str_eq(j.key, "k2");
    ck_assert_ptr_nonnull(strstr(j.reason, "deeper"));

    job_reset(&j);
    j.wire_err = IDEMQ_ERR_UNDECODABLE;
    snprintf(j.wire_reason, sizeof j.wire_reason, "cannot decode");
    ck_assert_int_eq(job_decode(&j, &in), IDEMQ_ERR_UNDECODABLE);
    ck_assert(!j.has_key);
    ck_assert_str_eq(j.reason, "cannot decode");
    ck_assert_int_eq(strlen(j.sha256_hex), 64); /* of the empty body */
    job_destroy(&j);
}
END_TEST

START_TEST(test_body_buffer_reuse)
{
    struct job j;
    unsigned char *first;
    job_init(&j);
    ck_assert_int_eq(job_set_body(&j, "0123456789", 10), IDEMQ_OK);
    first = j.body;
    job_reset(&j);
    ck_assert_int_eq(job_set_body(&j, "abc", 3), IDEMQ_OK);
    ck_assert_ptr_eq(j.body, first); /* no per-message allocation once warm */
    ck_assert_int_eq(j.body_len, 3);
    ck_assert_int_eq(j.delivery_count, -1);
    job_destroy(&j);
}
END_TEST

/* a producer's AMQP timestamp counts only when it is plausible: on or
 * after 2000-01-01 and at most JOB_TIMESTAMP_FUTURE_S ahead; 0, ancient,
 * far-future and wrapped (>= 2^63, read back negative) values are absent,
 * and the age never overflows. */
START_TEST(test_timestamp_plausible)
{
    struct job j;
    long long ts = -1, now = 1780000000LL; /* 2026 */
    job_init(&j);
    ck_assert(!job_timestamp(&j, now, &ts)); /* no timestamp property */
    ck_assert_int_eq(job_age_s(&j, now), -1);
    json_object_set_new(j.props, "timestamp", json_integer(0));
    ck_assert(!job_timestamp(&j, now, &ts));
    ck_assert_int_eq(job_age_s(&j, now), -1);
    json_object_set_new(j.props, "timestamp", json_integer(946684799LL));
    ck_assert(!job_timestamp(&j, now, &ts));
    json_object_set_new(j.props, "timestamp", json_integer(946684800LL));
    ck_assert(job_timestamp(&j, now, &ts));
    ck_assert_int_eq(ts, 946684800LL);
    ck_assert_int_eq(job_age_s(&j, now), now - 946684800LL);
    json_object_set_new(j.props, "timestamp", json_integer(now - 3600));
    ck_assert_int_eq(job_age_s(&j, now), 3600);
    json_object_set_new(j.props, "timestamp", json_integer(now + JOB_TIMESTAMP_FUTURE_S));
    ck_assert(job_timestamp(&j, now, &ts));
    ck_assert_int_eq(job_age_s(&j, now), 0); /* a clock a little ahead: age 0 */
    json_object_set_new(j.props, "timestamp", json_integer(now + JOB_TIMESTAMP_FUTURE_S + 1));
    ck_assert(!job_timestamp(&j, now, &ts));
    json_object_set_new(j.props, "timestamp", json_integer(INT64_MAX));
    ck_assert(!job_timestamp(&j, now, &ts));
    ck_assert_int_eq(job_age_s(&j, now), -1);
    json_object_set_new(j.props, "timestamp", json_integer(INT64_MIN)); /* 2^63 on the wire */
    ck_assert(!job_timestamp(&j, now, &ts));
    ck_assert_int_eq(job_age_s(&j, now), -1);
    json_object_set_new(j.props, "timestamp", json_string("1780000000"));
    ck_assert(!job_timestamp(&j, now, &ts));
    job_destroy(&j);
}
END_TEST

/* job_decode accepts a redrive header only with idemq's seal over key,
 * generation and park id; x-idemq-redriven-by only with its own seal. */
START_TEST(test_redrive_seal)
{
    struct job j;
    struct conf_input in = input(CONF_KEY_JSON, "job_id", 1024);
    const unsigned char secret[32] = "0123456789abcdef0123456789abcde";
    char s[SEAL_HEX], by[SEAL_HEX];
    ck_assert(seal_set_secret(secret, sizeof secret));
    ck_assert(seal_park("K", 0, 7, s));
    ck_assert(seal_by("K", 0, 7, "alice@host", by));
    job_init(&j);
    /* no generation: nothing to prove */
    ck_assert_int_eq(decode(&j, &in, "{\"job_id\":\"K\"}"), IDEMQ_OK);
    /* a generation without a seal, or with a wrong one */
    job_reset(&j);
    json_object_set_new(j.headers, "x-idemq-generation", json_integer(0));
    ck_assert_int_eq(decode(&j, &in, "{\"job_id\":\"K\"}"), IDEMQ_ERR_FORGED_REDRIVE);
    ck_assert_ptr_nonnull(strstr(j.reason, "x-idemq-seal"));
    job_reset(&j);
    json_object_set_new(j.headers, "x-idemq-generation", json_integer(0));
    json_object_set_new(j.headers, "x-idemq-park-id", json_integer(8)); /* another park */
    json_object_set_new(j.headers, "x-idemq-seal", json_string(s));
    ck_assert_int_eq(decode(&j, &in, "{\"job_id\":\"K\"}"), IDEMQ_ERR_FORGED_REDRIVE);
    job_reset(&j);
    json_object_set_new(j.headers, "x-idemq-generation", json_integer(0));
    json_object_set_new(j.headers, "x-idemq-park-id", json_integer(7));
    json_object_set_new(j.headers, "x-idemq-seal", json_string(s));
    ck_assert_int_eq(decode(&j, &in, "{\"job_id\":\"L\"}"), IDEMQ_ERR_FORGED_REDRIVE); /* key */
    /* sealed: accepted; an unsealed who is dropped, a sealed one kept */
    job_reset(&j);
    json_object_set_new(j.headers, "x-idemq-generation", json_integer(0));
    json_object_set_new(j.headers, "x-idemq-park-id", json_integer(7));
    json_object_set_new(j.headers, "x-idemq-seal", json_string(s));
    json_object_set_new(j.headers, "x-idemq-redriven-by", json_string("mallory"));
    ck_assert_int_eq(decode(&j, &in, "{\"job_id\":\"K\"}"), IDEMQ_OK);
    ck_assert_ptr_null(json_object_get(j.headers, "x-idemq-redriven-by"));
    job_reset(&j);
    json_object_set_new(j.headers, "x-idemq-generation", json_integer(0));
    json_object_set_new(j.headers, "x-idemq-park-id", json_integer(7));
    json_object_set_new(j.headers, "x-idemq-seal", json_string(s));
    json_object_set_new(j.headers, "x-idemq-redriven-by", json_string("alice@host"));
    json_object_set_new(j.headers, "x-idemq-redrive-seal", json_string(by));
    ck_assert_int_eq(decode(&j, &in, "{\"job_id\":\"K\"}"), IDEMQ_OK);
    ck_assert_str_eq(json_string_value(json_object_get(j.headers, "x-idemq-redriven-by")),
                     "alice@host");
    /* another secret: the same seal no longer holds */
    ck_assert(seal_set_secret_hex("\\xffeeddccbbaa99887766554433221100"));
    job_reset(&j);
    json_object_set_new(j.headers, "x-idemq-generation", json_integer(0));
    json_object_set_new(j.headers, "x-idemq-park-id", json_integer(7));
    json_object_set_new(j.headers, "x-idemq-seal", json_string(s));
    ck_assert_int_eq(decode(&j, &in, "{\"job_id\":\"K\"}"), IDEMQ_ERR_FORGED_REDRIVE);
    ck_assert(!seal_set_secret_hex("\\xfe")); /* too short */
    job_destroy(&j);
}
END_TEST

/* The parser's error text quotes the token it stopped at ("near
 * '4111...'"): for an input with sensitive fields that quote is dropped,
 * since a body that is not JSON cannot be masked by path. */
START_TEST(test_bad_json_quotes_nothing_sensitive)
{
    struct job j;
    struct conf_input in = input(CONF_KEY_JSON, "job_id", 1024);
    char *paths[] = {"card.number"};
    job_init(&j);
    ck_assert_int_eq(decode(&j, &in, "{\"card\":{\"number\":\"4111111111111111\\q\"}}"),
                     IDEMQ_ERR_BAD_JSON);
    ck_assert_msg(strstr(j.reason, "4111111111111111"), "%s", j.reason); /* as before */
    job_reset(&j);
    in.sensitive.v = paths;
    in.sensitive.n = 1;
    ck_assert_int_eq(decode(&j, &in, "{\"card\":{\"number\":\"4111111111111111\\q\"}}"),
                     IDEMQ_ERR_BAD_JSON);
    ck_assert_msg(strstr(j.reason, "invalid JSON at byte") && !strstr(j.reason, "4111"), "%s",
                  j.reason);
    job_destroy(&j);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("job");
    TCase *tc = tcase_create("job");
    tcase_add_test(tc, test_json_key);
    tcase_add_test(tc, test_sha256_of_raw_body);
    tcase_add_test(tc, test_bad_bodies);
    tcase_add_test(tc, test_bad_json_quotes_nothing_sensitive);
    tcase_add_test(tc, test_bad_keys);
    tcase_add_test(tc, test_header_and_message_id_keys);
    tcase_add_test(tc, test_order_key_and_sequence);
    tcase_add_test(tc, test_utf8);
    tcase_add_test(tc, test_body_buffer_reuse);
    tcase_add_test(tc, test_duplicate_field);
    tcase_add_test(tc, test_wire_errors);
    tcase_add_test(tc, test_nul_byte_in_body);
    tcase_add_test(tc, test_timestamp_plausible);
    tcase_add_test(tc, test_redrive_seal);
    suite_add_tcase(s, tc);
    return check_run(s);
}
