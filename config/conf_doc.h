/*
 * conf_doc: the settings reference, generated from the settings table of
 * config/conf.c: config/SETTINGS.md (markdown) and the idemq.cfg(5) man page
 * (roff). Used by scripts/docs_tool.c (`cmake --build build --target docs`).
 *
 * API: conf_doc_print; conf_doc_roff_text for other generated pages.
 */
#ifndef IDEMQ_CONF_DOC_H
#define IDEMQ_CONF_DOC_H

#include <stdio.h>

enum conf_doc_format {
    CONF_DOC_MARKDOWN, /* config/SETTINGS.md */
    CONF_DOC_MAN,      /* config/idemq.cfg.5 */
};

/* Writes the whole reference of every setting (name, type, default, bounds,
 * sensitive, description; grouped by section, in table order) to out;
 * version goes into the man page's header. Returns 0, or -1 if a write
 * failed. Output depends on the table only (no date, no host). */
int conf_doc_print(FILE *out, enum conf_doc_format fmt, const char *version);

/* Writes one line of text in the table's light markup as roff: `code` in
 * bold, backslashes escaped, the dashes of a word that starts with one (an
 * option) as minus signs; a leading . or ' is neutralized. No newline. */
void conf_doc_roff_text(FILE *out, const char *s);

#endif
