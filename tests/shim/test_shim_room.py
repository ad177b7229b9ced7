"""The room (shim/src/room.c): under memory pressure a front plan's point is chosen within the
memory free at that moment (and, with MUCUDNN_MEMORY_BUDGET, within the budget less what is in
use), less MUCUDNN_ROOM_MARGIN; with plenty of memory nothing changes.

The fake driver's device has $FAKE_CUDA_TOTAL_BYTES, of which $FAKE_CUDA_USED_BYTES are taken by
others: the free memory is their difference. Workspaces follow the double's model (a * n * 4096
bytes for algorithm or engine a); the framework's engine in BASE is engine 1: 8 * 4096 bytes.
"""

from __future__ import annotations

import pytest

from shim_harness import key_of
from test_shim_front import CASE, LEGACY_POINTS, WS, front_plan, graph_front, pieces_run
from test_shim_graph import BASE

GRAPH_CASE = f"{BASE} dir=fwd alpha=1 beta=0"
GIB = 1 << 30
MIB = 1 << 20

FAST = (2 * 4 * WS, 0.6, "4:eng2:fma 4:eng2:fma")                      # within engine 1's workspace
SMALLER = (2 * 2 * WS, 0.9, "2:eng2:fma 2:eng2:fma 2:eng2:fma 2:eng2:fma")
FREE = (0, 2.0, "8:implicit_gemm:fma")
GRAPH_POINTS = [FAST, SMALLER, FREE]


def budget_left(left: int) -> dict[str, str]:
    """A 1 GiB device of which half is in use, under a budget that leaves `left` bytes (margin 0)."""
    return {**free_memory(GIB // 2), "MUCUDNN_MEMORY_BUDGET": str(GIB // 2 + left)}


def free_memory(free: int, margin: int | None = 0) -> dict[str, str]:
    """A 1 GiB device with `free` bytes free (and the margin, unless None: the default)."""
    env = {"FAKE_CUDA_TOTAL_BYTES": str(GIB), "FAKE_CUDA_USED_BYTES": str(GIB - free),
           "MUCUDNN_LOG_LEVEL": "info"}
    if margin is not None:
        env["MUCUDNN_ROOM_MARGIN"] = str(margin)
    return env


def run_graph(shim_env, env, points=GRAPH_POINTS):
    run = shim_env.run_graph([GRAPH_CASE], plan=graph_front(shim_env, GRAPH_CASE, points), env=env)
    result = run.cases[0]
    assert (result["status"], result["exact"], result["guard"]) == ("0", "1", "ok"), run.stderr
    return run


def chosen(run):
    """The workspace the finalized plan reports, and (n, engine) of the graph-API pieces it ran."""
    return int(run.cases[0]["ws"]), [(e["n"], e["engine"]) for e in run.graph_executions()]


def degraded_lines(run):
    return [line for line in run.shim_lines("info") if "degraded for lack of memory" in line]


FAST_RUN = (FAST[0], [("4", "2")] * 2)
SMALLER_RUN = (SMALLER[0], [("2", "2")] * 4)
FREE_RUN = (0, [])  # implicit_gemm undivided, a legacy piece: no graph-API execution


@pytest.mark.parametrize("free, expected", [
    (FAST[0], FAST_RUN),           # the fastest point fits exactly: as before
    (FAST[0] - 1, SMALLER_RUN),    # the fastest within the room
    (SMALLER[0] - 1, FREE_RUN),    # only the workspace-free point fits
])
def test_under_pressure_finalize_picks_the_fastest_point_within_the_room(shim_env, free, expected):
    run = run_graph(shim_env, free_memory(free))
    assert chosen(run) == expected
    if expected == FAST_RUN:
        assert not degraded_lines(run)
        return
    key = key_of(GRAPH_CASE + " math=fma")
    assert degraded_lines(run) == [
        f"mucudnn: info: {key} N=8: degraded for lack of memory: a point of {expected[0]} bytes of "
        f"workspace instead of {FAST[0]} (room {free}: free {free}, budget none, margin 0)"]
    assert "mucudnn: info: 1 kernels got a front point of less workspace" in run.stderr


def test_when_no_point_fits_the_room_the_smallest_is_chosen(shim_env):
    run = run_graph(shim_env, free_memory(100), points=[FAST, SMALLER])
    assert chosen(run) == SMALLER_RUN and len(degraded_lines(run)) == 1


def test_never_above_the_framework_engine_or_the_hard_limit_whatever_the_room(shim_env):
    bigger = (3 * 8 * WS, 0.3, "8:eng3:fma")  # faster, but needs more than engine 1
    run = run_graph(shim_env, {"MUCUDNN_WORKSPACE_LIMIT": str(SMALLER[0])}, points=[bigger, *GRAPH_POINTS])
    assert chosen(run) == SMALLER_RUN and not degraded_lines(run)


@pytest.mark.parametrize("env", [
    {},                                                      # the fake device: 80 GiB free
    {**budget_left(100), "FAKE_CUDA_NO_CONTEXT": "1"},      # no context: the room is unknown
    {**free_memory(100), "MUCUDNN_ROOM": "0"},              # turned off
    {"FAKE_CUDA_USED_BYTES": str(10 * GIB), "MUCUDNN_MEMORY_BUDGET": "20GiB"},  # 10 GiB left
], ids=["plenty", "no-context", "room-off", "budget-with-room"])
def test_with_plenty_of_memory_or_no_room_the_choice_is_as_before(shim_env, env):
    run = run_graph(shim_env, {**env, "MUCUDNN_LOG_LEVEL": "info"})
    assert chosen(run) == FAST_RUN and not degraded_lines(run)
    assert "kernels got a front point" not in run.stderr


@pytest.mark.parametrize("allocator, expected", [
    (f"{GIB // 2} {GIB // 2}", SMALLER_RUN),            # all it holds in use: 20000 bytes left
    (f"{GIB // 4} {GIB // 4}", FAST_RUN),               # it uses a quarter: the budget left grows
    (f"{GIB // 2} {GIB // 2 - 2 * FAST[0]}", FAST_RUN),  # what its cache holds free is its to use
    ("fail", SMALLER_RUN),                              # it cannot say: the device's view
    (f"{GIB // 4} {GIB // 2}", SMALLER_RUN),            # more allocated than held: not believed
], ids=["all-used", "quarter-used", "cached", "fails", "inconsistent"])
def test_the_allocators_own_view_sets_the_room_under_its_budget(shim_env, allocator, expected):
    """A 1 GiB device, half of it in use, under a budget that leaves 20000 bytes of the device's
    view; the framework's allocator says what it holds and uses (mucudnn_set_allocator)."""
    run = run_graph(shim_env, {**budget_left(20000), "DRIVER_ALLOCATOR": allocator})
    assert chosen(run) == expected
    if allocator == f"{GIB // 2} {GIB // 2}":
        assert degraded_lines(run)[0].endswith(
            f"(room 20000: free {GIB // 2}, budget 20000 left of the allocator's, 0 free in its "
            "cache, margin 0)")
    if allocator == "fail":
        assert degraded_lines(run)[0].endswith("(room 20000: free 536870912, budget 20000 left, margin 0)")


def test_the_allocators_cache_counts_as_free_memory_without_a_budget(shim_env):
    # 100 bytes free on the device, but the allocator holds 2 FAST points' worth free
    run = run_graph(shim_env, {**free_memory(100), "DRIVER_ALLOCATOR": f"{GIB // 2} {GIB // 2 - FAST[0]}"})
    assert chosen(run) == FAST_RUN and not degraded_lines(run)
    # holding less free than the fastest point needs: degraded within it, and said so
    run = run_graph(shim_env, {**free_memory(100), "DRIVER_ALLOCATOR": f"{GIB // 2} {GIB // 2 - SMALLER[0]}"})
    assert chosen(run) == SMALLER_RUN
    room = 100 + SMALLER[0]
    assert degraded_lines(run)[0].endswith(
        f"(room {room}: free {room}, budget none; the allocator's cache {SMALLER[0]} free, margin 0)")


def test_the_allocator_is_asked_only_where_the_devices_view_is_too_small(shim_env):
    """Its view is never smaller, and asking it costs a call into the framework (PyTorch's takes
    the GIL): a workspace that fits the device's view does not ask."""
    fits = run_graph(shim_env, {**budget_left(FAST[0]), "DRIVER_ALLOCATOR": f"{GIB // 4} {GIB // 4}"})
    assert chosen(fits) == FAST_RUN and "driver: allocator asked 0 times" in fits.stderr
    short = run_graph(shim_env, {**budget_left(FAST[0] - 1), "DRIVER_ALLOCATOR": f"{GIB // 4} {GIB // 4}"})
    assert chosen(short) == FAST_RUN and "driver: allocator asked 0 times" not in short.stderr


def test_the_allocators_view_also_lets_an_engine_through(shim_env):
    run = shim_env.run_graph([HEUR_CASE], plan=other_kernels_plan(shim_env),
                             env={**budget_left(100), "DRIVER_ALLOCATOR": f"{GIB // 4} {GIB // 4}"})
    assert landed(run) == ("3", 3 * 8 * WS) and not refused_lines(run)


def test_a_budget_below_use_leaves_the_room_the_budget_has_left(shim_env):
    """80 GiB free on the device, but the budget is 10 GiB and 10 GiB - 20000 bytes are in use."""
    used = 10 * GIB - 20000
    run = run_graph(shim_env, {"FAKE_CUDA_USED_BYTES": str(used), "MUCUDNN_MEMORY_BUDGET": "10GiB",
                               "MUCUDNN_ROOM_MARGIN": "0", "MUCUDNN_LOG_LEVEL": "info"})
    assert chosen(run) == SMALLER_RUN
    (line,) = degraded_lines(run)
    assert f"(room 20000: free {80 * GIB - used}, budget 20000 left, margin 0)" in line


@pytest.mark.parametrize("margin, expected", [
    (None, SMALLER_RUN),     # the default 64 MiB: the room is 20000 bytes
    ("0", FAST_RUN),         # none: the room is 64 MiB + 20000 bytes
    ("64M", SMALLER_RUN),    # malformed (a bare M): warned, the default
])
def test_the_margin_is_kept_free_and_a_bad_one_is_warned_and_defaulted(shim_env, margin, expected):
    env = free_memory(64 * MIB + 20000, margin=None)
    if margin is not None:
        env["MUCUDNN_ROOM_MARGIN"] = margin
    run = run_graph(shim_env, env)
    assert chosen(run) == expected
    warnings = [line for line in run.shim_lines("warning") if "MUCUDNN_ROOM_MARGIN" in line]
    if margin == "64M":
        assert warnings == ["mucudnn: warning: MUCUDNN_ROOM_MARGIN='64M' is not valid (a bare K, M, G or T "
                            "is ambiguous: write KiB, MiB, GiB, TiB (powers of 2) or KB, MB, GB, TB (powers "
                            "of 10); expected bytes, or a number with B, KiB, MiB, GiB, TiB, KB, MB, GB or "
                            "TB); using the default"]
    else:
        assert not warnings


# -- legacy queries: the points within the room first ----------------------------------------------

def offered(run):
    return [p.split(":") for p in run.cases[0]["perf"].split(",")]


@pytest.mark.parametrize("op", ["get_v7", "find", "find_ex ws=1048576"])
def test_under_pressure_queries_offer_the_points_within_the_room_first(shim_env, op):
    query = f"op={op} {CASE} requested=16"
    plan = front_plan(shim_env, key_of(query), LEGACY_POINTS)
    run = shim_env.run([query], plan=plan, env=free_memory(2 * 4 * WS))
    perf = offered(run)
    # within the room (fastest first), then the point over it; then cuDNN's results
    assert [(p[2], p[3]) for p in perf[:3]] == [("1", str(2 * 4 * WS)), ("2", "0"), ("0.8", str(2 * 8 * WS))]
    without = shim_env.run([query], preload=False).cases[0]["perf"].split(",")
    assert [":".join(p) for p in perf[3:]] == without[:len(perf) - 3]
    assert len([line for line in run.stderr.splitlines() if "degraded for lack of memory" in line]) == 1


def test_with_plenty_of_memory_queries_offer_the_points_fastest_first(shim_env):
    query = f"op=get_v7 {CASE} requested=16"
    plan = front_plan(shim_env, key_of(query), LEGACY_POINTS)
    perf = offered(shim_env.run([query], plan=plan, env=free_memory(2 * 8 * WS)))
    assert [p[3] for p in perf[:3]] == [str(2 * 8 * WS), str(2 * 4 * WS), "0"]


def test_a_framework_trying_the_results_in_order_lands_on_a_point_within_the_room(shim_env):
    """PyTorch's legacy path allocates the first result's memory: under pressure, a point that
    fits, which the call then runs (legacy execution itself is unchanged)."""
    query = f"op=get_v7 {CASE} requested=16"
    plan = front_plan(shim_env, key_of(query), LEGACY_POINTS)
    env = free_memory(2 * 4 * WS)
    algo, _, _, memory, *_ = offered(shim_env.run([query], plan=plan, env=env))[0]
    run = shim_env.run([f"op=conv {CASE} algo={algo} ws={memory}"], plan=plan, env=env)
    assert run.cases[0]["exact"] == "1" and pieces_run(run) == [("4", "2")] * 2


# -- finalize: an engine over the room is refused where no point runs ------------------------------

HEUR_CASE = f"{BASE.replace('engine=1', 'engine=heur')} dir=fwd alpha=1 beta=0"


def other_kernels_plan(shim_env):
    """A plan without HEUR_CASE's kernel: loading it names the GPU, which loads the fake driver,
    as a CUDA process always has its driver (the graph driver alone never loads it)."""
    return graph_front(shim_env, HEUR_CASE.replace("k=6", "k=2"), [FREE])


def refused_lines(run):
    return [line for line in run.shim_lines("info") if "refused for lack of memory" in line]


def landed(run):
    """The engine the framework-like heuristics walk landed on, and its workspace."""
    result = run.cases[0]
    assert (result["status"], result["exact"], result["guard"]) == ("0", "1", "ok"), run.stderr
    return result["engine"], int(result["ws"])


@pytest.mark.parametrize("free, expected", [
    (2 * 8 * WS, ("2", 2 * 8 * WS)),      # engine 3 over the room, engine 2 fits exactly
    (2 * 8 * WS - 1, ("1", 8 * WS)),      # engines 3 and 2 over it
    (0, ("0", 0)),                        # nothing free: the workspace-free engine is never refused
])
def test_without_a_plan_an_engine_over_the_room_is_refused_and_the_framework_takes_a_smaller(
        shim_env, free, expected):
    # two rounds of planning: each kernel's refusal is said once at info
    run = shim_env.run_graph([HEUR_CASE + " replan=2"], plan=other_kernels_plan(shim_env), env=budget_left(free))
    assert landed(run) == expected
    lines = refused_lines(run)
    assert lines[0] == (f"mucudnn: info: {key_of(HEUR_CASE + ' math=fma')} N=8: an engine of {3 * 8 * WS} bytes "
                        f"of workspace refused for lack of memory, the framework takes its next configuration "
                        f"(room {free}: free {GIB // 2}, budget {free} left, margin 0)")
    # engine 2 carries a TENSOR_CORE note, so its plan is another kernel (math=default); engines 3
    # and 1 are one kernel (math=fma), said once
    refused = [engine for engine in "321" if int(engine) * 8 * WS > free]
    kernels = {"default" if engine == "2" else "fma" for engine in refused}
    assert len(lines) == len(kernels)
    if "2" in refused:
        assert lines[1].startswith(f"mucudnn: info: {key_of(HEUR_CASE + ' math=default')} N=8: an engine of "
                                   f"{2 * 8 * WS} bytes")
    assert (f"mucudnn: info: {len(kernels)} kernels had an engine configuration refused for lack of free memory"
            in run.stderr)


@pytest.mark.parametrize("env", [
    {},                                                      # the fake device: 80 GiB free
    {**free_memory(100), "FAKE_CUDA_NO_CONTEXT": "1"},      # no context: the room is unknown
    {**budget_left(100), "MUCUDNN_ROOM": "0"},              # turned off
    free_memory(100),  # no budget: the device's free memory alone (PyTorch's cache counts as used)
], ids=["plenty", "no-context", "room-off", "no-budget"])
def test_with_plenty_of_memory_or_no_room_no_engine_is_refused(shim_env, env):
    run = shim_env.run_graph([HEUR_CASE], plan=other_kernels_plan(shim_env), env={**env, "MUCUDNN_LOG_LEVEL": "info"})
    assert landed(run) == ("3", 3 * 8 * WS) and not refused_lines(run)
    assert "refused for lack of free memory" not in run.stderr


def test_a_plan_the_engine_cannot_use_leaves_the_engine_to_the_room(shim_env):
    """A front plan whose only point needs more than the framework's engine 1 is not used: the
    engine runs undivided, so the room refuses it like an unplanned one."""
    bigger = (3 * 8 * WS, 0.3, "8:eng3:fma")
    plan = graph_front(shim_env, GRAPH_CASE, [bigger])
    run = shim_env.run_graph([GRAPH_CASE], plan=plan, env=budget_left(100))
    result = run.cases[0]
    assert (result["finalize"], result["status"]) == ("3000", "-1"), run.stderr
    assert len(refused_lines(run)) == 1
    # with a point attached (the smallest, over the room), nothing is refused
    run = run_graph(shim_env, budget_left(100), points=[FAST, SMALLER])
    assert not refused_lines(run)


@pytest.mark.parametrize("slack, point, expected", [
    (None, FAST, FAST_RUN),          # unset: the fastest point, as before
    ("49", FAST, FAST_RUN),          # SMALLER's 0.9 ms is 50 % over FAST's 0.6
    ("51", SMALLER, SMALLER_RUN),    # within 51 %: the point of less workspace
    ("240", FREE, FREE_RUN),         # FREE's 2.0 ms is 233 % over: within, and the least workspace
    ("0", FAST, FAST_RUN),           # no point of less workspace is as fast
])
def test_workspace_slack_takes_the_point_of_least_workspace_within_it(shim_env, slack, point, expected):
    env = free_memory(GIB)
    if slack is not None:
        env["MUCUDNN_WORKSPACE_SLACK"] = slack
    run = run_graph(shim_env, env)
    assert chosen(run) == expected
    lean = [line for line in run.shim_lines("info") if "MUCUDNN_WORKSPACE_SLACK" in line]
    if point is FAST:
        assert not lean
        return
    key = key_of(GRAPH_CASE + " math=fma")
    assert lean == [f"mucudnn: info: {key} N=8: a point of {point[0]} bytes of workspace ({point[1]:.4f} ms) "
                    f"rather than the fastest's {FAST[0]} (0.6000 ms): within MUCUDNN_WORKSPACE_SLACK's "
                    f"{slack} %"]


def test_workspace_slack_says_so_once_per_kernel(shim_env):
    env = {**free_memory(GIB), "MUCUDNN_WORKSPACE_SLACK": "51"}
    run = shim_env.run_graph([GRAPH_CASE, GRAPH_CASE],
                             plan=graph_front(shim_env, GRAPH_CASE, GRAPH_POINTS), env=env)
    assert [(c["status"], c["ws"]) for c in run.cases] == [("0", str(SMALLER[0]))] * 2, run.stderr
    assert len([line for line in run.shim_lines("info") if "MUCUDNN_WORKSPACE_SLACK" in line]) == 1
