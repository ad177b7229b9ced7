"""benchmarks/host_cost.py on the CPU: the dry run's driver, worker and tables end to end (the tiny
U-Net, real OffloadSessions over a host link where host and device are one memory), the verdict
of the table on made-up steps, and a bad case refused in one line."""

from __future__ import annotations

import argparse
import json

import pytest

torch = pytest.importorskip("torch")
if not hasattr(torch, "autograd") or not hasattr(torch.autograd, "graph"):
    pytest.skip("needs a real PyTorch", allow_module_level=True)

from benchmarks import host_cost  # noqa: E402


def test_dry_run_measures_every_configuration(tmp_path, capsys):
    host_cost.main(["--device", "cpu", "--cases", "tiny:2@256KiB", "--rounds", "2", "--steps",
                    "1", "--settle-steps", "2", "--max-warmup-steps", "20", "--out",
                    str(tmp_path)])
    document = json.loads((tmp_path / "host_cost.json").read_text())
    [case] = document["cases"]
    assert case["status"] == "ok", case["reason"]
    # the kept session keeps every group; the one for 256 KiB moves some (the step saves more)
    kept, mixed = case["kept_plan"], case["mixed_plan"]
    assert kept["groups"] > 0 and kept["kept"] == kept["groups"]
    assert mixed["groups"] == kept["groups"] and mixed["offloaded"] + mixed["recomputed"] > 0
    assert case["kept_settled"] and case["mixed_settled"]
    samples = case["samples"]
    # every configuration timed each round (2 rounds x 1 step), ran as it should
    assert {name: len(rows) for name, rows in samples.items()} == \
        {"pytorch": 2, "kept": 2, "mixed": 2, "recording": 2}
    assert {s["state"] for s in samples["pytorch"]} == {"none"}
    # settled: the lifecycle's states of a plan in force after its trial
    assert {s["state"] for s in samples["kept"] + samples["mixed"]} <= {"planned", "watching"}
    assert {s["state"] for s in samples["recording"]} == {"recording"}
    # the warm-up recorded before it planned
    warmup = [s["state"] for s in case["warmup"] if s["config"] == "mixed"]
    assert warmup[0] == "recording" and warmup[-1] in ("planned", "watching")
    for rows in samples.values():
        for s in rows:
            assert s["fwd_ms"] > 0 and s["bwd_ms"] > 0
            assert min(s["fwd_cpu_ms"], s["fwd_thread_ms"], s["bwd_cpu_ms"]) >= 0
            assert s["host_ms"] >= s["fwd_ms"] + s["bwd_ms"] + s["opt_ms"]
            assert s["device_ms"] >= s["host_ms"]   # on the CPU the step's wall time
    page = (tmp_path / "host_cost.md").read_text()
    assert "Dry run on the CPU" in page
    rows = [line for line in page.splitlines() if line.startswith("| tiny N=2 @ 256 KiB |")]
    assert [row.split(" | ")[1] for row in rows] == ["pytorch", "kept", "mixed", "recording-first"]
    assert f"{kept['kept']}/0/0" in rows[1]
    assert "plan changed" not in page
    assert page in capsys.readouterr().out


def sample(host_ms: float, device_ms: float) -> dict:
    return {"fwd_ms": host_ms / 2, "bwd_ms": host_ms / 2, "opt_ms": 0.0, "host_ms": host_ms,
            "fwd_cpu_ms": host_ms / 2, "bwd_cpu_ms": host_ms / 2, "fwd_thread_ms": host_ms / 2,
            "bwd_thread_ms": 0.0, "device_ms": device_ms,
            "wait_ms": max(0.0, device_ms - host_ms), "index": 1, "state": "planned"}


def test_the_table_says_which_step_is_host_bound():
    case = {"model": "resnet152", "batch": 128, "mixed_budget": 8 << 30, "status": "ok",
            "device": "H100", "torch": "2.11",
            "samples": {"pytorch": [sample(40, 150), sample(42, 152), sample(41, 151)],
                        "kept": [sample(60, 151)] * 3,
                        "mixed": [sample(190, 180), sample(200, 185), sample(150, 182)]},
            "mixed_plan": {"kept": 100, "offloaded": 50, "recomputed": 0, "groups": 150,
                           "fell_back": False}}
    rows = {row["config"]: row for row in host_cost.rows_of(case)}
    assert rows["pytorch"]["hidden"] and rows["kept"]["hidden"]
    assert rows["mixed"]["hidden"] is False and rows["mixed"]["hidden_steps"] == 1
    assert rows["mixed"]["host_ms"] == {"median": 190, "min": 150, "max": 200, "n": 3}
    assert rows["mixed"]["device_vs_pytorch"] == pytest.approx(182 / 151)
    args = argparse.Namespace(device="cuda", argv=["--cases", "resnet152:128@8GiB"])
    page = host_cost.markdown([case], args)
    mixed = next(line for line in page.splitlines() if "| mixed |" in line)
    assert "**no: host-bound**" in mixed and "1/3" in mixed
    assert "100/50/0 (not mixed)" in mixed   # a plan that recomputes nothing is said so
    assert "Dry run" not in page


def test_a_bad_case_is_one_line(capsys):
    with pytest.raises(SystemExit) as exit_info:
        host_cost.main(["--cases", "resnet152@8GiB"])
    assert exit_info.value.code == 2
    assert "expected MODEL:BATCH@BUDGET" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        host_cost.main(["--cases", "resnet152:128@8G"])
    assert "ambiguous" in capsys.readouterr().err


def test_a_dry_run_of_the_armed_configurations_times_sessions_whose_rescue_is_armed(tmp_path):
    host_cost.main(["--device", "cpu", "--cases", "tiny:2@256KiB", "--rounds", "1", "--steps",
                    "1", "--settle-steps", "2", "--max-warmup-steps", "20", "--configs",
                    "pytorch", "kept", "kept-armed", "--out", str(tmp_path)])
    [case] = json.loads((tmp_path / "host_cost.json").read_text())["cases"]
    assert case["status"] == "ok", case["reason"]
    samples = case["samples"]
    assert len(samples["kept-armed"]) == 1 and len(samples["kept"]) == 1
    assert case["kept-armed_plan"]["kept"] == case["kept_plan"]["kept"] > 0
    assert "mixed" not in samples and "mixed-armed" not in samples
