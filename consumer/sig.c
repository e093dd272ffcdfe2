/*
 * sig: async-signal-safe handlers that only set flags (or _exit on a second
 * stop request).
 */
#include "sig.h"

#include <signal.h>
#include <stdatomic.h>
#include <string.h>
#include <unistd.h>

/* A lock-free C11 atomic, not volatile sig_atomic_t: the handler runs in one
 * thread and the workers read the flag in others (volatile orders nothing
 * between threads; ThreadSanitizer reported the race). Lock-free atomics are
 * async-signal-safe. */
static atomic_int stop_requests;
_Static_assert(ATOMIC_INT_LOCK_FREE == 2, "the stop flag must be a lock-free atomic");

static void on_stop(int signo)
{
    (void)signo;
    if (atomic_fetch_add(&stop_requests, 1) > 0) {
        static const char msg[] = "idemq: second stop signal, exiting at once\n";
        (void)!write(STDERR_FILENO, msg, sizeof msg - 1);
        _exit(130);
    }
}

void sig_install(void)
{
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_stop;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    sa.sa_handler = SIG_IGN;
    sigaction(SIGPIPE, &sa, NULL);
}

bool sig_stop_requested(void) { return atomic_load(&stop_requests) > 0; }

void sig_request_stop(void)
{
    int none = 0;
    (void)atomic_compare_exchange_strong(&stop_requests, &none, 1);
}
