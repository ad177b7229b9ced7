"""mucudnn for PyTorch training steps under one memory budget (docs/torch.md).

``with mucudnn.torch.session("12GiB"): loss = model(x).loss(); loss.backward()`` or
``model = mucudnn.torch.fit(model, budget="12GiB")``: every tensor autograd saves is kept, offloaded
to pinned host memory (prefetched ahead of the backward op that needs it) or recomputed from a kept
one, as a plan chosen after a first recorded step says. Unmodified scripts:
``mucudnn run --memory-budget 12GiB --offload -- python train.py``.

Importing this package does not import torch; :mod:`mucudnn.torch.planner` never does.
"""

from __future__ import annotations

__all__ = ["session", "budget", "fit", "OffloadSession"]


def session(size: str | int, **options):
    """An offload session planned for ``size`` bytes of saved tensors (no allocator cap: that
    is ``mucudnn run --memory-budget``). A context manager: the forward passes run inside it save
    their tensors under the plan for ``size`` (their backward may run inside or after it). The
    same session object across ``with`` blocks keeps its profile and plan: hold it
    (``s = session(...)``) and enter it each step; a fresh one records its first step again."""
    from .offload_session import OffloadSession

    return OffloadSession(_bytes(size), **options)


#: the earlier name of :func:`session`, kept for scripts that use it
budget = session


def fit(model, budget: str | int, **options):
    """``model`` with its forward run inside one :class:`OffloadSession` for ``budget``; the
    session is ``model.mucudnn_session`` (its ``plan``, ``profile``).

    The fitted model deep-copies, pickles (``torch.save(model)``) and round-trips its
    ``state_dict`` as the plain module does; a copy runs its own weights under a fresh session
    for the same budget and options (it records its own steps). Options are copied with it
    (functions such as ``say`` shared); one that cannot be pickled (a ``say`` lambda) makes
    pickling raise one ``FitPickleError`` naming it. Fitting a fitted model again replaces its
    session (the new budget and options; its steps are recorded afresh). A compiled model
    (``torch.compile``, ``model.compile()``, a compiled submodule) is refused with one
    ``CompiledModelError``, and so is ``torch.compile`` of a fitted model when it runs: a
    session offloads eager PyTorch only (mucudnn/torch/fitted.py, mucudnn/torch/compiled.py)."""
    from .fitted import fit as fit_model

    return fit_model(model, _bytes(budget), **options)


def _bytes(size: str | int) -> int:
    from ..budget import parse_budget

    return parse_budget(size)


def __getattr__(name):
    if name == "OffloadSession":
        from .offload_session import OffloadSession
        return OffloadSession
    if name == "CompiledModelError":
        from .compiled import CompiledModelError
        return CompiledModelError
    if name in ("FitPickleError", "FitCopyError"):
        from . import fitted
        return getattr(fitted, name)
    raise AttributeError(name)
