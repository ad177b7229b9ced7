"""The runtime of mucudnn.torch (docs/torch.md): saved-tensor hooks that keep, offload or recompute
each tensor autograd saves, as a plan says, after a first step that records a profile.

Invariants:
- A tensor is restored bit for bit: an offloaded one is copied to a host tensor of the same dtype,
  shape and strides and back (dense tensors only; others are kept); a recomputed one re-runs its
  recipe, deterministic modules (:data:`CHEAP`, and :data:`CONVOLUTIONS` unless told not to)
  and tensor adds (:data:`ADDS`, ResNet's ``out += identity``) on its sources under ``no_grad``,
  with batch norm rerun on copies of its running statistics (its output in training mode does
  not read them, and the model's statistics are not updated twice). A source is a saved group,
  kept or itself recomputed: rebuilding a group first rebuilds its recomputed sources that are
  not on the device (a chain, as ``torch.utils.checkpoint`` reruns a segment), each once; a
  group saved as a view over exactly a tensor's elements (an instance norm's reshaped input) is
  a source of that tensor, viewed back to its shape (:class:`_ViewOf`).
  A convolution reruns the kernel its forward ran where the framework picks kernels per shape
  (PyTorch's cuDNN plan cache, ``cudnn.benchmark`` or not); a workspace allocation that fails
  during a rerun can make it pick another, whose result may differ in the last bits
  (``recompute_convolutions=False`` rules convolutions out).
- Nothing is recomputed from a source that changed since it was saved (its version counter), and
  every call of a recipe read each of its inputs at the version the recipe rebuilds or reads.
- Groups: every pack of the same tensor object (same version) is one group, moved or recomputed
  once. Parameters, views of them, one-dimensional leaves (buffers) and tensors under
  ``min_bytes`` pass through (:class:`_Passed`).
- A recipe's module reruns as its forward ran (:class:`_ModuleState`): its mode, the tensors in
  its ``_parameters`` then (``functional_call``'s), an eval-mode batch norm's statistics then;
  without hooks (a user's global hooks see the user's forward only).
- A copy of a saved tensor (an offload, a keep-apart copy) is made once the op that saved it
  has run (:meth:`OffloadSession._copy_pending`): an op may write a tensor after saving it.
- Autograd checks no saved tensor's version where saved-tensor hooks run: the session does, at
  each unpack, and raises PyTorch's error for a tensor changed in place since its pack (seen
  through the tensor, its view's base, its kept alias or a recipe's parameters while they live).
- The session holds a group's device tensor (kept, fetched, prefetched or recomputed) no longer
  than the planner's liveness says (planner.py): autograd holds one :class:`_Packed` per pack,
  and the device tensor goes when the last of them is freed (autograd frees a node's saved
  tensors once it ran), at the last unpack of a moved or recomputed group, and never while a
  recomputed group that reads it may still be unpacked. Nothing else (steps, recipes, calls)
  refers to a device tensor strongly, except a link while a copy reads or writes it: an
  offloaded tensor until its copy to the host is done (``CudaLink.poll``), a fetch's until the
  compute stream is ordered after its copy.
- Steps: a pack after an unpack starts a new step, and so does a module or pack after a forward
  whose graph autograd dropped without a backward (:meth:`_Step.abandoned`); group ``g`` is the
  ``g``-th tensor the step saves, unpack ``i`` its ``i``-th unpack (planner.py's clocks). A
  group of an ended step unpacked later is restored on demand, outside any step's clock.
- Entering a session inside itself (a forward calling the model again) is part of the outer
  ``with``; leaving the outermost by any exception leaves grad mode, hooks and staging as they
  were. A planned step whose groups differ
  from the profile's (another size) keeps those groups.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import gc
import time
import weakref
from collections import defaultdict, deque
from dataclasses import dataclass, field, replace

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ..errors import ChangedInPlaceError, InfeasibleError, MucudnnError, inplace_message
from ..sizes import describe_size
from . import planner
from .compiled import refuse_if_compiling
from .planner import KEEP, OFFLOAD, RECOMPUTE
from .stage import ChainRecorder, StagedForward, StagePlan, autocast_as, autocast_state

#: Modules whose recomputation is deterministic and cheap (SuperNeurons' choice: no convolution,
#: no dropout). Exact types: a subclass may override forward.
CHEAP = (nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.SiLU, nn.Sigmoid, nn.Tanh, nn.Hardswish,
         nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d,
         nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d, nn.AdaptiveAvgPool2d, nn.Identity)
_BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
#: Instance norms: cheap too, where they keep no running statistics (their default; a rerun
#: would update those a second time)
_INSTANCE_NORMS = (nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d)
#: Modules that may also be recomputed, at their measured cost (the planner weighs it against
#: moving their output; per-block checkpointing shows recomputing them can beat the host link).
#: A transposed one reruns at the output size it made (``output_size`` may have chosen it).
_TRANSPOSED = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
CONVOLUTIONS = (nn.Conv1d, nn.Conv2d, nn.Conv3d) + _TRANSPOSED
#: the smallest copy whose time measures the host link (smaller ones measure its latency)
LINK_PROBE_BYTES = 32 << 20
#: Ops a recipe may include besides modules (recorded by :class:`_OpRecorder`): the sum of two
#: tensors, deterministic and elementwise (ResNet's residual ``out += identity``, which Python runs
#: as ``add_``); True where the op changes its first operand.
ADDS = {torch.Tensor.add_: True, torch.Tensor.__iadd__: True, torch.Tensor.add: False,
         torch.Tensor.__add__: False, torch.add: False}
#: Concatenations a recipe may include too (a U-Net's skip joined to its upsampled input, which
#: the next convolution saves): a copy of their operands, deterministic.
CONCATS = (torch.cat, torch.concat)
#: the most calls (modules and ops) one recipe reruns from its sources
_MAX_CHAIN = 4


def dense(tensor: torch.Tensor) -> bool:
    """Its strides cover its elements once (contiguous or channels-last): it copies bit for bit
    into ``empty_strided`` of the same strides."""
    if tensor.is_contiguous():
        return True
    if tensor.dim() == 4:
        return tensor.is_contiguous(memory_format=torch.channels_last)
    if tensor.dim() == 5:
        return tensor.is_contiguous(memory_format=torch.channels_last_3d)
    return False


@dataclass(frozen=True)
class Mark:
    """A point of a step on a link's clock: ``seq`` orders marks (and stalls) as issued."""

    link: object
    seq: int
    stamp: object


@dataclass
class Transfer:
    tensor: torch.Tensor
    event: object = None


class SameMemoryLink:
    """A host link where host and device are one memory (CPU tests): copies are exact clones and
    every copy is complete when issued. Subclass it to observe the calls; :class:`CudaLink`, the
    link of a GPU session, builds on it. ``gbps``: the (device-to-host, host-to-device)
    bandwidth to plan with instead of measuring it."""

    def __init__(self, gbps: tuple[float, float] | None = None):
        self.gbps = gbps
        self._free_host: dict[tuple, list[torch.Tensor]] = defaultdict(list)
        self.host_allocations = 0     # host tensors made (not taken from the pool)
        self._seq = 0
        #: while True (a recording step), :meth:`stalling` records (before, after) marks
        self.timing = False
        self.stalls: list[tuple[Mark, Mark]] = []

    def host_buffer(self, tensor: torch.Tensor) -> torch.Tensor:
        """A host tensor of ``tensor``'s layout: one a group gave back (the host pool: a step
        saves the tensors the last one saved), else a new one."""
        free = self._free_host.get(_layout(tensor))
        if free:
            return free.pop()
        self.host_allocations += 1
        with self.stalling():         # pinning fresh host memory blocks the host
            return self._new_host(tensor)

    @contextlib.contextmanager
    def stalling(self):
        """Around what blocks the host thread: the device runs dry meanwhile, which is no
        module's compute time (:meth:`compute_ms` leaves it out)."""
        if not self.timing:
            yield
            return
        before = self.mark()
        try:
            yield
        finally:
            self.stalls.append((before, self.mark()))

    def _new_host(self, tensor: torch.Tensor) -> torch.Tensor:
        return _same_layout(tensor, tensor.device)

    def poll(self) -> None:
        """Let go of what finished copies no longer need (here: nothing is ever in flight)."""

    def empty_cache(self) -> None:
        """Give the device memory cached but unused back (here: there is no cache)."""

    def settle(self) -> None:
        """Wait for every copy in flight; afterwards the link holds no device tensor."""

    def release(self, transfer: Transfer) -> None:
        """``transfer``'s host tensor goes back to the pool: no group reads it again. A copy that
        still uses it is ordered before any later copy into it: a copy on a copy stream first
        waits for the compute stream, and an inline one for both copy streams."""
        self._free_host[_layout(transfer.tensor)].append(transfer.tensor)

    def offload(self, tensor: torch.Tensor, inline: bool = False, held: bool = False
                ) -> Transfer:
        """A host copy of ``tensor``. ``inline``: on the compute stream, in its order (as
        ``save_on_cpu``): no overlap, but the device memory is reusable at once, and the copy's
        time is in the compute stream's (the recording step subtracts it). ``held``: the link
        keeps ``tensor`` until :meth:`let_go` (or :meth:`settle`), whenever its copy is done."""
        return Transfer(self.host_buffer(tensor).copy_(tensor))

    def let_go(self, transfer: Transfer) -> None:
        """The device tensor of ``transfer`` (an offload ``held``) goes: the compute stream waits
        for its copy, then may reuse the memory."""

    def fetch(self, host: Transfer, device, inline: bool = False) -> Transfer:
        return Transfer(_same_layout(host.tensor, device).copy_(host.tensor))

    def keep_apart(self, tensor: torch.Tensor) -> torch.Tensor:
        """A copy of ``tensor`` (dense) in memory apart from the step's short-lived tensors
        (here: anywhere), made in the compute stream's order; the caller lets go of
        ``tensor``."""
        return _same_layout(tensor, tensor.device).copy_(tensor)

    def wait(self, transfer: Transfer) -> torch.Tensor:
        return transfer.tensor

    def mark(self) -> Mark:
        self._seq += 1
        return Mark(self, self._seq, self._stamp())

    def _stamp(self):
        return time.perf_counter()

    def _interval_ms(self, start, end) -> float:
        return (end - start) * 1e3

    def elapsed_ms(self, start: Mark, end: Mark) -> float:
        return self._interval_ms(start.stamp, end.stamp)

    def compute_ms(self, start: Mark, end: Mark) -> float:
        """The time from ``start`` to ``end`` less the host stalls between them (0 for marks of
        different links: no common clock)."""
        if start.link is not self or end.link is not self:
            return 0.0
        stalled = sum(self.elapsed_ms(a, b) for a, b in self.stalls
                      if start.seq < a.seq and b.seq < end.seq)
        return max(0.0, self.elapsed_ms(start, end) - stalled)

    def allocated(self) -> int:
        return 0

    def peak_allocated(self) -> int:
        """The most bytes allocated on the device since the previous call (which starts the next
        interval); ``allocated()`` where the link cannot see more."""
        return self.allocated()

    def ooms(self) -> int:
        """Allocations the device refused so far (a counter that only grows)."""
        return 0

    def flushes(self) -> int:
        """Times so far the device's caching allocator freed its cache to retry an allocation
        (a counter that only grows)."""
        return 0

    def bandwidth_gbps(self) -> tuple[float, float]:
        return self.gbps or measure_bandwidth(self, torch.device("cpu"))


class CudaLink(SameMemoryLink):
    """Pinned host memory and two copy streams per device, one per direction. Offload: the
    offload stream waits for the compute stream (the producer) and copies; the link holds the
    device tensor until that copy is done (:meth:`poll`), after which the compute stream may
    reuse its memory at once. Fetch: allocated from the compute stream's pool, copied on the
    fetch stream after the compute work queued so far and after the offload it reads; the
    compute stream waits for its event before use, and before the memory can be freed even where
    it never uses it (a transfer dropped unwaited). Inline copies (recording steps, a fall-back)
    run on the compute stream. Pinned buffers come from the link's host pool
    (:meth:`SameMemoryLink.host_buffer`).

    No ``record_stream``: it keeps a freed block from reuse until the side stream passes the
    point where the block was freed, that is behind every copy queued by then (up to
    ``max_pending`` bytes, or the prefetches ahead). The allocator counts such a block as neither
    allocated nor free, maps more memory meanwhile, and under a cap flushes its cache.

    The forward can produce activations faster than the link drains them; the device memory of an
    offloaded tensor returns only when its copy is done. So at most ``max_pending`` bytes of
    copies to the host are in flight: beyond that the host thread waits for the oldest (vDNN's
    layer-wise wait; the GPU keeps running what is already queued).

    A planned step holds each offloaded tensor instead (``held``) until its release point
    (:func:`~mucudnn.torch.planner.release_point`): :meth:`let_go` has the compute stream wait
    for the copy there and frees it. When the host sees a copy done depends on how far it runs
    ahead of the device; the release point does not, so the caching allocator gets the same
    frees in the same order at every step, and the plan's peak model holds."""

    def __init__(self, device, max_pending: int = 1 << 30):
        super().__init__()
        self.device = torch.device(device)
        # one stream per direction: a fetch in the backward never queues behind the forward's
        # offloads still draining (the two directions run at once on their own copy engines)
        self.stream = torch.cuda.Stream(self.device)
        self.fetch_stream = torch.cuda.Stream(self.device)
        # allocates, never runs: its blocks are a pool of their own (keep_apart)
        self.keep_stream = torch.cuda.Stream(self.device)
        self.max_pending = max_pending
        self._pending: deque = deque()
        self._pending_bytes = 0
        self._held: dict[int, tuple] = {}   # id(transfer) -> it, its tensor, the compute stream

    def _new_host(self, tensor):
        # on the host whatever the default device (a script's torch.set_default_device("cuda"))
        return torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype,
                                   device="cpu", pin_memory=True)

    def _copy_inline(self, destination, source) -> Transfer:
        """``source`` into ``destination`` on the compute stream, after what the copy stream
        holds: a pooled host buffer's last copy may be there (a planned step before a fall-back,
        whose forward failed, so nothing waited for that copy; a group of an earlier step kept by
        ``retain_graph``, unpacked after a fall-back)."""
        compute = torch.cuda.current_stream(self.device)
        compute.wait_stream(self.stream)
        compute.wait_stream(self.fetch_stream)
        destination.copy_(source, non_blocking=True)
        event = torch.cuda.Event()
        event.record(compute)
        return Transfer(destination, event)

    def _copy_on_side(self, destination, source, stream) -> Transfer:
        """``source`` into ``destination`` on ``stream``, after the compute work queued so far
        (the producer, or the last users of a block the compute stream freed)."""
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            destination.copy_(source, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        return Transfer(destination, event)

    def offload(self, tensor, inline=False, held=False):
        host = self.host_buffer(tensor)
        if inline:
            return self._copy_inline(host, tensor)
        transfer = self._copy_on_side(host, tensor, self.stream)
        if held:
            # the data only (not its autograd graph), and the stream it is freed on
            self._held[id(transfer)] = (transfer, tensor.detach(),
                                        torch.cuda.current_stream(self.device))
            return transfer
        nbytes = tensor.numel() * tensor.element_size()
        self._pending.append((transfer.event, nbytes, tensor))
        self._pending_bytes += nbytes
        self.poll()
        if self._pending_bytes > self.max_pending:
            with self.stalling():
                while self._pending and self._pending_bytes > self.max_pending:
                    self._pending[0][0].synchronize()
                    self._let_go_oldest()
        return transfer

    def poll(self) -> None:
        """Let go of the offloaded tensors whose copies are done (in issue order: one stream)."""
        while self._pending and self._pending[0][0].query():
            self._let_go_oldest()

    def settle(self) -> None:
        """Wait for every copy to the host in flight and let go of its tensor (a held one's
        memory: once the compute stream has waited for its copy)."""
        while self._pending:
            self._pending[0][0].synchronize()
            self._let_go_oldest()
        for transfer, *_ in list(self._held.values()):
            self.let_go(transfer)

    def let_go(self, transfer):
        held = self._held.pop(id(transfer), None)
        if held is not None:
            # then the tensor goes: its block returns to the pool of the stream it was made on,
            # whose later work is ordered after the copy that reads it
            held[2].wait_event(transfer.event)

    def _let_go_oldest(self) -> None:
        self._pending_bytes -= self._pending.popleft()[1]

    def fetch(self, host, device, inline=False):
        # Allocated from the compute stream's pool, where the memory the backward frees returns:
        # a block of the copy stream's own pool is not reusable by the compute stream, and at a
        # memory cap the allocator then frees and maps memory again (synchronising the device)
        # at every step.
        tensor = _same_layout(host.tensor, self.device)
        if inline:
            return self._copy_inline(tensor, host.tensor)
        self.poll()
        if host.event is not None:   # its offload may still be draining on the other stream
            self.fetch_stream.wait_event(host.event)
        compute = torch.cuda.current_stream(self.device)
        transfer = self._copy_on_side(tensor, host.tensor, self.fetch_stream)
        # whenever the transfer goes (waited for or not), the compute stream, where ``tensor``
        # was allocated and is freed, is ordered after the copy before the memory can return
        weakref.finalize(transfer, _free_after, compute, transfer.event, tensor).atexit = False
        return transfer

    def wait(self, transfer):
        torch.cuda.current_stream(self.device).wait_event(transfer.event)
        return transfer.tensor

    def keep_apart(self, tensor):
        # Allocated as if for the keep stream: the caching allocator gives each stream blocks of
        # its own (with expandable segments, its own address range), so kept tensors no longer
        # sit between the large short-lived tensors of the compute stream and split the holes
        # those leave. Every use is on the compute stream: recorded there, so that a freed
        # block is reused, or unmapped by a flush (which waits only for the keep stream), only
        # once the compute stream has passed its last use. Without it a step can read unmapped
        # memory.
        compute = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self.keep_stream):
            copy = _same_layout(tensor, self.device)
        copy.record_stream(compute)
        return copy.copy_(tensor)

    def empty_cache(self):
        with torch.cuda.device(self.device):
            torch.cuda.empty_cache()

    def _stamp(self):
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def _interval_ms(self, start, end):
        end.synchronize()
        return start.elapsed_time(end)

    def allocated(self):
        return torch.cuda.memory_allocated(self.device)

    def peak_allocated(self):
        # the caching allocator's peak since the last reset; resetting starts the next interval
        # (this also resets the peak reserved statistic of the device)
        peak = torch.cuda.max_memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        return peak

    def ooms(self):
        return torch.cuda.memory_stats(self.device).get("num_ooms", 0)

    def flushes(self):
        # read at every unpack of a trial's steps: the nested statistics, not memory_stats'
        # flattened copy of them
        return torch.cuda.memory.memory_stats_as_nested_dict(self.device).get(
            "num_alloc_retries", 0)

    def bandwidth_gbps(self):
        if self.gbps is None:
            self.gbps = measure_bandwidth(self, self.device)
        return self.gbps


def _free_after(stream, event, tensor: torch.Tensor) -> None:
    """``stream`` waits for ``event``; ``tensor``, held until now, may then be freed on it."""
    stream.wait_event(event)


def _layout(tensor: torch.Tensor) -> tuple:
    return tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype


def _same_layout(tensor: torch.Tensor, device) -> torch.Tensor:
    return torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device=device)


def measure_bandwidth(link: SameMemoryLink, device, nbytes: int = 256 * 2**20, repeats: int = 3
                      ) -> tuple[float, float]:
    """(device-to-host, host-to-device) GB/s of ``link``, the best of ``repeats`` copies."""
    source = torch.empty(nbytes, dtype=torch.uint8, device=device)
    best = [0.0, 0.0]
    for _ in range(repeats):
        start = time.perf_counter()
        host = link.offload(source)
        _synchronize(host)
        middle = time.perf_counter()
        back = link.fetch(host, device)
        _synchronize(back)
        end = time.perf_counter()
        link.release(host)     # the next repeat copies into the same pinned memory
        best[0] = max(best[0], nbytes / max(middle - start, 1e-9) / 1e9)
        best[1] = max(best[1], nbytes / max(end - middle, 1e-9) / 1e9)
    return best[0], best[1]


def _synchronize(transfer: Transfer) -> None:
    if transfer.event is not None:
        transfer.event.synchronize()


@dataclass(frozen=True, slots=True)
class _Read:
    """A tensor a call read, weakly, and its version then. An offloaded input is gone (autograd
    holds only what the pack hook returned) when a later recipe looks for it: its group is the
    one whose ``ref`` is this ``ref`` (CPython gives an object one weak reference without a
    callback, the same object after it died), never one by address, which the caching
    allocator gives the next tensor of its size (a downsampling convolution's output after the
    freed output of the block's last convolution)."""

    ref: weakref.ref
    version: int


@dataclass(eq=False, slots=True)
class _Call:
    """One leaf module's forward, or one recorded op (:data:`ADDS`; ``module`` None): what it
    read and wrote (weakly) and how long it took."""

    module: nn.Module | None
    name: str
    reads: tuple[_Read, ...]  # its tensor inputs (a module's first argument; an op's operands)
    output: weakref.ref | None
    start: object
    end: object = None
    moved: int = 0            # bytes copied inline to the host while it ran (recording step)
    done: bool = False        # its forward returned
    output_version: int = 0   # its output's version when it returned
    in_place: bool = False    # its output is its first input, changed
    op: object = None         # an op's function, called again with ``keywords`` to rerun it
    keywords: dict = field(default_factory=dict)
    #: a recipe may run it again: a module of an exact type the session recomputes
    #: (:meth:`OffloadSession._recomputable`), or a recorded op (deterministic, elementwise)
    recomputable: bool = False
    autocast: tuple = ()      # autocast_state() when it ran: its rerun runs under the same
    output_bytes: int = 0     # its output's bytes
    #: recording step, recomputable: bytes allocated when it started, and the most it allocated
    #: above them while it ran (its output and its workspace: what its rerun allocates)
    allocated_before: int = 0
    rise: int = 0
    output_shape: tuple = ()  # its output's shape (a transposed convolution reruns to it)
    index: int = -1           # its place in its step's calls
    #: a recomputable module's state as its forward read it (:class:`_ModuleState`)
    state: _ModuleState | None = None

    def run(self, values: list[torch.Tensor]) -> torch.Tensor:
        """Its forward again on ``values`` (one per read), without side effects
        (:func:`rerun_as_recorded`), under the autocast state it ran under and with the module's
        state as it read it."""
        with contextlib.ExitStack() as stack:
            autocast_as(self.autocast, stack)
            if self.op is not None:
                return self.op(*values, **self.keywords)
            return rerun_as_recorded(self.module, values[0], self.state, self.output_shape)


@dataclass(eq=False, slots=True)
class _ModuleState:
    """What a recomputable module's forward read besides its input, recorded when it ran, so
    that a rerun in the backward computes what it computed, whatever changed since: its mode
    (``model.eval()`` before the backward; a train- and an eval-mode forward in one step), the
    tensors in its ``_parameters`` (``torch.func.functional_call`` puts plain tensors there for
    the call; autograd holds them for the backward anyway) at their versions then, and an
    eval-mode batch norm's running statistics, copied (a later train-mode forward changes them
    in place)."""

    training: bool
    params: dict
    versions: tuple
    running: tuple | None = None     # (mean, var) copies: an eval-mode batch norm's

    @classmethod
    def of(cls, module: nn.Module) -> _ModuleState:
        params = {name: value for name, value in module._parameters.items() if value is not None}
        running = None
        if isinstance(module, _BATCH_NORMS) and not module.training and \
                module.running_mean is not None and module.running_var is not None:
            running = (module.running_mean.clone(), module.running_var.clone())
        return cls(module.training, params,
                   tuple(value._version for value in params.values()), running)

    def check(self) -> None:
        """PyTorch's error where a parameter the forward read was changed in place since (an
        optimizer step before the backward): a rerun would compute another value."""
        for (name, value), version in zip(self.params.items(), self.versions):
            if value._version != version:
                raise ChangedInPlaceError(
                    inplace_message(value, version, name) + "; a module recomputed in the "
                    "backward reads it (under autocast PyTorch alone differentiates with the "
                    "cast it saved: OffloadSession(recompute=False) does too)")


@dataclass(frozen=True, eq=False)
class _ViewOf:
    """A recipe's input read through a saved group of another shape over the same elements: an
    instance norm saves its input ``C`` (a convolution's output, contiguous) reshaped to
    ``(1, N*C, ...)``, a view sharing C's storage and version counter, and C's own object is freed
    once the norm returns. ``group``'s tensor (its values; kept, fetched or recomputed, contiguous
    or made so) viewed with ``shape`` and ``stride`` is C."""

    group: _Group
    shape: tuple
    stride: tuple

    def of(self, tensor: torch.Tensor) -> torch.Tensor:
        """C from ``tensor``, the group's tensor: the group and C are contiguous over the same
        elements, so C's elements are the group's in order (a fetched tensor has the group's
        layout, not its storage: the view is taken from it, never from a storage pointer)."""
        return _viewed(tensor, self.shape, self.stride)


def _viewed(tensor: torch.Tensor, shape: tuple, stride: tuple) -> torch.Tensor:
    """``tensor``'s elements in order, viewed with ``shape`` and ``stride`` (a contiguous layout
    over the same elements: an instance norm's ``(1, N*C, ...)`` view and its input ``C``)."""
    return tensor.contiguous().view(shape).as_strided(shape, stride)


def _same_elements(source: torch.Tensor | None, tensor: torch.Tensor) -> bool:
    """``tensor`` is another view of exactly ``source``'s elements, both contiguous (an instance
    norm's reshaped input saved for its backward, and that input)."""
    return source is not None and source is not tensor and source.is_contiguous() and \
        tensor.is_contiguous() and source.dtype == tensor.dtype and \
        source.device == tensor.device and source.numel() == tensor.numel() and \
        source.storage_offset() == tensor.storage_offset() and \
        source.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr()


@dataclass(frozen=True, eq=False)
class _Alias:
    """``group`` holds the values of the tensor whose weak reference is ``ref`` (the first read of
    the call that saved the group) as a :class:`_ViewOf` slot would read them."""

    ref: weakref.ref
    view: _ViewOf


@dataclass(eq=False)
class _Recipe:
    """Calls that rebuild a saved tensor from saved groups: ``calls`` run in order, the last
    makes the tensor; ``inputs[i]`` says where each read of ``calls[i]`` comes from: a source
    group, a source group viewed back to the shape read (:class:`_ViewOf`) or the index of an
    earlier call (each call's output is read once). ``view``: (shape, stride) the last call's
    output is viewed with to be the saved tensor (an instance norm saves its input, a
    convolution's output, reshaped), else None."""

    calls: list[_Call] = field(default_factory=list)
    inputs: list[tuple] = field(default_factory=list)
    view: tuple | None = None

    @property
    def sources(self) -> list[_Group]:
        """The groups it reads, each once, in the order it first reads them: each must be kept
        (at the version it read) or recomputed, and on the device until the rebuilt tensor can no
        longer be unpacked."""
        found = []
        for slots in self.inputs:
            for slot in slots:
                if isinstance(slot, _ViewOf):
                    slot = slot.group
                if isinstance(slot, _Group) and slot not in found:
                    found.append(slot)
        return found


@dataclass(eq=False, slots=True)
class _Group:
    gid: int
    mode: str
    nbytes: int
    device: torch.device
    ref: weakref.ref
    version: int
    producer: str
    offloadable: bool
    tensor: torch.Tensor | None = None      # on the device: kept, fetched or recomputed
    #: a kept ``tensor``'s version while it holds the saved value (an alias shares the saved
    #: tensor's version counter, a copy has its own: :meth:`OffloadSession._kept`); None:
    #: ``version``
    kept_version: int | None = None
    host: Transfer | None = None
    release: object = None                  # gives ``host`` back to the link's pool
    fetch: Transfer | None = None
    recipe: _Recipe | None = None
    packs: int = 0
    unpacks: int = 0
    first_unpack: int | None = None
    last_unpack: int | None = None
    pack_mark: object = None
    wanted: str = KEEP                      # the plan's mode; ``mode`` is what runs
    live_packs: int = 0                     # _Packed objects autograd still holds
    readers: int = 0                        # recomputed groups that may still read this one
    owner: _Step | None = None              # its step (which counts its live groups)
    #: the base of a view saved (weakly): it shares the view's version counter, and outlives
    #: the view object a forward made for the op (an in-place change through it is seen)
    base: weakref.ref | None = None

    def drop_device(self) -> None:
        """Let go of the device tensor where nothing may need it from the session again."""
        if self.readers or self.tensor is None and self.fetch is None:
            return
        if self.live_packs == 0 or (self.mode != KEEP and self.unpacks >= self.packs):
            self.tensor, self.fetch = None, None

    def pack_freed(self) -> None:
        self.live_packs -= 1
        if self.live_packs == 0:
            self.owner.live -= 1
            if self.host is not None and self.release is not None:
                self.release(self.host)       # nothing can unpack this group again
                self.host = None
            if self.mode == RECOMPUTE:
                for source in self.recipe.sources:
                    source.readers -= 1       # this one can no longer be unpacked
                    source.drop_device()
            self.drop_device()


class _OpRecorder(TorchFunctionMode):
    """Hands the ops of :data:`ADDS` and :data:`CONCATS` to the session, which records them while
    a step's forward records; every other function, and tensor attribute reads, pass straight
    through (a dict look-up each)."""

    def __init__(self, session: OffloadSession):
        super().__init__()
        self.session = session

    def __torch_function__(self, func, types, args=(), kwargs=None):
        try:
            recorded = func in ADDS
        except TypeError:         # an unhashable callable: no add
            recorded = False
        if recorded:
            refuse_if_compiling("a mucudnn.torch session's op recorder")
            return self.session._op(func, args, kwargs or {})
        if func in CONCATS:
            refuse_if_compiling("a mucudnn.torch session's op recorder")
            return self.session._concat(func, args, kwargs or {})
        return func(*args, **(kwargs or {}))


def _past_the_op_recorder(hook):
    """A session's forward hook (a module's, the pack hook) run with torch function handling
    off while the session's :class:`_OpRecorder` is entered: its own reads of tensors (shapes,
    strides, storages) and copies are none of the recorder's, and each would be a Python call
    through it (most of the calls a forward makes)."""
    refusal = f"a mucudnn.torch session's {hook.__name__.strip('_').replace('_', ' ')} hook"
    quiet = hook.__name__ == "_after_module"

    @functools.wraps(hook)
    def run(session, *args):
        # spelled out here: dynamo recognises this call only by its own name
        if torch.compiler.is_compiling():
            if quiet:   # always_call runs it after the refused forward: said once
                return None
            refuse_if_compiling(refusal)
        if session._ops is None:
            return hook(session, *args)
        with torch._C.DisableTorchFunction():
            return hook(session, *args)
    return run


class _Packed:
    """What autograd holds for one pack of a group: its lifetime is the saved tensor's."""

    __slots__ = ("group",)

    def __init__(self, group: _Group):
        self.group = group
        group.live_packs += 1
        if group.live_packs == 1:
            group.owner.live += 1

    def __del__(self):
        self.group.pack_freed()


class _Passed:
    """What autograd holds for a saved tensor the session leaves alone (a parameter, a small
    tensor, one saved in a backward): the tensor without its autograd history (a node saving its
    own output, sigmoid, would otherwise hold itself through it: a cycle through C++ the
    collector cannot break, memory a dropped graph never gives back; autograd puts the history
    back at the unpack) and its version then: autograd checks no version where saved-tensor
    hooks run, so the unpack does (:meth:`check`)."""

    __slots__ = ("tensor", "version")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor.detach() if tensor.grad_fn is not None else tensor
        self.version = tensor._version

    def check(self) -> torch.Tensor:
        if self.tensor._version != self.version:
            raise RuntimeError(inplace_message(self.tensor, self.version))
        return self.tensor


@dataclass(eq=False)
class _Step:
    groups: list = field(default_factory=list)
    by_key: dict = field(default_factory=dict)
    by_ref: dict = field(default_factory=dict)   # id(group.ref) -> group (the group holds it)
    #: id of a read's weak reference -> _Alias: a group saved as a view of that tensor covering
    #: its elements (an instance norm's reshaped input), which holds its values while that
    #: group is live and at the read's version (the view shares its version counter)
    by_view: dict = field(default_factory=dict)
    unpacks: int = 0
    calls: list = field(default_factory=list)
    #: id of a call's output's weak reference (CPython's one per live tensor without a callback)
    #: -> the indices in ``calls`` of the calls that returned it, ascending
    outputs: dict = field(default_factory=dict)
    marks: list = field(default_factory=list)  # (kind, index, mark, allocated, peak before)
    profiling: bool = False
    ooms: int | None = None                          # the link's ``ooms()`` at its first pack
    node: object = None            # the autograd node of the last unpack (not its tensors)
    node_groups: list = field(default_factory=list)  # the groups that node unpacked
    backward_done: bool = False    # its backward ran to the end (autograd's final callback)
    watching: bool = False         # that callback is queued
    finds_recipes: bool | None = None   # OffloadSession._finds_recipes, once decided
    start_allocated: int | None = None   # the link's allocated bytes at its first module
    end_mark: object = None        # its backward's end (recording steps)
    copies: list = field(default_factory=list)   # (direction, bytes, mark, mark): inline copies
    #: forward point -> (group, its offload's transfer) whose device tensors go there
    releases: dict = field(default_factory=dict)
    chain: ChainRecorder | None = None   # recording steps: its leading chain (stage.py)
    #: (group, tensor, autograd sequence number at its pack): copies due once its op has run
    pending: list = field(default_factory=list)
    live: int = 0                  # its groups that autograd still holds (a pack not freed)

    def abandoned(self) -> bool:
        """Its forward saved groups, no backward unpacked any, and autograd holds none of them:
        its graph was dropped (a skipped non-finite loss, a validation forward with grad)."""
        return bool(self.groups) and not self.unpacks and not self.live


@dataclass
class _Trial:
    """Plans run in turn, :data:`planner.TRIAL_STEPS` planned steps each; the marks at their
    steps' ends time them, and the link's flush count read at every unpack of their steps says
    after which op the caching allocator flushed its cache."""

    plans: list
    labels: list                                 # per plan: what it is, for the lines said
    current: int = 0
    marks: list = field(default_factory=list)    # per plan: the end marks of its steps
    flushes: list = field(default_factory=list)  # per plan: the link's flush count at each mark
    #: per plan: the backward points (-1: the forward) after whose op a link's flush count grew
    #: in a timed step
    flush_points: list = field(default_factory=list)
    seen: dict = field(default_factory=dict)   # link -> its flush count when last read

    def __post_init__(self):
        self.marks = [[] for _ in self.plans]
        self.flushes = [[] for _ in self.plans]
        self.flush_points = [set() for _ in self.plans]

    def saw_flushes(self, link, point: int) -> None:
        """``link``'s flush count read after backward point ``point``'s op (-1: after the
        forward): if it grew since the last read (the first read of a link is its start), the
        current plan flushed there; a timed step's point is kept (as :meth:`flushes_in`
        counts)."""
        count = link.flushes()
        if count > self.seen.get(link, count) and self.marks[self.current]:
            self.flush_points[self.current].add(point)
        self.seen[link] = count

    def flush_note(self, index: int) -> str:
        """Plan ``index``'s flushes in its timed steps and where, as its trial line says them
        (" (2 flushes after the forward and after backward point 6)"; none: "")."""
        count = self.flushes_in(index)
        if not count:
            return ""
        points = sorted(self.flush_points[index])
        said = ["after the forward"] * (points[:1] == [-1])
        backward = [point for point in points if point >= 0]
        if backward:
            said.append(f"after backward point{'s' if len(backward) > 1 else ''} "
                        + ", ".join(map(str, backward)))
        where = " " + " and ".join(said) if said else ""
        return f" ({count} flush{'es' if count > 1 else ''}{where})"

    def flushes_in(self, index: int) -> int:
        """The caching allocator's flushes in plan ``index``'s timed steps."""
        counts = self.flushes[index]
        return counts[-1] - counts[0] if counts else 0

    def kept(self, times: list[float]) -> int:
        """Of the first plans, timed ``times`` (:meth:`step_ms`), the fastest of those whose
        timed steps did not flush the caching allocator's cache (of all where each did): a plan
        that flushes in its trial flushes more after it (benchmarks/results/pressure)."""
        calm = [index for index in range(len(times)) if not self.flushes_in(index)]
        return min(calm or range(len(times)), key=times.__getitem__)

    def step_ms(self, index: int) -> float:
        """The fastest of plan ``index``'s timed steps (each after its first): a step slowed by
        what the script does between steps (a checkpoint, a log) says nothing of the plan."""
        marks = self.marks[index]
        return min(a.link.elapsed_ms(a, b) for a, b in zip(marks, marks[1:]))


class OffloadSession:
    """Saved-tensor hooks and leaf-module hooks (while entered) carrying out a plan.

    ``budget`` (bytes): the first ``record_steps`` (default
    :data:`~mucudnn.torch.planner.RECORD_STEPS`) steps record (every dense saved tensor
    offloaded on the compute stream, fetched on demand; the last is the profile, with each time
    the least any recorded), then a plan is made for ``budget * (1 - headroom)`` (room for the
    caching allocator's fragmentation; CBC at most ``plan_time_limit_s`` per solve) and applied
    from the next step. ``modes``: a fixed plan instead (one mode per group; tests,
    benchmarks). ``force``: every group in that mode where allowed.
    ``link``: the host link; default :class:`CudaLink` for CUDA tensors, CPU tensors stay.
    ``recompute``: recipes at all; ``recompute_convolutions``: recipes may rerun convolutions
    (:data:`CONVOLUTIONS`; see the module docstring). ``copy_exposure``: the planner's
    :data:`~mucudnn.torch.planner.COPY_EXPOSURE`. ``max_pending``: :class:`CudaLink`'s, the bytes
    of copies to the host in flight before the host thread waits for the oldest.
    ``trace``: a list that receives ``(event, gid, ...)`` tuples (tests). ``profile_to``: a
    path where each plan made (or the fall-back when none meets the budget) writes the recorded
    profile, the target and the modes as JSON (:meth:`write_profile`), so that the planner can be
    replayed on it off the GPU. ``strict``: a budget
    no plan meets raises :class:`~mucudnn.errors.InfeasibleError` (a solver failure its
    ``SolverError``); else ``say`` it and offload every saved tensor, as the recorded step did.
    A planned step that runs out of device memory (the link's ``ooms()`` grew; its exception
    propagates as ever) shows the peak model fell short: the plan is made again for a lower target
    (``min(target, modelled peak) - replan_step * budget``), at most ``replans`` times, each with
    one line; after that, or when no plan meets the lower target, every later step offloads every
    saved tensor, with one line (``fell_back``). ``trials``: where the plan moves bytes and
    :func:`planner.trial_plans` finds others its simulation says are faster (made at other
    copy exposures, and for smaller headrooms: :data:`planner.TRIAL_HEADROOM_SHARES`), run
    each :data:`planner.TRIAL_STEPS` steps and keep the fastest that did not flush the caching
    allocator's cache (:meth:`_Trial.kept`), with one line. ``keep_apart``: the trial also runs
    its simulated fastest plan with the small kept groups copied apart from the step's large
    tensors (:meth:`_keeps_apart`), and keeps it that way where it wins.
    """

    def __init__(self, budget: int | None = None, *, modes=None, force: str | None = None,
                 link: SameMemoryLink | None = None, lookahead: int = 2, recompute: bool = True,
                 min_bytes: int = 1 << 20, headroom: float = 0.1, trace: list | None = None,
                 say=None, strict: bool = True, replans: int = 3, replan_step: float = 0.1,
                 record_steps: int | None = None, plan_time_limit_s: float = 20,
                 recompute_convolutions: bool = True,
                 copy_exposure: float = planner.COPY_EXPOSURE, profile_to=None,
                 max_pending: int = 1 << 30, trials: bool = True, keep_apart: bool = True,
                 stage: bool | str = True):
        self.budget, self.force, self.lookahead = budget, force, lookahead
        self.replans_left, self.replan_step = replans, replan_step
        # lower targets after flushing trials: as many, apart, so that a step that later runs
        # out of memory still has its replans
        self.lowerings_left = replans
        self.replans_used = 0
        self._recordings_left = max(1, planner.RECORD_STEPS if record_steps is None
                                    else record_steps)
        self._recorded: list[planner.StepProfile] = []   # this recording's profiles so far
        #: CBC's limit per solve: ResNet-50's plans reached 60 s and were no better than at 20 s
        self.plan_time_limit_s = plan_time_limit_s
        self._lowered_target: int | None = None
        #: the highest target found to have no plan: no target at or below it has one
        self._no_plan_at: int | None = None
        self.recompute, self.min_bytes, self.headroom = recompute, min_bytes, headroom
        self.recompute_convolutions = recompute_convolutions
        self.copy_exposure = copy_exposure
        self._link, self._links = link, {}
        #: link -> the most allocated in the current interval of its ``peak_allocated`` before
        #: a call's own measure (:meth:`_start_call`) started one of its own
        self._carried_peak: dict = {}
        self._measuring: tuple = (None, None)   # (call, link): the call measured now
        self.max_pending = max_pending
        self.trials = trials
        self.keep_apart = keep_apart
        self._apart: tuple = (None, set())   # (plan, its planner.kept_apart groups)
        self._trial: _Trial | None = None
        #: the plan in force after its trial: per planned step (the last WATCH_STEPS), whether
        #: it flushed the caching allocator's cache, and each link's flush count at its end
        self._flushing: deque = deque(maxlen=planner.WATCH_STEPS)
        self._flush_counts: dict = {}
        #: how the plan in force was made, after a trial kept another than the one made
        #: (:func:`planner.trial_plans`' label; None: as made)
        self.kept_after_trial: str | None = None
        self.trace = trace
        self.profile_to = profile_to
        self.strict = strict
        self.say = say or (lambda text: None)
        self.profile: planner.StepProfile | None = None
        self.plan: planner.OffloadPlan | None = None
        self.modes = list(modes) if modes is not None else None
        self.steps = 0
        self._first_unpacks: list[int | None] = []   # per group, of the last whole step
        self._schedule: dict[int, list[int]] = {}
        self._step = _Step(profiling=budget is not None and modes is None and force is None)
        self._rerunning = False
        self._mismatch_said = False
        self._unmoved_said = False
        self._empty_cache_due = False   # after a failed step: at the next step's start
        self.fell_back = False
        self._handles = []
        self._hooks = None
        self._depth = 0                 # ``with`` blocks entered and not left
        self._ops: _OpRecorder | None = None
        #: the leaf modules running now whose forward took the op recorder off the stack of
        #: torch function modes (:meth:`_set_recorder_aside`), innermost last
        self._ops_set_aside: list = []
        #: stage.py: whether plans may stage the leading chain; the stage in force (its profile
        #: is :attr:`profile`, the recorded one :attr:`recorded_profile`); the staged forward
        #: running; the recording's candidates; the containers running now, innermost last
        if stage not in (True, False, "always"):
            raise ValueError(f"OffloadSession: stage={stage!r} is not True, False or 'always'")
        self.staging = stage
        self.stage: StagePlan | None = None
        self.recorded_profile: planner.StepProfile | None = None
        self._staged: StagedForward | None = None
        self._stage_candidates: list = []
        self._containers: list = []

    # --- entering and leaving -------------------------------------------------------------
    def __enter__(self):
        refuse_if_compiling("entering a mucudnn.torch session")
        # re-entrant: a forward under the session calling the model again (a siamese wrapper
        # running itself) is part of the outer forward; only the outermost ``with`` installs
        # and removes the hooks
        self._depth += 1
        if self._depth > 1:
            return self
        self._containers = []
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        hooks = torch.nn.modules.module
        self._handles = [hooks.register_module_forward_pre_hook(self._before_module),
                         hooks.register_module_forward_hook(self._after_module, always_call=True)]
        if self._recipes_used():  # the ops a recipe may include (the residual add)
            self._ops = _OpRecorder(self)
            self._ops.__enter__()
        return self

    def _recipes_used(self) -> bool:
        """Whether the steps run in this ``with`` may use recipes: recording ones (the profile's
        recipes), or a plan or ``force`` that recomputes. Otherwise no op is recorded, and the
        function mode that records them (a Python call per torch function) is not entered."""
        if not self.recompute or self.fell_back:
            return False
        if self.force is not None:
            return self.force == RECOMPUTE
        if self.modes is not None:
            return RECOMPUTE in self.modes
        return self.budget is not None

    def __exit__(self, *exc_info):
        self._depth -= 1
        if self._depth > 0:
            return
        # Any exception (KeyboardInterrupt too, which skips the modules' ``always_call`` hooks)
        # leaves grad mode, the hooks and the staged state as they were before the forward.
        staged, self._staged = self._staged, None
        if staged is not None:
            staged.abort()
        self._containers = []
        if self._step.pending:   # the forward is over: every op saving a pending group has run
            self._copy_pending(self._step)
        if self._ops is not None:
            if not self._ops_set_aside:   # else a leaf module's forward left without its hook
                self._ops.__exit__(*exc_info)
            self._ops, self._ops_set_aside = None, []
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._hooks.__exit__(*exc_info)
        self._hooks = None
        if exc_info[0] is None:
            return
        if self._step.unpacks:
            # the forward failed before its first module or save: the step still open is the
            # last one, whose backward ran; it ends as it would have, and the failure is no plan's
            self._end_step()
        if self._step.groups:
            # the forward failed: this step never reaches its backward; the next one starts afresh
            self._end_step(failed=True,
                           out_of_memory=issubclass(exc_info[0], torch.OutOfMemoryError))

    # --- the host link per device ---------------------------------------------------------
    def link_for(self, tensor: torch.Tensor) -> SameMemoryLink | None:
        if self._link is not None:
            return self._link
        if tensor.device.type != "cuda":
            return None
        key = tensor.device.index
        if key not in self._links:
            self._links[key] = CudaLink(tensor.device, self.max_pending)
        return self._links[key]

    def _links_in_use(self) -> list[SameMemoryLink]:
        return [self._link] if self._link is not None else list(self._links.values())

    def _poll_links(self) -> None:
        for link in self._links_in_use():
            link.poll()

    def _known_link(self) -> SameMemoryLink | None:
        """The session's link, or the first it made for a device; None before any."""
        return self._link or next(iter(self._links.values()), None)

    def _any_link(self) -> SameMemoryLink:
        return self._known_link() or SameMemoryLink()

    # --- module and op records (producers, recipes, times) --------------------------------
    def _records(self, module) -> bool:
        """A leaf module's forward in a step's forward (not a recipe's rerun, not in a
        backward, not under ``no_grad``)."""
        return not (self._rerunning or not torch.is_grad_enabled() or _in_backward()
                    or _has_children(module))

    def _read(self, tensor: torch.Tensor) -> _Read:
        return _Read(weakref.ref(tensor), tensor._version)

    @_past_the_op_recorder
    def _before_module(self, module, args):
        if self._step.pending:    # between ops: every op saving a pending group has run
            self._copy_pending(self._step)
        if self._rerunning or not torch.is_grad_enabled() or _in_backward():
            return
        if _has_children(module):
            self._containers.append(module)   # the parent of the leaves it runs
            return
        self._poll_links()   # between packs too: a module that saves nothing of ours
        self._at_step_start()   # the first module of the next step: its calls belong there
        step = self._step
        parent = self._containers[-1] if self._containers else None
        if self.stage is not None and not step.profiling and self._staged is None and \
                self.stage.runs(module, args, parent, len(step.groups)):
            self._staged = StagedForward(self.stage, args[0])   # grad mode off till its end
            return
        if not self._records_calls(step):
            return
        self._set_recorder_aside(module)
        if self._step.profiling and self._step.start_allocated is None:
            self._step.start_allocated = self._any_link().allocated()
        source = args[0] if args and isinstance(args[0], torch.Tensor) else None
        recomputable = self._recomputable(module)
        call = _Call(
            module, type(module).__name__, (self._read(source),) if source is not None else (),
            None, None, in_place=bool(getattr(module, "inplace", False)),
            recomputable=recomputable, autocast=autocast_state() if recomputable else (),
            state=_ModuleState.of(module) if recomputable else None)
        self._start_call(call)
        if step.profiling and self.staging:
            if step.chain is None:
                step.chain = ChainRecorder()
            step.chain.enter(module, args, parent, len(step.groups), call, self._key)

    def _start_call(self, call: _Call) -> None:
        """``call`` is the step's next; in a recording step it starts now on the link's clock.
        A recomputable one is also measured from here to its return: the most the link allocates
        meanwhile above what it held here is what its rerun allocates at most
        (:attr:`_Call.rise`), and the interval of :meth:`_peak` it falls in carries on. Not
        measured on its own: a call inside a measured one (its allocations are that call's), or
        one before the step's first pack (no link yet to read)."""
        if self._step.profiling:
            link = self._known_link()
            if call.recomputable and link is not None and self._measuring[0] is None:
                self._carry_peak(link)
                call.allocated_before = link.allocated()
                self._measuring = (call, link)
            call.start = self._any_link().mark()   # after the measure's own host work
        call.index = len(self._step.calls)
        self._step.calls.append(call)

    def _peak(self, link: SameMemoryLink) -> int:
        """``link.peak_allocated()``: the most allocated since the previous read, including what
        the call measured meanwhile read of it (and counting this interval in that call's
        rise)."""
        device = link.peak_allocated()
        call, measured = self._measuring
        if measured is link:
            call.rise = max(call.rise, device - call.allocated_before)
        return max(device, self._carried_peak.pop(link, 0))

    def _carry_peak(self, link: SameMemoryLink) -> None:
        """Starts a measured call's interval of ``link``'s peak (or ends it), the most allocated
        in :meth:`_peak`'s interval so far carried on to its next read."""
        self._carried_peak[link] = self._peak(link)

    def _recomputable(self, module) -> bool:
        """Of a recomputable type, and without hooks of its own: a rerun would run them again
        (``spectral_norm``'s power iteration changes the weight and its buffers)."""
        if module._forward_pre_hooks or module._forward_hooks:
            return False
        if type(module) in _INSTANCE_NORMS:
            return getattr(module, "running_mean", None) is None
        return type(module) in CHEAP or (self.recompute_convolutions
                                         and type(module) in CONVOLUTIONS)

    def _set_recorder_aside(self, module) -> None:
        """Takes the op recorder off the stack of torch function modes while leaf ``module``'s
        forward runs, where it is on top: no op inside a leaf module is recorded (it is part of
        the module's call), and each torch function it calls would be a Python call through
        the recorder. :meth:`_after_module` (called even where the forward raises an Exception)
        puts it back. Only where no hook runs after the session's pre-hook (the module's own, a
        global one registered later): one entering a mode there and leaving it in a forward hook
        would find the recorder put back on top of it, and pop the recorder. (A forward left by
        a BaseException leaves the recorder aside until that module runs again: until then no
        op is recorded, and no recipe through one is found.)"""
        ops = self._ops
        if ops is None or module._forward_pre_hooks or module._forward_hooks or \
                not self._hooks_last():
            return
        depth = torch._C._len_torch_function_stack()
        if depth and torch._C._get_function_stack_at(depth - 1) is ops:
            torch._C._pop_torch_function_stack()
            self._ops_set_aside.append(module)

    def _hooks_last(self) -> bool:
        """The session's global module hooks are the last registered: each runs after the other
        global ones (a module's own hooks run after all of them)."""
        hooks = torch.nn.modules.module
        before, after = self._handles
        return next(reversed(hooks._global_forward_pre_hooks), None) == before.id and \
            next(reversed(hooks._global_forward_hooks), None) == after.id

    @_past_the_op_recorder
    def _after_module(self, module, args, output):
        if self._step.pending:
            self._copy_pending(self._step)
        if self._ops_set_aside and self._ops_set_aside[-1] is module:
            self._ops_set_aside.pop()
            torch._C._push_on_torch_function_stack(self._ops)
        staged = self._staged
        if staged is not None and module in staged.modules:
            if not isinstance(output, torch.Tensor):   # it raised (this hook is always called)
                self._staged = None
                staged.abort()
            elif staged.ends_at(module):
                self._staged = None
                return staged.finish(output)
            return None
        if self._containers and self._containers[-1] is module:
            self._containers.pop()
            return None
        if not self._records(module) or not self._records_calls(self._step):
            return None
        if self._step.chain is not None:
            self._step.chain.leave(module, output, len(self._step.groups))
        for call in reversed(self._step.calls):
            if call.module is module and not call.done:
                self._returned(call, output)
                break
        if isinstance(output, torch.Tensor) and self.recompute:
            self._late_recipe(output)

    def _returned(self, call: _Call, output) -> None:
        call.done = True
        if isinstance(output, torch.Tensor):
            call.output = weakref.ref(output)
            # ascending, though calls may return out of order (a leaf module running one it
            # does not register returns after it)
            bisect.insort(self._step.outputs.setdefault(id(call.output), []), call.index)
            call.output_version = output._version
            call.output_bytes = output.numel() * output.element_size()
            call.output_shape = tuple(output.shape)
        if self._step.profiling:
            call.end = self._any_link().mark()
            if self._measuring[0] is call:
                self._carry_peak(self._measuring[1])
                self._measuring = (None, None)

    def _records_op(self) -> bool:
        """Ops are recorded in a step's forward as modules are, and only before its backward
        began: an op after it (``total += loss.detach()``) neither is the next step's nor
        ends this one; nor inside a leaf module's forward, whose call they are part of (a
        recipe finding an op there would skip the rest of the module)."""
        return (self.recompute and not self._rerunning and not self._step.unpacks
                and self._records_calls(self._step) and torch.is_grad_enabled()
                and not _in_backward()
                and self._running_module(self._step)[1] is None)

    def _op(self, func, args, kwargs):
        """``func(*args, **kwargs)``, recorded as a call when it is an op of :data:`ADDS` on two
        distinct plain tensors of one device (``alpha`` the only keyword) in a recording forward:
        a recipe may then include it (ResNet's ``out += identity``)."""
        if len(args) != 2 or not set(kwargs) <= {"alpha"} or not self._records_op():
            return func(*args, **kwargs)
        first, second = args
        if type(first) is not torch.Tensor or type(second) is not torch.Tensor or \
                first is second or first.device != second.device:
            return func(*args, **kwargs)
        call = _Call(None, func.__name__, (self._read(first), self._read(second)), None, None,
                     in_place=ADDS[func], op=func, keywords=dict(kwargs), recomputable=True,
                     autocast=autocast_state())
        return self._run_op(call, func, args, kwargs)

    def _concat(self, func, args, kwargs):
        """``func(*args, **kwargs)``, recorded as a call when it joins two or more distinct plain
        tensors of one device (a list or tuple; ``dim`` positional or a keyword, nothing else) in
        a recording forward: a recipe may then include it (a U-Net's ``torch.cat((up, skip))``)."""
        tensors = args[0] if args else kwargs.get("tensors")
        dims = args[1:] + ((kwargs["dim"],) if "dim" in kwargs else ())   # given once at most
        dim = dims[0] if dims else 0
        if len(args) > 2 or len(dims) > 1 or not set(kwargs) <= {"tensors", "dim"} or \
                not isinstance(dim, int) or not isinstance(tensors, (list, tuple)) or \
                len(tensors) < 2 or not self._records_op():
            return func(*args, **kwargs)
        if any(type(t) is not torch.Tensor or t.device != tensors[0].device for t in tensors) or \
                len({id(t) for t in tensors}) != len(tensors):
            return func(*args, **kwargs)
        call = _Call(None, func.__name__, tuple(self._read(t) for t in tensors), None, None,
                     op=_joined, keywords={"dim": dim}, recomputable=True,
                     autocast=autocast_state())
        return self._run_op(call, func, args, kwargs)

    def _run_op(self, call: _Call, func, args, kwargs):
        """``func(*args, **kwargs)`` as the recorded ``call``: started, run, returned."""
        self._start_call(call)
        output = None
        try:
            output = func(*args, **kwargs)
        finally:
            self._returned(call, output)
        return output

    def _producer(self, step: _Step, tensor: torch.Tensor) -> str:
        """The name of what made ``tensor`` as it is saved: an in-place module running now on
        it (ReLU(inplace=True) saves its output), else the last call that returned it, else
        "op"."""
        _, running = self._running_module(step)
        if _changes_in_place(running, tensor):
            return running.name
        made_by = self._made_by(step, tensor, len(step.calls))
        return step.calls[made_by].name if made_by is not None else "op"

    def _may_recompute(self, step: _Step, gid: int) -> bool:
        """Whether group ``gid`` of ``step`` needs a recipe: in a recording step (the profile's),
        or where its step's plan or ``force`` recomputes it. Finding one is most of what a
        kept group costs the host in the forward."""
        if not self._finds_recipes(step):
            return False
        return step.profiling or self.modes is None or \
            gid < len(self.modes) and self.modes[gid] == RECOMPUTE

    def _records_calls(self, step: _Step) -> bool:
        """Whether ``step`` records its calls (modules and ops): for its times and its profile
        (recording), or for recipes (:meth:`_finds_recipes`). A step that needs neither spends
        its forward's host time on its packs alone."""
        return step.profiling or self._finds_recipes(step)

    def _finds_recipes(self, step: _Step) -> bool:
        """Whether :meth:`_may_recompute` may hold for any group of ``step``: where not, its
        groups need neither recipes nor the aliases recipes start from (:meth:`_alias`). Decided
        at its first module or group, once the step before has ended (modes change only there)."""
        if step.finds_recipes is None:
            if not self.recompute:
                step.finds_recipes = False
            elif step.profiling or self.modes is None:
                step.finds_recipes = self.force in (None, RECOMPUTE)
            else:
                step.finds_recipes = RECOMPUTE in self.modes
        return step.finds_recipes

    def _late_recipe(self, output: torch.Tensor) -> None:
        """A module that saves its own output (ReLU) packs it before its forward hook names the
        output: its recipe is found here, and a group meant to be recomputed, kept until now
        (nothing unpacks during the forward), drops its tensor."""
        step = self._step
        if not self._finds_recipes(step):
            return
        group = self._find(step, output)
        if group is None or group.recipe is not None or not self._may_recompute(step, group.gid):
            return
        recipe = self._recipe(output, step)
        if recipe is None:
            return
        group.recipe, group.producer = recipe, recipe.calls[-1].name
        if group.wanted == RECOMPUTE and group.mode == KEEP and self._mode_for(group) == RECOMPUTE:
            group.mode, group.tensor = RECOMPUTE, None
            for source in recipe.sources:
                source.readers += 1
            self._event("mode", group.gid, RECOMPUTE)

    def _recipe(self, tensor: torch.Tensor, step: _Step) -> _Recipe | None:
        """The recomputable calls (at most ``_MAX_CHAIN``) that rebuild ``tensor`` as it is now
        from saved groups, or None."""
        recipe, calls = _Recipe(), step.calls
        # An in-place module (ReLU(inplace=True)) saves its output, the tensor it was given, while
        # it runs: it ends the recipe, and what made its input (batch norm, an add) comes before.
        index, running = self._running_module(step)
        if _changes_in_place(running, tensor):
            if not running.recomputable:
                return None
            slot = self._rebuild(step, recipe, tensor, running.reads[0], index, own=True, depth=1)
            if slot is None:
                return None
            recipe.calls.append(running)
            recipe.inputs.append((slot,))
            return recipe
        now = self._read(tensor)
        if self._rebuild(step, recipe, tensor, now, len(calls), own=True) is not None:
            return recipe
        # An instance norm saves its input C reshaped, a view made inside it: no call output that
        # view, but C's maker (the convolution) rebuilds C, viewed back as saved; only where the
        # view holds C as the module was given it (the view shares C's version counter: a
        # module changing it in place before saving it, ``sigmoid_``, saves another value)
        read = self._viewed_input(running, tensor)
        if read is None or tensor._version != read.version:
            return None
        recipe = _Recipe(view=(tuple(tensor.shape), tuple(tensor.stride())))
        if self._rebuild(step, recipe, read.ref(), read, index, own=True) is None:
            return None
        return recipe

    @staticmethod
    def _running_module(step: _Step) -> tuple[int | None, _Call | None]:
        """The leaf module call whose forward is running now (its index and itself), or
        (None, None)."""
        calls = step.calls
        index = next((i for i in range(len(calls) - 1, -1, -1) if calls[i].module is not None),
                     None)
        if index is None or calls[index].done:
            return None, None
        return index, calls[index]

    def _alias(self, step: _Step, group: _Group, tensor: torch.Tensor) -> None:
        """When ``tensor``, saved as ``group``, is a view of the running module's first input
        ``C`` over exactly C's elements, both contiguous (an instance norm's ``(1, N*C, ...)``
        view of the convolution's output): ``group`` holds C's values, for recipes that read C
        once its own object is gone (:attr:`_Step.by_view`)."""
        read = self._viewed_input(self._running_module(step)[1], tensor)
        if read is None:
            return
        source = read.ref()
        step.by_view[id(read.ref)] = _Alias(
            read.ref, _ViewOf(group, tuple(source.shape), tuple(source.stride())))

    @staticmethod
    def _viewed_input(running: _Call | None, tensor: torch.Tensor) -> _Read | None:
        """The read of ``running``'s first input ``C`` where ``tensor`` is another view of
        exactly C's elements, both contiguous (:func:`_same_elements`), else None."""
        if running is None or not running.reads:
            return None
        read = running.reads[0]
        return read if _same_elements(read.ref(), tensor) else None

    @staticmethod
    def _made_by(step: _Step, made, before: int) -> int | None:
        """The index of the last call before ``calls[before]`` that returned ``made``: a tensor,
        or the weak reference of a freed one (None: no such call)."""
        ref = made if isinstance(made, weakref.ref) else weakref.ref(made)
        indices = step.outputs.get(id(ref), ())
        at = bisect.bisect_left(indices, before)
        return indices[at - 1] if at else None

    @staticmethod
    def _view_source(step: _Step, read: _Read) -> _ViewOf | None:
        """The :class:`_ViewOf` slot that reads ``read``'s tensor from a group saved as a view of
        it (:meth:`_alias`), where that group is live and at the read's version, else None."""
        alias = step.by_view.get(id(read.ref))
        if alias is None or alias.ref is not read.ref:
            return None
        group = alias.view.group
        if group.live_packs == 0 or group.version != read.version:
            return None
        return alias.view

    def _rebuild(self, step: _Step, recipe: _Recipe, tensor, read: _Read, before: int,
                 own: bool = False, depth: int = 0):
        """Where ``recipe`` gets ``tensor`` (None once freed) at the version of ``read``: a saved
        group of it at that version (a source), else a saved view over its elements at that
        version (a :class:`_ViewOf` of its source group), else the recomputable
        call before ``calls[before]`` that made it so, appended after what rebuilds its own
        reads (that call's index in the recipe); None where none exists. ``own``: the tensor
        being saved, or an in-place call's input (the tensor it changed): not a source, since
        the group of that tensor holds its later version. ``depth``: calls waiting for this one
        (each counts against ``_MAX_CHAIN``)."""
        if not own:
            if tensor is not None:
                group = self._find(step, tensor)
            else:                  # freed: its group (if saved), by its weak reference
                group = step.by_ref.get(id(read.ref))
                if group is not None and (group.ref is not read.ref or group.live_packs == 0):
                    group = None   # let go (a graph dropped during the forward)
            if group is not None:
                # a group of it at another version holds another value (a change by no call,
                # ``identity.mul_(2)``, or after the read)
                return group if group.version == read.version else None
            # none of its own: a group saved as a view of it (an instance norm's input), where
            # the recipe starts instead of rerunning what made it (the convolution)
            view = self._view_source(step, read)
            if view is not None:
                return view
        calls = step.calls
        # the last call before ``before`` that output ``tensor``: it must have left it at the
        # version read (an op or module that changed it since, recorded or not, made another
        # value). A freed tensor is that call's output by its weak reference (one per object:
        # an instance norm saves a reshaped view of its input, whose own object is gone).
        index = self._made_by(step, tensor if tensor is not None else read.ref, before)
        if index is None:
            return None
        call = calls[index]
        if not call.recomputable or not call.reads or call.output_version != read.version or \
                call in recipe.calls or len(recipe.calls) + depth >= _MAX_CHAIN:
            return None
        slots = []
        for input_read in call.reads:
            source = input_read.ref()
            slot = self._rebuild(step, recipe, source, input_read, index,
                                 own=source is not None and source is tensor, depth=depth + 1)
            if slot is None:
                return None
            slots.append(slot)
        if len(recipe.calls) + depth >= _MAX_CHAIN:
            return None
        recipe.calls.append(call)
        recipe.inputs.append(tuple(slots))
        return len(recipe.calls) - 1

    # --- pack and unpack ------------------------------------------------------------------
    @staticmethod
    def _key(tensor):
        return (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape),
                tuple(tensor.stride()), tensor.dtype, tensor.device)

    def _find(self, step, tensor, key=None):
        """The live group of ``tensor`` (``key``: its :meth:`_key`, where known): one whose packs
        were all freed (a graph dropped during the forward) gave its device and host tensors up,
        so saving the tensor again starts a new group."""
        group = step.by_key.get(self._key(tensor) if key is None else key)
        if group is not None and group.ref() is tensor and group.version == tensor._version \
                and group.live_packs > 0:
            return group
        return None

    @_past_the_op_recorder
    def _pack(self, tensor: torch.Tensor):
        group = self._group_for(tensor)
        return _Passed(tensor) if group is None else _Packed(group)

    def _group_for(self, tensor: torch.Tensor) -> _Group | None:
        if self._rerunning or _in_backward():   # e.g. a checkpoint's recomputation: not ours
            return None
        self._copy_pending(self._step, _SEQUENCE_NR())
        # nn.Parameter's isinstance is a Python metaclass call: a tensor of type Tensor is none.
        # A leaf of one dimension without grad is a module's buffer (batch norm's running
        # statistics, which a later train-mode forward changes in place without a version bump,
        # and which an eval-mode backward reads as they are then): autograd keeps it, as ever.
        # A view of a parameter (a linear layer saves its weight transposed) holds none of its
        # own memory: moving it frees nothing.
        base = tensor._base
        if tensor.is_leaf and (tensor.requires_grad or tensor.dim() <= 1) or (
                type(tensor) is not torch.Tensor and isinstance(tensor, nn.Parameter)) or \
                tensor.numel() * tensor.element_size() < self.min_bytes or tensor.is_sparse or \
                base is not None and base.is_leaf and base.requires_grad:
            return None
        link = self.link_for(tensor)
        if link is None:
            return None
        link.poll()   # offloaded tensors whose copies are done go back now, not at the next offload
        self._at_step_start()
        step = self._step
        key = self._key(tensor)
        group = self._find(step, tensor, key)
        if group is None:
            group = self._new_group(step, tensor, link, key)
        group.packs += 1
        return group

    def _new_group(self, step, tensor, link, key) -> _Group:
        gid = len(step.groups)
        self._let_go_due(step, gid)
        if step.ooms is None:
            step.ooms = link.ooms()
        recipe = self._recipe(tensor, step) if self._may_recompute(step, gid) else None
        group = _Group(gid, KEEP, tensor.numel() * tensor.element_size(), tensor.device,
                       weakref.ref(tensor), tensor._version, "", dense(tensor),
                       recipe=recipe, owner=step,
                       base=weakref.ref(tensor._base) if tensor._base is not None else None)
        group.wanted = self._wanted(group)
        group.mode = self._mode_for(group)
        if self._records_calls(step):   # named from its calls (a step without them: unnamed)
            group.producer = recipe.calls[-1].name if recipe else self._producer(step, tensor)
        step.groups.append(group)
        step.by_key[key] = group
        step.by_ref[id(group.ref)] = group
        if self._finds_recipes(step):
            self._alias(step, group, tensor)
        if step.profiling:
            if gid == 0:
                link.timing, link.stalls = True, []
            group.pack_mark = link.mark()
            step.marks.append(("pack", gid, group.pack_mark, link.allocated(),
                               self._peak(link)))
        self._event("pack", gid, group.mode)
        if group.mode == OFFLOAD:
            # copied once the op saving it has run (:meth:`_copy_pending`)
            step.pending.append((group, tensor, _SEQUENCE_NR()))
        elif group.mode == KEEP:
            if self._keeps_apart(step, group):   # a copy: once the op has run, as an offload
                step.pending.append((group, tensor, _SEQUENCE_NR()))
            else:
                group.tensor = tensor.detach()
                group.kept_version = group.tensor._version
        else:
            for source in recipe.sources:
                source.readers += 1
        return group

    def _copy_pending(self, step: _Step, before: int | None = None) -> None:
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
            link = self.link_for_group(group)
            if group.mode == KEEP:
                group.tensor = link.keep_apart(tensor)
                group.kept_version = group.tensor._version
                continue
            due = self._release_point(step, group)
            if due is not None:    # not a point the forward has passed while the op ran
                due = max(due, len(step.groups))
            group.host = self._copy(step, link, "d2h", group.nbytes, lambda: link.offload(
                tensor, self._inline(step), held=due is not None))
            group.release = link.release
            if due is not None:
                # the transfer itself: a group whose packs are all freed meanwhile (its graph
                # dropped in the forward) gives back its host copy and forgets it
                step.releases.setdefault(due, []).append((group, group.host))
            if step.profiling:             # recording: copies inline
                for call in step.calls:    # the calls running now: the copy is in their time
                    if call.end is None and call.start is not None:
                        call.moved += group.nbytes
            self._event("offload", group.gid)

    def _keeps_apart(self, step: _Step, group: _Group) -> bool:
        """Whether kept ``group`` is copied apart (:meth:`SameMemoryLink.keep_apart`): in a planned
        step of a plan run with :attr:`~planner.OffloadPlan.keep_apart`, one of
        :func:`planner.kept_apart` (a dense group of at most :data:`~planner.KEEP_APART_SHARE`
        of the profile's largest group). The caching allocator places a tensor in the smallest
        free block that holds it: kept tensors made in the forward fill the holes large
        activations leave, live through the backward, and split the space the
        backward's large tensors need into pieces too small for them. Under a cap it then frees
        its whole cache, after a synchronisation, and maps memory again
        (benchmarks/results/pressure)."""
        if step.profiling or self.fell_back or self.plan is None or not self.plan.keep_apart \
                or self.profile is None or not group.offloadable:
            return False
        if self._apart[0] is not self.plan:
            self._apart = (self.plan, set(planner.kept_apart(self.profile, self.plan.modes)))
        return group.gid in self._apart[1] and \
            self.profile.groups[group.gid].nbytes == group.nbytes

    def _release_point(self, step: _Step, group: _Group) -> int | None:
        """The forward point at which a planned step lets go of offloaded ``group``'s device
        tensor, as the plan's peak model has it (its ``releases``); with fixed ``modes``,
        :func:`planner.release_point` on the profile; under a budget no plan met, the next
        point. None where nothing is planned for it (a recording step or a fall-back, whose
        copies are inline; a group the profile does not have): the link then lets go once its
        copy is done."""
        profile, gid = self.profile, group.gid
        if self._inline(step) or profile is None or gid >= len(profile.groups) \
                or profile.groups[gid].nbytes != group.nbytes:
            return None
        if self.plan is None:
            # fixed modes: as the profile has it; under a budget no plan met: the least memory
            return planner.release_point(profile, gid, 0 if self.budget is not None else None)
        releases = self.plan.releases
        if gid < len(releases) and releases[gid] >= 0:   # the plan's (its release margin's)
            return releases[gid]
        return planner.release_point(profile, gid)

    def _let_go_due(self, step: _Step, point: int | None) -> None:
        """The offloaded groups due at forward ``point`` (None: all, the forward is over) go."""
        due = step.releases.pop(point, ()) if point is not None else [
            entry for point in sorted(step.releases) for entry in step.releases.pop(point)]
        for group, transfer in due:
            self.link_for_group(group).let_go(transfer)
            self._event("release", group.gid)

    def _mode_for(self, group: _Group) -> str:
        """The wanted mode where it can be carried out (else kept)."""
        wanted = group.wanted
        if wanted == OFFLOAD and not group.offloadable:
            return KEEP
        if wanted == RECOMPUTE and (group.recipe is None or any(
                source.mode == OFFLOAD for source in group.recipe.sources)):
            return KEEP
        return wanted

    def _wanted(self, group: _Group) -> str:
        wanted = KEEP
        if self.force is not None:
            wanted = self.force
        elif self._step.profiling:
            wanted = OFFLOAD
        elif self.modes is not None:
            if group.gid < len(self.modes) and (self.profile is None or (
                    group.gid < len(self.profile.groups)
                    and self.profile.groups[group.gid].nbytes == group.nbytes)):
                wanted = self.modes[group.gid]
            elif not self._mismatch_said:
                self._mismatch_said = True
                self.say(f"this step saves other tensors than the profiled one (group "
                         f"{group.gid}); keeping those")
        return wanted

    def _unpack(self, packed):
        if not isinstance(packed, _Packed):
            return packed.check() if isinstance(packed, _Passed) else packed
        group = packed.group
        step = group.owner
        if step.pending:   # its forward is over: every op saving a pending group has run
            self._copy_pending(step)
        self._check_version(group)
        if step is not self._step:
            # a graph of a step that has ended (a forward kept for later, its backward after
            # the next step's): its group is restored as ever, and is no part of this step
            return self._restored(group)
        index = step.unpacks
        step.unpacks += 1
        link = self.link_for_group(group)
        link.poll()   # the forward's last offloads end during the backward
        if step.releases:   # the first unpack: the forward is over
            self._let_go_due(step, None)
        peak_before = self._peak(link) if step.profiling else 0
        # autograd's final callback can only be queued from inside a backward (an unpack can also
        # come from Python reading ``grad_fn._saved_*``): at the first unpack inside one
        if not step.watching and _in_backward():
            step.watching = True

            def backward_done(step=step, link=link):
                step.backward_done = True
                if step.profiling:      # the backward's last ops follow its last unpack
                    step.end_mark = link.mark()
            _at_end_of_backward(backward_done)
        if group.first_unpack is None:
            group.first_unpack = index
        # what a node unpacked stays alive (autograd holds it) until the node is done, so in the
        # model its last unpack is the node's last
        node = _current_node()
        if node is None or node is not step.node:
            step.node, step.node_groups = node, []
        step.node_groups.append(group)
        for unpacked in step.node_groups:
            unpacked.last_unpack = index
        if self._trial is not None and not step.profiling:
            # a flush since the last read came in the op after the last unpack (the forward:
            # before the first), or in what that unpack fetched or rebuilt
            self._trial.saw_flushes(link, index - 1)
        scheduled = [step.groups[gid] for gid in self._schedule.get(index, ())
                     if gid < len(step.groups)]
        if group in scheduled:   # the one needed now goes first on the copy stream
            self._prefetch(group, index)
        if group.mode == OFFLOAD and group.tensor is None and group.fetch is None:
            # on demand: not prefetched
            group.fetch = self._copy(step, link, "h2d", group.nbytes, lambda: link.fetch(
                group.host, group.device, self._inline(step)))
            self._event("fetch", group.gid, index)
        for other in scheduled:
            self._prefetch(other, index)
        tensor = self._materialize(group, link)
        self._event("unpack", group.gid, index)
        if step.profiling:
            at = max(link.allocated(), self._peak(link))   # with this group fetched
            step.marks.append(("unpack", index, link.mark(), at, peak_before))
        group.unpacks += 1
        group.drop_device()    # a moved group's last unpack: autograd holds the rest of its use
        return tensor

    @staticmethod
    def _check_version(group: _Group) -> None:
        """PyTorch's error where the saved tensor was changed in place since its pack (as autograd
        raises without saved-tensor hooks): read through the tensor itself while it lives, or
        the kept alias, which shares its version counter."""
        original = group.ref()
        if original is None and group.base is not None:
            original = group.base()
        if original is not None and original._version != group.version:
            raise RuntimeError(inplace_message(original, group.version))
        kept = group.tensor if group.mode == KEEP else None
        if kept is not None and group.kept_version is not None and \
                kept._version != group.kept_version:
            raise RuntimeError(inplace_message(kept, group.kept_version))

    def _restored(self, group: _Group) -> torch.Tensor:
        """A group of an ended step, unpacked: its values, on demand (no schedule, no profile)."""
        link = self.link_for_group(group)
        if group.mode == OFFLOAD and group.tensor is None and group.fetch is None:
            group.fetch = link.fetch(group.host, group.device)
        tensor = self._materialize(group, link)
        group.unpacks += 1
        group.drop_device()
        return tensor

    @staticmethod
    def _copy(step: _Step, link: SameMemoryLink, direction: str, nbytes: int, copy) -> Transfer:
        """``copy()``; in a recording step (whose copies are inline, each alone on the compute
        stream) between two marks, which time the host link (:meth:`_link_speeds`)."""
        if not step.profiling:
            return copy()
        before = link.mark()
        transfer = copy()
        step.copies.append((direction, nbytes, before, link.mark()))
        return transfer

    def _inline(self, step: _Step) -> bool:
        """Copies on the compute stream: in the recording step (its times are then compute plus
        known copies, with no host waits, and its memory that of ``save_on_cpu``) and after a
        fall-back (the least memory)."""
        return step.profiling or self.fell_back

    def link_for_group(self, group):
        return self._link or self._links.get(group.device.index) or SameMemoryLink()

    def _prefetch(self, group: _Group, index: int) -> None:
        if group.mode == OFFLOAD and group.fetch is None and group.tensor is None \
                and group.unpacks == 0 and group.host is not None:
            group.fetch = self.link_for_group(group).fetch(group.host, group.device)
            self._event("prefetch", group.gid, index)

    def _materialize(self, group: _Group, link) -> torch.Tensor:
        if group.tensor is not None:
            return group.tensor
        if group.mode == OFFLOAD:
            group.tensor, group.fetch = link.wait(group.fetch), None
        elif group.mode == RECOMPUTE:
            # its recomputed sources not on the device first, each once (then held until its
            # own last unpack and while a recomputed group may read it: ``readers``)
            for rebuilt in _rebuild_order(group):
                original = rebuilt.ref()   # as autograd refuses a saved tensor changed in place
                if original is not None and original._version != rebuilt.version:
                    raise RuntimeError(f"mucudnn.torch: saved tensor {rebuilt.gid} changed after "
                                       "it was saved; cannot recompute it")
                rebuilt.tensor = self._recompute_group(rebuilt, link)
        return group.tensor

    def _recompute_group(self, group: _Group, link) -> torch.Tensor:
        recipe = group.recipe
        sources = recipe.sources
        for source in sources:
            # a recomputed source is a new tensor holding the value at the version saved
            held = source.version if source.kept_version is None else source.kept_version
            if source.tensor is None or (source.mode == KEEP and source.tensor._version != held):
                raise RuntimeError(f"mucudnn.torch: source {source.gid} of saved tensor "
                                   f"{group.gid} changed after it was saved; cannot recompute it")
        # the sources' tensors and the views of them the recipe reads
        kept = [source.tensor for source in sources]
        values: list[torch.Tensor | None] = []
        self._rerunning = True
        try:
            with torch.no_grad():
                for call, slots in zip(recipe.calls, recipe.inputs):
                    inputs = []
                    for slot in slots:
                        if isinstance(slot, _Group):
                            inputs.append(slot.tensor)
                        elif isinstance(slot, _ViewOf):
                            inputs.append(slot.of(slot.group.tensor))
                            kept.append(inputs[-1])
                        else:      # read once: the recipe lets go of it (or changes it) here
                            inputs.append(values[slot])
                            values[slot] = None
                    # an in-place call changes its first input: never a kept tensor (an
                    # Identity passes one on)
                    if call.in_place and any(inputs[0] is tensor for tensor in kept):
                        inputs[0] = inputs[0].clone()
                    values.append(call.run(inputs))
        finally:
            self._rerunning = False
        self._event("recompute", group.gid, tuple(source.gid for source in sources))
        return values[-1] if recipe.view is None else _viewed(values[-1], *recipe.view)

    def _event(self, *event):
        if self.trace is not None:
            self.trace.append(event)

    # --- steps, profile, plan -------------------------------------------------------------
    def _end_step(self, failed: bool = False, out_of_memory: bool = False,
                  abandoned: bool = False) -> None:
        """The step is over: the next one saves its first tensor or runs its first module, or its
        forward raised (``failed``; ``out_of_memory`` when it ran out of device memory), or its
        graph was dropped without a backward (``abandoned``: the next step runs as it would
        have, recording or planned; nothing is learnt from this one).

        When the next step runs other modes (the plan made, each plan of a trial, the one kept
        after it, a plan made again, the fall-back), the links' caching allocators start it
        empty: between steps little is allocated (parameters, the optimizer's state), so each
        plan lays its tensors out from the same state rather than in the holes the last plan's
        layout left, and a trial compares plans, not the order it ran them in. After a failed
        step that waits for the next step's start: until the script lets go of the error, its
        traceback holds the failed forward's tensors.
        """
        if abandoned:
            for used in self._links_in_use():
                used.settle()
            self._step = _Step(profiling=self._step.profiling)
            self._event("abandoned", self.steps)
            return
        plan, modes = self.plan, self.modes
        self._close_step(failed, out_of_memory)
        if self.modes is not None and (self.modes != modes or self.plan is not plan):
            if failed:
                self._empty_cache_due = True
            else:
                self._empty_caches()

    def _at_step_start(self) -> None:
        """A module runs or a tensor is saved: if the step before has unpacked (its backward
        ran), this one is the next step's first, and that step ends here; a cache emptying
        left due by a failed step happens here too."""
        if self._step.unpacks:
            self._end_step()
        elif self._step.abandoned():
            self._end_step(failed=True, abandoned=True)
        if self._empty_cache_due:
            self._empty_caches()

    def _empty_caches(self) -> None:
        self._empty_cache_due = False
        for link in self._links_in_use():
            link.empty_cache()
        self._event("empty_cache", self.steps)

    def _close_step(self, failed: bool, out_of_memory: bool) -> None:
        finished = self._step
        link = self._any_link()
        for used in self._links_in_use():
            used.settle()   # a step's copies to the host are over (one whose forward failed too)
        # the rest of the backward, the optimizer and the next forward up to here
        tail_peak = self._peak(link) if finished.profiling else 0
        if not failed and finished.unpacks and not finished.backward_done:
            # its backward raised; out of memory if the allocator refused something meanwhile
            # (a refusal that an op caught, cuDNN trying a workspace, does not end a backward)
            failed = True
            out_of_memory = finished.ooms is not None and link.ooms() > finished.ooms
        # the first recording pins the host pool (seconds of the host waiting, which leave the
        # copies' own time uncertain); the profile is the last of ``record_steps``, with each time
        # the least of them all (planner.least_times)
        more_recording = finished.profiling and not failed and self._recordings_left > 1
        if finished.profiling and not failed:
            self._recordings_left -= 1
        self._step = _Step(profiling=finished.profiling and (failed or more_recording))
        if failed:
            # What the failed step's error still refers to (its traceback's frames, autograd's
            # unrun nodes) reaches its groups: they let go of their device tensors, and reference
            # cycles through those frames are collected now, before this step allocates. Without
            # both, every later step began with most of the failed step's memory still allocated,
            # and each ran out of memory.
            for group in finished.groups:
                group.tensor, group.fetch, group.readers = None, None, 0
            finished.node, finished.node_groups = None, []
            gc.collect()
        self.steps += 1
        if failed and finished.profiling:
            self.say("the recording step failed" + (" (out of device memory)" if out_of_memory
                                                    else "") + "; recording the next one")
            return
        if failed:
            trial, self._trial = self._trial, None
            if trial is not None and trial.current > 0:
                # a step of a plan after the first failed: the fastest of those that ran stays
                label = trial.labels[trial.current]
                self._end_trial(trial, trial.current,
                                f"the plan {label} ran out of device memory in its trial"
                                if out_of_memory else f"a step of the plan {label} failed in "
                                "its trial")
                self._schedule = self._prefetch_schedule(self.modes)
                return
            # its unpacks are partial: the prefetch schedule stays that of the last whole step
            if out_of_memory and not self.fell_back and self.budget is not None:
                if self._plan_again():
                    return
                # as the recording step ran: everything offloaded, fetched on demand
                self.fell_back = True
                recorded = self.profile.groups if self.profile is not None else finished.groups
                self.modes = offload_everything(recorded)
                self._schedule = {}
                self.write_profile()
                self.say(f"a step under the offload plan for {self.budget / 2**30:.2f} GiB ran "
                         "out of device memory; offloading every saved tensor from now on")
            return
        self._first_unpacks = [g.first_unpack for g in finished.groups]
        self._say_unmoved(finished)
        if finished.profiling and finished.groups:
            # what the recorded step left that every later step carries (the optimizer's state,
            # made by its first step): each point of the profile has it too
            grown = 0
            if finished.start_allocated is not None:
                grown = max(0, link.allocated() - finished.start_allocated)
            self._recorded.append(self._profile_of(finished, tail_peak, grown))
            self._stage_candidates = self._stage_candidates_of(finished)
            self._peak(link)   # what a probe of the link allocated there is no step's
            if not more_recording:
                # each time the least recorded: a host that fell behind in one recording
                # stretched its times there
                self.profile = planner.least_times(self._recorded)
                self._recorded = []
                self._make_plan()
        elif self._trial is not None and not finished.profiling:
            self._advance_trial(link, finished.unpacks)
        elif not finished.profiling and self.plan is not None and self.trials \
                and not self.fell_back:
            self._watch_flushes()
        # a recording step fetches on demand (its memory is save_on_cpu's, and its baselines
        # count no group before its first unpack); so does a fall-back
        self._schedule = {} if self.fell_back or self._step.profiling else self._prefetch_schedule(
            [g.mode for g in finished.groups] if self.modes is None else self.modes)

    def _say_unmoved(self, step: _Step) -> None:
        """One line, once, when a step kept groups its plan moves (no recipe found, not dense):
        its peak is then over the plan's."""
        unmoved = [g for g in step.groups if g.wanted != KEEP and g.mode == KEEP]
        if unmoved and not step.profiling and not self._unmoved_said:
            self._unmoved_said = True
            first = unmoved[0]
            # a planned step names no group: the profile's name for it, where there is one
            profiled = self.profile.groups if self.profile is not None else ()
            name = first.producer or (profiled[first.gid].producer if first.gid < len(profiled)
                                      else "unnamed")
            self.say(f"{len(unmoved)} saved tensors the plan offloads or recomputes were kept "
                     f"({sum(g.nbytes for g in unmoved) / 2**20:.1f} MiB; first: group "
                     f"{first.gid}, {name}, wanted {first.wanted})")

    @property
    def target(self) -> int | None:
        """What plans are made for: ``budget * (1 - headroom)``, lower after a planned step that
        ran out of memory or a plan that flushed, higher where no plan met it
        (:meth:`_plan_with_less_headroom`)."""
        if self._lowered_target is not None:
            return self._lowered_target
        return (planner.planning_target(self.budget, self.headroom) if self.budget is not None
                else None)

    def _plan_again(self) -> bool:
        """After a planned step ran out of memory: a plan for a lower target, if replans are left
        and one meets it (True), with one line."""
        if self.plan is None or self.profile is None or self.replans_left <= 0:
            return False
        self.replans_left -= 1
        self.replans_used += 1
        modelled = self.plan.peak
        target = min(self.target, modelled) - int(self.replan_step * self.budget)
        if target <= 0:     # nothing left to plan for: the fall-back (everything offloaded)
            return False
        try:
            plan = self._plan_for(target)
        except MucudnnError:
            return False
        self._lowered_target, self.plan, self.modes = target, plan, list(plan.modes)
        self.kept_after_trial = None
        self._watch_from_now()   # not the flush of the step that failed (a retry before it)
        self._schedule = self._prefetch_schedule(self.modes)
        self.write_profile()
        self.say(f"a step under the offload plan for {self.budget / 2**30:.2f} GiB ran out of "
                 f"device memory (modelled peak {modelled / 2**30:.2f} GiB); planning for "
                 f"{target / 2**30:.2f} GiB: {plan.describe()}")
        return True

    def _plan_for(self, target: int, explain: bool = True) -> planner.OffloadPlan:
        """The plan for ``target``. Where none meets it, :class:`InfeasibleError` (with
        ``explain``: saying the least peak, solved for) and :attr:`_no_plan_at` raised to it:
        no lower target is solved again."""
        if self._no_plan_at is not None and target <= self._no_plan_at:
            raise InfeasibleError(f"no plan within {describe_size(target)}: none within "
                                  f"{describe_size(self._no_plan_at)} either")
        try:
            return planner.plan_with_prefetch(self.profile, target, self.lookahead,
                                              self.plan_time_limit_s, explain=explain)
        except InfeasibleError:
            self._no_plan_at = max(target, self._no_plan_at or 0)
            raise

    def _make_plan(self, plan: planner.OffloadPlan | None = None) -> None:
        """The plan for :attr:`target` (``plan``: made for it already) in force, said in one
        line, and a trial of the others worth running against it (:func:`planner.trial_plans`;
        for smaller headrooms too, unless the target was lowered)."""
        target = self.target
        if plan is None and self._stage_candidates:
            plan = self._choose_stage(target)
        try:
            self.plan = plan or self._plan_for(target)
        except MucudnnError as exc:   # infeasible, or CBC failed
            self.plan = self._plan_with_less_headroom(exc)
            if self.plan is None:
                if self.strict:
                    raise
                # an unmodified script: go on as the recorded step ran (everything offloaded)
                self.say(f"{exc}; offloading every saved tensor")
                self.modes = offload_everything(self.profile.groups)
                self.write_profile()
                return
            target = self.target
            self.say(f"no offload plan for {self.budget / 2**30:.2f} GiB less its headroom "
                     f"({self.headroom:.0%}); planning for {target / 2**30:.2f} GiB, "
                     f"{1 - target / self.budget:.1%} less")
        self.modes = list(self.plan.modes)
        self._watch_from_now()
        self.say(f"offload plan for {self.budget / 2**30:.2f} GiB"
                 + (f" (planned for {target / 2**30:.2f} GiB)"
                    if self._lowered_target is not None else "")
                 + f": {self.plan.describe()}"
                 + (f"; {self.stage.stage.describe()}" if self.stage is not None else ""))
        self.write_profile()
        if not self.trials:
            return
        others = planner.trial_plans(
            self.profile, target, self.plan, self.lookahead, self.plan_time_limit_s,
            planner.trial_budgets(self.budget, self.headroom)
            if self._lowered_target is None else (),
            keep_apart=self.keep_apart)
        # alone, the plan is still run as a trial where a lower target can follow: whether it
        # flushes the caching allocator's cache (:meth:`_plan_below_flushes`)
        if others or (self.headroom and self.lowerings_left > 0):
            self._trial = _Trial([self.plan] + [plan for _, plan in others],
                                 ["as made"] + [label for label, _ in others],
                                 seen=self._flush_counts_now())
        if others:
            self.say("trying it against " + "; ".join(
                f"the plan {label} ({plan.describe()})" for label, plan in others)
                + f", {planner.TRIAL_STEPS} steps each")

    def _stage_candidates_of(self, step: _Step) -> list:
        """The stages recording ``step``'s leading chain allows (stage.py): (planner.Stage,
        its modules, their container, the batch)."""
        chain = step.chain
        # a staged chain reruns its convolutions, and sums its parameters' gradients over
        # micro-batches: not where convolutions may not rerun (MUCUDNN_OFFLOAD=cheap)
        if chain is None or not chain.links or not self.recompute_convolutions:
            return []
        link = self._any_link()
        d2h, _ = self._link_speeds(step, link)
        group = step.by_key.get(chain.input_key)
        input_group = group.gid if group is not None else None
        return [(stage, modules, chain.parent, chain.batch)
                for stage, modules in chain.candidates(
                    input_group, lambda call: _call_ms(link, call, d2h) or 0.0)]

    def _choose_stage(self, target: int) -> planner.OffloadPlan | None:
        """Whether a plan stages the leading chain (stage.py), weighed once on the recorded
        profile: the plain plan for ``target`` against each candidate's plan on its
        :func:`planner.staged_profile` (its micro-batches :func:`planner.stage_chunks`). A staged
        plan is taken where it is predicted faster by :data:`planner.STAGE_MIN_GAIN` or the
        plain one has none; where none has a plan, the candidate of the least peak, if lower
        than the plain profile's (its headroom is then lowered as ever). Taken, its profile
        becomes :attr:`profile`. Returns the plan taken (None: none meets ``target``)."""
        candidates, self._stage_candidates = self._stage_candidates, []

        def plan_on(profile):
            try:
                return planner.plan_with_prefetch(profile, target, self.lookahead,
                                                  self.plan_time_limit_s, explain=False)
            except MucudnnError:
                return None
        plain = plan_on(self.profile)
        options = []
        for stage, modules, parent, batch in candidates:
            chunks = planner.stage_chunks(self.profile, stage)
            if chunks is None or min(chunks, batch) < 2:
                continue
            stage = replace(stage, chunks=min(chunks, batch))
            staged = planner.staged_profile(self.profile, stage)
            options.append((plan_on(staged), staged, StagePlan(stage, modules, parent)))
        planned = [option for option in options if option[0] is not None]
        if planned:
            best = min(planned, key=lambda option: option[0].predicted_ms)
            if plain is not None and self.staging != "always" and \
                    best[0].predicted_ms >= plain.predicted_ms * (1 - planner.STAGE_MIN_GAIN):
                return plain
        elif plain is None and options:
            peaks = [planner.least_peak(option[1], self.lookahead) for option in options]
            lowest = min(peaks)
            best = options[peaks.index(lowest)]
            if lowest >= planner.least_peak(self.profile, self.lookahead) and \
                    self.staging != "always":
                return None
        else:
            return plain
        plan, staged, self.stage = best
        self.recorded_profile, self.profile = self.profile, staged
        self._no_plan_at = None
        self._first_unpacks = [group.first_unpack for group in staged.groups]
        return plan

    def _advance_trial(self, link: SameMemoryLink, unpacks: int) -> None:
        """A planned step of the trial ended (its backward ``unpacks`` points; a flush since the
        last unpack came after the last point's op): the next plan's turn after
        :data:`planner.TRIAL_STEPS` steps, and after the last plan's, :meth:`_Trial.kept` stays."""
        trial = self._trial
        for used in self._links_in_use():   # after the last unpack: its op, the optimizer's
            trial.saw_flushes(used, unpacks - 1)
        trial.marks[trial.current].append(link.mark())
        trial.flushes[trial.current].append(link.flushes())
        if len(trial.marks[trial.current]) < planner.TRIAL_STEPS:
            return
        if trial.current + 1 < len(trial.plans):
            trial.current += 1
            self.plan = trial.plans[trial.current]
            self.modes = list(self.plan.modes)
            return
        self._end_trial(trial, len(trial.plans), "offload plans tried")

    def _end_trial(self, trial: _Trial, ran: int, why: str) -> None:
        """:meth:`_Trial.kept` of the trial's first ``ran`` plans (each timed) stays, said in one
        line that starts with ``why``."""
        times = [trial.step_ms(index) for index in range(ran)]
        best = trial.kept(times)
        self._trial = None
        self._watch_from_now()   # the plan kept, or made for less below
        timed = ", ".join(f"{trial.labels[index]} {ms:.1f} ms a step{trial.flush_note(index)}"
                          for index, ms in enumerate(times))
        alone = len(trial.plans) == 1
        if ran == len(trial.plans) and all(trial.flushes_in(index) for index in range(ran)):
            lower = self._plan_below_flushes(min(plan.peak for plan in trial.plans))
            if lower is not None:
                self.say((f"the offload plan ran {times[0]:.1f} ms a step{trial.flush_note(0)}; "
                          "it flushed" if alone else f"{why}: {timed}; each flushed")
                         + " the caching allocator's cache, so planning for "
                         f"{self.target / 2**30:.2f} GiB")
                self._make_plan(lower)
                return
        if alone:   # it stays, flushing or not (no lower target): nothing to say
            return
        self.kept_after_trial = trial.labels[best] if best else None
        self.plan = trial.plans[best]
        self.modes = list(self.plan.modes)
        self.write_profile()
        self.say(f"{why}: {timed}; keeping the plan {trial.labels[best]}")

    def _flush_counts_now(self) -> dict:
        """Each link in use and its caching allocator's flush count now."""
        return {link: link.flushes() for link in self._links_in_use()}

    def _watch_from_now(self) -> None:
        """The watch (:meth:`_watch_flushes`) of the plan that comes into force: no step of it
        yet, and flushes counted from here."""
        self._flushing.clear()
        self._flush_counts = self._flush_counts_now()

    def _watch_flushes(self) -> None:
        """A planned step of the plan in force ended after its trial: once
        :data:`planner.WATCH_FLUSHING` of its last :data:`planner.WATCH_STEPS` steps flushed the
        caching allocator's cache, the plan for less (:meth:`_plan_below_flushes`) is made and
        tried, with one line; where none is left, the plan stays and nothing more is said."""
        counts = self._flush_counts_now()
        self._flushing.append(any(count > self._flush_counts.get(link, count)
                                  for link, count in counts.items()))
        self._flush_counts = counts
        flushed = sum(self._flushing)
        if flushed < planner.WATCH_FLUSHING:
            return
        steps = len(self._flushing)
        self._flushing.clear()
        lower = self._plan_below_flushes(self.plan.peak)
        if lower is None:
            return
        self.say(f"the offload plan flushed the caching allocator's cache in {flushed} of its "
                 f"last {steps} steps, so planning for {self.target / 2**30:.2f} GiB")
        self._make_plan(lower)

    def _plan_with_less_headroom(self, error: MucudnnError) -> planner.OffloadPlan | None:
        """Where no plan meets the target the headroom leaves (``error``, an
        :class:`InfeasibleError`): the plan for the budget less half the headroom, else a
        quarter, ..., down to :data:`planner.LEAST_HEADROOM`
        (:func:`planner.smaller_headrooms`, none below the least peak ``error`` found); the
        target then that one, and no lowering after a flush (a lower target has no plan).
        None where none meets even that, where CBC failed (a plan may exist), or where the
        target is not the headroom's. The headroom is a guess at the caching allocator's
        fragmentation; near the step's least peak the flushes and the replans after running
        out of memory measure it."""
        if self.budget is None or self._lowered_target is not None:
            return None
        plan = planner.plan_with_less_headroom(
            error, self.budget, self.headroom, lambda target: self._plan_for(target, explain=False))
        if plan is not None:
            self._lowered_target = plan.target
            self.lowerings_left = 0
        return plan

    def _plan_below_flushes(self, flushed_peak: int) -> planner.OffloadPlan | None:
        """After a trial whose every plan flushed the caching allocator's cache, or a plan kept
        after its trial that flushes (:meth:`_watch_flushes`; fragmentation the model does not
        see needs more room than its headroom): the plan for a target half
        the headroom lower (at most ``replans`` such lowerings, apart from the replans after
        running out of memory; None, the target unchanged, where none is left or no plan meets
        that target; after such a target, none is tried again: a lower one has no plan either).
        A flush costs a step more than the room does (benchmarks/results/pressure).

        A plan's time steps up at some peaks: where the plan for a quarter of the headroom lower
        is faster by :data:`planner.LOWERING_MIN_GAIN` and still peaks below ``flushed_peak``
        (the least predicted peak of the plans that flushed), it is made instead
        (:meth:`_nearer_lowering`)."""
        if self.lowerings_left <= 0 or not self.headroom:
            return None
        step = int(self.headroom / 2 * self.budget)
        target = self.target - step
        try:
            plan = self._plan_for(target)
        except MucudnnError:
            # no plan meets it, nor any lower one (or CBC failed): not solved again
            self.lowerings_left = 0
            return None
        target, plan = self._nearer_lowering(target + step // 2, target, plan, flushed_peak)
        self.lowerings_left -= 1
        self.replans_used += 1
        self._lowered_target = target
        return plan

    def _nearer_lowering(self, nearer: int, target: int, plan: planner.OffloadPlan,
                         flushed_peak: int) -> tuple[int, planner.OffloadPlan]:
        """``(nearer, its plan)`` where that plan peaks below ``flushed_peak`` (so it gives room
        all the same) and is predicted faster than ``plan`` (for ``target``) by
        :data:`planner.LOWERING_MIN_GAIN`; else ``(target, plan)``: a plan's time steps up at some
        peaks, and a lowering by half the headroom may pass a step that a quarter does not."""
        try:
            near = self._plan_for(nearer, explain=False)
        except MucudnnError:   # CBC failed (a lower target has a plan)
            return target, plan
        if near.peak < flushed_peak and \
                near.predicted_ms < plan.predicted_ms * (1 - planner.LOWERING_MIN_GAIN):
            return nearer, near
        return target, plan

    def write_profile(self) -> bool:
        """``profile_to``: the budget, the target, the recorded profile (its dataclass's fields),
        the plan's description (None: no plan met the target) and its release points with their
        margin, whether the session fell back to offloading everything after planned steps ran
        out of memory (``fell_back``: the plan is then the last one tried), how a plan kept after
        a trial was made (``kept_after_trial``) and the modes in force, as one JSON document
        written atomically; each plan made (or kept after a trial) rewrites it. Never raises: a
        path that cannot be written is one line (the step goes on)."""
        if not self.profile_to or self.profile is None:
            return False
        import dataclasses
        import json
        from ..outputs import write_text_atomically
        def plain(value):  # a NumPy or torch scalar given as the budget, a link's speeds, ...
            if hasattr(value, "item"):
                return value.item()
            raise TypeError(f"{type(value).__name__} is not JSON serializable")

        try:
            plan = self.plan
            document = {"budget": self.budget, "target": self.target,
                        "plan": plan.describe() if plan is not None else None,
                        # where its offloads leave the device, and the margin that put them there
                        "releases": list(plan.releases) if plan is not None else None,
                        "release_margin": plan.release_margin if plan is not None else None,
                        "fell_back": self.fell_back, "modes": self.modes,
                        # a plan kept after a trial is made from this profile as its label says
                        "kept_after_trial": self.kept_after_trial,
                        "format": 2,   # profiles.FORMAT: what profiles.load_profile reads
                        "profile": dataclasses.asdict(self.profile)}
            if self.stage is not None:   # the profile is the staged one, made from the recorded
                document.update(stage=dataclasses.asdict(self.stage.stage),
                                recorded_profile=dataclasses.asdict(self.recorded_profile))
            write_text_atomically(self.profile_to, json.dumps(document, default=plain) + "\n")
        except (OSError, ValueError, TypeError) as exc:
            self.say(f"the offload profile was not written to {self.profile_to}: {exc}")
            return False
        return True

    @property
    def prefetch_margin(self) -> float:
        """The plan's :func:`planner.prefetch_point` margin (0 without a plan: untimed)."""
        return self.plan.prefetch_margin if self.plan is not None else 0.0

    @property
    def prefetch_distance(self) -> int:
        """How many unpacks ahead offloaded groups are fetched: the plan's (it may prefetch less
        than ``lookahead`` to fit), else ``lookahead``."""
        return self.plan.lookahead if self.plan is not None else self.lookahead

    def _prefetch_schedule(self, modes) -> dict[int, list[int]]:
        """Unpack index -> offloaded groups to fetch then, relative to the first unpack of each as
        the last finished step unpacked them (vDNN's prefetch; one it never unpacked is fetched
        on demand): as many unpacks ahead as the planner's model has it
        (:func:`planner.prefetch_point` on the profile), else ``prefetch_distance``."""
        schedule = defaultdict(list)
        profile = self.profile
        for gid, (first, mode) in enumerate(zip(self._first_unpacks, modes)):
            if mode != OFFLOAD or first is None:
                continue
            distance = self.prefetch_distance
            if profile is not None and gid < len(profile.groups):
                distance = profile.groups[gid].first_unpack - planner.prefetch_point(
                    profile, gid, self.prefetch_distance, self.prefetch_margin)
            schedule[max(0, first - distance)].append(gid)
        # at each point in the order the groups were saved, so the one needed last is allocated
        # first and freed last: stack order for the caching allocator. Needed-first order (the
        # fetch queue's best) allocated them the other way round, and the allocator flushed its
        # cache where this order does not. The one needed at that unpack goes first all the same
        # (:meth:`_unpack`); planner.simulate plays this.
        return dict(schedule)

    @staticmethod
    def _link_speeds(step: _Step, link: SameMemoryLink) -> tuple[float, float]:
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

    @staticmethod
    def _clock(step: _Step, link: SameMemoryLink, marks: list, points: int, direction: str
               ) -> list[float]:
        """Compute ms from the first of a recording step's ``marks`` (its packs, or its unpacks)
        to each: their times less its own inline copies ``direction`` before each (the forward's
        offloads, the backward's on-demand fetches; each between two marks, in issue order),
        non-decreasing; [] without marks."""
        if not marks:
            return []
        start = marks[0][2]
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

    def _profile_of(self, step: _Step, tail_peak: int = 0, grown: int = 0
                    ) -> planner.StepProfile:
        link = self._any_link()
        unpacks = max(step.unpacks, 1)
        d2h, h2d = self._link_speeds(step, link)
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
        # compute only: the host's waits for copies and for pinned memory are left out
        forward_ms = link.compute_ms(packs[0][2], unpack_marks[0][2]) if unpack_marks else 0.0
        backward_ms = (link.compute_ms(unpack_marks[0][2], step.end_mark or unpack_marks[-1][2])
                       if unpack_marks else 0.0)
        link.timing, link.stalls = False, []
        moved = sum(g.nbytes for g in groups if g.offloadable)
        # The recording step copied every offloaded tensor on the compute stream, to the host in
        # the forward and back on demand in the backward: those copies are not compute (at least
        # the forward's time remains in the backward).
        forward_ms = max(forward_ms - planner.transfer_ms(moved, d2h), 0.0)
        backward_ms = max(backward_ms - planner.transfer_ms(moved, h2d), forward_ms)
        profile = planner.StepProfile(
            groups, forward_ms, backward_ms, d2h, h2d, unpacks,
            backward_clock=self._clock(step, link, unpack_marks, unpacks, "h2d"),
            forward_clock=self._clock(step, link, packs, len(groups), "d2h"),
            copy_exposure=self.copy_exposure)
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


def _call_ms(link: SameMemoryLink, call: _Call, d2h: float) -> float | None:
    """A recording step's ``call``: its compute ms, less what it copied to the host inline
    (``d2h`` GB/s); None where untimed: its marks not on one link's clock (a first recording's
    calls before its first pack, marked on no link yet)."""
    if call.start is None or call.end is None or call.start.link is not call.end.link:
        return None
    return max(0.0, link.compute_ms(call.start, call.end) - planner.transfer_ms(call.moved, d2h))


def _rebuild_order(group: _Group) -> list[_Group]:
    """``group`` and its recomputed sources without a device tensor, transitively, each once,
    every source before its readers (iterative: a chain may be longer than Python's stack). A
    source read by two of them (a dense block's input, concatenated and also rebuilt through)
    comes before both: a group is placed when its expansion ends, never where first met."""
    order, placed, stack = [], set(), [(group, False)]   # groups hash by identity
    while stack:
        current, expanded = stack.pop()
        if current in placed:
            continue
        if expanded:
            placed.add(current)
            order.append(current)
            continue
        stack.append((current, True))
        for source in current.recipe.sources:
            if source.mode == RECOMPUTE and source.tensor is None and source not in placed:
                stack.append((source, False))
    return order


def offload_everything(groups) -> list[str]:
    """The recording steps' modes: every group offloaded where it can be (else kept)."""
    return [OFFLOAD if g.offloadable else KEEP for g in groups]


def _at_end_of_backward(callback) -> None:
    """Run ``callback`` when the running backward finishes without an error."""
    engine = getattr(torch.autograd.Variable, "_execution_engine", None)
    if engine is not None and hasattr(engine, "queue_callback"):
        engine.queue_callback(callback)
    else:   # no way to tell: take every backward as finished
        callback()


def _changes_in_place(call: _Call | None, tensor: torch.Tensor) -> bool:
    """``call`` (a running module's) changes ``tensor``, its first input, in place:
    ReLU(inplace=True) saves its output, the tensor it was given."""
    return call is not None and call.in_place and bool(call.reads) \
        and call.reads[0].ref() is tensor


def _has_children(module: nn.Module) -> bool:
    """``module.children()`` is not empty: read from the dict it iterates, without a generator
    (this runs at every module call of a step's forward)."""
    return any(child is not None for child in module._modules.values())


#: the sequence number the next autograd node will get (thread-local, one per node made): a pack
#: reads it after its node was made and before the op ran, the packs of a later op read a larger
#: one. Without it (an older PyTorch) pending copies wait for the next Python hook.
_SEQUENCE_NR = getattr(torch._C._autograd, "_get_sequence_nr", None) or (lambda: 0)

#: torch's reader of the autograd node whose backward runs now (resolved once: it is read at every
#: pack, unpack and module of a step)
_CURRENT_AUTOGRAD_NODE = getattr(torch._C, "_current_autograd_node", None)


def _current_node():
    """The autograd node whose backward runs now, or None."""
    return _CURRENT_AUTOGRAD_NODE() if _CURRENT_AUTOGRAD_NODE is not None else None


def _in_backward() -> bool:
    """Inside an autograd node's backward (where a step's forward never runs)."""
    return _current_node() is not None


def _transposed_size(module: nn.Module, value: torch.Tensor) -> tuple[int, ...]:
    """The spatial size a transposed convolution makes of ``value`` with its own output padding
    (what it makes unless called with ``output_size``)."""
    n = len(module.kernel_size)
    return tuple((size - 1) * stride - 2 * pad + dilation * (kernel - 1) + extra + 1
                 for size, stride, pad, dilation, kernel, extra in zip(
                     value.shape[-n:], module.stride, module.padding, module.dilation,
                     module.kernel_size, module.output_padding))


def _joined(*values: torch.Tensor, dim: int) -> torch.Tensor:
    """A recorded concatenation's rerun: its operands, one value each, joined again."""
    return torch.cat(values, dim=dim)


def rerun_as_recorded(module: nn.Module, value: torch.Tensor,
                      state: _ModuleState | None = None,
                      output_shape: tuple = ()) -> torch.Tensor:
    """``module(value)`` as its forward ran (``state``: what it read then; None: the module as it
    is now), without its side effects and without hooks (a recomputable module has none of its
    own; the global ones, a user's activation monitor, see only the user's forward): a
    training-mode batch norm runs on copies of its running statistics (same kernel, same
    output; the model's statistics and batch counter untouched), an eval-mode one on the
    statistics its forward read; the parameters are the tensors the forward read."""
    if state is None:
        state = _ModuleState.of(module)
    state.check()
    saved = {name: module._parameters[name] for name in state.params}
    try:
        module._parameters.update(state.params)
        if isinstance(module, _BATCH_NORMS) and type(module) in CHEAP:
            training = state.training or module.running_mean is None
            if state.running is not None and not training:
                mean, var = state.running
            elif module.running_mean is not None and module.running_var is not None:
                mean, var = module.running_mean.clone(), module.running_var.clone()
            else:
                mean = var = None
            return F.batch_norm(value, mean, var, state.params.get("weight"),
                                state.params.get("bias"), training,
                                module.momentum if module.momentum is not None else 0.0,
                                module.eps)
        forward = type(module).forward
        if type(module) in _TRANSPOSED and output_shape:
            made = output_shape[-len(module.kernel_size):]
            if _transposed_size(module, value) != made:
                # it was given output_size (its own output_padding makes another size)
                return forward(module, value, output_size=list(made))
        return forward(module, value)
    finally:
        module._parameters.update(saved)

