"""What a convolution workspace limit buys under a memory cap (issue 12 (b), issue 14's "per
convolution its point on the time-workspace front").

Under a cap the offload planner takes each step's baseline (everything but the saved tensors) as
recorded, cuDNN workspace included; at the 3-D models' backward peaks that baseline is 2.4 GiB
(r3d_18) and 3.2 GiB (U-Net). A workspace limit (the shim's `--workspace-limit`, each kernel's
fastest micro-batched point within it) lowers that baseline for some convolution time. Per model
and limit this study runs, each in its own process (benchmarks/pressure.py's worker, online
tuning or, with ``--shim-mode front``, a front plan benched offline over both APIs; PyTorch's
default path, fp32 with TF32):

- the shim uncapped: the setting's cost in step time and what it takes off the peak;
- shim + offload (`mucudnn run --memory-budget CAP --offload`) at each cap: step and flushes.

A setting is a hard limit (`--workspace-limit`) or a slack (`MUCUDNN_WORKSPACE_SLACK`: each
kernel of a front plan at its point of least workspace within that many percent of its fastest,
what `mucudnn run --offload` does). A first-use run per setting tunes the kernels the limit makes PyTorch pick, outside the timed runs.

    python -m benchmarks.workspace_limit --models unet3d r3d_18 --caps unet3d=7.0 r3d_18=4.5 \\
        --limits none 256MiB 64MiB --out OUT
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from benchmarks.models import parse_model
from benchmarks.pressure import RUN_CHOICES, Budget, Runner, brief, parser as pressure_parser
from mucudnn.outputs import write_text_atomically

GiB = 2**30


def study(args) -> dict:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    pressure_args = pressure_parser().parse_args(
        ["minmem", "--out", str(out), "--dtypes", "fp32", "--benchmark", "off",
         "--probe-steps", str(args.probe_steps), "--offload", "--shim-mode", args.shim_mode]
        + (["--memory-trace"] if args.memory_trace else []))
    runner = Runner(pressure_args, Budget(args.time_budget_s), out)
    caps = {}
    for spec in args.caps:
        model, _, values = spec.partition("=")
        caps[model] = [float(v) for v in values.split(",")]
    result = {"limits": args.limits, "caps": caps, "models": {},
              "settings": {"shim_mode": args.shim_mode, "steps": args.steps,
                           "probe_steps": args.probe_steps, "profile_steps": args.profile,
                           "offload_warmup": pressure_args.offload_warmup,
                           "allocator": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")}}
    path = out / "workspace-limit.json"
    for model, batch in (parse_model(m) for m in args.models):
        entry = result["models"][model] = {"batch": batch, "rows": []}
        entry["pytorch_uncapped"] = brief(runner.run(
            f"{model} PyTorch uncapped", model, batch, shim=False, dtype="fp32",
            cudnn_benchmark=False, steps=args.steps, warmup=3, profile_steps=args.profile))
        for limit in args.limits:
            apply_setting(limit)
            runner.tuned.clear()  # a limit makes PyTorch pick other engines: tune them first
            first = runner.first_use(model, batch, "fp32", False)
            row = {"limit": limit, "first_use": first and {k: first.get(k) for k in ("status", "wall_s")}}
            row["shim_uncapped"] = brief(runner.run(
                f"{model} shim uncapped, limit {limit}", model, batch, shim=True, dtype="fp32",
                cudnn_benchmark=False, steps=args.steps, warmup=3))
            row["offload"] = {}
            for cap in caps.get(model, []):
                run = brief(runner.run(
                    f"{model} offload at {cap:g} GiB, limit {limit}", model, batch, shim=True,
                    offload=True, dtype="fp32", cudnn_benchmark=False, cap_gib=cap,
                    steps=args.probe_steps, warmup=pressure_args.offload_warmup,
                    profile_steps=args.profile))
                for name in ("offload_profile", "offload_log"):  # one file per cap: keep each
                    if run.get(name):                              # setting's
                        kept = Path(run[name])
                        kept = kept.with_name(f"{kept.stem}-limit-{limit}{kept.suffix}")
                        (out / run[name]).replace(out / kept)
                        run[name] = str(kept)
                row["offload"][f"{cap:g}"] = run
            entry["rows"].append(row)
            write_text_atomically(path, json.dumps(result, indent=1))
            print(line(model, entry, row), flush=True)
    for name in SETTING_ENV:
        os.environ.pop(name, None)
    return result


#: what a setting sets, each run's environment, cleared before each setting
SETTING_ENV = RUN_CHOICES


def apply_setting(setting: str) -> None:
    """This process's environment (the runs inherit it) for one setting, comma-separated items:
    ``none`` (the fastest point, slack 0, where `mucudnn run --offload` would give 5), a
    workspace limit (a size, slack 0), ``slack=PERCENT`` (no limit), ``headroom=PERCENT``
    (mucudnn.torch's plans leave that much of the cap, ``MUCUDNN_OFFLOAD_HEADROOM``)."""
    for name in SETTING_ENV:
        os.environ.pop(name, None)
    os.environ["MUCUDNN_WORKSPACE_SLACK"] = "0"
    for item in setting.split(","):
        if item.startswith("slack="):
            os.environ["MUCUDNN_WORKSPACE_SLACK"] = item.partition("=")[2]
        elif item.startswith("headroom="):
            os.environ["MUCUDNN_OFFLOAD_HEADROOM"] = item.partition("=")[2]
        elif item != "none":
            os.environ["MUCUDNN_WORKSPACE_LIMIT"] = item


def line(model: str, entry: dict, row: dict) -> str:
    base = entry["pytorch_uncapped"].get("step_ms")

    def step(run):
        if run.get("status") != "ok":
            return run.get("status", "?")
        ratio = f" ({run['step_ms'] / base:.3f}x)" if base else ""
        extra = f", {run['alloc_retries']} flushes" if "alloc_retries" in run else ""
        return f"{run['step_ms']:.1f} ms{ratio}{extra}"
    shim = row["shim_uncapped"]
    peak = f", peak {shim['peak_bytes'] / GiB:.2f} GiB" if shim.get("peak_bytes") else ""
    caps = "; ".join(f"{cap} GiB: {step(run)}" for cap, run in row["offload"].items())
    return (f"{model} limit {row['limit']}: uncapped {step(shim)}{peak} (PyTorch {base and round(base, 1)} "
            f"ms, peak {entry['pytorch_uncapped'].get('peak_bytes', 0) / GiB:.2f} GiB); offload {caps}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["unet3d", "r3d_18"])
    ap.add_argument("--caps", nargs="*", default=["unet3d=7.0", "r3d_18=4.5"],
                    help="MODEL=GiB[,GiB...]: the caps of the offload runs")
    ap.add_argument("--limits", nargs="+", default=["none", "slack=5", "256MiB"],
                    help="settings: none, a workspace limit (SIZE) or slack=PERCENT, and "
                         "headroom=PERCENT, comma-separated (e.g. slack=5,headroom=5)")
    ap.add_argument("--shim-mode", choices=["online", "front"], default="online",
                    help="online tuning, or a front plan (record, bench both APIs, tune) made first")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--probe-steps", type=int, default=3)
    ap.add_argument("--time-budget-s", type=float)
    ap.add_argument("--memory-trace", action="store_true",
                    help="capped runs also record one step's allocator history (pressure's)")
    ap.add_argument("--profile", type=int, default=0, metavar="STEPS",
                    help="PyTorch's uncapped runs and the capped ones profile STEPS more steps "
                         "(the worker's --profile: compute stream busy and waiting, copies)")
    ap.add_argument("--out", required=True)
    study(ap.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
