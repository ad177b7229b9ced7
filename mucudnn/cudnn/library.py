"""Finding the cuDNN library users already have.

Order: ``$MUCUDNN_CUDNN_LIBRARY`` (a path); the cuDNN that PyTorch uses (the ``nvidia-cudnn-cu13``/
``-cu12`` wheel beside it, or a copy inside ``torch/lib``); any ``nvidia-cudnn`` wheel on ``sys.path``;
the system loader (``libcudnn.so.9``). mucudnn never installs a cuDNN of its own.
"""

from __future__ import annotations

import ctypes
import glob
import os
import sys
from pathlib import Path

from ..wheels import package_dirs as _package_dirs
from ..errors import LibraryNotFoundError

ENV_OVERRIDE = "MUCUDNN_CUDNN_LIBRARY"
SONAME = "libcudnn.so.9"


def candidates() -> list[tuple[str, Path]]:
    """(where it came from, path) for each place cuDNN may be, in the order they are tried."""
    found: list[tuple[str, Path]] = []
    override = os.environ.get(ENV_OVERRIDE)
    if override:
        found.append((f"${ENV_OVERRIDE}", Path(override)))
    torch_loaded = "torch" in sys.modules
    for torch_dir in _package_dirs("torch"):
        site = torch_dir.parent
        for lib in sorted(glob.glob(str(torch_dir / "lib" / "libcudnn.so*"))):
            found.append(("torch/lib", Path(lib)))
        for sub in ("nvidia/cudnn/lib", "nvidia/cu13/lib", "nvidia/cu12/lib"):
            lib = site / sub / SONAME
            if lib.exists():
                found.append((f"PyTorch's {sub.split('/')[1]} wheel" if not torch_loaded
                              else "loaded PyTorch's wheel", lib))
    for nvidia_dir in _package_dirs("nvidia"):
        lib = nvidia_dir / "cudnn" / "lib" / SONAME
        if lib.exists():
            found.append(("nvidia-cudnn wheel", lib))
    found.append(("system loader", Path(SONAME)))
    seen: set[str] = set()
    unique = []
    for origin, path in found:
        if str(path) not in seen:
            seen.add(str(path))
            unique.append((origin, path))
    return unique


def load_cudnn() -> tuple[ctypes.CDLL, str]:
    """Load cuDNN 9; returns (library, path). :class:`LibraryNotFoundError` lists what was tried."""
    errors = []
    for origin, path in candidates():
        if origin.startswith("$") and not path.exists():
            raise LibraryNotFoundError(f"${ENV_OVERRIDE}={path}: no such file")
        try:
            # RTLD_GLOBAL: cuDNN's dispatcher dlopens its sub-libraries, which need its symbols.
            lib = ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
        except OSError as exc:
            errors.append(f"{origin} ({path}): {exc}")
            continue
        return lib, str(path)
    raise LibraryNotFoundError(
        "no cuDNN 9 library found; install PyTorch (CUDA build) or nvidia-cudnn-cu13, or set "
        f"${ENV_OVERRIDE} to libcudnn.so.9. Tried:\n  " + "\n  ".join(errors)
    )
