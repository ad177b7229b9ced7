"""The fast planner's memory model (planner_fast.py): a profile's liveness at one prefetch
distance and margin as intervals of points (:class:`Layout`), and one plan's memory at every
point, changed group by group (:class:`State`).

A group's liveness in a mode is at most three intervals of points (a kept group's is one), so a
change of modes is evaluated on the points it touches, not the whole step. The axis is the
step's points, forward points then backward points; the memory is the recorded baseline plus
the saved groups on the device, plus at each rebuild point what its rebuilds lift above the
baseline.
"""

from __future__ import annotations

import heapq
import math
from typing import Sequence

import numpy as np

from . import planner as model

from . import planner_ilp
from .planner import KEEP, OFFLOAD, RECOMPUTE, PREFETCH_MARGIN, StepProfile

#: the ILP's tie term (planner_ilp.py): ms per byte moved or recomputed, far below any real time
#: difference, so that of two plans of one step the one moving fewer bytes is taken
TIE_MS_PER_BYTE = 2.0 ** -40


class Layout:
    """A profile's liveness at one prefetch distance and margin (its release margin the
    profile's): per group and mode, the intervals of points at which it is on the device, on one
    axis of ``G + U`` points (forward point ``t`` at ``t``, backward point ``p`` at ``G + p``)."""

    def __init__(self, profile: StepProfile, lookahead: int,
                 prefetch_margin: float = PREFETCH_MARGIN):
        self.profile, self.lookahead, self.prefetch_margin = profile, lookahead, prefetch_margin
        groups = profile.groups
        g = self.g = len(groups)
        self.size = g + profile.unpacks
        self.base = np.array(list(profile.baseline_forward) + list(profile.baseline_backward),
                             dtype=np.int64)
        self.floor = [profile.floor(p) for p in range(profile.unpacks)]
        self.nbytes = [group.nbytes for group in groups]
        self.first = [group.first_unpack for group in groups]
        self.last = [group.last_unpack for group in groups]
        self.transient = [group.transient for group in groups]
        self.sources = [tuple(group.recompute_source or ()) for group in groups]
        self.readers = model.readers(profile)
        self.allowed = [model.allowed_modes(group) for group in groups]
        self.recompute_ms = [group.recompute_ms or 0.0 for group in groups]
        #: per group, the points a plan may rebuild it at (the ILP's candidates: no chain longer
        #: than planner.MAX_CHAIN recipes)
        self.candidates = [set(points) for points in model.rebuild_candidates(profile)]
        self.fixed: list[dict[str, list[tuple[int, int, int]]]] = []
        #: per group, where offloaded: its release and prefetch points (else None)
        self.release: list[int | None] = [None] * g
        self.prefetch: list[int | None] = [None] * g
        for index, group in enumerate(groups):
            n, last = group.nbytes, group.last_unpack
            spans = {KEEP: [(n, index, g + last + 1)]}
            if OFFLOAD in self.allowed[index]:
                release = self.release[index] = model.release_point(profile, index)
                fetch = self.prefetch[index] = model.prefetch_point(profile, index, lookahead,
                                                                    prefetch_margin)
                spans[OFFLOAD] = [(n, index, min(release + 1, g)), (n, g + fetch, g + last + 1)]
            if RECOMPUTE in self.allowed[index]:
                # without its backward interval, which starts where it is rebuilt
                held = [(groups[s].nbytes, g + groups[s].last_unpack + 1, g + last + 1)
                        for s in self.sources[index] if last > groups[s].last_unpack]
                spans[RECOMPUTE] = [(n, index, min(index + 2, g))] + held
            self.fixed.append(spans)
        self.ms_per_byte_d2h = 1e3 / (profile.d2h_gbps * 1e9)
        self.ms_per_byte_h2d = 1e3 / (profile.h2d_gbps * 1e9)
        #: what the planner derives from this layout alone, kept (by name)
        self.memo: dict[str, object] = {}

    def costs(self, moved: np.ndarray, recompute_ms: np.ndarray, traffic: np.ndarray
              ) -> np.ndarray:
        """:meth:`cost` of each element (the same operations in the same order: equal floats)."""
        profile = self.profile
        offload = moved * self.ms_per_byte_d2h
        fetch = moved * self.ms_per_byte_h2d
        backward = profile.backward_ms + recompute_ms
        return (np.maximum(profile.forward_ms, offload)
                + (backward + fetch if self.lookahead == 0 else np.maximum(backward, fetch))
                + profile.copy_exposure * (offload + fetch) + traffic * TIE_MS_PER_BYTE)

    def spans(self, index: int, mode: str, rebuilt: int | None) -> list[tuple[int, int, int]]:
        """(bytes, first point, end point) of group ``index`` in ``mode`` (rebuilt at backward
        point ``rebuilt`` where recomputed)."""
        found = self.fixed[index][mode]
        if mode == RECOMPUTE:
            found = found + [(self.nbytes[index], self.g + rebuilt, self.g + self.last[index] + 1)]
        return found

    def cost(self, moved: int, recompute_ms: float, traffic: int) -> float:
        """:func:`planner.step_time` of ``moved`` bytes offloaded and ``recompute_ms`` of recipes,
        plus the tie term for ``traffic`` bytes moved or recomputed."""
        profile = self.profile
        offload = moved * self.ms_per_byte_d2h
        fetch = moved * self.ms_per_byte_h2d
        backward = profile.backward_ms + recompute_ms
        return (max(profile.forward_ms, offload)
                + (backward + fetch if self.lookahead == 0 else max(backward, fetch))
                + profile.copy_exposure * (offload + fetch) + traffic * TIE_MS_PER_BYTE)


class State:
    """One plan's modes with its memory at every point, changed group by group."""

    def __init__(self, layout: Layout, modes: Sequence[str]):
        self.layout = layout
        self.modes = list(modes)
        self.rebuilt = model.rebuild_points(layout.profile, self.modes)
        self.moved = sum(n for n, m in zip(layout.nbytes, self.modes) if m == OFFLOAD)
        self.recompute_ms = math.fsum(t for t, m in zip(layout.recompute_ms, self.modes)
                                      if m == RECOMPUTE)
        self.traffic = sum(n for n, m in zip(layout.nbytes, self.modes) if m != KEEP)
        # backward point -> {group rebuilt there: its transient}
        self.rebuilds: dict[int, dict[int, int]] = {}
        for index, point in enumerate(self.rebuilt):
            if point is not None:
                self.rebuilds.setdefault(point, {})[index] = layout.transient[index]
        diff = np.zeros(layout.size + 1, dtype=np.int64)
        for index, mode in enumerate(self.modes):
            for n, lo, hi in layout.spans(index, mode, self.rebuilt[index]):
                if lo < hi:
                    diff[lo] += n
                    diff[hi] -= n
        self.memory = layout.base + np.cumsum(diff[:-1])
        for point in self.rebuilds:
            self.memory[layout.g + point] += self._lift(point, self.rebuilds[point])
        #: (target, :meth:`_excess_prefix` for it) of the memory as it is, or None
        self._prefix: tuple[int, np.ndarray] | None = None
        #: backward point -> :meth:`_lift_now` there
        self._lifts: dict[int, int] = {}

    def _lift(self, point: int, rebuilt: dict[int, int]) -> int:
        """What the rebuilds at backward ``point`` add above its baseline (the largest transient
        on the floor there, where it is above the baseline)."""
        if not rebuilt:
            return 0
        base = int(self.layout.base[self.layout.g + point])
        return max(0, self.layout.floor[point] + max(rebuilt.values()) - base)

    def _lift_now(self, point: int) -> int:
        """:meth:`_lift` of the rebuilds at ``point`` as they are (kept until they change)."""
        lift = self._lifts.get(point)
        if lift is None:
            lift = self._lifts[point] = self._lift(point, self.rebuilds.get(point, {}))
        return lift

    def cost(self) -> float:
        return self.layout.cost(self.moved, self.recompute_ms, self.traffic)

    def peak(self) -> int:
        return int(self.memory.max()) if self.layout.size else 0

    def cost_after(self, changes: dict[int, str]) -> float:
        """:meth:`cost` after ``changes`` (group -> mode): it depends on the modes alone."""
        layout = self.layout
        moved, recompute_ms, traffic = self.moved, self.recompute_ms, self.traffic
        for index, new_mode in changes.items():
            old_mode, n = self.modes[index], layout.nbytes[index]
            if old_mode == new_mode:
                continue
            moved += n * ((new_mode == OFFLOAD) - (old_mode == OFFLOAD))
            recompute_ms += layout.recompute_ms[index] * (
                (new_mode == RECOMPUTE) - (old_mode == RECOMPUTE))
            traffic += n * ((new_mode != KEEP) - (old_mode != KEEP))
        return layout.cost(moved, recompute_ms, traffic)

    def valid_change(self, changes: dict[int, str]) -> bool:
        """Whether ``changes`` (group -> mode) leave every recomputed group's sources not
        offloaded (the changed groups and their readers)."""
        layout, modes = self.layout, self.modes

        def mode_of(index):
            return changes.get(index, modes[index])
        for index, mode in changes.items():
            if mode not in layout.allowed[index]:
                return False
            if mode == RECOMPUTE and any(mode_of(s) == OFFLOAD for s in layout.sources[index]):
                return False
            if mode == OFFLOAD and any(mode_of(r) == RECOMPUTE for r in layout.readers[index]):
                return False
        return True

    def change(self, changes: dict[int, str]):
        """What ``changes`` (group -> mode; :meth:`valid_change`) do: (the memory delta as
        (bytes, first, end) intervals, {backward point: its new lift}, {group: its new rebuild
        point}, the cost's new terms (moved, recompute ms, traffic)); None where a group would
        be rebuilt at a point no plan may rebuild it at (:attr:`Layout.candidates`)."""
        layout, modes, rebuilt = self.layout, self.modes, self.rebuilt
        if len(changes) == 1:
            ((index, mode),) = changes.items()
            old = modes[index]
            if old != RECOMPUTE and mode != RECOMPUTE:
                # neither rebuilt: no rebuild point, its sources' or readers', changes
                n = layout.nbytes[index]
                intervals = [(-b, lo, hi) for b, lo, hi in layout.fixed[index][old]] + \
                    layout.fixed[index][mode]
                moved = self.moved + n * ((mode == OFFLOAD) - (old == OFFLOAD))
                traffic = self.traffic + n * ((mode != KEEP) - (old != KEEP))
                return intervals, {}, {index: None}, (moved, self.recompute_ms, traffic)
        new_points: dict[int, int | None] = {}
        pending = [-index for index in changes]
        heapq.heapify(pending)
        seen = set(changes)
        while pending:   # readers before sources: a source's point depends on its readers'
            index = -heapq.heappop(pending)
            mode = changes.get(index, modes[index])
            point = None
            if mode == RECOMPUTE:
                point = layout.first[index]
                for reader in layout.readers[index]:
                    if changes.get(reader, modes[reader]) == RECOMPUTE:
                        at = new_points.get(reader, rebuilt[reader]) if reader in new_points \
                            else rebuilt[reader]
                        if at is not None and at < point:
                            point = at
            if point is not None and point not in layout.candidates[index]:
                return None        # a chain longer than planner.MAX_CHAIN recipes
            if point != rebuilt[index] or index in changes:
                new_points[index] = point
                for source in layout.sources[index]:
                    if source not in seen:
                        seen.add(source)
                        heapq.heappush(pending, -source)
        intervals = []
        append = intervals.append
        moved, recompute_ms, traffic = self.moved, self.recompute_ms, self.traffic
        rebuilds, g = self.rebuilds, layout.g
        touched: dict[int, dict[int, int]] = {}
        for index, point in new_points.items():
            old_mode = modes[index]
            new_mode = changes.get(index, old_mode)
            old_point = rebuilt[index]
            if old_mode == new_mode and old_point == point:
                continue
            # Layout.spans of the old mode taken away, of the new one added
            fixed, n = layout.fixed[index], layout.nbytes[index]
            for b, lo, hi in fixed[old_mode]:
                append((-b, lo, hi))
            if old_mode == RECOMPUTE:
                append((-n, g + old_point, g + layout.last[index] + 1))
            intervals.extend(fixed[new_mode])
            if new_mode == RECOMPUTE:
                append((n, g + point, g + layout.last[index] + 1))
            if old_point is not None:
                there = touched.get(old_point)
                if there is None:
                    there = touched[old_point] = dict(rebuilds.get(old_point, ()))
                del there[index]
            if point is not None:
                there = touched.get(point)
                if there is None:
                    there = touched[point] = dict(rebuilds.get(point, ()))
                there[index] = layout.transient[index]
            if old_mode != new_mode:
                moved += n * ((new_mode == OFFLOAD) - (old_mode == OFFLOAD))
                recompute_ms += layout.recompute_ms[index] * (
                    (new_mode == RECOMPUTE) - (old_mode == RECOMPUTE))
                traffic += n * ((new_mode != KEEP) - (old_mode != KEEP))
        lifts = {}
        for point, there in touched.items():
            lift = self._lift(point, there) - self._lift_now(point)
            if lift:
                append((lift, g + point, g + point + 1))
            lifts[point] = there
        return intervals, lifts, new_points, (moved, recompute_ms, traffic)

    def simulated_ms(self, changes: dict[int, str], evaluated) -> float:
        """:func:`planner.simulate`'s step after ``changes`` (``evaluated``: :meth:`change`'s),
        from the layout's points and the rebuild points the change leaves."""
        layout = self.layout
        modes = list(self.modes)
        for index, mode in changes.items():
            modes[index] = mode
        rebuilt = list(self.rebuilt)
        for index, point in evaluated[2].items():
            rebuilt[index] = point
        return model.simulate(layout.profile, modes, layout.lookahead, layout.prefetch_margin,
                              (layout.release, layout.prefetch, rebuilt)).step_ms

    def excess(self, target: int) -> int:
        """The bytes above ``target``, summed over the step's points."""
        return int(self._excess_prefix(target)[-1])

    def _excess_prefix(self, target: int) -> np.ndarray:
        """The running sum of the bytes above ``target`` over the points (0 first), kept until
        the memory changes."""
        cached = self._prefix
        if cached is None or cached[0] != target:
            over = self.memory - target
            np.maximum(over, 0, out=over)
            cached = self._prefix = (target, np.concatenate(([0], np.cumsum(over))))
        return cached[1]

    def excess_change(self, intervals, target: int) -> int:
        """What the memory delta ``intervals`` ((bytes, first, end) of :meth:`change`) do to
        :meth:`excess`: evaluated on the pieces of points where their sum is not zero (a change
        of mode adds and takes away its group's bytes over mostly the same points), the excess
        there before from the running sum."""
        bounds: dict[int, int] = {}
        for n, a, b in intervals:
            if a < b and n:
                bounds[a] = bounds.get(a, 0) + n
                bounds[b] = bounds.get(b, 0) - n
        if not bounds:
            return 0
        prefix = self._excess_prefix(target)
        memory = self.memory
        changed = delta = 0
        previous = 0
        for point in sorted(bounds):
            if delta:
                before = int(prefix[point] - prefix[previous])
                # where bytes are freed and nothing was over the target, nothing is after
                if delta > 0 or before:
                    after = memory[previous:point] + (delta - target)
                    changed += int(np.maximum(after, 0, out=after).sum()) - before
            delta += bounds[point]
            previous = point
        return changed

    def window(self, intervals) -> tuple[int, np.ndarray]:
        """(first point, the memory from there to the last point ``intervals`` touch, with
        them applied)."""
        lo = min((i[1] for i in intervals), default=0)
        hi = max((i[2] for i in intervals), default=0)
        memory = self.memory[lo:hi].copy()
        for n, a, b in intervals:
            if a < b:
                memory[a - lo:b - lo] += n
        return lo, memory

    def apply(self, changes: dict[int, str], evaluated=None) -> None:
        intervals, lifts, new_points, terms = evaluated or self.change(changes)
        self._prefix = None
        for n, a, b in intervals:
            if a < b:
                self.memory[a:b] += n
        for index, mode in changes.items():
            self.modes[index] = mode
        for index, point in new_points.items():
            self.rebuilt[index] = point
        for point, there in lifts.items():
            self._lifts.pop(point, None)
            if there:
                self.rebuilds[point] = there
            else:
                self.rebuilds.pop(point, None)
        self.moved, self.recompute_ms, self.traffic = terms
