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


def test_package_dirs_is_the_one_wheel_search(tmp_path, monkeypatch):
    """shimlib's header search and cudnn.library's library search both look in package_dirs."""
    from mucudnn import environment, shimlib
    from mucudnn.cudnn import library
    wheel = tmp_path / "nvidia"
    (wheel / "cudnn" / "lib").mkdir(parents=True)
    (wheel / "cudnn" / "lib" / library.SONAME).write_bytes(b"")
    (wheel / "cudnn" / "include").mkdir()
    monkeypatch.setattr(environment.importlib.util, "find_spec",
                        lambda name: type("Spec", (), {"submodule_search_locations": [str(wheel)]})()
                        if name == "nvidia" else None)
    assert shimlib._nvidia_wheel_dirs("cudnn", "include") == [wheel / "cudnn" / "include"]
    assert ("nvidia-cudnn wheel", wheel / "cudnn" / "lib" / library.SONAME) in library.candidates()
