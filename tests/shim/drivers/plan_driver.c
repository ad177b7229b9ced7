/*
 * plan_driver: the shim's plan reader (shim/src/plan.c, key.c) on its own, for
 * tests/test_plan_differential.py. For each path argument it prints
 *
 *   file PATH
 *   accept                        then the plan, canonically:
 *   gpu NAME / cudnn V / strategy S / limit L / policy P
 *   kernel KEY N WORKSPACE TIME(%.17g) B:ALGO:MATH[:out] ...   one per entry, in file order
 *
 * or
 *
 *   file PATH
 *   reject LINE                   the line the error names (0: the whole file)
 *   error MESSAGE
 *
 * mucudnn/plan.py prints the same for the same file (the test's dump_python). Build:
 *   cc -std=c11 -D_GNU_SOURCE -Ishim/include -Ishim/src -I$CUDNN_INCLUDE -I$CUDA_INCLUDE \
 *      tests/shim/drivers/plan_driver.c shim/src/plan.c shim/src/key.c -lm
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

/* key.c builds keys from descriptors through the real cuDNN functions; parsing never does. */
const mu_real_table *mu_real(void) { return NULL; }

static void print_piece(const mu_plan_entry *entry, const mu_piece *piece) {
    printf(" %d:", piece->batch);
    if (piece->engine != NULL) {
        printf("eng%" PRId64, piece->engine->global_index);
        for (int k = 0; k < piece->engine->knob_count; k++)
            printf(".k%d=%" PRId64, piece->engine->knob_types[k], piece->engine->knob_values[k]);
    } else {
        printf("%s", mu_algo_name(entry->dir, piece->algo));
    }
    printf(":%s%s", mu_math_name(piece->math), piece->borrow ? ":" MU_BORROW_MARK : "");
}

static void dump(const char *path) {
    char error[1024];
    printf("file %s\n", path);
    mu_plan *plan = mu_plan_load(path, error, sizeof error);
    if (plan == NULL) {
        /* "PATH:LINE: what" */
        size_t length = strlen(path);
        long line = strncmp(error, path, length) == 0 && error[length] == ':'
                        ? strtol(error + length + 1, NULL, 10)
                        : -1;
        printf("reject %ld\nerror %s\n", line, error);
        return;
    }
    printf("accept\ngpu %s\ncudnn %ld\nstrategy %s\nlimit %llu\npolicy %s\n", plan->gpu,
           plan->cudnn_version, plan->strategy, plan->limit, plan->policy);
    for (size_t i = 0; i < plan->entry_count; i++) {
        const mu_plan_entry *entry = &plan->entries[i];
        printf("kernel %s %d %zu %.17g", entry->key, entry->n, entry->workspace, entry->time_ms);
        for (int j = 0; j < entry->piece_count; j++) print_piece(entry, &entry->pieces[j]);
        printf("\n");
    }
    /* The plan is not freed: plan.c frees only on its error paths, and this process exits. */
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: plan_driver PLAN...\n");
        return 2;
    }
    for (int i = 1; i < argc; i++) dump(argv[i]);
    return 0;
}
