/*
 * lifecycle: maintain, archive list / export / verify, and the ledger.*
 * settings of migrate and run (see lifecycle.h). The work is in the
 * ledger's functions (ledger/functions_retention.sql); this is the
 * command line around them.
 */
#include "lifecycle.h"

#include <errno.h>
#include <openssl/evp.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "ledger_retention.h"
#include "log.h"
#include "ops.h"

#define MAINTAIN_BUDGET_MS 1000
#define MAINTAIN_CALLS 10000

static PGconn *connect(const struct conf *c) { return ops_connect(c, "idemq lifecycle", 0); }


static long long jint(json_t *v, const char *k)
{
    return json_integer_value(json_object_get(v, k));
}

int lifecycle_migrate_settings(PGconn *db, const struct conf *c, FILE *out)
{
    struct ledger_db_error e;
    bool changed = false;
    json_t *res = NULL;

    if (ledger_retention_apply(db, c, &changed, &e)) {
        log_error("cannot write the ledger.* settings: %s %s", e.sqlstate, e.message);
        return 5;
    }
    fprintf(out, "ledger windows%s: dedup %g days, partitions of %s, hot %g days, retention "
            "%g days\n", changed ? " (changed)" : "", c->dedup_window_days,
            c->partition_interval, c->history_hot_days, c->history_retention_days);
    if (ledger_retention_maintain(db, "idemq migrate", MAINTAIN_BUDGET_MS, NULL, &res, &e)) {
        log_error("first maintenance call failed: %s %s", e.sqlstate, e.message);
        return 5;
    }
    if (jint(res, "created"))
        fprintf(out, "created %lld history partitions ahead\n", jint(res, "created"));
    json_decref(res);
    return 0;
}

void lifecycle_check_settings(PGconn *db, const struct conf *c)
{
    PGresult *r = PQexec(db, "SELECT idemq.ledger_settings()");
    json_t *v;
    double w, h, k, iv;

    if (PQresultStatus(r) != PGRES_TUPLES_OK || PQntuples(r) != 1) {
        log_warn("cannot read the ledger's windows: %s", PQerrorMessage(db));
        PQclear(r);
        return;
    }
    v = json_loads(PQgetvalue(r, 0, 0), 0, NULL);
    PQclear(r);
    w = json_number_value(json_object_get(v, "dedup_window_s"));
    iv = json_number_value(json_object_get(v, "partition_interval_s"));
    h = json_number_value(json_object_get(v, "history_hot_s"));
    k = json_number_value(json_object_get(v, "history_retention_s"));
#define DIFF(a, b) ((a) - (b) > 0.5 || (b) - (a) > 0.5)
    if (DIFF(w, c->dedup_window_days * 86400) || DIFF(iv, c->partition_interval_s) ||
        DIFF(h, c->history_hot_days * 86400) || DIFF(k, c->history_retention_days * 86400))
        log_warn("the ledger's windows (dedup %g days, partitions of %g s, hot %g days, "
                 "retention %g days) differ from ledger.* in %s; the ledger's apply: run "
                 "`idemq migrate` with this configuration to change them",
                 w / 86400, iv, h / 86400, k / 86400, c->path);
#undef DIFF
    json_decref(v);
}

int lifecycle_maintain(const struct conf *c, const char *now, FILE *out)
{
    struct ledger_db_error e;
    PGconn *db = connect(c);
    long long total[5] = {0, 0, 0, 0, 0};
    static const char *const names[5] = {"created", "archived", "dropped", "rescued", "pruned"};
    int calls = 0, rc = 0;

    if (!db)
        return 4;
    for (; calls < MAINTAIN_CALLS; calls++) {
        json_t *res = NULL;
        bool did = false;
        if (ledger_retention_maintain(db, "idemq maintain", MAINTAIN_BUDGET_MS, now, &res, &e)) {
            log_error("maintenance failed: %s %s", e.sqlstate, e.message);
            rc = 1;
            break;
        }
        if (json_is_true(json_object_get(res, "busy"))) {
            fprintf(out, "another session is maintaining the ledger; nothing done\n");
            json_decref(res);
            break;
        }
        ledger_retention_log_failures(res);
        for (int i = 0; i < 5; i++) {
            total[i] += jint(res, names[i]);
            did = did || jint(res, names[i]);
        }
        if (did)
            fprintf(out, "maintain: created %lld, archived %lld, dropped %lld partitions; moved "
                    "%lld rows out of default partitions; pruned %lld keys\n",
                    jint(res, "created"), jint(res, "archived"), jint(res, "dropped"),
                    jint(res, "rescued"), jint(res, "pruned"));
        if (!json_is_true(json_object_get(res, "more"))) {
            json_decref(res);
            calls++;
            break;
        }
        json_decref(res);
    }
    if (rc == 0)
        fprintf(out, "maintenance done in %d call%s: %lld partitions created, %lld archived, "
                "%lld dropped, %lld rows moved out of default partitions, %lld keys pruned\n",
                calls, calls == 1 ? "" : "s", total[0], total[1], total[2], total[3], total[4]);
    PQfinish(db);
    return rc;
}

int lifecycle_archive_list(const struct conf *c, FILE *out)
{
    PGconn *db = connect(c);
    PGresult *r;
    int rc = 0;

    if (!db)
        return 4;
    r = PQexec(db,
               "SELECT h.relname, h.kind, h.lo, h.hi, h.location, "
               "CASE WHEN h.location = 'dropped' THEN NULL ELSE "
               "(SELECT greatest(c.reltuples, 0)::bigint FROM pg_class c JOIN pg_namespace n ON "
               "n.oid = c.relnamespace WHERE c.relname = h.relname AND n.nspname = "
               "CASE h.location WHEN 'archive' THEN 'idemq_archive' ELSE 'idemq' END) END, "
               "CASE WHEN h.pruned_at IS NOT NULL THEN 'yes' WHEN h.kind IN ('attempts', "
               "'batches') THEN 'no' ELSE '-' END, coalesce(h.export_sha256, '-'), "
               "coalesce(h.archived_at::text, '-'), coalesce(h.dropped_at::text, '-') "
               "FROM idemq.history_parts h ORDER BY h.kind, h.lo");
    if (PQresultStatus(r) != PGRES_TUPLES_OK) {
        log_error("cannot read the history register: %s", PQerrorMessage(db));
        rc = PQstatus(db) == CONNECTION_OK ? 1 : 4;
        goto out;
    }
    fprintf(out, "%-34s %-8s %-22s %-22s %-8s %-10s %-6s %s\n", "partition", "kind", "from",
            "to", "where", "rows(est)", "pruned", "export sha256");
    for (int i = 0; i < PQntuples(r); i++)
        fprintf(out, "%-34s %-8s %-22.22s %-22.22s %-8s %-10s %-6s %s\n", ops_val(r, i, 0),
                ops_val(r, i, 1), ops_val(r, i, 2), ops_val(r, i, 3), ops_val(r, i, 4),
                ops_val(r, i, 5), ops_val(r, i, 6), ops_val(r, i, 7));
out:
    PQclear(r);
    PQfinish(db);
    return rc;
}

static void hex(const unsigned char *md, unsigned n, char *out)
{
    static const char digits[] = "0123456789abcdef";
    for (unsigned i = 0; i < n; i++) {
        out[2 * i] = digits[md[i] >> 4];
        out[2 * i + 1] = digits[md[i] & 15];
    }
    out[2 * n] = '\0';
}

/* Writes one archived partition to path (through path.tmp, renamed when
 * complete): sha_hex and *rows receive its SHA-256 and data rows. */
static int export_one(PGconn *db, const char *relname, const char *path, char *sha_hex,
                      long long *rows)
{
    char tmp[4200], *ident = PQescapeIdentifier(db, relname, strlen(relname));
    char sql[512];
    unsigned char md[EVP_MAX_MD_SIZE];
    unsigned mdlen = 0;
    EVP_MD_CTX *ctx = EVP_MD_CTX_new();
    FILE *f = NULL;
    PGresult *r;
    char *buf;
    int n, rc = 1;
    long long lines = 0;

    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    if (!ident || !ctx || EVP_DigestInit_ex(ctx, EVP_sha256(), NULL) != 1)
        goto out;
    if (!(f = fopen(tmp, "wb"))) {
        log_error("cannot write %s: %s", tmp, strerror(errno));
        goto out;
    }
    snprintf(sql, sizeof sql, "COPY idemq_archive.%s TO STDOUT (FORMAT csv, HEADER true)", ident);
    r = PQexec(db, sql);
    if (PQresultStatus(r) != PGRES_COPY_OUT) {
        log_error("COPY of %s failed: %s", relname, PQerrorMessage(db));
        PQclear(r);
        goto out;
    }
    PQclear(r);
    while ((n = PQgetCopyData(db, &buf, 0)) > 0) { /* one row per call */
        lines++;
        if (fwrite(buf, 1, (size_t)n, f) != (size_t)n ||
            EVP_DigestUpdate(ctx, buf, (size_t)n) != 1) {
            PQfreemem(buf);
            log_error("cannot write %s: %s", tmp, strerror(errno));
            while (PQgetCopyData(db, &buf, 0) > 0)
                PQfreemem(buf);
            goto drain;
        }
        PQfreemem(buf);
    }
    if (n == -2) {
        log_error("COPY of %s failed: %s", relname, PQerrorMessage(db));
        goto drain;
    }
    rc = 0;
drain:
    while ((r = PQgetResult(db))) {
        if (PQresultStatus(r) != PGRES_COMMAND_OK) {
            log_error("COPY of %s failed: %s", relname, PQresultErrorMessage(r));
            rc = 1;
        }
        PQclear(r);
    }
    if (rc == 0 && (fflush(f) != 0 || fsync(fileno(f)) != 0)) {
        log_error("cannot write %s: %s", tmp, strerror(errno));
        rc = 1;
    }
    if (fclose(f) != 0)
        rc = 1;
    f = NULL;
    if (rc == 0 && EVP_DigestFinal_ex(ctx, md, &mdlen) != 1)
        rc = 1;
    if (rc == 0 && rename(tmp, path) != 0) {
        log_error("cannot rename %s: %s", tmp, strerror(errno));
        rc = 1;
    }
    if (rc == 0) {
        hex(md, mdlen, sha_hex);
        *rows = lines > 0 ? lines - 1 : 0; /* the header is the first line */
    } else {
        unlink(tmp);
    }
out:
    if (f) {
        fclose(f);
        unlink(tmp);
    }
    EVP_MD_CTX_free(ctx);
    PQfreemem(ident);
    return rc;
}

static const char *base_name(const char *path)
{
    const char *slash = strrchr(path, '/');
    return slash ? slash + 1 : path;
}

int lifecycle_archive_export(const struct conf *c, const char *dir, bool all, FILE *out)
{
    struct stat st;
    PGconn *db;
    PGresult *r;
    int rc = 0, done = 0;

    if (!dir || stat(dir, &st) != 0 || !S_ISDIR(st.st_mode)) {
        fprintf(stderr, "idemq: archive export needs --dir DIR, an existing directory\n");
        return 2;
    }
    if (!(db = connect(c)))
        return 4;
    r = PQexec(db, all ? "SELECT relname FROM idemq.history_parts WHERE location = 'archive' "
                         "ORDER BY kind, lo"
                       : "SELECT relname FROM idemq.history_parts WHERE location = 'archive' "
                         "AND export_sha256 IS NULL ORDER BY kind, lo");
    if (PQresultStatus(r) != PGRES_TUPLES_OK) {
        log_error("cannot read the history register: %s", PQerrorMessage(db));
        PQclear(r);
        PQfinish(db);
        return 4;
    }
    for (int i = 0; i < PQntuples(r); i++) {
        const char *rel = PQgetvalue(r, i, 0);
        char path[4096], side[4200], sha[2 * EVP_MAX_MD_SIZE + 1], rows_s[32];
        const char *params[4] = {rel, path, sha, rows_s};
        long long rows = 0;
        PGresult *w;
        FILE *f;

        snprintf(path, sizeof path, "%s/%s.csv", dir, rel);
        if (export_one(db, rel, path, sha, &rows) != 0) {
            rc = 1;
            continue;
        }
        snprintf(side, sizeof side, "%s.sha256", path);
        if (!(f = fopen(side, "w")) || fprintf(f, "%s  %s\n", sha, base_name(path)) < 0 ||
            fclose(f) != 0) {
            log_error("cannot write %s: %s", side, strerror(errno));
            rc = 1;
            continue;
        }
        snprintf(rows_s, sizeof rows_s, "%lld", rows);
        w = PQexecParams(db, "SELECT idemq.archive_exported($1, $2, $3, $4::bigint)", 4, NULL,
                         params, NULL, NULL, 0);
        if (PQresultStatus(w) != PGRES_TUPLES_OK) {
            log_error("exported %s but cannot record it: %s", rel, PQerrorMessage(db));
            rc = 1;
        } else {
            fprintf(out, "exported %s: %lld rows, sha256 %s\n", path, rows, sha);
            done++;
        }
        PQclear(w);
    }
    fprintf(out, "%d partition%s exported to %s\n", done, done == 1 ? "" : "s", dir);
    PQclear(r);
    PQfinish(db);
    return rc;
}

/* SHA-256 of a file as hex into out; false if it cannot be read. */
static bool file_sha256(const char *path, char *out)
{
    unsigned char buf[65536], md[EVP_MAX_MD_SIZE];
    unsigned mdlen = 0;
    EVP_MD_CTX *ctx = EVP_MD_CTX_new();
    FILE *f = fopen(path, "rb");
    size_t n;
    bool ok = f && ctx && EVP_DigestInit_ex(ctx, EVP_sha256(), NULL) == 1;

    while (ok && (n = fread(buf, 1, sizeof buf, f)) > 0)
        ok = EVP_DigestUpdate(ctx, buf, n) == 1;
    ok = ok && !ferror(f) && EVP_DigestFinal_ex(ctx, md, &mdlen) == 1;
    if (ok)
        hex(md, mdlen, out);
    if (f)
        fclose(f);
    EVP_MD_CTX_free(ctx);
    return ok;
}

int lifecycle_archive_verify(const struct conf *c, const char *dir, FILE *out)
{
    PGconn *db;
    PGresult *r;
    int rc = 0, ok = 0;

    if (!dir) {
        fprintf(stderr, "idemq: archive verify needs --dir DIR\n");
        return 2;
    }
    if (!(db = connect(c)))
        return 4;
    r = PQexec(db, "SELECT relname, export_file, export_sha256, export_rows, location "
                   "FROM idemq.history_parts WHERE export_sha256 IS NOT NULL ORDER BY kind, lo");
    if (PQresultStatus(r) != PGRES_TUPLES_OK) {
        log_error("cannot read the history register: %s", PQerrorMessage(db));
        PQclear(r);
        PQfinish(db);
        return 4;
    }
    for (int i = 0; i < PQntuples(r); i++) {
        const char *rel = PQgetvalue(r, i, 0), *want = PQgetvalue(r, i, 2);
        char path[4096], side[4200], got[2 * EVP_MAX_MD_SIZE + 1], line[600] = "";
        FILE *f;

        snprintf(path, sizeof path, "%s/%s", dir, base_name(PQgetvalue(r, i, 1)));
        snprintf(side, sizeof side, "%s.sha256", path);
        if (!file_sha256(path, got)) {
            fprintf(out, "FAILED %s: cannot read %s\n", rel, path);
            rc = 1;
            continue;
        }
        if (strcmp(got, want) != 0) {
            fprintf(out, "FAILED %s: %s has sha256 %s, the ledger recorded %s\n", rel, path, got,
                    want);
            rc = 1;
            continue;
        }
        if (!(f = fopen(side, "r")) || !fgets(line, sizeof line, f) ||
            strncmp(line, want, strlen(want)) != 0) {
            fprintf(out, "FAILED %s: %s does not hold the recorded sha256\n", rel, side);
            rc = 1;
            if (f)
                fclose(f);
            continue;
        }
        fclose(f);
        if (strcmp(PQgetvalue(r, i, 4), "archive") == 0) {
            char sql[300], *ident = PQescapeIdentifier(db, rel, strlen(rel));
            PGresult *n;
            snprintf(sql, sizeof sql, "SELECT count(*) FROM idemq_archive.%s", ident ? ident : "");
            PQfreemem(ident);
            n = PQexec(db, sql);
            if (PQresultStatus(n) != PGRES_TUPLES_OK ||
                strcmp(PQgetvalue(n, 0, 0), PQgetvalue(r, i, 3)) != 0) {
                fprintf(out, "FAILED %s: the partition holds %s rows, the export %s\n", rel,
                        PQresultStatus(n) == PGRES_TUPLES_OK ? PQgetvalue(n, 0, 0) : "?",
                        PQgetvalue(r, i, 3));
                rc = 1;
                PQclear(n);
                continue;
            }
            PQclear(n);
        }
        fprintf(out, "OK %s: %s rows, sha256 %s\n", rel, PQgetvalue(r, i, 3), got);
        ok++;
    }
    fprintf(out, "%d export%s verified%s\n", ok, ok == 1 ? "" : "s", rc ? "; some FAILED" : "");
    PQclear(r);
    PQfinish(db);
    return rc;
}
