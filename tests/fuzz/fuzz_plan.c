/*
 * fuzz_plan: the plan-file parser (shim/src/plan.c) on arbitrary bytes. The input becomes a
 * memfd read through /proc/self/fd/N, exactly the path mu_plan_load takes for a file; a plan that
 * loads is looked up entry by entry. Leak checks are off (__asan_default_options below): plan.c
 * has no public free for a loaded plan (a process keeps its plan for life), so each accepted input
 * leaks it by design.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "internal.h"

const char *__asan_default_options(void);
const char *__asan_default_options(void) { return "detect_leaks=0"; }

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc, (void)argv;
    mu_log_configure(-1, NULL); /* below error: the parser's messages would only slow the run */
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    int fd = memfd_create("plan", MFD_CLOEXEC);
    if (fd < 0) abort();
    if (size > 0 && write(fd, data, size) != (ssize_t)size) abort();
    char path[64], error[512];
    snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
    mu_plan *plan = mu_plan_load(path, error, sizeof error);
    if (plan == NULL) {
        /* Every refusal names the file and a line: "PATH:LINE: what". */
        if (strncmp(error, path, strlen(path)) != 0 || error[strlen(path)] != ':') abort();
    } else {
        for (size_t i = 0; i < plan->entry_count; i++) {
            const mu_plan_entry *entry = &plan->entries[i];
            mu_direction dir;
            if (mu_key_check(entry->key, &dir) != NULL || dir != entry->dir) abort();
            /* Found through its kernel's first point (front plans: the least workspace), on a
             * chain in strictly ascending workspace. */
            const mu_plan_entry *point = mu_plan_find(plan, entry->key, entry->n, mu_kernel_hash(entry->key, entry->n));
            while (point != NULL && point != entry) {
                if (point->next_point != NULL && point->next_point->workspace <= point->workspace) abort();
                point = point->next_point;
            }
            if (point == NULL) abort();
            char text[256];
            mu_plan_pieces_text(entry, text, sizeof text);
            if (strlen(text) >= sizeof text) abort();
        }
    }
    close(fd);
    return 0;
}
