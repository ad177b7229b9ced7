/* log.c: "mucudnn: LEVEL: message" lines, one write() each, to stderr or MUCUDNN_LOG_FILE. */
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "internal.h"

/* How often one call site may print before it goes quiet. */
#define MU_LOG_REPEAT_MAX 5
#define MU_LOG_LINE_MAX 4096

static atomic_int log_level = MU_LOG_WARNING;
static atomic_int log_fd = STDERR_FILENO;

static const char *const level_names[] = {"error", "warning", "info", "debug"};

static const char *file_type_name(mode_t mode) {
    return S_ISFIFO(mode)  ? "a FIFO"
           : S_ISSOCK(mode) ? "a socket"
           : S_ISDIR(mode)  ? "a directory"
           : S_ISBLK(mode)  ? "a block device"
           : S_ISCHR(mode)  ? "a character device"
                            : "not a regular file";
}

int mu_open_output(const char *path, bool allow_devices, char *why, size_t why_size) {
    /* O_NONBLOCK: opening a FIFO for writing would otherwise wait for a reader, forever; with it
     * the open fails (ENXIO) or succeeds at once, and the type check below refuses it. */
    int fd = open(path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC | O_NOCTTY | O_NONBLOCK, 0644);
    struct stat st;
    if (fd < 0) {
        int error = errno;
        if (error == ENXIO && stat(path, &st) == 0 && !S_ISREG(st.st_mode))
            snprintf(why, why_size, "is %s, not a regular file", file_type_name(st.st_mode));
        else
            snprintf(why, why_size, "cannot open (%s)", strerror(error));
        return -1;
    }
    if (fstat(fd, &st) != 0) {
        snprintf(why, why_size, "cannot stat (%s)", strerror(errno));
        close(fd);
        return -1;
    }
    /* /dev/stderr of a process whose stderr is a pipe opens that pipe: it is stderr, so it is fine. */
    struct stat err;
    bool is_stderr = fstat(STDERR_FILENO, &err) == 0 && err.st_dev == st.st_dev && err.st_ino == st.st_ino;
    if (!S_ISREG(st.st_mode) && !(allow_devices && (S_ISCHR(st.st_mode) || is_stderr))) {
        snprintf(why, why_size, "is %s, not a regular file", file_type_name(st.st_mode));
        close(fd);
        return -1;
    }
    /* Writes block as usual: a full disk or a slow terminal must not turn into EAGAIN. */
    int flags = fcntl(fd, F_GETFL);
    if (flags < 0 || fcntl(fd, F_SETFL, flags & ~O_NONBLOCK) != 0) {
        snprintf(why, why_size, "cannot clear O_NONBLOCK (%s)", strerror(errno));
        close(fd);
        return -1;
    }
    return fd;
}

/* c as it appears in a message: itself, or a backslash escape for control characters and '\'. */
static size_t escape_char(unsigned char c, char piece[4]) {
    static const char hex[] = "0123456789abcdef";
    if (c >= 0x20 && c != 0x7f && c != '\\') return piece[0] = (char)c, 1;
    piece[0] = '\\';
    switch (c) {
    case '\\': return piece[1] = '\\', 2;
    case '\n': return piece[1] = 'n', 2;
    case '\r': return piece[1] = 'r', 2;
    case '\t': return piece[1] = 't', 2;
    default: return piece[1] = 'x', piece[2] = hex[c >> 4], piece[3] = hex[c & 15], 4;
    }
}

const char *mu_log_escape(const char *text, char *buf, size_t size) {
    char piece[4];
    size_t total = 0;
    for (const unsigned char *p = (const unsigned char *)text; *p; p++) total += escape_char(*p, piece);
    /* Too long: keep whole escapes up to room for "..." and the NUL. */
    size_t room = total < size ? size - 1 : size - 4;
    size_t used = 0;
    for (const unsigned char *p = (const unsigned char *)text; *p; p++) {
        size_t length = escape_char(*p, piece);
        if (used + length > room) break;
        memcpy(buf + used, piece, length);
        used += length;
    }
    if (total >= size) memcpy(buf + used, "...", 3), used += 3;
    buf[used] = '\0';
    return buf;
}

void mu_log_configure(int level, const char *path) {
    atomic_store(&log_level, level);
    if (path == NULL || path[0] == '\0') return;
    char why[128];
    int fd = mu_open_output(path, true, why, sizeof why);
    if (fd < 0) {
        char shown[MU_ESCAPED_MAX];
        mu_log(MU_LOG_WARNING, "MUCUDNN_LOG_FILE=%s: %s; logging to stderr",
               mu_log_escape(path, shown, sizeof shown), why);
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
    int fd = atomic_load(&log_fd);
    ssize_t wrote_line = write(fd, line, (size_t)used);
    if (wrote_line == (ssize_t)used || fd == STDERR_FILENO) return;
    /* The log file failed (a full disk, a closed device): every later line goes to stderr. The
     * thread that switches says so, once; the old descriptor stays open because other threads
     * may still be writing to it. */
    int error = wrote_line < 0 ? errno : ENOSPC;
    if (atomic_compare_exchange_strong(&log_fd, &fd, STDERR_FILENO) && mu_log_enabled(MU_LOG_WARNING)) {
        char notice[256];
        int length = snprintf(notice, sizeof notice,
                              "mucudnn: warning: MUCUDNN_LOG_FILE: write failed (%s); logging to "
                              "stderr from here\n",
                              strerror(error));
        if (length > 0) (void)!write(STDERR_FILENO, notice, (size_t)length);
    }
    (void)!write(STDERR_FILENO, line, (size_t)used);
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
