"""Issue "Never slower than PyTorch": the shim with a front plan (no workspace limit) against
plain PyTorch with the same settings, as users run it (default path, TF32 on), with
`cudnn.benchmark` off and on, then under per-process memory caps (a smaller GPU emulated).

For each model: record what it runs under the shim, `mucudnn bench` it (both APIs, powerOfTwo),
`mucudnn tune` it twice: a front plan (no limit: each call runs the fastest point within the
workspace it has) and a front cut at --cap-limit (the hard cap). Then:
- no pressure: R rounds, each PyTorch then the shim back to back, per benchmark mode; the ratio
  shim/PyTorch of each round and their median;
- under each --caps GiB: PyTorch, the shim with the front plan, the shim with the capped front
  (benchmark off), and the shim with the front plan told the cap as MUCUDNN_MEMORY_BUDGET, so that
  it chooses each point within what the budget has left (shim_front_room; its info log counts the
  kernels degraded); step time or "oom".
Worker and timing: benchmarks/shim_pytorch.py (CUDA events, warm-up, median of the steps).

    python3 -m benchmarks.never_slower --models resnet50:256 r3d_18:32 --caps 6.0 5.6 --out DIR
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.shim_pytorch import MU, run_worker


def prepare(model: str, batch: int, out: Path, cap_limit: str, dtype: str = "fp32") -> dict:
    """Record ``model`` at ``batch`` in ``dtype`` (fp32: TF32 on) under the shim, bench it, tune
    a front plan and a front cut at ``cap_limit``: {"plans": {"front": P, "capped": P}, ...}."""
    tag = model if dtype == "fp32" else f"{model}-{dtype}"
    record = out / f"{tag}.record"
    record.unlink(missing_ok=True)
    run_worker(model, {}, tf32=True, shim=True, record=str(record), steps=1, warmup=1, path="default",
               batch=batch, dtype=dtype)
    t0 = time.perf_counter()
    bench = subprocess.run(MU + ["bench", "--recording", str(record), "--no-progress"],
                           capture_output=True, text=True)
    bench_s = time.perf_counter() - t0
    if bench.returncode != 0:
        raise RuntimeError(f"bench failed: {bench.stderr[-2000:]}")
    plans = {}
    for name, extra in (("front", []), ("capped", ["--workspace-limit", cap_limit, "--front"])):
        plan = out / f"{tag}-{name}.plan"
        tune = subprocess.run(MU + ["tune", "--recording", str(record), "-o", str(plan), *extra],
                              capture_output=True, text=True)
        if tune.returncode != 0:
            raise RuntimeError(f"tune {name} failed: {tune.stderr[-2000:]}")
        plans[name] = str(plan)
    return {"plans": plans, "bench_s": bench_s, "bench_tail": bench.stdout[-500:]}


def step(result: dict):
    return None if result.get("oom") else result["step_ms"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["resnet50:256"], help="MODEL:BATCH")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--caps", nargs="*", type=float, default=[], help="memory caps in GiB")
    ap.add_argument("--cap-limit", default="64MiB", help="the hard cap of the capped front plan")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {}
    for spec in args.models:
        model, _, batch = spec.partition(":")
        batch = int(batch or 256)
        r = report[spec] = {}
        try:
            r["prepare"] = prepare(model, batch, out, args.cap_limit)
            plans = r["prepare"]["plans"]
            for mode in (False, True):
                rounds = []
                for _ in range(args.rounds):
                    torch_run = run_worker(model, {}, tf32=True, shim=False, path="default", batch=batch,
                                           cudnn_benchmark=mode)
                    shim_run = run_worker(model, {}, tf32=True, shim=True, plan=plans["front"], path="default",
                                          batch=batch, cudnn_benchmark=mode,
                                          log=str(out / f"{model}-bench{int(mode)}-shim.log"))
                    rounds.append({"pytorch_ms": step(torch_run), "shim_ms": step(shim_run),
                                   "ratio": step(shim_run) / step(torch_run),
                                   "peak_gib": [x["peak_bytes"] / 2**30 for x in (torch_run, shim_run)]})
                median = statistics.median(x["ratio"] for x in rounds)
                r["benchmark_on" if mode else "benchmark_off"] = {"rounds": rounds, "median_ratio": median}
                ratios = " ".join(f"{x['ratio']:.4f}" for x in rounds)
                print(f"[{spec}] cudnn.benchmark={mode}: shim/PyTorch {ratios} -> median {median:.4f}",
                      flush=True)
            caps = r["caps"] = {}
            for cap in args.caps:
                row = caps[str(cap)] = {}
                room_log = out / f"{model}-cap{cap}-room.log"
                room_log.unlink(missing_ok=True)
                budget = {"MUCUDNN_MEMORY_BUDGET": str(int(cap * 2**30))}  # the cap, for the shim's room
                for name, env, kwargs in (("pytorch", {}, {"shim": False}),
                                          ("shim_front", {}, {"shim": True, "plan": plans["front"]}),
                                          ("shim_capped", {}, {"shim": True, "plan": plans["capped"],
                                                               "limit": args.cap_limit}),
                                          ("shim_front_room", budget, {"shim": True, "plan": plans["front"],
                                                                       "log": str(room_log)})):
                    result = run_worker(model, env, tf32=True, path="default", batch=batch, memory_cap_gib=cap,
                                        **kwargs)
                    row[name] = step(result)
                if room_log.exists():  # the room's info lines: one per degraded kernel, a count at exit
                    lines = room_log.read_text(errors="replace").splitlines()
                    r.setdefault("room", {})[str(cap)] = {
                        "degraded_kernels": sum("degraded for lack of memory" in line for line in lines),
                        "exit_line": next((line for line in lines if "kernels got a front point" in line), None)}
                shown = ", ".join(f"{k} " + ("oom" if v is None else f"{v:.1f} ms") for k, v in row.items())
                print(f"[{spec}] cap {cap} GiB: {shown}", flush=True)
        except Exception as exc:  # keep going: the other models still run
            r["error"] = str(exc)[-2000:]
            print(f"[{spec}] failed: {exc}", flush=True)
        (out / "never_slower.json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
