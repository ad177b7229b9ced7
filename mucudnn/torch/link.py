"""The host links of mucudnn.torch's offload session: where a saved tensor is copied to the host
and back, and the clock a recording step is timed on. :class:`SameMemoryLink` (host and device one
memory: CPU tests) and :class:`CudaLink` (pinned host memory and a copy stream per direction)."""

from __future__ import annotations

import contextlib
import time
import weakref
from collections import defaultdict, deque
from dataclasses import dataclass

import torch


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


def allocator_flushes(device: torch.device) -> int:
    """Times so far ``device``'s caching allocator freed its cache to retry an allocation (0 for
    the host). Read at every unpack of a trial's steps: the nested statistics, not
    memory_stats' flattened copy of them."""
    if device.type != "cuda":
        return 0
    return torch.cuda.memory.memory_stats_as_nested_dict(device).get("num_alloc_retries", 0)


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
        #: while True too, :meth:`keep_device_behind` has the device wait where it caught up
        self.leads = False
        self._lead_ms = self._led_ms = 0.0  # the last wait, and the waits of this step so far

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

    #: the first wait of a step, ms of the device's clock; each next one where the device caught
    #: up again is twice the last, up to LEAD_MAX_MS, and LEAD_STEP_MS in all (what it costs:
    #: the step ends at most that much later)
    LEAD_MS, LEAD_MAX_MS, LEAD_STEP_MS = 8.0, 1000.0, 2000.0

    def start_timing(self, leads: bool) -> None:
        """A recording step starts: its stalls recorded from now, and (``leads``) the device
        kept behind the host (:meth:`keep_device_behind`)."""
        self.timing, self.stalls, self.leads = True, [], leads
        # each wait is twice the last: the step's first is LEAD_MS
        self._lead_ms, self._led_ms = self.LEAD_MS / 2, 0.0

    def keep_device_behind(self) -> None:
        """In a timing step, at a point: where the device has run all that was issued, have it
        wait (a stall) so that it runs the next work only once the host has issued more (here:
        the host's clock, nothing runs apart)."""

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
        self._last_stamp = None             # the last mark's event (keep_device_behind)

    def __deepcopy__(self, memo):
        """A fresh link to the same device (streams, pinned pool and copies in flight are this
        one's own), with its measured speeds: a fitted model's copy (an EMA's) gets one."""
        return _cuda_link(str(self.device), self.max_pending, self.gbps)

    def __reduce__(self):
        # pickled as what makes it (a fitted model's torch.save): device, pending bytes, speeds
        return _cuda_link, (str(self.device), self.max_pending, self.gbps)

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
        self._last_stamp = event
        return event

    def keep_device_behind(self) -> None:
        """A recording step's hooks take the host longer to issue a module than the device takes
        to run it (ResNet-152's forward: 480-850 ms issued, ~50 ms run): with the device waiting
        on the host, the time between two marks is the host's, and a profile of it plans with
        inflated compute. So where the device has run all that was issued (the last mark's event
        is done), it is given a wait (``torch.cuda._sleep``) between two marks of a stall, which
        compute time leaves out (:meth:`compute_ms`): the host issues the next work meanwhile,
        and the device runs it back to back, as in a planned step."""
        last = self._last_stamp
        if not (self.timing and self.leads) or last is None or not last.query() \
                or not hasattr(torch.cuda, "_sleep"):
            return
        # twice the last; at most LEAD_STEP_MS a step in all (a host that keeps synchronizing
        # would have the device wait at each)
        lead = min(2 * self._lead_ms, self.LEAD_MAX_MS, self.LEAD_STEP_MS - self._led_ms)
        if lead <= 0:
            return
        self._lead_ms, self._led_ms = lead, self._led_ms + lead
        with self.stalling():
            torch.cuda._sleep(int(lead * self._cycles_per_ms()))

    def _cycles_per_ms(self) -> float:
        # the SM clock (kHz = cycles per ms) where PyTorch says it; the wait is timed by the
        # stall's marks, so its length need not be exact
        rate = getattr(torch.cuda.get_device_properties(self.device), "clock_rate", 0)
        return float(rate) if rate else 1.5e6

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
        return allocator_flushes(self.device)

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


def _cuda_link(device: str, max_pending: int, gbps) -> CudaLink:
    """A :class:`CudaLink` to ``device`` with speeds ``gbps``: as pickled or deep-copied
    (:meth:`CudaLink.__reduce__`, :meth:`CudaLink.__deepcopy__`)."""
    link = CudaLink(device, max_pending)
    link.gbps = gbps
    return link
