"""Plans as the session asks for them: the plan for a target (:func:`plan_offload`, by the fast
method of planner_fast.py or the ILP of planner_ilp.py), its prefetch ladder
(:func:`plan_with_prefetch`), the plans tried against it (:func:`trial_plans`, :func:`polished`),
the least peak and the error of a budget no plan meets.

``method``: :data:`FAST` (the default: milliseconds, within 2 % of the ILP's step on every
committed profile: tests/torch/test_planner_fast.py) or :data:`ILP` (CBC, seconds to minutes;
the reference). Functions that tests or callers replace are called through the planner module
(``plan_with_prefetch``, ``polished``, ``planner.kept_apart``,
``_least_peak_modes``), so a replacement there is seen here too."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Sequence

from ..errors import InfeasibleError, MucudnnError, SolverError
from ..sizes import describe_size
from . import planner as model
from . import planner_fast
from .planner import (KEEP, PREFETCH_MARGIN, TRIAL_EXPOSURES, TRIAL_MADE, TRIAL_MIN_GAIN,
                      TRIAL_SOLVE_S, OffloadPlan, StepProfile, _result, _same_plan,
                      peak_memory, peak_point, release_point, simulate,
                      smaller_headrooms, valid)

#: the planning methods: the fast planner (planner_fast.py) and the ILP (planner_ilp.py)
FAST, ILP = "fast", "ilp"
METHODS = (FAST, ILP)
#: the most simulations one fast :func:`polished` runs: a simulation is linear in the groups
#: and points, and a polish that takes small gains one at a time could run thousands; the first
#: are where it gains most (the changes the time model gets most wrong are found first)
POLISH_SIMULATIONS = 150


def _checked(method: str) -> str:
    if method not in METHODS:
        raise ValueError(f"planning method {method!r}: one of {', '.join(METHODS)} expected")
    return method


def plan_offload(profile: StepProfile, budget: int, lookahead: int = 2,
                 time_limit_s: float | None = 60, prefetch_margin: float = PREFETCH_MARGIN,
                 explain: bool = True, method: str = FAST,
                 start: Sequence[str] | None = None, quick: bool = False,
                 second_start: Sequence[str] | None = None,
                 made_by: list | None = None) -> OffloadPlan:
    """The fastest valid choice whose modelled peak is within ``budget`` bytes (ties go to fewer
    bytes moved or recomputed), by ``method`` (``time_limit_s``: CBC's, for the ILP; ``start``:
    the modes of a valid plan of this profile the fast method starts from, a warm start; with
    ``quick``, only its construction and improvement from there, else from ``second_start``;
    ``made_by``: which search made the plan: planner_fast.plan_modes).
    :class:`InfeasibleError` says the least peak any choice reaches when none fits (``explain``
    False: only that none fits, without solving for it)."""
    _checked(method)
    if budget <= 0:
        raise ValueError(f"budget must be more than 0 bytes, got {budget}")
    everything_kept = [KEEP] * len(profile.groups)
    if peak_memory(profile, everything_kept, lookahead, prefetch_margin) <= budget:
        return replace(_result(profile, everything_kept, lookahead, prefetch_margin), target=budget)
    if method == ILP:
        from . import planner_ilp
        plan = planner_ilp.solve_plan(profile, budget, lookahead, time_limit_s, prefetch_margin)
    else:
        modes = planner_fast.plan_modes(profile, budget, lookahead, prefetch_margin, start,
                                        quick, second_start, made_by)
        plan = None if modes is None else _result(profile, modes, lookahead, prefetch_margin)
    if plan is None:
        if not explain:
            raise InfeasibleError(f"no plan within {describe_size(budget)} prefetching "
                                  f"{lookahead} unpacks ahead")
        raise _infeasible(profile, budget, lookahead, prefetch_margin, method)
    if plan.peak > budget or not valid(profile, plan.modes):
        raise SolverError(f"the {method} planner chose a plan over the budget or invalid")
    return replace(plan, target=budget)


def plan_with_less_headroom(error: Exception, budget: int, headroom: float,
                            plan_for) -> OffloadPlan | None:
    """After ``error`` for :func:`planning_target` at ``headroom``: where it is an
    :class:`InfeasibleError` (no plan fits; not a solver's failure, where a plan may exist), the
    first plan ``plan_for(target)`` makes for the targets of :func:`smaller_headrooms` (none
    below the least peak ``error`` found), its ``target`` the one it met; None where none meets
    any (the runtime and an off-GPU replay alike)."""
    if not isinstance(error, InfeasibleError):
        return None
    for _, target in smaller_headrooms(budget, headroom, getattr(error, "least_peak", None)):
        try:
            return plan_for(target)
        except MucudnnError:
            continue
    return None


def plan_with_prefetch(profile: StepProfile, budget: int, lookahead: int = 2,
                       time_limit_s: float | None = 60, explain: bool = True,
                       method: str = FAST, start: Sequence[str] | None = None,
                       quick: bool = False, second_start: Sequence[str] | None = None,
                       from_rung: OffloadPlan | None = None,
                       made_by: list | None = None) -> OffloadPlan:
    """:func:`plan_offload` with the earliest prefetches that fit: at ``lookahead`` timed by
    :data:`PREFETCH_MARGIN`, then by half of it, then untimed at ``lookahead`` and each smaller
    distance down to 0 (fetched when first unpacked, as the recording step did). An earlier
    prefetch hides more of its copy but holds its group on the device longer, which the largest
    backward ops may not have room for. Distance 0's :class:`InfeasibleError` (the least peak of
    all) when none fits; only that one searches for the least peak (for the ILP a second program
    per rung, which with chains can take its whole time limit). A rung where the planner found
    no plan (for the ILP also a :class:`SolverError`: none within its time limit) goes on to the
    next (``explain`` False: the last says only that none fits, without that search): near the
    least peak, prefetching less leaves more room, and a plan is easier to find. Where no rung
    fits with offloaded tensors released when their copies are due (the profile's
    ``release_margin``), the ladder runs again with each released at the next forward point
    (release margin 0): the compute stream then waits there for the copy, the forward bound by
    the link as vDNN's layer-wise wait (a model whose every plan of the first ladder peaks above
    the budget). ``start``, ``quick``, ``second_start``, ``made_by``: :func:`plan_offload`'s,
    each rung's.
    ``from_rung``: a plan of this profile at another copy exposure for the same ``budget``,
    made by this ladder: the ladder starts at its rung (the rungs before it found no plan for
    it, and the memory, so the room a rung leaves, does not depend on the exposure)."""
    ladder = [(lookahead, PREFETCH_MARGIN), (lookahead, PREFETCH_MARGIN / 2)] * (lookahead > 0)
    ladder += [(distance, 0.0) for distance in range(lookahead, -1, -1)]
    # the next point only where it releases some offload earlier (not: no forward clock, or
    # every copy due by the next point already)
    earlier = profile.release_margin > 0 and any(
        release_point(profile, index, 0.0) < release_point(profile, index)
        for index in range(len(profile.groups)))
    releases = [profile.release_margin] + [0.0] * earlier
    rungs = [(release, distance, prefetch_margin) for release in releases
             for distance, prefetch_margin in ladder]
    if from_rung is not None:
        at = (from_rung.release_margin, from_rung.lookahead, from_rung.prefetch_margin)
        rungs = rungs[rungs.index(at):] if at in rungs else rungs
    for rung, (release, distance, prefetch_margin) in enumerate(rungs):
        planned = profile if release == profile.release_margin else replace(
            profile, release_margin=release)
        try:
            return plan_offload(planned, budget, distance, time_limit_s, prefetch_margin,
                                explain=explain and rung == len(rungs) - 1, method=method,
                                start=start, quick=quick, second_start=second_start,
                                made_by=made_by)
        except (InfeasibleError, SolverError):
            if rung == len(rungs) - 1:
                raise
    raise AssertionError("unreachable: the ladder ends with distance 0")


def trial_plans(profile: StepProfile, budget: int, plan: OffloadPlan, lookahead: int = 2,
                time_limit_s: float | None = 60, larger_budgets: Sequence[int] = (),
                keep_apart: bool = False, method: str = FAST) -> list[tuple[str, OffloadPlan]]:
    """(how it was made, plan) for the plans worth running against ``plan`` (made for ``budget``
    with the profile's copy exposure), at most one a budget (``budget``, then each of
    ``larger_budgets`` above it, smallest first) and :data:`TRIAL_MADE` in all, in the order to
    run them; with ``keep_apart``, last, the simulated fastest of them all again with its small
    kept groups apart (:attr:`OffloadPlan.keep_apart`: the caching allocator's layout, which the
    model does not see, decides whether that flushes less or more). The exposure is a measured
    share of the copies' time (:data:`COPY_EXPOSURE`), the same for every copy, where
    in truth a copy costs the compute stream what it waits for it in its queue: little where
    copies are few and the compute long, much where they queue behind each other
    (:func:`simulate`). So plans are also made at
    :data:`TRIAL_EXPOSURES`, and for each larger budget (a smaller headroom: a cheaper plan the
    caching allocator may not have room for, or only by flushing its cache) at those and the
    profile's; of each budget's, the one :func:`simulate` finds fastest is tried if it beats
    every plan before it by :data:`TRIAL_MIN_GAIN`; at ``budget`` that includes the fastest
    of its plans (``plan`` too) :func:`polished`. None (``[]``) where ``plan`` moves nothing
    (its exposure then changes nothing). The plans are made by ``method`` (the fast one starts
    from ``plan``'s modes: within every larger target, near the plans of other exposures; at
    another exposure than the profile's, only a construction and improvement from there, else
    from the target's plan at the profile's exposure, on the prefetch ladder from that plan's
    rung on: those plans are candidates the trial measures, not the model's best); CBC gets at
    most
    :data:`TRIAL_SOLVE_S` a solve here. The
    runtime runs each :data:`TRIAL_STEPS` steps and keeps the fastest (of those that did not
    flush the allocator's cache where any did not): what the allocator does near its cap is no
    part of the model."""
    if not plan.moved_bytes:
        return []
    tried, best, chosen = [plan], plan.simulated_ms, []
    solve_s = TRIAL_SOLVE_S if time_limit_s is None else min(time_limit_s, TRIAL_SOLVE_S)
    rounds = [(budget, "", TRIAL_EXPOSURES)] + [
        (larger, f" for {larger / 2**30:.2f} GiB",
         tuple(dict.fromkeys((profile.copy_exposure,) + TRIAL_EXPOSURES)))
        for larger in sorted(set(larger_budgets)) if larger > budget]
    for target, where, exposures in rounds:
        if len(chosen) == TRIAL_MADE:
            break
        made = []
        # the target's plan at the profile's exposure (made first): the other exposures' ladder
        # starts at its rung, their quick construction from it where the one from ``plan``
        # does not meet the target
        same = plan if target == budget else None
        for exposure in exposures:
            if target == budget and exposure == profile.copy_exposure:
                continue
            other_exposure = exposure != profile.copy_exposure
            try:
                other = plan_with_prefetch(
                    replace(profile, copy_exposure=exposure), target, lookahead, solve_s,
                    method=method, start=plan.modes, quick=other_exposure,
                    second_start=same.modes if other_exposure and same is not None
                    and same is not plan else None,
                    from_rung=same if other_exposure else None)
            except (InfeasibleError, SolverError):
                continue
            if not other_exposure:
                same = other
            if not any(_same_plan(other, seen) for seen in tried + [p for _, p in made]):
                made.append((f"made at copy exposure {exposure:g}{where}", other))
        if target == budget:
            # the simulated fastest of the target's plans, polished on the simulation
            label, fastest = min([("as made", plan)] + made,
                                 key=lambda entry: entry[1].simulated_ms)
            better = polished(profile, fastest, solve_s, method=method)
            if better is not fastest and not any(_same_plan(better, seen) for seen in tried):
                made.append((f"{label}, polished on its simulation", better))
        tried += [p for _, p in made]
        if made:
            label, fastest = min(made, key=lambda entry: entry[1].simulated_ms)
            if fastest.simulated_ms < best * (1 - TRIAL_MIN_GAIN):
                chosen.append((label, fastest))
                best = fastest.simulated_ms
    label, fastest = chosen[-1] if chosen else ("as made", plan)
    if keep_apart and model.kept_apart(profile, fastest.modes):
        chosen.append((f"{label}, its small kept groups apart", replace(fastest, keep_apart=True)))
    return chosen


def polished(profile: StepProfile, plan: OffloadPlan, time_limit_s: float | None = TRIAL_SOLVE_S,
             method: str = FAST) -> OffloadPlan:
    """``plan`` improved by :func:`simulate`: changes of one group's mode, else of two, that keep
    the plan valid and its modelled peak within its target and shorten its simulated step,
    taken as found, until none does (or ``time_limit_s`` has passed). The program minimises the
    time model, linear in the choices, where every copy costs the same exposure share; the
    simulation queues them (what polishing gains: benchmarks/results/pressure).

    Each sweep tries every change of one group (taking each that shortens the step, and going
    on from there); where none does, pairs: with ``method`` :data:`ILP` every pair of changes,
    with :data:`FAST` each change that alone goes over the target with the cheapest change
    (modelled step) that brings it back within it (a bounded number of simulations where
    every pair is quadratic in the groups; at most :data:`POLISH_SIMULATIONS` simulations).
    Peaks are checked incrementally (planner_fast.State) on the points a change touches; a
    change whose compute alone (forward, backward, recipes) is no shorter than the best step is
    not simulated."""
    _checked(method)
    if not plan.target:
        return plan
    profile = replace(profile, release_margin=plan.release_margin)
    lookahead, prefetch_margin = plan.lookahead, plan.prefetch_margin
    deadline = None if time_limit_s is None else time.monotonic() + time_limit_s
    layout = planner_fast.Layout(profile, lookahead, prefetch_margin)
    state = planner_fast.State(layout, plan.modes)
    best = simulate(profile, plan.modes, lookahead, prefetch_margin).step_ms
    compute = profile.forward_ms + profile.backward_ms
    pairs = planner_fast.all_pairs if method == ILP else planner_fast.repaired_pairs
    simulations = None if method == ILP else POLISH_SIMULATIONS

    def shorter(changes, evaluated) -> bool:
        """Takes ``changes`` where they shorten the simulated step."""
        nonlocal best, simulations
        if compute + evaluated[3][1] >= best - 1e-6:
            return False
        if simulations is not None:
            simulations -= 1
        step = state.simulated_ms(changes, evaluated)
        if step < best - 1e-6:
            state.apply(changes, evaluated)
            best = step
            return True
        return False

    def timed_out() -> bool:
        return (deadline is not None and time.monotonic() >= deadline) or simulations == 0

    improved = True
    while improved and not timed_out():
        improved = False
        for index in range(layout.g):
            for changes, evaluated in planner_fast.group_changes(state, index):
                if planner_fast.fits(state, evaluated, plan.target) and \
                        shorter(changes, evaluated):
                    improved = True
            if timed_out():
                break
        if improved or timed_out():
            continue
        for changes, evaluated in pairs(state, plan.target):
            if shorter(changes, evaluated):
                improved = True
                break
            if timed_out():
                break
    if state.modes == list(plan.modes):
        return plan
    return replace(_result(profile, state.modes, lookahead, prefetch_margin), target=plan.target)


def least_peak(profile: StepProfile, lookahead: int = 2,
               prefetch_margin: float = PREFETCH_MARGIN, method: str = FAST) -> int:
    """The smallest modelled peak any valid choice reaches, as ``method`` finds it (the fast
    method's is an upper bound: a descent, planner_fast.least_peak_modes)."""
    modes = _least_peak_modes(profile, lookahead, prefetch_margin, method)
    return peak_memory(profile, modes, lookahead, prefetch_margin)


def _least_peak_modes(profile: StepProfile, lookahead: int,
                      prefetch_margin: float = PREFETCH_MARGIN, method: str = FAST) -> list[str]:
    """Modes of :func:`least_peak`."""
    if _checked(method) == ILP:
        from . import planner_ilp
        return planner_ilp.least_peak_modes(profile, lookahead, prefetch_margin)
    return planner_fast.least_peak_modes(profile, lookahead, prefetch_margin)



def _infeasible(profile: StepProfile, budget: int, lookahead: int,
                prefetch_margin: float = PREFETCH_MARGIN, method: str = FAST) -> InfeasibleError:
    """The error of a budget no choice meets at ``lookahead``: the least peak any choice
    reaches, where, and what is there: the baseline (what the recorded step allocated beside its
    saved groups) and the largest saved groups (the least peak as ``method`` finds it)."""
    modes = _least_peak_modes(profile, lookahead, prefetch_margin, method)
    least = peak_memory(profile, modes, lookahead, prefetch_margin)
    clock, point, baseline, saved = peak_point(profile, modes, lookahead, prefetch_margin)
    largest = ", ".join(f"group {g} ({profile.groups[g].producer or 'op'}, {modes[g]}, "
                        f"{describe_size(b)})" for b, g in saved[:3])
    error = InfeasibleError(
        f"memory budget {describe_size(budget)} is too small for this step: keeping, offloading "
        f"or recomputing its {len(profile.groups)} saved tensors reaches a peak of "
        f"{describe_size(least)} at least"
        + (f" (prefetching {lookahead} unpacks ahead)" if lookahead else "")
        + f", at {clock} point {point}: {describe_size(baseline)} not saved tensors "
        "(parameters, gradients, optimizer state, the op's inputs, outputs and workspace, as the "
        f"recorded step allocated them) and {describe_size(least - baseline)} saved"
        + (f" ({largest})" if largest else ""))
    error.least_peak = least
    return error


