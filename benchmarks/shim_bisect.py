"""Which part of a plan changes a model's gradients? Runs the model's gradient check (the worker of
shim_pytorch.py, TF32 off) without the shim, with the whole plan, with the plan's entries of one
direction at a time, and with CUDA_LAUNCH_BLOCKING=1, and prints each run's largest per-tensor
relative difference from the run without the shim.

    python -m benchmarks.shim_bisect --model alexnet --plan P --out DIR
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from benchmarks.shim_pytorch import run_worker


def filtered_plan(plan: Path, direction: str | None, out: Path) -> Path:
    lines = plan.read_text().splitlines()
    keep = [l for l in lines if not l.startswith("kernel ")
            or direction is None or l.split()[1].startswith(f"dir={direction},")]
    path = out / f"{plan.stem}-{direction or 'all'}.plan"
    path.write_text("\n".join(keep) + "\n")
    return path


def differences(ref: str, got: str) -> dict[str, float]:
    """Relative L2 difference per gradient tensor, largest first."""
    import torch
    a, b = torch.load(ref), torch.load(got)
    errs = {n: float((b["grads"][n].double() - g.double()).norm() / g.double().norm())
            for n, g in a["grads"].items()}
    return dict(sorted(errs.items(), key=lambda item: -item[1]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--plan", required=True, type=Path)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--limit", default="64MiB")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    ref = str(args.out / "ref.pt")
    run_worker(args.model, {}, tf32=False, shim=False, grads=ref)
    runs = [(d, {}) for d in (None, "fwd", "bwd_data", "bwd_filter")]
    runs.append((None, {"CUDA_LAUNCH_BLOCKING": "1"}))
    for direction, env in runs:
        plan = filtered_plan(args.plan, direction, args.out)
        got = str(args.out / "got.pt")
        run_worker(args.model, env, tf32=False, shim=True, grads=got, plan=str(plan),
                   limit=args.limit)
        errs = differences(ref, got)
        shown = ", ".join(f"{name} {err:.2e}" for name, err in list(errs.items())[:4])
        last = list(errs.items())[-3:]
        print(f"plan entries {direction or 'all':10s} {env or ''}: {shown}; smallest: "
              + ", ".join(f"{name} {err:.2e}" for name, err in last), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
