/*
 * sdnotify: the supervisor thread behind Type=notify (see sdnotify.h).
 */
#include "sdnotify.h"

#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <systemd/sd-daemon.h>
#include <time.h>

#include "liveness.h"
#include "log.h"
#include "sig.h"

#define TICK_MS 200          /* how often the thread looks */
#define STATUS_EVERY_MS 10000 /* counts in STATUS= at most this often */

struct sdnotify {
    const struct conf *c;
    struct worker *ws;
    int n;
    pthread_t thread;
    pthread_mutex_t lock;
    pthread_cond_t wake;
    bool stop;
    /* thread-owned */
    bool ready_sent, stopping_sent, stalled;
    uint64_t watchdog_usec; /* 0 = no watchdog */
    char last_status[700];
    long long last_status_ms, last_ping_ms;
};

static long long mono_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* Sends msg (assignments, one per line). Texts put in it went through
 * one_line(), so no worker status (which may quote a business key) can add
 * an assignment of its own. */
static void notify(const char *msg)
{
    int rc = sd_notify(0, msg);
    if (rc < 0)
        log_debug("sd_notify: %s", strerror(-rc));
}

/* s with control characters escaped, so it stays one assignment. */
static const char *one_line(const char *s, char *buf, size_t len)
{
    return log_escape_text(s, buf, len);
}

/* The readiness part of STATUS= (what changes it is sent at once). */
static bool all_ready(struct sdnotify *s, char *why, size_t len)
{
    for (int i = 0; i < s->n; i++) {
        if (!atomic_load(&s->ws[i].ready)) {
            char st[512];
            worker_status(&s->ws[i], st, sizeof st);
            char esc[600];
            snprintf(why, len, "not ready: worker %d: %s", i, one_line(st, esc, sizeof esc));
            return false;
        }
    }
    snprintf(why, len, "consuming with %d worker(s)", s->n);
    return true;
}

static void tick(struct sdnotify *s)
{
    char head[600], status[700], msg[760], live[600];
    long applied = 0, parked = 0, retried = 0, dups = 0;
    long long now = mono_ms();
    bool ready = all_ready(s, head, sizeof head);
    bool ok = liveness_ok(s->ws, s->n, (long long)s->c->live_stall_s * 1000, live, sizeof live);

    for (int i = 0; i < s->n; i++) {
        applied += atomic_load(&s->ws[i].stats.applied);
        parked += atomic_load(&s->ws[i].stats.parked);
        retried += atomic_load(&s->ws[i].stats.retried);
        dups += atomic_load(&s->ws[i].stats.duplicates);
    }
    if (sig_stop_requested() && !s->stopping_sent) {
        notify("STOPPING=1\nSTATUS=draining: finishing and acknowledging the batches in flight");
        s->stopping_sent = true;
        snprintf(s->last_status, sizeof s->last_status, "draining");
        s->last_status_ms = now;
    }
    if (!s->stopping_sent) {
        char esc[600];
        if (!ok)
            snprintf(status, sizeof status, "STUCK: %s", one_line(live, esc, sizeof esc));
        else
            snprintf(status, sizeof status, "%s; applied %ld, duplicates %ld, retried %ld, "
                     "parked %ld", head, applied, dups, retried, parked);
        if (ready && !s->ready_sent) {
            snprintf(msg, sizeof msg, "READY=1\nSTATUS=%s", status);
            notify(msg);
            s->ready_sent = true;
            snprintf(s->last_status, sizeof s->last_status, "%s", status);
            s->last_status_ms = now;
        } else if (strncmp(status, s->last_status, strlen(head)) != 0 ||
                   now - s->last_status_ms >= STATUS_EVERY_MS) {
            snprintf(msg, sizeof msg, "STATUS=%s", status);
            notify(msg);
            snprintf(s->last_status, sizeof s->last_status, "%s", status);
            s->last_status_ms = now;
        }
    }
    if (s->watchdog_usec && now - s->last_ping_ms >= (long long)(s->watchdog_usec / 2000)) {
        if (ok) {
            notify("WATCHDOG=1");
            s->last_ping_ms = now;
            s->stalled = false;
        } else if (!s->stalled) {
            log_error("watchdog: not pinging systemd: %s", live);
            s->stalled = true;
        }
    }
}

static void *run(void *arg)
{
    struct sdnotify *s = arg;
    pthread_mutex_lock(&s->lock);
    while (!s->stop) {
        struct timespec until;
        pthread_mutex_unlock(&s->lock);
        tick(s);
        pthread_mutex_lock(&s->lock);
        clock_gettime(CLOCK_REALTIME, &until);
        until.tv_nsec += TICK_MS * 1000000L;
        if (until.tv_nsec >= 1000000000L) {
            until.tv_sec++;
            until.tv_nsec -= 1000000000L;
        }
        if (!s->stop)
            pthread_cond_timedwait(&s->wake, &s->lock, &until);
    }
    pthread_mutex_unlock(&s->lock);
    return NULL;
}

idemq_err_t sdnotify_start(const struct conf *c, struct worker *ws, int n, struct sdnotify **out,
                           char *errbuf, size_t errlen)
{
    struct sdnotify *s;
    uint64_t usec = 0;

    *out = NULL;
    if (!getenv("NOTIFY_SOCKET"))
        return IDEMQ_OK;
    if (!(s = calloc(1, sizeof *s))) {
        snprintf(errbuf, errlen, "out of memory");
        return IDEMQ_ERR_NOMEM;
    }
    s->c = c;
    s->ws = ws;
    s->n = n;
    if (sd_watchdog_enabled(0, &usec) > 0)
        s->watchdog_usec = usec;
    pthread_mutex_init(&s->lock, NULL);
    pthread_cond_init(&s->wake, NULL);
    notify("STATUS=starting: connecting the workers");
    if (pthread_create(&s->thread, NULL, run, s) != 0) {
        pthread_cond_destroy(&s->wake);
        pthread_mutex_destroy(&s->lock);
        free(s);
        snprintf(errbuf, errlen, "cannot start the systemd notify thread");
        return IDEMQ_ERR_INTERNAL;
    }
    log_info("systemd: notifying %s%s", getenv("NOTIFY_SOCKET"),
             usec ? " with a watchdog" : "");
    *out = s;
    return IDEMQ_OK;
}

void sdnotify_stop(struct sdnotify *s)
{
    if (!s)
        return;
    pthread_mutex_lock(&s->lock);
    s->stop = true;
    pthread_cond_signal(&s->wake);
    pthread_mutex_unlock(&s->lock);
    pthread_join(s->thread, NULL);
    if (!s->stopping_sent)
        notify("STOPPING=1");
    notify("STATUS=stopped");
    pthread_cond_destroy(&s->wake);
    pthread_mutex_destroy(&s->lock);
    free(s);
}
