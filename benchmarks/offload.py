"""Activation offload under a memory budget (GPU only; not run by CI): mucudnn.torch against what
PyTorch users have, at the same budget (docs/torch.md; issue "One memory budget for the whole
step").

For each model (torchvision, fp32 with TF32, SGD, random data, batch N) one subprocess per
configuration trains a few steps with PyTorch's caching allocator limited to the budget
(``set_per_process_memory_fraction``):

- ``pytorch``: no limit, nothing offloaded: the unconstrained step and PyTorch's own peak;
- ``mucudnn@B``: ``mucudnn.torch.fit(model, budget=B)``: the first step records, then the plan
  (keep / offload with prefetch / recompute) runs; at ``--budget`` and each ``--sweep`` budget;
- ``save_on_cpu@B``: ``torch.autograd.graph.save_on_cpu(pin_memory=True)``;
- ``ondemand@B``: torchtune-style offload: every saved activation copied to pinned memory on a side
  stream, fetched back when backward needs it (no lookahead), written here in a few lines;
- ``checkpoint@B``: ``torch.utils.checkpoint`` of every block (VGG: each stage up to its pooling;
  ResNet: each bottleneck).

Each reports the median step time (CUDA events, after warm-up), peak reserved and allocated memory
of the timed steps, or ``oom``. A mucudnn step that runs out of memory is recorded
(``failed_steps``; the session plans again for less, at most 3 times, then offloads everything,
``fell_back``) and the run goes on. mucudnn's rows add the plan (bytes moved each way, counts), the measured host link and
the lower bound from it: ``max(F, moved/d2h) + max(B, moved/h2d)`` with F, B the unconstrained
step split as the recorded profile splits it. Writes ``OUT/offload.json``, ``OUT/offload.md`` and
``OUT/offload.png`` (step time against the budget; matplotlib, if installed).

    python -m benchmarks.offload --models vgg16 resnet50 --batch 256 --budget 12GiB \\
        --sweep 16GiB 8GiB --out DIR
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()
ROOT = HERE.parents[1]
OOM_MARKERS = ("OutOfMemoryError", "CUDA out of memory", "CUBLAS_STATUS_ALLOC_FAILED",
               "CUDNN_STATUS_ALLOC_FAILED")
METHODS = ("mucudnn", "save_on_cpu", "ondemand", "checkpoint")


# -- worker (one configuration, in its own process) -----------------------------------------------

def ondemand_hooks(torch, min_bytes: int = 1 << 20):
    """torchtune's OffloadActivations in miniature: copy out on a side stream, fetch on demand."""
    stream = torch.cuda.Stream()

    def pack(tensor):
        if not tensor.is_cuda or tensor.numel() * tensor.element_size() < min_bytes or \
                (tensor.requires_grad and tensor.is_leaf):
            return tensor
        stream.wait_stream(torch.cuda.current_stream())
        host = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype,
                                   pin_memory=True)
        with torch.cuda.stream(stream):
            host.copy_(tensor, non_blocking=True)
        tensor.record_stream(stream)
        event = torch.cuda.Event()
        event.record(stream)
        return (host, event, tensor.device)

    def unpack(packed):
        if not isinstance(packed, tuple):
            return packed
        host, event, device = packed
        torch.cuda.current_stream().wait_event(event)
        return host.to(device, non_blocking=True)   # on demand, on the compute stream

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


def checkpointed(torch, model, name: str):
    """``model`` with every block under ``torch.utils.checkpoint``."""
    from torch.utils.checkpoint import checkpoint

    class Checkpointed(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return checkpoint(self.inner, x, use_reentrant=False)

    if name.startswith("vgg"):
        stages, current = [], []
        for layer in model.features:
            current.append(layer)
            if isinstance(layer, torch.nn.MaxPool2d):
                stages.append(Checkpointed(torch.nn.Sequential(*current)))
                current = []
        model.features = torch.nn.Sequential(*stages, *current)
    else:
        for stage in ("layer1", "layer2", "layer3", "layer4"):
            blocks = getattr(model, stage)
            setattr(model, stage, torch.nn.Sequential(*(Checkpointed(b) for b in blocks)))
    return model


def worker(args) -> None:
    import contextlib

    import torch
    import torchvision

    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    torch.backends.cudnn.benchmark = False
    device = torch.device("cuda", torch.cuda.current_device())  # an index: the memory-fraction API needs one
    total = torch.cuda.get_device_properties(device).total_memory
    if args.budget_bytes:
        torch.cuda.set_per_process_memory_fraction(args.budget_bytes / total, device)
    model = getattr(torchvision.models, args.model)(num_classes=1000).to(device)
    if args.method == "checkpoint":
        model = checkpointed(torch, model, args.model)
    result = {}
    context = contextlib.nullcontext
    if args.method == "mucudnn":
        sys.path.insert(0, str(ROOT))
        import mucudnn.torch as mt
        # not strict: a budget no plan meets offloads everything (as an unmodified script does)
        # and the row still has the recorded profile
        model = mt.fit(model, budget=args.budget_bytes, headroom=args.headroom, strict=False,
                       say=lambda text: print("mucudnn:", text, file=sys.stderr, flush=True))
    elif args.method == "save_on_cpu":
        context = lambda: torch.autograd.graph.save_on_cpu(pin_memory=True)  # noqa: E731
    elif args.method == "ondemand":
        hooks = ondemand_hooks(torch)
        context = lambda: hooks  # noqa: E731
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(args.batch, 3, 224, 224, device=device)
    y = torch.randint(0, 1000, (args.batch,), device=device)
    times, failed_steps, retries_before = [], [], 0
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            # peaks of the timed steps only (mucudnn's recording step resets the statistics)
            torch.cuda.reset_peak_memory_stats(device)
            retries_before = torch.cuda.memory_stats(device).get("num_alloc_retries", 0)
        if args.method == "mucudnn":   # what a step leaves behind shows here (a leak, state)
            print(f"step {step}: {torch.cuda.memory_allocated(device) / 2**30:.2f} GiB allocated "
                  "at its start", file=sys.stderr, flush=True)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        optimizer.zero_grad(set_to_none=True)
        try:
            with context():
                loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
        except torch.OutOfMemoryError:
            # mucudnn falls back to offloading everything after a planned step that ran out of
            # memory: record the step and go on; any other method's OOM ends the configuration
            if args.method != "mucudnn":
                raise
            loss = None
            failed_steps.append(step)
            print(f"step {step}: out of memory", file=sys.stderr, flush=True)
            continue
        optimizer.step()
        end.record()
        end.synchronize()
        if step >= args.warmup:
            times.append(start.elapsed_time(end))
        print(f"step {step}: {start.elapsed_time(end):.1f} ms", file=sys.stderr, flush=True)
    if not times:
        raise torch.OutOfMemoryError(f"every timed step ran out of memory ({failed_steps})")
    # the caching allocator's flushes (free every cached block, synchronise, allocate again)
    # during the timed steps: a configuration that runs at the cap pays them in its step time
    result.update(failed_steps=failed_steps, alloc_retries=torch.cuda.memory_stats(device).get(
        "num_alloc_retries", 0) - retries_before)
    result.update(step_ms=statistics.median(times), steps_ms=times,
                  peak_reserved=torch.cuda.max_memory_reserved(device),
                  peak_allocated=torch.cuda.max_memory_allocated(device))
    if args.method == "mucudnn":
        session = model.mucudnn_session
        plan, profile = session.plan, session.profile
        links = list(session._links.values())
        result.update(fell_back=session.fell_back, target=session.target,
                      replans_used=session.replans_used,
                      host_allocations=sum(link.host_allocations for link in links))
        if profile is not None:
            result.update(profile_baseline_peak=max(profile.baseline_forward
                                                    + profile.baseline_backward, default=0))
            # the whole recorded profile: the planner can be replayed on it off the GPU
            result.update(profile=dataclasses.asdict(profile),
                          modes=list(plan.modes) if plan is not None else None)
        if plan is not None:
            result.update(moved_bytes=plan.moved_bytes, predicted_ms=plan.step_ms,
                          predicted_peak=plan.peak, prefetch_lookahead=plan.lookahead,
                          kept=plan.count("keep"), offloaded=plan.count("offload"),
                          recomputed=plan.count("recompute"), d2h_gbps=profile.d2h_gbps,
                          h2d_gbps=profile.h2d_gbps, profile_forward_ms=profile.forward_ms,
                          profile_backward_ms=profile.backward_ms,
                          saved_bytes=sum(g.nbytes for g in profile.groups))
    print("RESULT " + json.dumps(result), flush=True)


# -- driver ---------------------------------------------------------------------------------------

def run_config(args, model: str, method: str, budget: int | None) -> dict:
    name = method if budget is None else f"{method}@{budget / 2**30:g}GiB"
    cmd = [sys.executable, "-m", "benchmarks.offload", "worker", "--model", model,
           "--method", method, "--batch", str(args.batch), "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--budget-bytes", str(budget or 0),
           "--headroom", str(args.headroom)]
    row = {"model": model, "config": name, "method": method, "budget_bytes": budget}
    started = time.time()
    print(f"[{time.strftime('%H:%M:%S')}] {model} {name}", flush=True)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout,
                              cwd=ROOT, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    except subprocess.TimeoutExpired:
        row.update(status="timeout", wall_s=time.time() - started)
        print("    timeout", flush=True)
        return row
    row["wall_s"] = round(time.time() - started, 1)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode == 0 and lines:
        row.update(status="ok", **json.loads(lines[-1][len("RESULT "):]))
    elif any(marker in proc.stderr for marker in OOM_MARKERS):
        row["status"] = "oom"
    else:
        row.update(status="error", error=proc.stderr.strip().splitlines()[-5:])
    row["log_tail"] = proc.stderr.strip().splitlines()[-4:]
    row["said"] = [line for line in proc.stderr.splitlines()
                   if line.startswith(("mucudnn:", "step "))]
    print(f"    {row['status']}" + (f" {row['step_ms']:.1f} ms, peak reserved "
                                    f"{row['peak_reserved'] / 2**30:.2f} GiB"
                                    if row["status"] == "ok" else ""), flush=True)
    return row


def add_bounds(rows: list[dict]) -> None:
    """The host-link lower bound and ratios to the unconstrained step, per model."""
    base = {r["model"]: r for r in rows if r["method"] == "pytorch" and r["status"] == "ok"}
    for row in rows:
        ref = base.get(row["model"])
        if ref is None or row.get("status") != "ok":
            continue
        row["vs_unconstrained"] = row["step_ms"] / ref["step_ms"]
        if "moved_bytes" in row:
            share = row["profile_forward_ms"] / max(row["profile_forward_ms"]
                                                    + row["profile_backward_ms"], 1e-9)
            d2h_ms = row["moved_bytes"] / (row["d2h_gbps"] * 1e9) * 1e3
            h2d_ms = row["moved_bytes"] / (row["h2d_gbps"] * 1e9) * 1e3
            row["bound_ms"] = max(share * ref["step_ms"], d2h_ms) + \
                max((1 - share) * ref["step_ms"], h2d_ms)
            row["vs_bound"] = row["step_ms"] / row["bound_ms"]


def markdown(rows: list[dict], args) -> str:
    out = [f"# Activation offload, N={args.batch}, budget {args.budget} (fp32, TF32)", "",
           "| model | config | status | step ms | × unconstrained | peak reserved GiB | "
           "moved each way GiB | bound ms | × bound | plan (keep/offload/recompute) | "
           "allocator flushes |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ok = r.get("status") == "ok"
        out.append("| " + " | ".join([
            r["model"], r["config"], r.get("status", "?") + (
                f" (steps {r['failed_steps']} out of memory; fell back to offloading everything)"
                if r.get("failed_steps") else ""),
            f"{r['step_ms']:.1f}" if ok else "—",
            f"{r['vs_unconstrained']:.3f}" if "vs_unconstrained" in r else "—",
            f"{r['peak_reserved'] / 2**30:.2f}" if ok else "—",
            f"{r['moved_bytes'] / 2**30:.2f}" if "moved_bytes" in r else "—",
            f"{r['bound_ms']:.1f}" if "bound_ms" in r else "—",
            f"{r['vs_bound']:.3f}" if "vs_bound" in r else "—",
            f"{r['kept']}/{r['offloaded']}/{r['recomputed']}" if "kept" in r else "—",
            str(r["alloc_retries"]) if "alloc_retries" in r else "—"]) + " |")
    link = next((r for r in rows if "d2h_gbps" in r), None)
    if link:
        out += ["", f"Host link measured by mucudnn.torch: {link['d2h_gbps']:.1f} GB/s to the "
                    f"host, {link['h2d_gbps']:.1f} GB/s to the device (pinned, one direction at "
                    "a time)."]
    return "\n".join(out) + "\n"


def plot(rows: list[dict], path: Path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    models = sorted({r["model"] for r in rows})
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4), squeeze=False)
    for ax, model in zip(axes[0], models):
        mine = sorted((r for r in rows if r["model"] == model and r["status"] == "ok"
                       and r["method"] == "mucudnn"), key=lambda r: r["budget_bytes"])
        ax.plot([r["budget_bytes"] / 2**30 for r in mine], [r["step_ms"] for r in mine], "o-",
                label="mucudnn.torch")
        for r in rows:
            if r["model"] != model or r["status"] != "ok" or r["method"] == "mucudnn":
                continue
            x = (r["budget_bytes"] or r["peak_reserved"]) / 2**30
            ax.plot([x], [r["step_ms"]], "s", label=f"{r['method']} (peak "
                                                     f"{r['peak_reserved'] / 2**30:.1f} GiB)")
        for r in rows:
            if r["model"] == model and r["status"] == "oom":
                ax.axvline(r["budget_bytes"] / 2**30, color="grey", lw=0.5, ls=":")
        ax.set(title=model, xlabel="budget (GiB)", ylabel="step time (ms)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def driver(args) -> None:
    sys.path.insert(0, str(ROOT))
    from mucudnn.budget import parse_budget
    from mucudnn.outputs import write_text_atomically

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    budget = parse_budget(args.budget)
    sweep = [parse_budget(b) for b in args.sweep]
    rows = []
    for model in args.models:
        rows.append(run_config(args, model, "pytorch", None))
        for method in args.methods:
            rows.append(run_config(args, model, method, budget))
        for extra in sweep:
            rows.append(run_config(args, model, "mucudnn", extra))
        add_bounds(rows)
        # after each model: what ran so far survives a later timeout
        write_text_atomically(out / "offload.json", json.dumps(rows, indent=1))
        write_text_atomically(out / "offload.md", markdown(rows, args))
    if plot(rows, out / "offload.png"):
        print(f"wrote {out / 'offload.png'}")
    print(markdown(rows, args))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="role")
    drive = sub.add_parser("driver", help="every configuration (the default)")
    work = sub.add_parser("worker", help="one configuration (internal)")
    for p in (parser, drive):
        p.add_argument("--models", nargs="+", default=["vgg16", "resnet50"])
        p.add_argument("--batch", type=int, default=256)
        p.add_argument("--budget", default="12GiB", help="the budget every method is held to")
        p.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS),
                       help="what runs at --budget (all: one table)")
        p.add_argument("--sweep", nargs="*", default=["16GiB", "8GiB"],
                       help="more budgets for mucudnn alone (the plot)")
        p.add_argument("--steps", type=int, default=5)
        p.add_argument("--warmup", type=int, default=4,
                       help="steps not timed (mucudnn records the first; a planned step that "
                            "runs out of memory plans again)")
        p.add_argument("--headroom", type=float, default=0.1)
        p.add_argument("--timeout", type=float, default=150, help="seconds per configuration")
        p.add_argument("--out", default="offload-out")
    work.add_argument("--model", required=True)
    work.add_argument("--method", choices=("pytorch",) + METHODS, required=True)
    work.add_argument("--batch", type=int, required=True)
    work.add_argument("--steps", type=int, default=5)
    work.add_argument("--warmup", type=int, default=4)
    work.add_argument("--budget-bytes", type=int, default=0)
    work.add_argument("--headroom", type=float, default=0.1)
    args = parser.parse_args(argv)
    if args.role == "worker":
        worker(args)
    else:
        driver(args)


if __name__ == "__main__":
    main()
