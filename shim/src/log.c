/* log.c: "mucudnn: LEVEL: message" lines, one write() each, to stderr or MUCUDNN_LOG_FILE. */
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "internal.h"

/* How often one call site may print before it goes quiet. */
#define MU_LOG_REPEAT_MAX 5
#define MU_LOG_LINE_MAX 4096

static atomic_int log_level = MU_LOG_WARNING;
static atomic_int log_fd = STDERR_FILENO;

static const char *const level_names[] = {"error", "warning", "info", "debug"};

void mu_log_configure(int level, const char *path) {
    atomic_store(&log_level, level);
    if (path == NULL || path[0] == '\0') return;
    int fd = open(path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    if (fd < 0) {
        mu_log(MU_LOG_WARNING, "MUCUDNN_LOG_FILE=%s: cannot open (%s); logging to stderr", path,
               strerror(errno));
        return;
    }
    atomic_store(&log_fd, fd);
}

bool mu_log_enabled(mu_log_level level) { return (int)level <= atomic_load(&log_level); }

static void write_line(const char *label, const char *suffix, const char *fmt, va_list args) {
    char line[MU_LOG_LINE_MAX];
    int used = snprintf(line, sizeof line, "mucudnn: %s: ", label);
    int room = (int)sizeof line - used - 1 - (int)strlen(suffix);
    int wrote = vsnprintf(line + used, (size_t)room, fmt, args);
    if (wrote >= room) { /* truncated: say so rather than cut silently */
        wrote = room - 1;
        memcpy(line + used + wrote - 3, "...", 3);
    }
    used += wrote;
    used += snprintf(line + used, sizeof line - (size_t)used, "%s\n", suffix);
    /* One write per line keeps lines whole when threads and processes share the file. */
    ssize_t ignored = write(atomic_load(&log_fd), line, (size_t)used);
    (void)ignored;
}

void mu_log(mu_log_level level, const char *fmt, ...) {
    if (!mu_log_enabled(level)) return;
    va_list args;
    va_start(args, fmt);
    write_line(level_names[level], "", fmt, args);
    va_end(args);
}

void mu_log_limited(mu_rate_limit *limit, mu_log_level level, const char *fmt, ...) {
    if (!mu_log_enabled(level)) return;
    int count = atomic_fetch_add(&limit->count, 1);
    if (count >= MU_LOG_REPEAT_MAX) return;
    va_list args;
    va_start(args, fmt);
    write_line(level_names[level],
               count == MU_LOG_REPEAT_MAX - 1 ? " (further messages like this are suppressed)" : "",
               fmt, args);
    va_end(args);
}

void mu_log_summary(const char *fmt, ...) {
    va_list args;
    va_start(args, fmt);
    write_line("summary", "", fmt, args);
    va_end(args);
}
