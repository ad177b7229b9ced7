"""Algorithm queries and workspace sizes through the shim: the plan first, the limit respected."""

from __future__ import annotations

import pytest

from shim_harness import WS_PER_SAMPLE, plan_line

BASE = "n=8 c=4 in=7x7 k=6 f=3x3 pad=1x1 math=tensor_op"
# In the double's model algorithm a needs a * n * 4096 bytes: each first piece's algorithm runs the
# whole N = 8 within the plan's workspace (set by the second piece).
PIECES = {"fwd": [(4, "implicit_precomp_gemm", "fma"), (4, "direct", "fma")],          # 1, 3
          "bwd_data": [(4, "algo_1", "fma"), (4, "fft", "fma")],                      # 1, 2
          "bwd_filter": [(4, "algo_1", "fma"), (4, "algo_3", "fma")]}                 # 1, 3


def perf(result):
    """[(algo, status, time, memory, math, determinism)] of a query result line."""
    if not result["perf"]:
        return []
    return [tuple(float(v) if i == 2 else int(v) for i, v in enumerate(p.split(":")))
            for p in result["perf"].split(",")]


@pytest.mark.parametrize("op", ["get_v7", "find", "find_ex"])
@pytest.mark.parametrize("direction", ["fwd", "bwd_data", "bwd_filter"])
def test_queries_offer_the_plan_first_then_cudnns_results(shim_env, op, direction):
    case = f"op={op} dir={direction} {BASE} ws=1000000"
    line = plan_line(case, PIECES[direction], time_ms=0.125)
    plan, plan_workspace = shim_env.write_plan([line]), int(line.split()[3])
    without = shim_env.run([case + " requested=8"], preload=False).cases[0]
    run = shim_env.run([case + " requested=8", case + " requested=1", case + " requested=3"], plan=plan)
    full, one, three = run.cases
    real = perf(without)
    assert full["status"] == "0" and int(full["returned"]) == min(8, len(real) + 1)
    first = perf(full)[0]
    from mucudnn.problem import ALGORITHMS, Direction
    # the first piece's algorithm, as deterministic as the plan; backward-filter's plan has an
    # algo_3 piece (non-deterministic), so it is reported as the workspace-free algo_0, also
    # non-deterministic (DETERMINISTIC = 1)
    algo, deterministic = {"fwd": ("implicit_precomp_gemm", 1), "bwd_data": ("algo_1", 1),
                           "bwd_filter": ("algo_0", 0)}[direction]
    assert first == (ALGORITHMS[Direction(direction)].index(algo), 0, 0.125, plan_workspace, 1, deterministic)
    assert perf(full)[1:] == real[:7]
    assert (one["returned"], perf(one)) == ("1", [first])
    assert (three["returned"], perf(three)) == ("3", [first] + real[:2])


def test_representative_algorithm_fits_the_plans_workspace(shim_env):
    # Piece algorithm 3 (direct) at N=8 needs 3*8*4096 bytes, more than the plan's 3*4*4096:
    # the shim reports an algorithm that fits, the workspace-free implicit_gemm.
    case = f"op=get_v7 dir=fwd {BASE}"
    plan = shim_env.write_plan([plan_line(case, [(4, "direct", "fma"), (4, "direct", "fma")])])
    first = perf(shim_env.run([case], plan=plan).cases[0])[0]
    assert first[0] == 0 and first[3] == 3 * 4 * WS_PER_SAMPLE


@pytest.mark.parametrize("direction", ["fwd", "bwd_data", "bwd_filter"])
def test_workspace_size_of_a_planned_kernel_is_the_plans_for_the_offered_algorithm(shim_env, direction):
    line = plan_line(f"dir={direction} {BASE}", PIECES[direction])
    plan = shim_env.write_plan([line])
    offered = perf(shim_env.run([f"op=get_v7 dir={direction} {BASE}"], plan=plan).cases[0])[0][0]
    other = 2  # an algorithm the query did not offer for the plan
    assert offered != other
    cases = [f"op=ws dir={direction} {BASE} algo={offered}", f"op=ws dir={direction} {BASE} algo={other}",
             f"op=ws dir={direction} {BASE.replace('n=8', 'n=9')} algo={offered}"]
    planned, not_offered, unplanned = shim_env.run(cases, plan=plan).cases
    assert planned["size"] == line.split()[3]
    # cuDNN's own answers: for another algorithm (a caller that sizes its buffer by its own
    # choice must be able to run it when the plan passes through), and for another kernel
    assert not_offered["size"] == str(other * 8 * WS_PER_SAMPLE)
    assert unplanned["size"] == str(offered * 9 * WS_PER_SAMPLE)


def test_without_plan_or_limit_queries_are_cudnns(shim_env):
    cases = [f"op={op} dir={d} {BASE} ws=100000" for op in ("get_v7", "find_ex") for d in PIECES]
    strip_key = lambda results: [{k: v for k, v in r.items() if k != "key"} for r in results]  # noqa: E731
    assert strip_key(shim_env.run(cases).cases) == strip_key(shim_env.run(cases, preload=False).cases)


@pytest.mark.parametrize("op", ["get_v7", "find"])
def test_the_workspace_limit_removes_larger_results(shim_env, op):
    limit = 2 * 8 * WS_PER_SAMPLE  # algorithms 0..2 fit at N=8
    cases = [f"op={op} dir={d} {BASE}" for d in PIECES]
    run = shim_env.run(cases, env={"MUCUDNN_WORKSPACE_LIMIT": str(limit)})
    unlimited = shim_env.run(cases, preload=False)
    for limited, real in zip(run.cases, unlimited.cases):
        expected = [p for p in perf(real) if p[3] <= limit]
        assert perf(limited) == expected and int(limited["returned"]) == len(expected)
        assert len(expected) < len(perf(real))  # the limit did remove something


def test_a_planned_kernel_keeps_its_plan_above_the_limit(shim_env):
    case = f"op=get_v7 dir=fwd {BASE}"
    plan = shim_env.write_plan([plan_line(case, PIECES["fwd"])])  # workspace 3*4*4096
    run = shim_env.run([case], plan=plan, env={"MUCUDNN_WORKSPACE_LIMIT": "0"})
    results = perf(run.cases[0])
    assert results[0][3] == 3 * 4 * WS_PER_SAMPLE
    assert all(p[3] == 0 for p in results[1:]) and len(results) > 1
