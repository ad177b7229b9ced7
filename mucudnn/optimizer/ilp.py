"""Workspace division (WD): one workspace budget shared by all kernels of a network.

Each kernel offers a Pareto front of plans (:func:`~mucudnn.optimizer.dp.pareto_plans`); an integer
linear program picks one plan per kernel so that the network is as fast as possible while the plans'
workspaces together fit the budget. PuLP builds the program and its bundled CBC solves it.
"""

from __future__ import annotations

import math
import warnings
from typing import Mapping, Sequence

import pulp

from ..errors import InfeasibleError, SolverError
from ._text import describe_bytes
from .kernel_plan import KernelPlan


def network_time(plans: Mapping[str, KernelPlan],
                 weights: Mapping[str, float] | None = None) -> float:
    """Predicted time of one pass: Σ weight[k] · time of plan k (weights default to 1)."""
    weights = weights or {}
    return math.fsum(weights.get(key, 1) * plan.time_ms for key, plan in plans.items())


def network_workspace(plans: Mapping[str, KernelPlan]) -> int:
    """Bytes the plans need together: each unique kernel's workspace counted once."""
    return sum(plan.workspace for plan in plans.values())


def solve_budget(fronts: Mapping[str, Sequence[KernelPlan]], budget: int,
                 weights: Mapping[str, float] | None = None,
                 time_limit_s: float | None = None) -> dict[str, KernelPlan]:
    """One plan per kernel minimising Σ_k weight[k] · time, with Σ_k workspace <= ``budget``.

    ``fronts[k]`` are the plans kernel ``k`` may use (usually its Pareto front; dominated plans are
    dropped here anyway), all for one kernel key and n; ``k`` is any label (e.g. ``"KEY N"``, as
    a key may run at several N). ``weights[k]`` (default 1) is how many layers of the network run
    kernel ``k``: its time counts that many times, but its workspace only once, because identical
    kernels share one plan line and one buffer. The program: binary x[k,c]; minimise
    Σ w_k·t[k,c]·x[k,c] subject to Σ_c x[k,c] = 1 for every k and Σ m[k,c]·x[k,c] <= budget.

    Returns the chosen plans (objects from ``fronts``) in the order of ``fronts``.
    Raises :class:`InfeasibleError` when even the smallest plans exceed the budget (the message
    says the minimum budget needed), :class:`SolverError` when CBC fails, stops at
    ``time_limit_s`` before proving optimality, or returns a choice over the budget.
    """
    if budget < 0:
        raise ValueError(f"workspace budget must be >= 0 bytes, got {budget}")
    weight = _weights(fronts, weights)
    options = {key: _pareto(key, plans) for key, plans in fronts.items()}

    minimum = sum(plans[0].workspace for plans in options.values())
    if minimum > budget:
        raise InfeasibleError(
            f"workspace budget {describe_bytes(budget)} is too small for these {len(options)} "
            f"kernels: they need at least {describe_bytes(minimum)} (each kernel's "
            "smallest-workspace plan)"
        )
    # Whatever a kernel takes above its own minimum comes out of this slack.
    slack = budget - minimum
    options = {key: [plan for plan in plans if plan.workspace - plans[0].workspace <= slack]
               for key, plans in options.items()}

    fastest = {key: plans[-1] for key, plans in options.items()}
    if network_workspace(fastest) <= budget:
        return fastest  # the unconstrained optimum fits: nothing to trade off
    choice = {key: plans[0] for key, plans in options.items() if len(plans) == 1}
    open_options = {key: plans for key, plans in options.items() if len(plans) > 1}
    choice.update(_solve(open_options, weight, budget - network_workspace(choice), time_limit_s))
    choice = {key: choice[key] for key in fronts}

    used = network_workspace(choice)
    if used > budget:  # CBC's tolerances must never turn into an over-budget plan
        raise SolverError(f"the solver chose plans needing {describe_bytes(used)}, over the "
                          f"budget of {describe_bytes(budget)}")
    return choice


def _weights(fronts: Mapping[str, Sequence[KernelPlan]],
             weights: Mapping[str, float] | None) -> dict[str, float]:
    weights = dict(weights or {})
    unknown = sorted(set(weights) - set(fronts))
    if unknown:
        raise ValueError("weights given for kernels without a front: " + "; ".join(unknown))
    for key, value in weights.items():
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"kernel {key}: weight must be finite and >= 0, got {value}")
    return {key: float(weights.get(key, 1)) for key in fronts}


def _pareto(key: str, plans: Sequence[KernelPlan]) -> list[KernelPlan]:
    """The plans of ``key`` that no other plan beats on both time and workspace, by workspace."""
    if not plans:
        raise InfeasibleError(f"kernel {key}: no plan to choose from")
    first = plans[0]
    for plan in plans:
        if (plan.key, plan.n) != (first.key, first.n):
            raise ValueError(f"the front {key!r} mixes plans of two kernels: {first.key} "
                             f"n={first.n} and {plan.key} n={plan.n}")
    front: list[KernelPlan] = []
    for plan in sorted(plans, key=lambda plan: (plan.workspace, plan.time_ms)):
        if not front or plan.time_ms < front[-1].time_ms:
            front.append(plan)
    return front


def _solve(options: Mapping[str, Sequence[KernelPlan]], weight: Mapping[str, float],
           budget: int, time_limit_s: float | None) -> dict[str, KernelPlan]:
    """The ILP over kernels with at least two plans each; ``budget`` is what they may share."""
    if not options:
        return {}
    problem = pulp.LpProblem("workspace_division", pulp.LpMinimize)
    picks = {key: [problem.add_variable(f"x_{k}_{c}", cat=pulp.LpBinary) for c in range(len(plans))]
             for k, (key, plans) in enumerate(options.items())}
    time_terms, workspace_terms = [], []
    for key, plans in options.items():
        fastest, smallest = plans[-1], plans[0]
        for plan, x in zip(plans, picks[key], strict=True):
            # Time above the kernel's fastest plan and workspace above its smallest: the same
            # optimum with smaller, non-negative coefficients, which CBC handles better.
            time_terms.append((x, weight[key] * (plan.time_ms - fastest.time_ms)))
            workspace_terms.append((x, plan.workspace - smallest.workspace))
        problem += pulp.LpAffineExpression([(x, 1) for x in picks[key]]) == 1
    problem += pulp.LpAffineExpression(time_terms)
    problem += pulp.LpAffineExpression(workspace_terms) <= \
        budget - sum(plans[0].workspace for plans in options.values())

    status = run_cbc(problem, time_limit_s)
    if status != pulp.LpStatusOptimal or problem.sol_status != pulp.LpSolutionOptimal:
        raise SolverError(
            f"CBC did not prove an optimal choice of plans for {len(options)} kernels: status "
            f"{pulp.LpStatus.get(status, status)}, solution "
            f"{pulp.LpSolution.get(problem.sol_status, problem.sol_status)}"
            + (f" (time limit {time_limit_s} s)" if time_limit_s is not None else "")
        )
    result = {}
    for key, variables in picks.items():
        picked = [c for c, x in enumerate(variables) if (x.varValue or 0) > 0.5]
        if len(picked) != 1:
            raise SolverError(f"kernel {key}: the solver picked {len(picked)} plans, not one")
        result[key] = options[key][picked[0]]
    return result


def run_cbc(problem: pulp.LpProblem, time_limit_s: float | None) -> int:
    """Solves ``problem`` with PuLP's bundled CBC (quiet, within the time limit): its status, or
    :class:`SolverError` where CBC is missing or fails. The one way this package runs CBC."""
    with warnings.catch_warnings():
        # PuLP 3.x deprecates its bundled CBC for 4.x, which ships none (pyproject pins <4).
        warnings.filterwarnings("ignore", message="PULP_CBC_CMD is deprecated",
                                category=DeprecationWarning)
        solver = pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit_s)
    if not solver.available():
        raise SolverError("PuLP's bundled CBC solver is not available on this machine")
    try:
        return problem.solve(solver)
    except pulp.PulpSolverError as exc:
        raise SolverError(f"CBC failed: {exc}") from exc
