"""Out of device memory inside a planned step, rescued: the op that ran out is run again once the
step's kept tensors that are needed last are on the host, and the step goes on (docs/torch.md,
"Out of memory").

A plan's peak is a model; fragmentation, a workspace the recording did not see or another size
of batch can take a step past it. PyTorch's caching allocator calls nobody back before it raises,
and the step is the user's code (a forward, ``loss.backward()``, under ``mucudnn run`` a script
we never see), so the only place to catch the error and try again is around each op:
:class:`OomRescue`, a ``TorchDispatchMode``, below autograd, where every op of the forward and of
the backward passes (autograd's threads inherit the mode with the rest of the thread's state).

Rules:

1. An op is run again only as it first ran: it draws no random numbers (its schema takes no
   generator: a random op may draw before it allocates), and each argument it writes (declared
   in its schema, or in :data:`WRITES_UNDECLARED`: batch norm's running statistics) is a tensor
   of at most :data:`RESTORED_BYTES` in all, copied before the op runs and put back before it
   runs again, so the second run reads what the first did. Any other op's error (an in-place
   op on an activation, rrelu's noise), and any other error, propagate unchanged.
2. What is freed first is the workspace lent to the shim (lend.py), where a buffer is lent: the
   op is run again, the step is no rescued one, and the plan lends no more. Then the step's
   own: groups the session holds on the device and may let go of
   without changing a value (:func:`evictable`): kept groups (copied to the host, then fetched
   at their unpack as an offloaded group is, bit for bit, and before a recomputation that
   reads them), and fetched or prefetched groups not yet unpacked (their host copy stays).
   Never one an unpack of the running node returned, one changed since its save, one saved by
   the op running in the forward (an op may write what it saved after saving it: rrelu's
   noise), nor a source of a recomputation under way (:meth:`StepRescue.pinning`).
3. Needed last goes first: groups no recomputation reads before those one does (which may be
   needed before their own unpack), and among them, in the forward the earliest saved, in the
   backward the one whose first unpack (as the last whole step had it) is furthest. Each round
   frees at least twice the bytes the allocator was asked for (its message says; 256 MiB where
   it does not), then twice the last round; the op is run again after each. When nothing is
   left to free, an error with the allocator's last message propagates, after one line.
4. A rescued step ends as one that ran out of memory and ran to its end (``lifecycle.RESCUED``:
   the plan for less is made while this one stays in force), and says one line the first time
   it rescues.
5. The mode costs a Python call per op (on an H100, about 50 ms of host time a step of
   ResNet-152 N=128: benchmarks/results/rescue), so it is armed only in the first
   :data:`ARMED_STEPS` steps under each new plan or set of modes and the steps after a rescue
   (``rescue="always"``: every planned step), and in the steps run under a plan that ran out
   while the plan for less is made (``Lifecycle.replanning_under_plan``); never in a recording
   step or one run as recorded (every tensor is offloaded already), nor under ``force``. A plan
   that ran its first :data:`ARMED_STEPS` steps with no rescue nor failure is proven (a plan
   that ran within its budget allocates the same way in the next steps); so is one as soon as
   an armed step of it ran clean (:meth:`StepRescue.ran_clean`: no rescue, no failure, no
   flush of the caching allocator's cache, modes that move no bytes, an allocator whose flush
   gives back every page no live tensor holds): its later steps allocate the same bytes in the
   same order, and where one of them finds the cache laid out too loosely, the allocator's own
   flush takes it back to what the clean step ran in. Not in a trial comparing plans (each is
   timed in steps armed alike), and for this process only (another run's allocator may have
   no expandable segments: a later run proves the plan by a clean step of its own). A plan
   proven by its armed steps is so in the plan cache's entry, and a later run of the script
   under that entry arms only its first :data:`PROVEN_ARMED_STEPS` (a new process: each
   convolution's kernel chosen, the allocator's cache laid out anew), as does a proven plan
   back in force in the same process (a trial keeping one it ran before another; the
   allocator's cache is emptied between them). The plan in force with its modes copied (a
   trial keeping the plan it ran last) is not new.
6. The mode never outlives the session's ``with``: on the thread that entered it, it is pushed
   at the start of an armed step (or at the ``with`` itself) and popped at the start of the
   first step not armed and when the ``with`` ends, only while it is the innermost mode (a mode
   the script entered inside it stays, and this one passes every op through until it can be
   popped). A backward run outside the ``with`` gets it in autograd's thread node by node: at
   each unpack of a group of the step and at each leaf module's output node, pushed for the rest
   of that node (autograd restores the thread's state, mode stack included, after each node).
"""

from __future__ import annotations

import contextlib
import os
import re

import torch
from torch.utils._python_dispatch import (TorchDispatchMode, _get_current_dispatch_mode,
                                          _get_current_dispatch_mode_stack, _pop_mode, _push_mode)

from ..launch import ALLOCATOR_CONF_NAMES
from .lifecycle import FIXED, _gib
from .planner import KEEP, OFFLOAD
from .recorder import _current_node
from .records import _SEQUENCE_NR

#: ops whose schemas declare no write, though they write arguments (their indices): batch
#: norm's running statistics (training mode), rrelu's noise
WRITES_UNDECLARED = {"aten::native_batch_norm": (3, 4), "aten::cudnn_batch_norm": (3, 4),
                     "aten::miopen_batch_norm": (3, 4), "aten::rrelu_with_noise": (1,)}
#: the most bytes of written arguments copied so that an op can run again (running statistics:
#: a few KiB; an activation written in place is far more, and is not copied)
RESTORED_BYTES = 1 << 20
#: steps armed after a plan (or fixed modes) comes into force, and after a rescued step
ARMED_STEPS = 3
#: steps armed under a cached plan that an earlier run proved (rule 5)
PROVEN_ARMED_STEPS = 1
#: the first round's bytes where the allocator's message names no size
DEFAULT_ASK = 256 << 20

_ASKED = re.compile(r"Tried to allocate ([0-9.]+) (B|KiB|MiB|GiB|TiB)")
_UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}


def asked_bytes(message: str) -> int:
    """The bytes PyTorch's caching allocator was refused, as its error ``message`` says; else
    :data:`DEFAULT_ASK`."""
    found = _ASKED.search(message)
    return int(float(found.group(1)) * _UNITS[found.group(2)]) if found else DEFAULT_ASK


_WRITES: dict = {}   # op -> the indices of the arguments it writes; None: it draws randomness
_UNKNOWN = object()


def writes(func) -> tuple | None:
    """Rule 1: the indices of the arguments op ``func`` writes (declared or not); None where it
    draws random numbers. Found once per op."""
    found = _WRITES.get(func, _UNKNOWN)
    if found is not _UNKNOWN:
        return found
    schema = func._schema
    if any("Generator" in str(argument.type) for argument in schema.arguments):
        found = None
    else:
        found = tuple(sorted({index for index, argument in enumerate(schema.arguments)
                              if argument.alias_info is not None and argument.alias_info.is_write}
                             | set(WRITES_UNDECLARED.get(schema.name, ()))))
    _WRITES[func] = found
    return found


def written_arguments(func, args, kwargs) -> list | None:
    """Rule 1: the tensors op ``func`` writes, called with ``args`` and ``kwargs`` (to be copied
    before it runs); None where it cannot be run again."""
    indices = writes(func)
    if indices is None:
        return None
    if not indices:
        return []
    arguments = func._schema.arguments
    written, total = [], 0
    for index in indices:
        value = args[index] if index < len(args) else kwargs.get(arguments[index].name)
        if value is None:
            continue
        if not isinstance(value, torch.Tensor):   # a list of tensors (foreach ops): not copied
            return None
        total += value.numel() * value.element_size()
        if total > RESTORED_BYTES:
            return None
        written.append(value)
    return written


def evictable(group, in_use) -> bool:
    """Rule 2: whether ``group``'s device tensor can go to the host (or simply go) now, the step
    computing the same values. ``in_use``: the groups the running node unpacked."""
    if group.live_packs == 0 or group in in_use or not group.offloadable:
        return False
    if group.mode == KEEP:
        tensor = group.tensor
        if tensor is None or group.unpacks:
            return False
        original = group.ref()
        kept = group.kept_version if group.kept_version is not None else group.version
        return tensor._version == kept and (original is None or original._version == group.version)
    if group.mode == OFFLOAD:   # fetched ahead of its unpack: the host copy is still there
        return group.unpacks == 0 and not group.readers and group.host is not None and (
            group.tensor is not None or group.fetch is not None)
    return False


def eviction_order(step, first_unpacks: list, pinned=frozenset()) -> list:
    """Rule 3: ``step``'s evictable groups, needed last first; none of ``pinned``."""
    in_use = set(pinned)
    if step.unpacks:
        in_use.update(step.node_groups)
    groups = [g for g in step.groups if evictable(g, in_use)]
    if not step.unpacks:   # the forward: saved first, unpacked last; none its running op saved
        now = _SEQUENCE_NR()
        return sorted((g for g in groups if g.saved_seq < now), key=lambda g: g.readers > 0)
    later = len(step.groups) + 1   # never unpacked in the last whole step: as late as any

    def needed(group):
        known = first_unpacks[group.gid] if group.gid < len(first_unpacks) else None
        return (group.readers > 0, -(later if known is None else known))
    return sorted(groups, key=needed)


class OomRescue(TorchDispatchMode):
    """The mode of rules 1 and 5, for ``rescuer`` (a :class:`StepRescue`); :attr:`active` false
    passes every op through (pushed but not to be popped yet)."""

    def __init__(self, rescuer):
        super().__init__()
        self.rescuer = rescuer
        self.active = True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.active:
            return func(*args, **kwargs)
        # rule 1: what the op writes, copied before it runs (most ops write nothing: no copy)
        indices = writes(func)
        written = written_arguments(func, args, kwargs) if indices else []
        if written is None:
            return func(*args, **kwargs)
        # Only the error's message outlives its ``except`` clause: the error's traceback holds
        # this frame, and with it the op's inputs, in a cycle that the collector alone breaks,
        # so a rescued op would keep its inputs (a step's activations) allocated until then.
        copies = None   # made before the op's first run; refused too, they are made again
        want = freed = 0
        while True:
            try:
                if copies is None:
                    copies = [tensor.clone() for tensor in written]
                else:
                    for tensor, before in zip(written, copies):
                        tensor.copy_(before)
                return func(*args, **kwargs)
            except torch.OutOfMemoryError as error:
                message = str(error)
            want = 2 * max(want, freed) if want else 2 * asked_bytes(message)
            freed = self.rescuer.rescue(func, want, message)
            if not freed:
                raise torch.OutOfMemoryError(message) from None


def flush_recovers(device) -> bool:
    """Rule 5: whether the caching allocator of ``device`` (None: the host's, no caching
    allocator), freeing its cache to retry an allocation, gives back every page no live tensor
    holds: PyTorch's CUDA allocator with expandable segments (what ``mucudnn run --memory-budget``
    sets). Its segments of fixed size are freed only when wholly free, so a later step's live
    tensors, placed otherwise than the clean step's, can leave too little whole. Read from the
    allocator's settings as PyTorch holds them (set at run time too), else from the process's
    environment (``PYTORCH_ALLOC_CONF``, else ``PYTORCH_CUDA_ALLOC_CONF``); the last
    ``expandable_segments`` given counts, as in PyTorch. A platform where PyTorch falls back to
    fixed segments is not seen (it warns then)."""
    if device is None or torch.device(device).type != "cuda":
        return False
    settings = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    if settings is not None:
        conf = settings()
    else:   # an older PyTorch: the first of its names set, as it reads them
        conf = next((os.environ[name] for name in ALLOCATOR_CONF_NAMES if name in os.environ), "")
    found = False
    for option in conf.split(","):
        key, _, value = option.partition(":")
        if key.strip() == "expandable_segments":
            found = value.strip().lower() == "true"
    return found


def push(mode: OomRescue) -> None:
    mode.active = True
    _push_mode(mode)


def pop(mode: OomRescue) -> bool:
    """Rule 6's pop: ``mode`` off the thread's stack where it is the innermost (True); else it
    stays, passing every op through."""
    mode.active = False
    if _get_current_dispatch_mode() is mode:
        _pop_mode()
        return True
    return False


def _holds(plans: list, plan) -> bool:
    """Whether ``plans`` holds ``plan`` itself (plans compare by value: an equal plan made again
    is another plan, with its own steps to prove)."""
    return any(each is plan for each in plans)


class StepRescue:
    """Rules 2-6 for one :class:`~mucudnn.torch.offload_session.OffloadSession` (``session``: its
    step, plan, copies and lines): whether the step is armed, the mode and where it is pushed,
    and what an op refused moves. ``when``: True (rule 5), ``"always"`` or False (never)."""

    def __init__(self, session, when: bool | str = True):
        self.session, self.when = session, when
        self.mode = OomRescue(self)
        self.armed = False        # this step is (rule 5)
        self.pushed = False       # the mode is on the stack of the thread that entered
        self.left = 0             # armed steps left
        self.counted_for = (None, None)   # the plan and modes they count for
        self._flushes_at_start: dict = {}   # each link's flush count as the step started
        self.pinned: frozenset = frozenset()   # groups no rescue moves now
        #: the plans proven (rule 5): in this process, or by the run that cached the plan
        #: in force; armed for fewer steps whenever they come into force
        self.proven: list = []
        #: the plans a step of which was rescued or failed in their armed steps: never proven
        self.spoiled: list = []

    def arm(self, ended: bool = False, rescued: bool = False, failed: bool = False) -> None:
        """At a step's start: whether rule 5 arms it. ``ended``: a step has just ended
        (``rescued``: it was rescued; ``failed``: it raised), which counts against the armed
        steps; the plan they count for is proven where they are over with neither, or where
        the step ran clean (:meth:`ran_clean`)."""
        session = self.session
        if ended and self.armed:
            # a trial comparing plans times each in the same steps, armed alike
            trial = session.lifecycle.trial
            clean = not (rescued or failed) and (trial is None or len(trial.plans) < 2) and \
                self.ran_clean()
            self.left = ARMED_STEPS if rescued or failed else 0 if clean else self.left - 1
            proved = self.counted_for[0]
            if (rescued or failed) and proved is not None and not _holds(self.spoiled, proved):
                self.spoiled.append(proved)
            if self.left == 0 and proved is not None and not self.is_proven(proved) and \
                    not _holds(self.spoiled, proved):
                self.proven.append(proved)
                if not clean:   # a clean step proves it for this process's allocator only
                    session.plan_proven(proved)
        plan, modes = session.plan, session.modes
        if plan is not self.counted_for[0] or modes is not self.counted_for[1]:
            # the same plan with its modes copied (a trial keeping the plan it ran last) runs
            # on: its steps go on counting
            runs_on = plan is self.counted_for[0] and modes == self.counted_for[1]
            self.counted_for = (plan, modes)
            if not runs_on:
                self.left = PROVEN_ARMED_STEPS if self.is_proven(plan) else ARMED_STEPS
        self.armed = bool(self.when) and modes is not None and not session._step.profiling \
            and not session.offloads_as_recorded and (
                self.when == "always" or self.left > 0
                or session.lifecycle.replanning_under_plan)
        # each link's flush count as this step starts: the lifecycle's, read at the boundary;
        # an armed step before any step ended (a cached plan's first, armed at its first save)
        # reads them now
        self._flushes_at_start = dict(session.lifecycle.flush_counts)
        if not self._flushes_at_start and self.armed and session.lifecycle.state != FIXED:
            self._flushes_at_start = session._flush_counts_now()
        self.sync()

    def ran_clean(self) -> bool:
        """Rule 5, read where an armed step has just ended with no rescue nor failure: whether
        its allocations prove the plan in force for the steps after it. Its modes move no byte
        (no offload, no kept group copied apart, no workspace lent: what is on the device at
        each point is then the same in every step, not a copy's timing), the caching allocator
        of every link it ran on freed no cache to retry an allocation during it (the lifecycle's
        flush counts, known and unchanged), and a flush gives that allocator back every page
        no live tensor holds (:func:`flush_recovers`). The plan and modes are those the step
        ran (:attr:`counted_for`: the lifecycle may have put others in force for the next)."""
        session = self.session
        plan, modes = self.counted_for
        if modes is None or OFFLOAD in modes or (plan is not None and plan.keep_apart) or \
                session.lender.on:
            return False
        counts, before = session.lifecycle.flush_counts, self._flushes_at_start
        links = session._links_in_use()
        return bool(links) and \
            all(link in counts and counts[link] == before.get(link) for link in links) and \
            all(flush_recovers(getattr(link, "device", None)) for link in links)

    def is_proven(self, plan) -> bool:
        """Whether ``plan`` (not None) is one of :attr:`proven`, the very object."""
        return plan is not None and _holds(self.proven, plan)

    def sync(self) -> None:
        """Inside the session's ``with``, on the thread that entered it: the mode on its stack
        while the step is armed, off it otherwise (a backward run inside the ``with`` inherits
        it; one run outside gets it node by node, :meth:`node`)."""
        if self.session._depth <= 0 or not self.session.on_with_thread():
            return   # outside the ``with``, or a module run on another thread (DataParallel)
        if self.armed and not self.pushed:
            push(self.mode)
            self.pushed = True
        elif self.armed:
            self.mode.active = True
        elif self.pushed:
            self.pushed = not pop(self.mode)

    def leave(self) -> None:
        """The session's outermost ``with`` ends: the mode never outlives it."""
        if self.pushed and self.session.on_with_thread():
            self.pushed = not pop(self.mode)

    def watch(self, output) -> None:
        """A leaf module's ``output`` in an armed step: its backward node gets the mode too
        (:meth:`node`), whether it unpacks a group of the step or not."""
        if isinstance(output, torch.Tensor) and output.grad_fn is not None:
            output.grad_fn.register_prehook(self._prehook)

    def _prehook(self, grad_outputs):
        if self.armed:
            self.node()

    def node(self) -> None:
        """In autograd's backward of an armed step (an unpack, a watched node), run outside the
        session's ``with``: the mode on this thread's stack for the rest of the node (autograd
        restores the thread's state after each node, mode stack included)."""
        if _current_node() is not None and self.mode not in _get_current_dispatch_mode_stack():
            push(self.mode)

    @contextlib.contextmanager
    def pinning(self, groups: list):
        """While a recomputation rebuilds ``groups`` (a rebuild order): none of them, and none of
        their sources, is moved; yields ``groups``."""
        before = self.pinned
        self.pinned = before | frozenset(groups) | frozenset(
            source for group in groups for source in group.recipe.sources)
        try:
            yield groups
        finally:
            self.pinned = before

    def rescue(self, func, wanted: int, message: str) -> int:
        """Rules 2-4 for an op ``func`` the allocator refused (its ``message``): the step's groups
        needed last moved off the device until ``wanted`` bytes are; the bytes moved (0: none
        was left, and the error goes on)."""
        session = self.session
        step = session._step
        given = session.lender.give_back()   # the workspace lent to the shim goes first
        if given:
            session.say(f"out of device memory in {func}: the workspace lent to the shim "
                        f"({_gib(given)}) given back and the op run again; this plan lends no "
                        "more")
            return given
        moved = 0
        for group in eviction_order(step, session._first_unpacks, self.pinned):
            if moved >= wanted:
                break
            session.copies.move_to_host(group)
            moved += group.nbytes
        asked = _gib(asked_bytes(message))
        if moved and not step.rescued:
            session.say(f"out of device memory in {func} ({asked} asked); kept tensors of this "
                        f"step moved to the host ({_gib(moved)}) and the op run again; the next "
                        "plan is made for less")
        elif not moved:
            session.say(f"out of device memory in {func} ({asked} asked) with nothing of this "
                        f"step left to move to the host ({_gib(step.rescued)} moved): the error "
                        "goes on")
        step.rescued += moved
        return moved
