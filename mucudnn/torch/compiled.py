"""``torch.compile`` and mucudnn.torch: refused, in one line (docs/torch.md).

A session works on eager PyTorch: saved-tensor hooks, global module hooks and a torch function
mode that record each leaf module's forward, its saved tensors, and rerun modules in the
backward. Dynamo cannot trace those hooks (it failed with an ``AssertionError`` in
``_before_module``, or retraced the session up to its recompile limit), and inside a compiled
graph there are no leaf-module calls left to record or rerun. So a compiled model is refused:

- :func:`refuse_compiled_model` (``fit``): the model, or a submodule of it, is compiled
  (``torch.compile(model)``'s ``OptimizedModule``, ``model.compile()``);
- :func:`refuse_if_compiling` (the fitted forward, the session's hooks): the call is being traced
  by dynamo (``torch.compile(fit(model))``, a compiled model run inside ``session(...)``). Raising
  while dynamo traces would not reach the user (dynamo falls back to running the frame eagerly,
  where nothing is compiling); the raise is a function ``torch.compiler.disable`` keeps out of the
  graph, so the compiled code calls it, and it raises, when it runs. Under
  ``torch.compile(..., fullgraph=True)`` dynamo refuses that call itself, with ``Unsupported``
  naming this reason.

Either way: :class:`CompiledModelError`, one line naming what works. This module imports torch.
"""

from __future__ import annotations

import torch

from ..errors import MucudnnError

#: what works, said by every refusal
WHAT_WORKS = ("mucudnn.torch offloads eager PyTorch only: fit (or run under budget) the "
              "uncompiled model, and don't compile it")


class CompiledModelError(MucudnnError, RuntimeError):
    """A model compiled with ``torch.compile`` met mucudnn.torch (fit or a session)."""


def compiled_parts(model) -> list[str]:
    """The names (``""``: the model itself) of the modules of ``model`` that are compiled: a
    ``torch.compile(module)`` wrapper (``OptimizedModule``), or a module after
    ``module.compile()``."""
    optimized = _optimized_module_type()
    found = []
    for name, module in model.named_modules(remove_duplicate=True):
        if (optimized is not None and isinstance(module, optimized)) or \
                getattr(module, "_compiled_call_impl", None) is not None:
            found.append(name)
    return found


def refuse_compiled_model(model, what: str = "mucudnn.torch.fit") -> None:
    """:class:`CompiledModelError` where ``model`` or one of its submodules is compiled."""
    parts = compiled_parts(model)
    if parts:
        where = "the model" if parts[0] == "" else f"its submodule {parts[0]!r}"
        raise CompiledModelError(
            f"{what}: {where} is compiled (torch.compile); {WHAT_WORKS}")


def refuse_if_compiling(what: str) -> None:
    """:class:`CompiledModelError` when the caller is run by code compiled with
    ``torch.compile`` (see the module docstring); a flag's read otherwise (cheap enough for
    every module hook)."""
    # torch.compiler.is_compiling() spelt out here: through an alias (a module global bound to
    # it) dynamo ran this frame eagerly after the graph break, where nothing is compiling, and
    # the refusal never came (PyTorch 2.13)
    if torch.compiler.is_compiling():
        _refuse(what)


def _optimized_module_type():
    try:
        from torch._dynamo.eval_frame import OptimizedModule
    except Exception:  # noqa: BLE001 - a PyTorch without dynamo compiles nothing
        return None
    return OptimizedModule


def _raise_refusal(what: str):
    raise CompiledModelError(f"{what} ran under torch.compile; {WHAT_WORKS}")


def _kept_out_of_graphs(function):
    disable = getattr(getattr(torch, "compiler", None), "disable", None)
    if disable is None:
        return function
    try:
        return disable(function, reason=f"mucudnn.torch refuses torch.compile: {WHAT_WORKS}")
    except TypeError:  # a PyTorch whose disable takes no reason
        return disable(function)


_refuse = _kept_out_of_graphs(_raise_refusal)
