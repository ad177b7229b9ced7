/*
 * fuzz_key: kernel-key strings (mu_key_check, docs/kernel-key.md) and the names a plan's pieces
 * hold (algorithms, math types, engine names "eng<G>[.k<T>=<V>...]") on arbitrary text.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    char *text = malloc(size + 1);
    if (text == NULL) return 0;
    memcpy(text, data, size);
    text[size] = '\0';
    mu_direction dir = (mu_direction)-1;
    if (mu_key_check(text, &dir) == NULL) {
        /* An accepted key names its direction first, and hashes the same twice. */
        const char *name = mu_direction_name(dir);
        if (strncmp(text, "dir=", 4) != 0 || strncmp(text + 4, name, strlen(name)) != 0) abort();
        if (mu_kernel_hash(text, 1) != mu_kernel_hash(text, 1)) abort();
    }
    for (int d = 0; d < 3; d++) {
        int algo = mu_algo_from_name((mu_direction)d, text);
        if (algo >= 0 && strcmp(mu_algo_name((mu_direction)d, algo), text) != 0) abort();
    }
    int math = mu_math_from_name(text);
    if (math >= 0 && strcmp(mu_math_name((cudnnMathType_t)math), text) != 0) abort();
    mu_engine engine;
    if (mu_engine_parse(text, &engine) && (engine.knob_count < 0 || engine.knob_count > MU_MAX_KNOBS)) abort();
    free(text);
    return 0;
}
