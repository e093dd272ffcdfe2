/*
 * protect: AES-256-GCM of stored payload copies under keys read from
 * files (see protect.h).
 */
#include "protect.h"

#include <errno.h>
#include <fcntl.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/rand.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "conf.h"

#define NONCE 12
#define TAG 16
#define ID_MAX 32

struct protect_key {
    char id[ID_MAX + 1];
    unsigned char k[PROTECT_KEY_BYTES];
};

struct protect {
    struct protect_key *keys;
    int n;
    int active; /* index, or -1 */
};

static struct protect *global;

void protect_set_global(struct protect *p) { global = p; }

const struct protect *protect_global(void) { return global; }

static int hexval(int c)
{
    return c >= '0' && c <= '9' ? c - '0'
           : c >= 'a' && c <= 'f' ? c - 'a' + 10
           : c >= 'A' && c <= 'F' ? c - 'A' + 10
                                  : -1;
}

/* Reads one key file into k; false with errbuf set. */
static bool read_key(const char *id, const char *path, unsigned char *k, char *errbuf,
                     size_t errlen)
{
    unsigned char buf[2 * PROTECT_KEY_BYTES + 4];
    struct stat st;
    ssize_t got;
    size_t n;
    bool ok = false;
    int fd = open(path, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);

    if (fd < 0) {
        snprintf(errbuf, errlen, "protection.keys: key %s: cannot open %s: %s", id, path,
                 strerror(errno));
        return false;
    }
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        snprintf(errbuf, errlen, "protection.keys: key %s: %s is not a regular file", id, path);
        goto out;
    }
    if (st.st_mode & 077) {
        snprintf(errbuf, errlen,
                 "protection.keys: key %s: %s may be read or written by others than its owner "
                 "(mode %03o; chmod 600)",
                 id, path, (unsigned)(st.st_mode & 0777));
        goto out;
    }
    got = read(fd, buf, sizeof buf);
    n = got > 0 ? (size_t)got : 0;
    if (n == PROTECT_KEY_BYTES) {
        memcpy(k, buf, PROTECT_KEY_BYTES);
        ok = true;
    } else {
        while (n > 0 && (buf[n - 1] == '\n' || buf[n - 1] == '\r'))
            n--;
        if (n == 2 * PROTECT_KEY_BYTES) {
            ok = true;
            for (size_t i = 0; i < PROTECT_KEY_BYTES && ok; i++) {
                int hi = hexval(buf[2 * i]), lo = hexval(buf[2 * i + 1]);
                ok = hi >= 0 && lo >= 0;
                k[i] = (unsigned char)(hi << 4 | lo);
            }
        }
        if (!ok)
            snprintf(errbuf, errlen,
                     "protection.keys: key %s: %s must hold %d bytes, raw or as %d hex digits "
                     "(openssl rand -hex 32)",
                     id, path, PROTECT_KEY_BYTES, 2 * PROTECT_KEY_BYTES);
    }
out:
    OPENSSL_cleanse(buf, sizeof buf);
    close(fd);
    return ok;
}

idemq_err_t protect_load(const struct conf *c, struct protect **out, char *errbuf,
                         size_t errlen)
{
    struct protect *p = calloc(1, sizeof *p);

    *out = NULL;
    if (!p || (c->protection_keys.n > 0 &&
               !(p->keys = calloc((size_t)c->protection_keys.n, sizeof *p->keys)))) {
        free(p);
        snprintf(errbuf, errlen, "out of memory");
        return IDEMQ_ERR_NOMEM;
    }
    p->active = -1;
    for (int i = 0; i < c->protection_keys.n; i++) {
        const char *e = c->protection_keys.v[i], *eq = strchr(e, '=');
        struct protect_key *k = &p->keys[p->n];
        if (!e[0])
            continue; /* the default: none */
        /* conf validated the form: id=path */
        snprintf(k->id, sizeof k->id, "%.*s", (int)(eq - e), e);
        if (!read_key(k->id, eq + 1, k->k, errbuf, errlen)) {
            protect_free(p);
            return IDEMQ_ERR_CONFIG;
        }
        if (c->protection_active[0] && strcmp(k->id, c->protection_active) == 0)
            p->active = p->n;
        p->n++;
    }
    *out = p;
    return IDEMQ_OK;
}

void protect_free(struct protect *p)
{
    if (!p)
        return;
    if (p->keys)
        OPENSSL_cleanse(p->keys, sizeof *p->keys * (size_t)(p->n > 0 ? p->n : 0));
    free(p->keys);
    free(p);
}

const char *protect_active(const struct protect *p)
{
    return p && p->active >= 0 ? p->keys[p->active].id : NULL;
}

idemq_err_t protect_seal(const struct protect *p, const unsigned char *in, size_t n,
                         unsigned char **out, size_t *outlen)
{
    const struct protect_key *k;
    EVP_CIPHER_CTX *x = NULL;
    unsigned char *o;
    int len = 0, fin = 0;
    idemq_err_t err = IDEMQ_ERR_INTERNAL;

    *out = NULL;
    *outlen = 0;
    if (!protect_active(p))
        return IDEMQ_ERR_CONFIG;
    if (n > (size_t)0x7fffffff - PROTECT_OVERHEAD)
        return IDEMQ_ERR_INTERNAL;
    k = &p->keys[p->active];
    if (!(o = malloc(n + PROTECT_OVERHEAD)))
        return IDEMQ_ERR_NOMEM;
    if (RAND_bytes(o, NONCE) != 1 || !(x = EVP_CIPHER_CTX_new()) ||
        EVP_EncryptInit_ex(x, EVP_aes_256_gcm(), NULL, NULL, NULL) != 1 ||
        EVP_CIPHER_CTX_ctrl(x, EVP_CTRL_GCM_SET_IVLEN, NONCE, NULL) != 1 ||
        EVP_EncryptInit_ex(x, NULL, NULL, k->k, o) != 1 ||
        EVP_EncryptUpdate(x, NULL, &len, (const unsigned char *)k->id, (int)strlen(k->id)) != 1 ||
        (n > 0 && EVP_EncryptUpdate(x, o + NONCE, &len, in, (int)n) != 1) ||
        EVP_EncryptFinal_ex(x, o + NONCE + (n > 0 ? len : 0), &fin) != 1 ||
        EVP_CIPHER_CTX_ctrl(x, EVP_CTRL_GCM_GET_TAG, TAG, o + NONCE + n) != 1)
        goto out;
    *out = o;
    *outlen = n + PROTECT_OVERHEAD;
    o = NULL;
    err = IDEMQ_OK;
out:
    EVP_CIPHER_CTX_free(x);
    free(o);
    return err;
}

idemq_err_t protect_seal_stored(const unsigned char *in, size_t n, unsigned char **out,
                                size_t *outlen, const char **key_id)
{
    const struct protect *p = protect_global();
    idemq_err_t err;
    *out = NULL;
    *outlen = 0;
    *key_id = NULL;
    if (!protect_active(p))
        return IDEMQ_OK;
    if ((err = protect_seal(p, in ? in : (const unsigned char *)"", in ? n : 0, out, outlen)))
        return err;
    *key_id = protect_active(p);
    return IDEMQ_OK;
}

enum protect_open_result protect_open(const struct protect *p, const char *key_id,
                                      const unsigned char *in, size_t n, unsigned char **out,
                                      size_t *outlen)
{
    const struct protect_key *k = NULL;
    EVP_CIPHER_CTX *x = NULL;
    unsigned char *o = NULL;
    size_t m;
    int len = 0, fin = 0;
    enum protect_open_result r = PROTECT_FAILED;

    *out = NULL;
    *outlen = 0;
    for (int i = 0; p && key_id && i < p->n && !k; i++)
        if (strcmp(p->keys[i].id, key_id) == 0)
            k = &p->keys[i];
    if (!k)
        return PROTECT_NO_KEY;
    if (n < PROTECT_OVERHEAD || n - PROTECT_OVERHEAD > 0x7fffffff)
        return PROTECT_BAD_COPY;
    m = n - PROTECT_OVERHEAD;
    if (!(o = malloc(m + 1)))
        return PROTECT_FAILED;
    if (!(x = EVP_CIPHER_CTX_new()) ||
        EVP_DecryptInit_ex(x, EVP_aes_256_gcm(), NULL, NULL, NULL) != 1 ||
        EVP_CIPHER_CTX_ctrl(x, EVP_CTRL_GCM_SET_IVLEN, NONCE, NULL) != 1 ||
        EVP_DecryptInit_ex(x, NULL, NULL, k->k, in) != 1 ||
        EVP_DecryptUpdate(x, NULL, &len, (const unsigned char *)k->id, (int)strlen(k->id)) != 1 ||
        (m > 0 && EVP_DecryptUpdate(x, o, &len, in + NONCE, (int)m) != 1) ||
        EVP_CIPHER_CTX_ctrl(x, EVP_CTRL_GCM_SET_TAG, TAG, (void *)(in + NONCE + m)) != 1)
        goto out;
    if (EVP_DecryptFinal_ex(x, o + (m > 0 ? len : 0), &fin) != 1) {
        r = PROTECT_BAD_COPY;
        goto out;
    }
    o[m] = '\0';
    *out = o;
    *outlen = m;
    o = NULL;
    r = PROTECT_OPENED;
out:
    EVP_CIPHER_CTX_free(x);
    if (o) {
        OPENSSL_cleanse(o, m + 1);
        free(o);
    }
    return r;
}

const char *protect_open_str(enum protect_open_result r)
{
    switch (r) {
    case PROTECT_OPENED: return "opened";
    case PROTECT_NO_KEY: return "its key is not configured (protection.keys)";
    case PROTECT_BAD_COPY: return "altered, or sealed with another key of that id";
    case PROTECT_FAILED: return "out of memory or OpenSSL failed";
    }
    return "?";
}
