/*
 * fuzz_pgq: a row of a PostgreSQL queue input from a hostile producer,
 * from the values idemq.queue_take returns to the job it becomes
 * (pgq_row_job). The input is a flags byte, then three parts split at the
 * first two NUL bytes:
 *
 *   flags      bit 0: the row has a key; bit 1: an order key; bit 2: it was
 *              put back by a redrive (generation 3, park 9); bits 3-7: attempts
 *   key        the enqueue's key (any bytes but NUL)
 *   order key  the same
 *   payload    the body, any bytes
 *
 * Each goes through pgq_row_job against inputs with key_source json:job_id
 * and key (the enqueue's key), and a small max_body_bytes.
 *
 * Checked: every result is IDEMQ_OK or a named decode error with a reason;
 * a decoded job has a key of UTF-8 of at most 256 bytes, and with
 * key_source = "key" exactly the row's key (never a cut one); only a
 * redriven row carries a redrive generation, and only once decoded; the
 * properties name the transport, the queue and the row.
 */
#include <jansson.h>
#include <string.h>

#include "conf.h"
#include "fuzz.h"
#include "idemq_err.h"
#include "job.h"
#include "pgq.h"

/* Two postgres inputs, loaded as a configuration would be. */
static struct conf *conf;

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    char err[512];
    (void)argc;
    (void)argv;
    FUZZ_CHECK(conf_load_string("inputs = ("
                                "{ name = \"j\"; transport = \"postgres\"; queue = \"j\"; "
                                "key_source = \"json:job_id\"; max_body_bytes = 4096; "
                                "effect_function = \"x.f\"; },"
                                "{ name = \"k\"; transport = \"postgres\"; queue = \"k\"; "
                                "key_source = \"key\"; max_body_bytes = 4096; "
                                "effect_function = \"x.f\"; });",
                                &conf, err, sizeof err) == IDEMQ_OK &&
                   conf->n_pg_inputs == 2,
               "%s", err);
    return 0;
}

static void check(const struct pgq_row *row, const struct conf_input *in, const char *ks)
{
    struct job j;
    json_t *gen;

    job_init(&j);
    FUZZ_CHECK(pgq_row_job(row, in, 0, &j), "out of memory");
    FUZZ_CHECK(j.decode_err == IDEMQ_OK || (idemq_err_name(j.decode_err)[0] && j.reason[0]),
               "decode error %d without a name or reason", (int)j.decode_err);
    if (j.decode_err == IDEMQ_OK) {
        FUZZ_CHECK(j.has_key && j.key[0] && strlen(j.key) <= 256 &&
                       job_utf8_valid((const unsigned char *)j.key, strlen(j.key)),
                   "key %s", j.key);
        if (strcmp(ks, "key") == 0)
            FUZZ_CHECK(row->key && strcmp(row->key, j.key) == 0, "key %s of row key %s", j.key,
                       row->key ? row->key : "(none)");
    }
    gen = json_object_get(j.headers, "x-idemq-generation");
    FUZZ_CHECK(!gen || (row->has_redrive && j.decode_err == IDEMQ_OK),
               "a redrive generation on a row that was not redriven, or not decoded");
    FUZZ_CHECK(json_is_object(j.props) &&
                   strcmp(json_string_value(json_object_get(j.props, "transport")), "postgres") ==
                       0 &&
                   json_integer_value(json_object_get(j.props, "queue_row")) == row->id,
               "properties");
    FUZZ_CHECK(j.tag == (uint64_t)row->id, "tag");
    job_destroy(&j);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    const uint8_t *a, *b;
    char *key = NULL, *okey = NULL;
    struct pgq_row row;
    uint8_t flags;

    if (size < 1)
        return 0;
    flags = data[0];
    data++;
    size--;
    a = memchr(data, 0, size);
    if (!a)
        return 0;
    b = memchr(a + 1, 0, size - (size_t)(a + 1 - data));
    if (!b)
        return 0;
    memset(&row, 0, sizeof row);
    row.id = 42;
    if (flags & 1)
        key = strndup((const char *)data, (size_t)(a - data));
    if (flags & 2)
        okey = strndup((const char *)a + 1, (size_t)(b - a - 1));
    row.key = key;
    row.order_key = okey;
    row.payload = b + 1;
    row.payload_len = size - (size_t)(b + 1 - data);
    row.attempts = flags >> 3;
    row.has_redrive = (flags & 4) != 0;
    row.redrive_gen = row.has_redrive ? 3 : 0;
    row.park_id = row.has_redrive ? 9 : 0;
    row.enqueued_at = "2026-12-04 09:00:00+00";

    check(&row, &conf->pg_inputs[0], "json:job_id");
    check(&row, &conf->pg_inputs[1], "key");
    free(key);
    free(okey);
    return 0;
}
