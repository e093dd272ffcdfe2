/*
 * seal: HMAC-SHA256 seals on redrive headers (see seal.h).
 */
#include "seal.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/params.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static unsigned char secret[SEAL_SECRET_MAX];
static size_t secret_len;

bool seal_set_secret(const unsigned char *s, size_t len)
{
    if (len < 16 || len > SEAL_SECRET_MAX)
        return false;
    pthread_mutex_lock(&lock);
    memcpy(secret, s, len);
    secret_len = len;
    pthread_mutex_unlock(&lock);
    return true;
}

static int hexval(char c)
{
    return c >= '0' && c <= '9' ? c - '0'
           : c >= 'a' && c <= 'f' ? c - 'a' + 10
           : c >= 'A' && c <= 'F' ? c - 'A' + 10
                                  : -1;
}

bool seal_set_secret_hex(const char *hex)
{
    unsigned char b[SEAL_SECRET_MAX];
    size_t n = 0;
    bool ok;
    if (hex[0] == '\\' && hex[1] == 'x')
        hex += 2;
    for (; hex[0] && hex[1] && n < sizeof b; hex += 2) {
        int hi = hexval(hex[0]), lo = hexval(hex[1]);
        if (hi < 0 || lo < 0)
            return false;
        b[n++] = (unsigned char)(hi << 4 | lo);
    }
    ok = !hex[0] && seal_set_secret(b, n);
    OPENSSL_cleanse(b, sizeof b);
    return ok;
}

bool seal_ready(void)
{
    bool r;
    pthread_mutex_lock(&lock);
    r = secret_len > 0;
    pthread_mutex_unlock(&lock);
    return r;
}

/* HMAC over a length-prefixed list of fields (no field can run into the
 * next, whatever bytes a key holds), as hex. */
static bool mac(const char *const *fields, int n, char out[SEAL_HEX])
{
    unsigned char md[EVP_MAX_MD_SIZE];
    unsigned int mdlen = 0;
    EVP_MAC *m = EVP_MAC_fetch(NULL, "HMAC", NULL);
    EVP_MAC_CTX *ctx = m ? EVP_MAC_CTX_new(m) : NULL;
    OSSL_PARAM params[2];
    size_t got = 0;
    bool ok = false;

    params[0] = OSSL_PARAM_construct_utf8_string("digest", (char *)"SHA256", 0);
    params[1] = OSSL_PARAM_construct_end();
    pthread_mutex_lock(&lock);
    if (ctx && secret_len && EVP_MAC_init(ctx, secret, secret_len, params) == 1) {
        ok = true;
        for (int i = 0; i < n && ok; i++) {
            char len[24];
            int l = snprintf(len, sizeof len, "%zu:", strlen(fields[i]));
            ok = EVP_MAC_update(ctx, (const unsigned char *)len, (size_t)l) == 1 &&
                 EVP_MAC_update(ctx, (const unsigned char *)fields[i], strlen(fields[i])) == 1;
        }
        ok = ok && EVP_MAC_final(ctx, md, &got, sizeof md) == 1 && got == 32;
    }
    pthread_mutex_unlock(&lock);
    EVP_MAC_CTX_free(ctx);
    EVP_MAC_free(m);
    mdlen = (unsigned int)got;
    if (ok)
        for (unsigned int i = 0; i < mdlen; i++)
            snprintf(out + 2 * i, 3, "%02x", md[i]);
    return ok;
}

bool seal_park(const char *key, long long generation, long long park_id, char out[SEAL_HEX])
{
    char g[24], p[24];
    const char *f[4] = {"idemq park v1", key, g, p};
    snprintf(g, sizeof g, "%lld", generation);
    snprintf(p, sizeof p, "%lld", park_id);
    return mac(f, 4, out);
}

bool seal_by(const char *key, long long generation, long long park_id, const char *by,
             char out[SEAL_HEX])
{
    char g[24], p[24];
    const char *f[5] = {"idemq redrive v1", key, g, p, by};
    snprintf(g, sizeof g, "%lld", generation);
    snprintf(p, sizeof p, "%lld", park_id);
    return mac(f, 5, out);
}

/* Integer header value, or fallback when absent or not an integer. */
static long long int_header(const json_t *h, const char *name, long long fallback)
{
    json_t *v = json_object_get(h, name);
    return json_is_integer(v) ? (long long)json_integer_value(v) : fallback;
}

static bool same(const char *expected, const json_t *v)
{
    const char *got = json_string_value(v);
    return got && strlen(got) == SEAL_HEX - 1 && CRYPTO_memcmp(expected, got, SEAL_HEX - 1) == 0;
}

bool seal_check_headers(json_t *headers, const char *key, char *why, size_t whylen)
{
    json_t *gen = json_object_get(headers, "x-idemq-generation");
    long long g, p;
    char want[SEAL_HEX];
    const char *by;

    if (!gen)
        return true;
    if (!json_is_integer(gen)) {
        snprintf(why, whylen, "x-idemq-generation is not an integer");
        return false;
    }
    g = (long long)json_integer_value(gen);
    p = int_header(headers, "x-idemq-park-id", -1);
    if (!seal_park(key, g, p, want)) {
        snprintf(why, whylen, "no redrive secret to check x-idemq-seal with");
        return false;
    }
    if (!same(want, json_object_get(headers, "x-idemq-seal"))) {
        snprintf(why, whylen, "x-idemq-generation %lld without a valid x-idemq-seal: a redrive "
                              "idemq did not make", g);
        return false;
    }
    by = json_string_value(json_object_get(headers, "x-idemq-redriven-by"));
    if (json_object_get(headers, "x-idemq-redriven-by") &&
        !(by && seal_by(key, g, p, by, want) &&
          same(want, json_object_get(headers, "x-idemq-redrive-seal"))))
        json_object_del(headers, "x-idemq-redriven-by");
    return true;
}

bool seal_put_park(json_t *headers, const char *key)
{
    json_t *gen = json_object_get(headers, "x-idemq-generation");
    char s[SEAL_HEX];
    if (!key || !json_is_integer(gen))
        return true;
    return seal_park(key, (long long)json_integer_value(gen),
                     int_header(headers, "x-idemq-park-id", -1), s) &&
           json_object_set_new(headers, "x-idemq-seal", json_string(s)) == 0;
}
