/*
 * celery: the Celery task protocol. Reads a task message of
 * protocol 2 (the `task` header; body [args, kwargs, embed]) or 1 (all in
 * the body), JSON serializer only, within limits, into a struct
 * celery_task; turns it into a job (route by task name to an effect, the
 * idempotency key from a kwarg, an arg or the task id, the effect's
 * payload {"args","kwargs"} and meta.celery); and writes the result
 * messages Celery's rpc:// backend reads. Pickle bodies are never decoded:
 * the content type alone parks them. Pure (no broker, no database).
 *
 * API: celery_parse -> celery_task_clear (tests, fuzzing);
 *      celery_decode (job_decode of a Celery input);
 *      celery_reply_body (consumer/celery_reply.c).
 */
#ifndef IDEMQ_CELERY_H
#define IDEMQ_CELERY_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>

#include "conf.h"
#include "idemq_err.h"
#include "job.h"

#define CELERY_STR_MAX 255      /* task name, ids, group, origin (bytes) */
#define CELERY_TIME_MAX 64      /* eta / expires text (bytes) */
#define CELERY_MAX_ARGS 1024    /* positional arguments */
#define CELERY_MAX_KWARGS 1024  /* keyword arguments */
#define CELERY_RETRIES_MAX 1000000
/* The direct exchange Celery results are published to (`idemq declare`
 * creates it for Celery inputs); each reply queue is bound to it under its
 * own name before its first reply. */
#define CELERY_REPLIES_EXCHANGE "idemq.celery.replies"

struct celery_task {
    int version; /* 1 or 2 */
    char task[CELERY_STR_MAX + 1];
    char id[CELERY_STR_MAX + 1];
    char root_id[CELERY_STR_MAX + 1];   /* "" when absent */
    char parent_id[CELERY_STR_MAX + 1];
    char group[CELERY_STR_MAX + 1];
    char origin[CELERY_STR_MAX + 1];
    char reply_to[CELERY_STR_MAX + 1];  /* AMQP property; "" = none */
    char correlation_id[CELERY_STR_MAX + 1];
    long long retries;                  /* -1 when absent */
    bool has_eta, has_expires;
    long long eta_ms, expires_ms;       /* ms since the epoch (UTC) */
    char eta[CELERY_TIME_MAX + 1], expires[CELERY_TIME_MAX + 1]; /* as sent */
    bool ignore_result;
    char embed[64]; /* non-empty callbacks, errbacks, chain, chord: "callbacks,chain" */
    json_t *args;   /* array (owned) */
    json_t *kwargs; /* object (owned) */
};

/* Releases what t owns and zeroes it. */
void celery_task_clear(struct celery_task *t);

/*
 * Reads one task message: body[0..len) as received, headers (the AMQP
 * header table as JSON, adapters/amqp_table) and props (the other AMQP
 * properties as JSON: content_type, content_encoding, reply_to,
 * correlation_id). Returns IDEMQ_OK with t filled, or a code with reason
 * set and t cleared: IDEMQ_ERR_CELERY_PICKLE (content type
 * application/x-python-serialize; the body is not looked at),
 * _SERIALIZER (YAML, msgpack, any other content type or encoding),
 * _COMPRESSED (kombu's `compression` header, or a compressing content
 * encoding), _MALFORMED (anything else that is not a protocol 1 or 2
 * message of JSON within the limits above). Pure; t is cleared first.
 */
idemq_err_t celery_parse(const unsigned char *body, size_t len, const json_t *headers,
                         const json_t *props, struct celery_task *t, char *reason,
                         size_t rlen) IDEMQ_MUSTCHECK;

/*
 * Parses an ISO 8601 date-time as Celery writes eta and expires
 * (YYYY-MM-DD[T ]HH:MM[:SS[.fraction]][Z|+HH:MM|-HH:MM|+HHMM]; no zone is
 * UTC) into *ms since the epoch. false if it is not one. Pure.
 */
bool celery_parse_time(const char *s, long long *ms);

/*
 * job_decode of a Celery input: the limits of the message contract (body
 * size, header tables), then celery_parse, the route of the task name, the
 * key per in->key_kind, expiry at now_ms and the forged-redrive check.
 * Sets j->decode_err and returns it; on IDEMQ_OK j->effect, j->payload,
 * j->meta_extra and the key are set, and j->hold_ms > 0 when an eta lies
 * ahead. The reply facts (j->reply, task_id, reply_to, correlation_id) are
 * set whenever the headers and properties could be read, so a parked task
 * is answered too; j->celery_err keeps a Celery-specific code. An expired
 * task returns IDEMQ_ERR_CELERY_EXPIRED with the job otherwise complete
 * (effect, payload, key): `expires` applies only to a key not yet claimed,
 * which the batch decides (consumer/batch.c). Pure but for the process's
 * seal secret.
 */
idemq_err_t celery_decode(struct job *j, const struct conf_input *in, long long now_ms);

/*
 * The body of a result message as the rpc:// backend reads it
 * ({"task_id","status","result","traceback","children","date_done"}):
 * status SUCCESS with result (any JSON; NULL is null), or FAILURE /
 * REVOKED with an exception a Python client rebuilds
 * ({"exc_type","exc_message":[message],"exc_module"}; exc_module NULL is
 * null: Celery then makes a class of that name). date_done is ISO 8601
 * UTC of now. New string (caller frees), NULL when out of memory.
 */
char *celery_reply_body(const char *task_id, const char *status, const json_t *result,
                        const char *exc_type, const char *exc_module, const char *message);

#endif
