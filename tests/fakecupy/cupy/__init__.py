"""A stand-in for CuPy on host memory, so that the benchmarker runs against the cuDNN test double
(tests/shim/fake_cudnn, which computes on host memory) without a GPU.

Only what mucudnn.bench and mucudnn.timing use: arrays are numpy arrays whose ``.data.ptr`` is
their address; the stream is the null one; events read the host clock, which times the double's
work since it computes synchronously. Put ``tests/fakecupy`` first on ``PYTHONPATH`` to use it.

The devices are ``$FAKE_CUPY_GPUS`` (comma-separated model names; default one "host stand-in"),
of which ``$CUDA_VISIBLE_DEVICES``, where set, keeps those it numbers, as CUDA does; all of them
compute on the host.
"""

from __future__ import annotations

import os
import time
import types

import numpy


class ndarray(numpy.ndarray):
    @property
    def data(self):  # CuPy's MemoryPointer: only .ptr is used
        return types.SimpleNamespace(ptr=self.ctypes.data)


def _host(array) -> ndarray:
    return numpy.ascontiguousarray(array).view(ndarray)


def empty(shape, dtype="float32") -> ndarray:
    return _host(numpy.empty(shape, dtype=dtype))


class _Generator:
    def __init__(self, seed=None) -> None:
        self._rng = numpy.random.default_rng(seed)

    def standard_normal(self, size, dtype="float32") -> ndarray:
        return _host(self._rng.standard_normal(size, dtype=dtype))


class _Stream:
    ptr = 0  # the null stream

    def __enter__(self):
        return self

    def __exit__(self, *exc_info) -> bool:
        return False

    def synchronize(self) -> None:
        pass


class _Event:
    def record(self, stream=None) -> None:
        self.t = time.perf_counter()

    def synchronize(self) -> None:
        pass


class _Pool:
    def free_all_blocks(self) -> None:
        pass


class OutOfMemoryError(MemoryError):
    pass


def get_default_memory_pool() -> _Pool:
    return _Pool()


def _visible_names() -> list[str]:
    names = os.environ.get("FAKE_CUPY_GPUS", "host stand-in").split(",")
    if "CUDA_VISIBLE_DEVICES" not in os.environ:
        return names
    listed = [e.strip() for e in os.environ["CUDA_VISIBLE_DEVICES"].split(",") if e.strip()]
    return [names[int(e)] for e in listed if e.isdigit() and int(e) < len(names)]


def _device_properties(device: int) -> dict:
    return {"name": _visible_names()[device].encode()}


random = types.SimpleNamespace(default_rng=_Generator)
cuda = types.SimpleNamespace(
    Stream=_Stream, Event=_Event,
    get_elapsed_time=lambda start, end: (end.t - start.t) * 1e3,
    memory=types.SimpleNamespace(OutOfMemoryError=OutOfMemoryError),
    Device=lambda: types.SimpleNamespace(id=0),
    runtime=types.SimpleNamespace(getDeviceCount=lambda: len(_visible_names()),
                                  getDeviceProperties=_device_properties))
