/*
 * A fake CUDA driver (libcuda.so.1) with the few calls the mucudnn shim uses to learn which GPU
 * it runs on: one device, ordinal 0, named "mucudnn fake GPU" or $FAKE_CUDNN_GPU_NAME.
 * Prototypes come from the CUDA toolkit's cuda.h so they cannot drift from the real driver.
 */
#define _POSIX_C_SOURCE 200809L

#include <cuda.h>

#include <stdlib.h>
#include <string.h>

static const char DEFAULT_GPU_NAME[] = "mucudnn fake GPU";
enum { FAKE_DRIVER_VERSION = 13000 };

static const char *gpu_name(void)
{
    const char *name = getenv("FAKE_CUDNN_GPU_NAME");
    return name != NULL && name[0] != '\0' ? name : DEFAULT_GPU_NAME;
}

CUresult cuInit(unsigned int Flags)
{
    return Flags == 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

CUresult cuDriverGetVersion(int *driverVersion)
{
    if (driverVersion == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    *driverVersion = FAKE_DRIVER_VERSION;
    return CUDA_SUCCESS;
}

CUresult cuDeviceGetCount(int *count)
{
    if (count == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    *count = 1;
    return CUDA_SUCCESS;
}

CUresult cuDeviceGet(CUdevice *device, int ordinal)
{
    if (device == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    if (ordinal != 0)
        return CUDA_ERROR_INVALID_DEVICE;
    *device = 0;
    return CUDA_SUCCESS;
}

CUresult cuCtxGetDevice(CUdevice *device)
{
    if (device == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    *device = 0; /* as if the primary context of device 0 were current */
    return CUDA_SUCCESS;
}

CUresult cuDeviceGetName(char *name, int len, CUdevice dev)
{
    if (name == NULL || len <= 0)
        return CUDA_ERROR_INVALID_VALUE;
    if (dev != 0)
        return CUDA_ERROR_INVALID_DEVICE;
    /* Like the driver: truncate to len - 1 characters, always terminate. */
    size_t capacity = (size_t)len - 1;
    size_t length = strlen(gpu_name());
    size_t copied = length < capacity ? length : capacity;
    memcpy(name, gpu_name(), copied);
    name[copied] = '\0';
    return CUDA_SUCCESS;
}

CUresult cuGetErrorString(CUresult error, const char **pStr)
{
    if (pStr == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    switch (error) {
    case CUDA_SUCCESS:
        *pStr = "no error";
        return CUDA_SUCCESS;
    case CUDA_ERROR_INVALID_VALUE:
        *pStr = "invalid argument";
        return CUDA_SUCCESS;
    case CUDA_ERROR_INVALID_DEVICE:
        *pStr = "invalid device ordinal";
        return CUDA_SUCCESS;
    default:
        *pStr = NULL;
        return CUDA_ERROR_INVALID_VALUE;
    }
}
