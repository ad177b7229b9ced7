"""benchmarks/offload.py on the CPU: the smallest-budget search and the automatic sweep against fake
runs (a function budget -> row), the driver's order and time budget with run_config faked, the
tables and plot series written from those rows, per-block checkpointing of the 3-D U-Net, and how
a worker's output becomes a row."""

from __future__ import annotations

import argparse
import json
import math
import os

import pytest

from benchmarks import offload
from benchmarks.budget_plot import plot_series
from benchmarks.offload import (GiB, auto_sweep_budgets, markdown, measure_model,
                                min_budget_search, run_config)
from benchmarks.pressure import Budget

BASE = {"model": "unet3d", "batch": 2, "method": "pytorch", "budget_bytes": None, "status": "ok",
        "step_ms": 400.0, "peak_allocated": 10.2 * GiB, "peak_reserved": 11.6 * GiB,
        "device_memory": 80 * GiB, "part": "table"}


def args_of(*argv):
    """The driver's options as its parser makes them."""
    parsed = {}

    def capture(args):
        parsed["args"] = args

    original = offload.driver
    offload.driver = capture
    try:
        offload.main(["driver", *argv])
    finally:
        offload.driver = original
    return parsed["args"]


def fake_row(method, budget, status, step_ms=500.0, **extra):
    row = {"model": "unet3d", "batch": 2, "config": offload.config_name(method, budget),
           "method": method, "budget_bytes": budget, "status": status, **extra}
    if status == "ok":
        row.update(step_ms=step_ms, peak_reserved=budget or 11.6 * GiB,
                   peak_allocated=(budget or 11.6 * GiB) * 0.9)
    return row


def threshold_runner(method, threshold_gib, calls, below="oom"):
    def run_probe(budget):
        calls.append(budget / GiB)
        if budget / GiB >= threshold_gib - 1e-9:
            return fake_row(method, budget, "ok", step_ms=400 + 1000 / (budget / GiB))
        return fake_row(method, budget, below)
    return run_probe


# -- the search ------------------------------------------------------------------------------------

@pytest.mark.parametrize("threshold", [8.1, 9.0, 11.6, 14.2])
def test_pytorch_minimum_is_the_threshold_rounded_up_to_the_grid(threshold):
    calls = []
    row = min_budget_search("pytorch", threshold_runner("pytorch", threshold, calls), BASE,
                            args_of())
    expected = math.ceil(threshold / 0.25 - 1e-9) * 0.25
    assert row["part"] == "min" and row["status"] == "ok"
    assert row["min_budget_gib"] == pytest.approx(expected)
    assert row["budget_bytes"] == round(expected * GiB)
    assert calls[0] == pytest.approx(11.75)   # PyTorch's peak reserved, up to the grid, first
    assert all(abs(c / 0.25 - round(c / 0.25)) < 1e-9 for c in calls)
    assert len(calls) == len(set(calls))
    # every probe: budget, status, step time where it trained
    probes = row["search"]["probes"]
    assert [p["budget_gib"] for p in probes] == pytest.approx(calls)
    for probe in probes:
        assert probe["status"] == ("ok" if probe["budget_gib"] >= threshold - 1e-9 else "oom")
        assert ("step_ms" in probe) == (probe["status"] == "ok")
    assert row["step_ms"] == pytest.approx(400 + 1000 / expected)


@pytest.mark.parametrize("below", ["error", "timeout", "failed_steps"])
def test_an_error_a_timeout_or_a_failed_step_fails_to_train_and_the_search_goes_on(below):
    calls = []

    def run_probe(budget):
        calls.append(budget / GiB)
        if budget / GiB >= 5.0:
            return fake_row("mucudnn", budget, "ok")
        if below == "failed_steps":   # it ran, but one step ran out of memory
            return fake_row("mucudnn", budget, "ok", failed_steps=[1])
        return fake_row("mucudnn", budget, below, error=["RuntimeError: boom"])

    row = min_budget_search("mucudnn", run_probe, BASE, args_of())
    assert row["status"] == "ok" and row["min_budget_gib"] == 5.0
    assert below in {p["status"] for p in row["search"]["probes"]}


def test_mucudnn_searches_below_pytorchs_minimum():
    pytorch = min_budget_search("pytorch", threshold_runner("pytorch", 9.6, []), BASE, args_of())
    calls = []
    row = min_budget_search("mucudnn", threshold_runner("mucudnn", 3.3, calls), BASE, args_of(),
                            pytorch)
    assert pytorch["min_budget_gib"] == 9.75
    assert calls[0] == 9.75                       # PyTorch's minimum first
    assert row["bracket_gib"] == [pytest.approx(9.75 * 0.25, abs=1e-3), 9.75]
    assert row["min_budget_gib"] == 3.5


def test_a_spent_time_budget_leaves_the_search_incomplete_with_what_it_knows():
    calls = []
    passing = threshold_runner("pytorch", 9.0, calls)

    def run_probe(budget):
        if len(calls) >= 2:
            return fake_row("pytorch", budget, "skipped", reason="time budget spent")
        return passing(budget)

    row = min_budget_search("pytorch", run_probe, BASE, args_of())
    assert row["status"] == "incomplete" and row["min_budget_gib"] is None
    assert row["at_most_gib"] == pytest.approx(min(c for c in calls if c >= 9.0))
    assert row["search"]["complete"] is False and len(row["search"]["probes"]) == 2


# -- the automatic sweep ---------------------------------------------------------------------------

def test_auto_sweep_from_pytorchs_peak_down_to_the_minimum():
    budgets = auto_sweep_budgets(31.37, 6.25, 5, 0.25)
    assert budgets[0] == 31.5 and budgets[-1] == 6.25   # the peak rounded up; the minimum itself
    assert len(budgets) == 5 and budgets == sorted(budgets, reverse=True)
    assert all(abs(b / 0.25 - round(b / 0.25)) < 1e-9 for b in budgets)
    gaps = [a - b for a, b in zip(budgets, budgets[1:])]
    assert max(gaps) - min(gaps) <= 0.25 + 1e-9          # evenly spaced, up to the grid


def test_auto_sweep_degenerate_cases():
    assert auto_sweep_budgets(10.0, 9.9, 6, 0.25) == [10.0]   # the minimum at the peak
    assert auto_sweep_budgets(2.0, 1.5, 10, 0.25) == [2.0, 1.75, 1.5]   # distinct on the grid
    assert auto_sweep_budgets(12.0, 3.0, 1, 0.25) == [12.0]
    assert auto_sweep_budgets(12.0, 0.0, 3, 0.25)[-1] == 0.25          # never 0 (no budget)
    assert auto_sweep_budgets(12.0, 3.0, 0, 0.25) == []


# -- the driver's order, with run_config faked -------------------------------------------------------

RESIDENT_GIB = 0.6   # FakeGPU's unconstrained run: allocated between its steps


class FakeGPU:
    """run_config answered from thresholds: PyTorch trains from 9.6 GiB, mucudnn from 3.3 GiB
    (slower the smaller the budget), save_on_cpu fails, checkpoint is unsupported; compile at
    fraction f peaks at the resident 0.6 GiB + f x the 11 GiB above it of PyTorch's 11.6 GiB
    (``compiled``: (budget GiB, fraction, label) of each compile run)."""

    def __init__(self, mucudnn_from=3.3, fail_at=()):
        self.calls, self.mucudnn_from, self.fail_at = [], mucudnn_from, set(fail_at)
        self.compiled = []

    def __call__(self, args, model, batch, method, budget, *, part="table", steps=None,
                 clock=None, extra=(), label=""):
        self.calls.append((method, budget and budget / GiB, part))
        row = {"model": model, "batch": batch, "method": method, "budget_bytes": budget,
               "config": offload.config_name(method, budget) + (f" {label}" if label else ""),
               "part": part}
        if method == "compile":
            fraction = float(extra[list(extra).index("--compile-fraction") + 1])
            self.compiled.append((budget / GiB, fraction, label))
            peak = (RESIDENT_GIB + fraction * (11.6 - RESIDENT_GIB)) * GiB
            if peak > budget:
                return {**row, "status": "oom"}
            return {**row, "status": "ok", "step_ms": 400.0 + 200 * (1 - fraction),
                    "peak_reserved": peak, "peak_allocated": 0.9 * peak}
        if clock is not None:
            try:
                clock.check(row["config"])
            except offload.OutOfTime:
                return {**row, "status": "skipped", "reason": "time budget spent"}
        gib = budget / GiB if budget else None
        if method == "checkpoint":
            return {**row, "status": "unsupported", "reason": "not this model"}
        trains = (gib is None or (method == "pytorch" and gib >= 9.6)
                  or (method == "mucudnn" and gib >= self.mucudnn_from
                      and round(gib, 2) not in self.fail_at))
        if not trains or method == "save_on_cpu":
            return {**row, "status": "oom"}
        return {**row, "status": "ok", "step_ms": 400.0 + (0 if gib is None else 800 / gib),
                "peak_reserved": 11.6 * GiB if gib is None else 0.95 * budget,
                "peak_allocated": 10.2 * GiB if gib is None else 0.9 * budget,
                "resident_bytes": RESIDENT_GIB * GiB, "device_memory": 80 * GiB}


def drive(monkeypatch, fake, *argv, clock=None):
    monkeypatch.setattr(offload, "run_config", fake)
    args = args_of(*argv)
    rows, saves = [], []
    for text in args.models:
        measure_model(args, text, rows, clock or Budget(None), lambda: saves.append(len(rows)))
    return args, rows, saves


def test_the_driver_runs_pytorch_the_table_the_searches_then_the_sweep(monkeypatch):
    fake = FakeGPU()
    args, rows, saves = drive(monkeypatch, fake, "--models", "unet3d", "--methods", "mucudnn",
                              "checkpoint", "--budget", "6GiB", "--sweep", "auto",
                              "--min-search", "pytorch", "mucudnn")
    parts = [part for _, _, part in fake.calls]
    assert fake.calls[0] == ("pytorch", None, "table")
    assert parts.index("min-probe") > parts.index("table")
    assert parts[-1] == "auto-sweep" and "table" not in parts[parts.index("min-probe"):]
    assert rows[0]["batch"] == 2                      # models.py's N of unet3d
    mins = {r["method"]: r for r in rows if r["part"] == "min"}
    assert mins["pytorch"]["min_budget_gib"] == 9.75 and mins["mucudnn"]["min_budget_gib"] == 3.5
    assert mins["mucudnn"]["vs_pytorch_min"] == pytest.approx(3.5 / 9.75)
    sweep = [b for m, b, p in fake.calls if p == "auto-sweep"]
    # from PyTorch's peak (11.6 up to 11.75) down to the minimum, which was probed already
    assert sweep[0] == 11.75 and 3.5 not in sweep
    assert all(b > 3.5 for b in sweep)
    checkpoint = next(r for r in rows if r["method"] == "checkpoint")
    assert checkpoint["status"] == "unsupported"
    assert len(saves) == len(fake.calls) + 2          # after every run and every search


def test_the_auto_sweep_stops_at_its_first_failure(monkeypatch):
    # no minimum searched: down to a quarter of PyTorch's peak, stopped at the failure
    planned = auto_sweep_budgets(11.6, 11.6 * 0.25, 8, 0.25)
    fake = FakeGPU(fail_at={planned[3]})
    drive(monkeypatch, fake, "--models", "unet3d", "--methods", "--sweep", "auto",
          "--sweep-points", "8")
    assert [b for m, b, p in fake.calls if p == "auto-sweep"] == planned[:4]


def test_batch_option_and_model_batch(monkeypatch):
    _, rows, _ = drive(monkeypatch, FakeGPU(), "--models", "unet3d", "vgg16:64", "--methods",
                       "--sweep", "--batch", "4")
    assert [(r["model"], r["batch"]) for r in rows] == [("unet3d", 4), ("vgg16", 64)]


def test_a_spent_time_budget_marks_what_was_not_run(monkeypatch):
    now = [0.0]
    clock = Budget(100.0, clock=lambda: now[0])
    fake = FakeGPU()
    original = fake.__call__

    def slow(*a, **k):   # every run takes 30 s
        row = original(*a, **k)
        now[0] += 30
        return row

    _, rows, _ = drive(monkeypatch, slow, "--models", "unet3d", "--methods", "--sweep", "auto",
                       "--min-search", "pytorch", "mucudnn", clock=clock)
    ran = [r for r in rows if r["part"] != "min" and r["status"] != "skipped"]
    assert len(ran) == 4                              # started at 0, 30, 60, 90 s
    mins = {r["method"]: r for r in rows if r["part"] == "min"}
    assert mins["pytorch"]["status"] == "incomplete" and mins["mucudnn"]["status"] == "incomplete"
    assert any(r["part"] == "auto-sweep" and r["status"] == "skipped" for r in rows)
    assert clock.skipped


def test_without_pytorchs_run_the_searches_are_skipped(monkeypatch):
    fake = FakeGPU()
    original = fake.__call__
    monkeypatch.setattr(offload, "run_config", lambda *a, **k: (
        {**original(*a, **k), "status": "oom"} if a[3] == "pytorch" else original(*a, **k)))
    args = args_of("--models", "unet3d", "--methods", "--sweep", "auto", "--min-search",
                   "pytorch", "mucudnn")
    rows = []
    measure_model(args, "unet3d", rows, Budget(None), lambda: None)
    assert [(r["config"], r["status"]) for r in rows[1:]] == [
        ("pytorch min", "skipped"), ("mucudnn min", "skipped"), ("auto sweep", "skipped")]
    assert "PyTorch's unconstrained run: oom" in markdown(rows, args)


# -- outputs -----------------------------------------------------------------------------------------

def test_markdown_of_the_searches(monkeypatch):
    args, rows, _ = drive(monkeypatch, FakeGPU(), "--models", "unet3d", "--methods", "mucudnn",
                          "--budget", "6GiB", "--sweep", "--min-search", "pytorch", "mucudnn")
    text = markdown(rows, args)
    assert "## Smallest budget that trains" in text
    table = text.split("## Smallest budget that trains")[1]
    pytorch_line = next(line for line in table.splitlines() if line.startswith("| unet3d N=2 | pytorch"))
    mucudnn_line = next(line for line in table.splitlines() if line.startswith("| unet3d N=2 | mucudnn"))
    assert "| 9.75 |" in pytorch_line and "11.75: ok" in pytorch_line and "oom" in pytorch_line
    assert "| 3.5 | 0.36 |" in mucudnn_line
    assert "mucudnn trains in 0.36 of PyTorch's smallest budget (3.5 GiB against 9.75 GiB)" in text
    # the probes are not rows of the main table
    main = text.split("## Smallest budget that trains")[0]
    assert "pytorch@9.75GiB" not in main and "mucudnn@6GiB" in main
    json.dumps(rows)   # offload.json


def test_markdown_without_searches_has_no_search_table(monkeypatch):
    args, rows, _ = drive(monkeypatch, FakeGPU(), "--models", "unet3d", "--sweep", "8GiB")
    assert "Smallest budget" not in markdown(rows, args)


def test_plot_series_has_the_anchors_the_curve_and_the_minima(monkeypatch):
    _, rows, _ = drive(monkeypatch, FakeGPU(), "--models", "unet3d", "--methods", "mucudnn",
                       "save_on_cpu", "--budget", "12GiB", "--sweep", "auto",
                       "--min-search", "pytorch", "mucudnn")
    rows.append({**rows[0], "method": "ondemand", "config": "ondemand@12GiB",
                 "budget_bytes": 12 * GiB, "step_ms": 900.0})
    series = plot_series(rows, "unet3d")
    labels = [label for label, _, _ in series["anchors"]]
    assert any(label.startswith("pytorch unconstrained") for label in labels)
    assert (next(a for a in series["anchors"] if a[0].startswith("pytorch"))[1:]
            == (pytest.approx(11.6), 400.0))
    assert any(label.startswith("ondemand") for label in labels)
    assert [x for _, x in series["minima"]] == [9.75, 3.5]
    budgets = [x for x, _ in series["mucudnn"]]
    assert min(budgets) == 3.5 and max(budgets) == 12.0 and budgets == sorted(budgets)
    assert 9.75 in [x for x, _ in series["pytorch"]]    # PyTorch under a budget: its probes
    assert 12.0 in series["failures"]                   # save_on_cpu ran out of memory there
    assert series["failed_methods"][12.0] == {"ran out of memory": ["save_on_cpu"]}


def test_plot_series_names_a_failure_only_where_no_row_of_the_method_trained():
    """Rows of two calls: a method cut by one call's time budget (``out_of_time``) or that ran
    out of memory there, and trained at the same budget in the other call, did not fail; a
    run past its own timeout did, named as such."""
    base = {"model": "resnet152", "batch": 128, "peak_reserved": 7 * GiB}
    rows = [{**base, "method": "pytorch", "budget_bytes": None, "status": "ok", "step_ms": 130.0,
             "peak_reserved": 22 * GiB},
            {**base, "method": "mucudnn-run", "budget_bytes": 8 * GiB, "status": "out_of_time"},
            {**base, "method": "save_on_cpu", "budget_bytes": 8 * GiB, "status": "oom"},
            {**base, "method": "compile", "budget_bytes": 8 * GiB, "status": "timeout"},
            {**base, "method": "checkpoint", "budget_bytes": 8 * GiB, "status": "oom"},
            {**base, "method": "mucudnn-run", "budget_bytes": 8 * GiB, "status": "ok",
             "step_ms": 190.0},
            {**base, "method": "save_on_cpu", "budget_bytes": 8 * GiB, "status": "ok",
             "step_ms": 1400.0},
            {**base, "method": "compile", "budget_bytes": 8 * GiB, "status": "oom"}]
    series = plot_series(rows, "resnet152")
    assert series["mucudnn-run"] == [(8.0, 190.0)]
    assert series["failed_methods"] == {8.0: {"passed its timeout": ["compile"],
                                              "ran out of memory": ["checkpoint", "compile"]}}


# -- a worker's output, per-block checkpointing ------------------------------------------------------

@pytest.mark.parametrize("stdout,stderr,rc,timed_out,status", [
    ('RESULT {"status": "unsupported", "reason": "no"}\n', "", 0, False, "unsupported"),
    ('RESULT {"step_ms": 1.0, "peak_reserved": 1}\n', "", 0, False, "ok"),
    ("", "torch.OutOfMemoryError: CUDA out of memory.", 1, False, "oom"),
    ("", "RuntimeError: something else", 1, False, "error"),
    ("", "", -9, True, "timeout"),
])
def test_a_workers_outcome_becomes_the_rows_status(monkeypatch, stdout, stderr, rc, timed_out,
                                                   status):
    seen = {}

    def execute(cmd, env, timeout):
        seen.update(cmd=cmd, timeout=timeout)
        return rc, stdout, stderr, 1.0, timed_out

    monkeypatch.setattr(offload, "execute", execute)
    row = run_config(args_of(), "unet3d", 2, "checkpoint", 3 * GiB, part="min-probe", steps=2)
    assert row["status"] == status and row["part"] == "min-probe" and row["batch"] == 2
    assert seen["cmd"][seen["cmd"].index("--steps") + 1] == "2"
    assert seen["cmd"][seen["cmd"].index("--budget-bytes") + 1] == str(3 * GiB)


def test_a_sessions_timed_steps_wait_until_it_settled_a_few_steps_in_a_row():
    from benchmarks.offload import MOST_EXTRA_WARMUP, SETTLED_STEPS, warmup_done
    assert not warmup_done(9, 10, None) and warmup_done(10, 10, None)   # no session: --warmup
    assert not warmup_done(9, 10, SETTLED_STEPS)                        # never before --warmup
    assert not warmup_done(10, 10, SETTLED_STEPS - 1)    # a plan watched, still to be lowered
    assert warmup_done(12, 10, SETTLED_STEPS)
    assert not warmup_done(10 + MOST_EXTRA_WARMUP - 1, 10, 0)
    assert warmup_done(10 + MOST_EXTRA_WARMUP, 10, 0)    # never settled: timed as it runs


def test_a_compile_row_gets_the_compile_timeout_and_the_others_theirs(monkeypatch):
    seen = []
    monkeypatch.setattr(offload, "execute", lambda cmd, env, timeout: (
        seen.append(timeout) or (0, 'RESULT {"step_ms": 1.0, "peak_reserved": 1}\n', "", 1.0,
                                 False)))
    args = args_of("--timeout", "100", "--compile-timeout", "400")
    for method in ("checkpoint", "compile"):
        run_config(args, "vgg16", 8, method, 3 * GiB)
    assert seen == [100, 400]
    args = args_of("--timeout", "500", "--compile-timeout", "400")   # never less than --timeout
    run_config(args, "vgg16", 8, "compile", 3 * GiB)
    assert seen[-1] == 500


def test_mucudnn_run_is_the_worker_under_the_cli_which_caps_the_allocator(monkeypatch):
    seen = {}

    def execute(cmd, env, timeout):
        seen.update(cmd=cmd, cache=env.get("MUCUDNN_PLAN_CACHE"),
                    level=env.get("MUCUDNN_LOG_LEVEL"))
        stderr = ("mucudnn: info: dir=fwd,dt=f32 N=176: passthrough on the graph path\n"
                  "mucudnn: info: offload plan for 3.00 GiB: 10 kept\nstep 4: 9.0 ms\nother\n")
        return 0, 'RESULT {"step_ms": 1.0, "peak_reserved": 1, "recomputed": 3}\n', stderr, 1.0, \
            False

    monkeypatch.setattr(offload, "execute", execute)
    row = run_config(args_of(), "vgg16", 176, "mucudnn-run", 3 * GiB)
    cmd = seen["cmd"]
    run_at, worker_at = cmd.index("run"), cmd.index("worker")
    assert cmd[run_at - 1:run_at + 5] == ["mucudnn", "run", "--memory-budget", str(3 * GiB),
                                          "--offload", "--"]
    assert run_at < worker_at and cmd[cmd.index("--method") + 1] == "mucudnn-run"
    assert "--no-cap" in cmd[worker_at:]   # the CLI's cap alone: not a second one inside
    first_cache = seen["cache"]            # a first run: a plan cache of its own, gone after
    assert first_cache and not os.path.exists(first_cache)
    run_config(args_of(), "vgg16", 176, "mucudnn-run", 3 * GiB)
    assert seen["cache"] != first_cache
    assert row["status"] == "ok" and row["recomputed"] == 3 and row["method"] == "mucudnn-run"
    # the session's lines at the info level, beside the steps; the shim's per-kernel ones not
    assert seen["level"] == "info"
    assert row["said"] == ["mucudnn: info: offload plan for 3.00 GiB: 10 kept", "step 4: 9.0 ms"]
    series = plot_series([{**row, "model": "vgg16"}], "vgg16")
    assert series["mucudnn-run"] == [(3.0, 1.0)] and series["anchors"] == []


def test_a_run_is_cut_at_the_time_budget_and_none_starts_after_it(monkeypatch):
    now = [0.0]
    clock = Budget(100.0, clock=lambda: now[0])
    seen = []
    monkeypatch.setattr(offload, "execute",
                        lambda cmd, env, timeout: seen.append(timeout) or (-9, "", "", 1.0, True))
    now[0] = 60.0
    assert run_config(args_of(), "unet3d", 2, "mucudnn", GiB, clock=clock)["status"] == "out_of_time"
    assert seen == [40.0]
    now[0] = 100.0
    row = run_config(args_of(), "unet3d", 2, "mucudnn", GiB, clock=clock)
    assert row["status"] == "skipped" and seen == [40.0]


def test_the_unet_is_checkpointed_per_stage_with_the_same_gradients():
    torch = pytest.importorskip("torch")
    from benchmarks.models import unet3d

    torch.manual_seed(0)
    plain = unet3d(base=4, levels=3, max_channels=16)
    wrapped = unet3d(base=4, levels=3, max_channels=16)
    wrapped.load_state_dict(plain.state_dict())
    wrapped = offload.checkpointed(torch, wrapped, "unet3d")
    stages = [m for m in wrapped.modules() if type(m).__name__ == "Checkpointed"]
    assert len(stages) == 3 + 2                        # every encoder and decoder stage
    x = torch.randn(1, 1, 8, 8, 8)
    grads = []
    for model in (plain, wrapped):
        model(x).square().mean().backward()
        grads.append([p.grad for p in model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)


def test_a_model_without_known_blocks_is_unsupported():
    torch = pytest.importorskip("torch")
    with pytest.raises(offload.UnsupportedModel, match="not mlp"):
        offload.checkpointed(torch, torch.nn.Sequential(torch.nn.Linear(2, 2)), "mlp")


def test_a_resnet_like_backbone_is_checkpointed_per_block():
    torch = pytest.importorskip("torch")
    nn = torch.nn

    class Backbone(nn.Module):   # DeepLabV3's: the residual stages under ``backbone``
        def __init__(self):
            super().__init__()
            for i in range(1, 5):
                setattr(self, f"layer{i}", nn.Sequential(nn.Conv2d(2, 2, 1), nn.Conv2d(2, 2, 1)))

    model = nn.Module()
    model.backbone = Backbone()
    offload.checkpointed(torch, model, "deeplabv3_resnet50")
    assert all(type(block).__name__ == "Checkpointed"
               for i in range(1, 5) for block in getattr(model.backbone, f"layer{i}"))


def test_the_driver_writes_json_and_markdown_after_every_run(monkeypatch, tmp_path):
    written = []

    def execute(cmd, env, timeout):
        written.append((tmp_path / "offload.json").exists())
        budget = int(cmd[cmd.index("--budget-bytes") + 1])
        method = cmd[cmd.index("--method") + 1]
        if method == "pytorch" and budget and budget < 9 * GiB:
            return 1, "", "torch.OutOfMemoryError: CUDA out of memory", 1.0, False
        result = {"step_ms": 100.0, "peak_reserved": budget or 10 * GiB,
                  "peak_allocated": 0.9 * (budget or 10 * GiB), "device_memory": 80 * GiB}
        return 0, "RESULT " + json.dumps(result) + "\n", "", 1.0, False

    monkeypatch.setattr(offload, "execute", execute)
    offload.main(["driver", "--models", "unet3d", "--methods", "--sweep", "--min-search",
                  "pytorch", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "offload.json").read_text())
    assert rows[-1]["part"] == "min" and rows[-1]["min_budget_gib"] == 9.0
    assert written[0] is False and all(written[1:])
    assert "| unet3d N=2 | pytorch | 9 |" in (tmp_path / "offload.md").read_text()


def test_a_bad_budget_is_one_error_before_any_run(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(offload, "execute", lambda *a: pytest.fail("ran"))
    with pytest.raises(SystemExit):
        offload.main(["driver", "--sweep", "auto", "8GB2", "--out", str(tmp_path)])
    assert "cannot read '8GB2' as a size" in capsys.readouterr().err


def test_markdown_shows_the_profiled_step(monkeypatch):
    row = {"model": "resnet50", "batch": 256, "config": "mucudnn@20GiB", "method": "mucudnn",
           "part": "sweep", "status": "ok", "step_ms": 169.0, "peak_reserved": 19 * GiB,
           "trace": {"span_ms": 170.0, "streams": {"7": {"busy_ms": 120.0}, "13": {"busy_ms": 40.0}},
                     "compute_stream": "7", "compute_idle_ms": 50.0, "compute_gaps_over_50us": 12,
                     "largest_gaps_ms_at_ms": [], "runtime_calls_ms": {"cudaEventSynchronize": [30.0, 4]}}}
    text = markdown([row], argparse.Namespace(budget="12GiB"))
    assert "| resnet50 N=256 | mucudnn@20GiB | 170.0 | 120.0 | 50.0 (12) | 40.0 | cudaEventSynchronize 30.0 (4) |" in text


# -- replay: the planner on a recorded profile, off the GPU -------------------------------------------

def recorded_profile(tmp_path, *, as_rows=False):
    """A session's profile document (or offload.json's rows): 6 groups of 1 GiB in a chain, every
    second one rebuilt from the one before it, 1 GiB of baseline; a slow link (5 GB/s: 215 ms a
    copy)."""
    import dataclasses
    from mucudnn.torch.planner import SavedGroup, StepProfile
    n = 6
    groups = [SavedGroup(GiB, first_unpack=n - 1 - g, last_unpack=n - 1 - g, producer=f"m{g}",
                         recompute_ms=0.5 if g % 2 else None,
                         recompute_source=(g - 1,) if g % 2 else None) for g in range(n)]
    profile = StepProfile(groups, forward_ms=30.0, backward_ms=60.0, d2h_gbps=5.0, h2d_gbps=5.0,
                          unpacks=n, baseline_forward=[GiB] * n, baseline_backward=[GiB] * n)
    document = {"budget": 8 * GiB, "target": 7 * GiB, "plan": "6 kept", "modes": ["keep"] * n,
                "profile": dataclasses.asdict(profile)}
    path = tmp_path / ("offload.json" if as_rows else "profile.json")
    data = [{"model": "x", "method": "pytorch"}, {**document, "budget_bytes": 8 * GiB}] if as_rows \
        else document
    path.write_text(json.dumps(data))
    return path


def test_replay_plans_a_recorded_profile_at_other_budgets(tmp_path, capsys):
    path = recorded_profile(tmp_path)
    with pytest.raises(SystemExit) as done:
        offload.main(["replay", str(path), "--budgets", "8GiB", "5GiB", "--headroom", "0",
                      "--groups"])
    assert done.value.code == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"{path}: 6 saved groups, 6 backward points; recorded plan: 6 kept"
    assert out[1].startswith("8 GiB (target 8.00): 6 kept, 0 offloaded")
    five = next(i for i, line in enumerate(out) if line.startswith("5 GiB (target 5.00): "))
    assert "4 kept, 0 offloaded" in out[five] and "2 recomputed" in out[five]  # cheaper than copies
    modes = [line.split()[1] for line in out[five + 1:five + 7]]
    assert modes.count("recompute") == 2 and modes.count("keep") == 4
    assert all(mode == "keep" for mode in modes[0::2])  # only the groups with a recipe


def test_replay_reads_offload_json_rows(tmp_path, capsys):
    path = recorded_profile(tmp_path, as_rows=True)
    with pytest.raises(SystemExit) as done:
        offload.main(["replay", str(path), "--budgets", "8GiB", "--row", "0"])
    assert done.value.code == 0 and "6 saved groups" in capsys.readouterr().out


@pytest.mark.parametrize("content, budgets, said", [
    (None, ["8GiB"], "cannot be read as JSON"),
    ("not json", ["8GiB"], "cannot be read as JSON"),
    ('{"profile": {"groups": []}}', ["8GiB"], "not a recorded profile"),
    ('{"modes": []}', ["8GiB"], "no recorded profile in it"),
    ("[]", ["8GiB"], "0 rows with a profile, no row 0"),
    ("VALID", ["eight"], "eight"),
])
def test_replay_of_a_bad_file_or_budget_is_one_line(tmp_path, capsys, content, budgets, said):
    path = tmp_path / "profile.json"
    if content == "VALID":
        path = recorded_profile(tmp_path)
    elif content is not None:
        path.write_text(content)
    with pytest.raises(SystemExit) as done:
        offload.main(["replay", str(path), "--budgets", *budgets])
    err = capsys.readouterr().err.strip().splitlines()
    assert done.value.code == 2 and len(err) == 1 and said in err[0]
    assert err[0].startswith("offload replay: ") and "Traceback" not in err[0]


def test_replay_plans_with_less_headroom_where_the_session_would(tmp_path, capsys):
    # a budget whose 10 % headroom leaves no plan, and 5 % does: the error, then the plan the
    # session would make (planner.smaller_headrooms)
    from mucudnn.torch import planner
    from mucudnn.torch import planning
    path = recorded_profile(tmp_path)
    profile = planner.profile_from_dict(json.loads(path.read_text())["profile"])
    budget = int(planning.least_peak(profile, 0, 0.0) / 0.93)   # the ladder's last rung
    with pytest.raises(SystemExit) as done:
        offload.main(["replay", str(path), "--budgets", str(budget), "--headroom", "0.1"])
    assert done.value.code == 0
    out = capsys.readouterr().out.splitlines()
    assert "too small for this step" in out[1]
    target = planner.planning_target(budget, 0.05)
    assert out[2].startswith(f"{budget / GiB:g} GiB (target {target / GiB:.2f}): ")


# -- torch.compile with activation_memory_budget ----------------------------------------------------

# PyTorch's unconstrained run: 11 GiB above the half GiB that stays allocated between its steps
UNCONSTRAINED = {"status": "ok", "peak_reserved": 23 * GiB // 2, "resident_bytes": GiB // 2}


@pytest.mark.parametrize("budget_gib, fraction", [
    (11.5, 1.0), (40.0, 1.0),        # PyTorch's peak fits: nothing to recompute
    (0.5, 0.0), (0.25, 0.0),         # nothing above what stays resident
    (6.0, 0.5),                      # 5.5 of the 11 GiB above the resident
    (5.75, 0.47),                    # 0.477...: rounded down, never up
])
def test_auto_fraction_is_the_budgets_share_above_the_resident_bytes(budget_gib, fraction):
    assert offload.compile_fraction(round(budget_gib * GiB), UNCONSTRAINED) == fraction


def test_auto_fraction_never_exceeds_the_budgets_share_and_grows_with_it():
    peak, resident = UNCONSTRAINED["peak_reserved"], UNCONSTRAINED["resident_bytes"]
    budgets = [round(gib / 8 * GiB) for gib in range(1, 120)]
    fractions = [offload.compile_fraction(b, UNCONSTRAINED) for b in budgets]
    assert fractions == sorted(fractions) and 0.0 in fractions and 1.0 in fractions
    for budget, fraction in zip(budgets, fractions):
        assert resident + fraction * (peak - resident) <= max(budget, resident) + 1
        assert fraction == round(fraction, 2)
    # a step that allocates nothing above its resident bytes recomputes nothing
    assert offload.compile_fraction(GiB, {"peak_reserved": GiB, "resident_bytes": 2 * GiB}) == 1.0


def test_compile_fractions_are_parsed_and_a_bad_one_is_one_error(capsys):
    assert args_of().compile_fractions == ["auto"]
    assert args_of("--compile-fractions", "auto", "0.5", "1", "0").compile_fractions == \
        ["auto", 0.5, 1.0, 0.0]
    for bad in ("1.5", "-0.1", "nan", "half"):
        with pytest.raises(SystemExit):
            args_of("--compile-fractions", bad)
        assert f"{bad!r} is not a fraction in [0, 1]" in capsys.readouterr().err
    with pytest.raises(SystemExit):   # its knob is the fraction: no budget search
        args_of("--min-search", "compile")


def test_a_compile_worker_needs_its_fraction(monkeypatch, capsys):
    seen = []
    monkeypatch.setattr(offload, "worker", seen.append)
    worker = ["worker", "--model", "resnet50", "--batch", "2", "--method"]
    offload.main(worker + ["compile", "--compile-fraction", "0.3"])
    offload.main(worker + ["pytorch"])
    assert [a.compile_fraction for a in seen] == [0.3, None]
    with pytest.raises(SystemExit):
        offload.main(worker + ["compile"])
    assert "--method compile needs --compile-fraction" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        offload.main(worker + ["compile", "--compile-fraction", "2"])
    assert len(seen) == 2


def test_every_method_runs_at_every_budget_and_compile_at_every_fraction(monkeypatch):
    fake = FakeGPU()
    args, rows, _ = drive(monkeypatch, fake, "--models", "unet3d", "--methods", "checkpoint",
                          "compile", "--budget", "10GiB", "5GiB", "--sweep",
                          "--compile-fractions", "auto", "0.4", "0.2")
    assert [(m, b) for m, b, _ in fake.calls] == [
        ("pytorch", None), ("checkpoint", 10), ("compile", 10), ("compile", 10), ("compile", 10),
        ("checkpoint", 5), ("compile", 5), ("compile", 5)]
    # at 10 GiB auto is (10 - 0.6) / 11 = 0.85; at 5 GiB it is 0.4, given too: run once
    assert fake.compiled == [(10, 0.85, "f=0.85 (auto)"), (10, 0.4, "f=0.4"), (10, 0.2, "f=0.2"),
                             (5, 0.4, "f=0.4 (auto)"), (5, 0.2, "f=0.2")]
    compiled = [r for r in rows if r["method"] == "compile"]
    assert [r["compile_fraction"] for r in compiled] == [0.85, 0.4, 0.2, 0.4, 0.2]
    assert compiled[0]["config"] == "compile@10GiB f=0.85 (auto)"
    assert all(r["status"] == "ok" for r in compiled)   # each fits its budget in FakeGPU


def test_auto_is_skipped_without_pytorchs_run_and_the_given_fractions_still_run(monkeypatch):
    fake = FakeGPU()
    original = fake.__call__
    monkeypatch.setattr(offload, "run_config", lambda *a, **k: (
        {**original(*a, **k), "status": "oom"} if a[3] == "pytorch" else original(*a, **k)))
    args = args_of("--models", "unet3d", "--methods", "compile", "--budget", "8GiB", "--sweep",
                   "--compile-fractions", "auto", "0.5")
    rows = []
    measure_model(args, "unet3d", rows, Budget(None), lambda: None)
    auto, given = rows[1:]
    assert auto["status"] == "skipped" and auto["config"] == "compile@8GiB f=auto"
    assert auto["reason"] == "PyTorch's unconstrained run: oom"
    assert given["status"] == "ok" and given["compile_fraction"] == 0.5
    assert [f for _, f, _ in fake.compiled] == [0.5]


def compile_driver(monkeypatch, tmp_path, compile_result: dict):
    """The driver's files, each worker answered here: PyTorch trains (10 GiB peak, 1 GiB
    resident), compile answers ``compile_result``."""
    commands = []

    def execute(cmd, env, timeout):
        commands.append(cmd)
        method = cmd[cmd.index("--method") + 1]
        result = compile_result if method == "compile" else {
            "step_ms": 100.0, "peak_reserved": 10 * GiB, "peak_allocated": 9 * GiB,
            "resident_bytes": GiB, "device_memory": 80 * GiB}
        return 0, "RESULT " + json.dumps(result) + "\n", "", 1.0, False

    monkeypatch.setattr(offload, "execute", execute)
    offload.main(["driver", "--models", "resnet50:8", "--methods", "compile", "--budget", "5.5GiB",
                  "--sweep", "--compile-fractions", "auto", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "offload.json").read_text())
    return commands, rows, (tmp_path / "offload.md").read_text()


def test_a_compile_run_is_a_row_with_its_fraction_and_warm_up(monkeypatch, tmp_path):
    commands, rows, page = compile_driver(monkeypatch, tmp_path, {
        "step_ms": 120.0, "peak_reserved": 5 * GiB, "peak_allocated": 4.5 * GiB,
        "first_step_s": 41.5, "compiled_in_timed_steps": 0, "warmup": 16})
    cmd = commands[1]
    assert cmd[cmd.index("--compile-fraction") + 1] == "0.5"   # (5.5 - 1) / (10 - 1)
    row = rows[1]
    assert row["config"] == "compile@5.5GiB f=0.5 (auto)" and row["compile_fraction"] == 0.5
    assert row["vs_unconstrained"] == pytest.approx(1.2)
    section = page.split("## torch.compile with activation_memory_budget")[1]
    assert "| resnet50 N=8 | compile@5.5GiB f=0.5 (auto) | 0.5 | ok | 120.0 | 1.200 | 5.00 | " \
           "41.5 | 0 |" in section
    series = plot_series(rows, "resnet50")
    assert series["compile"] == [(5.0, 120.0, 0.5)]            # at its peak, not its budget
    assert all(not label.startswith("compile") for label, _, _ in series["anchors"])


def test_a_model_compile_refuses_is_unsupported_not_a_failure(monkeypatch, tmp_path):
    reason = "torch.compile: BackendCompilerFailed: backend='inductor' raised: RuntimeError: no"
    _, rows, page = compile_driver(monkeypatch, tmp_path,
                                   {"status": "unsupported", "reason": reason})
    row = rows[1]
    assert row["status"] == "unsupported" and row["reason"] == reason
    assert row["compile_fraction"] == 0.5                         # the driver's, though it failed
    assert f"| unsupported ({reason}) |" in page
    series = plot_series(rows, "resnet50")
    assert series["compile"] == [] and series["failures"] == []


@pytest.fixture
def functorch_config():
    """torch's functorch config, its partitioner's fraction restored after the test (the worker
    sets it for its whole process; a config module's entries are not its ``__dict__``'s, so
    monkeypatch would delete the entry on undo)."""
    torch = pytest.importorskip("torch")
    from torch._functorch import config
    with config.patch(activation_memory_budget=config.activation_memory_budget):
        yield config
    torch._dynamo.reset()


def test_compile_refusal_names_the_error_and_leaves_out_of_memory_to_the_oom_row(functorch_config):
    import torch

    def failing(error):
        def backend(graph, example_inputs):
            raise error
        return backend

    def refusal(error):
        torch._dynamo.reset()
        model = offload.compiled(torch, torch.nn.Linear(2, 2), 0.5, backend=failing(error))
        with pytest.raises(Exception) as raised:
            model(torch.randn(1, 2))
        return offload.compile_refusal(torch, raised.value)

    said = refusal(RuntimeError("no lowering for\n  this op"))
    assert said.startswith("torch.compile: BackendCompilerFailed: ")
    assert "RuntimeError: no lowering for this op" in said and "\n" not in said
    assert refusal(torch.OutOfMemoryError("CUDA out of memory")) is None
    assert functorch_config.activation_memory_budget == 0.5
    try:
        raise RuntimeError("while compiling") from torch.OutOfMemoryError("CUDA out of memory")
    except RuntimeError as exc:
        assert offload.compile_refusal(torch, exc) is None


def test_the_fraction_reaches_the_partitioner(functorch_config):
    """What a compiled step saves for its backward shrinks with the fraction (the min-cut
    partitioner of aot_eager_decomp_partition, inductor's, on the CPU)."""
    import torch

    def saved_bytes(fraction):
        torch._dynamo.reset()
        torch.manual_seed(0)
        layers = [torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(),
                                      torch.nn.LayerNorm(64)) for _ in range(4)]
        model = offload.compiled(torch, torch.nn.Sequential(*layers), fraction,
                                 backend="aot_eager_decomp_partition")
        saved = []

        def pack(tensor):
            saved.append(tensor.numel() * tensor.element_size())
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            model(torch.randn(32, 64)).sum().backward()
        return sum(saved)

    full, half, none = saved_bytes(1.0), saved_bytes(0.5), saved_bytes(0.0)
    assert full > half > none > 0


# -- MONeT's published points, the plot of several runs -----------------------------------------------

def unconstrained_row(model, batch, step_ms=300.0, status="ok"):
    return {"model": model, "batch": batch, "method": "pytorch", "config": "pytorch",
            "budget_bytes": None, "status": status, "step_ms": step_ms,
            "peak_reserved": 15 * GiB, "part": "table"}


@pytest.mark.parametrize("model, batch, published", [
    ("resnet50", 184, True), ("vgg16", 176, True),
    ("resnet50", 256, False), ("vgg16", 184, False), ("unet3d", 184, False),
])
def test_monets_points_are_drawn_exactly_where_model_and_batch_match(model, batch, published):
    from benchmarks.budget_plot import MONET_PUBLISHED
    series = plot_series([unconstrained_row(model, batch)], model)
    if not published:
        assert series["monet"] is None
        return
    table = MONET_PUBLISHED[(model, batch)]
    assert series["monet"]["pytorch"] == (table["pytorch_gib"], 300.0)
    assert series["monet"]["points"] == [(gib, pytest.approx(300.0 * (1 + percent / 100)))
                                         for gib, percent in table["points"]]


def test_monets_published_numbers():
    from benchmarks.budget_plot import MONET_PUBLISHED
    resnet, vgg = MONET_PUBLISHED[("resnet50", 184)], MONET_PUBLISHED[("vgg16", 176)]
    assert resnet["pytorch_gib"] == 15.06 and vgg["pytorch_gib"] == 14.12
    assert (10.01, 3.22) in resnet["points"] and (4.99, 11.95) in resnet["points"]
    assert (9.71, -5.30) in vgg["points"] and (5.51, 9.11) in vgg["points"]
    series = plot_series([unconstrained_row("vgg16", 176, step_ms=200.0)], "vgg16")
    assert (9.71, pytest.approx(189.4)) in series["monet"]["points"]   # 5.3 % faster than PyTorch


def test_monets_points_need_this_runs_pytorch_step_and_its_batch():
    # PyTorch unconstrained did not train: nothing to scale the overheads by
    assert plot_series([unconstrained_row("resnet50", 184, status="oom")], "resnet50")["monet"] \
        is None
    # pressure.py's rows carry no batch
    row = unconstrained_row("resnet50", 184)
    del row["batch"]
    assert plot_series([row], "resnet50")["monet"] is None
    # two batches of one model: a panel each, MONeT's points on the matching one only
    rows = [unconstrained_row("resnet50", 184, step_ms=300.0),
            unconstrained_row("resnet50", 256, step_ms=400.0)]
    assert plot_series(rows, "resnet50")["monet"] is None
    at_184, at_256 = plot_series(rows, "resnet50", 184), plot_series(rows, "resnet50", 256)
    assert at_184["monet"]["pytorch"] == (15.06, 300.0) and at_256["monet"] is None
    assert [y for _, _, y in at_256["anchors"]] == [400.0]


def test_the_plot_of_several_runs(monkeypatch, tmp_path):
    from benchmarks import budget_plot
    drawn = []
    monkeypatch.setattr(budget_plot, "plot", lambda rows, path: drawn.append((rows, path)) or True)
    paths = []
    for index, budget in enumerate((10, 5)):
        path = tmp_path / f"run{index}.json"
        path.write_text(json.dumps([unconstrained_row("resnet50", 184),
                                    fake_row("save_on_cpu", budget * GiB, "ok")]))
        paths.append(str(path))
    assert budget_plot.main(paths + ["--out", str(tmp_path / "plot.png")]) == 0
    (rows, path), = drawn
    assert path == tmp_path / "plot.png" and len(rows) == 4
    monkeypatch.setattr(budget_plot, "plot", lambda rows, path: False)
    assert budget_plot.main(paths + ["--out", str(tmp_path / "plot.png")]) == 1


def test_the_plot_draws_compile_and_monet(tmp_path):
    pytest.importorskip("matplotlib")
    from benchmarks.budget_plot import plot
    rows = [unconstrained_row("resnet50", 184),
            {**fake_row("save_on_cpu", 10 * GiB, "ok"), "model": "resnet50", "batch": 184},
            {**fake_row("compile", 10 * GiB, "ok"), "model": "resnet50", "batch": 184,
             "compile_fraction": 0.6, "peak_reserved": 8 * GiB},
            {**fake_row("compile", 5 * GiB, "oom"), "model": "resnet50", "batch": 184}]
    assert plot(rows, tmp_path / "plot.png") and (tmp_path / "plot.png").stat().st_size > 0
