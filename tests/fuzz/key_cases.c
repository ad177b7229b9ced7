/*
 * key_cases: one stub case per stdin line (STUB_FIELDS integers, tests/fuzz/descs.py) through the
 * shim's mu_kernel_from_descs; prints "key=KEY n=N" or "nokey=REASON" per line. Built with
 * -fsanitize=undefined by tests/shim/test_shim_key_overflow.py: hostile geometry must give no key,
 * and no undefined behaviour on the way.
 */
#include <stdio.h>
#include <stdlib.h>

#include "stub_cudnn.h"

int main(void) {
    char line[4096];
    while (fgets(line, sizeof line, stdin)) {
        int32_t values[STUB_FIELDS];
        char *p = line;
        for (int i = 0; i < STUB_FIELDS; i++) values[i] = (int32_t)strtol(p, &p, 10);
        stub_set(values);
        mu_conv_descs descs = stub_descs();
        mu_kernel kernel;
        const char *why = mu_kernel_from_descs(&descs, &kernel);
        if (why) printf("nokey=%s\n", why);
        else printf("key=%s n=%d\n", kernel.key, kernel.n);
    }
    return 0;
}
