"""Pareto fronts of one kernel's plans against brute force, and their agreement with best_plan."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from mucudnn.errors import InfeasibleError, MissingMeasurementsError
from mucudnn.optimizer import Policy, best_plan, pareto_plans
from optimizer_tables import (
    SMALL_TABLES, assert_plan_is_measured, brute_force_points, usable_rows, workspace_limits,
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
