/*
 * local_scope_user.h: the interface of liblocaluser.so (local_scope_lib.c), shared with its
 * loader local_scope_main.c. Plain C types only: the loader must not need cuDNN's headers or
 * library, as a Python interpreter does not before it imports torch.
 */
#ifndef LOCAL_SCOPE_USER_H
#define LOCAL_SCOPE_USER_H

#include <stddef.h>

/* One float NCHW forward convolution: square filter, padding filter / 2, stride 1, so y is
 * n x k x h x w (filter odd). */
typedef struct {
    int n, c, h, w, k, filter;
    int algo;               /* cudnnConvolutionFwdAlgo_t passed to cudnnConvolutionForward */
    size_t workspace_bytes; /* the workspace handed to cudnnConvolutionForward */
    unsigned seed;          /* of the random x and w, reals in [-1, 1) */
} local_conv_request;

/* Statuses are cudnnStatus_t values (0 = success). */
typedef struct {
    int setup_status;       /* the first failing handle/descriptor call, else 0 */
    int get_v7_status;      /* cudnnGetConvolutionForwardAlgorithm_v7 (all algorithms requested) */
    int returned;           /* its *returnedAlgoCount */
    int first_algo, first_status;
    size_t first_memory;    /* its first perf result */
    int forward_status;     /* cudnnConvolutionForward */
} local_conv_result;

#define LOCAL_CONV_SYMBOL "local_user_convolve"

/* Runs the request; writes y (n*k*h*w floats, caller-owned) and *result. Returns 0, or -1 when
 * the request is malformed or memory ran out (then *result is not meaningful). */
typedef int local_conv_fn(const local_conv_request *request, float *y, local_conv_result *result);

#endif
