"""DistributedDataParallel under the shim, on several GPUs of one node (GPU only; not run by CI).

The driver answers issue 15's three questions on a machine with N GPUs, writing JSON under --out
after each part (a part that fails or runs out of time leaves the others' results):

- ``bench``: the wall time of ``mucudnn bench --recording R`` of the model's kernels on 1 GPU
  (``--gpus 0``) and on N (``--gpus all``), each into a fresh store; the ratio should be at most
  0.55 for N = 2.
- ``steps``: the median DDP training step (SGD, random data, batch N per GPU, fp32 with
  PyTorch's defaults) of plain PyTorch and of the same command under ``mucudnn run --plan P``
  (P tuned from a recording of the DDP run itself), on N GPUs and on 1 (torchrun with one
  process), in alternating rounds; the shim/PyTorch ratio on N GPUs should equal the 1-GPU ratio
  within 1 %. Each run also compares the gradients of every rank after one fixed step (DDP
  averages them, so they must be bit-identical across ranks).

    python -m benchmarks.ddp driver --gpus 2 --model resnet50 --batch 256 --out DIR
    python -m benchmarks.ddp driver --gpus 2 --dry-run          # the commands, nothing run

The worker (one DDP rank, started by torchrun) is ``python -m benchmarks.ddp worker``; with
``--device cpu`` it runs on the gloo backend (how it is tested without a GPU), with ``--model
tiny`` a two-layer convolution net.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import NoReturn

MU = [sys.executable, "-m", "mucudnn"]
OOM_MARKERS = ("OutOfMemoryError", "CUDA out of memory", "CUDNN_STATUS_ALLOC_FAILED")


def log(text: str) -> None:
    print(f"[ddp {time.strftime('%H:%M:%S')}] {text}", flush=True)


# -- worker: one rank -----------------------------------------------------------------------------

def build_model(name: str):
    import torch
    if name == "tiny":
        return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(),
                                   torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.ReLU(),
                                   torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
                                   torch.nn.Linear(8, 10))
    import torchvision
    return getattr(torchvision.models, name)(num_classes=1000)


def gradient_digest(model) -> str:
    """sha256 of every parameter's gradient bytes, in parameter order."""
    digest = hashlib.sha256()
    for parameter in model.parameters():
        if parameter.grad is not None:
            digest.update(parameter.grad.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def worker(args) -> NoReturn:   # ends the process (below: why)
    import torch
    import torch.distributed as dist
    rank, local_rank = int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0))
    cuda = args.device == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo")
    world = dist.get_world_size()
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.manual_seed(0)  # the same initial model on every rank (DDP also broadcasts it)
    model = torch.nn.parallel.DistributedDataParallel(
        build_model(args.model).to(device), device_ids=[local_rank] if cuda else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    size = 224 if args.model != "tiny" else 16
    generator = torch.Generator(device="cpu").manual_seed(1000 + rank)  # each rank its own data
    x = torch.randn(args.batch, 3, size, size, generator=generator).to(device)
    y = torch.randint(0, 10 if args.model == "tiny" else 1000, (args.batch,),
                      generator=generator).to(device)
    loss_fn = torch.nn.CrossEntropyLoss()

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        optimizer.step()

    result: dict = {"rank": rank, "world": world, "model": args.model, "batch": args.batch}
    try:
        times = []
        for i in range(args.warmup + args.steps):
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            step()
            if cuda:
                torch.cuda.synchronize()
            if i >= args.warmup:
                times.append((time.perf_counter() - start) * 1e3)
        result["step_ms"] = statistics.median(times) if times else None
        # gradients of one more step, before the optimizer moves the weights: each rank's own
        # (no_sync: not averaged; they differ, as the ranks' data do) and DDP's averaged ones
        optimizer.zero_grad(set_to_none=True)
        with model.no_sync():
            loss_fn(model(x), y).backward()
        result["local_grad_sha256"] = gradient_digest(model.module)
        optimizer.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        result["grad_sha256"] = gradient_digest(model.module)
        if cuda:
            result["peak_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
            result["gpu"] = torch.cuda.get_device_name(device)
    except Exception as exc:  # out of memory and the like: said in the result, not a traceback
        result["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
    gathered: list = [None] * world
    dist.all_gather_object(gathered, result)
    if rank == 0:
        digests = {r.get("grad_sha256") for r in gathered}
        identical = len(digests) == 1 and None not in digests
        summary = {"ranks": gathered, "identical_gradients": identical,
                   "step_ms": max((r.get("step_ms") or 0) for r in gathered) or None,
                   "errors": [r["error"] for r in gathered if "error" in r]}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(summary, indent=1))
    # every rank leaves together, and leaves at once: DDP's reducer holds the process group
    # past destroy_process_group, and a gloo rank whose group's threads were still joinable when
    # the interpreter tore the reducer down aborted ("terminate called without an active
    # exception", about 1 run in 6 of tests/test_ddp_benchmark.py on a loaded 2-core machine)
    del model, optimizer
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# -- driver ----------------------------------------------------------------------------------------

def torchrun(nproc: int, args, out: Path, steps: int, warmup: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={nproc}", "-m", "benchmarks.ddp", "worker", "--model", args.model,
            "--batch", str(args.batch), "--steps", str(steps), "--warmup", str(warmup),
            "--device", args.device, "--out", str(out)]


def run(command: list[str], args, what: str) -> dict:
    """Run ``command``; its wall time and status, the tail of its output where it failed."""
    log(f"{what}: {shlex.join(command)}")
    if args.dry_run:
        return {"command": shlex.join(command), "dry_run": True}
    start = time.perf_counter()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout,
                              env={**os.environ, "PYTHONUNBUFFERED": "1"})
    except subprocess.TimeoutExpired:
        log(f"{what}: timed out after {args.timeout} s")
        return {"command": shlex.join(command), "status": "timeout"}
    wall = time.perf_counter() - start
    output = done.stdout + done.stderr
    status = "ok" if done.returncode == 0 else \
        ("oom" if any(m in output for m in OOM_MARKERS) else f"exit {done.returncode}")
    log(f"{what}: {status} in {wall:.1f} s")
    result = {"command": shlex.join(command), "status": status, "wall_s": wall}
    if status != "ok":
        result["tail"] = output[-2000:]
    return result


def save(args, name: str, data: dict) -> None:
    path = Path(args.out) / f"ddp-{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1))
    log(f"wrote {path}")


def record_and_tune(args) -> tuple[Path, Path]:
    """A recording of the DDP run on all GPUs (every rank appends to it) and a plan from it,
    benchmarked into the session's store."""
    out = Path(args.out)
    recording, plan = out / "ddp.record", out / "ddp.plan"
    if not args.dry_run:
        recording.unlink(missing_ok=True)
    run(MU + ["record", "-o", str(recording), "--"] +
        torchrun(args.gpus, args, out / "record-run.json", 2, 1), args, "record")
    run(MU + ["bench", "--recording", str(recording), "--no-progress"], args, "bench (store)")
    run(MU + ["tune", "--recording", str(recording), "-o", str(plan)], args, "tune")
    return recording, plan


def part_bench(args, recording: Path) -> dict:
    results = {}
    for label, gpus in (("1", "0"), (str(args.gpus), "all")):
        store = Path(args.out) / f"bench-{label}gpu.sqlite"
        for leftover in store.parent.glob(store.name + "*"):
            leftover.unlink()
        results[label] = run(MU + ["bench", "--recording", str(recording), "--gpus", gpus,
                                   "--no-progress", "--store", str(store)] + args.bench_args,
                             args, f"bench on {label} GPU(s)")
    one, many = results["1"].get("wall_s"), results[str(args.gpus)].get("wall_s")
    summary = {"runs": results, "ratio": many / one if one and many else None, "target": 0.55}
    log(f"bench wall time ratio {args.gpus} GPUs / 1 GPU: {summary['ratio']}")
    return summary


def part_steps(args, plan: Path) -> dict:
    rounds: list[dict] = []
    for number in range(args.rounds):
        for nproc in (1, args.gpus):
            for through in (False, True):
                name = f"{'shim' if through else 'pytorch'}-{nproc}gpu-round{number}"
                out = Path(args.out) / f"{name}.json"
                command = torchrun(nproc, args, out, args.steps, args.warmup)
                if through:
                    command = MU + ["run", "--plan", str(plan), "--"] + command
                done = run(command, args, name)
                if out.exists():
                    done.update(json.loads(out.read_text()))
                rounds.append({"name": name, "nproc": nproc, "shim": through, **done})
    summary: dict = {"rounds": rounds, "ratios": {}}
    for nproc in (1, args.gpus):
        medians = {}
        for through in (False, True):
            steps = [r["step_ms"] for r in rounds
                     if r["nproc"] == nproc and r["shim"] == through and r.get("step_ms")]
            medians[through] = statistics.median(steps) if steps else None
        summary["ratios"][str(nproc)] = (medians[True] / medians[False]
                                         if medians[True] and medians[False] else None)
    one, many = summary["ratios"]["1"], summary["ratios"][str(args.gpus)]
    summary["ratio_difference"] = abs(many / one - 1) if one and many else None
    summary["all_gradients_identical"] = all(r.get("identical_gradients") for r in rounds
                                             if not args.dry_run)
    log(f"shim/PyTorch step ratio: 1 GPU {one}, {args.gpus} GPUs {many}; gradients identical "
        f"across ranks: {summary['all_gradients_identical']}")
    return summary


def driver(args) -> int:
    Path(args.out).mkdir(parents=True, exist_ok=True)
    recording, plan = record_and_tune(args)
    if "bench" in args.parts:
        save(args, f"bench-{args.gpus}", part_bench(args, recording))
    if "steps" in args.parts:
        save(args, f"steps-{args.gpus}", part_steps(args, plan))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.ddp", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="role", required=True)
    for role in ("driver", "worker"):
        p = sub.add_parser(role)
        p.add_argument("--model", default="resnet50", help="torchvision model, or tiny")
        p.add_argument("--batch", type=int, default=256, help="samples per GPU")
        p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
        p.add_argument("--steps", type=int, default=20, help="timed steps")
        p.add_argument("--warmup", type=int, default=5)
        p.add_argument("--out", required=True,
                       help="driver: directory of the JSON results; worker: its JSON file")
        if role == "driver":
            p.add_argument("--gpus", type=int, default=2, help="GPUs of the node (DDP ranks)")
            p.add_argument("--parts", nargs="+", choices=["bench", "steps"],
                           default=["bench", "steps"])
            p.add_argument("--rounds", type=int, default=3)
            p.add_argument("--timeout", type=float, default=540, help="seconds per command")
            p.add_argument("--bench-args", type=shlex.split, default=[],
                           help="more options of both timed benches, one string: "
                                "--bench-args='--api legacy'")
            p.add_argument("--dry-run", action="store_true", help="log the commands only")
    args = parser.parse_args(argv)
    return driver(args) if args.role == "driver" else worker(args)


if __name__ == "__main__":
    sys.exit(main())
