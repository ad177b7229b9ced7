"""mucudnn for PyTorch training steps under one memory budget (docs/torch.md).

``with mucudnn.torch.budget("12GiB"): loss = model(x).loss(); loss.backward()`` or
``model = mucudnn.torch.fit(model, budget="12GiB")``: every tensor autograd saves is kept, offloaded
to pinned host memory (prefetched ahead of the backward op that needs it) or recomputed from a kept
one, as a plan chosen after a first recorded step says. Unmodified scripts:
``mucudnn run --memory-budget 12GiB --offload -- python train.py``.

Importing this package does not import torch; :mod:`mucudnn.torch.planner` never does.
"""

from __future__ import annotations

__all__ = ["budget", "fit", "OffloadSession"]

def budget(size: str | int, **options):
    """A context manager: the forward passes run inside it save their tensors under the plan
    for ``size`` (their backward may run inside or after it). The same session object across
    ``with`` blocks keeps its profile and plan: hold it (``session = budget(...)``) and enter it
    each step; a fresh one records its first step again."""
    from .runtime import OffloadSession

    return OffloadSession(_bytes(size), **options)


def fit(model, budget: str | int, **options):
    """``model`` with its forward run inside one :class:`OffloadSession` for ``budget``; the
    session is ``model.mucudnn_session`` (its ``plan``, ``profile``)."""
    from .runtime import OffloadSession

    session = OffloadSession(_bytes(budget), **options)
    original = model.forward

    def forward(*args, **kwargs):
        with session:
            return original(*args, **kwargs)

    model.forward = forward
    model.mucudnn_session = session
    return model


def _bytes(size: str | int) -> int:
    from ..budget import parse_budget

    return parse_budget(size)


def __getattr__(name):
    if name == "OffloadSession":
        from .runtime import OffloadSession
        return OffloadSession
    raise AttributeError(name)
