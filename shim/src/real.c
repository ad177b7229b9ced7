/*
 * real.c: the real cuDNN functions, all in one table resolved once with dlsym(RTLD_NEXT)
 * (libfaketime style), and the thread-local recursion guard.
 */
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>

#include "internal.h"

static mu_real_table real_table;
static pthread_once_t real_once = PTHREAD_ONCE_INIT;

/* dlsym calls nothing of cuDNN, so this cannot re-enter; mu_config(), which can, runs inside
 * the recursion guard. */
static void resolve_real_functions(void) {
#define MU_RESOLVE_REAL(name) real_table.name = (__typeof__(name) *)dlsym(RTLD_NEXT, #name);
    MU_REAL_FUNCTIONS(MU_RESOLVE_REAL)
#undef MU_RESOLVE_REAL
}

const mu_real_table *mu_real(void) {
    pthread_once(&real_once, resolve_real_functions);
    return &real_table;
}

static _Thread_local bool inside_shim;

bool mu_guard_enter(void) {
    if (inside_shim) return false;
    inside_shim = true;
    return true;
}

void mu_guard_leave(void) { inside_shim = false; }

const char *mu_status_text(cudnnStatus_t status) {
    const mu_real_table *real = mu_real();
    if (real->cudnnGetErrorString != NULL) return real->cudnnGetErrorString(status);
    static _Thread_local char text[32];
    snprintf(text, sizeof text, "status %d", (int)status);
    return text;
}

MU_EXPORT const char *mucudnn_version(void) { return MUCUDNN_VERSION_STRING; }

bool mu_real_missing(const void *function, const char *name) {
    if (function != NULL) return false;
    static mu_rate_limit limit = MU_RATE_LIMIT_INIT;
    mu_log_limited(&limit, MU_LOG_ERROR, "the real %s was not found (is libcudnn loaded?)", name);
    return true;
}
