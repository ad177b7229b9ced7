/*
 * Convolutions on a capturing stream: handed to the fake driver (fake_cuda_driver.c), which runs
 * them when the captured graph is launched, as a GPU runs captured kernels.
 */
#define _GNU_SOURCE

#include "fake_internal.h"

#include <dlfcn.h>
#include <pthread.h>

typedef int (*defer_fn)(void *stream, void (*run)(void *), const void *argument, size_t size);

typedef void (*advance_fn)(double ms);

static defer_fn driver_defer;
static advance_fn driver_advance;
static pthread_once_t lookup_once = PTHREAD_ONCE_INIT;

/* The driver is the one already in the process (the shim loads it); never loaded here. */
static void lookup(void)
{
    void *driver = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_NOLOAD);
    if (driver != NULL)
    {
        *(void **)&driver_defer = dlsym(driver, "fake_cuda_defer");
        *(void **)&driver_advance = dlsym(driver, "fake_cuda_advance_ms");
    }
}

bool fake_defer(cudaStream_t stream, void (*run)(void *), const void *argument, size_t size)
{
    pthread_once(&lookup_once, lookup);
    return driver_defer != NULL && driver_defer((void *)stream, run, argument, size) == 1;
}

void fake_advance_clock(double ms)
{
    pthread_once(&lookup_once, lookup);
    if (driver_advance != NULL)
        driver_advance(ms);
}
