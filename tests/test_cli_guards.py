"""What the command line refuses before it does harm, and what it says then: places it cannot
write, files of another kind where it would write, invalid settings; one line each."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

import mucudnn
from mucudnn import shimlib
from mucudnn.plan import read_plan
from test_cli import VALID_PLAN, assert_one_error_line, assert_usage_error, invoke
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


# -- outputs onto files of another kind -----------------------------------------------------------

PLAN_TEXT = VALID_PLAN.read_text()
CONFIG = mucudnn.find_config("alexnet")


def _kinds(tmp_path: Path) -> dict[str, Path]:
    """An existing file of each kind a command reads or writes."""
    from test_cli import _filled_store
    files = {"plan": tmp_path / "in.plan", "config": tmp_path / "net.yaml",
             "recording": tmp_path / "run.record", "store": tmp_path / "other.sqlite",
             "export": tmp_path / "rows.csv"}
    files["plan"].write_text(PLAN_TEXT)
    files["config"].write_text(CONFIG.read_text())
    files["recording"].write_text("# mucudnn-record 1 pid=1\nkernel K 8\n")
    _filled_store(files["store"])
    assert invoke("store", "export", files["export"], "--store", files["store"]).exit_code == 0
    return files


@pytest.mark.parametrize("kind", ["plan", "config", "recording", "store"])
def test_store_export_refuses_to_overwrite_a_file_of_another_kind(tmp_path, kind):
    from test_cli import _filled_store
    source = _filled_store(tmp_path / "s.sqlite")
    target = _kinds(tmp_path)[kind]
    before = target.read_bytes()
    result = invoke("store", "export", target, "--store", source)
    assert_one_error_line(result, f"{target} is a", "not a CSV export")
    assert target.read_bytes() == before


def test_store_export_overwrites_an_earlier_export(tmp_path):
    from test_cli import _filled_store
    target = _kinds(tmp_path)["export"]
    source = _filled_store(tmp_path / "s.sqlite", batches=(1, 2, 4, 8))
    result = invoke("store", "export", target, "--store", source)
    assert result.exit_code == 0, result.output
    assert len(target.read_text().splitlines()) == 1 + 4


@pytest.mark.parametrize("kind", ["plan", "config", "store", "export"])
def test_record_refuses_to_append_to_a_file_of_another_kind(fake_exec, tmp_path, kind):
    target = _kinds(tmp_path)[kind]
    before = target.read_bytes()
    result = invoke("record", "-o", target, "--", "python", "train.py")
    assert_one_error_line(result, f"-o {target} is a", "not a recording")
    assert target.read_bytes() == before and fake_exec[1] == []  # nothing ran


@pytest.mark.parametrize("kind", ["recording", "config", "export"])
def test_tune_refuses_to_overwrite_a_file_of_another_kind(no_gpu, tmp_path, kind):
    target = _kinds(tmp_path)[kind]
    before = target.read_bytes()
    result = invoke("tune", "alexnet", "--workspace-limit", "64MiB", "-o", target)
    assert_one_error_line(result, f"-o {target} is a", "not a plan")
    assert target.read_bytes() == before


def test_tune_overwrites_an_earlier_plan_and_an_empty_file(no_gpu, tmp_path):
    for target in (_kinds(tmp_path)["plan"], tmp_path / "empty.plan"):
        target.touch()
        result = invoke("tune", "alexnet", "--workspace-limit", "64MiB", "-o", target)
        assert result.exit_code == 0, result.output
        assert read_plan(target).gpu == "NVIDIA H200"


@pytest.mark.parametrize("which", ["plan", "recording"])
def test_autotune_refuses_to_overwrite_a_file_of_another_kind(no_gpu, fake_exec, tmp_path, which):
    plan_path = tmp_path / "train.plan"
    target = plan_path if which == "plan" else plan_path.with_suffix(".record")
    target.write_text(CONFIG.read_text())
    result = invoke("autotune", "--workspace-limit", "64MiB", "-o", plan_path, "--", "python",
                    "t.py")
    assert_one_error_line(result, f"{target} is a file of another kind, not a {which}")
    assert target.read_text() == CONFIG.read_text() and fake_exec[1] == []  # nothing ran


# -- a store named by MUCUDNN_STORE is a store named by --store ----------------------------------

@pytest.mark.parametrize("command", ["tune", "show"])
def test_a_missing_store_in_mucudnn_store_is_the_error_of_store(no_gpu, monkeypatch, tmp_path,
                                                                  command):
    missing = tmp_path / "nonexistent" / "x.sqlite"
    args = (["tune", "alexnet", "--workspace-limit", "64MiB", "-o", tmp_path / "a.plan"]
            if command == "tune" else ["show", VALID_PLAN])
    by_option = invoke(*args, "--store", missing)
    monkeypatch.setenv("MUCUDNN_STORE", str(missing))
    by_setting = invoke(*args)
    said = (f"store {missing}", "does not exist; create it with "
            f"`mucudnn bench --store {missing}`")
    assert_one_error_line(by_option, *said)
    assert_one_error_line(by_setting, *said, "(MUCUDNN_STORE)")
    assert not missing.parent.exists() and not (tmp_path / "a.plan").exists()


# -- the small ones -------------------------------------------------------------------------------

def test_bench_without_cupy_creates_no_store(monkeypatch, tmp_path):
    import sys
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy raises ImportError
    store = tmp_path / "new.sqlite"
    result = invoke("bench", "alexnet", "--store", store, "--no-progress")
    assert_one_error_line(result, "CuPy is needed to benchmark on the GPU")
    assert not store.exists() and list(tmp_path.iterdir()) == []


def test_interrupted_command_exits_130(monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt  # Ctrl-C while the command works

    monkeypatch.setattr("mucudnn.settings.format_settings", interrupted)
    result = invoke("env")
    assert result.exit_code == 130, result.output
    assert result.stderr.strip().splitlines() == ["mucudnn: interrupted"]


def test_tune_help_says_gpu_and_cudnn_go_together():
    import re
    text = " ".join(invoke("tune", "--help").stdout.split())
    assert re.search(r"--gpu TEXT .*with --cudnn", text), text
    assert re.search(r"--cudnn INTEGER .*with --gpu", text), text
    assert_usage_error(invoke("tune", "alexnet", "--gpu", "NVIDIA H200", "-o", "x.plan"),
                       "--gpu and --cudnn go together")


def test_store_info_on_a_fresh_machine_says_what_is_shipped_and_where(monkeypatch, tmp_path):
    from mucudnn.tuner import SHIPPED_MEASUREMENTS
    monkeypatch.delenv("MUCUDNN_STORE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    result = invoke("store", "info")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    own = tmp_path / "mucudnn" / "benchmarks.sqlite"
    assert lines[0] == f"no store of your own yet at {own} (`mucudnn bench` on a GPU makes it)"
    assert lines[1] == (f"the measurements shipped with mucudnn: {SHIPPED_MEASUREMENTS} (what "
                        "`mucudnn tune` reads)")
    assert lines[2] == "rows: 74803" and lines[-1].split() == ["NVIDIA", "H200", "91900", "74803"]
    assert not own.exists()


def test_store_export_says_it_leaves_the_shipped_rows_out(tmp_path):
    from test_cli import _filled_store
    source = _filled_store(tmp_path / "s.sqlite")
    result = invoke("store", "export", tmp_path / "rows.csv", "--store", source)
    assert result.exit_code == 0, result.output
    assert result.stderr.splitlines() == [
        f"mucudnn: wrote 3 rows of store {source} to {tmp_path / 'rows.csv'} (not the "
        "measurements shipped with mucudnn: every install has them)"]
