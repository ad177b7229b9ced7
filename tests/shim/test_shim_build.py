"""mucudnn.shimlib: finding headers and a compiler, building and caching libmucudnn.so."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import fakebuild

from mucudnn import shimlib
from mucudnn.errors import LibraryNotFoundError, MucudnnError


@pytest.fixture
def headers(monkeypatch):
    reason = fakebuild.missing_prerequisite()
    if reason:
        pytest.skip(reason)
    monkeypatch.setenv("MUCUDNN_CUDNN_INCLUDE", str(fakebuild.find_cudnn_include()))
    monkeypatch.setenv("CUDA_HOME", str(fakebuild.find_cuda_include().parent))


def test_build_is_cached_by_content(headers, tmp_path, monkeypatch):
    monkeypatch.setenv("MUCUDNN_SHIM_DIR", str(tmp_path))
    library = shimlib.build_shim()
    assert library.name == "libmucudnn.so" and library.parent.parent == tmp_path
    built_at = library.stat().st_mtime_ns
    assert shimlib.shim_path() == library and library.stat().st_mtime_ns == built_at
    symbols = subprocess.run(["nm", "-D", "--defined-only", str(library)], capture_output=True,
                             text=True).stdout
    for direction in ("Forward", "BackwardData", "BackwardFilter"):
        assert f" T cudnnConvolution{direction}\n" in symbols
    assert " T cudnnCreate\n" not in symbols  # everything else passes through untouched
    needed = subprocess.run(["readelf", "-d", str(library)], capture_output=True, text=True).stdout
    assert "libcudnn" not in needed  # found with dlsym at run time, never linked


def test_missing_cudnn_headers_name_the_places_tried(tmp_path, monkeypatch):
    monkeypatch.setenv("MUCUDNN_CUDNN_INCLUDE", str(tmp_path))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # no headers unpacked there
    monkeypatch.setattr(shimlib, "_nvidia_wheel_dirs", lambda *parts: [])
    if Path("/usr/include/cudnn.h").exists() or Path("/usr/local/cuda/include/cudnn.h").exists():
        pytest.skip("system cuDNN headers present")
    with pytest.raises(LibraryNotFoundError, match=f"cudnn.h not found \\(tried {tmp_path}, "):
        shimlib.find_cudnn_include()


def test_no_compiler_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("CC", "no-such-compiler-xyz")
    with pytest.raises(MucudnnError, match="no C compiler found \\(tried no-such-compiler-xyz\\)"):
        shimlib.build_shim()


def test_a_failed_compile_carries_the_compiler_output(headers, tmp_path, monkeypatch):
    monkeypatch.setenv("MUCUDNN_CUDNN_INCLUDE", str(tmp_path))
    (tmp_path / "cudnn.h").write_text("#error this is not cudnn.h\n")
    with pytest.raises(MucudnnError, match="this is not cudnn.h"):
        shimlib.build_shim(out_dir=tmp_path / "out")


def test_shim_version_is_the_package_version(headers, tmp_path):
    """mucudnn/_version.py is the one source: the Makefile passes it to the C build."""
    library = shimlib.build_shim(out_dir=tmp_path / "out")
    probe = ("import ctypes, sys; lib = ctypes.CDLL(sys.argv[1]); "
             "lib.mucudnn_version.restype = ctypes.c_char_p; print(lib.mucudnn_version().decode())")
    shim_version = subprocess.run([sys.executable, "-c", probe, str(library)], capture_output=True,
                                  text=True, check=True).stdout.strip()
    cli = subprocess.run([sys.executable, "-m", "mucudnn", "--version"], capture_output=True,
                         text=True, check=True).stdout.split()
    assert cli == ["mucudnn,", "version", shim_version]
    from importlib.metadata import version
    assert version("mucudnn") == shim_version


def test_build_runs_the_makefile(headers, tmp_path, monkeypatch):
    """The Makefile is the one copy of the build flags: what make is told, the build gets."""
    calls = []
    real_run = subprocess.run

    def spy(command, *args, **kwargs):
        calls.append(list(command))
        return real_run(command, *args, **kwargs)

    monkeypatch.setattr(shimlib.subprocess, "run", spy)
    shimlib.build_shim(out_dir=tmp_path / "out")
    assert len(calls) == 1 and Path(calls[0][0]).name == "make"
    assert calls[0][calls[0].index("-C") + 1] == str(shimlib.SHIM_SOURCE_DIR)
    assert (shimlib.SHIM_SOURCE_DIR / "Makefile").is_file()


@pytest.mark.parametrize("leave", ["nothing", "sources only"])
def test_missing_shim_sources_are_one_clear_error(tmp_path, monkeypatch, leave):
    if leave == "sources only":   # its C files without the Makefile
        (tmp_path / "src").mkdir()
        (tmp_path / "src" / "shim.c").write_text("int x;\n")
    monkeypatch.setattr(shimlib, "SHIM_SOURCE_DIR", tmp_path)
    with pytest.raises(MucudnnError, match="shim sources not found in .*reinstall mucudnn"):
        shimlib._build_hash(tmp_path, tmp_path, "cc")
