"""Self-test of the cuDNN double's graph (backend) API (tests/shim/fake_cudnn/fake_backend.c).

Two ways in:

* ``graph_driver`` (built by the shim harness, run without the shim unless said) runs the call
  sequences of cudnn-frontend / PyTorch and compares each result with the same convolution through
  the double's legacy functions, which test_fake_cudnn.py checks against numpy;
* ctypes calls on numpy arrays, checked against the numpy float64 reference directly, for strided
  views, the fused ReLU, error statuses, queries and log lines.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from fakebuild import fake_cudnn_or_skip
from shim_harness import parse_fields
from test_fake_cudnn import (CONVOLUTION, CROSS_CORRELATION, DATA_DOUBLE, DATA_FLOAT,
                             DATA_HALF, FORMAT_NCHW, FORMAT_NHWC, Geometry, filter_array, place,
                             random_geometry, ref_backward_data, ref_backward_filter, ref_forward,
                             tolerance)

SUCCESS, BAD_PARAM, NOT_SUPPORTED, NOT_SUPPORTED_DATA_TYPE = 0, 2000, 3000, 3003
EXECUTION_FAILED = 5000
WS_PER_SAMPLE = 4096
WORKSPACE_PATTERN = 0xFFF8DEAD

# cudnnBackendDescriptorType_t
POINTWISE, CONVOLUTION_DESC, ENGINE, ENGINECFG, ENGINEHEUR, PLAN = 0, 1, 2, 3, 4, 5
KNOB_CHOICE, OP_FWD, OP_BWD_FILTER, OP_BWD_DATA, OP_POINTWISE = 7, 10, 11, 12, 13
GRAPH, VARIANT_PACK, TENSOR, MATMUL = 15, 16, 17, 18
# cudnnBackendAttributeType_t
T_HANDLE, T_DATA_TYPE, T_BOOLEAN, T_INT64, T_FLOAT, T_DOUBLE, T_VOID_PTR = 0, 1, 2, 3, 4, 5, 6
T_CONV_MODE, T_HEUR_MODE, T_KNOB_TYPE, T_NUMERICAL_NOTE, T_POINTWISE_MODE = 7, 8, 9, 11, 14
T_DESCRIPTOR, T_BEHAVIOR_NOTE = 15, 19
# cudnnBackendAttributeName_t
A_PW_MODE, A_PW_MATH_PREC, A_PW_RELU_UPPER_CLIP, A_PW_RELU_LOWER_CLIP_SLOPE = 0, 1, 4, 5
A_CONV_COMP_TYPE, A_CONV_MODE, A_CONV_DILATIONS, A_CONV_STRIDES = 100, 101, 102, 103
A_CONV_POST_PADDINGS, A_CONV_PRE_PADDINGS, A_CONV_SPATIAL_DIMS = 104, 105, 106
A_HEUR_MODE, A_HEUR_GRAPH, A_HEUR_RESULTS = 200, 201, 202
A_CFG_ENGINE, A_CFG_KNOB_CHOICES, A_CFG_WORKSPACE_SIZE = 300, 302, 303
A_PLAN_HANDLE, A_PLAN_ENGINE_CONFIG, A_PLAN_WORKSPACE_SIZE = 400, 401, 402
A_KNOB_TYPE, A_KNOB_VALUE = 600, 601
A_PWOP_PW, A_PWOP_X, A_PWOP_Y, A_PWOP_ALPHA1 = 750, 751, 753, 754
A_GRAPH_HANDLE, A_GRAPH_OPS, A_GRAPH_GLOBAL_COUNT = 800, 801, 802
A_TENSOR_ALIGNMENT, A_TENSOR_DATA_TYPE, A_TENSOR_DIMS, A_TENSOR_STRIDES = 900, 901, 902, 903
A_TENSOR_UID, A_TENSOR_IS_VIRTUAL = 906, 907
A_PACK_UIDS, A_PACK_POINTERS, A_PACK_WORKSPACE = 1000, 1001, 1003
A_ENGINE_GRAPH, A_ENGINE_INDEX = 1300, 1301
A_ENGINE_NUMERICAL_NOTE, A_ENGINE_BEHAVIOR_NOTE = 1303, 1305
RELU_FWD, HEUR_MODE_INSTANT, NUMERICAL_NOTE_TENSOR_CORE = 100, 0, 0

# Per direction: the operation type and its X, W, Y, CONV_DESC, ALPHA, BETA attributes (in
# forward roles: X is dx for bwd_data, W is dw for bwd_filter, Y is dy for both).
CONV_OPS = {
    "fwd": (OP_FWD, 704, 703, 705, 702, 700, 701),
    "bwd_data": (OP_BWD_DATA, 710, 709, 711, 708, 706, 707),
    "bwd_filter": (OP_BWD_FILTER, 716, 715, 717, 714, 712, 713),
}
DIRECTIONS = tuple(CONV_OPS)

_CTYPES = {T_HANDLE: ctypes.c_void_p, T_BOOLEAN: ctypes.c_bool, T_INT64: ctypes.c_int64,
           T_FLOAT: ctypes.c_float, T_DOUBLE: ctypes.c_double, T_VOID_PTR: ctypes.c_void_p,
           T_DESCRIPTOR: ctypes.c_void_p}  # every other type is an enum: int


def ctype_of(attribute_type):
    return _CTYPES.get(attribute_type, ctypes.c_int)


# ============================================================================ through graph_driver


def run_cases(shim_env, cases, **kwargs):
    run = shim_env.run_graph(cases, preload=kwargs.pop("preload", False), **kwargs)
    assert run.returncode == 0, run.stderr
    assert len(run.cases) == len(cases), run.stderr
    return run


def assert_exact(result, engine=3, n=None):
    assert (result["status"], result["ref_status"], result["exact"]) == ("0", "0", "1"), result
    assert (result["guard"], result["finalize"], result["engine"]) == ("ok", "0", str(engine))
    if n is not None:
        assert int(result["ws"]) == engine * n * WS_PER_SAMPLE


def cases_for(direction, dtype):
    """nchw and nhwc, 2-D and 3-D, groups (also depthwise), stride, dilation, alpha and beta."""
    head = f"op=exec dir={direction} dt={dtype}"
    return [
        f"{head} layout=nchw n=3 c=4 in=7x6 k=6 f=3x3 pad=1x1 g=2",
        f"{head} layout=nhwc n=2 c=3 in=6x5 k=4 f=3x2 pad=1x0 stride=2x1 dil=1x2 alpha=0.5 "
        "beta=-1.5",
        f"{head} layout=nchw n=2 c=6 in=4x5x6 k=3 f=3x1x2 pad=1x0x1 stride=1x2x1 g=3 beta=0.5",
        f"{head} layout=nhwc n=3 c=2 in=3x4x5 k=4 f=2x2x2 pad=0x1x1 dil=2x1x1 alpha=2 beta=1 "
        "seed=9",
        f"{head} layout=nhwc n=1 c=4 in=5x5 k=4 f=3x3 pad=1x1 g=4 beta=2 seed=3",
    ]


@pytest.mark.parametrize("dtype", ["f32", "f64"])
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_graph_convolutions_match_the_legacy_path(shim_env, direction, dtype):
    cases = cases_for(direction, dtype)
    run = run_cases(shim_env, cases)
    for case, result in zip(cases, run.cases):
        assert_exact(result, n=int(parse_fields(case)["n"]))
    executions = run.graph_executions()
    assert [(e["dir"], e["fused"], e["engine"]) for e in executions] == [(direction, "0", "3")] * 5
    assert [e["n"] for e in executions] == [parse_fields(c)["n"] for c in cases]


@pytest.mark.parametrize("dtype", ["f32", "f64"])
def test_fused_convolution_relu_matches_the_legacy_path_plus_relu(shim_env, dtype):
    head = f"op=exec dt={dtype} fuse=1"
    cases = [f"{head} layout=nchw n=3 c=4 in=7x6 k=6 f=3x3 pad=1x1 g=2",
             f"{head} layout=nhwc n=2 c=3 in=4x5x6 k=4 f=3x2x1 stride=1x2x1 beta=0.5 repeat=2",
             f"{head} layout=nhwc n=2 c=2 in=6x6 k=3 f=3x3 engine=0 alpha=-1"]
    run = run_cases(shim_env, cases)
    for result, engine, n in zip(run.cases, (3, 3, 0), (3, 2, 2)):
        assert_exact(result, engine=engine, n=n)
    executions = run.graph_executions()
    assert [(e["dir"], e["fused"]) for e in executions] == [("fwd", "1")] * 4
    # y is the ReLU's output, laid out as the case's y (nhwc: C innermost)
    assert (executions[1]["ydims"], executions[1]["ystrides"]) == ("2x4x2x2x6", "96x1x48x24x4")


def test_heuristics_list_engines_3_2_1_0_with_their_workspace(shim_env):
    cases = ["op=heur n=4 c=2 in=6x6 k=3 f=3x3", "op=heur dir=bwd_filter n=2 c=2 in=5x5 k=2 fuse=0",
             "op=heur n=5 c=1 in=4x4 k=1 fuse=1"]
    run = run_cases(shim_env, cases)
    assert [r["results"] for r in run.cases] == [
        ",".join(f"{e}:0:{e * n * WS_PER_SAMPLE}" for e in (3, 2, 1, 0)) for n in (4, 2, 5)]
    assert {r["status"] for r in run.cases} == {"0"}
    # cudnn-frontend's two calls: the count, then that many configs
    gets = [c for c in run.calls if c["fn"] == "cudnnBackendGetAttribute" and c["attr"] == "202"]
    assert [(g["requested"], g["count"]) for g in gets[:2]] == [("0", "4"), ("4", "4")]

    run = run_cases(shim_env, cases[:1], env={"FAKE_CUDNN_WS_PER_SAMPLE": "10"})
    assert run.cases[0]["results"] == "3:0:120,2:0:80,1:0:40,0:0:0"


def test_heuristics_skip_an_engine_that_does_not_plan(shim_env):
    cases = ["op=heur n=4 c=2 in=6x6 k=3 f=3x3", "op=exec n=4 c=2 in=6x6 k=3 f=3x3",
             "op=exec n=4 c=2 in=6x6 k=3 f=3x3 engine=3"]
    run = run_cases(shim_env, cases, env={"FAKE_CUDNN_ENGINE_UNSUPPORTED": "3"})
    heur, chosen, forced = run.cases
    assert heur["results"] == "3:3000:49152,2:0:32768,1:0:16384,0:0:0"
    assert_exact(chosen, engine=2, n=4)
    assert [forced[k] for k in ("finalize", "status", "engine", "ws")] == ["3000", "-1", "-1", "-1"]
    assert forced["exact"] == "0"  # never executed, so its output differs from the reference


def test_engine_by_index_with_knob_choices(shim_env):
    cases = [f"op=exec dir=bwd_data n=3 c=2 in=5x5 k=2 f=3x3 engine={e} knobs=2.4,17.{e}"
             for e in range(4)] + ["op=exec n=3 c=2 in=5x5 k=2 engine=4 knobs=1.1"]
    run = run_cases(shim_env, cases)
    for engine, result in enumerate(run.cases[:4]):
        assert_exact(result, engine=engine, n=3)
    assert (run.cases[4]["finalize"], run.cases[4]["status"]) == (str(NOT_SUPPORTED), "-1")

    knob_sets = [c for c in run.calls
                 if c["fn"] == "cudnnBackendSetAttribute" and c["attr"] == str(A_CFG_KNOB_CHOICES)]
    assert [k["knobs"] for k in knob_sets] == [f"2.4,17.{e}" for e in range(4)]
    plans = [c for c in run.calls if c["fn"] == "cudnnBackendFinalize" and c["type"] == str(PLAN)]
    assert [(p["engine"], p["n"], p["ws"], p["knobs"]) for p in plans] == [
        (str(e), "3", str(e * 3 * WS_PER_SAMPLE), f"2.4,17.{e}") for e in range(4)]
    assert [(e["engine"], e["knobs"]) for e in run.graph_executions()] == [
        (str(e), "2") for e in range(4)]


def test_injected_failure_applies_to_graph_executions(shim_env):
    cases = ["op=exec n=3 c=2 in=5x5 k=2 f=3x3", "op=exec n=2 c=2 in=5x5 k=2 f=3x3 dir=bwd_filter"]
    run = run_cases(shim_env, cases, env={"FAKE_CUDNN_FAIL_N": "3"})
    assert (run.cases[0]["status"], run.cases[0]["ref_status"]) == (str(EXECUTION_FAILED),) * 2
    assert_exact(run.cases[1], n=2)


def test_execute_log_line(shim_env):
    run = run_cases(shim_env, ["op=exec dir=bwd_data layout=nhwc n=2 c=3 in=5x4 k=4 f=3x3 pad=1x1 "
                               "alpha=0.5 beta=0.25 engine=1 knobs=3.1"])
    (line,) = run.graph_executions()
    assert {k: line[k] for k in ("dir", "fused", "engine", "n", "knobs", "need", "alpha", "beta",
                                 "xdims", "xstrides", "ydims", "ystrides", "status")} == {
        "dir": "bwd_data", "fused": "0", "engine": "1", "n": "2", "knobs": "1",
        "need": str(2 * WS_PER_SAMPLE), "alpha": "0.5", "beta": "0.25", "xdims": "2x3x5x4",
        "xstrides": "60x1x12x3", "ydims": "2x4x5x4", "ystrides": "80x1x16x4", "status": "0"}
    pointers = [line[k] for k in ("x", "w", "y", "workspace", "handle")]
    assert len(set(pointers)) == 5 and "0x0" not in pointers


def test_repeated_executions_reuse_the_plan(shim_env):
    run = run_cases(shim_env, ["op=exec dir=bwd_filter n=2 c=2 in=5x5 k=3 f=3x3 beta=0.5 repeat=3"])
    assert_exact(run.cases[0], n=2)
    assert len(run.graph_executions()) == 3
    assert len({e["workspace"] for e in run.graph_executions()}) == 1
    finalized = [c["type"] for c in run.calls if c["fn"] == "cudnnBackendFinalize"]
    assert (finalized.count(str(PLAN)), finalized.count(str(VARIANT_PACK))) == (1, 3)


def test_the_driver_destroys_every_descriptor(shim_env):
    cases = cases_for("fwd", "f32")[:2] + ["op=heur n=2 fuse=1 in=4x4",
                                           "op=exec n=2 in=4x4 engine=2 knobs=1.2,3.4"]
    run = run_cases(shim_env, cases)
    created = [c["desc"] for c in run.calls if c["fn"] == "cudnnBackendCreateDescriptor"]
    destroyed = [c["desc"] for c in run.calls if c["fn"] == "cudnnBackendDestroyDescriptor"]
    assert sorted(created) == sorted(destroyed) and created


def test_threads_each_with_their_own_handle(shim_env):
    cases = [c for d in DIRECTIONS for c in cases_for(d, "f32")] * 2
    run = run_cases(shim_env, cases, threads=4)
    for case, result in zip(cases, run.cases):
        assert_exact(result, n=int(parse_fields(case)["n"]))
    assert len({e["handle"] for e in run.graph_executions()}) > 1


def test_graph_calls_pass_through_the_preloaded_shim(shim_env):
    cases = cases_for("fwd", "f32")[:2] + ["op=exec fuse=1 n=2 c=2 in=5x5 k=2 f=3x3"]
    run = run_cases(shim_env, cases, preload=True)
    assert [(r["status"], r["exact"]) for r in run.cases] == [("0", "1")] * 3, run.stderr


# ============================================================================ through ctypes


@pytest.fixture(scope="session")
def lib(tmp_path_factory):
    library = ctypes.CDLL(str(fake_cudnn_or_skip(tmp_path_factory.mktemp("fake_backend"))))
    c_void_p, c_int, c_int64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    library.cudnnBackendCreateDescriptor.argtypes = [c_int, ctypes.POINTER(c_void_p)]
    library.cudnnBackendDestroyDescriptor.argtypes = [c_void_p]
    library.cudnnBackendFinalize.argtypes = [c_void_p]
    library.cudnnBackendSetAttribute.argtypes = [c_void_p, c_int, c_int, c_int64, c_void_p]
    library.cudnnBackendGetAttribute.argtypes = [c_void_p, c_int, c_int, c_int64,
                                                 ctypes.POINTER(c_int64), c_void_p]
    library.cudnnBackendExecute.argtypes = [c_void_p, c_void_p, c_void_p]
    return library


def log_calls(path, function):
    lines = path.read_text().splitlines() if path.exists() else []
    return [fields for fields in map(parse_fields, lines) if fields["fn"] == function]


class Backend:
    """cudnnBackend* through ctypes; builders assert success. Created descriptors die on close()."""

    def __init__(self, lib):
        self.lib = lib
        self.owned = []

    # -- raw calls: statuses are returned, not asserted

    def create(self, kind):
        desc = ctypes.c_void_p()
        status = self.lib.cudnnBackendCreateDescriptor(kind, ctypes.byref(desc))
        if status == SUCCESS:
            self.owned.append(desc)
        return status, desc

    def set(self, desc, attr, attribute_type, values, count=None):
        values = values if isinstance(values, (list, tuple)) else [values]
        array = (ctype_of(attribute_type) * max(len(values), 1))(
            *[v.value if isinstance(v, ctypes.c_void_p) else v for v in values])
        return self.lib.cudnnBackendSetAttribute(desc, attr, attribute_type,
                                                 len(values) if count is None else count, array)

    def get(self, desc, attr, attribute_type, requested=1, null_array=False):
        """(status, count, values)."""
        array = (ctype_of(attribute_type) * max(requested, 1))()
        count = ctypes.c_int64(-1)
        status = self.lib.cudnnBackendGetAttribute(desc, attr, attribute_type, requested,
                                                   ctypes.byref(count),
                                                   None if null_array else array)
        return status, count.value, list(array[:max(min(count.value, requested), 0)])

    def get_descs(self, desc, attr, targets):
        """Fills the caller-created `targets`; (status, count)."""
        array = (ctypes.c_void_p * max(len(targets), 1))(*[t.value for t in targets])
        count = ctypes.c_int64(-1)
        status = self.lib.cudnnBackendGetAttribute(desc, attr, T_DESCRIPTOR, len(targets),
                                                   ctypes.byref(count), array)
        return status, count.value

    def finalize(self, desc):
        return self.lib.cudnnBackendFinalize(desc)

    def destroy(self, desc):
        self.owned = [d for d in self.owned if d.value != desc.value]
        return self.lib.cudnnBackendDestroyDescriptor(desc)

    def close(self):
        for desc in reversed(self.owned):
            assert self.lib.cudnnBackendDestroyDescriptor(desc) == SUCCESS
        self.owned.clear()

    # -- builders

    def new(self, kind):
        status, desc = self.create(kind)
        assert status == SUCCESS
        return desc

    def build(self, kind, attributes, finalize=True):
        """A descriptor with `attributes` [(attr, type, values)], finalized unless told not to."""
        desc = self.new(kind)
        for attr, attribute_type, values in attributes:
            assert self.set(desc, attr, attribute_type, values) == SUCCESS, (kind, attr)
        if finalize:
            assert self.finalize(desc) == SUCCESS, kind
        return desc

    def tensor(self, uid, shape, strides, data_type=DATA_FLOAT, virtual=False, finalize=True):
        attributes = [(A_TENSOR_DATA_TYPE, T_DATA_TYPE, data_type),
                      (A_TENSOR_DIMS, T_INT64, list(shape)),
                      (A_TENSOR_STRIDES, T_INT64, list(strides)),
                      (A_TENSOR_UID, T_INT64, uid), (A_TENSOR_ALIGNMENT, T_INT64, 16)]
        if virtual:
            attributes.append((A_TENSOR_IS_VIRTUAL, T_BOOLEAN, True))
        return self.build(TENSOR, attributes, finalize)

    def array_tensor(self, uid, array, virtual=False):
        data_type = DATA_DOUBLE if array.dtype == np.float64 else DATA_FLOAT
        return self.tensor(uid, array.shape, [s // array.itemsize for s in array.strides],
                           data_type, virtual)

    def convolution(self, pad, stride=None, dilation=None, mode=CROSS_CORRELATION,
                    compute=DATA_FLOAT, post_pad=None, finalize=True):
        spatial = len(pad)
        return self.build(CONVOLUTION_DESC, [
            (A_CONV_COMP_TYPE, T_DATA_TYPE, compute), (A_CONV_MODE, T_CONV_MODE, mode),
            (A_CONV_SPATIAL_DIMS, T_INT64, spatial),
            (A_CONV_DILATIONS, T_INT64, list(dilation or [1] * spatial)),
            (A_CONV_STRIDES, T_INT64, list(stride or [1] * spatial)),
            (A_CONV_PRE_PADDINGS, T_INT64, list(pad)),
            (A_CONV_POST_PADDINGS, T_INT64, list(post_pad or pad))], finalize)

    def conv_op(self, direction, x, w, y, conv, alpha=None, beta=None, scale_type=T_FLOAT,
                finalize=True):
        kind, a_x, a_w, a_y, a_conv, a_alpha, a_beta = CONV_OPS[direction]
        attributes = [(a_x, T_DESCRIPTOR, x), (a_w, T_DESCRIPTOR, w), (a_y, T_DESCRIPTOR, y),
                      (a_conv, T_DESCRIPTOR, conv)]
        attributes += [(a, scale_type, v) for a, v in ((a_alpha, alpha), (a_beta, beta))
                       if v is not None]
        return self.build(kind, attributes, finalize)

    def relu_op(self, x, y, upper=None, alpha1=None, finalize=True):
        pointwise = [(A_PW_MODE, T_POINTWISE_MODE, RELU_FWD),
                     (A_PW_MATH_PREC, T_DATA_TYPE, DATA_FLOAT)]
        if upper is not None:
            pointwise.append((A_PW_RELU_UPPER_CLIP, T_DOUBLE, upper))
        attributes = [(A_PWOP_PW, T_DESCRIPTOR, self.build(POINTWISE, pointwise)),
                      (A_PWOP_X, T_DESCRIPTOR, x), (A_PWOP_Y, T_DESCRIPTOR, y)]
        if alpha1 is not None:
            attributes.append((A_PWOP_ALPHA1, T_FLOAT, alpha1))
        return self.build(OP_POINTWISE, attributes, finalize)

    def graph(self, ops, finalize=True):
        return self.build(GRAPH, [(A_GRAPH_OPS, T_DESCRIPTOR, list(ops))], finalize)

    def engine(self, graph, index, finalize=True):
        return self.build(ENGINE, [(A_ENGINE_GRAPH, T_DESCRIPTOR, graph),
                                   (A_ENGINE_INDEX, T_INT64, index)], finalize)

    def config(self, graph, index, knobs=()):
        choices = [self.build(KNOB_CHOICE, [(A_KNOB_TYPE, T_KNOB_TYPE, t),
                                            (A_KNOB_VALUE, T_INT64, v)]) for t, v in knobs]
        attributes = [(A_CFG_ENGINE, T_DESCRIPTOR, self.engine(graph, index))]
        if choices:
            attributes.append((A_CFG_KNOB_CHOICES, T_DESCRIPTOR, choices))
        return self.build(ENGINECFG, attributes)

    def plan(self, handle, config):
        """(finalize status, plan)."""
        plan = self.build(PLAN, [(A_PLAN_HANDLE, T_HANDLE, handle),
                                 (A_PLAN_ENGINE_CONFIG, T_DESCRIPTOR, config)], finalize=False)
        return self.finalize(plan), plan

    def execute(self, handle, plan, tensors, workspace):
        """Executes with a variant pack {uid: array or pointer} and a workspace array or None."""
        pointers = [a.ctypes.data if isinstance(a, np.ndarray) else a for a in tensors.values()]
        workspace_pointer = workspace.ctypes.data if workspace is not None else None
        pack = self.build(VARIANT_PACK, [
            (A_PACK_UIDS, T_INT64, list(tensors)), (A_PACK_POINTERS, T_VOID_PTR, pointers),
            (A_PACK_WORKSPACE, T_VOID_PTR, workspace_pointer)])
        return self.lib.cudnnBackendExecute(handle, plan, pack)


@pytest.fixture
def be(lib):
    backend = Backend(lib)
    yield backend
    backend.close()


def workspace_for(nbytes, guard=64):
    """A workspace of `nbytes` followed by a guard region, as one array (zeros)."""
    return np.zeros(nbytes + guard, np.uint8)


def pattern_bytes(buffer, nbytes):
    """What the double's workspace pattern makes of the first `nbytes` of `buffer`."""
    addresses = buffer.ctypes.data + np.arange(nbytes)
    return ((WORKSPACE_PATTERN >> (8 * (addresses % 4))) & 0xFF).astype(np.uint8)


class NumpyProblem:
    """One convolution's arrays (forward roles) and its single-op graph planned on `engine`."""

    def __init__(self, be, handle, direction, geometry, dtype, layout, filter_format, rng,
                 engine=3, scale_type=T_FLOAT, alpha=None, beta=None):
        g = geometry
        self.geometry, self.direction = g, direction
        self.x = place(rng.standard_normal((g.n, g.c) + g.in_spatial).astype(dtype), layout, rng)
        self.y = place(rng.standard_normal((g.n, g.k) + g.out_spatial).astype(dtype), layout, rng)
        self.w = filter_array(rng.standard_normal(g.filter_shape).astype(dtype), filter_format)
        conv = be.convolution(g.pad, g.stride, g.dilation, g.mode)
        tensors = [be.array_tensor(uid, a) for uid, a in ((1, self.x), (2, self.w), (3, self.y))]
        op = be.conv_op(direction, *tensors, conv, alpha, beta, scale_type)
        status, self.plan = be.plan(handle, be.config(be.graph([op]), engine))
        assert status == SUCCESS
        self.workspace_size = be.get(self.plan, A_PLAN_WORKSPACE_SIZE, T_INT64)[2][0]

    def output(self):
        return {"fwd": self.y, "bwd_data": self.x, "bwd_filter": self.w}[self.direction]

    def reference(self):
        g = self.geometry
        if self.direction == "fwd":
            return ref_forward(self.x, self.w, g.pad, g.stride, g.dilation, g.groups, g.mode)
        if self.direction == "bwd_data":
            return ref_backward_data(self.w, self.y, g.in_spatial, g.pad, g.stride, g.dilation,
                                     g.groups, g.mode)
        return ref_backward_filter(self.x, self.y, g.filter_spatial, g.pad, g.stride, g.dilation,
                                   g.groups, g.mode)

    def buffers(self):
        return {1: self.x, 2: self.w, 3: self.y}


SIMPLE = Geometry(n=2, c=4, k=4, groups=2, in_spatial=(5, 6), filter_spatial=(3, 3), pad=(1, 1),
                  stride=(1, 1), dilation=(1, 1), mode=CROSS_CORRELATION)


@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("case", range(8))
def test_graph_executions_match_numpy(be, handle, direction, case):
    rng = np.random.default_rng(7000 + case)
    geometry = random_geometry(rng, spatial_rank=3 if case % 3 == 2 else 2)
    dtype = np.float64 if case % 2 else np.float32
    layout = ("nchw", "nhwc", "padded", "nslice")[case % 4]
    filter_format = FORMAT_NHWC if layout == "nhwc" else FORMAT_NCHW
    alpha = float(rng.uniform(0.5, 2.0))
    beta = 0.0 if case % 3 == 0 else float(rng.uniform(-1.0, 1.0))
    problem = NumpyProblem(be, handle, direction, geometry, dtype, layout, filter_format, rng,
                           engine=case % 4, scale_type=(T_FLOAT, T_DOUBLE)[case % 2],
                           alpha=alpha, beta=beta)
    output = problem.output()
    prior = output.astype(np.float64)
    if beta == 0.0:
        output[...] = np.nan  # beta == 0: the output must not be read
    expected = alpha * problem.reference() + (beta * prior if beta else 0.0)
    workspace = workspace_for(problem.workspace_size)
    assert be.execute(handle, problem.plan, problem.buffers(), workspace) == SUCCESS
    np.testing.assert_allclose(output, expected, **tolerance(dtype),
                               err_msg=f"{direction} {geometry} {layout}")
    size = problem.workspace_size
    assert size == (case % 4) * geometry.n * WS_PER_SAMPLE
    np.testing.assert_array_equal(workspace[:size], pattern_bytes(workspace, size))
    assert not workspace[size:].any()  # nothing beyond what the plan asked for


@pytest.mark.parametrize("reverse", [False, True])
def test_fused_graph_matches_numpy_in_either_op_order(be, handle, reverse):
    rng = np.random.default_rng(11)
    g = SIMPLE
    x = rng.standard_normal((g.n, g.c) + g.in_spatial)
    w = filter_array(rng.standard_normal(g.filter_shape), FORMAT_NHWC)
    y = place(np.full((g.n, g.k) + g.out_spatial, np.nan), "nhwc", rng)
    v = be.tensor(4, y.shape, [s // 8 for s in y.strides], DATA_DOUBLE, virtual=True)
    conv_op = be.conv_op("fwd", be.array_tensor(1, x), be.array_tensor(2, w), v,
                         be.convolution(g.pad), alpha=0.5, beta=3.0, scale_type=T_DOUBLE)
    relu_op = be.relu_op(v, be.array_tensor(3, y), upper=4.0, alpha1=2.0)
    graph = be.graph([relu_op, conv_op] if reverse else [conv_op, relu_op])
    status, plan = be.plan(handle, be.config(graph, 1))
    assert status == SUCCESS
    workspace = workspace_for(g.n * WS_PER_SAMPLE)
    assert be.execute(handle, plan, {1: x, 2: w, 3: y}, workspace) == SUCCESS
    conv = 0.5 * ref_forward(x, w, g.pad, g.stride, g.dilation, g.groups, g.mode)  # beta: v is new
    np.testing.assert_allclose(y, np.clip(2.0 * conv, 0.0, 4.0), rtol=1e-12, atol=1e-12)


def test_execution_errors(be, handle, monkeypatch):
    rng = np.random.default_rng(5)
    problem = NumpyProblem(be, handle, "fwd", SIMPLE, np.float32, "nchw", FORMAT_NCHW, rng,
                           engine=2)
    buffers, workspace = problem.buffers(), workspace_for(problem.workspace_size)
    before = problem.y.copy()
    assert be.execute(handle, problem.plan, {1: problem.x, 2: problem.w}, workspace) == BAD_PARAM
    assert be.execute(handle, problem.plan, {**buffers, 3: 0}, workspace) == BAD_PARAM
    assert be.execute(handle, problem.plan, buffers, None) == BAD_PARAM  # ws > 0 needs one
    assert be.execute(None, problem.plan, buffers, workspace) == BAD_PARAM
    assert be.lib.cudnnBackendExecute(handle, problem.plan, problem.plan) == BAD_PARAM
    monkeypatch.setenv("FAKE_CUDNN_FAIL_N", str(SIMPLE.n))
    assert be.execute(handle, problem.plan, buffers, workspace) == EXECUTION_FAILED
    np.testing.assert_array_equal(problem.y, before)  # every failure leaves the output alone
    assert not workspace.any()
    monkeypatch.delenv("FAKE_CUDNN_FAIL_N")

    engine0 = NumpyProblem(be, handle, "bwd_data", SIMPLE, np.float64, "nhwc", FORMAT_NHWC, rng,
                           engine=0)
    assert engine0.workspace_size == 0
    assert be.execute(handle, engine0.plan, engine0.buffers(), None) == SUCCESS


def test_half_data_plans_but_does_not_execute(be, handle):
    x, w, y = [be.tensor(uid, shape, strides, DATA_HALF) for uid, shape, strides in
               ((1, (1, 1, 4, 4), (16, 16, 4, 1)), (2, (1, 1, 1, 1), (1, 1, 1, 1)),
                (3, (1, 1, 4, 4), (16, 16, 4, 1)))]
    graph = be.graph([be.conv_op("fwd", x, w, y, be.convolution([0, 0], compute=DATA_HALF))])
    status, plan = be.plan(handle, be.config(graph, 0))
    assert status == SUCCESS
    buffer = np.zeros(16, np.float16)
    status = be.execute(handle, plan, {1: buffer, 2: buffer, 3: buffer}, None)
    assert status == NOT_SUPPORTED_DATA_TYPE


def simple_tensors(be, n=2, virtual_y=False):
    x = be.tensor(1, (n, 4, 5, 6), (120, 30, 6, 1))
    w = be.tensor(2, (4, 2, 3, 3), (18, 9, 3, 1))
    y = be.tensor(3, (n, 4, 5, 6), (120, 30, 6, 1), virtual=virtual_y)
    return x, w, y


def test_descriptor_rules(be):
    assert be.create(MATMUL)[0] == NOT_SUPPORTED
    assert be.lib.cudnnBackendCreateDescriptor(TENSOR, None) == BAD_PARAM
    assert be.lib.cudnnBackendDestroyDescriptor(None) == SUCCESS
    x, w, y = simple_tensors(be)
    assert be.set(x, A_TENSOR_UID, T_INT64, 9) == BAD_PARAM  # finalized: read-only
    assert be.finalize(x) == BAD_PARAM
    t = be.new(TENSOR)
    assert be.set(t, 12345, T_INT64, 1) == NOT_SUPPORTED  # unknown attribute
    assert be.set(t, A_TENSOR_UID, T_DOUBLE, 1.0) == BAD_PARAM  # wrong type
    assert be.set(t, A_TENSOR_UID, T_INT64, [1, 2]) == BAD_PARAM  # wrong count
    assert be.set(t, A_TENSOR_DIMS, T_INT64, [1, 2, 3]) == BAD_PARAM  # 4 or 5 dims
    assert be.set(t, A_TENSOR_DATA_TYPE, T_DATA_TYPE, 3) == NOT_SUPPORTED_DATA_TYPE  # INT8
    assert be.set(None, A_TENSOR_UID, T_INT64, 1) == BAD_PARAM
    assert be.get(t, A_TENSOR_UID, T_INT64)[0] == BAD_PARAM  # not finalized
    assert be.finalize(t) == BAD_PARAM  # required attributes missing

    op = be.new(OP_FWD)
    assert be.set(op, CONV_OPS["fwd"][1], T_DESCRIPTOR, t) == BAD_PARAM  # unfinalized tensor
    assert be.set(op, CONV_OPS["fwd"][1], T_DESCRIPTOR, be.convolution([1, 1])) == BAD_PARAM
    assert be.set(op, CONV_OPS["bwd_data"][1], T_DESCRIPTOR, x) == NOT_SUPPORTED  # dx: not fwd's
    assert be.finalize(op) == BAD_PARAM  # no tensors
    half = be.tensor(1, (2, 4, 5, 6), (120, 30, 6, 1), DATA_HALF, finalize=False)
    assert be.set(half, A_TENSOR_ALIGNMENT, T_INT64, 3) == SUCCESS
    assert be.finalize(half) == BAD_PARAM  # alignment not a multiple of the element size


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_a_convolution_operation_answers_to_its_own_attribute_names_only(be, direction):
    x, w, y = simple_tensors(be)
    conv = be.convolution([1, 1])
    kind, *names = CONV_OPS[direction]
    op = be.conv_op(direction, x, w, y, conv, alpha=0.5, beta=0.25)
    *tensor_names, conv_name, alpha_name, beta_name = names
    for name in tensor_names:
        assert be.get_descs(op, name, [be.new(TENSOR)]) == (SUCCESS, 1), name
    assert be.get_descs(op, conv_name, [be.new(CONVOLUTION_DESC)]) == (SUCCESS, 1)
    assert be.get(op, alpha_name, T_DOUBLE) == (SUCCESS, 1, [0.5])
    assert be.get(op, beta_name, T_FLOAT) == (SUCCESS, 1, [0.25])
    for other in DIRECTIONS:
        if other != direction:
            for name in CONV_OPS[other][1:]:
                assert be.get(op, name, T_DOUBLE)[0] == NOT_SUPPORTED, (other, name)
                assert be.set(be.new(kind), name, T_DOUBLE, 1.0) == NOT_SUPPORTED, (other, name)


def test_write_only_attributes_refuse_get_and_read_only_ones_refuse_set(be, handle):
    x, w, y = simple_tensors(be)
    graph = be.graph([be.conv_op("fwd", x, w, y, be.convolution([1, 1]))])
    pointwise = be.build(POINTWISE, [(A_PW_MODE, T_POINTWISE_MODE, RELU_FWD)])
    heuristics = be.build(ENGINEHEUR, [(A_HEUR_GRAPH, T_DESCRIPTOR, graph),
                                       (A_HEUR_MODE, T_HEUR_MODE, HEUR_MODE_INSTANT)])
    pack = be.build(VARIANT_PACK, [(A_PACK_UIDS, T_INT64, [1]), (A_PACK_POINTERS, T_VOID_PTR, [64]),
                                   (A_PACK_WORKSPACE, T_VOID_PTR, 64)])
    status, plan = be.plan(handle, be.config(graph, 1))
    assert status == SUCCESS
    write_only = [(pointwise, A_PW_MODE, T_POINTWISE_MODE), (graph, A_GRAPH_HANDLE, T_HANDLE),
                  (be.relu_op(y, be.tensor(4, (2, 4, 5, 6), (120, 30, 6, 1))), A_PWOP_X,
                   T_DESCRIPTOR),
                  (heuristics, A_HEUR_MODE, T_HEUR_MODE), (heuristics, A_HEUR_GRAPH, T_DESCRIPTOR),
                  (pack, A_PACK_UIDS, T_INT64), (pack, A_PACK_WORKSPACE, T_VOID_PTR),
                  (plan, A_PLAN_HANDLE, T_HANDLE)]
    for desc, name, attribute_type in write_only:
        assert be.get(desc, name, attribute_type)[0] == NOT_SUPPORTED, name
    read_only = [(GRAPH, A_GRAPH_GLOBAL_COUNT, T_INT64), (ENGINEHEUR, A_HEUR_RESULTS, T_INT64),
                 (ENGINE, A_ENGINE_NUMERICAL_NOTE, T_NUMERICAL_NOTE),
                 (ENGINE, A_ENGINE_BEHAVIOR_NOTE, T_BEHAVIOR_NOTE),
                 (ENGINECFG, A_CFG_WORKSPACE_SIZE, T_INT64), (PLAN, A_PLAN_WORKSPACE_SIZE, T_INT64)]
    for kind, name, attribute_type in read_only:
        assert be.set(be.new(kind), name, attribute_type, 0) == NOT_SUPPORTED, name


def test_descriptor_attributes_are_copies(be, handle):
    x, w, y = simple_tensors(be)
    conv = be.convolution([1, 1])
    op = be.conv_op("fwd", x, w, y, conv, finalize=False)
    for desc in (x, w, y, conv):
        assert be.destroy(desc) == SUCCESS
    assert be.finalize(op) == SUCCESS
    graph = be.graph([op])
    assert be.destroy(op) == SUCCESS
    assert be.get_descs(graph, A_GRAPH_OPS, []) == (SUCCESS, 1)
    ops, copy = [be.new(OP_FWD)], be.new(TENSOR)
    assert be.get_descs(graph, A_GRAPH_OPS, ops) == (SUCCESS, 1)
    assert be.get_descs(ops[0], CONV_OPS["fwd"][3], [copy]) == (SUCCESS, 1)  # Y
    assert be.get(copy, A_TENSOR_DIMS, T_INT64, 5) == (SUCCESS, 4, [2, 4, 5, 6])
    assert be.get(copy, A_TENSOR_UID, T_INT64) == (SUCCESS, 1, [3])
    assert be.get_descs(ops[0], CONV_OPS["fwd"][3], [be.new(ENGINE)])[0] == BAD_PARAM  # wrong kind
    assert be.plan(handle, be.config(graph, 3))[0] == SUCCESS


def test_attribute_round_trips(be):
    t = be.tensor(7, (2, 3, 4, 5, 6), (360, 1, 90, 18, 3), DATA_DOUBLE, virtual=True)
    assert be.get(t, A_TENSOR_DATA_TYPE, T_DATA_TYPE) == (SUCCESS, 1, [DATA_DOUBLE])
    assert be.get(t, A_TENSOR_STRIDES, T_INT64, 8) == (SUCCESS, 5, [360, 1, 90, 18, 3])
    assert be.get(t, A_TENSOR_STRIDES, T_INT64, 0, null_array=True)[:2] == (SUCCESS, 5)
    assert be.get(t, A_TENSOR_IS_VIRTUAL, T_BOOLEAN) == (SUCCESS, 1, [True])
    assert be.get(t, A_TENSOR_ALIGNMENT, T_INT64) == (SUCCESS, 1, [16])
    assert be.get(t, A_TENSOR_UID, T_FLOAT)[0] == BAD_PARAM

    conv = be.convolution([1, 2, 0], [2, 1, 1], [1, 1, 3], mode=CONVOLUTION, compute=DATA_DOUBLE)
    assert be.get(conv, A_CONV_PRE_PADDINGS, T_INT64, 3) == (SUCCESS, 3, [1, 2, 0])
    assert be.get(conv, A_CONV_DILATIONS, T_INT64, 3) == (SUCCESS, 3, [1, 1, 3])
    assert be.get(conv, A_CONV_MODE, T_CONV_MODE) == (SUCCESS, 1, [CONVOLUTION])
    assert be.get(conv, A_CONV_SPATIAL_DIMS, T_INT64) == (SUCCESS, 1, [3])

    x, w, y = simple_tensors(be)
    op = be.conv_op("bwd_filter", x, w, y, be.convolution([1, 1]), beta=0.25, scale_type=T_DOUBLE)
    _, _, _, _, _, a_alpha, a_beta = CONV_OPS["bwd_filter"]
    assert be.get(op, a_alpha, T_FLOAT) == (SUCCESS, 1, [1.0])  # the default
    assert be.get(op, a_beta, T_DOUBLE) == (SUCCESS, 1, [0.25])


def test_graph_shapes_the_double_runs(be):
    x, w, y = simple_tensors(be)
    conv = be.convolution([1, 1])
    fwd = be.conv_op("fwd", x, w, y, conv)
    assert be.finalize(be.graph([fwd, fwd], finalize=False)) == NOT_SUPPORTED
    assert be.finalize(be.graph([fwd] * 3, finalize=False)) == NOT_SUPPORTED
    vx, vw, vy = simple_tensors(be, virtual_y=True)
    into_virtual = be.conv_op("fwd", vx, vw, vy, conv)
    assert be.finalize(be.graph([into_virtual], finalize=False)) == NOT_SUPPORTED
    relu_other = be.relu_op(y, be.tensor(4, (2, 4, 5, 6), (120, 30, 6, 1)))
    assert be.finalize(be.graph([into_virtual, relu_other], finalize=False)) == NOT_SUPPORTED
    relu = be.relu_op(vy, be.tensor(4, (2, 4, 5, 6), (120, 30, 6, 1)))
    assert be.finalize(be.graph([relu, into_virtual], finalize=False)) == SUCCESS
    bwd = be.conv_op("bwd_data", x, w, vy, conv)
    assert be.finalize(be.graph([bwd, relu], finalize=False)) == NOT_SUPPORTED
    same_uid = be.conv_op("fwd", x, be.tensor(1, (4, 2, 3, 3), (18, 9, 3, 1)), y, conv)
    assert be.finalize(be.graph([same_uid], finalize=False)) == BAD_PARAM

    # operation finalization: the legacy geometry checks
    assert be.finalize(be.conv_op("fwd", x, w, y, be.convolution([1, 1], post_pad=[1, 2]),
                                  finalize=False)) == NOT_SUPPORTED  # asymmetric padding
    unpacked_w = be.tensor(2, (4, 2, 3, 3), (36, 9, 3, 1))
    assert be.finalize(be.conv_op("fwd", x, unpacked_w, y, conv, finalize=False)) == BAD_PARAM
    krsc_w = be.tensor(2, (4, 2, 3, 3), (18, 1, 6, 2))
    assert be.finalize(be.conv_op("fwd", x, krsc_w, y, conv, finalize=False)) == SUCCESS
    no_padding = be.convolution([0, 0])  # y's 5x6 is not what the convolution makes
    assert be.finalize(be.conv_op("fwd", x, w, y, no_padding, finalize=False)) == BAD_PARAM
    w3 = be.tensor(2, (4, 3, 3, 3), (27, 9, 3, 1))  # x's 4 channels are no multiple of w's 3
    assert be.finalize(be.conv_op("fwd", x, w3, y, conv, finalize=False)) == BAD_PARAM


def test_engine_queries(be, handle, monkeypatch):
    x, w, y = simple_tensors(be, n=3)
    graph = be.graph([be.conv_op("fwd", x, w, y, be.convolution([1, 1]))])
    assert be.get(graph, A_GRAPH_GLOBAL_COUNT, T_INT64) == (SUCCESS, 1, [4])
    for index in range(4):
        engine = be.engine(graph, index)
        notes = [NUMERICAL_NOTE_TENSOR_CORE] if index == 2 else []
        assert be.get(engine, A_ENGINE_NUMERICAL_NOTE, T_NUMERICAL_NOTE, 10) == (
            SUCCESS, len(notes), notes)
        counted = be.get(engine, A_ENGINE_NUMERICAL_NOTE, T_NUMERICAL_NOTE, 10, null_array=True)
        assert counted[:2] == (SUCCESS, len(notes))
        assert be.get(engine, A_ENGINE_BEHAVIOR_NOTE, T_BEHAVIOR_NOTE, 5) == (SUCCESS, 0, [])
        assert be.get(engine, A_ENGINE_INDEX, T_INT64) == (SUCCESS, 1, [index])
    for index in (-1, 4):
        assert be.finalize(be.engine(graph, index, finalize=False)) == NOT_SUPPORTED

    config = be.config(graph, 2, knobs=[(2, 4), (17, -3)])
    assert be.get(config, A_CFG_WORKSPACE_SIZE, T_INT64) == (SUCCESS, 1, [2 * 3 * WS_PER_SAMPLE])
    monkeypatch.setenv("FAKE_CUDNN_WS_PER_SAMPLE", "7")
    assert be.get(config, A_CFG_WORKSPACE_SIZE, T_INT64) == (SUCCESS, 1, [2 * 3 * 7])
    knobs = [be.new(KNOB_CHOICE) for _ in range(3)]
    assert be.get_descs(config, A_CFG_KNOB_CHOICES, knobs) == (SUCCESS, 2)
    assert [(be.get(k, A_KNOB_TYPE, T_KNOB_TYPE)[2][0], be.get(k, A_KNOB_VALUE, T_INT64)[2][0])
            for k in knobs[:2]] == [(2, 4), (17, -3)]
    status, plan = be.plan(handle, config)
    assert status == SUCCESS
    monkeypatch.setenv("FAKE_CUDNN_WS_PER_SAMPLE", "1000")  # a finalized plan keeps its size
    assert be.get(plan, A_PLAN_WORKSPACE_SIZE, T_INT64) == (SUCCESS, 1, [2 * 3 * 7])
    back = be.new(ENGINECFG)
    assert be.get_descs(plan, A_PLAN_ENGINE_CONFIG, [back]) == (SUCCESS, 1)
    engine = be.new(ENGINE)
    assert be.get_descs(back, A_CFG_ENGINE, [engine]) == (SUCCESS, 1)
    assert be.get(engine, A_ENGINE_INDEX, T_INT64) == (SUCCESS, 1, [2])

    monkeypatch.setenv("FAKE_CUDNN_ENGINE_UNSUPPORTED", "1")
    assert be.plan(handle, be.config(graph, 1))[0] == NOT_SUPPORTED
    no_handle = be.build(PLAN, [(A_PLAN_ENGINE_CONFIG, T_DESCRIPTOR, be.config(graph, 0))], False)
    assert be.set(no_handle, A_PLAN_HANDLE, T_HANDLE, None) == BAD_PARAM
    assert be.finalize(no_handle) == BAD_PARAM


def test_heuristics_results(be):
    x, w, y = simple_tensors(be)
    graph = be.graph([be.conv_op("bwd_filter", x, w, y, be.convolution([1, 1]))])
    heur = be.build(ENGINEHEUR, [(A_HEUR_GRAPH, T_DESCRIPTOR, graph),
                                 (A_HEUR_MODE, T_HEUR_MODE, HEUR_MODE_INSTANT)])
    assert be.get_descs(heur, A_HEUR_RESULTS, []) == (SUCCESS, 4)
    configs = [be.new(ENGINECFG) for _ in range(2)]
    assert be.get_descs(heur, A_HEUR_RESULTS, configs) == (SUCCESS, 2)  # as many as asked for
    engines = []
    for config in configs:
        engine = be.new(ENGINE)
        assert be.get_descs(config, A_CFG_ENGINE, [engine]) == (SUCCESS, 1)
        engines.append(be.get(engine, A_ENGINE_INDEX, T_INT64)[2][0])
        assert be.get_descs(config, A_CFG_KNOB_CHOICES, [be.new(KNOB_CHOICE)]) == (SUCCESS, 0)
    assert engines == [3, 2]
    assert be.get_descs(heur, A_HEUR_RESULTS, [be.new(ENGINE)])[0] == BAD_PARAM
    unfinished = be.build(ENGINEHEUR, [(A_HEUR_GRAPH, T_DESCRIPTOR, graph)], finalize=False)
    assert be.finalize(unfinished) == BAD_PARAM  # no mode


def test_log_lines(be, handle, log_path):
    status, tensor = be.create(TENSOR)
    assert be.set(tensor, A_TENSOR_UID, T_INT64, 5) == SUCCESS
    assert be.finalize(tensor) == BAD_PARAM
    assert be.get(tensor, A_TENSOR_UID, T_INT64)[0] == BAD_PARAM
    assert be.destroy(tensor) == SUCCESS
    desc = f"0x{tensor.value:x}"
    assert log_calls(log_path, "cudnnBackendCreateDescriptor") == [
        {"fn": "cudnnBackendCreateDescriptor", "type": "17", "desc": desc, "status": "0"}]
    assert log_calls(log_path, "cudnnBackendSetAttribute") == [
        {"fn": "cudnnBackendSetAttribute", "desc": desc, "type": "17", "attr": "906", "atype": "3",
         "count": "1", "status": "0"}]
    assert log_calls(log_path, "cudnnBackendFinalize") == [
        {"fn": "cudnnBackendFinalize", "desc": desc, "type": "17", "status": "2000"}]
    assert log_calls(log_path, "cudnnBackendGetAttribute") == [
        {"fn": "cudnnBackendGetAttribute", "desc": desc, "type": "17", "attr": "906", "atype": "3",
         "requested": "1", "count": "-1", "status": "2000"}]
    assert log_calls(log_path, "cudnnBackendDestroyDescriptor") == [
        {"fn": "cudnnBackendDestroyDescriptor", "desc": desc, "type": "17", "status": "0"}]

    assert be.lib.cudnnBackendExecute(handle, None, None) == BAD_PARAM
    (line,) = log_calls(log_path, "cudnnBackendExecute")
    assert (line["dir"], line["engine"], line["xdims"], line["status"]) == ("-", "-1", "-", "2000")
