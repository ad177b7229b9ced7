"""benchmarks/allocator_sim.py off the GPU: the model of the caching allocator with expandable
segments, on a history made by hand (best fit, a flush past the cap, pages mapped at the lowest
address with room) and on the two recorded on an H200 (benchmarks/results/plan-accuracy)."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

from benchmarks.allocator_sim import PAGE, main, replay

MiB = 2**20
BASE = 0x7F00_0000_0000          # page-aligned
HISTORIES = Path(__file__).resolve().parents[2] / "benchmarks/results/plan-accuracy/h200-rerun/callE"


def act(action, offset_mib, size_mib):
    return {"action": action, "addr": BASE + offset_mib * MiB, "size": size_mib * MiB,
            "stream": 0}


def by_hand():
    """At the start 100 MiB mapped: A (0-20) and C (45-80) live, free pieces of 25 (20-45) and
    20 MiB (80-100, next to the unmapped rest). 20 MiB goes to the 25 MiB piece: the allocator
    passes over a piece it could grow into the unmapped space. 30 MiB fits no piece and, under
    a 110 MiB cap, not on top: the flush unmaps the whole page 80-100, and 30 MiB is mapped (two
    pages) at 80, the lowest address with room (40-45 has 5 MiB)."""
    trace = [act("alloc", 20, 20), act("segment_unmap", 80, 20), act("segment_map", 80, 40),
             act("alloc", 80, 30)]
    blocks = [(20, "active_allocated"), (20, "active_allocated"), (5, "inactive"),
              (35, "active_allocated"), (30, "active_allocated"), (10, "inactive")]
    end = [{"device": 0, "address": BASE, "stream": 0, "segment_type": "large",
            "total_size": 120 * MiB,
            "blocks": [{"size": size * MiB, "state": state} for size, state in blocks]}]
    return {"segments": end, "device_traces": [trace]}


def test_the_model_places_best_fit_and_flushes_past_the_cap_as_the_allocator_did():
    assert PAGE == 20 * MiB
    result = replay(by_hand(), 110 * MiB)
    assert (result.allocations, result.placed_alike) == (2, 2)
    assert (result.recorded_flushes, result.flushes) == (1, 1)
    assert result.flushed_at == result.recorded_at == ((1, 30 * MiB),)   # the second allocation
    # room on top: no flush, and 30 MiB grows the piece at 80 into a new page: the same place
    roomy = replay(by_hand(), 140 * MiB)
    assert (roomy.placed_alike, roomy.flushes, roomy.out_of_memory) == (2, 0, None)


def test_an_allocation_left_out_and_too_small_a_cap():
    # without the 20 MiB allocation the flush unmaps 20-40 too, and 30 MiB still goes to 80:
    # 20-45 has 25 MiB of room
    result = replay(by_hand(), 110 * MiB, leave_out=frozenset({20 * MiB}))
    assert (result.allocations, result.placed_alike, result.flushes) == (1, 1, 1)
    tight = replay(by_hand(), 90 * MiB)    # A, C and 20 MiB live: 30 MiB more never fits
    assert tight.out_of_memory == 30 * MiB and tight.recorded_flushes == 1


@pytest.mark.parametrize("name,cap,allocations,flushed_at", [
    ("vgg16-11-step6.pickle", 11 * 2**30, 123, ((106, 1078 * MiB),)),
    ("r3d-4.5-step8.pickle", int(4.5 * 2**30), 175, ((134, 392 * MiB),)),
])
def test_the_model_follows_the_recorded_h200_histories(name, cap, allocations, flushed_at):
    with open(HISTORIES / name, "rb") as file:
        result = replay(pickle.load(file), cap)
    # every allocation where the allocator put it, and the flush at the same one (by position)
    assert (result.placed_alike, result.allocations) == (allocations, allocations)
    assert result.recorded_at == result.flushed_at == flushed_at


def test_requests_are_rounded_to_blocks_and_a_block_is_free_only_once_its_free_completes():
    # one page mapped, nothing live: 2 MiB + 1 byte takes a block of 2 MiB + 512, 2 MiB goes
    # right after it; the first one's free is requested, not completed (pending at the end),
    # when 1 MiB is asked: that goes after the second, not into the first
    two, odd = 2 * MiB, 2 * MiB + 1

    def at(offset, size, action="alloc"):
        return {"action": action, "addr": BASE + offset, "size": size, "stream": 0}
    trace = [at(0, odd), at(two + 512, two), at(0, odd, "free_requested"),
             at(2 * two + 512, MiB)]
    blocks = [(two + 512, "active_pending_free"), (two, "active_allocated"),
              (MiB, "active_allocated"), (PAGE - 2 * two - 512 - MiB, "inactive")]
    end = [{"device": 0, "address": BASE, "stream": 0, "segment_type": "large",
            "total_size": PAGE, "blocks": [{"size": size, "state": state}
                                           for size, state in blocks]}]
    result = replay({"segments": end, "device_traces": [trace]}, 100 * MiB)
    assert (result.allocations, result.placed_alike) == (3, 3)


def test_a_history_of_cudamallocd_segments_is_refused_in_one_line(tmp_path, capsys):
    snapshot = by_hand()
    snapshot["device_traces"][0].insert(0, act("segment_alloc", 200, 20))
    path = tmp_path / "history.pickle"
    path.write_bytes(pickle.dumps(snapshot))
    assert main([str(path), "--cap", "1GiB"]) == 2
    err = capsys.readouterr().err
    assert "only expandable segments are replayed" in err and err.count("\n") == 1


def test_the_command_says_what_the_model_did_and_a_bad_size_is_one_line(tmp_path, capsys):
    path = tmp_path / "history.pickle"
    path.write_bytes(pickle.dumps(by_hand()))
    assert main([str(path), "--cap", "110MiB"]) == 0
    assert capsys.readouterr().out.strip() == (
        "2 allocations, 2 placed where the allocator put them; flushes: 1 recorded, 1 in the "
        "model (at allocations #1 of 30 MiB) (recorded: #1 of 30 MiB)")
    assert main([str(path), "--cap", "lots"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("allocator_sim: ") and err.count("\n") == 1
