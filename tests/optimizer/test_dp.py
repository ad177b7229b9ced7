"""The WR dynamic program (best_plan) against brute force on random timing tables."""

from __future__ import annotations

import math

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from mucudnn.errors import InfeasibleError, MissingMeasurementsError
from mucudnn.measurement import Measurement, Status
from mucudnn.optimizer import KernelPlan, Piece, Policy, best_plan, candidate_sizes, fit_sizes
from mucudnn.optimizer.kernel_plan import largest_fitting_size
from optimizer_tables import (
    ALGOS, KEY, SMALL_TABLES, assert_plan_is_measured, brute_force_points, exact_times,
    float_times, lexicographic_min, timing_tables, usable_rows, workspace_limits,
)


# -- candidate sizes ---------------------------------------------------------------------------

@given(st.integers(1, 5000))
def test_candidate_sizes_of_each_policy(n):
    powers, size = [], 1
    while size <= n:
        powers.append(size)
        size *= 2
    assert candidate_sizes(Policy.UNDIVIDED, n) == [n]
    assert candidate_sizes("all", n) == list(range(1, n + 1))
    assert candidate_sizes(Policy.POWER_OF_TWO, n) == sorted(set(powers) | {n})


def test_candidate_sizes_refuse_bad_arguments():
    with pytest.raises(ValueError, match="n must be >= 1"):
        candidate_sizes(Policy.ALL, 0)
    with pytest.raises(ValueError, match="halves"):
        candidate_sizes("halves", 8)


# -- policy fit ----------------------------------------------------------------------------------

@pytest.mark.parametrize("workspace_at, limit, largest", [
    ({1: 10, 2: 20, 4: 40}, 35, 3),        # linear between 2 and 4: 3 samples take 30 bytes
    ({1: 10, 2: 20, 4: 40}, 40, 4),        # the largest measured size fits
    ({1: 10, 2: 20, 4: 40}, 5, None),      # not even one sample
    ({1: 0, 2: 0, 4: 0}, 0, 4),            # no workspace at all
    ({1: 100, 2: 100, 4: 1000}, 550, 3),   # a fixed part, then 450 per sample
    ({1: 10, 8: 80}, 79, 7),
])
def test_largest_fitting_size(workspace_at, limit, largest):
    assert largest_fitting_size(workspace_at, limit) == largest


def test_fit_adds_each_configurations_largest_fitting_size():
    rows = [Measurement(KEY, b, algo, "fma", 1.0, per_sample * b)
            for b in candidate_sizes(Policy.POWER_OF_TWO, 16)
            for algo, per_sample in (("gemm", 0), ("fft", 10), ("winograd", 3))]
    rows.append(Measurement(KEY, 16, "direct", "fma", math.nan, 0, Status.NOT_SUPPORTED))
    # fft fits 5 samples in 50 bytes, winograd 16; gemm and winograd at powers of two already
    assert fit_sizes(rows, 16, 50) == [5]
    assert fit_sizes(rows, 16, 35) == [3, 11]
    assert fit_sizes(rows, 8, 35) == [3]  # sizes are capped at the kernel's N


def test_fit_plans_use_the_extra_sizes_measured():
    per_sample = {"gemm": (1.0, 0), "fft": (0.25, 10)}  # ms, bytes per sample
    sizes = candidate_sizes(Policy.POWER_OF_TWO, 15) + [5]
    rows = [Measurement(KEY, b, algo, "fma", 0.1 + ms * b, ws * b)  # 0.1 ms per launch
            for b in sizes for algo, (ms, ws) in per_sample.items()]
    # fft fits 5 samples in 50 bytes: 3 pieces of 5, where powerOfTwo needs 4+4+4+2+1
    fit = best_plan(rows, 15, 50, Policy.FIT)
    assert [(p.batch, p.algo) for p in fit.pieces] == [(5, "fft")] * 3
    pow2 = best_plan(rows, 15, 50, Policy.POWER_OF_TWO)
    assert 5 not in {p.batch for p in pow2.pieces}
    assert fit.time_ms < pow2.time_ms


# -- plans ---------------------------------------------------------------------------------------

pieces = st.builds(Piece, batch=st.integers(1, 64), algo=st.just("gemm"), math=st.just("fma"),
                   time_ms=float_times, workspace=st.integers(0, 1 << 30))


@given(st.lists(pieces, min_size=1, max_size=6))
def test_kernel_plan_adds_times_and_shares_one_buffer(plan_pieces):
    plan = KernelPlan(KEY, sum(piece.batch for piece in plan_pieces), plan_pieces)
    assert plan.time_ms == pytest.approx(sum(piece.time_ms for piece in plan_pieces))
    assert plan.workspace == max(piece.workspace for piece in plan_pieces)
    assert plan.is_divided == (len(plan_pieces) > 1)
    assert isinstance(plan.pieces, tuple)


@given(st.lists(pieces, min_size=1, max_size=6), st.integers(1, 10))
def test_kernel_plan_pieces_must_add_up_to_n(plan_pieces, excess):
    n = sum(piece.batch for piece in plan_pieces) + excess
    with pytest.raises(ValueError, match=f"add up to {n - excess}, not {n}"):
        KernelPlan(KEY, n, plan_pieces)
    with pytest.raises(ValueError, match="at least one piece"):
        KernelPlan(KEY, n, ())


def test_engine_configurations_and_legacy_algorithms_mix_in_one_plan():
    """Only time and workspace decide: within the limit the engine runs micro-batches of 2 (it has
    no row at 1) and a legacy algorithm, needing no workspace, the sample left over."""
    engine = "eng7.k2=16.k11=-1"
    rows = [Measurement(KEY, b, "implicit_gemm", "fma", 1.0 * b, 0) for b in (1, 2, 4, 5)]
    rows += [Measurement(KEY, b, engine, "fma", 0.1 + 0.25 * b, 100 * b) for b in (2, 4, 5)]
    plan = best_plan(rows, 5, limit=200, policy=Policy.POWER_OF_TWO)
    assert [str(piece) for piece in plan.pieces] == [
        f"2:{engine}:fma", f"2:{engine}:fma", "1:implicit_gemm:fma"]
    assert (plan.time_ms, plan.workspace) == (2.2, 200)
    assert best_plan(rows, 5, limit=None, policy=Policy.UNDIVIDED).pieces[0].algo == engine


# -- best_plan against brute force ---------------------------------------------------------------

@pytest.mark.parametrize("policy", list(SMALL_TABLES))
@settings(deadline=None, max_examples=150)
@given(data=st.data())
def test_best_plan_is_optimal(policy, data):
    n, rows = data.draw(SMALL_TABLES[policy])
    limit = data.draw(workspace_limits(rows))
    if not usable_rows(rows, policy, n):
        with pytest.raises(MissingMeasurementsError, match=f"n={n}"):
            best_plan(rows, n, limit, policy)
        return
    points = brute_force_points(rows, policy, n, limit)
    if len(points) == 0:
        with pytest.raises(InfeasibleError, match=f"n={n}"):
            best_plan(rows, n, limit, policy)
        return
    plan = best_plan(rows, n, limit, policy)
    assert_plan_is_measured(plan, rows, policy, limit)
    # Fastest, and of the fastest the smallest workspace (times are exact sums here).
    assert (plan.time_ms, plan.workspace) == lexicographic_min(points)
    assert [piece.batch for piece in plan.pieces] == sorted(
        (piece.batch for piece in plan.pieces), reverse=True)


@pytest.mark.parametrize("policy", [Policy.ALL, Policy.POWER_OF_TWO])
@settings(deadline=None, max_examples=60)
@given(data=st.data())
def test_best_plan_is_optimal_with_rounded_times(policy, data):
    n, rows = data.draw(timing_tables(policy, max_n=12, times=float_times))
    limit = data.draw(workspace_limits(rows))
    points = brute_force_points(rows, policy, n, limit)
    assume(len(points) > 0)
    plan = best_plan(rows, n, limit, policy)
    assert_plan_is_measured(plan, rows, policy, limit)
    assert math.isclose(plan.time_ms, points[:, 0].min(), rel_tol=1e-12)


@settings(deadline=None)
@given(data=st.data())
def test_best_plan_ignores_row_order(data):
    n, rows = data.draw(SMALL_TABLES[Policy.ALL])
    assume(len(brute_force_points(rows, Policy.ALL, n)) > 0)
    assert best_plan(rows, n, None, Policy.ALL) == best_plan(rows[::-1], n, None, Policy.ALL)


@pytest.mark.parametrize("policy", [Policy.ALL, Policy.POWER_OF_TWO])
@given(n=st.integers(1, 64), data=st.data())
def test_splitting_that_gains_nothing_is_not_done(policy, n, data):
    # Time proportional to b and a workspace independent of b: every split is exactly as fast
    # and as large as running the whole batch at once, so the plan must stay in one piece.
    algos = data.draw(st.lists(st.tuples(st.sampled_from(ALGOS), exact_times, st.integers(0, 8)),
                               min_size=1, max_size=4, unique_by=lambda algo: algo[0]))
    rows = [Measurement(KEY, b, algo, math, per_sample * b, workspace)
            for (algo, math), per_sample, workspace in algos for b in candidate_sizes(policy, n)]
    plan = best_plan(rows, n, None, policy)
    assert [piece.batch for piece in plan.pieces] == [n]


@settings(deadline=None)
@given(data=st.data())
def test_undivided_plan_is_the_fastest_single_algorithm(data):
    n, rows = data.draw(SMALL_TABLES[Policy.UNDIVIDED])
    limit = data.draw(workspace_limits(rows))
    fitting = usable_rows(rows, Policy.UNDIVIDED, n, limit)
    assume(fitting)
    plan = best_plan(rows, n, limit, Policy.UNDIVIDED)
    assert len(plan.pieces) == 1 and not plan.is_divided
    assert plan.pieces[0].batch == n
    assert plan.time_ms == min(row.time_ms for row in fitting)


@pytest.mark.parametrize("policy", list(SMALL_TABLES))
@settings(deadline=None)
@given(data=st.data())
def test_limit_below_every_workspace_is_infeasible(policy, data):
    n, rows = data.draw(SMALL_TABLES[policy])
    usable = usable_rows(rows, policy, n)
    assume(usable)
    smallest = min(row.workspace for row in usable)
    assume(smallest > 0)
    with pytest.raises(InfeasibleError) as raised:
        best_plan(rows, n, smallest - 1, policy)
    message = str(raised.value)
    for part in (KEY, f"n={n}", f"{smallest - 1} bytes", f"{smallest} bytes"):
        assert part in message


def test_sizes_that_cannot_add_up_to_n_are_infeasible():
    rows = [Measurement(KEY, 4, "gemm", "fma", 1.0, 0)]
    with pytest.raises(InfeasibleError, match=r"sizes \(4\) cannot add up to 6"):
        best_plan(rows, 6, None, Policy.POWER_OF_TWO)


# -- refusals ------------------------------------------------------------------------------------

def test_rows_of_several_kernels_are_refused():
    other = KEY.replace("k=64", "k=128")
    rows = [Measurement(key, 1, "gemm", "fma", 1.0, 0) for key in (KEY, other)]
    with pytest.raises(ValueError, match="2 kernels") as raised:
        best_plan(rows, 1)
    assert KEY in str(raised.value) and other in str(raised.value)


@pytest.mark.parametrize("rows", [
    [],
    [Measurement(KEY, 4, "gemm", "fma", 1.0, 0, Status.FAILED)],
    [Measurement(KEY, 3, "gemm", "fma", 1.0, 0)],  # 3 is no candidate size of powerOfTwo for 4
], ids=["no rows", "no OK row", "no candidate size"])
def test_no_usable_rows_is_missing_measurements(rows):
    with pytest.raises(MissingMeasurementsError, match="n=4"):
        best_plan(rows, 4, None, Policy.POWER_OF_TWO)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1.0])
def test_impossible_times_are_refused(bad):
    with pytest.raises(ValueError, match="finite and >= 0"):
        best_plan([Measurement(KEY, 1, "gemm", "fma", bad, 0)], 1)


def test_negative_limit_is_refused():
    with pytest.raises(ValueError, match="limit must be >= 0"):
        best_plan([Measurement(KEY, 1, "gemm", "fma", 1.0, 0)], 1, -1)


# -- borrowing the output's unwritten part as workspace ------------------------------------------

def brute_force_borrowing_time(rows, n: int, limit: int, sample_bytes: int) -> float:
    """The fastest run of pieces (powerOfTwo sizes), in every order of every composition of n,
    where a piece may use max(limit, samples after it * sample_bytes) of workspace."""
    by_size: dict[int, list[Measurement]] = {}
    sizes = set(candidate_sizes(Policy.POWER_OF_TWO, n))
    for row in rows:
        if row.ok and row.batch in sizes:
            by_size.setdefault(row.batch, []).append(row)
    best = math.inf

    def walk(left: int, spent: float) -> None:
        nonlocal best
        if left == 0:
            best = min(best, spent)
            return
        for size, at in by_size.items():
            if size <= left:
                room = max(limit, (left - size) * sample_bytes)
                times = [r.time_ms for r in at if r.workspace <= room]
                if times:
                    walk(left - size, spent + min(times))

    walk(n, 0.0)
    return best


@settings(deadline=None, max_examples=150)
@given(data=st.data())
def test_borrowing_plan_is_optimal_and_runs_in_order(data):
    n, rows = data.draw(timing_tables(Policy.POWER_OF_TWO, max_n=12))
    limit = data.draw(workspace_limits(rows, unlimited=False))
    sample_bytes = data.draw(st.integers(0, 64)) * 1024
    assume(usable_rows(rows, Policy.POWER_OF_TWO, n))
    expected = brute_force_borrowing_time(rows, n, limit, sample_bytes)
    if math.isinf(expected):
        with pytest.raises(InfeasibleError):
            best_plan(rows, n, limit, borrow_sample_bytes=sample_bytes)
        return
    plan = best_plan(rows, n, limit, borrow_sample_bytes=sample_bytes)
    assert plan.time_ms == expected
    assert plan.workspace <= limit
    done = 0
    for piece in plan.pieces:  # in run order: a borrowing piece fits the output after it
        done += piece.batch
        assert piece.borrow == (piece.workspace > limit)
        assert piece.workspace <= max(limit, (n - done) * sample_bytes)
    # never slower than without borrowing (which may find no plan at all)
    without = brute_force_borrowing_time(rows, n, limit, 0)
    assert plan.time_ms <= without


def test_a_borrowing_piece_runs_first_and_leaves_the_plan_workspace():
    rows = [Measurement(KEY, 2, "gemm", "fma", 0.5, 3000), Measurement(KEY, 2, "implicit_gemm", "fma", 2.0, 0),
            Measurement(KEY, 1, "implicit_gemm", "fma", 1.0, 0), Measurement(KEY, 4, "implicit_gemm", "fma", 4.0, 0)]
    plan = best_plan(rows, 4, limit=100, borrow_sample_bytes=1500)
    # gemm at 2 needs 3000 bytes: the 2 samples after it have exactly that
    assert [str(piece) for piece in plan.pieces] == ["2:gemm:fma:out", "2:implicit_gemm:fma"]
    assert (plan.time_ms, plan.workspace) == (2.5, 0)
    assert best_plan(rows, 4, limit=100).time_ms == 4.0


def test_borrowing_sizes_follow_the_room_each_piece_leaves():
    from mucudnn.optimizer.kernel_plan import borrowing_sizes

    mib = 1 << 20
    workspace_at = {b: 2 * mib * b for b in candidate_sizes(Policy.POWER_OF_TWO, 256)}
    # a piece of s with r samples after it fits while 2 MiB * s <= r * 1 MiB: s = left // 3
    assert borrowing_sizes(workspace_at, 256, 3 * mib, mib) == [85, 57, 38, 25, 17, 11, 7, 5, 3, 2, 2]
    assert borrowing_sizes(workspace_at, 256, 3 * mib, 0) == []  # nothing to borrow


def test_fit_adds_borrowing_sizes_of_fast_configurations_only():
    rows = []
    for b in candidate_sizes(Policy.POWER_OF_TWO, 64):
        rows.append(Measurement(KEY, b, "gemm", "fma", 1.0 * b, 2000 * b))      # fast, hungry
        rows.append(Measurement(KEY, b, "fft", "fma", 3.0 * b, 1000 * b))       # slow
        rows.append(Measurement(KEY, b, "implicit_gemm", "fma", 4.0 * b, 0))
    plain = fit_sizes(rows, 64, limit=10_000)
    borrowing = fit_sizes(rows, 64, limit=10_000, borrow_sample_bytes=1000)
    assert plain == [5, 10]  # the largest within the limit of gemm and of fft
    assert set(borrowing) - set(plain) == {21, 14, 9, 6}  # gemm's chain: left // 3 while over the limit
