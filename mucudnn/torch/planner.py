"""Keep, offload or recompute: one choice per saved tensor, minimising the predicted step time with
the modelled peak memory within a budget (docs/torch.md, "The planner").

This module is the model (pure Python, no torch): the runtime records a :class:`StepProfile`;
here are its liveness, memory, step time and simulation. The choosers live beside it and import
it: planning.py (:func:`plan_offload`, :func:`plan_with_prefetch`,
:func:`trial_plans`, :func:`polished`, :func:`least_peak`), planner_fast.py (the default
method), planner_ilp.py (the ILP, CBC: the reference), planner_stage.py (staged steps).
Everything is indexed by two clocks of one training step:

- *forward points* ``0..G-1``: the first pack of saved group ``g`` happens at forward point ``g``
  (groups are numbered in the order the forward first saves them);
- *backward points* ``0..U-1``: the ``i``-th unpack of the backward (every unpack counts).

A group is one tensor saved for backward, however many ops save it. Its bytes are on the device:

- kept: from its forward point through the end of the forward and the backward up to its last
  unpack;
- offloaded: from its forward point through its release point (:func:`release_point`: the
  first later forward point by whose recorded time its copy to the host is done,
  ``release_margin`` copy times after it was made, or the end of the forward; there the runtime
  has the compute stream wait for the copy and lets the memory go, so the caching allocator sees
  the same frees in the same order at every step, however far the host runs ahead of the
  device), then again from
  its prefetch point (:func:`prefetch_point`: ``lookahead`` unpacks before its first unpack, or
  earlier where the recorded backward clock says the copy needs longer) to its last unpack;
- recomputed: at its forward point and the next one (the forward's own use), then from the point
  it is rebuilt to its last unpack, plus there what its rebuild allocates (its recipe's outputs
  that are not in place, as recorded: :attr:`SavedGroup.transient`; the largest of those rebuilt
  at one point). Its recipe reads its source groups (a residual add reads
  two), each kept or itself recomputed, and each stays on the device through the recomputed
  group's last unpack. A group is rebuilt at its first unpack, or earlier when a recomputed
  reader is rebuilt first (:func:`rebuild_points`: rebuilding a reader rebuilds its recomputed
  sources first, as ``torch.utils.checkpoint`` reruns a whole segment from its kept input).

Peak memory at a point is the measured baseline there (everything that is not a saved group:
parameters, gradients, the op's own inputs, outputs and workspace, as the recorded step's peak
between this point and the next shows it) plus the live groups' bytes.

Predicted step time (the host-link bound, vDNN's model): ``max(F, offloaded bytes / d2h) +
max(B + recompute time, offloaded bytes / h2d)``, with F and B the forward and backward compute
times. It is exact when copies overlap compute perfectly and a lower bound otherwise. To it comes
the profile's ``copy_exposure`` times the copies' time both ways: the share of copy time the step
shows beyond that bound (measured: see :data:`COPY_EXPOSURE`). Without
prefetch (lookahead 0: :func:`plan_with_prefetch` when prefetching does not fit) the backward
term is ``B + recompute time + offloaded bytes / h2d``.

That time is the program's objective, linear in the choices. A plan's copies also queue: one
stream per direction, in the order their tensors were made, so a copy can end long after its
tensor, and the compute stream then waits for it at a release point or a first unpack.
:func:`simulate` plays a plan on the recorded clocks with those queues (its
:attr:`OffloadPlan.simulated_ms`), and :func:`trial_plans` uses it to choose which other plans
the runtime tries against the one made.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections import defaultdict
from dataclasses import dataclass, field, replace
from typing import Mapping, Sequence

from ..sizes import describe_size

KEEP, OFFLOAD, RECOMPUTE = "keep", "offload", "recompute"
MODES = (KEEP, OFFLOAD, RECOMPUTE)
#: a prefetch is issued this many copy times before its first unpack: the backward clock is the
#: recording step's, and other fetches may share the link, so a copy is given more than its time
PREFETCH_MARGIN = 1.5
#: an offloaded group's device memory goes this many copy times after its forward point: the
#: copies to the host queue on one stream, so a copy can start after its tensor is made
RELEASE_MARGIN = 1.5
#: the share of its copies' time (both ways) that offloading adds beyond the host-link bound:
#: without it the model takes overlapped copies as free and picks them over recomputation that
#: costs less (its measurement: benchmarks/results/offload)
COPY_EXPOSURE = 0.6
#: steps an ``OffloadSession`` records before it plans; the profile takes each time as the
#: least of them (:func:`least_times`): the first recording pins the host pool, and a recording
#: whose host fell behind stretches its times, so the least of two is the device's time
#: (benchmarks/results/offload)
RECORD_STEPS = 2
#: the least headroom (share of the budget) a session plans with where no plan meets its own
#: (``OffloadSession._plan_with_less_headroom``, halving it): below it the caching allocator's
#: fragmentation has no room
LEAST_HEADROOM = 0.025
#: planned steps each plan runs where the session tries more than one (:func:`trial_plans`):
#: the first settles the caching allocator, the others are timed
TRIAL_STEPS = 3
#: after its trial, the plan in force is watched: once WATCH_FLUSHING of its last WATCH_STEPS
#: planned steps flushed the caching allocator's cache, the session plans for less
#: (``OffloadSession._plan_below_flushes``): a trial's steps do not see every flush to come
WATCH_STEPS = 4
WATCH_FLUSHING = 2
#: the shares of the session's headroom (room for the allocator's fragmentation) for which
#: :func:`trial_plans` makes plans besides the plan made for the whole one: a smaller headroom
#: is a cheaper plan the allocator may have room for (benchmarks/results/pressure)
TRIAL_HEADROOM_SHARES = (0.5,)
#: a kept group of at most this share of the profile's largest group is copied apart from the
#: step's large short-lived tensors under a plan run with :attr:`OffloadPlan.keep_apart`
#: (:func:`kept_apart`): small kept tensors would split the holes the large ones leave, while
#: copies of larger groups, made while their originals still live, flush the cache themselves
KEEP_APART_SHARE = 0.25
#: the most plans :func:`trial_plans` makes to run against the plan made (one a budget)
TRIAL_MADE = 1 + len(TRIAL_HEADROOM_SHARES)
#: the most plans one trial runs: the plan made, :func:`trial_plans`' and the fastest of them with
#: its small kept groups apart
TRIAL_PLANS = 1 + TRIAL_MADE + 1
#: the copy exposures besides the profile's at which :func:`trial_plans` makes other plans: the
#: exposure is one share for every copy, where a copy's true cost is its wait in its queue, so
#: the simulated best plan is made at different exposures on different steps
TRIAL_EXPOSURES = (0.0, 0.2)
#: the least simulated gain (a share of the best plan's simulated step) for which a plan is
#: tried: a trial of plans that differ by less measures noise
TRIAL_MIN_GAIN = 0.005
#: the least predicted gain (a share of the lower plan's step) for which a lowering after flushes
#: stops a quarter of the headroom short (``OffloadSession._nearer_lowering``): less room than
#: asked for, so only for a step in the plans' time, not for the noise between neighbouring plans
LOWERING_MIN_GAIN = 0.05
#: CBC's limit per solve for :func:`trial_plans`' plans made by the ILP (``method="ilp"``): a
#: trial's plan need not be proven optimal, only good enough to be tried
TRIAL_SOLVE_S = 5.0
#: the most recipes one rebuild may chain in a plan (a recomputed group whose recipe reads a
#: recomputed group rebuilds that one first, and so on): enough for a ResNet bottleneck's output
#: to rebuild its block back to the first convolution's output (5), and a bound on the ILP's
#: rebuild candidates, which grow with it
MAX_CHAIN = 5


@dataclass(frozen=True)
class SavedGroup:
    """One tensor saved for backward (all packs of the same tensor)."""

    nbytes: int
    first_unpack: int              # backward point of its first unpack
    last_unpack: int               # backward point of its last unpack (>= first_unpack)
    producer: str = ""             # the module (or op) that made it, for reports
    offloadable: bool = True
    recompute_ms: float | None = None  # None: no recipe (not produced by a cheap chain)
    #: the groups the recipe reads, each to be kept (a tuple; an int, one group, is read as such)
    recompute_source: tuple[int, ...] | int | None = None
    #: the most a rebuild allocates, the group itself included (its recipe's outputs and
    #: workspace; None: ``nbytes``, the group alone)
    rebuild_bytes: int | None = None

    @property
    def transient(self) -> int:
        """What a rebuild allocates beyond the group, which then stays (and is counted live
        from its rebuild point): a convolution's workspace, a chain's intermediate outputs."""
        return max(0, (self.nbytes if self.rebuild_bytes is None else self.rebuild_bytes)
                   - self.nbytes)

    def __post_init__(self):
        source = self.recompute_source
        if source is not None:
            object.__setattr__(self, "recompute_source",
                               (source,) if isinstance(source, int) else tuple(source))


@dataclass
class StepProfile:
    """What one recorded training step says (see the module docstring for the clocks)."""

    groups: list[SavedGroup]
    forward_ms: float
    backward_ms: float
    d2h_gbps: float
    h2d_gbps: float
    unpacks: int                   # U, backward points
    baseline_forward: list[int] = field(default_factory=list)   # bytes at each forward point
    baseline_backward: list[int] = field(default_factory=list)  # bytes at each backward point
    # compute ms from the backward's start to each backward point (non-decreasing); empty:
    # ``backward_ms`` spread evenly over the points
    backward_clock: list[float] = field(default_factory=list)
    copy_exposure: float = 0.0      # see the module docstring (the runtime: COPY_EXPOSURE)
    # compute ms from the forward's start (its first pack, or where a staged chain began before
    # it) to each forward point (non-decreasing), as ``forward_ms``; empty: untimed (an
    # offloaded group leaves the device at the next point: :func:`release_point`)
    forward_clock: list[float] = field(default_factory=list)
    #: :func:`release_point`'s margin for plans made on this profile (a planning choice, not
    #: recorded: :func:`plan_with_prefetch` lowers it to 0 where no plan fits otherwise)
    release_margin: float = RELEASE_MARGIN
    #: bytes at each backward point when its unpack runs, before the node that unpacked runs
    #: (its outputs and workspace are not there yet; saved groups left out, as in the
    #: baselines): what a rebuild there allocates on top of. Empty: the baseline (a bound)
    floor_backward: list[int] = field(default_factory=list)

    def floor(self, point: int) -> int:
        """:attr:`floor_backward` at backward ``point``, or its baseline where not recorded."""
        return (self.floor_backward or self.baseline_backward)[point]

    def __post_init__(self):
        g = len(self.groups)
        self.baseline_forward = list(self.baseline_forward) or [0] * g
        self.baseline_backward = list(self.baseline_backward) or [0] * self.unpacks
        self.backward_clock = list(self.backward_clock) or [
            self.backward_ms * t / max(self.unpacks, 1) for t in range(self.unpacks)]
        self.forward_clock = list(self.forward_clock)
        for name, clock, points in (("backward", self.backward_clock, self.unpacks),
                                    ("forward", self.forward_clock or [0.0] * g, g)):
            if len(clock) != points or any(b < a for a, b in zip(clock, clock[1:])):
                raise ValueError(f"{name} clock: {len(clock)} non-decreasing times "
                                 f"for {points} {name} points expected")
        self.floor_backward = list(self.floor_backward)
        if len(self.baseline_forward) != g or len(self.baseline_backward) != self.unpacks or \
                len(self.floor_backward) not in (0, self.unpacks):
            raise ValueError(f"baselines: {len(self.baseline_forward)} forward points for {g} "
                             f"groups, {len(self.baseline_backward)} backward points and "
                             f"{len(self.floor_backward)} floors for {self.unpacks} unpacks")
        for index, group in enumerate(self.groups):
            if not 0 <= group.first_unpack <= group.last_unpack < max(self.unpacks, 1):
                raise ValueError(f"group {index}: unpacks {group.first_unpack}.."
                                 f"{group.last_unpack} outside 0..{self.unpacks - 1}")
            if any(not 0 <= source < index for source in group.recompute_source or ()):
                raise ValueError(f"group {index}: recompute sources {group.recompute_source} "
                                 "are not all earlier groups")


@dataclass(frozen=True)
class OffloadPlan:
    """The choice per group, with what the model predicts for it."""

    modes: tuple[str, ...]
    lookahead: int
    peak: int
    step_ms: float
    moved_bytes: int               # each way
    prefetch_margin: float = 0.0   # prefetch_point's: copy times of its prefetches' lead
    #: per group, the forward point where an offloaded one leaves the device (-1: not offloaded)
    releases: tuple[int, ...] = ()
    release_margin: float = RELEASE_MARGIN   # the profile's it was made with
    #: :func:`simulate`'s step time (None: not simulated)
    simulated_ms: float | None = None
    #: the budget it was made for (0: unknown; not what it is, so no part of equality)
    target: int = field(default=0, compare=False)
    #: the runtime copies its small kept groups apart from the step's large tensors
    #: (``OffloadSession._keeps_apart``; how it is run, so no part of equality)
    keep_apart: bool = field(default=False, compare=False)

    @property
    def predicted_ms(self) -> float:
        """Its step as predicted: :func:`simulate`'s where simulated, else the model's."""
        return self.step_ms if self.simulated_ms is None else self.simulated_ms

    def count(self, mode: str) -> int:
        return sum(1 for m in self.modes if m == mode)

    def describe(self) -> str:
        return (f"{self.count(KEEP)} kept, {self.count(OFFLOAD)} offloaded "
                f"({describe_size(self.moved_bytes)} each way), {self.count(RECOMPUTE)} "
                f"recomputed; predicted peak {describe_size(self.peak)}, step {self.step_ms:.1f} ms"
                + (f" ({self.simulated_ms:.1f} ms with its copies queued)"
                   if self.count(OFFLOAD) and self.simulated_ms is not None else "")
                + (f"; prefetch {self.lookahead} unpacks ahead" if self.count(OFFLOAD) else "")
                + (f" or {self.prefetch_margin:g} copy times"
                   if self.count(OFFLOAD) and self.prefetch_margin else "")
                + ("; each offload released at the next point" if self.count(OFFLOAD)
                   and self.release_margin == 0 else "")
                + ("; small kept groups apart" if self.keep_apart else ""))


def planning_target(budget: int, headroom: float) -> int:
    """What a plan is made for under ``budget``: less ``headroom`` of it, room for the caching
    allocator's fragmentation (the runtime's and an off-GPU replay's alike)."""
    return int(budget * (1 - headroom))


def trial_budgets(budget: int, headroom: float) -> list[int]:
    """The larger targets :func:`trial_plans` tries beside the plan for
    :func:`planning_target`: ``budget`` less each :data:`TRIAL_HEADROOM_SHARES` of ``headroom``
    (none without a headroom)."""
    return [planning_target(budget, headroom * share) for share in TRIAL_HEADROOM_SHARES] \
        if headroom else []


def smaller_headrooms(budget: int, headroom: float,
                      least_peak: int | None = None) -> list[tuple[float, int]]:
    """(headroom, target) to plan for where no plan meets :func:`planning_target` at
    ``headroom``: half of it, a quarter, ... down to :data:`LEAST_HEADROOM`, leaving out the
    targets below ``least_peak`` (the least peak any plan reaches, where known: no plan meets
    them), for the runtime and an off-GPU replay alike."""
    ladder, share = [], headroom / 2
    while share >= LEAST_HEADROOM:
        target = planning_target(budget, share)
        if least_peak is None or target >= least_peak:
            ladder.append((share, target))
        share /= 2
    return ladder



def profile_from_dict(fields: Mapping) -> StepProfile:
    """The :class:`StepProfile` whose ``dataclasses.asdict`` is ``fields`` (what
    ``OffloadSession(profile_to=...)`` and benchmarks/offload.py's rows keep): the planner replayed
    on a recorded step off the GPU. ValueError (naming the field) for fields that are not one."""
    try:
        groups = [SavedGroup(**group) for group in fields["groups"]]
        return StepProfile(**{**fields, "groups": groups})
    except KeyError as exc:
        raise ValueError(f"not a recorded profile: no {exc.args[0]!r}") from None
    except TypeError as exc:  # an unknown or missing field
        raise ValueError(f"not a recorded profile: {exc}") from None


def least_times(profiles: Sequence[StepProfile]) -> StepProfile:
    """The last of ``profiles`` (recordings of the same step, in order) with each of its times
    the least any of them recorded: a host that falls behind the device (pinning memory, the
    interpreter) leaves the device idle between a recording's marks, which stretches that
    recording's times there and never shortens them. A clock takes the least time between each
    two points; a recipe's time, the least of the recordings that timed the same recipe. Its
    memory stays the last recording's; a recording of other tensors (by count or size) is left
    out."""
    last = profiles[-1]
    alike = [p for p in profiles if p.unpacks == last.unpacks and len(p.groups) == len(
        last.groups) and all(a.nbytes == b.nbytes for a, b in zip(p.groups, last.groups))]

    def least_clock(clocks: list[list[float]]) -> list[float]:
        clocks = [clock for clock in clocks if clock]
        if len(clocks) < 2:
            return list(clocks[-1]) if clocks else []
        gaps = [min(clock[i] - clock[i - 1] for clock in clocks)
                for i in range(1, len(clocks[0]))]
        return list(itertools.accumulate(gaps, initial=min(clock[0] for clock in clocks)))

    groups = []
    for index, group in enumerate(last.groups):
        times = [p.groups[index].recompute_ms for p in alike
                 if p.groups[index].recompute_source == group.recompute_source
                 and p.groups[index].recompute_ms is not None]
        groups.append(group if group.recompute_ms is None else
                      replace(group, recompute_ms=min(times)))
    return replace(
        last, groups=groups, forward_ms=min(p.forward_ms for p in alike),
        backward_ms=min(p.backward_ms for p in alike),
        d2h_gbps=max(p.d2h_gbps for p in alike), h2d_gbps=max(p.h2d_gbps for p in alike),
        forward_clock=least_clock([p.forward_clock for p in alike]),
        backward_clock=least_clock([p.backward_clock for p in alike]))


def allowed_modes(group: SavedGroup) -> tuple[str, ...]:
    return (KEEP,) + ((OFFLOAD,) if group.offloadable else ()) + \
        ((RECOMPUTE,) if group.recompute_ms is not None and group.recompute_source else ())


def prefetch_point(profile: StepProfile, index: int, lookahead: int,
                   prefetch_margin: float = PREFETCH_MARGIN) -> int:
    """The backward point at which offloaded group ``index`` is fetched: ``lookahead`` unpacks
    before its first unpack, or earlier where the recorded backward between them is shorter than
    its copy (``prefetch_margin`` times ``nbytes / h2d``; 0: untimed): the fetch starts once the
    compute stream reaches that point, and must end before the first unpack. ``lookahead`` 0: at
    its first unpack."""
    group = profile.groups[index]
    if lookahead <= 0:
        return group.first_unpack
    clock = profile.backward_clock
    need = prefetch_margin * transfer_ms(group.nbytes, profile.h2d_gbps)
    timed = bisect.bisect_right(clock, clock[group.first_unpack] - need) - 1
    return max(0, min(group.first_unpack - lookahead, timed))


def release_point(profile: StepProfile, index: int, release_margin: float | None = None) -> int:
    """The forward point at which offloaded group ``index`` leaves the device: the first later
    one whose recorded time is at least ``release_margin`` (default the profile's) copy times
    (``nbytes / d2h``) after the group's own, else the number of groups (the end of the forward:
    the first unpack). It is on the device through that point (the op that made that point's
    group ran while it was there). ``release_margin`` 0, or a profile without a forward clock:
    the next point (the compute stream then waits there for what is left of the copy)."""
    release_margin = profile.release_margin if release_margin is None else release_margin
    clock = profile.forward_clock
    if not clock:
        return index + 1
    copy_ms = transfer_ms(profile.groups[index].nbytes, profile.d2h_gbps)
    due = clock[index] + release_margin * copy_ms
    return max(index + 1, bisect.bisect_left(clock, due, lo=index + 1))


def readers(profile: StepProfile) -> list[list[int]]:
    """Per group, the groups whose recipe reads it (all later groups)."""
    found: list[list[int]] = [[] for _ in profile.groups]
    for index, group in enumerate(profile.groups):
        for source in group.recompute_source or ():
            found[source].append(index)
    return found


def rebuild_points(profile: StepProfile, modes: Sequence[str]) -> list[int | None]:
    """Per group, the backward point at which the runtime rebuilds it (None: not recomputed): its
    first unpack, or the point of a recomputed reader's rebuild where that comes first."""
    points: list[int | None] = [None] * len(profile.groups)
    reading = readers(profile)
    for index in reversed(range(len(profile.groups))):   # readers come after their sources
        if modes[index] == RECOMPUTE:
            points[index] = min([profile.groups[index].first_unpack] + [
                points[r] for r in reading[index] if modes[r] == RECOMPUTE])
    return points


def rebuild_candidates(profile: StepProfile) -> list[list[int]]:
    """Per group that may be recomputed, the points at which a plan may rebuild it (ascending):
    its first unpack, and each earlier point at which a recomputed reader at most
    :data:`MAX_CHAIN` recipes away may be rebuilt; [] for the others."""
    depths: list[dict[int, int]] = [{} for _ in profile.groups]
    reading = readers(profile)
    for index in reversed(range(len(profile.groups))):
        group = profile.groups[index]
        if RECOMPUTE not in allowed_modes(group):
            continue
        points = {group.first_unpack: 0}
        for reader in reading[index]:
            for point, depth in depths[reader].items():
                if point < group.first_unpack and depth < MAX_CHAIN:
                    points[point] = min(points.get(point, MAX_CHAIN), depth + 1)
        depths[index] = points
    return [sorted(points) for points in depths]


def live_points(profile: StepProfile, index: int, mode: str, lookahead: int,
                prefetch_margin: float = PREFETCH_MARGIN, rebuilt: int | None = None,
                release_margin: float | None = None) -> tuple[range, range]:
    """(forward points, backward points) at which group ``index`` is on the device in ``mode``;
    ``rebuilt``: where a recomputed one is rebuilt (default its first unpack);
    ``prefetch_margin``: :func:`prefetch_point`'s, ``release_margin``: :func:`release_point`'s."""
    group, g = profile.groups[index], len(profile.groups)
    if mode == KEEP:
        return range(index, g), range(0, group.last_unpack + 1)
    forward = range(index, min(index + 2, g))
    if mode == OFFLOAD:
        forward = range(index, min(release_point(profile, index, release_margin) + 1, g))
        start = prefetch_point(profile, index, lookahead, prefetch_margin)
    else:
        start = group.first_unpack if rebuilt is None else rebuilt
    return forward, range(start, group.last_unpack + 1)


def contributions(profile: StepProfile, index: int, mode: str, lookahead: int,
                  prefetch_margin: float = PREFETCH_MARGIN, rebuilt: int | None = None
                  ) -> list[tuple[int, range, range]]:
    """(bytes, forward points, backward points) that choosing ``mode`` for group ``index`` puts on
    the device: its own liveness and, when recomputed (``rebuilt`` as :func:`live_points`), each
    source held past that source's own last unpack. Rebuilding also needs a transient
    (:func:`transients`)."""
    group = profile.groups[index]
    f_points, b_points = live_points(profile, index, mode, lookahead, prefetch_margin, rebuilt)
    added = [(group.nbytes, f_points, b_points)]
    if mode == RECOMPUTE:
        for source in (profile.groups[s] for s in group.recompute_source):
            if group.last_unpack > source.last_unpack:
                added.append((source.nbytes, range(0),
                              range(source.last_unpack + 1, group.last_unpack + 1)))
    return added


def plan_contributions(profile: StepProfile, modes: Sequence[str], lookahead: int,
                       prefetch_margin: float = PREFETCH_MARGIN
                       ) -> list[list[tuple[int, range, range]]]:
    """Per group, :func:`contributions` of its mode in ``modes``, rebuilt where the runtime
    rebuilds it (:func:`rebuild_points`)."""
    rebuilt = rebuild_points(profile, modes)
    return [contributions(profile, index, mode, lookahead, prefetch_margin, rebuilt[index])
            for index, mode in enumerate(modes)]


def transients(profile: StepProfile, modes: Sequence[str]) -> dict[int, tuple[int, int]]:
    """Backward point -> (bytes, group): the most a rebuild there needs beside the groups it
    rebuilds: the largest :attr:`SavedGroup.transient` of those rebuilt there (a recipe's
    outputs, or the copy of an in-place module's input). Recipes run one after another, so only
    the largest counts."""
    found: dict[int, tuple[int, int]] = {}
    for index, point in enumerate(rebuild_points(profile, modes)):
        if point is not None:
            found[point] = max(found.get(point, (0, -1)), (profile.groups[index].transient, index))
    return found


def memory_at_points(profile: StepProfile, modes: Sequence[str], lookahead: int,
                     prefetch_margin: float = PREFETCH_MARGIN) -> tuple[list[int], list[int]]:
    """The modelled bytes at each (forward point, backward point) under ``modes``: at a backward
    point the live groups and the more of its baseline (the node's own peak) and of its floor
    with what the rebuilds there allocate (they run at the unpack, before the node)."""
    forward = list(profile.baseline_forward)
    backward = list(profile.baseline_backward)
    for point, (nbytes, _) in transients(profile, modes).items():
        backward[point] = max(backward[point], profile.floor(point) + nbytes)
    for added in plan_contributions(profile, modes, lookahead, prefetch_margin):
        for nbytes, f_points, b_points in added:
            for t in f_points:
                forward[t] += nbytes
            for t in b_points:
                backward[t] += nbytes
    return forward, backward


def peak_memory(profile: StepProfile, modes: Sequence[str], lookahead: int,
                prefetch_margin: float = PREFETCH_MARGIN) -> int:
    """The modelled peak of ``modes`` (one per group)."""
    forward, backward = memory_at_points(profile, modes, lookahead, prefetch_margin)
    return max(forward + backward, default=0)


def step_time(profile: StepProfile, modes: Sequence[str], lookahead: int = 2) -> float:
    """Predicted step time (ms) of ``modes``: see the module docstring. Without prefetch
    (``lookahead`` 0) the backward waits for every fetch: no overlap."""
    moved = sum(g.nbytes for g, m in zip(profile.groups, modes, strict=True) if m == OFFLOAD)
    recompute = math.fsum(g.recompute_ms for g, m in zip(profile.groups, modes, strict=True)
                          if m == RECOMPUTE)
    backward = profile.backward_ms + recompute
    fetch = transfer_ms(moved, profile.h2d_gbps)
    offload = transfer_ms(moved, profile.d2h_gbps)
    return (max(profile.forward_ms, offload)
            + (backward + fetch if lookahead == 0 else max(backward, fetch))
            + profile.copy_exposure * (offload + fetch))


@dataclass(frozen=True)
class SimulatedStep:
    """:func:`simulate`'s account of one step (ms)."""

    step_ms: float
    forward_wait_ms: float     # the compute stream waiting for copies to the host
    backward_wait_ms: float    # waiting for fetches
    recompute_ms: float


def simulate(profile: StepProfile, modes: Sequence[str], lookahead: int,
             prefetch_margin: float = PREFETCH_MARGIN, points=None) -> SimulatedStep:
    """The step ``modes`` run as the runtime carries them out, on the recorded clocks: the
    compute stream runs the forward and the backward as recorded, plus each recomputed group's
    recipe where it is rebuilt (:func:`rebuild_points`). Copies to the host queue on one stream
    in the order their groups were made, each starting at its forward point at the earliest; at
    a group's release point (:func:`release_point`; the end of the forward: the first unpack)
    the compute stream waits for its copy. Fetches queue on the other stream, each issued when
    the compute stream reaches its prefetch point (:func:`prefetch_point`; of those issued at
    one point the one needed there first, then in the order they were saved, as the runtime
    issues them) and not before its own copy to the host ended; at a group's first unpack the
    compute stream waits for its fetch. Every wait delays all later compute. Its assumptions:
    copies at the measured link speeds whatever else runs, compute as recorded (no host time, no
    slower kernels for less workspace, no allocator flushes); how near measured steps come is in
    benchmarks/results/pressure.

    ``points``: (release points, prefetch points, rebuild points), per group, where the caller
    has them (planner_fast.Layout's and its state's, for many plans of one profile): the same
    as :func:`release_point`, :func:`prefetch_point` and :func:`rebuild_points` give."""
    groups, g = profile.groups, len(profile.groups)
    if points is None:
        points = ([release_point(profile, i) if m == OFFLOAD else None
                   for i, m in enumerate(modes)],
                  [prefetch_point(profile, i, lookahead, prefetch_margin) if m == OFFLOAD
                   else None for i, m in enumerate(modes)],
                  rebuild_points(profile, modes))
    releases, prefetches, rebuilt_at = points
    forward_clock = profile.forward_clock or [0.0] * g
    due = defaultdict(list)        # forward point -> offloaded groups released there
    for index, mode in enumerate(modes):
        if mode == OFFLOAD:
            due[releases[index]].append(index)
    copied: dict[int, float] = {}  # group -> when its copy to the host ends
    shift = forward_wait = queue = 0.0

    def wait_for(index: int, now: float) -> float:
        return max(0.0, copied[index] - now)
    # only points where a copy is due or starts change the clocks' shift
    for point in sorted(set(due).union(i for i, m in enumerate(modes) if m == OFFLOAD)):
        if point >= g:
            continue
        now = forward_clock[point] + shift
        waited = max((wait_for(index, now) for index in due.get(point, ())), default=0.0)
        shift, forward_wait, now = shift + waited, forward_wait + waited, now + waited
        if modes[point] == OFFLOAD:
            queue = max(now, queue) + transfer_ms(groups[point].nbytes, profile.d2h_gbps)
            copied[point] = queue
    forward_end = profile.forward_ms + shift
    waited = max((wait_for(index, forward_end) for index in due.get(g, ())), default=0.0)
    forward_end, forward_wait = forward_end + waited, forward_wait + waited

    fetches, rebuilds, needed = defaultdict(list), defaultdict(list), defaultdict(list)
    for index, mode in enumerate(modes):
        if mode == OFFLOAD:
            fetches[prefetches[index]].append(index)
            needed[groups[index].first_unpack].append(index)
    for index, point in enumerate(rebuilt_at):
        if point is not None:
            rebuilds[point].append(index)
    fetched: dict[int, float] = {}
    shift = backward_wait = recompute = 0.0
    queue = forward_end
    # only points where a fetch is issued or needed, or a group rebuilt, change the shift (a
    # fetch is issued at or before its first unpack: fetched by the time it is needed)
    for point in sorted(set(fetches) | set(needed) | set(rebuilds)):
        now = forward_end + profile.backward_clock[point] + shift
        # the runtime's order: the one needed at this point, then in the order they were saved
        for index in sorted(fetches.get(point, ()),
                            key=lambda i: (groups[i].first_unpack != point, i)):
            queue = max(now, queue, copied[index]) + transfer_ms(groups[index].nbytes,
                                                                 profile.h2d_gbps)
            fetched[index] = queue
        waited = max((fetched[index] - now for index in needed.get(point, ())), default=0.0)
        waited = max(0.0, waited)
        rebuilt = math.fsum(groups[index].recompute_ms for index in rebuilds.get(point, ()))
        shift += waited + rebuilt
        backward_wait += waited
        recompute += rebuilt
    return SimulatedStep(forward_end + profile.backward_ms + shift, forward_wait, backward_wait,
                         recompute)


def transfer_ms(nbytes: int, gbps: float) -> float:
    """Milliseconds to move ``nbytes`` at ``gbps`` GB/s."""
    return nbytes / (gbps * 1e9) * 1e3 if nbytes else 0.0


def valid(profile: StepProfile, modes: Sequence[str]) -> bool:
    """Each mode allowed for its group, and every recomputed group's sources kept or recomputed."""
    for group, mode in zip(profile.groups, modes, strict=True):
        if mode not in allowed_modes(group):
            return False
        if mode == RECOMPUTE and any(modes[s] == OFFLOAD for s in group.recompute_source):
            return False
    return True


def _result(profile: StepProfile, modes: Sequence[str], lookahead: int,
            prefetch_margin: float = PREFETCH_MARGIN) -> OffloadPlan:
    moved = sum(g.nbytes for g, m in zip(profile.groups, modes, strict=True) if m == OFFLOAD)
    releases = tuple(release_point(profile, index) if mode == OFFLOAD else -1
                     for index, mode in enumerate(modes))
    peak = peak_memory(profile, modes, lookahead, prefetch_margin)
    return OffloadPlan(tuple(modes), lookahead, peak,
                       step_time(profile, modes, lookahead), moved, prefetch_margin, releases,
                       profile.release_margin,
                       simulate(profile, modes, lookahead, prefetch_margin).step_ms)


def brute_force(profile: StepProfile, budget: int, lookahead: int = 2,
                prefetch_margin: float = PREFETCH_MARGIN) -> OffloadPlan | None:
    """The optimum by enumeration (small profiles: tests); None when nothing fits."""
    best = None
    for modes in itertools.product(*(allowed_modes(g) for g in profile.groups)):
        if (not valid(profile, modes)
                or peak_memory(profile, modes, lookahead, prefetch_margin) > budget):
            continue
        candidate = _result(profile, modes, lookahead, prefetch_margin)
        if best is None or candidate.step_ms < best.step_ms - 1e-9:
            best = candidate
    return best



def kept_apart(profile: StepProfile, modes: Sequence[str]) -> list[int]:
    """The groups a plan of ``modes`` run with :attr:`OffloadPlan.keep_apart` copies apart: kept,
    dense (offloadable) and at most :data:`KEEP_APART_SHARE` of the largest group's bytes."""
    largest = max((g.nbytes for g in profile.groups), default=0)
    return [index for index, (group, mode) in enumerate(zip(profile.groups, modes))
            if mode == KEEP and group.offloadable and group.nbytes <= largest * KEEP_APART_SHARE]



def _same_plan(a: OffloadPlan, b: OffloadPlan) -> bool:
    return ((a.modes, a.lookahead, a.prefetch_margin, a.releases)
            == (b.modes, b.lookahead, b.prefetch_margin, b.releases))



def peak_point(profile: StepProfile, modes: Sequence[str], lookahead: int,
               prefetch_margin: float = PREFETCH_MARGIN
               ) -> tuple[str, int, int, list[tuple[int, int]]]:
    """Where ``modes`` reach their modelled peak (the first such point, forward before backward):
    (``"forward"`` or ``"backward"``, the point, its baseline bytes, and (bytes, group) of every
    saved group on the device there, largest first)."""
    forward, backward = memory_at_points(profile, modes, lookahead, prefetch_margin)
    peak = max(forward + backward)
    clock = "forward" if peak in forward else "backward"
    point = (forward if clock == "forward" else backward).index(peak)
    baseline = (profile.baseline_forward if clock == "forward"
                else profile.baseline_backward)[point]
    there = defaultdict(int)
    for index, added in enumerate(plan_contributions(profile, modes, lookahead, prefetch_margin)):
        for nbytes, f_points, b_points in added:
            if point in (f_points if clock == "forward" else b_points):
                there[index] += nbytes
    rebuilding = transients(profile, modes) if clock == "backward" else {}
    if point in rebuilding and profile.floor(point) + rebuilding[point][0] > baseline:
        nbytes, index = rebuilding[point]   # the peak is the rebuild's, before the node runs
        baseline = profile.floor(point)
        there[index] += nbytes
    return clock, point, baseline, sorted(((b, g) for g, b in there.items()), reverse=True)
