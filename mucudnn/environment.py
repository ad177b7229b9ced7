"""Where measurements are valid (:class:`Environment`), whether a GPU is here, and where the
installed wheels are (:func:`package_dirs`).

Imported by CPU-only tuning, so CuPy and the benchmarker are imported only inside the functions
that need a GPU, never at module import."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

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


def package_dirs(name: str) -> list[Path]:
    """Directories of an installed (possibly namespace) package, without importing it: the one
    search of the wheel directories (``nvidia`` for the CUDA and cuDNN wheels, ``torch``)."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return []
    if spec is None:
        return []
    return [Path(p) for p in (spec.submodule_search_locations or [])]
