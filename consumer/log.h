/*
 * log: leveled, thread-safe logging to stderr. The macros test the level
 * before formatting, so disabled lines cost one comparison. Lines about a
 * job go through log_job() so they always carry key, delivery tag, attempt.
 */
#ifndef IDEMQ_LOG_H
#define IDEMQ_LOG_H

#include <stdarg.h>

enum log_level { LOG_LVL_ERROR = 0, LOG_LVL_WARN, LOG_LVL_INFO, LOG_LVL_DEBUG };

extern volatile int log_current_level;

/* Parses "error|warn|info|debug"; returns -1 for anything else. */
int log_level_parse(const char *s);

/* Writes one line. Any thread. Prefer the macros. */
void log_write(int level, const char *file, int line, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

/* Logs file:line and the message, then aborts. For states that cannot be. */
void log_panic(const char *file, int line, const char *fmt, ...)
    __attribute__((format(printf, 3, 4), noreturn));

#define LOG_AT(lvl, ...)                                                    \
    do {                                                                    \
        if ((lvl) <= log_current_level)                                     \
            log_write((lvl), __FILE__, __LINE__, __VA_ARGS__);              \
    } while (0)
#define log_error(...) LOG_AT(LOG_LVL_ERROR, __VA_ARGS__)
#define log_warn(...) LOG_AT(LOG_LVL_WARN, __VA_ARGS__)
#define log_info(...) LOG_AT(LOG_LVL_INFO, __VA_ARGS__)
#define log_debug(...) LOG_AT(LOG_LVL_DEBUG, __VA_ARGS__)

/* A line about one job: "key=K tag=T attempt=N: message". */
#define log_job(lvl, key, tag, attempt, fmt, ...)                            \
    LOG_AT(lvl, "key=%s tag=%llu attempt=%d: " fmt, (key) ? (key) : "-",    \
           (unsigned long long)(tag), (int)(attempt), __VA_ARGS__)

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
