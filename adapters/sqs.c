/*
 * sqs: the Amazon SQS client on libcurl (see sqs.h). Each request is one
 * signed POST of a JSON document; the answer is read with a cap and parsed
 * with jansson; the status comes from the HTTP code and the error's
 * __type.
 */
#include "sqs.h"

#include <curl/curl.h>
#include <errno.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

struct sqs_client {
    CURL *easy;
    char *url;        /* where requests go: endpoint or the queue URL's origin, "/" */
    char *queue_url;
    char *userpwd;    /* "KEY:SECRET" for CURLOPT_USERPWD; never logged */
    char *token_hdr;  /* "X-Amz-Security-Token: ..." or NULL */
    char sigv4[96];   /* "aws:amz:REGION:sqs" */
    long timeout_ms;
    long visibility_s;
    bool (*should_stop)(void);
};

struct buf {
    char *p;
    size_t n;
    bool over;
};

const char *sqs_status_name(enum sqs_status s)
{
    switch (s) {
    case SQS_OK: return "ok";
    case SQS_THROTTLED: return "throttled";
    case SQS_UNAVAILABLE: return "unavailable";
    case SQS_DENIED: return "denied";
    case SQS_REFUSED: return "refused";
    case SQS_BAD_ANSWER: return "bad answer";
    }
    return "?";
}

static void errf(char *err, size_t len, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void errf(char *err, size_t len, const char *fmt, ...)
{
    va_list ap;
    if (!err || !len)
        return;
    va_start(ap, fmt);
    vsnprintf(err, len, fmt, ap);
    va_end(ap);
}

/* ---- credentials ---- */

static char *trim(char *s)
{
    char *e;
    while (*s == ' ' || *s == '\t')
        s++;
    e = s + strlen(s);
    while (e > s && strchr(" \t\r\n", e[-1]))
        *--e = '\0';
    return s;
}

/* Reads key, secret and token of profile from the shared credentials file.
 * Returns 0 if both key and secret were found. */
static int creds_file(const char *path, const char *profile, char **key, char **secret,
                      char **token)
{
    char line[1024], want[160];
    bool in = false;
    FILE *f = fopen(path, "r");
    if (!f)
        return -1;
    snprintf(want, sizeof want, "[%s]", profile);
    while (fgets(line, sizeof line, f)) {
        char *l = trim(line), *eq;
        if (*l == '[') {
            in = strcmp(l, want) == 0;
            continue;
        }
        if (!in || !(eq = strchr(l, '=')))
            continue;
        *eq = '\0';
        char *name = trim(l), *val = trim(eq + 1);
        char **slot = strcmp(name, "aws_access_key_id") == 0       ? key
                      : strcmp(name, "aws_secret_access_key") == 0 ? secret
                      : strcmp(name, "aws_session_token") == 0     ? token
                                                                   : NULL;
        if (slot && *val) {
            free(*slot);
            *slot = strdup(val);
        }
    }
    fclose(f);
    return *key && *secret ? 0 : -1;
}

/* ---- the client ---- */

void sqs_client_free(struct sqs_client *c)
{
    if (!c)
        return;
    if (c->easy)
        curl_easy_cleanup(c->easy);
    free(c->url);
    free(c->queue_url);
    if (c->userpwd) {
        memset(c->userpwd, 0, strlen(c->userpwd));
        free(c->userpwd);
    }
    if (c->token_hdr) {
        memset(c->token_hdr, 0, strlen(c->token_hdr));
        free(c->token_hdr);
    }
    free(c);
}

int sqs_client_new(const struct sqs_client_config *cfg, struct sqs_client **out, char *err,
                   size_t errlen)
{
    struct sqs_client *c = calloc(1, sizeof *c);
    const char *origin = cfg->endpoint && cfg->endpoint[0] ? cfg->endpoint : cfg->queue_url;
    const char *host = strstr(origin, "://");
    char *key = NULL, *secret = NULL, *token = NULL;
    size_t olen;
    *out = NULL;
    if (!c || !host)
        goto nomem_or_bad;
    host += 3;
    olen = (size_t)(host - origin) + strcspn(host, "/");
    if (!(c->url = malloc(olen + 2)) || !(c->queue_url = strdup(cfg->queue_url)))
        goto nomem_or_bad;
    memcpy(c->url, origin, olen);
    strcpy(c->url + olen, "/");
    snprintf(c->sigv4, sizeof c->sigv4, "aws:amz:%s:sqs", cfg->region);
    c->timeout_ms = cfg->timeout_ms > 0 ? cfg->timeout_ms : 10000;
    c->visibility_s = cfg->visibility_s < 0                      ? 0
                      : cfg->visibility_s > SQS_MAX_VISIBILITY_S ? SQS_MAX_VISIBILITY_S
                                                                 : cfg->visibility_s;
    c->should_stop = cfg->should_stop;

    if (getenv("AWS_ACCESS_KEY_ID") && getenv("AWS_SECRET_ACCESS_KEY") &&
        *getenv("AWS_ACCESS_KEY_ID") && *getenv("AWS_SECRET_ACCESS_KEY")) {
        key = strdup(getenv("AWS_ACCESS_KEY_ID"));
        secret = strdup(getenv("AWS_SECRET_ACCESS_KEY"));
        if (getenv("AWS_SESSION_TOKEN") && *getenv("AWS_SESSION_TOKEN"))
            token = strdup(getenv("AWS_SESSION_TOKEN"));
    } else {
        char path[1024];
        const char *file = getenv("AWS_SHARED_CREDENTIALS_FILE");
        const char *profile = getenv("AWS_PROFILE");
        if (!file || !*file) {
            snprintf(path, sizeof path, "%s/.aws/credentials",
                     getenv("HOME") ? getenv("HOME") : "");
            file = path;
        }
        if (creds_file(file, profile && *profile ? profile : "default", &key, &secret,
                       &token)) {
            errf(err, errlen, "no AWS credentials: set AWS_ACCESS_KEY_ID and "
                 "AWS_SECRET_ACCESS_KEY, or a profile in the shared credentials file");
            free(key);
            free(secret);
            free(token);
            sqs_client_free(c);
            return -1;
        }
    }
    if (!key || !secret || strchr(key, ':'))
        goto creds_bad;
    if (!(c->userpwd = malloc(strlen(key) + strlen(secret) + 2)))
        goto creds_bad;
    sprintf(c->userpwd, "%s:%s", key, secret);
    if (token) {
        if (!(c->token_hdr = malloc(strlen(token) + 32)))
            goto creds_bad;
        sprintf(c->token_hdr, "X-Amz-Security-Token: %s", token);
    }
    memset(secret, 0, strlen(secret));
    free(key);
    free(secret);
    if (token)
        memset(token, 0, strlen(token));
    free(token);
    if (!(c->easy = curl_easy_init()))
        goto nomem_or_bad;
    *out = c;
    return 0;
creds_bad:
    errf(err, errlen, "AWS credentials unusable (an access key id holding ':', or out of "
         "memory)");
    if (secret)
        memset(secret, 0, strlen(secret));
    free(key);
    free(secret);
    free(token);
    sqs_client_free(c);
    return -1;
nomem_or_bad:
    errf(err, errlen, "sqs client: out of memory or a URL without a scheme");
    sqs_client_free(c);
    return -1;
}

/* ---- one request ---- */

static size_t on_data(char *p, size_t size, size_t nmemb, void *ud)
{
    struct buf *b = ud;
    size_t n = size * nmemb;
    char *q;
    if (b->n + n > (size_t)SQS_MAX_ANSWER) {
        b->over = true;
        return 0; /* curl stops: CURLE_WRITE_ERROR */
    }
    if (!(q = realloc(b->p, b->n + n + 1)))
        return 0;
    b->p = q;
    memcpy(b->p + b->n, p, n);
    b->n += n;
    b->p[b->n] = '\0';
    return n;
}

/* The status of an error answer: HTTP code and the __type of its body. */
static enum sqs_status error_status(long code, const json_t *ans)
{
    const char *type = json_string_value(json_object_get(ans, "__type"));
    type = type ? type : "";
    if (strstr(type, "Throttl") || strstr(type, "RequestThrottled") ||
        strstr(type, "RequestLimitExceeded") || code == 429)
        return SQS_THROTTLED;
    if (code >= 500)
        return SQS_UNAVAILABLE;
    if (code == 401 || code == 403 || strstr(type, "InvalidClientTokenId") ||
        strstr(type, "SignatureDoesNotMatch") || strstr(type, "AccessDenied") ||
        strstr(type, "UnrecognizedClient") || strstr(type, "MissingAuthenticationToken") ||
        strstr(type, "InvalidSecurity") || strstr(type, "ExpiredToken") ||
        strstr(type, "IncompleteSignature") ||
        /* a clock off by more than SigV4 allows: the signature is refused */
        strstr(type, "RequestExpired") || strstr(type, "RequestTimeTooSkewed"))
        return SQS_DENIED;
    return SQS_REFUSED;
}

/* libcurl's progress callback: a nonzero answer aborts the transfer. */
static int on_progress(void *ud, curl_off_t dt, curl_off_t dn, curl_off_t ut, curl_off_t un)
{
    struct sqs_client *c = ud;
    (void)dt, (void)dn, (void)ut, (void)un;
    return c->should_stop && c->should_stop() ? 1 : 0;
}

/* POSTs req as AmazonSQS.<action>; *ans is the parsed 2xx answer (a new
 * reference) on SQS_OK. wait_s extends the timeout for a long poll. */
static enum sqs_status call(struct sqs_client *c, const char *action, const json_t *req,
                            long wait_s, json_t **ans, char *err, size_t errlen)
{
    struct curl_slist *h = NULL;
    bool hdr_ok;
    struct buf b = {0};
    char target[96];
    char *body = json_dumps(req, JSON_COMPACT);
    long code = 0;
    CURLcode rc;
    enum sqs_status st;
    json_t *j = NULL;
    json_error_t je;

    *ans = NULL;
    snprintf(target, sizeof target, "X-Amz-Target: AmazonSQS.%s", action);
    h = curl_slist_append(NULL, "Content-Type: application/x-amz-json-1.0");
    hdr_ok = h && curl_slist_append(h, target) &&
             (!c->token_hdr || curl_slist_append(h, c->token_hdr));
    if (!body || !hdr_ok) {
        free(body);
        curl_slist_free_all(h);
        errf(err, errlen, "%s: out of memory", action);
        return SQS_UNAVAILABLE;
    }
    curl_easy_reset(c->easy);
    curl_easy_setopt(c->easy, CURLOPT_URL, c->url);
    curl_easy_setopt(c->easy, CURLOPT_PROTOCOLS_STR, "http,https");
    curl_easy_setopt(c->easy, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(c->easy, CURLOPT_SSL_VERIFYPEER, 1L);
    curl_easy_setopt(c->easy, CURLOPT_SSL_VERIFYHOST, 2L);
    curl_easy_setopt(c->easy, CURLOPT_FOLLOWLOCATION, 0L);
    curl_easy_setopt(c->easy, CURLOPT_CONNECTTIMEOUT_MS, c->timeout_ms);
    curl_easy_setopt(c->easy, CURLOPT_TIMEOUT_MS, c->timeout_ms + wait_s * 1000);
    curl_easy_setopt(c->easy, CURLOPT_HTTPHEADER, h);
    curl_easy_setopt(c->easy, CURLOPT_POSTFIELDS, body);
    curl_easy_setopt(c->easy, CURLOPT_POSTFIELDSIZE, (long)strlen(body));
    curl_easy_setopt(c->easy, CURLOPT_USERPWD, c->userpwd);
    curl_easy_setopt(c->easy, CURLOPT_AWS_SIGV4, c->sigv4);
    curl_easy_setopt(c->easy, CURLOPT_WRITEFUNCTION, on_data);
    curl_easy_setopt(c->easy, CURLOPT_WRITEDATA, &b);
    /* a long poll only: a delete after a commit is let finish */
    if (c->should_stop && wait_s > 0) {
        curl_easy_setopt(c->easy, CURLOPT_NOPROGRESS, 0L);
        curl_easy_setopt(c->easy, CURLOPT_XFERINFOFUNCTION, on_progress);
        curl_easy_setopt(c->easy, CURLOPT_XFERINFODATA, c);
    }
    rc = curl_easy_perform(c->easy);
    curl_easy_getinfo(c->easy, CURLINFO_RESPONSE_CODE, &code);
    curl_slist_free_all(h);
    free(body);
    if (b.over) {
        errf(err, errlen, "%s: the answer is over %ld bytes", action, (long)SQS_MAX_ANSWER);
        free(b.p);
        return SQS_BAD_ANSWER;
    }
    if (rc != CURLE_OK) {
        errf(err, errlen, "%s: %s", action, curl_easy_strerror(rc));
        free(b.p);
        return SQS_UNAVAILABLE;
    }
    j = b.n ? json_loadb(b.p, b.n, 0, &je) : json_object();
    if (code >= 200 && code < 300) {
        if (!json_is_object(j)) {
            errf(err, errlen, "%s: HTTP %ld answer is not a JSON object: %.60s", action, code,
                 b.p ? b.p : "");
            json_decref(j);
            free(b.p);
            return SQS_BAD_ANSWER;
        }
        free(b.p);
        *ans = j;
        return SQS_OK;
    }
    st = error_status(code, j);
    {
        const char *type = json_string_value(json_object_get(j, "__type"));
        const char *msg = json_string_value(json_object_get(j, "message"));
        msg = msg ? msg : json_string_value(json_object_get(j, "Message"));
        errf(err, errlen, "%s: HTTP %ld %.100s: %.200s", action, code, type ? type : "",
             msg ? msg : "");
    }
    json_decref(j);
    free(b.p);
    return st;
}

/* ---- the actions ---- */

static char *dup_str(const json_t *v)
{
    const char *s = json_string_value(v);
    return s ? strdup(s) : NULL;
}

void sqs_messages_free(struct sqs_message *m, int n)
{
    if (!m)
        return;
    for (int i = 0; i < n; i++) {
        free(m[i].id);
        free(m[i].receipt);
        free(m[i].body);
        free(m[i].group_id);
        json_decref(m[i].attributes);
    }
    free(m);
}

enum sqs_status sqs_receive(struct sqs_client *c, int max, int wait_s, struct sqs_message **msgs,
                            int *n, char *err, size_t errlen)
{
    json_t *req, *ans = NULL, *list;
    enum sqs_status st;
    struct sqs_message *m = NULL;
    size_t k = 0, cnt;

    *msgs = NULL;
    *n = 0;
    max = max < 1 ? 1 : max > SQS_MAX_MESSAGES ? SQS_MAX_MESSAGES : max;
    wait_s = wait_s < 0 ? 0 : wait_s > 20 ? 20 : wait_s;
    req = json_pack("{s:s, s:i, s:i, s:[s,s], s:[s], s:[s,s]}", "QueueUrl", c->queue_url,
                    "MaxNumberOfMessages", max, "WaitTimeSeconds", wait_s,
                    "AttributeNames", "ApproximateReceiveCount", "MessageGroupId",
                    "MessageAttributeNames", "All",
                    "MessageSystemAttributeNames", "ApproximateReceiveCount", "MessageGroupId");
    if (req && c->visibility_s > 0)
        json_object_set_new(req, "VisibilityTimeout", json_integer(c->visibility_s));
    if (!req) {
        errf(err, errlen, "ReceiveMessage: out of memory");
        return SQS_UNAVAILABLE;
    }
    st = call(c, "ReceiveMessage", req, wait_s, &ans, err, errlen);
    json_decref(req);
    if (st != SQS_OK)
        return st;
    list = json_object_get(ans, "Messages");
    if (!list) {
        json_decref(ans);
        return SQS_OK;
    }
    cnt = json_array_size(list);
    if (!json_is_array(list) || cnt > SQS_MAX_MESSAGES) {
        errf(err, errlen, "ReceiveMessage: Messages is not an array of at most %d",
             SQS_MAX_MESSAGES);
        json_decref(ans);
        return SQS_BAD_ANSWER;
    }
    if (cnt && !(m = calloc(cnt, sizeof *m))) {
        json_decref(ans);
        errf(err, errlen, "ReceiveMessage: out of memory");
        return SQS_UNAVAILABLE;
    }
    for (k = 0; k < cnt; k++) {
        json_t *e = json_array_get(list, k), *body = json_object_get(e, "Body");
        json_t *attrs = json_object_get(e, "Attributes");
        json_t *mattrs = json_object_get(e, "MessageAttributes");
        const char *rc_s = json_string_value(json_object_get(attrs, "ApproximateReceiveCount"));
        if (!json_is_string(body) || json_string_length(body) > SQS_MAX_BODY ||
            !json_is_string(json_object_get(e, "MessageId")) ||
            !json_is_string(json_object_get(e, "ReceiptHandle")) ||
            (mattrs && (!json_is_object(mattrs) || json_object_size(mattrs) > SQS_MAX_ATTRIBUTES))) {
            errf(err, errlen, "ReceiveMessage: message %zu lacks its id, receipt or body, or its "
                 "body is over %d bytes, or it has over %d attributes", k, SQS_MAX_BODY,
                 SQS_MAX_ATTRIBUTES);
            sqs_messages_free(m, (int)cnt);
            json_decref(ans);
            return SQS_BAD_ANSWER;
        }
        m[k].id = dup_str(json_object_get(e, "MessageId"));
        m[k].receipt = dup_str(json_object_get(e, "ReceiptHandle"));
        m[k].body_len = json_string_length(body);
        if ((m[k].body = malloc(m[k].body_len + 1)))
            memcpy(m[k].body, json_string_value(body), m[k].body_len + 1);
        m[k].group_id = dup_str(json_object_get(attrs, "MessageGroupId"));
        m[k].receive_count = rc_s ? strtol(rc_s, NULL, 10) : 0;
        m[k].attributes = mattrs ? json_incref(mattrs) : NULL;
        if (!m[k].id || !m[k].receipt || !m[k].body) {
            sqs_messages_free(m, (int)cnt);
            json_decref(ans);
            errf(err, errlen, "ReceiveMessage: out of memory");
            return SQS_UNAVAILABLE;
        }
    }
    json_decref(ans);
    *msgs = m;
    *n = (int)cnt;
    return SQS_OK;
}

enum sqs_status sqs_delete_batch(struct sqs_client *c, const char *const *receipts, int n,
                                 int *failed, int *n_failed, char *err, size_t errlen)
{
    json_t *entries = json_array(), *req, *ans = NULL, *bad;
    enum sqs_status st;
    size_t i;
    json_t *v;
    *n_failed = 0;
    if (n < 1 || n > SQS_MAX_MESSAGES || !entries) {
        json_decref(entries);
        errf(err, errlen, "DeleteMessageBatch: 1 to %d entries, not %d", SQS_MAX_MESSAGES, n);
        return SQS_REFUSED;
    }
    for (int k = 0; k < n; k++) {
        char id[16];
        failed[k] = 0;
        snprintf(id, sizeof id, "%d", k);
        json_array_append_new(entries, json_pack("{s:s, s:s}", "Id", id, "ReceiptHandle",
                                                 receipts[k]));
    }
    req = json_pack("{s:s, s:o}", "QueueUrl", c->queue_url, "Entries", entries);
    if (!req) {
        errf(err, errlen, "DeleteMessageBatch: out of memory");
        return SQS_UNAVAILABLE;
    }
    st = call(c, "DeleteMessageBatch", req, 0, &ans, err, errlen);
    json_decref(req);
    if (st != SQS_OK)
        return st;
    bad = json_object_get(ans, "Failed");
    json_array_foreach(bad, i, v) {
        const char *id = json_string_value(json_object_get(v, "Id"));
        char *end;
        long k = id ? strtol(id, &end, 10) : -1;
        if (id && *end == '\0' && k >= 0 && k < n && !failed[k]) {
            failed[k] = 1;
            (*n_failed)++;
        }
    }
    json_decref(ans);
    return SQS_OK;
}

enum sqs_status sqs_change_visibility(struct sqs_client *c, const char *receipt, long seconds,
                                      char *err, size_t errlen)
{
    json_t *req, *ans = NULL;
    enum sqs_status st;
    seconds = seconds < 0 ? 0 : seconds > SQS_MAX_VISIBILITY_S ? SQS_MAX_VISIBILITY_S : seconds;
    req = json_pack("{s:s, s:s, s:I}", "QueueUrl", c->queue_url, "ReceiptHandle", receipt,
                    "VisibilityTimeout", (json_int_t)seconds);
    if (!req) {
        errf(err, errlen, "ChangeMessageVisibility: out of memory");
        return SQS_UNAVAILABLE;
    }
    st = call(c, "ChangeMessageVisibility", req, 0, &ans, err, errlen);
    json_decref(req);
    json_decref(ans);
    return st;
}

enum sqs_status sqs_send(struct sqs_client *c, const char *queue_url, const char *body,
                         const char *group_id, const char *dedup_id, const json_t *attributes,
                         char **message_id, char *err, size_t errlen)
{
    json_t *req = json_pack("{s:s, s:s}", "QueueUrl", queue_url ? queue_url : c->queue_url,
                            "MessageBody", body);
    json_t *ans = NULL, *ma = NULL;
    const char *name;
    json_t *v;
    enum sqs_status st;
    *message_id = NULL;
    if (req && group_id)
        json_object_set_new(req, "MessageGroupId", json_string(group_id));
    if (req && dedup_id)
        json_object_set_new(req, "MessageDeduplicationId", json_string(dedup_id));
    if (req && attributes && json_object_size(attributes)) {
        if (json_object_size(attributes) > SQS_MAX_ATTRIBUTES) {
            json_decref(req);
            errf(err, errlen, "SendMessage: over %d attributes", SQS_MAX_ATTRIBUTES);
            return SQS_REFUSED;
        }
        ma = json_object();
        json_object_foreach((json_t *)attributes, name, v) {
            char num[32];
            if (json_is_string(v)) {
                json_object_set_new(ma, name, json_pack("{s:s, s:s}", "DataType", "String",
                                                        "StringValue", json_string_value(v)));
            } else if (json_is_integer(v)) {
                snprintf(num, sizeof num, "%" JSON_INTEGER_FORMAT, json_integer_value(v));
                json_object_set_new(ma, name, json_pack("{s:s, s:s}", "DataType", "Number",
                                                        "StringValue", num));
            }
        }
        json_object_set_new(req, "MessageAttributes", ma);
    }
    if (!req) {
        errf(err, errlen, "SendMessage: out of memory");
        return SQS_UNAVAILABLE;
    }
    st = call(c, "SendMessage", req, 0, &ans, err, errlen);
    json_decref(req);
    if (st == SQS_OK && !(*message_id = dup_str(json_object_get(ans, "MessageId")))) {
        errf(err, errlen, "SendMessage: the answer has no MessageId");
        st = SQS_BAD_ANSWER;
    }
    json_decref(ans);
    return st;
}

enum sqs_status sqs_queue_attribute(struct sqs_client *c, const char *name, char **value,
                                    char *err, size_t errlen)
{
    json_t *req = json_pack("{s:s, s:[s]}", "QueueUrl", c->queue_url, "AttributeNames", name);
    json_t *ans = NULL;
    enum sqs_status st;
    *value = NULL;
    if (!req) {
        errf(err, errlen, "GetQueueAttributes: out of memory");
        return SQS_UNAVAILABLE;
    }
    st = call(c, "GetQueueAttributes", req, 0, &ans, err, errlen);
    json_decref(req);
    if (st == SQS_OK)
        *value = dup_str(json_object_get(json_object_get(ans, "Attributes"), name));
    json_decref(ans);
    return st;
}

void sqs_attributes_to_headers(const json_t *attrs, json_t *headers)
{
    const char *name;
    json_t *v;
    json_object_foreach((json_t *)attrs, name, v) {
        const char *type = json_string_value(json_object_get(v, "DataType"));
        const char *sv = json_string_value(json_object_get(v, "StringValue"));
        if (!type || !sv)
            continue;
        if (strncmp(type, "Number", 6) == 0) {
            char *end;
            long long x;
            errno = 0;
            x = strtoll(sv, &end, 10);
            if (end != sv && !*end && !errno) {
                json_object_set_new(headers, name, json_integer(x));
                continue;
            }
        }
        json_object_set_new(headers, name, json_string(sv));
    }
}
