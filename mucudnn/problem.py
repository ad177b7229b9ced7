"""Convolution problems and their kernel keys (docs/kernel-key.md).

A :class:`ConvProblem` is one convolution kernel: a forward geometry, a direction and a data type. The
mini-batch size ``n`` travels with it but is not part of :attr:`ConvProblem.key`: the store and the
plan file keep N beside the key, and micro-batches of one kernel share the key.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import Iterable

from .errors import KeyFormatError


class Direction(str, enum.Enum):
    FORWARD = "fwd"
    BACKWARD_DATA = "bwd_data"
    BACKWARD_FILTER = "bwd_filter"


class DataType(str, enum.Enum):
    FLOAT = "f32"
    DOUBLE = "f64"
    HALF = "f16"
    BFLOAT16 = "bf16"

    @property
    def itemsize(self) -> int:
        return {"f32": 4, "f64": 8, "f16": 2, "bf16": 2}[self.value]

    @property
    def cudnn(self) -> int:
        """The ``cudnnDataType_t`` value."""
        return {"f32": 0, "f64": 1, "f16": 2, "bf16": 9}[self.value]


class MathType(str, enum.Enum):
    DEFAULT = "default"
    TENSOR_OP = "tensor_op"
    TENSOR_OP_ALLOW_CONVERSION = "tensor_op_conv"
    FMA = "fma"

    @property
    def cudnn(self) -> int:
        """The ``cudnnMathType_t`` value."""
        return {"default": 0, "tensor_op": 1, "tensor_op_conv": 2, "fma": 3}[self.value]


class Layout(str, enum.Enum):
    NCHW = "nchw"  # channels first (NCDHW in 3-D)
    NHWC = "nhwc"  # channels last (NDHWC in 3-D)


class ConvMode(str, enum.Enum):
    CROSS_CORRELATION = "xcorr"
    CONVOLUTION = "conv"


# Algorithm names per direction, in cudnnConvolution*Algo_t value order (docs/plan-format.md).
ALGORITHMS: dict[Direction, tuple[str, ...]] = {
    Direction.FORWARD: (
        "implicit_gemm", "implicit_precomp_gemm", "gemm", "direct",
        "fft", "fft_tiling", "winograd", "winograd_nonfused",
    ),
    Direction.BACKWARD_DATA: (
        "algo_0", "algo_1", "fft", "fft_tiling", "winograd", "winograd_nonfused",
    ),
    Direction.BACKWARD_FILTER: (
        "algo_0", "algo_1", "fft", "algo_3", "winograd", "winograd_nonfused", "fft_tiling",
    ),
}


def algorithm_value(direction: Direction, name: str) -> int:
    """The cuDNN enum value of an algorithm name; ``KeyError`` names the valid choices."""
    try:
        return ALGORITHMS[direction].index(name)
    except ValueError:
        raise KeyError(
            f"unknown {direction.value} algorithm {name!r}; expected one of "
            + ", ".join(ALGORITHMS[direction])
        ) from None


def _join(values: Iterable[int]) -> str:
    return "x".join(str(int(v)) for v in values)


#: The largest integer a key holds (cuDNN's descriptors take int; docs/kernel-key.md).
KEY_INT_MAX = (1 << 31) - 1

_ENUM_FIELDS: dict[str, type[enum.Enum]] = {
    "direction": Direction, "dtype": DataType, "compute_type": DataType, "math": MathType,
    "layout": Layout, "mode": ConvMode,
}


@dataclasses.dataclass(frozen=True)
class ConvProblem:
    """One convolution kernel. Spatial tuples have 2 (H, W) or 3 (D, H, W) entries."""

    direction: Direction
    c: int
    input_size: tuple[int, ...]
    k: int
    filter_size: tuple[int, ...]
    padding: tuple[int, ...]
    stride: tuple[int, ...]
    dilation: tuple[int, ...]
    groups: int = 1
    dtype: DataType = DataType.FLOAT
    compute_type: DataType = DataType.FLOAT
    math: MathType = MathType.FMA
    layout: Layout = Layout.NCHW
    mode: ConvMode = ConvMode.CROSS_CORRELATION
    n: int = 1

    def __post_init__(self) -> None:
        for name, enum_type in _ENUM_FIELDS.items():
            value = getattr(self, name)
            if not isinstance(value, enum_type):
                try:
                    object.__setattr__(self, name, enum_type(value))
                except ValueError:
                    raise ValueError(
                        f"{name}: {value!r} is not one of "
                        + ", ".join(m.value for m in enum_type)
                    ) from None
        for name in ("input_size", "filter_size", "padding", "stride", "dilation"):
            object.__setattr__(self, name, tuple(int(v) for v in getattr(self, name)))
        d = len(self.input_size)
        if d not in (2, 3):
            raise ValueError(f"input_size: 2 or 3 spatial dims expected, got {d}")
        for name in ("filter_size", "padding", "stride", "dilation"):
            if len(getattr(self, name)) != d:
                raise ValueError(f"{name}: {d} values expected (one per spatial dim)")
        for name in ("c", "k", "groups", "n"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if any(v < 1 for v in self.input_size + self.filter_size + self.stride + self.dilation):
            raise ValueError("input_size, filter_size, stride and dilation must be >= 1")
        if any(p < 0 for p in self.padding):
            raise ValueError("padding must be >= 0")
        if self.c % self.groups or self.k % self.groups:
            raise ValueError(f"c={self.c} and k={self.k} must be multiples of groups={self.groups}")
        if any(o < 1 for o in self.output_size):
            raise ValueError(f"the output would be empty (output size {self.output_size})")

    # -- geometry -------------------------------------------------------------------------------
    @property
    def spatial_dims(self) -> int:
        return len(self.input_size)

    @property
    def output_size(self) -> tuple[int, ...]:
        return tuple(
            (i + 2 * p - d * (f - 1) - 1) // s + 1
            for i, f, p, s, d in zip(self.input_size, self.filter_size, self.padding,
                                     self.stride, self.dilation)
        )

    @property
    def x_shape(self) -> tuple[int, ...]:
        """Forward input dims in NC(D)HW order (the logical order cuDNN descriptors take)."""
        return (self.n, self.c, *self.input_size)

    @property
    def w_shape(self) -> tuple[int, ...]:
        return (self.k, self.c // self.groups, *self.filter_size)

    @property
    def y_shape(self) -> tuple[int, ...]:
        return (self.n, self.k, *self.output_size)

    @property
    def flops(self) -> int:
        """Multiply-adds x 2 of the forward convolution (the same count for each direction)."""
        per_out = 2 * (self.c // self.groups)
        for f in self.filter_size:
            per_out *= f
        out = self.n * self.k
        for o in self.output_size:
            out *= o
        return per_out * out

    @property
    def written_sample_bytes(self) -> int:
        """Bytes per sample of the tensor this direction writes along N: y for forward, x for
        backward-data; 0 for backward-filter, whose output (the filter gradient) has no N."""
        if self.direction is Direction.FORWARD:
            return math.prod(self.y_shape[1:]) * self.dtype.itemsize
        if self.direction is Direction.BACKWARD_DATA:
            return math.prod(self.x_shape[1:]) * self.dtype.itemsize
        return 0

    def with_n(self, n: int) -> "ConvProblem":
        return dataclasses.replace(self, n=n)

    def with_direction(self, direction: Direction | str) -> "ConvProblem":
        return dataclasses.replace(self, direction=Direction(direction))

    # -- key ------------------------------------------------------------------------------------
    @property
    def key(self) -> str:
        return (
            f"dir={self.direction.value},dt={self.dtype.value},ct={self.compute_type.value},"
            f"math={self.math.value},layout={self.layout.value},c={self.c},"
            f"in={_join(self.input_size)},k={self.k},f={_join(self.filter_size)},"
            f"pad={_join(self.padding)},stride={_join(self.stride)},dil={_join(self.dilation)},"
            f"g={self.groups},mode={self.mode.value}"
        )

    @classmethod
    def from_key(cls, key: str, n: int = 1) -> "ConvProblem":
        """Parse a key built by :attr:`key` or by the shim; :class:`KeyFormatError` says why not."""
        names = ("dir", "dt", "ct", "math", "layout", "c", "in", "k", "f", "pad", "stride",
                 "dil", "g", "mode")
        parts = key.strip().split(",")
        if len(parts) != len(names):
            raise KeyFormatError(f"kernel key {key!r}: expected {len(names)} fields "
                                 f"({','.join(names)}), got {len(parts)}")
        fields: dict[str, str] = {}
        for part, want in zip(parts, names):
            name, sep, value = part.partition("=")
            if not sep or name != want or not value:
                raise KeyFormatError(f"kernel key {key!r}: field {want}= expected, got {part!r}")
            fields[name] = value

        def fail(name: str, why: str) -> KeyFormatError:
            return KeyFormatError(f"kernel key {key!r}: {name}={fields[name]!r} {why}")

        def ints(name: str) -> tuple[int, ...]:
            texts = fields[name].split("x")
            try:
                values = tuple(int(v) for v in texts)
            except ValueError:
                values = ()
            # Only the canonical form: int() also takes '+4', '1_0', '04', which the shim never
            # writes and which would re-serialise to another key. cuDNN takes int: at most INT32_MAX.
            if [str(v) for v in values] != texts or any(v > KEY_INT_MAX for v in values):
                raise fail(name, f"is not x-joined integers (canonical, at most {KEY_INT_MAX})")
            return values

        def one_int(name: str) -> int:
            values = ints(name)
            if len(values) != 1:
                raise fail(name, "is not one integer")
            return values[0]

        def choice(name: str, enum_type: type[enum.Enum]):
            try:
                return enum_type(fields[name])
            except ValueError:
                raise fail(name, "is not one of " + ", ".join(m.value for m in enum_type)) from None

        parsed = dict(
            direction=choice("dir", Direction), dtype=choice("dt", DataType),
            compute_type=choice("ct", DataType), math=choice("math", MathType),
            layout=choice("layout", Layout), c=one_int("c"), input_size=ints("in"),
            k=one_int("k"), filter_size=ints("f"), padding=ints("pad"), stride=ints("stride"),
            dilation=ints("dil"), groups=one_int("g"), mode=choice("mode", ConvMode),
        )
        try:
            return cls(**parsed, n=n)
        except ValueError as exc:  # geometry: dims, ranges, groups (the message names the field)
            raise KeyFormatError(f"kernel key {key!r}: {exc}") from None

    def __str__(self) -> str:
        return f"{self.key} n={self.n}"
