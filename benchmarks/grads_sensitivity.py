"""Which part of a shim run moves a model's fp32 gradients (TF32 off)?

Against a first PyTorch run and a float64 run of the same weights and data, compares: a second
PyTorch run, the shim loaded with no plan, the shim's workspace limit alone (PyTorch then picks
other engines itself), and the limit with a plan. Prints, per run, the tensors less accurate than
PyTorch (as ``shim_pytorch.py`` judges them) and the errors of the classifier's tensors.

    python -m benchmarks.grads_sensitivity PLAN [--model vgg16] [--path default] [--limit 64MiB]

Session 4 ran it on VGG-16 (benchmarks/results/graph-pytorch-h200.md, raw/grads-sensitivity-vgg16.txt).
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

from benchmarks import shim_pytorch  # the worker and the comparison of shim_pytorch's driver


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("plan", help="a TF32-off (math=fma) plan of the model on this path")
    ap.add_argument("--model", default="vgg16")
    ap.add_argument("--path", default="default", choices=("default", "legacy"))
    ap.add_argument("--limit", default="64MiB")
    args = ap.parse_args()
    scratch = Path(tempfile.mkdtemp())
    runs = {  # name -> shim_pytorch.run_worker keyword arguments
        "ref2": dict(shim=False),
        "passthrough": dict(shim=True),
        "limit_only": dict(shim=True, limit=args.limit),
        "plan": dict(shim=True, plan=args.plan, limit=args.limit),
    }
    try:
        common = dict(tf32=False, path=args.path, dtype="fp32", batch=256)
        shim_pytorch.run_worker(args.model, {}, grads=str(scratch / "f64.pt"), double=True,
                                shim=False, **common)
        shim_pytorch.run_worker(args.model, {}, grads=str(scratch / "ref.pt"), shim=False,
                                **common)
        for name, extra in runs.items():
            shim_pytorch.run_worker(args.model, {}, grads=str(scratch / f"{name}.pt"), **extra,
                                    **common)
            r = shim_pytorch.compare_grads(str(scratch / "ref.pt"), str(scratch / f"{name}.pt"),
                                           str(scratch / "f64.pt"))
            head = {t["tensor"]: {"between": t["between"], "no_shim_vs_f64": t["no_shim_vs_f64"],
                                  "run_vs_f64": t["shim_vs_f64"]}
                    for t in r["per_tensor"] if t["tensor"].startswith(("classifier", "fc"))}
            print(name, "less accurate than PyTorch:", r["tensors_less_accurate_than_pytorch"],
                  json.dumps(head), flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
