"""Pieces that borrow their output's unwritten part as workspace (``B:ALGO:MATH:out``).

The double fills a call's workspace with garbage before and after computing, so a borrowed
workspace that overlapped the piece's own slice, or an earlier piece's, would spoil the output:
``exact=1`` shows it did not.
"""

from __future__ import annotations

import pytest

from shim_harness import key_of
from test_shim_exec import assert_passthrough, split_by_case

ALIGNMENT = 256  # exec.c: a borrowed workspace starts at the next multiple of this
WS_PER_SAMPLE = 256  # the double's model here: algorithm index * b * this many bytes
OUTPUT = {"fwd": ("y", 6 * 49 * 4), "bwd_data": ("dx", 4 * 49 * 4)}  # role, bytes per sample
PIECES = {"fwd": ("gemm", 2, "implicit_gemm"), "bwd_data": ("algo_1", 1, "algo_0")}


def case_and_plan(direction, beta="0", ws=0):
    case = f"dir={direction} n=8 c=4 in=7x7 k=6 f=3x3 pad=1x1 g=2 ws={ws} alpha=1 beta={beta} algo=0"
    big, _, free = PIECES[direction]
    line = (f"kernel {key_of(case)} 8 0 0.5 4:{big}:fma:out 2:{big}:fma:out 2:{free}:fma")
    return case, line


@pytest.mark.parametrize("direction", ["fwd", "bwd_data"])
def test_borrowing_pieces_use_the_output_after_their_slice(shim_env, direction):
    case, line = case_and_plan(direction)
    run = shim_env.run([case], plan=shim_env.write_plan([line]),
                       env={"FAKE_CUDNN_WS_PER_SAMPLE": str(WS_PER_SAMPLE), "MUCUDNN_LOG_LEVEL": "info"})
    result = run.cases[0]
    assert (result["status"], result["ref_status"], result["exact"]) == ("0", "0", "1"), run.stderr
    pieces, reference = split_by_case(run, [case])[0]
    role, sample = OUTPUT[direction]
    _, index, _ = PIECES[direction]
    out = int(pieces[0][role], 16)
    end = out + 8 * sample
    assert [c["n"] for c in pieces] == ["4", "2", "2"]
    for call, done in zip(pieces[:2], (4, 6)):  # the borrowing ones: after their own slice
        start = int(call["workspace"], 16)
        assert out + done * sample <= start < out + done * sample + ALIGNMENT
        assert start % ALIGNMENT == 0
        assert int(call["ws"]) == end - start >= int(call["need"]) == index * int(call["n"]) * WS_PER_SAMPLE
    assert (pieces[2]["workspace"], pieces[2]["ws"]) == (result["workspace"], "0")  # the caller's
    assert any(f"N=8: plan, 3 pieces: 4:{PIECES[direction][0]}:fma:out" in line
               for line in run.shim_lines("info")), run.stderr


@pytest.mark.parametrize("direction", ["fwd", "bwd_data"])
def test_a_nonzero_beta_passes_through(shim_env, direction):
    case, line = case_and_plan(direction, beta="0.5")
    run = shim_env.run([case], plan=shim_env.write_plan([line]),
                       env={"FAKE_CUDNN_WS_PER_SAMPLE": str(WS_PER_SAMPLE), "MUCUDNN_LOG_LEVEL": "info"})
    assert_passthrough(run, case)
    assert any("passthrough (beta is not 0: the plan borrows the output as workspace)" in line
               for line in run.shim_lines("info")), run.stderr


def test_too_little_room_after_a_piece_passes_through(shim_env):
    case, line = case_and_plan("fwd")
    # 2 * 4 samples * 1024 bytes = 8 KiB, where the output after the first piece has 4 * 1176
    run = shim_env.run([case], plan=shim_env.write_plan([line]),
                       env={"FAKE_CUDNN_WS_PER_SAMPLE": "1024", "MUCUDNN_LOG_LEVEL": "info"})
    assert_passthrough(run, case)
    assert any("passthrough (piece 1 needs 8192 bytes of workspace, the output after it has" in line
               for line in run.shim_lines("info")), run.stderr


GRAPH_BASE = "op=exec n=8 c=4 in=7x7 k=6 f=3x3 pad=1x1 g=2 engine=1 seed=3"


@pytest.mark.parametrize("direction", ["fwd", "bwd_data"])
def test_graph_engine_pieces_borrow_on_the_default_path(shim_env, direction):
    from test_shim_graph import graph_key

    case = f"{GRAPH_BASE} dir={direction} alpha=1 beta=0"
    line = f"kernel {graph_key(case)} 8 0 0.5 4:eng3:fma:out 2:eng3:fma:out 2:eng0:fma"
    run = shim_env.run_graph([case], plan=shim_env.write_plan([line]),
                             env={"FAKE_CUDNN_WS_PER_SAMPLE": "64", "MUCUDNN_LOG_LEVEL": "info"})
    result = run.cases[0]
    assert (result["status"], result["exact"], result["guard"]) == ("0", "1", "ok"), run.stderr
    executions = run.graph_executions()
    assert [(e["n"], e["engine"]) for e in executions] == [("4", "3"), ("2", "3"), ("2", "0")]
    role = "y" if direction == "fwd" else "x"  # the tensor the direction writes
    sample = OUTPUT[direction][1]
    out = int(executions[0][role], 16)
    for execution, done in zip(executions[:2], (4, 6)):
        start = int(execution["workspace"], 16)
        assert out + done * sample <= start < out + done * sample + ALIGNMENT
        assert out + 8 * sample - start >= int(execution["need"]) > 0


def test_graph_plan_with_a_nonzero_beta_runs_undivided(shim_env):
    from test_shim_graph import graph_key

    case = f"{GRAPH_BASE} dir=fwd alpha=1 beta=0.5"
    line = f"kernel {graph_key(case)} 8 0 0.5 4:eng3:fma:out 2:eng3:fma:out 2:eng0:fma"
    run = shim_env.run_graph([case], plan=shim_env.write_plan([line]),
                             env={"FAKE_CUDNN_WS_PER_SAMPLE": "64", "MUCUDNN_LOG_LEVEL": "info"})
    result = run.cases[0]
    assert (result["status"], result["exact"]) == ("0", "1"), run.stderr
    assert [e["n"] for e in run.graph_executions()] == ["8"]
    assert any("beta is not 0" in line for line in run.stderr.splitlines()), run.stderr
