"""mucudnn.torch.lend: workspace lent to the shim where the plan in force leaves room (its points
from the plan's model, on CPU torch; the shim's side is tests/shim/test_shim_lend.py)."""

import copy
import threading

import pytest

torch = pytest.importorskip("torch")
if not hasattr(torch, "autograd") or not hasattr(torch.autograd, "graph"):
    pytest.skip("needs a real PyTorch", allow_module_level=True)

from mucudnn.torch import planner  # noqa: E402
from mucudnn.torch.lend import LEND_ROUND, WorkspaceLender, lend_points  # noqa: E402
from mucudnn.torch.offload_session import OffloadSession  # noqa: E402
from mucudnn.torch.planner import KEEP  # noqa: E402
from session_helpers import (  # noqa: E402
    assert_bitwise, batches, RecordingLink, saved_bytes, small_cnn, train)
from test_planner import chain_profile  # noqa: E402

MiB = 2**20


def test_a_lend_goes_where_the_model_has_room_until_the_next_point():
    # kept groups of 8, 8, 2, 2 MiB: 8, 16, 18, 20 MiB at the forward's points; 20, 18, 16, 8 at
    # the backward's (each group gone after its one unpack)
    profile = chain_profile([8 * MiB, 8 * MiB, 2 * MiB, 2 * MiB])
    forward, backward = planner.memory_at_points(profile, [KEEP] * 4, 2)
    assert (forward, backward) == ([8 * MiB, 16 * MiB, 18 * MiB, 20 * MiB],
                                   [20 * MiB, 18 * MiB, 16 * MiB, 8 * MiB])
    # room below 24 MiB until the next point: forward 8, 6, 4 (none after the last); backward
    # 4, 6, 8, and 16 to the backward's end
    lends = lend_points(profile, [KEEP] * 4, 2, 0.0, 24 * MiB, most=6 * MiB, least=1)
    assert (lends.size, lends.forward, lends.backward) == (6 * MiB, {0, 1}, {1, 2, 3})
    # never more than the most room anywhere, and only where that much is
    lends = lend_points(profile, [KEEP] * 4, 2, 0.0, 24 * MiB, most=100 * MiB, least=1)
    assert (lends.size, lends.forward, lends.backward) == (16 * MiB, set(), {3})
    # whole multiples of LEND_ROUND; none under the least worth lending
    assert lend_points(profile, [KEEP] * 4, 2, 0.0, 24 * MiB, most=5 * MiB, least=1).size == 4 * MiB
    assert LEND_ROUND == 2 * MiB
    assert lend_points(profile, [KEEP] * 4, 2, 0.0, 24 * MiB, most=100 * MiB, least=17 * MiB) is None
    assert lend_points(profile, [KEEP] * 4, 2, 0.0, 8 * MiB, most=100 * MiB, least=1) is None  # no room


class FakeShim:
    """Stands in for the preloaded shim's two functions; logs each lend with its thread."""

    def __init__(self, held):
        self.held, self.calls = held, []

    def mucudnn_lend_workspace(self, ptr, size, stream):
        self.calls.append((ptr, size, threading.get_ident()))
        return 0

    def mucudnn_held_workspace(self):
        return self.held


def lending_session(model, data, shim, **options):
    session = OffloadSession(budget=int(saved_bytes(model, data) * 0.8), link=RecordingLink(),
                             min_bytes=0, headroom=0.0, trials=False, **options)
    session.lender = WorkspaceLender(library=shim, least=1)
    return session


def test_a_planned_step_lends_at_its_plans_points_and_trains_as_the_plain_step(monkeypatch):
    monkeypatch.setattr("mucudnn.torch.lend.LEND_ROUND", 1)
    model, data = small_cnn(torch.float64), batches(torch.float64, 5)
    reference = train(copy.deepcopy(model), data)
    shim = FakeShim(held=40_000)     # a fifth of the budget: room for it at several points
    session = lending_session(model, data, shim)
    assert_bitwise(reference, train(model, data, session))
    plan = session.lender.plan
    assert plan is not None and plan.size == 40_000 and plan.forward and plan.backward, plan
    # the plan's lends checked against its model (rule 1)
    forward, backward = planner.memory_at_points(session.profile, session.modes,
                                                 session.prefetch_distance,
                                                 session.prefetch_margin)
    for t in plan.forward:
        assert max(forward[t], forward[t + 1]) + plan.size <= session.lender.limit
    for i in plan.backward:
        assert max(backward[i:i + 2]) + plan.size <= session.lender.limit
    # lent in the planned steps only (the recording steps lend nothing), one size, each lend
    # withdrawn before the step ends
    lent = [c for c in shim.calls if c[0] is not None]
    assert lent and all(size == plan.size for _, size, _ in lent)
    assert shim.calls[-1][:2] == (None, 0)
    planned_steps = len(data) - planner.RECORD_STEPS    # the plan, made inline, from step 3
    points = len(plan.forward) + len(plan.backward)
    assert session.lender.lends >= planned_steps > 0
    assert len(lent) == planned_steps * points


def test_no_lend_without_the_shim_or_where_the_allocator_refuses(monkeypatch):
    model, data = small_cnn(torch.float64), batches(torch.float64, 4)
    reference = train(copy.deepcopy(model), data)
    session = OffloadSession(budget=int(saved_bytes(model, data) * 0.8), link=RecordingLink(),
                             min_bytes=0, headroom=0.0, trials=False)
    assert session.lender.plan is None   # this process has no shim, and lends are off
    assert WorkspaceLender(library=FakeShim(held=1 << 40), on=False).plan_for(
        session.profile, [], 2, 0.0, 1 << 40, 1 << 40) is None
    assert_bitwise(reference, train(model, data, session))
    assert session.lender.plan is None and session.lender.lends == 0

    class Refused(WorkspaceLender):
        @staticmethod
        def _allocate(size, device):
            raise torch.OutOfMemoryError("no room for a lend")

    monkeypatch.setattr("mucudnn.torch.lend.LEND_ROUND", 1)
    model, data = small_cnn(torch.float64), batches(torch.float64, 4)
    shim = FakeShim(held=1 << 40)
    session = lending_session(model, data, shim)
    session.lender = Refused(library=shim, least=1)
    assert_bitwise(reference, train(model, data, session))
    assert session.lender.lends == 0 and not [c for c in shim.calls if c[0] is not None]


def test_a_plan_lends_no_more_once_the_allocator_flushed_while_a_buffer_was_lent(monkeypatch):
    """Rule 5: a flush costs a step more than the lends save; that flush is the lender's, so the
    lifecycle does not lower the plan for it; the step trains as ever."""
    monkeypatch.setattr("mucudnn.torch.lend.LEND_ROUND", 1)
    flushes = []

    class Flushing(WorkspaceLender):
        def _flushes(self, device):   # the allocator flushes at each lend
            return len(flushes)

        def _allocate(self, size, device):
            flushes.append(size)
            return super()._allocate(size, device)

    class FlushCounting(RecordingLink):
        def flushes(self):
            return len(flushes)

    model, data = small_cnn(torch.float64), batches(torch.float64, 3 + planner.TRIAL_STEPS)
    reference = train(copy.deepcopy(model), data)
    shim, said = FakeShim(held=40_000), []
    session = OffloadSession(budget=int(saved_bytes(model, data) * 0.8), link=FlushCounting(),
                             min_bytes=0, headroom=0.0, say=said.append)
    session.lender = Flushing(library=shim, least=1)
    assert_bitwise(reference, train(model, data, session))
    # one buffer lent, in the first planned step; that plan lent no more, and was not lowered
    assert session.lender.lends == 1 and session.lender.stopped == 1 and len(flushes) == 1
    assert session.lender.plan is None
    assert session.lender.flushes_not_lent(len(flushes)) == 0
    assert not [line for line in said if "flush" in line], said
