/*
 * fuzz_descs: the key of a call from its descriptors (mu_kernel_from_descs, key.c) on whatever the
 * descriptor queries may report: the input is a stub case (stub_cudnn.h, STUB_FIELDS int32).
 * A call either has no key, or a key that mu_key_check accepts, of its own direction, with a batch
 * of at least 1 and the hash of (key, n).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "stub_cudnn.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    int32_t values[STUB_FIELDS];
    stub_decode(data, size, values);
    stub_set(values);
    mu_conv_descs descs = stub_descs();
    mu_kernel kernel;
    if (mu_kernel_from_descs(&descs, &kernel) != NULL) return 0;
    mu_direction dir;
    if (strlen(kernel.key) >= MU_KEY_MAX || mu_key_check(kernel.key, &dir) != NULL || dir != descs.dir) abort();
    if (kernel.n < 1 || kernel.n != kernel.x_dims[0]) abort();
    if (kernel.hash != mu_kernel_hash(kernel.key, kernel.n)) abort();
    return 0;
}
