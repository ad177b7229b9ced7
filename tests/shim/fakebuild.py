"""Build the cuDNN test double (``tests/shim/fake_cudnn``) for tests that need cuDNN but no GPU.

``build_fake_cudnn(out_dir)`` compiles ``libcudnn.so.9`` and the fake driver ``libcuda.so.1`` into
``out_dir`` and returns the path of ``libcudnn.so.9``; put its directory on ``LD_LIBRARY_PATH`` (or
load it with ctypes) and cuDNN resolves to the double. ``fake_cudnn_or_skip`` does the same inside a
pytest test or fixture, skipping the test when no C compiler, ``make`` or header set is available::

    @pytest.fixture(scope="session")
    def fake_cudnn(tmp_path_factory):
        return fake_cudnn_or_skip(tmp_path_factory.mktemp("fake_cudnn"))

What the double does (workspace model, call log format, environment variables) is documented in
``tests/shim/fake_cudnn/README.md``.
"""

from __future__ import annotations

import os
import shutil
import subprocess

from pathlib import Path

FAKE_CUDNN_SOURCE_DIR = Path(__file__).resolve().parent / "fake_cudnn"
LIBRARY_NAME = "libcudnn.so.9"
DRIVER_NAME = "libcuda.so.1"


class FakeCudnnUnavailable(RuntimeError):
    """A prerequisite of the build (compiler, make, headers) is missing: skip, do not fail."""


class FakeCudnnBuildError(RuntimeError):
    """The prerequisites are there but the build failed: a real error in the double."""


def find_cudnn_include() -> Path | None:
    """Where ``cudnn.h`` is, found as the shim's own build finds it (``mucudnn.shimlib``)."""
    from mucudnn.errors import MucudnnError
    from mucudnn.shimlib import find_cudnn_include as find
    try:
        return find()
    except MucudnnError:
        return None


def find_cuda_include() -> Path | None:
    """Where ``cuda_runtime_api.h`` is (the fake driver also needs ``cuda.h`` beside it)."""
    from mucudnn.errors import MucudnnError
    from mucudnn.shimlib import find_cuda_include as find
    try:
        found = find()
    except MucudnnError:
        return None
    return found if (found / "cuda.h").is_file() else None


def find_c_compiler() -> str | None:
    """``$CC`` if set and found, else the first of cc, gcc, clang on PATH."""
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def missing_prerequisite() -> str | None:
    """Why the double cannot be built here, or None when it can."""
    if find_c_compiler() is None:
        return "no C compiler ($CC, cc, gcc or clang) on PATH"
    if shutil.which("make") is None:
        return "no make on PATH"
    if find_cudnn_include() is None:
        return ("no cuDNN headers (cudnn.h): set MUCUDNN_CUDNN_INCLUDE or install "
                "nvidia-cudnn-cu13 (see mucudnn.shimlib.find_cudnn_include)")
    if find_cuda_include() is None:
        return ("no CUDA headers (cuda_runtime_api.h, cuda.h): set CUDA_HOME "
                "(see mucudnn.shimlib.find_cuda_include)")
    return None


def build_fake_cudnn(out_dir: str | os.PathLike[str]) -> Path:
    """Compile the double into ``out_dir``; return the path of ``out_dir/libcudnn.so.9``.

    ``out_dir`` also receives ``libcuda.so.1`` and the unversioned links ``libcudnn.so`` and
    ``libcuda.so``. Raises ``FakeCudnnUnavailable`` when a prerequisite is missing and
    ``FakeCudnnBuildError`` (with the compiler output) when the build fails.
    """
    reason = missing_prerequisite()
    if reason is not None:
        raise FakeCudnnUnavailable(f"cannot build the fake cuDNN: {reason}")
    out = Path(out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    command = [
        "make", "-s", "-C", str(FAKE_CUDNN_SOURCE_DIR),
        f"CC={find_c_compiler()}",
        f"CUDNN_INCLUDE={find_cudnn_include()}",
        f"CUDA_INCLUDE={find_cuda_include()}",
        f"OUT={out}",
    ]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    library = out / LIBRARY_NAME
    if result.returncode != 0 or not library.is_file():
        raise FakeCudnnBuildError(
            f"building the fake cuDNN in {out} failed (exit {result.returncode}):\n"
            f"$ {' '.join(command)}\n{result.stdout}{result.stderr}")
    return library


def fake_cudnn_or_skip(out_dir: str | os.PathLike[str]) -> Path:
    """``build_fake_cudnn`` for pytest: skips the calling test when a prerequisite is missing."""
    import pytest

    try:
        return build_fake_cudnn(out_dir)
    except FakeCudnnUnavailable as missing:
        pytest.skip(str(missing))
