"""benchmarks/batch_size.py on the CPU: reading what `mucudnn batch-size` prints (lines made by
mucudnn.batchsize itself), the sweep's grid, the verdict, the long run's time reservation, and the
driver end to end against a fake GPU (every command answered from its arguments)."""

from __future__ import annotations

import json

import pytest

from benchmarks import batch_size
from benchmarks.batch_size import (long_run_estimate_s, markdown, neighbours, next_grid_batch,
                                   parse_tuner_output, summarize, summarize_against)
from benchmarks.pressure import OFFLOAD_MIN_WARMUP, Budget, OutOfTime
from mucudnn.batchsize import Trial, explain, tune

GiB = 2**30
BUDGET = 24 * GiB


# A fake GPU: images/s grows with the batch and saturates; memory grows linearly.
def images_per_s(batch: int) -> float:
    return 2400.0 * batch / (batch + 24)


def peak_of(batch: int) -> int:
    return int(0.5 * GiB + batch * 80 * 2**20)   # 300 holds in 24 GiB, 310 does not


def fits(batch: int) -> bool:
    return peak_of(batch) <= BUDGET


def fake_trial(batch: int) -> Trial:
    if not fits(batch):
        return Trial(batch, 1, None, None, "out of memory")
    return Trial(batch, 0, images_per_s(batch), peak_of(batch))


def tuner_output(start=32, multiple=16, largest=4096, trial=fake_trial
                 ) -> tuple[str, str, Trial]:
    """stdout and stderr as the CLI writes them (its `say` prefixes "mucudnn: ")."""
    lines = []
    best, trials, margin = tune(trial, BUDGET, start=start, largest=largest,
                                multiple=multiple, say=lines.append)
    lines += explain(best, trials, BUDGET, margin)
    return f"{best.batch}\n", "\n".join(f"mucudnn: {line}" for line in lines) + "\n", best


# -- the tuner's output ----------------------------------------------------------------------------

def test_the_tuners_pick_candidates_and_reasons_are_read_from_what_it_prints():
    stdout, stderr, best = tuner_output()
    parsed = parse_tuner_output(stdout, stderr)
    assert parsed["pick"] == best.batch
    by_batch = {t["batch"]: t for t in parsed["trials"]}
    assert set(by_batch) >= {32, 64, 128, 256, 512}
    for batch, trial in by_batch.items():
        assert trial["holds"] == fits(batch)
        if fits(batch):
            assert trial["images_per_s"] == pytest.approx(images_per_s(batch), abs=0.05)
            assert trial["peak_bytes"] == peak_of(batch)
        else:
            assert trial["why"] == "out of memory" and trial["images_per_s"] is None
    assert parsed["again"] == [{"batch": best.batch, "peak_bytes": peak_of(best.batch),
                                "exit": 0}]
    assert parsed["margin_bytes"] == 0
    assert parsed["reasons"][0].startswith(f"batch size {best.batch}:")


def test_a_candidate_over_the_budget_is_read_as_not_holding_with_its_peak():
    stderr = ("mucudnn: batch 64: 1000.0 images/s, peak 30 bytes (30 B); does not hold "
              "(peak 30 bytes (30 B) over 20 bytes (20 B))\n"
              "mucudnn: batch 8: no throughput; does not hold (exit 1: boom)\n")
    trials = parse_tuner_output("", stderr)["trials"]
    assert trials == [
        {"batch": 64, "images_per_s": 1000.0, "peak_bytes": 30, "holds": False,
         "why": "peak 30 bytes (30 B) over 20 bytes (20 B)"},
        {"batch": 8, "images_per_s": None, "peak_bytes": None, "holds": False,
         "why": "exit 1: boom"}]


def test_a_failed_tuner_has_no_pick_and_keeps_its_error():
    parsed = parse_tuner_output("", "mucudnn: error: no batch size from 32 holds\n")
    assert parsed["pick"] is None and parsed["reasons"] == ["error: no batch size from 32 holds"]


# -- the sweep's grid ------------------------------------------------------------------------------

def sweep_batches(threshold: int, multiple=16, step=32, largest=4096) -> list[int]:
    held: dict[int, bool] = {}
    while (batch := next_grid_batch(held, multiple, step, largest)) is not None:
        held[batch] = batch <= threshold
    return list(held)


def test_the_sweep_doubles_then_steps_up_from_the_largest_that_held_until_one_does_not():
    assert sweep_batches(300) == [16, 32, 64, 128, 256, 512, 288, 320]


def test_the_sweep_stops_at_largest_and_when_even_the_first_does_not_hold():
    assert sweep_batches(10_000, largest=256) == [16, 32, 64, 128, 256]
    assert sweep_batches(10_000, largest=300) == [16, 32, 64, 128, 256, 288]
    assert sweep_batches(0) == [16, 8, 4, 2, 1]


def test_where_even_the_first_does_not_hold_the_sweep_halves_then_steps_up_below_the_failure():
    # PyTorch alone under 8 GiB against a tuner starting at 96: 96 and 48 ran out of memory
    assert sweep_batches(40, multiple=96, step=8, largest=192) == [96, 48, 24, 32, 40]
    assert sweep_batches(8) == [16, 8]
    assert sweep_batches(12, step=2) == [16, 8, 10, 12, 14]


def test_the_step_up_never_reaches_the_doubling_failure():
    # 256 held, 512 did not: with a step of 128 the only point between is 384
    assert sweep_batches(400, step=128) == [16, 32, 64, 128, 256, 512, 384]


def test_the_picks_neighbours_stay_within_one_and_largest():
    assert neighbours(288, 16, 4096) == [272, 304]
    assert neighbours(16, 16, 4096) == [32]
    assert neighbours(4096, 16, 4096) == [4080]


# -- verdict and time ------------------------------------------------------------------------------

def report_with(points, pick, long_run=None, long_steps=500):
    return {"budget_bytes": BUDGET, "settings": {"target": 0.97, "long_steps": long_steps},
            "tuner": {"pick": pick}, "long_run": long_run,
            "sweep": {"points": [{"batch": b, "holds": ok, "images_per_s": ips}
                                 for b, ok, ips in points]}}


def test_the_ratio_is_the_picks_sweep_images_per_s_over_the_best_that_held():
    points = [(64, True, 1900.0), (128, True, 2000.0), (256, True, 1950.0), (512, False, None)]
    summary = summarize(report_with(points, 256, {"status": "ok", "steps": 500,
                                                  "peak_reserved_bytes": 20 * GiB}))
    assert summary["best_batch"] == 128 and summary["ratio"] == pytest.approx(0.975)
    assert summary["ratio_passed"] and summary["long_run_passed"] and summary["passed"]
    assert summary["largest_held"] == 256 and summary["smallest_failed_above"] == 512


def test_a_pick_below_the_target_fails():
    points = [(64, True, 1900.0), (128, True, 2000.0)]
    summary = summarize(report_with(points, 64, {"status": "ok", "steps": 500,
                                                 "peak_reserved_bytes": GiB}))
    assert summary["ratio"] == pytest.approx(0.95) and summary["ratio_passed"] is False
    assert not summary["passed"]


@pytest.mark.parametrize("long_run", [
    {"status": "oom"},
    {"status": "ok", "steps": 499, "peak_reserved_bytes": GiB},     # cut short
    {"status": "ok", "steps": 500, "peak_reserved_bytes": BUDGET + 1},
    None,                                                             # never ran
])
def test_the_long_run_passes_only_with_all_its_steps_within_the_budget(long_run):
    summary = summarize(report_with([(128, True, 2000.0)], 128, long_run))
    assert summary["ratio"] == 1.0 and not summary["long_run_passed"] and not summary["passed"]


def test_a_pick_that_did_not_hold_in_the_sweep_has_no_ratio():
    summary = summarize(report_with([(128, True, 2000.0), (288, False, None)], 288))
    assert summary["ratio"] is None and summary["pick_held"] is False and not summary["passed"]


def test_the_long_run_estimate_scales_the_picks_run_to_its_steps():
    point = {"status": "ok", "wall_s": 20.0, "steps": 10, "warmup": 3, "step_ms": 100.0}
    assert long_run_estimate_s(point, 500, 3, 99.0) == pytest.approx(1.15 * (20 + 490 * 0.1))
    assert long_run_estimate_s({"status": "oom"}, 500, 3, 99.0) == 99.0
    assert long_run_estimate_s(None, 500, 3, 99.0) == 99.0


def test_the_time_budget_keeps_a_reserve():
    now = [0.0]
    budget = Budget(100, clock=lambda: now[0])
    now[0] = 50
    budget.check("a", reserve_s=40)
    with pytest.raises(OutOfTime):
        budget.check("b", reserve_s=60)
    assert budget.skipped == ["b"] and budget.remaining_s() == 50


# -- the driver against a fake GPU -----------------------------------------------------------------

# Under --offload the fake GPU runs every batch up to OFFLOAD_LARGEST within the budget (what does
# not fit is offloaded), at ``offload_factor`` times PyTorch's images/s for that batch.
OFFLOAD_LARGEST = 1024


def offload_peak(batch: int) -> int:
    return min(peak_of(batch), BUDGET - GiB)


def offload_fake_trial(factor: float):
    def trial(batch: int) -> Trial:
        if batch > OFFLOAD_LARGEST:
            return Trial(batch, 1, None, None, "out of memory")
        return Trial(batch, 0, factor * images_per_s(batch), offload_peak(batch))
    return trial


class FakeGpu:
    """Answers the tuner's command as the CLI would (mucudnn.batchsize's search on fake_trial, or
    offload_fake_trial under --offload) and each `mucudnn run -- worker` as the worker would; the
    clock advances by each run's wall time (the tuner's 150 s, or its timeout if shorter)."""

    def __init__(self, run_s=15.0, offload_factor=1.0, tuner_s=150.0):
        self.now, self.run_s, self.commands = 0.0, run_s, []
        self.offload_factor, self.tuner_s = offload_factor, tuner_s
        self.started: list[tuple[float, list[str], float]] = []   # (clock, command, timeout)

    def clock(self):
        return self.now

    def execute(self, cmd, env, timeout_s):
        self.commands.append(cmd)
        self.started.append((self.now, cmd, timeout_s))
        assert "benchmarks.batch_size" in cmd and "worker" in cmd
        offload = "--offload" in cmd[:cmd.index("--")]
        if "batch-size" in cmd:
            assert cmd[cmd.index("--batch-size") + 1] == "{}"
            start = int(cmd[cmd.index("--start") + 1])
            multiple = int(cmd[cmd.index("--multiple") + 1])
            largest = int(cmd[cmd.index("--largest") + 1])
            if self.tuner_s > timeout_s:
                self.now += timeout_s
                return -9, "", "mucudnn: batch 32: 1.0 images/s\n", timeout_s, True
            trial = offload_fake_trial(self.offload_factor) if offload else fake_trial
            stdout, stderr, _ = tuner_output(start, multiple, largest, trial)
            self.now += self.tuner_s
            return 0, stdout, stderr, self.tuner_s, False
        assert cmd[3:6] == ["run", "--no-online", "--memory-budget"]
        batch = int(cmd[cmd.index("--batch-size") + 1])
        steps = int(cmd[cmd.index("--steps") + 1])
        wall = min(timeout_s, self.run_s + steps * 0.1)
        self.now += wall
        if not (batch <= OFFLOAD_LARGEST if offload else fits(batch)):
            return 3, json.dumps({"oom": True, "error": "CUDA out of memory"}) + "\n", \
                "batch_size worker: out of memory\n", wall, False
        ips = images_per_s(batch) * (self.offload_factor if offload else 1.0)
        peak = offload_peak(batch) if offload else peak_of(batch)
        result = {"step_ms": batch * 1000 / ips, "steps": steps,
                  "peak_reserved_bytes": peak, "peak_bytes": peak - 1,
                  "device": "NVIDIA H200", "batch": batch, "step_ms_all": [1.0] * steps}
        return 0, json.dumps(result) + f"\nmucudnn-throughput: {ips}\n", "", wall, False


def run_driver(tmp_path, monkeypatch, *extra, run_s=15.0, **gpu_options):
    gpu = FakeGpu(run_s, **gpu_options)
    monkeypatch.setattr(batch_size, "execute", gpu.execute)
    monkeypatch.setattr(batch_size, "Budget",
                        lambda seconds: Budget(seconds, clock=gpu.clock))
    assert batch_size.main(["driver", "--out", str(tmp_path), *extra]) == 0
    return json.loads((tmp_path / "batch-size-resnet50.json").read_text()), gpu


def test_the_driver_runs_tuner_sweep_and_long_run_and_writes_json_and_page(tmp_path, monkeypatch):
    report, gpu = run_driver(tmp_path, monkeypatch)
    pick = report["tuner"]["pick"]
    assert pick == tuner_output()[2].batch
    points = report["sweep"]["points"]
    assert points[0] == {**points[0], "batch": pick, "role": "pick", "holds": True}
    # the grid of sweep_batches(300), less the pick, already measured
    assert [p["batch"] for p in points if p["role"] == "grid"] == [
        b for b in [16, 32, 64, 128, 256, 512, 288, 320] if b != pick]
    assert {p["batch"] for p in points if p["role"] == "neighbour"} <= {pick - 16, pick + 16}
    summary = report["summary"]
    best = max((p for p in points if fits(p["batch"])), key=lambda p: images_per_s(p["batch"]))
    assert summary["best_batch"] == best["batch"]
    assert summary["ratio"] == pytest.approx(images_per_s(pick) / images_per_s(best["batch"]))
    assert report["long_run"]["batch"] == pick and report["long_run"]["steps"] == 500
    assert summary["long_run_passed"] and summary["passed"] == (summary["ratio"] >= 0.97)
    page = (tmp_path / "batch-size-resnet50.md").read_text()
    assert f"| {best['batch']} **best** |" in page and "ratio pick / best" in page


def test_a_short_time_budget_cuts_the_sweep_but_keeps_the_long_run(tmp_path, monkeypatch):
    # 150 s tuner + pick ~16 s; the long run needs ~1.15 * (16 + 490 * 0.1) = 75 s
    report, _ = run_driver(tmp_path, monkeypatch, "--time-budget-s", "300")
    assert report["skipped"] and report["skipped"][0].startswith("sweep batch")
    assert 1 < len(report["sweep"]["points"]) < 8
    assert report["long_run"]["status"] == "ok" and report["long_run"]["steps"] == 500


def test_worker_lines_follow_the_tuners_protocol(monkeypatch, capsys):
    monkeypatch.setattr(batch_size, "worker_result", lambda ns: {
        "step_ms": 100.0, "steps": ns.steps, "batch": ns.batch, "tf32": ns.tf32})
    assert batch_size.main(["worker", "--batch-size", "64", "--steps", "7"]) == 0
    out = capsys.readouterr().out
    assert json.loads(out.splitlines()[0])["tf32"] is True
    from mucudnn.batchsize import parse_throughput
    assert parse_throughput(out) == pytest.approx(640.0)
    monkeypatch.setattr(batch_size, "worker_result", lambda ns: {"oom": True, "error": "x"})
    assert batch_size.main(["worker", "--batch-size", "64"]) == batch_size.OUT_OF_MEMORY_EXIT
    captured = capsys.readouterr()
    assert "out of memory" in captured.err and parse_throughput(captured.out) is None


def test_under_offload_every_run_warms_up_past_the_recording_and_the_trial(tmp_path, monkeypatch):
    report, gpu = run_driver(tmp_path, monkeypatch, "--offload", "--time-budget-s", "300")
    warmups = [int(cmd[cmd.index("--warmup") + 1]) for cmd in gpu.commands]
    assert warmups and min(warmups) >= OFFLOAD_MIN_WARMUP
    assert report["settings"]["warmup"] == OFFLOAD_MIN_WARMUP


# -- --against-pytorch: the pick under offload against PyTorch alone (issue 40) --------------------

AGAINST = ("--offload", "--against-pytorch", "--largest", "1024", "--long-steps", "0")
PYTORCH_GRID = [16, 32, 64, 128, 256, 512, 288, 320]   # sweep_batches(300, largest=1024)


def offload_flag(cmd) -> bool:
    return "--offload" in cmd[:cmd.index("--")]


@pytest.mark.parametrize("factor", [1.0, 0.9])
def test_against_pytorch_sweeps_pytorch_alone_then_runs_the_pick_under_offload(
        tmp_path, monkeypatch, factor):
    report, gpu = run_driver(tmp_path, monkeypatch, *AGAINST, offload_factor=factor)
    assert report["sweep"]["points"] == []          # no sweep under offload in this mode
    points = report["pytorch"]["points"]
    assert [p["batch"] for p in points] == PYTORCH_GRID
    assert all(p["offload"] is False and p["warmup"] == 3 for p in points)
    runs = [cmd for cmd in gpu.commands if "run" in cmd[3:4]]
    assert [offload_flag(cmd) for cmd in runs] == [False] * len(PYTORCH_GRID) + [True, True]
    tuner = next(cmd for cmd in gpu.commands if "batch-size" in cmd)
    assert offload_flag(tuner)
    # the pick and PyTorch alone's best batch, each once under --offload past its warm-up
    compare = report["compare"]
    assert report["tuner"]["pick"] == compare["pick"]["batch"] == OFFLOAD_LARGEST
    assert compare["at_pytorch_best"]["batch"] == 288
    for run in compare.values():
        assert run["offload"] is True and run["warmup"] >= OFFLOAD_MIN_WARMUP
        assert run["steps"] == 20 and run["holds"]
    against = report["summary"]["against_pytorch"]
    ratio = factor * images_per_s(OFFLOAD_LARGEST) / images_per_s(288)
    assert against["pytorch_best_batch"] == 288 and against["pytorch_largest_held"] == 288
    assert against["pytorch_smallest_failed_above"] == 320
    assert against["ratio"] == pytest.approx(ratio, rel=1e-9)
    assert against["claim_holds"] is (ratio > 1) and against["claim_holds"] is (factor == 1.0)
    assert against["offload_cost"] == pytest.approx(factor)
    assert against["batch_gain"] == pytest.approx(images_per_s(OFFLOAD_LARGEST)
                                                  / images_per_s(288))
    assert against["pick_larger"] and against["tuner_larger_batch"] == OFFLOAD_LARGEST
    assert report["summary"]["passed"] is None and report["long_run"] is None
    page = (tmp_path / "batch-size-resnet50.md").read_text()
    assert "against PyTorch alone" in page and "Device: NVIDIA H200" in page
    assert "Command: `python -m benchmarks.batch_size driver --out" in page
    assert "--against-pytorch" in page and "| 288 **best** |" in page
    assert f"offload pick / PyTorch-alone best: **{ratio:.4f}x**" in page
    assert ("claim (a larger batch with offloading beats the batch that fits alone) "
            + ("**holds**" if factor == 1.0 else "**does not hold**")) in page


def test_against_pytorch_needs_offload():
    with pytest.raises(SystemExit):
        batch_size.main(["driver", "--against-pytorch", "--out", "/nonexistent"])


def test_against_pytorch_keeps_the_tuner_and_the_picks_run_their_time(tmp_path, monkeypatch):
    # runs of 15 + 2 s (PyTorch alone, 10 steps: 16 s); the tuner 150 s at most 200; the pick's
    # offload run 60 s kept: PyTorch-alone points start only while 260 s are left
    report, gpu = run_driver(tmp_path, monkeypatch, *AGAINST, "--time-budget-s", "330",
                             "--tuner-timeout-s", "200", "--offload-run-default-s", "60")
    points = report["pytorch"]["points"]
    assert [p["batch"] for p in points] == PYTORCH_GRID[:5]
    assert all(start + 260 < 330 for start, cmd, _ in gpu.started[:5])
    assert report["skipped"][0] == "pytorch batch 512 (grid)"
    start, _, timeout = next(s for s in gpu.started if "batch-size" in s[1])
    assert timeout == pytest.approx(min(200, 330 - start - 60))
    assert report["compare"]["pick"]["holds"] and report["compare"]["at_pytorch_best"]
    assert all(start < 330 for start, _, _ in gpu.started)
    against = report["summary"]["against_pytorch"]
    assert against["pytorch_best_batch"] == 256 and against["pytorch_largest_held"] == 256
    assert against["pytorch_smallest_failed_above"] is None
    assert against["ratio"] == pytest.approx(images_per_s(OFFLOAD_LARGEST) / images_per_s(256))


def test_a_tuner_cut_short_by_the_time_budget_leaves_the_comparison_unmeasured(tmp_path,
                                                                              monkeypatch):
    # the tuner needs 150 s but gets what is left less the pick's 60 s: it times out, no pick
    report, gpu = run_driver(tmp_path, monkeypatch, *AGAINST, "--time-budget-s", "330",
                             "--tuner-timeout-s", "100", "--offload-run-default-s", "60")
    assert report["tuner"]["timed_out"] and report["tuner"]["pick"] is None
    assert report["compare"] == {} and sum("batch-size" in c for c in gpu.commands) == 1
    against = report["summary"]["against_pytorch"]
    assert against["ratio"] is None and against["claim_holds"] is None
    assert against["pytorch_best_batch"] is not None
    page = (tmp_path / "batch-size-resnet50.md").read_text()
    assert "fits alone) not measured" in page and "| the tuner's pick" in page


@pytest.mark.parametrize("budget_s, at_best_runs", [(560, True), (540, False)])
def test_the_long_run_keeps_its_time_from_the_picks_offload_run(tmp_path, monkeypatch, budget_s,
                                                                at_best_runs):
    # PyTorch alone 8 x 16 s, the tuner 150 s: the pick's offload run ends at 295 s and sets the
    # long run's estimate (its 17 s and 436.7 ms a step for 470 steps more, 15 % to spare:
    # 255 s); the run at PyTorch alone's batch starts only with that left after it
    report, gpu = run_driver(tmp_path, monkeypatch, "--offload", "--against-pytorch",
                             "--largest", "1024", "--long-steps", "500", "--time-budget-s",
                             str(budget_s), "--tuner-timeout-s", "200",
                             "--long-run-default-s", "80")
    pick_run = report["compare"]["pick"]
    estimate = long_run_estimate_s(pick_run, 500, OFFLOAD_MIN_WARMUP, 80)
    assert estimate == pytest.approx(1.15 * (17 + 470 * pick_run["step_ms"] / 1000))
    assert 540 < 295 + estimate < 560
    assert ("at_pytorch_best" in report["compare"]) is at_best_runs
    assert ("offload run of batch 288 (at_pytorch_best)" in report["skipped"]) is not at_best_runs
    assert report["long_run"]["status"] == "ok" and report["long_run"]["offload"] is True
    assert report["long_run"]["batch"] == report["tuner"]["pick"]
    assert all(start < budget_s for start, _, _ in gpu.started)


def against_report(pytorch, pick, pick_run=None, at_best=None, trials=()):
    """A report of --against-pytorch: PyTorch alone's points (batch, holds, images/s), the
    tuner's pick and its trials (batch, holds, images/s), the offload runs (batch, holds,
    images/s)."""
    def run(spec):
        if spec is None:
            return None
        batch, holds, ips = spec
        return {"batch": batch, "holds": holds, "images_per_s": ips, "role": "grid",
                "status": "ok" if holds else "oom"}
    return {"budget_bytes": BUDGET, "settings": {"target": 0.97, "long_steps": 0,
                                                 "against_pytorch": True},
            "tuner": {"pick": pick, "trials": [{"batch": b, "holds": h, "images_per_s": i}
                                               for b, h, i in trials]},
            "sweep": {"points": []}, "long_run": None,
            "pytorch": {"points": [run(p) for p in pytorch]},
            "compare": {k: run(v) for k, v in (("pick", pick_run), ("at_pytorch_best", at_best))
                        if v is not None}}


PYTORCH_POINTS = [(16, True, 500.0), (32, True, 700.0), (64, False, None), (48, True, 650.0),
                  (56, False, None)]


def test_the_ratio_is_the_picks_offload_images_per_s_over_pytorch_alones_fastest():
    a = summarize_against(against_report(PYTORCH_POINTS, 96, (96, True, 770.0), (32, True, 560.0),
                                         trials=[(48, True, 600.0), (96, True, 760.0),
                                                 (192, True, 720.0)]))
    # the fastest that held (32), not the largest (48)
    assert a["pytorch_best_batch"] == 32 and a["pytorch_largest_held"] == 48
    assert a["pytorch_smallest_failed_above"] == 56
    assert a["ratio"] == pytest.approx(1.1) and a["claim_holds"] is True and a["pick_larger"]
    assert a["offload_cost"] == pytest.approx(0.8) and a["batch_gain"] == pytest.approx(1.375)
    assert a["tuner_larger_batch"] == 96 and a["tuner_larger_ratio"] == pytest.approx(760 / 700)


def test_a_pick_slower_than_pytorch_alone_refutes_the_claim_and_one_that_fits_says_so():
    a = summarize_against(against_report(PYTORCH_POINTS, 32, (32, True, 630.0),
                                         trials=[(32, True, 640.0), (64, True, 600.0)]))
    assert a["ratio"] == pytest.approx(0.9) and a["claim_holds"] is False
    assert a["pick_larger"] is False and a["offload_cost"] is None   # no run at PyTorch's batch
    assert a["tuner_larger_batch"] == 64 and a["tuner_larger_ratio"] == pytest.approx(600 / 700)
    report = against_report(PYTORCH_POINTS, 32, (32, True, 630.0))
    report["settings"].update(tf32=True, cudnn_benchmark=False, offload=True, compare_steps=20,
                              compare_warmup=26, tuner_steps=10, pytorch_warmup=3, steps=10)
    report.update(model="resnet152", budget="8GiB", started="now", device="NVIDIA H100")
    report["tuner"].update(command="python -m mucudnn batch-size", returncode=0, wall_s=1.0,
                           margin_bytes=0, reasons=[])
    page = markdown(report)
    assert "**does not hold** (-10.0 %)" in page and "which PyTorch alone also runs" in page


def test_an_equal_images_per_s_is_no_win_and_a_failed_pick_has_no_ratio():
    a = summarize_against(against_report(PYTORCH_POINTS, 96, (96, True, 700.0)))
    assert a["ratio"] == 1.0 and a["claim_holds"] is False
    a = summarize_against(against_report(PYTORCH_POINTS, 96, (96, False, None)))
    assert a["ratio"] is None and a["claim_holds"] is None and a["pick_held"] is False
    a = summarize_against(against_report([(16, False, None)], 96, (96, True, 700.0)))
    assert a["ratio"] is None and a["pytorch_best_batch"] is None and a["pick_larger"] is None
