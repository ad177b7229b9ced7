"""Shared test set-up: GPU tests (marked ``gpu``) are skipped cleanly where no GPU is present, and
the fixtures used by more than one test module (tests/shim/conftest.py has those of the double)."""

from __future__ import annotations

import pathlib
import re
import shutil
import subprocess
import tempfile
import types

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


# -- the shim against the cuDNN double (tests/shim/drivers/shim_harness.py) ------------------------

@pytest.fixture(scope="session")
def shim_env(tmp_path_factory):
    """The shim, the cuDNN double and the drivers, built once per session (a ``ShimEnv``)."""
    from shim_harness import build_shim_env

    return build_shim_env(tmp_path_factory.mktemp("shim"))


# -- the command line without a GPU (test_cli.py, test_budget.py) ---------------------------------

@pytest.fixture(scope="module")
def stores_dir(tmp_path_factory):
    """One directory for every test's user store, so the shipped cache is built only once."""
    return tmp_path_factory.mktemp("stores")


@pytest.fixture
def no_gpu(monkeypatch, stores_dir, tmp_path, request):
    """No GPU, an empty user store and a private cache: the CLI tunes from the shipped data."""
    from mucudnn import tuner
    from mucudnn.store import open_store

    name = re.sub(r"[^A-Za-z0-9]+", "_", request.node.name)
    store = stores_dir / f"{name}.sqlite"
    open_store(store).close()  # MUCUDNN_STORE names a store that exists, as --store must
    monkeypatch.setenv("MUCUDNN_STORE", str(store))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setattr(tuner, "gpu_available", lambda: False)
    monkeypatch.setattr(tuner, "gpu_without_cupy", lambda: None)
    # the one GPU enumeration: a test double of CuPy or the driver another test left loaded
    # must not show a GPU here
    monkeypatch.setattr(tuner, "visible_gpus", lambda: None)


@pytest.fixture
def fake_exec(monkeypatch, tmp_path):
    """A dummy shim and a ``subprocess.call`` that records what it would have run."""
    from mucudnn import shimlib

    shim = tmp_path / "libmucudnn.so"
    shim.write_bytes(b"")
    monkeypatch.setattr(shimlib, "shim_path", lambda: shim)
    calls = []

    def call(args, env=None, **kwargs):
        calls.append((args, env))
        return 0

    monkeypatch.setattr(subprocess, "call", call)
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    monkeypatch.delenv("TORCH_CUDNN_V8_API_DISABLED", raising=False)
    return shim, calls


@pytest.fixture
def recording_exec(fake_exec, monkeypatch):
    """fake_exec whose commands, run with ``MUCUDNN_RECORD`` set, write a recording there (what
    the shim would append while the command runs): the ``kernel KEY N`` lines of ``kernels``, or
    ``text``. ``shim, calls = recording_exec(kernels=...)``, each call recorded as (args, env)."""
    shim, calls = fake_exec

    def install(kernels=(), text: str | None = None):
        recorded = text if text is not None else "".join(f"kernel {p.key} {p.n}\n" for p in kernels)

        def call(args, env=None, **kwargs):
            calls.append((args, env))
            if "MUCUDNN_RECORD" in env:
                pathlib.Path(env["MUCUDNN_RECORD"]).write_text(recorded)
            return 0

        monkeypatch.setattr(subprocess, "call", call)
        return shim, calls

    return install


# -- read-only places (test_store.py's as_unprivileged runs code as the unprivileged user) --------

@pytest.fixture
def shared_dir():
    """A directory the unprivileged user of ``test_store.as_unprivileged`` can reach and write."""
    path = pathlib.Path(tempfile.mkdtemp(prefix="mucudnn-store-test-"))
    path.chmod(0o755)
    yield path
    for inner in [path, *path.rglob("*")]:
        if inner.is_dir():
            inner.chmod(0o755)
    shutil.rmtree(path)


# -- timing without a GPU (test_timing.py, test_bench.py) -----------------------------------------

@pytest.fixture
def clock(monkeypatch):
    """A fake ``cupy`` module: each call of the timed function advances ``clock["now"]``."""
    state = {"now": 0.0}

    class Event:
        def record(self, stream=None) -> None:
            self.t = state["now"]

        def synchronize(self) -> None:
            pass

    cuda = types.SimpleNamespace(Event=Event, get_elapsed_time=lambda start, end: end.t - start.t)
    monkeypatch.setitem(__import__("sys").modules, "cupy", types.SimpleNamespace(cuda=cuda))
    return state
