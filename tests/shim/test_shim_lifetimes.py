"""What the shim builds and captures lives no longer than what it was made from, and the shim
never runs less deterministic pieces, nor in less workspace, than the caller chose.

Each test here reproduces a defect of an outside review against the cuDNN double: a CUDA graph
replayed after the engine plans it launched were destroyed, graphs and piece plans surviving their
handle, graph-API piece plans built without bound, determinism dropped, workspace sizes and FindEx
results that let a caller allocate less than cuDNN needs, cuDNN's native CUDA graphs recorded in a
workspace too small for the engine.
"""

from __future__ import annotations

import pytest
from shim_harness import WS_PER_SAMPLE, key_of, plan_line
from test_shim_graph import BASE, LEGACY_CASE, NONDETERMINISTIC_ENGINES, graph_key, graph_plan_line

GRAPHS = {"FAKE_CUDA_GRAPHS": "1"}
EXECUTION_PLAN = "5"  # CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR in the double's log


def named(run, name):
    return [c for c in run.calls if c["fn"] == name]


def replayed_destroyed_plans(run):
    return [c for c in run.graph_executions() if c.get("destroyed_plan")]


# -- CUDA graphs and the plans they launch ---------------------------------------------------------

@pytest.mark.parametrize("direction", ["fwd", "bwd_filter"])
def test_a_new_plan_on_the_same_buffers_never_replays_the_old_plans_graph(shim_env, direction):
    """cudnn.benchmark times candidates on the same buffers and destroys the losers; an LRU
    evicts plans. Each framework plan's pieces get graphs of their own, destroyed with them."""
    case = f"{BASE} dir={direction} alpha=1 beta=0 repeat=3 replan=3"
    plan = shim_env.write_plan([graph_plan_line(case, [(4, "eng3"), (4, "eng2")])])
    run = shim_env.run_graph([case], plan=plan, env=GRAPHS)
    result = run.cases[0]
    assert not replayed_destroyed_plans(run), "a graph launched pieces of a destroyed plan"
    assert (result["status"], result["exact"]) == ("0", "1"), run.stderr
    # each of the 3 framework plans: first call direct, second captured, third launched
    assert len(named(run, "cuStreamBeginCapture")) == 3
    assert len(named(run, "cuGraphLaunch")) == 3 * 2
    assert len(named(run, "cuGraphExecDestroy")) == 3  # every graph destroyed with its plan


def test_graphs_die_with_the_handle_they_were_captured_with(shim_env):
    """A handle destroyed and created again (at the same address, maybe on another device) gets
    no graph of the old one's: each handle captures its own, and cudnnDestroy destroys them."""
    case = "dir=fwd n=8 c=4 in=7x7 k=6 f=3x3 pad=1x1 g=2 ws=65536 algo=0 repeat=4 rehandle=1"
    plan = shim_env.write_plan([plan_line(case, [(4, "gemm", "fma"), (4, "gemm", "fma")])])
    run = shim_env.run([case], plan=plan, env=GRAPHS)
    assert run.cases[0]["exact"] == "1"
    # call 1 runs directly (the entry's first); calls 2-4 each on a new handle: each captures
    assert len(named(run, "cuStreamBeginCapture")) == 3
    order = [c["fn"] for c in run.calls if c["fn"] in ("cuGraphExecDestroy", "cudnnDestroy")]
    # the handles of calls 2, 3 and 4 captured: their graph goes before the handle does
    assert order.count("cuGraphExecDestroy") == 3
    for i, fn in enumerate(order):
        if fn == "cuGraphExecDestroy":
            assert order[i + 1] == "cudnnDestroy", order


# -- graph-API pieces of legacy calls ------------------------------------------------------------------

def test_legacy_engine_pieces_are_bounded_per_kernel(shim_env):
    """A changing loss scale (alpha) builds piece plans for each value: a few are kept, the
    others destroyed, not kept for the life of the process."""
    cases = [LEGACY_CASE.format(d="fwd", beta=0).replace("alpha=1", f"alpha={a}") for a in range(1, 9)]
    line = f"kernel {key_of(cases[0])} 8 {3 * 4 * WS_PER_SAMPLE} 0.5 4:eng3:fma 4:eng3:fma"
    run = shim_env.run(cases, plan=shim_env.write_plan([line]))
    assert all(r["exact"] == "1" for r in run.cases), run.cases
    events = ["destroyed" if c["fn"] == "cudnnBackendDestroyDescriptor" else "executed"
              for c in run.calls
              if (c["fn"] == "cudnnBackendDestroyDescriptor" and c["type"] == EXECUTION_PLAN)
              or c["fn"] == "cudnnBackendExecute"]
    last_execution = len(events) - 1 - events[::-1].index("executed")
    # 8 sets of 2 piece plans built, at most 4 kept: sets 1-3 were destroyed before the 8th
    # alpha's pieces ran (set 4 as they were built), and every set by the end (with the handle)
    assert events[:last_execution].count("destroyed") == (7 - 4) * 2 + 2
    assert events.count("destroyed") == 8 * 2


def test_legacy_engine_pieces_die_with_their_handle(shim_env):
    case = LEGACY_CASE.format(d="fwd", beta=0) + " repeat=3 rehandle=1"
    line = f"kernel {key_of(case)} 8 {3 * 4 * WS_PER_SAMPLE} 0.5 4:eng3:fma 4:eng3:fma"
    run = shim_env.run([case], plan=shim_env.write_plan([line]))
    assert run.cases[0]["exact"] == "1"
    order = [("plan" if c["fn"] == "cudnnBackendDestroyDescriptor" else "handle")
             for c in run.calls
             if (c["fn"] == "cudnnBackendDestroyDescriptor" and c["type"] == EXECUTION_PLAN)
             or c["fn"] == "cudnnDestroy"]
    # three handles, each with its own 2 piece plans, destroyed just before it
    assert order[:9] == ["plan", "plan", "handle"] * 3, order


# -- determinism ----------------------------------------------------------------------------------

ALGO_0_PLAN = [(4, "algo_0", "fma"), (4, "algo_0", "fma")]  # bwd_filter algo_0: atomic adds


@pytest.mark.parametrize("callers_algo, planned", [(1, False), (0, True)])
def test_a_caller_that_chose_a_deterministic_algorithm_gets_no_nondeterministic_pieces(
        shim_env, callers_algo, planned):
    case = f"dir=bwd_filter n=8 c=4 in=7x7 k=6 f=3x3 pad=1x1 ws=1000000 algo={callers_algo}"
    run = shim_env.run([case], plan=shim_env.write_plan([plan_line(case, ALGO_0_PLAN)]))
    assert run.cases[0]["exact"] == "1"
    calls = run.conv_calls()[:-1]  # the last is the reference
    assert [c["n"] for c in calls] == (["4", "4"] if planned else ["8"])
    if not planned:
        assert calls[0]["algo"] == str(callers_algo)


def test_queries_offer_a_nondeterministic_plan_as_nondeterministic(shim_env):
    case = "op=get_v7 dir=bwd_filter n=8 c=4 in=7x7 k=6 f=3x3 pad=1x1 requested=8"
    run = shim_env.run([case], plan=shim_env.write_plan([plan_line(case, ALGO_0_PLAN)]))
    algo, status, _time, _memory, _math, determinism = run.cases[0]["perf"].split(",")[0].split(":")
    assert (algo, status, determinism) == ("0", "0", "0")  # algo_0, SUCCESS, NON_DETERMINISTIC


@pytest.mark.parametrize("engines, planned", [({}, False), (NONDETERMINISTIC_ENGINES, True)])
def test_on_the_graph_path_a_deterministic_engine_gets_no_nondeterministic_plan(shim_env, engines, planned):
    case = f"{BASE} dir=bwd_filter alpha=1 beta=0"
    plan = shim_env.write_plan([graph_plan_line(case, [(4, "algo_0"), (4, "algo_0")])])
    run = shim_env.run_graph([case], plan=plan, env=engines)
    assert run.cases[0]["exact"] == "1"
    pieces = [c["n"] for c in run.conv_calls() if c["n"] == "4"]
    assert pieces == (["4", "4"] if planned else [])
    if not planned:
        assert [e["n"] for e in run.graph_executions()] == ["8"]  # the framework's own engine


# -- workspace ------------------------------------------------------------------------------------

def test_find_ex_marks_a_plan_needing_more_than_the_callers_workspace_alloc_failed(shim_env):
    base = "op=find_ex dir=fwd n=8 c=4 in=7x7 k=6 f=3x3 pad=1x1 requested=16"
    line = plan_line(base, [(4, "direct", "fma"), (4, "direct", "fma")])  # 3 * 4 * 4096 bytes
    plan_workspace = int(line.split()[3])
    small, large = (f"{base} ws={plan_workspace - 1}", f"{base} ws={plan_workspace}")
    run = shim_env.run([small, large], plan=shim_env.write_plan([line]))
    small_perf = [p.split(":") for p in run.cases[0]["perf"].split(",")]
    large_perf = [p.split(":") for p in run.cases[1]["perf"].split(",")]
    assert (large_perf[0][1], large_perf[0][3]) == ("0", str(plan_workspace))  # first, SUCCESS
    planned = [p for p in small_perf if p[3] == str(plan_workspace) and p[1] != "0"]
    assert len(planned) == 1 and planned[0][1] == "4003"  # CUDNN_STATUS_ALLOC_FAILED
    statuses = [p[1] for p in small_perf]
    assert statuses == sorted(statuses, key=lambda s: s != "0")  # after every result that succeeded


def test_a_buffer_sized_for_another_algorithm_runs_when_the_plan_passes_through(shim_env):
    """A program picks its own algorithm (gemm), sizes its buffer with cudnnGetConvolution*
    WorkspaceSize and calls with beta != 0, which a borrowing plan passes through: cuDNN must
    get a buffer it can run in."""
    base = "dir=fwd n=8 c=4 in=7x7 k=6 f=3x3 pad=1x1 algo=2"
    line = f"kernel {key_of(base)} 8 0 0.5 4:direct:fma:out 4:implicit_gemm:fma"
    plan = shim_env.write_plan([line])
    size = shim_env.run([f"op=ws {base}"], plan=plan).cases[0]["size"]
    assert size == str(2 * 8 * WS_PER_SAMPLE)  # cuDNN's own, not the plan's 0
    run = shim_env.run([f"op=conv {base} ws={size} beta=0.5"], plan=plan)
    assert (run.cases[0]["status"], run.cases[0]["exact"]) == ("0", "1")


@pytest.mark.parametrize("plan_workspace, allowed", [(0, False), (10**7, True)])
def test_cudnns_native_cuda_graph_never_records_the_engine_in_a_too_small_workspace(
        shim_env, plan_workspace, allowed):
    case = f"{BASE} dir=fwd alpha=1 beta=0 populate=1"
    line = f"kernel {graph_key(case)} 8 {plan_workspace} 0.5 4:implicit_gemm:fma 4:implicit_gemm:fma"
    run = shim_env.run_graph([case], plan=shim_env.write_plan([line]))
    result = run.cases[0]
    assert (result["status"], result["exact"], result["ws"]) == ("0", "1", str(plan_workspace))
    populated = named(run, "cudnnBackendPopulateCudaGraph")
    engine_needs = int(populated[0]["need"]) if populated else None
    if allowed:  # the engine fits the plan's workspace: cuDNN records it
        assert result["populate"] == "0" and len(populated) == 1 and engine_needs <= plan_workspace
    else:
        assert result["populate"] == "3000" and not populated  # CUDNN_STATUS_NOT_SUPPORTED
        assert any("refused" in line for line in run.shim_lines("warning")), run.stderr


def test_an_engine_noted_tensor_core_and_nondeterministic_counts_as_nondeterministic(shim_env):
    """Both notes are read, not only the first (the double lists TENSOR_CORE first): the
    framework's non-deterministic tensor-core engine takes a plan with non-deterministic pieces."""
    case = f"{BASE} dir=bwd_filter alpha=1 beta=0".replace("engine=1", "engine=2")
    plan = shim_env.write_plan([graph_plan_line(case, [(4, "algo_0"), (4, "algo_0")], math="default")])
    run = shim_env.run_graph([case], plan=plan, env={"FAKE_CUDNN_NONDETERMINISTIC_ENGINES": "2"})
    assert run.cases[0]["exact"] == "1"
    assert [c["n"] for c in run.conv_calls() if c["n"] == "4"] == ["4", "4"], run.stderr
