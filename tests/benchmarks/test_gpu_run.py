"""benchmarks/gpu_run.sh, its python3 faked: what a call leaves under $OUT."""

from __future__ import annotations

import os
import subprocess
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_two_calls_with_one_out_keep_both_calls_logs(tmp_path):
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "python3").write_text("#!/bin/sh\necho \"$*\"\n")
    (fake / "python3").chmod(0o755)
    out = tmp_path / "out"
    env = dict(os.environ, PATH=f"{fake}:{os.environ['PATH']}", OUT=str(out))
    for stage in ("build-shim", "export"):
        subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_run.sh"), stage], cwd=tmp_path,
                       env=env, capture_output=True, timeout=60, check=True)
    with tarfile.open(out / "logs.tgz") as archive:
        names = set(archive.getnames())
    assert {"logs/build-shim.log", "logs/export.log"} <= names
    assert not (out / "logs").exists()   # folded into the archive, as after one call
