"""mucudnn.environment: CPU-only tuning needs neither the benchmarker nor CuPy."""

from __future__ import annotations

import subprocess
import sys


def test_tuning_imports_neither_the_benchmarker_nor_cupy():
    probe = ("import sys, mucudnn, mucudnn.tuner, mucudnn.cli, mucudnn.environment; "
             "print(sorted(m for m in ('mucudnn.bench', 'cupy') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def test_bench_keeps_the_names_it_had():
    from mucudnn import bench, environment
    assert bench.Environment is environment.Environment
    assert bench.gpu_available is environment.gpu_available
