"""Workspace lent to the shim where a plan leaves room (docs/torch.md, "Workspace where the plan
leaves room").

Under ``mucudnn run --memory-budget B --offload`` the shim holds each convolution's engine to a
share of the budget (docs/shim.md, "The hold"): PyTorch sizes a convolution's workspace once, in
the recording step, and one share for every convolution must fit the step's tightest point. A
planned step has room at other points, and the plan's model (:func:`planner.memory_at_points`)
says where. At each point where it has room for the lend until the next point, the session
allocates a buffer and lends it to the preloaded shim (``mucudnn_lend_workspace``), where a held
convolution runs its online front's faster point within it.

Rules:

1. A lend lives from one point of the step (a new group's pack, an unpack) to the next, or to the
   backward's end: the modelled bytes at both points, plus the lend, stay within the target less
   :data:`LEND_MARGIN` of the budget. The forward's last point lends nothing (what follows it,
   the loss, is no point of the model).
2. One size per plan: the largest workspace of an engine the shim holds (what each held
   convolution would have had without the hold), or less where no point has room for that; one
   size is one block the caching allocator reuses.
3. The buffer is withdrawn from the shim before it is freed: the shim uses it only for the
   lending thread's convolutions on the lent stream, enqueued before the free. It is lent on
   the device and the stream it was allocated on only (the caching allocator orders a freed
   block's reuse on that stream): a point on another is lent a buffer of its own.
4. Without the shim preloaded, with no engine held, or after an allocation it refused, nothing
   is lent; lending never raises into the training step. An op the allocator refuses while a
   buffer is lent gets that buffer first (the rescue: rescue.py), and the plan lends no more.
5. A buffer is allocated only where the bytes allocated then leave the room rule 1 asks for.
   Where the caching allocator freed its cache (a flush) while a buffer was lent, or to allocate
   one, the plan lends no more, in this run (a flush costs a step more than the lends save), and
   that flush is the lender's, not the plan's: the session leaves it out of the counts its
   lifecycle judges plans by (:meth:`WorkspaceLender.flushes_not_lent`), which would lower the
   plan for it.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Sequence

import torch

from . import planner
from .link import allocator_flushes
from .planner import StepProfile

#: room kept below the target besides a lend (a share of the budget): the model's error
LEND_MARGIN = 0.05
#: the least lend worth an allocation (the hold is at least this much where it binds)
MIN_LEND = 64 << 20
#: lends are whole multiples of this (the caching allocator's large blocks round to 2 MiB)
LEND_ROUND = 2 << 20


@dataclass(frozen=True)
class LendPlan:
    """Where a plan lends (:func:`lend_points`): ``size`` bytes from each forward point in
    ``forward`` (group ids) and each backward point in ``backward`` (unpack indices)."""

    size: int
    forward: frozenset
    backward: frozenset


def lend_points(profile: StepProfile, modes: Sequence[str], lookahead: int, prefetch_margin: float,
                limit: int, most: int, least: int = MIN_LEND) -> LendPlan | None:
    """Rules 1 and 2 for ``modes`` on ``profile``: ``limit`` is the target less the margin,
    ``most`` the largest held engine workspace; None where no point has ``least`` bytes of room."""
    forward, backward = planner.memory_at_points(profile, modes, lookahead, prefetch_margin)
    room_forward = [limit - max(here, after) for here, after in zip(forward, forward[1:])]
    room_backward = [limit - max(here, after) for here, after in zip(backward, backward[1:])]
    if backward:
        room_backward.append(limit - backward[-1])
    size = min(most, max(room_forward + room_backward, default=0)) // LEND_ROUND * LEND_ROUND
    if size < max(least, 1):
        return None
    return LendPlan(size, frozenset(t for t, room in enumerate(room_forward) if room >= size),
                    frozenset(i for i, room in enumerate(room_backward) if room >= size))


def _shim_functions(library):
    """The preloaded shim's ``mucudnn_lend_workspace`` and ``mucudnn_held_workspace``, or
    (None, None) where this process has no shim."""
    try:
        library = library if library is not None else ctypes.CDLL(None)
        lend, held = library.mucudnn_lend_workspace, library.mucudnn_held_workspace
    except (OSError, AttributeError):
        return None, None
    if isinstance(lend, ctypes._CFuncPtr):
        lend.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        lend.restype = ctypes.c_int
        held.argtypes, held.restype = [], ctypes.c_size_t
    return lend, held


class WorkspaceLender:
    """A session's lends (rules 3 and 4): :meth:`plan_for` at each plan, :meth:`at_point` at each
    point of a planned step, :meth:`withdraw` at its end. ``library``: the shim's functions
    (this process's symbols by default); ``on`` False: nothing is ever lent."""

    def __init__(self, library=None, least: int = MIN_LEND, on: bool = True):
        self.on = on
        self._lend, self._held = _shim_functions(library) if on else (None, None)
        self.least = least
        self.plan: LendPlan | None = None
        self.limit = 0      # the plan's target less the margin (bytes)
        self._made_for = None
        #: the plans (profile, key) whose lends stopped (rule 5): a trial may run one again
        self._stopped_plans: list = []
        #: the buffer lent, and the stream it was allocated on (rule 3)
        self._buffer: torch.Tensor | None = None
        self._stream = 0
        #: lends made (buffers allocated), and plans whose lends stopped (rule 5)
        self.lends = self.stopped = 0
        #: per device: its flush count when the buffer was allocated, and the flushes so far
        #: that were the lender's (rule 5)
        self._flushes_before = 0
        self._flushes_lent: dict = {}

    def plan_for(self, profile: StepProfile | None, modes, lookahead: int, prefetch_margin: float,
                 target: int | None, budget: int | None) -> LendPlan | None:
        """The lends of ``modes`` (None where there is nothing to lend: no shim, no engine held,
        no target, no room, or its lends stopped)."""
        self.withdraw()
        if self._lend is None or profile is None or modes is None or target is None or \
                budget is None or len(modes) != len(profile.groups):
            self.plan = self._made_for = None
            return None
        most = int(self._held())
        # asked at every step's end: the plan in force again is not modelled again
        key = (tuple(modes), lookahead, prefetch_margin, target, budget, most)
        if self._made_for is not None and self._made_for[0] is profile and \
                self._made_for[1] == key:
            return self.plan
        self._made_for = (profile, key)
        self.limit = int(target - LEND_MARGIN * budget)
        stopped = any(made is profile and made_key == key
                      for made, made_key in self._stopped_plans)
        self.plan = None if most <= 0 or stopped else lend_points(
            profile, modes, lookahead, prefetch_margin, self.limit, most, self.least)
        return self.plan

    def at_point(self, points: frozenset, index: int, device: torch.device) -> None:
        """At point ``index`` of the forward (``points``: the plan's ``forward``) or backward:
        the buffer lent (allocated where none is) where the plan lends, else withdrawn."""
        if index not in points:
            self.withdraw()
            return
        stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
        if self._buffer is not None and (self._buffer.device != device or self._stream != stream):
            self.withdraw()   # rule 3: lent on the device and stream it was allocated on only
            if self.plan is None:
                return
        if self._buffer is None:
            if device.type == "cuda" and \
                    torch.cuda.memory_allocated(device) + self.plan.size > self.limit:
                return   # rule 5: no lend this time
            self._flushes_before = self._flushes(device)
            try:
                # past the session's modes: the op recorder records no lend, and the rescue
                # moves no tensor for one (an allocation refused is no lend, nothing else)
                with torch._C.DisableTorchFunction(), torch._C._DisableTorchDispatch():
                    self._buffer = self._allocate(self.plan.size, device)
            except torch.OutOfMemoryError:   # rule 4: this plan lends no more
                self._lender_flushed(device)   # the allocator flushes before it refuses
                self._stop()
                return
            self._stream = stream
            self.lends += 1
        # again at each point: the backward's points run on autograd's thread (rule 3)
        self._lend(self._buffer.data_ptr(), self.plan.size, stream)

    @staticmethod
    def _allocate(size: int, device: torch.device) -> torch.Tensor:
        return torch.empty(size, dtype=torch.uint8, device=device)

    @staticmethod
    def _flushes(device: torch.device) -> int:
        return allocator_flushes(device)

    def _lender_flushed(self, device: torch.device) -> bool:
        """Counts the flushes since the buffer's allocation as the lender's (rule 5)."""
        flushed = self._flushes(device) - self._flushes_before
        if flushed > 0:
            key = _device_key(device)
            self._flushes_lent[key] = self._flushes_lent.get(key, 0) + flushed
        return flushed > 0

    def _stop(self) -> None:
        if self.plan is not None:
            self.plan = None
            self.stopped += 1
            if self._made_for is not None:
                self._stopped_plans.append(self._made_for)

    def give_back(self) -> int:
        """For an op the allocator refused: the buffer lent withdrawn, and this plan's lends
        stopped (rule 5); the bytes it held (0: none was lent)."""
        if self._buffer is None:
            return 0
        size = self.plan.size
        self.withdraw()
        self._stop()
        return size

    def withdraw(self) -> None:
        if self._buffer is not None:
            self._lend(None, 0, None)
            device, self._buffer = self._buffer.device, None
            if self._lender_flushed(device):   # rule 5
                self._stop()

    def flushes_not_lent(self, count: int, device: torch.device | None = None) -> int:
        """``count``, the flush count now of a link on ``device`` (None: the host's), less the
        lender's flushes there (rule 5): a count that never goes down, as ``count`` does not."""
        if self._buffer is None and not self._flushes_lent:   # lends off, or none flushed yet
            return count
        key = _device_key(device)
        lent = self._flushes_lent.get(key, 0)
        if self._buffer is not None and _device_key(self._buffer.device) == key:
            lent += max(0, count - self._flushes_before)
        return count - lent


def _device_key(device: torch.device | None) -> tuple:
    device = torch.device("cpu") if device is None else torch.device(device)
    return device.type, device.index
