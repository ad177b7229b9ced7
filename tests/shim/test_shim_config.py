"""Configuration of the shim: plan files (tests/data/plans), environment values, messages."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from shim_harness import FAKE_GPU_NAME, plan_line

PLANS = Path(__file__).resolve().parents[1] / "data" / "plans"
CASE = "dir=fwd n=8 c=4 in=7x7 k=6 f=3x3 pad=1x1 g=2 ws=65536 algo=0"


def expected_line(path: Path) -> str:
    match = re.match(r"# expect-error-line: (\S+)", path.read_text())
    assert match, f"{path} lacks its '# expect-error-line: N' comment"
    return match.group(1)


@pytest.mark.parametrize("path", sorted(PLANS.glob("invalid_*.plan")), ids=lambda p: p.stem)
def test_a_malformed_plan_gives_one_error_naming_file_and_line_and_passes_through(shim_env, path):
    run = shim_env.run([CASE], plan=path)
    errors = run.shim_lines("error")
    assert len(errors) == 1, run.stderr
    line = expected_line(path)
    where = f"{path}:{line}:" if line != "-" else f"{path}:"
    assert errors[0].startswith(f"mucudnn: error: {where}"), errors[0]
    assert errors[0].endswith("; passing every call through")
    assert [c["n"] for c in run.conv_calls()] == ["8", "8"]  # undivided, then the reference
    assert run.cases[0]["exact"] == "1"


@pytest.mark.parametrize("path", sorted(PLANS.glob("valid_*.plan")), ids=lambda p: p.stem)
def test_valid_plans_load_or_are_refused_for_another_gpu_or_cudnn(shim_env, path):
    run = shim_env.run([CASE], plan=path, env={"MUCUDNN_LOG_LEVEL": "info"})
    kernels = sum(1 for line in path.read_text().splitlines() if line.strip().startswith("kernel"))
    if "other_gpu" in path.stem:
        assert run.shim_lines("error") == [
            f"mucudnn: error: {path}: plan is for gpu 'NVIDIA H200' but this process runs on "
            f"'{FAKE_GPU_NAME}'; passing every call through"]
    elif "other_cudnn" in path.stem:
        assert run.shim_lines("error") == [
            f"mucudnn: error: {path}: plan is for cudnn 90100 but this process runs cudnn 91900; "
            "passing every call through"]
    else:
        assert not run.shim_lines("error"), run.stderr
        assert any(f"loaded plan {path}: {kernels} kernel plans" in line
                   for line in run.shim_lines("info")), run.stderr
    assert run.cases[0]["exact"] == "1"


def test_the_gpu_name_comes_from_the_driver(shim_env):
    plan = shim_env.write_plan([plan_line(CASE, [(4, "gemm", "fma")] * 2)])
    run = shim_env.run([CASE], plan=plan, env={"FAKE_CUDNN_GPU_NAME": "Another GPU"})
    assert "runs on 'Another GPU'" in run.shim_lines("error")[0]
    assert len(run.conv_calls()) == 2  # refused: undivided


@pytest.mark.parametrize("variable, value", [
    ("MUCUDNN_WORKSPACE_LIMIT", "lots"), ("MUCUDNN_WORKSPACE_LIMIT", "64XB"),
    ("MUCUDNN_WORKSPACE_LIMIT", "-5"), ("MUCUDNN_LOG_LEVEL", "loud"), ("MUCUDNN_DISABLE", "maybe"),
    ("MUCUDNN_SUMMARY", "2"), ("MUCUDNN_CUDA_GRAPHS", "sometimes"),
    ("MUCUDNN_WORKSPACE_SLACK", "5%"), ("MUCUDNN_WORKSPACE_SLACK", "-3"),
])
def test_a_malformed_value_gives_one_warning_and_the_default(shim_env, variable, value):
    plan = shim_env.write_plan([plan_line(CASE, [(4, "gemm", "fma")] * 2)])
    run = shim_env.run([CASE, CASE], plan=plan, env={variable: value})
    warnings = run.shim_lines("warning")
    assert len(warnings) == 1 and warnings[0].startswith(
        f"mucudnn: warning: {variable}='{value}' is not valid (expected "), run.stderr
    assert warnings[0].endswith("; using the default")
    assert [c["n"] for c in run.conv_calls()] == ["4", "4", "8"] * 2  # the defaults: plan runs


@pytest.mark.parametrize("value, bytes_", [("123", 123), ("512KiB", 512 << 10), ("64MiB", 64 << 20),
                                           ("1GiB", 1 << 30), ("2GB", 2 * 10**9), ("0", 0)])
def test_workspace_limit_values(shim_env, value, bytes_):
    run = shim_env.run([CASE.replace("n=8", "op=ws n=8")],
                       env={"MUCUDNN_WORKSPACE_LIMIT": value, "MUCUDNN_LOG_LEVEL": "debug"})
    assert (f"mucudnn: debug: option MUCUDNN_WORKSPACE_LIMIT = {bytes_} (environment;"
            in run.stderr), run.stderr


def test_debug_level_prints_every_option_and_each_piece(shim_env):
    plan = shim_env.write_plan([plan_line(CASE, [(4, "gemm", "fma")] * 2)])
    run = shim_env.run([CASE], plan=plan, env={"MUCUDNN_LOG_LEVEL": "3"})
    for name in ("DISABLE", "PLAN", "WORKSPACE_LIMIT", "RECORD", "LOG_LEVEL", "LOG_FILE", "SUMMARY",
                 "CUDA_GRAPHS"):
        assert f"mucudnn: debug: option MUCUDNN_{name} = " in run.stderr
    assert run.stderr.count(" piece ") == 2 and "piece 2/2: b=4 algo=gemm math=fma" in run.stderr


def test_log_file_and_summary(shim_env, tmp_path):
    log = tmp_path / "shim.log"
    plan = shim_env.write_plan([plan_line(CASE, [(4, "gemm", "fma")] * 2)])
    other = CASE.replace("n=8", "n=3")
    unkeyable = CASE.replace("dir=fwd", "dir=fwd layout=padded")
    run = shim_env.run([CASE, CASE, other, unkeyable], plan=plan,
                       env={"MUCUDNN_SUMMARY": "yes", "MUCUDNN_LOG_FILE": str(log)})
    assert not run.stderr
    summary = [line.split(None, 5)[2:] for line in log.read_text().splitlines()
               if line.startswith("mucudnn: summary:")]
    assert summary[0] == ["planned", "passthrough", "N", "kernel"]
    rows = {(row[2], row[3]): (row[0], row[1]) for row in summary[1:]}
    key = run.cases[0]["key"]
    assert rows[("8", key)] == ("2", "0") and rows[("3", key)] == ("0", "1")
    assert rows[("-", "(calls without a kernel key)")] == ("0", "1")


@pytest.mark.parametrize("graphs", [None, "0"])
def test_cuda_graphs_fall_back_to_piece_by_piece_without_stream_capture(shim_env, graphs):
    """Without $FAKE_CUDA_GRAPHS the fake driver cannot begin a capture: plans run piece by piece,
    exactly, and the shim says why once at info level (MUCUDNN_CUDA_GRAPHS=0: it never tries)."""
    plan = shim_env.write_plan([plan_line(CASE, [(4, "gemm", "fma")] * 2)])
    env = {"MUCUDNN_LOG_LEVEL": "info", **({"MUCUDNN_CUDA_GRAPHS": graphs} if graphs else {})}
    run = shim_env.run([CASE, CASE, CASE], plan=plan, env=env)
    assert [c["exact"] for c in run.cases] == ["1"] * 3
    assert [c["n"] for c in run.conv_calls()] == ["4", "4", "8"] * 3
    said = "mucudnn: info: CUDA graphs off: the CUDA driver cannot begin a stream capture"
    assert run.stderr.count(said) == (0 if graphs == "0" else 1), run.stderr
    assert not run.shim_lines("warning")


# -- where the log goes, and values echoed in messages -----------------------------------------------

@pytest.fixture(params=["no reader", "a reader"])
def fifo(request, tmp_path):
    """A FIFO: without a reader a blocking open for writing never returns; with one it would."""
    import os

    path = tmp_path / "log.fifo"
    os.mkfifo(path)
    reader = os.open(path, os.O_RDONLY | os.O_NONBLOCK) if request.param == "a reader" else None
    yield path
    if reader is not None:
        os.close(reader)


def test_a_log_file_that_is_a_fifo_is_refused_without_blocking(shim_env, fifo):
    run = shim_env.run([CASE], env={"MUCUDNN_LOG_FILE": str(fifo), "MUCUDNN_LOG_LEVEL": "info"},
                       timeout=20)
    assert run.returncode == 0 and run.cases[0]["exact"] == "1"
    assert run.shim_lines("warning") == [
        f"mucudnn: warning: MUCUDNN_LOG_FILE={fifo}: is a FIFO, not a regular file; logging to stderr"]
    assert run.shim_lines("info"), run.stderr  # the rest of the log did reach stderr


@pytest.mark.parametrize("device", ["/dev/null", "/dev/stderr"])
def test_a_log_file_may_be_a_device_or_the_process_stderr(shim_env, device):
    """/dev/stderr is a pipe here (the test captures stderr): it is the process's own stderr."""
    run = shim_env.run([CASE], env={"MUCUDNN_LOG_FILE": device, "MUCUDNN_LOG_LEVEL": "info"})
    assert not run.shim_lines("warning"), run.stderr
    assert bool(run.shim_lines("info")) == (device == "/dev/stderr"), run.stderr


def test_a_log_file_that_cannot_be_written_falls_back_to_stderr_once(shim_env):
    """/dev/full fails every write with ENOSPC, as a full disk does."""
    plan = shim_env.write_plan([plan_line(CASE, [(4, "gemm", "fma")] * 2)])
    run = shim_env.run([CASE, CASE], plan=plan,
                       env={"MUCUDNN_LOG_FILE": "/dev/full", "MUCUDNN_LOG_LEVEL": "debug"})
    lines = run.stderr.splitlines()
    assert lines[0] == ("mucudnn: warning: MUCUDNN_LOG_FILE: write failed (No space left on device); "
                        "logging to stderr from here"), run.stderr
    assert sum("write failed" in line for line in lines) == 1
    # the line that failed is the first debug line; it and every later one are on stderr
    assert lines[1].startswith("mucudnn: debug: option MUCUDNN_DISABLE = ")
    assert run.stderr.count("piece 2/2: b=4 algo=gemm math=fma") == 2


@pytest.mark.parametrize("variable, value, shown", [
    ("MUCUDNN_LOG_LEVEL", "loud\nmucudnn: error: injected", r"loud\nmucudnn: error: injected"),
    ("MUCUDNN_WORKSPACE_LIMIT", "64\tMiB\r\x1b[2J\\", r"64\tMiB\r\x1b[2J\\"),
])
def test_a_value_echoed_in_a_message_stays_on_one_line(shim_env, variable, value, shown):
    run = shim_env.run([CASE], env={variable: value})
    lines = run.stderr.splitlines()
    assert len(lines) == 1, run.stderr
    assert lines[0].startswith(f"mucudnn: warning: {variable}='{shown}' is not valid (expected ")
    assert lines[0].endswith("; using the default")


def test_a_path_echoed_in_a_message_stays_on_one_line(shim_env, tmp_path):
    path = tmp_path / "no\ndir" / "shim.log"
    run = shim_env.run([CASE], env={"MUCUDNN_LOG_FILE": str(path), "MUCUDNN_LOG_LEVEL": "debug"})
    escaped = str(path).replace("\n", r"\n")
    assert (f"mucudnn: warning: MUCUDNN_LOG_FILE={escaped}: cannot open (No such file or directory); "
            "logging to stderr") in run.stderr.splitlines()
    assert f"mucudnn: debug: option MUCUDNN_LOG_FILE = {escaped} (environment;" in run.stderr
    assert all(line.startswith("mucudnn: ") for line in run.stderr.splitlines()), run.stderr
