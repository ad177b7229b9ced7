"""A memory budget for a process (docs/shim.md, "Environment": "Memory budget").

``mucudnn run --memory-budget 6GiB -- python train.py`` limits, without editing the script:

- PyTorch's caching allocator on every GPU the program sees, to the budget: through
  ``torch.cuda.set_per_process_memory_fraction(budget / total_memory, device)``, queued for
  PyTorch's lazy CUDA initialisation by ``sitecustomize.py`` in :data:`SITE_DIR`, which the
  launcher puts first on PYTHONPATH (``_torch_site/mucudnn_torch_budget.py`` does the work);
- the shim: ``MUCUDNN_MEMORY_BUDGET`` (bytes) in its environment;
- fragmentation: ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` unless the user set
  ``PYTORCH_CUDA_ALLOC_CONF`` (:data:`ALLOCATOR_CONF`). Under a tight budget the caching
  allocator's fixed segments fail an allocation while GiBs are reserved but free in pieces (VGG-16
  at N = 256 under 12 GiB: 3.06 GiB asked, 3.26 GiB reserved but unallocated, with every method;
  r3d_18 at N = 32 under 6 GiB: 392 MiB asked, 838 MiB free in pieces; H200, PyTorch 2.11),
  which is what PyTorch's own out-of-memory message advises.

What that limits is the memory the caching allocator reserves (tensors, its cache, and the cuDNN
workspaces PyTorch allocates through it): an allocation that would take the reserved total over the
budget frees cached blocks, then raises PyTorch's out-of-memory error. Not limited: the CUDA
context, memory that other libraries (NCCL, CuPy's pool, ...) allocate themselves.

:func:`memory_budget` does the same inside a running process.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import shlex
import sys
import tempfile
import warnings
from pathlib import Path

from .environment import visible_gpus
from .errors import MucudnnError
from .sizes import describe_size, parse_size

SITE_DIR = Path(__file__).resolve().parent / "_torch_site"
_HOOK_NAME = "mucudnn_torch_budget"


class BudgetError(MucudnnError, ValueError):
    """A memory budget that cannot be applied (malformed, zero, more than a GPU's memory)."""


def _hook():
    """The in-process half, ``_torch_site/mucudnn_torch_budget.py``: the module sitecustomize
    already imported in a launched process, else loaded from the file under the same name."""
    module = sys.modules.get(_HOOK_NAME)
    if module is None:
        spec = importlib.util.spec_from_file_location(_HOOK_NAME, SITE_DIR / f"{_HOOK_NAME}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[_HOOK_NAME] = module
    return module


ENV_BUDGET = _hook().ENV_BUDGET
ENV_REPORT = _hook().ENV_REPORT
ENV_OFFLOAD = _hook().ENV_OFFLOAD
ENV_OFFLOAD_PROFILE = _hook().ENV_OFFLOAD_PROFILE


def parse_budget(value: str | int) -> int:
    """Bytes of a budget in the one size grammar (:func:`~mucudnn.sizes.parse_size`: ``5.6GiB`` is
    rounded down to whole bytes), more than 0."""
    budget = parse_size(value)
    if budget <= 0:
        raise BudgetError(f"memory budget {value!r} is not more than 0 bytes")
    return budget


def check_budget(budget: int) -> str | None:
    """Refuses a budget over a visible GPU's memory (:class:`BudgetError`); returns a warning
    when no GPU is visible (the command runs anyway: its processes may still see one)."""
    gpus = visible_gpus()
    if not gpus:
        return (f"memory budget {describe_size(budget)}: no GPU visible to this process "
                f"({'no CUDA driver' if gpus is None else 'the driver lists none'}); running "
                "the command anyway")
    for gpu in gpus:
        if gpu.memory is not None and budget > gpu.memory:
            raise BudgetError(f"memory budget {describe_size(budget)} is more than GPU "
                              f"{gpu.index}'s memory ({gpu.name}, {describe_size(gpu.memory)})")
    return None


def _prepend_path(value: str | None, entry: str) -> str:
    parts = [part for part in (value or "").split(os.pathsep) if part and part != entry]
    return os.pathsep.join([entry, *parts])


#: What a budgeted command's PyTorch allocator is configured with, unless the user configured it.
ALLOCATOR_CONF = "expandable_segments:True"

ENV_WORKSPACE_SLACK = "MUCUDNN_WORKSPACE_SLACK"
#: Percent: under --offload each convolution of a front plan takes its point of least workspace
#: within this much of its fastest (docs/shim.md, "The slack"). A byte of workspace at the step's
#: peak is a byte of saved tensors offloaded or recomputed, and fronts are flat near their fastest
#: point: the U-Net's 128^3 convolutions with 3^3 filters run within 0.5-1.5 % of it at half the
#: workspace (805 MB against 1.61 GB). Measured on an H200 with front plans (benchmarks/results/
#: pressure, session 13): under a 7 GiB cap the U-Net's step went from 139.0 to 114.4 ms, its plan
#: from 1.4 to 1.0 GiB offloaded each way; r3d_18's under 4.5 GiB from 112.6 to 90-109 ms (one
#: plan, several runs). 2 and 10 made the same plans as 5; the runs do not rank them.
OFFLOAD_WORKSPACE_SLACK = 5


def set_workspace_slack(env: dict, slack: int | str | None, offload: bool | str) -> None:
    """``MUCUDNN_WORKSPACE_SLACK`` in ``env``: ``slack`` percent when given, unset for ``"off"``;
    with neither, under ``offload``, :data:`OFFLOAD_WORKSPACE_SLACK` unless ``env`` has one."""
    if slack == "off":
        env.pop(ENV_WORKSPACE_SLACK, None)
    elif slack is not None:
        env[ENV_WORKSPACE_SLACK] = str(slack)
    elif offload:
        env.setdefault(ENV_WORKSPACE_SLACK, str(OFFLOAD_WORKSPACE_SLACK))


def _point_within(front, limit: int, slack: int):
    """The shim's point of ``front`` (entries by workspace ascending) under a workspace limit:
    the fastest within ``limit``, then its point of least workspace within ``slack`` percent of
    it (``mu_plan_lean_point``); None where no point fits."""
    under = [entry for entry in front if entry.workspace <= limit]
    if not under:
        return None
    fastest = min(under, key=lambda entry: entry.time_ms)
    within = fastest.time_ms * (1 + slack / 100)
    return next((entry for entry in under if entry.workspace < fastest.workspace
                 and entry.time_ms <= within), fastest)


def plan_workspace_limit(plans, slack: int) -> int | None:
    """The step's share of the slack: the least workspace limit at which the front plans'
    kernels, each at its point under the limit (:func:`_point_within`), take at most ``slack``
    percent more time in total than with no limit; None where no limit binds (none lowers the
    largest point) or a plan is no front.

    Why: the slack alone picks per kernel, and a kernel whose leaner points are more than slack
    percent slower keeps its large workspace, although the step could pay for it elsewhere.
    Under a memory cap the largest workspace requests are what the caching allocator cannot
    place in the holes it has, so it maps more and, at the cap, flushes its cache. Measured on
    an H200 (benchmarks/results/pressure, session 14), r3d_18 (N=32) under a 4.5 GiB cap, 7
    steps a probe: 100.9-109.3 ms in three runs at slack 5 alone (1.25-1.35x PyTorch's uncapped
    step), 90.7, 92.1 and 88.1 ms in three runs with this rule's 246 MiB (1.12x, 1.14x, 1.08x).
    The 3-D U-Net gets no limit: its 128^3 convolutions have no fast point under 770 MiB. Each
    kernel of a plan counts once (a plan does not say how often a step calls it), and its
    fastest point stands for the framework's engine (the shim's point is the fastest within that
    engine's workspace). The limit is the shim's hard one: it holds every convolution."""
    limits = []
    for plan in plans:
        fronts = [plan.front(key, n) for key, n in plan.kernels()]
        if not plan.is_front or not fronts:
            return None
        sizes = sorted({entry.workspace for front in fronts for entry in front})

        def total(limit):
            points = [_point_within(front, limit, slack) for front in fronts]
            return None if None in points else sum(point.time_ms for point in points)

        unlimited_points = [_point_within(front, sizes[-1], slack) for front in fronts]
        unlimited = sum(point.time_ms for point in unlimited_points)
        largest = max(point.workspace for point in unlimited_points)
        limit = next(size for size in sizes
                     if (t := total(size)) is not None and t <= unlimited * (1 + slack / 100))
        if limit >= largest:
            return None
        limits.append(limit)
    return max(limits) if limits else None


def set_plan_workspace_limit(env: dict, plan_paths, offload, say) -> None:
    """Under ``offload`` with front plans and a slack (``env``'s, after :func:`set_workspace_slack`)
    and no workspace limit given: ``MUCUDNN_WORKSPACE_LIMIT`` from :func:`plan_workspace_limit`,
    said in one line through ``say``."""
    slack = env.get(ENV_WORKSPACE_SLACK, "")
    # ASCII digits only, as the shim reads it: another value is the shim's to warn about
    if not (offload and plan_paths and slack.isascii() and slack.isdigit()) \
            or env.get("MUCUDNN_WORKSPACE_LIMIT"):
        return
    from .plan import read_plan
    limit = plan_workspace_limit([read_plan(path) for path in plan_paths], int(slack))
    if limit is not None:
        env["MUCUDNN_WORKSPACE_LIMIT"] = str(limit)
        say(f"mucudnn: workspace limit {describe_size(limit)} from the plan's fronts: its kernels "
            f"take at most {slack} % more time under it; it holds every convolution, planned or "
            "not (--workspace-limit sets another)")


@contextlib.contextmanager
def launch_env(env: dict, budget: int, command: tuple[str, ...], warn,
               offload: bool | str = False):
    """``env`` for running ``command`` under ``budget``; after the command, ``warn(text)`` once if
    no Python process of it imported torch (so only the shim had the budget). ``offload``: its
    Python processes also run mucudnn.torch's activation offload (``MUCUDNN_OFFLOAD=1``, or
    ``"cheap"``: convolutions never recomputed; and this mucudnn on PYTHONPATH after the site
    directory, for interpreters that lack it)."""
    handle, report = tempfile.mkstemp(prefix="mucudnn-budget-", suffix=".log")
    os.close(handle)
    try:
        env = dict(env)
        env[ENV_BUDGET] = str(budget)
        env[ENV_REPORT] = report
        env.setdefault("PYTORCH_CUDA_ALLOC_CONF", ALLOCATOR_CONF)
        if offload:
            env[ENV_OFFLOAD] = "cheap" if offload == "cheap" else "1"
            env["PYTHONPATH"] = _prepend_path(env.get("PYTHONPATH"), str(SITE_DIR.parent.parent))
        env["PYTHONPATH"] = _prepend_path(env.get("PYTHONPATH"), str(SITE_DIR))
        yield env
        events = Path(report).read_text().split()
        if "torch" not in events:
            warn(f"memory budget {describe_size(budget)}: no Python process of "
                 f"`{shlex.join(command)}` imported torch (or it ran with python -I/-E, which "
                 "ignore PYTHONPATH), so only the shim had the budget")
    finally:
        Path(report).unlink(missing_ok=True)


class memory_budget:  # noqa: N801 - used like a function: mucudnn.memory_budget("6GiB")
    """Limits this process to ``size`` (``"6GiB"``, bytes, ...) of GPU memory: PyTorch's caching
    allocator on every visible GPU (at once if CUDA is initialised, else at its initialisation:
    this call does not initialise CUDA) and ``MUCUDNN_MEMORY_BUDGET`` for the shim (which reads
    it at its first intercepted call) and child processes.

    Called alone it stays in force; as a context manager it undoes both at exit (fractions back to
    what ``torch.cuda.get_per_process_memory_fraction`` said, 1.0 where PyTorch has no such call).
    """

    def __init__(self, size: str | int):
        self.budget = parse_budget(size)
        try:
            import torch
        except ImportError as exc:
            raise BudgetError(f"memory_budget needs PyTorch in this process: {exc}") from None
        self._torch = torch
        cuda = torch.cuda
        self._previous_env = os.environ.get(ENV_BUDGET)
        self._previous_fractions: list[tuple[int, float]] = []
        self._lazy = None
        hook = _hook()
        if cuda.is_initialized():
            self._previous_fractions = [(device, self._fraction(device))
                                        for device in range(cuda.device_count())]
            try:
                hook.apply_budget(torch, self.budget)
            except hook.BudgetTooLarge as exc:
                raise BudgetError(str(exc)) from None
        else:
            if cuda.device_count() == 0:  # NVML where it can: no CUDA initialisation
                warnings.warn(f"memory budget {describe_size(self.budget)}: no GPU visible to "
                              "PyTorch; nothing to limit", stacklevel=2)
            self._lazy = hook.apply_lazily(torch, self.budget)
        os.environ[ENV_BUDGET] = str(self.budget)

    def _fraction(self, device: int) -> float:
        getter = getattr(self._torch.cuda, "get_per_process_memory_fraction", None)
        return float(getter(device)) if getter is not None else 1.0

    def __enter__(self) -> memory_budget:
        return self

    def __exit__(self, *exc_info) -> None:
        if self._previous_env is None:
            os.environ.pop(ENV_BUDGET, None)
        else:
            os.environ[ENV_BUDGET] = self._previous_env
        if self._lazy is not None:
            self._lazy.cancel()  # not yet run: it never will; run: undo what it applied
            self._previous_fractions = [(device, 1.0) for device, _ in self._lazy.applied]
        for device, fraction in self._previous_fractions:
            self._torch.cuda.set_per_process_memory_fraction(fraction, device)
