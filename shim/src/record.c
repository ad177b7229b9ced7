/*
 * record.c: the table of kernels (key, N) this process has seen, with call counts; the record
 * file (MUCUDNN_RECORD, docs/plan-format.md "The record file": a `kernel` line when a kernel is
 * first seen, its `calls` line at exit) and the exit summary.
 *
 * Lookups are lock-free (entries are only ever added, at the head of a bucket, and published
 * with a release store); insertions take a mutex, so each kernel is recorded exactly once.
 */
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "internal.h"

#define SEEN_BUCKETS 4096

static mu_seen *_Atomic seen_buckets[SEEN_BUCKETS];
static pthread_mutex_t seen_mutex = PTHREAD_MUTEX_INITIALIZER;
static atomic_ulong unkeyed_calls;
static int record_fd = -1;

static void write_record_line(const char *line, size_t length) {
    if (record_fd < 0) return;
    /* One write per line with O_APPEND: lines of several processes never interleave. */
    if (write(record_fd, line, length) != (ssize_t)length) {
        static mu_rate_limit limit = MU_RATE_LIMIT_INIT;
        mu_log_limited(&limit, MU_LOG_WARNING, "MUCUDNN_RECORD: write failed: %s", strerror(errno));
    }
}

static void for_each_seen(void (*visit)(const mu_seen *seen)) {
    for (size_t b = 0; b < SEEN_BUCKETS; b++)
        for (mu_seen *seen = atomic_load(&seen_buckets[b]); seen; seen = atomic_load(&seen->next_in_bucket))
            visit(seen);
}

static void print_summary_line(const mu_seen *seen) {
    mu_log_summary("%-12lu %-12lu %6d  %s", atomic_load(&seen->planned_calls),
                   atomic_load(&seen->passthrough_calls), seen->n, seen->key);
}

static void print_summary(void) {
    mu_log_summary("%-12s %-12s %6s  %s", "planned", "passthrough", "N", "kernel");
    for_each_seen(print_summary_line);
    mu_log_summary("%-12d %-12lu %6s  %s", 0, atomic_load(&unkeyed_calls), "-",
                   "(calls without a kernel key)");
}

/* At exit: how often each kernel ran, so that the tuner weighs kernels as the framework runs them
 * (a network's repeated layers are one kernel). Kernels only queried, never run, get no line. */
static void write_call_count(const mu_seen *seen) {
    unsigned long calls = atomic_load(&seen->planned_calls) + atomic_load(&seen->passthrough_calls);
    if (calls == 0) return;
    char line[MU_KEY_MAX + 64];
    int length = snprintf(line, sizeof line, "calls %s %d %lu\n", seen->key, seen->n, calls);
    if (length > 0 && (size_t)length < sizeof line) write_record_line(line, (size_t)length);
}

static void write_call_counts(void) { for_each_seen(write_call_count); }

static size_t seen_count, planned_count;
static void count_planned(const mu_seen *seen) {
    seen_count++;
    planned_count += atomic_load(&seen->planned_calls) > 0;
}

void mu_seen_totals(size_t *kernels, size_t *planned) {
    seen_count = planned_count = 0;
    for_each_seen(count_planned);
    *kernels = seen_count, *planned = planned_count;
}

void mu_record_init(void) {
    const char *path = mu_option_path(MU_OPT_RECORD);
    if (path != NULL) {
        char why[128];
        record_fd = mu_open_output(path, false, why, sizeof why);
        if (record_fd < 0) {
            char shown[MU_ESCAPED_MAX];
            mu_log(MU_LOG_ERROR, "MUCUDNN_RECORD=%s: %s; not recording",
                   mu_log_escape(path, shown, sizeof shown), why);
        } else {
            char header[64];
            int length = snprintf(header, sizeof header, "# mucudnn-record 1 pid=%ld\n", (long)getpid());
            write_record_line(header, (size_t)length);
            atexit(write_call_counts);
        }
    }
    if (mu_option_int(MU_OPT_SUMMARY)) atexit(print_summary);
}

static mu_seen *find_seen(mu_seen *head, const mu_kernel *kernel) {
    for (mu_seen *seen = head; seen; seen = atomic_load_explicit(&seen->next_in_bucket, memory_order_acquire))
        if (seen->hash == kernel->hash && seen->n == kernel->n && strcmp(seen->key, kernel->key) == 0)
            return seen;
    return NULL;
}

static void record_kernel(const mu_kernel *kernel) {
    if (record_fd < 0) return;
    char line[MU_KEY_MAX + 32];
    int length = snprintf(line, sizeof line, "kernel %s %d\n", kernel->key, kernel->n);
    write_record_line(line, (size_t)length);
}

mu_seen *mu_seen_kernel(const mu_kernel *kernel) {
    mu_seen *_Atomic *bucket = &seen_buckets[kernel->hash % SEEN_BUCKETS];
    mu_seen *seen = find_seen(atomic_load_explicit(bucket, memory_order_acquire), kernel);
    if (seen != NULL) return seen;

    pthread_mutex_lock(&seen_mutex);
    seen = find_seen(atomic_load_explicit(bucket, memory_order_acquire), kernel);
    if (seen == NULL && (seen = calloc(1, sizeof *seen)) != NULL) {
        size_t key_size = strlen(kernel->key) + 1;
        seen->key = malloc(key_size);
        if (seen->key == NULL) {
            free(seen);
            seen = NULL;
        } else {
            memcpy(seen->key, kernel->key, key_size);
            seen->n = kernel->n;
            seen->hash = kernel->hash;
            atomic_init(&seen->next_in_bucket, atomic_load(bucket));
            atomic_store_explicit(bucket, seen, memory_order_release);
            record_kernel(kernel);
        }
    }
    pthread_mutex_unlock(&seen_mutex);
    return seen;
}

void mu_count_unkeyed_call(void) { atomic_fetch_add(&unkeyed_calls, 1); }
