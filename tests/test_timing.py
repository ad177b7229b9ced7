"""The timing method without a GPU: a stand-in CuPy whose events read a simulated clock."""

from __future__ import annotations

import pytest

from mucudnn.timing import TimingMethod, calls_made, do_bench


def timed(clock, ms: float):
    """A function taking ``ms`` per call, and the list of its call indices."""
    calls = []

    def fn(i: int) -> None:
        calls.append(i)
        clock["now"] += ms

    return fn, calls


def test_short_calls_are_batched_between_events(clock):
    fn, calls = timed(clock, 0.1)
    timing = do_bench(fn, stream=None)
    assert timing.median_ms == pytest.approx(0.1)
    assert timing.inner == 5 and timing.reps == 20 and not timing.cut_short
    assert calls == list(range(2 + 20 * 5))  # warm-up, probe, then the timed ones


def test_slow_calls_are_timed_fewer_times(clock):
    fn, calls = timed(clock, 100.0)
    timing = do_bench(fn, stream=None)
    assert (timing.reps, timing.inner, len(calls)) == (TimingMethod().min_reps_slow, 1, 4)


@pytest.mark.parametrize("cutoff, cut_short, expected_calls", [(5.0, True, 2), (50.0, False, 2 + 4),
                                                           (None, False, 2 + 4)])
def test_a_probe_over_the_cutoff_is_the_whole_result(clock, cutoff, cut_short, expected_calls):
    fn, calls = timed(clock, 10.0)
    timing = do_bench(fn, stream=None, cutoff_ms=cutoff)
    assert timing.cut_short is cut_short
    assert timing.median_ms == pytest.approx(10.0)
    assert len(calls) == expected_calls
    assert len(timing.samples_ms) == (1 if cut_short else 4)
    assert calls_made(10.0, TimingMethod(), cutoff) == expected_calls


def test_a_cold_call_far_over_the_cutoff_ends_it_at_once(clock):
    fn, calls = timed(clock, 10.0)
    timing = do_bench(fn, stream=None, cutoff_ms=0.5)  # 20x over: the warm-up call is enough
    assert (timing.cut_short, timing.median_ms, len(calls)) == (True, pytest.approx(10.0), 1)
    assert calls_made(10.0, TimingMethod(), 0.5) == 1


@pytest.mark.parametrize("ms", [0.1, 10.0, 100.0])
def test_calls_made_is_what_do_bench_does(clock, ms):
    fn, calls = timed(clock, ms)
    do_bench(fn, stream=None)
    assert calls_made(ms, TimingMethod()) == len(calls)


def test_the_spread_is_the_interquartile_range_of_the_samples(clock):
    times = iter([1.0, 1.0] + [1.0, 2.0, 3.0, 4.0, 5.0])  # warm-up, probe, then 5 samples

    def fn(i: int) -> None:
        clock["now"] += next(times)

    timing = do_bench(fn, None, TimingMethod(warmup=1, min_reps=5, max_reps=5, budget_ms=0,
                                             batch_ms=0.1))
    assert timing.samples_ms == (1.0, 2.0, 3.0, 4.0, 5.0)
    assert timing.iqr_ms == 2.0  # quartiles 2 and 4


def test_a_single_sample_has_no_spread(clock):
    fn, _ = timed(clock, 5.0)
    timing = do_bench(fn, None, TimingMethod(), cutoff_ms=1.0)
    assert timing.cut_short and timing.iqr_ms is None
