"""mucudnn.environment: CPU-only tuning needs neither the benchmarker nor CuPy; visible_gpus is the
one enumeration of the GPUs here, through CuPy or, without it, the driver."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import types

import pytest

from mucudnn.environment import Gpu


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
    from mucudnn import shimlib, wheels
    from mucudnn.cudnn import library
    wheel = tmp_path / "nvidia"
    (wheel / "cudnn" / "lib").mkdir(parents=True)
    (wheel / "cudnn" / "lib" / library.SONAME).write_bytes(b"")
    (wheel / "cudnn" / "include").mkdir()
    monkeypatch.setattr(wheels.importlib.util, "find_spec",
                        lambda name: type("Spec", (), {"submodule_search_locations": [str(wheel)]})()
                        if name == "nvidia" else None)
    assert shimlib._nvidia_wheel_dirs("cudnn", "include") == [wheel / "cudnn" / "include"]
    assert ("nvidia-cudnn wheel", wheel / "cudnn" / "lib" / library.SONAME) in library.candidates()


# -- visible_gpus: the one enumeration of the GPUs here --------------------------------------------

class FakeDriver:
    """``libcuda.so.1`` as ctypes calls it: ``names`` are its devices; ``memory`` False leaves out
    ``cuDeviceTotalMem_v2`` (as tests/shim's fake driver does)."""

    def __init__(self, names, memory=True):
        self.names = names
        if memory:
            self.cuDeviceTotalMem_v2 = self._total

    def cuInit(self, flags):
        return 0

    def cuDeviceGetCount(self, count):
        count._obj.value = len(self.names)
        return 0

    def cuDeviceGet(self, device, ordinal):
        device._obj.value = ordinal
        return 0 if ordinal < len(self.names) else 101

    def cuDeviceGetName(self, name, length, device):
        name.value = self.names[device.value].encode()[:length - 1]
        return 0

    def _total(self, total, device):
        total._obj.value = (device.value + 1) << 30
        return 0


def fake_cupy(names):
    runtime = types.SimpleNamespace(getDeviceCount=lambda: len(names),
                                    getDeviceProperties=lambda i: {"name": names[i].encode(),
                                                                   "totalGlobalMem": 80 << 30})
    return types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=runtime))


@pytest.fixture
def without_cupy(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # `import cupy` raises ImportError
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "cupy" else FIND_SPEC(name, *a))


FIND_SPEC = importlib.util.find_spec


def test_without_cupy_the_driver_lists_the_gpus_as_cuda_visible_devices_names_them(
        without_cupy, monkeypatch):
    from mucudnn import environment, tuner
    monkeypatch.setattr(environment.ctypes, "CDLL", lambda name: FakeDriver(["A100", "H100"]))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3, 5")
    assert environment.visible_gpus() == [Gpu(0, "3", "A100", 1 << 30),
                                          Gpu(1, "5", "H100", 2 << 30)]
    assert not environment.gpu_available()  # nothing to benchmark with
    assert tuner.gpu_without_cupy() == "A100"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert [gpu.visible_as for gpu in environment.visible_gpus()] == ["0", "1"]


def test_a_driver_that_cannot_say_the_memory_lists_the_gpu_and_no_budget_is_refused(
        without_cupy, monkeypatch):
    from mucudnn import budget, environment
    monkeypatch.setattr(environment.ctypes, "CDLL", lambda name: FakeDriver(["fake"], memory=False))
    assert environment.visible_gpus() == [Gpu(0, "0", "fake", None)]
    assert budget.check_budget(1 << 50) is None


def test_without_a_driver_nothing_tells_and_a_driver_may_list_none(without_cupy, monkeypatch):
    from mucudnn import budget, environment, tuner

    def no_library(name):
        raise OSError(name)

    monkeypatch.setattr(environment.ctypes, "CDLL", no_library)
    assert environment.visible_gpus() is None and tuner.gpu_without_cupy() is None
    assert "(no CUDA driver)" in budget.check_budget(1 << 30)
    monkeypatch.setattr(environment.ctypes, "CDLL", lambda name: FakeDriver([]))
    assert environment.visible_gpus() == [] and tuner.gpu_without_cupy() is None
    assert "(the driver lists none)" in budget.check_budget(1 << 30)


def test_with_cupy_its_view_is_the_one_and_a_gpu_is_available(monkeypatch):
    from mucudnn import environment

    def no_driver(name):  # CuPy answers; the driver is not asked
        raise AssertionError("the driver was asked")

    monkeypatch.setitem(sys.modules, "cupy", fake_cupy(["model A", "model B"]))
    monkeypatch.setattr(environment.ctypes, "CDLL", no_driver)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,0")
    assert environment.visible_gpus() == [Gpu(0, "2", "model A", 80 << 30),
                                          Gpu(1, "0", "model B", 80 << 30)]
    assert environment.gpu_available()
