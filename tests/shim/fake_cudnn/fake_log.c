/*
 * The call log of the cuDNN test double and small shared helpers (environment, formatting).
 *
 * The log file is opened, appended to with a single write(2) and closed on every call: no cached
 * FILE*, so $FAKE_CUDNN_LOG may change between calls and several processes may share one file.
 * The mutex keeps lines of concurrent threads whole even on file systems where O_APPEND writes
 * are not atomic.
 */
#define _POSIX_C_SOURCE 200809L

#include "fake_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* The only mutable global of the library. */
static pthread_mutex_t log_mutex = PTHREAD_MUTEX_INITIALIZER;

enum { LOG_LINE_MAX = 2048 };

static void write_all(int fd, const char *data, size_t length)
{
    while (length > 0) {
        ssize_t written = write(fd, data, length);
        if (written < 0) {
            if (errno == EINTR)
                continue;
            return; /* a test double must not fail a call because its log is unwritable */
        }
        data += written;
        length -= (size_t)written;
    }
}

void fake_log(const char *function, cudnnStatus_t status, const char *fields_format, ...)
{
    const char *path = getenv("FAKE_CUDNN_LOG");
    if (path == NULL || path[0] == '\0')
        return;

    char line[LOG_LINE_MAX];
    int used = snprintf(line, sizeof line, "%s", function);
    char fields[LOG_LINE_MAX];
    va_list arguments;
    va_start(arguments, fields_format);
    vsnprintf(fields, sizeof fields, fields_format, arguments);
    va_end(arguments);
    if (fields[0] != '\0')
        used += snprintf(line + used, sizeof line - (size_t)used, " %s", fields);
    if (used < (int)sizeof line)
        used += snprintf(line + used, sizeof line - (size_t)used, " status=%d\n", (int)status);
    if (used >= (int)sizeof line) { /* truncated: still end the record with a newline */
        used = (int)sizeof line - 1;
        line[used - 1] = '\n';
    }

    pthread_mutex_lock(&log_mutex);
    int fd = open(path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    if (fd >= 0) {
        write_all(fd, line, (size_t)used);
        close(fd);
    }
    pthread_mutex_unlock(&log_mutex);
}

const char *fake_math_name(cudnnMathType_t math)
{
    switch (math) {
    case CUDNN_DEFAULT_MATH:
        return "default";
    case CUDNN_TENSOR_OP_MATH:
        return "tensor_op";
    case CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION:
        return "tensor_op_conv";
    case CUDNN_FMA_MATH:
        return "fma";
    }
    return "unknown";
}

void fake_format_ints(char *buffer, size_t size, const int *values, int count)
{
    size_t used = 0;
    buffer[0] = '\0';
    if (count <= 0) {
        snprintf(buffer, size, "-");
        return;
    }
    for (int i = 0; i < count && used < size; ++i) {
        int written = snprintf(buffer + used, size - used, i == 0 ? "%d" : "x%d", values[i]);
        if (written < 0)
            return;
        used += (size_t)written;
    }
}

long long fake_env_integer(const char *name, long long fallback)
{
    const char *text = getenv(name);
    if (text == NULL || text[0] == '\0')
        return fallback;
    char *end = NULL;
    errno = 0;
    long long value = strtoll(text, &end, 10);
    if (errno != 0 || *end != '\0' || value < 0)
        return fallback;
    return value;
}
