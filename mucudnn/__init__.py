"""mucudnn: micro-batched cuDNN convolutions under a workspace limit."""

from .errors import (  # noqa: F401
    ConfigError, CudnnError, EngineNameError, InfeasibleError, KeyFormatError, LibraryNotFoundError,
    MissingMeasurementsError, MucudnnError, PlanError, SchemaVersionError, SizeError, StoreError,
)
from .measurement import Measurement, Status  # noqa: F401
from .problem import ConvProblem, DataType, Direction, Layout, MathType  # noqa: F401
from ._version import __version__  # noqa: F401

__all__ = [
    "BudgetError", "ConfigError", "ConvProblem", "CudnnError", "DataType", "Direction",
    "EngineNameError", "InfeasibleError", "KernelPlan", "KeyFormatError", "Layout",
    "LibraryNotFoundError", "MathType", "Measurement", "MissingMeasurementsError", "MucudnnError",
    "NetworkConfig", "Plan", "PlanEntry", "PlanError", "Policy", "SchemaVersionError", "SizeError",
    "Status", "StoreError", "benchmark", "best_plan", "find_config", "format_size", "list_configs",
    "load_config", "memory_budget", "optimize", "pareto_plans", "parse_size", "read_plan", "read_recording",
    "read_recording_weights", "solve_budget", "write_plan",
]

from .budget import BudgetError, memory_budget  # noqa: F401,E402
from .config import NetworkConfig, find_config, list_configs, load_config  # noqa: F401,E402
from .optimizer import KernelPlan, Policy, best_plan, pareto_plans, solve_budget  # noqa: F401,E402
from .plan import (Plan, PlanEntry, read_plan, read_recording, read_recording_weights,  # noqa: F401,E402
                   write_plan)
from .sizes import format_size, parse_size  # noqa: F401,E402
from .tuner import benchmark, optimize  # noqa: F401,E402
