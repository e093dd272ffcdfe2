/*
 * log: leveled, thread-safe logging to stderr, as text lines or as one JSON
 * object per line (log.format). The macros test the level before
 * formatting, so disabled lines cost one comparison. Lines about a job go
 * through log_job() (or LOG_FIELDS with more facts) so they always carry
 * key, delivery tag and attempt. Control characters in any text (a hostile
 * key, an error message) are escaped in both formats: nothing logged can
 * start a line of its own.
 *
 * API: log_configure (once, at start) -> log_set_worker (per worker
 *      thread) -> the macros.
 */
#ifndef IDEMQ_LOG_H
#define IDEMQ_LOG_H

#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>

enum log_level { LOG_LVL_ERROR = 0, LOG_LVL_WARN, LOG_LVL_INFO, LOG_LVL_DEBUG };

extern volatile int log_current_level;

/* Structured facts of one line; NULL / negative members are unknown and
 * come out as JSON null (text lines show key, tag and attempt only). */
struct log_fields {
    const char *event;       /* stable name of what happened; NULL = "log" */
    const char *input;       /* input name */
    const char *key;         /* business key */
    unsigned long long tag;  /* delivery tag, 0 = none */
    int attempt;             /* < 0 = none */
    const char *outcome;     /* applied, retry, parked, deferred, ... */
    const char *error_class; /* transient, permanent, fatal, infrastructure */
    const char *code;        /* idemq error code, e.g. retries_exhausted */
    const char *sqlstate;
    double duration_ms;      /* < 0 = none */
};

/* The field values meaning "unknown", to start a struct log_fields from. */
#define LOG_FIELDS_NONE                                                                       \
    {NULL, NULL, NULL, 0, -1, NULL, NULL, NULL, NULL, -1.0}

/* Parses "error|warn|info|debug"; returns -1 for anything else. */
int log_level_parse(const char *s);

/* Sets the output format (json true: one JSON object per line) and the
 * consumer id every line carries (copied; NULL = none). Call once from the
 * main thread before other threads log. */
void log_configure(bool json, const char *consumer_id);

/* The worker id lines of the calling thread carry (-1 = none). Call at the
 * start of each worker thread. */
void log_set_worker(int worker_id);

/* Writes one line. Any thread. Prefer the macros. f may be NULL. */
void log_emit(int level, const char *file, int line, const struct log_fields *f,
              const char *fmt, ...) __attribute__((format(printf, 5, 6)));

/* Writes one line without fields. Any thread. Prefer the macros. */
void log_write(int level, const char *file, int line, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

/* Logs file:line and the message, then aborts. For states that cannot be. */
void log_panic(const char *file, int line, const char *fmt, ...)
    __attribute__((format(printf, 3, 4), noreturn));

/*
 * Escapes s into buf for a text line: \n, \r, \t, \\ and other control
 * bytes (below 0x20, and 0x7f) become C-style escapes, so s cannot start a
 * new line. Returns buf (always terminated; cut to len). Pure.
 */
char *log_escape_text(const char *s, char *buf, size_t len);

#define LOG_AT(lvl, ...)                                                    \
    do {                                                                    \
        if ((lvl) <= log_current_level)                                     \
            log_write((lvl), __FILE__, __LINE__, __VA_ARGS__);              \
    } while (0)
#define log_error(...) LOG_AT(LOG_LVL_ERROR, __VA_ARGS__)
#define log_warn(...) LOG_AT(LOG_LVL_WARN, __VA_ARGS__)
#define log_info(...) LOG_AT(LOG_LVL_INFO, __VA_ARGS__)
#define log_debug(...) LOG_AT(LOG_LVL_DEBUG, __VA_ARGS__)

/* A line with structured fields (fields: const struct log_fields *). */
#define LOG_FIELDS(lvl, fields, ...)                                        \
    do {                                                                    \
        if ((lvl) <= log_current_level)                                     \
            log_emit((lvl), __FILE__, __LINE__, (fields), __VA_ARGS__);     \
    } while (0)

/* A line about one job: text "key=K tag=T attempt=N: message"; in JSON the
 * three are fields and the event is "job". */
#define log_job(lvl, key_, tag_, attempt_, ...)                              \
    do {                                                                    \
        if ((lvl) <= log_current_level) {                                   \
            struct log_fields lf_ = LOG_FIELDS_NONE;                        \
            lf_.event = "job";                                              \
            lf_.key = (key_);                                               \
            lf_.tag = (unsigned long long)(tag_);                           \
            lf_.attempt = (int)(attempt_);                                  \
            log_emit((lvl), __FILE__, __LINE__, &lf_, __VA_ARGS__);         \
        }                                                                   \
    } while (0)

#define IDEMQ_PANIC(...) log_panic(__FILE__, __LINE__, __VA_ARGS__)
#ifndef NDEBUG
#define IDEMQ_ASSERT(c)                                                     \
    do {                                                                    \
        if (!(c))                                                           \
            log_panic(__FILE__, __LINE__, "assertion failed: %s", #c);      \
    } while (0)
#else
#define IDEMQ_ASSERT(c) ((void)0)
#endif

#endif
