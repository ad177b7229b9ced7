"""PyTorch under a memory budget, with and without mucudnn (GPU only; not run by CI).

For one torchvision model it trains (SGD, random data) in one subprocess per configuration:

- ``pytorch``: plain PyTorch, no limit;
- ``pytorch@B`` for each budget B: plain PyTorch that limits itself, as users emulate a smaller
  GPU: ``torch.cuda.set_per_process_memory_fraction(B / total_memory)`` before the model is built;
- ``mucudnn@B``: the same unmodified worker under ``mucudnn run --memory-budget B`` (with
  ``--plan`` if given), which sets that fraction itself at CUDA initialisation.

Each configuration runs benchmarks/shim_pytorch.py's worker (its model, data and timing) and
reports the median step time (CUDA events, after warm-up steps), the peak memory the caching
allocator reserved and allocated, and the fraction in force (``get_per_process_memory_fraction``,
where PyTorch has it), or ``"oom"`` when PyTorch ran out of memory under that budget. Exit status
0 whatever the configurations did; the JSON goes to ``OUT/memory_budget-MODEL-N.json``.

    python -m benchmarks.memory_budget --model r3d_18 --batch 32 --budgets 6GiB 5.6GiB --out DIR

Inputs, labels and loss of each model: benchmarks/models.py.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve()
WORKER = HERE.with_name("shim_pytorch.py")
sys.path.insert(0, str(HERE.parents[1]))  # the checkout's mucudnn, for its size grammar

from benchmarks.shim_pytorch import is_out_of_memory  # noqa: E402
from mucudnn.budget import parse_budget  # noqa: E402
from mucudnn.sizes import format_size  # noqa: E402

MU = [sys.executable, "-m", "mucudnn"]


# -- driver ----------------------------------------------------------------------------------------

def run_config(args, name: str, budget: int | None, through_mucudnn: bool) -> dict:
    # benchmarks/shim_pytorch.py's worker: the same model, data and timing as its other results
    cmd = [sys.executable, str(WORKER), "worker", "--model", args.model, "--batch", str(args.batch),
           "--steps", str(args.steps), "--warmup", str(args.warmup)]
    cmd += ["--cudnn-benchmark"] if args.cudnn_benchmark else []
    cmd += ["--tf32"] if args.tf32 else []
    if budget is not None and not through_mucudnn:  # plain PyTorch limiting itself
        cmd += ["--memory-cap-gib", repr(budget / 2**30)]
    if through_mucudnn:
        cmd = MU + ["run", "--memory-budget", str(budget)] + \
              (["--plan", args.plan] if args.plan else []) + ["--"] + cmd
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"config": name, "budget_bytes": budget, "status": "timeout"}
    result: dict = {"status": "failed"}
    for line in reversed(proc.stdout.strip().splitlines()):
        try:
            worker = json.loads(line)
        except json.JSONDecodeError:
            continue
        result = ({"status": "oom", "error": worker.get("error")} if worker.get("oom") else
                  {"status": "ok", "step_ms": worker["step_ms"], "steps": worker["steps"],
                   "step_ms_all": worker["step_ms_all"], "loss": worker["loss"],
                   "fraction": worker["memory_fraction"],
                   "peak_allocated_bytes": worker["peak_bytes"],
                   "peak_reserved_bytes": worker["peak_reserved_bytes"]})
        break
    if result.get("status") == "failed" and is_out_of_memory(proc.stderr):
        result["status"] = "oom"  # out of memory outside the training loop (cuDNN, cuBLAS, ...)
    if result.get("status") != "ok":
        result["stderr_tail"] = proc.stderr[-1500:]
    result.update(config=name, budget_bytes=budget, returncode=proc.returncode,
                  mucudnn_lines=[line for line in proc.stderr.splitlines()
                                 if line.startswith("mucudnn: ")][:20])
    return result


def driver(args) -> int:
    budgets = [parse_budget(text) for text in args.budgets]  # as `mucudnn run` reads them
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    configs = [("pytorch", None, False)]
    for text, budget in zip(args.budgets, budgets):
        configs += [(f"pytorch@{text}", budget, False), (f"mucudnn@{text}", budget, True)]
    results = []
    for name, budget, through in configs:
        result = run_config(args, name, budget, through)
        results.append(result)
        print(row(result), flush=True)
    report = {"model": args.model, "batch": args.batch, "steps": args.steps,
              "warmup": args.warmup, "cudnn_benchmark": args.cudnn_benchmark, "tf32": args.tf32,
              "plan": args.plan, "results": results}
    path = out / f"memory_budget-{args.model}-{args.batch}.json"
    path.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {path}")
    return 0


def row(result: dict) -> str:
    status = result.get("status")
    if status != "ok":
        return f"{result['config']:>20s}  {status}"
    fraction = result.get("fraction")
    return (f"{result['config']:>20s}  step {result['step_ms']:8.2f} ms  "
            f"peak reserved {format_size(result['peak_reserved_bytes']):>10s}  "
            f"allocated {format_size(result['peak_allocated_bytes']):>10s}  "
            f"fraction {'-' if fraction is None else f'{fraction:.4f}'}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="r3d_18")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--cudnn-benchmark", action="store_true")
    parser.add_argument("--no-tf32", dest="tf32", action="store_false",
                        help="TF32 off (PyTorch's default for cuDNN is on)")
    parser.add_argument("--budgets", nargs="+", default=["6GiB", "5.6GiB"])
    parser.add_argument("--plan", help="plan file for the mucudnn runs")
    parser.add_argument("--timeout", type=int, default=600, help="seconds per configuration")
    parser.add_argument("--out", default="memory_budget_results")
    return driver(parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())
