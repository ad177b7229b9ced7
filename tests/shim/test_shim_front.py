"""Front plans (`strategy front`, docs/plan-format.md): a kernel's lines are the points of its
time-workspace front, and the shim runs, per call, the fastest point within the workspace that
call has; queries offer the points fastest first, so a framework's fallback on an allocation
failure lands on the next point rather than on a slow algorithm.

In the double's model algorithm (or engine) a needs a * n * 4096 bytes of workspace; the times
below are the plan's own, what the tuner would have measured.
"""

from __future__ import annotations

import pytest

from shim_harness import HEADER, WS_PER_SAMPLE, key_of
from test_shim_graph import BASE, graph_key

FRONT = HEADER.replace("strategy wr", "strategy front").replace("limit 67108864", "limit 18446744073709551615")
CASE = "dir=fwd n=8 c=4 in=7x7 k=6 f=3x3 pad=1x1 math=fma"
WS = WS_PER_SAMPLE

# (workspace, time, pieces): implicit_gemm is algorithm 0, gemm 2
LEGACY_POINTS = [(0, 2.0, "8:implicit_gemm:fma"),
                 (2 * 4 * WS, 1.0, "4:gemm:fma 4:gemm:fma"),
                 (2 * 8 * WS, 0.8, "8:gemm:fma")]


def front_plan(shim_env, key, points):
    return shim_env.write_plan([f"kernel {key} 8 {ws} {t} {pieces}" for ws, t, pieces in points], header=FRONT)


def pieces_run(run):
    """(n, algo) of the shim's convolution calls: all but the driver's reference (the last)."""
    return [(c["n"], c["algo"]) for c in run.conv_calls()[:-1]]


@pytest.mark.parametrize("workspace, callers_algo, expected", [
    (2 * 8 * WS, 1, [("8", "2")]),             # the fastest point: gemm, undivided
    (2 * 8 * WS - 1, 1, [("4", "2")] * 2),     # the fastest within: gemm in two pieces
    (2 * 4 * WS - 1, 0, [("8", "0")]),         # only the workspace-free point fits: the caller's
    (2 * 8 * WS, 2, [("8", "2")]),             # the fastest point is the caller's own: passthrough
])
def test_a_call_runs_the_fastest_point_within_its_workspace(shim_env, workspace, callers_algo, expected):
    case = f"op=conv {CASE} algo={callers_algo} ws={workspace}"
    run = shim_env.run([case], plan=front_plan(shim_env, key_of(case), LEGACY_POINTS),
                       env={"MUCUDNN_LOG_LEVEL": "info"})
    assert (run.cases[0]["status"], run.cases[0]["exact"]) == ("0", "1"), run.stderr
    assert pieces_run(run) == expected
    if callers_algo != 1:
        assert "passthrough (the plan's point is the caller's algorithm)" in run.stderr


def test_queries_offer_the_points_fastest_first_then_cudnns(shim_env):
    case = f"op=get_v7 {CASE} requested=16"
    run = shim_env.run([case], plan=front_plan(shim_env, key_of(case), LEGACY_POINTS))
    perf = [p.split(":") for p in run.cases[0]["perf"].split(",")]
    assert [(p[2], p[3]) for p in perf[:3]] == [("0.8", str(2 * 8 * WS)), ("1", str(2 * 4 * WS)), ("2", "0")]
    without = shim_env.run([case], preload=False).cases[0]["perf"].split(",")
    assert [":".join(p) for p in perf[3:]] == without[:len(perf) - 3]


def test_the_workspace_limit_caps_a_front(shim_env):
    case = f"op=get_v7 {CASE} requested=16"
    run = shim_env.run([case], plan=front_plan(shim_env, key_of(case), LEGACY_POINTS),
                       env={"MUCUDNN_WORKSPACE_LIMIT": str(2 * 8 * WS - 1)})
    offered = [p.split(":")[3] for p in run.cases[0]["perf"].split(",")[:2]]
    assert offered == [str(2 * 4 * WS), "0"]  # the fastest point is over the limit


def test_a_framework_that_falls_back_lands_on_the_next_point(shim_env):
    """PyTorch's legacy path allocates the first result's memory and, on failure, the next's:
    the call then has that workspace and runs that point."""
    query = f"op=get_v7 {CASE} requested=16"
    plan = front_plan(shim_env, key_of(query), LEGACY_POINTS)
    perf = [p.split(":") for p in shim_env.run([query], plan=plan).cases[0]["perf"].split(",")]
    second_algo, second_memory = perf[1][0], perf[1][3]  # the first allocation failed
    run = shim_env.run([f"op=conv {CASE} algo={second_algo} ws={second_memory}"], plan=plan)
    assert run.cases[0]["exact"] == "1" and pieces_run(run) == [("4", "2")] * 2


# -- the graph path: the framework's engine (engine=1 in BASE) needs 1 * 8 * 4096 bytes -----------

def graph_front(shim_env, case, points):
    return front_plan(shim_env, graph_key(case), points)


def test_on_the_graph_path_the_point_fits_the_framework_engines_workspace(shim_env):
    case = f"{BASE} dir=fwd alpha=1 beta=0"
    points = [(3 * 8 * WS, 0.5, "8:eng3:fma"),           # faster, but needs more than engine 1
              (2 * 4 * WS, 0.7, "4:eng2:fma 4:eng2:fma"),  # within engine 1's 8 * 4096 bytes
              (0, 2.0, "8:implicit_gemm:fma")]
    run = shim_env.run_graph([case], plan=graph_front(shim_env, case, points))
    result = run.cases[0]
    assert (result["status"], result["exact"], result["guard"]) == ("0", "1", "ok")
    assert result["ws"] == str(2 * 4 * WS)  # never more than the framework's engine
    assert [(e["n"], e["engine"]) for e in run.graph_executions()] == [("4", "2"), ("4", "2")]


def test_a_hard_limit_caps_the_point_on_the_graph_path(shim_env):
    case = f"{BASE} dir=fwd alpha=1 beta=0"
    points = [(2 * 4 * WS, 0.7, "4:eng2:fma 4:eng2:fma"), (0, 2.0, "8:implicit_gemm:fma")]
    run = shim_env.run_graph([case], plan=graph_front(shim_env, case, points),
                             env={"MUCUDNN_WORKSPACE_LIMIT": str(2 * 4 * WS - 1)})
    result = run.cases[0]
    assert (result["status"], result["exact"], result["ws"]) == ("0", "1", "0")
    assert not run.graph_executions()  # the workspace-free legacy point
    assert [c["n"] for c in run.conv_calls()[:-1]] == ["8"]


def test_the_framework_engine_itself_as_the_fastest_point_is_left_alone(shim_env):
    case = f"{BASE} dir=fwd alpha=1 beta=0"
    points = [(1 * 8 * WS, 0.6, "8:eng1:fma"), (0, 2.0, "8:implicit_gemm:fma")]
    run = shim_env.run_graph([case], plan=graph_front(shim_env, case, points),
                             env={"MUCUDNN_LOG_LEVEL": "info"})
    result = run.cases[0]
    assert (result["status"], result["exact"], result["ws"]) == ("0", "1", str(1 * 8 * WS))
    assert [(e["n"], e["engine"]) for e in run.graph_executions()] == [("8", "1")]
    assert "runs the micro-batch plan" not in run.stderr
