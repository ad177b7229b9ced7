/*
 * fuzz_size: the shim's size parser (mu_parse_size, docs/sizes.md) on arbitrary text. A size is
 * 0 to 2^63-1, every refusal has a reason, and blanks around the text change nothing.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    char *padded = malloc(size + 3); /* " TEXT\t" */
    char *bare = malloc(size + 1);
    if (padded == NULL || bare == NULL) abort();
    memcpy(bare, data, size);
    bare[size] = '\0';
    size_t length = strlen(bare); /* the text ends at its first NUL, as an environment value does */
    padded[0] = ' ';
    memcpy(padded + 1, bare, length);
    memcpy(padded + 1 + length, "\t", 2);
    long long value = -1, padded_value = -1;
    mu_size_result result = mu_parse_size(bare, &value);
    if (result == MU_SIZE_OK ? value < 0 : strlen(mu_size_problem(result)) == 0) abort();
    if (mu_parse_size(padded, &padded_value) != result || (result == MU_SIZE_OK && padded_value != value))
        abort();
    free(padded);
    free(bare);
    return 0;
}
