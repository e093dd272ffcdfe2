/*
 * log: formats and writes log lines to stderr under a mutex, as text
 * ("<UTC time> idemq[LEVEL] message") or JSON (jansson encodes, so keys and
 * messages are escaped by the library); panics log file:line and abort.
 */
#include "log.h"

#include <jansson.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "job.h"

#define LOG_MSG_MAX 4096 /* longer messages are cut */

volatile int log_current_level = LOG_LVL_INFO;
static pthread_mutex_t log_lock = PTHREAD_MUTEX_INITIALIZER;
static bool log_json;
static char log_consumer[256];
static _Thread_local int log_worker = -1;

static const char *const level_names[] = {"error", "warn", "info", "debug"};
static const char *const level_tags[] = {"ERROR", "WARN", "INFO", "DEBUG"};

int log_level_parse(const char *s)
{
    for (int i = 0; i < 4; i++)
        if (strcmp(s, level_names[i]) == 0)
            return i;
    return -1;
}

void log_configure(bool json, const char *consumer_id)
{
    log_json = json;
    snprintf(log_consumer, sizeof log_consumer, "%s", consumer_id ? consumer_id : "");
}

void log_set_worker(int worker_id) { log_worker = worker_id; }

char *log_escape_text(const char *s, char *buf, size_t len)
{
    size_t o = 0;
    if (!len)
        return buf;
    for (; s && *s && o + 1 < len; s++) {
        unsigned char c = (unsigned char)*s;
        char esc[5] = "";
        switch (c) {
        case '\n': memcpy(esc, "\\n", 3); break;
        case '\r': memcpy(esc, "\\r", 3); break;
        case '\t': memcpy(esc, "\\t", 3); break;
        case '\\': memcpy(esc, "\\\\", 3); break;
        default:
            if (c < 0x20 || c == 0x7f)
                snprintf(esc, sizeof esc, "\\x%02x", c);
        }
        if (esc[0]) {
            size_t n = strlen(esc);
            if (o + n + 1 > len)
                break;
            memcpy(buf + o, esc, n);
            o += n;
        } else {
            buf[o++] = (char)c;
        }
    }
    buf[o] = '\0';
    return buf;
}

/* A JSON string of s (invalid UTF-8 bytes become '?'), or null. */
static json_t *jstr(const char *s)
{
    char tmp[LOG_MSG_MAX];
    if (!s)
        return json_null();
    snprintf(tmp, sizeof tmp, "%s", s);
    job_utf8_sanitize(tmp);
    return json_string(tmp);
}

/* "worker.c" of "/src/consumer/worker.c": stable across build directories. */
static const char *base(const char *file)
{
    const char *slash = strrchr(file, '/');
    return slash ? slash + 1 : file;
}

static void stamp(char *buf, size_t len)
{
    struct timespec ts;
    struct tm tm;
    char sec[32];
    clock_gettime(CLOCK_REALTIME, &ts);
    gmtime_r(&ts.tv_sec, &tm);
    strftime(sec, sizeof sec, "%Y-%m-%dT%H:%M:%S", &tm);
    snprintf(buf, len, "%s.%03ldZ", sec, ts.tv_nsec / 1000000L);
}

static void write_json(int level, const char *file, int line, const struct log_fields *f,
                       const char *ts, const char *msg)
{
    static const struct log_fields none = LOG_FIELDS_NONE;
    char src[300];
    json_t *o = json_object();
    char *text;

    if (!f)
        f = &none;
    snprintf(src, sizeof src, "%s:%d", base(file), line);
    json_object_set_new(o, "ts", json_string(ts));
    json_object_set_new(o, "level", json_string(level_names[level]));
    json_object_set_new(o, "event", jstr(f->event ? f->event : "log"));
    json_object_set_new(o, "msg", jstr(msg));
    json_object_set_new(o, "worker", log_worker >= 0 ? json_integer(log_worker) : json_null());
    json_object_set_new(o, "input", jstr(f->input));
    json_object_set_new(o, "key", jstr(f->key));
    json_object_set_new(o, "tag", f->tag ? json_integer((json_int_t)f->tag) : json_null());
    json_object_set_new(o, "attempt", f->attempt >= 0 ? json_integer(f->attempt) : json_null());
    json_object_set_new(o, "outcome", jstr(f->outcome));
    json_object_set_new(o, "error_class", jstr(f->error_class));
    json_object_set_new(o, "code", jstr(f->code));
    json_object_set_new(o, "sqlstate", jstr(f->sqlstate));
    json_object_set_new(o, "duration_ms",
                        f->duration_ms >= 0 ? json_real(f->duration_ms) : json_null());
    json_object_set_new(o, "consumer", log_consumer[0] ? jstr(log_consumer) : json_null());
    json_object_set_new(o, "source", jstr(src));
    text = json_dumps(o, JSON_COMPACT | JSON_PRESERVE_ORDER | JSON_REAL_PRECISION(6));
    json_decref(o);
    if (text) {
        fputs(text, stderr);
        fputc('\n', stderr);
        free(text);
    } else { /* out of memory: still one parsable line */
        fprintf(stderr, "{\"ts\":\"%s\",\"level\":\"%s\",\"event\":\"log\","
                "\"msg\":\"(out of memory formatting a log line)\"}\n",
                ts, level_names[level]);
    }
}

static void write_text(int level, const char *file, int line, const struct log_fields *f,
                       const char *ts, const char *msg)
{
    char esc[LOG_MSG_MAX * 2], key[CONF_KEY_MAX_BYTES * 4 + 1];
    fprintf(stderr, "%s idemq[%s]", ts, level_tags[level]);
    if (level == LOG_LVL_DEBUG || level == LOG_LVL_ERROR)
        fprintf(stderr, " %s:%d", base(file), line);
    fputs(" ", stderr);
    if (f && (f->key || f->tag || f->attempt >= 0))
        fprintf(stderr, "key=%s tag=%llu attempt=%d: ",
                f->key ? log_escape_text(f->key, key, sizeof key) : "-", f->tag,
                f->attempt < 0 ? 0 : f->attempt);
    fputs(log_escape_text(msg, esc, sizeof esc), stderr);
    fputc('\n', stderr);
}

static void log_vemit(int level, const char *file, int line, const struct log_fields *f,
                      const char *fmt, va_list ap) __attribute__((format(printf, 5, 0)));

static void log_vemit(int level, const char *file, int line, const struct log_fields *f,
                      const char *fmt, va_list ap)
{
    char ts[48], msg[LOG_MSG_MAX];

    if (level < 0)
        level = 0;
    if (level > 3)
        level = 3;
    vsnprintf(msg, sizeof msg, fmt, ap);
    stamp(ts, sizeof ts);
    pthread_mutex_lock(&log_lock);
    if (log_json)
        write_json(level, file, line, f, ts, msg);
    else
        write_text(level, file, line, f, ts, msg);
    fflush(stderr);
    pthread_mutex_unlock(&log_lock);
}

void log_emit(int level, const char *file, int line, const struct log_fields *f,
              const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    log_vemit(level, file, line, f, fmt, ap);
    va_end(ap);
}

void log_write(int level, const char *file, int line, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    log_vemit(level, file, line, NULL, fmt, ap);
    va_end(ap);
}

void log_panic(const char *file, int line, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    log_vemit(LOG_LVL_ERROR, file, line, NULL, fmt, ap);
    va_end(ap);
    abort();
}
