/*
 * docs_tool: idemq-docs, the generator of the committed reference pages, so
 * none of them can disagree with its source:
 *
 *   idemq-docs settings md    config/SETTINGS.md, from the settings table
 *   idemq-docs settings man   config/idemq.cfg.5, the same as roff
 *   idemq-docs cli-man TEMPLATE < usage
 *                             consumer/idemq.1: TEMPLATE (consumer/idemq.1.in)
 *                             with its @PLACEHOLDER@ lines filled from the
 *                             usage text of `idemq --help` on stdin
 *
 * Regenerate all three with one command: cmake --build build --target docs
 * (tests/docs_check.cmake; the ctest `docs_current` fails when a committed
 * file differs from what this prints).
 */
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "conf_doc.h"

#define MAX_ENTRIES 64
#define TEXT_MAX 1024

struct entry {
    char term[TEXT_MAX];
    char desc[TEXT_MAX];
};

/* The usage text of `idemq --help`, parsed. */
struct usage {
    char synopsis[TEXT_MAX];       /* after "usage: " */
    struct entry cmds[MAX_ENTRIES]; /* "commands:" lines */
    int ncmds;
    char options[TEXT_MAX];     /* after "options: " */
    char environment[TEXT_MAX]; /* after "environment: " */
    char exits[TEXT_MAX];       /* after "exit codes: " */
};

/* What each option of the "options:" line does (the usage text lists them
 * without one); an option missing here is printed without a description. */
static const struct {
    const char *option;
    const char *desc;
} option_docs[] = {
    {"--config", "the configuration file; see `idemq.cfg(5)`. Every command needs it."},
    {"--help", "print the usage text and exit 0."},
    {"--version", "print `idemq` and its version and exit 0."},
};

static void append(char *dst, const char *src)
{
    size_t n = strlen(dst);
    snprintf(dst + n, TEXT_MAX - n, "%s%s", n && src[0] ? " " : "", src);
}

static char *trim(char *s)
{
    size_t n;
    while (*s == ' ')
        s++;
    n = strlen(s);
    while (n && (s[n - 1] == ' ' || s[n - 1] == '\n'))
        s[--n] = '\0';
    return s;
}

static int parse_usage(FILE *in, struct usage *u)
{
    char line[TEXT_MAX];
    char *para = NULL; /* the paragraph a continuation line extends */
    bool in_cmds = false;

    memset(u, 0, sizeof *u);
    while (fgets(line, sizeof line, in)) {
        char *t = trim(line);
        if (!*t) {
            in_cmds = false;
            para = NULL;
        } else if (strncmp(t, "usage: ", 7) == 0) {
            snprintf(u->synopsis, sizeof u->synopsis, "%s", t + 7);
        } else if (strcmp(t, "commands:") == 0) {
            in_cmds = true;
        } else if (in_cmds && line[0] == ' ' && line[1] == ' ' && line[2] != ' ') {
            /* "  term  description" or "  term" (its description below) */
            struct entry *e;
            char *gap = strstr(t, "  ");
            if (u->ncmds == MAX_ENTRIES)
                return -1;
            e = &u->cmds[u->ncmds++];
            if (gap)
                *gap = '\0';
            snprintf(e->term, sizeof e->term, "%s", trim(t));
            para = e->desc;
            if (gap)
                append(para, trim(gap + 2));
        } else if (in_cmds && line[0] == ' ' && para) {
            append(para, t);
        } else if (strncmp(t, "options: ", 9) == 0) {
            append(para = u->options, t + 9);
        } else if (strncmp(t, "environment: ", 13) == 0) {
            append(para = u->environment, t + 13);
        } else if (strncmp(t, "exit codes: ", 12) == 0) {
            append(para = u->exits, t + 12);
        } else if (para) {
            append(para, t);
        } else {
            fprintf(stderr, "idemq-docs: usage line not understood: %s\n", t);
            return -1;
        }
    }
    return u->ncmds && u->synopsis[0] && u->exits[0] ? 0 : -1;
}

/* A command line fragment as roff: words starting with a dash (options) in
 * bold with minus signs, upper-case words (placeholders) in italics, other
 * words (commands) in bold, punctuation as is. */
static void roff_term(FILE *out, const char *s)
{
    while (*s) {
        size_t n = strspn(s, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-");
        if (!n) {
            if (*s == '\\')
                fputs("\\e", out);
            else
                fputc(*s, out);
            s++;
            continue;
        }
        bool upper = true;
        for (size_t i = 0; i < n; i++)
            if (s[i] >= 'a' && s[i] <= 'z')
                upper = false;
        fputs(upper && s[0] != '-' ? "\\fI" : "\\fB", out);
        for (size_t i = 0; i < n; i++)
            if (s[i] == '-')
                fputs("\\-", out);
            else
                fputc(s[i], out);
        fputs("\\fR", out);
        s += n;
    }
}

static void put_commands(FILE *out, const struct usage *u)
{
    for (int i = 0; i < u->ncmds; i++) {
        const struct entry *e = &u->cmds[i];
        const char *colon = strchr(e->term, ':');
        fputs(".TP\n", out);
        if (colon && colon[1] == ' ') { /* "FILTERS: --input NAME ..." */
            fprintf(out, "\\fI%.*s\\fR\n", (int)(colon - e->term), e->term);
            fputs("the filters of \\fBparked list\\fR and \\fBredrive\\fR: ", out);
            roff_term(out, colon + 2);
            fputc('\n', out);
            continue;
        }
        fputs("\\fBidemq\\fR ", out);
        roff_term(out, e->term);
        fputc('\n', out);
        conf_doc_roff_text(out, e->desc);
        fputs(e->desc[0] && e->desc[strlen(e->desc) - 1] != '.' ? ".\n" : "\n", out);
    }
}

static void put_options(FILE *out, const struct usage *u)
{
    char buf[TEXT_MAX];
    snprintf(buf, sizeof buf, "%s", u->options);
    for (char *save = NULL, *o = strtok_r(buf, ";", &save); o; o = strtok_r(NULL, ";", &save)) {
        const char *desc = NULL;
        o = trim(o);
        for (size_t i = 0; i < sizeof option_docs / sizeof option_docs[0]; i++) {
            const char *p = strstr(o, option_docs[i].option);
            size_t n = strlen(option_docs[i].option);
            if (p && (p[n] == '\0' || p[n] == ' '))
                desc = option_docs[i].desc;
        }
        fputs(".TP\n", out);
        roff_term(out, o);
        fputc('\n', out);
        if (desc) {
            conf_doc_roff_text(out, desc);
            fputc('\n', out);
        }
    }
}

/* "0 ok, 1 runtime failure, 2 usage, ..." as one .TP per code. */
static void put_exits(FILE *out, const struct usage *u)
{
    const char *s = u->exits;
    while (*s) {
        char *end;
        long code = strtol(s, &end, 10);
        const char *next = end;
        if (end == s || *end != ' ') {
            fprintf(stderr, "idemq-docs: exit codes not understood at: %s\n", s);
            exit(1);
        }
        /* the text runs to the next ", <digit>" */
        while (*next && !(next[0] == ',' && next[1] == ' ' && next[2] >= '0' && next[2] <= '9'))
            next++;
        fprintf(out, ".TP\n.B %ld\n", code);
        {
            char text[TEXT_MAX];
            snprintf(text, sizeof text, "%.*s", (int)(next - end - 1), end + 1);
            conf_doc_roff_text(out, text);
            fputs(".\n", out);
        }
        s = *next ? next + 2 : next;
    }
}

static int cli_man(const char *template_path)
{
    struct usage u;
    char line[TEXT_MAX];
    FILE *t;

    if (parse_usage(stdin, &u)) {
        fprintf(stderr, "idemq-docs: stdin is not the usage text of idemq --help\n");
        return 1;
    }
    if (!(t = fopen(template_path, "r"))) {
        perror(template_path);
        return 1;
    }
    printf(".\\\" Generated by idemq-docs from %s and the usage text of idemq --help\n"
           ".\\\" (consumer/main.c): do not edit. Regenerate: cmake --build build --target docs\n",
           "consumer/idemq.1.in");
    while (fgets(line, sizeof line, t)) {
        char *v = strstr(line, "@VERSION@");
        if (strcmp(line, "@SYNOPSIS@\n") == 0) {
            roff_term(stdout, u.synopsis);
            putchar('\n');
        } else if (strcmp(line, "@COMMANDS@\n") == 0) {
            put_commands(stdout, &u);
        } else if (strcmp(line, "@OPTIONS@\n") == 0) {
            put_options(stdout, &u);
        } else if (strcmp(line, "@ENVIRONMENT@\n") == 0) {
            conf_doc_roff_text(stdout, u.environment);
            puts(".");
        } else if (strcmp(line, "@EXIT_STATUS@\n") == 0) {
            put_exits(stdout, &u);
        } else if (v) {
            printf("%.*s%s%s", (int)(v - line), line, IDEMQ_VERSION, v + 9);
        } else if (line[0] == '@') {
            fprintf(stderr, "idemq-docs: %s: unknown placeholder %s", template_path, line);
            fclose(t);
            return 1;
        } else {
            fputs(line, stdout);
        }
    }
    fclose(t);
    return ferror(stdout) ? 1 : 0;
}

int main(int argc, char **argv)
{
    if (argc == 3 && strcmp(argv[1], "settings") == 0 &&
        (strcmp(argv[2], "md") == 0 || strcmp(argv[2], "man") == 0))
        return conf_doc_print(stdout, argv[2][1] == 'd' ? CONF_DOC_MARKDOWN : CONF_DOC_MAN,
                              IDEMQ_VERSION)
                   ? 1
                   : 0;
    if (argc == 3 && strcmp(argv[1], "cli-man") == 0)
        return cli_man(argv[2]);
    fprintf(stderr, "usage: idemq-docs settings md|man\n"
                    "       idemq-docs cli-man TEMPLATE < usage-text\n"
                    "regenerate the committed pages: cmake --build build --target docs\n");
    return 2;
}
