"""Every ``MUCUDNN_*`` environment variable, in one table (``mucudnn env`` prints it).

The shim's rows mirror shim/src/options.c's table (tests/test_settings.py checks that both list
the same names); the others are read by this package only. Also the user's cache directory, the
one place the package keeps files of its own."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

SHIM = "shim"
PYTHON = "mucudnn"


@dataclasses.dataclass(frozen=True)
class Setting:
    name: str
    meaning: str
    default: str
    read_by: tuple[str, ...]

    @property
    def value(self) -> str | None:
        """The value in this process's environment, None where unset."""
        return os.environ.get(self.name)


SETTINGS: tuple[Setting, ...] = (
    Setting("MUCUDNN_DISABLE", "pass every call through", "0", (SHIM,)),
    Setting("MUCUDNN_PLAN", "plan file to execute, or plans (a:b, a directory of *.plan): the "
            "one made for this GPU and cuDNN", "(none)", (SHIM,)),
    Setting("MUCUDNN_WORKSPACE_LIMIT", "largest workspace offered for kernels without a plan",
            "(no limit)", (SHIM,)),
    Setting("MUCUDNN_RECORD", "file the kernels run are appended to", "(none)", (SHIM,)),
    Setting("MUCUDNN_LOG_LEVEL", "error, warning, info or debug (0-3)", "warning", (SHIM, PYTHON)),
    Setting("MUCUDNN_LOG_FILE", "log destination", "(stderr)", (SHIM,)),
    Setting("MUCUDNN_SUMMARY", "print a per-kernel summary at exit", "0", (SHIM,)),
    Setting("MUCUDNN_CUDA_GRAPHS", "launch each plan's pieces as one CUDA graph", "1", (SHIM,)),
    Setting("MUCUDNN_MEMORY_BUDGET", "GPU memory of the whole process (PyTorch's allocator; the "
            "shim keeps front points within what it has left)", "(no budget)", (SHIM, PYTHON)),
    Setting("MUCUDNN_ROOM", "choose front points within the memory free at the time", "1", (SHIM,)),
    Setting("MUCUDNN_ROOM_MARGIN", "memory kept free when choosing a front point within the room",
            "64MiB", (SHIM,)),
    Setting("MUCUDNN_ONLINE", "tune kernels without a plan on first use (`mucudnn run` without "
            "--plan sets it)", "0", (SHIM,)),
    Setting("MUCUDNN_ONLINE_DIR", "where online tuning keeps its plan file and locks",
            "$XDG_CACHE_HOME/mucudnn/online", (SHIM,)),
    Setting("MUCUDNN_ONLINE_BUDGET_MS", "milliseconds a process may spend measuring", "20000",
            (SHIM,)),
    Setting("MUCUDNN_WORKSPACE_SLACK", "percent: a front plan's call takes its point of least "
            "workspace within this much of the fastest (run and autotune --offload: 5)", "unset", (SHIM,)),
    Setting("MUCUDNN_OFFLOAD", "1: keep, offload or recompute saved tensors within the memory "
            "budget (mucudnn.torch); cheap: recompute no convolution", "0", (PYTHON,)),
    Setting("MUCUDNN_OFFLOAD_PROFILE", "file where each offload plan writes its recorded step's "
            "profile as JSON (for the planner to be replayed off the GPU)", "(none)", (PYTHON,)),
    Setting("MUCUDNN_OFFLOAD_HEADROOM", "percent (0 to 50) of the memory budget offload plans "
            "leave for the caching allocator's fragmentation", "10", (PYTHON,)),
    Setting("MUCUDNN_BUDGET_REPORT", "file the budget launcher's processes report to", "(none)",
            (PYTHON,)),
    Setting("MUCUDNN_STORE", "benchmark store", "$XDG_CACHE_HOME/mucudnn/benchmarks.sqlite",
            (PYTHON,)),
    Setting("MUCUDNN_CUDNN_INCLUDE", "directory of cudnn.h for building the shim",
            "(searched: docs/shim.md)", (PYTHON,)),
    Setting("MUCUDNN_CUDNN_LIBRARY", "cuDNN library the Python bindings load",
            "(searched: PyTorch's, a wheel's, the system's)", (PYTHON,)),
    Setting("MUCUDNN_SHIM_DIR", "where built shims are cached", "$XDG_CACHE_HOME/mucudnn/shim",
            (PYTHON,)),
)


def setting(name: str) -> Setting:
    """The row of ``name`` (KeyError for a name not in the table)."""
    for row in SETTINGS:
        if row.name == name:
            return row
    raise KeyError(name)


def user_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/mucudnn``, or ``~/.cache/mucudnn`` when that is unset or not absolute
    (the XDG spec says to ignore relative paths)."""
    base = Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser()
    if not base.is_absolute():
        base = Path("~/.cache").expanduser()
    return base / "mucudnn"


def format_settings() -> str:
    """The table as ``mucudnn env`` prints it: one block per setting."""
    lines = []
    for row in SETTINGS:
        value = row.value
        lines.append(f"{row.name} = {value if value is not None else '(unset)'}")
        lines.append(f"    {row.meaning}; default {row.default}; read by {', '.join(row.read_by)}")
    return "\n".join(lines)
