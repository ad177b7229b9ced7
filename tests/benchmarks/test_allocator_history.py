"""benchmarks/allocator_history.py off the GPU: a flush's memory rebuilt from a snapshot's end
state and its history (the holes between live blocks, what was given back, what asked)."""

from __future__ import annotations

import pickle

from benchmarks.allocator_history import Memory, flushes, main

MiB = 2**20
BASE = 0x7F00_0000_0000


def segment(offset_mib, blocks, stream=0, kind="large"):
    return {"device": 0, "address": BASE + offset_mib * MiB, "stream": stream,
            "segment_type": kind, "total_size": sum(size for size, _ in blocks) * MiB,
            "blocks": [{"size": size * MiB, "state": state} for size, state in blocks]}


def act(action, offset_mib, size_mib):
    return {"action": action, "addr": BASE + offset_mib * MiB, "size": size_mib * MiB,
            "stream": 0}


def history():
    """At the start: 100 MiB mapped, A (0-40), C (40-60), D (60-90) live, 10 MiB free at the
    end. C is freed, leaving holes of 20 and 10 MiB; a 40 MiB allocation fits neither: the
    allocator gives both back and maps 40 MiB after the end, where E goes."""
    trace = [act("free_requested", 40, 20), act("free_completed", 40, 20),
             act("segment_unmap", 40, 20), act("segment_unmap", 90, 10),
             act("segment_map", 100, 40), act("alloc", 100, 40)]
    end = [segment(0, [(40, "active_allocated")]), segment(60, [(30, "active_allocated")]),
           segment(100, [(40, "active_allocated")])]
    return {"segments": end, "device_traces": [trace]}


def test_a_flush_shows_the_holes_between_live_blocks_and_the_allocation_that_asked():
    (flush,) = flushes(history())
    assert flush.pool == ("large", 0)
    assert (flush.mapped, flush.allocated) == (100 * MiB, 70 * MiB)
    assert flush.pieces == [20 * MiB, 10 * MiB]   # 30 MiB free, none of it 40 MiB in one piece
    assert (flush.released, flush.asked) == (30 * MiB, 40 * MiB)
    assert flush.describe() == (
        "flush of large pool, stream 0: 100 MiB mapped, 70 allocated, 30 free in pieces of "
        "[20, 10] MiB; 30 MiB given back, then an allocation of 40 MiB (largest free piece "
        "20 MiB)")


def test_another_pools_memory_stays_apart_and_a_pending_free_is_alive():
    snapshot = history()
    # the small pool's own range, far from the large one, with a live block and a block freed
    # in the history: neither counts in the large pool's flush
    snapshot["segments"].append(segment(1 << 20, [(2, "active_allocated"), (2, "inactive")],
                                        kind="small"))
    snapshot["device_traces"][0].insert(0, act("free_completed", (1 << 20) + 2, 2))
    (flush,) = flushes(snapshot)
    assert (flush.pool, flush.allocated, flush.pieces) == (("large", 0), 70 * MiB,
                                                          [20 * MiB, 10 * MiB])
    # a block allocated before the history whose free is pending at its end is alive at its
    # start: D (60-90) here, pending; the flush's memory counts it
    snapshot["segments"][1] = segment(60, [(30, "active_pending_free")])
    (flush,) = flushes(snapshot)
    assert (flush.allocated, flush.pieces) == (70 * MiB, [20 * MiB, 10 * MiB])
    memory = Memory()
    memory.map(0, 100)
    memory.blocks.update({10: 20, 50: 10})
    assert memory.free_pieces() == [40, 20, 10]   # 60-100, 30-50, 0-10
    memory.unmap(60, 20)
    assert memory.mapped == [[0, 60], [80, 100]] and memory.free_pieces() == [20, 20, 10]


def test_the_command_prints_each_flush_and_a_bad_file_is_one_line(tmp_path, capsys):
    path = tmp_path / "history.pickle"
    path.write_bytes(pickle.dumps(history()))
    assert main([str(path)]) == 0
    assert capsys.readouterr().out.startswith("flush of large pool, stream 0: 100 MiB mapped")
    bad = tmp_path / "bad.pickle"
    bad.write_bytes(b"not a pickle")
    assert main([str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"allocator_history: cannot read {bad}:") and err.count("\n") == 1
