/*
 * check_run: runs one Check suite and turns the result into the program's
 * exit status; shared by every test program under tests/.
 */
#ifndef IDEMQ_CHECK_RUN_H
#define IDEMQ_CHECK_RUN_H

#include <check.h>

/* Runs s (taking it), prints Check's summary; returns 0 if all passed. */
static inline int check_run(Suite *s)
{
    SRunner *sr = srunner_create(s);
    int failed;
    srunner_run_all(sr, CK_NORMAL);
    failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? 1 : 0;
}

#endif
