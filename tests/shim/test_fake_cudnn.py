"""Self-test of the cuDNN test double (tests/shim/fake_cudnn) against a numpy float64 reference.

The double is built into a temporary dir and loaded with ctypes. Convolutions run on numpy arrays
(host memory), described to the double through their real strides, so NCHW, NHWC, padded and
N-sliced views all go through the same stride arithmetic the shim will rely on.
"""

from __future__ import annotations

import ctypes
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

import fakebuild
from fakebuild import (DRIVER_NAME, fake_cudnn_or_skip, find_c_compiler, find_cuda_include,
                       find_cudnn_include)

SUCCESS = 0
BAD_PARAM = 2000
NOT_SUPPORTED = 3000
NOT_SUPPORTED_DATA_TYPE = 3003
WORKSPACE_TOO_SMALL = 4003  # INTERNAL_ERROR_HOST_ALLOCATION_FAILED, the old ALLOC_FAILED
EXECUTION_FAILED = 5000

DATA_FLOAT, DATA_DOUBLE, DATA_HALF = 0, 1, 2
FORMAT_NCHW, FORMAT_NHWC = 0, 1
CONVOLUTION, CROSS_CORRELATION = 0, 1
DIRECTIONS = ("fwd", "bwd_data", "bwd_filter")
ALGO_COUNTS = {"fwd": 8, "bwd_data": 6, "bwd_filter": 7}
FFT_ALGOS = {"fwd": {4, 5}, "bwd_data": {2, 3}, "bwd_filter": {2, 6}}
WINOGRAD_ALGOS = {"fwd": {6, 7}, "bwd_data": {4, 5}, "bwd_filter": {4, 5}}
DEFAULT_WS_PER_SAMPLE = 4096
WORKSPACE_PATTERN = 0xFFF8DEAD
API_NAME = {"fwd": "Forward", "bwd_data": "BackwardData", "bwd_filter": "BackwardFilter"}


# ------------------------------------------------------------------------------ numpy reference


def _taps(w_shape):
    return np.ndindex(*w_shape[2:])


def _window(tap, out, stride, dilation):
    """Slices of the padded input that tap reads for every output position."""
    return tuple(slice(t * d, t * d + (o - 1) * s + 1, s)
                 for t, o, s, d in zip(tap, out, stride, dilation))


def output_shape(in_spatial, filter_spatial, pad, stride, dilation):
    return tuple((i + 2 * p - (f - 1) * d - 1) // s + 1
                 for i, f, p, s, d in zip(in_spatial, filter_spatial, pad, stride, dilation))


def _flip(w):
    return w[(slice(None), slice(None)) + (slice(None, None, -1),) * (w.ndim - 2)]


def ref_forward(x, w, pad, stride, dilation, groups, mode):
    x, w = x.astype(np.float64), w.astype(np.float64)
    if mode == CONVOLUTION:
        w = _flip(w)
    n, c = x.shape[:2]
    k = w.shape[0]
    out = output_shape(x.shape[2:], w.shape[2:], pad, stride, dilation)
    padded = np.pad(x, [(0, 0), (0, 0)] + [(p, p) for p in pad])
    y = np.zeros((n, k) + out)
    cg, kg = c // groups, k // groups
    for tap in _taps(w.shape):
        patch = padded[(slice(None), slice(None)) + _window(tap, out, stride, dilation)]
        for g in range(groups):
            y[:, g * kg:(g + 1) * kg] += np.einsum(
                "nc...,kc->nk...", patch[:, g * cg:(g + 1) * cg],
                w[(slice(g * kg, (g + 1) * kg), slice(None)) + tap])
    return y


def ref_backward_data(w, dy, x_spatial, pad, stride, dilation, groups, mode):
    w, dy = w.astype(np.float64), dy.astype(np.float64)
    if mode == CONVOLUTION:
        w = _flip(w)
    n, k = dy.shape[:2]
    c = w.shape[1] * groups
    out = dy.shape[2:]
    padded = np.zeros((n, c) + tuple(i + 2 * p for i, p in zip(x_spatial, pad)))
    cg, kg = c // groups, k // groups
    for tap in _taps(w.shape):
        window = (slice(None), slice(None)) + _window(tap, out, stride, dilation)
        for g in range(groups):
            padded[window][:, g * cg:(g + 1) * cg] += np.einsum(
                "nk...,kc->nc...", dy[:, g * kg:(g + 1) * kg],
                w[(slice(g * kg, (g + 1) * kg), slice(None)) + tap])
    crop = tuple(slice(p, p + i) for p, i in zip(pad, x_spatial))
    return padded[(slice(None), slice(None)) + crop]


def ref_backward_filter(x, dy, filter_spatial, pad, stride, dilation, groups, mode):
    x, dy = x.astype(np.float64), dy.astype(np.float64)
    c, k = x.shape[1], dy.shape[1]
    out = dy.shape[2:]
    padded = np.pad(x, [(0, 0), (0, 0)] + [(p, p) for p in pad])
    dw = np.zeros((k, c // groups) + tuple(filter_spatial))
    cg, kg = c // groups, k // groups
    for tap in np.ndindex(*filter_spatial):
        patch = padded[(slice(None), slice(None)) + _window(tap, out, stride, dilation)]
        for g in range(groups):
            x_group = patch[:, g * cg:(g + 1) * cg].reshape(x.shape[0], cg, -1)
            dy_group = dy[:, g * kg:(g + 1) * kg].reshape(dy.shape[0], kg, -1)
            dw[(slice(g * kg, (g + 1) * kg), slice(None)) + tap] = np.einsum(
                "ncs,nks->kc", x_group, dy_group)
    return _flip(dw) if mode == CONVOLUTION else dw


# ------------------------------------------------------------------------------ ctypes binding


class Perf(ctypes.Structure):
    """cudnnConvolution{Fwd,BwdData,BwdFilter}AlgoPerf_t (the three share one layout)."""

    _fields_ = [("algo", ctypes.c_int), ("status", ctypes.c_int), ("time", ctypes.c_float),
                ("memory", ctypes.c_size_t), ("determinism", ctypes.c_int),
                ("mathType", ctypes.c_int), ("reserved", ctypes.c_int * 3)]


def _ints(values):
    return (ctypes.c_int * len(values))(*values)


def _ptr(array):
    return ctypes.c_void_p(array.ctypes.data)


def _log_fields(line):
    """Function name and key=value fields of one log line."""
    name, *pairs = line.split()
    return name, dict(pair.split("=", 1) for pair in pairs)


@pytest.fixture(scope="session")
def fake_dir(tmp_path_factory) -> Path:
    return fake_cudnn_or_skip(tmp_path_factory.mktemp("fake_cudnn")).parent


@pytest.fixture(scope="session")
def lib(fake_dir):
    return ctypes.CDLL(str(fake_dir / "libcudnn.so.9"))


def log_lines(path, function=None):
    if not path.exists():
        return []
    lines = [_log_fields(line) for line in path.read_text().splitlines()]
    return [fields for name, fields in lines if function is None or name == function]


def _call(lib, name, *args):
    """Calls a cuDNN function by name; every one returns cudnnStatus_t (ctypes' default int)."""
    return getattr(lib, name)(*args)


class Descriptors:
    """Tensor, filter and convolution descriptors for one convolution, destroyed on close()."""

    def __init__(self, lib):
        self.lib = lib
        self.owned = []

    def create(self, kind):
        desc = ctypes.c_void_p()
        assert _call(self.lib, f"cudnnCreate{kind}Descriptor", ctypes.byref(desc)) == SUCCESS
        self.owned.append((kind, desc))
        return desc

    def tensor(self, array, data_type=None):
        desc = self.create("Tensor")
        data_type = data_type if data_type is not None else _data_type(array)
        strides = [s // array.itemsize for s in array.strides]
        status = _call(self.lib, "cudnnSetTensorNdDescriptor", desc, data_type, array.ndim,
                       _ints(array.shape), _ints(strides))
        assert status == SUCCESS, f"cudnnSetTensorNdDescriptor{array.shape} -> {status}"
        return desc

    def filter(self, shape, data_type, filter_format):
        desc = self.create("Filter")
        status = _call(self.lib, "cudnnSetFilterNdDescriptor", desc, data_type, filter_format,
                       len(shape), _ints(shape))
        assert status == SUCCESS, f"cudnnSetFilterNdDescriptor{shape} -> {status}"
        return desc

    def convolution(self, geometry, compute_type, math_type=0):
        desc = self.create("Convolution")
        spatial = len(geometry.pad)
        assert _call(self.lib, "cudnnSetConvolutionNdDescriptor", desc, spatial,
                     _ints(geometry.pad), _ints(geometry.stride), _ints(geometry.dilation),
                     geometry.mode, compute_type) == SUCCESS
        assert _call(self.lib, "cudnnSetConvolutionGroupCount", desc, geometry.groups) == SUCCESS
        assert _call(self.lib, "cudnnSetConvolutionMathType", desc, math_type) == SUCCESS
        return desc

    def close(self):
        for kind, desc in reversed(self.owned):
            assert _call(self.lib, f"cudnnDestroy{kind}Descriptor", desc) == SUCCESS
        self.owned.clear()


def _data_type(array):
    return {np.dtype(np.float32): DATA_FLOAT, np.dtype(np.float64): DATA_DOUBLE}[array.dtype]


# ------------------------------------------------------------------------------ test problems


@dataclass(frozen=True)
class Geometry:
    n: int
    c: int
    k: int
    groups: int
    in_spatial: tuple
    filter_spatial: tuple
    pad: tuple
    stride: tuple
    dilation: tuple
    mode: int

    @property
    def out_spatial(self):
        return output_shape(self.in_spatial, self.filter_spatial, self.pad, self.stride,
                            self.dilation)

    @property
    def filter_shape(self):
        return (self.k, self.c // self.groups) + self.filter_spatial


def random_geometry(rng, spatial_rank):
    """A small valid geometry with groups, padding, stride and dilation drawn at random."""
    while True:
        groups = int(rng.integers(1, 4))
        in_spatial = tuple(int(rng.integers(2 if spatial_rank == 3 else 3, 8))
                           for _ in range(spatial_rank))
        filter_spatial = tuple(int(rng.integers(1, 4)) for _ in range(spatial_rank))
        geometry = Geometry(
            n=int(rng.integers(1, 4)), c=groups * int(rng.integers(1, 4)),
            k=groups * int(rng.integers(1, 4)), groups=groups, in_spatial=in_spatial,
            filter_spatial=filter_spatial,
            pad=tuple(int(rng.integers(0, 3)) for _ in range(spatial_rank)),
            stride=tuple(int(rng.integers(1, 3)) for _ in range(spatial_rank)),
            dilation=tuple(int(rng.integers(1, 3)) for _ in range(spatial_rank)),
            mode=int(rng.choice([CONVOLUTION, CROSS_CORRELATION])))
        if all(o >= 1 for o in geometry.out_spatial):
            return geometry


def place(values, layout, rng):
    """A view with the contents of `values` (N, C, spatial...) in the memory layout named."""
    if layout == "nchw":
        return np.ascontiguousarray(values)
    if layout == "nhwc":
        channels_last = np.ascontiguousarray(np.moveaxis(values, 1, -1))
        return np.moveaxis(channels_last, -1, 1)
    if layout == "padded":  # non-packed: extra elements between rows and at the end
        shape = values.shape[:-1] + (values.shape[-1] + 3,)
        backing = rng.standard_normal(shape).astype(values.dtype)
        view = backing[..., :values.shape[-1]]
        view[...] = values
        return view
    if layout == "nslice":  # samples 1..n of a larger batch, as a micro-batch shim passes them
        shape = (values.shape[0] + 2,) + values.shape[1:]
        backing = rng.standard_normal(shape).astype(values.dtype)
        view = backing[1:1 + values.shape[0]]
        view[...] = values
        return view
    raise ValueError(f"unknown layout {layout!r}")


def filter_array(values, filter_format):
    """(K, C/g, spatial...) values stored in the filter format; returns the logical view."""
    if filter_format == FORMAT_NCHW:
        return np.ascontiguousarray(values)
    return np.moveaxis(np.ascontiguousarray(np.moveaxis(values, 1, -1)), -1, 1)


AUTO = object()  # Problem.run: allocate the workspace the algorithm needs


class Problem:
    """One convolution with its buffers and descriptors, runnable in any direction."""

    def __init__(self, lib, handle, geometry, dtype, layout, filter_format, rng, math_type=3):
        self.lib, self.handle, self.geometry, self.dtype = lib, handle, geometry, dtype
        g = geometry
        self.x = place(rng.standard_normal((g.n, g.c) + g.in_spatial).astype(dtype), layout, rng)
        self.y = place(rng.standard_normal((g.n, g.k) + g.out_spatial).astype(dtype), layout, rng)
        self.w = filter_array(rng.standard_normal(g.filter_shape).astype(dtype), filter_format)
        self.descs = Descriptors(lib)
        data_type = _data_type(self.x)
        self.x_desc = self.descs.tensor(self.x)
        self.y_desc = self.descs.tensor(self.y)
        self.w_desc = self.descs.filter(g.filter_shape, data_type, filter_format)
        self.conv_desc = self.descs.convolution(g, data_type, math_type)

    def close(self):
        self.descs.close()

    def output(self, direction):
        return {"fwd": self.y, "bwd_data": self.x, "bwd_filter": self.w}[direction]

    def reference(self, direction):
        g = self.geometry
        if direction == "fwd":
            return ref_forward(self.x, self.w, g.pad, g.stride, g.dilation, g.groups, g.mode)
        if direction == "bwd_data":
            return ref_backward_data(self.w, self.y, g.in_spatial, g.pad, g.stride, g.dilation,
                                     g.groups, g.mode)
        return ref_backward_filter(self.x, self.y, g.filter_spatial, g.pad, g.stride, g.dilation,
                                   g.groups, g.mode)

    def scale(self, value):
        return (ctypes.c_double if self.dtype == np.float64 else ctypes.c_float)(value)

    def _descriptor_args(self, direction):
        """Descriptors in the order the direction's query functions take them."""
        return {"fwd": (self.x_desc, self.w_desc, self.conv_desc, self.y_desc),
                "bwd_data": (self.w_desc, self.y_desc, self.conv_desc, self.x_desc),
                "bwd_filter": (self.x_desc, self.y_desc, self.conv_desc, self.w_desc)}[direction]

    def workspace_size(self, direction, algo):
        size = ctypes.c_size_t()
        status = _call(self.lib, f"cudnnGetConvolution{API_NAME[direction]}WorkspaceSize",
                       self.handle, *self._descriptor_args(direction), algo, ctypes.byref(size))
        return status, size.value

    def run(self, direction, algo, alpha, beta, workspace=AUTO, workspace_size=None):
        """cudnnConvolution<direction>; by default with exactly the workspace algo needs.

        `workspace` None passes a NULL workspace of `workspace_size` bytes.
        """
        if workspace is AUTO:
            status, needed = self.workspace_size(direction, algo)
            workspace = np.zeros(max(needed, 1), np.uint8) if status == SUCCESS else None
            workspace_size = needed if status == SUCCESS else 0
        ws = (_ptr(workspace) if workspace is not None else None, ctypes.c_size_t(workspace_size))
        alpha_ref, beta_ref = ctypes.byref(self.scale(alpha)), ctypes.byref(self.scale(beta))
        x, w, y = _ptr(self.x), _ptr(self.w), _ptr(self.y)
        args = {
            "fwd": (self.x_desc, x, self.w_desc, w, self.conv_desc, algo, *ws, beta_ref,
                    self.y_desc, y),
            "bwd_data": (self.w_desc, w, self.y_desc, y, self.conv_desc, algo, *ws, beta_ref,
                         self.x_desc, x),
            "bwd_filter": (self.x_desc, x, self.y_desc, y, self.conv_desc, algo, *ws, beta_ref,
                           self.w_desc, w),
        }[direction]
        return _call(self.lib, f"cudnnConvolution{API_NAME[direction]}", self.handle, alpha_ref,
                     *args)

    def query(self, direction, kind, requested, workspace=None):
        """Get_v7 ("get"), Find ("find") or FindEx ("find_ex"): (status, [Perf])."""
        results = (Perf * max(requested, 1))()
        returned = ctypes.c_int(-1)
        descs = self._descriptor_args(direction)
        if kind == "find_ex":
            buffers = {"fwd": (self.x, self.w, self.y), "bwd_data": (self.w, self.y, self.x),
                       "bwd_filter": (self.x, self.y, self.w)}[direction]
            interleaved = (descs[0], _ptr(buffers[0]), descs[1], _ptr(buffers[1]), descs[2],
                           descs[3], _ptr(buffers[2]))
            ws_ptr = _ptr(workspace) if workspace is not None else None
            ws_size = ctypes.c_size_t(workspace.nbytes if workspace is not None else 0)
            status = _call(self.lib, f"cudnnFindConvolution{API_NAME[direction]}AlgorithmEx",
                           self.handle, *interleaved, requested, ctypes.byref(returned), results,
                           ws_ptr, ws_size)
        else:
            name = (f"cudnnGetConvolution{API_NAME[direction]}Algorithm_v7" if kind == "get"
                    else f"cudnnFindConvolution{API_NAME[direction]}Algorithm")
            status = _call(self.lib, name, self.handle, *descs, requested, ctypes.byref(returned),
                           results)
        return status, list(results[:max(returned.value, 0)])


@pytest.fixture
def make_problem(lib, handle):
    problems = []

    def make(geometry, dtype=np.float32, layout="nchw", filter_format=FORMAT_NCHW, seed=0,
             math_type=3):
        problem = Problem(lib, handle, geometry, dtype, layout, filter_format,
                          np.random.default_rng(seed), math_type)
        problems.append(problem)
        return problem

    yield make
    for problem in problems:
        problem.close()


def tolerance(dtype):
    return {"rtol": 1e-5, "atol": 1e-5} if dtype == np.float32 else {"rtol": 1e-12, "atol": 1e-12}


SIMPLE = Geometry(n=2, c=3, k=4, groups=1, in_spatial=(6, 5), filter_spatial=(3, 3), pad=(1, 1),
                  stride=(1, 1), dilation=(1, 1), mode=CROSS_CORRELATION)
STRIDED = Geometry(n=3, c=4, k=2, groups=2, in_spatial=(7, 7), filter_spatial=(3, 3), pad=(1, 0),
                   stride=(2, 2), dilation=(1, 1), mode=CROSS_CORRELATION)


# ------------------------------------------------------------------------------ the tests


@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("case", range(10))
def test_random_convolutions_match_numpy(make_problem, direction, case):
    rng = np.random.default_rng(1000 + case)
    geometry = random_geometry(rng, spatial_rank=3 if case % 3 == 2 else 2)
    dtype = np.float64 if case % 2 else np.float32
    layout = ("nchw", "nhwc", "padded", "nslice")[case % 4]
    filter_format = FORMAT_NHWC if layout == "nhwc" else FORMAT_NCHW
    problem = make_problem(geometry, dtype, layout, filter_format, seed=case)
    alpha = float(rng.uniform(0.5, 2.0))
    beta = 0.0 if case % 3 == 0 else float(rng.uniform(-1.0, 1.0))
    output = problem.output(direction)
    prior = output.astype(np.float64)
    if beta == 0.0:
        output[...] = np.nan  # beta == 0: the output must not be read
    expected = alpha * problem.reference(direction) + (beta * prior if beta else 0.0)

    assert problem.run(direction, algo=0, alpha=alpha, beta=beta) == SUCCESS
    np.testing.assert_allclose(output, expected, **tolerance(dtype),
                               err_msg=f"{direction} {geometry} {layout}")


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_every_supported_algorithm_computes_the_reference(make_problem, direction):
    problem = make_problem(SIMPLE, np.float64, seed=7)
    expected = problem.reference(direction)
    supported = [algo for algo in range(ALGO_COUNTS[direction])
                 if problem.workspace_size(direction, algo)[0] == SUCCESS]
    assert 0 in supported and len(supported) >= 2
    for algo in supported:
        problem.output(direction)[...] = 0.0
        assert problem.run(direction, algo, alpha=1.0, beta=0.0) == SUCCESS
        np.testing.assert_allclose(problem.output(direction), expected, rtol=1e-12, atol=1e-12,
                                   err_msg=f"{direction} algo {algo}")


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_workspace_model_and_unsupported_algorithms(make_problem, direction, monkeypatch):
    problem = make_problem(STRIDED, seed=3)  # stride 2 and 2 groups: no FFT, no Winograd
    for algo in range(ALGO_COUNTS[direction]):
        status, size = problem.workspace_size(direction, algo)
        if algo in FFT_ALGOS[direction] | WINOGRAD_ALGOS[direction]:
            assert status == NOT_SUPPORTED, f"{direction} algo {algo}"
            assert problem.run(direction, algo, 1.0, 0.0, np.zeros(1 << 16, np.uint8),
                               1 << 16) == NOT_SUPPORTED
        else:
            assert (status, size) == (SUCCESS, algo * STRIDED.n * DEFAULT_WS_PER_SAMPLE)
    monkeypatch.setenv("FAKE_CUDNN_WS_PER_SAMPLE", "100")
    assert problem.workspace_size(direction, 3 if direction != "bwd_data" else 1) == (
        SUCCESS, (3 if direction != "bwd_data" else 1) * STRIDED.n * 100)


def test_winograd_and_fft_are_supported_for_3x3_unit_stride(make_problem):
    problem = make_problem(SIMPLE)
    for direction in DIRECTIONS:
        for algo in FFT_ALGOS[direction] | WINOGRAD_ALGOS[direction]:
            assert problem.workspace_size(direction, algo)[0] == SUCCESS, (direction, algo)


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_execution_checks_the_workspace(make_problem, direction):
    problem = make_problem(SIMPLE, seed=5)
    algo = 1
    needed = algo * SIMPLE.n * DEFAULT_WS_PER_SAMPLE
    output = problem.output(direction)
    before = output.copy()
    workspace = np.zeros(needed + 64, np.uint8)

    assert problem.run(direction, algo, 1.0, 0.0, workspace, needed - 1) == BAD_PARAM
    assert problem.run(direction, algo, 1.0, 0.0, None, needed) == BAD_PARAM  # NULL but needed
    np.testing.assert_array_equal(output, before)  # failed calls leave the output alone
    assert not workspace.any()

    assert problem.run(direction, algo, 1.0, 0.0, workspace, needed) == SUCCESS
    words = workspace[:needed].view(np.uint32)
    assert (words == WORKSPACE_PATTERN).all()
    assert np.isnan(workspace[:needed].view(np.float32)).all()
    assert np.isnan(workspace[:needed].view(np.float64)).all()
    assert not workspace[needed:].any()  # only the needed bytes are touched
    assert problem.run(direction, 0, 1.0, 0.0, None, 0) == SUCCESS  # algo 0 needs none


def test_workspace_overlapping_an_input_corrupts_the_result(make_problem, monkeypatch):
    monkeypatch.setenv("FAKE_CUDNN_WS_PER_SAMPLE", "64")  # algo 1 needs 128 bytes, inside x
    problem = make_problem(SIMPLE, seed=9)
    expected = problem.reference("fwd")
    x_bytes = problem.x.view(np.uint8).reshape(-1)  # x is contiguous: its bytes as workspace
    assert problem.run("fwd", 1, 1.0, 0.0, x_bytes, x_bytes.nbytes) == SUCCESS
    assert not np.allclose(problem.y, expected, equal_nan=False)


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_shape_errors_are_bad_param(lib, handle, make_problem, direction):
    problem = make_problem(SIMPLE)
    descs = Descriptors(lib)
    try:
        wrong_y = np.zeros((SIMPLE.n, SIMPLE.k, 6, 4), np.float32)  # width should be 5
        problem.y_desc = descs.tensor(wrong_y)
        assert problem.run(direction, 0, 1.0, 0.0) == BAD_PARAM
        problem.y_desc = descs.tensor(problem.y.astype(np.float64))  # data type differs
        assert problem.run(direction, 0, 1.0, 0.0) == BAD_PARAM
        problem.y_desc = descs.tensor(problem.y)
        problem.w_desc = descs.filter((SIMPLE.k, SIMPLE.c + 1, 3, 3), DATA_FLOAT, FORMAT_NCHW)
        assert problem.run(direction, 0, 1.0, 0.0) == BAD_PARAM  # channel count differs
        assert problem.run(direction, ALGO_COUNTS[direction], 1.0, 0.0) == BAD_PARAM
    finally:
        descs.close()


def test_groups_must_divide_channels(lib, make_problem):
    problem = make_problem(SIMPLE)
    assert _call(lib, "cudnnSetConvolutionGroupCount", problem.conv_desc, 2) == SUCCESS
    assert problem.run("fwd", 0, 1.0, 0.0) == BAD_PARAM  # c = 3 is not 2 * (c per group = 3)


def test_half_data_is_described_but_not_computed(lib, handle, make_problem):
    problem = make_problem(SIMPLE)
    descs = Descriptors(lib)
    try:
        half_x = descs.tensor(problem.x, DATA_HALF)
        half_y = descs.tensor(problem.y, DATA_HALF)
        half_w = descs.filter(SIMPLE.filter_shape, DATA_HALF, FORMAT_NCHW)
        problem.x_desc, problem.y_desc, problem.w_desc = half_x, half_y, half_w
        status, results = problem.query("fwd", "get", 8)
        assert status == SUCCESS and len(results) == 8
        assert problem.run("fwd", 0, 1.0, 0.0) == NOT_SUPPORTED_DATA_TYPE
    finally:
        descs.close()


def test_injected_execution_failure(make_problem, monkeypatch):
    problem = make_problem(SIMPLE)
    monkeypatch.setenv("FAKE_CUDNN_FAIL_N", str(SIMPLE.n))
    assert problem.run("fwd", 0, 1.0, 0.0) == EXECUTION_FAILED
    monkeypatch.setenv("FAKE_CUDNN_FAIL_N", str(SIMPLE.n + 1))
    assert problem.run("fwd", 0, 1.0, 0.0) == SUCCESS


@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("kind", ["get", "find"])
def test_queries_report_every_algorithm_sorted(make_problem, direction, kind):
    problem = make_problem(STRIDED, math_type=1)
    count = ALGO_COUNTS[direction]
    status, results = problem.query(direction, kind, 100)
    assert status == SUCCESS
    assert sorted(r.algo for r in results) == list(range(count))
    ok = [r for r in results if r.status == SUCCESS]
    assert results[:len(ok)] == ok  # successes first
    assert [r.time for r in ok] == sorted(r.time for r in ok)
    assert all(r.mathType == 1 for r in results)  # the descriptor's math type
    for r in ok:
        assert r.memory == r.algo * STRIDED.n * DEFAULT_WS_PER_SAMPLE
    unsupported = {r.algo for r in results if r.status == NOT_SUPPORTED}
    assert unsupported == FFT_ALGOS[direction] | WINOGRAD_ALGOS[direction]

    status, top = problem.query(direction, kind, 3)
    assert status == SUCCESS and [r.algo for r in top] == [r.algo for r in results[:3]]
    assert problem.query(direction, kind, 0)[0] == BAD_PARAM


def test_larger_workspace_algorithms_are_faster(make_problem):
    _, results = make_problem(SIMPLE).query("fwd", "get", 8)
    ok = [r for r in results if r.status == SUCCESS]
    assert [r.algo for r in ok] == sorted((r.algo for r in ok), reverse=True)


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_find_ex_runs_what_fits_and_reports_the_rest(make_problem, direction):
    problem = make_problem(SIMPLE, np.float64, seed=11)
    expected = problem.reference(direction)
    problem.output(direction)[...] = np.nan  # FindEx overwrites it with the result
    fits = 2 * SIMPLE.n * DEFAULT_WS_PER_SAMPLE  # algorithms 0..2 fit
    workspace = np.zeros(fits, np.uint8)
    status, results = problem.query(direction, "find_ex", 100, workspace)
    assert status == SUCCESS and len(results) == ALGO_COUNTS[direction]
    by_algo = {r.algo: r for r in results}
    for algo in range(ALGO_COUNTS[direction]):
        memory = algo * SIMPLE.n * DEFAULT_WS_PER_SAMPLE
        assert by_algo[algo].memory == memory
        assert by_algo[algo].status == (SUCCESS if memory <= fits else WORKSPACE_TOO_SMALL)
    np.testing.assert_allclose(problem.output(direction), expected, rtol=1e-12, atol=1e-12)
    assert (workspace.view(np.uint32) == WORKSPACE_PATTERN).all()


def test_execution_log_lines(make_problem, log_path):
    problem = make_problem(STRIDED, math_type=3)
    workspace = np.zeros(8 * STRIDED.n * DEFAULT_WS_PER_SAMPLE, np.uint8)
    assert problem.run("fwd", 1, 1.5, 0.25, workspace, workspace.nbytes) == SUCCESS
    assert problem.run("bwd_data", 0, 1.0, 0.0, workspace, 0) == SUCCESS
    assert problem.run("bwd_filter", 3, 2.0, 1.0, workspace, workspace.nbytes) == SUCCESS

    (fwd,) = log_lines(log_path, "cudnnConvolutionForward")
    assert fwd["n"] == str(STRIDED.n) and fwd["algo"] == "1" and fwd["math"] == "fma"
    assert int(fwd["ws"]) == workspace.nbytes
    assert int(fwd["need"]) == STRIDED.n * DEFAULT_WS_PER_SAMPLE
    assert (float(fwd["alpha"]), float(fwd["beta"])) == (1.5, 0.25)
    assert int(fwd["x"], 16) == problem.x.ctypes.data
    assert int(fwd["w"], 16) == problem.w.ctypes.data
    assert int(fwd["y"], 16) == problem.y.ctypes.data
    assert int(fwd["workspace"], 16) == workspace.ctypes.data
    assert fwd["xdims"] == "x".join(map(str, problem.x.shape))
    assert fwd["ystrides"] == "x".join(str(s // 4) for s in problem.y.strides)
    assert fwd["status"] == "0"

    (bwd_data,) = log_lines(log_path, "cudnnConvolutionBackwardData")
    assert int(bwd_data["dx"], 16) == problem.x.ctypes.data
    assert int(bwd_data["dy"], 16) == problem.y.ctypes.data
    assert bwd_data["ws"] == "0" and bwd_data["algo"] == "0"
    (bwd_filter,) = log_lines(log_path, "cudnnConvolutionBackwardFilter")
    assert int(bwd_filter["dw"], 16) == problem.w.ctypes.data
    assert (bwd_filter["algo"], bwd_filter["alpha"], bwd_filter["beta"]) == ("3", "2", "1")


def test_failed_calls_are_logged_with_their_status(make_problem, log_path):
    problem = make_problem(SIMPLE)
    assert problem.run("fwd", 2, 0.5, 0.75, np.zeros(8, np.uint8), 8) == BAD_PARAM
    (line,) = log_lines(log_path, "cudnnConvolutionForward")
    assert line["status"] == str(BAD_PARAM) and line["ws"] == "8"
    assert line["need"] == str(2 * SIMPLE.n * DEFAULT_WS_PER_SAMPLE)
    assert (line["alpha"], line["beta"]) == ("0.5", "0.75")


def test_unset_descriptors_are_bad_param(lib, make_problem):
    problem = make_problem(SIMPLE)
    descs = Descriptors(lib)
    try:
        problem.conv_desc = descs.create("Convolution")  # created, never set
        assert problem.run("fwd", 0, 1.0, 0.0) == BAD_PARAM
        assert problem.query("fwd", "get", 8)[0] == BAD_PARAM
    finally:
        descs.close()


def test_query_log_lines(make_problem, log_path):
    problem = make_problem(SIMPLE)
    status, results = problem.query("bwd_filter", "get", 4)
    assert status == SUCCESS
    (line,) = log_lines(log_path, "cudnnGetConvolutionBackwardFilterAlgorithm_v7")
    assert (line["requested"], line["returned"], line["n"]) == ("4", "4", str(SIMPLE.n))
    assert line["results"] == ",".join(f"{r.algo}:{r.status}:{r.memory}" for r in results)

    workspace = np.zeros(SIMPLE.n * DEFAULT_WS_PER_SAMPLE, np.uint8)
    problem.query("fwd", "find_ex", 8, workspace)
    (find_ex,) = log_lines(log_path, "cudnnFindConvolutionForwardAlgorithmEx")
    assert find_ex["returned"] == "8" and int(find_ex["ws"]) == workspace.nbytes
    assert int(find_ex["y"], 16) == problem.y.ctypes.data
    assert log_lines(log_path, "cudnnConvolutionForward") == []  # FindEx's runs are not logged

    problem.workspace_size("fwd", 1)
    (size_line,) = log_lines(log_path, "cudnnGetConvolutionForwardWorkspaceSize")
    assert size_line["size"] == str(SIMPLE.n * DEFAULT_WS_PER_SAMPLE)


def test_log_is_whole_lines_under_concurrency(lib, make_problem, log_path):
    problems = [make_problem(SIMPLE, seed=s) for s in range(4)]
    calls_per_thread = 25

    def work(problem):
        for _ in range(calls_per_thread):
            assert problem.run("fwd", 1, 1.0, 0.0) == SUCCESS

    threads = [threading.Thread(target=work, args=(p,)) for p in problems]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    lines = log_lines(log_path, "cudnnConvolutionForward")
    assert len(lines) == len(problems) * calls_per_thread
    assert all(line["status"] == "0" and line["n"] == str(SIMPLE.n) for line in lines)
    expected = problems[0].reference("fwd")
    np.testing.assert_allclose(problems[0].y, expected, **tolerance(np.float32))


def test_tensor_descriptor_round_trip(lib):
    descs = Descriptors(lib)
    try:
        desc = descs.create("Tensor")
        assert _call(lib, "cudnnSetTensor4dDescriptor", desc, FORMAT_NHWC, DATA_FLOAT,
                     2, 3, 4, 5) == SUCCESS
        dims, strides = (ctypes.c_int * 8)(), (ctypes.c_int * 8)()
        data_type, rank = ctypes.c_int(), ctypes.c_int()
        assert _call(lib, "cudnnGetTensorNdDescriptor", desc, 8, ctypes.byref(data_type),
                     ctypes.byref(rank), dims, strides) == SUCCESS
        assert (data_type.value, rank.value) == (DATA_FLOAT, 4)
        assert list(dims[:4]) == [2, 3, 4, 5] and list(strides[:4]) == [60, 1, 15, 3]

        assert _call(lib, "cudnnSetTensor4dDescriptorEx", desc, DATA_DOUBLE, 1, 2, 3, 4,
                     100, 12, 4, 1) == SUCCESS
        out = [ctypes.c_int() for _ in range(9)]
        assert _call(lib, "cudnnGetTensor4dDescriptor", desc, *map(ctypes.byref, out)) == SUCCESS
        assert [o.value for o in out] == [DATA_DOUBLE, 1, 2, 3, 4, 100, 12, 4, 1]
        size = ctypes.c_size_t()
        assert _call(lib, "cudnnGetTensorSizeInBytes", desc, ctypes.byref(size)) == SUCCESS
        assert size.value == (1 * 12 + 2 * 4 + 3 * 1 + 1) * 8

        assert _call(lib, "cudnnSetTensorNdDescriptorEx", desc, FORMAT_NCHW, DATA_FLOAT, 5,
                     _ints([1, 2, 3, 4, 5])) == SUCCESS
        assert _call(lib, "cudnnGetTensorNdDescriptor", desc, 8, ctypes.byref(data_type),
                     ctypes.byref(rank), dims, strides) == SUCCESS
        assert rank.value == 5 and list(strides[:5]) == [120, 60, 20, 5, 1]
        assert _call(lib, "cudnnSetTensorNdDescriptor", desc, DATA_FLOAT, 4,
                     _ints([1, 0, 3, 3]), _ints([9, 9, 3, 1])) == BAD_PARAM
    finally:
        descs.close()


def test_filter_and_convolution_descriptor_round_trip(lib):
    descs = Descriptors(lib)
    try:
        filt = descs.filter((8, 4, 3, 2), DATA_FLOAT, FORMAT_NHWC)
        out = [ctypes.c_int() for _ in range(6)]
        assert _call(lib, "cudnnGetFilter4dDescriptor", filt, *map(ctypes.byref, out)) == SUCCESS
        assert [o.value for o in out] == [DATA_FLOAT, FORMAT_NHWC, 8, 4, 3, 2]

        conv = descs.create("Convolution")
        assert _call(lib, "cudnnSetConvolution2dDescriptor", conv, 1, 2, 3, 1, 2, 1,
                     CONVOLUTION, DATA_FLOAT) == SUCCESS
        got = [ctypes.c_int() for _ in range(8)]
        assert _call(lib, "cudnnGetConvolution2dDescriptor", conv,
                     *map(ctypes.byref, got)) == SUCCESS
        assert [g.value for g in got] == [1, 2, 3, 1, 2, 1, CONVOLUTION, DATA_FLOAT]
        groups, math = ctypes.c_int(), ctypes.c_int()
        assert _call(lib, "cudnnGetConvolutionGroupCount", conv, ctypes.byref(groups)) == SUCCESS
        assert _call(lib, "cudnnGetConvolutionMathType", conv, ctypes.byref(math)) == SUCCESS
        assert (groups.value, math.value) == (1, 0)  # cuDNN's defaults

        x = descs.tensor(np.zeros((2, 4, 10, 9), np.float32))
        n, c, h, w = (ctypes.c_int() for _ in range(4))
        assert _call(lib, "cudnnGetConvolution2dForwardOutputDim", conv, x, filt,
                     *map(ctypes.byref, (n, c, h, w))) == SUCCESS
        expected_hw = output_shape((10, 9), (3, 2), (1, 2), (3, 1), (2, 1))
        assert (n.value, c.value, (h.value, w.value)) == (2, 8, expected_hw)
        dims = (ctypes.c_int * 4)()
        assert _call(lib, "cudnnGetConvolutionNdForwardOutputDim", conv, x, filt, 4,
                     dims) == SUCCESS
        assert list(dims) == [2, 8, *expected_hw]
    finally:
        descs.close()


def test_version_and_error_strings(lib, monkeypatch):
    lib.cudnnGetVersion.restype = ctypes.c_size_t
    lib.cudnnGetErrorString.restype = ctypes.c_char_p
    assert lib.cudnnGetVersion() == 91900
    monkeypatch.setenv("FAKE_CUDNN_VERSION", "90100")
    assert lib.cudnnGetVersion() == 90100
    assert lib.cudnnGetErrorString(BAD_PARAM) == b"CUDNN_STATUS_BAD_PARAM"


def test_max_counts_and_stream(lib, handle):
    for direction, count in ALGO_COUNTS.items():
        got = ctypes.c_int()
        name = f"cudnnGetConvolution{API_NAME[direction]}AlgorithmMaxCount"
        assert _call(lib, name, handle, ctypes.byref(got)) == SUCCESS and got.value == count
    stream = ctypes.c_void_p(0x1234)
    assert _call(lib, "cudnnSetStream", handle, stream) == SUCCESS
    back = ctypes.c_void_p()
    assert _call(lib, "cudnnGetStream", handle, ctypes.byref(back)) == SUCCESS
    assert back.value == 0x1234


def test_fake_cuda_driver_names_the_gpu(fake_dir, monkeypatch):
    driver = ctypes.CDLL(str(fake_dir / DRIVER_NAME))
    device, count = ctypes.c_int(-1), ctypes.c_int()
    assert driver.cuInit(0) == 0
    assert driver.cuDeviceGetCount(ctypes.byref(count)) == 0 and count.value == 1
    assert driver.cuCtxGetDevice(ctypes.byref(device)) == 0 and device.value == 0
    name = ctypes.create_string_buffer(64)
    assert driver.cuDeviceGetName(name, 64, device) == 0
    assert name.value == b"mucudnn fake GPU"
    monkeypatch.setenv("FAKE_CUDNN_GPU_NAME", "NVIDIA H200")
    assert driver.cuDeviceGetName(name, 64, device) == 0 and name.value == b"NVIDIA H200"
    assert driver.cuDeviceGetName(name, 5, device) == 0 and name.value == b"NVID"
    assert driver.cuDeviceGet(ctypes.byref(device), 1) != 0


LINK_TEST_PROGRAM = r"""
#include <cudnn.h>
#include <stdio.h>

/* 1x1x3x3 input of ones, 1x1x2x2 filter of ones, no padding: every output is 4. */
int main(void)
{
    cudnnHandle_t handle;
    cudnnTensorDescriptor_t x_desc, y_desc;
    cudnnFilterDescriptor_t w_desc;
    cudnnConvolutionDescriptor_t conv;
    float x[9], w[4], y[4] = {0}, alpha = 1.0f, beta = 0.0f;
    for (int i = 0; i < 9; ++i) x[i] = 1.0f;
    for (int i = 0; i < 4; ++i) w[i] = 1.0f;
    int failed = cudnnCreate(&handle) || cudnnCreateTensorDescriptor(&x_desc) ||
        cudnnCreateTensorDescriptor(&y_desc) || cudnnCreateFilterDescriptor(&w_desc) ||
        cudnnCreateConvolutionDescriptor(&conv) ||
        cudnnSetTensor4dDescriptor(x_desc, CUDNN_TENSOR_NCHW, CUDNN_DATA_FLOAT, 1, 1, 3, 3) ||
        cudnnSetTensor4dDescriptor(y_desc, CUDNN_TENSOR_NCHW, CUDNN_DATA_FLOAT, 1, 1, 2, 2) ||
        cudnnSetFilter4dDescriptor(w_desc, CUDNN_DATA_FLOAT, CUDNN_TENSOR_NCHW, 1, 1, 2, 2) ||
        cudnnSetConvolution2dDescriptor(conv, 0, 0, 1, 1, 1, 1, CUDNN_CROSS_CORRELATION,
                                        CUDNN_DATA_FLOAT) ||
        cudnnConvolutionForward(handle, &alpha, x_desc, x, w_desc, w, conv,
                                CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_GEMM, NULL, 0, &beta,
                                y_desc, y);
    printf("version=%zu failed=%d y=%g,%g,%g,%g\n", cudnnGetVersion(), failed, y[0], y[1], y[2],
           y[3]);
    return failed;
}
"""


def test_a_program_linked_with_lcudnn_runs_on_the_double(fake_dir, tmp_path):
    source = tmp_path / "link_test.c"
    source.write_text(LINK_TEST_PROGRAM)
    program = tmp_path / "link_test"
    subprocess.run([find_c_compiler(), "-std=c11", f"-I{find_cudnn_include()}",
                    f"-I{find_cuda_include()}", str(source), "-o", str(program),
                    f"-L{fake_dir}", "-lcudnn"], check=True, capture_output=True, text=True)
    result = subprocess.run([str(program)], capture_output=True, text=True, check=False,
                            env={"LD_LIBRARY_PATH": str(fake_dir), "FAKE_CUDNN_VERSION": "91234"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "version=91234 failed=0 y=4,4,4,4"


def test_missing_headers_make_the_build_unavailable_not_failed(tmp_path, monkeypatch):
    monkeypatch.setattr(fakebuild, "find_cudnn_include", lambda: None)  # no cudnn.h anywhere
    assert "cudnn.h" in fakebuild.missing_prerequisite()
    with pytest.raises(fakebuild.FakeCudnnUnavailable, match="cudnn.h"):
        fakebuild.build_fake_cudnn(tmp_path / "out")
    assert not (tmp_path / "out").exists()
