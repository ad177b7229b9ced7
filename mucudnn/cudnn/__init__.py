"""cuDNN bindings: the library the user already has, bound with ctypes (legacy and graph API)."""

from .api import ConvolutionCall, Cudnn, get, packed_strides  # noqa: F401
from .library import candidates, load_cudnn  # noqa: F401
