/*
 * fuzz_delivery: a delivery from a hostile producer, from the wire to the
 * batch document. The input is
 *
 *   byte 0        flags: bit 0 redelivered; bits 1-7 pick the lane
 *   bytes 1-2     n, big-endian: length of the encoded properties
 *   n bytes       basic properties as in a content header frame (16-bit
 *                 flags, then the fields), decoded by librabbitmq-c's own
 *                 amqp_decode_properties, as the library does on receipt
 *   1 byte        r: length of the routing key, then r bytes of it
 *   the rest      the body
 *
 * and it goes the way delivery_read and broker.c take a delivery: the
 * method facts (exchange, routing key: copied and UTF-8-sanitized as
 * broker.c's delivery_facts does), the properties through
 * delivery_props_to_job with the default table limits (a content header
 * the library cannot decode becomes IDEMQ_ERR_UNDECODABLE, as in
 * delivery_read), the body through job_set_body, then job_decode against
 * each input of a config with every key source (json, header, message_id,
 * ordered inputs with order key and sequence, a small max_body_bytes).
 * Every job that decoded goes into one batch document (ledger_doc), which
 * must parse back with jansson and hold exactly what the jobs held.
 *
 * Checked: decode results are named decode errors with a reason, keys
 * are non-empty UTF-8 of at most 256 bytes, headers stay within the depth
 * limit, and the document round-trips.
 *
 * librabbitmq-c 0.11 overflows its stack on deeply nested tables (fixed
 * upstream in 0.14); scripts/fuzz bounds the input (-max_len 4096) so the
 * default runs do not just rediscover that. Longer inputs are allowed with
 * FUZZ_MAX_LEN.
 */
#include <amqp.h>
#include <amqp_framing.h>
#include <jansson.h>
#include <string.h>

#include "amqp_table.h"
#include "conf.h"
#include "delivery.h"
#include "fuzz.h"
#include "idemq_err.h"
#include "job.h"
#include "ledger_doc.h"

static const char inputs_cfg[] =
    "inputs = (\n"
    "  { name = \"json\"; queue = \"q.json\"; effect_function = \"f\"; },\n"
    "  { name = \"header\"; queue = \"q.header\"; effect_function = \"f\";\n"
    "    key_source = \"header:x-key\"; },\n"
    "  { name = \"msgid\"; queue = \"q.msgid\"; effect_function = \"f\";\n"
    "    key_source = \"message_id\"; max_body_bytes = 64; },\n"
    "  { name = \"ordered\"; exchange = \"x.ord\"; queue = \"q.ord\"; effect_function = \"f\";\n"
    "    partitions = 4; order_key_source = \"json:account\"; sequence_source = \"json:seq\"; },\n"
    "  { name = \"ordered_hdr\"; exchange = \"x.oh\"; queue = \"q.oh\"; effect_function = \"f\";\n"
    "    partitions = 2; key_source = \"header:x-key\"; order_key_source = \"header:x-order\";\n"
    "    on_park = \"hold_key\"; },\n"
    "  { name = \"ordered_mid\"; exchange = \"x.om\"; queue = \"q.om\"; effect_function = \"f\";\n"
    "    partitions = 2; key_source = \"json:id\"; order_key_source = \"message_id\";\n"
    "    sequence_source = \"json:seq\"; }\n"
    ");\n";

static struct conf *cfg;
static struct amqp_table_limits limits;
static bool verbose; /* FUZZ_VERBOSE=1: print each input's decode result */

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    char err[512];
    (void)argc, (void)argv;
    unsetenv("IDEMQ_AMQP_URL");
    unsetenv("IDEMQ_PG_DSN");
    if (conf_load_string(inputs_cfg, &cfg, err, sizeof err) != IDEMQ_OK) {
        fprintf(stderr, "fuzz_delivery: config: %s\n", err);
        abort();
    }
    amqp_table_default_limits(&limits);
    verbose = getenv("FUZZ_VERBOSE") != NULL;
    return 0;
}

/* As broker.c's copy_short: at most 255 bytes, cut at a NUL. */
static void copy_short(char *dst, const uint8_t *s, size_t len)
{
    size_t n = len < JOB_SHORTSTR - 1 ? len : JOB_SHORTSTR - 1;
    if (n)
        memcpy(dst, s, n);
    dst[n] = '\0';
}

static int depth_of(const json_t *v)
{
    int d = 0;
    if (json_is_object(v)) {
        const char *k;
        json_t *e;
        json_object_foreach((json_t *)v, k, e)
        {
            int x = depth_of(e);
            d = x > d ? x : d;
        }
        return d + 1;
    }
    if (json_is_array(v)) {
        for (size_t i = 0; i < json_array_size(v); i++) {
            int x = depth_of(json_array_get(v, i));
            d = x > d ? x : d;
        }
        return d + 1;
    }
    return 0;
}

static bool is_decode_error(idemq_err_t e)
{
    switch (e) {
    case IDEMQ_ERR_BODY_TOO_LARGE:
    case IDEMQ_ERR_BAD_JSON:
    case IDEMQ_ERR_NOT_OBJECT:
    case IDEMQ_ERR_KEY_MISSING:
    case IDEMQ_ERR_KEY_EMPTY:
    case IDEMQ_ERR_KEY_TOO_LONG:
    case IDEMQ_ERR_KEY_INVALID:
    case IDEMQ_ERR_SEQUENCE_INVALID:
    case IDEMQ_ERR_HEADERS_TOO_DEEP:
    case IDEMQ_ERR_HEADERS_TOO_LARGE:
    case IDEMQ_ERR_DUPLICATE_FIELD:
    case IDEMQ_ERR_KEY_NULL:
    case IDEMQ_ERR_UNDECODABLE:
        return true;
    default:
        return false;
    }
}

/* What a decoded job put into the document, to compare it with. */
struct expect {
    int input;
    char key[CONF_KEY_MAX_BYTES + 1];
    char sha[65];
    bool has_order, has_seq;
    char order_key[CONF_KEY_MAX_BYTES + 1];
    long long seq;
};

/* Fills j the way the transport does, from the pieces of one input. */
static void fill(struct job *j, uint8_t flags, const amqp_basic_properties_t *props,
                 int props_rc, const uint8_t *rk, size_t rk_len, const uint8_t *body,
                 size_t body_len)
{
    job_reset(j);
    j->tag = 1;
    j->redelivered = flags & 1;
    copy_short(j->exchange, rk, rk_len > 8 ? 8 : rk_len);
    copy_short(j->routing_key, rk, rk_len);
    job_utf8_sanitize(j->exchange);
    job_utf8_sanitize(j->routing_key);
    if (props_rc != AMQP_STATUS_OK) {
        /* delivery_read: the library refused the content header */
        j->wire_err = IDEMQ_ERR_UNDECODABLE;
        snprintf(j->wire_reason, sizeof j->wire_reason,
                 "librabbitmq-c cannot decode the message's properties or headers (%s)",
                 amqp_error_string2(props_rc));
    } else {
        FUZZ_CHECK(delivery_props_to_job(props, j, &limits) == IDEMQ_OK, "out of memory");
        FUZZ_CHECK(depth_of(j->headers) <= limits.max_depth + 1,
                   "headers %d deep, limit %d (+1 for $bytes_hex)", depth_of(j->headers),
                   limits.max_depth);
        FUZZ_CHECK(j->delivery_count >= -1, "delivery_count %d", j->delivery_count);
    }
    FUZZ_CHECK(job_set_body(j, body, body_len) == IDEMQ_OK, "out of memory");
}

static void check_doc(const struct ledger_doc *d, const struct expect *ex, int n,
                      const struct job *j, const uint8_t *body, size_t body_len)
{
    json_error_t jerr;
    json_t *doc = json_loads(d->buf, JSON_REJECT_DUPLICATES, &jerr), *payload;

    FUZZ_CHECK(doc, "batch document does not parse: %s at %d: %.300s", jerr.text,
               jerr.position, d->buf);
    FUZZ_CHECK(strlen(d->buf) == d->len, "document holds a NUL byte (%zu of %zu)",
               strlen(d->buf), d->len);
    FUZZ_CHECK(json_is_array(doc) && json_array_size(doc) == (size_t)n,
               "document has %zu jobs, %d added", json_array_size(doc), n);
    payload = json_loadb((const char *)body, body_len, JSON_REJECT_DUPLICATES, &jerr);
    FUZZ_CHECK(!n || json_is_object(payload), "a job decoded but its body is no object");
    for (int i = 0; i < n; i++) {
        json_t *e = json_array_get(doc, (size_t)i), *m = json_object_get(e, "m");
        const char *k = json_string_value(json_object_get(e, "k"));
        const char *h = json_string_value(json_object_get(e, "h"));
        FUZZ_CHECK(k && strcmp(k, ex[i].key) == 0, "job %d key %s, expected %s", i, k,
                   ex[i].key);
        FUZZ_CHECK(json_integer_value(json_object_get(e, "i")) == ex[i].input + 1,
                   "job %d input", i);
        FUZZ_CHECK(h && strcmp(h, ex[i].sha) == 0 && strlen(h) == 64, "job %d sha256", i);
        FUZZ_CHECK(json_equal(json_object_get(e, "p"), payload), "job %d payload differs", i);
        FUZZ_CHECK(json_is_object(m), "job %d meta", i);
        FUZZ_CHECK(json_equal(json_object_get(m, "headers"), j->headers),
                   "job %d headers differ", i);
        FUZZ_CHECK(json_is_string(json_object_get(m, "routing_key")) &&
                       strcmp(json_string_value(json_object_get(m, "routing_key")),
                              j->routing_key) == 0,
                   "job %d routing key differs", i);
        FUZZ_CHECK(json_is_boolean(json_object_get(m, "redelivered")), "job %d redelivered", i);
        if (j->has_message_id)
            FUZZ_CHECK(json_is_string(json_object_get(m, "message_id")) &&
                           (!job_utf8_valid((const unsigned char *)j->message_id,
                                            strlen(j->message_id)) ||
                            strcmp(json_string_value(json_object_get(m, "message_id")),
                                   j->message_id) == 0),
                       "job %d message_id differs", i);
        if (ex[i].has_order) {
            const char *o = json_string_value(json_object_get(e, "o"));
            FUZZ_CHECK(o && strcmp(o, ex[i].order_key) == 0, "job %d order key", i);
            FUZZ_CHECK(json_is_string(json_object_get(e, "l")), "job %d lane", i);
        }
        if (ex[i].has_seq)
            FUZZ_CHECK(json_integer_value(json_object_get(e, "s")) == ex[i].seq, "job %d seq",
                       i);
    }
    json_decref(payload);
    json_decref(doc);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    amqp_pool_t pool;
    amqp_basic_properties_t *props = NULL, empty;
    int props_rc = AMQP_STATUS_OK;
    size_t plen, rlen, off;
    const uint8_t *rk, *body;
    size_t body_len;
    struct job j;
    struct ledger_doc d;
    struct expect ex[16];
    int n = 0;

    if (size < 4)
        return 0;
    plen = (size_t)data[1] << 8 | data[2];
    off = 3;
    if (plen > size - off)
        plen = size - off;
    init_amqp_pool(&pool, 4096);
    if (plen >= 2) {
        amqp_bytes_t enc = {plen, (void *)(data + off)};
        props_rc = amqp_decode_properties(AMQP_BASIC_CLASS, &pool, enc, (void **)&props);
    } else {
        memset(&empty, 0, sizeof empty); /* no properties at all */
        props = &empty;
    }
    off += plen;
    rlen = off < size ? data[off++] : 0;
    if (rlen > size - off)
        rlen = size - off;
    rk = data + off;
    off += rlen;
    body = data + off;
    body_len = size - off;

    job_init(&j);
    ledger_doc_init(&d);
    ledger_doc_begin(&d);
    for (int i = 0; i < cfg->n_inputs; i++) {
        const struct conf_input *in = &cfg->inputs[i];
        idemq_err_t err;
        fill(&j, data[0], props, props_rc, rk, rlen, body, body_len);
        j.input = i;
        if (CONF_INPUT_ORDERED(in))
            j.lane = (data[0] >> 1) % in->partitions;
        err = job_decode(&j, in);
        if (verbose)
            fprintf(stderr, "  %-12s %-20s %s\n", in->name, idemq_err_name(err),
                    err ? j.reason : j.key);
        FUZZ_CHECK(err == j.decode_err, "returned %d, recorded %d", err, j.decode_err);
        FUZZ_CHECK(strlen(j.sha256_hex) == 64, "input %d: no body SHA-256", i);
        if (props_rc != AMQP_STATUS_OK)
            FUZZ_CHECK(err == IDEMQ_ERR_UNDECODABLE, "undecodable delivery gave %s",
                       idemq_err_name(err));
        if (err) {
            FUZZ_CHECK(is_decode_error(err), "input %d: %s is no decode error", i,
                       idemq_err_name(err));
            FUZZ_CHECK(j.reason[0], "input %d: %s without a reason", i, idemq_err_name(err));
            continue;
        }
        FUZZ_CHECK(j.has_key && j.key[0], "input %d: decoded without a key", i);
        FUZZ_CHECK(strlen(j.key) <= CONF_KEY_MAX_BYTES &&
                       job_utf8_valid((const unsigned char *)j.key, strlen(j.key)),
                   "input %d: bad key", i);
        FUZZ_CHECK(!CONF_INPUT_ORDERED(in) || in->order_kind == CONF_KEY_NONE ||
                       j.has_order_key,
                   "input %d: ordered job without an order key", i);
        FUZZ_CHECK(!in->seq_name || (j.has_seq && j.seq >= 1), "input %d: sequence", i);
        ledger_doc_add_job(&d, &j, in, i, false);
        ex[n].input = i;
        memcpy(ex[n].key, j.key, sizeof ex[n].key);
        memcpy(ex[n].sha, j.sha256_hex, sizeof ex[n].sha);
        ex[n].has_order = j.has_order_key;
        memcpy(ex[n].order_key, j.order_key, sizeof ex[n].order_key);
        ex[n].has_seq = j.has_seq;
        ex[n].seq = j.seq;
        n++;
    }
    FUZZ_CHECK(ledger_doc_end(&d), "document out of memory");
    /* the jobs share headers, body and routing key: compare with the last
     * fill (identical for every input) */
    check_doc(&d, ex, n, &j, body, body_len);

    ledger_doc_free(&d);
    job_destroy(&j);
    empty_amqp_pool(&pool);
    return 0;
}
