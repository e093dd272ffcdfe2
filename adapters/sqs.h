/*
 * sqs: a small Amazon SQS client (inputs with transport = "sqs"). It owns
 * the wire: requests on SQS's JSON protocol (POST /, Content-Type
 * application/x-amz-json-1.0, X-Amz-Target AmazonSQS.<Action>), signed
 * with SigV4 by libcurl (CURLOPT_AWS_SIGV4), TLS verified; the credentials
 * (the AWS environment variables or the shared credentials file, never
 * logged); the limits on every answer (its size, at most 10 messages, a
 * body of at most 1 MiB, the attributes); and the mapping of every
 * answer to one status. What a status means for a job is the worker's.
 *
 * API: sqs_client_new -> sqs_receive / sqs_delete_batch /
 *      sqs_change_visibility / sqs_send / sqs_queue_attribute ... ->
 *      sqs_client_free. One client per thread.
 */
#ifndef IDEMQ_SQS_H
#define IDEMQ_SQS_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>

/* Limits of what an answer may hold (SQS's own limits). */
#define SQS_MAX_MESSAGES 10
#define SQS_MAX_BODY (1024 * 1024) /* SQS's limit since August 2025 (was 256 KiB) */
#define SQS_MAX_ATTRIBUTES 10
#define SQS_MAX_VISIBILITY_S (12 * 3600)
/* An answer larger than this is refused unread: 10 bodies of 1 MiB each
 * escaped as \uXXXX (6 bytes a byte) fit, with their envelope. The buffer
 * grows with what is read, so the bound costs nothing until it is used. */
#define SQS_MAX_ANSWER (10L * SQS_MAX_BODY * 6 + 1024 * 1024)

/* What one request came to. Every answer is one of these. */
enum sqs_status {
    SQS_OK = 0,
    SQS_THROTTLED,   /* ThrottlingException, RequestThrottled, 429: back off */
    SQS_UNAVAILABLE, /* no answer (connect, timeout, reset) or a 5xx: back off */
    SQS_DENIED,      /* credentials refused or missing, signature, access denied */
    SQS_REFUSED,     /* any other 4xx: the request itself (a queue that does not
                      * exist, a receipt handle that expired) */
    SQS_BAD_ANSWER,  /* a 2xx that is too large or not the schema */
};

/* Short name of a status, for logs. */
const char *sqs_status_name(enum sqs_status s);

struct sqs_client_config {
    const char *queue_url; /* https://HOST/ACCOUNT/NAME */
    const char *region;
    const char *endpoint;  /* "" = the queue URL's scheme and host */
    long timeout_ms;       /* of a request beyond its long-poll wait */
    long visibility_s;     /* VisibilityTimeout of a receive (the lease); 0 = the queue's */
    /* polled during a long poll; true aborts it (SQS_UNAVAILABLE): a
     * stopping daemon does not wait out 20 s. NULL = never */
    bool (*should_stop)(void);
};

struct sqs_client;

/* One message of a receive. Strings are NUL-terminated copies; body holds
 * body_len bytes. group_id is NULL on a standard queue. attributes is the
 * message attributes object as received (a new reference, or NULL). */
struct sqs_message {
    char *id;
    char *receipt;
    char *body;
    size_t body_len;
    char *group_id;
    long receive_count; /* ApproximateReceiveCount, 0 if absent */
    json_t *attributes;
};

/*
 * A client of cfg's queue; credentials from AWS_ACCESS_KEY_ID /
 * AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN, else the profile AWS_PROFILE
 * (or "default") of AWS_SHARED_CREDENTIALS_FILE (or ~/.aws/credentials).
 * Returns 0 and *out, or -1 with a message in err naming what is missing
 * (never a secret).
 */
int sqs_client_new(const struct sqs_client_config *cfg, struct sqs_client **out, char *err,
                   size_t errlen);
void sqs_client_free(struct sqs_client *c);

/*
 * ReceiveMessage: up to max (1..10) messages, waiting up to wait_s seconds
 * (0..20) for the first, with their ApproximateReceiveCount, MessageGroupId
 * and every message attribute. *msgs (free with sqs_messages_free) and *n
 * are set on SQS_OK. A message whose body exceeds SQS_MAX_BODY (more than
 * SQS itself accepts) or that lacks its id, receipt or body makes the
 * whole answer SQS_BAD_ANSWER
 * (nothing is deleted: the messages come back after their visibility).
 */
enum sqs_status sqs_receive(struct sqs_client *c, int max, int wait_s, struct sqs_message **msgs,
                            int *n, char *err, size_t errlen);
void sqs_messages_free(struct sqs_message *msgs, int n);

/*
 * DeleteMessageBatch of n (1..10) receipt handles. On SQS_OK, failed[i] is
 * 1 for each entry SQS did not delete (an expired receipt: the message
 * comes back, a duplicate then), 0 otherwise; *n_failed their count.
 */
enum sqs_status sqs_delete_batch(struct sqs_client *c, const char *const *receipts, int n,
                                 int *failed, int *n_failed, char *err, size_t errlen);

/* ChangeMessageVisibility of one receipt to seconds (capped at 12 h). */
enum sqs_status sqs_change_visibility(struct sqs_client *c, const char *receipt, long seconds,
                                      char *err, size_t errlen);

/*
 * SendMessage to queue_url (NULL = the client's queue): body, group_id and
 * dedup_id (FIFO queues; NULL otherwise), attributes a JSON object of
 * name -> string value (sent as DataType String) or integer (DataType
 * Number); may be NULL. *message_id
 * (free) is set on SQS_OK: the send is confirmed only by that answer.
 */
enum sqs_status sqs_send(struct sqs_client *c, const char *queue_url, const char *body,
                         const char *group_id, const char *dedup_id, const json_t *attributes,
                         char **message_id, char *err, size_t errlen);

/* GetQueueAttributes of one attribute name: *value (free) on SQS_OK, NULL
 * if the queue does not have it. */
enum sqs_status sqs_queue_attribute(struct sqs_client *c, const char *name, char **value,
                                    char *err, size_t errlen);

/* A message's attributes (as received: name -> {DataType, StringValue})
 * into headers: String (and String.label) as text, Number as an integer
 * when it is one, else as text; Binary ones are not carried. */
void sqs_attributes_to_headers(const json_t *attrs, json_t *headers);

#endif
