/*
 * local_scope_main: loads liblocaluser.so the way Python imports torch's extension, then runs it.
 *
 *   local_scope_main LIB n=4 c=3 h=5 w=5 k=2 f=3 algo=0 ws=BYTES seed=1
 *
 * Not linked to cuDNN: LIB is opened with dlopen(RTLD_NOW | RTLD_LOCAL), which brings
 * libcudnn.so.9 in as LIB's dependency, in LIB's local scope. Prints one line (fields as in
 * conv_driver's output; y is every output value in C99 hex-float notation, exact):
 *
 *   case 0 op=local_forward cudnn_loaded=1 cudnn_global=0 setup=S get_v7=S returned=R
 *          first_algo=A first_status=S first_memory=BYTES forward=S y=V,V,...
 *
 * cudnn_global says whether a cuDNN-only symbol (cudnnCreate) is visible in the global scope:
 * 0 is the situation this program exists to reproduce.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "local_scope_user.h"

static void die(const char *what, const char *detail) {
    fprintf(stderr, "local_scope_main: %s%s%s\n", what, detail ? ": " : "", detail ? detail : "");
    exit(2);
}

static void parse_argument(const char *argument, local_conv_request *r) {
    const char *value = strchr(argument, '=');
    if (value == NULL) die("argument without '='", argument);
    size_t length = (size_t)(value++ - argument);
#define IS(name) (length == strlen(name) && strncmp(argument, name, length) == 0)
    if (IS("n")) r->n = atoi(value);
    else if (IS("c")) r->c = atoi(value);
    else if (IS("h")) r->h = atoi(value);
    else if (IS("w")) r->w = atoi(value);
    else if (IS("k")) r->k = atoi(value);
    else if (IS("f")) r->filter = atoi(value);
    else if (IS("algo")) r->algo = atoi(value);
    else if (IS("ws")) r->workspace_bytes = strtoull(value, NULL, 10);
    else if (IS("seed")) r->seed = (unsigned)strtoul(value, NULL, 10);
    else die("unknown argument", argument);
#undef IS
}

static void print_result(const local_conv_result *result, const float *y, size_t y_count) {
    void *cudnn = dlopen("libcudnn.so.9", RTLD_LAZY | RTLD_NOLOAD);
    printf("case 0 op=local_forward cudnn_loaded=%d cudnn_global=%d setup=%d get_v7=%d returned=%d "
           "first_algo=%d first_status=%d first_memory=%zu forward=%d y=",
           cudnn != NULL, dlsym(RTLD_DEFAULT, "cudnnCreate") != NULL, result->setup_status,
           result->get_v7_status, result->returned, result->first_algo, result->first_status,
           result->first_memory, result->forward_status);
    for (size_t i = 0; i < y_count; i++) printf("%s%a", i ? "," : "", (double)y[i]);
    putchar('\n');
    if (cudnn != NULL) dlclose(cudnn);
}

int main(int argc, char **argv) {
    if (argc < 2) die("usage: local_scope_main LIB name=value...", NULL);
    local_conv_request request = {.n = 4, .c = 3, .h = 5, .w = 5, .k = 2, .filter = 3, .seed = 1};
    for (int i = 2; i < argc; i++) parse_argument(argv[i], &request);

    void *library = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
    if (library == NULL) die("cannot load the library", dlerror());
    local_conv_fn *convolve = (local_conv_fn *)dlsym(library, LOCAL_CONV_SYMBOL);
    if (convolve == NULL) die("the library lacks " LOCAL_CONV_SYMBOL, dlerror());

    size_t y_count = (size_t)request.n * request.k * request.h * request.w;
    float *y = calloc(y_count ? y_count : 1, sizeof *y);
    if (y == NULL) die("out of memory", NULL);
    local_conv_result result;
    if (convolve(&request, y, &result) != 0) die("malformed request or out of memory", NULL);
    print_result(&result, y, y_count);
    free(y);
    return 0;
}
