"""The offload plan as an integer linear program solved by CBC (PuLP): the reference the fast
planner (planner_fast.py) is measured against (tests/data/planner_ilp_reference.json), and the
method of ``method="ilp"`` (``mucudnn offload-plan --method ilp``). The program is the model of
planner.py: one binary per group and mode, one per candidate rebuild point of a recomputed group
(:func:`planner.rebuild_candidates`), the modelled bytes at every point within the budget, the
objective :func:`planner.step_time` plus a tie term (less traffic)."""

from __future__ import annotations

from collections import defaultdict
from typing import Mapping, Sequence

from ..errors import SolverError
from ..sizes import describe_size
from . import planner as model
from .planner import (KEEP, OFFLOAD, PREFETCH_MARGIN, RECOMPUTE, OffloadPlan, StepProfile,
                      _result, allowed_modes, contributions, readers, rebuild_candidates, valid)


def solve_plan(profile: StepProfile, budget: int, lookahead: int = 2,
               time_limit_s: float | None = 60, prefetch_margin: float = PREFETCH_MARGIN
               ) -> OffloadPlan | None:
    """The fastest valid choice whose modelled peak is within ``budget`` bytes (ties go to fewer
    bytes moved or recomputed); None where CBC proves none fits. :class:`SolverError` where CBC
    found no plan within ``time_limit_s`` (a plan may exist) or chose one it should not."""
    limit = budget
    for _ in range(3):
        status, modes = _chained_solve(profile, lookahead, limit, prefetch_margin, time_limit_s)
        if status == "Infeasible":
            # also below ``budget`` (a limit lowered after CBC's tolerance let a plan over): no
            # plan within the budget
            return None
        if status != "Optimal":
            raise SolverError(f"CBC did not prove an optimal offload plan: {status}")
        if not valid(profile, modes):
            raise SolverError("the solver chose an invalid offload plan")
        plan = _result(profile, modes, lookahead, prefetch_margin)
        if plan.peak <= budget:
            return plan
        # CBC's feasibility tolerance (1e-7 of the limit) let the peak over by a few bytes:
        # never over budget
        limit -= plan.peak - budget + int(2e-7 * limit) + 1
    raise SolverError(f"the solver chose a plan of peak {describe_size(plan.peak)}, over the "
                      f"budget of {describe_size(budget)}")


def least_peak_modes(profile: StepProfile, lookahead: int,
                     prefetch_margin: float = PREFETCH_MARGIN,
                     time_limit_s: float | None = 60) -> list[str]:
    """Modes of the least modelled peak any valid choice reaches (the program minimising the
    peak)."""
    status, modes = _chained_solve(profile, lookahead, None, prefetch_margin, time_limit_s)
    if status != "Optimal":
        raise SolverError("CBC did not find the least peak of this step")
    return modes


def _chained_solve(profile: StepProfile, lookahead: int, budget: int | None, prefetch_margin: float,
                   time_limit_s: float | None) -> tuple[str, list[str] | None]:
    """(status, modes) of :func:`_program`. Chains (a group rebuilt before its first unpack) make
    the program harder for CBC, which can reach its time limit with no plan at all: then the
    program without them (each group rebuilt at its first unpack; a subset of the plans) is
    solved instead. (A start from that program's plan made CBC overrun its time limit by
    minutes, with worse plans.)"""
    problem, picks, _ = _program(profile, lookahead, budget, prefetch_margin)
    # through the planner module, where tests replace the solve
    status = _solve(problem, time_limit_s)
    if status in ("Optimal", "Infeasible") or not any(
            len(points) > 1 for points in rebuild_candidates(profile)):
        return status, (_picked(picks) if status == "Optimal" else None)
    problem, picks, _ = _program(profile, lookahead, budget, prefetch_margin, chains=False)
    fallback = _solve(problem, time_limit_s)
    if fallback == "Optimal":
        return fallback, _picked(picks)
    return status, None



def _program(profile: StepProfile, lookahead: int, budget: int | None,
             prefetch_margin: float = PREFETCH_MARGIN, chains: bool = True):
    """The ILP. With ``budget`` None it minimises the peak instead of the time. ``chains``
    False: every recomputed group rebuilt at its first unpack (a smaller program)."""
    import pulp

    problem = pulp.LpProblem("offload", pulp.LpMinimize)
    picks: list[dict[str, pulp.LpVariable]] = []
    for index, group in enumerate(profile.groups):
        modes = allowed_modes(group)
        x = {mode: problem.add_variable(f"x_{index}_{mode}", cat=pulp.LpBinary) for mode in modes}
        problem += pulp.lpSum(x.values()) == 1
        picks.append(x)
    # Where each recomputed group is rebuilt: one binary per candidate point, their sum its
    # recompute binary. A recomputed source is rebuilt no later than its recomputed readers, and
    # before its first unpack only where one of them is rebuilt at that very point: so exactly
    # where the runtime rebuilds it (:func:`rebuild_points`), its transient included.
    candidates = rebuild_candidates(profile) if chains else [
        [group.first_unpack] if RECOMPUTE in allowed_modes(group) else []
        for group in profile.groups]
    rebuilds: list[dict[int, pulp.LpVariable]] = []
    for index, x in enumerate(picks):
        at = {}
        if RECOMPUTE in x:
            at = {point: problem.add_variable(f"r_{index}_{point}", cat=pulp.LpBinary)
                  for point in candidates[index]}
            problem += pulp.lpSum(at.values()) == x[RECOMPUTE]
        rebuilds.append(at)
    for index, group in enumerate(profile.groups):
        if RECOMPUTE not in picks[index]:
            continue
        for source in group.recompute_source:
            if RECOMPUTE not in picks[source]:
                problem += picks[index][RECOMPUTE] <= picks[source][KEEP]
                continue
            for point, r in rebuilds[index].items():
                problem += r <= picks[source][KEEP] + pulp.lpSum(
                    v for p, v in rebuilds[source].items() if p <= point)
    reading = readers(profile)
    for index, group in enumerate(profile.groups):
        for point, r in rebuilds[index].items():
            if point != group.first_unpack:
                problem += r <= pulp.lpSum(rebuilds[reader][point] for reader in reading[index]
                                           if point in rebuilds[reader])
    forward = [pulp.LpAffineExpression() + base for base in profile.baseline_forward]
    live = [pulp.LpAffineExpression() for _ in range(profile.unpacks)]   # backward, saved groups
    # the transient of the rebuilds at each point: the largest of the groups rebuilt there
    largest: dict[int, list] = defaultdict(list)
    for index, at in enumerate(rebuilds):
        for point, r in at.items():
            if profile.groups[index].transient:
                largest[point].append(profile.groups[index].transient * r)
    rebuilding = {}   # backward point -> the transient there (on the floor, with the live groups)
    for point, terms in largest.items():
        if len(terms) == 1:
            rebuilding[point] = terms[0]
            continue
        transient = problem.add_variable(f"transient_{point}", lowBound=0)
        for term in terms:
            problem += transient >= term
        rebuilding[point] = transient
    for index, group in enumerate(profile.groups):
        chosen = [(mode, x, None) for mode, x in picks[index].items() if mode != RECOMPUTE]
        chosen += [(RECOMPUTE, r, point) for point, r in rebuilds[index].items()]
        for mode, x, point in chosen:
            for nbytes, f_points, b_points in contributions(profile, index, mode, lookahead,
                                                            prefetch_margin, point):
                for t in f_points:
                    forward[t] += nbytes * x
                for t in b_points:
                    live[t] += nbytes * x
    # each backward point twice where something is rebuilt there: the node's own peak, and the
    # rebuild's on the floor before the node runs
    backward = [base + saved for base, saved in zip(profile.baseline_backward, live)]
    rebuild_peaks = [profile.floor(point) + transient + live[point]
                     for point, transient in sorted(rebuilding.items())]
    peak = problem.add_variable("peak", lowBound=0)
    # Bytes in GiB (or in budgets) inside the program: CBC's tolerances are relative to
    # coefficients near 1 (the caller checks the peak in bytes).
    scale = 2.0 ** -30 if budget is None else 1.0 / budget
    for expression in forward + backward + rebuild_peaks:
        if budget is None:
            problem += scale * expression <= peak
        else:
            problem += scale * expression <= 1.0
    if budget is None:
        problem += peak
        return problem, picks, peak
    moved = pulp.lpSum(g.nbytes * x[OFFLOAD] for g, x in zip(profile.groups, picks)
                       if OFFLOAD in x)
    recompute = pulp.lpSum(g.recompute_ms * x[RECOMPUTE] for g, x in zip(profile.groups, picks)
                           if RECOMPUTE in x)
    forward_ms = problem.add_variable("forward_ms", lowBound=profile.forward_ms)
    backward_ms = problem.add_variable("backward_ms", lowBound=0)
    offload_ms = moved * (1e3 / (profile.d2h_gbps * 1e9))
    problem += forward_ms >= offload_ms
    fetch_ms = moved * (1e3 / (profile.h2d_gbps * 1e9))
    if lookahead == 0:   # fetched when needed: the backward waits for each copy
        problem += backward_ms >= profile.backward_ms + recompute + fetch_ms
    else:
        problem += backward_ms >= profile.backward_ms + recompute
        problem += backward_ms >= fetch_ms
    # Ties (the copies hidden behind compute either way) go to less traffic: 1 ms per 2^40 bytes
    # moved or recomputed, far below any real time difference.
    tie = pulp.lpSum(g.nbytes * (x.get(OFFLOAD, 0) + x.get(RECOMPUTE, 0)) * 2.0 ** -40
                     for g, x in zip(profile.groups, picks))
    exposed = profile.copy_exposure * (offload_ms + fetch_ms)
    problem += forward_ms + backward_ms + exposed + tie
    return problem, picks, peak


def _solve(problem, time_limit_s) -> str:
    import pulp

    from ..optimizer.ilp import run_cbc
    status = run_cbc(problem, time_limit_s)
    if status == pulp.LpStatusInfeasible:
        return "Infeasible"
    if status == pulp.LpStatusOptimal and problem.sol_status in (
            pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
        # integer feasible: CBC stopped at the time limit with a valid plan (its peak is checked
        # by the caller); a good plan now is worth more than a proof of optimality later
        return "Optimal"
    return f"{pulp.LpStatus.get(status, status)} / {pulp.LpSolution.get(problem.sol_status)}"


def _picked(picks: Sequence[Mapping]) -> list[str]:
    modes = []
    for index, x in enumerate(picks):
        chosen = [mode for mode, var in x.items() if (var.varValue or 0) > 0.5]
        if len(chosen) != 1:
            raise SolverError(f"saved group {index}: the solver picked {len(chosen)} modes")
        modes.append(chosen[0])
    return modes
