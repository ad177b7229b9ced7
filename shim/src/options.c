/*
 * options.c: every MUCUDNN_* environment variable, read once into one enum-indexed table
 * (mimalloc style). No other file calls getenv.
 */
#include <ctype.h>
#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "internal.h"

typedef enum { KIND_BOOL, KIND_SIZE, KIND_PATH, KIND_LEVEL } option_kind;

typedef struct {
    const char *name;
    option_kind kind;
    long long default_value;
    const char *description;
    /* Filled in by mu_options_init. */
    bool is_set;
    long long value;
    const char *path;
} option_entry;

static option_entry options[MU_OPT_COUNT] = {
    [MU_OPT_DISABLE] = {"MUCUDNN_DISABLE", KIND_BOOL, 0, "pass every call through", false, 0, NULL},
    [MU_OPT_PLAN] = {"MUCUDNN_PLAN", KIND_PATH, 0, "plan file to execute", false, 0, NULL},
    [MU_OPT_WORKSPACE_LIMIT] = {"MUCUDNN_WORKSPACE_LIMIT", KIND_SIZE, -1,
                                "largest workspace offered for kernels without a plan", false, 0,
                                NULL},
    [MU_OPT_RECORD] = {"MUCUDNN_RECORD", KIND_PATH, 0, "file the kernels run are appended to",
                       false, 0, NULL},
    [MU_OPT_LOG_LEVEL] = {"MUCUDNN_LOG_LEVEL", KIND_LEVEL, MU_LOG_WARNING,
                          "error, warning, info or debug (0-3)", false, 0, NULL},
    [MU_OPT_LOG_FILE] = {"MUCUDNN_LOG_FILE", KIND_PATH, 0, "log destination (default stderr)",
                         false, 0, NULL},
    [MU_OPT_SUMMARY] = {"MUCUDNN_SUMMARY", KIND_BOOL, 0, "print a per-kernel summary at exit",
                        false, 0, NULL},
    [MU_OPT_CUDA_GRAPHS] = {"MUCUDNN_CUDA_GRAPHS", KIND_BOOL, 1,
                            "launch each plan's pieces as one CUDA graph", false, 0, NULL},
    [MU_OPT_MEMORY_BUDGET] = {"MUCUDNN_MEMORY_BUDGET", KIND_SIZE, -1,
                              "GPU memory of the whole process (read, not yet acted on)", false, 0,
                              NULL},
};

static bool parse_bool(const char *text, long long *value) {
    static const char *const yes[] = {"1", "true", "yes", "on"};
    static const char *const no[] = {"0", "false", "no", "off"};
    for (size_t i = 0; i < sizeof yes / sizeof *yes; i++) {
        if (strcasecmp(text, yes[i]) == 0) return *value = 1, true;
        if (strcasecmp(text, no[i]) == 0) return *value = 0, true;
    }
    return false;
}

/* "123", "64MiB", "512KiB", "1GiB", "2GB", "10kB", "100B" (suffixes case-insensitive). */
static bool parse_size(const char *text, long long *value) {
    static const struct {
        const char *suffix;
        unsigned long long factor;
    } units[] = {
        {"", 1ULL},          {"b", 1ULL},          {"kib", 1ULL << 10}, {"mib", 1ULL << 20},
        {"gib", 1ULL << 30}, {"tib", 1ULL << 40},  {"kb", 1000ULL},     {"mb", 1000000ULL},
        {"gb", 1000000000ULL}, {"tb", 1000000000000ULL},
    };
    if (!isdigit((unsigned char)text[0])) return false;
    errno = 0;
    char *end;
    unsigned long long number = strtoull(text, &end, 10);
    if (errno == ERANGE) return false;
    for (size_t i = 0; i < sizeof units / sizeof *units; i++) {
        if (strcasecmp(end, units[i].suffix) != 0) continue;
        if (number > (unsigned long long)LLONG_MAX / units[i].factor) return false;
        *value = (long long)(number * units[i].factor);
        return true;
    }
    return false;
}

static bool parse_level(const char *text, long long *value) {
    static const char *const names[] = {"error", "warning", "info", "debug"};
    for (int level = 0; level < 4; level++) {
        char digit[2] = {(char)('0' + level), '\0'};
        if (strcasecmp(text, names[level]) == 0 || strcmp(text, digit) == 0) {
            *value = level;
            return true;
        }
    }
    return false;
}

static const char *expected_form(option_kind kind) {
    switch (kind) {
    case KIND_BOOL: return "1/0, true/false, yes/no or on/off";
    case KIND_SIZE: return "bytes, or a number with B, KiB, MiB, GiB, TiB, kB, MB, GB or TB";
    case KIND_LEVEL: return "error, warning, info, debug or 0-3";
    case KIND_PATH: return "a path";
    }
    return "?";
}

/* Parses one variable; returns false (and leaves the default) when its value is malformed. */
static bool read_option(option_entry *option) {
    option->value = option->default_value;
    const char *text = getenv(option->name);
    if (text == NULL) return true;
    bool ok = false;
    switch (option->kind) {
    case KIND_BOOL: ok = parse_bool(text, &option->value); break;
    case KIND_SIZE: ok = parse_size(text, &option->value); break;
    case KIND_LEVEL: ok = parse_level(text, &option->value); break;
    case KIND_PATH:
        ok = text[0] != '\0';
        option->path = ok ? text : NULL;
        break;
    }
    if (!ok) option->value = option->default_value;
    option->is_set = ok;
    return ok;
}

static void warn_malformed(const option_entry *option) {
    mu_log(MU_LOG_WARNING, "%s='%s' is not valid (expected %s); using the default", option->name,
           getenv(option->name), expected_form(option->kind));
}

static void read_all_options(void) {
    /* The log options first, so that the other warnings reach the right place at the right level. */
    bool level_ok = read_option(&options[MU_OPT_LOG_LEVEL]);
    bool file_ok = read_option(&options[MU_OPT_LOG_FILE]);
    mu_log_configure((int)options[MU_OPT_LOG_LEVEL].value, options[MU_OPT_LOG_FILE].path);
    if (!level_ok) warn_malformed(&options[MU_OPT_LOG_LEVEL]);
    if (!file_ok) warn_malformed(&options[MU_OPT_LOG_FILE]);
    for (int i = 0; i < MU_OPT_COUNT; i++) {
        if (i == MU_OPT_LOG_LEVEL || i == MU_OPT_LOG_FILE) continue;
        if (!read_option(&options[i])) warn_malformed(&options[i]);
    }
}

void mu_options_init(void) {
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, read_all_options);
}

bool mu_option_is_set(mu_option option) { return options[option].is_set; }

long long mu_option_int(mu_option option) { return options[option].value; }

const char *mu_option_path(mu_option option) { return options[option].path; }

void mu_options_log(void) {
    if (!mu_log_enabled(MU_LOG_DEBUG)) return;
    for (int i = 0; i < MU_OPT_COUNT; i++) {
        const option_entry *option = &options[i];
        const char *origin = option->is_set ? "environment" : "default";
        if (option->kind == KIND_PATH)
            mu_log(MU_LOG_DEBUG, "option %s = %s (%s; %s)", option->name,
                   option->path ? option->path : "(unset)", origin, option->description);
        else if (option->kind == KIND_SIZE && option->value < 0)
            mu_log(MU_LOG_DEBUG, "option %s = none (%s; %s)", option->name, origin,
                   option->description);
        else
            mu_log(MU_LOG_DEBUG, "option %s = %lld (%s; %s)", option->name, option->value, origin,
                   option->description);
    }
}
