"""PyTorch + shim on the GPU (issues 3 and 4): correctness of gradients, step time, peak memory.

``driver`` runs everything for each model, one subprocess per configuration, and writes a JSON
report and a table. SGD, random data, batch 256, on one of PyTorch's cuDNN paths:

- ``--path legacy`` (issue 3; TORCH_CUDNN_V8_API_DISABLED=1, fp32): ``uncapped`` plain PyTorch,
  ``capped`` cuDNN's own cap CUDNN_CONV_WSCAP_DBG=64 (MiB), ``passthrough`` the shim loaded with
  no plan (its overhead), ``shim`` the shim with a WR plan tuned at 64 MiB from a recording of what
  this very model runs, plus MUCUDNN_WORKSPACE_LIMIT=64MiB for anything unplanned;
- ``--path default`` (issue 4; the graph API, no switch): ``uncapped`` is PyTorch's default,
  ``capped`` the shim with the limit only (no plan: what a workspace limit alone costs on this
  path), then ``passthrough`` and ``shim`` as above. ``--dtype fp16|bf16`` runs the model under
  autocast in channels-last memory format (channels_last_3d for 3-D models).

The worker's network, data and loss come from benchmarks/models.py (``--model`` any of its table,
e.g. ``unet3d`` or ``deeplabv3_resnet50``, or a torchvision classification or video model);
``worker_outcome`` reads what any worker run ended with (ok, out of memory, failed).

Timing runs use PyTorch's defaults (TF32 allowed in cuDNN); gradient checks turn TF32 off and compare
loss and every parameter gradient with and without the shim (relative L2 error per tensor), with
torch.backends.cudnn.benchmark off and on, and read the shim's log to count plans that really split
the batch.

``--double-check`` adds an exactness check in float64: the issue's criterion (every parameter
gradient with the shim within 1e-4 relative L2 error of the one without it) cannot hold in fp32,
where a change of algorithm alone moves BatchNorm gradients by 1e-2. In float64, rounding is near
1e-16, so with and without a plan tuned at a small limit (``--double-limit``, so that batches
really split) the gradients must agree far below 1e-4 unless the micro-batching itself (slices,
alpha/beta, order of pieces) is wrong: this check fails only on a real bug.

    python -m benchmarks.shim_pytorch driver --models resnet50 vgg16 alexnet --out DIR
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()
MU = [sys.executable, "-m", "mucudnn"]


class _Skipped(Exception):
    pass


# -- worker: runs inside the measured process ----------------------------------------------------

def worker(args) -> None:
    print(json.dumps(worker_result(args)))


def worker_result(args) -> dict:
    """What one worker run measured (the line ``worker`` prints): the timing result, the gradient
    run's loss, or ``{"oom": True, "error": ...}`` where memory ran out. ``args``: the worker's
    options (add_worker_arguments)."""
    import torch

    if str(HERE.parents[1]) not in sys.path:  # run as a script: the checkout's benchmarks package
        sys.path.insert(0, str(HERE.parents[1]))
    torch.backends.cudnn.benchmark = args.cudnn_benchmark
    torch.backends.cudnn.allow_tf32 = args.tf32
    torch.backends.cuda.matmul.allow_tf32 = args.tf32
    torch.manual_seed(0)
    if args.memory_cap_gib:  # a smaller GPU, emulated: the caching allocator's own limit
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.memory_cap_gib * 2**30 / total))
    where = {"phase": "set-up"}   # where memory ran out, if it does: set-up, a step, or after
    try:
        return _worker_steps(args, torch, where)
    except (torch.cuda.OutOfMemoryError, RuntimeError) as exc:  # a too small cap is a result
        if not out_of_memory(torch, exc):
            raise
        return {"oom": True, "error": str(exc).splitlines()[0][:300], "oom_at": where["phase"]}


def out_of_memory(torch, exc: BaseException) -> bool:
    return isinstance(exc, torch.cuda.OutOfMemoryError) or is_out_of_memory(str(exc))


# What PyTorch, cuDNN and cuBLAS say when memory runs out. PyTorch's cuDNN path tries engines in
# turn when one's workspace cannot be allocated and reports "unable to find an engine" when none
# could: under a memory cap, that is running out of memory too.
OOM_MARKERS = ("OutOfMemoryError", "out of memory", "CUBLAS_STATUS_ALLOC_FAILED",
               "CUDNN_STATUS_ALLOC_FAILED", "unable to find an engine")


def is_out_of_memory(text: str) -> bool:
    return any(marker.lower() in text.lower() for marker in OOM_MARKERS)


def _worker_steps(args, torch, where: dict) -> dict:
    from benchmarks.models import prepare
    training = prepare(args.model, args.batch, dtype=args.dtype, double=args.double,
                       generator=torch.Generator().manual_seed(1))
    model = training.model
    if args.grads:
        # no dropout: its masks differ between float32 and float64 runs, which would make the
        # float64 comparison meaningless (float32 runs with and without the shim share masks)
        for module in model.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0
        # the same forward and backward --grad-repeats times, the last one kept: the shim runs a
        # kernel's pieces one by one on its first call and as a CUDA graph from the second on
        for _ in range(args.grad_repeats):
            model.zero_grad(set_to_none=True)
            loss = training.forward_loss()
            loss.backward()
        grads = {name: p.grad.detach().cpu() for name, p in model.named_parameters()}
        torch.save({"loss": loss.item(), "grads": grads}, args.grads)
        return {"loss": loss.item()}
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    forward_end: list = []   # the last step's forward end: (host clock, device event)

    def step():
        step_loss = training.forward_loss()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        forward_end[:] = [(time.perf_counter(), event)]
        step_loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return step_loss

    if os.environ.get(ENV_NO_TRIAL) == "1":   # the plan made runs, whatever the trial says
        session = offload_session()
        if session is not None:
            session.trials = False
    # the caching allocator's flushes in each step, warm-up included (an offload plan's trial
    # is in the warm-up): when flushes start, and whether they stop; the timed steps' at a cap
    # host_times: from a step's start until the host has queued it (its Python, the session's
    # hooks, any wait of the host's): close to the step's time where the host bounds the step
    # frees_per_step: the blocks the allocator gave back to the device (freed or unmapped, each
    # waiting for the stream), with or without a retry
    # forward_*: the timed steps' forward alone, on the host and on the device: a forward whose
    # host time reaches its device time keeps the device waiting for the host
    # host_cpu: the main thread's CPU time while it queued each step (less than its host time
    # where it waited, on the device or a lock); gc: the collector's time in each step
    times, warm_times, host_times, retries_per_step, frees_per_step = [], [], [], [], []
    forward_host, forward_device, host_cpu, gc_times, allocs_per_step = [], [], [], [], []
    seen = allocator_counters(torch)
    collecting = [0.0, 0.0]   # the running collection's start, the step's total (s)

    def collector(phase, info):
        if phase == "start":
            collecting[0] = time.perf_counter()
        else:
            collecting[1] += time.perf_counter() - collecting[0]
    gc.callbacks.append(collector)
    try:
        for i in range(args.warmup + args.steps):
            where["phase"] = (f"warm-up step {i + 1}" if i < args.warmup
                              else f"timed step {i + 1 - args.warmup}")
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            queued = time.perf_counter()
            collecting[1] = 0.0
            cpu = time.thread_time()
            start.record()
            loss = step()
            end.record()
            host_times.append((time.perf_counter() - queued) * 1e3)
            host_cpu.append((time.thread_time() - cpu) * 1e3)
            gc_times.append(collecting[1] * 1e3)
            end.synchronize()
            (times if i >= args.warmup else warm_times).append(start.elapsed_time(end))
            if i >= args.warmup:
                forward_host.append((forward_end[0][0] - queued) * 1e3)
                forward_device.append(start.elapsed_time(forward_end[0][1]))
            counters = allocator_counters(torch)
            retries_per_step.append(counters["num_alloc_retries"] - seen["num_alloc_retries"])
            frees_per_step.append(counters["num_device_free"] - seen["num_device_free"])
            allocs_per_step.append(counters["num_device_alloc"] - seen["num_device_alloc"])
            seen = counters
    finally:
        gc.callbacks.remove(collector)
    fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)  # newer PyTorch only
    result = {"step_ms": statistics.median(times), "steps": len(times),
              "step_ms_all": times, "warmup_ms_all": warm_times, "host_ms_all": host_times,
              "forward_host_ms_all": forward_host, "forward_ms_all": forward_device,
              "host_cpu_ms_all": host_cpu, "gc_ms_all": gc_times,
              "peak_bytes": torch.cuda.max_memory_allocated(),
              "peak_reserved_bytes": torch.cuda.max_memory_reserved(), "loss": loss.item(),
              "alloc_retries": sum(retries_per_step[args.warmup:]),
              "alloc_retries_per_step": retries_per_step,
              "device_frees_per_step": frees_per_step, "device_allocs_per_step": allocs_per_step,
              "memory_fraction": fraction(0) if fraction else None,
              "device": torch.cuda.get_device_name(0), "batch": args.batch,
              "segments": segment_summary(torch.cuda.memory_snapshot())}
    # after the timed steps, so neither touches the timing; memory running out there (one more
    # step) leaves the timed result standing and says so in place of the extra
    extras = []
    if args.memory_trace:  # recording allocations slows the host
        extras.append(("memory_trace", lambda: memory_trace_step(step)))
    if args.profile:
        extras.append(("host_profile", lambda: host_profile_steps(step, args.profile)))
        extras.append(("profile", lambda: profile_steps(step, args.profile)))
    add_extras(torch, result, extras)
    return result


def add_extras(torch, result: dict, extras: list) -> None:
    """``result[name] = run()`` for each ``(name, run)`` of ``extras``, in turn; one that runs out
    of memory gives ``{"oom": message}`` instead, and the next still runs."""
    for name, extra in extras:
        try:
            result[name] = extra()
        except (torch.cuda.OutOfMemoryError, RuntimeError) as exc:
            if not out_of_memory(torch, exc):
                raise
            result[name] = {"oom": str(exc).splitlines()[0][:300]}


#: the caching allocator's counters of what costs a step time at a memory cap: flushes (free every
#: cached block after synchronising, then allocate again), device allocations and frees
ALLOCATOR_COUNTERS = ("num_alloc_retries", "num_sync_all_streams", "num_device_alloc",
                      "num_device_free")


def allocator_counters(torch, device=None) -> dict:
    """:data:`ALLOCATOR_COUNTERS` of ``device`` (the current one by default), 0 where absent."""
    stats = torch.cuda.memory_stats(device)
    return {name: stats.get(name, 0) for name in ALLOCATOR_COUNTERS}


def segment_summary(snapshot: list[dict]) -> list[dict]:
    """The caching allocator's segments after the timed steps (``torch.cuda.memory_snapshot()``):
    per segment its stream, pool, bytes mapped and allocated, and its free blocks (count, largest).
    With expandable segments one segment shows as one entry per contiguous mapped range."""
    summary = []
    for segment in snapshot:
        free = [b["size"] for b in segment.get("blocks", []) if b.get("state") == "inactive"]
        summary.append({"stream": segment.get("stream"), "pool": segment.get("segment_type"),
                        "total": segment.get("total_size"),
                        "allocated": segment.get("allocated_size"),
                        "free_blocks": len(free), "largest_free": max(free, default=0)})
    return summary


#: ``SHIM_PYTORCH_MEMORY_HISTORY=DIR``: the memory trace's step is also written whole to
#: ``DIR/history-<pid>.json`` (:func:`write_history`), with the offload session's points marked
#: in it, for analysing the caching allocator's layout off the GPU
ENV_HISTORY = "SHIM_PYTORCH_MEMORY_HISTORY"
#: ``SHIM_PYTORCH_NO_OFFLOAD_TRIAL=1``: the offload session runs the plan it made, with no trial
#: of others (to study one plan's layout)
ENV_NO_TRIAL = "SHIM_PYTORCH_NO_OFFLOAD_TRIAL"
#: a marker's size in the trace: ``MARK_BASE + 512 * point`` bytes (the small pool: below 1 MiB,
#: so the large pool's layout is untouched); backward points from 0, forward points (groups)
#: from :data:`MARK_FORWARD`
MARK_BASE, MARK_FORWARD = 512 * 1024, 512


def offload_session():
    """The process's mucudnn.torch session (``mucudnn run --offload``), or None."""
    import gc
    return next((o for o in gc.get_objects() if type(o).__name__ == "OffloadSession"), None)


def memory_trace_step(step) -> dict:
    """One training step under the caching allocator's history
    (``torch.cuda.memory._record_memory_history``), summarised by :func:`memory_trace_summary`
    (and written whole under :data:`ENV_HISTORY`)."""
    import torch

    torch.cuda.synchronize()
    stats = torch.cuda.memory_stats()
    start = {"allocated": stats.get("allocated_bytes.all.current", 0),
             "mapped": stats.get("reserved_bytes.all.current", 0)}
    history = os.environ.get(ENV_HISTORY)
    session = offload_session() if history else None   # written only for an offload session
    before = torch.cuda.memory._snapshot()["segments"] if session is not None else None
    marked = _mark_points(torch, session) if session is not None else None
    torch.cuda.memory._record_memory_history(max_entries=1_000_000, context="alloc",
                                             stacks="python")
    try:
        step()
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
        if marked is not None:
            session._event = marked
    device = torch.cuda.current_device()
    traces = snapshot.get("device_traces") or [[]]
    trace = traces[device] if device < len(traces) else []
    if session is not None:
        write_history(Path(history), before, trace, start, session)
    return memory_trace_summary(trace, **start)


def _mark_points(torch, session):
    """Has ``session`` allocate and free a marker (:data:`MARK_BASE`) at every pack of a new
    group and every unpack; returns its own ``_event`` to put back."""
    own = session._event

    def event(*what):
        own(*what)
        if what[0] in ("pack", "unpack"):
            point = what[1] + MARK_FORWARD if what[0] == "pack" else what[2]
            torch.empty(MARK_BASE + 512 * point, dtype=torch.uint8, device="cuda")
    session._event = event
    return own


def write_history(directory: Path, segments, trace: list[dict], start: dict, session) -> None:
    """The step's allocator history as JSON: the segments and blocks before it, every trace
    entry (action, address, size, stream, Python frames outside torch), the levels it started
    at, and the session's plan (modes, target) where there is one."""
    keep = ("address", "total_size", "stream", "segment_type", "allocated_size")
    plan = getattr(session, "plan", None)
    document = {
        "start": start,
        "segments": [{**{k: s.get(k) for k in keep},
                      "blocks": [{"size": b.get("size"), "state": b.get("state")}
                                 for b in s.get("blocks", [])]} for s in segments],
        "trace": [{"action": e.get("action"), "addr": e.get("addr", 0), "size": e.get("size", 0),
                   "stream": e.get("stream", 0), "where": _frame_names(e.get("frames", []), 4)}
                  for e in trace],
        "plan": None if plan is None else {"modes": list(plan.modes), "target": plan.target,
                                           "describe": plan.describe()},
        "kept_after_trial": getattr(session, "kept_after_trial", None),
    }
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"history-{os.getpid()}.json").write_text(json.dumps(document))


#: trace actions that map (+) or unmap (-) device memory: whole segments, or the ranges of an
#: expandable segment
_MAPS = {"segment_alloc": 1, "segment_map": 1, "segment_free": -1, "segment_unmap": -1}


def memory_trace_summary(trace: list[dict], allocated: int = 0, mapped: int = 0) -> dict:
    """What the allocator held at the step's most mapped moment (None where it mapped nothing
    beyond its levels at the start), from its trace (a device's ``device_traces`` entry:
    ``action``, ``addr``, ``size``, ``frames``) and its levels when the trace began
    (``allocated``, ``mapped``: reserved): bytes allocated, bytes freed but not yet
    reusable (``free_requested`` without its ``free_completed``: a block with stream uses,
    ``record_stream``, waits for their events), and the rest, cached free blocks; the counts of
    mappings (growth) and unmappings (a flush frees cached blocks), per growth the request
    that caused it, and per run of unmappings (a flush; the first 16) the levels before it, the
    bytes unmapped and the request that followed (``failed``: it ran out of memory even so).
    Blocks freed before the trace and completed in it are ignored (their requests are not in
    it)."""
    pending = 0
    waiting: dict[int, int] = {}       # addr -> size of a free requested, not completed

    def level() -> dict:
        return {"mapped": mapped, "allocated": allocated, "pending": pending,
                "cached_free": mapped - allocated - pending}

    peak, most_mapped = None, mapped    # None: the step mapped nothing beyond what it began with
    most_pending = 0
    growths, unmaps, ooms = [], 0, 0
    flushes: list[dict] = []            # per run of unmappings: its levels, the request after it
    flush = None                        # the last run, until a request (or an oom) follows it
    last_map = None
    for entry in trace:
        action, size, addr = entry.get("action"), entry.get("size", 0), entry.get("addr", 0)
        if action == "alloc":
            allocated += size
            if last_map is not None:     # the request the mapping just before it served
                growths.append({**last_map, "request": size,
                                "where": _frame_names(entry.get("frames", []))})
                last_map = None
            if flush is not None:        # the request the unmapping made room for
                flush.update(request=size, where=_frame_names(entry.get("frames", [])))
                flush = None
        elif action == "free_requested":
            allocated -= size
            waiting[addr] = size
            pending += size
        elif action == "free_completed":
            pending -= waiting.pop(addr, 0)
        elif action in _MAPS:
            before = level()
            mapped += _MAPS[action] * size
            if _MAPS[action] > 0:
                last_map = {"grown": size, **level()}
            else:
                unmaps += 1
                if flush is None:
                    flush = {"unmapped": 0, **before}
                    flushes.append(flush)
                flush["unmapped"] += size
        elif action == "oom":
            ooms += 1
            if flush is not None:        # the request failed even after the unmapping
                flush.update(request=size, failed=True,
                             where=_frame_names(entry.get("frames", [])))
                flush = None
        most_pending = max(most_pending, pending)
        if mapped > most_mapped:
            peak, most_mapped = level(), mapped
    return {"entries": len(trace), "at_most_mapped": peak, "most_pending": most_pending,
            "growths": len(growths), "grown_bytes": sum(g["grown"] for g in growths),
            "largest_growths": sorted(growths, key=lambda g: -g["grown"])[:8],
            "unmaps": unmaps, "ooms": ooms, "flushes": flushes[:16]}


def _frame_names(frames: list[dict], keep: int = 3) -> list[str]:
    """The innermost ``keep`` Python frames of a trace entry outside PyTorch's own package, as
    ``file:line function``: where in the model or in mucudnn the allocation came from."""
    def outside(name: str) -> bool:
        return bool(name) and not name.startswith("??") and "-packages/torch/" not in name
    return [f"{Path(f['filename']).name}:{f.get('line', 0)} {f.get('name', '?')}"
            for f in frames if outside(str(f.get("filename", "")))][:keep]


def host_profile_steps(step, steps: int, top: int = 30) -> list:
    """The host's Python in ``steps`` training steps (cProfile, the calling thread: the forward,
    the optimizer, not autograd's own threads): the ``top`` functions by their own time, each
    ``[function, calls, own ms, cumulative ms]`` per step."""
    import cProfile
    import pstats

    import torch

    torch.cuda.synchronize()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        step()
    profiler.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(profiler).stats
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    return [[f"{Path(file).name}:{line} {name}", calls / steps, own * 1e3 / steps,
             cumulative * 1e3 / steps]
            for (file, line, name), (_, calls, own, cumulative, _) in rows]


def union_length(intervals) -> float:
    """The length covered by ``intervals`` ((start, stop, ...) tuples): where at least one ran,
    overlaps counted once (a device busy with kernels and copies on several streams)."""
    covered, reach = 0.0, None
    for start, stop, *_ in sorted(intervals):
        if reach is None or start > reach:
            covered += stop - start
            reach = stop
        elif stop > reach:
            covered += stop - reach
            reach = stop
    return covered


def profile_steps(step, steps: int) -> dict:
    """GPU activity of ``steps`` training steps (torch.profiler, CUPTI): per step, the span from
    the first GPU activity to the last, the time some kernel, copy or fill ran (busy), the rest
    (idle: the GPU waited for the host), the kernels' total times by name, and
    :func:`trace_summary` of them all (the compute stream apart from the copy streams)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    # the host too (its ops and Python frames): who waited on the device, and what the device
    # waited for (host_waits)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                 with_stack=True) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text())["traceEvents"]
    gpu = sorted((e["ts"], e["ts"] + e.get("dur", 0), e["name"]) for e in events
                 if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))
    busy = union_length(gpu)   # µs
    span = gpu[-1][1] - gpu[0][0] if gpu else 0.0
    by_name: dict[str, list] = {}
    for start, stop, name in gpu:
        entry = by_name.setdefault(name[:120], [0, 0.0])
        entry[0] += 1
        entry[1] += (stop - start) / 1000 / steps
    top = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:60]
    # where the GPU waited: each gap over 5 µs, by the activity after it
    gaps: dict[str, list] = {}
    latest = None
    for start, stop, name in gpu:
        if latest is not None and start - latest > 5:
            entry = gaps.setdefault(name[:90], [0, 0.0])
            entry[0] += 1
            entry[1] += (start - latest) / 1000 / steps
        latest = stop if latest is None else max(latest, stop)
    # host calls into the CUDA runtime and driver: a synchronising one stalls the queue
    host: dict[str, list] = {}
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in ("cuda_runtime", "cuda_driver"):
            entry = host.setdefault(e["name"], [0, 0.0])
            entry[0] += 1
            entry[1] += e.get("dur", 0) / 1000 / steps
    return {"steps": steps, "span_ms": span / 1000 / steps, "busy_ms": busy / 1000 / steps,
            # per stream, over all ``steps``: the compute stream's busy time and what it waited for
            "trace": trace_summary({"traceEvents": events}, top=12),
            "idle_ms": (span - busy) / 1000 / steps, "activities": len(gpu) // steps,
            "kernels_ms": {name: {"calls": c // steps, "ms": ms} for name, (c, ms) in top},
            "gaps_before": {name: {"gaps": c // steps, "ms": ms} for name, (c, ms)
                            in sorted(gaps.items(), key=lambda kv: -kv[1][1])[:25]},
            "host_calls": {name: {"calls": c // steps, "ms": ms} for name, (c, ms)
                           in sorted(host.items(), key=lambda kv: -kv[1][1])},
            "host_waits": host_waits(events, steps)}


#: the CUDA calls that block the host until the device catches up: after one, the device idles
#: while the host queues the next work
SYNCHRONIZING_CALLS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize",
                       "cuStreamSynchronize", "cuEventSynchronize", "cuCtxSynchronize")


def host_waits(events: list, steps: int = 1, keep: int = 4) -> dict:
    """Where the host waited for the device, from a profiler's Chrome trace events recorded with
    the CPU activity and Python stacks: each synchronising call (:data:`SYNCHRONIZING_CALLS`)
    by the host context it ran in (the innermost ``keep`` operators and Python frames around it,
    on its thread), with its count and ms per step; and the compute stream's largest gaps, each
    with the host context of the launch that ended it (what the host was queueing while the
    device waited)."""
    spans: dict = {}    # (pid, tid) -> [(start, end, name)] of operators and Python frames
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "python_function"):
            start = float(e["ts"])
            spans.setdefault((e.get("pid"), e.get("tid")), []).append(
                (start, start + float(e.get("dur", 0)), str(e.get("name", ""))[:100]))

    def context(event) -> tuple:
        at = float(event["ts"])
        around = sorted((s for s in spans.get((event.get("pid"), event.get("tid")), ())
                         if s[0] <= at <= s[1]), key=lambda s: s[0])
        return tuple(name for _, _, name in around[-keep:])

    waits: dict = {}
    launches: dict = {}   # correlation id -> its runtime call
    for e in events:
        if e.get("ph") != "X" or e.get("cat") not in ("cuda_runtime", "cuda_driver"):
            continue
        correlation = (e.get("args") or {}).get("correlation")
        if correlation is not None:
            launches[correlation] = e
        if e.get("name") in SYNCHRONIZING_CALLS:
            entry = waits.setdefault((e["name"],) + context(e), [0, 0.0])
            entry[0] += 1
            entry[1] += float(e.get("dur", 0)) / 1e3
    streams = device_streams(events)
    gaps = []
    if streams:
        latest = None
        for start, end, _, name, e in sorted(streams[compute_stream(streams)],
                                             key=lambda span: span[:4]):
            if latest is not None and start - latest > 50:
                launch = launches.get((e.get("args") or {}).get("correlation"))
                gaps.append((start - latest, name[:80],
                             context(launch) if launch is not None else ()))
            latest = end if latest is None else max(latest, end)
    gaps.sort(key=lambda g: -g[0])
    return {
        "syncs": [{"call": key[0], "calls_per_step": count / steps, "ms_per_step": ms / steps,
                   "context": list(key[1:])}
                  for key, (count, ms) in sorted(waits.items(), key=lambda kv: -kv[1][1])],
        "largest_gaps": [{"ms": round(gap / 1e3, 3), "before": name, "launched_in": list(where)}
                         for gap, name, where in gaps[:12]]}


def device_streams(events: list) -> dict:
    """Per CUDA stream, its kernels, copies and fills among a profiler's Chrome trace events, as
    ``(start µs, end µs, category, name, event)`` in the trace's order."""
    streams: dict = {}
    for event in events:
        if event.get("ph") == "X" and event.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            stream = (event.get("args") or {}).get("stream", event.get("tid"))
            start = float(event["ts"])
            streams.setdefault(stream, []).append((start, start + float(event.get("dur", 0)),
                                                   event["cat"], event.get("name", ""), event))
    return streams


def compute_stream(streams: dict):
    """The stream of :func:`device_streams` whose kernels ran longest (the others copy)."""
    return max(streams, key=lambda stream: sum(
        end - start for start, end, category, *_ in streams[stream] if category == "kernel"))


def trace_summary(trace: dict, top: int = 8) -> dict:
    """Where a step's time went, from a profiler's Chrome trace (``export_chrome_trace``): per
    CUDA stream its busy ms (kernels, copies, memsets; overlaps merged) and, for the busiest
    (the compute stream), its idle gaps; the CUDA runtime calls that took the host's time (a
    host waiting on the device shows as ``cudaEventSynchronize`` and its kin)."""
    streams = {stream: [span[:4] for span in spans]
               for stream, spans in device_streams(trace.get("traceEvents", [])).items()}
    if not streams:
        return {}
    begin = min(span[0] for spans in streams.values() for span in spans)
    end = max(span[1] for spans in streams.values() for span in spans)

    def merged(spans):
        out = []
        for start, stop, _, name in sorted(spans):
            if out and start <= out[-1][1]:
                out[-1][1] = max(out[-1][1], stop)
            else:
                out.append([start, stop, name])
        return out

    busy = {stream: merged(spans) for stream, spans in streams.items()}
    compute = compute_stream(streams)
    intervals = busy[compute]
    gaps = sorted(((b[0] - a[1]) / 1e3, (a[1] - begin) / 1e3, b[2])
                  for a, b in zip(intervals, intervals[1:]))
    runtime: dict = {}
    for event in trace["traceEvents"]:
        if event.get("ph") == "X" and event.get("cat") == "cuda_runtime":
            total, count = runtime.get(event["name"], (0.0, 0))
            runtime[event["name"]] = (total + float(event["dur"]) / 1e3, count + 1)
    return {
        "span_ms": round((end - begin) / 1e3, 3),
        "streams": {str(stream): {"busy_ms": round(sum(b - a for a, b, _ in spans) / 1e3, 3),
                                  "events": len(streams[stream]),
                                  "kinds": sorted({span[2] for span in streams[stream]})}
                    for stream, spans in busy.items()},
        "compute_stream": str(compute),
        "compute_idle_ms": round(sum(g for g, _, _ in gaps), 3),
        "compute_gaps_over_50us": sum(1 for g, _, _ in gaps if g > 0.05),
        # each with the activity that ended it: what the compute stream waited to run
        "largest_gaps_ms_at_ms": [[round(g, 3), round(at, 3), name[:80]]
                                  for g, at, name in gaps[::-1][:top]],
        "runtime_calls_ms": {name: [round(total, 3), count] for name, (total, count) in
                             sorted(runtime.items(), key=lambda kv: -kv[1][0])[:top]},
        # the compute stream's work by kernel (name cut to 60 characters): ms and count, the
        # largest 2 * top (what a plan adds to PyTorch's step shows against PyTorch's)
        "compute_kernels_ms": {name: [round(total / 1e3, 3), count] for name, (total, count) in
                               sorted(by_name(streams[compute]).items(),
                                      key=lambda kv: -kv[1][0])[:2 * top]},
    }


def by_name(spans: list) -> dict:
    """Spans ``(start, end, category, name)`` summed by name (its first 60 characters):
    name -> (total µs, count)."""
    totals: dict = {}
    for start, stop, _, name in spans:
        total, count = totals.get(name[:60], (0.0, 0))
        totals[name[:60]] = (total + stop - start, count + 1)
    return totals


# -- driver ----------------------------------------------------------------------------------------

def worker_command(model: str, env_extra: dict, *, tf32: bool, shim: bool, steps=15, warmup=5,
                   grads: str | None = None, cudnn_benchmark=False, record=None, plan=None,
                   limit=None, log=None, batch=256, double=False, path="legacy",
                   dtype="fp32", profile=0, memory_cap_gib=0.0,
                   online=False, memory_budget: int | None = None,
                   offload=False, memory_trace=False) -> tuple[list[str], dict]:
    """The command and environment of one worker run: plain PyTorch, or under `mucudnn run`
    (``--plan`` and ``--workspace-limit`` if given) or `mucudnn record` (``record``). Without a
    plan, `mucudnn run` tunes online only with ``online`` (else the shim passes through).
    ``memory_budget`` (bytes): `mucudnn run --memory-budget`, and with ``offload`` its
    ``--offload`` (mucudnn.torch's activation offload, docs/torch.md), which needs a budget."""
    if offload and not (shim and memory_budget and not record):
        raise ValueError("offload needs `mucudnn run` (shim, no record) with a memory budget")
    cmd = [sys.executable, str(HERE), "worker", "--model", model, "--batch", str(batch),
           "--steps", str(steps), "--warmup", str(warmup), "--dtype", dtype,
           "--profile", str(profile), "--memory-cap-gib", str(memory_cap_gib)]
    cmd += ["--tf32"] if tf32 else []
    cmd += ["--cudnn-benchmark"] if cudnn_benchmark else []
    cmd += ["--grads", grads] if grads else []
    cmd += ["--double"] if double else []
    cmd += ["--memory-trace"] if memory_trace else []
    env = dict(os.environ, **env_extra)
    env.pop("TORCH_CUDNN_V8_API_DISABLED", None)
    if path == "legacy":
        env["TORCH_CUDNN_V8_API_DISABLED"] = "1"
    if shim:
        sub = ["record", "-o", record] if record else ["run"]
        if plan:
            sub += ["--plan", plan]
        elif not record and not online:
            sub += ["--no-online"]
        if limit:
            sub += ["--workspace-limit", limit]
        if memory_budget:
            sub += ["--memory-budget", str(memory_budget)] + (["--offload"] if offload else [])
        if log:
            env.update(MUCUDNN_LOG_LEVEL="info", MUCUDNN_LOG_FILE=log)
        cmd = MU + sub + ["--"] + cmd
    return cmd, env


def run_worker(model: str, env_extra: dict, **kwargs) -> dict:
    """One worker run (see worker_command); raises RuntimeError if it fails."""
    cmd, env = worker_command(model, env_extra, **kwargs)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["wall_s"] = time.perf_counter() - t0
    result["stderr_tail"] = proc.stderr[-500:]
    return result


def worker_outcome(returncode: int, stdout: str, stderr: str) -> dict:
    """What a worker run ended with, whatever it was: ``status`` "ok" (with the worker's result),
    "oom" (the worker caught it, or the run died of it elsewhere: cuDNN, cuBLAS, the shim), or
    "failed" (with the end of stderr)."""
    for line in reversed(stdout.strip().splitlines()):
        try:
            result = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(result, dict) and result.get("oom"):
            return {"status": "oom", "error": result.get("error"),
                    **({"oom_at": result["oom_at"]} if result.get("oom_at") else {})}
        if isinstance(result, dict) and "step_ms" in result and returncode == 0:
            return {"status": "ok", **result}
        break
    if is_out_of_memory(stderr):
        return {"status": "oom", "error": next((line for line in reversed(stderr.splitlines())
                                                if is_out_of_memory(line)), "")[:300]}
    return {"status": "failed", "returncode": returncode, "stderr_tail": stderr[-1500:]}


def rel(a, b) -> float:
    """Relative L2 error of tensor ``a`` against the reference ``b``, computed in float64."""
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-300))


def pair_errors(ref: dict, got: dict) -> dict:
    """Loss and per-tensor gradient errors of one loaded gradient file against a reference one."""
    per_tensor = {name: rel(got["grads"][name], g) for name, g in ref["grads"].items()}
    worst = max(per_tensor, key=per_tensor.get)
    return {"loss_rel_err": abs(got["loss"] - ref["loss"]) / abs(ref["loss"]),
            "tensors": len(per_tensor), "worst_grad": worst,
            "worst_grad_rel_err": per_tensor[worst], "per_tensor": per_tensor}


def compare_pair(ref_path: str, got_path: str) -> dict:
    """pair_errors of two gradient files the worker wrote."""
    import torch
    return pair_errors(torch.load(ref_path), torch.load(got_path))


def compare_grads(ref_path: str, shim_path: str, f64_path: str) -> dict:
    """Per-tensor relative L2 errors: shim vs no shim, and each of them vs the float64 run."""
    import torch
    ref, shim, f64 = (torch.load(p) for p in (ref_path, shim_path, f64_path))
    between = pair_errors(ref, shim)
    no_shim_vs_f64 = pair_errors(f64, ref)["per_tensor"]
    shim_vs_f64 = pair_errors(f64, shim)["per_tensor"]
    rows = [{"tensor": name, "between": err, "no_shim_vs_f64": no_shim_vs_f64[name],
             "shim_vs_f64": shim_vs_f64[name]} for name, err in between["per_tensor"].items()]
    # "as accurate": the shim's error against float64 is within 2x of PyTorch's own (plus 1e-6)
    less_accurate = [r for r in rows if r["shim_vs_f64"] > 2 * r["no_shim_vs_f64"] + 1e-6]
    return {"loss_rel_err": between["loss_rel_err"], "tensors": between["tensors"],
            "worst_grad": between["worst_grad"],
            "worst_grad_rel_err": between["worst_grad_rel_err"],
            "worst_no_shim_vs_f64": max(r["no_shim_vs_f64"] for r in rows),
            "worst_shim_vs_f64": max(r["shim_vs_f64"] for r in rows),
            "tensors_between_below_1e-4": sum(r["between"] < 1e-4 for r in rows),
            "tensors_less_accurate_than_pytorch": [r["tensor"] for r in less_accurate],
            "per_tensor": rows}


def graph_plans(log_path: str) -> int:
    """Graph-API execution plans the shim attached a micro-batch plan to (debug log lines)."""
    try:
        return Path(log_path).read_text().count("runs the micro-batch plan")
    except OSError:
        return 0


def split_kernels(log_path: str) -> int:
    """Kernels whose first execution ran a plan of more than one piece (from the shim's log)."""
    try:
        text = Path(log_path).read_text()
    except OSError:
        return 0
    return sum(1 for m in re.finditer(r": plan, (\d+) pieces", text) if int(m.group(1)) > 1)


def prepare_plan(model: str, out: Path, tf32: bool, limit: str, policy: str,
                 precise: bool = False, path: str = "legacy", dtype: str = "fp32",
                 bench_args: tuple[str, ...] = (), double: bool = False,
                 batch: int = 256, tune_args: tuple[str, ...] = ()) -> tuple[str, dict]:
    """Record ``model`` under the shim at ``batch``, benchmark what it ran, tune a WR plan."""
    # float64 kernels are other problems than fp32 ones: their files must not collide
    numerics = "f64" if double else dtype if dtype != "fp32" else "tf32" if tf32 else "fp32"
    tag = f"{model}-{path}-{numerics}"
    record = out / f"{tag}.record"
    record.unlink(missing_ok=True)
    run_worker(model, {}, tf32=tf32, shim=True, record=str(record), steps=1, warmup=1, path=path,
               dtype=dtype, double=double, batch=batch)
    t0 = time.perf_counter()
    fit = ["--workspace-limit", limit] if policy == "fit" else []  # fit measures what fits it
    bench = subprocess.run(MU + ["bench", "--recording", str(record), "--no-progress",
                                 "--policy", policy, *fit, *bench_args],
                           capture_output=True, text=True)
    bench_s = time.perf_counter() - t0
    if bench.returncode != 0:
        raise RuntimeError(f"bench failed: {bench.stderr[-2000:]}")
    flags = [*(["--precise"] if precise else []), *tune_args]
    suffix = "".join("-" + flag.lstrip("-") for flag in flags if flag.startswith("--"))
    plan = out / f"{tag}-{limit}-{policy}{suffix}.plan"
    tune = subprocess.run(MU + ["tune", "--recording", str(record), "--workspace-limit", limit,
                                "--policy", policy, "-o", str(plan), *flags],
                          capture_output=True, text=True)
    if tune.returncode != 0:
        raise RuntimeError(f"tune failed: {tune.stderr[-2000:]}")
    return str(plan), {"bench_s": bench_s, "bench": bench.stdout.strip(),
                       "tune": tune.stdout.strip()}


def driver(args) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"models": {}, "path": args.path, "dtype": args.dtype}
    paths = {"path": args.path, "dtype": args.dtype}

    def run_worker(*a, **k):  # every run of this driver on one path and data type
        return globals()["run_worker"](*a, **paths, **k)

    # no cuDNN cap on the default path: there the limit alone, through the shim, is the cap
    capped = ({"CUDNN_CONV_WSCAP_DBG": str(args.cap_mib)}, False, None) if args.path == "legacy" \
        else ({}, True, args.limit)
    bench_args = tuple(args.bench_args.split()) if args.bench_args else ()
    tune_args = tuple(args.tune_args.split())
    for model in args.models:
        r = report["models"][model] = {}
        try:
            if args.skip_timing:
                raise _Skipped("timing skipped (--skip-timing)")
            plan, info = prepare_plan(model, out, True, args.limit, args.policy, **paths,
                                      bench_args=bench_args, tune_args=tune_args)
            r["prepare_tf32"] = info
            timing = {
                "uncapped": run_worker(model, {}, tf32=True, shim=False),
                "capped": run_worker(model, capped[0], tf32=True, shim=capped[1], limit=capped[2]),
                "passthrough": run_worker(model, {}, tf32=True, shim=True),
                "shim": run_worker(model, {}, tf32=True, shim=True, plan=plan, limit=args.limit,
                                   log=str(out / f"{model}-tf32-shim.log")),
            }
            if args.path == "legacy":
                timing["uncapped_again"] = run_worker(model, {}, tf32=True, shim=False)
            # more rounds of (uncapped, shim), alternating: the spread of the ratio between runs
            # (with --graphs-check, also the shim with its CUDA graphs off)
            rounds = []
            for i in range(args.rounds):
                unc = timing["uncapped"] if i == 0 else run_worker(model, {}, tf32=True, shim=False)
                shim = timing["shim"] if i == 0 else run_worker(model, {}, tf32=True, shim=True,
                                                                plan=plan, limit=args.limit)
                row = {"uncapped_ms": unc["step_ms"], "shim_ms": shim["step_ms"],
                       "ratio": shim["step_ms"] / unc["step_ms"]}
                if args.graphs_check:
                    off = run_worker(model, {"MUCUDNN_CUDA_GRAPHS": "0"}, tf32=True, shim=True,
                                     plan=plan, limit=args.limit)["step_ms"]
                    row.update(shim_no_graphs_ms=off, ratio_no_graphs=off / unc["step_ms"])
                rounds.append(row)
            timing["rounds"] = rounds
            if args.graphs_check:
                r["graphs_check"] = graphs_check(model, plan, args, out, run_worker)
            if args.profile:  # where each spends its step: kernels, and the GPU waiting
                r["profile"] = {
                    "uncapped": run_worker(model, {}, tf32=True, shim=False, steps=3,
                                           profile=args.profile)["profile"],
                    "shim": run_worker(model, {}, tf32=True, shim=True, plan=plan, steps=3,
                                       limit=args.limit, profile=args.profile)["profile"]}
                print(f"[{model}] profile per step (ms): " + "  ".join(
                    f"{k}: span {v['span_ms']:.2f} busy {v['busy_ms']:.2f} idle {v['idle_ms']:.2f}"
                    f" ({v['activities']} GPU activities)" for k, v in r["profile"].items()),
                    flush=True)
            if args.path == "default":  # benchmark mode tries every engine: workspace peaks
                timing["uncapped_cudnn_benchmark"] = run_worker(model, {}, tf32=True, shim=False,
                                                                cudnn_benchmark=True)
                timing["shim_cudnn_benchmark"] = run_worker(model, {}, tf32=True, shim=True, plan=plan,
                                                            limit=args.limit, cudnn_benchmark=True)
            timing["shim"]["split_kernels"] = split_kernels(str(out / f"{model}-tf32-shim.log"))
            timing["shim"]["graph_plans"] = graph_plans(str(out / f"{model}-tf32-shim.log"))
            r["timing"] = timing
            (out / "shim_pytorch.json").write_text(json.dumps(report, indent=1))
            print(f"[{model}] " + "  ".join(f"{k}={v['step_ms']:.1f}ms/{v['peak_bytes'] / 2**30:.2f}GiB"
                                            f"/{v['peak_reserved_bytes'] / 2**30:.2f}GiB-reserved"
                                            for k, v in timing.items() if k != "rounds"), flush=True)
            for field in ("ratio", "ratio_no_graphs"):
                ratios = [row[field] for row in timing["rounds"] if field in row]
                if len(ratios) > 1 or (ratios and field != "ratio"):
                    print(f"[{model}] shim/uncapped by round ({field}): "
                          + " ".join(f"{ratio:.4f}" for ratio in ratios)
                          + f"  median {statistics.median(ratios):.4f}", flush=True)
        except _Skipped as exc:
            r["timing_error"] = str(exc)
        except Exception as exc:  # keep going: other models and the correctness part still run
            r["timing_error"] = str(exc)
            print(f"[{model}] timing failed: {exc}", flush=True)
        try:
            if args.skip_grads:  # not `continue`: the float64 check below runs regardless
                raise _Skipped("gradient checks skipped (--skip-grads)")
            plan32, info = prepare_plan(model, out, False, args.limit, args.policy, args.precise,
                                        **paths, bench_args=bench_args, tune_args=tune_args)
            r["prepare_fp32"] = info
            checks = {}
            scratch = Path(tempfile.mkdtemp())  # gradients are large: never under --out
            f64 = str(scratch / f"{model}-f64.pt")
            run_worker(model, {}, tf32=False, shim=False, grads=f64, batch=args.grad_batch,
                       double=True)
            for bench_mode in (False, True):
                name = "benchmark_on" if bench_mode else "benchmark_off"
                ref = str(scratch / f"{model}-{name}-ref.pt")
                got = str(scratch / f"{model}-{name}-shim.pt")
                log = str(out / f"{model}-{name}-shim.log")
                Path(log).unlink(missing_ok=True)
                run_worker(model, {}, tf32=False, shim=False, grads=ref, cudnn_benchmark=bench_mode,
                           batch=args.grad_batch)
                run_worker(model, {}, tf32=False, shim=True, grads=got, cudnn_benchmark=bench_mode,
                           plan=plan32, limit=args.limit, log=log, batch=args.grad_batch)
                checks[name] = {**compare_grads(ref, got, f64), "split_kernels": split_kernels(log)}
                for path in (ref, got):
                    Path(path).unlink(missing_ok=True)
            shutil.rmtree(scratch, ignore_errors=True)
            r["grads"] = checks
            (out / "shim_pytorch.json").write_text(json.dumps(report, indent=1))
            print(f"[{model}] grads " + json.dumps({k: {f: v for f, v in c.items() if f != "per_tensor"}
                                                    for k, c in checks.items()}), flush=True)
        except _Skipped as exc:
            r["grads_error"] = str(exc)
        except Exception as exc:
            r["grads_error"] = str(exc)
            print(f"[{model}] grads failed: {exc}", flush=True)
        if args.double_check:
            double_check(model, r, args, out, paths, bench_args, tune_args)
            (out / "shim_pytorch.json").write_text(json.dumps(report, indent=1))
    (out / "shim_pytorch.json").write_text(json.dumps(report, indent=1))
    print_table(report)
    return 0


def graphs_check(model: str, plan: str, args, out: Path, run_worker) -> dict:
    """Gradients with the plan's pieces as CUDA graphs (the default) and one by one
    (MUCUDNN_CUDA_GRAPHS=0): the same kernels in the same order, so they must be bitwise equal
    except where cuDNN itself is not deterministic, which a second run with graphs off shows."""
    import torch
    scratch = Path(tempfile.mkdtemp())
    try:
        files, logs = {}, {}
        for run, graphs in (("off", "0"), ("off_again", "0"), ("on", "1")):
            files[run] = str(scratch / f"{model}-graphs-{run}.pt")
            logs[run] = str(out / f"{model}-graphs-{run}-shim.log")
            Path(logs[run]).unlink(missing_ok=True)
            run_worker(model, {"MUCUDNN_CUDA_GRAPHS": graphs}, tf32=True, shim=True,
                       grads=files[run], plan=plan, limit=args.limit, log=logs[run])
        off, again, on = (torch.load(files[run]) for run in ("off", "off_again", "on"))

        def differing(a, b):
            return {name: rel(b["grads"][name], g) for name, g in a["grads"].items()
                    if not torch.equal(g, b["grads"][name])}

        unequal, control = differing(off, on), differing(off, again)
        result = {"tensors": len(off["grads"]), "tensors_not_bitwise_equal": unequal,
                  "not_bitwise_equal_between_two_runs_without_graphs": control,
                  "differing_only_with_graphs": sorted(set(unequal) - set(control)),
                  "loss_equal": off["loss"] == on["loss"],
                  "kernels_as_graphs": Path(logs["on"]).read_text().count("pieces run as one CUDA graph"),
                  "kernels_as_graphs_when_off": Path(logs["off"]).read_text().count(
                      "pieces run as one CUDA graph"),
                  "split_kernels": split_kernels(logs["on"])}
        print(f"[{model}] CUDA graphs on vs off: {len(unequal)}/{result['tensors']} gradient "
              f"tensors differ (largest rel. difference {max(unequal.values(), default=0):.1e}), "
              f"{len(control)} differ between two runs with graphs off, "
              f"{len(result['differing_only_with_graphs'])} only with graphs; loss equal "
              f"{result['loss_equal']}, {result['kernels_as_graphs']} kernels ran as graphs "
              f"({result['kernels_as_graphs_when_off']} with graphs off)", flush=True)
        return result
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def double_check(model: str, r: dict, args, out: Path, paths: dict,
                 bench_args: tuple[str, ...], tune_args: tuple[str, ...]) -> None:
    """Float64 gradients with and without a plan that splits batches must agree to rounding:
    stores r["double"] (or r["double_error"])."""
    scratch = Path(tempfile.mkdtemp())  # gradients are large: never under --out
    try:
        # few engines handle float64: legacy algorithms are enough, and cheaper to benchmark
        plan64, info = prepare_plan(model, out, False, args.double_limit, args.policy, **paths,
                                    bench_args=("--api", "legacy", *bench_args), double=True,
                                    batch=args.double_batch, tune_args=tune_args)
        r["prepare_f64"] = info
        ref, got = str(scratch / f"{model}-f64-ref.pt"), str(scratch / f"{model}-f64-shim.pt")
        log = str(out / f"{model}-f64-shim.log")
        Path(log).unlink(missing_ok=True)
        bench_mode = args.double_benchmark
        run_worker(model, {}, tf32=False, shim=False, grads=ref, batch=args.double_batch,
                   double=True, cudnn_benchmark=bench_mode, **paths)
        run_worker(model, {}, tf32=False, shim=True, grads=got, plan=plan64,
                   limit=args.double_limit, log=log, batch=args.double_batch, double=True,
                   cudnn_benchmark=bench_mode, **paths)
        errors = compare_pair(ref, got)
        r["double"] = {
            **{k: v for k, v in errors.items() if k != "per_tensor"},
            "tensors_at_or_above_1e-4": [n for n, e in errors["per_tensor"].items() if e >= 1e-4],
            "split_kernels": split_kernels(log), "limit": args.double_limit,
            "batch": args.double_batch, "cudnn_benchmark": bench_mode}
        d = r["double"]
        print(f"[{model}] float64 worst grad rel err {d['worst_grad_rel_err']:.2e} "
              f"({d['worst_grad']}), loss rel err {d['loss_rel_err']:.2e}, "
              f"{len(d['tensors_at_or_above_1e-4'])}/{d['tensors']} tensors >= 1e-4, "
              f"{d['split_kernels']} split kernels at {d['limit']}, batch {d['batch']}", flush=True)
    except Exception as exc:
        r["double_error"] = str(exc)
        print(f"[{model}] float64 check failed: {exc}", flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def print_table(report: dict) -> None:
    print("\nmodel      uncapped ms  capped ms  shim ms  shim/capped speedup  shim/uncapped  "
          "passthrough/uncapped  peak GiB uncapped/capped/shim  split kernels  worst grad err")
    for model, r in report["models"].items():
        t = r.get("timing")
        if not t:
            print(f"{model:10s} {r.get('timing_error', '')[:100]}")
            continue
        unc = min(t["uncapped"]["step_ms"], t.get("uncapped_again", t["uncapped"])["step_ms"])
        g = r.get("grads", {})
        worst = max((c["worst_grad_rel_err"] for c in g.values()), default=float("nan"))
        worse = sum(len(c["tensors_less_accurate_than_pytorch"]) for c in g.values())
        print(f"{model:10s} {unc:11.1f} {t['capped']['step_ms']:10.1f} {t['shim']['step_ms']:8.1f} "
              f"{t['capped']['step_ms'] / t['shim']['step_ms']:20.2f} "
              f"{t['shim']['step_ms'] / unc:14.3f} {t['passthrough']['step_ms'] / unc:21.3f}  "
              f"{t['uncapped']['peak_bytes'] / 2**30:8.2f}/{t['capped']['peak_bytes'] / 2**30:.2f}/"
              f"{t['shim']['peak_bytes'] / 2**30:.2f} {t['shim'].get('split_kernels', 0):14d}  "
              f"{worst:.2e} (tensors less accurate than PyTorch vs float64: {worse})")
    for model, r in report["models"].items():
        if "double" in r:
            d = r["double"]
            print(f"{model:10s} float64 at {d['limit']}, batch {d['batch']}: worst grad rel err "
                  f"{d['worst_grad_rel_err']:.2e}, {len(d['tensors_at_or_above_1e-4'])} tensors "
                  f">= 1e-4, {d['split_kernels']} split kernels")
        elif "double_error" in r:
            print(f"{model:10s} float64 check failed: {r['double_error'][:100]}")


def add_worker_arguments(w: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The worker's options (its defaults: what worker_result reads)."""
    w.add_argument("--model", required=True)
    w.add_argument("--batch", type=int, default=256)
    w.add_argument("--steps", type=int, default=15)
    w.add_argument("--warmup", type=int, default=5)
    w.add_argument("--tf32", action="store_true")
    w.add_argument("--cudnn-benchmark", action="store_true")
    w.add_argument("--grads")
    w.add_argument("--double", action="store_true", help="run in float64 (the reference)")
    w.add_argument("--dtype", choices=["fp32", "fp16", "bf16"], default="fp32")
    w.add_argument("--grad-repeats", type=int, default=3)
    w.add_argument("--memory-cap-gib", type=float, default=0.0,
                   help="torch.cuda.set_per_process_memory_fraction to this many GiB (0: none)")
    w.add_argument("--profile", type=int, default=0, metavar="STEPS",
                   help="after timing, profile this many steps on the host (cProfile) and "
                        "this many under torch.profiler (GPU busy and idle time, host waits)")
    w.add_argument("--memory-trace", action="store_true",
                   help="after timing, one step under the allocator's history: what it held "
                        "at its most mapped (allocated, freed but not reusable, cached)")
    return w


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="mode", required=True)
    add_worker_arguments(sub.add_parser("worker"))
    d = sub.add_parser("driver")
    d.add_argument("--models", nargs="+", default=["resnet50", "vgg16", "alexnet"])
    d.add_argument("--out", required=True)
    d.add_argument("--limit", default="64MiB")
    d.add_argument("--cap-mib", type=int, default=64)
    d.add_argument("--policy", default="powerOfTwo")
    d.add_argument("--grad-batch", type=int, default=256)
    d.add_argument("--skip-grads", action="store_true")
    d.add_argument("--path", choices=["legacy", "default"], default="legacy",
                   help="PyTorch's cuDNN path: legacy API, or the default graph API")
    d.add_argument("--dtype", choices=["fp32", "fp16", "bf16"], default="fp32")
    d.add_argument("--bench-args", default="", help="extra arguments of `mucudnn bench`")
    d.add_argument("--tune-args", default="",
                   help="extra arguments of `mucudnn tune` for every plan, e.g. --borrow-output")
    d.add_argument("--skip-timing", action="store_true")
    d.add_argument("--graphs-check", action="store_true",
                   help="gradients with the shim's CUDA graphs on and off must be bitwise equal")
    d.add_argument("--profile", type=int, default=0, metavar="STEPS",
                   help="also profile STEPS steps of uncapped and shim (GPU busy/idle, kernels)")
    d.add_argument("--rounds", type=int, default=1,
                   help="time uncapped and shim this many times each, alternating (the ratio's "
                        "spread between runs)")
    d.add_argument("--precise", action="store_true",
                   help="gradient checks with plans free of FFT/Winograd algorithms")
    d.add_argument("--double-check", action="store_true",
                   help="also compare float64 gradients with and without a plan that splits "
                        "batches (must agree to rounding)")
    d.add_argument("--double-limit", default="4MiB",
                   help="workspace limit of the float64 plan: small, so that batches split")
    d.add_argument("--double-batch", type=int, default=64,
                   help="batch of the float64 check (float64 steps are slow)")
    d.add_argument("--double-benchmark", action="store_true",
                   help="the float64 check with torch.backends.cudnn.benchmark = True")
    args = ap.parse_args()
    if args.mode == "worker":
        worker(args)
        return 0
    return driver(args)


if __name__ == "__main__":
    sys.exit(main())
