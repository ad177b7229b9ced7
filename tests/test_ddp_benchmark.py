"""benchmarks/ddp.py (issue 15's 2-GPU stage): the driver's commands and results without a GPU,
and the DDP worker on two CPU processes (gloo) where torch is installed."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import ddp

ROOT = Path(__file__).resolve().parents[1]


def test_a_dry_run_names_every_command_and_writes_both_parts(tmp_path, capsys):
    assert ddp.main(["driver", "--gpus", "2", "--dry-run", "--rounds", "2", "--out", str(tmp_path),
                     "--bench-args=--api legacy"]) == 0
    logged = capsys.readouterr().out
    assert "--nproc-per-node=2" in logged and "mucudnn record -o" in logged
    bench = json.loads((tmp_path / "ddp-bench-2.json").read_text())
    assert bench["runs"]["1"]["command"].endswith("--gpus 0 --no-progress --store "
                                                  f"{tmp_path / 'bench-1gpu.sqlite'} --api legacy")
    assert "--gpus all" in bench["runs"]["2"]["command"]
    steps = json.loads((tmp_path / "ddp-steps-2.json").read_text())
    names = [r["name"] for r in steps["rounds"]]
    assert names[:4] == ["pytorch-1gpu-round0", "shim-1gpu-round0", "pytorch-2gpu-round0",
                         "shim-2gpu-round0"] and len(names) == 8
    shim = next(r for r in steps["rounds"] if r["name"] == "shim-2gpu-round1")
    assert " run --plan " in shim["command"] and "--nproc-per-node=2" in shim["command"]


def test_the_gpu_run_stage_runs_the_driver_on_n_gpus(tmp_path):
    script = (ROOT / "benchmarks" / "gpu_run.sh").read_text()
    assert "ddp-*)" in script and "python3 -m benchmarks.ddp driver --gpus \"$n\"" in script


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")
def test_two_cpu_ranks_train_with_identical_gradients(tmp_path):
    out = tmp_path / "tiny.json"
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         "-m", "benchmarks.ddp", "worker", "--model", "tiny", "--batch", "4", "--steps", "2",
         "--warmup", "1", "--device", "cpu", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert [r["rank"] for r in result["ranks"]] == [0, 1] and not result["errors"]
    assert result["identical_gradients"] and result["step_ms"] > 0
    # each rank had its own data: its own gradients differ, DDP's averaged ones do not
    assert len({r["local_grad_sha256"] for r in result["ranks"]}) == 2
    assert len({r["grad_sha256"] for r in result["ranks"]}) == 1
