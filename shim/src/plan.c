/*
 * plan.c: a small hand-written parser of the plan file (docs/plan-format.md) and its lookup
 * table on (key, N). Any error makes the whole file invalid; the message names file and line.
 * It accepts exactly what mucudnn/plan.py accepts (tests/test_plan_differential.py).
 */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <locale.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "internal.h"

/* The largest plan file read (docs/plan-format.md; mucudnn.plan.MAX_PLAN_BYTES). */
#define MU_PLAN_MAX_BYTES (64 << 20)
_Static_assert(SIZE_MAX >= UINT64_MAX, "WORKSPACE is read as a uint64 into a size_t");

enum { HEADER_GPU, HEADER_CUDNN, HEADER_STRATEGY, HEADER_LIMIT, HEADER_POLICY, HEADER_COUNT };
static const char *const header_names[HEADER_COUNT] = {"gpu", "cudnn", "strategy", "limit", "policy"};

typedef struct {
    const char *path;
    int line_number;
    char *error;
    size_t error_size;
    bool failed;
    bool seen_version;
    bool seen_header[HEADER_COUNT];
    bool seen_kernel;
    mu_plan *plan;
    size_t entry_capacity;
    size_t *slots;    /* open-addressed (key, N) table of entry index + 1, 0 = free */
    size_t slot_mask;
    locale_t c_locale; /* TIME is read with '.' whatever the host process's LC_NUMERIC */
} parser;

MU_PRINTF(2, 3) static bool fail(parser *p, const char *fmt, ...) {
    int used = snprintf(p->error, p->error_size, "%s:%d: ", p->path, p->line_number);
    if (used >= 0 && (size_t)used < p->error_size) {
        va_list args;
        va_start(args, fmt);
        vsnprintf(p->error + used, p->error_size - (size_t)used, fmt, args);
        va_end(args);
    }
    p->failed = true;
    return false;
}

/* An integer of the plan grammar: "0" or [1-9][0-9]*, ASCII, within [min, max]. */
static bool parse_unsigned(const char *text, unsigned long long min, unsigned long long max,
                           unsigned long long *value) {
    if (text[0] < '0' || text[0] > '9' || (text[0] == '0' && text[1] != '\0')) return false;
    unsigned long long number = 0;
    for (const char *s = text; *s; s++) {
        if (*s < '0' || *s > '9') return false;
        unsigned digit = (unsigned)(*s - '0');
        if (number > (max - digit) / 10) return false; /* number * 10 + digit > max */
        number = number * 10 + digit;
    }
    if (number < min) return false;
    *value = number;
    return true;
}

static bool parse_positive_int(const char *text, int *value) {
    unsigned long long number;
    if (!parse_unsigned(text, 1, INT_MAX, &number)) return false;
    *value = (int)number;
    return true;
}

/* TIME: [0-9]+ ("." [0-9]+)? ([eE] [+-]? [0-9]+)?, finite, rounded to the nearest double. */
static bool parse_time(const parser *p, const char *text, double *value) {
    const char *s = text;
    size_t digits = strspn(s, "0123456789");
    if (digits == 0) return false;
    s += digits;
    if (*s == '.') {
        if ((digits = strspn(s + 1, "0123456789")) == 0) return false;
        s += 1 + digits;
    }
    if (*s == 'e' || *s == 'E') {
        s += 1 + (s[1] == '+' || s[1] == '-');
        if ((digits = strspn(s, "0123456789")) == 0) return false;
        s += digits;
    }
    if (*s != '\0') return false;
    char *end;
    double number = p->c_locale != (locale_t)0 ? strtod_l(text, &end, p->c_locale) : strtod(text, &end);
    if (*end != '\0' || !isfinite(number)) return false;
    *value = number;
    return true;
}

static char *copy_string(const char *text) {
    size_t length = strlen(text) + 1;
    char *copy = malloc(length);
    if (copy != NULL) memcpy(copy, text, length);
    return copy;
}

/* Splits at runs of blanks, in place; returns the number of tokens (at most max). */
static int split_blanks(char *line, char *tokens[], int max) {
    int count = 0;
    char *p = line;
    while (*p && count < max) {
        while (*p == ' ' || *p == '\t') p++;
        if (!*p) break;
        tokens[count++] = p;
        while (*p && *p != ' ' && *p != '\t') p++;
        if (*p) *p++ = '\0';
    }
    return count;
}

static bool parse_header(parser *p, int header, const char *value) {
    mu_plan *plan = p->plan;
    if (p->seen_kernel) return fail(p, "header record '%s' after a kernel record", header_names[header]);
    if (p->seen_header[header]) return fail(p, "duplicate header record '%s'", header_names[header]);
    if (value[0] == '\0') return fail(p, "header record '%s' has no value", header_names[header]);
    p->seen_header[header] = true;
    unsigned long long number;
    switch (header) {
    case HEADER_GPU: plan->gpu = copy_string(value); break;
    case HEADER_CUDNN:
        if (!parse_unsigned(value, 1, INT_MAX, &number))
            return fail(p, "cudnn version '%s' is not an integer in 1..%d", value, INT_MAX);
        plan->cudnn_version = (long)number;
        break;
    case HEADER_STRATEGY:
        if (strcmp(value, "wr") != 0 && strcmp(value, "wd") != 0 && strcmp(value, "front") != 0)
            return fail(p, "strategy '%s' is not wr, wd or front", value);
        plan->strategy = copy_string(value);
        plan->front = strcmp(value, "front") == 0;
        break;
    case HEADER_LIMIT:
        if (!parse_unsigned(value, 0, UINT64_MAX, &number))
            return fail(p, "limit '%s' is not a byte count in 0..%llu", value,
                        (unsigned long long)UINT64_MAX);
        plan->limit = number;
        break;
    case HEADER_POLICY:
        if (strcmp(value, "undivided") != 0 && strcmp(value, "powerOfTwo") != 0 &&
            strcmp(value, "all") != 0 && strcmp(value, "fit") != 0)
            return fail(p, "policy '%s' is not undivided, powerOfTwo, all or fit", value);
        plan->policy = copy_string(value);
        break;
    }
    return true;
}

static bool parse_piece(parser *p, mu_direction dir, char *text, mu_piece *piece) {
    char *algo = strchr(text, ':');
    char *math = algo ? strchr(algo + 1, ':') : NULL;
    char *mark = math ? strchr(math + 1, ':') : NULL;
    if (algo == NULL || math == NULL || (mark != NULL && strcmp(mark, ":" MU_BORROW_MARK) != 0))
        return fail(p, "piece '%s' is not B:ALGO:MATH or B:ALGO:MATH:" MU_BORROW_MARK, text);
    piece->borrow = mark != NULL;
    if (piece->borrow && dir == MU_DIR_BWD_FILTER)
        return fail(p, "piece '%s': only fwd and bwd_data pieces can borrow their output as workspace",
                    text);
    if (mark != NULL) *mark = '\0';
    *algo++ = '\0';
    *math++ = '\0';
    if (!parse_positive_int(text, &piece->batch))
        return fail(p, "piece batch size '%s' is not an integer in 1..%d", text, INT_MAX);
    piece->algo = mu_algo_from_name(dir, algo);
    piece->engine = NULL;
    if (piece->algo < 0 && strncmp(algo, "eng", 3) == 0) {
        mu_engine engine;
        if (!mu_engine_parse(algo, &engine))
            return fail(p, "engine '%s' is not eng<G> or eng<G>.k<T>=<V>... with knob types ascending "
                        "(at most %d knobs)", algo, MU_MAX_KNOBS);
        if ((piece->engine = malloc(sizeof engine)) == NULL) return fail(p, "out of memory");
        *piece->engine = engine;
    } else if (piece->algo < 0) {
        return fail(p, "unknown %s algorithm '%s'", mu_direction_name(dir), algo);
    }
    int math_value = mu_math_from_name(math);
    if (math_value < 0)
        return fail(p, "unknown math type '%s' (expected default, tensor_op, tensor_op_conv or fma)", math);
    piece->math = (cudnnMathType_t)math_value;
    return true;
}

static mu_plan_entry *new_entry(parser *p) {
    mu_plan *plan = p->plan;
    if (plan->entry_count == p->entry_capacity) {
        size_t capacity = p->entry_capacity ? 2 * p->entry_capacity : 64;
        mu_plan_entry *entries = realloc(plan->entries, capacity * sizeof *entries);
        if (entries == NULL) return NULL;
        plan->entries = entries;
        p->entry_capacity = capacity;
    }
    mu_plan_entry *entry = &plan->entries[plan->entry_count++];
    memset(entry, 0, sizeof *entry);
    return entry;
}

static size_t plan_index(const parser *p, const mu_plan_entry *entry) {
    return (size_t)(entry - p->plan->entries);
}

/* Refuses a (key, N) seen on an earlier line, on this line (as mucudnn/plan.py does); in a front
 * plan, the same (key, N) is another point of its front unless its workspace is the same. */
static bool check_unique(parser *p, size_t index) {
    mu_plan_entry *entries = p->plan->entries;
    if (2 * (index + 1) > p->slot_mask) { /* keep the load at most 1/2: rebuild twice as large */
        size_t size = p->slot_mask ? 2 * (p->slot_mask + 1) : 64;
        size_t *slots = calloc(size, sizeof *slots);
        if (slots == NULL) return fail(p, "out of memory");
        free(p->slots);
        p->slots = slots;
        p->slot_mask = size - 1;
        for (size_t i = 0; i < index; i++) {
            size_t s = entries[i].hash & p->slot_mask;
            while (slots[s] != 0) s = (s + 1) & p->slot_mask;
            slots[s] = i + 1;
        }
    }
    mu_plan_entry *entry = &entries[index];
    entry->hash = mu_kernel_hash(entry->key, entry->n);
    size_t s = entry->hash & p->slot_mask;
    for (; p->slots[s] != 0; s = (s + 1) & p->slot_mask) {
        const mu_plan_entry *other = &entries[p->slots[s] - 1];
        if (other->hash == entry->hash && other->n == entry->n && strcmp(other->key, entry->key) == 0 &&
            (!p->plan->front || other->workspace == entry->workspace))
            return fail(p, "duplicate kernel %s N=%d%s", entry->key, entry->n,
                        p->plan->front ? " with the same workspace" : "");
    }
    p->slots[s] = index + 1;
    return true;
}

/* kernel KEY N WORKSPACE TIME PIECE [PIECE ...] */
static bool parse_kernel(parser *p, char *tokens[], int count) {
    for (int h = 0; h < HEADER_COUNT; h++)
        if (!p->seen_header[h])
            return fail(p, "kernel record before header record '%s'", header_names[h]);
    p->seen_kernel = true;
    if (count < 6) return fail(p, "kernel record needs KEY N WORKSPACE TIME and at least one PIECE");
    mu_direction dir;
    const char *why = mu_key_check(tokens[1], &dir);
    if (why != NULL) return fail(p, "%s: '%s'", why, tokens[1]);
    int n;
    unsigned long long workspace;
    double time_ms;
    if (!parse_positive_int(tokens[2], &n))
        return fail(p, "N '%s' is not an integer in 1..%d", tokens[2], INT_MAX);
    if (!parse_unsigned(tokens[3], 0, UINT64_MAX, &workspace))
        return fail(p, "workspace '%s' is not a byte count in 0..%llu", tokens[3],
                    (unsigned long long)UINT64_MAX);
    if (!parse_time(p, tokens[4], &time_ms))
        return fail(p, "time '%s' is not a finite decimal number >= 0", tokens[4]);

    mu_plan_entry *entry = new_entry(p);
    mu_piece *pieces = malloc((size_t)(count - 5) * sizeof *pieces);
    char *key = copy_string(tokens[1]);
    if (entry == NULL || pieces == NULL || key == NULL) {
        free(pieces);
        free(key);
        return fail(p, "out of memory");
    }
    *entry = (mu_plan_entry){.key = key, .dir = dir, .n = n, .workspace = (size_t)workspace,
                             .time_ms = time_ms, .piece_count = count - 5, .pieces = pieces};
    long long total = 0;
    memset(pieces, 0, (size_t)entry->piece_count * sizeof *pieces);
    for (int i = 0; i < entry->piece_count; i++) {
        if (!parse_piece(p, dir, tokens[5 + i], &pieces[i])) return false;
        total += pieces[i].batch;
        entry->has_engine_pieces |= pieces[i].engine != NULL;
        entry->has_borrow_pieces |= pieces[i].borrow;
    }
    if (total != n) return fail(p, "pieces add up to %lld samples, not N = %d", total, n);
    if (p->plan->front && workspace > p->plan->limit)
        return fail(p, "workspace %llu is over the plan's limit %llu", workspace, p->plan->limit);
    return check_unique(p, plan_index(p, entry));
}

static bool is_blank(char c) { return c == ' ' || c == '\t'; }

/* Length of the well-formed UTF-8 sequence at s (n bytes left), 0 when there is none: no overlong
 * form, no surrogate, nothing past U+10FFFF (what Python's decoder refuses). */
static size_t utf8_length(const unsigned char *s, size_t n) {
    if (s[0] < 0x80) return 1;
    size_t length;
    unsigned char low = 0x80, high = 0xbf; /* the range of the second byte */
    if (s[0] >= 0xc2 && s[0] <= 0xdf) length = 2;
    else if (s[0] >= 0xe0 && s[0] <= 0xef) {
        length = 3;
        if (s[0] == 0xe0) low = 0xa0;
        if (s[0] == 0xed) high = 0x9f;
    } else if (s[0] >= 0xf0 && s[0] <= 0xf4) {
        length = 4;
        if (s[0] == 0xf0) low = 0x90;
        if (s[0] == 0xf4) high = 0x8f;
    } else
        return 0;
    if (n < length || s[1] < low || s[1] > high) return 0;
    for (size_t i = 2; i < length; i++)
        if (s[i] < 0x80 || s[i] > 0xbf) return 0;
    return length;
}

/* The characters of a line: no control character but tab. (UTF-8 is checked for the whole file
 * first, as Python decodes it before it reads any line.) */
static bool check_characters(parser *p, const char *line, size_t length) {
    for (size_t i = 0; i < length; i++) {
        unsigned char c = (unsigned char)line[i];
        if (c == '\r') return fail(p, "a carriage return (lines end with \\n alone)");
        if ((c < 0x20 && c != '\t') || c == 0x7f) return fail(p, "control character U+%04X", c);
    }
    return true;
}

static bool parse_line(parser *p, char *line) {
    size_t length = strlen(line);
    while (length > 0 && is_blank(line[length - 1])) line[--length] = '\0';
    char *start = line;
    while (is_blank(*start)) start++;
    if (*start == '\0' || *start == '#') return true;

    /* The record name; a header's value is the rest of the line (a GPU name has blanks). */
    char *rest = start + strcspn(start, " \t");
    if (*rest) *rest++ = '\0';
    while (is_blank(*rest)) rest++;
    if (strcmp(start, "gpu") != 0)
        for (const char *c = start; c < line + length; c++)
            if ((unsigned char)*c >= 0x80)
                return fail(p, "non-ASCII character outside a comment or the gpu value");

    if (!p->seen_version) {
        if (strcmp(start, "mucudnn-plan") != 0)
            return fail(p, "not a plan file: the first record must be 'mucudnn-plan 1', got '%s'", start);
        if (strcmp(rest, "1") != 0)
            return fail(p, "plan file version '%s' is not supported (this shim reads version 1)", rest);
        p->seen_version = true;
        return true;
    }
    for (int h = 0; h < HEADER_COUNT; h++)
        if (strcmp(start, header_names[h]) == 0) return parse_header(p, h, rest);
    if (strcmp(start, "kernel") == 0) {
        /* Tokens: "kernel", KEY, N, WORKSPACE, TIME, then up to (length of line) pieces. */
        size_t max_tokens = 1 + strlen(rest) / 2 + 1;
        char **tokens = malloc((max_tokens + 1) * sizeof *tokens);
        if (tokens == NULL) return fail(p, "out of memory");
        tokens[0] = start;
        int count = 1 + split_blanks(rest, tokens + 1, (int)max_tokens);
        bool ok = parse_kernel(p, tokens, count);
        free(tokens);
        return ok;
    }
    if (strcmp(start, "mucudnn-plan") == 0) return fail(p, "duplicate 'mucudnn-plan' record");
    return fail(p, "unknown record '%s'", start);
}

static bool build_table(parser *p) {
    mu_plan *plan = p->plan;
    size_t buckets = 16;
    while (buckets < 2 * plan->entry_count) buckets *= 2;
    plan->buckets = calloc(buckets, sizeof *plan->buckets);
    if (plan->buckets == NULL) return fail(p, "out of memory");
    plan->bucket_mask = buckets - 1;
    /* One bucket item per (key, N), the point of least workspace; its other points (front plans)
     * follow it through next_point in ascending workspace (distinct: check_unique). */
    for (size_t i = 0; i < plan->entry_count; i++) {
        mu_plan_entry *entry = &plan->entries[i];
        mu_plan_entry **link = &plan->buckets[entry->hash & plan->bucket_mask];
        while (*link != NULL && !((*link)->hash == entry->hash && (*link)->n == entry->n &&
                                  strcmp((*link)->key, entry->key) == 0))
            link = &(*link)->next_in_bucket;
        if (*link == NULL) {
            *link = entry;
            continue;
        }
        if (entry->workspace < (*link)->workspace) { /* the new head */
            entry->next_in_bucket = (*link)->next_in_bucket;
            entry->next_point = *link;
            (*link)->next_in_bucket = NULL;
            *link = entry;
            continue;
        }
        mu_plan_entry *before = *link;
        while (before->next_point != NULL && before->next_point->workspace < entry->workspace)
            before = before->next_point;
        entry->next_point = before->next_point;
        before->next_point = entry;
    }
    return true;
}

/* Reads a regular file of at most MU_PLAN_MAX_BYTES. The open does not block (a FIFO without a
 * writer would hang the host process), and what is not a regular file (FIFO, device such as
 * /dev/zero, directory) is refused before anything is read. */
static char *read_file(const char *path, size_t *size, char *error, size_t error_size) {
    int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) {
        snprintf(error, error_size, "%s:0: cannot open plan file: %s", path, strerror(errno));
        return NULL;
    }
    struct stat info;
    if (fstat(fd, &info) != 0) {
        snprintf(error, error_size, "%s:0: cannot read plan file: %s", path, strerror(errno));
        close(fd);
        return NULL;
    }
    if (!S_ISREG(info.st_mode) || info.st_size > MU_PLAN_MAX_BYTES) {
        if (!S_ISREG(info.st_mode))
            snprintf(error, error_size, "%s:0: plan file is not a regular file", path);
        else
            snprintf(error, error_size, "%s:0: plan file is larger than %d bytes", path, MU_PLAN_MAX_BYTES);
        close(fd);
        return NULL;
    }
    /* Read until end of file or one byte past the maximum (the file may grow after fstat). */
    size_t capacity = info.st_size > 0 ? (size_t)info.st_size + 2 : (size_t)1 << 16;
    size_t length = 0;
    char *text = malloc(capacity);
    bool read_error = false;
    while (text != NULL && length <= MU_PLAN_MAX_BYTES) {
        if (length + 1 == capacity) {
            capacity = capacity * 2 > MU_PLAN_MAX_BYTES + 2 ? MU_PLAN_MAX_BYTES + 2 : capacity * 2;
            char *bigger = realloc(text, capacity);
            if (bigger == NULL) free(text);
            text = bigger;
            continue;
        }
        ssize_t got = read(fd, text + length, capacity - length - 1);
        if (got < 0 && errno == EINTR) continue;
        if (got <= 0) {
            read_error = got < 0;
            break;
        }
        length += (size_t)got;
    }
    close(fd);
    if (text == NULL || read_error || length > MU_PLAN_MAX_BYTES) {
        if (text == NULL) snprintf(error, error_size, "%s:0: out of memory reading the plan file", path);
        else if (read_error) snprintf(error, error_size, "%s:0: cannot read plan file", path);
        else snprintf(error, error_size, "%s:0: plan file is larger than %d bytes", path, MU_PLAN_MAX_BYTES);
        free(text);
        return NULL;
    }
    text[length] = '\0';
    *size = length;
    return text;
}

void mu_plan_free(mu_plan *plan) {
    if (plan == NULL) return;
    for (size_t i = 0; i < plan->entry_count; i++) {
        free(plan->entries[i].key);
        for (int j = 0; j < plan->entries[i].piece_count; j++) free(plan->entries[i].pieces[j].engine);
        free(plan->entries[i].pieces);
    }
    free(plan->entries);
    free(plan->buckets);
    free(plan->path);
    free(plan->gpu);
    free(plan->strategy);
    free(plan->policy);
    free(plan);
}

mu_plan *mu_plan_load(const char *path, char *error, size_t error_size) {
    size_t size;
    char *text = read_file(path, &size, error, error_size);
    if (text == NULL) return NULL;
    parser p = {.path = path, .error = error, .error_size = error_size};
    p.plan = calloc(1, sizeof *p.plan);
    if (p.plan == NULL) {
        free(text);
        snprintf(error, error_size, "%s:0: out of memory", path);
        return NULL;
    }
    p.c_locale = newlocale(LC_NUMERIC_MASK, "C", (locale_t)0);
    for (size_t i = 0; i < size && !p.failed;) {
        size_t length = utf8_length((const unsigned char *)text + i, size - i);
        if (length == 0) {
            p.line_number = 1;
            for (size_t j = 0; j < i; j++) p.line_number += text[j] == '\n';
            fail(&p, "not UTF-8 (byte 0x%02x)", (unsigned char)text[i]);
        }
        i += length;
    }
    /* Lines are what lies between line feeds: a file ending in '\n' has an empty last line. */
    for (char *line = text; line != NULL && !p.failed;) {
        char *newline = memchr(line, '\n', size - (size_t)(line - text));
        size_t length = newline ? (size_t)(newline - line) : size - (size_t)(line - text);
        p.line_number++;
        if (!check_characters(&p, line, length)) break;
        line[length] = '\0';
        parse_line(&p, line);
        line = newline ? newline + 1 : NULL;
    }
    if (!p.failed && !p.seen_version) {
        p.line_number = 0;
        fail(&p, "empty plan file (expected 'mucudnn-plan 1')");
    }
    for (int h = 0; h < HEADER_COUNT && !p.failed; h++)
        if (!p.seen_header[h]) fail(&p, "missing header record '%s'", header_names[h]);
    if (!p.failed) build_table(&p);
    free(text);
    free(p.slots);
    if (p.c_locale != (locale_t)0) freelocale(p.c_locale);
    if (!p.failed && (p.plan->path = copy_string(path)) == NULL) fail(&p, "out of memory");
    if (p.failed) {
        mu_plan_free(p.plan);
        return NULL;
    }
    return p.plan;
}

mu_plan_entry *mu_plan_find(const mu_plan *plan, const char *key, int n, uint64_t hash) {
    for (mu_plan_entry *entry = plan->buckets[hash & plan->bucket_mask]; entry != NULL;
         entry = entry->next_in_bucket)
        if (entry->hash == hash && entry->n == n && strcmp(entry->key, key) == 0) return entry;
    return NULL;
}

void mu_plan_pieces_text(const mu_plan_entry *entry, char *buf, size_t size) {
    size_t used = 0;
    buf[0] = '\0';
    for (int i = 0; i < entry->piece_count; i++) {
        const mu_piece *piece = &entry->pieces[i];
        char engine[32];
        if (piece->engine != NULL)
            snprintf(engine, sizeof engine, "eng%lld%s", (long long)piece->engine->global_index,
                     piece->engine->knob_count ? ".k..." : "");
        int wrote = snprintf(buf + used, size - used, "%s%d:%s:%s%s", i ? " " : "", piece->batch,
                             piece->engine ? engine : mu_algo_name(entry->dir, piece->algo),
                             mu_math_name(piece->math), piece->borrow ? ":" MU_BORROW_MARK : "");
        if (wrote < 0 || used + (size_t)wrote >= size) {
            if (size > 4) strcpy(buf + size - 4, "...");
            return;
        }
        used += (size_t)wrote;
    }
}

/* Canonical decimal: no leading zeros, "-" only before a non-zero value (mucudnn/engines.py). */
static const char *parse_decimal(const char *s, bool allow_negative, int64_t *value) {
    bool negative = allow_negative && *s == '-';
    s += negative;
    if (*s < '0' || *s > '9' || (*s == '0' && s[1] >= '0' && s[1] <= '9')) return NULL;
    unsigned long long magnitude = 0;
    for (; *s >= '0' && *s <= '9'; s++) {
        if (magnitude > (ULLONG_MAX - 9) / 10) return NULL;
        magnitude = magnitude * 10 + (unsigned)(*s - '0');
    }
    if (magnitude > (unsigned long long)INT64_MAX + negative || (negative && magnitude == 0)) return NULL;
    *value = negative ? (int64_t)(0 - magnitude) : (int64_t)magnitude;
    return s;
}

bool mu_engine_parse(const char *name, mu_engine *engine) {
    memset(engine, 0, sizeof *engine);
    if (strncmp(name, "eng", 3) != 0) return false;
    const char *s = parse_decimal(name + 3, false, &engine->global_index);
    while (s != NULL && *s != '\0') {
        int64_t type, value;
        if (strncmp(s, ".k", 2) != 0 || engine->knob_count == MU_MAX_KNOBS) return false;
        s = parse_decimal(s + 2, false, &type);
        if (s == NULL || *s != '=' || type > INT32_MAX) return false;
        if (engine->knob_count > 0 && type <= engine->knob_types[engine->knob_count - 1]) return false;
        s = parse_decimal(s + 1, true, &value);
        engine->knob_types[engine->knob_count] = (int)type;
        engine->knob_values[engine->knob_count++] = value;
    }
    return s != NULL;
}
