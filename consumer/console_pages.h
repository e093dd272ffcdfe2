/*
 * console_pages: the on-call pages of the web console (console.c serves
 * them): one parked message (body, headers, properties, its attempts and
 * its actions), a key's story as a timeline (attempts, parks, redrives,
 * provider intent, outbox rows, operator actions, with its actions), and
 * the jobs retrying now. Each reads the ledger on the console's session
 * and writes one page into an html buffer; stored text goes through
 * html_text.
 *
 * API: console_pages_park, console_pages_key, console_pages_retrying,
 * console_pages_actions.
 */
#ifndef IDEMQ_CONSOLE_PAGES_H
#define IDEMQ_CONSOLE_PAGES_H

#include <libpq-fe.h>

#include "conf.h"
#include "html.h"

#define CONSOLE_PAGES_BODY_SHOWN 65536 /* bytes of a body shown */
#define CONSOLE_PAGES_TEXT_SHOWN 300   /* bytes of a key or reason in a table cell */

/*
 * The redrive, discard and archive buttons of a selection: each a form
 * POSTing to /confirm with the one-time form token csrf ("" = no buttons),
 * the action and field=value (group, park or key; a key is sent as keyhex,
 * the hex digits of its bytes, so that what html_text escapes for the eye
 * reaches /confirm unchanged).
 */
void console_pages_actions(struct html *b, const char *csrf, const char *field,
                           const char *value);

/*
 * The page of park id (decimal text; also a closed one: its resolution)
 * on db (NULL: unavailable); csrf: the form token of its actions. Returns
 * the HTTP status (200, 400, 404, 503). The console's thread.
 */
unsigned console_pages_park(PGconn *db, const struct conf *c, const char *id, const char *csrf,
                            struct html *b);

/* The page of key (NULL: asks for one): its state and its story as a
 * timeline, with the actions on its open parks. Returns the HTTP status. */
unsigned console_pages_key(PGconn *db, const struct conf *c, const char *key, const char *csrf,
                           struct html *b);

/* The jobs retrying now: keys in state retrying whose last attempt (within
 * the hour) failed transiently, newest first, 100 at most. */
unsigned console_pages_retrying(PGconn *db, const struct conf *c, struct html *b);

#endif
