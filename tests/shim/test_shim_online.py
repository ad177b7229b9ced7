"""Online tuning (MUCUDNN_ONLINE=1, docs/shim.md "Online tuning"): a kernel without a plan is
measured on its first call (every algorithm at N and the powers of two below N), its front is
kept in memory and appended to the online plan file, and the next process starts tuned.

The double's events read a clock that each convolution advances by its modelled time
(0.01 ms + work / (FLOPS * (1 + algo)); workspace algo * b * 4096 bytes), so the measurements and
the front are deterministic. FAKE_CUDNN_FLOPS_PER_MS makes the small test convolutions slow in
modelled time, so that micro-batches pay.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from mucudnn.measurement import Measurement
from mucudnn.optimizer import best_plan, pareto_plans, thin_front
from mucudnn.plan import read_plan
from shim_harness import FAKE_CUDNN_VERSION, FAKE_GPU_NAME, WS_PER_SAMPLE, key_of, parse_fields

FLOPS_PER_MS = 200_000
TIMED_RUNS = 3  # internal.h MU_TIMED_RUNS (mu_time_calls): one warm-up, then this many timed runs
CASE = "op=conv dir=fwd n=8 c=4 in=7x7 k=6 f=3x3 pad=1x1 math=fma"
OTHER = "op=conv dir=fwd n=8 c=5 in=7x7 k=6 f=3x3 pad=1x1 math=fma"  # another kernel
FILE_NAME = f"{FAKE_GPU_NAME.replace(' ', '_')}-cudnn{FAKE_CUDNN_VERSION}.plan"
FWD_ALGOS = ["implicit_gemm", "implicit_precomp_gemm", "gemm", "direct", "fft", "fft_tiling", "winograd",
             "winograd_nonfused"]


def online_env(directory, **extra):
    env = {"MUCUDNN_ONLINE": "1", "MUCUDNN_ONLINE_DIR": str(directory), "MUCUDNN_LOG_LEVEL": "info",
           "FAKE_CUDNN_FLOPS_PER_MS": str(FLOPS_PER_MS)}
    env.update(extra)
    return env


def report(run):
    lines = [line for line in run.stderr.splitlines() if "summary: online tuning:" in line]
    assert len(lines) == 1, run.stderr
    return lines[0]


def candidates_timed(run) -> int:
    return int(report(run).split("(")[1].split()[0])


def measuring_and_pieces(run):
    """The convolution calls of the measurement (they come first: a warm-up and the timed runs
    per candidate), and those of the plan's pieces (the driver's reference call is the last)."""
    calls = run.conv_calls()
    measuring = (1 + TIMED_RUNS) * candidates_timed(run)
    return calls[:measuring], calls[measuring:-1]


def file_kernels(path):
    """(key, N) of the file's kernel lines."""
    return {tuple(line.split()[1:3]) for line in path.read_text().splitlines() if line.startswith("kernel ")}


def model_ms(case: str, batch: int, algo: int) -> float:
    f = parse_fields(case)
    size = [int(v) for v in f["in"].split("x")]
    filt = [int(v) for v in f["f"].split("x")]
    pad = [int(v) for v in f["pad"].split("x")]
    taps = int(f["c"])
    for i, s, p in zip(size, filt, pad):
        taps *= s * (i + 2 * p - s + 1)
    return 0.01 + batch * 2.0 * int(f["k"]) * taps / (FLOPS_PER_MS * (1 + algo))


def model_rows(case: str):
    key = key_of(case)
    return [Measurement(key, b, name, "fma", model_ms(case, b, a), a * b * WS_PER_SAMPLE)
            for a, name in enumerate(FWD_ALGOS) for b in (1, 2, 4, 8)]


def modelled_best(case: str, limit: int):
    """The fastest plan within limit the offline tuner (mucudnn.optimizer) makes of the model."""
    return best_plan(model_rows(case), 8, limit=limit)


def modelled_point(case: str, limit: int):
    """The point of the offline tuner's thinned front a call with `limit` bytes runs."""
    front = thin_front(pareto_plans(model_rows(case), 8))
    return min((p for p in front if p.workspace <= limit), key=lambda p: p.time_ms)


@pytest.mark.parametrize("workspace", [0, 7 * 4 * WS_PER_SAMPLE, 3 * 8 * WS_PER_SAMPLE - 1, 7 * 8 * WS_PER_SAMPLE])
def test_the_first_run_measures_micro_batches_and_runs_the_fastest_point_within_the_workspace(
        shim_env, tmp_path, workspace):
    run = shim_env.run([f"{CASE} algo=0 ws={workspace}"], env=online_env(tmp_path))
    assert (run.cases[0]["status"], run.cases[0]["exact"]) == ("0", "1"), run.stderr
    assert "measured 1 kernels (32 candidates timed)" in report(run)  # 8 algorithms x sizes 8, 4, 2, 1
    measuring, pieces = measuring_and_pieces(run)
    assert sorted({int(c["n"]) for c in measuring}) == [1, 2, 4, 8]
    expected = modelled_point(CASE, workspace)
    if pieces:
        chosen = [(int(c["n"]), int(c["algo"])) for c in pieces]
    else:  # the point is the caller's own algorithm, run undivided
        chosen = [(8, 0)]
        assert "passthrough (the plan's point is the caller's algorithm)" in run.stderr
    # the point mucudnn.optimizer's pareto_plans + thin_front would run (thinned fronts lose up to
    # a few per cent against the unthinned optimum, modelled_best)
    assert sorted(chosen) == sorted((p.batch, FWD_ALGOS.index(p.algo)) for p in expected.pieces)
    assert all(a * b * WS_PER_SAMPLE <= workspace for b, a in chosen)
    assert sum(model_ms(CASE, b, a) for b, a in chosen) <= modelled_best(CASE, workspace).time_ms * 1.15


def test_a_micro_batched_point_is_chosen_where_it_is_fastest(shim_env, tmp_path):
    run = shim_env.run([f"{CASE} algo=0 ws={7 * 4 * WS_PER_SAMPLE}"], env=online_env(tmp_path))
    _, pieces = measuring_and_pieces(run)
    assert [(c["n"], c["algo"]) for c in pieces] == [("4", "7"), ("4", "7")]
    assert [(p.batch, p.algo) for p in modelled_best(CASE, 7 * 4 * WS_PER_SAMPLE).pieces] == \
        [(4, "winograd_nonfused")] * 2


def test_the_second_run_loads_the_file_and_measures_nothing(shim_env, tmp_path):
    case = f"{CASE} algo=0 ws={7 * 4 * WS_PER_SAMPLE}"
    first = shim_env.run([case, OTHER + " algo=0 ws=0"], env=online_env(tmp_path))
    assert "measured 2 kernels" in report(first)
    read_plan(tmp_path / FILE_NAME)  # valid for the Python side too
    assert file_kernels(tmp_path / FILE_NAME) == {(key_of(CASE), "8"), (key_of(OTHER), "8")}
    second = shim_env.run([case], env=online_env(tmp_path))
    assert (second.cases[0]["status"], second.cases[0]["exact"]) == ("0", "1"), second.stderr
    assert "measured 0 kernels (0 candidates timed)" in report(second)
    assert f"1 kernels from {tmp_path / FILE_NAME}" in report(second)
    assert [(c["n"], c["algo"]) for c in second.conv_calls()[:-1]] == [("4", "7"), ("4", "7")]


def test_the_budget_stops_measuring(shim_env, tmp_path):
    none = shim_env.run([f"{CASE} algo=0 ws=0"], env=online_env(tmp_path, MUCUDNN_ONLINE_BUDGET_MS="0"))
    assert none.cases[0]["exact"] == "1"
    assert "measured 0 kernels" in report(none) and "1 passed through (1 budget)" in report(none)
    assert len(none.conv_calls()) == 2  # the call, undivided, and the reference
    # 1 ms: the first kernel's measurement is cut short (kept in memory only), the second passes
    cut = shim_env.run([f"{CASE} algo=0 ws=0", f"{OTHER} algo=0 ws=0"],
                       env=online_env(tmp_path, MUCUDNN_ONLINE_BUDGET_MS="1"))
    assert [c["exact"] for c in cut.cases] == ["1", "1"]
    assert "measured 1 kernels" in report(cut) and "1 passed through (1 budget)" in report(cut)
    assert "cut short by the budget" in cut.stderr
    assert not (tmp_path / FILE_NAME).exists()


@pytest.mark.parametrize("direction, beta", [("fwd", "1"), ("bwd_data", "0.5"), ("bwd_filter", "0"),
                                             ("bwd_filter", "1")])
def test_measuring_never_writes_an_output_the_call_does_not_overwrite(shim_env, tmp_path, direction, beta):
    case = f"op=conv dir={direction} n=8 c=4 in=7x7 k=6 f=3x3 pad=1x1 math=fma algo=0 ws=0 beta={beta}"
    run = shim_env.run([case], env=online_env(tmp_path))
    assert (run.cases[0]["status"], run.cases[0]["exact"]) == ("0", "1"), run.stderr
    measuring, _ = measuring_and_pieces(run)
    output = {"fwd": "y", "bwd_data": "dx", "bwd_filter": "dw"}[direction]
    callers = run.conv_calls()[-2][output]  # the caller's buffer: the last call through the shim
    assert measuring and all(c[output] != callers for c in measuring)


def test_with_beta_0_forward_measures_in_the_callers_output(shim_env, tmp_path):
    run = shim_env.run([f"{CASE} algo=0 ws=0"], env=online_env(tmp_path))
    measuring, _ = measuring_and_pieces(run)
    assert {c["y"] for c in measuring} == {run.conv_calls()[-2]["y"]}
    assert run.cases[0]["exact"] == "1"


def spawn(shim_env, directory, cases, log, **extra):
    environment = {k: v for k, v in os.environ.items() if not k.startswith(("MUCUDNN_", "FAKE_CUDNN_"))}
    environment.update(LD_LIBRARY_PATH=str(shim_env.fake_dir), LD_PRELOAD=str(shim_env.shim),
                       FAKE_CUDNN_LOG=str(log), **online_env(directory, **extra))
    cases_file = log.with_name(f"{log.name}.{len(list(log.parent.iterdir()))}.cases")
    cases_file.write_text("".join(c + "\n" for c in cases))
    with cases_file.open() as stdin:
        return subprocess.Popen([str(shim_env.driver)], env=environment, stdin=stdin,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def log_calls(log):
    return [parse_fields(line) for line in log.read_text().splitlines()] if log.exists() else []


def test_processes_at_once_measure_each_kernel_once_and_merge_the_file(shim_env, tmp_path):
    log = tmp_path / "calls.log"
    cases = [f"{CASE} algo=0 ws=0 repeat=3", f"{OTHER} algo=0 ws=0 repeat=3"]
    processes = [spawn(shim_env, tmp_path / "dir", cases, log, FAKE_CUDNN_SLEEP_MS="1") for _ in range(4)]
    outputs = [p.communicate(timeout=120) for p in processes]
    assert all(p.returncode == 0 for p in processes), outputs
    for out, _ in outputs:
        assert [parse_fields(line)["exact"] for line in out.splitlines() if line.startswith("case ")] == ["1", "1"]
    # each measurement times algorithm 0 at b = 1 once: a warm-up and the timed runs
    first_candidates = [c for c in log_calls(log) if c["fn"] == "cudnnConvolutionForward" and c["n"] == "1"
                        and c["algo"] == "0"]
    assert len(first_candidates) == 2 * (1 + TIMED_RUNS)
    measured = sum(int(e.split("measured ")[1].split()[0]) for _, e in outputs
                   for e in e.splitlines() if "summary: online tuning:" in e)
    assert measured == 2
    read_plan(tmp_path / "dir" / FILE_NAME)
    assert file_kernels(tmp_path / "dir" / FILE_NAME) == {(key_of(CASE), "8"), (key_of(OTHER), "8")}


def test_a_process_killed_while_measuring_leaves_the_file_valid_and_the_kernel_free(shim_env, tmp_path):
    directory = tmp_path / "dir"
    first = shim_env.run([f"{OTHER} algo=0 ws=0"], env=online_env(directory))
    assert "measured 1 kernels" in report(first)
    before = (directory / FILE_NAME).read_text()
    log = tmp_path / "killed.log"
    process = spawn(shim_env, directory, [f"{CASE} algo=0 ws=0"], log, FAKE_CUDNN_SLEEP_MS="20")
    deadline = time.monotonic() + 30
    while len([c for c in log_calls(log) if c["fn"] == "cudnnConvolutionForward"]) < 5:
        assert time.monotonic() < deadline and process.poll() is None
        time.sleep(0.02)
    process.send_signal(signal.SIGKILL)
    process.communicate(timeout=30)
    assert (directory / FILE_NAME).read_text() == before
    read_plan(directory / FILE_NAME)
    after = shim_env.run([f"{CASE} algo=0 ws=0"], env=online_env(directory))
    assert "measured 1 kernels" in report(after), after.stderr  # not "claimed by another process"
    text = (directory / FILE_NAME).read_text()
    assert text.startswith(before) and key_of(CASE) in text
    read_plan(directory / FILE_NAME)


def test_a_malformed_file_is_warned_about_ignored_and_left_as_it_is(shim_env, tmp_path):
    (tmp_path / FILE_NAME).write_text("mucudnn-plan 1\ngpu x\nnonsense here\n")
    run = shim_env.run([f"{CASE} algo=0 ws={7 * 4 * WS_PER_SAMPLE}"], env=online_env(tmp_path))
    assert run.cases[0]["exact"] == "1"
    warnings = [line for line in run.shim_lines("warning") if FILE_NAME in line]
    assert len(warnings) == 1 and f"{FILE_NAME}:3:" in warnings[0], run.stderr
    assert (tmp_path / FILE_NAME).read_text() == "mucudnn-plan 1\ngpu x\nnonsense here\n"
    assert "measured 1 kernels" in report(run)
    _, pieces = measuring_and_pieces(run)
    assert [(c["n"], c["algo"]) for c in pieces] == [("4", "7"), ("4", "7")]  # tuned in memory


def test_a_file_of_another_gpu_is_ignored_and_left_as_it_is(shim_env, tmp_path):
    run = shim_env.run([f"{CASE} algo=0 ws=0"], env=online_env(tmp_path))
    text = (tmp_path / FILE_NAME).read_text().replace(f"gpu {FAKE_GPU_NAME}", "gpu Other GPU")
    (tmp_path / FILE_NAME).write_text(text)
    again = shim_env.run([f"{CASE} algo=0 ws=0", f"{OTHER} algo=0 ws=0"], env=online_env(tmp_path))
    assert "measured 2 kernels" in report(again) and "Other GPU" in again.stderr
    assert (tmp_path / FILE_NAME).read_text() == text
    assert "measured 1 kernels" in report(run)


def test_an_unusable_directory_is_one_warning_and_tuning_stays_in_memory(shim_env, tmp_path):
    (tmp_path / "file").write_text("")
    run = shim_env.run([f"{CASE} algo=0 ws={7 * 4 * WS_PER_SAMPLE}", f"{OTHER} algo=0 ws=0"],
                       env=online_env(tmp_path / "file" / "sub"))
    assert [c["exact"] for c in run.cases] == ["1", "1"]
    assert len([line for line in run.shim_lines("warning") if "MUCUDNN_ONLINE_DIR" in line]) == 1, run.stderr
    assert "measured 2 kernels (64 candidates timed)" in report(run)
    first_kernels_pieces = run.conv_calls()[(1 + TIMED_RUNS) * 32:][:2]  # after its measurement
    assert [(c["n"], c["algo"]) for c in first_kernels_pieces] == [("4", "7"), ("4", "7")]


def test_online_is_off_by_default_and_bad_values_are_warned(shim_env, tmp_path):
    off = shim_env.run([f"{CASE} algo=0 ws=0"], env={"MUCUDNN_ONLINE_DIR": str(tmp_path)})
    assert len(off.conv_calls()) == 2 and "online tuning" not in off.stderr
    bad = shim_env.run([f"{CASE} algo=0 ws=0"], env=online_env(tmp_path, MUCUDNN_ONLINE_BUDGET_MS="5s"))
    assert "MUCUDNN_ONLINE_BUDGET_MS='5s' is not valid" in bad.stderr
    assert "measured 1 kernels" in report(bad)  # the default budget


# -- the graph API (PyTorch's default path): tuned at an execution plan's first execution -----------

# CASE's kernel through the graph API on engine 3 (no TENSOR_CORE note: math fma, the same key),
# whose workspace 3 * 8 * 4096 bytes the framework allocates
GRAPH_CASE = "op=exec dir=fwd n=8 c=4 in=7x7 k=6 f=3x3 pad=1x1 engine=3 seed=3 alpha=1 beta=0 repeat=2"
ENGINE_WS = 3 * 8 * WS_PER_SAMPLE
ENGINE_TIMED_RUNS = TIMED_RUNS  # the engine is timed as the candidates are


def graph_result(run):
    result = run.cases[0]
    assert (result["status"], result["exact"], result["guard"], result["finalize"]) == ("0", "1", "ok", "0"), \
        run.stderr
    return result


def graph_pieces(run, repeat=2):
    """(b, algo) of the legacy convolutions run after the measurement, but the driver's references."""
    _, pieces = measuring_and_pieces(run)
    return [(int(c["n"]), int(c["algo"])) for c in pieces[:len(pieces) - (repeat - 1)]]


def test_on_the_graph_path_the_first_execution_measures_and_the_next_process_loads_the_front(shim_env, tmp_path):
    first = shim_env.run_graph([GRAPH_CASE], env=online_env(tmp_path))
    result = graph_result(first)
    assert int(result["ws"]) == ENGINE_WS  # pending: the framework allocates its engine's workspace
    assert "measured 1 kernels (32 candidates timed)" in report(first)
    measuring, _ = measuring_and_pieces(first)
    assert sorted({int(c["n"]) for c in measuring}) == [1, 2, 4, 8]  # micro-batches timed
    expected = sorted((p.batch, FWD_ALGOS.index(p.algo)) for p in modelled_point(CASE, ENGINE_WS).pieces)
    assert len(expected) > 1  # a micro-batched point
    # both executions run the point; the framework's engine runs only to be timed against it
    assert sorted(graph_pieces(first)) == sorted(expected * 2)
    assert len(first.graph_executions()) == 1 + ENGINE_TIMED_RUNS
    assert "runs the online front's point" in first.stderr
    assert file_kernels(tmp_path / FILE_NAME) == {(key_of(CASE), "8")}
    read_plan(tmp_path / FILE_NAME)

    second = shim_env.run_graph([GRAPH_CASE], env=online_env(tmp_path))
    result = graph_result(second)
    assert "measured 0 kernels (0 candidates timed)" in report(second)
    assert f"1 kernels from {tmp_path / FILE_NAME}" in report(second)
    # the loaded front's point is checked against the engine at the first execution, as measured
    assert int(result["ws"]) == ENGINE_WS
    assert len(second.graph_executions()) == 1 + ENGINE_TIMED_RUNS
    assert sorted((int(c["n"]), int(c["algo"])) for c in second.conv_calls()[:-2]) == sorted(expected * 2)


@pytest.mark.parametrize("fresh", [True, False], ids=["measuring", "loaded"])
def test_an_online_point_never_replaces_a_faster_framework_engine(shim_env, tmp_path, fresh):
    """The front holds legacy algorithms only: PyTorch's default path may pick an engine faster than
    all of them (ResNet-50 on an H200 ran 1.26x slower when the front's point replaced it)."""
    if not fresh:  # the file from a process whose engine was slow, then a process whose engine is fast
        shim_env.run_graph([GRAPH_CASE], env=online_env(tmp_path))
    run = shim_env.run_graph([GRAPH_CASE], env=online_env(tmp_path, FAKE_CUDNN_ENGINE_US="1"))
    graph_result(run)
    executions = run.graph_executions()
    assert [(e["engine"], e["n"]) for e in executions] == [("3", "8")] * (1 + ENGINE_TIMED_RUNS + 2)  # repeat=2
    assert "the framework's engine runs: as fast or faster" in run.stderr
    if fresh:
        assert "measured 1 kernels" in report(run)


def test_a_plan_finalized_after_the_kernel_was_tuned_takes_its_point_at_finalize(shim_env, tmp_path):
    """Two rounds of planning in one process: the second plan gets the front measured in the first."""
    run = shim_env.run_graph([GRAPH_CASE + " replan=2"], env=online_env(tmp_path))
    assert graph_result(run)
    assert "measured 1 kernels" in report(run)
    point = [line for line in run.stderr.splitlines() if "runs the online front's point" in line]
    assert len(point) == 2 and all(f"the engine's {ENGINE_WS};" in line for line in point), run.stderr


def test_when_measuring_is_refused_the_framework_engine_runs(shim_env, tmp_path):
    run = shim_env.run_graph([GRAPH_CASE], env=online_env(tmp_path, MUCUDNN_ONLINE_BUDGET_MS="0"))
    result = graph_result(run)
    assert int(result["ws"]) == ENGINE_WS
    assert "measured 0 kernels" in report(run) and "1 passed through (1 budget)" in report(run)
    assert [(e["engine"], e["n"]) for e in run.graph_executions()] == [("3", "8")] * 2
    assert len(run.conv_calls()) == 2  # the driver's references only


def test_a_kernel_claimed_by_another_process_runs_the_framework_engine_meanwhile(shim_env, tmp_path):
    import fcntl

    # a first run leaves the kernel's lock file (named by its hash) in its directory
    shim_env.run_graph([GRAPH_CASE], env=online_env(tmp_path / "first"))
    (lock_name,) = [p.name for p in (tmp_path / "first" / "locks").iterdir() if not p.name.endswith(".file.lock")]
    locks = tmp_path / "dir" / "locks"
    locks.mkdir(parents=True)
    with open(locks / lock_name, "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # another process measuring it
        run = shim_env.run_graph([GRAPH_CASE], env=online_env(tmp_path / "dir"))
    graph_result(run)
    assert "1 passed through (1 claimed by another process)" in report(run)
    assert [(e["engine"], e["n"]) for e in run.graph_executions()] == [("3", "8")] * 2
    assert len(run.conv_calls()) == 2


BWD_FILTER = ("op=exec dir=bwd_filter n=8 c=4 in=9x9 k=6 f=3x3 pad=1x1 stride=2x2 engine=1 seed=3 alpha=1 "
              "beta=0 repeat=2")
NONDETERMINISTIC_ALGOS = {0, 3}  # backward-filter's, in cuDNN and in the double


@pytest.mark.parametrize("engines_nondeterministic", [False, True])
def test_a_deterministic_framework_engine_gets_only_deterministic_points(shim_env, tmp_path,
                                                                         engines_nondeterministic):
    extra = {"FAKE_CUDNN_NONDETERMINISTIC_ENGINES": "all"} if engines_nondeterministic else {}
    extra["FAKE_CUDNN_ENGINE_US"] = "1000000"  # a slow engine: the front's points replace it
    run = shim_env.run_graph([BWD_FILTER], env=online_env(tmp_path, **extra))
    graph_result(run)
    assert "measured 1 kernels" in report(run)
    algos = {a for _, a in graph_pieces(run)}
    assert algos and all(a * b * WS_PER_SAMPLE <= 8 * WS_PER_SAMPLE for b, a in graph_pieces(run))
    if engines_nondeterministic:  # the fastest point within the engine's workspace: algorithm 3
        assert algos & NONDETERMINISTIC_ALGOS
    else:
        assert not algos & NONDETERMINISTIC_ALGOS


# -- the hard limit with online tuning: an engine over it is held to it, not refused -----------------


@pytest.mark.parametrize("limit", [2 * 4 * WS_PER_SAMPLE, 7 * 2 * WS_PER_SAMPLE])
def test_under_the_limit_an_engine_over_it_runs_the_fronts_point_within_the_limit(shim_env, tmp_path, limit):
    """Refusing the engine would leave the framework to its next configurations, down to a
    workspace-free engine; held to the limit, the kernel runs the online front's fastest point
    within it (micro-batched where that is fastest), and the framework allocates the limit."""
    run = shim_env.run_graph([GRAPH_CASE], env=online_env(tmp_path, MUCUDNN_WORKSPACE_LIMIT=str(limit)))
    result = graph_result(run)
    assert int(result["ws"]) == limit < ENGINE_WS
    assert "over the limit" in run.stderr and "the online front's point within it runs" in run.stderr
    # the engine never runs: it needs more workspace than the framework allocated
    assert run.graph_executions() == []
    expected = sorted((p.batch, FWD_ALGOS.index(p.algo)) for p in modelled_point(CASE, limit).pieces)
    assert sorted(graph_pieces(run)) == sorted(expected * 2)
    assert all(a * b * WS_PER_SAMPLE <= limit for b, a in graph_pieces(run))


def test_under_the_limit_without_a_front_the_fallback_runs_within_the_limit(shim_env, tmp_path):
    """Measuring refused (no budget): the engine cannot run in the limit's workspace, so the
    fallback algorithm runs undivided within it, every call, with the right result: cuDNN's
    heuristics' first within the limit (the double ranks algorithms by modelled time: the most
    workspace that fits), not the first in enum order (algorithm 0, the slowest)."""
    limit = 2 * 8 * WS_PER_SAMPLE
    run = shim_env.run_graph([GRAPH_CASE], env=online_env(tmp_path, MUCUDNN_WORKSPACE_LIMIT=str(limit),
                                                          MUCUDNN_ONLINE_BUDGET_MS="0"))
    result = graph_result(run)
    assert int(result["ws"]) == limit
    assert run.graph_executions() == []
    calls = [(int(c["n"]), int(c["algo"])) for c in run.conv_calls()[:-2]]  # the references are the last
    assert calls == [(8, 2), (8, 2)], calls


HOLD_CASE = GRAPH_CASE.replace("n=8", "n=64")      # engine 3's workspace: 3 * 64 samples' worth


def test_the_hold_holds_an_engine_to_it_but_never_below_8_samples_worth(shim_env, tmp_path):
    """MUCUDNN_WORKSPACE_HOLD (run --offload's): held to the hold where the engine's workspace
    for 8 samples is less; the framework allocates that and the front's point within it runs."""
    hold = 30 * WS_PER_SAMPLE                         # over 3 * 8 samples' worth: the hold binds
    run = shim_env.run_graph([HOLD_CASE], env=online_env(tmp_path, MUCUDNN_WORKSPACE_HOLD=str(hold)))
    result = graph_result(run)
    assert int(result["ws"]) == hold
    assert "over the hold" in run.stderr and run.graph_executions() == []
    pieces = graph_pieces(run)
    assert pieces and all(a * b * WS_PER_SAMPLE <= hold for b, a in pieces)
    # below 8 samples' worth (3 * 8 * 4096 bytes), the engine is held to 8 samples' worth
    run = shim_env.run_graph([HOLD_CASE], env=online_env(tmp_path / "low", MUCUDNN_WORKSPACE_HOLD="1"))
    assert int(graph_result(run)["ws"]) == 3 * 8 * WS_PER_SAMPLE
    # at N = 8, 8 samples' worth is the engine's own: the hold does not bind
    run = shim_env.run_graph([GRAPH_CASE], env=online_env(tmp_path / "small", MUCUDNN_WORKSPACE_HOLD="1"))
    assert int(graph_result(run)["ws"]) == ENGINE_WS and "over the hold" not in run.stderr


def test_without_online_tuning_the_limit_still_refuses_an_engine_over_it(shim_env, tmp_path):
    limit = 2 * 4 * WS_PER_SAMPLE
    run = shim_env.run_graph([GRAPH_CASE], env={"MUCUDNN_WORKSPACE_LIMIT": str(limit)})
    assert run.cases[0]["finalize"] != "0"  # refused: the framework would take its next configuration


# -- regressions found in review ---------------------------------------------------------------------


def test_a_stream_whose_capture_status_cannot_be_read_is_not_measured_on(shim_env, tmp_path):
    """cuStreamIsCapturing fails (CUDA_ERROR_STREAM_CAPTURE_IMPLICIT) on the legacy stream while a
    blocking stream captures: measuring there (events, synchronisation) would join that capture, so
    a status that cannot be read counts as a capture: the call passes through, nothing measured."""
    run = shim_env.run([f"{CASE} algo=0 ws=0"], env=online_env(tmp_path, FAKE_CUDA_CALLER_CAPTURING="implicit"))
    assert (run.cases[0]["status"], run.cases[0]["exact"]) == ("0", "1"), run.stderr
    assert len(run.conv_calls()) == 2, run.stderr  # the call, undivided, and the reference
    assert "online tuning: the stream is being captured" in run.stderr
    assert "measured 1 kernels" not in run.stderr


def test_on_the_graph_path_a_capture_defers_the_engine_comparison_instead_of_settling_it(shim_env, tmp_path):
    """A pending plan of a kernel with a front times the framework's engine at its first
    execution; inside a capture it cannot (no synchronising there), which is "not now", not "never":
    the engine runs the call and a later execution compares, as docs/shim.md says for captures."""
    shim_env.run_graph([GRAPH_CASE], env=online_env(tmp_path))  # the file with the kernel's front
    run = shim_env.run_graph([GRAPH_CASE], env=online_env(tmp_path, FAKE_CUDA_CALLER_CAPTURING="1"))
    graph_result(run)
    assert "the framework's engine runs: it cannot be timed here" not in run.stderr, run.stderr
    assert "passthrough on the graph path (online tuning: the stream is being captured)" in run.stderr
    assert [(e["engine"], e["n"]) for e in run.graph_executions()] == [("3", "8")] * 2  # repeat=2, untimed


def test_a_plan_file_lock_held_for_long_does_not_hang_the_call(shim_env, tmp_path):
    """The merge waits for the file's lock a bounded time: a holder that never lets go (a stopped
    process, or a child forked while the lock was held, which keeps it) must not hang the caller's
    convolution. The kernel then runs its front from memory, unsaved."""
    import fcntl

    locks = tmp_path / "locks"
    locks.mkdir()
    with open(locks / f"{FILE_NAME}.file.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        started = time.monotonic()
        run = shim_env.run([f"{CASE} algo=0 ws={7 * 4 * WS_PER_SAMPLE}"], env=online_env(tmp_path), timeout=30)
        assert time.monotonic() - started < 20
    assert (run.cases[0]["status"], run.cases[0]["exact"]) == ("0", "1"), run.stderr
    assert "measured 1 kernels" in report(run)
    assert [line for line in run.shim_lines("warning") if "held by another process" in line], run.stderr
    _, pieces = measuring_and_pieces(run)
    assert [(c["n"], c["algo"]) for c in pieces] == [("4", "7"), ("4", "7")]  # the front, in memory
    assert not (tmp_path / FILE_NAME).exists()


def test_kernels_of_a_given_plan_are_not_reported_as_from_the_online_file(shim_env, tmp_path):
    """With MUCUDNN_PLAN the plan's kernels run from that plan: the exit report's "kernels from FILE"
    names the online file, so it counts only kernels that came from it (here: none, it does not exist)."""
    from shim_harness import plan_line

    plan = shim_env.write_plan([plan_line(CASE, [(4, "winograd_nonfused", "fma")] * 2)])
    run = shim_env.run([f"{CASE} algo=0 ws={7 * 4 * WS_PER_SAMPLE}", f"{OTHER} algo=0 ws=0"], plan=plan,
                       env=online_env(tmp_path))
    assert [c["exact"] for c in run.cases] == ["1", "1"], run.stderr
    assert "measured 1 kernels" in report(run)  # OTHER, which the plan lacks
    assert f"0 kernels from {tmp_path / FILE_NAME}" in report(run), report(run)


def test_past_the_budget_a_kernel_another_process_measured_is_read_not_passed(shim_env, tmp_path):
    """The budget bounds measuring; reading a front another process of the node wrote to the file
    costs nothing, so a kernel found there runs it even past the budget (each kernel is measured
    once per node). Here the file is not loaded at start (MUCUDNN_PLAN is set, without the kernel)."""
    from shim_harness import plan_line

    shim_env.run([f"{CASE} algo=0 ws=0"], env=online_env(tmp_path))  # "another process"
    plan = shim_env.write_plan([plan_line(OTHER, [(8, "implicit_gemm", "fma")])])
    run = shim_env.run([f"{CASE} algo=0 ws={7 * 4 * WS_PER_SAMPLE}"], plan=plan,
                       env=online_env(tmp_path, MUCUDNN_ONLINE_BUDGET_MS="0"))
    assert run.cases[0]["exact"] == "1", run.stderr
    assert "measured 0 kernels" in report(run) and f"1 kernels from {tmp_path / FILE_NAME}" in report(run)
    assert report(run).endswith("0 passed through")
    assert [(c["n"], c["algo"]) for c in run.conv_calls()[:-1]] == [("4", "7"), ("4", "7")]


def test_with_no_memory_free_what_fits_the_callers_workspace_is_still_measured(shim_env, tmp_path):
    """Scratch workspace comes from the memory free (less a 256 MiB margin); the caller's own
    workspace is free until the real call, so its algorithm, and whatever else fits it, is measured
    and can run: the point is never one of only the workspace-free algorithms."""
    workspace = 7 * 8 * WS_PER_SAMPLE  # the caller's winograd_nonfused (7) at N = 8
    full = {"FAKE_CUDA_TOTAL_BYTES": str(1 << 30), "FAKE_CUDA_USED_BYTES": str((1 << 30) - (1 << 20))}
    run = shim_env.run([f"{CASE} algo=7 ws={workspace}"], env=online_env(tmp_path, **full))
    assert (run.cases[0]["status"], run.cases[0]["exact"]) == ("0", "1"), run.stderr
    assert "measured 1 kernels (32 candidates timed)" in report(run)
    _, pieces = measuring_and_pieces(run)
    chosen = [(int(c["n"]), int(c["algo"])) for c in pieces] or [(8, 7)]  # undivided: the caller's own
    expected = modelled_point(CASE, workspace)
    assert sorted(chosen) == sorted((p.batch, FWD_ALGOS.index(p.algo)) for p in expected.pieces)
