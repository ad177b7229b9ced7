"""The copies of an offload session's saved groups to the host and back (link.py carries them
out): an offload or a keep-apart copy made once the op that saved the group has run, the device
tensor of an offloaded group let go at its release point, fetches on demand and prefetches ahead,
each as the session's plan times it. The session owns one :class:`StepCopies`."""

from __future__ import annotations

import torch

from . import planner
from .link import SameMemoryLink, Transfer
from .planner import KEEP, OFFLOAD
from .records import _Group, _Step


class StepCopies:
    """Issues the copies of the session's groups; its state is the kept groups its plan copies
    apart. ``session``: the :class:`~mucudnn.torch.offload_session.OffloadSession` that owns it
    (its plan, profile and links)."""

    def __init__(self, session):
        self.session = session
        self._apart: tuple = (None, set())   # (plan, its planner.kept_apart groups)

    def copy_pending(self, step: _Step, before: int | None = None) -> None:
        """The offloads and keep-apart copies of ``step``'s groups saved by ops that have run:
        those saved before autograd node ``before`` was made (the op making it runs after its own
        packs), or all (None: from Python between ops, a module hook, the first unpack, the
        session's exit). An op may write a tensor it saved after saving it (``rrelu_with_noise``
        fills its ``noise``, with no version bump): a copy at its pack would hold the values
        before. A kept group holds an alias of the tensor without its autograd history (a node
        saving its own output, ReLU, would otherwise hold itself through it, a cycle through C++
        that the collector cannot break)."""
        pending = step.pending
        if not pending or before is not None and pending[0][2] >= before:
            return
        ready = [entry for entry in pending if before is None or entry[2] < before]
        step.pending = [entry for entry in pending if before is not None and entry[2] >= before]
        with torch.no_grad():   # copies with no autograd history (it would hold the graph)
            self._copy_ready(step, ready)

    def _copy_ready(self, step: _Step, ready: list) -> None:
        for group, tensor, _ in ready:
            if group.live_packs == 0:     # its graph was dropped meanwhile: nothing to copy
                continue
            link = self.session.link_for_group(group)
            if group.mode == KEEP:
                group.tensor = link.keep_apart(tensor)
                group.kept_version = group.tensor._version
                continue
            due = self._release_point(step, group)
            if due is not None:    # not a point the forward has passed while the op ran
                due = max(due, len(step.groups))
            group.host = self.copy(step, link, "d2h", group.nbytes, lambda: link.offload(
                tensor, self.inline(step), held=due is not None))
            group.release = link.release
            if due is not None:
                # the transfer itself: a group whose packs are all freed meanwhile (its graph
                # dropped in the forward) gives back its host copy and forgets it
                step.releases.setdefault(due, []).append((group, group.host))
            if step.profiling:             # recording: copies inline
                for call in step.calls:    # the calls running now: the copy is in their time
                    if call.end is None and call.start is not None:
                        call.moved += group.nbytes
            self.session._event("offload", group.gid)

    def keeps_apart(self, step: _Step, group: _Group) -> bool:
        """Whether kept ``group`` is copied apart (:meth:`SameMemoryLink.keep_apart`): in a planned
        step of a plan run with :attr:`~planner.OffloadPlan.keep_apart`, one of
        :func:`planner.kept_apart` (a dense group of at most :data:`~planner.KEEP_APART_SHARE`
        of the profile's largest group). The caching allocator places a tensor in the smallest
        free block that holds it: kept tensors made in the forward fill the holes large
        activations leave, live through the backward, and split the space the
        backward's large tensors need into pieces too small for them. Under a cap it then frees
        its whole cache, after a synchronisation, and maps memory again
        (benchmarks/results/pressure)."""
        session = self.session
        plan, profile = session.plan, session.profile
        # the plain reads first: at every kept group's pack, most often of no such plan
        if plan is None or not plan.keep_apart or step.profiling or \
                session.offloads_as_recorded or profile is None or not group.offloadable:
            return False
        if self._apart[0] is not plan:
            self._apart = (plan, set(planner.kept_apart(profile, plan.modes)))
        return group.gid in self._apart[1] and profile.groups[group.gid].nbytes == group.nbytes

    def _release_point(self, step: _Step, group: _Group) -> int | None:
        """The forward point at which a planned step lets go of offloaded ``group``'s device
        tensor, as the plan's peak model has it (its ``releases``); with fixed ``modes``,
        :func:`planner.release_point` on the profile; under a budget no plan met, the next
        point. None where nothing is planned for it (a recording step or a fall-back, whose
        copies are inline; a group the profile does not have): the link then lets go once its
        copy is done."""
        session, gid = self.session, group.gid
        profile = session.profile
        if self.inline(step) or profile is None or gid >= len(profile.groups) \
                or profile.groups[gid].nbytes != group.nbytes:
            return None
        if session.plan is None:
            # fixed modes: as the profile has it; under a budget no plan met: the least memory
            return planner.release_point(profile, gid, 0 if session.budget is not None else None)
        releases = session.plan.releases
        if gid < len(releases) and releases[gid] >= 0:   # the plan's (its release margin's)
            return releases[gid]
        return planner.release_point(profile, gid)

    def let_go_due(self, step: _Step, point: int | None) -> None:
        """The offloaded groups due at forward ``point`` (None: all, the forward is over) go."""
        if not step.releases:   # at every new group: most steps move nothing
            return
        due = step.releases.pop(point, ()) if point is not None else [
            entry for point in sorted(step.releases) for entry in step.releases.pop(point)]
        for group, transfer in due:
            self.session.link_for_group(group).let_go(transfer)
            self.session._event("release", group.gid)

    @staticmethod
    def copy(step: _Step, link: SameMemoryLink, direction: str, nbytes: int, copy) -> Transfer:
        """``copy()``; in a recording step (whose copies are inline, each alone on the compute
        stream) between two marks, which time the host link (:func:`~.recording.link_speeds`)."""
        if not step.profiling:
            return copy()
        before = link.mark()
        transfer = copy()
        step.copies.append((direction, nbytes, before, link.mark()))
        return transfer

    def inline(self, step: _Step) -> bool:
        """Copies on the compute stream: in the recording step (its times are then compute plus
        known copies, with no host waits, and its memory that of ``save_on_cpu``) and after a
        fall-back (the least memory)."""
        return step.profiling or self.session.offloads_as_recorded

    def move_to_host(self, group: _Group) -> None:
        """``group``'s device tensor let go now (:func:`.rescue.evictable` said it may): a kept
        group is copied to the host first, on the compute stream (its memory reusable by the
        next op at once), and from here on is an offloaded group fetched on demand at its
        unpack; a fetched one keeps its host copy and is fetched again."""
        if group.mode == KEEP:
            link = self.session.link_for_group(group)
            with torch.no_grad():
                group.host = link.offload(group.tensor, inline=True)
            group.release = link.release
            group.mode, group.kept_version = OFFLOAD, None
        group.tensor, group.fetch = None, None
        self.session._event("rescue", group.gid)

    def prefetch(self, group: _Group, index: int) -> None:
        if group.mode == OFFLOAD and group.fetch is None and group.tensor is None \
                and group.unpacks == 0 and group.host is not None:
            group.fetch = self.session.link_for_group(group).fetch(group.host, group.device)
            self.session._event("prefetch", group.gid, index)
