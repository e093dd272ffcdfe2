/*
 * broker_tls: the TLS side of an amqps:// connection. Builds the
 * librabbitmq-c SSL socket from the broker.tls settings (CA file, client
 * certificate and key, verification on unless switched off explicitly) and
 * turns a failed handshake into a message that names the setting to check.
 * librabbitmq-c loads no CA store of its own, so a CA file is always set.
 *
 * API: broker_tls_socket (before amqp_socket_open) -> broker_tls_explain
 *      (if the open failed).
 */
#ifndef IDEMQ_BROKER_TLS_H
#define IDEMQ_BROKER_TLS_H

#include <amqp.h>
#include <stddef.h>

#include "conf.h"

/*
 * Creates the SSL socket of conn (owned by conn, as every librabbitmq-c
 * socket) configured per c: TLS 1.2 or newer, c->tls_ca_file as the trust
 * anchors, the client certificate and key if set, peer and hostname
 * verification unless c->tls_verify_off (then a warning is logged). Returns
 * the socket, or NULL with errbuf naming the setting that failed. Thread
 * of the connection.
 */
amqp_socket_t *broker_tls_socket(amqp_connection_state_t conn, const struct conf *c,
                                 char *errbuf, size_t errlen);

/*
 * Explains a failed amqp_socket_open of a TLS socket (status rc) to host:
 * the library's text, OpenSSL's reason if it left one in this thread's
 * error queue, and what to check (ca_file, the certificate's DNS names).
 * Returns buf. Thread of the connection.
 */
const char *broker_tls_explain(int rc, const char *host, const struct conf *c, char *buf,
                               size_t len);

/*
 * Appends to err (a failed login's text) OpenSSL's reason, if this thread's
 * error queue holds one, and what to check: with TLS 1.3 a broker that
 * requires a client certificate refuses it only after the handshake.
 * Thread of the connection.
 */
void broker_tls_explain_login(const struct conf *c, char *err, size_t len);

#endif
