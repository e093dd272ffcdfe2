/*
 * fuzz.h: what every libFuzzer target in tests/fuzz shares: the entry
 * points libFuzzer calls, and FUZZ_CHECK, which aborts (a crash libFuzzer
 * keeps as crash-<sha1>) when an invariant the target checks is broken.
 */
#ifndef IDEMQ_FUZZ_H
#define IDEMQ_FUZZ_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerInitialize(int *argc, char ***argv);

#define FUZZ_CHECK(cond, ...)                                                                \
    do {                                                                                     \
        if (!(cond)) {                                                                       \
            fprintf(stderr, "%s:%d: invariant broken: %s: ", __FILE__, __LINE__, #cond);    \
            fprintf(stderr, __VA_ARGS__);                                                    \
            fputc('\n', stderr);                                                             \
            abort();                                                                         \
        }                                                                                    \
    } while (0)

#endif
