"""Pareto fronts of one kernel's plans against brute force, and their agreement with best_plan."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from mucudnn.errors import InfeasibleError, MissingMeasurementsError
from mucudnn.optimizer import (
    FRONT_MAX_POINTS, FRONT_MIN_GAIN, KernelPlan, Piece, Policy, best_plan, pareto_plans, thin_front,
)
from optimizer_tables import (
    KEY, SMALL_TABLES, assert_plan_is_measured, brute_force_points, usable_rows, workspace_limits,
)


def feasible_table(data, policy):
    n, rows = data.draw(SMALL_TABLES[policy])
    assume(len(brute_force_points(rows, policy, n)) > 0)
    return n, rows


@pytest.mark.parametrize("policy", list(SMALL_TABLES))
@settings(deadline=None, max_examples=150)
@given(data=st.data())
def test_front_is_exactly_the_pareto_front(policy, data):
    n, rows = data.draw(SMALL_TABLES[policy])
    max_workspace = data.draw(workspace_limits(rows))
    if not usable_rows(rows, policy, n):
        with pytest.raises(MissingMeasurementsError):
            pareto_plans(rows, n, policy, max_workspace)
        return
    points = brute_force_points(rows, policy, n, max_workspace)
    if len(points) == 0:
        with pytest.raises(InfeasibleError, match=f"n={n}"):
            pareto_plans(rows, n, policy, max_workspace)
        return
    front = pareto_plans(rows, n, policy, max_workspace)
    for plan in front:
        assert_plan_is_measured(plan, rows, policy, max_workspace)
    times = np.array([plan.time_ms for plan in front])
    workspaces = np.array([plan.workspace for plan in front])
    # Workspace ascending and time strictly decreasing: no member dominates another.
    assert np.all(np.diff(workspaces) > 0) and np.all(np.diff(times) < 0)
    # Every plan is dominated by (or equal to) a member ...
    covered = (times[None, :] <= points[:, :1]) & (workspaces[None, :] <= points[:, 1:])
    assert covered.any(axis=1).all()
    # ... and no plan beats a member (the front is not merely a cover).
    not_worse = (points[:, :1] <= times[None, :]) & (points[:, 1:] <= workspaces[None, :])
    better = (points[:, :1] < times[None, :]) | (points[:, 1:] < workspaces[None, :])
    assert not (not_worse & better).any()


@pytest.mark.parametrize("policy", list(SMALL_TABLES))
@settings(deadline=None, max_examples=150)
@given(data=st.data())
def test_front_agrees_with_best_plan(policy, data):
    n, rows = feasible_table(data, policy)
    front = pareto_plans(rows, n, policy)
    assert front[-1] == best_plan(rows, n, None, policy)
    limit = data.draw(workspace_limits(rows, unlimited=False))
    fitting = [plan for plan in front if plan.workspace <= limit]
    if not fitting:
        with pytest.raises(InfeasibleError):
            best_plan(rows, n, limit, policy)
        return
    assert fitting[-1].time_ms == best_plan(rows, n, limit, policy).time_ms


@pytest.mark.parametrize("policy", [Policy.ALL, Policy.POWER_OF_TWO])
@settings(deadline=None)
@given(data=st.data())
def test_max_workspace_cuts_the_front(policy, data):
    n, rows = feasible_table(data, policy)
    bound = data.draw(workspace_limits(rows, unlimited=False))
    within = [plan for plan in pareto_plans(rows, n, policy) if plan.workspace <= bound]
    if within:
        assert pareto_plans(rows, n, policy, max_workspace=bound) == within
    else:
        with pytest.raises(InfeasibleError, match=f"{bound} bytes"):
            pareto_plans(rows, n, policy, max_workspace=bound)


@settings(deadline=None)
@given(data=st.data())
def test_undivided_front_holds_single_pieces(data):
    n, rows = feasible_table(data, Policy.UNDIVIDED)
    for plan in pareto_plans(rows, n, Policy.UNDIVIDED):
        assert len(plan.pieces) == 1 and plan.pieces[0].batch == n


# -- thinning a front for a front plan ------------------------------------------------------------

def front_of(points) -> list[KernelPlan]:
    """Undivided single-piece plans at (workspace, time) points, as a front lists them."""
    return [KernelPlan(KEY, 1, (Piece(1, f"eng{i}", "fma", time_ms, workspace),))
            for i, (workspace, time_ms) in enumerate(points)]


def points_of(plans) -> list[tuple[int, float]]:
    return [(plan.workspace, plan.time_ms) for plan in plans]


def test_thinning_keeps_the_ends_and_each_point_two_percent_faster():
    front = front_of([(0, 10.0), (1, 9.9), (2, 9.85), (3, 9.5), (4, 9.4), (5, 9.0)])
    # 9.9 and 9.85 are within 2 % of 10; 9.5 is 5 % faster; 9.4 within 2 % of 9.5; 9.0 the fastest.
    assert points_of(thin_front(front)) == [(0, 10.0), (3, 9.5), (5, 9.0)]
    # Steps of 1 % each add up (0.99 ** 2 is just short of 2 %): every 3rd point is kept.
    gradual = front_of([(w, 10.0 * 0.99 ** w) for w in range(9)])
    assert [w for w, _ in points_of(thin_front(gradual))] == [0, 3, 6, 8]


def test_thinning_drops_the_least_gaining_points_down_to_the_maximum():
    times = [100.0, 50.0, 40.0, 39.0, 20.0, 10.0, 9.0, 5.0, 4.5]
    kept = thin_front(front_of(list(enumerate(times))), max_points=6)
    # The gain rule keeps all 9. Dropped: 39 (2.5 % over 40), then 9 (10 % over 10), then 40
    # (20 % over 50); the fastest (4.5, 10 % over 5) is never dropped.
    assert points_of(kept) == [(0, 100.0), (1, 50.0), (4, 20.0), (5, 10.0), (7, 5.0), (8, 4.5)]


@pytest.mark.parametrize("policy", list(SMALL_TABLES))
@settings(deadline=None, max_examples=100)
@given(data=st.data())
def test_thinned_front_keeps_its_promise(policy, data):
    n, rows = feasible_table(data, policy)
    front = pareto_plans(rows, n, policy)
    thin = thin_front(front, max_points=len(front) + 2)  # the gain rule alone
    assert thin[0] == front[0] and thin[-1] == front[-1]
    assert all(plan in front for plan in thin)
    for lower, upper in zip(thin, thin[1:-1]):
        assert upper.time_ms <= (1 - FRONT_MIN_GAIN) * lower.time_ms
    for plan in front:  # a dropped point is < 2 % faster than the best kept one below it
        below = [kept for kept in thin if kept.workspace <= plan.workspace][-1]
        assert plan.time_ms >= (1 - FRONT_MIN_GAIN) * below.time_ms or plan is thin[-1]
    capped = thin_front(front)
    assert len(capped) <= FRONT_MAX_POINTS and all(plan in thin for plan in capped)
    assert capped[0] == front[0] and capped[-1] == front[-1]
