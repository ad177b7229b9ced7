"""benchmarks/pressure.py on the CPU: the searches against fake probes with known thresholds,
the parts end to end against a fake GPU (every worker run answered from the command it was
given), the time budget, killing a run's process group, and the results page."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from benchmarks import pressure
from benchmarks.pressure import Budget, OutOfTime, max_batch_search, min_cap_search
from benchmarks.shim_pytorch import worker_outcome
from mucudnn.torch import planner

OK, OOM = {"status": "ok", "step_ms": 10.0}, {"status": "oom"}


def threshold_probe(threshold, calls):
    def probe(x):
        calls.append(x)
        return OK if x >= threshold else OOM
    return probe


# -- minimum cap -----------------------------------------------------------------------------------

@given(threshold=st.floats(0.01, 60), low=st.floats(0, 80), high=st.floats(0, 80))
def test_min_cap_is_the_threshold_rounded_up_to_the_grid_whatever_the_bracket(threshold, low, high):
    calls = []
    result = min_cap_search(threshold_probe(threshold, calls), low, high, step_gib=0.25,
                            ceiling_gib=100)
    assert result["complete"]
    assert result["min_cap_gib"] == pytest.approx(math.ceil(threshold / 0.25 - 1e-9) * 0.25)
    assert len(calls) == len(set(calls))  # no cap probed twice
    assert all(c > 0 and round(c / 0.25, 9) == round(c / 0.25) for c in calls)  # on the grid


def test_a_good_bracket_costs_a_few_probes():
    calls = []
    result = min_cap_search(threshold_probe(6.1, calls), 4.0, 9.0, step_gib=0.25)
    assert result["min_cap_gib"] == 6.25
    assert calls[0] == 9.0  # the upper end first
    assert len(calls) <= 1 + math.ceil(math.log2((9.0 - 4.0) / 0.25))
    assert result["at_min"]["status"] == "ok" and len(result["probes"]) == len(calls)


def test_a_lower_end_that_passes_is_probed_and_the_bracket_widens_down():
    calls = []
    result = min_cap_search(threshold_probe(1.0, calls), 4.0, 5.0, step_gib=0.25)
    assert result["min_cap_gib"] == 1.0
    assert 4.0 in calls and 0.75 in calls  # the assumed-failing end, then the one below 1.0


def test_out_of_memory_at_every_cap_is_a_result():
    calls = []
    result = min_cap_search(lambda c: calls.append(c) or OOM, 4.0, 9.0, ceiling_gib=140)
    assert result["complete"] and result["min_cap_gib"] is None
    assert "fails even at 140" in result["note"]
    assert len(calls) <= 6  # 9, 14, 24, 44, 84, 140


def test_timed_out_runs_count_as_not_training():
    result = min_cap_search(lambda c: {"status": "ok" if c >= 3 else "timeout"}, 1, 8)
    assert result["min_cap_gib"] == 3.0


def test_a_crash_can_count_as_failing_to_train():
    calls = []
    crash = {"status": "failed", "stderr_tail": "Segmentation fault"}
    result = min_cap_search(lambda c: calls.append(c) or (OK if c >= 7 else crash), 2, 8,
                            crash_ends_search=False)
    assert result["min_cap_gib"] == 7 and "error" not in result
    assert {p["status"] for p in result["probes"]} == {"ok", "failed"}


def test_a_crash_ends_a_search_instead_of_bisecting_on_it():
    calls = []
    crash = {"status": "failed", "stderr_tail": "Segmentation fault"}
    result = min_cap_search(lambda c: calls.append(c) or (OK if c >= 7 else crash), 2, 8)
    assert calls == [8, 5] and result["min_cap_gib"] is None and not result["complete"]
    assert result["error"] == "failed at 5 GiB: Segmentation fault"
    calls.clear()
    result = max_batch_search(lambda b: calls.append(b) or crash, 256)
    assert calls == [256] and result["max_batch"] is None and "batch 256" in result["error"]


def fake_clock(budget_probes):
    """A clock that passes the deadline after ``budget_probes`` probes."""
    state = {"now": 0.0}

    def clock():
        return state["now"]
    return clock, state


def test_the_time_budget_ends_a_min_cap_search_with_the_bracket_so_far():
    clock, state = fake_clock(3)
    budget = Budget(3.0, clock=clock)
    calls = []

    def probe(cap):
        budget.check(f"cap {cap}")
        calls.append(cap)
        state["now"] += 1.0
        return OK if cap >= 5.3 else OOM

    result = min_cap_search(probe, 2.0, 12.0)
    assert not result["complete"] and result["min_cap_gib"] is None and len(calls) == 3
    assert result["at_most_gib"] == min(c for c in calls if c >= 5.3)
    assert result["above_gib"] == max((c for c in calls if c < 5.3), default=None)
    assert budget.skipped and budget.skipped[0].startswith("cap ")


def test_budget_allows_runs_until_the_deadline_only():
    clock, state = fake_clock(0)
    budget = Budget(10, clock=clock)
    budget.check("first")
    state["now"] = 10
    with pytest.raises(OutOfTime):
        budget.check("second")
    assert budget.skipped == ["second"]
    Budget(None, clock=clock).check("never limited")


# -- largest batch ---------------------------------------------------------------------------------

@given(largest=st.integers(0, 5000), start=st.integers(1, 600), growth=st.sampled_from([2.0, 1.25]))
def test_largest_batch_within_the_resolution(largest, start, growth):
    calls = []
    result = max_batch_search(threshold_probe_le(largest, calls), start, growth=growth,
                              resolution=0.05)
    assert result["complete"]
    assert len(calls) == len(set(calls))
    if largest == 0:
        assert result["max_batch"] is None and "batch 1" in result["note"]
        return
    found = result["max_batch"]
    assert found <= largest and largest - found < max(1, int(0.05 * found))
    assert result["at_max"]["status"] == "ok"


def threshold_probe_le(largest, calls):
    def probe(batch):
        calls.append(batch)
        return OK if batch <= largest else OOM
    return probe


def test_largest_batch_doubles_from_n_then_bisects():
    calls = []
    result = max_batch_search(threshold_probe_le(300, calls), 256)
    assert calls[:2] == [256, 512] and result["max_batch"] in range(286, 301)
    assert len(calls) <= 2 + math.ceil(math.log2(256 / (0.05 * 256)))


def test_largest_batch_when_every_batch_runs_out_of_memory():
    calls = []
    result = max_batch_search(lambda b: calls.append(b) or OOM, 256)
    assert result["complete"] and result["max_batch"] is None
    assert calls == [256, 128, 64, 32, 16, 8, 4, 2, 1]


def test_largest_batch_stops_at_the_ceiling():
    result = max_batch_search(lambda b: OK, 4, ceiling=64)
    assert result["max_batch"] == 64 and "ceiling" in result["note"]


def test_the_time_budget_ends_a_batch_search():
    clock, state = fake_clock(0)
    budget = Budget(2.5, clock=clock)

    def probe(batch):
        budget.check(f"batch {batch}")
        state["now"] += 1
        return OK if batch <= 1000 else OOM

    result = max_batch_search(probe, 16)
    assert not result["complete"] and result["max_batch"] is None
    assert result["at_least"] == 64 and budget.skipped == ["batch 128"]


# -- runs ------------------------------------------------------------------------------------------

def test_worker_outcomes():
    ok = worker_outcome(0, 'noise\n{"step_ms": 12.5, "peak_bytes": 1}\n', "")
    assert ok["status"] == "ok" and ok["step_ms"] == 12.5
    assert worker_outcome(0, '{"oom": true, "error": "CUDA out of memory"}', "")["status"] == "oom"
    late = worker_outcome(0, '{"oom": true, "error": "CUDA out of memory", "oom_at": "timed step 3"}', "")
    assert late == {"status": "oom", "error": "CUDA out of memory", "oom_at": "timed step 3"}
    # died of it outside the training loop, with a traceback
    died = worker_outcome(1, "", "Traceback...\nRuntimeError: GET was unable to find an engine to "
                                 "execute this computation\n")
    assert died["status"] == "oom" and "unable to find an engine" in died["error"]
    failed = worker_outcome(139, "", "Segmentation fault")
    assert failed["status"] == "failed" and failed["returncode"] == 139
    assert worker_outcome(1, '{"step_ms": 1}', "")["status"] == "failed"


def test_a_run_past_its_timeout_is_killed_with_its_children(tmp_path):
    pid_file = tmp_path / "grandchild.pid"
    script = f"import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', " \
             f"'import time; time.sleep(60)']); open({str(pid_file)!r}, 'w').write(str(p.pid)); " \
             f"time.sleep(60)"
    t0 = time.monotonic()
    rc, _, _, wall, timed_out = pressure.execute([sys.executable, "-c", script], dict(os.environ), 5)
    assert timed_out and wall < 30 and time.monotonic() - t0 < 30
    grandchild = int(pid_file.read_text())
    for _ in range(50):  # reaped by init shortly after the kill
        try:
            os.kill(grandchild, 0)
        except ProcessLookupError:
            break
        if _zombie(grandchild):
            break
        time.sleep(0.1)
    else:
        pytest.fail("the worker (a grandchild) outlived its timeout")


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] == "Z"
    except OSError:
        return True


# -- the parts end to end, against a fake GPU --------------------------------------------------------

# GiB each side needs to train (PyTorch, shim, shim + offload) at the table's N, and its step ms
NEEDS = {"resnet50": (20.3, 19.6, 12.1), "unet3d": (9.1, 6.8, 4.4)}
STEP_MS = {"resnet50": (116.0, 116.3, 125.0), "unet3d": (600.0, 590.0, 630.0)}
# shim + offload below this cap (GiB, at the table's N) recomputes and moves more: 3x its step
FAST_ABOVE = {"resnet50": 15.0, "unet3d": 6.0}
OFFLOAD_LINE = "mucudnn: info: offload plan for {cap:.2f} GiB: 40 kept, 12 offloaded, 3 recomputed"


class FakeGpu:
    """Answers worker commands as the worker would print, from the model, batch and cap in the
    command and whether it runs under `mucudnn run`."""

    def __init__(self):
        self.runs = []

    def __call__(self, cmd, env, timeout_s):
        def arg(name, default=None):
            return cmd[cmd.index(name) + 1] if name in cmd else default
        shim = "mucudnn" in cmd and "run" in cmd
        cli = cmd[:cmd.index("--")] if shim else []  # `python -m mucudnn run ...` before the worker
        offload = "--offload" in cli
        model, batch = arg("--model"), int(arg("--batch"))
        cap = float(arg("--memory-cap-gib", "0"))
        self.runs.append({"model": model, "batch": batch, "cap": cap, "shim": shim,
                          "online": env.get("MUCUDNN_ONLINE"), "dir": env.get("MUCUDNN_ONLINE_DIR"),
                          "budget": env.get("MUCUDNN_MEMORY_BUDGET"),
                          "steps": int(arg("--steps")), "dtype": arg("--dtype"),
                          "benchmark": "--cudnn-benchmark" in cmd, "offload": offload,
                          "cli": cli, "warmup": int(arg("--warmup")),
                          "offload_env": env.get("MUCUDNN_OFFLOAD"),
                          "profile_to": env.get("MUCUDNN_OFFLOAD_PROFILE"),
                          "allocator": env.get("PYTORCH_CUDA_ALLOC_CONF"),
                          "log_level": env.get("MUCUDNN_LOG_LEVEL")})
        from benchmarks.models import spec_of
        side = 2 if offload else int(shim)
        need = NEEDS[model][side] * batch / spec_of(model).batch
        stderr = "mucudnn: online tuning: 12 kernels measured in 3.0 s\n" if shim and int(arg("--warmup")) == 0 else ""
        if offload:
            stderr += OFFLOAD_LINE.format(cap=cap) + "\n"
            Path(env["MUCUDNN_OFFLOAD_PROFILE"]).write_text('{"profile": {}}\n')  # as the session
            Path(env["MUCUDNN_LOG_FILE"]).write_text(f"shim of {model} at {cap:g}\n")  # as the shim
        if cap and need > cap:
            return 0, json.dumps({"oom": True, "error": "CUDA out of memory"}) + "\n", stderr, 5.0, False
        step = STEP_MS[model][side] * batch / spec_of(model).batch
        if offload and cap < FAST_ABOVE[model] * batch / spec_of(model).batch:
            step *= 3
        out = {"step_ms": step, "step_ms_all": [step * 3, step] if "--warmup" in cmd else [step],
               "steps": 2, "peak_bytes": int(need * 2**30), "peak_reserved_bytes": int(need * 1.3 * 2**30),
               "loss": 1.0, "memory_fraction": None, "device": "NVIDIA H200", "batch": batch}
        return 0, json.dumps(out) + "\n", stderr, 6.0, False


@pytest.fixture
def gpu(monkeypatch):
    fake = FakeGpu()
    monkeypatch.setattr(pressure, "execute", fake)
    monkeypatch.setenv("MUCUDNN_ONLINE", "1")  # must never reach a plain PyTorch run
    monkeypatch.setenv("MUCUDNN_ONLINE_DIR", "/somewhere/else")
    monkeypatch.setenv("MUCUDNN_MEMORY_BUDGET", "1GiB")  # nor a budget the run did not ask for
    monkeypatch.setenv("MUCUDNN_OFFLOAD", "1")  # nor offload
    monkeypatch.setenv("MUCUDNN_OFFLOAD_PROFILE", "/somewhere/profile.json")  # nor its profile
    return fake


def test_ratio_tunes_once_per_setting_then_alternates_rounds(gpu, tmp_path, capsys):
    assert pressure.main(["ratio", "--models", "resnet50", "unet3d", "--rounds", "2",
                          "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "pressure-ratio.json").read_text())
    assert data["device"] == "NVIDIA H200" and data["skipped"] == []
    row = data["models"]["resnet50"]["settings"]["bf16/benchmark-on"]
    assert row["median_ratio"] == pytest.approx(116.3 / 116.0)
    assert row["first_use"]["online_lines"] == ["mucudnn: online tuning: 12 kernels measured in 3.0 s"]
    assert len(data["models"]["unet3d"]["settings"]) == 4
    # per setting and model: the first use, then PyTorch and the shim alternating
    resnet = [r for r in gpu.runs if r["model"] == "resnet50" and r["dtype"] == "fp32" and not r["benchmark"]]
    assert [(r["shim"], r["steps"]) for r in resnet] == [(True, 2), (False, 10), (True, 10),
                                                         (False, 10), (True, 10)]
    assert all(r["online"] is None and r["dir"] is None for r in gpu.runs if not r["shim"])
    assert all(r["online"] == "1" and r["dir"] == str(tmp_path / "online" / r["model"])
               for r in gpu.runs if r["shim"])
    assert "[ratio resnet50:256 fp32 benchmark off] shim/PyTorch 1.0026 1.0026 -> median 1.0026" \
        in capsys.readouterr().out
    page = (tmp_path / "pressure-h200.md").read_text()
    assert "| resnet50, 256 | fp32/benchmark-off |" in page and "| 1.0026 | yes |" in page
    assert "| unet3d, 2 | bf16/benchmark-on |" in page and "| 0.9833 | yes |" in page


def test_minmem_finds_each_sides_smallest_cap_and_reuses_the_ratio_runs(gpu, tmp_path):
    pressure.main(["ratio", "--models", "unet3d", "--rounds", "1", "--dtypes", "fp32",
                   "--benchmark", "off", "--out", str(tmp_path)])
    before = len(gpu.runs)
    assert pressure.main(["minmem", "--models", "unet3d", "resnet50", "--dtypes", "fp32",
                          "--benchmark", "off", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "pressure-minmem.json").read_text())
    unet, resnet = data["models"]["unet3d"], data["models"]["resnet50"]
    assert unet["pytorch"]["min_cap_gib"] == 9.25 and unet["shim"]["min_cap_gib"] == 7.0
    assert resnet["pytorch"]["min_cap_gib"] == 20.5 and resnet["shim"]["min_cap_gib"] == 19.75
    assert unet["pytorch_uncapped"].get("reused_from") == "pressure-ratio.json"
    assert "shim_first_use" not in unet  # tuned by the ratio part already
    assert "shim_first_use" in resnet
    new = gpu.runs[before:]
    assert not any(r["cap"] == 0 for r in new if r["model"] == "unet3d")  # no uncapped rerun
    assert all(r["steps"] == 3 for r in new if r["cap"])
    # the shim is told the cap as a user tells it, `mucudnn run --memory-budget CAP` (the CLI
    # sets the variable); PyTorch is not
    assert all(r["cli"][-3:] == ["run", "--memory-budget", str(int(r["cap"] * 2**30))]
               for r in new if r["shim"] and r["cap"])
    assert all(r["allocator"] == "" for r in new if r["shim"] and r["cap"])  # the part's allocator
    assert all(r["budget"] is None for r in gpu.runs)
    assert all("--memory-budget" not in r["cli"] for r in gpu.runs if not r["cap"])
    page = (tmp_path / "pressure-h200.md").read_text()
    assert "| unet3d, 2 | fp32/benchmark-off |" in page and "| 9.25 |" in page and "| 0.757 |" in page


def test_minmem_offload_searches_a_third_side_through_the_cli_below_the_smaller_minimum(
        gpu, tmp_path, capsys):
    assert pressure.main(["minmem", "--models", "unet3d", "resnet50", "--dtypes", "fp32",
                          "--benchmark", "off", "--offload", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "pressure-minmem.json").read_text())
    assert data["settings"]["offload"]
    assert data["settings"]["offload_warmup"] == pressure.OFFLOAD_WARMUP
    unet, resnet = data["models"]["unet3d"], data["models"]["resnet50"]
    # the 3-D target's cap probed first, alone: 0.8x PyTorch's 9.25 GiB, down to the grid
    assert unet["target"]["cap_gib"] == 7.25 and unet["target"]["target_met"] is True
    assert unet["target"]["vs_pytorch_uncapped_step"] == pytest.approx(630.0 / 600.0)
    assert "target" not in resnet
    assert unet["shim"]["min_cap_gib"] == 7.0 and unet["offload"]["min_cap_gib"] == 4.5
    assert resnet["offload"]["min_cap_gib"] == 12.25
    # fast: the smallest cap whose step is <= 1.10x PyTorch's uncapped; a slower run fails there
    assert unet["fast"]["min_cap_gib"] == 6.0 and resnet["fast"]["min_cap_gib"] == 15.0
    assert any(p["status"] == "slow" and p["limit_ms"] == pytest.approx(660.0)
               for p in unet["fast"]["probes"])
    # the conditions, per side: unet3d is 3-D (<= 0.8x at <= 1.10x), resnet50 is not
    assert unet["offload"]["vs_pytorch_min"] == pytest.approx(4.5 / 9.25)
    assert unet["offload"]["vs_pytorch_uncapped_step"] == pytest.approx(3 * 630.0 / 600.0)
    assert unet["offload"]["target_met"] is False  # trains there, but too slowly
    assert unet["fast"]["vs_pytorch_min"] == pytest.approx(6.0 / 9.25)
    assert unet["fast"]["vs_pytorch_uncapped_step"] == pytest.approx(630.0 / 600.0)
    assert unet["fast"]["target_met"] is True
    assert unet["shim"]["vs_pytorch_min"] == pytest.approx(7.0 / 9.25)
    assert unet["shim"]["target_met"] is True and resnet["shim"]["target_met"] is True
    assert resnet["offload"]["target_met"] is True  # 2-D: at most PyTorch's minimum
    assert unet["offload"]["at_min"]["offload_lines"] == [OFFLOAD_LINE.format(cap=4.5)]
    offload = [r for r in gpu.runs if r["offload"]]
    # the target's probe, then bracketed below the shim's minimum, down to 0.25x of it
    assert [r["cap"] for r in offload[:2]] == [7.25, 7.0] and min(r["cap"] for r in offload if r["model"] == "unet3d") >= 1.75
    # each offload run writes its recorded profile beside its log, named in its probe
    for probe in unet["offload"]["probes"] + unet["fast"]["probes"] + [unet["target"]]:
        assert (tmp_path / probe["offload_profile"]).read_text() == '{"profile": {}}\n'
        assert (tmp_path / probe["offload_log"]).read_text() == f"shim of unet3d at {probe['cap_gib']:g}\n"
    assert all(r["profile_to"] is None for r in gpu.runs if not r["offload"])
    # the two searches share their runs: no cap runs twice, and a shared one is marked reused
    caps = [(r["model"], r["cap"]) for r in offload]
    assert len(caps) == len(set(caps))
    reused = [p for p in unet["offload"]["probes"] if "reused_from" in p]
    assert reused and {p["cap_gib"] for p in reused} <= {p["cap_gib"] for p in unet["fast"]["probes"]}
    assert not any("reused_from" in p for p in unet["fast"]["probes"])
    for run in offload:  # the CLI's path: `mucudnn run --memory-budget CAP --offload`
        assert run["cli"][-4:] == ["run", "--memory-budget", str(int(run["cap"] * 2**30)), "--offload"]
        assert run["warmup"] == pressure.OFFLOAD_WARMUP
        # the target's probe (7.25 GiB) times more steps: its median decides the target
        assert run["steps"] == (40 if run["cap"] == 7.25 else 3)
        assert run["online"] == "1"
        # the CLI sets the budget and offload; the allocator stays the part's (none: the default)
        assert run["budget"] is None and run["offload_env"] is None and run["allocator"] == ""
        assert run["log_level"] == "info"
    assert all(r["offload_env"] is None and "--offload" not in r["cli"]
               for r in gpu.runs if not r["offload"])
    assert all(r["warmup"] == 1 for r in gpu.runs if r["cap"] and not r["offload"])
    printed = capsys.readouterr().out
    assert "offload 4.5 GiB 1890.0 ms [" in printed and "fast 6 GiB 630.0 ms [" in printed
    page = (tmp_path / "pressure-h200.md").read_text()
    assert "### Shim + activation offload (`mucudnn run --memory-budget CAP --offload`)" in page
    assert (f"after {pressure.OFFLOAD_WARMUP} warm-up train (the first "
            f"{planner.RECORD_STEPS} record") in page
    assert (f"| unet3d, 2 | fp32/benchmark-off | target (one probe) | 600.00 | 9.25 | 7.25 (ok) | "
            f"630.00 | 0.784 | 1.050 | yes | 1 | {OFFLOAD_LINE.format(cap=7.25)} |  |") in page
    assert (f"| unet3d, 2 | fp32/benchmark-off | any | 600.00 | 9.25 | 4.5 | 1890.00 | 0.486 | 3.150 | "
            f"**no** | {len(unet['offload']['probes'])} | {OFFLOAD_LINE.format(cap=4.5)} |  |") in page
    assert (f"| unet3d, 2 | fp32/benchmark-off | fast | 600.00 | 9.25 | 6 | 630.00 | 0.649 | 1.050 | "
            f"yes | {len(unet['fast']['probes'])} | {OFFLOAD_LINE.format(cap=6.0)} |  |") in page


def test_a_fast_search_slow_at_its_upper_end_fails_there_without_widening():
    calls = []
    probe = pressure.fast_probe(lambda c: calls.append(c) or {"status": "ok", "step_ms": 200.0}, 110.0)
    result = min_cap_search(probe, 3.0, 6.0, ceiling_gib=6.0)
    assert calls == [6.0] and result["min_cap_gib"] is None and result["complete"]
    assert result["probes"][0]["status"] == "slow" and result["probes"][0]["limit_ms"] == 110.0


def test_a_fast_search_slow_at_its_ceiling_does_not_meet_the_target():
    entry = {"pytorch": {"min_cap_gib": 9.25}, "pytorch_uncapped": {"step_ms": 600.0},
             "fast": {"min_cap_gib": None, "complete": True, "note": "fails even at 9.25 GiB"}}
    assert pressure.minmem_targets("unet3d", entry, "fast")["target_met"] is False


@pytest.mark.parametrize("target_ms, slower", [(121.6, [7.0]), (112.0, [])])
def test_a_fast_minimum_with_a_slower_cap_above_it_does_not_meet_the_target(target_ms, slower):
    # session 17's U-Net: 113.2 ms at 6.75 GiB (the fast search's minimum), 121.6 ms at the
    # target's 7.0 GiB probe, over 1.10x PyTorch's 103.3: the bisection's assumption failed
    probes = [{"cap_gib": 9.0, "status": "ok", "step_ms": 105.1},
              {"cap_gib": 6.5, "status": "slow", "step_ms": 140.5},
              {"cap_gib": 6.75, "status": "ok", "step_ms": 113.2}]
    entry = {"pytorch_uncapped": {"step_ms": 103.3}, "pytorch": {"min_cap_gib": 9.0, "probes": []},
             "target": {"cap_gib": 7.0, "status": "ok", "step_ms": target_ms},
             "fast": {"min_cap_gib": 6.75, "complete": True, "probes": probes,
                      "at_min": {"step_ms": 113.2}}}
    result = pressure.minmem_targets("unet3d", entry, "fast")
    assert result["slower_above_gib"] == slower and result["target_met"] is (not slower)
    assert result["vs_pytorch_min"] == pytest.approx(0.75)
    line = pressure.minmem_line("unet3d", 2, {**entry, "fast": {**entry["fast"], **result}})
    assert ("slower at 7 GiB" in line) is bool(slower)


def test_minmem_can_leave_the_shim_alone_out(gpu, tmp_path):
    assert pressure.main(["minmem", "--models", "unet3d", "--dtypes", "fp32", "--benchmark", "off",
                          "--offload", "--no-shim-search", "--out", str(tmp_path)]) == 0
    unet = json.loads((tmp_path / "pressure-minmem.json").read_text())["models"]["unet3d"]
    assert "shim" not in unet and unet["fast"]["min_cap_gib"] == 6.0
    assert "| not searched |" in (tmp_path / "pressure-h200.md").read_text()
    assert not any(r["shim"] and r["cap"] and not r["offload"] for r in gpu.runs)
    # the target's probe, then bracketed below PyTorch's minimum, the only one searched
    assert [r["cap"] for r in gpu.runs if r["offload"]][:2] == [7.25, unet["pytorch"]["min_cap_gib"]]


def test_minmem_can_probe_the_3d_target_alone(gpu, tmp_path):
    assert pressure.main(["minmem", "--models", "unet3d", "--dtypes", "fp32", "--benchmark", "off",
                          "--offload", "--no-shim-search", "--offload-searches", "target",
                          "--out", str(tmp_path)]) == 0
    unet = json.loads((tmp_path / "pressure-minmem.json").read_text())["models"]["unet3d"]
    assert "fast" not in unet and "offload" not in unet and unet["target"]["cap_gib"] == 7.25
    assert [r["cap"] for r in gpu.runs if r["offload"]] == [7.25]
    assert "target (one probe)" in (tmp_path / "pressure-h200.md").read_text()


def test_minmem_without_offload_runs_no_offload(gpu, tmp_path):
    pressure.main(["minmem", "--models", "unet3d", "--out", str(tmp_path)])
    entry = json.loads((tmp_path / "pressure-minmem.json").read_text())["models"]["unet3d"]
    assert "offload" not in entry and not any(r["offload"] for r in gpu.runs)
    assert "Shim + activation offload" not in (tmp_path / "pressure-h200.md").read_text()


def test_offload_is_minmems_and_warms_up_past_the_recording_steps(gpu, tmp_path, capsys):
    for argv in (["ratio", "--offload"], ["maxbatch", "--offload"],
                 ["minmem", "--offload", "--offload-warmup", "3"]):
        with pytest.raises(SystemExit):
            pressure.main([*argv, "--out", str(tmp_path)])
        assert "error: --offload" in capsys.readouterr().err
    assert gpu.runs == []
    warmup = pressure.OFFLOAD_MIN_WARMUP + 1
    pressure.main(["minmem", "--models", "unet3d", "--offload", "--offload-warmup", str(warmup),
                   "--offload-low-fraction", "0.5", "--out", str(tmp_path)])
    offload = [r for r in gpu.runs if r["offload"]]
    assert offload and all(r["warmup"] == warmup for r in offload)
    assert min(r["cap"] for r in offload) >= 3.5  # 0.5 x the shim's 7 GiB


def test_the_offload_warmup_covers_mucudnn_torchs_recording_steps():
    pytest.importorskip("torch")
    from mucudnn.torch.offload_session import OffloadSession
    recorded = OffloadSession(budget=1).lifecycle.record_steps   # a session's by default
    assert pressure.OFFLOAD_RECORD_STEPS == recorded
    # and the trial of up to TRIAL_PLANS plans (mucudnn.torch.planning.trial_plans), each
    # TRIAL_STEPS
    assert pressure.OFFLOAD_MIN_WARMUP >= recorded + pressure.TRIAL_PLANS * pressure.TRIAL_STEPS + 2


@pytest.mark.parametrize("model, ratios, met", [
    ("unet3d", (4.0, 9.0, 105.0, 100.0), True),
    ("unet3d", (8.0, 9.0, 105.0, 100.0), False),    # 0.89x PyTorch's minimum
    ("r3d_18", (4.0, 6.25, 115.0, 100.0), False),   # 1.15x the uncapped step
    ("resnet50", (20.0, 20.0, 300.0, 100.0), True),  # 2-D: at most PyTorch's minimum
    ("resnet50", (20.25, 20.0, 100.0, 100.0), False),
    ("unet3d", (None, 9.0, None, 100.0), None),     # no minimum: nothing to judge
])
def test_minmem_targets(model, ratios, met):
    own, pytorch, own_ms, base_ms = ratios
    entry = {"pytorch_uncapped": {"step_ms": base_ms}, "pytorch": {"min_cap_gib": pytorch},
             "offload": {"min_cap_gib": own, "at_min": {"step_ms": own_ms} if own_ms else {}}}
    result = pressure.minmem_targets(model, entry, "offload")
    assert result["target_met"] is met
    if own:
        assert result["vs_pytorch_min"] == pytest.approx(own / pytorch)
        assert result["vs_pytorch_uncapped_step"] == pytest.approx(own_ms / base_ms)


def test_the_minmem_stage_adds_offload_when_asked(tmp_path):
    """gpu_run.sh's pressure stage, its python3 faked: PRESSURE_OFFLOAD=1 reaches minmem only."""
    root = Path(__file__).resolve().parents[2]
    fake = tmp_path / "bin"
    fake.mkdir()
    calls = tmp_path / "calls"
    (fake / "python3").write_text(f"#!/bin/sh\necho \"$*\" >> {calls}\n")
    (fake / "python3").chmod(0o755)
    env = dict(os.environ, PATH=f"{fake}:{os.environ['PATH']}", OUT=str(tmp_path / "out"),
               PRESSURE_OFFLOAD="1")
    subprocess.run(["bash", str(root / "benchmarks" / "gpu_run.sh"), "pressure-minmem-r3d_18",
                    "pressure-ratio-r3d_18"], cwd=tmp_path, env=env, capture_output=True,
                   timeout=60)
    runs = [line for line in calls.read_text().splitlines() if "benchmarks.pressure" in line]
    assert len(runs) == 2
    assert runs[0].startswith("-m benchmarks.pressure minmem --models r3d_18") and "--offload" in runs[0]
    assert runs[1].startswith("-m benchmarks.pressure ratio") and "--offload" not in runs[1]


def test_maxbatch_under_the_cap(gpu, tmp_path):
    assert pressure.main(["maxbatch", "--models", "resnet50", "--cap", "24", "--dtypes", "bf16",
                          "--out", str(tmp_path)]) == 0
    entry = json.loads((tmp_path / "pressure-maxbatch.json").read_text())["models"]["resnet50"]
    pt, shim = entry["pytorch"]["max_batch"], entry["shim"]["max_batch"]
    assert 24 / 20.3 * 256 - pt < 0.05 * pt and pt <= 24 / 20.3 * 256
    assert 24 / 19.6 * 256 - shim < 0.05 * shim and shim <= 24 / 19.6 * 256
    assert entry["pytorch"]["images_per_s"] == pytest.approx(256 * 1000 / 116.0)
    assert all(r["dtype"] == "bf16" and r["cap"] == 24 for r in gpu.runs)
    assert "| resnet50 | bf16/benchmark-off |" in (tmp_path / "pressure-h200.md").read_text()


def test_front_mode_runs_the_shim_with_a_plan_made_once_per_dtype(gpu, tmp_path, monkeypatch):
    from benchmarks import never_slower
    made = []

    def prepare(model, batch, out, cap_limit, dtype="fp32"):
        made.append((model, batch, dtype))
        if dtype == "bf16":
            raise RuntimeError("bench failed: no engine")
        return {"plans": {"front": str(out / f"{model}-{dtype}.plan")}}

    monkeypatch.setattr(never_slower, "prepare", prepare)
    assert pressure.main(["ratio", "--models", "resnet50", "--shim-mode", "front", "--rounds", "2",
                          "--out", str(tmp_path)]) == 0
    assert made == [("resnet50", 256, "fp32"), ("resnet50", 256, "bf16")]
    shim_runs = [r for r in gpu.runs if r["shim"]]
    assert shim_runs and all(r["online"] is None and r["dtype"] == "fp32" for r in shim_runs)
    settings = json.loads((tmp_path / "pressure-ratio.json").read_text())["models"]["resnet50"]["settings"]
    assert "first_use" not in settings["fp32/benchmark-off"]
    assert settings["fp32/benchmark-on"]["median_ratio"] == pytest.approx(116.3 / 116.0)
    failed = settings["bf16/benchmark-off"]["rounds"][0]["shim"]
    assert failed["status"] == "failed" and "no engine" in failed["stderr_tail"]


def test_a_spent_budget_records_what_was_not_run(gpu, tmp_path):
    assert pressure.main(["minmem", "--models", "unet3d", "resnet50", "--time-budget-s", "0",
                          "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "pressure-minmem.json").read_text())
    assert gpu.runs == []
    assert len(data["skipped"]) == 2 and data["skipped"][0].startswith("unet3d:2 fp32")
    assert all(e["incomplete"] == "time budget spent" for e in data["models"].values())
    page = (tmp_path / "pressure-gpu.md").read_text()  # no run: no device name
    assert "## Not run (time budget spent)" in page


# -- several GPUs ----------------------------------------------------------------------------------

def test_models_spread_over_gpus_and_results_merge(tmp_path, monkeypatch):
    started = []

    class FakeChild:
        def __init__(self, cmd, env, stdout, stderr):
            out = cmd[cmd.index("--out") + 1]
            model = cmd[cmd.index("--models") + 1]
            started.append((model, env["CUDA_VISIBLE_DEVICES"], cmd))
            data = {"part": "ratio", "device": "NVIDIA H200", "settings": {}, "skipped": [],
                    "models": {model: {"batch": 1, "settings": {}}}}
            with open(os.path.join(out, "pressure-ratio.json"), "w") as f:
                json.dump(data, f)

        def poll(self):
            return 0

    monkeypatch.setattr(pressure.subprocess, "Popen", FakeChild)
    monkeypatch.setattr(pressure.time, "sleep", lambda s: None)
    assert pressure.main(["ratio", "--models", "resnet50", "unet3d", "r3d_18:16", "--gpus", "0,1",
                          "--rounds", "1", "--time-budget-s", "500", "--out", str(tmp_path)]) == 0
    assert [(m, g) for m, g, _ in started] == [("resnet50", "0"), ("unet3d", "1"), ("r3d_18:16", "0")]
    cmd = started[0][2]
    assert cmd.count("--models") == 1 and "--gpus" not in cmd and "--rounds" in cmd
    assert float(cmd[cmd.index("--time-budget-s") + 1]) <= 500
    merged = json.loads((tmp_path / "pressure-ratio.json").read_text())
    assert set(merged["models"]) == {"resnet50", "unet3d", "r3d_18:16"}
    assert (tmp_path / "pressure-h200.md").exists()


def test_strip_options_drops_options_with_all_their_values():
    argv = ["ratio", "--models", "a", "b:2", "--rounds", "2", "--out=x", "--gpus", "0,1"]
    assert pressure.strip_options(argv, {"--models", "--out", "--gpus"}) == ["ratio", "--rounds", "2"]


# -- the page ----------------------------------------------------------------------------------------

SAMPLE = {
    "ratio": {"part": "ratio", "device": "NVIDIA H100 80GB HBM3", "skipped": ["vgg16:256 bf16 x"],
              "started": "2026-11-23 10:00 UTC",
              "settings": {"shim_mode": "online", "rounds": 2, "steps": 10, "warmup": 3},
              "models": {"vgg16": {"batch": 256, "settings": {"bf16/benchmark-off": {
                  "dtype": "bf16", "cudnn_benchmark": False, "median_ratio": 1.0213,
                  "first_use": {"status": "ok", "wall_s": 31.2, "step_ms_all": [9000.0, 100.0],
                                "online_lines": ["mucudnn: online tuning: 9 kernels | 20 s"]},
                  "rounds": [{"pytorch": {"status": "ok", "step_ms": 100.0, "peak_bytes": 2**31},
                              "shim": {"status": "ok", "step_ms": 102.13, "peak_bytes": 2**31},
                              "ratio": 1.0213},
                             {"pytorch": {"status": "ok", "step_ms": 100.0},
                              "shim": {"status": "oom"}}]}}}}},
    "minmem": {"part": "minmem", "device": None, "skipped": [],
               "settings": {"cap_step": 0.25, "probe_steps": 3},
               "models": {"r3d_18": {"batch": 32, "dtype": "fp32", "cudnn_benchmark": False,
                                     "pytorch_uncapped": {"status": "ok", "step_ms": 80.0,
                                                          "peak_bytes": 6 * 2**30,
                                                          "peak_reserved_bytes": 9 * 2**30},
                                     "pytorch": {"min_cap_gib": 6.5, "probes": [{}] * 4,
                                                 "at_min": {"step_ms": 84.0}},
                                     "shim": {"min_cap_gib": None, "at_most_gib": 5.0,
                                              "error": "failed at 4 GiB: boom",
                                              "probes": [{}] * 2}}}},
}


def test_the_page_from_sample_json():
    page = pressure.markdown(SAMPLE)
    assert "Device: NVIDIA H100 80GB HBM3" in page
    assert page.count("Run started") == 1 and "Run started 2026-11-23 10:00 UTC." in page
    assert ("| vgg16, 256 | bf16/benchmark-off | 100.00 100.00 | 102.13 oom | 1.0213 - | 1.0213 | "
            "**no** | 2.00 / 2.00 | 31.2 s; 9000 / 100; mucudnn: online tuning: 9 kernels / 20 s |  |"
            ) in page
    assert ("| r3d_18, 32 | fp32/benchmark-off | 80.00 (6.00 / 9.00) | 6.5 | 84.00 | <= 5 (incomplete) "
            "| - | - | - | 4 / 2 | shim: failed at 4 GiB: boom |") in page
    assert "(c) Largest batch" not in page  # no maxbatch JSON
    assert page.rstrip().endswith("- vgg16:256 bf16 x")
    assert pressure.gpu_slug("NVIDIA H100 80GB HBM3") == "h100"
    assert pressure.gpu_slug("NVIDIA H200") == "h200" and pressure.gpu_slug(None) == "gpu"


def test_report_rewrites_the_page_from_the_json(tmp_path):
    (tmp_path / "pressure-minmem.json").write_text(json.dumps(SAMPLE["minmem"]))
    target = tmp_path / "page.md"
    assert pressure.main(["report", "--out", str(tmp_path), "--to", str(target)]) == 0
    assert "| r3d_18, 32 |" in target.read_text()


def test_the_module_runs_without_torch():
    proc = subprocess.run([sys.executable, "-c", "import sys; sys.modules['torch'] = None; "
                           "import benchmarks.pressure, benchmarks.models"], capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("allocator", ["", "expandable_segments:True"])
def test_the_allocator_every_run_inherits_is_recorded_and_shown(gpu, tmp_path, monkeypatch, allocator):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", allocator)
    pressure.main(["ratio", "--models", "resnet50", "--rounds", "1", "--dtypes", "fp32",
                   "--benchmark", "off", "--out", str(tmp_path)])
    data = json.loads((tmp_path / "pressure-ratio.json").read_text())
    assert data["settings"]["allocator"] == allocator
    shown = f"`{allocator}`" if allocator else "the default"
    assert f"PyTorch's allocator (`PYTORCH_CUDA_ALLOC_CONF`, every run alike): {shown}." in \
        (tmp_path / "pressure-h200.md").read_text()


@pytest.mark.parametrize("environment", [{}, {"MUCUDNN_WORKSPACE_LIMIT": "256MiB"},
                                         {"MUCUDNN_WORKSPACE_SLACK": "5"},
                                         {"MUCUDNN_OFFLOAD_HEADROOM": "5"}])
def test_the_shims_point_settings_are_recorded_where_set(tmp_path, monkeypatch, environment):
    for name in pressure.RUN_CHOICES:
        monkeypatch.setenv(name, "x")   # recorded, so restored after the test
        monkeypatch.delenv(name)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    args = pressure.parser().parse_args(["minmem", "--out", str(tmp_path)])
    assert pressure.settings_of(args).get("shim_environment") == (environment or None)


def test_without_the_shim_budget_the_shim_runs_capped_but_untold(gpu, tmp_path):
    assert pressure.main(["minmem", "--models", "unet3d", "--dtypes", "fp32", "--benchmark", "off",
                          "--no-shim-budget", "--out", str(tmp_path)]) == 0
    capped = [r for r in gpu.runs if r["shim"] and r["cap"]]
    assert capped and all("--memory-budget" not in r["cli"] and r["budget"] is None for r in capped)


def test_minmem_probes_become_the_offload_plots_rows(gpu, tmp_path):
    assert pressure.main(["minmem", "--models", "unet3d", "--dtypes", "fp32", "--benchmark", "off",
                          "--offload", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "pressure-minmem.json").read_text())
    rows = pressure.minmem_rows(report)
    from benchmarks.budget_plot import plot_series
    series = plot_series(rows, "unet3d")
    entry = report["models"]["unet3d"]
    # every offload run that trained, slow ones included, once per cap; PyTorch's capped runs
    offload_caps = {p["cap_gib"] for side in ("offload", "fast") for p in entry[side]["probes"]
                    if p["status"] in ("ok", "slow")}
    assert [x for x, _ in series["mucudnn"]] == sorted(offload_caps)
    assert (6.0, 630.0) in series["mucudnn"] and (4.5, 1890.0) in series["mucudnn"]
    assert [x for x, _ in series["pytorch"]] == sorted(
        p["cap_gib"] for p in entry["pytorch"]["probes"] if p["status"] == "ok")
    (label, x, y), = series["anchors"]  # PyTorch unconstrained, at its peak reserved
    assert label.startswith("pytorch unconstrained") and y == 600.0
    assert x == pytest.approx(entry["pytorch_uncapped"]["peak_reserved_bytes"] / 2**30)
    assert sorted(series["minima"]) == [("mucudnn min 4.5 GiB", 4.5), ("pytorch min 9.25 GiB", 9.25)]
    assert 7.0 in series["failures"] or any(p["status"] == "oom" for p in entry["pytorch"]["probes"])


def test_the_page_has_its_minmem_plot_beside_it(gpu, tmp_path):
    pytest.importorskip("matplotlib")
    pressure.main(["minmem", "--models", "unet3d", "--dtypes", "fp32", "--benchmark", "off",
                   "--offload", "--out", str(tmp_path)])
    png = tmp_path / "pressure-h200-minmem.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_capped_shim_run_that_tuned_online_says_so_beside_its_step():
    lines = ["mucudnn: info: KEY N=16: online tuning measured 6 points in 376.3 ms; fastest 0.2 ms",
             "mucudnn: summary: online tuning: measured 38 kernels (212 candidates timed) in 9 s; "
             "2 kernels from DIR"]
    assert pressure.tuned_kernels(lines) == 38
    assert pressure.tuned_kernels(lines[:1]) is None
    assert "tuned 38 kernels online" in pressure.tuning_note({"tuned_kernels": 38})
    assert pressure.tuning_note({"tuned_kernels": 0}) == pressure.tuning_note({}) == ""


def test_a_target_cap_below_one_grid_step_is_not_probed():
    probed = []
    result = pressure.target_probe(lambda cap: probed.append(cap) or {"status": "ok", "step_ms": 1.0},
                                   1.0, 1.0, 1.0)
    assert not probed and result["status"] == "not probed" and result["target_met"] is False
