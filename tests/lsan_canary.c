/*
 * lsan_canary: leaks on purpose. scripts/test runs it with the ASan pass's
 * options and expects LeakSanitizer to report it: if leak checking were
 * silently off (LeakSanitizer needs ptrace, which some sandboxes refuse),
 * a green ASan pass would prove nothing about leaks.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The pointer must not survive anywhere LeakSanitizer looks (globals, live
 * stack, registers): it is dropped inside a function that has returned long
 * before the check at exit. */
__attribute__((noinline)) static size_t leak(size_t n)
{
    char *p = malloc(n);
    if (!p)
        return 0;
    memset(p, 'x', n - 1);
    p[n - 1] = '\0';
    return strlen(p) + 1; /* p is lost here */
}

int main(void)
{
    size_t lost = 0;
    for (int i = 0; i < 8; i++)
        lost += leak(4096 + (size_t)i);
    printf("lsan_canary: dropped %zu bytes in 8 blocks\n", lost);
    return 0;
}
