"""What the caching allocator's memory looked like at each flush of a recorded step: the history
that ``torch.cuda.memory._record_memory_history`` keeps and ``_dump_snapshot`` writes
(``benchmarks/train_steps.py --memory-history-step K --memory-history-out PATH``).

A *flush* is a run of ``segment_free``/``segment_unmap`` actions: an allocation found no free block
it fits in and could not grow the memory under the cap, so the allocator synchronised and gave
its cached free memory back before mapping again. With expandable segments the question a flush
raises is which: too much allocated, or the free memory cut into holes by the blocks still alive
between them (benchmarks/results/plan-accuracy, ``h200-rerun/``). This replays the history to
answer it. The snapshot holds the segments (their mapped ranges and blocks) at its end and the
actions since the recording started; undoing the actions from the end gives the memory at the
start, and replaying them forward gives, at each flush, the bytes mapped, the bytes allocated and
the free pieces of the mapped memory (a free piece: a gap between live blocks, or before or after
them, within one mapped range), with the allocation that asked (the first one after the run).

Expandable segments only (what ``mucudnn run --memory-budget`` sets): one memory per (pool,
stream), each its own virtual range, and an action belongs to the segment of the snapshot nearest
its address; a history with ``segment_alloc``/``segment_free`` (cudaMalloc'd segments, side by
side) is refused (:class:`NotExpandable`). A block lives from its ``alloc`` to its
``free_completed`` (one pending its stream's events at the end is alive), its size the request
rounded up to ``BLOCK`` bytes, as the allocator sizes it.

    python -m benchmarks.allocator_history SNAPSHOT.pickle
"""

from __future__ import annotations

import argparse
import bisect
import pickle
import sys
from dataclasses import dataclass, field

MiB = 2**20
BLOCK = 512   # kMinBlockSize: a block's size is its request rounded up to this
FLUSH_ACTIONS = ("segment_free", "segment_unmap")
GROW_ACTIONS = ("segment_alloc", "segment_map")
LIVE_STATES = ("active_allocated", "active_pending_free")


class NotExpandable(ValueError):
    """A history of cudaMalloc'd segments, which these replays do not model."""


def block_size(size: int) -> int:
    """The block a request of ``size`` bytes takes (round_size, without power-of-two rounding)."""
    return BLOCK * max(1, -(-size // BLOCK))


@dataclass
class Memory:
    """One (pool, stream)'s memory: its mapped ranges and its live blocks, by address."""

    mapped: list = field(default_factory=list)   # sorted, disjoint [start, end) ranges
    blocks: dict = field(default_factory=dict)   # address -> size

    def map(self, address: int, size: int) -> None:
        ranges = sorted(self.mapped + [[address, address + size]])
        self.mapped = []
        for start, end in ranges:
            if self.mapped and start <= self.mapped[-1][1]:
                self.mapped[-1][1] = max(self.mapped[-1][1], end)
            else:
                self.mapped.append([start, end])

    def unmap(self, address: int, size: int) -> None:
        end_of = address + size
        kept = []
        for start, end in self.mapped:
            if end <= address or start >= end_of:
                kept.append([start, end])
                continue
            if start < address:
                kept.append([start, address])
            if end > end_of:
                kept.append([end_of, end])
        self.mapped = kept

    def mapped_bytes(self) -> int:
        return sum(end - start for start, end in self.mapped)

    def allocated_bytes(self) -> int:
        return sum(self.blocks.values())

    def free_pieces(self) -> list[int]:
        """The free pieces of the mapped memory, largest first."""
        pieces = []
        addresses = sorted(self.blocks)
        for start, end in self.mapped:
            at = start
            for address in addresses[bisect.bisect_left(addresses, start):]:
                if address >= end:
                    break
                if address > at:
                    pieces.append(address - at)
                at = max(at, address + self.blocks[address])
            if end > at:
                pieces.append(end - at)
        return sorted(pieces, reverse=True)


@dataclass
class Flush:
    """One flush: the memory of its (pool, stream) just before it, and what it gave back."""

    pool: tuple                # the (pool, stream) of its first release (the large pool's first)
    mapped: int
    allocated: int
    pieces: list
    released: int = 0          # in that pool
    asked: int | None = None   # the allocation after it, in any pool (None: the history ended)
    asked_pool: tuple | None = None

    def describe(self, most: int = 6) -> str:
        pieces = ", ".join(f"{piece / MiB:.0f}" for piece in self.pieces[:most])
        asked = "no allocation after it" if self.asked is None else \
            f"then an allocation of {self.asked / MiB:.0f} MiB" + (
                f" (largest free piece {(self.pieces[0] if self.pieces else 0) / MiB:.0f} MiB)"
                if self.asked_pool == self.pool else f" in the {self.asked_pool[0]} pool")
        return (f"flush of {self.pool[0]} pool, stream {self.pool[1]}: {self.mapped / MiB:.0f} MiB "
                f"mapped, {self.allocated / MiB:.0f} allocated, "
                f"{(self.mapped - self.allocated) / MiB:.0f} free in pieces of [{pieces}] MiB; "
                f"{self.released / MiB:.0f} MiB given back, {asked}")


def _owner(segments: list[dict]):
    """The (pool, stream) whose segment is nearest an address."""
    starts = sorted((segment["address"], (segment["segment_type"], segment["stream"]))
                    for segment in segments)
    addresses = [address for address, _ in starts]

    def owner(address: int):
        at = bisect.bisect_right(addresses, address) - 1
        candidates = [starts[i] for i in (at, at + 1) if 0 <= i < len(starts)]
        return min(candidates, key=lambda each: abs(each[0] - address))[1]
    return owner


@dataclass
class History:
    """A recorded history on one device: each (pool, stream)'s memory at its start, the owner of
    an address, and the actions in order."""

    start: dict
    owner: object
    trace: list


def history(snapshot: dict, device: int = 0) -> History | None:
    """``snapshot``'s history on ``device`` with the memory at its start (None: no segment or no
    action to replay): the segments at the end, each action undone from the last."""
    segments = [s for s in snapshot.get("segments", []) if s.get("device", 0) == device]
    traces = snapshot.get("device_traces", [])
    trace = traces[device] if device < len(traces) else []
    if not segments or not trace:
        return None
    if any(entry["action"] in ("segment_alloc", "segment_free") for entry in trace) or \
            any(not segment.get("is_expandable", True) for segment in segments):
        raise NotExpandable("a history of cudaMalloc'd segments (no expandable segments): "
                            "only expandable segments are replayed")
    owner = _owner(segments)
    memories: dict[tuple, Memory] = {}

    def memory_of(address: int) -> Memory:
        return memories.setdefault(owner(address), Memory())

    for segment in segments:   # the end: mapped ranges and live blocks
        memory = memory_of(segment["address"])
        memory.map(segment["address"], segment["total_size"])
        address = segment["address"]
        for block in segment["blocks"]:
            if block["state"] in LIVE_STATES:
                memory.blocks[address] = block["size"]
            address += block["size"]
    for entry in reversed(trace):   # back to the start
        action, address, size = entry["action"], entry["addr"], entry["size"]
        if action == "alloc":
            memory_of(address).blocks.pop(address, None)
        elif action == "free_completed":
            memory_of(address).blocks[address] = block_size(size)
        elif action in GROW_ACTIONS:
            memory_of(address).unmap(address, size)
        elif action in FLUSH_ACTIONS:
            memory_of(address).map(address, size)
    return History(memories, owner, trace)


def flushes(snapshot: dict, device: int = 0) -> list[Flush]:
    """Every flush of ``snapshot``'s history on ``device``, with its memory just before it."""
    recorded = history(snapshot, device)
    if recorded is None:
        return []
    owner, memories = recorded.owner, {pool: Memory(list(map(list, memory.mapped)),
                                                    dict(memory.blocks))
                                       for pool, memory in recorded.start.items()}

    def memory_of(address: int) -> Memory:
        return memories.setdefault(owner(address), Memory())

    # forward: a flush is a run of releases, seen just before its first; the allocation that
    # asked for it is the first one after the run, in any pool
    found, in_run, asking = [], None, None
    for entry in recorded.trace:
        action, address, size = entry["action"], entry["addr"], entry["size"]
        memory = memory_of(address)
        if action in FLUSH_ACTIONS:
            if in_run is None:
                in_run = Flush(owner(address), memory.mapped_bytes(), memory.allocated_bytes(),
                               memory.free_pieces())
                found.append(in_run)
            if owner(address) == in_run.pool:
                in_run.released += size
            memory.unmap(address, size)
            continue
        if in_run is not None:
            asking, in_run = in_run, None
        if action == "alloc":
            if asking is not None:
                asking.asked, asking.asked_pool, asking = size, owner(address), None
            memory.blocks[address] = block_size(size)
        elif action == "free_completed":
            memory.blocks.pop(address, None)
        elif action in GROW_ACTIONS:
            memory.map(address, size)
    return found


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("snapshot", help="a pickle torch.cuda.memory._dump_snapshot wrote")
    parser.add_argument("--device", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        with open(args.snapshot, "rb") as file:
            snapshot = pickle.load(file)
    except (OSError, pickle.UnpicklingError, EOFError) as exc:
        print(f"allocator_history: cannot read {args.snapshot}: {exc}", file=sys.stderr)
        return 2
    try:
        found = flushes(snapshot, args.device)
    except NotExpandable as exc:
        print(f"allocator_history: {args.snapshot}: {exc}", file=sys.stderr)
        return 2
    for flush in found:
        print(flush.describe())
    if not found:
        print("no flush in this history")
    return 0


if __name__ == "__main__":
    sys.exit(main())
