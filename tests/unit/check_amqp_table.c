/* Unit tests of adapters/amqp_table (bounded AMQP table <-> JSON) and of
 * delivery_props_to_job (message properties into a job, with the limits),
 * on tables built in memory as the client library would decode them. */
#include <check.h>

#include "check_run.h"
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "amqp_table.h"
#include "delivery.h"
#include "job.h"

/* A table nested `depth` levels deep: {"n": {"n": ... {"leaf": 1}}}. */
static amqp_table_t nested(amqp_pool_t *pool, int depth)
{
    amqp_table_t t;
    amqp_table_entry_t *e = amqp_pool_alloc(pool, sizeof *e);
    e->key = amqp_cstring_bytes(depth == 1 ? "leaf" : "n");
    if (depth == 1) {
        e->value.kind = AMQP_FIELD_KIND_I32;
        e->value.value.i32 = 1;
    } else {
        e->value.kind = AMQP_FIELD_KIND_TABLE;
        e->value.value.table = nested(pool, depth - 1);
    }
    t.num_entries = 1;
    t.entries = e;
    return t;
}

START_TEST(test_depth_limit)
{
    amqp_pool_t pool;
    struct amqp_table_limits lim;
    struct amqp_table_report rep;
    json_t *j;
    init_amqp_pool(&pool, 4096);
    amqp_table_default_limits(&lim);
    /* exactly at the limit: kept whole */
    amqp_table_t t = nested(&pool, lim.max_depth);
    j = amqp_table_to_json(&t, &lim, &rep);
    ck_assert_ptr_nonnull(j);
    ck_assert_int_eq(rep.err, IDEMQ_OK);
    ck_assert_int_eq(rep.depth, lim.max_depth);
    json_decref(j);
    /* 20,000 levels (the crash-loop finding): cut at the limit, reported */
    t = nested(&pool, 20000);
    j = amqp_table_to_json(&t, &lim, &rep);
    ck_assert_ptr_nonnull(j);
    ck_assert_int_eq(rep.err, IDEMQ_ERR_HEADERS_TOO_DEEP);
    ck_assert_int_eq(rep.depth, lim.max_depth + 1);
    {
        /* the JSON kept is max_depth levels deep at most */
        json_t *v = j;
        int d = 0;
        while (json_is_object(v) && json_object_get(v, "n")) {
            v = json_object_get(v, "n");
            d++;
        }
        ck_assert_int_le(d, lim.max_depth);
    }
    json_decref(j);
    empty_amqp_pool(&pool);
}
END_TEST

START_TEST(test_size_limits)
{
    amqp_pool_t pool;
    struct amqp_table_limits lim = {8, 10, 100};
    struct amqp_table_report rep;
    amqp_table_t t;
    amqp_table_entry_t e[20];
    char names[20][8];
    json_t *j;
    init_amqp_pool(&pool, 4096);
    for (int i = 0; i < 20; i++) {
        snprintf(names[i], sizeof names[i], "h%d", i);
        e[i].key = amqp_cstring_bytes(names[i]);
        e[i].value.kind = AMQP_FIELD_KIND_UTF8;
        e[i].value.value.bytes = amqp_cstring_bytes("v");
    }
    t.entries = e;
    t.num_entries = 20;
    j = amqp_table_to_json(&t, &lim, &rep);
    ck_assert_int_eq(rep.err, IDEMQ_ERR_HEADERS_TOO_LARGE);
    ck_assert_int_eq(json_object_size(j), 10); /* the first 10 fields fit */
    json_decref(j);
    /* a value over the byte budget: dropped (null), reported */
    char big[200];
    memset(big, 'x', sizeof big - 1);
    big[sizeof big - 1] = '\0';
    e[0].value.value.bytes = amqp_cstring_bytes(big);
    t.num_entries = 2;
    j = amqp_table_to_json(&t, &lim, &rep);
    ck_assert_int_eq(rep.err, IDEMQ_ERR_HEADERS_TOO_LARGE);
    ck_assert(json_is_null(json_object_get(j, "h0")));
    ck_assert_str_eq(json_string_value(json_object_get(j, "h1")), "v");
    json_decref(j);
    empty_amqp_pool(&pool);
}
END_TEST

/* Every field type, bytes that are not text, non-finite reals, names that
 * are not UTF-8. */
START_TEST(test_field_types)
{
    amqp_table_entry_t e[9];
    amqp_field_value_t arr[2];
    amqp_table_t t = {9, e};
    struct amqp_table_report rep;
    json_t *j;
    static const char bin[] = {'\x00', '\xff', 'a'};
    e[0].key = amqp_cstring_bytes("b");
    e[0].value.kind = AMQP_FIELD_KIND_BOOLEAN;
    e[0].value.value.boolean = 1;
    e[1].key = amqp_cstring_bytes("u64");
    e[1].value.kind = AMQP_FIELD_KIND_U64;
    e[1].value.value.u64 = 42;
    e[2].key = amqp_cstring_bytes("nan");
    e[2].value.kind = AMQP_FIELD_KIND_F64;
    e[2].value.value.f64 = NAN;
    e[3].key = amqp_cstring_bytes("bin");
    e[3].value.kind = AMQP_FIELD_KIND_BYTES;
    e[3].value.value.bytes.bytes = (void *)bin;
    e[3].value.value.bytes.len = sizeof bin;
    e[4].key = amqp_cstring_bytes("dec");
    e[4].value.kind = AMQP_FIELD_KIND_DECIMAL;
    e[4].value.value.decimal.decimals = 2;
    e[4].value.value.decimal.value = 1234;
    e[5].key.bytes = (void *)"\xc3\x28"; /* not UTF-8: left out */
    e[5].key.len = 2;
    e[5].value.kind = AMQP_FIELD_KIND_I8;
    e[5].value.value.i8 = 1;
    e[6].key = amqp_cstring_bytes("arr");
    e[6].value.kind = AMQP_FIELD_KIND_ARRAY;
    e[6].value.value.array.num_entries = 2;
    e[6].value.value.array.entries = arr;
    arr[0].kind = AMQP_FIELD_KIND_VOID;
    arr[1].kind = AMQP_FIELD_KIND_TIMESTAMP;
    arr[1].value.u64 = 1700000000;
    e[7].key = amqp_cstring_bytes("f32");
    e[7].value.kind = AMQP_FIELD_KIND_F32;
    e[7].value.value.f32 = INFINITY;
    e[8].key = amqp_cstring_bytes("s");
    e[8].value.kind = AMQP_FIELD_KIND_UTF8;
    e[8].value.value.bytes = amqp_cstring_bytes("\xc3\xa9t\xc3\xa9");
    j = amqp_table_to_json(&t, NULL, &rep);
    ck_assert_int_eq(rep.err, IDEMQ_OK);
    ck_assert_int_eq(rep.skipped_names, 1);
    ck_assert(json_is_true(json_object_get(j, "b")));
    ck_assert_int_eq(json_integer_value(json_object_get(j, "u64")), 42);
    ck_assert(json_is_null(json_object_get(j, "nan")));
    ck_assert(json_is_null(json_object_get(j, "f32")));
    ck_assert_str_eq(json_string_value(json_object_get(json_object_get(j, "bin"), "$bytes_hex")),
                     "00ff61");
    ck_assert_int_eq(json_integer_value(json_object_get(json_object_get(j, "dec"), "value")),
                     1234);
    ck_assert_int_eq(json_array_size(json_object_get(j, "arr")), 2);
    ck_assert_str_eq(json_string_value(json_object_get(j, "s")), "\xc3\xa9t\xc3\xa9");
    ck_assert_int_eq(json_object_size(j), 8);
    json_decref(j);
}
END_TEST

/* JSON -> table -> JSON keeps what idemq publishes (x-idemq-* headers). */
START_TEST(test_round_trip)
{
    amqp_pool_t pool;
    amqp_table_t t;
    struct amqp_table_report rep;
    json_t *in = json_pack("{s:s,s:i,s:b,s:f,s:{s:[i,s]}}", "x-idemq-reason", "bad", "n", 7,
                           "ok", 1, "r", 1.5, "nested", "a", 1, "two");
    json_t *out;
    init_amqp_pool(&pool, 1024);
    ck_assert_int_eq(amqp_table_from_json(in, &t, &pool), 0);
    ck_assert_int_eq(t.num_entries, 5);
    out = amqp_table_to_json(&t, NULL, &rep);
    ck_assert(json_equal(in, out));
    json_decref(out);
    ck_assert_int_eq(amqp_table_from_json(NULL, &t, &pool), 0);
    ck_assert_int_eq(t.num_entries, 0);
    json_decref(in);
    empty_amqp_pool(&pool);
}
END_TEST

/* Properties into a job: headers over the limit mark the job (parked with
 * what fit), x-delivery-count is taken when sane, a message_id with NUL
 * stays unusable as a key. */
START_TEST(test_props_to_job)
{
    amqp_pool_t pool;
    amqp_basic_properties_t p;
    struct amqp_table_limits lim;
    amqp_table_entry_t e[3];
    struct job j;
    init_amqp_pool(&pool, 4096);
    amqp_table_default_limits(&lim);
    memset(&p, 0, sizeof p);
    job_init(&j);
    e[0].key = amqp_cstring_bytes("x-delivery-count");
    e[0].value.kind = AMQP_FIELD_KIND_I64;
    e[0].value.value.i64 = 3;
    e[1].key = amqp_cstring_bytes("deep");
    e[1].value.kind = AMQP_FIELD_KIND_TABLE;
    e[1].value.value.table = nested(&pool, 40);
    p._flags = AMQP_BASIC_HEADERS_FLAG | AMQP_BASIC_MESSAGE_ID_FLAG | AMQP_BASIC_TIMESTAMP_FLAG;
    e[2].key = amqp_cstring_bytes("x-acquired-count");
    e[2].value.kind = AMQP_FIELD_KIND_I64;
    e[2].value.value.i64 = 7;
    p.headers.num_entries = 3;
    p.headers.entries = e;
    p.message_id.bytes = (void *)"a\0b";
    p.message_id.len = 3;
    p.timestamp = 1700000000;
    ck_assert_int_eq(delivery_props_to_job(&p, &j, &lim), IDEMQ_OK);
    ck_assert_int_eq(j.wire_err, IDEMQ_ERR_HEADERS_TOO_DEEP);
    ck_assert_ptr_nonnull(strstr(j.wire_reason, "deeper than 16"));
    ck_assert_int_eq(j.delivery_count, 3);
    ck_assert_int_eq(j.acquired_count, 7);
    ck_assert(j.has_message_id);
    ck_assert(!job_utf8_valid((unsigned char *)j.message_id, strlen(j.message_id)));
    ck_assert_ptr_nonnull(json_object_get(j.props, "message_id")); /* shown as hex */
    ck_assert_int_eq(json_integer_value(json_object_get(j.props, "timestamp")), 1700000000);
    job_destroy(&j);
    empty_amqp_pool(&pool);
}
END_TEST

/* x-acquired-count (RabbitMQ 4.3) is taken only as an integer in
 * 0..DELIVERY_COUNT_MAX; anything else (a producer's string, a negative or
 * huge number, a table) leaves the count unknown and stays a header. */
START_TEST(test_acquired_count_bounded)
{
    amqp_pool_t pool;
    amqp_basic_properties_t p;
    struct amqp_table_limits lim;
    amqp_table_entry_t e;
    struct job j;
    struct {
        uint8_t kind;
        int64_t v;
        int want;
    } cases[] = {
        {AMQP_FIELD_KIND_I32, 1, 1},
        {AMQP_FIELD_KIND_U32, 4000, 4000},
        {AMQP_FIELD_KIND_I64, 0, 0},
        {AMQP_FIELD_KIND_I64, DELIVERY_COUNT_MAX, DELIVERY_COUNT_MAX},
        {AMQP_FIELD_KIND_I64, DELIVERY_COUNT_MAX + 1LL, -1},
        {AMQP_FIELD_KIND_I64, -5, -1},
        {AMQP_FIELD_KIND_I64, INT64_MIN, -1},
        {AMQP_FIELD_KIND_UTF8, 0, -1}, /* "12": text is not a count */
        {AMQP_FIELD_KIND_TABLE, 0, -1},
    };
    init_amqp_pool(&pool, 4096);
    amqp_table_default_limits(&lim);
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        memset(&p, 0, sizeof p);
        memset(&e, 0, sizeof e);
        job_init(&j);
        e.key = amqp_cstring_bytes("x-acquired-count");
        e.value.kind = cases[i].kind;
        if (cases[i].kind == AMQP_FIELD_KIND_I32)
            e.value.value.i32 = (int32_t)cases[i].v;
        else if (cases[i].kind == AMQP_FIELD_KIND_U32)
            e.value.value.u32 = (uint32_t)cases[i].v;
        else if (cases[i].kind == AMQP_FIELD_KIND_I64)
            e.value.value.i64 = cases[i].v;
        else if (cases[i].kind == AMQP_FIELD_KIND_UTF8)
            e.value.value.bytes = amqp_cstring_bytes("12");
        else
            e.value.value.table = nested(&pool, 2);
        p._flags = AMQP_BASIC_HEADERS_FLAG;
        p.headers.num_entries = 1;
        p.headers.entries = &e;
        ck_assert_int_eq(delivery_props_to_job(&p, &j, &lim), IDEMQ_OK);
        ck_assert_msg(j.acquired_count == cases[i].want, "case %zu: %d, want %d", i,
                      j.acquired_count, cases[i].want);
        ck_assert_int_eq(j.delivery_count, -1); /* the other count is untouched */
        ck_assert_ptr_nonnull(json_object_get(j.headers, "x-acquired-count")); /* kept as data */
        job_destroy(&j);
    }
    empty_amqp_pool(&pool);
}
END_TEST

/* amqp_table_wire_size agrees with what amqp_encode_table writes, for
 * every kind amqp_table_from_json makes (and nested tables and arrays),
 * and reports the longest field name at any depth. */
START_TEST(test_wire_size)
{
    amqp_pool_t pool;
    amqp_table_t t;
    static char buf[1 << 16];
    amqp_bytes_t enc = {sizeof buf, buf};
    size_t off = 0, longest = 0;
    char name[301];
    json_t *v;

    memset(name, 'n', 300);
    name[300] = '\0';
    v = json_pack("{s:s, s:i, s:b, s:f, s:n, s:{s:[i, s, {s:b}, []]}, s:{}}", "str", "text",
                  "int", 7, "bool", 1, "real", 1.5, "null", "nest", "arr", 1, "x", "deep", 0,
                  "empty");
    json_object_set_new(v, name, json_string("long name"));
    init_amqp_pool(&pool, 4096);
    ck_assert_int_eq(amqp_table_from_json(v, &t, &pool), 0);
    ck_assert_int_eq(amqp_encode_table(enc, &t, &off), AMQP_STATUS_OK);
    ck_assert_uint_eq(amqp_table_wire_size(&t, &longest), off);
    ck_assert_uint_eq(longest, 300);
    empty_amqp_pool(&pool);
    json_decref(v);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("amqp_table");
    TCase *tc = tcase_create("amqp_table");
    tcase_add_test(tc, test_depth_limit);
    tcase_add_test(tc, test_size_limits);
    tcase_add_test(tc, test_field_types);
    tcase_add_test(tc, test_round_trip);
    tcase_add_test(tc, test_props_to_job);
    tcase_add_test(tc, test_acquired_count_bounded);
    tcase_add_test(tc, test_wire_size);
    suite_add_tcase(s, tc);
    return check_run(s);
}
