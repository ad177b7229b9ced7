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

/* The loaded cuDNN, for symbols RTLD_NEXT cannot see: PyTorch's import loads libcudnn into a
 * local (RTLD_LOCAL) scope, outside the global scope that RTLD_NEXT searches from an LD_PRELOADed
 * library. RTLD_NOLOAD only finds a library already in the process (by soname), so this never
 * loads a second cuDNN. */
static void *loaded_cudnn(void) {
    const char *names[] = {"libcudnn.so.9", "libcudnn.so"};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        void *handle = dlopen(names[i], RTLD_LAZY | RTLD_NOLOAD);
        if (handle != NULL) return handle;
    }
    return NULL;
}

/* dlsym calls nothing of cuDNN, so this cannot re-enter; mu_config(), which can, runs inside
 * the recursion guard. */
static void resolve_real_functions(void) {
    void *cudnn = NULL;
    bool looked_up = false;
#define MU_RESOLVE_REAL(name)                                                   \
    real_table.name = (__typeof__(name) *)dlsym(RTLD_NEXT, #name);              \
    if (real_table.name == NULL) {                                              \
        if (!looked_up) cudnn = loaded_cudnn(), looked_up = true;               \
        if (cudnn != NULL) real_table.name = (__typeof__(name) *)dlsym(cudnn, #name); \
    }
    MU_REAL_FUNCTIONS(MU_RESOLVE_REAL)
#undef MU_RESOLVE_REAL
}

bool mu_real_has(const char *name) {
    if (dlsym(RTLD_NEXT, name) != NULL) return true;
    void *cudnn = loaded_cudnn();
    return cudnn != NULL && dlsym(cudnn, name) != NULL;
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
