/*
 * broker_tls: amqps:// sockets per broker.tls (see broker_tls.h).
 */
#include "broker_tls.h"

#include <amqp_ssl_socket.h>
#include <openssl/err.h>
#include <stdio.h>
#include <string.h>

#include "log.h"

amqp_socket_t *broker_tls_socket(amqp_connection_state_t conn, const struct conf *c,
                                 char *errbuf, size_t errlen)
{
    amqp_socket_t *sock = amqp_ssl_socket_new(conn);
    int rc;

    if (!sock) {
        snprintf(errbuf, errlen, "cannot create a TLS socket (out of memory?)");
        return NULL;
    }
    ERR_clear_error(); /* explain() reads what this connection leaves */
    if ((rc = amqp_ssl_socket_set_ssl_versions(sock, AMQP_TLSv1_2, AMQP_TLSvLATEST))) {
        snprintf(errbuf, errlen, "cannot require TLS 1.2 or newer: %s", amqp_error_string2(rc));
        return NULL;
    }
    if ((rc = amqp_ssl_socket_set_cacert(sock, c->tls_ca_file))) {
        snprintf(errbuf, errlen, "cannot load broker.tls.ca_file \"%s\": %s", c->tls_ca_file,
                 amqp_error_string2(rc));
        return NULL;
    }
    if (c->tls_cert_file[0] &&
        (rc = amqp_ssl_socket_set_key(sock, c->tls_cert_file, c->tls_key_file))) {
        snprintf(errbuf, errlen,
                 "cannot load broker.tls.cert_file \"%s\" with key_file \"%s\": %s (both PEM, "
                 "the key unencrypted and matching the certificate)",
                 c->tls_cert_file, c->tls_key_file, amqp_error_string2(rc));
        return NULL;
    }
    amqp_ssl_socket_set_verify_peer(sock, !c->tls_verify_off);
    amqp_ssl_socket_set_verify_hostname(sock, !c->tls_verify_off);
    if (c->tls_verify_off)
        log_warn("broker.tls.verify = \"none\": the broker's certificate and name are NOT "
                 "verified; anyone on the path can read and change this connection");
    return sock;
}

/* OpenSSL's most specific reason left in this thread's queue, or "". */
static void ssl_reason(char *buf, size_t len)
{
    unsigned long e, last = 0;
    while ((e = ERR_get_error()) != 0)
        last = e;
    buf[0] = '\0';
    if (last)
        ERR_error_string_n(last, buf, len);
}

void broker_tls_explain_login(const struct conf *c, char *err, size_t len)
{
    char ssl[256];
    size_t n = strlen(err);
    ssl_reason(ssl, sizeof ssl);
    snprintf(err + n, len - n, "%s%s%s; if the broker requires a client certificate, set "
             "broker.tls.cert_file and key_file%s",
             ssl[0] ? " (" : "", ssl, ssl[0] ? ")" : "",
             c->tls_cert_file[0] ? " (set: check that the broker trusts its CA)" : "");
}

const char *broker_tls_explain(int rc, const char *host, const struct conf *c, char *buf,
                               size_t len)
{
    char ssl[256];
    const char *hint = "";

    ssl_reason(ssl, sizeof ssl);
    switch (rc) {
    case AMQP_STATUS_SSL_HOSTNAME_VERIFY_FAILED:
        hint = "; the certificate must name the host of the URL as a DNS name in "
               "subjectAltName (IP addresses are not matched: use the DNS name)";
        break;
    case AMQP_STATUS_SSL_PEER_VERIFY_FAILED:
        hint = "; the broker's certificate does not chain to a CA in broker.tls.ca_file (or "
               "it expired): refusing to talk to an unverified broker";
        break;
    case AMQP_STATUS_SSL_CONNECTION_FAILED:
    case AMQP_STATUS_SSL_ERROR:
        hint = "; the broker's certificate must chain to a CA in broker.tls.ca_file, and a "
               "broker that requires a client certificate needs broker.tls.cert_file and "
               "key_file";
        break;
    default:
        break;
    }
    snprintf(buf, len, "TLS connection to %s failed: %s%s%s%s (ca_file %s)", host,
             amqp_error_string2(rc), ssl[0] ? " (" : "", ssl, ssl[0] ? ")" : "", c->tls_ca_file);
    /* the hint goes last so a cut message still names the cause */
    if (strlen(buf) + strlen(hint) < len)
        strcat(buf, hint);
    return buf;
}
