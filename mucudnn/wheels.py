"""Where installed wheels lie, without importing them: the one search of the wheel directories
(``nvidia`` for the CUDA and cuDNN wheels, ``torch``), which the shim's header search
(:mod:`mucudnn.shimlib`) and the cuDNN library search (:mod:`mucudnn.cudnn.library`) share.
Imports nothing of mucudnn (both sides import it: no circle)."""

from __future__ import annotations

import importlib.util
from pathlib import Path


def package_dirs(name: str) -> list[Path]:
    """Directories of an installed (possibly namespace) package, without importing it."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return []
    if spec is None:
        return []
    return [Path(p) for p in (spec.submodule_search_locations or [])]
