"""The whole timing method in one place (after triton's ``do_bench``).

Warm-up runs first (module loading, lazy kernel set-up). A probe run tells how long one call takes;
calls shorter than ``batch_ms`` are then timed ``inner`` at a time between one pair of CUDA events
(back to back, as a plan's pieces run, so host launch overhead overlaps GPU work instead of being
counted). Repetitions stop at ``max_reps`` or once ``budget_ms`` of GPU time is spent, never below
``min_reps``. The result is the median per call: robust to the odd preempted repetition.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from typing import Callable


@dataclasses.dataclass(frozen=True)
class TimingMethod:
    warmup: int = 1
    min_reps: int = 3
    max_reps: int = 20
    budget_ms: float = 40.0
    batch_ms: float = 0.5       # calls shorter than this are timed several per event pair
    # a single call slower than this is timed min_reps_slow times only (FFT at N=256...)
    slow_ms: float = 60.0
    min_reps_slow: int = 2


@dataclasses.dataclass(frozen=True)
class Timing:
    median_ms: float
    reps: int
    inner: int
    samples_ms: tuple[float, ...]


def do_bench(fn: Callable[[int], None], stream, method: TimingMethod = TimingMethod()) -> Timing:
    """Time ``fn(i)`` on a CuPy ``stream``; ``i`` counts calls so callers can rotate inputs."""
    import cupy

    calls = 0

    def call() -> None:
        nonlocal calls
        fn(calls)
        calls += 1

    for _ in range(method.warmup):
        call()
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    start.record(stream)
    call()
    end.record(stream)
    end.synchronize()
    probe = max(cupy.cuda.get_elapsed_time(start, end), 1e-3)
    inner = max(1, math.ceil(method.batch_ms / probe))
    if probe > method.slow_ms:
        reps = method.min_reps_slow
    else:
        reps = int(min(method.max_reps,
                       max(method.min_reps, method.budget_ms // (probe * inner))))
    events = [(cupy.cuda.Event(), cupy.cuda.Event()) for _ in range(reps)]
    for s, e in events:
        s.record(stream)
        for _ in range(inner):
            call()
        e.record(stream)
    events[-1][1].synchronize()
    samples = tuple(cupy.cuda.get_elapsed_time(s, e) / inner for s, e in events)
    return Timing(statistics.median(samples), reps, inner, samples)
