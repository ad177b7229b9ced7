"""The profile of a recording step (:func:`step_profile`), timed on its link's clock: its saved
groups with their recipes' costs, its compute times less its own inline copies, the host link's
speeds (:func:`link_speeds`), the memory at each point besides the saved groups; and the stages
its leading chain allows (:func:`stage_candidates`). Read from the records the session's
:class:`~mucudnn.torch.recorder.StepRecorder` kept (records.py), at the recording step's end."""

from __future__ import annotations

from collections import deque

from . import planner
from .link import SameMemoryLink
from .records import _Call, _Step, offload_everything

#: the smallest copy whose time measures the host link (smaller ones measure its latency)
LINK_PROBE_BYTES = 32 << 20


def stage_candidates(step: _Step, link: SameMemoryLink, recompute_convolutions: bool,
                     recorded=None) -> list:
    """The stages recording ``step``'s leading chain allows (stage.py): (planner_stage.Stage,
    its modules, their container, the batch, each of its calls' time: None where untimed, as a
    first recording's calls before its first save are). ``recorded``: the stage the recording
    took (stage.StagePlan), which the step's chain goes on from: the stages that extend it."""
    chain = step.chain
    # a staged chain reruns its convolutions, and sums its parameters' gradients over
    # micro-batches: not where convolutions may not rerun (MUCUDNN_OFFLOAD=cheap)
    if chain is None or not chain.links or not recompute_convolutions:
        return []
    d2h, _ = link_speeds(step, link)
    if recorded is not None:
        if step.stage_end_groups is None:
            return []
        return [(stage, modules, chain.parent, chain.batch, times)
                for stage, modules, times in chain.extending(
                    recorded, step.stage_end_groups, lambda call: _call_ms(link, call, d2h))]
    group = step.by_key.get(chain.input_key)
    input_group = group.gid if group is not None else None
    return [(stage, modules, chain.parent, chain.batch, times)
            for stage, modules, times in chain.candidates(
                input_group, lambda call: _call_ms(link, call, d2h))]


def link_speeds(step: _Step, link: SameMemoryLink) -> tuple[float, float]:
    """(device-to-host, host-to-device) GB/s: the link's own (given, or measured before), else
    the fastest of the recording step's inline copies of at least ``LINK_PROBE_BYTES`` (each
    alone on the compute stream between two marks: the link as this step used it, with no
    buffer to allocate at the tightest moment), else a probe of the link."""
    if link.gbps is not None:
        return link.gbps
    best = {}
    for direction, nbytes, start, end in step.copies:
        if nbytes >= LINK_PROBE_BYTES:
            ms = link.compute_ms(start, end)
            if ms > 0:
                best[direction] = max(best.get(direction, 0.0), nbytes / (ms * 1e6))
    if "d2h" in best and "h2d" in best:
        link.gbps = (best["d2h"], best["h2d"])
        return link.gbps
    return link.bandwidth_gbps()

def _clock(step: _Step, link: SameMemoryLink, marks: list, points: int, direction: str,
           start=None) -> list[float]:
    """Compute ms from ``start`` (default: the first of a recording step's ``marks``, its packs
    or its unpacks) to each mark: their times less its own inline copies ``direction`` before
    each (the forward's offloads, the backward's on-demand fetches; each between two marks, in
    issue order), non-decreasing; [] without marks."""
    if not marks:
        return []
    start = start or marks[0][2]
    copies = deque((before, after) for way, _, before, after in step.copies
                   if way == direction and before.seq > start.seq)
    clock, now, copying = [0.0] * points, 0.0, 0.0
    for _, index, mark, *_ in marks:
        while copies and copies[0][1].seq <= mark.seq:
            copying += link.compute_ms(*copies.popleft())
        now = max(now, link.compute_ms(start, mark) - copying)
        clock[index] = now
    for index in range(1, points):     # points no mark names keep the time before them
        clock[index] = max(clock[index], clock[index - 1])
    return clock

def step_profile(step: _Step, link: SameMemoryLink, copy_exposure: float, tail_peak: int = 0,
                 grown: int = 0) -> planner.StepProfile:
    """The profile of recording ``step``, timed on ``link``'s clock: its saved groups (sizes,
    first and last unpacks, recipes and their costs), its compute times without the inline
    copies, the link's speeds, and the memory at each point besides the saved groups
    (``tail_peak``: the most allocated after its last unpack; ``grown``: what the step left that
    every later step carries)."""
    unpacks = max(step.unpacks, 1)
    d2h, h2d = link_speeds(step, link)
    groups = []
    for group in step.groups:
        first = group.first_unpack if group.first_unpack is not None else unpacks - 1
        last = group.last_unpack if group.last_unpack is not None else unpacks - 1
        recompute_ms, sources = None, None
        times = [_call_ms(link, c, d2h) for c in group.recipe.calls] \
            if group.recipe is not None else [None]
        if None not in times:
            recompute_ms = sum(times)
            sources = tuple(source.gid for source in group.recipe.sources)
        # what a rebuild allocates: every call's output but an in-place one's (its input),
        # or the most it allocated while it ran, where more (a convolution's workspace)
        rebuild_bytes = sum(max(c.rise, 0 if c.in_place else c.output_bytes)
                            for c in group.recipe.calls) if recompute_ms is not None else None
        groups.append(planner.SavedGroup(
            group.nbytes, first, last, group.producer, group.offloadable, recompute_ms,
            sources, rebuild_bytes or None))
    packs = [m for m in step.marks if m[0] == "pack"]
    unpack_marks = [m for m in step.marks if m[0] == "unpack"]
    # Compute only: the host's waits (stalls) and the recording's own copies to the host in the
    # forward and back in the backward, each inline on the compute stream, are left out (at least
    # the forward's time remains in the backward).
    # The forward starts at the first save, or where a staged chain began before it
    start = step.forward_start if packs and step.forward_start is not None and \
        step.forward_start.link is packs[0][2].link else (packs[0][2] if packs else None)
    forward_ms = _span_ms(step, link, start, unpack_marks[0][2]) if unpack_marks else 0.0
    backward_ms = max(_span_ms(step, link, unpack_marks[0][2],
                               step.end_mark or unpack_marks[-1][2]),
                      forward_ms) if unpack_marks else 0.0
    link.timing, link.stalls = False, []
    profile = planner.StepProfile(
        groups, forward_ms, backward_ms, d2h, h2d, unpacks,
        backward_clock=_clock(step, link, unpack_marks, unpacks, "h2d"),
        forward_clock=_clock(step, link, packs, len(groups), "d2h", start),
        copy_exposure=copy_exposure)
    recorded = offload_everything(groups)
    live_f, live_b = [0] * len(groups), [0] * unpacks
    for gid, mode in enumerate(recorded):
        # inline copies: the device memory goes with the next point, as the recording ran
        f_points, b_points = planner.live_points(profile, gid, mode, 0, release_margin=0)
        for t in f_points:
            live_f[t] += groups[gid].nbytes
        for t in b_points:
            live_b[t] += groups[gid].nbytes
    # Baselines: the most allocated at or between points, less the saved groups live there.
    # A forward point takes the peak since the previous point (the op that made its group);
    # a backward point the peak until the next unpack (the node that unpacked it: its output,
    # gradients, workspace), the last one the peak until the next step (the rest of the
    # backward, the optimizer). In between no group arrives (the recording fetches at
    # unpacks), and a group freed meanwhile is freed as early under any plan, so this is the
    # non-saved memory at the interval's peak.
    forward = [max(0, max(m[3], m[4]) - live_f[m[1]]) for m in packs]
    if packs and unpack_marks:      # the loss and the start of the backward
        forward[-1] = max(forward[-1], unpack_marks[0][4] - live_f[packs[-1][1]])
    # A backward point's floor: what was allocated at its unpack, the group fetched, before
    # the node ran (a rebuild there runs then; its transient is gone when the node runs).
    backward, floor = [0] * unpacks, [0] * unpacks
    peaks_after = [m[4] for m in unpack_marks[1:]] + [tail_peak]
    for m, after in zip(unpack_marks, peaks_after):
        backward[m[1]] = max(backward[m[1]], 0, max(m[3], after) - live_b[m[1]])
        floor[m[1]] = max(floor[m[1]], 0, m[3] - live_b[m[1]])
    profile.baseline_forward = [b + grown for b in forward]
    profile.baseline_backward = [b + grown for b in backward]
    profile.floor_backward = [f + grown for f in floor]
    return profile



def _span_ms(step: _Step, link: SameMemoryLink, start, end) -> float:
    """Compute ms from mark ``start`` to mark ``end`` of recording ``step``: their time on the
    link's clock less its stalls and less each of the step's inline copies between them, as each
    copy took (not as the link's best speed would move its bytes: a recording copies every
    saved tensor, and the forward's compute is a tenth of its copies' time, so a copy a few per
    cent slower than the fastest would count as compute several times over)."""
    copying = sum(link.compute_ms(before, after) for _, _, before, after in step.copies
                  if before.link is link and start.seq < before.seq and after.seq <= end.seq)
    return max(0.0, link.compute_ms(start, end) - copying)


def _call_ms(link: SameMemoryLink, call: _Call, d2h: float) -> float | None:
    """A recording step's ``call``: its compute ms, less what it copied to the host inline
    (``d2h`` GB/s); None where untimed: its marks not on one link's clock (a first recording's
    calls before its first pack, marked on no link yet)."""
    if call.start is None or call.end is None or call.start.link is not call.end.link:
        return None
    return max(0.0, link.compute_ms(call.start, call.end) - planner.transfer_ms(call.moved, d2h))
