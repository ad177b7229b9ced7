"""Benchmarking spread over several GPUs: one worker process per GPU, all measuring into one store,
with one progress display (``mucudnn bench --gpus``, :func:`mucudnn.tuner.benchmark`).

GPUs are grouped by model: measurements hold for a GPU model (docs/store.md), so every model
present measures every kernel, and within a model the kernels are split over its GPUs, each kernel
to exactly one of them. A worker is :mod:`mucudnn.bench_worker` run as ``python -m
mucudnn.bench_worker JOB`` with ``CUDA_VISIBLE_DEVICES`` naming its one GPU; it measures its
kernels with :func:`mucudnn.tuner.benchmark` (which commits each kernel's rows in one store write,
so a worker that dies loses at most the kernel it was measuring) and tells the parent on its
stdout, one line per event, what it has to do and what it has done (:class:`EventLines`).

This module is the parent's side and the event lines both sides share; it imports neither the
tuner nor the worker (the worker is started by its module name).
"""

from __future__ import annotations

import dataclasses
import json
import os
import selectors
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

from .environment import Gpu
from .errors import MucudnnError
from .problem import ConvProblem

#: What a worker prints: ``todo COUNT`` (sizes it is about to measure), ``size`` (one done),
#: ``kernel N KEY`` (a kernel's rows committed), ``timed COUNT`` (at the end: sizes timed).
EVENT_PREFIX = "mucudnn-bench-event "


def select_gpus(spec: str | Sequence[int] | None, gpus: Sequence[Gpu]) -> list[Gpu]:
    """The GPUs ``spec`` names: ``"all"`` / None (every visible one), ``"0,2"`` or a sequence of
    CuPy ordinals. Raises MucudnnError naming an ordinal that is not there."""
    if spec is None or spec == "all":
        return list(gpus)
    if isinstance(spec, str):
        try:
            wanted = [int(part) for part in spec.split(",") if part.strip()]
        except ValueError:
            raise MucudnnError(f"--gpus {spec!r}: expected 'all' or GPU numbers such as 0,1") \
                from None
    else:
        wanted = list(spec)
    if not wanted or len(set(wanted)) != len(wanted):
        raise MucudnnError(f"--gpus {spec!r}: name each GPU once (or 'all')")
    by_index = {gpu.index: gpu for gpu in gpus}
    missing = [i for i in wanted if i not in by_index]
    if missing:
        raise MucudnnError(f"--gpus {spec!r}: no GPU {missing[0]} here ({len(gpus)} visible"
                           f"{': ' + ', '.join(str(g.index) for g in gpus) if gpus else ''})")
    return [by_index[i] for i in wanted]


def split_kernels(costs: Sequence[tuple[ConvProblem, float]],
                  workers: int) -> list[list[ConvProblem]]:
    """Kernels split over ``workers``, each kernel to one: greatest cost first, each to the worker
    with the least cost so far (ties: the lower worker; equal costs make it round-robin)."""
    shares: list[list[ConvProblem]] = [[] for _ in range(workers)]
    loads = [0.0] * workers
    order = sorted(range(len(costs)), key=lambda i: (-costs[i][1], i))
    for i in order:
        problem, cost = costs[i]
        target = min(range(workers), key=lambda w: (loads[w], w))
        shares[target].append(problem)
        loads[target] += cost
    return shares


class EventLines:
    """A worker's events (``Benchmarker``'s ``events`` callback) as lines on ``stream``."""

    def __init__(self, stream) -> None:
        self.stream = stream

    def __call__(self, event: str, value) -> None:
        if event == "kernel":
            value = f"{value.n} {value.key}"
        self.stream.write(f"{EVENT_PREFIX}{event} {value}\n")
        self.stream.flush()


@dataclasses.dataclass
class Worker:
    gpu: Gpu
    kernels: list[ConvProblem]
    process: subprocess.Popen | None = None
    stored: list[tuple[str, int]] = dataclasses.field(default_factory=list)
    timed: int = 0
    #: Bytes read from the worker's stdout after its last whole line.
    buffer: bytes = b""

    def failure(self) -> str | None:
        """How this worker ended, where it failed (None: it succeeded)."""
        code = self.process.returncode
        if code == 0:
            return None
        if code < 0:
            try:
                how = f"killed by {signal.Signals(-code).name}"
            except ValueError:
                how = f"killed by signal {-code}"
        else:
            how = f"exited with {code}"
        return (f"GPU {self.gpu.index} ({self.gpu.name}) {how} after storing "
                f"{len(self.stored)} of {len(self.kernels)} kernels")


@dataclasses.dataclass
class SpreadResult:
    """What :func:`benchmark_on_gpus` did: sizes timed, and per worker its GPU and the kernels
    (key, N) whose rows it stored."""

    timed: int
    stored: list[tuple[Gpu, list[tuple[str, int]]]]


def benchmark_on_gpus(gpus: Sequence[Gpu],
                      kernel_costs: Callable[[str], list[tuple[ConvProblem, float]]],
                      job: dict, progress: bool = True) -> SpreadResult:
    """Measure kernels on ``gpus``, one worker each, into ``job["store"]``.

    ``kernel_costs(gpu_name)`` gives the kernels a GPU model still has to measure with a cost of
    each (what :func:`split_kernels` balances). ``job`` holds the rest of the worker's arguments of
    :func:`mucudnn.tuner.benchmark` (JSON: policy, API, limits, timing method, store path).
    Every worker runs to its end; then a failed one raises MucudnnError, one line naming each.
    """
    from .bench import _progress
    workers: list[Worker] = []
    for name in dict.fromkeys(gpu.name for gpu in gpus):
        model = [gpu for gpu in gpus if gpu.name == name]
        shares = split_kernels(kernel_costs(name), len(model))
        workers += [Worker(gpu, share) for gpu, share in zip(model, shares) if share]
    if not workers:
        return SpreadResult(0, [])  # everything already stored
    shares = ", ".join(f"GPU {w.gpu.index} ({w.gpu.name}): {len(w.kernels)}" for w in workers)
    print(f"mucudnn: measuring on {len(workers)} GPUs, kernels each: {shares}", file=sys.stderr)
    bar = _progress(None, progress)  # its total grows as the workers say what they measure
    with tempfile.TemporaryDirectory(prefix="mucudnn-bench-") as scratch:
        selector = selectors.DefaultSelector()
        try:
            for number, worker in enumerate(workers):
                path = Path(scratch) / f"job{number}.json"
                kernels = [[p.key, p.n] for p in worker.kernels]
                path.write_text(json.dumps({**job, "kernels": kernels}))
                env = {**os.environ, "CUDA_VISIBLE_DEVICES": worker.gpu.visible_as}
                worker.process = subprocess.Popen(
                    [sys.executable, "-m", "mucudnn.bench_worker", str(path)], env=env,
                    stdout=subprocess.PIPE, bufsize=0)
                selector.register(worker.process.stdout, selectors.EVENT_READ, worker)
            # Raw reads of what is there, split into lines here: a buffered readline would wait
            # for the end of a worker's unfinished line (its own block-buffered output), holding
            # the others back, and would keep a second line read with the first from the
            # selector until the worker writes again.
            while selector.get_map():
                for key, _ in selector.select():
                    worker = key.data
                    chunk = os.read(key.fileobj.fileno(), 65536)
                    lines = (worker.buffer + chunk).split(b"\n")
                    worker.buffer = lines.pop() if chunk else b""
                    if not chunk:
                        selector.unregister(key.fileobj)
                    for line in lines if chunk else [line for line in lines if line]:
                        _take_event(worker, line.decode(errors="replace") + "\n", bar)
        except BaseException:  # the parent itself failed (Ctrl-C...): stop measuring
            for worker in workers:
                if worker.process is not None and worker.process.poll() is None:
                    worker.process.kill()
            raise
        finally:
            for worker in workers:
                if worker.process is not None:
                    worker.process.wait()
                    worker.process.stdout.close()
            selector.close()
            bar.close()
    failures = [text for text in (w.failure() for w in workers) if text]
    if failures:
        raise MucudnnError(f"benchmarking failed on {len(failures)} of {len(workers)} GPUs: "
                           f"{'; '.join(failures)}; the kernels stored are kept, run bench again "
                           "to measure the others")
    return SpreadResult(sum(w.timed for w in workers), [(w.gpu, w.stored) for w in workers])


def _take_event(worker: Worker, line: str, bar) -> None:
    if not line.startswith(EVENT_PREFIX):
        sys.stdout.write(line)  # the worker's own output, passed on
        return
    event, _, value = line[len(EVENT_PREFIX):].rstrip("\n").partition(" ")
    if event == "todo":
        bar.total = (bar.total or 0) + int(value)
        bar.refresh()
    elif event == "size":
        bar.update(1)
    elif event == "kernel":
        n, _, key = value.partition(" ")
        worker.stored.append((key, int(n)))
    elif event == "timed":
        worker.timed += int(value)
