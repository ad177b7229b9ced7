"""mucudnn: micro-batched cuDNN convolutions under a workspace limit."""

from .errors import (  # noqa: F401
    ConfigError, CudnnError, InfeasibleError, KeyFormatError, LibraryNotFoundError,
    MissingMeasurementsError, MucudnnError, PlanError, SchemaVersionError, SizeError, StoreError,
)
from .measurement import Measurement, Status  # noqa: F401
from .problem import ConvProblem, DataType, Direction, Layout, MathType  # noqa: F401

__version__ = "0.1.0"
