"""A training script as a new user writes it, for plan_timeline.py to run under ``mucudnn run
--memory-budget B --offload``: a network of benchmarks/models.py (any torchvision classification
model, the 3-D U-Net, ...), SGD, random data, fp32 with TF32, ``--steps`` steps. After each step
one line on stderr:

    train_steps: step I start_s=S end_s=E step_ms=M session=STATE

I counts from 1; S and E are seconds since this process started (Linux: its start time in
/proc/self/stat against /proc/uptime, 10 ms ticks; elsewhere since this module ran), M the step's
wall time with the device synchronised at both ends. With ``--sync-every K`` the device is waited
for only after every K-th step, as a loop that reads its loss every K steps runs (the host then
issues a step while the device still runs the one before): M is then the host's time for the
step, and after each K steps one more line gives their mean wall time a step:

    train_steps: steps A-B ms_per_step=M session=STATE

STATE is how the activation-offload session
that ``mucudnn run --offload`` installed (found once, after ``import torch``, among the live
objects: the site hook keeps no name for it) ran the step, read once the step is over (a session
decides a step's mode at its first module, where the step before it ends): the session's own
``state`` where it names one (``recording``, ``planning``, ``trial``, ``watching``, ...), else
``recording`` (no plan yet), ``planned`` or ``fallback`` (everything offloaded after steps ran
out of memory); ``none`` where no session runs in this process. The script calls nothing of
mucudnn: the lines it prints are what a plain loop would time.

    python -m benchmarks.train_steps --model resnet152 --batch 128 --steps 40
    python -m mucudnn run --memory-budget 8GiB --offload -- python -m benchmarks.train_steps ...
    python -m benchmarks.train_steps --device cpu --model tiny --batch 2 --steps 5
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import sys
import time
from pathlib import Path

_MODULE_START = time.monotonic()


def process_start_offset() -> float:
    """Seconds between this process's start and ``time.monotonic()``'s zero: ``monotonic() -
    offset`` is the process's age. Linux reads it from /proc (uptime and the process's start in
    clock ticks, both since boot); elsewhere the age is counted from this module's import."""
    try:
        with open("/proc/self/stat") as stat:
            # the command name (field 2) may hold spaces: fields after its ')' are plain
            fields = stat.read().rsplit(")", 1)[1].split()
        started_after_boot = int(fields[19]) / os.sysconf("SC_CLK_TCK")   # field 22, starttime
        with open("/proc/uptime") as uptime:
            age = float(uptime.read().split()[0]) - started_after_boot
        return time.monotonic() - max(age, 0.0)
    except (OSError, ValueError, IndexError):
        return _MODULE_START


def find_session():
    """The offload session ``mucudnn run --offload`` entered in this process, or None. The site
    hook imports mucudnn.torch when torch is imported and keeps the session in no name, so it is
    looked up once among the live objects by its public class."""
    package = sys.modules.get("mucudnn.torch")
    if package is None:
        return None
    try:
        session_class = getattr(package, "OffloadSession")
    except (AttributeError, ImportError):
        return None
    return next((o for o in gc.get_objects() if isinstance(o, session_class)), None)


def session_state(session) -> str:
    """How ``session`` ran the step that just ended (see the module docstring)."""
    if session is None:
        return "none"
    for holder in (session, getattr(session, "lifecycle", None)):
        state = getattr(holder, "state", None)
        if isinstance(state, str):
            return state
    if getattr(session, "fell_back", False):
        return "fallback"
    if getattr(session, "plan", None) is not None or getattr(session, "modes", None) is not None:
        return "planned"
    return "recording"


#: ``--model tiny``: the 3-D U-Net of benchmarks/models.py at 4 base channels and 3 levels on 8^3
#: patches, torch alone (no torchvision), a CPU step in milliseconds: the dry runs' network
TINY = "tiny"
TINY_SAMPLE = (1, 8, 8, 8)


def parse_sample(text: str | None) -> tuple[int, ...] | None:
    return tuple(int(part) for part in text.split(",")) if text else None


def build_training(model: str, batch: int, device: str, sample: tuple[int, ...] | None = None):
    """benchmarks.models.prepare's network, data and loss (fp32), or the tiny U-Net's."""
    import torch

    from benchmarks.models import Training, loss_function, make_batch, prepare, spec_of, unet3d
    generator = torch.Generator().manual_seed(1)
    if model != TINY:
        return prepare(model, batch, device=device, generator=generator, sample=sample)
    spec = spec_of("unet3d")
    network = unet3d(in_channels=1, classes=spec.classes, base=4, levels=3, max_channels=16)
    inputs, labels = make_batch(spec, batch, generator, sample or TINY_SAMPLE)
    return Training(network.to(device), inputs.to(device), labels.to(device),
                    loss_function(spec), contextlib.nullcontext())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="resnet152",
                    help=f"a name of benchmarks/models.py, or {TINY} (a dry run's U-Net)")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu (a dry run)")
    ap.add_argument("--sample", help="one input's shape, e.g. 3,32,32 (default: the model's)")
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--throughput", action="store_true",
                    help="at the end print `mucudnn-throughput: IMAGES/S` over the last half of "
                         "the steps (the median step; `mucudnn batch-size`'s protocol)")
    ap.add_argument("--sync-every", type=int, default=1, metavar="K",
                    help="wait for the device only after every K-th step, as a loop that reads "
                         "its loss every K steps does (default 1: each step's time is its own); "
                         "each K steps then print one line of their mean time a step")
    ap.add_argument("--detail", action="store_true",
                    help="also print each step's memory (peak allocated, reserved, the caching "
                         "allocator's retries), the session plan's prediction, whether the "
                         "session's out-of-memory rescue was armed and how many modules the "
                         "step recorded")
    ap.add_argument("--trace-step", default="", metavar="K[,K...]",
                    help="profile these steps (torch.profiler, device activity only) and print "
                         "where their device time went")
    ap.add_argument("--trace-out", default="", metavar="DIR",
                    help="with --trace-step, also write each traced step's Chrome trace to "
                         "DIR/step-K.json.gz")
    ap.add_argument("--cprofile-step", type=int, default=0, metavar="K",
                    help="run step K under cProfile and print the host's hottest functions")
    ap.add_argument("--cprofile-out", default="", metavar="PATH",
                    help="with --cprofile-step: also write step K's profile (pstats) to PATH")
    ap.add_argument("--memory-history-step", type=int, default=0, metavar="K",
                    help="record the caching allocator's history in step K and print each of "
                         "its flushes: what it unmapped and the allocation that asked for it")
    ap.add_argument("--memory-history-out", default="", metavar="PATH",
                    help="with --memory-history-step: also write the whole history (the caching "
                         "allocator's snapshot, torch.cuda.memory._dump_snapshot) to PATH")
    ap.add_argument("--snapshot-step", type=int, default=0, metavar="K",
                    help="after step K print the caching allocator's segments per stream")
    args = ap.parse_args(argv)
    offset = process_start_offset()

    import torch

    session = find_session()
    if args.device == "cpu":   # a dry run: one thread, not every core's (CI machines are small)
        torch.set_num_threads(1)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    torch.manual_seed(0)
    training = build_training(args.model, args.batch, args.device, parse_sample(args.sample))
    optimizer = torch.optim.SGD(training.model.parameters(), lr=args.lr, momentum=0.9)
    cuda = args.device.startswith("cuda")

    def synchronize() -> None:
        if cuda:
            torch.cuda.synchronize()

    print(f"train_steps: ready at {time.monotonic() - offset:.3f} s (session: "
          f"{'found' if session is not None else 'none'})", file=sys.stderr, flush=True)
    step_seconds = []
    detail = args.detail and cuda
    traced = {int(k) for k in args.trace_step.split(",") if k.strip()}
    every = max(1, args.sync_every)
    window_start = time.monotonic()
    retries = memory_counter("num_alloc_retries") if detail else 0
    for step in range(1, args.steps + 1):
        if every == 1:
            synchronize()
        if detail:
            torch.cuda.reset_peak_memory_stats()
        tracer = trace(step in traced and cuda)
        if step == args.memory_history_step and cuda:
            torch.cuda.memory._record_memory_history(context=None, stacks="python",
                                                     max_entries=1_000_000)
        host = HostClock(step == args.cprofile_step)
        start = time.monotonic()
        with tracer as profiler, host:
            optimizer.zero_grad(set_to_none=True)
            loss = training.forward_loss()
            host.mark("forward")
            loss.backward()
            host.mark("backward")
            optimizer.step()
            host.mark("optimizer")
            if every == 1 or step % every == 0:
                synchronize()
        end = time.monotonic()
        step_seconds.append(end - start)
        state = session_state(session)
        extra = ""
        if detail:
            now = memory_counter("num_alloc_retries")
            extra = (f" peak_gib={torch.cuda.max_memory_allocated() / 2**30:.3f}"
                     f" reserved_gib={torch.cuda.max_memory_reserved() / 2**30:.3f}"
                     f" retries={now - retries}{plan_prediction(session)}"
                     f"{session_detail(session)}{host.fields()}")
            retries = now
        print(f"train_steps: step {step} start_s={start - offset:.3f} end_s={end - offset:.3f} "
              f"step_ms={(end - start) * 1e3:.2f} session={state}{extra}", file=sys.stderr,
              flush=True)
        if every > 1 and step % every == 0:
            print(f"train_steps: steps {step - every + 1}-{step} ms_per_step="
                  f"{(end - window_start) * 1e3 / every:.2f} session={state}", file=sys.stderr,
                  flush=True)
            window_start = end
        for line in host.hottest():
            print(f"train_steps: cprofile step {step} {line}", file=sys.stderr, flush=True)
        if host.profile is not None and args.cprofile_out:
            host.profile.dump_stats(args.cprofile_out)
        if step == args.memory_history_step and cuda:
            from benchmarks import allocator_history
            snapshot = torch.cuda.memory._snapshot()
            # each flush, then the memory it found (allocator_history: the holes it left)
            try:
                layouts = [flush.describe() for flush in allocator_history.flushes(snapshot)]
            except allocator_history.NotExpandable as exc:
                layouts = [f"no layout: {exc}"]
            for line in flushes_in_history(snapshot) + layouts:
                print(f"train_steps: history step {step} {line}", file=sys.stderr, flush=True)
            if args.memory_history_out:
                torch.cuda.memory._dump_snapshot(args.memory_history_out)
            torch.cuda.memory._record_memory_history(enabled=None)
        if step == args.snapshot_step and cuda:
            for line in segments_by_stream():
                print(f"train_steps: segments step {step} {line}", file=sys.stderr, flush=True)
        if profiler is not None:
            for line in trace_summary(profiler, (end - start) * 1e3):
                print(f"train_steps: trace step {step} {line}", file=sys.stderr, flush=True)
            if args.trace_out:
                trace_file = Path(args.trace_out) / f"step-{step}.json.gz"
                trace_file.parent.mkdir(parents=True, exist_ok=True)
                profiler.export_chrome_trace(str(trace_file))   # gzipped: the name says .gz
    if detail:
        for line in planning_lines(session):
            print(f"train_steps: {line}", file=sys.stderr, flush=True)
    if args.throughput:
        print(f"mucudnn-throughput: {throughput(step_seconds, args.batch):.2f}", flush=True)
    return 0


def throughput(step_seconds: list[float], batch: int) -> float:
    """Images a second at the median of the last half of the steps (the first half warms up:
    recording, planning, trials)."""
    import statistics
    timed = step_seconds[len(step_seconds) // 2:] or step_seconds
    return batch / statistics.median(timed)


class HostClock:
    """The host's milliseconds to each mark of a step (issue only: the device is not waited
    for), the garbage collector's milliseconds within the step, and where ``profiled`` the step
    under cProfile."""

    def __init__(self, profiled: bool = False):
        import cProfile
        self.profile = cProfile.Profile() if profiled else None
        self.marks: list[tuple[str, float]] = []
        self.gc_ms = 0.0
        self._gc_start = None
        self.probe_ms = host_probe_ms()   # before the step's clock starts

    def _on_gc(self, phase, info) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
        elif self._gc_start is not None:
            self.gc_ms += (time.perf_counter() - self._gc_start) * 1e3
            self._gc_start = None

    def __enter__(self):
        gc.callbacks.append(self._on_gc)
        self.cpu_start = time.process_time()
        self.switches_start = _involuntary_switches()
        self.start = self.last = time.perf_counter()
        if self.profile is not None:
            self.profile.enable()
        return self

    def __exit__(self, *exc):
        if self.profile is not None:
            self.profile.disable()
        gc.callbacks.remove(self._on_gc)
        self.cpu_ms = (time.process_time() - self.cpu_start) * 1e3
        self.switches = _involuntary_switches() - self.switches_start
        return False

    def mark(self, name: str) -> None:
        now = time.perf_counter()
        self.marks.append((name, (now - self.last) * 1e3))
        self.last = now

    def fields(self) -> str:
        return "".join(f" host_{name}_ms={ms:.1f}" for name, ms in self.marks) + \
            f" gc_ms={self.gc_ms:.1f} process_cpu_ms={self.cpu_ms:.1f} preempted={self.switches}" \
            f" probe_ms={self.probe_ms:.2f}"

    def hottest(self, top: int = 25) -> list[str]:
        if self.profile is None:
            return []
        import io
        import pstats
        text = io.StringIO()
        pstats.Stats(self.profile, stream=text).sort_stats("tottime").print_stats(top)
        return [line for line in text.getvalue().splitlines() if line.strip()][-top - 1:]


def _probe_call(value: int) -> int:
    return value + 1


def host_probe_ms(calls: int = 20_000) -> float:
    """The host's milliseconds for a fixed piece of pure Python (``calls`` function calls), run
    before each step: the same work every step, so its time is the machine's pace then (another
    process on the core, the clock's frequency), which a step's host times are read against."""
    start = time.perf_counter()
    value = 0
    for _ in range(calls):
        value = _probe_call(value)
    return (time.perf_counter() - start) * 1e3


def flushes_in_history(snapshot: dict, most: int = 40) -> list[str]:
    """The caching allocator's history (``_record_memory_history``): the count of each action,
    then each run of segment frees or unmaps (a flush: an allocation that found no free block
    within the limit) with the allocation that ran it, and the bytes allocated then."""
    lines, counts, allocated, pending = [], {}, 0, None
    for device in snapshot.get("device_traces", []):
        for entry in device:
            action, size = entry["action"], entry.get("size", 0)
            counts[action] = counts.get(action, 0) + 1
            if action in ("segment_free", "segment_unmap"):
                if pending is None:
                    pending = [0, 0, allocated]
                pending[0] += 1
                pending[1] += size
            elif action == "alloc":
                if pending is not None and len(lines) < most:
                    lines.append(f"flush: {pending[0]} {action_word(pending)} of "
                                 f"{pending[1] / 2**20:.0f} MiB, then an allocation of "
                                 f"{size / 2**20:.1f} MiB with {pending[2] / 2**30:.3f} GiB "
                                 f"allocated")
                pending = None
                allocated += size
            elif action == "free_completed":
                allocated -= size
    return [" ".join(f"{k}={v}" for k, v in sorted(counts.items()))] + lines


def action_word(pending) -> str:
    return "segments freed or unmapped" if pending[0] > 1 else "segment freed or unmapped"


def _involuntary_switches() -> int:
    """The process's involuntary context switches so far (the host descheduled: another process
    or thread wanted its core)."""
    try:
        import resource
        return resource.getrusage(resource.RUSAGE_SELF).ru_nivcsw
    except (ImportError, OSError):
        return 0


def segments_by_stream() -> list[str]:
    """The caching allocator's segments per stream: reserved, allocated, free blocks and the
    largest free one (what a failed allocation of the compute stream cannot use elsewhere)."""
    import torch
    streams: dict = {}
    for segment in torch.cuda.memory_snapshot():
        row = streams.setdefault((segment["stream"], segment["segment_type"]),
                                 [0, 0, 0, 0, 0])
        row[0] += segment["total_size"]
        row[1] += segment["allocated_size"]
        row[4] += 1
        for block in segment["blocks"]:
            if block["state"] == "inactive":
                row[2] += 1
                row[3] = max(row[3], block["size"])
    return [f"stream={stream} pool={pool} segments={n} reserved_mib={r / 2**20:.0f} "
            f"allocated_mib={a / 2**20:.0f} free_blocks={f} largest_free_mib={big / 2**20:.0f}"
            for (stream, pool), (r, a, f, big, n) in sorted(streams.items(), key=str)]


def memory_counter(name: str) -> int:
    import torch
    return int(torch.cuda.memory_stats().get(name, 0))


def plan_prediction(session) -> str:
    """`` predicted_ms=P predicted_peak_gib=G`` of the plan ``session`` runs, or ""."""
    for holder in (getattr(session, "lifecycle", None), session):
        plan = getattr(holder, "plan", None)
        if plan is not None and hasattr(plan, "predicted_ms"):
            return (f" predicted_ms={plan.predicted_ms:.2f}"
                    f" predicted_peak_gib={plan.peak / 2**30:.3f}")
    return ""


def session_detail(session) -> str:
    """`` armed=A records=R aside=S`` of the step ``session`` just ran (a session closes a step at
    the next one's first module, so it is still the session's step here): A 1 where the
    out-of-memory rescue was armed in it (its cost per op: mucudnn/torch/rescue.py, rule 5), R
    ``all`` where it recorded every leaf module's calls, else how many modules it recorded, S 1
    where the session stood aside (mucudnn/torch/aside.py); "" where the session has none."""
    rescuer, step = getattr(session, "rescuer", None), getattr(session, "_step", None)
    if rescuer is None or step is None:
        return ""
    only = getattr(step, "records_only", None)
    aside = getattr(session, "aside", None)
    standing = "" if aside is None else f" aside={int(bool(aside.standing))}"
    return (f" armed={int(bool(rescuer.armed))} records={'all' if only is None else len(only)}"
            f"{standing}")


def planning_lines(session) -> list[str]:
    """One line per plan request ``session`` had made: its kind, the wall seconds its making
    took and the steps run meanwhile (its lifecycle's timings); none without a session."""
    lifecycle = getattr(session, "lifecycle", None)
    return [f"planning kind={kind.replace(' ', '_')} seconds={seconds:.3f} steps_run={steps}"
            for kind, seconds, steps in getattr(lifecycle, "timings", ())]


def trace(on: bool):
    """torch.profiler over a step (CUDA activity) where ``on``, else a context that yields None."""
    if not on:
        return contextlib.nullcontext()
    from torch.profiler import ProfilerActivity, profile
    # device activity only: the host's op records would slow the host this measures
    return profile(activities=[ProfilerActivity.CUDA])


def trace_summary(profiler, wall_ms: float, top: int = 12) -> list[str]:
    """Where a traced step's device time went: kernels, copies and the union of both against the
    step's wall; the CUDA runtime's allocations and frees; the kernels that took the most."""
    from torch.autograd import DeviceType
    kernels, copies, spans, calls = {}, 0.0, [], {}
    for event in profiler.events():
        if event.device_type == DeviceType.CUDA:
            start = event.time_range.start / 1e3
            end = event.time_range.end / 1e3
            if end <= start:
                continue
            spans.append((start, end))
            if "Memcpy" in event.name or "Memset" in event.name:
                copies += end - start
            else:
                kernels[event.name] = kernels.get(event.name, 0.0) + (end - start)
        elif event.name in ("cudaMalloc", "cudaFree", "cudaStreamSynchronize",
                            "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaHostAlloc"):
            calls[event.name] = calls.get(event.name, 0) + 1
    from benchmarks.shim_pytorch import union_length
    busy = union_length(spans)
    lines = [f"wall_ms={wall_ms:.2f} kernels_ms={sum(kernels.values()):.2f} "
             f"copies_ms={copies:.2f} busy_ms={busy:.2f} "
             + " ".join(f"{name}={count}" for name, count in sorted(calls.items()))]
    for name, ms in sorted(kernels.items(), key=lambda item: -item[1])[:top]:
        lines.append(f"kernel_ms={ms:.2f} {name[:100]}")
    return lines


if __name__ == "__main__":
    sys.exit(main())
