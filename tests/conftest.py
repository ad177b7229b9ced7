"""Shared test set-up: GPU tests (marked ``gpu``) are skipped cleanly where no GPU is present."""

from __future__ import annotations

import pytest
from hypothesis import settings

# CI machines are small and shared: property tests are bounded by example counts, not wall time.
settings.register_profile("mucudnn", deadline=None)
settings.load_profile("mucudnn")


def _gpu_reason() -> str | None:
    try:
        from mucudnn.bench import gpu_available
        from mucudnn.cudnn import get
    except Exception as exc:  # pragma: no cover - import problems are reported by other tests
        return f"mucudnn does not import: {exc}"
    if not gpu_available():
        return "no CUDA GPU (or no CuPy) here"
    try:
        get()
    except Exception as exc:
        return f"no usable cuDNN: {exc}"
    return None


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if not gpu_items:
        return
    reason = _gpu_reason()
    if reason:
        marker = pytest.mark.skip(reason=reason)
        for item in gpu_items:
            item.add_marker(marker)


@pytest.fixture(scope="module")
def gpu():
    """(cupy, cudnn, stream, handle) for GPU tests: one blocking stream, current for CuPy too."""
    import cupy

    from mucudnn.cudnn import get
    stream = cupy.cuda.Stream()
    stream.use()  # CuPy's fills run in order with cuDNN's work
    cudnn = get()
    return cupy, cudnn, stream, cudnn.handle(stream.ptr)
