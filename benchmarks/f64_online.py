"""Float64 gradients with online tuning active (issue 12, correctness): equal with and without it.

For each model and cuDNN path (``legacy``: TORCH_CUDNN_V8_API_DISABLED=1; ``default``: the graph
API), one plain float64 run writes the reference gradients; then two runs under `mucudnn run` with
no plan (zero set-up: online tuning) share a fresh online directory: the first measures every
kernel on its first call, in the middle of the very step whose gradients it writes; the second
loads what the first kept and measures nothing. ``--limit`` (a hard workspace cap, default 1MiB)
makes the points that run micro-batched, so the check covers the slices and the accumulation.
Each run does three forward+backward passes (the later ones launch the shim's CUDA graphs); the
worst relative L2 error over every parameter gradient must stay far below 1e-10.

    python -m benchmarks.f64_online --models resnet50 --paths legacy default --out DIR
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import tempfile
from pathlib import Path

from benchmarks.shim_pytorch import compare_pair, run_worker, split_kernels

ONLINE_SUMMARY = re.compile(r"online tuning: measured (\d+) kernels \((\d+) candidates timed\) in (\d+) ms; "
                            r"(\d+) kernels from")


def online_summary(log: Path) -> dict:
    """The shim's exit line on online tuning, as numbers (empty if it printed none)."""
    text = log.read_text(errors="replace") if log.exists() else ""
    found = ONLINE_SUMMARY.findall(text)
    if not found:
        return {}
    measured, candidates, ms, loaded = (int(v) for v in found[-1])
    return {"measured_kernels": measured, "candidates_timed": candidates, "measuring_ms": ms,
            "kernels_from_file": loaded}


def check(model: str, path: str, args, out: Path, scratch: Path) -> dict:
    common = dict(tf32=False, batch=args.batch, double=True, path=path,
                  cudnn_benchmark=args.cudnn_benchmark)
    ref = scratch / f"{model}-{path}-ref.pt"
    run_worker(model, {}, shim=False, grads=str(ref), **common)
    online_dir = scratch / f"{model}-{path}-online"
    result = {"model": model, "path": path, "batch": args.batch, "limit": args.limit,
              "cudnn_benchmark": args.cudnn_benchmark}
    for run in ("first", "second"):
        got, log = scratch / f"{model}-{path}-{run}.pt", out / f"{model}-{path}-{run}-shim.log"
        log.unlink(missing_ok=True)
        run_worker(model, {"MUCUDNN_ONLINE_DIR": str(online_dir)}, shim=True, online=True,
                   limit=args.limit, log=str(log), grads=str(got), **common)
        errors = compare_pair(str(ref), str(got))
        result[run] = {"worst_grad_rel_err": errors["worst_grad_rel_err"],
                       "worst_grad": errors["worst_grad"], "loss_rel_err": errors["loss_rel_err"],
                       "tensors": errors["tensors"], "split_kernels": split_kernels(str(log)),
                       **online_summary(log)}
        r = result[run]
        print(f"[{model} {path}] {run} run: worst grad rel err {r['worst_grad_rel_err']:.2e} "
              f"({r['worst_grad']}), loss rel err {r['loss_rel_err']:.2e}, {r['split_kernels']} "
              f"split kernels; online: {r.get('measured_kernels', '?')} measured, "
              f"{r.get('kernels_from_file', '?')} from the file", flush=True)
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["resnet50"])
    ap.add_argument("--paths", nargs="+", choices=["legacy", "default"], default=["legacy", "default"])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--limit", default="1MiB", help="hard workspace cap, so that points split")
    ap.add_argument("--cudnn-benchmark", action="store_true")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp())  # gradients are large: never under --out
    results = []
    try:
        for model in args.models:
            for path in args.paths:
                try:
                    results.append(check(model, path, args, out, scratch))
                except Exception as exc:  # one failing configuration must not hide the others
                    results.append({"model": model, "path": path, "error": str(exc)[-2000:]})
                    print(f"[{model} {path}] failed: {str(exc)[-500:]}", flush=True)
                (out / "f64_online.json").write_text(json.dumps(results, indent=1))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
