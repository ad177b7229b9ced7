"""The WD integer program (solve_budget) against brute force and an exact knapsack DP."""

from __future__ import annotations

import itertools
import math
import random

import numpy as np
import pulp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mucudnn.errors import InfeasibleError
from mucudnn.optimizer import SolverError, network_time, network_workspace, solve_budget
from mucudnn.optimizer import ilp
from optimizer_tables import MIB, exact_times, fronts_of

# (time, workspace) options: workspaces from a small set so that budgets hit them exactly.
options = st.tuples(exact_times, st.integers(0, 16).map(lambda units: units * MIB))


@st.composite
def small_networks(draw):
    """``(fronts, weights)``: 2-4 kernels with 1-4 plans each (not necessarily Pareto)."""
    per_kernel = draw(st.lists(st.lists(options, min_size=1, max_size=4), min_size=2, max_size=4))
    fronts = fronts_of(per_kernel)
    weights = draw(st.one_of(st.none(), st.fixed_dictionaries(
        {key: st.integers(0, 4) for key in fronts})))
    return fronts, weights


def minimum_workspace(fronts) -> int:
    return sum(min(plan.workspace for plan in plans) for plans in fronts.values())


def brute_force_time(fronts, weights, budget) -> float:
    """The best weighted time over every combination of one plan per kernel within budget."""
    best = math.inf
    for combination in itertools.product(*fronts.values()):
        choice = dict(zip(fronts, combination, strict=True))
        if network_workspace(choice) <= budget:
            best = min(best, network_time(choice, weights))
    return best


def assert_valid_choice(choice, fronts, budget):
    assert list(choice) == list(fronts)
    for key, plan in choice.items():
        assert any(plan is option for option in fronts[key])
    assert network_workspace(choice) <= budget


@settings(deadline=None, max_examples=60)
@given(network=small_networks(), data=st.data())
def test_small_network_is_optimal(network, data):
    fronts, weights = network
    lowest = minimum_workspace(fronts)
    highest = sum(max(plan.workspace for plan in plans) for plans in fronts.values())
    budget = data.draw(st.integers(lowest, highest))
    choice = solve_budget(fronts, budget, weights)
    assert_valid_choice(choice, fronts, budget)
    assert math.isclose(network_time(choice, weights), brute_force_time(fronts, weights, budget),
                        rel_tol=1e-9, abs_tol=1e-9)


@settings(deadline=None, max_examples=30)
@given(network=small_networks())
def test_budget_below_the_smallest_plans_is_infeasible(network):
    fronts, weights = network
    lowest = minimum_workspace(fronts)
    if lowest > 0:
        with pytest.raises(InfeasibleError) as raised:
            solve_budget(fronts, lowest - 1, weights)
        assert f"{lowest} bytes ({lowest / MIB:.1f} MiB)" in str(raised.value)
    choice = solve_budget(fronts, lowest, weights)
    assert network_workspace(choice) == lowest


@settings(deadline=None, max_examples=30)
@given(fast=exact_times, saving=exact_times, workspace=st.integers(1, 1 << 34),
       weights=st.lists(st.integers(1, 8), min_size=2, max_size=2, unique=True))
def test_the_heavier_kernel_gets_the_fast_plan(fast, saving, workspace, weights):
    # Two identical kernels, a budget for one fast plan: it saves more time on the kernel that
    # runs in more layers.
    fronts = fronts_of([[(fast + saving, 0), (fast, workspace)]] * 2)
    for order in (weights, weights[::-1]):
        weight = dict(zip(fronts, order, strict=True))
        choice = solve_budget(fronts, workspace, weight)
        heavier = max(weight, key=weight.get)
        assert [key for key, plan in choice.items() if plan.workspace] == [heavier]


@settings(deadline=None, max_examples=20)
@given(network=small_networks())
def test_weights_default_to_one(network):
    fronts, _ = network
    budget = minimum_workspace(fronts) + 4 * MIB
    ones = {key: 1 for key in fronts}
    assert network_time(solve_budget(fronts, budget), ones) == \
        network_time(solve_budget(fronts, budget, ones), ones)


# -- a ResNet-50-sized network -------------------------------------------------------------------

def random_network(seed: int, kernels: int = 150):
    """Pareto fronts of 5-40 plans per kernel, workspaces in whole MiB, layer counts 1-3."""
    rng = random.Random(seed)
    per_kernel = []
    for _ in range(kernels):
        size = rng.randint(5, 40)
        workspaces = sorted(rng.sample(range(512), size))
        times = sorted((rng.randint(16, 64000) / 16 for _ in range(size)), reverse=True)
        per_kernel.append([(time_ms, units * MIB)
                           for time_ms, units in zip(times, workspaces, strict=True)])
    fronts = fronts_of(per_kernel)
    weights = {key: rng.randint(1, 3) for key in fronts}
    return fronts, weights


def knapsack_time(fronts, weights, budget) -> float:
    """Exact optimum by dynamic programming over the budget in MiB (workspaces are whole MiB)."""
    spare = (budget - minimum_workspace(fronts)) // MIB
    best = np.zeros(spare + 1)  # best[u]: optimum with u MiB above every kernel's minimum
    for key, plans in fronts.items():
        smallest = min(plan.workspace for plan in plans) // MIB
        extended = np.full(spare + 1, np.inf)
        for plan in plans:
            extra = plan.workspace // MIB - smallest
            if extra <= spare:
                np.minimum(extended[extra:], best[:spare + 1 - extra] + weights[key] * plan.time_ms,
                           out=extended[extra:])
        best = extended
    return float(best.min())


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("tightness", [0.05, 0.5, 0.95])
def test_large_network_is_optimal(seed, tightness):
    # (its solve time is a benchmark's: benchmarks/ilp_time.py; a test's wall clock would read
    # how busy the machine is)
    fronts, weights = random_network(seed)
    lowest = minimum_workspace(fronts)
    fastest = sum(max(plan.workspace for plan in plans) for plans in fronts.values())
    budget = lowest + int(tightness * (fastest - lowest)) // MIB * MIB
    choice = solve_budget(fronts, budget, weights)
    assert_valid_choice(choice, fronts, budget)
    assert math.isclose(network_time(choice, weights), knapsack_time(fronts, weights, budget),
                        rel_tol=1e-9)


# -- refusals ------------------------------------------------------------------------------------

def test_unproven_optimum_is_an_error(monkeypatch):
    def stopped_at_time_limit(problem, time_limit_s):
        problem.assignStatus(pulp.LpStatusOptimal, pulp.LpSolutionIntegerFeasible)
        return pulp.LpStatusOptimal

    monkeypatch.setattr(ilp, "run_cbc", stopped_at_time_limit)
    fronts = fronts_of([[(2.0, 0), (1.0, MIB)]] * 2)
    with pytest.raises(SolverError, match="did not prove an optimal"):
        solve_budget(fronts, MIB, time_limit_s=1)


def test_bad_arguments_are_refused():
    fronts = fronts_of([[(2.0, 0), (1.0, MIB)]] * 2)
    first, second = fronts
    with pytest.raises(ValueError, match="budget must be >= 0"):
        solve_budget(fronts, -1)
    with pytest.raises(ValueError, match="without a front: nowhere"):
        solve_budget(fronts, MIB, {"nowhere": 1})
    with pytest.raises(ValueError, match="weight must be finite and >= 0"):
        solve_budget(fronts, MIB, {first: -1})
    with pytest.raises(ValueError, match="mixes plans of two kernels"):
        solve_budget({first: fronts[first] + fronts[second]}, MIB)
    with pytest.raises(InfeasibleError, match="no plan to choose from"):
        solve_budget({first: fronts[first], second: []}, MIB)
