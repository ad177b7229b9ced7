"""Every ``MUCUDNN_*`` environment variable, in one table (``mucudnn env`` prints it), each with
the rule of the values it accepts (``env`` marks a value against it, and the commands that hand
the environment to a program refuse one, :func:`check_environment`).

The shim's rows mirror shim/src/options.c's table (tests/test_settings.py checks that both list
the same names and that each shim row accepts what its kind there does); the others are read by
this package only. Also the user's cache directory, the one place the package keeps files of its
own."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Callable, Mapping

from ._torch_site.mucudnn_torch_env import MAX_OFFLOAD_HEADROOM
from .errors import MucudnnError, SettingError

SHIM = "shim"
PYTHON = "mucudnn"


@dataclasses.dataclass(frozen=True)
class Rule:
    """What a setting accepts: ``accepted`` in words (options.c's ``expected_form`` for the
    shim's kinds), ``test`` whether a value is one of them."""

    accepted: str
    test: Callable[[str], bool]


def _is_size(text: str, least: int = 0) -> bool:
    from .sizes import parse_size
    try:
        return parse_size(text) >= least
    except MucudnnError:
        return False


def _is_count(text: str, most: int = 1 << 62) -> bool:
    return text.isascii() and text.isdigit() and int(text) <= most


#: the words of an on/off setting, either way (case-insensitive)
_SWITCH_WORDS = frozenset({"1", "0", "true", "false", "yes", "no", "on", "off"})

# The shim's kinds, read as options.c reads them (case-insensitive words, ASCII digits).
BOOL = Rule("1/0, true/false, yes/no or on/off", lambda text: text.lower() in _SWITCH_WORDS)
SIZE = Rule("bytes, or a number with B, KiB, MiB, GiB, TiB, KB, MB, GB or TB", _is_size)
LEVEL = Rule("error, warning, info, debug or 0-3",
             lambda text: text.lower() in {"error", "warning", "info", "debug"}
             or text in {"0", "1", "2", "3"})
COUNT = Rule("a non-negative integer", _is_count)
PATH = Rule("a path", lambda text: text != "")
# Read by this package's launched processes too (_torch_site/mucudnn_torch_budget.py).
BUDGET = Rule("a size over 0 bytes, e.g. 6GiB", lambda text: _is_size(text, least=1))
OFFLOAD = Rule("0, 1 or cheap (1/0 also as true/false, yes/no, on/off)",
               lambda text: text.strip().lower() in _SWITCH_WORDS | {"", "cheap"})
#: empty: the default directory (the user's cache's)
PLAN_CACHE = Rule("an absolute directory (~ allowed), or off",
                  lambda text: not text.strip() or text.strip().lower() == "off"
                  or Path(text).expanduser().is_absolute())
RESCUE = Rule("1/0, true/false, yes/no, on/off or always",
              lambda text: text.strip().lower() in _SWITCH_WORDS | {"", "always"})
PERCENT_50 = Rule(f"a whole percent from 0 to {MAX_OFFLOAD_HEADROOM}",
                  lambda text: not text.strip()
                  or _is_count(text.strip(), most=MAX_OFFLOAD_HEADROOM))


@dataclasses.dataclass(frozen=True)
class Setting:
    name: str
    meaning: str
    default: str
    read_by: tuple[str, ...]
    rule: Rule

    @property
    def value(self) -> str | None:
        """The value in this process's environment, None where unset."""
        return os.environ.get(self.name)

    def problem(self, value: str | None) -> str | None:
        """Why ``value`` is not accepted (what is), None where it is or it is unset (an empty
        path is none, as its readers take it)."""
        if value is None or self.rule.test(value) or (value == "" and self.rule is PATH):
            return None
        return f"expected {self.rule.accepted}"


SETTINGS: tuple[Setting, ...] = (
    Setting("MUCUDNN_DISABLE", "pass every call through", "0", (SHIM,), BOOL),
    Setting("MUCUDNN_PLAN", "plan file to execute, or plans (a:b, a directory of *.plan): the "
            "one made for this GPU and cuDNN", "(none)", (SHIM,), PATH),
    Setting("MUCUDNN_WORKSPACE_LIMIT", "largest workspace offered for kernels without a plan",
            "(no limit)", (SHIM,), SIZE),
    Setting("MUCUDNN_RECORD", "file the kernels run are appended to", "(none)", (SHIM,), PATH),
    Setting("MUCUDNN_LOG_LEVEL", "error, warning, info or debug (0-3)", "warning", (SHIM, PYTHON),
            LEVEL),
    Setting("MUCUDNN_LOG_FILE", "log destination", "(stderr)", (SHIM,), PATH),
    Setting("MUCUDNN_SUMMARY", "print a per-kernel summary at exit", "0", (SHIM,), BOOL),
    Setting("MUCUDNN_CUDA_GRAPHS", "launch each plan's pieces as one CUDA graph", "1", (SHIM,),
            BOOL),
    Setting("MUCUDNN_MEMORY_BUDGET", "GPU memory of the whole process (PyTorch's allocator; the "
            "shim keeps front points within what it has left)", "(no budget)", (SHIM, PYTHON),
            BUDGET),
    Setting("MUCUDNN_ROOM", "choose front points within the memory free at the time", "1", (SHIM,),
            BOOL),
    Setting("MUCUDNN_ROOM_MARGIN", "memory kept free when choosing a front point within the room",
            "64MiB", (SHIM,), SIZE),
    Setting("MUCUDNN_ONLINE", "tune kernels without a plan on first use (`mucudnn run` without "
            "--plan sets it)", "0", (SHIM,), BOOL),
    Setting("MUCUDNN_ONLINE_DIR", "where online tuning keeps its plan file and locks",
            "$XDG_CACHE_HOME/mucudnn/online", (SHIM,), PATH),
    Setting("MUCUDNN_ONLINE_BUDGET_MS", "milliseconds a process may spend measuring", "20000",
            (SHIM,), COUNT),
    Setting("MUCUDNN_WORKSPACE_SLACK", "percent: a front plan's call takes its point of least "
            "workspace within this much of the fastest (run and autotune --offload: 5)", "unset",
            (SHIM,), COUNT),
    Setting("MUCUDNN_WORKSPACE_HOLD", "with online tuning, an engine of more workspace runs the "
            "online front's point within this, or within 8 of its samples' worth where more "
            "(run --offload: 1/16 of the budget)", "unset", (SHIM,), SIZE),
    Setting("MUCUDNN_OFFLOAD", "1: keep, offload or recompute saved tensors within the memory "
            "budget (mucudnn.torch); cheap: recompute no convolution", "0", (PYTHON,), OFFLOAD),
    Setting("MUCUDNN_OFFLOAD_PROFILE", "file where each offload plan writes its recorded step's "
            "profile as JSON (for the planner to be replayed off the GPU)", "(none)", (PYTHON,),
            PATH),
    Setting("MUCUDNN_OFFLOAD_HEADROOM", "percent (0 to 50) of the memory budget offload plans "
            "leave for the caching allocator's fragmentation", "10", (PYTHON,), PERCENT_50),
    Setting("MUCUDNN_OFFLOAD_FREEZE_GC", "1: when the first offload plan takes over, Python's "
            "garbage collector freezes what the process holds then (gc.freeze), so that its full "
            "collections stop pausing steps; 0: leave the collector alone", "1", (PYTHON,), BOOL),
    Setting("MUCUDNN_OFFLOAD_RESCUE", "1: an op the caching allocator refuses in the first steps "
            "of an offload plan runs again once kept tensors are on the host (mucudnn.torch's "
            "rescue); always: in every planned step; 0: never", "1", (PYTHON,), RESCUE),
    Setting("MUCUDNN_OFFLOAD_LEND", "1: in planned steps, workspace is lent to the shim where "
            "the offload plan leaves room, for faster convolution points (mucudnn.torch.lend); "
            "0: none", "0", (PYTHON,), BOOL),
    Setting("MUCUDNN_OFFLOAD_STAND_ASIDE", "1: once an offload plan that keeps every saved "
            "tensor has run settled, the session removes its hooks until the model's input "
            "changes or the caching allocator flushes (mucudnn.torch.aside); 0: never", "1",
            (PYTHON,), BOOL),
    Setting("MUCUDNN_OFFLOAD_REPLAY", "1: once a planned step has found every recipe its offload "
            "plan needs, the next steps check those recipes against autograd's graph instead of "
            "recording their calls (mucudnn.torch.replay); 0: they always record", "1",
            (PYTHON,), BOOL),
    Setting("MUCUDNN_PINNED_REGISTER", "1: the site hook adds PyTorch's options that page-lock "
            "pinned host memory with cudaHostRegister on several threads (mucudnn run "
            "--offload sets it where it configured the allocator itself); 0: PyTorch's default",
            "0", (PYTHON,), BOOL),
    Setting("MUCUDNN_PLAN_CACHE", "directory of the offload plans kept between runs of a "
            "script (mucudnn.torch.plancache), or off", "$XDG_CACHE_HOME/mucudnn/offload-plans",
            (PYTHON,), PLAN_CACHE),
    Setting("MUCUDNN_BUDGET_REPORT", "file the budget launcher's processes report to", "(none)",
            (PYTHON,), PATH),
    Setting("MUCUDNN_STORE", "benchmark store", "$XDG_CACHE_HOME/mucudnn/benchmarks.sqlite",
            (PYTHON,), PATH),
    Setting("MUCUDNN_CUDNN_INCLUDE", "directory of cudnn.h for building the shim",
            "(searched: docs/shim.md)", (PYTHON,), PATH),
    Setting("MUCUDNN_CUDNN_LIBRARY", "cuDNN library the Python bindings load",
            "(searched: PyTorch's, a wheel's, the system's)", (PYTHON,), PATH),
    Setting("MUCUDNN_SHIM_DIR", "where built shims are cached", "$XDG_CACHE_HOME/mucudnn/shim",
            (PYTHON,), PATH),
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
    """The table as ``mucudnn env`` prints it: one block per setting, a value it does not accept
    marked with what it does."""
    lines = []
    for row in SETTINGS:
        value, problem = row.value, row.problem(row.value)
        lines.append(f"{row.name} = {value if value is not None else '(unset)'}"
                     + (f"  (invalid: {problem})" if problem else ""))
        lines.append(f"    {row.meaning}; default {row.default}; read by {', '.join(row.read_by)}")
    return "\n".join(lines)


def check_environment(environ: Mapping[str, str] | None = None) -> None:
    """Raise :class:`SettingError`, one line naming every ``MUCUDNN_*`` value of ``environ``
    (default this process's) that its setting does not accept, and what it accepts."""
    environ = os.environ if environ is None else environ
    found = [f"{row.name}={environ[row.name]!r} is not valid ({row.problem(environ[row.name])})"
             for row in SETTINGS if row.problem(environ.get(row.name))]
    if found:
        raise SettingError("; ".join(found) + ": fix or unset "
                           + ("them" if len(found) > 1 else "it")
                           + " (`mucudnn env` lists every setting)")
