/*
 * fuzz_conf: configuration text from anywhere -> conf_load_string (libconfig
 * parse, the settings table, validation) -> conf_print, conf_lint (which
 * stats the files a config names, never reads them) -> conf_free. The
 * environment overrides (IDEMQ_AMQP_URL, IDEMQ_PG_DSN) are unset, so the
 * text alone decides.
 *
 * Checked: a load either succeeds or fails with IDEMQ_ERR_CONFIG (or
 * NOMEM) and a message; a loaded config holds what validation promises
 * (at least one input, each with a queue, an effect signature and a key
 * name unless the key is message_id); printing it and freeing it are clean
 * (ASan, LeakSanitizer).
 *
 * Inputs naming `@include` are skipped: libconfig would open whatever path
 * follows (a file idemq's operator chose, in real use), and a fuzzer must
 * not read the machine's files or block on a FIFO.
 */
#include <string.h>

#include "conf.h"
#include "fuzz.h"
#include "idemq_err.h"

static FILE *devnull;

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc, (void)argv;
    unsetenv("IDEMQ_AMQP_URL");
    unsetenv("IDEMQ_PG_DSN");
    devnull = fopen("/dev/null", "w");
    if (!devnull)
        abort();
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char *text, errbuf[1024];
    struct conf *c = (struct conf *)1;
    idemq_err_t err;

    if (!(text = malloc(size + 1)))
        return 0;
    memcpy(text, data, size);
    text[size] = '\0';
    if (strstr(text, "@include")) {
        free(text);
        return 0;
    }
    errbuf[0] = '\0';
    err = conf_load_string(text, &c, errbuf, sizeof errbuf);
    if (err) {
        FUZZ_CHECK(err == IDEMQ_ERR_CONFIG || err == IDEMQ_ERR_NOMEM, "load returned %s",
                   idemq_err_name(err));
        FUZZ_CHECK(c == NULL, "failed load left a config");
        FUZZ_CHECK(errbuf[0], "failed load without a message");
    } else {
        FUZZ_CHECK(c != NULL, "load succeeded without a config");
        FUZZ_CHECK(c->n_inputs >= 1, "config without inputs");
        FUZZ_CHECK(c->urls.n >= 1, "config without a broker URL");
        for (int i = 0; i < c->n_inputs; i++) {
            const struct conf_input *in = &c->inputs[i];
            FUZZ_CHECK(in->name && in->name[0] && in->queue && in->queue[0],
                       "input %d without name or queue", i);
            FUZZ_CHECK(in->effect_signature && in->effect_signature[0],
                       "input %d without an effect signature", i);
            FUZZ_CHECK(in->key_kind == CONF_KEY_MESSAGE_ID || (in->key_name && in->key_name[0]),
                       "input %d without a key name", i);
            FUZZ_CHECK(!in->seq_name || in->order_kind != CONF_KEY_NONE,
                       "input %d: sequence without an order key", i);
            FUZZ_CHECK(in->max_body_bytes >= 2, "input %d: max_body_bytes %d", i,
                       in->max_body_bytes);
        }
        conf_print(c, devnull);
        FUZZ_CHECK(conf_lint(c, devnull) >= 0, "conf_lint counted below zero");
        fflush(devnull);
        conf_free(c);
    }
    free(text);
    return 0;
}
