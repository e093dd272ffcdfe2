/*
 * fuzz_amqp_table: an AMQP field table off the wire (raw bytes ->
 * librabbitmq-c's amqp_decode_table) -> adapters/amqp_table.c.
 *
 * Checked:
 *  - the conversion within small limits (depth 3, 12 fields, 96 bytes)
 *    stays inside them (the report and the JSON's own depth), and when it
 *    reports no limit hit it equals the unlimited conversion;
 *  - the round trip: JSON -> amqp_table_from_json -> amqp_encode_table ->
 *    amqp_decode_table -> JSON gives the same JSON (what idemq republishes
 *    is what it read).
 *
 * The input is bounded (scripts/fuzz: -max_len 4096): librabbitmq-c 0.11
 * overflows its stack decoding deeply nested tables (fixed in 0.14).
 */
#include <amqp.h>
#include <jansson.h>
#include <limits.h>
#include <string.h>

#include "amqp_table.h"
#include "fuzz.h"

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc, (void)argv;
    return 0;
}

static int depth_of(const json_t *v)
{
    int d = 0;
    size_t i;
    const char *k;
    json_t *e;
    if (json_is_object(v)) {
        json_object_foreach((json_t *)v, k, e)
        {
            int x = depth_of(e);
            d = x > d ? x : d;
        }
        return d + 1;
    }
    if (json_is_array(v)) {
        json_array_foreach(v, i, e)
        {
            int x = depth_of(e);
            d = x > d ? x : d;
        }
        return d + 1;
    }
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    amqp_pool_t pool;
    amqp_table_t t, t2, t3;
    amqp_bytes_t enc = {size, (void *)data};
    size_t off = 0;
    struct amqp_table_limits big = {INT_MAX, INT_MAX, SIZE_MAX}, small = {3, 12, 96};
    struct amqp_table_report rep_big, rep_small, rep3;
    json_t *full, *cut, *again;

    init_amqp_pool(&pool, 4096);
    if (amqp_decode_table(enc, &pool, &t, &off) != AMQP_STATUS_OK)
        goto out;
    FUZZ_CHECK(off <= size, "decoder read past the input (%zu of %zu)", off, size);

    full = amqp_table_to_json(&t, &big, &rep_big);
    cut = amqp_table_to_json(&t, &small, &rep_small);
    FUZZ_CHECK(full && cut, "out of memory");
    FUZZ_CHECK(rep_big.err == IDEMQ_OK, "unlimited conversion hit a limit");
    FUZZ_CHECK(rep_small.fields <= small.max_fields && rep_small.bytes <= small.max_bytes &&
                   rep_small.depth <= small.max_depth + 1,
               "small limits exceeded: %d fields, %zu bytes, depth %d", rep_small.fields,
               rep_small.bytes, rep_small.depth);
    /* + 1: a value that is not text becomes {"$bytes_hex": ...} */
    FUZZ_CHECK(depth_of(cut) <= small.max_depth + 1, "JSON %d deep within depth limit %d",
               depth_of(cut), small.max_depth);
    if (rep_small.err == IDEMQ_OK)
        FUZZ_CHECK(json_equal(full, cut), "within the limits, yet not the full conversion");
    else
        FUZZ_CHECK(rep_small.err == IDEMQ_ERR_HEADERS_TOO_DEEP ||
                       rep_small.err == IDEMQ_ERR_HEADERS_TOO_LARGE,
                   "report error %d", rep_small.err);

    /* round trip through the wire format */
    if (amqp_table_from_json(full, &t2, &pool) == 0) {
        size_t cap = 64 + 8 * size + 2 * (size_t)rep_big.bytes, woff = 0, roff = 0;
        void *buf = malloc(cap);
        FUZZ_CHECK(buf, "out of memory");
        if (amqp_encode_table((amqp_bytes_t){cap, buf}, &t2, &woff) == AMQP_STATUS_OK) {
            int rc = amqp_decode_table((amqp_bytes_t){woff, buf}, &pool, &t3, &roff);
            FUZZ_CHECK(rc == AMQP_STATUS_OK, "re-encoded table does not decode: %s",
                       amqp_error_string2(rc));
            FUZZ_CHECK(roff == woff, "decoded %zu of %zu bytes", roff, woff);
            again = amqp_table_to_json(&t3, &big, &rep3);
            FUZZ_CHECK(again, "out of memory");
            if (!json_equal(full, again)) {
                char *a = json_dumps(full, JSON_COMPACT | JSON_SORT_KEYS);
                char *b = json_dumps(again, JSON_COMPACT | JSON_SORT_KEYS);
                FUZZ_CHECK(false, "round trip changed the table:\n%s\n%s", a, b);
            }
            json_decref(again);
        } else {
            FUZZ_CHECK(false, "table of %zu input bytes does not encode into %zu", size, cap);
        }
        free(buf);
    }
    json_decref(full);
    json_decref(cut);
out:
    empty_amqp_pool(&pool);
    return 0;
}
