"""A memory budget for a process (docs/shim.md, "Environment": "Memory budget").

``mucudnn run --memory-budget 6GiB -- python train.py`` limits, without editing the script,
PyTorch's caching allocator on every GPU the program sees to the budget (through
``torch.cuda.set_per_process_memory_fraction(budget / total_memory, device)``) and the shim; how
the command is started with it is :mod:`mucudnn.launch`. Here: the budget's value
(:func:`parse_budget`, in the one size grammar), its check against the visible GPUs
(:func:`check_budget`), and :func:`memory_budget`.

What that limits is the memory the caching allocator reserves (tensors, its cache, and the cuDNN
workspaces PyTorch allocates through it): an allocation that would take the reserved total over the
budget frees cached blocks, then raises PyTorch's out-of-memory error. Not limited: the CUDA
context, memory that other libraries (NCCL, CuPy's pool, ...) allocate themselves.

:func:`memory_budget` does the same inside a running process.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import warnings

from ._torch_site.mucudnn_torch_env import ENV_BUDGET
from .environment import visible_gpus
from .errors import MucudnnError
from .launch import SITE_DIR
from .sizes import describe_size, parse_size

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
