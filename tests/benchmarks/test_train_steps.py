"""benchmarks/train_steps.py off the GPU: its throughput line (`mucudnn batch-size`'s protocol),
the allocator history's flush summary, and a CPU dry run with every option it has."""

from __future__ import annotations

import pstats
import re
import subprocess
import sys
from pathlib import Path

from benchmarks.train_steps import flushes_in_history, host_probe_ms, throughput

from mucudnn.batchsize import THROUGHPUT

ROOT = Path(__file__).resolve().parents[2]


def test_throughput_is_the_median_of_the_last_half():
    # the first half (recording, planning) is left out; 4 images a step
    assert throughput([10.0, 9.0, 0.5, 0.4, 0.6, 0.5], 4) == 4 / 0.5


def test_the_host_probe_times_its_calls():
    # a positive time, and more calls take longer than none (no time at all is 0 or nearly)
    assert host_probe_ms(0) < host_probe_ms(200_000)
    assert host_probe_ms(1000) > 0


def test_a_flush_is_the_run_of_unmaps_before_an_allocation():
    mib = 1 << 20
    trace = [{"action": "alloc", "size": 100 * mib},
             {"action": "segment_unmap", "size": 30 * mib},
             {"action": "segment_unmap", "size": 10 * mib},
             {"action": "alloc", "size": 64 * mib},
             {"action": "free_completed", "size": 100 * mib},
             {"action": "alloc", "size": 1 * mib}]
    counts, flush = flushes_in_history({"device_traces": [trace]})
    assert counts == "alloc=3 free_completed=1 segment_unmap=2"
    assert flush == ("flush: 2 segments freed or unmapped of 40 MiB, then an allocation of "
                     "64.0 MiB with 0.098 GiB allocated")


def test_a_cpu_dry_run_prints_its_steps_and_a_throughput_batch_size_reads(tmp_path):
    stats = tmp_path / "step-3.prof"
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.train_steps", "--device", "cpu", "--model", "tiny",
         "--batch", "2", "--steps", "4", "--throughput", "--detail", "--trace-step", "2",
         "--cprofile-step", "3", "--cprofile-out", str(stats)],
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("train_steps: step ") == 4
    assert "cprofile step 3" in done.stderr
    # the step's profile, readable by pstats: the model's forward among its functions
    functions = {name for _, _, name in pstats.Stats(str(stats)).stats}
    assert "forward" in functions
    match = THROUGHPUT.search(done.stdout)
    assert match is not None and float(match.group(1)) > 0


def test_a_run_that_waits_every_k_steps_prints_each_windows_time_a_step():
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.train_steps", "--device", "cpu", "--model", "tiny",
         "--batch", "2", "--steps", "5", "--sync-every", "2"],
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("train_steps: step ") == 5
    windows = re.findall(r"train_steps: steps (\d+)-(\d+) ms_per_step=([0-9.]+)", done.stderr)
    assert [(a, b) for a, b, _ in windows] == [("1", "2"), ("3", "4")]
    assert all(float(ms) > 0 for _, _, ms in windows)


def test_the_detail_says_whether_a_step_was_armed_and_which_modules_it_recorded():
    import torch
    from torch import nn

    from benchmarks.train_steps import session_detail
    from mucudnn.torch.link import SameMemoryLink
    from mucudnn.torch.offload_session import OffloadSession
    from mucudnn.torch.planner import KEEP, RECOMPUTE

    assert session_detail(None) == "" and session_detail(object()) == ""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 4, 3), nn.Flatten(),
                          nn.Linear(4 * 12 * 12, 2)).double()
    x = torch.randn(2, 3, 16, 16, dtype=torch.float64)

    def step(session):
        with session:
            loss = model(x).sum()
        loss.backward()
        return session_detail(session)

    # probe which groups a recipe rebuilds, then recompute every one of them in later steps
    probe = OffloadSession(force=RECOMPUTE, link=SameMemoryLink(), min_bytes=0)
    step(probe)
    modes = [RECOMPUTE if g.mode == RECOMPUTE else KEEP for g in probe._step.groups]
    assert RECOMPUTE in modes
    session = OffloadSession(modes=modes, link=SameMemoryLink(), min_bytes=0, strict=False,
                             rescue="always")
    details = [step(session) for _ in range(3)]
    # armed in every step ("always"); the first records every call, and once it has learnt the
    # recipes' modules the next records only those
    # (a plan that recomputes never stands aside: mucudnn/torch/aside.py)
    assert details[0] == " armed=1 records=all aside=0"
    recorded = re.fullmatch(r" armed=1 records=(\d+) aside=0", details[2])
    assert recorded is not None and 0 < int(recorded.group(1)) < len(list(model.modules()))


def test_the_detail_ends_with_each_plan_requests_making_time():
    import torch
    from torch import nn

    from benchmarks.train_steps import planning_lines
    from mucudnn.torch.link import SameMemoryLink
    from mucudnn.torch.offload_session import OffloadSession

    assert planning_lines(None) == [] and planning_lines(object()) == []
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 4, 3), nn.Flatten(),
                          nn.Linear(4 * 12 * 12, 2)).double()
    x = torch.randn(2, 3, 16, 16, dtype=torch.float64)
    session = OffloadSession(budget=1 << 30, link=SameMemoryLink(), min_bytes=0, strict=False)
    for _ in range(4):     # two recording steps, then the first plan's request is made
        with session:
            loss = model(x).sum()
        loss.backward()
    lines = planning_lines(session)
    assert lines and re.fullmatch(r"planning kind=first_plan seconds=\d+\.\d{3} steps_run=\d+",
                                  lines[0])
