/*
 * mucudnn.h: the public interface of libmucudnn.so, the LD_PRELOAD shim that runs cuDNN legacy
 * convolutions as micro-batch plans (docs/shim.md).
 *
 * A process normally uses the shim without including anything: preloading the library interposes
 * the cuDNN convolution calls. These few functions are exported for tools and tests; they can be
 * reached with dlsym(RTLD_DEFAULT, "mucudnn_...") when the shim is preloaded.
 */
#ifndef MUCUDNN_H
#define MUCUDNN_H

#include <stddef.h>

#include <cudnn.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Directions, in the order of docs/kernel-key.md. */
typedef enum {
    MUCUDNN_FORWARD = 0,
    MUCUDNN_BACKWARD_DATA = 1,
    MUCUDNN_BACKWARD_FILTER = 2,
} mucudnn_direction;

/*
 * The kernel key (docs/kernel-key.md) of a convolution given by its descriptors, in forward terms:
 * x describes x (fwd, bwd_filter) or dx (bwd_data), y describes y or dy, w describes w or dw.
 * On success writes the NUL-terminated key into buf, the batch size into *n and returns 0.
 * When the descriptors have no key, writes the reason into buf and returns -1; -2 when buf is
 * too small.
 */
int mucudnn_kernel_key(mucudnn_direction direction, cudnnTensorDescriptor_t x,
                       cudnnFilterDescriptor_t w, cudnnConvolutionDescriptor_t conv,
                       cudnnTensorDescriptor_t y, char *buf, size_t size, int *n);

/* The shim's version string, e.g. "0.1.0". */
const char *mucudnn_version(void);

/*
 * The framework's caching allocator on the calling thread's current device: the bytes it holds
 * from the driver (*reserved) and of them the bytes in use (*allocated); returns 0, or nonzero
 * when it cannot say. The rest of what it holds is free to the framework's next allocations.
 * Called when the shim reads the room (docs/shim.md, "The room") and the device's view is too
 * small for the workspace at hand, from any thread inside a cuDNN call; it must not call cuDNN.
 * NULL (the default) unregisters: the room then sees the device alone.
 */
typedef int (*mucudnn_allocator_fn)(size_t *reserved, size_t *allocated);
void mucudnn_set_allocator(mucudnn_allocator_fn fn);

/*
 * Lends the convolutions this thread runs next on `stream` a device buffer of `bytes` for their
 * workspace, until the next call: a convolution whose engine online tuning holds under its
 * workspace (MUCUDNN_WORKSPACE_HOLD) then runs its front's fastest point within the buffer, where
 * that is 2 % faster than its held point (docs/shim.md, "Lent workspace"). One lend at a time, the
 * process's: a call replaces the last, and (NULL, 0) withdraws it. The buffer must stay allocated
 * until withdrawn by the same thread; work enqueued on `stream` before it is freed may use it.
 * Returns 0.
 */
int mucudnn_lend_workspace(void *ptr, size_t bytes, cudaStream_t stream);

/* The largest workspace of an engine that online tuning has held under it so far (0: none): a
 * lend of that much gives every held convolution at least the workspace its engine asked for. */
size_t mucudnn_held_workspace(void);

/* How many convolution calls ran in lent workspace so far. */
size_t mucudnn_lent_calls(void);

#ifdef __cplusplus
}
#endif

#endif /* MUCUDNN_H */
