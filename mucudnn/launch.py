"""Starting a command under a memory budget (docs/shim.md, "Environment": "Memory budget"):
its environment for ``mucudnn run`` and ``mucudnn autotune``.

- PyTorch's caching allocator is limited in each Python process of the command by
  ``sitecustomize.py`` in :data:`SITE_DIR`, which the launcher puts first on PYTHONPATH
  (``_torch_site/mucudnn_torch_budget.py`` does the work, at PyTorch's lazy CUDA initialisation);
- the shim reads ``MUCUDNN_MEMORY_BUDGET`` (bytes) in the same environment;
- fragmentation: ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` unless the user set
  ``PYTORCH_CUDA_ALLOC_CONF`` (:data:`ALLOCATOR_CONF`). Under a tight budget the caching
  allocator's fixed segments fail an allocation while GiBs are reserved but free in pieces
  (measured: benchmarks/results/offload and pressure), which is what PyTorch's own
  out-of-memory message advises;
- under ``--offload``, where the user set neither of PyTorch's allocator variables
  (:data:`ALLOCATOR_CONF_NAMES`), ``MUCUDNN_PINNED_REGISTER=1``
  (unless set): the site hook adds PyTorch's options that page-lock pinned host memory on
  several threads (``mucudnn_torch_budget.pinned_register_conf``), which it can do only in the
  program's own interpreter, knowing that interpreter's PyTorch.

The budget itself (its grammar, the GPU check, the in-process :func:`~mucudnn.memory_budget`) is
:mod:`mucudnn.budget`; the workspace slack set beside it under ``--offload``, :mod:`mucudnn.slack`.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import tempfile
from pathlib import Path

from ._torch_site.mucudnn_torch_env import ENV_BUDGET, ENV_OFFLOAD, ENV_PINNED_REGISTER, ENV_REPORT
from .sizes import describe_size

#: The site directory a launched Python process imports ``sitecustomize`` from.
SITE_DIR = Path(__file__).resolve().parent / "_torch_site"


def _prepend_path(value: str | None, entry: str) -> str:
    parts = [part for part in (value or "").split(os.pathsep) if part and part != entry]
    return os.pathsep.join([entry, *parts])


#: What a budgeted command's PyTorch allocator is configured with, unless the user configured it.
ALLOCATOR_CONF = "expandable_segments:True"
#: The variables PyTorch reads its allocator configuration from (the first set wins)
ALLOCATOR_CONF_NAMES = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")

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
        owned = not any(env.get(name) for name in ALLOCATOR_CONF_NAMES)
        env.setdefault("PYTORCH_CUDA_ALLOC_CONF", ALLOCATOR_CONF)
        if offload:
            env[ENV_OFFLOAD] = "cheap" if offload == "cheap" else "1"
            if owned:
                env.setdefault(ENV_PINNED_REGISTER, "1")
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
