"""Where measurements are valid (:class:`Environment`) and whether a GPU is here.

Imported by CPU-only tuning, so CuPy and the benchmarker are imported only inside the functions
that need a GPU, never at module import."""

from __future__ import annotations

import dataclasses

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
    name = props["name"]
    return Environment(name.decode() if isinstance(name, bytes) else str(name), get().version)


def gpu_available() -> bool:
    try:
        cupy = cupy_module()
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no CuPy, no driver, no device: all mean "no GPU here"
        return False
