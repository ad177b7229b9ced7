"""capture.c: a plan's pieces as one CUDA graph, against the double and its fake driver.

With $FAKE_CUDA_GRAPHS the fake driver captures for real in the double's terms: while its stream
captures, the double defers each convolution into the graph instead of running it, and
cuGraphLaunch runs them (tests/shim/fake_cudnn/fake_cuda_driver.c). So a replayed graph that
skipped, repeated or reordered a piece, or ran it on stale pointers, would show in the output.
``repeat=R`` makes the conv driver run the same call R times on the same buffers, the output
restored before each; the last is compared with the undivided reference.
"""

from __future__ import annotations

import pytest

from shim_harness import plan_line

FWD = "dir=fwd n=8 c=4 in=7x7 k=6 f=3x3 pad=1x1 g=2 ws=65536 algo=0"
GRAPHS = {"FAKE_CUDA_GRAPHS": "1", "MUCUDNN_LOG_LEVEL": "info"}


def calls_named(run, name):
    return [c for c in run.calls if c["fn"] == name]


@pytest.mark.parametrize("case, beta", [
    (FWD, "0"), (FWD, "0.5"),
    (FWD.replace("dir=fwd", "dir=bwd_data"), "0"),
    (FWD.replace("dir=fwd", "dir=bwd_filter"), "0"),
    (FWD.replace("dir=fwd", "dir=bwd_filter"), "0.75"),  # beta != 0: only the first piece's
])
def test_second_call_is_captured_and_later_calls_replay_the_graph(shim_env, case, beta):
    case = f"{case} beta={beta} alpha=1.5 repeat=4"
    fast, slow = ("gemm", "implicit_gemm") if "dir=fwd" in case else ("algo_1", "algo_0")
    plan = shim_env.write_plan([plan_line(case, [(4, fast, "fma"), (2, fast, "fma"),
                                                 (2, slow, "fma")])])
    run = shim_env.run([case], plan=plan, env=GRAPHS)
    assert run.cases[0]["exact"] == "1", run.cases[0]
    assert not run.shim_lines("warning"), run.stderr
    # the first call runs its 3 pieces, the second captures them (deferred: they run at its
    # launch), the third and fourth only launch; then the undivided reference
    assert [c["n"] for c in run.conv_calls()] == ["4", "2", "2"] * 2 + ["8"]
    assert len(calls_named(run, "cuStreamBeginCapture")) == 1
    launches = calls_named(run, "cuGraphLaunch")
    assert [c["calls"] for c in launches] == ["3"] * 3 and {c["stream"] for c in launches} == {"0x0"}
    assert run.stderr.count("pieces run as one CUDA graph") == 1
    # the handle points at the capture stream for the capture only
    streams = [c["stream"] for c in calls_named(run, "cudnnSetStream")]
    assert len(streams) == 2 and streams[0] != "0x0" and streams[1] == "0x0"


def test_other_pointers_are_captured_again_and_each_replays_right(shim_env):
    """Cases with other buffers (other seeds, sizes of allocation) get graphs of their own."""
    cases = [f"{FWD} seed={seed} repeat=3" for seed in (1, 2, 3)]
    plan = shim_env.write_plan([plan_line(FWD, [(4, "gemm", "fma")] * 2)])
    run = shim_env.run(cases, plan=plan, env=GRAPHS)
    assert [c["exact"] for c in run.cases] == ["1"] * 3
    captures = len(calls_named(run, "cuStreamBeginCapture"))
    assert 1 <= captures <= 3  # one per distinct set of pointers (malloc may reuse them)
    assert len(calls_named(run, "cuGraphLaunch")) == 3 * 3 - 1  # every call after the first


def test_a_failed_capture_runs_the_pieces_one_by_one_and_warns_once(shim_env):
    case = f"{FWD} repeat=4"
    plan = shim_env.write_plan([plan_line(case, [(4, "gemm", "fma")] * 2)])
    run = shim_env.run([case], plan=plan, env={**GRAPHS, "FAKE_CUDA_GRAPHS": "invalidate"})
    assert run.cases[0]["exact"] == "1"
    warnings = run.shim_lines("warning")
    assert len(warnings) == 1 and "cannot run the pieces as a CUDA graph (cuDNN did something a " \
        "capture cannot hold); running them one by one" in warnings[0], run.stderr
    # call 2's capture was discarded, never run: it and calls 3-4 run their pieces directly
    assert [c["n"] for c in run.conv_calls()] == ["4", "4"] * 5 + ["8"]
    assert len(calls_named(run, "cuStreamBeginCapture")) == 1 and not calls_named(run, "cuGraphLaunch")


def test_nothing_is_captured_on_a_stream_the_caller_is_capturing(shim_env):
    case = f"{FWD} repeat=3"
    plan = shim_env.write_plan([plan_line(case, [(4, "gemm", "fma")] * 2)])
    run = shim_env.run([case], plan=plan, env={**GRAPHS, "FAKE_CUDA_CALLER_CAPTURING": "1"})
    assert run.cases[0]["exact"] == "1" and not run.shim_lines("warning")
    assert [c["n"] for c in run.conv_calls()] == ["4", "4"] * 3 + ["8"]
    assert not calls_named(run, "cuStreamBeginCapture") and not calls_named(run, "cuGraphLaunch")


def test_graphs_off_by_option(shim_env):
    case = f"{FWD} repeat=3"
    plan = shim_env.write_plan([plan_line(case, [(4, "gemm", "fma")] * 2)])
    run = shim_env.run([case], plan=plan, env={**GRAPHS, "MUCUDNN_CUDA_GRAPHS": "off"})
    assert run.cases[0]["exact"] == "1"
    assert [c["n"] for c in run.conv_calls()] == ["4", "4"] * 3 + ["8"]
    assert not calls_named(run, "cuStreamBeginCapture")


def test_threads_capture_on_their_own_streams(shim_env):
    cases = [f"{FWD} seed={seed} repeat=3" for seed in range(1, 9)]
    plan = shim_env.write_plan([plan_line(FWD, [(4, "gemm", "fma")] * 2)])
    run = shim_env.run(cases, plan=plan, env=GRAPHS, threads=4)
    assert [c["exact"] for c in run.cases] == ["1"] * 8
    assert not run.shim_lines("warning"), run.stderr


def test_graph_path_engine_and_legacy_pieces_replay(shim_env):
    """On the graph path (cudnnBackendExecute), engine pieces and a legacy piece, accumulating
    into dw over repeats: the graph replays all three in order with beta 1 after the first."""
    from test_shim_graph import BASE, graph_plan_line

    case = f"{BASE} dir=bwd_filter alpha=1 beta=0.25 repeat=4"
    plan = shim_env.write_plan([graph_plan_line(case, [(2, "eng2"), (2, "algo_1"), (4, "eng0")])])
    run = shim_env.run_graph([case], plan=plan, env=GRAPHS)
    assert run.cases[0]["exact"] == "1" and run.cases[0]["status"] == "0"
    assert not run.shim_lines("warning"), run.stderr
    # the shim's engine pieces: run on the first call, captured on the second; then launches only
    shim_executions = [e for e in run.graph_executions() if e["n"] in ("2", "4")]
    assert [e["n"] for e in shim_executions][:4] == ["2", "4"] * 2
    assert [c["calls"] for c in calls_named(run, "cuGraphLaunch")] == ["3"] * 3
