"""The fast planner: the ILP's plan (planner_ilp.py) found without a solver, in milliseconds.

The program is the same: one mode per saved group, :func:`planner.valid`, the modelled peak
(:func:`planner.peak_memory`, with rebuilds where :func:`planner.rebuild_points` puts them)
within the target, the least :func:`planner.step_time` (plus the ILP's tie term: less traffic).
The method (:func:`plan_modes`):

1. **Construction** (:func:`construct`). From everything kept, the change (of one group's mode,
   or of a group and one of its readers: :func:`changes_of`) that frees the most excess memory
   (bytes above the target, summed over the step's points) per millisecond it adds to the step,
   taken until nothing is above the target (a lazy greedy: a change's ratio is evaluated again
   only when it comes to the top).
2. **Improvement** (:func:`improve`). On a plan within the target: changes to a cheaper mode
   that stay within it, and each such change paired with the cheapest other change that brings
   the plan back within it (:func:`_cheapest_repair`), taken while they shorten the step.
3. **Restarts**, the cheapest plan kept: from everything moved (brought within the target by
   the construction where it is at most :data:`NO_PLAN_OVER` above it) with the moves of the
   largest saving taken back (:func:`drop`), weighed at the plan's marginal prices, rebuilt
   around each of its dearest moves kept (:func:`_rebuilt_around`) and in a window of groups
   around its dearest offload (:func:`_rebuilt_in_windows`), with offloads capped at
   shares of the link's bound (:data:`LINK_BOUND_SHARES`); on steps of more than
   :data:`COMPOUND_GROUPS` groups only 1 and 2 (the planning time).
4. **Where no construction meets the target** (from everything kept, or from everything moved)
   the target is taken as infeasible (without the compound constructions where the one-group
   ones all end over :data:`NO_PLAN_OVER` times the target): :class:`InfeasibleError` then
   says the least peak of :func:`least_peak_modes` (a descent on the peak). There is no
   fall-back to the ILP: on the committed profiles the fast planner had a plan wherever the ILP
   had one (benchmarks/results/planning-time.md).

Memory is kept as one array over the step's points (forward points, then backward points) and
changed by intervals: a group's liveness in a mode is at most three intervals of points (a kept
group's is one), so a change is evaluated on the points it touches, not the whole step
(:class:`Layout`, :class:`State`: planner_memory.py).
"""

from __future__ import annotations

import heapq
import math
from typing import Sequence

import numpy as np

from . import planner as model

from . import planner_ilp
from .planner import KEEP, OFFLOAD, RECOMPUTE, PREFETCH_MARGIN, StepProfile
from .planner_memory import TIE_MS_PER_BYTE, Layout, State

#: the construction takes a re-evaluated change whose ratio is at most this share above the best
#: ratio still to be re-evaluated (lazy greedy: re-evaluating every change after each one taken
#: is quadratic in the groups; the improvement takes back what a near-best choice costs)
STALE_TOLERANCE = 0.1
#: the shares of the link's bound (:func:`_link_bound`) at which a plan that offloads more is
#: made again with its offloads capped there (the cheaper kept)
LINK_BOUND_SHARES = (1.5, 1.25, 1.0, 0.75, 0.5)
#: the most groups of a step on which the fast planner also searches changes of a group with one
#: of its readers (:func:`changes_of`) and plans again with offloads capped
#: (:data:`LINK_BOUND_SHARES`): their number grows with the readers and the modes, and beyond
#: this many groups the search would not fit the planning time (planning-time.md); the
#: committed profiles, the 2 % test's, have at most 107
COMPOUND_GROUPS = 200
#: a target the constructions of one-group changes (from every start) all end more than this
#: share above is taken as infeasible without the compound search and the restarts: near the
#: least peak each rung of the prefetch ladder that fails would run them all. A heuristic, not a
#: bound: where a target had a plan on the committed profiles, the one-group constructions
#: that all failed ended at most 10.7 % above it; no plan changed with it
#: (benchmarks/results/planning-time.md)
NO_PLAN_OVER = 1.2
#: the most improvement rounds (each a pass over the moved groups); a round that changes nothing
#: ends the search earlier
IMPROVE_ROUNDS = 8


def _try(state: State, changes: dict[int, str], target: int):
    """(cost after, excess change, evaluated) of ``changes``, or None where invalid."""
    if not state.valid_change(changes):
        return None
    evaluated = state.change(changes)
    if evaluated is None:
        return None
    return state.layout.cost(*evaluated[3]), state.excess_change(evaluated[0], target), evaluated


def fits(state: State, evaluated, target: int) -> bool:
    """Whether the state after ``evaluated`` (a change of a state within ``target``; None: an
    invalid one) is within it: only the points the change adds bytes to can go over."""
    if evaluated is None:
        return False
    rising = [i for i in evaluated[0] if i[0] > 0 and i[1] < i[2]]
    if not rising:
        return True
    lo = min(i[1] for i in rising)
    hi = max(i[2] for i in rising)
    memory = state.memory[lo:hi].copy()
    for n, a, b in evaluated[0]:
        a, b = max(a, lo), min(b, hi)
        if a < b:
            memory[a - lo:b - lo] += n
    return int(memory.max()) <= target


def changes_of(state: State, index: int, compound: bool = True):
    """The changes (group -> mode) that start at group ``index``: each other mode of it and,
    with ``compound``, each change of both it and one of its readers (a source of a recomputed
    group may not be offloaded, and a recipe's source kept costs its reader nothing to rebuild:
    the two change together)."""
    layout, modes = state.layout, state.modes
    for mode in layout.allowed[index]:
        if mode != modes[index]:
            yield {index: mode}
    if not compound:
        return
    for reader in layout.readers[index]:
        for mode in layout.allowed[index]:
            if mode == modes[index]:
                continue
            for other in layout.allowed[reader]:
                if other != modes[reader]:
                    yield {index: mode, reader: other}


def construct(state: State, target: int, moved_cap: float = math.inf,
              compound: bool = True, frozen: frozenset = frozenset(),
              prices: tuple[float, float] | None = None) -> bool:
    """Changes (:func:`changes_of`, with ``compound`` its changes of two groups) taken on
    ``state`` until its memory is within ``target`` (True) or no change lowers its excess
    (False): each time the one of the least added cost per excess byte freed (lazily
    re-evaluated); none that offloads more than ``moved_cap`` bytes in all, none of a group in
    ``frozen``. ``prices``: (ms a byte offloaded, ms a recipe's ms) to weigh changes by instead
    of the step's time (:func:`_marginal_prices`)."""
    layout = state.layout
    excess = state.excess(target)
    if not excess:
        return True
    version = 0
    heap = []
    # the changes evaluated on the state as it is (since the last taken): a change pushed and
    # popped with no other taken between is not evaluated again
    evaluated_now: dict[tuple, tuple] = {}

    def tried(changes):
        if any(state.modes[i] == m or i in frozen for i, m in changes.items()):
            return None   # stale (a group in it changed since), or frozen
        found = _try(state, changes, target)
        if found is None or found[1] >= 0 or found[2][3][0] > moved_cap:
            return None
        return found

    def added_by(cost, evaluated) -> float:
        if prices is None:
            return max(cost - state.cost(), 0.0)
        moved, recompute_ms, traffic = evaluated[3]
        return max(0.0, (moved - state.moved) * prices[0]
                   + (recompute_ms - state.recompute_ms) * prices[1]
                   + (traffic - state.traffic) * TIE_MS_PER_BYTE)

    def push(changes):
        found = tried(changes)
        if found is not None:
            cost, gained, evaluated = found
            added = added_by(cost, evaluated)
            items = tuple(changes.items())
            evaluated_now[items] = found
            heapq.heappush(heap, (added / -gained, gained, items, version))

    # only a change of a group on the device at a point over the target (or of a source whose
    # reader is) can lower the excess
    over = np.concatenate(([0], np.cumsum(state.memory > target)))

    def at_over(index) -> bool:
        return any(over[hi] > over[lo] for _, lo, hi in
                   layout.spans(index, state.modes[index], state.rebuilt[index])) or (
            state.rebuilt[index] is not None
            and over[layout.g + state.rebuilt[index] + 1] > over[layout.g + state.rebuilt[index]])

    live = [at_over(index) for index in range(layout.g)]
    for index in range(layout.g):
        if live[index] or any(live[r] for r in layout.readers[index]):
            for changes in changes_of(state, index, compound):
                push(changes)
    while excess and heap:
        score, gained, items, stamp = heapq.heappop(heap)
        changes = dict(items)
        found = evaluated_now.get(items) if stamp == version else None
        if found is None:
            found = tried(changes)
        if found is None:
            continue
        cost, gained, evaluated = found
        if stamp != version:
            fresh = added_by(cost, evaluated) / -gained
            if heap and fresh > heap[0][0] * (1 + STALE_TOLERANCE):
                evaluated_now[items] = found
                heapq.heappush(heap, (fresh, gained, items, version))
                continue
        state.apply(changes, evaluated)
        excess = state.excess(target)
        version += 1
        evaluated_now.clear()
        # the changed groups' other changes, and their sources' and readers', are from here
        related = set(changes)
        for index in changes:
            related.update(layout.sources[index])
            related.update(layout.readers[index])
        for index in related:
            for other in changes_of(state, index, compound):
                push(other)
    return not excess


#: the most moved groups :func:`_rebuilt_around` takes back one at a time: REBUILDS, and on a
#: larger step REBUILD_GROUPS divided by its groups (a rebuild's time grows with them)
REBUILDS = 32
REBUILD_GROUPS = 1600
#: the improvement rounds of each of :func:`_rebuilt_around`'s plans (the most gain comes in
#: the first)
REBUILD_ROUNDS = 2


def _rebuilt_around(state: State, target: int) -> State:
    """``state`` or a cheaper plan: for each of its moved groups (the largest saving first, at
    most :data:`REBUILDS`, fewer on larger steps), the plan with that group kept and everything
    else constructed and improved around it (a move the local changes cannot undo alone: a
    covering of the peak by other groups); the cheapest."""
    layout = state.layout
    now = state.cost()
    moved = sorted((now - state.cost_after({i: KEEP}), i) for i in range(layout.g)
                   if state.modes[i] != KEEP)
    for saved, index in reversed(moved[-min(REBUILDS, REBUILD_GROUPS // layout.g):]):
        if saved <= 1e-12 or state.modes[index] == KEEP:
            continue
        trial = State(layout, state.modes)
        changes = {index: KEEP}
        if not trial.valid_change(changes):
            continue
        evaluated = trial.change(changes)
        if evaluated is None:
            continue
        trial.apply(changes, evaluated)
        if construct(trial, target, frozen=frozenset(changes)):
            improve(trial, target, REBUILD_ROUNDS)
            if trial.cost() < state.cost() - 1e-9:
                state = trial
    return state


#: :func:`_rebuilt_in_windows`: the offloaded groups (the largest saving first) whose window is
#: rebuilt, and the window, in groups before and after the offloaded one
WINDOW_REBUILDS = 1
WINDOW = (4, 8)


def _rebuilt_in_windows(state: State, target: int) -> State:
    """``state`` or a cheaper plan: for each of its offloaded groups (the largest saving first,
    at most :data:`WINDOW_REBUILDS`), the plan with every group of its :data:`WINDOW` kept and
    the rest constructed and improved from there; the cheapest. An offload taken early by the
    construction can be the one that makes a cheaper covering of the same points impossible (a
    residual add's output recomputed needs its other source not offloaded): the changes that
    undo it are of several groups at once, each alone over the target or invalid, which neither
    the improvement's pairs nor :func:`_rebuilt_around` (the offload alone kept) reach."""
    layout = state.layout
    now = state.cost()
    offloaded = sorted((now - state.cost_after({i: KEEP}), i) for i in range(layout.g)
                       if state.modes[i] == OFFLOAD)
    before, after = WINDOW
    for saved, index in reversed(offloaded[-WINDOW_REBUILDS:]):
        if saved <= 1e-12:
            continue
        modes = list(state.modes)
        modes[max(0, index - before):index + after + 1] = \
            [KEEP] * (min(layout.g, index + after + 1) - max(0, index - before))
        trial = State(layout, modes)
        if construct(trial, target):
            improve(trial, target, REBUILD_ROUNDS)
            if trial.cost() < state.cost() - 1e-9:
                state = trial
    return state


def drop(state: State, target: int, frozen: frozenset = frozenset()) -> None:
    """On ``state`` within ``target``: the change of one group of the largest saving that keeps
    it within the target, taken until none does (lazily re-evaluated: a change's saving depends
    on the modes alone; a change that goes over the target is not tried again, since taking
    moves back only adds bytes); none of a group in ``frozen``."""
    layout = state.layout
    now = state.cost()
    heap = []
    for index in range(layout.g):
        for mode in layout.allowed[index]:
            if mode != state.modes[index] and index not in frozen:
                saved = now - state.cost_after({index: mode})
                if saved > 1e-12:
                    heap.append((-saved, index, mode))
    heapq.heapify(heap)
    while heap:
        _, index, mode = heapq.heappop(heap)
        changes = {index: mode}
        if state.modes[index] == mode or not state.valid_change(changes):
            continue
        now = state.cost()
        saved = now - state.cost_after(changes)
        if saved <= 1e-12:
            continue
        if heap and saved < -heap[0][0] - 1e-12:
            heapq.heappush(heap, (-saved, index, mode))
            continue
        evaluated = state.change(changes)
        if fits(state, evaluated, target):
            state.apply(changes, evaluated)


def improve(state: State, target: int, rounds: int = IMPROVE_ROUNDS,
            compound: bool = True) -> None:
    """On ``state`` within ``target``: changes of one group to a cheaper mode that stay within
    it, and pairs of such a change with the change of another group that brings the state back
    within it, taken while they lower the cost (first the one of the largest gain a group).
    A change's cost depends on the modes alone (:meth:`State.cost_after`), so its memory is
    evaluated only where it would lower the cost."""
    layout = state.layout
    for _ in range(rounds):
        improved = False
        now = state.cost()
        # one-group changes
        for index in range(layout.g):
            best = None
            for mode in layout.allowed[index]:
                changes = {index: mode}
                if mode == state.modes[index]:
                    continue
                cost = state.cost_after(changes)
                if cost >= now - 1e-12 or (best is not None and cost >= best[0]) or \
                        not state.valid_change(changes):
                    continue
                evaluated = state.change(changes)
                if fits(state, evaluated, target):
                    best = (cost, changes, evaluated)
            if best is not None:
                state.apply(best[1], best[2])
                now, improved = best[0], True
        # pairs: a change that saves, over the target, repaired by one that frees
        savers = []
        for index in range(layout.g):
            for changes in changes_of(state, index, compound):
                saved = now - state.cost_after(changes)
                if saved > 1e-12 and state.valid_change(changes):
                    savers.append((saved, tuple(changes.items())))
        savers.sort(reverse=True)
        freeing = Freeing(state)
        for saved, items in savers:
            changes = dict(items)
            if any(state.modes[i] == m for i, m in items) or \
                    state.cost_after(changes) >= now - 1e-12 or not state.valid_change(changes):
                continue
            evaluated = state.change(changes)
            if evaluated is None:
                continue
            worst = _worst_point(state, evaluated, target)
            if worst is None:
                state.apply(changes, evaluated)
                now, improved = state.cost(), True
                freeing = Freeing(state)
                continue
            repaired = _cheapest_repair(state, changes, worst, freeing, now, target)
            if repaired is not None:
                state.apply(*repaired)
                now, improved = state.cost(), True
                freeing = Freeing(state)
        if not improved:
            return


def _worst_point(state: State, evaluated, target: int) -> tuple[int, int] | None:
    """(the point most over ``target`` after ``evaluated``, the bytes over there); None where
    none is over it."""
    lo, after = state.window(evaluated[0])
    worst = int(np.argmax(after))
    if after[worst] <= target:
        return None
    return lo + worst, int(after[worst]) - target


#: the most pairs :func:`_cheapest_repair` evaluates for one change (those that free enough
#: where the change goes over most, the cheapest first): a bound on the improvement's time
REPAIRS_TRIED = 12
#: the most intervals of points one change of a group's mode frees (its liveness in one mode
#: less that in another: two intervals less two)
FREED_INTERVALS = 3


class Freeing:
    """Each change of one group from its mode in a state to one whose own liveness is smaller
    somewhere, the cheapest first: its added cost, group, mode, the most it frees at a point, and
    the intervals of points where it frees its group's bytes (arrays: one row a change)."""

    def __init__(self, state: State):
        layout = state.layout
        rows = [row for index in range(layout.g) for row in _freeing_rows(
            layout, index, state.modes[index], state.rebuilt[index])]
        moved = np.array([row[2] for row in rows], dtype=np.int64) + state.moved
        recompute_ms = np.array([row[3] for row in rows], dtype=float) + state.recompute_ms
        traffic = np.array([row[4] for row in rows], dtype=np.int64) + state.traffic
        # as State.cost_after each change (the same operations, in the same order), less now;
        # the cheapest first, changes of equal cost in the groups' order
        added = layout.costs(moved, recompute_ms, traffic) - state.cost()
        order = np.argsort(added, kind="stable")
        self.changes = [rows[i][:2] for i in order]
        self.added = added[order]
        self.most = np.array([row[5] for row in rows], dtype=np.int64)[order]
        spans = np.array([row[6] for row in rows], dtype=np.int64).reshape(
            len(rows), FREED_INTERVALS, 2)[order]
        self.lo, self.hi = spans[:, :, 0], spans[:, :, 1]

    def at(self, point: int, over: int, saved: float) -> np.ndarray:
        """Rows (cheapest first) that add less than ``saved``, may free ``over`` bytes and free
        their group's bytes at ``point``."""
        if not len(self.changes):
            return np.zeros(0, dtype=np.int64)
        frees = ((self.lo <= point) & (point < self.hi)).any(axis=1)
        return np.nonzero(frees & (self.added < saved) & (self.most >= over))[0]


def _freeing_rows(layout: Layout, index: int, current: str, rebuilt: int | None) -> list[tuple]:
    """:class:`Freeing`'s rows of group ``index`` in mode ``current`` (rebuilt at ``rebuilt``):
    (group, mode, the changes of moved bytes, recipe ms and traffic, the most it frees at a
    point, its freed intervals), kept on the layout (they depend on these alone)."""
    key = (index, current, rebuilt)
    cache = layout.memo.setdefault("freeing", {})
    if key in cache:
        return cache[key]
    n = layout.nbytes[index]
    spans_now = [(lo, hi) for b, lo, hi in layout.spans(index, current, rebuilt) if b == n]
    held = sum(layout.nbytes[s] for s in layout.sources[index]) if current == RECOMPUTE else 0
    rows = []
    for mode in layout.allowed[index]:
        if mode == current:
            continue
        spans_then = [(lo, hi) for b, lo, hi in layout.spans(
            index, mode, layout.first[index] if mode == RECOMPUTE else None) if b == n]
        freed = _minus(spans_now, spans_then)[:FREED_INTERVALS]
        if not freed:
            continue
        freed += [(0, 0)] * (FREED_INTERVALS - len(freed))
        rows.append((index, mode, n * ((mode == OFFLOAD) - (current == OFFLOAD)),
                     layout.recompute_ms[index] * ((mode == RECOMPUTE) - (current == RECOMPUTE)),
                     n * ((mode != KEEP) - (current != KEEP)), n + held, freed))
    cache[key] = rows
    return rows


def _minus(spans: list[tuple[int, int]], less: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The points of ``spans`` not in ``less`` (intervals [first, end))."""
    found = []
    for lo, hi in spans:
        pieces = [(lo, hi)]
        for a, b in less:
            pieces = [piece for p_lo, p_hi in pieces
                      for piece in ((p_lo, min(p_hi, a)), (max(p_lo, b), p_hi))
                      if piece[0] < piece[1]]
        found += pieces
    return found


def _cheapest_repair(state: State, changes: dict[int, str], worst: tuple[int, int],
                     freeing: Freeing, below: float, target: int):
    """(changes with the change of another group, evaluated) of the least added cost by which
    the state after ``changes`` (over ``target``: ``worst``, the point most over it and by how
    much) is within the target and costs less than ``below``; None where none of the first
    :data:`REPAIRS_TRIED` does. ``freeing``: the state's :class:`Freeing`, in the order of their
    own added cost, which bounds the search: a change that alone adds at least what ``changes``
    save, or frees less than is over at ``worst``, is not tried."""
    saved = below - state.cost_after(changes)
    point, over = worst
    tried = 0
    for row in freeing.at(point, over, saved):
        other, other_mode = freeing.changes[row]
        if other in changes:
            continue
        pair = {**changes, other: other_mode}
        if state.cost_after(pair) >= below - 1e-12 or not state.valid_change(pair):
            continue
        tried += 1
        paired = state.change(pair)
        if fits(state, paired, target):
            return pair, paired
        if tried == REPAIRS_TRIED:
            break
    return None


def plan_modes(profile: StepProfile, target: int, lookahead: int,
               prefetch_margin: float = PREFETCH_MARGIN,
               start: Sequence[str] | None = None, quick: bool = False,
               second_start: Sequence[str] | None = None,
               made_by: list | None = None) -> list[str] | None:
    """The modes of the fast plan within ``target`` (None: none found). The construction starts
    from ``start`` where given (a valid plan of this profile: a warm start, such as the plan made
    for another exposure or target), else from everything kept; where it finds no change that
    lowers the excess, from everything kept and each of :func:`_moved_starts` (everything moved
    that may be: memory near the least peak), and the improvement then brings back what the
    target has room for. With ``quick``, where the construction of one-group changes from
    ``start`` meets the target, only it and the improvement; else the same from
    ``second_start`` (another warm start) where given; else the full search. ``made_by``: a
    list where given, to which :data:`QUICK` or :data:`FULL` is appended, the search that made
    the plan returned."""
    layout = Layout(profile, lookahead, prefetch_margin)
    # the quick construction from ``start``: the same as the first of the full search's
    failed = None
    if quick and start is not None:
        state = State(layout, start)
        if construct(state, target, compound=False):
            improve(state, target, compound=False)
            return _made(state.modes, QUICK, made_by)
        failed = state
        if second_start is not None:
            second = State(layout, second_start)
            if construct(second, target, compound=False):
                improve(second, target, compound=False)
                return _made(second.modes, QUICK, made_by)
    best = None
    compound = layout.g <= COMPOUND_GROUPS
    # the starts within the target: their construction changes nothing, with or without the
    # compound changes, so the second pass would improve the same plan again
    within = set()
    # whether the construction of every change from everything kept found no plan
    kept_failed, kept_at = False, int(start is not None)
    for compounds in (False, True)[:1 + compound]:
        starts = [[KEEP] * layout.g] + _moved_starts(layout)
        if start is not None:
            starts.insert(0, list(start))
        least = None
        for at, modes in enumerate(starts):
            if not compounds and at == 0 and failed is not None:
                least = failed.peak()
                continue
            if compounds and at in within:
                break
            state = State(layout, modes)
            if not compounds and state.peak() <= target:
                within.add(at)
            if construct(state, target, compound=compounds):
                improve(state, target, compound=compound)
                if best is None or state.cost() < best.cost():
                    best = state
                break
            kept_failed = kept_failed or (compounds and at == kept_at)
            least = state.peak() if least is None else min(least, state.peak())
        if best is None and not compounds and least > target * NO_PLAN_OVER:
            return None
    if compound:
        # from the other side: everything moved (brought within the target where it is at
        # most NO_PLAN_OVER above it), the moves of the largest saving taken back while the
        # plan stays within it
        for modes in _moved_starts(layout):
            state = State(layout, modes)
            peak = state.peak()
            if peak <= target or (peak <= target * NO_PLAN_OVER and construct(state, target)):
                drop(state, target)
                improve(state, target)
                if best is None or state.cost() < best.cost():
                    best = state
    if best is None:
        return None
    # the constructions from everything kept below are the same greedy at other prices or with
    # offloads capped: where it found no plan from there, they are not run (a heuristic: on the
    # committed profiles none of them then found one; benchmarks/results/planning-time.md)
    if compound and not kept_failed:
        # the greedy weighs each change at the step's time where it is made; the plan's own
        # marginal prices (an offloaded byte past the link's bound, a recipe hidden under the
        # fetches) weigh the first changes as the last see them
        priced = State(layout, [KEEP] * layout.g)
        if construct(priced, target, prices=_marginal_prices(best)):
            improve(priced, target)
            if priced.cost() < best.cost():
                best = priced
    if compound:
        best = _rebuilt_in_windows(_rebuilt_around(best, target), target)
    # the greedy takes offloads at their cost below the link's bound, and past it each byte
    # costs more (the step waits for the link): a plan made with offloads capped near the
    # bound (first, then as the rest of the excess needs) is often the cheaper one then
    for share in LINK_BOUND_SHARES * (compound and not kept_failed):
        cap = share * _link_bound(layout)
        if best.moved <= cap:
            continue
        capped = State(layout, [KEEP] * layout.g)
        # where the capped construction finds nothing more to change, it goes on uncapped
        if construct(capped, target, cap) or construct(capped, target):
            improve(capped, target)
            if capped.cost() < best.cost():
                best = capped
    return _made(best.modes, FULL, made_by)


#: :func:`plan_modes`' ``made_by`` entries: the plan is the quick construction's, or the full
#: search's
QUICK, FULL = "quick", "full"


def _made(modes: list[str], search: str, made_by: list | None) -> list[str]:
    if made_by is not None:
        made_by.append(search)
    return modes


def _marginal_prices(state: State) -> tuple[float, float]:
    """(ms a byte more offloaded adds, ms a recipe's ms more adds) to ``state``'s step."""
    layout, now = state.layout, state.cost()
    more = 2**20
    per_byte = (layout.cost(state.moved + more, state.recompute_ms, state.traffic) - now) / more
    per_ms = layout.cost(state.moved, state.recompute_ms + 1.0, state.traffic) - now
    return per_byte, per_ms


def _link_bound(layout: Layout) -> float:
    """The bytes offloaded past which the step waits for the link (its forward for the copies
    to the host, or its backward without recipes for the fetches)."""
    profile = layout.profile
    return min(profile.forward_ms / layout.ms_per_byte_d2h,
               profile.backward_ms / layout.ms_per_byte_h2d)


def _moved_starts(layout: Layout) -> list[list[str]]:
    """Valid plans of every group moved that may be: offloaded where it may be, else
    recomputed; and recomputed where it may be, else offloaded (a source of a recomputed group
    not offloaded: kept; a group a chain would rebuild too early: kept, :func:`_chains_cut`)."""
    if "moved starts" not in layout.memo:
        layout.memo["moved starts"] = _moved_starts_of(layout)
    return [list(modes) for modes in layout.memo["moved starts"]]


def _moved_starts_of(layout: Layout) -> list[list[str]]:
    starts = []
    for prefer in ((OFFLOAD, RECOMPUTE), (RECOMPUTE, OFFLOAD)):
        modes = [next((m for m in prefer if m in allowed), KEEP) for allowed in layout.allowed]
        modes = [KEEP if m == OFFLOAD and any(modes[r] == RECOMPUTE for r in readers)
                 else m for m, readers in zip(modes, layout.readers)]
        starts.append(_chains_cut(layout, modes))
    return starts


def _chains_cut(layout: Layout, modes: list[str]) -> list[str]:
    """``modes`` with each recomputed group that would be rebuilt where no plan may rebuild it
    (a chain of more than planner.MAX_CHAIN recipes) kept: keeping it ends the chain there,
    and its sources are rebuilt no earlier than before."""
    modes = list(modes)
    while True:
        rebuilt = model.rebuild_points(layout.profile, modes)
        early = [index for index, point in enumerate(rebuilt)
                 if point is not None and point not in layout.candidates[index]]
        if not early:
            return modes
        modes[early[-1]] = KEEP


#: the least peak's descent stops once lowering the peak by this many bytes finds no plan
LEAST_PEAK_RESOLUTION = 1


def least_peak_modes(profile: StepProfile, lookahead: int,
                     prefetch_margin: float = PREFETCH_MARGIN) -> list[str]:
    """Modes of a least peak (an upper bound on the ILP's least peak): from everything kept and
    from each of :func:`_moved_starts`, a descent on the peak (the construction for a target a
    step below the peak, the step a quarter where it finds none, down to
    :data:`LEAST_PEAK_RESOLUTION`); the lowest."""
    layout = Layout(profile, lookahead, prefetch_margin)
    best = None
    for modes in [[KEEP] * layout.g] + _moved_starts(layout):
        state = State(layout, modes)
        step = max(state.peak() // 16, LEAST_PEAK_RESOLUTION)
        while step >= LEAST_PEAK_RESOLUTION:
            trial = State(layout, state.modes)
            if construct(trial, state.peak() - step) and trial.peak() < state.peak():
                state = trial
            else:
                step //= 4
        if best is None or state.peak() < best.peak():
            best = state
    return best.modes


def group_changes(state: State, index: int):
    """(changes, evaluated) for each valid change of group ``index``'s mode on ``state`` as it
    is when the change comes (a caller may take one before the next), none to a rebuild point
    no plan may rebuild at."""
    for mode in state.layout.allowed[index]:
        changes = {index: mode}
        if mode == state.modes[index] or not state.valid_change(changes):
            continue
        evaluated = state.change(changes)
        if evaluated is not None:
            yield changes, evaluated


def repaired_pairs(state: State, target: int):
    """(changes, evaluated) for each valid change of one group's mode that takes ``state``
    over ``target``, paired with the change of another group of the least modelled cost that
    frees memory where the first goes over most and brings the state back within the target."""
    layout = state.layout
    freeing = None
    for index in range(layout.g):
        for changes, evaluated in group_changes(state, index):
            worst = _worst_point(state, evaluated, target)
            if worst is None:
                continue
            freeing = freeing if freeing is not None else Freeing(state)
            repaired = _cheapest_repair(state, changes, worst, freeing, math.inf, target)
            if repaired is not None:
                yield repaired


def all_pairs(state: State, target: int):
    """(changes, evaluated) for every valid pair of changes of two groups' modes that keeps
    ``state`` within ``target``."""
    import itertools
    layout = state.layout
    changes = [(index, mode) for index in range(layout.g) for mode in layout.allowed[index]
               if mode != state.modes[index]]
    for (a, ma), (b, mb) in itertools.combinations(changes, 2):
        pair = {a: ma, b: mb}
        if a == b or not state.valid_change(pair):
            continue
        evaluated = state.change(pair)
        if fits(state, evaluated, target):
            yield pair, evaluated
