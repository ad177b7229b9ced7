"""The rescue (rescue.py) on the training loops users write (training_patterns.py): each case's
session arms every planned step (``rescue="always"``) and a mode below it refuses, at random
(seeded), ops the rescue may run again while something of the step can move; gradients, buffers
and losses must stay bitwise those of the plain run. Cases whose graph is dropped without a
backward (``skip_backward``) are left out: a refusal there can find the step's groups freed
before the rescue looks, and the error then rightly reaches the script."""

import inspect
import random
import sys

import pytest

torch = pytest.importorskip("torch")
if not hasattr(torch, "autograd") or not hasattr(torch.autograd, "graph"):
    pytest.skip("needs a real PyTorch", allow_module_level=True)

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import training_patterns as patterns  # noqa: E402
from mucudnn.torch import rescue  # noqa: E402
from mucudnn.torch.offload_session import OffloadSession  # noqa: E402
from mucudnn.torch.planner import KEEP, OFFLOAD, RECOMPUTE  # noqa: E402
from session_helpers import RecordingLink  # noqa: E402

#: the rescue's own handler: a refusal is made only inside it, where it is caught
HANDLER = inspect.unwrap(rescue.OomRescue.__torch_dispatch__).__code__
REFUSAL = 0.05   # the chance of each op the rescue may run again being refused once


def in_handler() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code is HANDLER:
            return True
        frame = frame.f_back
    return False


class RandomRefusals(TorchDispatchMode):
    """Refuses an op the rescue may run again, with chance :data:`REFUSAL`, where the session's
    step has something to move and the rescue is not moving it now; never the same op twice in
    a row (its rerun goes through)."""

    def __init__(self, seed: int):
        super().__init__()
        self.random = random.Random(seed)
        self.session = None
        self.moving = False
        self.last = None
        self.refused = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        session = self.session
        if session is not None and not self.moving and func is not self.last \
                and rescue.writes(func) is not None \
                and rescue.written_arguments(func, args, kwargs) is not None \
                and in_handler() and self.random.random() < REFUSAL \
                and rescue.eviction_order(session._step, session._first_unpacks,
                                          session.rescuer.pinned):
            self.last = func
            self.refused += 1
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1 B. GPU 0")
        self.last = None
        return func(*args, **kwargs)


def armed_always(make_session):
    """training_patterns.make_session with every session's rescue armed at every step, and the
    forced sessions given fixed mixes of modes (a forced session is never armed)."""
    mixes = {"keep": [KEEP], "offload": [KEEP, OFFLOAD], "recompute": [KEEP, RECOMPUTE, RECOMPUTE]}

    def made(case, model):
        if case.session in mixes:
            return model, OffloadSession(modes=mixes[case.session] * 200, link=RecordingLink(),
                                         min_bytes=0, rescue="always")
        model, session = make_session(case, model)
        if session is not None:
            session.rescuer.when = "always"
            session.rescuer.arm()
        return model, session
    return made


def under_refusals(train, refusals):
    """training_patterns.train with ``refusals`` below the session's rescue."""
    def trained(case, model, parts, session=None):
        session = session or getattr(model, "mucudnn_session", None)
        if session is None:
            return train(case, model, parts, None)
        refusals.session = session
        moves = session.rescuer.rescue

        def rescue_moving(*args):
            refusals.moving = True
            try:
                return moves(*args)
            finally:
                refusals.moving = False
        session.rescuer.rescue = rescue_moving
        with refusals:
            return train(case, model, parts, None if hasattr(model, "mucudnn_session")
                         else session)
    return trained


CASES = [case for case in map(patterns.make_case, range(40))
         if case.session not in ("stage", "fit") and "skip_backward" not in case.label]


@pytest.mark.parametrize("case", CASES, ids=[case.label for case in CASES])
def test_a_training_loop_under_random_refusals_trains_as_plain_pytorch(case, monkeypatch):
    refusals = RandomRefusals(case.seed)
    monkeypatch.setattr(patterns, "make_session", armed_always(patterns.make_session))
    monkeypatch.setattr(patterns, "train", under_refusals(patterns.train, refusals))
    outcome = patterns.run_case(case)
    assert outcome.ok, f"{outcome.verdict}: {outcome.detail} ({refusals.refused} refused)"


def test_the_random_refusals_refuse():
    """The differential above is no differential unless ops are refused and rescued."""
    refused = 0
    for case in CASES[:8]:
        refusals = RandomRefusals(case.seed)
        with pytest.MonkeyPatch.context() as monkeypatch:
            monkeypatch.setattr(patterns, "make_session", armed_always(patterns.make_session))
            monkeypatch.setattr(patterns, "train", under_refusals(patterns.train, refusals))
            assert patterns.run_case(case).ok
        refused += refusals.refused
    assert refused >= 8
