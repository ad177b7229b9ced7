"""keys.txt-style fields (``dir=fwd n=8 c=4 in=7x7 ...``) as a stub case (stub_cudnn.h): the
integers the stub's descriptor queries report, as text for key_cases or bytes for fuzz_descs.

Values wrap to int32 as a C caller's would, so hostile geometry (``pad=1100000000x1100000000``)
can be written as plainly as a real one; ``y=``, ``w=``, ``xs=``, ``ys=`` override the dims of y and
w and the strides of x and y.
"""

from __future__ import annotations

import struct

DTYPES = {"f32": 0, "f64": 1, "f16": 2, "i8": 3, "bf16": 9}
MATHS = {"default": 0, "tensor_op": 1, "tensor_op_conv": 2, "fma": 3}
DIRS = {"fwd": 0, "bwd_data": 1, "bwd_filter": 2}
FIELDS = 71  # STUB_FIELDS
X_DIMS, X_STRIDES, Y_DIMS, Y_STRIDES, W_DIMS, PAD, STRIDE, DILATION = 13, 21, 29, 37, 45, 53, 59, 65


def _int32(value: int) -> int:
    return (value + (1 << 31)) % (1 << 32) - (1 << 31)


def _dims(text: str) -> list[int]:
    return [int(v) for v in text.split("x")]


def _strides(dims: list[int], nhwc: bool, pitch: int) -> list[int]:
    """Packed strides, rows padded by `pitch` elements in NCHW (conv_driver's make_strides)."""
    rank, strides = len(dims), [0] * len(dims)
    if nhwc:
        strides[1] = 1
        strides[rank - 1] = dims[1]
        for i in range(rank - 2, 1, -1):
            strides[i] = strides[i + 1] * dims[i + 1]
        strides[0] = strides[2] * dims[2]
    else:
        strides[rank - 1] = 1
        strides[rank - 2] = dims[rank - 1] + pitch
        for i in range(rank - 3, -1, -1):
            strides[i] = strides[i + 1] * dims[i + 1]
    return strides


def encode(text: str) -> list[int]:
    """The stub case of one line of fields (defaults as in conv_driver)."""
    f = dict(token.split("=", 1) for token in text.split())
    spatial_in = _dims(f["in"])
    spatial = len(spatial_in)
    ones = "x".join(["1"] * spatial)
    n, c, k, groups = int(f.get("n", 2)), int(f.get("c", 1)), int(f.get("k", 1)), int(f.get("g", 1))
    filt, pad = _dims(f.get("f", ones)), _dims(f.get("pad", "x".join(["0"] * spatial)))
    stride, dil = _dims(f.get("stride", ones)), _dims(f.get("dil", ones))
    out = [(i + 2 * p - d * (r - 1) - 1) // s + 1 for i, p, d, r, s in zip(spatial_in, pad, dil, filt, stride)]
    x_dims = [n, c, *spatial_in]
    w_dims = _dims(f["w"]) if "w" in f else [k, c // groups, *filt]
    y_dims = _dims(f["y"]) if "y" in f else [n, k, *out]
    layout = f.get("layout", "nchw")
    pitch = 1 if layout == "padded" else 0
    x_strides = _dims(f["xs"]) if "xs" in f else _strides(x_dims, layout == "nhwc", pitch)
    y_strides = _dims(f["ys"]) if "ys" in f else _strides(y_dims, layout == "nhwc", pitch)
    dtype = DTYPES[f.get("dt", "f32")]
    values = [0] * FIELDS
    values[:13] = [DIRS[f.get("dir", "fwd")], spatial + 2, spatial + 2, spatial + 2, spatial, dtype, dtype,
                   dtype, DTYPES[f.get("ct", f.get("dt", "f32"))], MATHS[f.get("math", "fma")],
                   0 if f.get("mode", "xcorr") == "conv" else 1, groups, 1 if layout == "nhwc" else 0]
    for start, seq in ((X_DIMS, x_dims), (X_STRIDES, x_strides), (Y_DIMS, y_dims), (Y_STRIDES, y_strides),
                       (W_DIMS, w_dims), (PAD, pad), (STRIDE, stride), (DILATION, dil)):
        values[start:start + len(seq)] = seq
    return [_int32(v) for v in values]


def as_line(values: list[int]) -> str:
    return " ".join(map(str, values))


def as_bytes(values: list[int]) -> bytes:
    return struct.pack(f"<{len(values)}i", *values)
