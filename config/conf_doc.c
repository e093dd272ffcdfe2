/*
 * conf_doc: writes the settings reference from the settings table of
 * config/conf.c (conf_key_describe), as markdown (config/SETTINGS.md) or as
 * the roff man page idemq.cfg(5), so the table and the docs cannot disagree
 * (tests/docs_check.cmake compares the committed files with this output).
 */
#include "conf_doc.h"

#include <stdbool.h>
#include <string.h>

#include "conf.h"

#define MAX_SECTIONS 64

/* One paragraph of text per section, in the same light markup as the
 * table's descriptions (`code`). A section missing here has none. */
static const struct {
    const char *section;
    const char *intro;
} intros[] = {
    {"broker", "The RabbitMQ connection of every worker and command."},
    {"broker.tls", "TLS of `amqps://` URLs (a subgroup: `broker: { tls: { ... }; };`)."},
    {"database", "The PostgreSQL connection to the ledger (and the effects)."},
    {"consumer", "Worker threads, batches and the shared rate limit of `idemq run`."},
    {"retry", "Transient failures: backoff on the broker's delay buckets, then parking."},
    {"metrics", "The HTTP endpoint of `idemq run`: `/metrics`, `/ready` and `/live`."},
    {"log", "What goes to standard error, and how."},
    {"topology", "How `idemq run` checks the exchanges, queues and bindings at start-up."},
    {"ledger", "The ledger's lifecycle: dedup window, history partitions, archive and drops. "
               "`idemq migrate` writes these to the ledger; `run` warns when they differ."},
    {"outbox", "The relay of the transactional outbox: rows written by `idemq.emit` in an "
               "effect or an application's transaction are published after their commit "
               "(mandatory, confirmed, in commit order per order key) by the processes with "
               "`relay = 1`. Unsent rows stay until sent or parked; sent rows age out with "
               "the `ledger` history partitions."},
    {"inputs[]", "`inputs` is a list of groups, one per queue consumed "
                 "(`inputs = ( { name = \"payouts\"; queue = \"payouts\"; ... } );`); "
                 "these keys go in each group."},
    {"inputs[].provider", "A group inside an input (`provider: { url = \"https://...\"; ... };`) "
                          "that makes its effect an HTTP call to a payments provider, with "
                          "the business key as `Idempotency-Key`; without it the effect is "
                          "`effect_function`."},
};

static const char *intro_of(const char *section)
{
    for (size_t i = 0; i < sizeof intros / sizeof intros[0]; i++)
        if (strcmp(intros[i].section, section) == 0)
            return intros[i].intro;
    return NULL;
}

/* Section of a row: its path without the last component, under "inputs[]"
 * for input rows ("broker.tls", "inputs[].provider"). */
static void section_of(const struct conf_key_info *k, char *buf, size_t len)
{
    const char *dot = strrchr(k->path, '.');
    int n = dot ? (int)(dot - k->path) : 0;
    if (k->input)
        snprintf(buf, len, "inputs[]%s%.*s", n ? "." : "", n, k->path);
    else
        snprintf(buf, len, "%.*s", n, k->path);
}

/* Full name of a row as a reader writes it ("inputs[].provider.url"). */
static void name_of(const struct conf_key_info *k, char *buf, size_t len)
{
    snprintf(buf, len, "%s%s", k->input ? "inputs[]." : "", k->path);
}

static size_t top_len(const char *section)
{
    const char *dot = strchr(section, '.');
    return dot ? (size_t)(dot - section) : strlen(section);
}

/*
 * The sections in print order: top-level groups in order of first
 * appearance in the table, each followed by its subgroups in order of first
 * appearance (rows of one group need not be adjacent in the table).
 */
static int sections(char names[][64], int max)
{
    char seen[MAX_SECTIONS][64];
    int nseen = 0, n = 0;
    struct conf_key_info k;

    for (int i = 0; conf_key_describe(i, &k); i++) {
        char s[64];
        bool dup = false;
        section_of(&k, s, sizeof s);
        for (int j = 0; j < nseen && !dup; j++)
            dup = strcmp(seen[j], s) == 0;
        if (!dup && nseen < MAX_SECTIONS)
            snprintf(seen[nseen++], sizeof seen[0], "%s", s);
    }
    for (int i = 0; i < nseen; i++) {
        size_t t = top_len(seen[i]);
        bool first = true;
        for (int j = 0; j < i && first; j++)
            first = !(top_len(seen[j]) == t && strncmp(seen[j], seen[i], t) == 0);
        if (!first)
            continue;
        for (int pass = 0; pass < 2; pass++) /* the group itself, then its subgroups */
            for (int j = i; j < nseen && n < max; j++)
                if (top_len(seen[j]) == t && strncmp(seen[j], seen[i], t) == 0 &&
                    (pass == 0) == (strlen(seen[j]) == t))
                    snprintf(names[n++], 64, "%s", seen[j]);
    }
    return n;
}

static const char *type_text(enum conf_key_type t)
{
    switch (t) {
    case CONF_TYPE_INT: return "integer";
    case CONF_TYPE_STR: return "string";
    case CONF_TYPE_STRLIST: return "string or list of strings";
    case CONF_TYPE_BOOL: return "boolean";
    case CONF_TYPE_DAYS: return "days (a number, may be fractional)";
    }
    return "value";
}

static void minutes_text(long m, char *buf, size_t len)
{
    if (m % 1440 == 0)
        snprintf(buf, len, "%ld day%s", m / 1440, m == 1440 ? "" : "s");
    else
        snprintf(buf, len, "%ld minute%s", m, m == 1 ? "" : "s");
}

/* Bounds as text ("1 to 65535", "length 0 to 255"); "" for booleans. */
static void range_text(const struct conf_key_info *k, char *buf, size_t len)
{
    char lo[32], hi[32];
    switch (k->type) {
    case CONF_TYPE_INT: snprintf(buf, len, "%ld to %ld", k->min, k->max); break;
    case CONF_TYPE_STR: snprintf(buf, len, "length %ld to %ld", k->min, k->max); break;
    case CONF_TYPE_STRLIST: snprintf(buf, len, "%ld to %ld entries", k->min, k->max); break;
    case CONF_TYPE_BOOL: snprintf(buf, len, "%s", ""); break;
    case CONF_TYPE_DAYS:
        minutes_text(k->min, lo, sizeof lo);
        minutes_text(k->max, hi, sizeof hi);
        snprintf(buf, len, "%s to %s", lo, hi);
        break;
    }
}

/* The default as a libconfig literal ("\"equal\"", "[\"IR001\"]", "400"),
 * or "" for a required setting. */
static void default_text(const struct conf_key_info *k, char *buf, size_t len)
{
    if (k->required) {
        snprintf(buf, len, "%s", "");
        return;
    }
    switch (k->type) {
    case CONF_TYPE_INT: snprintf(buf, len, "%ld", k->def_int); break;
    case CONF_TYPE_STR: snprintf(buf, len, "\"%s\"", k->def_str ? k->def_str : ""); break;
    case CONF_TYPE_STRLIST: snprintf(buf, len, "[\"%s\"]", k->def_str ? k->def_str : ""); break;
    case CONF_TYPE_BOOL: snprintf(buf, len, "%s", k->def_int ? "true" : "false"); break;
    case CONF_TYPE_DAYS:
        if (k->def_int % 1440 == 0)
            snprintf(buf, len, "%ld", k->def_int / 1440);
        else
            snprintf(buf, len, "%g", (double)k->def_int / 1440.0);
        break;
    }
}

static const char sensitive_text[] =
    "sensitive: `check-config` prints it redacted and it is never logged";

/* ---- markdown ---- */

/* Text with `code` spans, escaped for a markdown table cell. */
static void md_text(FILE *out, const char *s)
{
    bool code = false;
    for (; *s; s++) {
        if (*s == '`')
            code = !code;
        if (*s == '|')
            fputs("\\|", out);
        else if (!code && *s == '<')
            fputs("&lt;", out);
        else if (!code && *s == '>')
            fputs("&gt;", out);
        else if (!code && *s == '*')
            fputs("\\*", out);
        else
            fputc(*s, out);
    }
}

static void md_print(FILE *out)
{
    char secs[MAX_SECTIONS][64];
    int nsec = sections(secs, MAX_SECTIONS);

    fputs("<!-- Generated from the settings table in config/conf.c by idemq-docs: do not "
          "edit.\n     Regenerate: cmake --build build --target docs -->\n"
          "# idemq settings reference\n\n"
          "Every setting of idemq's configuration file, generated from the settings table\n"
          "in `config/conf.c` (the same table loading, defaults, range checks and\n"
          "`idemq check-config` read). The file is in libconfig syntax: groups of\n"
          "settings at the top level and a list `inputs` of groups, one per queue:\n\n"
          "```\n"
          "broker: { url = \"amqp://idemq:secret@127.0.0.1:5672/%2F\"; prefetch = 1000;\n"
          "          tls: { verify = \"full\"; }; };\n"
          "database: { dsn = \"dbname=idemq\"; };\n"
          "inputs = ( { name = \"payouts\"; queue = \"payouts\";\n"
          "             effect_function = \"app.apply_payout\"; } );\n"
          "```\n\n"
          "Unknown settings are errors, and every error names the file, the line and the\n"
          "setting. `IDEMQ_AMQP_URL` and `IDEMQ_PG_DSN` override `broker.url` and\n"
          "`database.dsn`. The sample `config/idemq.cfg` (installed as\n"
          "`/etc/idemq/idemq.cfg`) shows every setting with its default;\n"
          "[`config/README.md`](README.md) explains how they work together. The same\n"
          "reference is the man page `idemq.cfg(5)`; the command line is `idemq(1)`.\n\n"
          "Defaults are written as libconfig literals. Ranges: integers, their values;\n"
          "strings, their length in bytes; lists, their number of entries.\n\n",
          out);
    fputs("Sections:", out);
    for (int s = 0; s < nsec; s++) {
        char anchor[64];
        size_t o = 0;
        for (const char *p = secs[s]; *p && o + 1 < sizeof anchor; p++) /* GitHub's rule */
            if (*p != '.' && *p != '[' && *p != ']')
                anchor[o++] = *p;
        anchor[o] = '\0';
        fprintf(out, "%s [`%s`](#%s)", s ? "," : "", secs[s], anchor);
    }
    fputs(".\n", out);
    for (int s = 0; s < nsec; s++) {
        const char *intro = intro_of(secs[s]);
        struct conf_key_info k;
        fprintf(out, "\n## `%s`\n\n", secs[s]);
        if (intro) {
            md_text(out, intro);
            fputs("\n\n", out);
        }
        fputs("| setting | type | default | range | description |\n"
              "|---|---|---|---|---|\n", out);
        for (int i = 0; conf_key_describe(i, &k); i++) {
            char sec[64], name[128], def[512], range[96];
            section_of(&k, sec, sizeof sec);
            if (strcmp(sec, secs[s]))
                continue;
            name_of(&k, name, sizeof name);
            default_text(&k, def, sizeof def);
            range_text(&k, range, sizeof range);
            fprintf(out, "| `%s` | %s | ", name, type_text(k.type));
            if (k.required)
                fputs("(required)", out);
            else {
                fputc('`', out);
                md_text(out, def);
                fputc('`', out);
            }
            fprintf(out, " | %s | ", range[0] ? range : "");
            md_text(out, k.desc);
            if (k.sensitive) {
                fputs("; ", out);
                md_text(out, sensitive_text);
            }
            fputs(" |\n", out);
        }
    }
}

/* ---- roff (man) ---- */

/* Text with `code` spans as roff: code in bold; backslashes escaped; the
 * dashes of a word that starts with one (an option) as minus signs. */
void conf_doc_roff_text(FILE *out, const char *s)
{
    bool code = false, option = false;
    const char *start = s;
    if (*s == '.' || *s == '\'')
        fputs("\\&", out);
    for (; *s; s++) {
        if (s == start || s[-1] == ' ' || s[-1] == '`' || s[-1] == '(')
            option = *s == '-' && s[1] && s[1] != ' ';
        else if (*s == ' ')
            option = false;
        if (*s == '`') {
            fputs(code ? "\\fR" : "\\fB\\%", out); /* \%: not hyphenated */
            code = !code;
        } else if (*s == '\\') {
            fputs("\\e", out);
        } else if (*s == '-' && option) {
            fputs("\\-", out);
        } else {
            fputc(*s, out);
        }
    }
    if (code)
        fputs("\\fR", out);
}

static void man_print(FILE *out, const char *version)
{
    char secs[MAX_SECTIONS][64];
    int nsec = sections(secs, MAX_SECTIONS);

    fputs(".\\\" Generated from the settings table in config/conf.c by idemq-docs: do not\n"
          ".\\\" edit. Regenerate: cmake --build build --target docs\n", out);
    fprintf(out, ".TH IDEMQ.CFG 5 \"\" \"idemq %s\" \"File Formats\"\n", version);
    fputs(".SH NAME\n"
          "idemq.cfg \\- configuration file of idemq\n"
          ".SH SYNOPSIS\n"
          ".I /etc/idemq/idemq.cfg\n"
          ".SH DESCRIPTION\n"
          "\\fBidemq\\fR(1) reads one configuration file, named with \\fB\\-c\\fR \\fIFILE\\fR.\n"
          "It is in libconfig syntax: groups of settings at the top level and a list\n"
          "\\fBinputs\\fR of groups, one per queue consumed:\n"
          ".PP\n"
          ".RS\n"
          ".nf\n"
          "broker: { url = \"amqp://idemq:secret@127.0.0.1:5672/%2F\"; prefetch = 1000;\n"
          "          tls: { verify = \"full\"; }; };\n"
          "database: { dsn = \"dbname=idemq\"; };\n"
          "inputs = ( { name = \"payouts\"; queue = \"payouts\";\n"
          "             effect_function = \"app.apply_payout\"; } );\n"
          ".fi\n"
          ".RE\n"
          ".PP\n"
          "Unknown settings are errors, and every error names the file, the line and the\n"
          "setting.\n"
          "\\fBidemq check\\-config \\-c\\fR \\fIFILE\\fR validates a file and prints the\n"
          "effective configuration with secrets redacted.\n"
          "Defaults below are written as libconfig literals.\n"
          "Ranges: integers, their values; strings, their length in bytes; lists, their\n"
          "number of entries.\n"
          ".SH SETTINGS\n", out);
    for (int s = 0; s < nsec; s++) {
        const char *intro = intro_of(secs[s]);
        struct conf_key_info k;
        fprintf(out, ".SS %s\n", secs[s]);
        if (intro) {
            conf_doc_roff_text(out, intro);
            fputc('\n', out);
        }
        for (int i = 0; conf_key_describe(i, &k); i++) {
            char sec[64], name[128], def[512], range[96];
            section_of(&k, sec, sizeof sec);
            if (strcmp(sec, secs[s]))
                continue;
            name_of(&k, name, sizeof name);
            default_text(&k, def, sizeof def);
            range_text(&k, range, sizeof range);
            fprintf(out, ".TP\n\\fB%s\\fR\n", name);
            conf_doc_roff_text(out, k.desc);
            fputs(".\n.br\n", out);
            fprintf(out, "\\fIType:\\fR %s%s%s.\n", type_text(k.type), range[0] ? ", " : "",
                    range);
            if (k.required) {
                fputs("Required.\n", out);
            } else {
                fputs("\\fIDefault:\\fR \\fB\\%", out);
                conf_doc_roff_text(out, def);
                fputs("\\fR.\n", out);
            }
            if (k.sensitive) {
                fputs("It is ", out);
                conf_doc_roff_text(out, sensitive_text);
                fputs(".\n", out);
            }
        }
    }
    fputs(".SH ENVIRONMENT\n"
          ".TP\n\\fBIDEMQ_AMQP_URL\\fR\n"
          "overrides \\fBbroker.url\\fR (a comma-separated list is allowed).\n"
          ".TP\n\\fBIDEMQ_PG_DSN\\fR\n"
          "overrides \\fBdatabase.dsn\\fR.\n"
          ".PP\n"
          "So the file need not hold secrets: the packaged unit reads them from\n"
          ".IR /etc/idemq/idemq.env .\n"
          ".SH FILES\n"
          ".TP\n.I /etc/idemq/idemq.cfg\n"
          "the sample configuration, every setting with its default\n"
          ".TP\n.I /etc/idemq/idemq.env\n"
          "environment of the systemd unit (mode 0600), for secrets\n"
          ".TP\n.I /usr/share/doc/idemq/config.md\n"
          "how the settings work together (config/README.md in the source)\n"
          ".SH SEE ALSO\n"
          "\\fBidemq\\fR(1)\n", out);
}

int conf_doc_print(FILE *out, enum conf_doc_format fmt, const char *version)
{
    switch (fmt) {
    case CONF_DOC_MARKDOWN: md_print(out); break;
    case CONF_DOC_MAN: man_print(out, version); break;
    }
    return ferror(out) ? -1 : 0;
}
