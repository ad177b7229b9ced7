"""ctypes bindings of cuDNN's legacy convolution API (the subset mucudnn needs).

Every call goes through :meth:`Cudnn.call`, which turns a status other than SUCCESS into the
:class:`~mucudnn.errors.CudnnError` subclass of that status, naming the call and cuDNN's status string.
Pointers (device memory, streams) are plain integers, e.g. ``cupy_array.data.ptr``.
"""

from __future__ import annotations

import ctypes
import threading
from ctypes import POINTER, byref, c_double, c_float, c_int, c_size_t, c_void_p

from ..errors import cudnn_error_class
from ..problem import ConvMode, ConvProblem, DataType, Direction, Layout, MathType
from .library import load_cudnn

_handle_t = c_void_p
_desc_t = c_void_p


# name: (argtypes); every function returns cudnnStatus_t except those in _NON_STATUS.
_SIGNATURES: dict[str, list] = {
    "cudnnCreate": [POINTER(_handle_t)],
    "cudnnDestroy": [_handle_t],
    "cudnnSetStream": [_handle_t, c_void_p],
    "cudnnCreateTensorDescriptor": [POINTER(_desc_t)],
    "cudnnDestroyTensorDescriptor": [_desc_t],
    "cudnnSetTensorNdDescriptor": [_desc_t, c_int, c_int, POINTER(c_int), POINTER(c_int)],
    "cudnnCreateFilterDescriptor": [POINTER(_desc_t)],
    "cudnnDestroyFilterDescriptor": [_desc_t],
    "cudnnSetFilterNdDescriptor": [_desc_t, c_int, c_int, c_int, POINTER(c_int)],
    "cudnnCreateConvolutionDescriptor": [POINTER(_desc_t)],
    "cudnnDestroyConvolutionDescriptor": [_desc_t],
    "cudnnSetConvolutionNdDescriptor": [_desc_t, c_int, POINTER(c_int), POINTER(c_int),
                                        POINTER(c_int), c_int, c_int],
    "cudnnSetConvolutionGroupCount": [_desc_t, c_int],
    "cudnnSetConvolutionMathType": [_desc_t, c_int],
    "cudnnGetConvolutionForwardWorkspaceSize": [_handle_t, _desc_t, _desc_t, _desc_t, _desc_t,
                                                c_int, POINTER(c_size_t)],
    "cudnnGetConvolutionBackwardDataWorkspaceSize": [_handle_t, _desc_t, _desc_t, _desc_t, _desc_t,
                                                     c_int, POINTER(c_size_t)],
    "cudnnGetConvolutionBackwardFilterWorkspaceSize": [_handle_t, _desc_t, _desc_t, _desc_t,
                                                       _desc_t, c_int, POINTER(c_size_t)],
    "cudnnConvolutionForward": [_handle_t, c_void_p, _desc_t, c_void_p, _desc_t, c_void_p, _desc_t,
                                c_int, c_void_p, c_size_t, c_void_p, _desc_t, c_void_p],
    "cudnnConvolutionBackwardData": [_handle_t, c_void_p, _desc_t, c_void_p, _desc_t, c_void_p,
                                     _desc_t, c_int, c_void_p, c_size_t, c_void_p, _desc_t,
                                     c_void_p],
    "cudnnConvolutionBackwardFilter": [_handle_t, c_void_p, _desc_t, c_void_p, _desc_t, c_void_p,
                                       _desc_t, c_int, c_void_p, c_size_t, c_void_p, _desc_t,
                                       c_void_p],
}
_NON_STATUS = {"cudnnGetVersion": c_size_t, "cudnnGetErrorString": ctypes.c_char_p}

_lock = threading.Lock()
_instance: "Cudnn | None" = None


def _ints(values) -> ctypes.Array:
    values = [int(v) for v in values]
    return (c_int * len(values))(*values)


def packed_strides(dims: tuple[int, ...], layout: Layout) -> tuple[int, ...]:
    """Strides (in elements) of a fully packed tensor with NC(D)HW-ordered ``dims``."""
    if layout is Layout.NCHW:
        order = list(range(len(dims)))                       # n, c, d, h, w
    else:
        order = [0] + list(range(2, len(dims))) + [1]         # n, d, h, w, c
    strides = [0] * len(dims)
    step = 1
    for axis in reversed(order):
        strides[axis] = step
        step *= dims[axis]
    return tuple(strides)


class Cudnn:
    """The loaded library. Use :func:`get` for the process-wide instance."""

    def __init__(self) -> None:
        self.lib, self.path = load_cudnn()
        self.bind(_SIGNATURES)
        for name, restype in _NON_STATUS.items():
            getattr(self.lib, name).restype = restype
        self.lib.cudnnGetErrorString.argtypes = [c_int]
        self.version = int(self.lib.cudnnGetVersion())

    def bind(self, signatures: dict[str, list]) -> None:
        """Declare functions returning ``cudnnStatus_t`` with these argument types.

        Other modules (graph.py) bind the functions they use on the same library object.
        """
        for name, argtypes in signatures.items():
            fn = getattr(self.lib, name)
            fn.argtypes = argtypes
            fn.restype = c_int

    def call(self, name: str, *args) -> None:
        status = getattr(self.lib, name)(*args)
        if status != 0:
            text = self.lib.cudnnGetErrorString(status).decode(errors="replace")
            raise cudnn_error_class(status)(name, status, text)

    # -- descriptors ------------------------------------------------------------------------------
    def handle(self, stream_ptr: int = 0) -> "Handle":
        return Handle(self, stream_ptr)

    def tensor(self, dtype: DataType, dims, strides) -> "Descriptor":
        desc = Descriptor(self, "Tensor")
        self.call("cudnnSetTensorNdDescriptor", desc.ptr, dtype.cudnn, len(dims), _ints(dims),
                  _ints(strides))
        return desc

    def filter(self, dtype: DataType, layout: Layout, dims) -> "Descriptor":
        desc = Descriptor(self, "Filter")
        fmt = 0 if layout is Layout.NCHW else 1  # CUDNN_TENSOR_NCHW / CUDNN_TENSOR_NHWC
        self.call("cudnnSetFilterNdDescriptor", desc.ptr, dtype.cudnn, fmt, len(dims), _ints(dims))
        return desc

    def convolution(self, problem: ConvProblem, math: MathType) -> "Descriptor":
        desc = Descriptor(self, "Convolution")
        mode = 0 if problem.mode is ConvMode.CONVOLUTION else 1
        self.call("cudnnSetConvolutionNdDescriptor", desc.ptr, problem.spatial_dims,
                  _ints(problem.padding), _ints(problem.stride), _ints(problem.dilation), mode,
                  problem.compute_type.cudnn)
        self.call("cudnnSetConvolutionGroupCount", desc.ptr, problem.groups)
        self.call("cudnnSetConvolutionMathType", desc.ptr, math.cudnn)
        return desc

    def scaling(self, dtype: DataType, value: float):
        """alpha/beta as cuDNN wants them: double for double data, float otherwise."""
        return c_double(value) if dtype is DataType.DOUBLE else c_float(value)


class Descriptor:
    """An owned cuDNN descriptor of kind ``Tensor``, ``Filter`` or ``Convolution``."""

    def __init__(self, cudnn: Cudnn, kind: str) -> None:
        self._cudnn, self._kind = cudnn, kind
        ptr = _desc_t()
        cudnn.call(f"cudnnCreate{kind}Descriptor", byref(ptr))
        self.ptr = ptr

    def __del__(self) -> None:
        if getattr(self, "ptr", None) is not None and self.ptr.value:
            self._cudnn.lib[f"cudnnDestroy{self._kind}Descriptor"](self.ptr)
            self.ptr = None


class Handle:
    """A cuDNN handle bound to a CUDA stream."""

    def __init__(self, cudnn: Cudnn, stream_ptr: int = 0) -> None:
        self._cudnn = cudnn
        ptr = _handle_t()
        cudnn.call("cudnnCreate", byref(ptr))
        self.ptr = ptr
        cudnn.call("cudnnSetStream", self.ptr, c_void_p(stream_ptr))

    def __del__(self) -> None:
        if getattr(self, "ptr", None) is not None and self.ptr.value:
            self._cudnn.lib.cudnnDestroy(self.ptr)
            self.ptr = None


_DIRECTION_CALLS = {
    Direction.FORWARD: ("cudnnGetConvolutionForwardWorkspaceSize", "cudnnConvolutionForward"),
    Direction.BACKWARD_DATA: ("cudnnGetConvolutionBackwardDataWorkspaceSize",
                              "cudnnConvolutionBackwardData"),
    Direction.BACKWARD_FILTER: ("cudnnGetConvolutionBackwardFilterWorkspaceSize",
                                "cudnnConvolutionBackwardFilter"),
}


class ConvolutionCall:
    """Descriptors for one problem at one batch size and math type; runs one direction.

    Buffers are given as device pointers: ``x`` (input), ``w`` (filter), ``y`` (output) in forward
    terms; backward-data writes ``x`` from ``y``, backward-filter writes ``w`` from ``x`` and ``y``.
    Each tensor has the packed strides of the problem's layout, so a micro-batch of a larger
    packed tensor is just a pointer offset.
    """

    def __init__(self, cudnn: Cudnn, problem: ConvProblem, math: MathType) -> None:
        self.cudnn, self.problem, self.math = cudnn, problem, math
        self.x_desc = cudnn.tensor(problem.dtype, problem.x_shape,
                                   packed_strides(problem.x_shape, problem.layout))
        self.y_desc = cudnn.tensor(problem.dtype, problem.y_shape,
                                   packed_strides(problem.y_shape, problem.layout))
        self.w_desc = cudnn.filter(problem.dtype, problem.layout, problem.w_shape)
        self.conv_desc = cudnn.convolution(problem, math)
        self._scalars: dict[float, object] = {}

    def _scalar(self, value: float):
        # cached: the hot benchmarking loop should not build ctypes objects per call
        if value not in self._scalars:
            self._scalars[value] = self.cudnn.scaling(self.problem.dtype, value)
        return self._scalars[value]

    def workspace_size(self, handle: Handle, algo: int) -> int:
        size = c_size_t()
        (in_a, _), (in_b, _), (out, _) = self._operands(0, 0, 0)
        self.cudnn.call(_DIRECTION_CALLS[self.problem.direction][0], handle.ptr, in_a.ptr,
                        in_b.ptr, self.conv_desc.ptr, out.ptr, algo, byref(size))
        return size.value

    def run(self, handle: Handle, algo: int, x: int, w: int, y: int, workspace: int,
            workspace_size: int, beta: float = 0.0, alpha: float = 1.0) -> None:
        al = self._scalar(alpha)
        be = self._scalar(beta)
        (in_a, ptr_a), (in_b, ptr_b), (out, ptr_out) = self._operands(x, w, y)
        self.cudnn.call(_DIRECTION_CALLS[self.problem.direction][1], handle.ptr, byref(al),
                        in_a.ptr, c_void_p(ptr_a), in_b.ptr, c_void_p(ptr_b), self.conv_desc.ptr,
                        algo, c_void_p(workspace or None), c_size_t(workspace_size), byref(be),
                        out.ptr, c_void_p(ptr_out))

    def _operands(self, x: int, w: int, y: int):
        """(first input, second input, output) as (descriptor, pointer) in cuDNN's argument order."""
        d = self.problem.direction
        if d is Direction.FORWARD:
            return (self.x_desc, x), (self.w_desc, w), (self.y_desc, y)
        if d is Direction.BACKWARD_DATA:
            return (self.w_desc, w), (self.y_desc, y), (self.x_desc, x)
        return (self.x_desc, x), (self.y_desc, y), (self.w_desc, w)


def get() -> Cudnn:
    """The process-wide :class:`Cudnn` (loaded on first use)."""
    global _instance
    with _lock:
        if _instance is None:
            _instance = Cudnn()
        return _instance
