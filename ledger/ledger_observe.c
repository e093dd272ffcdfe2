/*
 * ledger_observe: the observe_batch document and outcome names (see
 * ledger_observe.h). Pure: no database, no broker.
 */
#include "ledger_observe.h"

#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char *const names[OBSERVE_N_OUTCOMES] = {
    "none", "observed", "duplicate", "late_replay", "would_park", "unrecorded",
};

const char *ledger_observe_outcome_name(enum observe_outcome o)
{
    return o > OBSERVE_NONE && o < OBSERVE_N_OUTCOMES ? names[o] : names[0];
}

enum observe_outcome ledger_observe_outcome_parse(const char *name)
{
    for (int o = OBSERVE_NEW; name && o < OBSERVE_N_OUTCOMES; o++)
        if (strcmp(name, names[o]) == 0)
            return (enum observe_outcome)o;
    return OBSERVE_NONE;
}

idemq_err_t ledger_observe_code_parse(const char *name)
{
    if (!name || !name[0])
        return IDEMQ_OK;
    for (int e = IDEMQ_ERR_NOMEM; e <= IDEMQ_ERR_KEY_REUSE; e++)
        if (strcmp(name, idemq_err_name((idemq_err_t)e)) == 0)
            return (idemq_err_t)e;
    return IDEMQ_OK;
}

/* s as a JSON string, with every byte that is not UTF-8 made '?'. */
static json_t *text(const char *s)
{
    char buf[1024];
    snprintf(buf, sizeof buf, "%s", s);
    job_utf8_sanitize(buf);
    return json_string(buf);
}

char *ledger_observe_doc(const struct conf *c, struct job *const *jobs, const bool *old, int n)
{
    json_t *arr = json_array();
    char *out = NULL;

    if (!arr)
        return NULL;
    for (int i = 0; i < n; i++) {
        const struct job *j = jobs[i];
        const struct conf_input *in = &c->inputs[j->input];
        bool keyed = j->has_key && job_utf8_valid((const unsigned char *)j->key, strlen(j->key));
        json_t *o = json_object();
        if (!o || json_array_append_new(arr, o))
            goto out;
        if (json_object_set_new(o, "n", text(in->name)) ||
            json_object_set_new(o, "q", text(in->queue)) ||
            json_object_set_new(o, "k", keyed ? json_string(j->key) : json_null()) ||
            json_object_set_new(o, "h", j->sha256_hex[0] ? json_string(j->sha256_hex)
                                                         : json_null()) ||
            json_object_set_new(o, "w", json_boolean(old && old[i])) ||
            json_object_set_new(o, "kp", json_boolean(in->key_reuse_parks)) ||
            json_object_set_new(o, "rd", json_boolean(j->redelivered)))
            goto out;
        if (j->decode_err != IDEMQ_OK || !keyed) {
            /* what apply mode would park it as (park_undecoded's code) */
            idemq_err_t code = j->decode_err != IDEMQ_OK ? j->decode_err : IDEMQ_ERR_KEY_INVALID;
            if (json_object_set_new(o, "c", json_string(idemq_err_name(code))) ||
                json_object_set_new(o, "r", text(j->reason)))
                goto out;
        }
    }
    out = json_dumps(arr, JSON_COMPACT);
out:
    json_decref(arr);
    return out;
}
