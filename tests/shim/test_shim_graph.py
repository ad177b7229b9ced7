"""The graph ("backend") API through the shim: PyTorch's default path.

``graph_driver`` builds each case's convolution as cudnn-frontend does (tensors, convolution,
operation, graph, heuristics or engine, configuration, execution plan), queries the plan's
workspace, allocates exactly that, executes, and compares with the double's own undivided
result on the same data (``exact=1``: bit-identical; f32 data are small integers).
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from shim_harness import WS_PER_SAMPLE, key_of, parse_fields

from mucudnn.problem import ALGORITHMS, Direction

BASE = "op=exec n=8 c=4 in=7x7 k=6 f=3x3 pad=1x1 g=2 engine=1 seed=3"
LEGACY = {"fwd": "implicit_precomp_gemm", "bwd_data": "algo_1", "bwd_filter": "algo_1"}


# The double's engines carry the NONDETERMINISTIC note: a framework that does not ask for determinism.
NONDETERMINISTIC_ENGINES = {"FAKE_CUDNN_NONDETERMINISTIC_ENGINES": "all"}

def graph_key(case: str) -> str:
    """The key the shim gives a graph case: f32 on a tensor-core engine (the double's engine 2)
    stands for TF32 math (``default``), any other f32 engine for ``fma``; f64 is ``default``."""
    f = parse_fields(case)
    tf32 = f.get("dt", "f32") == "f64" or f.get("engine") == "2"
    return key_of(case + f" math={'default' if tf32 else 'fma'}")


def piece_workspace(direction: str, b: int, algo: str) -> int:
    if algo.startswith("eng"):
        return int(algo[3:].split(".")[0]) * b * WS_PER_SAMPLE
    return ALGORITHMS[Direction(direction)].index(algo) * b * WS_PER_SAMPLE


def graph_plan_line(case: str, pieces: list[tuple[int, str]], math: str = "fma") -> str:
    direction = parse_fields(case).get("dir", "fwd")
    workspace = max(piece_workspace(direction, b, a) for b, a in pieces)
    text = " ".join(f"{b}:{a}:{math}" for b, a in pieces)
    return f"kernel {graph_key(case)} {sum(b for b, _ in pieces)} {workspace} 0.5 {text}"


def shim_calls(run) -> list[dict[str, str]]:
    """The double's executions made by the shim, legacy and graph, in order: all but the driver's
    undivided reference call (legacy, the last of a one-case run)."""
    calls = [c for c in run.calls if c["fn"].startswith("cudnnConvolution") or c["fn"] == "cudnnBackendExecute"]
    return calls[:-1] if calls and calls[-1]["fn"].startswith("cudnnConvolution") else calls


@pytest.mark.parametrize("direction", ["fwd", "bwd_data", "bwd_filter"])
def test_legacy_pieces_run_on_the_graph_path(shim_env, direction):
    case = f"{BASE} dir={direction} alpha=1 beta=0"
    pieces = [(4, LEGACY[direction]), (2, LEGACY[direction]), (2, ALGORITHMS[Direction(direction)][0])]
    plan = shim_env.write_plan([graph_plan_line(case, pieces)])
    # algo_0 pieces of the backward directions are non-deterministic: the framework's engine is too
    run = shim_env.run_graph([case], plan=plan, env={"MUCUDNN_LOG_LEVEL": "info", **NONDETERMINISTIC_ENGINES})
    result = run.cases[0]
    assert (result["status"], result["ref_status"], result["exact"], result["guard"]) == ("0", "0", "1", "ok")
    assert int(result["ws"]) == piece_workspace(direction, 4, LEGACY[direction])  # the plan's, reported
    calls = shim_calls(run)
    assert [c["fn"].startswith("cudnnConvolution") for c in calls] == [True, True, True]  # no engine ran
    assert [c["n"] for c in calls] == ["4", "2", "2"]
    assert any("runs the micro-batch plan" in line for line in run.shim_lines("info"))


@pytest.mark.parametrize("direction", ["fwd", "bwd_data", "bwd_filter"])
def test_engine_pieces_run_their_own_plans(shim_env, direction):
    case = f"{BASE} dir={direction} alpha=2 beta=0.5"
    plan = shim_env.write_plan([graph_plan_line(case, [(3, "eng3"), (5, "eng1.k2=5.k7=-1")])])
    run = shim_env.run_graph([case], plan=plan)
    result = run.cases[0]
    assert (result["status"], result["exact"], result["guard"]) == ("0", "1", "ok")
    executions = run.graph_executions()
    assert [(e["n"], e["engine"], e["knobs"]) for e in executions] == [("3", "3", "0"), ("5", "1", "2")]
    # backward-filter pieces accumulate into dw: beta = 1 after the first
    betas = [float(e["beta"]) for e in executions]
    assert betas == ([0.5, 1.0] if direction == "bwd_filter" else [0.5, 0.5])
    assert {e["alpha"] for e in executions} == {"2"}


def test_mixed_pieces_and_repeats(shim_env):
    case = f"{BASE} dir=bwd_filter alpha=1 beta=0.25 repeat=3"
    plan = shim_env.write_plan([graph_plan_line(case, [(2, "eng2"), (2, "algo_1"), (4, "eng0")])])
    run = shim_env.run_graph([case], plan=plan)
    assert run.cases[0]["exact"] == "1" and run.cases[0]["status"] == "0"
    assert [e["n"] for e in run.graph_executions()] == ["2", "4"] * 3


def test_random_shapes_layouts_and_splits(shim_env):
    rng = random.Random(7)
    cases, lines = [], []
    for i in range(24):
        direction = rng.choice(["fwd", "bwd_data", "bwd_filter"])
        three_d = rng.random() < 0.3
        groups = rng.choice([1, 2])
        spatial = 3 if three_d else 2
        dims = lambda low, high: "x".join(str(rng.randint(low, high)) for _ in range(spatial))  # noqa: E731
        n = rng.randint(2, 9)
        case = (f"op=exec dir={direction} dt={rng.choice(['f32', 'f64'])} "
                f"layout={rng.choice(['nchw', 'nhwc'])} n={n} c={2 * groups} in={dims(4, 7)} "
                f"k={2 * groups} f={dims(1, 3)} pad={dims(0, 1)} stride={dims(1, 2)} dil=1x1"
                f"{'x1' if three_d else ''} g={groups} alpha={rng.choice([1, 0.5])} "
                f"beta={rng.choice([0, 1, 0.5])} engine={rng.choice([0, 1, 3])} seed={i}")
        sizes, left = [], n
        while left:
            b = rng.randint(1, left)
            sizes.append(b)
            left -= b
        pieces = [(b, rng.choice([LEGACY[direction], "eng1", "eng3"])) for b in sizes]
        cases.append(case)
        lines.append(graph_plan_line(case, pieces, math="default" if "f64" in case else "fma"))
    plan = shim_env.write_plan(lines)
    run = shim_env.run_graph(cases, plan=plan, env=NONDETERMINISTIC_ENGINES)  # pieces may be algo_0
    for case, result in zip(cases, run.cases):
        assert result["status"] == "0", (case, result)
        assert result["guard"] == "ok", (case, result)
        assert result["exact"] == "1" or float(result["max_rel"]) < 1e-12, (case, result)
    assert not run.shim_lines("warning") and not run.shim_lines("error")


def test_without_a_plan_the_engine_runs_undivided(shim_env):
    case = f"{BASE} dir=fwd alpha=1 beta=0 engine=3"
    run = shim_env.run_graph([case])  # shim loaded, no plan
    assert run.cases[0]["exact"] == "1"
    assert int(run.cases[0]["ws"]) == 3 * 8 * WS_PER_SAMPLE
    assert [(e["n"], e["engine"]) for e in run.graph_executions()] == [("8", "3")]


def test_fused_graphs_pass_through(shim_env):
    case = f"{BASE} dir=fwd alpha=1 beta=0 fuse=1 engine=3"
    # a plan for the convolution's key must not touch the fused graph
    plan = shim_env.write_plan([graph_plan_line(case, [(4, "eng1"), (4, "eng1")])])
    run = shim_env.run_graph([case], plan=plan, env={"MUCUDNN_WORKSPACE_LIMIT": "1"})
    assert run.cases[0]["exact"] == "1" and run.cases[0]["finalize"] == "0"
    assert [(e["n"], e["fused"]) for e in run.graph_executions()] == [("8", "1")]


def test_plans_for_other_numerics_do_not_apply(shim_env):
    # engine 2 carries the tensor-core note: the key says math=default, so an fma plan is not used
    case = f"{BASE} dir=fwd alpha=1 beta=0 engine=2"
    fma_line = graph_plan_line(case.replace("engine=2", "engine=1"), [(4, "eng1"), (4, "eng1")])
    run = shim_env.run_graph([case], plan=shim_env.write_plan([fma_line]))
    assert [e["n"] for e in run.graph_executions()] == ["8"]
    tf32_line = graph_plan_line(case, [(4, "eng1"), (4, "eng1")], math="default")
    run = shim_env.run_graph([case], plan=shim_env.write_plan([tf32_line]))
    assert [e["n"] for e in run.graph_executions()] == ["4", "4"]


def test_limit_refuses_unplanned_plans_over_it(shim_env):
    limit = 2 * 8 * WS_PER_SAMPLE  # engines 0, 1, 2 fit at N = 8, engine 3 does not
    heur = "op=heur dir=fwd n=8 c=4 in=7x7 k=6 f=3x3 pad=1x1 g=2"
    run = shim_env.run_graph([heur], env={"MUCUDNN_WORKSPACE_LIMIT": str(limit)})
    results = [r.split(":") for r in run.cases[0]["results"].split(",")]
    assert [(e, status) for e, status, _ in results] == [("3", "3000"), ("2", "0"), ("1", "0"), ("0", "0")]
    # the framework takes the first configuration that finalizes: engine 2, within the limit
    case = f"{BASE} dir=bwd_data alpha=1 beta=0 engine=heur"
    run = shim_env.run_graph([case], env={"MUCUDNN_WORKSPACE_LIMIT": str(limit)})
    assert (run.cases[0]["engine"], run.cases[0]["exact"]) == ("2", "1")
    assert int(run.cases[0]["ws"]) <= limit
    # without the limit, the heuristics' first (engine 3) is taken
    run = shim_env.run_graph([case])
    assert run.cases[0]["engine"] == "3"


def test_a_plan_is_kept_over_the_limit(shim_env):
    case = f"{BASE} dir=fwd alpha=1 beta=0 engine=3"
    plan = shim_env.write_plan([graph_plan_line(case.replace("engine=3", "engine=1"), [(8, "eng3")])])
    run = shim_env.run_graph([case], plan=plan, env={"MUCUDNN_WORKSPACE_LIMIT": "1"})
    assert (run.cases[0]["finalize"], run.cases[0]["exact"]) == ("0", "1")


def test_recording_on_the_graph_path(shim_env, tmp_path):
    record = tmp_path / "graph.record"
    cases = [f"{BASE} dir={d} alpha=1 beta=0" for d in ("fwd", "bwd_data", "bwd_filter")]
    shim_env.run_graph(cases, env={"MUCUDNN_RECORD": str(record)})
    recorded = {line.split()[1]: line.split()[2] for line in record.read_text().splitlines()
                if line.startswith("kernel")}
    assert recorded == {graph_key(case): "8" for case in cases}


def test_engine_piece_that_cannot_be_built_leaves_the_plan_unused(shim_env):
    case = f"{BASE} dir=fwd alpha=1 beta=0"
    plan = shim_env.write_plan([graph_plan_line(case, [(4, "eng3"), (4, "eng1")])])
    run = shim_env.run_graph([case], plan=plan, env={"FAKE_CUDNN_ENGINE_UNSUPPORTED": "3"})
    assert run.cases[0]["exact"] == "1"
    assert [e["n"] for e in run.graph_executions()] == ["8"]  # the framework's own engine, undivided
    assert any("cannot build the plan's graph-API pieces" in w for w in run.shim_lines("warning"))


def test_a_failing_piece_reports_cuDNN_status(shim_env):
    case = f"{BASE} dir=fwd alpha=1 beta=0"
    plan = shim_env.write_plan([graph_plan_line(case, [(5, "eng1"), (3, "eng1")])])
    run = shim_env.run_graph([case], plan=plan, env={"FAKE_CUDNN_FAIL_N": "3"})
    assert run.cases[0]["status"] == "5000"  # CUDNN_STATUS_EXECUTION_FAILED, not hidden


LEGACY_CASE = "dir={d} n=8 c=4 in=7x7 k=6 f=3x3 pad=1x1 g=2 ws=1000000 alpha=1 beta={beta} algo=0 math=fma"


@pytest.mark.parametrize("direction", ["fwd", "bwd_data", "bwd_filter"])
def test_legacy_calls_run_engine_pieces_too(shim_env, direction):
    cases = [LEGACY_CASE.format(d=direction, beta=beta) + f" seed={i}" for i, beta in enumerate((0.5, 0, 0.5))]
    legacy = ALGORITHMS[Direction(direction)][0]
    line = f"kernel {key_of(cases[0])} 8 {3 * 8 * WS_PER_SAMPLE} 0.5 3:eng3:fma 2:{legacy}:fma 3:eng1.k4=2:fma"
    run = shim_env.run(cases, plan=shim_env.write_plan([line]))
    assert all(r["exact"] == "1" and r["status"] == "0" for r in run.cases), run.cases
    executions = run.graph_executions()
    assert [(e["n"], e["engine"], e["knobs"]) for e in executions] == [("3", "3", "0"), ("3", "1", "1")] * 3
    # alpha/beta are baked into graph plans: beta 0.5 and 0 get plans of their own, reused after
    later_beta = "1" if direction == "bwd_filter" else "0.5"
    assert [e["beta"] for e in executions[:2]] == ["0.5", later_beta]
    assert executions[2]["beta"] == "0"
    assert len({e["x"] for e in executions}) > 1  # slices: the pointers advance


def test_legacy_queries_offer_engine_plans(shim_env):
    case = LEGACY_CASE.format(d="fwd", beta=0) + " op=get_v7 requested=8"
    line = f"kernel {key_of(case)} 8 {3 * 4 * WS_PER_SAMPLE} 0.25 4:eng3:fma 4:eng3:fma"
    run = shim_env.run([case], plan=shim_env.write_plan([line]))
    first = run.cases[0]["perf"].split(",")[0].split(":")
    assert first[3] == str(3 * 4 * WS_PER_SAMPLE) and first[1] == "0"  # the plan's workspace, SUCCESS


def test_legacy_engine_pieces_that_cannot_be_built_run_undivided(shim_env):
    case = LEGACY_CASE.format(d="fwd", beta=0)
    line = f"kernel {key_of(case)} 8 {3 * 4 * WS_PER_SAMPLE} 0.5 4:eng3:fma 4:eng3:fma"
    run = shim_env.run([case, case], plan=shim_env.write_plan([line]),
                       env={"FAKE_CUDNN_ENGINE_UNSUPPORTED": "3", "MUCUDNN_LOG_LEVEL": "info"})
    assert all(r["exact"] == "1" for r in run.cases)
    assert not run.graph_executions()
    assert [c["n"] for c in run.conv_calls()] == ["8"] * 4  # undivided, then the reference, twice
    assert len([w for w in run.shim_lines("warning") if "cannot build" in w]) == 1  # tried once


def test_threads(shim_env):
    cases = [f"{BASE} dir={d} alpha=1 beta=0.5 seed={i}" for i in range(6) for d in ("fwd", "bwd_filter")]
    plan = shim_env.write_plan([graph_plan_line(cases[0], [(4, "eng1"), (4, "implicit_gemm")]),
                                graph_plan_line(cases[1], [(2, "eng3"), (6, "algo_0")])])
    run = shim_env.run_graph(cases, plan=plan, threads=4)
    assert all(r["exact"] == "1" and r["status"] == "0" for r in run.cases)
    assert len(run.graph_executions()) == 12


def test_the_shared_engine_plan_example_loads(shim_env):
    # tests/data/plans/engines.plan is parsed by Python's tests too: one grammar on both sides
    plan = Path(__file__).resolve().parents[1] / "data" / "plans" / "engines.plan"
    run = shim_env.run_graph([f"{BASE} dir=fwd alpha=1 beta=0"], plan=plan,
                             env={"MUCUDNN_LOG_LEVEL": "info"})
    assert any("loaded plan" in line and ": 4 kernel plans" in line for line in run.shim_lines("info"))
    assert not run.shim_lines("error")


@pytest.mark.parametrize("engine", ["eng", "eng01", "eng1.k2=3.k2=4", "eng1.k3=1.k2=1", "eng1.k2=-0",
                                    "eng1.k2=+3", "eng1.k2=9223372036854775808", "eng1.k2", "engX"])
def test_malformed_engine_names_are_refused(shim_env, engine):
    case = f"{BASE} dir=fwd alpha=1 beta=0"
    line = f"kernel {graph_key(case)} 8 0 0.5 8:{engine}:fma"
    run = shim_env.run_graph([case], plan=shim_env.write_plan([line]))
    [error] = run.shim_lines("error")
    assert ".plan:7: engine" in error, error  # file, line, what
    assert run.cases[0]["exact"] == "1"


def test_a_null_scale_on_a_legacy_call_with_engine_pieces_goes_to_cudnn(shim_env):
    """Engine pieces bake alpha and beta in: a NULL one cannot be read, so the call goes to cuDNN
    undivided, which reports it, and the process goes on."""
    case = LEGACY_CASE.format(d="fwd", beta=0) + " null_beta=1"
    line = f"kernel {key_of(case)} 8 {3 * 4 * WS_PER_SAMPLE} 0.5 4:eng3:fma 4:eng3:fma"
    run = shim_env.run([case], plan=shim_env.write_plan([line]), env={"MUCUDNN_LOG_LEVEL": "info"})
    assert run.returncode == 0, run.stderr
    assert run.cases[0]["status"] == run.cases[0]["ref_status"] == "2000"  # CUDNN_STATUS_BAD_PARAM
    assert not run.graph_executions()
    assert "passthrough (alpha or beta is NULL" in run.stderr, run.stderr
