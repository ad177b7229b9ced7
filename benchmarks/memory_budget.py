"""PyTorch under a memory budget, with and without mucudnn (GPU only; not run by CI).

For one torchvision model it trains (SGD, random data) in one subprocess per configuration:

- ``pytorch``: plain PyTorch, no limit;
- ``pytorch@B`` for each budget B: plain PyTorch that limits itself, as users emulate a smaller
  GPU: ``torch.cuda.set_per_process_memory_fraction(B / total_memory)`` before the model is built;
- ``mucudnn@B``: the same unmodified worker under ``mucudnn run --memory-budget B`` (with
  ``--plan`` if given), which sets that fraction itself at CUDA initialisation.

Each reports the median step time (CUDA events, after warm-up steps), the peak memory the caching
allocator reserved and allocated, and the fraction in force (``get_per_process_memory_fraction``,
where PyTorch has it), or ``"oom"`` when PyTorch ran out of memory under that budget. Exit status
0 whatever the configurations did; the JSON goes to ``OUT/memory_budget-MODEL-N.json``.

    python -m benchmarks.memory_budget --model r3d_18 --batch 32 --budgets 6GiB 5.6GiB --out DIR

3-D models (torchvision.models.video) take clips of (N, 3, 16, 112, 112), others (N, 3, 224, 224).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parents[1]))  # the checkout's mucudnn, for its size grammar

from mucudnn.budget import parse_budget  # noqa: E402
from mucudnn.sizes import format_size  # noqa: E402

MU = [sys.executable, "-m", "mucudnn"]
OOM_MARKERS = ("OutOfMemoryError", "CUDA out of memory", "CUBLAS_STATUS_ALLOC_FAILED",
               "CUDNN_STATUS_ALLOC_FAILED")


# -- worker: runs inside the measured process ----------------------------------------------------

def worker(args) -> None:
    import torch
    import torchvision

    if args.self_budget:  # plain PyTorch limiting itself, before anything is allocated
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(args.self_budget / total, 0)
    torch.backends.cudnn.benchmark = args.cudnn_benchmark
    torch.backends.cudnn.allow_tf32 = args.tf32
    torch.backends.cuda.matmul.allow_tf32 = args.tf32
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    result = {"status": "ok"}
    try:
        if hasattr(torchvision.models.video, args.model):  # 3-D convolutions: clips of 16 frames
            model = getattr(torchvision.models.video, args.model)(num_classes=1000).cuda()
            images = torch.randn(args.batch, 3, 16, 112, 112, generator=gen).cuda()
        else:  # as benchmarks/shim_pytorch.py's worker, so the numbers compare
            model = getattr(torchvision.models, args.model)(num_classes=1000).cuda()
            images = torch.randn(args.batch, 3, 224, 224, generator=gen).cuda()
        labels = torch.randint(0, 1000, (args.batch,), generator=gen).cuda()
        getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
        result["fraction"] = getter(0) if getter else None
        result["total_bytes"] = torch.cuda.get_device_properties(0).total_memory
        loss_fn = torch.nn.CrossEntropyLoss()
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        times = []
        for i in range(args.warmup + args.steps):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            loss = loss_fn(model(images), labels)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            end.record()
            end.synchronize()
            if i >= args.warmup:
                times.append(start.elapsed_time(end))
        result.update(step_ms=statistics.median(times), steps=len(times), step_ms_all=times,
                      loss=loss.item())
    except torch.cuda.OutOfMemoryError as exc:
        result.update(status="oom", error=str(exc).splitlines()[0][:300])
    result.update(peak_allocated_bytes=torch.cuda.max_memory_allocated(),
                  peak_reserved_bytes=torch.cuda.max_memory_reserved())
    print(json.dumps(result))


# -- driver ----------------------------------------------------------------------------------------

def run_config(args, name: str, budget: int | None, through_mucudnn: bool) -> dict:
    cmd = [sys.executable, str(HERE), "worker", "--model", args.model, "--batch", str(args.batch),
           "--steps", str(args.steps), "--warmup", str(args.warmup)]
    cmd += ["--cudnn-benchmark"] if args.cudnn_benchmark else []
    cmd += ["--no-tf32"] if not args.tf32 else []
    if budget is not None and not through_mucudnn:
        cmd += ["--self-budget", str(budget)]
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
            result = json.loads(line)
            break
        except json.JSONDecodeError:
            continue
    if result.get("status") == "failed" and any(m in proc.stderr for m in OOM_MARKERS):
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
    sub = parser.add_subparsers(dest="mode")
    work = sub.add_parser("worker")
    for p in (parser, work):
        p.add_argument("--model", default="r3d_18")
        p.add_argument("--batch", type=int, default=32)
        p.add_argument("--steps", type=int, default=30)
        p.add_argument("--warmup", type=int, default=10)
        p.add_argument("--cudnn-benchmark", action="store_true")
        p.add_argument("--no-tf32", dest="tf32", action="store_false",
                       help="TF32 off (PyTorch's default for cuDNN is on)")
    work.add_argument("--self-budget", type=int, help="bytes: limit the allocator itself")
    parser.add_argument("--budgets", nargs="+", default=["6GiB", "5.6GiB"])
    parser.add_argument("--plan", help="plan file for the mucudnn runs")
    parser.add_argument("--timeout", type=int, default=600, help="seconds per configuration")
    parser.add_argument("--out", default="memory_budget_results")
    args = parser.parse_args()
    if args.mode == "worker":
        worker(args)
        return 0
    return driver(args)


if __name__ == "__main__":
    sys.exit(main())
