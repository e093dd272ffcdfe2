/*
 * lsan_canary: leaks on purpose. scripts/test runs it with the ASan pass's
 * options and expects LeakSanitizer to report it: if leak checking were
 * silently off (LeakSanitizer needs ptrace, which some sandboxes refuse),
 * a green ASan pass would prove nothing about leaks.
 */
#include <stdio.h>
#include <stdlib.h>

static void *volatile sink;

int main(void)
{
    sink = malloc(4242);
    printf("lsan_canary: leaking %p\n", sink);
    sink = NULL;
    return 0;
}
