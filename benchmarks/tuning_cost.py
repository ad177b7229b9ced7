"""Tuning cost (issue 12, item 4): `mucudnn bench` + `tune` wall time from an empty store.

On a GPU (the default), for each model of benchmarks/models.py (default: the issue's five and
DenseNet-121, each at its N unless --batch or MODEL:BATCH says otherwise): record the kernels one
training step runs (`mucudnn record -- python benchmarks/shim_pytorch.py worker ...`, as
shim_pytorch.py's prepare_plan does), then for each variant time `mucudnn bench --recording R`
into a new, empty store and `mucudnn tune --recording R --workspace-limit L` from it. Variants:

- ``full``: bench with no limit (every configuration at every size: the old cost);
- ``limit``: ``bench --workspace-limit L`` (configurations over L are not timed; exact);
- ``quick``: ``bench --workspace-limit L --quick`` (sizes from N down, stopping per kernel).

The JSON report holds, per model and variant, the wall times, the kernels, the store's rows (timed,
left untimed) and the plan's predicted time per step, so that variants can be compared.

    python -m benchmarks.tuning_cost --models resnet50 unet3d:2 densenet121 --out DIR

``--simulate`` replays stored measurements instead (the shipped H200 ones, or ``--store``) on
the CPU: for the kernels of each ``--recording``, every variant's count of configurations timed
in full and by a probe only, of sizes timed, the GPU time the timing method would spend in timed
calls (mucudnn.timing.calls_made; without the cutoffs of dominated configurations, which every
variant has; host time not included), and whether each kernel's plan at the limit equals the one
from all rows (for those that differ: both predicted times).

    python -m benchmarks.tuning_cost --simulate --out DIR \
        --recording benchmarks/results/raw/resnet50-legacy-tf32.record
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.models import ISSUE_MODELS, parse_model

MU = [sys.executable, "-m", "mucudnn"]
VARIANTS = {"full": [], "limit": ["--workspace-limit", "{limit}"],
            "quick": ["--workspace-limit", "{limit}", "--quick"]}


def run(cmd: list[str], timeout: float) -> tuple[float, subprocess.CompletedProcess]:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    return time.perf_counter() - t0, proc


def store_counts(path: Path) -> dict:
    from mucudnn.bench import is_not_timed
    from mucudnn.store import open_store
    with open_store(path) as store:
        rows = [r.measurement for r in store.rows()]
    return {"rows": len(rows), "ok": sum(r.ok for r in rows),
            "not_timed": sum(is_not_timed(r) for r in rows),
            "sizes": len({(r.key, r.batch) for r in rows if not is_not_timed(r)})}


def gpu(args) -> int:
    from benchmarks import shim_pytorch
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"limit": args.limit, "path": args.path, "models": {}}
    for spec in args.models:
        model, batch = parse_model(spec)
        batch = args.batch or batch
        entry = report["models"][model] = {"batch": batch}
        record = out / f"{model}-{args.path}.record"
        record.unlink(missing_ok=True)
        try:
            t0 = time.perf_counter()
            shim_pytorch.run_worker(model, {}, tf32=True, shim=True, record=str(record), steps=1,
                                    warmup=1, path=args.path, batch=batch)
            entry["record_s"] = time.perf_counter() - t0
        except RuntimeError as exc:
            entry["error"] = str(exc)[-2000:]
            print(model, "recording failed:", str(exc)[-300:], flush=True)
            (out / "tuning_cost.json").write_text(json.dumps(report, indent=1))
            continue
        for variant in args.variants:
            store = out / f"{model}-{variant}.sqlite"
            for old in out.glob(store.name + "*"):
                old.unlink()
            plan = out / f"{model}-{variant}.plan"
            extra = [a.format(limit=args.limit) for a in VARIANTS[variant]]
            result = entry[variant] = {}
            try:
                result["bench_s"], bench = run(
                    MU + ["bench", "--recording", str(record), "--no-progress", "--store",
                          str(store), *extra], args.timeout)
                result["bench"] = (bench.stdout + bench.stderr).strip()[-1000:]
                if bench.returncode:
                    continue
                result["tune_s"], tune = run(
                    MU + ["tune", "--recording", str(record), "--workspace-limit", args.limit,
                          "--store", str(store), "-o", str(plan)], args.timeout)
                result["tune"] = (tune.stdout + tune.stderr).strip()[-1000:]
                result.update(store_counts(store))
                if tune.returncode == 0:
                    from mucudnn.plan import read_plan
                    result["predicted_ms"] = sum(e.time_ms for e in read_plan(plan))
            except subprocess.TimeoutExpired:
                result["timeout_s"] = args.timeout
            print(model, variant, {k: v for k, v in result.items() if k not in ("bench", "tune")},
                  flush=True)
            # after every variant: a stage's timeout keeps what was measured
            (out / "tuning_cost.json").write_text(json.dumps(report, indent=1))
    (out / "tuning_cost.json").write_text(json.dumps(report, indent=1))
    return 0


def simulate(args) -> int:
    """Replay stored rows as if they were being measured (see the module doc)."""
    from mucudnn.bench import Pruning, is_not_timed, measure_kernel, missing_apis
    from mucudnn.engines import Api, api_of
    from mucudnn.errors import MucudnnError
    from mucudnn.measurement import Measurement, Status
    from mucudnn.optimizer import Policy, best_plan, candidate_sizes
    from mucudnn.plan import read_plan, read_recording
    from mucudnn.sizes import parse_size
    from mucudnn.timing import TimingMethod, calls_made
    from mucudnn.tuner import open_measurements

    limit = parse_size(args.limit)
    method = TimingMethod()
    variants = {"full": Pruning(), "limit": Pruning(limit=limit),
                "quick": Pruning(limit=limit, quick=True)}
    report = {"limit": args.limit, "recordings": args.recording, "variants": {}}
    source, env = open_measurements(args.store)
    with source:
        # a plan file's kernels, or a recording's
        problems = [e.problem for path in args.recording if path.endswith(".plan")
                    for e in read_plan(path)] + \
            read_recording([path for path in args.recording if not path.endswith(".plan")])
        stored = {p.key: source.get(env.gpu, env.cudnn, p.key) for p in problems}
        plans: dict[str, dict] = {}
        for name, pruning in variants.items():
            cost = {"configs": 0, "probes": 0, "sizes": 0, "gpu_s": 0.0, "kernels": 0,
                    "skipped": 0}
            plans[name] = {}
            for p in problems:
                sizes = candidate_sizes(Policy.POWER_OF_TWO, p.n)
                rows = [r for r in stored[p.key] if r.batch in sizes]
                if missing_apis(rows, sizes, set(Api), p, Pruning()):
                    cost["skipped"] += 1  # not every size stored: nothing to replay
                    continue
                cost["kernels"] += 1

                def time_size(b, api, gate, rows=rows):
                    out, todo = [], []
                    for r in rows:
                        if r.batch != b or api_of(r.algo) is not api:
                            continue
                        if not r.ok:
                            out.append(r)
                        elif gate.skip(r.workspace):
                            out.append(Measurement(r.key, b, r.algo, r.math, 0.0, r.workspace,
                                                   Status.NOT_SUPPORTED, gate.skip(r.workspace)))
                        else:
                            todo.append(r)
                    todo.sort(key=lambda r: not gate.fits(r.workspace))
                    for r in todo:  # as the Benchmarker: fitting ones first, then probes
                        note = gate.skip_late(r.workspace)
                        if not note and gate.probe_only(r.workspace):
                            cost["probes"] += 1
                            cost["gpu_s"] += calls_made(r.time_ms, method,
                                                        gate.cutoff_ms(r.workspace),
                                                        probe_only=True) * r.time_ms / 1e3
                            gate.probed(r.time_ms)
                            note = gate.over_limit_note
                        if note:
                            out.append(Measurement(r.key, b, r.algo, r.math, 0.0, r.workspace,
                                                   Status.NOT_SUPPORTED, note))
                            continue
                        cost["configs"] += 1
                        cost["gpu_s"] += calls_made(r.time_ms, method) * r.time_ms / 1e3
                        out.append(gate.add(r))
                    return out

                got, timed = measure_kernel(p, {b: frozenset(Api) for b in sizes}, [], pruning,
                                            time_size)
                cost["sizes"] += timed
                try:
                    plans[name][p.key] = best_plan([r for r in got if not is_not_timed(r)], p.n,
                                                   limit)
                except MucudnnError:
                    plans[name][p.key] = None
            cost["gpu_s"] = round(cost["gpu_s"], 1)
            # Σ over kernels of the plan's predicted time (each kernel once, not weighted)
            cost["predicted_ms_sum"] = round(sum(plan.time_ms for plan in plans[name].values()
                                                 if plan is not None), 3)
            if name != "full":
                cost["plans_equal_to_full"] = sum(plans[name][k] == plans["full"][k]
                                                  for k in plans[name])
                # predicted ms of the full store's plan -> of this variant's, where they differ
                cost["plans_differing"] = {
                    k: [getattr(plans["full"][k], "time_ms", None),
                        getattr(plans[name][k], "time_ms", None)]
                    for k in plans[name] if plans[name][k] != plans["full"][k]}
            report["variants"][name] = cost
            print(name, {k: v for k, v in cost.items() if k != "plans_differing"},
                  f"{len(cost.get('plans_differing', []))} plans differ", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tuning_cost_simulated.json").write_text(json.dumps(report, indent=1))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=[*ISSUE_MODELS, "densenet121"],
                    help="MODEL or MODEL:BATCH (benchmarks/models.py)")
    ap.add_argument("--variants", nargs="+", choices=sorted(VARIANTS), default=["limit", "quick"])
    ap.add_argument("--limit", default="64MiB")
    ap.add_argument("--batch", type=int, help="every model's batch (default: each model's N)")
    ap.add_argument("--path", choices=["legacy", "default"], default="default",
                    help="PyTorch's cuDNN path to record (default: the graph API)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per bench or tune")
    ap.add_argument("--out", required=True)
    ap.add_argument("--simulate", action="store_true", help="replay stored rows on the CPU")
    ap.add_argument("--recording", nargs="+", default=[],
                    help="--simulate: kernels to replay (recordings, or plan files' kernels)")
    ap.add_argument("--store", help="--simulate: rows to replay (default: shipped + user store)")
    args = ap.parse_args()
    if args.simulate:
        if not args.recording:
            ap.error("--simulate needs --recording files")
        return simulate(args)
    return gpu(args)


if __name__ == "__main__":
    raise SystemExit(main())
