/*
 * sig: turns signals into flags the worker loops poll. SIGTERM/SIGINT ask
 * for a drain (stop taking deliveries, finish and ack what is in flight);
 * a second one exits at once. SIGHUP sets a reload request.
 */
#ifndef IDEMQ_SIG_H
#define IDEMQ_SIG_H

#include <stdbool.h>

/* Installs the handlers. Main thread, once, before workers start. */
void sig_install(void);

/* True once a stop was requested (by signal or sig_request_stop). Any thread. */
bool sig_stop_requested(void);

/* Requests a stop from code (e.g. a fatal error in one worker). */
void sig_request_stop(void);

#endif
