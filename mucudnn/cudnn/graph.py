"""ctypes bindings of cuDNN's graph ("backend") API for one convolution (the subset mucudnn needs).

PyTorch's default convolution path describes each convolution as a graph of one operation and runs
an *engine configuration* of it: an engine (a global index) with knob choices. mucudnn builds the
same graph for a :class:`~mucudnn.problem.ConvProblem` (:class:`ConvolutionGraph`), asks cuDNN's
heuristics for configurations (:meth:`ConvolutionGraph.heuristics`, :func:`candidate_configs`), and
builds execution plans (:class:`ExecutionPlan`) from a heuristics result or from an engine name
(:mod:`mucudnn.engines`), to time them and to run them.

Calls go through :meth:`Cudnn.call` of the library :func:`mucudnn.cudnn.get` loaded, so a status
other than SUCCESS raises the :class:`~mucudnn.errors.CudnnError` subclass of that status. Every
descriptor belongs to one Python object and is destroyed by its ``close()``; the objects are
context managers. Pointers (device memory) are plain integers.

Enum values are cuDNN 9's (``cudnn_graph.h``); tests/test_graph.py checks them against the header.
"""

from __future__ import annotations

import contextlib
import enum
from ctypes import POINTER, byref, c_double, c_float, c_int, c_int64, c_void_p
from typing import Sequence

from ..engines import EngineConfig, format_numerical_notes
from ..errors import CudnnError, EngineNameError
from ..problem import ConvMode, ConvProblem, DataType, Direction, MathType
from .api import Cudnn, Handle, packed_strides

_desc_t = c_void_p

_SIGNATURES: dict[str, list] = {
    "cudnnBackendCreateDescriptor": [c_int, POINTER(_desc_t)],
    "cudnnBackendDestroyDescriptor": [_desc_t],
    "cudnnBackendFinalize": [_desc_t],
    "cudnnBackendSetAttribute": [_desc_t, c_int, c_int, c_int64, c_void_p],
    "cudnnBackendGetAttribute": [_desc_t, c_int, c_int, c_int64, POINTER(c_int64), c_void_p],
    "cudnnBackendExecute": [c_void_p, _desc_t, _desc_t],
}


class DescriptorType(enum.IntEnum):
    """``cudnnBackendDescriptorType_t``: ``CUDNN_BACKEND_<name>_DESCRIPTOR``."""

    CONVOLUTION = 1
    ENGINE = 2
    ENGINECFG = 3
    ENGINEHEUR = 4
    EXECUTION_PLAN = 5
    KNOB_CHOICE = 7
    OPERATION_CONVOLUTION_FORWARD = 10
    OPERATION_CONVOLUTION_BACKWARD_FILTER = 11
    OPERATION_CONVOLUTION_BACKWARD_DATA = 12
    OPERATIONGRAPH = 15
    VARIANT_PACK = 16
    TENSOR = 17


class AttributeType(enum.IntEnum):
    """``cudnnBackendAttributeType_t``: ``CUDNN_TYPE_<name>``."""

    HANDLE = 0
    DATA_TYPE = 1
    INT64 = 3
    FLOAT = 4
    DOUBLE = 5
    VOID_PTR = 6
    CONVOLUTION_MODE = 7
    HEUR_MODE = 8
    KNOB_TYPE = 9
    NUMERICAL_NOTE = 11
    BACKEND_DESCRIPTOR = 15


class Attribute(enum.IntEnum):
    """``cudnnBackendAttributeName_t``: ``CUDNN_ATTR_<name>``."""

    CONVOLUTION_COMP_TYPE = 100
    CONVOLUTION_CONV_MODE = 101
    CONVOLUTION_DILATIONS = 102
    CONVOLUTION_FILTER_STRIDES = 103
    CONVOLUTION_POST_PADDINGS = 104
    CONVOLUTION_PRE_PADDINGS = 105
    CONVOLUTION_SPATIAL_DIMS = 106
    ENGINEHEUR_MODE = 200
    ENGINEHEUR_OPERATION_GRAPH = 201
    ENGINEHEUR_RESULTS = 202
    ENGINECFG_ENGINE = 300
    ENGINECFG_KNOB_CHOICES = 302
    # deprecated in cuDNN 9.24's header, still required by the 9.19 the GPU machine has
    EXECUTION_PLAN_HANDLE = 400
    EXECUTION_PLAN_ENGINE_CONFIG = 401
    EXECUTION_PLAN_WORKSPACE_SIZE = 402
    KNOB_CHOICE_KNOB_TYPE = 600
    KNOB_CHOICE_KNOB_VALUE = 601
    OPERATION_CONVOLUTION_FORWARD_ALPHA = 700
    OPERATION_CONVOLUTION_FORWARD_BETA = 701
    OPERATION_CONVOLUTION_FORWARD_CONV_DESC = 702
    OPERATION_CONVOLUTION_FORWARD_W = 703
    OPERATION_CONVOLUTION_FORWARD_X = 704
    OPERATION_CONVOLUTION_FORWARD_Y = 705
    OPERATION_CONVOLUTION_BWD_DATA_ALPHA = 706
    OPERATION_CONVOLUTION_BWD_DATA_BETA = 707
    OPERATION_CONVOLUTION_BWD_DATA_CONV_DESC = 708
    OPERATION_CONVOLUTION_BWD_DATA_W = 709
    OPERATION_CONVOLUTION_BWD_DATA_DX = 710
    OPERATION_CONVOLUTION_BWD_DATA_DY = 711
    OPERATION_CONVOLUTION_BWD_FILTER_ALPHA = 712
    OPERATION_CONVOLUTION_BWD_FILTER_BETA = 713
    OPERATION_CONVOLUTION_BWD_FILTER_CONV_DESC = 714
    OPERATION_CONVOLUTION_BWD_FILTER_DW = 715
    OPERATION_CONVOLUTION_BWD_FILTER_X = 716
    OPERATION_CONVOLUTION_BWD_FILTER_DY = 717
    # deprecated in cuDNN 9.24's header, still required by 9.19
    OPERATIONGRAPH_HANDLE = 800
    OPERATIONGRAPH_OPS = 801
    TENSOR_BYTE_ALIGNMENT = 900
    TENSOR_DATA_TYPE = 901
    TENSOR_DIMENSIONS = 902
    TENSOR_STRIDES = 903
    TENSOR_UNIQUE_ID = 906
    VARIANT_PACK_UNIQUE_IDS = 1000
    VARIANT_PACK_DATA_POINTERS = 1001
    VARIANT_PACK_WORKSPACE = 1003
    ENGINE_OPERATION_GRAPH = 1300
    ENGINE_GLOBAL_INDEX = 1301
    ENGINE_NUMERICAL_NOTE = 1303


class HeurMode(enum.IntEnum):
    """``cudnnBackendHeurMode_t``: ``CUDNN_HEUR_MODE_<name>``."""

    INSTANT = 0
    B = 1
    FALLBACK = 2
    A = 3


class NumericalNote(enum.IntEnum):
    """``cudnnBackendNumericalNote_t``: ``CUDNN_NUMERICAL_NOTE_<name>``."""

    TENSOR_CORE = 0
    DOWN_CONVERT_INPUTS = 1
    REDUCED_PRECISION_REDUCTION = 2
    FFT = 3
    NONDETERMINISTIC = 4
    WINOGRAD = 5
    WINOGRAD_TILE_4x4 = 6
    WINOGRAD_TILE_6x6 = 7
    WINOGRAD_TILE_13x13 = 8
    STRICT_NAN_PROP = 9


# The C element type of each attribute type (C enums are ints).
_ELEMENT = {
    AttributeType.HANDLE: c_void_p, AttributeType.DATA_TYPE: c_int, AttributeType.INT64: c_int64,
    AttributeType.FLOAT: c_float, AttributeType.DOUBLE: c_double,
    AttributeType.VOID_PTR: c_void_p, AttributeType.CONVOLUTION_MODE: c_int,
    AttributeType.HEUR_MODE: c_int, AttributeType.KNOB_TYPE: c_int,
    AttributeType.NUMERICAL_NOTE: c_int, AttributeType.BACKEND_DESCRIPTOR: c_void_p,
}

#: Unique ids of the operation's tensors, as PyTorch gives them: the forward names' characters.
UIDS = {"x": ord("x"), "w": ord("w"), "y": ord("y")}

# (operation, {forward tensor name or role: attribute}) per direction; backward data writes dx
# (forward x) from dy (forward y), backward filter writes dw (forward w).
_OPERATIONS = {
    Direction.FORWARD: (DescriptorType.OPERATION_CONVOLUTION_FORWARD, {
        "alpha": Attribute.OPERATION_CONVOLUTION_FORWARD_ALPHA,
        "beta": Attribute.OPERATION_CONVOLUTION_FORWARD_BETA,
        "conv": Attribute.OPERATION_CONVOLUTION_FORWARD_CONV_DESC,
        "x": Attribute.OPERATION_CONVOLUTION_FORWARD_X,
        "w": Attribute.OPERATION_CONVOLUTION_FORWARD_W,
        "y": Attribute.OPERATION_CONVOLUTION_FORWARD_Y}),
    Direction.BACKWARD_DATA: (DescriptorType.OPERATION_CONVOLUTION_BACKWARD_DATA, {
        "alpha": Attribute.OPERATION_CONVOLUTION_BWD_DATA_ALPHA,
        "beta": Attribute.OPERATION_CONVOLUTION_BWD_DATA_BETA,
        "conv": Attribute.OPERATION_CONVOLUTION_BWD_DATA_CONV_DESC,
        "x": Attribute.OPERATION_CONVOLUTION_BWD_DATA_DX,
        "w": Attribute.OPERATION_CONVOLUTION_BWD_DATA_W,
        "y": Attribute.OPERATION_CONVOLUTION_BWD_DATA_DY}),
    Direction.BACKWARD_FILTER: (DescriptorType.OPERATION_CONVOLUTION_BACKWARD_FILTER, {
        "alpha": Attribute.OPERATION_CONVOLUTION_BWD_FILTER_ALPHA,
        "beta": Attribute.OPERATION_CONVOLUTION_BWD_FILTER_BETA,
        "conv": Attribute.OPERATION_CONVOLUTION_BWD_FILTER_CONV_DESC,
        "x": Attribute.OPERATION_CONVOLUTION_BWD_FILTER_X,
        "w": Attribute.OPERATION_CONVOLUTION_BWD_FILTER_DW,
        "y": Attribute.OPERATION_CONVOLUTION_BWD_FILTER_DY}),
}

#: Room for an engine configuration's knob choices, more than cuDNN 9 has knob types (46 in
#: 9.24): asked for their count alone, cuDNN 9.19 answers 0.
KNOB_CAPACITY = 64

#: Largest tensor byte alignment declared (cuDNN's widest vector loads are 16 bytes).
MAX_ALIGNMENT = 16


def byte_alignment(*addresses: int) -> int:
    """The largest power of two up to :data:`MAX_ALIGNMENT` dividing every address (or offset)."""
    alignment = MAX_ALIGNMENT
    for address in addresses:
        while address % alignment:
            alignment //= 2
    return alignment


class BackendDescriptor:
    """One owned backend descriptor of ``kind``; ``close()`` destroys it."""

    def __init__(self, cudnn: Cudnn, kind: DescriptorType) -> None:
        self._cudnn, self.kind = cudnn, kind
        ptr = _desc_t()
        cudnn.call("cudnnBackendCreateDescriptor", kind, byref(ptr))
        self.ptr = ptr

    def set(self, attribute: Attribute, attr_type: AttributeType,
            values: Sequence) -> "BackendDescriptor":
        """Set an attribute to ``values`` (numbers, pointers, or BackendDescriptors); chainable."""
        raw = [v.ptr.value if isinstance(v, BackendDescriptor) else v for v in values]
        array = (_ELEMENT[attr_type] * len(raw))(*raw)
        self._cudnn.call("cudnnBackendSetAttribute", self.ptr, attribute, attr_type, len(raw),
                         array)
        return self

    def finalize(self) -> "BackendDescriptor":
        self._cudnn.call("cudnnBackendFinalize", self.ptr)
        return self

    def count(self, attribute: Attribute, attr_type: AttributeType) -> int:
        """How many elements the attribute holds (cuDNN 9.19 answers 0 for knob choices)."""
        count = c_int64()
        self._cudnn.call("cudnnBackendGetAttribute", self.ptr, attribute, attr_type, 0,
                         byref(count), None)
        return count.value

    def get(self, attribute: Attribute, attr_type: AttributeType, capacity: int = 1) -> list:
        """The elements of a numeric attribute, at most ``capacity``."""
        array = (_ELEMENT[attr_type] * capacity)()
        count = c_int64()
        self._cudnn.call("cudnnBackendGetAttribute", self.ptr, attribute, attr_type, capacity,
                         byref(count), array)
        return list(array[:min(count.value, capacity)])

    def get_descriptors(self, attribute: Attribute, kind: DescriptorType,
                        capacity: int | None = None) -> list["BackendDescriptor"]:
        """The elements of a descriptor-valued attribute (at most ``capacity``, default as many as
        :meth:`count` says), as new descriptors the caller owns."""
        if capacity is None:
            capacity = self.count(attribute, AttributeType.BACKEND_DESCRIPTOR)
        with contextlib.ExitStack() as stack:
            found = [stack.enter_context(BackendDescriptor(self._cudnn, kind))
                     for _ in range(capacity)]
            array = (c_void_p * max(capacity, 1))(*(d.ptr.value for d in found))
            count = c_int64()
            self._cudnn.call("cudnnBackendGetAttribute", self.ptr, attribute,
                             AttributeType.BACKEND_DESCRIPTOR, capacity, byref(count), array)
            stack.pop_all()
        returned = min(count.value, capacity)
        for extra in found[returned:]:
            extra.close()
        return found[:returned]

    def close(self) -> None:
        if getattr(self, "ptr", None) is not None and self.ptr.value:
            self._cudnn.lib.cudnnBackendDestroyDescriptor(self.ptr)
        self.ptr = None

    def __enter__(self) -> "BackendDescriptor":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:  # a safety net: owners close their descriptors
        self.close()


def _scalar_type(dtype: DataType) -> AttributeType:
    """alpha/beta as cuDNN wants them: double for double data, float otherwise."""
    return AttributeType.DOUBLE if dtype is DataType.DOUBLE else AttributeType.FLOAT


def _note_name(value: int) -> str:
    """The enumerator's name, or the number for a note newer than this table."""
    try:
        return NumericalNote(value).name
    except ValueError:
        return str(value)


class EngineCandidate:
    """One engine configuration the heuristics returned: its name's parts, numerical notes, and
    the configuration descriptor (owned by the graph that asked)."""

    def __init__(self, config: EngineConfig, notes: frozenset[int],
                 descriptor: BackendDescriptor) -> None:
        self.config, self.notes, self.descriptor = config, notes, descriptor

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def note_text(self) -> str:
        """The notes as a measurement's note (:func:`mucudnn.engines.format_numerical_notes`)."""
        return format_numerical_notes(_note_name(n) for n in self.notes)

    def __repr__(self) -> str:
        return f"EngineCandidate({self.name}, {self.note_text})"


class ConvolutionGraph:
    """The finalized operation graph of one convolution: ``problem`` at its N, in its direction,
    with ``alpha``/``beta`` baked in, its tensors declared ``alignment``-byte aligned.

    Tensors have the unique ids :data:`UIDS` and the packed strides of the problem's layout (W is
    KCRS for NCHW, KRSC for NHWC; groups are implicit in W's dims K, C/g, ...).
    """

    def __init__(self, cudnn: Cudnn, handle: Handle, problem: ConvProblem, alpha: float = 1.0,
                 beta: float = 0.0, alignment: int = MAX_ALIGNMENT) -> None:
        cudnn.bind(_SIGNATURES)
        self.cudnn, self.handle, self.problem = cudnn, handle, problem
        self._owned = contextlib.ExitStack()
        try:
            tensors = {name: self._tensor(name, dims, alignment) for name, dims in
                       (("x", problem.x_shape), ("w", problem.w_shape), ("y", problem.y_shape))}
            operation = self._operation(tensors, self._convolution(), alpha, beta)
            self.descriptor = self._new(DescriptorType.OPERATIONGRAPH) \
                .set(Attribute.OPERATIONGRAPH_HANDLE, AttributeType.HANDLE, [handle.ptr.value]) \
                .set(Attribute.OPERATIONGRAPH_OPS, AttributeType.BACKEND_DESCRIPTOR, [operation]) \
                .finalize()
        except BaseException:
            self.close()
            raise

    def _new(self, kind: DescriptorType) -> BackendDescriptor:
        return self._owned.enter_context(BackendDescriptor(self.cudnn, kind))

    def _tensor(self, name: str, dims: tuple[int, ...], alignment: int) -> BackendDescriptor:
        return self._new(DescriptorType.TENSOR) \
            .set(Attribute.TENSOR_DATA_TYPE, AttributeType.DATA_TYPE, [self.problem.dtype.cudnn]) \
            .set(Attribute.TENSOR_DIMENSIONS, AttributeType.INT64, dims) \
            .set(Attribute.TENSOR_STRIDES, AttributeType.INT64,
                 packed_strides(dims, self.problem.layout)) \
            .set(Attribute.TENSOR_UNIQUE_ID, AttributeType.INT64, [UIDS[name]]) \
            .set(Attribute.TENSOR_BYTE_ALIGNMENT, AttributeType.INT64, [alignment]) \
            .finalize()

    def _convolution(self) -> BackendDescriptor:
        p = self.problem
        mode = 0 if p.mode is ConvMode.CONVOLUTION else 1  # CUDNN_CONVOLUTION / _CROSS_CORRELATION
        return self._new(DescriptorType.CONVOLUTION) \
            .set(Attribute.CONVOLUTION_COMP_TYPE, AttributeType.DATA_TYPE, [p.compute_type.cudnn]) \
            .set(Attribute.CONVOLUTION_CONV_MODE, AttributeType.CONVOLUTION_MODE, [mode]) \
            .set(Attribute.CONVOLUTION_SPATIAL_DIMS, AttributeType.INT64, [p.spatial_dims]) \
            .set(Attribute.CONVOLUTION_DILATIONS, AttributeType.INT64, p.dilation) \
            .set(Attribute.CONVOLUTION_FILTER_STRIDES, AttributeType.INT64, p.stride) \
            .set(Attribute.CONVOLUTION_PRE_PADDINGS, AttributeType.INT64, p.padding) \
            .set(Attribute.CONVOLUTION_POST_PADDINGS, AttributeType.INT64, p.padding) \
            .finalize()

    def _operation(self, tensors: dict[str, BackendDescriptor], convolution: BackendDescriptor,
                   alpha: float, beta: float) -> BackendDescriptor:
        kind, attributes = _OPERATIONS[self.problem.direction]
        scalar = _scalar_type(self.problem.dtype)
        operation = self._new(kind)
        for name, tensor in tensors.items():
            operation.set(attributes[name], AttributeType.BACKEND_DESCRIPTOR, [tensor])
        return operation \
            .set(attributes["conv"], AttributeType.BACKEND_DESCRIPTOR, [convolution]) \
            .set(attributes["alpha"], scalar, [alpha]) \
            .set(attributes["beta"], scalar, [beta]) \
            .finalize()

    # -- engine configurations --------------------------------------------------------------------
    def heuristics(self, mode: HeurMode) -> list[EngineCandidate]:
        """The configurations cuDNN's heuristics ``mode`` proposes, best first (except any whose
        knobs no engine name can list, mucudnn.engines.MAX_KNOBS)."""
        with BackendDescriptor(self.cudnn, DescriptorType.ENGINEHEUR) as heuristics:
            heuristics.set(Attribute.ENGINEHEUR_OPERATION_GRAPH, AttributeType.BACKEND_DESCRIPTOR,
                           [self.descriptor]) \
                .set(Attribute.ENGINEHEUR_MODE, AttributeType.HEUR_MODE, [mode]) \
                .finalize()
            configs = heuristics.get_descriptors(Attribute.ENGINEHEUR_RESULTS,
                                                 DescriptorType.ENGINECFG)
        for config in configs:
            self._owned.enter_context(config)
        described = [self._describe(config) for config in configs]
        return [candidate for candidate in described if candidate is not None]

    def _describe(self, config: BackendDescriptor) -> EngineCandidate | None:
        """The configuration's name parts and notes; None if no engine name can express it."""
        (engine,) = config.get_descriptors(Attribute.ENGINECFG_ENGINE, DescriptorType.ENGINE)
        with engine:
            index = engine.get(Attribute.ENGINE_GLOBAL_INDEX, AttributeType.INT64)[0]
            notes = engine.get(Attribute.ENGINE_NUMERICAL_NOTE, AttributeType.NUMERICAL_NOTE,
                               len(NumericalNote) + 8)  # room for notes newer than this table
        knobs = []
        for choice in config.get_descriptors(Attribute.ENGINECFG_KNOB_CHOICES,
                                             DescriptorType.KNOB_CHOICE, KNOB_CAPACITY):
            with choice:
                knobs.append((choice.get(Attribute.KNOB_CHOICE_KNOB_TYPE,
                                         AttributeType.KNOB_TYPE)[0],
                              choice.get(Attribute.KNOB_CHOICE_KNOB_VALUE,
                                         AttributeType.INT64)[0]))
        try:
            return EngineCandidate(EngineConfig.with_knobs(index, knobs), frozenset(notes), config)
        except EngineNameError:  # more knobs than a name may list: a plan could not run it
            return None

    def plan_from_heuristics(self, candidate: EngineCandidate) -> "ExecutionPlan":
        """An execution plan of a configuration :meth:`heuristics` returned."""
        return ExecutionPlan(self, candidate.descriptor, contextlib.ExitStack())

    def plan_from_name(self, config: EngineConfig) -> "ExecutionPlan":
        """An execution plan of engine ``config.global_index`` with ``config.knobs`` (what a plan
        file's engine piece names): an ENGINE, its KNOB_CHOICEs and an ENGINECFG built here."""
        with contextlib.ExitStack() as stack:
            def new(kind: DescriptorType) -> BackendDescriptor:
                return stack.enter_context(BackendDescriptor(self.cudnn, kind))

            engine = new(DescriptorType.ENGINE) \
                .set(Attribute.ENGINE_OPERATION_GRAPH, AttributeType.BACKEND_DESCRIPTOR,
                     [self.descriptor]) \
                .set(Attribute.ENGINE_GLOBAL_INDEX, AttributeType.INT64, [config.global_index]) \
                .finalize()
            choices = [new(DescriptorType.KNOB_CHOICE)
                       .set(Attribute.KNOB_CHOICE_KNOB_TYPE, AttributeType.KNOB_TYPE, [knob_type])
                       .set(Attribute.KNOB_CHOICE_KNOB_VALUE, AttributeType.INT64, [value])
                       .finalize() for knob_type, value in config.knobs]
            engine_config = new(DescriptorType.ENGINECFG) \
                .set(Attribute.ENGINECFG_ENGINE, AttributeType.BACKEND_DESCRIPTOR, [engine])
            if choices:  # none: the engine's default knobs
                engine_config.set(Attribute.ENGINECFG_KNOB_CHOICES,
                                  AttributeType.BACKEND_DESCRIPTOR, choices)
            engine_config.finalize()
            return ExecutionPlan(self, engine_config, stack.pop_all())

    def close(self) -> None:
        self._owned.close()

    def __enter__(self) -> "ConvolutionGraph":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class ExecutionPlan:
    """A finalized execution plan of one engine configuration of a :class:`ConvolutionGraph`.

    ``owned`` holds the descriptors it was built from that nobody else owns; ``close()`` destroys
    them with the plan.
    """

    def __init__(self, graph: ConvolutionGraph, engine_config: BackendDescriptor,
                 owned: contextlib.ExitStack) -> None:
        self.cudnn, self.handle = graph.cudnn, graph.handle
        self._owned = owned
        try:
            self.descriptor = owned.enter_context(
                BackendDescriptor(self.cudnn, DescriptorType.EXECUTION_PLAN))
            self.descriptor \
                .set(Attribute.EXECUTION_PLAN_HANDLE, AttributeType.HANDLE,
                     [self.handle.ptr.value]) \
                .set(Attribute.EXECUTION_PLAN_ENGINE_CONFIG, AttributeType.BACKEND_DESCRIPTOR,
                     [engine_config]) \
                .finalize()
            (self.workspace_size,) = self.descriptor.get(Attribute.EXECUTION_PLAN_WORKSPACE_SIZE,
                                                         AttributeType.INT64)
        except BaseException:
            self.close()
            raise

    def variant_pack(self, x: int, w: int, y: int, workspace: int) -> BackendDescriptor:
        """The finalized variant pack binding the tensors (forward names) and the workspace to
        device pointers; the caller closes it. Build once, :meth:`execute` many times."""
        pack = BackendDescriptor(self.cudnn, DescriptorType.VARIANT_PACK)
        try:
            return pack \
                .set(Attribute.VARIANT_PACK_UNIQUE_IDS, AttributeType.INT64,
                     [UIDS["x"], UIDS["w"], UIDS["y"]]) \
                .set(Attribute.VARIANT_PACK_DATA_POINTERS, AttributeType.VOID_PTR, [x, w, y]) \
                .set(Attribute.VARIANT_PACK_WORKSPACE, AttributeType.VOID_PTR,
                     [workspace or None]) \
                .finalize()
        except BaseException:
            pack.close()
            raise

    def execute(self, variant_pack: BackendDescriptor) -> None:
        self.cudnn.call("cudnnBackendExecute", self.handle.ptr, self.descriptor.ptr,
                        variant_pack.ptr)

    def run(self, x: int, w: int, y: int, workspace: int) -> None:
        with self.variant_pack(x, w, y, workspace) as pack:
            self.execute(pack)

    def close(self) -> None:
        self._owned.close()

    def __enter__(self) -> "ExecutionPlan":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# -- which configurations to time ---------------------------------------------------------------

def is_usable(candidate: EngineCandidate, problem: ConvProblem) -> bool:
    """PyTorch's filter: never engines that down-convert their inputs, and no tensor-core engines
    for float data when the caller asked for FMA math (TF32 off)."""
    if NumericalNote.DOWN_CONVERT_INPUTS in candidate.notes:
        return False
    return not (problem.dtype is DataType.FLOAT and problem.math is MathType.FMA
                and NumericalNote.TENSOR_CORE in candidate.notes)


def candidate_configs(graph: ConvolutionGraph, max_heuristic: int = 8) -> list[EngineCandidate]:
    """The configurations worth timing: the first ``max_heuristic`` usable ones of heuristics
    mode A, then every usable fallback one, each name once.

    A mode cuDNN refuses contributes nothing; if both are refused, the first refusal is raised.
    """
    chosen: dict[str, EngineCandidate] = {}
    refusals: list[CudnnError] = []
    for mode, limit in ((HeurMode.A, max_heuristic), (HeurMode.FALLBACK, None)):
        try:
            found = graph.heuristics(mode)
        except CudnnError as exc:
            refusals.append(exc)
            continue
        for candidate in [c for c in found if is_usable(c, graph.problem)][:limit]:
            chosen.setdefault(candidate.name, candidate)
    if len(refusals) == 2:
        raise refusals[0]
    return list(chosen.values())
