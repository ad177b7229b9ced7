"""Issue 14: does `mucudnn batch-size` pick a batch size within 3 % of the fastest of a measured
sweep, and does that batch size train 500 steps under the budget? (GPU)

``driver`` runs, for one model of benchmarks/models.py under one memory budget, four parts, each
in processes of its own, and writes OUT/batch-size-MODEL.json and a page OUT/batch-size-MODEL.md
after each run:

1. ``tuner``: the real CLI, ``python -m mucudnn batch-size --memory-budget B --start S --multiple
   M -- python -m benchmarks.batch_size worker --model MODEL --batch-size {}``; its pick (stdout),
   every candidate it reports on stderr (images/s, peak, why it did not hold), its reasons and its
   wall time;
2. ``sweep``: an independent measured sweep of the same worker under ``mucudnn run --no-online
   --memory-budget B`` (the shim loaded and passing through, as in the tuner's runs): the pick
   first, then M, 2M, 4M, ... until one does not hold, then from the largest that held upwards in
   steps of --sweep-step until one does not hold, then the pick's neighbours (pick - M, pick + M).
   A point holds when it trains and its peak reserved memory is within the budget;
3. ``ratio``: images/s of the pick (as the sweep measured it) over the best of the sweep; the
   target is >= --target (0.97);
4. ``long run``: the pick for --long-steps (500) timed steps after the warm-up, under the budget:
   whether it ran out of memory, its peak reserved memory against the budget.

Every run is one worker process: benchmarks/shim_pytorch.py's training (models.py's network,
random data and loss, SGD with momentum, fp32 with TF32 unless --no-tf32) at ``--batch-size``,
timed with CUDA events (median over --steps after --warmup); it prints shim_pytorch's JSON line
and ``mucudnn-throughput: <images/s>`` (the tuner's protocol, mucudnn/batchsize.py) and exits 3
when memory ran out. Running out of memory or time is a result per run, never the end of the
benchmark. --time-budget-s: no run starts once it is spent, and sweep points stop early enough to
leave the long run its estimated time (the pick's sweep run, scaled to the long run's steps).

``--offload --against-pytorch`` (issue 40, AccUDNN's measure: does a larger batch with offloading
beat the best batch that fits alone?) replaces the sweep of part 2 and the ratio of part 3:

a. ``pytorch``: PyTorch alone under the same budget, the worker under ``mucudnn run --no-online
   --memory-budget B`` without ``--offload`` (the caching allocator capped, nothing offloaded or
   recomputed: what a user without mucudnn.torch runs), on the sweep's grid (M, 2M, 4M, ... until
   one does not hold, then up in steps of --sweep-step; where M itself does not hold, M/2, M/4,
   ... until one does, then up from it), --pytorch-warmup warm-up steps; its best
   is the fastest point that held. It runs before the tuner: it does not depend on the pick, and
   the tuner's time limit is then what is left less the comparison's runs, so a slow tuner cannot
   leave the comparison without its baseline;
b. ``compare``: the tuner's pick once more under ``--offload`` (--compare-steps timed steps after
   --compare-warmup, at least OFFLOAD_MIN_WARMUP: past the recording, the trial of plans and the
   first planned steps), then, time permitting, the same offload run at PyTorch alone's best batch
   (mucudnn.torch's cost at an equal batch, apart from the larger batch's gain);
c. the summary: the pick's images/s over PyTorch alone's best; AccUDNN's claim holds when that
   ratio is over 1. The tuner's own candidates above the largest batch PyTorch alone held are
   listed too (measured by the tuner, at no extra run).

The long run (part 4) runs the pick under ``--offload`` as before; ``--long-steps 0`` skips it.
The time budget: PyTorch-alone points keep the tuner's time limit (--tuner-timeout-s) and the
pick's offload run (--offload-run-default-s, and the long run's default when there is one) in
reserve; the tuner runs for at most what is left less the latter; the pick's run keeps nothing in
reserve, the run at PyTorch alone's batch keeps the long run's estimate.

    python -m benchmarks.batch_size driver --model resnet50 --memory-budget 24GiB --out DIR
    python -m benchmarks.batch_size driver --model resnet152 --memory-budget 8GiB --offload \
        --against-pytorch --start 48 --largest 192 --sweep-step 8 --long-steps 0 --out DIR
    python -m benchmarks.batch_size worker --model resnet50 --batch-size 64 --steps 10
    python -m benchmarks.batch_size report --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import sys
import time
from pathlib import Path

from benchmarks.pressure import (OFFLOAD_MIN_WARMUP, OFFLOAD_WARMUP, Budget, OutOfTime,
                                 Terminated, execute, fmt, gpu_slug)
from benchmarks.shim_pytorch import MU, add_worker_arguments, worker_outcome, worker_result

ROOT = Path(__file__).resolve().parents[1]
OUT_OF_MEMORY_EXIT = 3   # the worker's exit status when memory ran out (stderr says so too)

# What `mucudnn batch-size` says on stderr about each candidate (mucudnn/batchsize.py, tune())
TRIAL_LINE = re.compile(r"^mucudnn: batch (\d+): (?:([0-9.eE+-]+) images/s|no throughput)"
                        r"(?:, peak (\d+) bytes \([^)]*\))?(?:; does not hold \((.*)\))?$")
AGAIN_LINE = re.compile(r"^mucudnn: batch (\d+) again: peak (?:(\d+) bytes \([^)]*\)|not reported)"
                        r", exit (-?\d+)$")
MARGIN = re.compile(r"safety margin (\d+) bytes")


# -- worker: one training run, the tuner's protocol ------------------------------------------------

def worker(args) -> int:
    options = ["--model", args.model, "--batch", str(args.batch_size), "--steps", str(args.steps),
               "--warmup", str(args.warmup), "--dtype", "fp32"]
    options += ["--tf32"] if args.tf32 else []
    options += ["--cudnn-benchmark"] if args.cudnn_benchmark else []
    result = worker_result(add_worker_arguments(argparse.ArgumentParser()).parse_args(options))
    if result.get("oom"):
        print(json.dumps(result), flush=True)
        print(f"batch_size worker: out of memory at batch {args.batch_size}: {result['error']}",
              file=sys.stderr)
        return OUT_OF_MEMORY_EXIT
    result["images_per_s"] = images_per_s(args.batch_size, result["step_ms"])
    print(json.dumps(result))
    print(f"mucudnn-throughput: {result['images_per_s']:.3f}", flush=True)
    return 0


def images_per_s(batch: int, step_ms: float) -> float:
    return batch * 1000.0 / step_ms


def worker_argv(args, batch: int | str, steps: int, warmup: int) -> list[str]:
    """The worker's command line (``batch`` "{}" for the tuner)."""
    argv = [sys.executable, "-m", "benchmarks.batch_size", "worker", "--model", args.model,
            "--batch-size", str(batch), "--steps", str(steps), "--warmup", str(warmup)]
    argv += [] if args.tf32 else ["--no-tf32"]
    argv += ["--cudnn-benchmark"] if args.cudnn_benchmark else []
    return argv


# -- pure parts: the tuner's output, the sweep's next batch, the verdict --------------------------

def parse_tuner_output(stdout: str, stderr: str) -> dict:
    """The pick (stdout's last line, a whole number; None when the tuner failed), each candidate
    as it reported it, each repeated run, the safety margin and the other ``mucudnn:`` lines (its
    reasons, warnings, errors)."""
    lines = [line.strip() for line in stdout.strip().splitlines()]
    pick = int(lines[-1]) if lines and lines[-1].isdigit() else None
    trials, again, reasons, margin = [], [], [], None
    for line in (line.rstrip() for line in stderr.splitlines()):
        if match := TRIAL_LINE.match(line):
            batch, throughput, peak, why = match.groups()
            trials.append({"batch": int(batch),
                           "images_per_s": float(throughput) if throughput else None,
                           "peak_bytes": int(peak) if peak else None,
                           "holds": why is None and throughput is not None, "why": why})
        elif match := AGAIN_LINE.match(line):
            batch, peak, code = match.groups()
            again.append({"batch": int(batch), "peak_bytes": int(peak) if peak else None,
                          "exit": int(code)})
        elif line.startswith("mucudnn: "):
            reasons.append(line[len("mucudnn: "):])
            if match := MARGIN.search(line):
                margin = int(match.group(1))
    return {"pick": pick, "trials": trials, "again": again, "reasons": reasons,
            "margin_bytes": margin}


def next_grid_batch(held: dict[int, bool], multiple: int, step: int, largest: int) -> int | None:
    """The sweep's next batch size, given what ran so far (batch: held?): ``multiple`` doubling
    while batches hold (up to ``largest``), then from the largest that held upwards in ``step``s
    until one does not hold (or the doubling's first failure, or ``largest``). Where even
    ``multiple`` did not hold (PyTorch alone under a budget the tuner's start is too large for),
    ``multiple`` halved until one holds, and from that one upwards in ``step``s below the least
    that failed. None when done, or when even a batch of 1 did not hold."""
    top, ceiling, batch = None, largest + 1, multiple
    while batch <= largest:
        if batch not in held:
            return batch
        if not held[batch]:
            ceiling = batch
            break
        top, batch = batch, batch * 2
    if top is None and held.get(multiple) is False:
        batch = multiple // 2
        while batch >= 1:
            if batch not in held:
                return batch
            if held[batch]:
                top = batch
                break
            ceiling, batch = batch, batch // 2
    if top is None:
        return None
    batch = top + step
    while batch < ceiling:
        if batch not in held:
            return batch
        if not held[batch]:
            return None
        batch += step
    return None


def neighbours(pick: int, multiple: int, largest: int) -> list[int]:
    return [b for b in (pick - multiple, pick + multiple) if 1 <= b <= largest]


def point_holds(outcome: dict, budget_bytes: int) -> bool:
    peak = outcome.get("peak_reserved_bytes")
    return outcome.get("status") == "ok" and (peak is None or peak <= budget_bytes)


def long_run_estimate_s(pick_point: dict | None, long_steps: int, warmup: int,
                        default_s: float) -> float:
    """Seconds the long run should take, from the pick's sweep run (its wall time, plus its step
    time for each step more), with 15 % to spare; ``default_s`` without a measured pick."""
    if not pick_point or pick_point.get("status") != "ok":
        return default_s
    more_steps = long_steps + warmup - pick_point["steps"] - pick_point["warmup"]
    return 1.15 * (pick_point["wall_s"] + max(0, more_steps) * pick_point["step_ms"] / 1000)


def summarize(report: dict) -> dict:
    """The verdict: the sweep's best, the pick's images/s in the sweep and their ratio against
    the target, and whether the long run trained its steps within the budget."""
    budget, target = report["budget_bytes"], report["settings"]["target"]
    points = report["sweep"]["points"]
    held = [p for p in points if p["holds"]]
    best = fastest_held(points)
    pick = (report.get("tuner") or {}).get("pick")
    pick_point = next((p for p in points if p["batch"] == pick), None)
    ratio = None
    if best and pick_point and pick_point["holds"]:
        ratio = pick_point["images_per_s"] / best["images_per_s"]
    failed_above = [p["batch"] for p in points if not p["holds"]
                    and held and p["batch"] > max(q["batch"] for q in held)]
    long = report.get("long_run") or {}
    long_steps = report["settings"]["long_steps"]
    long_ok = None
    if long:
        long_ok = (long.get("status") == "ok" and long.get("steps", 0) >= long_steps
                   and (long.get("peak_reserved_bytes") or budget + 1) <= budget)
    summary = {"pick": pick, "pick_images_per_s": pick_point["images_per_s"] if pick_point
               and pick_point["holds"] else None, "pick_held": pick_point["holds"] if pick_point
               else None, "best_batch": best["batch"] if best else None,
               "best_images_per_s": best["images_per_s"] if best else None,
               "ratio": ratio, "target": target,
               "ratio_passed": None if ratio is None else ratio >= target,
               "largest_held": max((p["batch"] for p in held), default=None),
               "smallest_failed_above": min(failed_above, default=None),
               "points": len(points), "long_run_passed": long_ok,
               "passed": bool(ratio is not None and ratio >= target and long_ok)}
    if report["settings"].get("against_pytorch"):
        # no sweep under offload ran: issue 14's target does not apply, the comparison does
        summary.update(passed=None, against_pytorch=summarize_against(report))
    return summary


def fastest_held(points: list[dict]) -> dict | None:
    held = [p for p in points if p["holds"]]
    return max(held, key=lambda p: p["images_per_s"]) if held else None


def summarize_against(report: dict) -> dict:
    """AccUDNN's measure: the tuner's pick, run under --offload, against the fastest batch that
    held for PyTorch alone under the same budget. ``ratio`` is pick / PyTorch alone's best in
    images/s, ``claim_holds`` whether it is over 1 (None when either was not measured). The offload
    run at PyTorch alone's best batch splits that ratio: ``offload_cost`` (offload / PyTorch alone
    at one batch) times ``batch_gain`` (the pick / that run, both under offload)."""
    points = report["pytorch"]["points"]
    best = fastest_held(points)
    largest = max((p["batch"] for p in points if p["holds"]), default=None)
    failed_above = [p["batch"] for p in points
                    if not p["holds"] and largest is not None and p["batch"] > largest]
    compare = report.get("compare") or {}
    pick = (report.get("tuner") or {}).get("pick")
    pick_run, at_best = compare.get("pick"), compare.get("at_pytorch_best")

    def held_ips(run: dict | None) -> float | None:
        return run["images_per_s"] if run and run["holds"] else None

    pick_ips = held_ips(pick_run) if pick_run and pick_run["batch"] == pick else None
    best_ips = best["images_per_s"] if best else None
    at_best_ips = held_ips(at_best) if at_best and best and at_best["batch"] == best["batch"] \
        else None
    ratio = pick_ips / best_ips if pick_ips is not None and best_ips else None
    # the tuner's candidates that PyTorch alone could not run (above its largest that held)
    larger = [t for t in (report.get("tuner") or {}).get("trials", [])
              if t["holds"] and largest is not None and t["batch"] > largest]
    tuner_larger = max(larger, key=lambda t: t["images_per_s"]) if larger else None
    return {"pick": pick, "pick_images_per_s": pick_ips,
            "pick_status": pick_run["status"] if pick_run else None,
            "pick_held": pick_run["holds"] if pick_run else None,
            "pick_larger": None if pick is None or largest is None else pick > largest,
            "pytorch_best_batch": best["batch"] if best else None,
            "pytorch_best_images_per_s": best_ips,
            "pytorch_largest_held": largest,
            "pytorch_smallest_failed_above": min(failed_above, default=None),
            "ratio": ratio, "claim_holds": None if ratio is None else ratio > 1,
            "offload_at_best_images_per_s": at_best_ips,
            "offload_cost": at_best_ips / best_ips if at_best_ips is not None and best_ips
            else None,
            "batch_gain": pick_ips / at_best_ips if pick_ips is not None and at_best_ips
            else None,
            "tuner_larger_batch": tuner_larger["batch"] if tuner_larger else None,
            "tuner_larger_images_per_s": tuner_larger["images_per_s"] if tuner_larger else None,
            "tuner_larger_ratio": tuner_larger["images_per_s"] / best_ips
            if tuner_larger and best_ips else None}


def compare_reserve_s(args) -> float:
    """Seconds kept, before the tuner runs, for what must follow it: the pick's offload run and,
    when there is one, the long run (no pick measured yet: their defaults)."""
    return args.offload_run_default_s + (args.long_run_default_s if args.long_steps else 0.0)


# -- the page --------------------------------------------------------------------------------------

def gib(nbytes) -> str:
    return fmt(None if nbytes is None else nbytes / 2**30)


def markdown(report: dict) -> str:
    s, settings, summary = report, report["settings"], report.get("summary") or summarize(report)
    against = settings.get("against_pytorch")
    title = (f"# `mucudnn batch-size --offload` against PyTorch alone: {s['model']} under "
             f"{s['budget']} (issue 40, AccUDNN's measure)" if against else
             f"# `mucudnn batch-size` against a measured sweep: {s['model']} under "
             f"{s['budget']} (issue 14)")
    lines = [title, "",
             f"Device: {s.get('device') or 'unknown'}; started {s['started']}"
             + (" (**terminated** before the end)" if s.get("terminated") else "") + ". "
             "`python -m benchmarks.batch_size driver` (benchmarks/batch_size.py; training: "
             "benchmarks/shim_pytorch.py's worker, benchmarks/models.py), fp32 "
             f"{'with' if settings['tf32'] else 'without'} TF32, cudnn.benchmark "
             f"{'on' if settings['cudnn_benchmark'] else 'off'}, SGD, random data, one process "
             f"per run{', `--offload`' if settings['offload'] else ''}."]
    if s.get("command"):
        lines += ["", f"Command: `{s['command']}`"]
    lines += ["", "## Verdict", ""]
    lines += against_lines(s, summary["against_pytorch"]) if against else verdict_lines(summary)
    long = s.get("long_run")
    if long:
        lines.append(f"- long run of the pick: {long.get('status')}, {long.get('steps', 0)} timed "
                     f"steps (+{settings['warmup']} warm-up) of {settings['long_steps']}, median "
                     f"{fmt(long.get('step_ms'))} ms, peak reserved "
                     f"{gib(long.get('peak_reserved_bytes'))} GiB of {gib(s['budget_bytes'])} GiB ("
                     + {True: "✓", False: "✗", None: "-"}[summary["long_run_passed"]] + ")")
    else:
        lines.append("- long run of the pick: not run")
    if s.get("skipped"):
        lines.append(f"- not started (time budget): {', '.join(s['skipped'])}")
    tuner = s.get("tuner")
    if tuner:
        lines += ["", "## The tuner", "",
                  f"`{tuner['command']}`: exit {tuner['returncode']}"
                  + (" (timed out)" if tuner.get("timed_out") else "")
                  + f", {tuner['wall_s']:.1f} s, pick {tuner['pick']}, margin "
                  f"{gib(tuner['margin_bytes'])} GiB.", "",
                  "| batch | images/s | peak reserved GiB | held | why not |",
                  "|---|---|---|---|---|"]
        lines += [f"| {t['batch']} | {fmt(t['images_per_s'], '.1f')} | {gib(t['peak_bytes'])} | "
                  f"{'yes' if t['holds'] else 'no'} | {t['why'] or ''} |" for t in tuner["trials"]]
        lines += ["", "Its reasons (stderr):", ""] + [f"    {r}" for r in tuner["reasons"]]
    if against:
        lines += ["", "## PyTorch alone", "",
                  f"Each point: {settings['steps']} timed steps after {settings['pytorch_warmup']} "
                  f"warm-up, under `mucudnn run --no-online --memory-budget {s['budget']}` without "
                  "`--offload` (the caching allocator capped; nothing offloaded or recomputed).",
                  ""] + points_table(s["pytorch"]["points"],
                                     summary["against_pytorch"]["pytorch_best_batch"])
    else:
        lines += ["", "## The sweep", "",
                  f"Each point: {settings['steps']} timed steps after {settings['warmup']} "
                  f"warm-up, under `mucudnn run --no-online --memory-budget {s['budget']}`"
                  + (" --offload" if settings["offload"] else "") + ".", ""] \
            + points_table(s["sweep"]["points"], summary["best_batch"])
    return "\n".join(lines) + "\n"


def verdict_lines(summary: dict) -> list[str]:
    """Issue 14's verdict: the pick against the best of the sweep."""
    return [f"- pick: batch {summary['pick'] if summary['pick'] is not None else '-'}, "
            f"{fmt(summary['pick_images_per_s'], '.1f')} images/s in the sweep; best of the "
            f"sweep: batch {summary['best_batch'] if summary['best_batch'] else '-'}, "
            f"{fmt(summary['best_images_per_s'], '.1f')} images/s",
            f"- ratio pick / best: **{fmt(summary['ratio'], '.4f')}** (target >= "
            f"{summary['target']}: "
            + {True: "✓", False: "✗", None: "not measured"}[summary["ratio_passed"]] + ")",
            f"- largest batch that held in the sweep: {summary['largest_held'] or '-'}"
            + (f"; {summary['smallest_failed_above']} did not"
               if summary["smallest_failed_above"] else "")]


def against_lines(report: dict, a: dict) -> list[str]:
    """AccUDNN's measure: the comparison table and what it says."""
    settings, budget = report["settings"], report["budget"]
    compare = report.get("compare") or {}
    best = a["pytorch_best_batch"]
    best_point = next((p for p in report["pytorch"]["points"] if p["batch"] == best), None)

    def row(what: str, run: dict | None, batch) -> str:
        run = run or {}
        return (f"| {what} | {batch if batch is not None else '-'} | "
                f"{run.get('status', 'not run')} | {fmt(run.get('images_per_s'), '.1f')} | "
                f"{fmt(run.get('step_ms'))} | {gib(run.get('peak_reserved_bytes'))} | "
                + ("-" if not run else "yes" if run["holds"] else "no")
                + f" | {fmt(run.get('wall_s'), '.1f')} |")

    at_best = compare.get("at_pytorch_best")
    lines = ["| run | batch | status | images/s | step ms | peak reserved GiB | held | wall s |",
             "|---|---|---|---|---|---|---|---|",
             row("the tuner's pick, `mucudnn run --offload`", compare.get("pick"), a["pick"]),
             row("PyTorch alone, its fastest batch that held", best_point, best),
             row("`mucudnn run --offload` at PyTorch alone's batch", at_best,
                 at_best["batch"] if at_best else best),
             "",
             f"The offload runs: {settings['compare_steps']} timed steps after "
             f"{settings['compare_warmup']} warm-up (past mucudnn.torch's recording and its trial "
             f"of plans) under `mucudnn run --no-online --memory-budget {budget} --offload`; a "
             "batch the tuner ran finds its plan in the plan cache (MUCUDNN_PLAN_CACHE: "
             f"{report.get('plan_cache') or 'default'}), as a user's second run does.", ""]
    verdict = {True: "**holds**", False: "**does not hold**",
               None: "not measured"}[a["claim_holds"]]
    lines.append(f"- offload pick / PyTorch-alone best: **{fmt(a['ratio'], '.4f')}x** "
                 f"({fmt(a['pick_images_per_s'], '.1f')} / "
                 f"{fmt(a['pytorch_best_images_per_s'], '.1f')} images/s): AccUDNN's claim (a "
                 f"larger batch with offloading beats the batch that fits alone) {verdict}"
                 + (f" ({(a['ratio'] - 1) * 100:+.1f} %)" if a["ratio"] is not None else ""))
    if a["pick_held"] is False:
        lines.append(f"- the pick's offload run did not hold: {a['pick_status']}")
    if a["pick_larger"] is False:
        lines.append(f"- the tuner picked batch {a['pick']}, which PyTorch alone also runs under "
                     f"{budget}: the ratio is mucudnn.torch's cost at a batch that fits, not a "
                     "larger batch's gain")
    if a["offload_cost"] is not None:
        lines.append(f"- at PyTorch alone's batch {best}, the offload run gives "
                     f"{fmt(a['offload_cost'], '.4f')}x its images/s (mucudnn.torch's cost); the "
                     f"pick's batch gives {fmt(a['batch_gain'], '.4f')}x that offload run (the "
                     "larger batch's gain)")
    lines.append(f"- largest batch PyTorch alone held: {a['pytorch_largest_held'] or '-'}"
                 + (f"; {a['pytorch_smallest_failed_above']} did not"
                    if a["pytorch_smallest_failed_above"] else ""))
    if a["tuner_larger_batch"] is not None:
        lines.append(f"- the tuner's fastest candidate above it: batch {a['tuner_larger_batch']}, "
                     f"{fmt(a['tuner_larger_images_per_s'], '.1f')} images/s, "
                     f"{fmt(a['tuner_larger_ratio'], '.4f')}x PyTorch alone's best (the tuner's "
                     f"{settings['tuner_steps']} timed steps)")
    return lines


def points_table(points: list[dict], best_batch) -> list[str]:
    lines = ["| batch | role | status | images/s | step ms | peak reserved GiB | held | wall s |",
             "|---|---|---|---|---|---|---|---|"]
    for p in sorted(points, key=lambda p: p["batch"]):
        mark = " **best**" if p["batch"] == best_batch else ""
        lines.append(f"| {p['batch']}{mark} | {p['role']} | {p['status']} | "
                     f"{fmt(p.get('images_per_s'), '.1f')} | {fmt(p.get('step_ms'))} | "
                     f"{gib(p.get('peak_reserved_bytes'))} | {'yes' if p['holds'] else 'no'} | "
                     f"{fmt(p.get('wall_s'), '.1f')} |")
    return lines


# -- driver ----------------------------------------------------------------------------------------

class Benchmark:
    """The report, rewritten (JSON and page) after every run."""

    def __init__(self, args):
        from mucudnn.budget import parse_budget
        self.args = args
        self.budget_bytes = parse_budget(args.memory_budget)  # as the CLI reads it
        self.clock = Budget(args.time_budget_s)
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        keep = ("start", "multiple", "largest", "sweep_step", "steps", "warmup", "tuner_steps",
                "tuner_warmup", "long_steps", "target", "tf32", "cudnn_benchmark", "offload",
                "neighbours", "time_budget_s", "probe_timeout_s", "tuner_timeout_s",
                "against_pytorch", "pytorch_warmup", "compare_steps", "compare_warmup",
                "offload_at_best", "offload_run_default_s", "long_run_default_s")
        self.data = {"model": args.model, "budget": args.memory_budget,
                     "budget_bytes": self.budget_bytes, "device": None,
                     "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                     "command": "python -m benchmarks.batch_size " + shlex.join(args.argv),
                     "settings": {k: getattr(args, k) for k in keep},
                     "allocator": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
                     "plan_cache": os.environ.get("MUCUDNN_PLAN_CACHE", ""),
                     "tuner": None, "sweep": {"points": []}, "long_run": None,
                     "skipped": self.clock.skipped}
        if args.against_pytorch:
            self.data.update(pytorch={"points": []}, compare={})
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        # the worker runs as `python -m benchmarks.batch_size` from wherever the tuner starts it
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get(
            "PYTHONPATH", "").split(os.pathsep) if p])
        self.env = env

    @property
    def json_path(self) -> Path:
        return self.out / f"batch-size-{self.args.model}.json"

    def save(self) -> None:
        from mucudnn.outputs import write_text_atomically
        self.data["summary"] = summarize(self.data)
        write_text_atomically(self.json_path, json.dumps(self.data, indent=1) + "\n")
        write_text_atomically(self.json_path.with_suffix(".md"), markdown(self.data))

    def label(self, part: str) -> str:
        """The part's place in the run's order, for the log."""
        order = (("pytorch", "PyTorch alone"), ("tuner", "tuner"), ("compare", "offload"),
                 ("long run", "long run")) if self.args.against_pytorch else \
            (("tuner", "tuner"), ("sweep", "sweep"), ("ratio", "ratio"), ("long run", "long run"))
        return next(f"{i}/4 {name}" for i, (key, name) in enumerate(order, 1) if key == part)

    def say(self, text: str) -> None:
        print(f"[batch-size {self.args.model}] {text}", flush=True)

    def tuner(self) -> None:
        args = self.args
        # against PyTorch: the pick's offload run (and the long run) must still fit after it
        reserve = compare_reserve_s(args) if args.against_pytorch else 0.0
        self.clock.check("tuner", reserve)
        cmd = MU + ["batch-size", "--memory-budget", args.memory_budget, "--start",
                    str(args.start), "--multiple", str(args.multiple), "--largest",
                    str(args.largest)] + (["--offload"] if args.offload else []) + ["--"] \
            + worker_argv(args, "{}", args.tuner_steps, args.tuner_warmup)
        remaining = self.clock.remaining_s()
        timeout = args.tuner_timeout_s if remaining is None \
            else min(args.tuner_timeout_s, remaining - reserve)
        self.say(f"{self.label('tuner')} (at most {timeout:.0f} s): {' '.join(cmd[2:])}")
        rc, stdout, stderr, wall_s, timed_out = execute(cmd, self.env, timeout)
        parsed = parse_tuner_output(stdout, stderr)
        self.data["tuner"] = {"command": " ".join(["python"] + cmd[1:]), "returncode": rc,
                              "timed_out": timed_out, "wall_s": round(wall_s, 2), **parsed,
                              "stderr_tail": stderr[-2000:] if parsed["pick"] is None else ""}
        self.say(f"tuner: pick {parsed['pick']} after {len(parsed['trials'])} candidates, "
                 f"{wall_s:.1f} s" + (" (timed out)" if timed_out else f", exit {rc}"))
        for reason in parsed["reasons"]:
            self.say(f"    {reason}")
        self.save()

    def point(self, batch: int, role: str, reserve_s: float, *, part: str = "sweep",
              offload: bool | None = None, warmup: int | None = None) -> dict:
        """One run at ``batch`` (OutOfTime when it would eat into ``reserve_s``), kept in
        ``part``'s points: the sweep's (under --offload when the driver is), or PyTorch alone's
        (``offload`` False)."""
        args = self.args
        offload = args.offload if offload is None else offload
        warmup = args.warmup if warmup is None else warmup
        self.clock.check(f"{part} batch {batch} ({role})", reserve_s)
        outcome = self.run_worker(batch, args.steps, warmup, args.probe_timeout_s, offload)
        point = self.measured(batch, role, outcome)
        self.data[part]["points"].append(point)
        self.say(f"{self.label(part)} batch {batch} ({role}): {self.described(point)}")
        self.save()
        return point

    def measured(self, batch: int, role: str, outcome: dict) -> dict:
        """A run's outcome as a point: whether it held under the budget, its images/s if so."""
        point = {"batch": batch, "role": role, **outcome,
                 "holds": point_holds(outcome, self.budget_bytes)}
        point.pop("step_ms_all", None)
        if point["holds"]:
            point["images_per_s"] = images_per_s(batch, point["step_ms"])
        return point

    @staticmethod
    def described(point: dict) -> str:
        return (point["status"] + (f", {point['images_per_s']:.1f} images/s, peak reserved "
                                   f"{gib(point.get('peak_reserved_bytes'))} GiB"
                                   if point["holds"] else "") + f" ({point['wall_s']:.1f} s)")

    def run_worker(self, batch: int, steps: int, warmup: int, timeout_s: float,
                   offload: bool | None = None) -> dict:
        args = self.args
        offload = args.offload if offload is None else offload
        cmd = MU + ["run", "--no-online", "--memory-budget", args.memory_budget] \
            + (["--offload"] if offload else []) + ["--"] \
            + worker_argv(args, batch, steps, warmup)
        remaining = self.clock.remaining_s()
        timeout = timeout_s if remaining is None else max(1.0, min(timeout_s, remaining))
        rc, stdout, stderr, wall_s, timed_out = execute(cmd, self.env, timeout)
        outcome = ({"status": "timeout", "stderr_tail": stderr[-1500:]} if timed_out
                   else worker_outcome(rc, stdout, stderr))
        outcome.update(wall_s=round(wall_s, 2), warmup=warmup, offload=offload)
        if outcome.get("device") and not self.data["device"]:
            self.data["device"] = outcome["device"]
        return outcome

    def sweep(self) -> None:
        args = self.args
        pick = (self.data["tuner"] or {}).get("pick")
        held: dict[int, bool] = {}

        def reserve() -> float:
            if not args.long_steps or pick is None:
                return 0.0
            pick_point = next((p for p in self.data["sweep"]["points"] if p["batch"] == pick), None)
            return long_run_estimate_s(pick_point, args.long_steps, args.warmup,
                                       args.long_run_default_s)

        if pick is not None:
            held[pick] = self.point(pick, "pick", 0.0)["holds"]
        while (batch := next_grid_batch(held, args.multiple, args.sweep_step,
                                        args.largest)) is not None:
            held[batch] = self.point(batch, "grid", reserve())["holds"]
        if pick is not None and args.neighbours:
            for batch in neighbours(pick, args.multiple, args.largest):
                if batch not in held:
                    held[batch] = self.point(batch, "neighbour", reserve())["holds"]

    def pytorch_sweep(self) -> None:
        """PyTorch alone under the budget (no --offload) on the sweep's grid; every point keeps
        the tuner's time limit and the comparison's runs in reserve."""
        args = self.args
        reserve = args.tuner_timeout_s + compare_reserve_s(args)
        held: dict[int, bool] = {}
        while (batch := next_grid_batch(held, args.multiple, args.sweep_step,
                                        args.largest)) is not None:
            held[batch] = self.point(batch, "grid", reserve, part="pytorch", offload=False,
                                     warmup=args.pytorch_warmup)["holds"]

    def compare(self) -> None:
        """The pick under --offload (the comparison's own run: it keeps nothing in reserve),
        then the same at PyTorch alone's best batch, leaving the long run its estimated time."""
        args = self.args
        pick = (self.data["tuner"] or {}).get("pick")
        if pick is None:
            return
        self.compare_run("pick", pick, 0.0)
        best = fastest_held(self.data["pytorch"]["points"])
        if args.offload_at_best and best and best["batch"] != pick:
            self.compare_run("at_pytorch_best", best["batch"], self.long_run_reserve_s())
        elif best and best["batch"] == pick:   # the pick's run is that run
            self.data["compare"]["at_pytorch_best"] = self.data["compare"]["pick"]
            self.save()

    def compare_run(self, key: str, batch: int, reserve_s: float) -> None:
        args = self.args
        self.clock.check(f"offload run of batch {batch} ({key})", reserve_s)
        outcome = self.run_worker(batch, args.compare_steps, args.compare_warmup,
                                  args.probe_timeout_s, True)
        self.data["compare"][key] = point = self.measured(batch, key, outcome)
        self.say(f"{self.label('compare')} batch {batch} ({key}): {self.described(point)}")
        self.save()

    def long_run_reserve_s(self) -> float:
        """The long run's estimate from the pick's comparison run (0 without a long run)."""
        if not self.args.long_steps:
            return 0.0
        return long_run_estimate_s((self.data.get("compare") or {}).get("pick"),
                                   self.args.long_steps, self.args.warmup,
                                   self.args.long_run_default_s)

    def long_run(self) -> None:
        args = self.args
        pick = (self.data["tuner"] or {}).get("pick")
        if not args.long_steps or pick is None:
            return
        self.clock.check(f"long run of batch {pick}")
        self.say(f"{self.label('long run')}: batch {pick}, {args.long_steps} steps after "
                 f"{args.warmup} warm-up")
        outcome = self.run_worker(pick, args.long_steps, args.warmup,
                                  self.clock.remaining_s() or 3600.0)
        outcome.pop("step_ms_all", None)
        self.data["long_run"] = {"batch": pick, **outcome}
        self.say(f"long run: {outcome['status']}, {outcome.get('steps', 0)} steps, peak reserved "
                 f"{gib(outcome.get('peak_reserved_bytes'))} GiB of {gib(self.budget_bytes)} GiB "
                 f"({outcome['wall_s']:.1f} s)")
        self.save()


def driver(args) -> int:
    if args.offload:   # mucudnn.torch's recording steps and its trial of plans come first
        args.warmup = max(args.warmup, OFFLOAD_MIN_WARMUP)
        args.tuner_warmup = max(args.tuner_warmup, OFFLOAD_MIN_WARMUP)
    args.compare_warmup = max(args.compare_warmup, OFFLOAD_MIN_WARMUP)
    bench = Benchmark(args)
    parts = ((bench.pytorch_sweep, bench.tuner, bench.compare, bench.long_run)
             if args.against_pytorch else (bench.tuner, bench.sweep, bench.long_run))

    def terminate(signum, frame):
        raise Terminated()
    signal.signal(signal.SIGTERM, terminate)
    try:
        for part in parts:
            try:
                part()
            except OutOfTime as exc:
                bench.say(f"time budget spent: {exc} not started")
    except Terminated:
        bench.data["terminated"] = True
        bench.say("terminated: writing what was measured")
    finally:
        bench.save()
    summary = bench.data["summary"]
    if args.against_pytorch:
        against = summary["against_pytorch"]
        bench.say(f"offload pick / PyTorch-alone best: {fmt(against['ratio'], '.4f')} (pick "
                  f"{against['pick']}, {fmt(against['pick_images_per_s'], '.1f')} images/s; "
                  f"PyTorch alone {against['pytorch_best_batch']}, "
                  f"{fmt(against['pytorch_best_images_per_s'], '.1f')} images/s); AccUDNN's "
                  f"claim holds: {against['claim_holds']}")
        bench.say(f"wrote {bench.json_path} and {bench.json_path.with_suffix('.md')}")
        return 0
    bench.say(f"3/4 ratio pick / best: {fmt(summary['ratio'], '.4f')} (pick {summary['pick']}, "
              f"best {summary['best_batch']}; target >= {args.target}); long run "
              f"{summary['long_run_passed']}; passed {summary['passed']}")
    bench.say(f"wrote {bench.json_path} and {bench.json_path.with_suffix('.md')}")
    return 0


def report(args) -> int:
    """Rewrite each OUT/batch-size-*.md from its JSON (after a change to the page)."""
    from mucudnn.outputs import write_text_atomically
    paths = sorted(Path(args.out).glob("batch-size-*.json"))
    for path in paths:
        write_text_atomically(path.with_suffix(".md"), markdown(json.loads(path.read_text())))
        print(f"wrote {path.with_suffix('.md')}")
    return 0 if paths else 1


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    sub = ap.add_subparsers(dest="mode", required=True)

    def training(p):
        p.add_argument("--model", default="resnet50", help="a model of benchmarks/models.py")
        p.add_argument("--no-tf32", dest="tf32", action="store_false", help="TF32 off")
        p.add_argument("--cudnn-benchmark", action="store_true",
                       help="torch.backends.cudnn.benchmark = True")

    w = sub.add_parser("worker", help="one training run: prints mucudnn-throughput: <images/s>")
    training(w)
    w.add_argument("--batch-size", type=int, required=True)
    w.add_argument("--steps", type=int, default=10, help="timed steps (median)")
    w.add_argument("--warmup", type=int, default=3, help="untimed steps first")

    d = sub.add_parser("driver", help="tuner, sweep, ratio, long run")
    training(d)
    d.add_argument("--memory-budget", default="24GiB", help="as `mucudnn run --memory-budget`")
    d.add_argument("--offload", action="store_true", help="tuner and runs with --offload")
    d.add_argument("--against-pytorch", action="store_true",
                   help="with --offload: instead of the sweep, PyTorch alone under the budget (no "
                        "--offload), the pick under --offload and their ratio (AccUDNN's claim)")
    d.add_argument("--pytorch-warmup", type=int, default=3,
                   help="--against-pytorch: warm-up steps of each PyTorch-alone run")
    d.add_argument("--compare-steps", type=int, default=20,
                   help="--against-pytorch: timed steps of each offload run (the pick, and "
                        "PyTorch alone's best batch)")
    d.add_argument("--compare-warmup", type=int, default=OFFLOAD_WARMUP,
                   help="--against-pytorch: warm-up steps of each offload run (at least "
                        f"{OFFLOAD_MIN_WARMUP})")
    d.add_argument("--no-offload-at-best", dest="offload_at_best", action="store_false",
                   help="--against-pytorch: do not also run --offload at PyTorch alone's best")
    d.add_argument("--offload-run-default-s", type=float, default=60.0,
                   help="--against-pytorch: time kept after the tuner for the pick's offload run")
    d.add_argument("--start", type=int, default=32, help="the tuner's --start")
    d.add_argument("--multiple", type=int, default=16,
                   help="the tuner's --multiple; the sweep doubles from it")
    d.add_argument("--largest", type=int, default=4096, help="the tuner's and sweep's largest")
    d.add_argument("--sweep-step", type=int, default=32,
                   help="above the largest power-of-two multiple that held, step by this")
    d.add_argument("--no-neighbours", dest="neighbours", action="store_false",
                   help="do not also measure pick - multiple and pick + multiple")
    d.add_argument("--steps", type=int, default=10,
                   help="timed steps of each sweep run (PyTorch alone's with --against-pytorch)")
    d.add_argument("--warmup", type=int, default=3,
                   help="warm-up steps of the sweep's runs and the long run (at least "
                        f"{OFFLOAD_MIN_WARMUP} with --offload)")
    d.add_argument("--tuner-steps", type=int, default=10, help="timed steps of each tuner run")
    d.add_argument("--tuner-warmup", type=int, default=3)
    d.add_argument("--long-steps", type=int, default=500, help="the pick's long run (0: none)")
    d.add_argument("--long-run-default-s", type=float, default=120.0,
                   help="time kept for the long run when the pick's sweep run gave no estimate")
    d.add_argument("--target", type=float, default=0.97, help="pick / best images/s at least")
    d.add_argument("--time-budget-s", type=float, default=540.0,
                   help="no run starts after this many seconds")
    d.add_argument("--tuner-timeout-s", type=float, default=330.0)
    d.add_argument("--probe-timeout-s", type=float, default=180.0, help="per sweep run")
    d.add_argument("--out", default="batch_size_results")

    r = sub.add_parser("report", help="rewrite the pages from the JSON in --out")
    r.add_argument("--out", required=True)
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = parser()
    args = ap.parse_args(argv)
    args.argv = list(argv)
    if args.mode == "driver" and args.against_pytorch and not args.offload:
        ap.error("--against-pytorch compares the pick under --offload with PyTorch alone: "
                 "give --offload too")
    return {"worker": worker, "driver": driver, "report": report}[args.mode](args)


if __name__ == "__main__":
    sys.exit(main())
