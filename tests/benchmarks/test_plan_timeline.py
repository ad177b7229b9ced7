"""benchmarks/plan_timeline.py on the CPU: the dry run end to end (the tiny U-Net's script alone
and under `mucudnn run --memory-budget --offload`, twice with one fresh cache), the timeline read
from a GPU-like output (the session's lines among the shim's, the steps' states or, without
them, the plan lines), steady state, a run killed at its timeout keeping its lines, and a bad
case refused in one line."""

from __future__ import annotations

import json
import sys

import pytest

from benchmarks import plan_timeline
from benchmarks.plan_timeline import p90_over_p50, parse_run, run_stamped, steady_from, timeline

torch = pytest.importorskip("torch")


def test_dry_run_first_and_cached_runs(tmp_path, capsys):
    if not hasattr(torch, "autograd") or not hasattr(torch.autograd, "graph"):
        pytest.skip("needs a real PyTorch")
    plan_timeline.main(["--device", "cpu", "--cases", "tiny:2@1MiB", "--steps", "5",
                        "--pytorch-steps", "2", "--out", str(tmp_path)])
    document = json.loads((tmp_path / "plan_timeline.json").read_text())
    [case] = document["cases"]
    assert (case["model"], case["batch"], case["budget"]) == ("tiny", 2, 1 << 20)
    runs = case["runs"]
    assert list(runs) == ["pytorch", "first", "cached"]
    for name, run in runs.items():
        assert run["status"] == "ok", (name, (tmp_path / f"plan_timeline-tiny-2-{name}.log")
                                       .read_text()[-2000:])
        assert len(run["steps_ms"]) == (2 if name == "pytorch" else 5)
        assert all(ms > 0 for ms in run["steps_ms"])
        # launched, then the process started, then its first step ended
        # (the process's start is read in 10 ms ticks)
        assert -0.02 <= run["process_started_s"] < run["first_step_end_s"] <= run["wall_s"]
        assert run["ready"]["at_s"] <= run["first_step_end_s"]
    assert runs["pytorch"]["states"] == ["none"] * 2
    # under `mucudnn run --offload` the script found the session; a CPU step is never planned
    assert runs["first"]["states"] == runs["cached"]["states"] == ["recording"] * 5
    assert "first_planned_step" not in runs["first"]
    assert runs["first"]["command"][1:7] == ["-m", "mucudnn", "run", "--memory-budget", "1MiB",
                                             "--offload"]
    assert runs["cached"]["command"] == runs["first"]["command"]
    assert (tmp_path / "cache-tiny-2").is_dir()
    page = (tmp_path / "plan_timeline.md").read_text()
    assert "Dry run on the CPU" in page
    assert [line.split(" | ")[1] for line in page.splitlines()
            if line.startswith("| tiny N=2 @ 1 MiB |")] == ["pytorch", "first", "cached"]
    assert "- first, steps 1–5 ms: " in page and page.count("[recording]") == 2
    assert page in capsys.readouterr().out


def gpu_like_output(states: bool) -> list[tuple[float, str]]:
    """A first run as the GPU prints it: the shim's lines, two recording steps, the plan, a trial,
    then steady steps (the process started 1.5 s after the launch)."""
    step_ms = [1100, 1000, 210, 230, 190, 160, 152, 153, 151, 152, 154, 152]
    state = ["recording", "recording"] + ["trial"] * 3 + ["watching"] * 7
    lines = [(0.4, "mucudnn: info: the shim's room reads PyTorch's caching allocator (its budget, "
                   "its free cache)"),
             (6.0, "train_steps: ready at 4.500 s (session: found)")]
    end = 4.5
    for index, ms in enumerate(step_ms, 1):
        if index == 1:
            lines.append((7.0, "mucudnn: info: graph plan: convolution N=128 runs the online "
                               "front's point (workspace 1024, the engine's 2048)"))
        if index == 3:
            lines.append((8.7, "mucudnn: info: offload plan for 8.00 GiB: 200 kept, 90 offloaded,"
                               " 21 recomputed; predicted peak 7.1 GiB, step 151.0 ms"))
            lines.append((8.8, "mucudnn: info: trying it against the plan as made, its small "
                               "kept groups apart, 3 steps each"))
        start, end = end, end + ms / 1000
        lines.append((end + 1.5 + 0.002, f"train_steps: step {index} start_s={start:.3f} "
                      f"end_s={end:.3f} step_ms={ms:.2f} "
                      f"session={state[index - 1] if states else 'none'}"))
    return lines


@pytest.mark.parametrize("states", [True, False])
def test_the_timeline_of_a_gpu_run(states):
    parsed = parse_run(gpu_like_output(states))
    assert [line["session"] for line in parsed["mucudnn_lines"]] == [False, False, True, True]
    assert parsed["ready"] == {"process_s": 4.5, "at_s": 6.0}
    got = timeline(parsed, 1.05, 5)
    assert got["process_started_s"] == pytest.approx(1.502)
    assert got["first_step_end_s"] == pytest.approx(4.5 + 1.1 + 1.502)
    # the first planned step is step 3, found by its state or by the plan line before it
    assert got["planned_by"] == ("session state" if states else "plan line")
    assert got["first_planned_step"] == 3
    assert got["first_planned_start_s"] == pytest.approx(4.5 + 2.1 + 1.502)
    # steps 6..12 (160, 152, ...): p90 160 over p50 152 is 1.053 > 1.05; from step 7 it is 1.0132
    assert got["steady_step"] == 7
    assert got["steady_median_ms"] == 152
    assert got["steady_p90_over_p50"] == pytest.approx(154 / 152, abs=1e-4)
    assert got["steady_start_s"] == pytest.approx(4.5 + sum([1100, 1000, 210, 230, 190, 160])
                                                  / 1000 + 1.502, abs=1e-3)


def test_steady_state_needs_enough_steps():
    assert p90_over_p50([100, 100, 100, 100, 110]) == pytest.approx(1.1)
    assert steady_from([300, 100, 100, 100, 100, 100], 1.05, 5) == 2
    assert steady_from([300, 100, 100, 100, 100], 1.05, 5) is None   # 4 steady steps only
    assert steady_from([100, 120, 100, 120, 100, 120, 100], 1.05, 3) is None   # two modes


def test_steady_state_starts_at_a_step_within_the_band():
    # a recording's and its planning's steps (under a tenth of the run) stay out of the p90 of
    # the rest, but they are not steady: steady state starts at the first step in the band
    steps = [25000, 1100, 990, 480, 250, 320] + [222, 228, 221, 223] * 15
    assert p90_over_p50(steps) <= 1.05
    assert steady_from(steps, 1.05, 5) == 7
    assert timeline({"steps": [], "mucudnn_lines": []}, 1.05, 5) == {"steps_ms": [], "states": []}


def test_a_run_past_its_timeout_keeps_what_it_printed(tmp_path):
    log = tmp_path / "run.log"
    script = "import time; print('train_steps: ready at 0.100 s', flush=True); time.sleep(60)"
    ran = run_stamped([sys.executable, "-c", script], {}, 3, log)
    assert ran["status"] == "timeout" and ran["wall_s"] < 30
    assert [text for _, text in ran["lines"]] == ["train_steps: ready at 0.100 s"]
    assert "ready at 0.100 s" in log.read_text()
    failed = run_stamped([sys.executable, "-c", "raise SystemExit(3)"], {}, 30, log)
    assert failed["status"] == "exit 3"


def test_a_bad_case_is_one_line(capsys):
    with pytest.raises(SystemExit) as exit_info:
        plan_timeline.main(["--cases", "resnet152:128"])
    assert exit_info.value.code == 2
    assert "expected MODEL:BATCH@BUDGET" in capsys.readouterr().err


def test_again_reads_the_runs_from_their_logs_with_this_versions_definitions(tmp_path, capsys):
    # a page written under another definition of steady state (steady_step 1, which a p90 alone
    # gave), and the run's log as run_stamped writes it
    lines = gpu_like_output(states=True)
    (tmp_path / "plan_timeline-resnet152-128-first.log").write_text(
        "".join(f"[{at:8.3f}] {text}\n" for at, text in lines))
    argv = ["--cases", "resnet152:128@8GiB", "--out", "somewhere"]
    old = {"status": "ok", "wall_s": 20.0, "timeout_s": 240.0, "command": ["python"],
           "steps_ms": [1.0], "steady_step": 1, "steady_start_s": 0.0, "steady_median_ms": 1.0,
           "plan_cache_files": ["a.json"]}
    (tmp_path / "plan_timeline.json").write_text(json.dumps(
        {"argv": argv, "shim": {"seconds": 1.0},
         "cases": [{"model": "resnet152", "batch": 128, "budget": 8 << 30,
                    "runs": {"first": old}}]}))
    plan_timeline.main(["--again", str(tmp_path)])
    run = json.loads((tmp_path / "plan_timeline.json").read_text())["cases"][0]["runs"]["first"]
    expected = timeline(parse_run(lines), 1.05, 5)
    assert run["steps_ms"] == expected["steps_ms"]
    assert run["steady_step"] == expected["steady_step"] == 7   # 152 ms, then 151-154
    assert run["first_planned_step"] == expected["first_planned_step"]
    # what the run was stays as recorded
    assert (run["status"], run["wall_s"], run["plan_cache_files"]) == ("ok", 20.0, ["a.json"])
    page = (tmp_path / "plan_timeline.md").read_text()
    assert "--cases resnet152:128@8GiB --out somewhere" in page
    assert page in capsys.readouterr().out


def test_again_without_a_page_is_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as exited:
        plan_timeline.main(["--again", str(tmp_path)])
    assert exited.value.code == 2
    assert "plan_timeline.json does not exist" in capsys.readouterr().err


def test_detail_asks_each_runs_script_for_its_steps_detail():
    import argparse
    from benchmarks.plan_timeline import train_command
    plain = argparse.Namespace(device="cuda", sample=None, detail=False)
    assert "--detail" not in train_command(plain, "resnet50", 184, 30)
    detailed = argparse.Namespace(device="cuda", sample=None, detail=True)
    command = train_command(detailed, "resnet50", 184, 30)
    assert command[-1] == "--detail" and command[command.index("--steps") + 1] == "30"
