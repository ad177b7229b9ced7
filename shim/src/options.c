/*
 * options.c: every MUCUDNN_* environment variable, read once into one enum-indexed table
 * (mimalloc style). No other file calls getenv.
 */
#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "internal.h"

typedef enum { KIND_BOOL, KIND_SIZE, KIND_PATH, KIND_LEVEL, KIND_COUNT } option_kind;

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
    [MU_OPT_PLAN] = {"MUCUDNN_PLAN", KIND_PATH, 0,
                     "plan file to execute, or plans (a:b, a directory of *.plan): the one made "
                     "for this GPU and cuDNN", false, 0, NULL},
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
                              "GPU memory of the whole process: workspaces keep within what is left",
                              false, 0, NULL},
    [MU_OPT_ROOM] = {"MUCUDNN_ROOM", KIND_BOOL, 1,
                     "choose front points within the memory free at the time (room.c)", false, 0, NULL},
    [MU_OPT_ROOM_MARGIN] = {"MUCUDNN_ROOM_MARGIN", KIND_SIZE, 64LL << 20,
                            "memory kept free when choosing a front point within the room", false, 0,
                            NULL},
    [MU_OPT_ONLINE] = {"MUCUDNN_ONLINE", KIND_BOOL, 0,
                       "measure kernels without a plan on first use and keep their fronts", false, 0,
                       NULL},
    [MU_OPT_ONLINE_DIR] = {"MUCUDNN_ONLINE_DIR", KIND_PATH, 0,
                           "where online tuning keeps its plan file and locks", false, 0, NULL},
    [MU_OPT_ONLINE_BUDGET_MS] = {"MUCUDNN_ONLINE_BUDGET_MS", KIND_COUNT, 20000,
                                 "milliseconds a process may spend measuring", false, 0, NULL},
    [MU_OPT_WORKSPACE_SLACK] = {"MUCUDNN_WORKSPACE_SLACK", KIND_COUNT, -1,
                                "percent: a front plan's call takes its point of least workspace "
                                "within this much of the fastest (unset: the fastest)", false, 0, NULL},
    [MU_OPT_WORKSPACE_HOLD] = {"MUCUDNN_WORKSPACE_HOLD", KIND_SIZE, -1,
                               "with online tuning, an engine of more workspace runs the online "
                               "front's point within this (or within 8 of its samples' worth)",
                               false, 0, NULL},
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

/* The grammar of docs/sizes.md, shared with mucudnn/sizes.py through tests/data/sizes.txt. ASCII
 * tests by hand: the host process's locale must not change what a size means. */
static bool is_blank(char c) { return c == ' ' || (c >= '\t' && c <= '\r'); }
static bool is_digit(char c) { return c >= '0' && c <= '9'; }
static bool is_letter(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'); }

mu_size_result mu_parse_size(const char *text, long long *value) {
    static const struct {
        const char *unit;
        unsigned long long factor;
    } units[] = {
        {"", 1ULL},           {"b", 1ULL},           {"kib", 1ULL << 10}, {"mib", 1ULL << 20},
        {"gib", 1ULL << 30},  {"tib", 1ULL << 40},   {"kb", 1000ULL},     {"mb", 1000000ULL},
        {"gb", 1000000000ULL}, {"tb", 1000000000000ULL},
    };
    const char *p = text;
    while (is_blank(*p)) p++;
    const char *whole = p;
    while (is_digit(*p)) p++;
    size_t whole_length = (size_t)(p - whole);
    const char *fraction = p;
    size_t fraction_length = 0;
    if (*p == '.') {
        fraction = ++p;
        while (is_digit(*p)) p++;
        fraction_length = (size_t)(p - fraction);
        if (fraction_length == 0) return MU_SIZE_SYNTAX;
    }
    if (whole_length == 0) return MU_SIZE_SYNTAX;
    while (is_blank(*p)) p++;
    const char *unit = p;
    while (is_letter(*p)) p++;
    size_t unit_length = (size_t)(p - unit);
    while (is_blank(*p)) p++;
    if (*p != '\0') return MU_SIZE_SYNTAX;

    unsigned long long factor = 0;
    for (size_t i = 0; i < sizeof units / sizeof *units; i++)
        if (strlen(units[i].unit) == unit_length && strncasecmp(unit, units[i].unit, unit_length) == 0)
            factor = units[i].factor;
    if (factor == 0)
        return unit_length == 1 && strchr("kKmMgGtT", unit[0]) ? MU_SIZE_AMBIGUOUS : MU_SIZE_SYNTAX;

    unsigned long long bytes = 0;
    for (size_t i = 0; i < whole_length; i++) {
        unsigned long long digit = (unsigned long long)(whole[i] - '0');
        if (bytes > ((unsigned long long)LLONG_MAX - digit) / 10) return MU_SIZE_RANGE;
        bytes = bytes * 10 + digit;
    }
    /* floor(0.FRACTION x factor), exactly: multiplying the fraction's digits by factor from the
     * last one up, each product digit falls below the point and what carries past the first digit
     * is the whole part (less than factor, so no step overflows). */
    unsigned long long carry = 0;
    for (size_t i = fraction_length; i-- > 0;)
        carry = ((unsigned long long)(fraction[i] - '0') * factor + carry) / 10;
    if (bytes > ((unsigned long long)LLONG_MAX - carry) / factor) return MU_SIZE_RANGE;
    *value = (long long)(bytes * factor + carry);
    return MU_SIZE_OK;
}

const char *mu_size_problem(mu_size_result result) {
    switch (result) {
    case MU_SIZE_OK: return "";
    case MU_SIZE_SYNTAX: break;
    case MU_SIZE_AMBIGUOUS:
        return "a bare K, M, G or T is ambiguous: write KiB, MiB, GiB, TiB (powers of 2) or KB, MB, "
               "GB, TB (powers of 10)";
    case MU_SIZE_RANGE: return "more than 2^63-1 bytes";
    }
    return "not a size";
}

static bool parse_size(const char *text, long long *value) { return mu_parse_size(text, value) == MU_SIZE_OK; }

/* A non-negative decimal integer (ASCII digits only, at most 2^62). */
static bool parse_count(const char *text, long long *value) {
    long long number = 0;
    if (*text == '\0') return false;
    for (const char *s = text; *s; s++) {
        if (!is_digit(*s) || number > ((1LL << 62) - (*s - '0')) / 10) return false;
        number = number * 10 + (*s - '0');
    }
    *value = number;
    return true;
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
    case KIND_SIZE: return "bytes, or a number with B, KiB, MiB, GiB, TiB, KB, MB, GB or TB";
    case KIND_LEVEL: return "error, warning, info, debug or 0-3";
    case KIND_COUNT: return "a non-negative integer";
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
    case KIND_COUNT: ok = parse_count(text, &option->value); break;
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
    char shown[MU_ESCAPED_MAX];
    const char *text = getenv(option->name);
    long long ignored;
    /* A size that only has the wrong unit or is too large says so before what a size looks like. */
    mu_size_result result = option->kind == KIND_SIZE ? mu_parse_size(text, &ignored) : MU_SIZE_SYNTAX;
    bool specific = result == MU_SIZE_AMBIGUOUS || result == MU_SIZE_RANGE;
    mu_log(MU_LOG_WARNING, "%s='%s' is not valid (%s%sexpected %s); using the default", option->name,
           mu_log_escape(text, shown, sizeof shown), specific ? mu_size_problem(result) : "",
           specific ? "; " : "", expected_form(option->kind));
}

/* $XDG_CACHE_HOME/mucudnn/online (an absolute XDG_CACHE_HOME only, as the XDG spec says), else
 * $HOME/.cache/mucudnn/online; NULL when neither is usable. */
static const char *default_online_dir(void) {
    static char dir[4096];
    const char *cache = getenv("XDG_CACHE_HOME");
    const char *home = getenv("HOME");
    int length = -1;
    if (cache != NULL && cache[0] == '/')
        length = snprintf(dir, sizeof dir, "%s/mucudnn/online", cache);
    else if (home != NULL && home[0] != '\0')
        length = snprintf(dir, sizeof dir, "%s/.cache/mucudnn/online", home);
    return length > 0 && (size_t)length < sizeof dir ? dir : NULL;
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
    if (options[MU_OPT_ONLINE_DIR].path == NULL) options[MU_OPT_ONLINE_DIR].path = default_online_dir();
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
        char shown[MU_ESCAPED_MAX];
        if (option->kind == KIND_PATH)
            mu_log(MU_LOG_DEBUG, "option %s = %s (%s; %s)", option->name,
                   option->path ? mu_log_escape(option->path, shown, sizeof shown) : "(unset)",
                   origin, option->description);
        else if ((option->kind == KIND_SIZE || option->kind == KIND_COUNT) && option->value < 0)
            mu_log(MU_LOG_DEBUG, "option %s = none (%s; %s)", option->name, origin,
                   option->description);
        else
            mu_log(MU_LOG_DEBUG, "option %s = %lld (%s; %s)", option->name, option->value, origin,
                   option->description);
    }
}
