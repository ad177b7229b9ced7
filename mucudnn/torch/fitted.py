"""What :func:`mucudnn.torch.fit` puts on a model: a forward run inside the model's own session.

A fitted model copies and pickles as the plain module does, each copy with a session of its own:

- ``model.forward`` is a :class:`FittedForward`, an object (not a closure) holding the model and
  its session, that runs ``type(model).forward(model, ...)`` inside the session; a deep copy or a
  pickle of the model copies it with the model, so a copy's forward runs the copy's weights;
- ``model.mucudnn_session`` is a :class:`FittedSession`: an :class:`OffloadSession` that knows the
  budget and options it was made with. It never copies its state: a deep copy, a copy or an
  unpickled one is a fresh session for the same budget and options (the copy records its own
  steps and makes its own plan); the forward and ``mucudnn_session`` of the copy are that one
  session. Options are deep-copied with the model (a ``link`` or a ``trace`` list: the copy's
  own; functions, such as ``say``, are shared, as ``copy.deepcopy`` shares functions), and
  pickled with it: one that cannot be (a ``say`` lambda) is one :class:`FitPickleError` naming
  it, as pickling a plain module with a lambda attribute fails.

``state_dict``/``load_state_dict`` see neither (they are no parameters, buffers or modules).
"""

from __future__ import annotations

import copy
import pickle

from ..errors import MucudnnError
from .compiled import refuse_compiled_model, refuse_if_compiling
from .offload_session import OffloadSession


class FitPickleError(MucudnnError, pickle.PicklingError):
    """A fitted model's option cannot be pickled (``torch.save(model)``, ``pickle.dumps``)."""


class FitCopyError(MucudnnError, TypeError):
    """A fitted model's option cannot be deep-copied (``copy.deepcopy(model)``)."""


class FittedSession(OffloadSession):
    """An :class:`OffloadSession` of a fitted model: copies and pickles as a fresh session made
    with the same budget and options (see the module docstring)."""

    enters_per_forward = True

    def __init__(self, budget: int, **options):
        super().__init__(budget, **options)
        self.fit_budget, self.fit_options = budget, dict(options)

    def __copy__(self):
        return _fresh_session(self.fit_budget, self.fit_options)

    def __deepcopy__(self, memo):
        options = {}
        for name, value in self.fit_options.items():
            try:
                options[name] = copy.deepcopy(value, memo)
            except Exception as exc:  # noqa: BLE001 - one line naming the option
                raise FitCopyError(
                    f"mucudnn.torch.fit: a copy of a fitted model gets a fresh session with "
                    f"copies of its options, and {name}={value!r} cannot be copied ({exc}); "
                    f"fit the model with options that can be") from None
        return _fresh_session(self.fit_budget, options)

    def __reduce__(self):
        for name, value in self.fit_options.items():
            try:
                pickle.dumps(value)
            except Exception as exc:  # noqa: BLE001 - PicklingError, TypeError, AttributeError
                raise FitPickleError(
                    f"mucudnn.torch.fit: a fitted model pickles with its budget and options, "
                    f"and {name}={value!r} cannot be pickled ({exc}); fit it with an option "
                    "that can be (a module-level function, not a lambda), or save its "
                    "state_dict()") from None
        return (_fresh_session, (self.fit_budget, self.fit_options))


def _fresh_session(budget: int, options: dict) -> FittedSession:
    return FittedSession(budget, **options)


class FittedForward:
    """``module``'s forward (``inner`` where the module had one of its own, set on the instance)
    run inside ``session``. Plain attributes only: ``copy.deepcopy`` and pickle copy it with the
    module (their memo maps ``module`` and ``session`` to the copy's)."""

    def __init__(self, module, session: FittedSession, inner=None):
        self.module, self.session, self.inner = module, session, inner

    def __call__(self, *args, **kwargs):
        refuse_if_compiling("a model fitted by mucudnn.torch.fit")
        self.session.outer_module = self.module   # the model: aside.py's root (rule 3)
        with self.session:
            if self.inner is not None:
                return self.inner(*args, **kwargs)
            return type(self.module).forward(self.module, *args, **kwargs)

    def __repr__(self):
        return f"<mucudnn.torch fitted forward of {type(self.module).__name__}>"


def fit(model, budget: int, **options):
    """:func:`mucudnn.torch.fit` (``budget`` in bytes)."""
    refuse_compiled_model(model)
    inner = model.__dict__.get("forward")
    if isinstance(inner, FittedForward) and inner.module is model:
        inner = inner.inner   # fitted again: the new budget and options replace the old ones
    session = FittedSession(budget, **options)
    # forward before mucudnn_session, as the copy's state is made (either order works: the memo)
    model.forward = FittedForward(model, session, inner)
    model.mucudnn_session = session
    return model
