"""Build and locate ``libmucudnn.so``, the LD_PRELOAD shim (docs/shim.md).

The shim is C compiled against the cuDNN headers (it links nothing of cuDNN: the real functions are
found with ``dlsym`` at run time). :func:`build_shim` compiles it once per distinct set of sources
and headers into a cache directory by running shim/Makefile (the one copy of the build flags);
:func:`shim_path` returns the built library.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
import zipfile
from pathlib import Path

from ._version import __version__
from .wheels import package_dirs
from .errors import LibraryNotFoundError, MucudnnError, UnwritableError
from .settings import user_cache_dir

# mucudnn/shim_src links to the checkout's shim/ and is copied into wheels, so an installed
# package carries the sources it builds the shim from.
SHIM_SOURCE_DIR = Path(__file__).resolve().parent / "shim_src"
LIBRARY_NAME = "libmucudnn.so"

#: The wheel whose headers ``scripts/test.sh`` unpacks where no cuDNN headers are installed: the
#: cuDNN of the shipped measurements (benchmarks/results/README.md), pinned so every checkout
#: builds against the same headers.
CUDNN_HEADERS_WHEEL = "nvidia-cudnn-cu13==9.19.0.56"
_WHEEL_INCLUDE = "nvidia/cudnn/include/"


def cudnn_headers_cache() -> Path:
    """Where :func:`unpack_cudnn_headers` puts the pinned wheel's headers, one directory per
    version, in the user's cache (so every checkout and command finds them)."""
    version = CUDNN_HEADERS_WHEEL.partition("==")[2]
    return user_cache_dir() / f"cudnn-headers-{version}" / "include"


def unpack_cudnn_headers(wheel: str | os.PathLike, dest: str | os.PathLike | None = None) -> Path:
    """Extract only the ``nvidia/cudnn/include/*.h`` files of an ``nvidia-cudnn`` wheel into
    ``dest`` (default :func:`cudnn_headers_cache`) and return it. The headers land in a scratch
    directory first and are renamed into place, so a reader never sees half of them."""
    dest = Path(dest) if dest is not None else cudnn_headers_cache()
    dest.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(dir=dest.parent, prefix=".unpack-"))
    try:
        try:
            with zipfile.ZipFile(wheel) as archive:
                names = [n for n in archive.namelist() if n.startswith(_WHEEL_INCLUDE)
                         and n.endswith(".h") and "/" not in n[len(_WHEEL_INCLUDE):]]
                if _WHEEL_INCLUDE + "cudnn.h" not in names:
                    raise MucudnnError(f"{wheel}: no {_WHEEL_INCLUDE}cudnn.h in it")
                for name in names:
                    (scratch / Path(name).name).write_bytes(archive.read(name))
        except (OSError, zipfile.BadZipFile) as exc:
            raise MucudnnError(f"{wheel}: cannot unpack cuDNN headers: {exc}") from None
        scratch.chmod(0o755)
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(scratch, dest)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return dest


def _nvidia_wheel_dirs(*parts: str) -> list[Path]:
    """``nvidia/<parts>`` in every search path of the ``nvidia`` namespace package (the CUDA wheels)."""
    return [location.joinpath(*parts) for location in package_dirs("nvidia")]


def find_cudnn_include() -> Path:
    """The directory holding ``cudnn.h``.

    Order: ``$MUCUDNN_CUDNN_INCLUDE``; the ``nvidia/cudnn/include`` of an installed
    ``nvidia-cudnn-cu13``/``-cu12`` wheel (PyTorch's cuDNN); ``/usr/include``;
    ``/usr/local/cuda/include``; last the headers ``scripts/test.sh`` unpacks into the user's
    cache (:func:`cudnn_headers_cache`), which match no installed library and so come after every
    installed cuDNN. Raises :class:`LibraryNotFoundError` naming the places tried.
    """
    candidates = []
    if os.environ.get("MUCUDNN_CUDNN_INCLUDE"):
        candidates.append(Path(os.environ["MUCUDNN_CUDNN_INCLUDE"]))
    candidates += _nvidia_wheel_dirs("cudnn", "include")
    candidates += [Path("/usr/include"), Path("/usr/local/cuda/include"), cudnn_headers_cache()]
    return _first_with(candidates, "cudnn.h", "set MUCUDNN_CUDNN_INCLUDE, install "
                       "nvidia-cudnn-cu13, or run bash scripts/quickstart.sh (it fetches the "
                       "headers)")


def find_cuda_include() -> Path:
    """The directory holding ``cuda_runtime_api.h`` (``cudnn_graph.h`` includes it).

    Order: ``$CUDA_HOME/include``, ``/usr/local/cuda/include``, the ``nvidia/cuda_runtime/include``
    wheel directory, ``/usr/include``.
    """
    candidates = []
    if os.environ.get("CUDA_HOME"):
        candidates.append(Path(os.environ["CUDA_HOME"]) / "include")
    candidates.append(Path("/usr/local/cuda/include"))
    candidates += _nvidia_wheel_dirs("cuda_runtime", "include")
    candidates.append(Path("/usr/include"))
    return _first_with(candidates, "cuda_runtime_api.h",
                       "set CUDA_HOME or install nvidia-cuda-runtime-cu13")


def _first_with(candidates: list[Path], header: str, hint: str) -> Path:
    for directory in candidates:
        if (directory / header).is_file():
            return directory
    tried = ", ".join(str(c) for c in candidates) or "(nowhere)"
    raise LibraryNotFoundError(f"{header} not found (tried {tried}); {hint}")


def find_compiler() -> str:
    """A C compiler: ``$CC``, else ``cc``, ``gcc`` or ``clang`` on PATH."""
    names = [os.environ["CC"]] if os.environ.get("CC") else ["cc", "gcc", "clang"]
    for name in names:
        path = shutil.which(name)
        if path:
            return path
    raise MucudnnError(f"no C compiler found (tried {', '.join(names)}); install gcc or set CC")


def _source_files() -> list[Path]:
    """The shim's C sources and headers and its Makefile; a package without them (an install or
    a copy that left out the ``shim_src`` link's target) is one error naming the directory."""
    sources = sorted(SHIM_SOURCE_DIR.glob("src/*.[ch]"))
    makefile = SHIM_SOURCE_DIR / "Makefile"
    if not any(path.suffix == ".c" for path in sources) or not makefile.is_file():
        raise MucudnnError(f"shim sources not found in {SHIM_SOURCE_DIR} (its src/*.c and "
                           "Makefile): reinstall mucudnn")
    return sources + sorted(SHIM_SOURCE_DIR.glob("include/*.h")) + [makefile]


def _build_hash(cudnn_include: Path, cuda_include: Path, compiler: str) -> str:
    """Hash of the sources, the Makefile, the version, the cuDNN headers and the compiler: a new
    build when any changes."""
    digest = hashlib.sha256(compiler.encode())
    digest.update(__version__.encode())
    for path in _source_files() + sorted(cudnn_include.glob("cudnn*.h")):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    digest.update(str(cuda_include).encode())
    return digest.hexdigest()[:16]


def _cache_root() -> Path:
    if os.environ.get("MUCUDNN_SHIM_DIR"):
        return Path(os.environ["MUCUDNN_SHIM_DIR"])
    return user_cache_dir() / "shim"


def find_make() -> str:
    """``make`` on PATH (the shim is built by shim/Makefile, the one copy of its build flags)."""
    path = shutil.which("make")
    if path is None:
        raise MucudnnError("no 'make' found on PATH; install make (it runs the shim's Makefile)")
    return path


def build_shim(out_dir: str | os.PathLike | None = None, force: bool = False) -> Path:
    """Build the shim with its Makefile and return the path of ``libmucudnn.so``.

    Runs ``make -C <shim sources> CUDNN_INCLUDE=… CUDA_INCLUDE=… CC=… VERSION=… OUT=<scratch>``.
    ``out_dir`` defaults to ``<cache>/<hash>/`` where the cache is ``$MUCUDNN_SHIM_DIR`` or
    ``~/.cache/mucudnn/shim``; an existing build there is reused unless ``force``. Raises
    :class:`LibraryNotFoundError` when the headers are missing and :class:`MucudnnError` when no
    compiler or make is found or the build fails (the message carries the compiler's output).
    """
    compiler = find_compiler()
    make = find_make()
    cudnn_include, cuda_include = find_cudnn_include(), find_cuda_include()
    target_dir = (Path(out_dir) if out_dir is not None
                  else _cache_root() / _build_hash(cudnn_include, cuda_include, compiler))
    library = target_dir / LIBRARY_NAME
    if library.is_file() and not force:
        return library
    # Build beside the target and rename, so concurrent builders never see a half-written file.
    try:
        target_dir.mkdir(parents=True, exist_ok=True)
        scratch_dir = tempfile.TemporaryDirectory(dir=target_dir, prefix=".build-")
    except OSError as exc:
        where = ("" if out_dir is not None else
                 f" (MUCUDNN_SHIM_DIR={os.environ['MUCUDNN_SHIM_DIR']}: set it to a writable "
                 "directory)" if os.environ.get("MUCUDNN_SHIM_DIR") else
                 " (set MUCUDNN_SHIM_DIR to a writable directory)")
        raise UnwritableError(f"cannot build the shim in {target_dir}: {exc.strerror}{where}") \
            from None
    with scratch_dir as scratch:
        command = [make, "-s", "-C", str(SHIM_SOURCE_DIR), f"CUDNN_INCLUDE={cudnn_include}",
                   f"CUDA_INCLUDE={cuda_include}", f"CC={compiler}", f"VERSION={__version__}",
                   f"OUT={scratch}"]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            output = (result.stderr.strip() or result.stdout.strip())
            raise MucudnnError(f"building {LIBRARY_NAME} failed (make -C {SHIM_SOURCE_DIR} exit "
                               f"{result.returncode}):\n{output}")
        os.replace(Path(scratch) / LIBRARY_NAME, library)
    return library


def shim_path() -> Path:
    """The built shim, building it first if needed."""
    return build_shim()
