"""benchmarks/workspace_limit.py: each setting's environment, the runs it makes, and its lines."""

import json
import os

import pytest

from benchmarks import workspace_limit


@pytest.mark.parametrize("setting, limit, slack, headroom", [
    ("none", None, "0", None),         # the fastest point (where `run --offload` would give 5)
    ("256MiB", "256MiB", "0", None),
    ("slack=5", None, "5", None),
    ("slack=5,headroom=7", None, "5", "7"),
])
def test_a_setting_is_a_limit_or_a_slack_never_both(monkeypatch, setting, limit, slack, headroom):
    monkeypatch.setenv("MUCUDNN_WORKSPACE_LIMIT", "1GiB")  # a previous setting's (and restored after)
    monkeypatch.setenv("MUCUDNN_WORKSPACE_SLACK", "7")
    monkeypatch.setenv("MUCUDNN_OFFLOAD_HEADROOM", "3")
    workspace_limit.apply_setting(setting)
    assert os.environ.get("MUCUDNN_WORKSPACE_LIMIT") == limit
    assert os.environ.get("MUCUDNN_WORKSPACE_SLACK") == slack
    assert os.environ.get("MUCUDNN_OFFLOAD_HEADROOM") == headroom


class FakeRunner:
    """Runner's interface: each run's setting as the worker would see it, and a fake outcome."""

    made: list = []

    def __init__(self, args, budget, out):
        self.tuned, self.out, self.calls, self.profiled = set(), out, [], []
        FakeRunner.made.append(self)

    def first_use(self, model, batch, dtype, cudnn_benchmark):
        return {"status": "ok", "wall_s": 1.0}

    def run(self, what, model, batch, *, shim, dtype, cudnn_benchmark, cap_gib=0.0, steps,
            warmup, offload=False, profile_steps=0):
        env = (os.environ.get("MUCUDNN_WORKSPACE_LIMIT"), os.environ.get("MUCUDNN_WORKSPACE_SLACK"))
        self.calls.append((what, shim, offload, cap_gib, env))
        self.profiled.append(profile_steps)
        outcome = {"status": "ok", "step_ms": 100.0 if not shim else 110.0, "peak_bytes": 2**30,
                   "alloc_retries": 2}
        if offload:
            profile = self.out / "logs" / f"{model}-offload-{cap_gib:g}GiB-profile.json"
            profile.parent.mkdir(parents=True, exist_ok=True)
            profile.write_text("{}")
            log = profile.parent / f"{model}-{batch}-fp32-offload-{cap_gib:g}GiB.log"
            log.write_text(what)
            outcome["offload_log"] = str(log.relative_to(self.out))
            outcome["offload_profile"] = str(profile.relative_to(self.out))
        return outcome


def test_the_study_runs_each_setting_and_keeps_each_offload_profile(tmp_path, monkeypatch, capsys):
    for name in workspace_limit.SETTING_ENV:
        monkeypatch.setenv(name, "x")   # recorded, so restored after the test
        monkeypatch.delenv(name)
    monkeypatch.setattr(workspace_limit, "Runner", FakeRunner)
    monkeypatch.setattr(FakeRunner, "made", [])
    workspace_limit.main(["--models", "unet3d", "--caps", "unet3d=7.0", "--limits", "none",
                          "slack=5", "--profile", "2", "--out", str(tmp_path)])
    calls = FakeRunner.made[0].calls
    # profiled: PyTorch uncapped, the reference, and each capped run, not the shim uncapped
    assert FakeRunner.made[0].profiled == [2, 0, 2, 0, 2]
    assert [(c[1], c[2], c[3], c[4]) for c in calls] == [
        (False, False, 0.0, (None, None)),                 # PyTorch, before any setting
        (True, False, 0.0, (None, "0")), (True, True, 7.0, (None, "0")),
        (True, False, 0.0, (None, "5")), (True, True, 7.0, (None, "5"))]
    assert "MUCUDNN_WORKSPACE_SLACK" not in os.environ       # the study leaves none behind
    result = json.loads((tmp_path / "workspace-limit.json").read_text())
    profiles = [row["offload"]["7"]["offload_profile"] for row in result["models"]["unet3d"]["rows"]]
    assert profiles == ["logs/unet3d-offload-7GiB-profile-limit-none.json",
                        "logs/unet3d-offload-7GiB-profile-limit-slack=5.json"]
    assert all((tmp_path / p).exists() for p in profiles)
    logs = sorted(p.name for p in (tmp_path / "logs").glob("*.log"))
    assert logs == ["unet3d-2-fp32-offload-7GiB-limit-none.log",
                    "unet3d-2-fp32-offload-7GiB-limit-slack=5.log"]
    assert result["settings"]["shim_mode"] == "online" and result["settings"]["probe_steps"] == 3
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("unet3d limit")]
    assert lines[1] == ("unet3d limit slack=5: uncapped 110.0 ms (1.100x), 2 flushes, peak 1.00 GiB "
                        "(PyTorch 100.0 ms, peak 1.00 GiB); offload 7 GiB: 110.0 ms (1.100x), 2 flushes")
