"""Lent workspace (mucudnn_lend_workspace, docs/shim.md "Lent workspace"): a convolution whose
engine online tuning holds under its workspace runs its front's fastest point within a buffer the
framework lends, on the lending thread and stream only, and computes the same convolution.

The double's modelled times and workspaces are test_shim_online.py's (algorithm a at b samples:
a * b * 4096 bytes; faster the higher a).
"""

from __future__ import annotations

from shim_harness import WS_PER_SAMPLE
from test_shim_online import GRAPH_CASE, graph_result, model_ms, online_env

CASE = GRAPH_CASE.replace("n=8", "n=64")        # engine 3's workspace: 3 * 64 samples' worth
ENGINE_WS = 3 * 64 * WS_PER_SAMPLE
HOLD = 30 * WS_PER_SAMPLE                        # over 8 samples' worth: the hold binds
LEND = 7 * 64 * WS_PER_SAMPLE                    # algorithm 7 undivided fits


def pieces_run(run, repeat=2):
    """(b, algo, ws) of the convolutions the executions ran: after the measurement's (a warm-up
    and 3 timed runs each, N = 64 and the powers of two below: every call with more than the
    pieces' smallest b is measuring), before the driver's references (the last `repeat`)."""
    calls = run.conv_calls()[:-repeat]
    line = next(line for line in run.stderr.splitlines() if "summary: online tuning:" in line)
    measured = 4 * int(line.split("(")[1].split()[0])
    return [(int(c["n"]), int(c["algo"]), int(c["ws"])) for c in calls[measured:]]


def modelled(pieces) -> float:
    return sum(model_ms(CASE.replace("op=exec", "op=conv"), b, a) for b, a, _ in pieces)


def held_run(shim_env, tmp_path, case=CASE, **env):
    run = shim_env.run_graph([case], env=online_env(tmp_path, MUCUDNN_WORKSPACE_HOLD=str(HOLD), **env))
    result = graph_result(run)  # the same convolution as the reference, nothing written past a buffer
    assert int(result["ws"]) == HOLD < ENGINE_WS, run.stderr
    return run


def test_a_held_convolution_runs_a_faster_point_in_lent_workspace(shim_env, tmp_path):
    held = pieces_run(held_run(shim_env, tmp_path / "held"))
    run = held_run(shim_env, tmp_path / "lent", f"{CASE} lend={LEND}")
    lent = pieces_run(run)
    assert held and all(ws == HOLD and a * b * WS_PER_SAMPLE <= HOLD for b, a, ws in held)
    assert lent and all(ws == LEND and a * b * WS_PER_SAMPLE <= LEND for b, a, ws in lent)
    # both executions run the lent point, which the front keeps only where 2 % faster
    assert modelled(lent) < 0.98 * modelled(held), (held, lent)
    assert any(a * b * WS_PER_SAMPLE > HOLD for b, a, _ in lent)
    assert run.stderr.count("in lent workspace (") == 1, run.stderr   # said once per kernel
    assert "; 2 calls in lent workspace" in run.stderr                 # the exit report


def test_a_lend_from_another_thread_or_on_another_stream_is_not_used(shim_env, tmp_path):
    """Invariant 2: the framework frees the buffer after withdrawing it on the lending thread,
    so only that thread's work on that stream, enqueued before, may use it."""
    held = pieces_run(held_run(shim_env, tmp_path / "held"))
    for name, extra in {"thread": "lendfrom=other", "stream": "lendstream=other"}.items():
        run = held_run(shim_env, tmp_path / name, f"{CASE} lend={LEND} {extra}")
        assert pieces_run(run) == held and "in lent workspace" not in run.stderr, name


def test_a_lend_no_larger_than_the_hold_changes_nothing(shim_env, tmp_path):
    held = pieces_run(held_run(shim_env, tmp_path / "held"))
    run = held_run(shim_env, tmp_path / "small", f"{CASE} lend={HOLD}")
    assert pieces_run(run) == held and "in lent workspace" not in run.stderr


def test_a_convolution_that_is_not_held_does_not_use_a_lend(shim_env, tmp_path):
    """The framework allocated its engine's workspace: the engine, or the front's point within it,
    runs there as without a lend."""
    run = shim_env.run_graph([f"{CASE} lend={LEND}"], env=online_env(tmp_path))
    assert int(graph_result(run)["ws"]) == ENGINE_WS
    assert "in lent workspace" not in run.stderr
    assert all(ws == ENGINE_WS for _, _, ws in pieces_run(run))


def test_the_largest_held_engine_workspace_is_told(shim_env, tmp_path):
    """What a framework sizes its lends by (mucudnn_held_workspace): the driver's exit line."""
    run = held_run(shim_env, tmp_path, f"{CASE} lend={LEND}")
    assert f"driver: held workspace {ENGINE_WS}, lent calls 2" in run.stderr, run.stderr


def test_a_lend_never_takes_a_convolution_past_the_hard_limit(shim_env, tmp_path):
    """MUCUDNN_WORKSPACE_LIMIT is the largest workspace any convolution gets: held under it, a
    convolution runs no lent point above it."""
    limit = {"MUCUDNN_WORKSPACE_LIMIT": str(HOLD)}
    run = shim_env.run_graph([f"{CASE} lend={LEND}"], env=online_env(tmp_path, **limit))
    assert int(graph_result(run)["ws"]) == HOLD
    assert "in lent workspace" not in run.stderr
    assert pieces_run(run) and all(a * b * WS_PER_SAMPLE <= HOLD for b, a, _ in pieces_run(run))
