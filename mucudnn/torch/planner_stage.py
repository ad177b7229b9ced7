"""Staging in profile terms: the step's leading chain of per-sample layers run without saving
anything and rerun in micro-batches in the backward (docs/torch.md, "Staging"; stage.py runs
it). Torch-free: :func:`staged_profile` is the profile the planner plans such a step on."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

from .planner import SavedGroup, StepProfile

#: micro-batches a staged chain's backward may run in (:func:`stage_chunks`): the fewest whose
#: chunk is no larger than the rest of the backward's non-saved memory
STAGE_CHUNKS = (2, 4, 8)
#: the most ends of the leading chain the session weighs a staged plan at (its first pooling
#: layers: where the activations shrink)
STAGE_ENDS = 2
#: the least predicted gain (a share of the plain plan's step) for which a staged plan is taken
#: over a plain one: the staged step reruns the chain's forward and sums its gradients over
#: chunks, so it is taken for a step in the plans' time, not for noise
STAGE_MIN_GAIN = 0.02


@dataclass(frozen=True)
class Stage:
    """The step's leading chain of per-sample layers (convolutions, activations, pooling) run
    without saving anything (its forward under ``no_grad``) and, in the backward, again in
    ``chunks`` micro-batches, each rerun and differentiated at once (docs/torch.md, "Staging").
    In profile terms: the groups ``first_group..end_group - 1`` it saved, but its input, leave the
    plan, its input is one group saved at ``first_group`` (``input_group``: the profile's group
    that is that input, where it saved it), and its backward points (the last of the step) become
    one, at which a chunk's share of their memory is live.

    A stage that extends the one its recording took (stage.py, "A recording that would not fit")
    has ``recorded_chunks`` > 1: the recorded profile's last backward point is that stage's, and
    held a ``recorded_chunks``-th of its chain's backward above the floor there; ``forward_ms`` is
    then the time of the modules past it only (the recorded backward holds the rest's reruns)."""

    modules: int          # leaf modules in it, from the step's first
    first_group: int
    end_group: int
    input_group: int | None
    input_bytes: int
    chunks: int
    forward_ms: float     # its forward's recorded time: what the backward runs again
    recorded_chunks: int = 1
    #: a staged step saves its input as a group of the session's; False where autograd keeps
    #: it (a leaf that requires grad: a gradient penalty's input; one under the session's
    #: ``min_bytes``): the staged profile then has no group for it
    input_saved: bool = True

    def describe(self) -> str:
        # a stage the recording took has no time of its own: its rerun is in the profile's
        return (f"its first {self.modules} layers staged (rerun in {self.chunks} micro-batches "
                f"in the backward" + (f", {self.forward_ms:.1f} ms)" if self.forward_ms else ")"))


def _stage_points(profile: StepProfile, stage: Stage) -> tuple[list[int], int] | None:
    """(the stage's groups, its first backward point), or None where other groups are still
    unpacked from that point on (its backward is not the step's last)."""
    inside = [g for g in range(stage.first_group, stage.end_group) if g != stage.input_group]
    if not inside or stage.end_group > len(profile.groups):
        return None
    start = min(profile.groups[g].first_unpack for g in inside)
    members = set(inside) | {stage.input_group}
    if any(group.last_unpack >= start for index, group in enumerate(profile.groups)
           if index not in members):
        return None
    return inside, start


def _stage_peak(profile: StepProfile, stage: Stage, inside: Sequence[int], start: int
                ) -> tuple[int, int]:
    """(the floor at the stage's first backward point, the most any of its backward points held
    with its groups kept: a kept group is live through its last unpack). The last point of a
    profile staged by its recording (:attr:`Stage.recorded_chunks`) held a chunk's share above
    its floor: it counts at the whole batch's."""
    def held(point: int) -> int:
        value = profile.baseline_backward[point] + sum(
            profile.groups[g].nbytes for g in inside if profile.groups[g].last_unpack >= point)
        if stage.recorded_chunks > 1 and point == profile.unpacks - 1:
            floor = profile.floor(point)
            value = floor + max(0, value - floor) * stage.recorded_chunks
        return value
    return profile.floor(start), max(held(point) for point in range(start, profile.unpacks))


def stage_chunks(profile: StepProfile, stage: Stage) -> int | None:
    """The fewest of :data:`STAGE_CHUNKS` for which the staged backward's chunk holds no more
    than the rest of the backward's non-saved memory at most (then the stage no longer sets the
    backward's peak); the most of them where none does; never fewer than the recording's stage
    it extends ran in (:attr:`Stage.recorded_chunks`: its chain fitted at that share). None where
    ``stage`` cannot be staged."""
    points = _stage_points(profile, stage)
    if points is None:
        return None
    inside, start = points
    floor, peak = _stage_peak(profile, stage, inside, start)
    rest = max(profile.baseline_backward[:start], default=0)
    fitting = next((chunks for chunks in STAGE_CHUNKS if floor + (peak - floor) / chunks <= rest),
                   STAGE_CHUNKS[-1])
    return max(fitting, stage.recorded_chunks)


def staged_profile(profile: StepProfile, stage: Stage) -> StepProfile | None:
    """The profile of a step run with ``stage`` (see :class:`Stage`), or None where it cannot be.

    - Groups: those before the stage, its input (kept for its backward: no recipe; none where
      autograd keeps it, :attr:`Stage.input_saved`), those after, renumbered; a recipe reading
      a staged group is dropped (nothing saved it).
    - Backward points: those before the stage's, then one: its backward, where the floor there
      (its output's gradient, parameters and their gradients) and a chunk's share of the most
      its points held above it are live. Its rerun forward adds to the backward's time.
    - Forward: the stage's points become its input's, whose baseline is the most any of them held
      besides their groups plus one of the chain's tensors (its forward keeps its current input
      and output, saving none); with no input group, the next group's point takes that."""
    points = _stage_points(profile, stage)
    if points is None:
        return None
    inside, start = points
    staged = set(inside)
    floor, peak = _stage_peak(profile, stage, inside, start)
    saved_before = stage.input_group is not None and stage.input_group < stage.first_group
    renumbered: dict[int, int] = {}
    groups: list[SavedGroup] = []
    forward_base: list[int] = []
    forward_clock: list[float] = []

    def add(index: int | None, group: SavedGroup, base: int, at: int) -> None:
        if index is not None:
            renumbered[index] = len(groups)
        groups.append(group)
        forward_base.append(base)
        if profile.forward_clock:
            forward_clock.append(profile.forward_clock[at])

    # the stage's forward: the most its points held besides their groups, and one of its tensors
    chain = profile.baseline_forward[stage.first_group:stage.end_group]
    stage_forward = max(chain) + max(profile.groups[g].nbytes for g in inside)
    unsaved_input = stage.input_group is None and not stage.input_saved
    pending = 0   # an unsaved input's stage forward, taken by the next group's point
    for index, group in enumerate(profile.groups):
        if index == stage.first_group and not saved_before:   # the stage saves its input
            if unsaved_input:
                pending = stage_forward
            else:
                recorded = profile.groups[stage.input_group] \
                    if stage.input_group is not None else None
                add(stage.input_group, SavedGroup(
                    stage.input_bytes, min(start, recorded.first_unpack) if recorded else start,
                    start, "stage input", recorded.offloadable if recorded else True),
                    stage_forward, index)
        if index in staged or (index == stage.input_group and not saved_before):
            continue
        if index == stage.input_group:        # saved before: the stage's backward reads it last
            add(index, replace(group, last_unpack=start), profile.baseline_forward[index], index)
            continue
        sources = group.recompute_source
        if sources is not None and any(source in staged for source in sources):
            group = replace(group, recompute_ms=None, recompute_source=None, rebuild_bytes=None)
        elif sources is not None:
            group = replace(group, recompute_source=tuple(renumbered[s] for s in sources))
        add(index, group, max(profile.baseline_forward[index], pending), index)
        pending = 0
    if pending:
        if not groups:   # nothing saved but the stage's: no point for its forward
            return None
        forward_base[-1] = max(forward_base[-1], pending)
    chunked = floor + -(-(peak - floor) // stage.chunks)
    return replace(
        profile, groups=groups, unpacks=start + 1,
        backward_ms=profile.backward_ms + stage.forward_ms,
        baseline_forward=forward_base, forward_clock=forward_clock,
        baseline_backward=profile.baseline_backward[:start] + [chunked],
        backward_clock=profile.backward_clock[:start + 1],
        floor_backward=(profile.floor_backward[:start] + [floor]) if profile.floor_backward
        else [])


