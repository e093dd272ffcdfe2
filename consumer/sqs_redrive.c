/*
 * sqs_redrive: moves an SQS input's dead letters back to its queue, sealed
 * (see sqs_redrive.h).
 */
#include "sqs_redrive.h"

#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "job.h"
#include "log.h"
#include "protect.h"
#include "sqs.h"

/* What a redriven copy carries (at most SQS's 10 attributes): idemq's
 * redrive attributes first, then the producer's own while there is room. */
static const char *const carried[] = {
    "x-idemq-key", "x-idemq-generation", "x-idemq-park-id", "x-idemq-seal",
    "x-idemq-redriven-by", "x-idemq-redrive-seal", "traceparent", "tracestate",
};

static json_t *copy_attributes(const json_t *headers)
{
    json_t *a = json_object();
    const char *k;
    json_t *v;
    size_t n = sizeof carried / sizeof carried[0];
    if (!a)
        return NULL;
    for (size_t i = 0; i < n; i++)
        if ((v = json_object_get(headers, carried[i])))
            json_object_set(a, carried[i], v);
    json_object_foreach((json_t *)headers, k, v) {
        if (json_object_size(a) >= SQS_MAX_ATTRIBUTES)
            break;
        if (strncmp(k, "x-idemq-", 8) != 0 && !json_object_get(a, k))
            json_object_set(a, k, v);
    }
    return a;
}

static long long header_int(const json_t *h, const char *name)
{
    const json_t *v = json_object_get(h, name);
    return json_is_integer(v) ? (long long)json_integer_value(v) : -1;
}

static int cmp_ll(const void *a, const void *b)
{
    long long x = *(const long long *)a, y = *(const long long *)b;
    return x < y ? -1 : x > y;
}

/* parked_at (text, or NULL) at or after since, asked of the database. */
static bool since_ok(PGconn *db, const char *parked_at, const char *since)
{
    const char *p[2] = {parked_at, since};
    PGresult *r;
    bool ok;
    if (!since || !parked_at)
        return true;
    r = PQexecParams(db, "SELECT $1::timestamptz >= $2::timestamptz", 2, NULL, p, NULL, NULL, 0);
    ok = PQresultStatus(r) == PGRES_TUPLES_OK && strcmp(PQgetvalue(r, 0, 0), "t") == 0;
    PQclear(r);
    return ok;
}

/*
 * A dead letter the queue's redrive policy moved (no park of idemq's): a
 * park row first (idemq.adopt_dead_letter, class broker, code
 * max_receive_count), then the copy carries its id and generation. 0 or 1.
 */
static int adopt(PGconn *db, const struct conf_input *in, struct job *j, const char *key,
                 long receives, const char *by)
{
    char reason[300], count[24], size[24], *hdrs = json_dumps(j->headers, JSON_COMPACT);
    char *props = json_dumps(j->props, JSON_COMPACT);
    size_t n = 0, sealed_len;
    unsigned char *sealed, *body;
    const char *params[14], *key_id;
    PGresult *r = NULL;
    int rc = 0;
    if (protect_seal_stored(j->body, j->body_len, &sealed, &sealed_len, &key_id)) {
        log_error("cannot seal the body of SQS's dead letter %s: left in place",
                  key ? key : "(no key)");
        free(hdrs);
        free(props);
        return 1;
    }
    body = sealed ? PQescapeByteaConn(db, sealed, sealed_len, &n)
                  : PQescapeByteaConn(db, j->body, j->body_len, &n);
    free(sealed);
    snprintf(reason, sizeof reason,
             "moved to the dead-letter queue by SQS (its redrive policy: maxReceiveCount) "
             "after %ld receive(s), before idemq parked it", receives);
    snprintf(count, sizeof count, "%ld", receives);
    snprintf(size, sizeof size, "%zu", j->body_len);
    params[0] = key;
    params[1] = in->queue;
    params[2] = "";
    params[3] = in->queue;
    params[4] = (const char *)body;
    params[5] = hdrs;
    params[6] = props;
    params[7] = j->sha256_hex;
    params[8] = "max_receive_count";
    params[9] = reason;
    params[10] = count;
    params[11] = by;
    params[12] = key_id;
    params[13] = size;
    if (body && hdrs && props)
        r = PQexecParams(db,
                         "SELECT r_park_id, r_generation FROM idemq.adopt_dead_letter($1, $2, "
                         "$3, $4, $5::bytea, $6::jsonb, $7::jsonb, $8, $9, $10, $11::integer, "
                         "$12, $13, $14::bigint)",
                         14, NULL, params, NULL, NULL, 0);
    if (PQresultStatus(r) != PGRES_TUPLES_OK || PQntuples(r) != 1) {
        log_error("cannot record SQS's dead letter %s in the ledger: %s (left in place)",
                  key ? key : "(no key)", PQerrorMessage(db));
        rc = 1;
    } else {
        if (key)
            json_object_set_new(j->headers, "x-idemq-key", json_string(key));
        json_object_set_new(j->headers, "x-idemq-park-id",
                            json_integer(atoll(PQgetvalue(r, 0, 0))));
        json_object_set_new(j->headers, "x-idemq-generation",
                            json_integer(atoll(PQgetvalue(r, 0, 1))));
    }
    PQclear(r);
    PQfreemem(body);
    free(hdrs);
    free(props);
    return rc;
}

/* What stays in the dead-letter queue is made visible again at once. */
struct held {
    char **receipts;
    size_t n, cap;
};

static bool hold(struct held *h, const char *receipt)
{
    if (h->n == h->cap) {
        size_t cap = h->cap ? h->cap * 2 : 64;
        char **v = realloc(h->receipts, cap * sizeof *v);
        if (!v)
            return false;
        h->receipts = v;
        h->cap = cap;
    }
    return (h->receipts[h->n] = strdup(receipt)) && ++h->n;
}

static void release(struct sqs_client *dlq, struct held *h)
{
    for (size_t i = 0; i < h->n; i++) {
        char err[256];
        (void)sqs_change_visibility(dlq, h->receipts[i], 0, err, sizeof err);
        free(h->receipts[i]);
    }
    free(h->receipts);
    memset(h, 0, sizeof *h);
}

/* One dead letter: matched, adopted if SQS moved it, sealed, sent to the
 * queue (confirmed), deleted. 0, 1 (stop), or -1 (left in place). */
static int one(const struct conf *c, PGconn *db, const struct conf_input *in,
               const struct ops_filter *f, struct sqs_client *src, struct sqs_client *dlq,
               const struct sqs_message *m, const char *by, FILE *out, long *moved)
{
    struct job j;
    const char *key, *cls, *note = NULL;
    long long park;
    char dedup[128], err[256], *id = NULL;
    json_t *attrs;
    int rc = -1;
    enum sqs_status st;
    (void)c;

    job_init(&j);
    if (job_set_body(&j, m->body, m->body_len) != IDEMQ_OK)
        goto done;
    if (m->attributes)
        sqs_attributes_to_headers(m->attributes, j.headers);
    if (m->group_id)
        json_object_set_new(j.props, "message_group_id", json_string(m->group_id));
    {   /* the body's key and SHA-256; the headers as received */
        json_t *keep = json_deep_copy(j.headers);
        (void)job_decode(&j, in);
        if (keep) {
            json_decref(j.headers);
            j.headers = keep;
        }
    }
    /* the key: the story's, else the body's (a dead letter SQS moved) */
    key = json_string_value(json_object_get(j.headers, "x-idemq-key"));
    park = header_int(j.headers, "x-idemq-park-id");
    cls = json_string_value(json_object_get(j.headers, "x-idemq-error-class"));
    if (!key && j.has_key)
        key = j.key;
    if ((f->park_ids && (park < 0 || !bsearch(&park, f->park_ids, f->n_park_ids,
                                              sizeof *f->park_ids, cmp_ll))) ||
        (f->key && (!key || strcmp(key, f->key))) ||
        (f->error_class &&
         strcmp(cls ? cls : "broker", f->error_class) != 0) ||
        !since_ok(db, json_string_value(json_object_get(j.headers, "x-idemq-parked-at")),
                  f->since))
        goto done;
    if (f->dry_run) {
        fprintf(out, "would redrive %s (%s) to %s\n", key ? key : "(no key)",
                cls ? cls : "moved by SQS", in->queue_url);
        (*moved)++;
        goto done;
    }
    if (park < 0 && !json_object_get(j.headers, "x-idemq-generation") &&
        adopt(db, in, &j, key, m->receive_count, by)) {
        rc = 1;
        goto done;
    }
    json_object_del(j.headers, "x-idemq-redriven-by");
    json_object_del(j.headers, "x-idemq-redrive-seal");
    if (ops_seal_copy(db, &j, key, by, &note)) {
        rc = 1;
        goto done;
    }
    json_object_set_new(j.headers, "x-idemq-redriven-by", json_string(by));
    if (note)
        log_warn("%s: %s%s", in->dead_letter_queue_url, key ? key : "(no key)", note);
    if (!(attrs = copy_attributes(j.headers))) {
        rc = 1;
        goto done;
    }
    snprintf(dedup, sizeof dedup, "idemq-redrive-%lld-%lld-%s", park,
             header_int(j.headers, "x-idemq-generation"), m->id);
    dedup[strspn(dedup, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_")] =
        '\0';
    st = sqs_send(src, NULL, m->body, in->sqs_fifo ? (m->group_id ? m->group_id : "idemq") : NULL,
                  in->sqs_fifo ? dedup : NULL, attrs, &id, err, sizeof err);
    json_decref(attrs);
    free(id);
    if (st != SQS_OK) {
        log_error("redrive to %s not confirmed: %s %s (the dead-letter copy stays)",
                  in->queue_url, sqs_status_name(st), err);
        rc = 1;
        goto done;
    }
    {
        const char *r[1] = {m->receipt};
        int failed[1], nf = 0;
        st = sqs_delete_batch(dlq, r, 1, failed, &nf, err, sizeof err);
        if (st != SQS_OK || nf)
            log_warn("%s: the copy of %s was sent back but not deleted here (%s): a redrive "
                     "again would be a duplicate", in->dead_letter_queue_url,
                     key ? key : "(no key)", st != SQS_OK ? err : "receipt refused");
    }
    (*moved)++;
    if (f->on_moved)
        f->on_moved(f->moved_arg, key, park);
    fprintf(out, "redriven %s%s to %s\n", key ? key : "(no key)",
            park < 0 ? " (moved by SQS; now recorded in idemq.parked)" : "", in->queue_url);
    rc = 0;
done:
    job_destroy(&j);
    return rc;
}

int sqs_redrive_input(const struct conf *c, PGconn *db, const struct conf_input *in,
                      const struct ops_filter *f, FILE *out, long *moved, long *left)
{
    struct sqs_client_config dc = {in->dead_letter_queue_url, in->region, in->endpoint, 10000,
                                   60, NULL};
    struct sqs_client_config sc = {in->queue_url, in->region, in->endpoint, 10000, 0, NULL};
    struct sqs_client *dlq = NULL, *src = NULL;
    struct held h = {NULL, 0, 0};
    char by[300], err[256];
    int rc = 0;

    if (!in->dead_letter_queue_url[0]) {
        fprintf(out, "input %s: no dead_letter_queue_url: its parks are in the ledger only\n",
                in->name);
        return 0;
    }
    if (sqs_client_new(&dc, &dlq, err, sizeof err) || sqs_client_new(&sc, &src, err, sizeof err)) {
        log_error("input %s: %s", in->name, err);
        sqs_client_free(dlq);
        return 3;
    }
    ops_who(by, sizeof by);
    while (rc == 0 && !(f->limit > 0 && *moved >= f->limit)) {
        struct sqs_message *m;
        int n;
        enum sqs_status st = sqs_receive(dlq, SQS_MAX_MESSAGES, 1, &m, &n, err, sizeof err);
        if (st != SQS_OK) {
            log_error("reading %s: %s %s", in->dead_letter_queue_url, sqs_status_name(st), err);
            rc = 1;
            break;
        }
        if (n == 0)
            break;
        for (int i = 0; i < n; i++) {
            int r = rc || (f->limit > 0 && *moved >= f->limit)
                        ? -1
                        : one(c, db, in, f, src, dlq, &m[i], by, out, moved);
            if (r != 0) {
                (*left)++;
                if (!hold(&h, m[i].receipt))
                    rc = 1;
            }
            if (r > 0)
                rc = 1;
            if (r == 0 && f->rate > 0) {
                struct timespec ts = {(time_t)(1.0 / f->rate),
                                      (long)(1e9 / f->rate) % 1000000000L};
                nanosleep(&ts, NULL);
            }
        }
        sqs_messages_free(m, n);
    }
    release(dlq, &h);
    sqs_client_free(dlq);
    sqs_client_free(src);
    return rc;
}
