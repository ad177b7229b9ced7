"""Where measurements are valid (:class:`Environment`) and which GPUs are here (:func:`visible_gpus`,
the one enumeration).

Imported by CPU-only tuning, so CuPy and the benchmarker are imported only inside the functions
that need a GPU, never at module import."""

from __future__ import annotations

import ctypes
import dataclasses
import os

from . import errors


@dataclasses.dataclass(frozen=True)
class Environment:
    """Where measurements are valid: the GPU model and the cuDNN version."""

    gpu: str
    cudnn: int


def cupy_module():
    """CuPy, or :class:`~mucudnn.errors.LibraryNotFoundError` saying how to install it."""
    try:
        import cupy
    except ImportError:
        raise errors.LibraryNotFoundError(
            "CuPy is needed to benchmark on the GPU: pip install 'mucudnn[gpu]' (cupy-cuda13x)"
        ) from None
    return cupy


def current_environment() -> Environment:
    """The GPU of the current CUDA device and the loaded cuDNN (raises if there is none)."""
    from .cudnn import get
    cupy = cupy_module()
    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
    return Environment(_text(props["name"]), get().version)


@dataclasses.dataclass(frozen=True)
class Gpu:
    """One GPU this process sees: its ordinal here (CuPy's and the driver's, which are the same),
    what ``CUDA_VISIBLE_DEVICES`` calls it (for a child process that is to see it alone), its model
    name and its memory in bytes (None where it could not be read)."""

    index: int
    visible_as: str
    name: str
    memory: int | None = None


def visible_gpus() -> list[Gpu] | None:
    """The GPUs this process sees, in device order (``CUDA_VISIBLE_DEVICES`` applies); None where
    nothing can tell (neither a working CuPy nor a CUDA driver library).

    Through CuPy where it works: that is the view the benchmarker measures with (and the one
    tests/fakecupy fakes). Otherwise through ``libcuda.so.1``, without creating a context: so a
    machine without CuPy (``mucudnn run --memory-budget``, CPU-only tuning) still sees its GPUs."""
    gpus = _cupy_gpus()
    return gpus if gpus is not None else _driver_gpus()


def gpu_available() -> bool:
    """Whether CuPy sees a GPU: whether this process can benchmark."""
    return bool(_cupy_gpus())


def _visible_as(index: int) -> str:
    """What ``CUDA_VISIBLE_DEVICES`` calls this process's GPU ``index`` (its number where unset)."""
    if "CUDA_VISIBLE_DEVICES" not in os.environ:
        return str(index)
    listed = [entry.strip() for entry in os.environ["CUDA_VISIBLE_DEVICES"].split(",")
              if entry.strip()]
    return listed[index] if index < len(listed) else str(index)


def _text(name) -> str:
    return name.decode(errors="replace") if isinstance(name, bytes) else str(name)


def _cupy_gpus() -> list[Gpu] | None:
    """The GPUs CuPy sees; None without CuPy, a driver or a device (CuPy raises for each)."""
    try:
        cupy = cupy_module()
        runtime = cupy.cuda.runtime
        gpus = []
        for index in range(runtime.getDeviceCount()):
            props = runtime.getDeviceProperties(index)
            gpus.append(Gpu(index, _visible_as(index), _text(props["name"]),
                            props.get("totalGlobalMem")))
        return gpus
    except Exception:  # no CuPy, no driver, no device: CuPy cannot tell
        return None


def _driver_gpus() -> list[Gpu] | None:
    """The GPUs ``libcuda.so.1`` lists ([] where it lists none); None without that library. A
    device whose name cannot be read is left out; its memory is None where the driver cannot say."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    try:
        count = ctypes.c_int()
        if cuda.cuInit(0) or cuda.cuDeviceGetCount(ctypes.byref(count)):
            return []
        total_memory = getattr(cuda, "cuDeviceTotalMem_v2", None)
        gpus = []
        for index in range(count.value):
            device, total = ctypes.c_int(), ctypes.c_size_t()
            name = ctypes.create_string_buffer(256)
            if cuda.cuDeviceGet(ctypes.byref(device), index) or \
                    cuda.cuDeviceGetName(name, len(name), device):
                continue
            known = total_memory is not None and not total_memory(ctypes.byref(total), device)
            gpus.append(Gpu(index, _visible_as(index), _text(name.value),
                            total.value if known else None))
        return gpus
    except AttributeError:  # a driver library without these entry points
        return None

