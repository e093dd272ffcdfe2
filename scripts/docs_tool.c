/*
 * docs_tool: idemq-docs, the generator of the committed reference pages, so
 * none of them can disagree with its source:
 *
 *   idemq-docs settings md    config/SETTINGS.md, from the settings table
 *   idemq-docs settings man   config/idemq.cfg.5, the same as roff
 *
 * Regenerate both with one command: cmake --build build --target docs
 * (tests/docs_check.cmake; the ctest `docs_current` fails when a committed
 * file differs from what this prints).
 */
#include <stdio.h>
#include <string.h>

#include "conf_doc.h"

int main(int argc, char **argv)
{
    if (argc == 3 && strcmp(argv[1], "settings") == 0 &&
        (strcmp(argv[2], "md") == 0 || strcmp(argv[2], "man") == 0))
        return conf_doc_print(stdout, argv[2][1] == 'd' ? CONF_DOC_MARKDOWN : CONF_DOC_MAN,
                              IDEMQ_VERSION)
                   ? 1
                   : 0;
    fprintf(stderr, "usage: idemq-docs settings md|man\n"
                    "regenerate the committed pages: cmake --build build --target docs\n");
    return 2;
}
