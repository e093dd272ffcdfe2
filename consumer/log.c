/*
 * log: formats and writes log lines to stderr under a mutex, with a UTC
 * timestamp and the level; panics log file:line and abort.
 */
#include "log.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

volatile int log_current_level = LOG_LVL_INFO;
static pthread_mutex_t log_lock = PTHREAD_MUTEX_INITIALIZER;

int log_level_parse(const char *s)
{
    static const char *const names[] = {"error", "warn", "info", "debug"};
    for (int i = 0; i < 4; i++)
        if (strcmp(s, names[i]) == 0)
            return i;
    return -1;
}

static void log_vwrite(int level, const char *file, int line, const char *fmt, va_list ap)
    __attribute__((format(printf, 4, 0)));

static void log_vwrite(int level, const char *file, int line, const char *fmt, va_list ap)
{
    static const char *const tags[] = {"ERROR", "WARN", "INFO", "DEBUG"};
    struct timespec ts;
    struct tm tm;
    char stamp[32];

    clock_gettime(CLOCK_REALTIME, &ts);
    gmtime_r(&ts.tv_sec, &tm);
    strftime(stamp, sizeof stamp, "%Y-%m-%dT%H:%M:%S", &tm);
    pthread_mutex_lock(&log_lock);
    fprintf(stderr, "%s.%03ldZ idemq[%s]", stamp, ts.tv_nsec / 1000000L,
            tags[level < 0 ? 0 : level > 3 ? 3 : level]);
    if (level == LOG_LVL_DEBUG || level == LOG_LVL_ERROR)
        fprintf(stderr, " %s:%d", file, line);
    fputs(" ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    fflush(stderr);
    pthread_mutex_unlock(&log_lock);
}

void log_write(int level, const char *file, int line, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    log_vwrite(level, file, line, fmt, ap);
    va_end(ap);
}

void log_panic(const char *file, int line, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    log_vwrite(LOG_LVL_ERROR, file, line, fmt, ap);
    va_end(ap);
    abort();
}
