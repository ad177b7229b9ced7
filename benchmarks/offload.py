"""Activation offload under a memory budget (GPU only; not run by CI): mucudnn.torch against what
PyTorch users have, at the same budget (docs/torch.md; issue "One memory budget for the whole
step").

For each model of benchmarks/models.py (``MODEL`` or ``MODEL:BATCH``: its network, input, labels
and loss, e.g. ``vgg16``, ``resnet50``, ``unet3d``, ``r3d_18``, ``deeplabv3_resnet50``; N: the
table's unless ``--batch``; fp32 with TF32, SGD, random data) one subprocess per configuration
trains a few steps with PyTorch's caching allocator limited to the budget
(``set_per_process_memory_fraction``):

- ``pytorch``: no limit, nothing offloaded: the unconstrained step and PyTorch's own peak;
- ``mucudnn@B``: ``mucudnn.torch.fit(model, budget=B, strict=False)``: the first two steps
  record, then the plan (keep / offload with prefetch / recompute) runs; at ``--budget`` and each
  ``--sweep`` budget;
- ``mucudnn-run@B``: the worker as a user's script under ``mucudnn run --memory-budget B
  --offload`` (the shim preloaded, the process-wide session, the CLI's cap; the worker caps
  nothing): what issue 40's table measures, a first run (a plan cache of its own); its timed
  steps start once the session has run settled for a few steps in a row (``SETTLED_STEPS``, at
  most ``MOST_EXTRA_WARMUP`` steps past ``--warmup``; the row's ``timed_from_step``), and the row
  adds what ``mucudnn@B``'s does (the plan in force at the end, the recorded profile);
- ``save_on_cpu@B``: ``torch.autograd.graph.save_on_cpu(pin_memory=True)``;
- ``ondemand@B``: torchtune-style offload: every saved activation copied to pinned memory on a side
  stream, fetched back when backward needs it (no lookahead), written here in a few lines;
- ``checkpoint@B``: ``torch.utils.checkpoint`` of every block (VGG: each stage up to its pooling;
  ResNets, video ResNets and DeepLabV3's backbone: each residual block; the 3-D U-Net: each
  encoder and decoder stage); another model's row is ``unsupported``;
- ``compile@B f=F``: the model under ``torch.compile`` (inductor, default mode; loss and optimizer
  eager) with ``torch._functorch.config.activation_memory_budget = F``: the min-cut partitioner
  keeps that fraction of the saved activations it keeps unconstrained (0: only the graph's
  inputs, the rest recomputed in the backward). F is a knob, not a size: each of
  ``--compile-fractions`` runs at every budget, the allocator capped at B as for the others.
  ``auto`` (the default) derives F from B and PyTorch's unconstrained run
  (``compile_fraction``): the share of that run's peak reserved P, above R, what stays allocated
  between its steps (parameters, optimizer state, the batch), that fits in B: (B - R) / (P - R).
  The rule is linear where the memory is not: the partitioner's fraction is of its own saved set,
  not of the eager peak, and the transient part of a step (gradients in flight, workspaces) does
  not shrink with F, so an ``oom`` at the derived F says the rule was optimistic at that budget;
  explicit fractions sweep the knob instead. Compilation runs in the first step (the forward at
  the first call, the backward at the first backward): the warm-up (at least
  ``COMPILE_MIN_WARMUP`` steps) holds it, so the timed steps exclude it; the row's
  ``compiled_in_timed_steps`` counts graphs compiled during them (0 where that holds) and
  ``first_step_s`` is the first step, compilation included. An exception of a compiled step (any
  but running out of memory) makes the row ``unsupported``, the exception its reason. The plot
  draws compile at its peak reserved (the cap only has to hold it).

``--budget`` takes several budgets: every method of ``--methods`` runs at each, in that order.

Each reports the median step time (CUDA events, after warm-up), peak reserved and allocated memory
of the timed steps, or ``oom``. A mucudnn step that runs out of memory is recorded
(``failed_steps``; the session plans again for less, at most 3 times, then offloads everything,
``fell_back``) and the run goes on. mucudnn's rows add the plan (bytes moved each way, counts),
the recorded profile, the measured host link and the lower bound from it: ``max(F, moved/d2h) +
max(B, moved/h2d)`` with F, B the unconstrained step split as the recorded profile splits it.

``--min-search pytorch mucudnn``: the smallest budget that trains, per method, bisected on a
``--min-step`` GiB grid (benchmarks/pressure.py's search): PyTorch's between its unconstrained peak
allocated x ``--pytorch-low-fraction`` (assumed to fail) and peak reserved (probed first);
mucudnn's between ``--mucudnn-low-fraction`` of PyTorch's minimum (its peak reserved where there is
none) and that minimum. A budget trains when every step ran (--warmup + --probe-steps): out of
memory, an error, a timeout or a mucudnn step that ran out of memory (``failed_steps``) fail. Every
probe is a row (``part: min-probe``); each search adds a ``part: min`` row with the minimum, its
probes (budget, status, step ms) and, for mucudnn, ``vs_pytorch_min`` (the issue's U-Net target:
<= 0.5). ``--sweep auto`` sweeps mucudnn from PyTorch's peak reserved down to mucudnn's minimum
(without one: to ``--mucudnn-low-fraction`` of the peak) in ``--sweep-points`` evenly spaced
budgets, stopping at the first that fails. ``--time-budget-s``: no run starts once that many
seconds have passed and none runs past it (rows ``skipped``, searches ``complete: false``).

Writes ``OUT/offload.json`` (every row), ``OUT/offload.md`` and ``OUT/offload.png`` (step time
against the budget, with PyTorch unconstrained, the other methods and the minima marked;
matplotlib, if installed) after every configuration.

``replay PROFILE --budgets B...`` (no GPU): the planner on a recorded step, at other budgets: what
it would keep, offload and recompute, its predicted peak and step, made by the session's own
lifecycle (mucudnn.torch.lifecycle, fed the recorded step; ``--trials``: the plans its trial runs
against it; mucudnn.torch.profiles reads the file). PROFILE is what
``MUCUDNN_OFFLOAD_PROFILE`` (``OffloadSession(profile_to=...)``) writes, benchmarks/pressure.py
keeps one per offload probe; or ``OUT/offload.json`` (``--row K``: its K-th row with a profile).

    python -m benchmarks.offload --models vgg16 resnet50 --budget 12GiB --sweep 16GiB 8GiB --out DIR
    python -m benchmarks.offload --models unet3d --methods --sweep auto \\
        --min-search pytorch mucudnn --time-budget-s 500 --out DIR
    python -m benchmarks.offload --models resnet50:184 --budget 10GiB 5GiB --sweep \\
        --methods mucudnn save_on_cpu ondemand checkpoint compile \\
        --compile-fractions auto 0.5 0.2 --out DIR
    python -m benchmarks.offload replay r3d_18-32-fp32-offload-4.5GiB-profile.json --budgets 4.5GiB 5GiB
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import signal
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

from benchmarks.budget_plot import GiB, plot, trains
from benchmarks.models import parse_model
from benchmarks.pressure import (DEVICE_MEMORY_GIB, OFFLOAD_MIN_WARMUP, Budget, OutOfTime,
                                 Terminated, execute, min_cap_search, min_text)
from benchmarks.shim_pytorch import allocator_counters, is_out_of_memory, trace_summary
from mucudnn.budget import parse_budget
from mucudnn.errors import MucudnnError
from mucudnn.outputs import write_text_atomically
from mucudnn.torch.lifecycle import SETTLED
from mucudnn.torch.planner import WATCH_STEPS, transfer_ms

HERE = Path(__file__).resolve()
ROOT = HERE.parents[1]
METHODS = ("mucudnn", "mucudnn-run", "save_on_cpu", "ondemand", "checkpoint", "compile")
# a search probes budgets: compile's knob is its fraction, and every probe would compile anew
SEARCHABLE = ("pytorch",) + tuple(m for m in METHODS if m != "compile")
# compilation happens in step 0 (the backward's graph at the first backward); a second warm-up
# step holds a recompilation on the second call (a guard failing on the state step 0 left)
COMPILE_MIN_WARMUP = 2


# -- worker (one configuration, in its own process) -----------------------------------------------

#: what a line of the shim about one kernel holds (its key: docs/shim.md), left out of a row's
#: ``said``
KERNEL_LINE = " dir="
#: mucudnn-run: the steps in a row its session must have run settled (lifecycle.SETTLED: a plan in
#: force and watched, or none to make; no plan being made) before its timed steps start. The watch
#: judges a plan by its last planner.WATCH_STEPS steps and a step's state is read as it ran (the
#: session ends a step at the next one's start), so one more than those
SETTLED_STEPS = WATCH_STEPS + 1
#: mucudnn-run: the most warm-up steps past --warmup spent waiting for that (then timed as it runs)
MOST_EXTRA_WARMUP = 30


def warmup_done(step: int, warmup: int, settled: int | None) -> bool:
    """Whether the worker's timed steps start at ``step``: past ``warmup`` steps and, where the
    method's session settles (``settled``: the steps in a row it ended settled; None: a method
    without one), once it settled for :data:`SETTLED_STEPS`, or :data:`MOST_EXTRA_WARMUP` steps
    later at the latest."""
    if step < warmup:
        return False
    return settled is None or settled >= SETTLED_STEPS or step >= warmup + MOST_EXTRA_WARMUP


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


def compiled(torch, model, fraction: float, backend: str = "inductor"):
    """``model`` under ``torch.compile`` whose min-cut partitioner keeps ``fraction`` of the
    activations it saves unconstrained. The partitioner reads the setting when a graph compiles
    (its first call), not here: it is the process's, one configuration per worker."""
    from torch._functorch import config   # not imported by ``import torch``
    config.activation_memory_budget = fraction
    return torch.compile(model, backend=backend)


def compile_refusal(torch, exc: BaseException) -> str | None:
    """Why a compiled step raised ``exc`` (the row's ``unsupported`` reason), or None where it
    ran out of memory (an ``oom`` row, as for any method): the error, its cause or context, or
    the one a backend failure wraps (dynamo's BackendCompilerFailed keeps it as
    ``inner_exception``) being torch's OutOfMemoryError."""
    seen, pending = set(), [exc]
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, torch.OutOfMemoryError):
            return None
        pending += [current.__cause__, current.__context__,
                    getattr(current, "inner_exception", None)]
    return f"torch.compile: {type(exc).__name__}: {' '.join(str(exc).split())}"[:300]


def fraction_arg(text: str) -> float:
    """An activation_memory_budget: a number in [0, 1]."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 <= value <= 1:   # NaN fails too
        raise argparse.ArgumentTypeError(f"{text!r} is not a fraction in [0, 1]")
    return value


def fractions_arg(text: str) -> float | str:
    """One of --compile-fractions: ``auto`` (derived from the budget) or a fraction in [0, 1]."""
    return text if text == "auto" else fraction_arg(text)


def compile_fraction(budget: int, base: dict) -> float:
    """``auto``'s activation_memory_budget at ``budget`` bytes, from PyTorch's unconstrained run
    ``base`` (its peak reserved P and ``resident_bytes`` R): (B - R) / (P - R) within [0, 1],
    rounded down to 0.01 (never above the budget's share; runs of one fraction at several
    budgets compile the same graphs, which inductor's cache then holds)."""
    resident, peak = base["resident_bytes"], base["peak_reserved"]
    if peak <= resident:
        return 1.0
    share = (budget - resident) / (peak - resident)
    return min(1.0, max(0.0, math.floor(share * 100 + 1e-9) / 100))


def compile_runs(args, budget: int, base: dict) -> list[tuple[float | None, str]]:
    """compile's runs at ``budget``: (fraction, label) per --compile-fractions, in order, each
    fraction once; ``auto``'s fraction None where PyTorch's unconstrained run (``base``), which
    it is derived from, did not train."""
    runs, seen = [], set()
    for given in args.compile_fractions:
        if given == "auto":
            if not trains(base):
                runs.append((None, "f=auto"))
                continue
            fraction = compile_fraction(budget, base)
            label = f"f={fraction:g} (auto)"
        else:
            fraction, label = given, f"f={given:g}"
        if fraction not in seen:
            seen.add(fraction)
            runs.append((fraction, label))
    return runs


class UnsupportedModel(Exception):
    """A model whose blocks ``checkpointed`` does not know: its checkpoint row is ``unsupported``."""


def checkpointed(torch, model, name: str):
    """``model`` with every block under ``torch.utils.checkpoint``: VGG's stages up to each pooling,
    the residual blocks of a ResNet (2-D, video, or a segmentation model's ``backbone``), the
    encoder and decoder stages of benchmarks/models.py's 3-D U-Net; UnsupportedModel otherwise."""
    from torch.utils.checkpoint import checkpoint

    class Checkpointed(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return checkpoint(self.inner, x, use_reentrant=False)

    trunk = getattr(model, "backbone", model)
    residual_stages = ("layer1", "layer2", "layer3", "layer4")
    if name.startswith("vgg"):
        stages, current = [], []
        for layer in model.features:
            current.append(layer)
            if isinstance(layer, torch.nn.MaxPool2d):
                stages.append(Checkpointed(torch.nn.Sequential(*current)))
                current = []
        model.features = torch.nn.Sequential(*stages, *current)
    elif all(isinstance(getattr(trunk, stage, None), torch.nn.Sequential)
             for stage in residual_stages):
        for stage in residual_stages:
            blocks = getattr(trunk, stage)
            setattr(trunk, stage, torch.nn.Sequential(*(Checkpointed(b) for b in blocks)))
    elif all(isinstance(getattr(model, part, None), torch.nn.ModuleList)
             for part in ("encoder", "decoder")):
        # each stage takes one tensor (the decoder's: the upsampled and skip tensors concatenated)
        for stages in (model.encoder, model.decoder):
            for index, stage in enumerate(stages):
                stages[index] = Checkpointed(stage)
    else:
        raise UnsupportedModel(f"per-block checkpointing knows VGG, ResNets (layer1..layer4) and "
                               f"the 3-D U-Net (encoder/decoder stages), not {name}")
    return model


def unsupported(reason: str) -> None:
    """A worker's result where the method does not run on the model (the row's status)."""
    print("RESULT " + json.dumps({"status": "unsupported", "reason": reason}), flush=True)


def worker(args) -> None:
    import contextlib

    import torch

    from benchmarks.models import prepare

    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    torch.backends.cudnn.benchmark = False
    device = torch.device("cuda", torch.cuda.current_device())  # an index: the memory-fraction API needs one
    total = torch.cuda.get_device_properties(device).total_memory
    if args.budget_bytes and not args.no_cap:
        torch.cuda.set_per_process_memory_fraction(args.budget_bytes / total, device)
    if args.method == "mucudnn-run":
        # the session the CLI entered when torch was imported, looked up now: once its first plan
        # takes over it freezes the garbage collector, whose frozen objects a lookup misses
        from benchmarks.train_steps import find_session
        cli_session = find_session()
        if cli_session is None:
            raise RuntimeError("mucudnn-run: no offload session in the worker (was it run "
                               "under `mucudnn run --offload`?)")
    torch.manual_seed(0)
    # network, input, labels and loss: benchmarks/models.py's, fp32
    training = prepare(args.model, args.batch, device=str(device),
                       generator=torch.Generator().manual_seed(1))
    model = training.model
    if args.method == "checkpoint":
        try:
            model = checkpointed(torch, model, args.model)
        except UnsupportedModel as exc:
            unsupported(str(exc))
            return
    result = {"device_memory": total}
    context = contextlib.nullcontext
    warmup = args.warmup
    if args.method == "compile":
        from torch._dynamo.utils import counters as dynamo_counters
        warmup = max(warmup, COMPILE_MIN_WARMUP)
        try:
            model = compiled(torch, model, args.compile_fraction)
        except Exception as exc:
            reason = compile_refusal(torch, exc)
            if reason is None:
                raise
            unsupported(reason)
            return
        result["warmup"] = warmup
    if args.method == "mucudnn":
        import mucudnn.torch as mt
        # not strict: a budget no plan meets offloads everything (as an unmodified script does)
        # and the row still has the recorded profile
        model = mt.fit(model, budget=args.budget_bytes, headroom=args.headroom, strict=False,
                       max_pending=args.max_pending_mib << 20,
                       say=lambda text: print("mucudnn:", text, file=sys.stderr, flush=True))
    elif args.method == "save_on_cpu":
        context = lambda: torch.autograd.graph.save_on_cpu(pin_memory=True)  # noqa: E731
    elif args.method == "ondemand":
        hooks = ondemand_hooks(torch)
        context = lambda: hooks  # noqa: E731
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    times, failed_steps, retries_before = [], [], 0
    allocator_steps = []   # per timed step: the caching allocator's counters that grew in it
    settled = 0            # mucudnn-run: the steps in a row its session ended settled
    step, timed_from = -1, None
    while timed_from is None or step + 1 < timed_from + args.steps:
        step += 1
        counters = allocator_counters(torch, device)
        if timed_from is None and warmup_done(step, warmup, settled
                                              if args.method == "mucudnn-run" else None):
            timed_from = step
            result["timed_from_step"] = step
            # peaks of the timed steps only (mucudnn's recording step resets the statistics)
            torch.cuda.reset_peak_memory_stats(device)
            retries_before = counters["num_alloc_retries"]
            if args.method == "compile":
                graphs_before = dynamo_counters["stats"]["unique_graphs"]
        if args.method == "mucudnn":   # what a step leaves behind shows here (a leak, state)
            print(f"step {step}: {torch.cuda.memory_allocated(device) / 2**30:.2f} GiB allocated "
                  "at its start", file=sys.stderr, flush=True)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        optimizer.zero_grad(set_to_none=True)
        try:
            with context():
                loss = training.loss(model(training.inputs), training.labels)
            loss.backward()
        except torch.OutOfMemoryError:
            # mucudnn falls back to offloading everything after a planned step that ran out of
            # memory: record the step and go on; any other method's OOM ends the configuration
            if args.method != "mucudnn":
                raise
            loss = None
            failed_steps.append(step)
            # where it ran out: the op, and whether rescue.py saw it
            print(f"step {step}: out of memory\n" + "".join(
                traceback.format_exc().splitlines(keepends=True)[-14:]),
                file=sys.stderr, flush=True)
            continue
        except Exception as exc:
            reason = compile_refusal(torch, exc) if args.method == "compile" else None
            if reason is None:   # another method's error, or compile running out of memory
                raise
            unsupported(reason)
            return
        optimizer.step()
        end.record()
        end.synchronize()
        if args.method == "compile" and step == 0:
            result["first_step_s"] = start.elapsed_time(end) / 1000
        if timed_from is not None:
            times.append(start.elapsed_time(end))
            allocator_steps.append({name: value - counters[name] for name, value
                                    in allocator_counters(torch, device).items()})
        print(f"step {step}: {start.elapsed_time(end):.1f} ms", file=sys.stderr, flush=True)
        if args.method == "mucudnn-run":
            lifecycle = cli_session.lifecycle
            settled = settled + 1 if lifecycle.state in SETTLED and lifecycle.awaiting is None \
                else 0
            if timed_from is not None and not settled:   # it left its plan while timed
                result["unsettled_timed_steps"] = result.get("unsettled_timed_steps", 0) + 1
    if not times:
        raise torch.OutOfMemoryError(f"every timed step ran out of memory ({failed_steps})")
    if args.method == "compile":
        result["compiled_in_timed_steps"] = (dynamo_counters["stats"]["unique_graphs"]
                                             - graphs_before)
    # what stays allocated between steps (parameters, optimizer state, the batch): compile's
    # ``auto`` fraction reads it from PyTorch's unconstrained run (compile_fraction)
    optimizer.zero_grad(set_to_none=True)
    loss = None
    result["resident_bytes"] = torch.cuda.memory_allocated(device)
    if args.trace:   # one more step under the profiler: where its time went (trace_summary)
        import tempfile

        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            optimizer.zero_grad(set_to_none=True)
            with context():
                loss = training.loss(model(training.inputs), training.labels)
            loss.backward()
            optimizer.step()
            torch.cuda.synchronize(device)
        with tempfile.TemporaryDirectory() as scratch:
            path = os.path.join(scratch, "trace.json")
            prof.export_chrome_trace(path)
            with open(path) as file:
                result["trace"] = trace_summary(json.load(file))
    # the caching allocator's flushes (free every cached block, synchronise, allocate again)
    # during the timed steps: a configuration that runs at the cap pays them in its step time
    result.update(failed_steps=failed_steps, alloc_retries=allocator_counters(
        torch, device)["num_alloc_retries"] - retries_before)
    result.update(step_ms=statistics.median(times), steps_ms=times, allocator_steps=allocator_steps,
                  peak_reserved=torch.cuda.max_memory_reserved(device),
                  peak_allocated=torch.cuda.max_memory_allocated(device))
    if args.method in ("mucudnn", "mucudnn-run"):   # the API's session or the CLI's
        session = model.mucudnn_session if args.method == "mucudnn" else cli_session
        plan, profile = session.plan, session.profile
        links = list(session._links.values())
        result.update(fell_back=session.fell_back, target=session.target,
                      replans_used=session.replans_used,
                      # per plan made: (what was asked, wall seconds, steps run meanwhile)
                      planning=session.lifecycle.timings,
                      host_allocations=sum(link.host_allocations for link in links))
        if profile is not None:
            result.update(profile_baseline_peak=max(profile.baseline_forward
                                                    + profile.baseline_backward, default=0))
            # the whole recorded profile: the planner can be replayed on it off the GPU
            result.update(profile=dataclasses.asdict(profile),
                          modes=list(plan.modes) if plan is not None else None)
        if session.stage is not None:   # the profile above is then the staged one
            result.update(stage=dataclasses.asdict(session.stage.stage),
                          recorded_profile=dataclasses.asdict(session.recorded_profile))
        if plan is not None:
            result.update(moved_bytes=plan.moved_bytes, predicted_ms=plan.step_ms,
                          predicted_peak=plan.peak, prefetch_lookahead=plan.lookahead,
                          kept=plan.count("keep"), offloaded=plan.count("offload"),
                          recomputed=plan.count("recompute"),
                          recomputed_bytes=sum(g.nbytes for g, m in zip(profile.groups, plan.modes)
                                               if m == "recompute"),
                          # recipes reading several groups: a residual add (ResNet's blocks)
                          recomputed_multi_source=sum(
                              1 for g, m in zip(profile.groups, plan.modes)
                              if m == "recompute" and len(g.recompute_source) > 1),
                          d2h_gbps=profile.d2h_gbps,
                          h2d_gbps=profile.h2d_gbps, profile_forward_ms=profile.forward_ms,
                          profile_backward_ms=profile.backward_ms,
                          saved_bytes=sum(g.nbytes for g in profile.groups))
    print("RESULT " + json.dumps(result), flush=True)


# -- driver ---------------------------------------------------------------------------------------

MIN_PARTS = ("min", "min-probe")   # the searches' rows: their own table, not the main one


def config_name(method: str, budget: int | None) -> str:
    return method if budget is None else f"{method}@{budget / GiB:g}GiB"


def run_config(args, model: str, batch: int, method: str, budget: int | None, *,
               part: str = "table", steps: int | None = None, clock: Budget | None = None,
               extra: tuple[str, ...] = (), label: str = "") -> dict:
    """One configuration in its own process (its process group killed past its timeout or on
    SIGTERM); ``skipped`` without a run once ``clock``'s time budget is spent, and never run past
    it (``out_of_time``). ``extra``: more worker options, ``label`` their name in the row's."""
    name = config_name(method, budget) + (f" {label}" if label else "")
    row = {"model": model, "batch": batch, "config": name, "method": method,
           "budget_bytes": budget, "part": part}
    # compilation runs in the warm-up, so compile's row takes longer: --compile-timeout at least
    timeout, cut = args.timeout, False
    if method == "compile":
        timeout = max(timeout, getattr(args, "compile_timeout", timeout))
    if clock is not None:
        try:
            clock.check(f"{model} {name} ({part})")
        except OutOfTime:
            row.update(status="skipped", reason="time budget spent")
            return row
        if clock.deadline is not None:
            remaining = clock.deadline - clock.clock()
            timeout, cut = min(timeout, remaining), remaining < timeout
    cmd = [sys.executable, "-m", "benchmarks.offload", "worker", "--model", model,
           "--method", method, "--batch", str(batch), "--steps", str(steps or args.steps),
           "--warmup", str(args.warmup), "--budget-bytes", str(budget or 0),
           "--headroom", str(args.headroom)] + ["--trace"] * bool(getattr(args, "trace", False)) \
        + list(extra)
    if method == "mucudnn-run":   # the worker under the CLI, which caps the allocator itself
        cmd = [sys.executable, "-m", "mucudnn", "run", "--memory-budget", str(budget),
               "--offload", "--"] + cmd + ["--no-cap"]
    env = dict(os.environ, PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH")))))
    print(f"[{time.strftime('%H:%M:%S')}] {model} N={batch} {name} ({part})", flush=True)
    with tempfile.TemporaryDirectory(prefix="mucudnn-plans-") as plans:
        if method == "mucudnn-run":
            # a first run, as a new user's: no plan of another row (the API's at the same budget
            # has the same script and key) or of an earlier run of the benchmark to load
            env["MUCUDNN_PLAN_CACHE"] = plans
            # the session's lines (its plans, trials, lowerings) beside the steps they came in
            env.setdefault("MUCUDNN_LOG_LEVEL", "info")
        rc, stdout, stderr, wall_s, timed_out = execute(cmd, env, timeout)
    row["wall_s"] = round(wall_s, 1)
    lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    if timed_out:
        row["status"] = "out_of_time" if cut else "timeout"
    elif rc == 0 and lines:
        result = json.loads(lines[-1][len("RESULT "):])
        row.update(status=result.pop("status", "ok"), **result)
    elif is_out_of_memory(stderr):
        row["status"] = "oom"
    else:
        row.update(status="error", error=stderr.strip().splitlines()[-5:])
    row["log_tail"] = stderr.strip().splitlines()[-4:]
    # the shim's lines about each kernel (" dir=...": hundreds at the info level) left out
    row["said"] = [line for line in stderr.splitlines()
                   if line.startswith(("mucudnn:", "step ")) and KERNEL_LINE not in line]
    print(f"    {row['status']}" + (f" {row['step_ms']:.1f} ms, peak reserved "
                                    f"{row['peak_reserved'] / GiB:.2f} GiB"
                                    if row["status"] == "ok" else "")
          + (f", steps {row['failed_steps']} out of memory" if row.get("failed_steps") else "")
          + f" ({row['wall_s']} s)", flush=True)
    return row


def unconstrained(rows: list[dict], model: str) -> dict | None:
    """PyTorch's run without a budget of ``model``, if it trained."""
    return next((r for r in rows if r["model"] == model and r["method"] == "pytorch"
                 and r.get("budget_bytes") is None and r.get("status") == "ok"), None)


def add_bounds(rows: list[dict]) -> None:
    """The host-link lower bound and ratios to the unconstrained step, per model; each minimum
    against PyTorch's."""
    for row in rows:
        ref = unconstrained(rows, row["model"])
        if ref is None or row.get("status") != "ok" or "step_ms" not in row:
            continue
        row["vs_unconstrained"] = row["step_ms"] / ref["step_ms"]
        if "moved_bytes" in row:
            share = row["profile_forward_ms"] / max(row["profile_forward_ms"]
                                                    + row["profile_backward_ms"], 1e-9)
            d2h_ms = transfer_ms(row["moved_bytes"], row["d2h_gbps"])
            h2d_ms = transfer_ms(row["moved_bytes"], row["h2d_gbps"])
            row["bound_ms"] = max(share * ref["step_ms"], d2h_ms) + \
                max((1 - share) * ref["step_ms"], h2d_ms)
            row["vs_bound"] = row["step_ms"] / row["bound_ms"]
    for row in rows:
        pytorch = next((r for r in rows if r.get("part") == "min" and r["model"] == row["model"]
                        and r["method"] == "pytorch" and r.get("min_budget_gib")), None)
        if row.get("part") == "min" and row["method"] != "pytorch" and pytorch \
                and row.get("min_budget_gib"):
            row["vs_pytorch_min"] = row["min_budget_gib"] / pytorch["min_budget_gib"]


# -- the smallest budget that trains, and the sweep down to it ------------------------------------

def search_bracket(method: str, base: dict, args, pytorch_min: dict | None = None):
    """(low, high) GiB of ``method``'s search: low assumed to fail, high probed first. PyTorch's
    from its unconstrained run (peak allocated x --pytorch-low-fraction, peak reserved); any other
    method's below PyTorch's minimum (or what bounds it), else below PyTorch's peak reserved."""
    if method == "pytorch":
        return (base["peak_allocated"] / GiB * args.pytorch_low_fraction,
                base["peak_reserved"] / GiB)
    high = ((pytorch_min or {}).get("min_budget_gib") or (pytorch_min or {}).get("at_most_gib")
            or base["peak_reserved"] / GiB)
    return high * args.offload_low_fraction, high


def min_budget_search(method: str, run_probe, base: dict, args,
                      pytorch_min: dict | None = None) -> dict:
    """The ``part: min`` row of ``method``: the smallest budget on the --min-step grid at which
    ``run_probe(budget_bytes) -> row`` trains (``trains``), by benchmarks/pressure.py's bisection,
    every outcome but training a failure. A ``skipped`` or ``out_of_time`` probe (the time budget)
    ends the search incomplete."""
    low, high = search_bracket(method, base, args, pytorch_min)
    probed: dict[int, dict] = {}

    def probe(gib: float) -> dict:
        budget = round(gib * GiB)
        row = probed[budget] = run_probe(budget)
        if row.get("status") in ("skipped", "out_of_time"):
            raise OutOfTime(row["config"])
        status = "ok" if trains(row) else ("failed_steps" if row.get("status") == "ok"
                                           else row.get("status", "error"))
        outcome = {"status": status, "wall_s": row.get("wall_s")}
        if row.get("status") == "ok":
            outcome["step_ms"] = row["step_ms"]
        if row.get("error"):
            outcome["error"] = " / ".join(row["error"])[-300:]
        return outcome

    search = min_cap_search(probe, low, high, step_gib=args.min_step,
                            ceiling_gib=base.get("device_memory", 0) / GiB or DEVICE_MEMORY_GIB,
                            crash_ends_search=False)
    search["probes"] = [{"budget_gib": p.pop("cap_gib"), **p} for p in search["probes"]]
    search.pop("at_min", None)   # the probe's own row is in the rows
    found = search.get("min_cap_gib")
    status = ("ok" if found is not None else "incomplete" if not search["complete"]
              else "not found")
    row = {"model": base["model"], "batch": base["batch"], "config": f"{method} min",
           "method": method, "part": "min", "status": status,
           "budget_bytes": round(found * GiB) if found is not None else None,
           "min_budget_gib": found, "at_most_gib": search.get("at_most_gib"),
           "bracket_gib": [round(low, 3), round(high, 3)], "search": search}
    if found is not None:
        at_min = probed[round(found * GiB)]
        row.update(step_ms=at_min["step_ms"], peak_reserved=at_min["peak_reserved"],
                   peak_allocated=at_min["peak_allocated"])
    return row


def auto_sweep_budgets(high_gib: float, low_gib: float, points: int, step_gib: float) -> list[float]:
    """``points`` budgets from ``high_gib`` (rounded up to the grid: at least PyTorch's peak) down
    to ``low_gib`` (rounded up: a found minimum stays itself), evenly spaced, the ones between
    rounded to the nearest grid point; descending, distinct, all above 0."""
    if points < 1:
        return []
    top = math.ceil(high_gib / step_gib - 1e-9) * step_gib
    bottom = max(step_gib, math.ceil(low_gib / step_gib - 1e-9) * step_gib)
    if points == 1 or bottom >= top:
        return [top]
    budgets = [top]
    for i in range(1, points - 1):
        budgets.append(round((top - (top - bottom) * i / (points - 1)) / step_gib) * step_gib)
    budgets.append(bottom)
    return sorted(set(budgets), reverse=True)


def measured(rows: list[dict], model: str, batch: int, method: str, budget: int) -> dict | None:
    """A run of ``method`` at ``budget`` already made (main table, sweep or search probe)."""
    return next((r for r in rows if r["model"] == model and r.get("batch", batch) == batch
                 and r["method"] == method and r.get("budget_bytes") == budget
                 and r.get("part") != "min"
                 and r.get("status") not in ("skipped", "out_of_time")), None)


def measure_model(args, text: str, rows: list[dict], clock: Budget, save) -> None:
    """Every configuration of one model, in order: PyTorch unconstrained, --methods at --budget,
    the explicit sweep, the searches, the automatic sweep; ``save()`` after each."""
    model, batch = parse_model(text)
    if args.batch and ":" not in text:
        batch = args.batch

    def run(method, budget, part, steps=None, fields=(), **more):
        row = run_config(args, model, batch, method, budget, part=part, steps=steps, clock=clock,
                         **more)
        row.update(fields)   # what the driver chose for the run (compile's fraction)
        rows.append(row)
        add_bounds(rows)
        save()
        return row

    base = run("pytorch", None, "table")
    for text_budget in budget_texts(args):
        budget = parse_budget(text_budget)
        for method in args.methods:
            if method != "compile":
                run(method, budget, "table")
                continue
            for fraction, label in compile_runs(args, budget, base):
                if fraction is None:
                    rows.append({"model": model, "batch": batch, "method": method,
                                 "config": f"{config_name(method, budget)} {label}",
                                 "budget_bytes": budget, "part": "table", "status": "skipped",
                                 "reason": f"PyTorch's unconstrained run: {base['status']}"})
                    save()
                    continue
                run(method, budget, "table", fields={"compile_fraction": fraction},
                    extra=("--compile-fraction", repr(fraction)), label=label)
    for text_budget in args.sweep:
        if text_budget != "auto":
            run("mucudnn", parse_budget(text_budget), "sweep")
    later = [f"{m} min" for m in args.min_search] + (["auto sweep"] if "auto" in args.sweep else [])
    if not trains(base):
        for what in later:   # both need PyTorch's peak
            rows.append({"model": model, "batch": batch, "config": what, "method": what.split()[0],
                         "part": "min" if what.endswith("min") else "auto-sweep",
                         "status": "skipped", "budget_bytes": None,
                         "reason": f"PyTorch's unconstrained run: {base['status']}"})
        save()
        return
    found: dict[str, dict] = {}
    for method in args.min_search:
        found[method] = min_budget_search(
            method, lambda budget, m=method: run(m, budget, "min-probe", args.probe_steps),
            base, args, found.get("pytorch"))
        rows.append(found[method])
        add_bounds(rows)
        save()
        print(f"    {model} {method}: smallest budget that trains "
              f"{min_text(found[method]['search'])} GiB", flush=True)
    if "auto" in args.sweep:
        low = (found.get("mucudnn") or {}).get("min_budget_gib") or \
            base["peak_reserved"] / GiB * args.offload_low_fraction
        for gib in auto_sweep_budgets(base["peak_reserved"] / GiB, low, args.sweep_points,
                                      args.min_step):
            budget = round(gib * GiB)
            row = measured(rows, model, batch, "mucudnn", budget) or run("mucudnn", budget,
                                                                        "auto-sweep")
            if row["status"] != "skipped" and not trains(row):
                print(f"    auto sweep: stops at {gib:g} GiB ({row['status']})", flush=True)
                break


# -- outputs ----------------------------------------------------------------------------------------

def model_cell(row: dict) -> str:
    return f"{row['model']} N={row['batch']}" if "batch" in row else row["model"]


def status_cell(row: dict) -> str:
    status = row.get("status", "?")
    if row.get("failed_steps"):
        return status + (f" (steps {row['failed_steps']} out of memory; fell back to offloading "
                         "everything)")
    if row.get("reason"):
        return f"{status} ({row['reason']})".replace("|", "/")
    return status


def budget_texts(args) -> list[str]:
    """--budget's sizes as given (a namespace made by hand may hold one as a string)."""
    return [args.budget] if isinstance(args.budget, str) else list(args.budget)


def markdown(rows: list[dict], args) -> str:
    out = [f"# Activation offload under a memory budget (fp32, TF32), budget "
           f"{', '.join(budget_texts(args))}", "",
           "| model | config | status | step ms | × unconstrained | peak reserved GiB | "
           "moved each way GiB | bound ms | × bound | plan (keep/offload/recompute) | "
           "allocator flushes |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.get("part") in MIN_PARTS:
            continue
        ok = r.get("status") == "ok"
        out.append("| " + " | ".join([
            model_cell(r), r["config"] + (" (auto sweep)" if r.get("part") == "auto-sweep" else ""),
            status_cell(r),
            f"{r['step_ms']:.1f}" if ok else "—",
            f"{r['vs_unconstrained']:.3f}" if "vs_unconstrained" in r else "—",
            f"{r['peak_reserved'] / GiB:.2f}" if ok else "—",
            f"{r['moved_bytes'] / GiB:.2f}" if "moved_bytes" in r else "—",
            f"{r['bound_ms']:.1f}" if "bound_ms" in r else "—",
            f"{r['vs_bound']:.3f}" if "vs_bound" in r else "—",
            f"{r['kept']}/{r['offloaded']}/{r['recomputed']}" if "kept" in r else "—",
            str(r["alloc_retries"]) if "alloc_retries" in r else "—"]) + " |")
    out += compile_markdown(rows)
    out += min_markdown(rows, args)
    traced = [r for r in rows if r.get("trace")]
    if traced:
        out += ["", "## One profiled step per configuration (`--trace`)", "",
                "| model | config | span ms | compute stream busy ms | idle ms (gaps > 50 µs) | "
                "other streams busy ms | host's top CUDA calls ms (count) |",
                "|---|---|---|---|---|---|---|"]
        for r in traced:
            t = r["trace"]
            others = ", ".join(f"{s['busy_ms']:.1f}" for k, s in t["streams"].items()
                               if k != t["compute_stream"])
            calls = ", ".join(f"{name} {ms:.1f} ({n})" for name, (ms, n) in
                              list(t["runtime_calls_ms"].items())[:3])
            out.append(f"| {model_cell(r)} | {r['config']} | {t['span_ms']:.1f} | "
                       f"{t['streams'][t['compute_stream']]['busy_ms']:.1f} | "
                       f"{t['compute_idle_ms']:.1f} ({t['compute_gaps_over_50us']}) | "
                       f"{others or '—'} | {calls} |")
    link = next((r for r in rows if "d2h_gbps" in r), None)
    if link:
        out += ["", f"Host link measured by mucudnn.torch: {link['d2h_gbps']:.1f} GB/s to the "
                    f"host, {link['h2d_gbps']:.1f} GB/s to the device (pinned, one direction at "
                    "a time)."]
    return "\n".join(out) + "\n"


def compile_markdown(rows: list[dict]) -> list[str]:
    """compile's rows (nothing without one): the fraction each ran at, its first step (which
    compiles) and the graphs compiled during the timed steps (0: the timing excludes
    compilation)."""
    compiled = [r for r in rows if r.get("method") == "compile"]
    if not compiled:
        return []
    out = ["", "## torch.compile with activation_memory_budget", "",
           "The model under `torch.compile` (inductor; loss and SGD eager), the min-cut "
           "partitioner's `activation_memory_budget` set to the fraction; the allocator capped at "
           "the budget. `auto`: (B - R) / (P - R), P PyTorch's unconstrained peak reserved, R what "
           "stays allocated between its steps, rounded down to 0.01.", "",
           "| model | config | fraction | status | step ms | × unconstrained | peak reserved GiB | "
           "first step s (compiles) | graphs compiled in timed steps |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in compiled:
        ok = r.get("status") == "ok"
        out.append("| " + " | ".join([
            model_cell(r), r["config"], f"{r['compile_fraction']:g}" if "compile_fraction" in r
            else "—", status_cell(r), f"{r['step_ms']:.1f}" if ok else "—",
            f"{r['vs_unconstrained']:.3f}" if "vs_unconstrained" in r else "—",
            f"{r['peak_reserved'] / GiB:.2f}" if ok else "—",
            f"{r['first_step_s']:.1f}" if "first_step_s" in r else "—",
            str(r["compiled_in_timed_steps"]) if "compiled_in_timed_steps" in r else "—"]) + " |")
    return out


def probe_text(probe: dict) -> str:
    return f"{probe['budget_gib']:g}: {probe['status']}" + (
        f" {probe['step_ms']:.1f} ms" if probe.get("step_ms") is not None else "")


def min_markdown(rows: list[dict], args) -> list[str]:
    """The searches' table (nothing without one) and mucudnn's minimum against PyTorch's."""
    mins = [r for r in rows if r.get("part") == "min"]
    if not mins:
        return []
    out = ["", "## Smallest budget that trains", "",
           f"A budget trains when all {args.warmup} + {args.probe_steps} steps ran; bisection on "
           f"a {args.min_step:g} GiB grid between the bracket's low end (assumed to fail) and "
           "high end (probed first); probes in the order run.", "",
           "| model | method | smallest budget GiB | × PyTorch's minimum | step ms there | "
           "× unconstrained | bracket GiB | probes (GiB: outcome) |",
           "|---|---|---|---|---|---|---|---|"]
    for r in mins:
        search = r.get("search", {})
        if r.get("status") == "skipped":
            smallest = status_cell(r)
        elif r.get("status") == "incomplete" and r.get("at_most_gib") is None:
            smallest = "not found (time budget spent)"
        else:
            smallest = min_text(search)
        out.append("| " + " | ".join([
            model_cell(r), r["method"], smallest,
            f"{r['vs_pytorch_min']:.2f}" if "vs_pytorch_min" in r else "—",
            f"{r['step_ms']:.1f}" if "step_ms" in r else "—",
            f"{r['vs_unconstrained']:.3f}" if "vs_unconstrained" in r else "—",
            "–".join(f"{b:g}" for b in r["bracket_gib"]) if "bracket_gib" in r else "—",
            "; ".join(probe_text(p) for p in search.get("probes", [])) or "—"]) + " |")
    for r in mins:
        if "vs_pytorch_min" in r:
            pytorch = next(m for m in mins if m["model"] == r["model"] and m["method"] == "pytorch")
            out += ["", f"{model_cell(r)}: {r['method']} trains in {r['vs_pytorch_min']:.2f} of "
                        f"PyTorch's smallest budget ({r['min_budget_gib']:g} GiB against "
                        f"{pytorch['min_budget_gib']:g} GiB)."]
    return out


def driver(args) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    clock = Budget(args.time_budget_s)
    rows: list[dict] = []

    def save() -> None:   # after every configuration: what ran survives a later timeout
        write_text_atomically(out / "offload.json", json.dumps(rows, indent=1))
        write_text_atomically(out / "offload.md", markdown(rows, args))

    def terminate(signum, frame):
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        for text in args.models:
            measure_model(args, text, rows, clock, save)
            plot(rows, out / "offload.png")
    except Terminated:
        print("terminated: writing what was measured", flush=True)
    finally:
        signal.signal(signal.SIGTERM, previous)
        save()
    if clock.skipped:
        print(f"not run (time budget spent): {', '.join(clock.skipped)}", flush=True)
    if plot(rows, out / "offload.png"):
        print(f"wrote {out / 'offload.png'}")
    print(markdown(rows, args))


def replay(args) -> int:
    """The planner on a recorded profile at each budget, as the session plans: the session's own
    lifecycle (mucudnn.torch.lifecycle, planning inline) fed the recorded step, so the plan is
    the one a session makes after recording it (its target the headroom's, or a smaller one's
    where none meets that). One line per budget (and with ``--trials`` the plans a trial runs
    against it, with ``--groups`` a table of the modes); one line and status 2 for a bad file or
    budget."""
    from mucudnn.torch.lifecycle import Lifecycle, StepOutcome
    from mucudnn.torch.profiles import group_lines, load_profile
    try:
        budgets = [parse_budget(text) for text in args.budgets]
        recorded = load_profile(Path(args.profile), args.row)
    except MucudnnError as exc:
        print(f"offload replay: {exc}", file=sys.stderr)
        return 2
    profile = recorded.profile
    print(f"{args.profile}: {len(profile.groups)} saved groups, {profile.unpacks} backward points; "
          f"recorded plan: {recorded.plan or '-'}")
    for budget in budgets:
        lifecycle = Lifecycle(budget, headroom=args.headroom, lookahead=args.lookahead,
                              plan_time_limit_s=args.time_limit_s, record_steps=1,
                              trials=args.trials, strict=False, staging=False)
        decision = lifecycle.end_step(StepOutcome(profile=profile))
        if lifecycle.first_error_message is not None:
            print(f"{budget / GiB:g} GiB: {lifecycle.first_error_message}")
        plan = lifecycle.plan
        if plan is None:
            continue
        seconds = sum(made for _, made, _ in lifecycle.timings)
        print(f"{budget / GiB:g} GiB (target {lifecycle.target / GiB:.2f}): {plan.describe()} "
              f"(planned in {seconds:.2f} s)")
        if args.trials:
            for line in decision.lines:
                if line.startswith("trying it against"):
                    print("   " + line)
        if args.groups:
            for line in group_lines(profile, plan.modes):
                print("   " + line)
    return 0


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="role")
    drive = sub.add_parser("driver", help="every configuration (the default)")
    work = sub.add_parser("worker", help="one configuration (internal)")
    again = sub.add_parser("replay", help="the planner on a recorded profile, at other budgets "
                                          "(no GPU)")
    again.add_argument("profile", help="MUCUDNN_OFFLOAD_PROFILE's file, or OUT/offload.json")
    again.add_argument("--budgets", nargs="+", required=True, help="sizes, e.g. 4.5GiB 5GiB")
    again.add_argument("--row", type=int, help="offload.json: the K-th row with a profile (0: first)")
    again.add_argument("--headroom", type=float, default=0.1, help="as OffloadSession's")
    again.add_argument("--lookahead", type=int, default=2, help="as OffloadSession's")
    again.add_argument("--time-limit-s", type=float, default=20, help="CBC's, per solve")
    again.add_argument("--groups", action="store_true", help="each saved group's mode")
    again.add_argument("--trials", action="store_true",
                       help="the plans the session's trial runs against the plan made")
    for p in (parser, drive):
        p.add_argument("--models", nargs="+", default=["vgg16", "resnet50"],
                       help="MODEL or MODEL:BATCH of benchmarks/models.py")
        p.add_argument("--batch", type=int, help="N of every MODEL (default: the model's own)")
        p.add_argument("--budget", nargs="+", default=["12GiB"],
                       help="the budgets every method of --methods is held to, each in turn")
        p.add_argument("--methods", nargs="*", choices=METHODS, default=list(METHODS),
                       help="what runs at --budget (default all: one table; --methods alone: none)")
        p.add_argument("--compile-fractions", nargs="+", type=fractions_arg, default=["auto"],
                       help="compile's activation_memory_budget values, each run at every "
                            "--budget: fractions in [0, 1], or auto (derived from the budget, "
                            "compile_fraction)")
        p.add_argument("--sweep", nargs="*", default=["16GiB", "8GiB"],
                       help="more budgets for mucudnn alone (the plot); auto: PyTorch's peak "
                            "reserved down to mucudnn's minimum in --sweep-points budgets")
        p.add_argument("--sweep-points", type=int, default=5, help="budgets of --sweep auto")
        p.add_argument("--min-search", nargs="*", default=[], choices=SEARCHABLE,
                       help="methods whose smallest budget that trains is bisected")
        p.add_argument("--min-step", type=float, default=0.25, help="GiB: the searches' grid")
        p.add_argument("--pytorch-low-fraction", type=float, default=0.7,
                       help="PyTorch's search: its peak allocated x this is assumed to fail")
        p.add_argument("--offload-low-fraction", type=float, default=0.25,
                       help="other methods' searches (and --sweep auto without a minimum): this "
                            "fraction of PyTorch's minimum (else peak reserved) is assumed to fail")
        p.add_argument("--probe-steps", type=int, default=2, help="timed steps of a search probe")
        p.add_argument("--steps", type=int, default=5)
        p.add_argument("--warmup", type=int, default=OFFLOAD_MIN_WARMUP,
                       help="steps not timed (mucudnn records the first, may try three plans; a "
                            "planned step that runs out of memory plans again)")
        p.add_argument("--headroom", type=float, default=0.1)
        p.add_argument("--timeout", type=float, default=150, help="seconds per configuration")
        p.add_argument("--compile-timeout", type=float, default=300,
                       help="seconds of a compile configuration at least (it compiles in its "
                            "warm-up: ResNet-152's took over 120 s on an H200)")
        p.add_argument("--time-budget-s", type=float,
                       help="no configuration starts, nor runs, past this many seconds")
        p.add_argument("--out", default="offload-out")
        p.add_argument("--trace", action="store_true",
                       help="each configuration also profiles one step after the timed ones: "
                            "busy and idle time per CUDA stream, host waits (row's 'trace')")
    work.add_argument("--model", required=True)
    work.add_argument("--method", choices=("pytorch",) + METHODS, required=True)
    work.add_argument("--compile-fraction", type=fraction_arg,
                      help="compile (required): torch._functorch.config.activation_memory_budget")
    work.add_argument("--batch", type=int, required=True)
    work.add_argument("--steps", type=int, default=5)
    work.add_argument("--warmup", type=int, default=OFFLOAD_MIN_WARMUP)
    work.add_argument("--budget-bytes", type=int, default=0)
    work.add_argument("--headroom", type=float, default=0.1)
    work.add_argument("--trace", action="store_true")
    work.add_argument("--no-cap", action="store_true",
                      help="plan for --budget-bytes without holding the allocator to it")
    work.add_argument("--max-pending-mib", type=int, default=1024,
                      help="copies to the host in flight before the host waits (CudaLink's)")
    args = parser.parse_args(argv)
    if args.role == "worker":
        if args.method == "compile" and args.compile_fraction is None:
            work.error("--method compile needs --compile-fraction")
        worker(args)
        return
    if args.role == "replay":
        sys.exit(replay(args))
    try:   # the budgets, before any run: one clear line for a bad one
        for text in args.budget * bool(args.methods) + [b for b in args.sweep if b != "auto"]:
            parse_budget(text)
    except MucudnnError as exc:
        parser.error(str(exc))
    driver(args)


if __name__ == "__main__":
    main()
