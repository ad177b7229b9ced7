"""The whole timing method in one place (after triton's ``do_bench``).

Warm-up runs first (module loading, lazy kernel set-up). A probe run tells how long one call takes;
calls shorter than ``batch_ms`` are then timed ``inner`` at a time between one pair of CUDA events
(back to back, as a plan's pieces run, so host launch overhead overlaps GPU work instead of being
counted). Repetitions stop at ``max_reps`` or once ``budget_ms`` of GPU time is spent, never below
``min_reps``. The result is the median per call: robust to the odd preempted repetition.

A caller that already knows a faster option passes ``cutoff_ms``: a probe slower than that ends
the timing there, with the probe as the only sample (``cut_short``). Benchmarks spend most of
their time on such hopeless configurations (100s of ms per call at large batches).
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
    # a configuration this many times slower than one already timed with no more workspace can
    # never be in a plan (see bench.Frontier): its probe is enough
    dominated_factor: float = 2.0


@dataclasses.dataclass(frozen=True)
class Timing:
    median_ms: float
    reps: int
    inner: int
    samples_ms: tuple[float, ...]
    cut_short: bool = False  # the probe exceeded the caller's cutoff: one sample only


def do_bench(fn: Callable[[int], None], stream, method: TimingMethod = TimingMethod(),
             cutoff_ms: float | None = None) -> Timing:
    """Time ``fn(i)`` on a CuPy ``stream``; ``i`` counts calls so callers can rotate inputs.
    A probe slower than ``cutoff_ms`` is the whole result (see the module doc)."""
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
    if cutoff_ms is not None and probe > cutoff_ms:
        return Timing(probe, 1, 1, (probe,), cut_short=True)
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
