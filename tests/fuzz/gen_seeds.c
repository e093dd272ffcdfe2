/*
 * gen_seeds: writes the binary seeds of tests/fuzz/corpus (fuzz_delivery,
 * fuzz_amqp_table, fuzz_track), so they are reproducible: properties and
 * tables are encoded by librabbitmq-c's own amqp_encode_properties and
 * amqp_encode_table, as a producer's client would put them on the wire.
 * fuzz_conf's seeds are the sample configs (config/, tests/unit/conf/),
 * copied by scripts/fuzz --seeds, which also runs this program.
 *
 * Usage: gen_seeds CORPUS_DIR (holding fuzz_delivery/, fuzz_amqp_table/,
 * fuzz_track/).
 */
#include <amqp.h>
#include <amqp_framing.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char *dir;

static void put(const char *target, const char *name, const void *p, size_t n)
{
    char path[1024];
    FILE *f;
    snprintf(path, sizeof path, "%s/%s/%s", dir, target, name);
    if (!(f = fopen(path, "wb")) || fwrite(p, 1, n, f) != n || fclose(f)) {
        perror(path);
        exit(1);
    }
}

static amqp_bytes_t b(const char *s) { return amqp_cstring_bytes(s); }

static amqp_table_entry_t str(const char *k, const char *v)
{
    amqp_table_entry_t e = {b(k), {AMQP_FIELD_KIND_UTF8, {.bytes = {0, NULL}}}};
    e.value.value.bytes = b(v);
    return e;
}

static amqp_table_entry_t i64(const char *k, int64_t v)
{
    amqp_table_entry_t e = {b(k), {AMQP_FIELD_KIND_I64, {.i64 = v}}};
    return e;
}

/* fuzz_delivery input: flags, properties length (big-endian), properties,
 * routing key length, routing key, body. */
static void delivery(const char *name, uint8_t flags, amqp_basic_properties_t *p, const char *rk,
                     size_t rk_len, const char *body)
{
    static uint8_t out[65536];
    uint8_t enc[32768];
    int n = 0;
    size_t o = 0, bl = strlen(body);

    if (p) {
        n = amqp_encode_properties(AMQP_BASIC_CLASS, p, (amqp_bytes_t){sizeof enc, enc});
        if (n < 0) {
            fprintf(stderr, "gen_seeds: %s: cannot encode: %s\n", name, amqp_error_string2(n));
            exit(1);
        }
    }
    out[o++] = flags;
    out[o++] = (uint8_t)(n >> 8);
    out[o++] = (uint8_t)n;
    memcpy(out + o, enc, (size_t)n);
    o += (size_t)n;
    out[o++] = (uint8_t)rk_len;
    memcpy(out + o, rk, rk_len);
    o += rk_len;
    memcpy(out + o, body, bl);
    o += bl;
    put("fuzz_delivery", name, out, o);
}

static void table(const char *name, amqp_table_t *t)
{
    uint8_t enc[32768];
    size_t off = 0;
    int rc = amqp_encode_table((amqp_bytes_t){sizeof enc, enc}, t, &off);
    if (rc != AMQP_STATUS_OK) {
        fprintf(stderr, "gen_seeds: table %s: %s\n", name, amqp_error_string2(rc));
        exit(1);
    }
    put("fuzz_amqp_table", name, enc, off);
}

/* Tables nested depth deep, each level {"n": {...}}; the innermost holds
 * a string. */
static amqp_table_t nested(amqp_table_entry_t *e, int depth)
{
    for (int i = 0; i < depth; i++) {
        e[i].key = b("n");
        if (i == depth - 1) {
            e[i] = str("leaf", "x");
        } else {
            e[i].value.kind = AMQP_FIELD_KIND_TABLE;
            e[i].value.value.table = (amqp_table_t){1, &e[i + 1]};
        }
    }
    return (amqp_table_t){1, e};
}

static void track(const char *name, const uint8_t *prog, size_t n)
{
    put("fuzz_track", name, prog, n);
}

int main(int argc, char **argv)
{
    amqp_basic_properties_t p;
    amqp_table_entry_t h[32], every[32], deep[24];
    amqp_field_value_t arr[4];
    amqp_table_t t;
    static const uint8_t not_utf8[] = {0xff, 0xfe, 'a', 0xc3};

    if (argc != 2) {
        fprintf(stderr, "usage: gen_seeds CORPUS_DIR\n");
        return 2;
    }
    dir = argv[1];

    /* a good job: every key source finds its key */
    memset(&p, 0, sizeof p);
    p._flags = AMQP_BASIC_CONTENT_TYPE_FLAG | AMQP_BASIC_DELIVERY_MODE_FLAG |
               AMQP_BASIC_MESSAGE_ID_FLAG | AMQP_BASIC_HEADERS_FLAG;
    p.content_type = b("application/json");
    p.delivery_mode = 2;
    p.message_id = b("msg-1");
    h[0] = str("x-key", "hk-1");
    h[1] = str("x-order", "acct-1");
    h[2] = i64("x-delivery-count", 2);
    p.headers = (amqp_table_t){3, h};
    delivery("good_job", 0, &p, "payouts", 7,
             "{\"job_id\":\"pay-1\",\"id\":\"id-1\",\"account\":\"acct-1\",\"seq\":1,"
             "\"amount\":100}");
    table("good_headers", &p.headers);
    /* the same, redelivered, on lane 3 */
    delivery("good_redelivered", 1 | 3 << 1, &p, "payouts", 7,
             "{\"job_id\":42,\"id\":7,\"account\":\"a\",\"seq\":9007199254740993}");

    /* every field type in the headers, and every string property */
    memset(&p, 0, sizeof p);
    p._flags = AMQP_BASIC_CONTENT_TYPE_FLAG | AMQP_BASIC_CONTENT_ENCODING_FLAG |
               AMQP_BASIC_HEADERS_FLAG | AMQP_BASIC_DELIVERY_MODE_FLAG |
               AMQP_BASIC_PRIORITY_FLAG | AMQP_BASIC_CORRELATION_ID_FLAG |
               AMQP_BASIC_REPLY_TO_FLAG | AMQP_BASIC_EXPIRATION_FLAG |
               AMQP_BASIC_MESSAGE_ID_FLAG | AMQP_BASIC_TIMESTAMP_FLAG | AMQP_BASIC_TYPE_FLAG |
               AMQP_BASIC_USER_ID_FLAG | AMQP_BASIC_APP_ID_FLAG;
    p.content_type = b("text/plain; charset=latin1");
    p.content_encoding = b("gzip");
    p.delivery_mode = 1;
    p.priority = 9;
    p.correlation_id = b("corr");
    p.reply_to = b("amq.rabbitmq.reply-to");
    p.expiration = b("60000");
    p.message_id = (amqp_bytes_t){sizeof not_utf8, (void *)not_utf8};
    p.timestamp = 1700000000;
    p.type = b("payout");
    p.user_id = b("guest");
    p.app_id = b("idemq-seed");
    every[0] = (amqp_table_entry_t){b("bool"), {AMQP_FIELD_KIND_BOOLEAN, {.boolean = 1}}};
    every[1] = (amqp_table_entry_t){b("i8"), {AMQP_FIELD_KIND_I8, {.i8 = -8}}};
    every[2] = (amqp_table_entry_t){b("u8"), {AMQP_FIELD_KIND_U8, {.u8 = 200}}};
    every[3] = (amqp_table_entry_t){b("i16"), {AMQP_FIELD_KIND_I16, {.i16 = -1600}}};
    every[4] = (amqp_table_entry_t){b("u16"), {AMQP_FIELD_KIND_U16, {.u16 = 60000}}};
    every[5] = (amqp_table_entry_t){b("i32"), {AMQP_FIELD_KIND_I32, {.i32 = -320000}}};
    every[6] = (amqp_table_entry_t){b("u32"), {AMQP_FIELD_KIND_U32, {.u32 = 4000000000u}}};
    every[7] = i64("i64", INT64_MIN);
    every[8] = (amqp_table_entry_t){b("u64"), {AMQP_FIELD_KIND_U64, {.u64 = UINT64_MAX}}};
    every[9] = (amqp_table_entry_t){b("f32"), {AMQP_FIELD_KIND_F32, {.f32 = 1.5f}}};
    every[10] = (amqp_table_entry_t){b("f64"), {AMQP_FIELD_KIND_F64, {.f64 = -2.25}}};
    every[11] = (amqp_table_entry_t){b("dec"), {AMQP_FIELD_KIND_DECIMAL,
                                                {.decimal = {2, 12345}}}};
    every[12] = str("utf8", "caf\xc3\xa9 \xe2\x82\xac");
    every[13] = (amqp_table_entry_t){b("bytes"), {AMQP_FIELD_KIND_BYTES,
                                                  {.bytes = {sizeof not_utf8,
                                                             (void *)not_utf8}}}};
    every[14] = (amqp_table_entry_t){b("ts"), {AMQP_FIELD_KIND_TIMESTAMP,
                                               {.u64 = 1700000000}}};
    every[15] = (amqp_table_entry_t){b("void"), {AMQP_FIELD_KIND_VOID, {.i64 = 0}}};
    arr[0] = (amqp_field_value_t){AMQP_FIELD_KIND_I32, {.i32 = 1}};
    arr[1] = (amqp_field_value_t){AMQP_FIELD_KIND_UTF8, {.bytes = {3, (void *)"two"}}};
    arr[2] = (amqp_field_value_t){AMQP_FIELD_KIND_TABLE, {.table = {2, &every[0]}}};
    arr[3] = (amqp_field_value_t){AMQP_FIELD_KIND_VOID, {.i64 = 0}};
    every[16] = (amqp_table_entry_t){b("array"), {AMQP_FIELD_KIND_ARRAY,
                                                  {.array = {4, arr}}}};
    every[17] = (amqp_table_entry_t){b("table"), {AMQP_FIELD_KIND_TABLE,
                                                  {.table = {3, &every[12]}}}};
    every[18] = str("x-key", "line1\nline2\x1b[31m");
    every[19] = (amqp_table_entry_t){{2, (void *)"\xc3\x28"}, /* name not UTF-8 */
                                     {AMQP_FIELD_KIND_I8, {.i8 = 1}}};
    every[20] = (amqp_table_entry_t){b("nan"), {AMQP_FIELD_KIND_F64, {.f64 = __builtin_nan("")}}};
    p.headers = (amqp_table_t){21, every};
    delivery("every_type", 0, &p, "rk\xff\x00tail", 8,
             "{\"job_id\":\"k\\u001b[31m\",\"id\":\"x\",\"account\":\"a\",\"seq\":2}");
    table("every_type", &p.headers);

    /* headers nested past the depth limit (16) */
    memset(&p, 0, sizeof p);
    p._flags = AMQP_BASIC_HEADERS_FLAG;
    p.headers = nested(deep, 20);
    delivery("deep_headers", 0, &p, "", 0, "{\"job_id\":\"deep-1\"}");
    table("deep", &p.headers);

    /* an empty field name: RabbitMQ accepts it, librabbitmq-c 0.11 refuses */
    memset(&p, 0, sizeof p);
    p._flags = AMQP_BASIC_HEADERS_FLAG;
    h[0] = str("", "empty name");
    p.headers = (amqp_table_t){1, h};
    delivery("empty_header_name", 0, &p, "", 0, "{\"job_id\":\"e-1\"}");
    t = (amqp_table_t){1, h};
    table("empty_name", &t);

    /* bodies: duplicate field, not an object, bad JSON, too large, empty */
    delivery("dup_field", 0, NULL, "", 0, "{\"job_id\":\"A\",\"job_id\":\"B\"}");
    delivery("not_object", 0, NULL, "", 0, "null");
    delivery("array_body", 0, NULL, "", 0, "[{\"job_id\":\"a\"}]");
    delivery("bad_json", 0, NULL, "", 0, "{\"job_id\":\"a\"");
    delivery("bad_utf8", 0, NULL, "", 0, "{\"job_id\":\"\xc3\x28\"}");
    delivery("key_null", 0, NULL, "", 0, "{\"job_id\":null,\"id\":\"\",\"seq\":0}");
    delivery("too_large", 0, NULL, "", 0,
             "{\"job_id\":\"big\",\"pad\":\"xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx"
             "xxxxxxxxxxxxxxxxxxxxxxxxxx\"}");
    delivery("empty", 0, NULL, "", 0, "");

    /* fuzz_track programs: pairs (opcode, argument); see fuzz_track.c */
    {
        /* six deliveries; 1, 2 settle; 4 rejected; 5 settles beyond the held
         * 3; acks go out; 3 settles; all acked */
        static const uint8_t gap[] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 6, 1, 5, 3, 3,
                                      1, 2, 6, 0, 2, 0, 6, 0};
        /* two lanes interleaved: odd tags settle, even held; then the
         * front settles one by one */
        static const uint8_t lanes[] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                        1, 8, 1, 6, 1, 4, 1, 2, 5, 0, 5, 0, 2, 0, 5, 0,
                                        2, 0, 5, 0, 2, 0, 2, 0, 6, 0};
        /* tags with gaps, a tag that does not increase, drop multiple,
         * a reset */
        static const uint8_t odd[] = {0, 2, 0, 3, 0, 255, 0, 1, 1, 2, 4, 5, 6, 0,
                                      0, 0, 7, 0, 0, 0, 1, 1, 6, 0};
        /* publishes confirmed out of order, one nacked, a range asked */
        static const uint8_t conf[] = {8, 4, 9, 2, 12, 5, 9, 0, 12, 5, 10, 4, 12, 5,
                                       9, 9, 12, 5, 13, 0, 12, 5};
        /* a return before the confirm it precedes; a multiple ack; strays */
        static const uint8_t ret[] = {8, 2, 11, 0, 9, 4, 9, 1, 12, 3, 9, 240,
                                      10, 241, 12, 3, 14, 0, 8, 0, 9, 0, 12, 1};
        track("acks_gap", gap, sizeof gap);
        track("acks_lanes", lanes, sizeof lanes);
        track("acks_odd", odd, sizeof odd);
        track("confirms_out_of_order", conf, sizeof conf);
        track("confirms_return", ret, sizeof ret);
    }
    return 0;
}
