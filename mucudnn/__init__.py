"""mucudnn: micro-batched cuDNN convolutions under a workspace limit.

The public names below are resolved on first use (PEP 562): ``import mucudnn.torch`` in a
training process loads neither the tuner stack (the store's sqlite3, YAML configs, PuLP) nor
anything else it does not use.
"""

from ._version import __version__  # noqa: F401

#: each public name and the submodule that defines it
_EXPORTS = {
    **dict.fromkeys((
        "ConfigError", "CudnnError", "EngineNameError", "InfeasibleError", "KeyFormatError",
        "LibraryNotFoundError", "MissingMeasurementsError", "MucudnnError", "PlanError",
        "SchemaVersionError", "SizeError", "StoreError"), "errors"),
    **dict.fromkeys(("Measurement", "Status"), "measurement"),
    **dict.fromkeys(("ConvProblem", "DataType", "Direction", "Layout", "MathType"), "problem"),
    **dict.fromkeys(("BudgetError", "memory_budget"), "budget"),
    **dict.fromkeys(("NetworkConfig", "find_config", "list_configs", "load_config"), "config"),
    **dict.fromkeys(("KernelPlan", "Policy", "best_plan", "pareto_plans", "solve_budget"),
                    "optimizer"),
    **dict.fromkeys(("Plan", "PlanEntry", "read_plan", "read_recording", "read_recording_weights",
                     "write_plan"), "plan"),
    **dict.fromkeys(("format_size", "parse_size"), "sizes"),
    **dict.fromkeys(("benchmark", "optimize"), "tuner"),
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        # not a public name: ``from mucudnn import tuner`` then imports the submodule
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value   # resolved once; later lookups do not reach __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
