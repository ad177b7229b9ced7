"""The whole timing method in one place (after triton's ``do_bench``).

Warm-up runs first (module loading, lazy kernel set-up). A probe run tells how long one call takes;
calls shorter than ``batch_ms`` are then timed ``inner`` at a time between one pair of CUDA events
(back to back, as a plan's pieces run, so host launch overhead overlaps GPU work instead of being
counted). Repetitions stop at ``max_reps`` or once ``budget_ms`` of GPU time is spent, never below
``min_reps``. The result is the median per call: robust to the odd preempted repetition.

A caller that already knows a faster option passes ``cutoff_ms``: a probe slower than that ends
the timing there, with the probe as the only sample (``cut_short``); so does a first warm-up call
``cold_factor`` times over it, since cold-start costs are far smaller than that. Benchmarks spend
most of their GPU time on such hopeless configurations (an fp16 backward-filter engine of VGG-16
takes 20 s per call at N = 256 where the best takes 1.4 ms). A caller that only needs to know on
which side of the cutoff a call falls passes ``probe_only``: the timing ends at the probe (or the
cold call) either way.
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
    dominated_factor: float | None = 2.0
    # a first warm-up call this many times over the cutoff is enough too
    cold_factor: float = 10.0


@dataclasses.dataclass(frozen=True)
class Timing:
    median_ms: float
    reps: int
    inner: int
    samples_ms: tuple[float, ...]
    cut_short: bool = False  # a call exceeded the caller's cutoff: one sample only

    @property
    def iqr_ms(self) -> float | None:
        """The interquartile range of the samples (the spread the store keeps beside the median),
        None for fewer than two. Quartiles interpolate between the samples ("inclusive"), so a
        few samples never give a spread wider than their range."""
        if len(self.samples_ms) < 2:
            return None
        q1, _, q3 = statistics.quantiles(self.samples_ms, n=4, method="inclusive")
        return q3 - q1


def repetitions(probe_ms: float, method: TimingMethod) -> tuple[int, int]:
    """(event pairs, calls per pair) that ``method`` times a call of ``probe_ms`` with."""
    inner = max(1, math.ceil(method.batch_ms / probe_ms))
    if probe_ms > method.slow_ms:
        return method.min_reps_slow, inner
    return int(min(method.max_reps,
                   max(method.min_reps, method.budget_ms // (probe_ms * inner)))), inner


def calls_made(call_ms: float, method: TimingMethod, cutoff_ms: float | None = None,
               probe_only: bool = False) -> int:
    """How many calls :func:`do_bench` makes of a function taking ``call_ms`` every time."""
    if cutoff_ms is not None and method.warmup and call_ms > method.cold_factor * cutoff_ms:
        return 1
    if probe_only or (cutoff_ms is not None and call_ms > cutoff_ms):
        return method.warmup + 1
    reps, inner = repetitions(max(call_ms, 1e-3), method)
    return method.warmup + 1 + reps * inner


def do_bench(fn: Callable[[int], None], stream, method: TimingMethod = TimingMethod(),
             cutoff_ms: float | None = None, probe_only: bool = False) -> Timing:
    """Time ``fn(i)`` on a CuPy ``stream``; ``i`` counts calls so callers can rotate inputs.
    A call slower than ``cutoff_ms`` ends it early, ``probe_only`` at the probe in any case (see
    the module doc)."""
    import cupy

    calls = 0

    def call() -> None:
        nonlocal calls
        fn(calls)
        calls += 1

    def timed_call() -> float:
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record(stream)
        call()
        end.record(stream)
        end.synchronize()
        return max(cupy.cuda.get_elapsed_time(start, end), 1e-3)

    for i in range(method.warmup):
        if i == 0 and cutoff_ms is not None:
            cold = timed_call()
            if cold > method.cold_factor * cutoff_ms:
                return Timing(cold, 1, 1, (cold,), cut_short=True)
        else:
            call()
    probe = timed_call()
    if probe_only or (cutoff_ms is not None and probe > cutoff_ms):
        return Timing(probe, 1, 1, (probe,), cut_short=True)
    reps, inner = repetitions(probe, method)
    events = [(cupy.cuda.Event(), cupy.cuda.Event()) for _ in range(reps)]
    for s, e in events:
        s.record(stream)
        for _ in range(inner):
            call()
        e.record(stream)
    events[-1][1].synchronize()
    samples = tuple(cupy.cuda.get_elapsed_time(s, e) / inner for s, e in events)
    return Timing(statistics.median(samples), reps, inner, samples)
