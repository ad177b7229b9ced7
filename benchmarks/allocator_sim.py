"""A model of PyTorch's caching allocator with expandable segments (one pool and stream: the large
pool's, where a step's activations go), replayed on a recorded history (allocator_history.py) to
ask what-if questions off the GPU: would this step flush under another cap, or without some of
its allocations?

The model follows c10/cuda/CUDACachingAllocator.cpp (PyTorch 2.11) for a large pool with
expandable segments, one virtual range mapped in pages of ``PAGE``:

1. A request (rounded up to 512 bytes) takes the smallest free mapped block it fits in (the lowest address among equals),
   passing over one whose size counted with the unmapped space after it is larger than the
   next's (``get_free_block``'s ``expandable_size``); the block is split, the request at its
   start.
2. None fits: where the pool's mapped bytes and the request's allocation size
   (``get_allocation_size``: 2 MiB rounding, a page under 10 MiB) stay within the cap, the lowest
   address with room (free mapped and unmapped blocks in a row, ``find_expandable_block``) is
   mapped page by page as far as the request needs (``try_allocate_expandable_block``).
3. Past the cap: a flush (``release_cached_blocks``: every whole page of every free mapped block
   unmapped), then 2 again; past the cap still: out of memory.
4. A freed block merges with free neighbours of its kind (mapped with mapped).

Checked against the two histories of benchmarks/results/plan-accuracy/h200-rerun/callE/: from
each step's start, it puts every allocation (VGG-16's 123, R3D-18's 175) where the allocator
did, and flushes at the same allocation.

    python -m benchmarks.allocator_sim SNAPSHOT.pickle --cap 11GiB [--leave-out BYTES ...]
"""

from __future__ import annotations

import argparse
import pickle
import sys
from dataclasses import dataclass

from benchmarks.allocator_history import FLUSH_ACTIONS, GROW_ACTIONS, block_size, history
from mucudnn.sizes import parse_size

MiB = 2**20
PAGE = 20 * MiB          # the large pool's page (kLargeBuffer)
ROUND_LARGE = 2 * MiB    # kRoundLarge
MIN_BLOCK = 512          # kMinBlockSize: no smaller remainder is split off
VIRTUAL = 1 << 45        # the virtual range after the first mapped byte: never the limit


def allocation_size(size: int) -> int:
    """What the cap is checked against for a request of ``size`` bytes (get_allocation_size)."""
    if size < 10 * MiB:
        return PAGE
    return ROUND_LARGE * -(-size // ROUND_LARGE)


class Block:
    __slots__ = ("address", "size", "kind", "prev", "next")

    def __init__(self, address: int, size: int, kind: str):
        self.address, self.size, self.kind = address, size, kind   # alloc, free or unmapped
        self.prev = self.next = None

    @property
    def end(self) -> int:
        return self.address + self.size


class Segment:
    """One expandable segment: blocks in address order over its virtual range."""

    def __init__(self, base: int, mapped: list, live: dict, cap: int):
        # pages are counted from the segment's start ``base``: its lowest byte mapped in the
        # history (the virtual range's own start is not in it)
        self.cap, self.flushes, self.base = cap, 0, base
        pieces, at = [], base
        for start, end in sorted(mapped):
            if start > at:
                pieces.append(Block(at, start - at, "unmapped"))
            pieces.append(Block(start, end - start, "free"))
            at = end
        pieces.append(Block(at, base + VIRTUAL - at, "unmapped"))
        for before, after in zip(pieces, pieces[1:]):
            before.next, after.prev = after, before
        self.head = pieces[0]
        for address, size in sorted(live.items()):
            block = next(b for b in self.blocks() if b.address <= address < b.end)
            if block.kind != "free":
                raise ValueError(f"live block at {address:#x} outside the mapped free memory")
            self._carve(block, address, size)

    def blocks(self):
        block = self.head
        while block is not None:
            yield block
            block = block.next

    def mapped(self) -> int:
        return sum(b.size for b in self.blocks() if b.kind != "unmapped")

    def _split(self, block: Block, at: int) -> Block:
        after = Block(at, block.end - at, block.kind)
        block.size = at - block.address
        after.prev, after.next = block, block.next
        if block.next is not None:
            block.next.prev = after
        block.next = after
        return after

    def _carve(self, block: Block, address: int, size: int) -> Block:
        if address > block.address:
            block = self._split(block, address)
        if block.size - size >= MIN_BLOCK:
            self._split(block, address + size)
        block.kind = "alloc"
        return block

    def _merge(self, block: Block) -> Block:
        while block.prev is not None and block.prev.kind == block.kind != "alloc":
            block = block.prev
        while block.next is not None and block.next.kind == block.kind != "alloc":
            gone = block.next
            block.size += gone.size
            block.next = gone.next
            if gone.next is not None:
                gone.next.prev = block
        return block

    def _free_block(self, size: int) -> Block | None:
        fits = sorted((b for b in self.blocks() if b.kind == "free" and b.size >= size),
                      key=lambda b: (b.size, b.address))

        def expandable(b: Block) -> int:
            return b.size + (b.next.size if b.next is not None and b.next.kind == "unmapped"
                             else 0)
        at = 0
        while at + 1 < len(fits) and expandable(fits[at + 1]) < expandable(fits[at]):
            at += 1
        return fits[at] if fits else None

    def _map(self, block: Block, size: int) -> Block:
        size = min(block.size, PAGE * -(-size // PAGE))
        if size < block.size:
            self._split(block, block.address + size)
        block.kind = "free"
        return self._merge(block)

    def _room(self, size: int) -> Block:
        for block in self.blocks():
            if block.kind != "unmapped":
                continue
            start = block.prev if block.prev is not None and block.prev.kind == "free" else block
            room, at = 0, start
            while at is not None and at.kind != "alloc" and room < size:
                room, at = room + at.size, at.next
            if room >= size:
                return start
        raise MemoryError(size)   # never: the virtual range ends far past any cap

    def _flush(self) -> None:
        self.flushes += 1
        for block in list(self.blocks()):
            start = self.base + PAGE * -(-(block.address - self.base) // PAGE)
            end = self.base + PAGE * ((block.end - self.base) // PAGE)
            if block.kind != "free" or end <= start:
                continue
            if start > block.address:
                block = self._split(block, start)
            if end < block.end:
                self._split(block, end)
            block.kind = "unmapped"
            self._merge(block)

    def malloc(self, size: int) -> Block:
        size = block_size(size)
        block = self._free_block(size)
        if block is not None:
            return self._carve(block, block.address, size)
        for attempt in range(2):
            if self.mapped() + allocation_size(size) <= self.cap:
                block = self._room(size)
                if block.kind == "unmapped":
                    block = self._map(block, size)
                while block.size < size:
                    block = self._map(block.next, size - block.size)
                return self._carve(block, block.address, size)
            if attempt == 0:
                self._flush()
        raise MemoryError(f"{size} bytes past the cap of {self.cap}")

    def free(self, block: Block) -> None:
        block.kind = "free"
        self._merge(block)


@dataclass
class Replay:
    allocations: int = 0
    placed_alike: int = 0         # where the recorded allocator put it too
    recorded_flushes: int = 0
    flushes: int = 0
    flushed_at: tuple = ()        # (the allocation's index in the history, its size) of each
    recorded_at: tuple = ()       # model flush, and of each recorded one
    out_of_memory: int | None = None   # the allocation past the cap even after a flush


def replay(snapshot: dict, cap: int, leave_out: frozenset = frozenset(), device: int = 0,
           pool: tuple = ("large", 0)) -> Replay | None:
    """The model run over ``snapshot``'s history of ``pool`` from its start under ``cap`` bytes,
    without the allocations (and their frees) of a size in ``leave_out``; None where the history
    has none of that pool."""
    recorded = history(snapshot, device)
    if recorded is None or pool not in recorded.start:
        return None
    start = recorded.start[pool]
    others = sum(memory.mapped_bytes() for key, memory in recorded.start.items() if key != pool)
    trace = [entry for entry in recorded.trace if recorded.owner(entry["addr"]) == pool]
    base = min([begin for begin, _ in start.mapped] +
               [entry["addr"] for entry in trace if entry["action"] in GROW_ACTIONS])
    segment = Segment(base, start.mapped, start.blocks, cap - others)
    live = {b.address: b for b in segment.blocks() if b.kind == "alloc"}
    result, left_out, index, released = Replay(), set(), 0, False
    for entry in trace:   # the recorded flushes, however far the model gets
        if entry["action"] in FLUSH_ACTIONS:
            released = True
        elif entry["action"] == "alloc":
            if released:
                result.recorded_at += ((index, entry["size"]),)
            released, index = False, index + 1
    result.recorded_flushes = len(result.recorded_at) + released
    index = 0
    for entry in trace:
        action, address, size = entry["action"], entry["addr"], entry["size"]
        if action == "alloc":
            index += 1
            if size in leave_out:
                left_out.add(address)
                continue
            flushes = segment.flushes
            try:
                block = segment.malloc(size)
            except MemoryError:
                result.out_of_memory = size
                break
            result.allocations += 1
            result.placed_alike += block.address == address
            if segment.flushes > flushes:
                result.flushed_at += ((index - 1, size),)
            live[address] = block
        elif action != "free_completed":
            continue
        elif address in left_out:
            left_out.discard(address)
        elif address in live:
            segment.free(live.pop(address))
    result.flushes = segment.flushes
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("snapshot", help="a pickle torch.cuda.memory._dump_snapshot wrote")
    parser.add_argument("--cap", required=True, help="the allocator's cap, e.g. 11GiB")
    parser.add_argument("--leave-out", nargs="*", default=[],
                        help="sizes of allocations the step would not make (e.g. 704MiB)")
    args = parser.parse_args(argv)
    try:
        cap, leave_out = parse_size(args.cap), frozenset(map(parse_size, args.leave_out))
        with open(args.snapshot, "rb") as file:
            snapshot = pickle.load(file)
        result = replay(snapshot, cap, leave_out)
    except (OSError, pickle.UnpicklingError, EOFError, ValueError) as exc:   # NotExpandable: one
        print(f"allocator_sim: {exc}", file=sys.stderr)
        return 2
    if result is None:
        print("allocator_sim: no history of the large pool on stream 0 in this file",
              file=sys.stderr)
        return 2
    print(f"{result.allocations} allocations, {result.placed_alike} placed where the allocator "
          f"put them; flushes: {result.recorded_flushes} recorded, {result.flushes} in the model"
          + (" (at allocations " + ", ".join(f"#{i} of {s / MiB:.0f} MiB"
                                               for i, s in result.flushed_at) + ")"
             if result.flushed_at else "")
          + (" (recorded: " + ", ".join(f"#{i} of {s / MiB:.0f} MiB"
                                        for i, s in result.recorded_at) + ")"
             if result.recorded_at else "")
          + (f"; out of memory at {result.out_of_memory / MiB:.0f} MiB"
             if result.out_of_memory is not None else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
