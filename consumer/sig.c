/*
 * sig: async-signal-safe handlers that only set flags (or _exit on a second
 * stop request).
 */
#include "sig.h"

#include <signal.h>
#include <string.h>
#include <unistd.h>

static volatile sig_atomic_t stop_requests;

static void on_stop(int signo)
{
    (void)signo;
    if (stop_requests++ > 0) {
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

bool sig_stop_requested(void) { return stop_requests > 0; }

void sig_request_stop(void)
{
    if (stop_requests == 0)
        stop_requests = 1;
}
