"""What the command line refuses before it does harm, and what it says then: places it cannot
write, files of another kind where it would write, invalid settings; one line each."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from mucudnn import shimlib
from test_cli import assert_one_error_line, invoke
from test_store import as_unprivileged


# -- places the shim cannot be built in -----------------------------------------------------------

@pytest.fixture
def buildable(monkeypatch, shared_dir):
    """Everything build_shim looks for before it writes, found (nothing is compiled), in a
    directory the unprivileged user can read."""
    headers = shared_dir / "include"
    headers.mkdir()
    (headers / "cudnn.h").write_text("")
    monkeypatch.setattr(shimlib, "find_compiler", lambda: "cc")
    monkeypatch.setattr(shimlib, "find_make", lambda: "make")
    monkeypatch.setattr(shimlib, "find_cudnn_include", lambda: headers)
    monkeypatch.setattr(shimlib, "find_cuda_include", lambda: headers)
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("nothing should build"))
    monkeypatch.setattr(subprocess, "call", lambda *a, **k: pytest.fail("nothing should run"))


SHIM_COMMANDS = [["build-shim"], ["run", "--plan", Path(__file__).parent / "data" / "plans" /
                                  "valid_basic.plan", "--", "python", "t.py"]]


@pytest.mark.parametrize("args", SHIM_COMMANDS, ids=["build-shim", "run"])
def test_a_shim_dir_that_cannot_be_made_is_one_error_line(buildable, monkeypatch, args):
    monkeypatch.setenv("MUCUDNN_SHIM_DIR", "/proc/nope")
    result = invoke(*args)
    assert_one_error_line(result, "cannot build the shim in /proc/nope/", "MUCUDNN_SHIM_DIR")


def _build_shim():
    result = invoke("build-shim")
    return result.exit_code, result.stderr


def test_a_read_only_shim_dir_is_one_error_line(buildable, shared_dir, monkeypatch):
    shim_dir = shared_dir / "shim"
    shim_dir.mkdir(mode=0o555)
    monkeypatch.setenv("MUCUDNN_SHIM_DIR", str(shim_dir))
    code, stderr = as_unprivileged(_build_shim)
    lines = stderr.splitlines()
    assert code == 2 and len(lines) == 1, stderr
    assert lines[0].startswith(f"mucudnn: error: cannot build the shim in {shim_dir}/"), stderr
    assert "MUCUDNN_SHIM_DIR" in lines[0]
