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


# -- a review's findings (CPU stand-ins for the device calls) --------------------------------------

from mucudnn.torch.planner import OFFLOAD  # noqa: E402
from test_planner import chain_profile as chain  # noqa: E402


class StandIn:
    """A lent buffer's stand-in (no GPU here): its device and address."""

    def __init__(self, device, ptr):
        self.device, self.ptr = torch.device(device), ptr

    def data_ptr(self):
        return self.ptr


def cuda_lender(monkeypatch, shim, allocations, flushes=None, streams=None):
    """A lender whose device calls are stand-ins: nothing allocated, each device's current
    stream from ``streams`` and its allocator's flush count from ``flushes`` (by index)."""
    flushes = flushes if flushes is not None else {}
    streams = streams if streams is not None else {}
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 0)

    class Stream:
        def __init__(self, number):
            self.cuda_stream = number
    monkeypatch.setattr(torch.cuda, "current_stream",
                        lambda device=None: Stream(streams.get(torch.device(device).index, 0)))

    class Lender(WorkspaceLender):
        def _allocate(self, size, device):
            allocations.append((device, streams.get(device.index, 0)))
            return StandIn(device, 0x1000 * len(allocations))

        def _flushes(self, device):
            return flushes.get(torch.device(device).index, 0)
    return Lender(library=shim, least=1)


def chain_plan(lender, modes=(KEEP,) * 4):
    profile = chain([8 * MiB, 8 * MiB, 2 * MiB, 2 * MiB])
    return profile, lender.plan_for(profile, list(modes), 2, 0.0, 30 * MiB, MiB)


def test_a_buffer_is_lent_on_its_own_device_and_stream_only(monkeypatch):
    """Rule 3: a point on another device or stream is lent a buffer of its own (a buffer's
    reuse after its free is ordered on the stream it was allocated on)."""
    shim, allocations, streams = FakeShim(held=6 * MiB), [], {0: 100, 1: 200}
    lender = cuda_lender(monkeypatch, shim, allocations, streams=streams)
    _, plan = chain_plan(lender)
    assert {0, 1} <= plan.forward, plan
    lender.at_point(plan.forward, 0, torch.device("cuda:0"))
    lender.at_point(plan.forward, 1, torch.device("cuda:1"))
    streams[1] = 300
    lender.at_point(plan.forward, 1, torch.device("cuda:1"))
    assert allocations == [(torch.device("cuda:0"), 100), (torch.device("cuda:1"), 200),
                           (torch.device("cuda:1"), 300)]
    lent = [ptr for ptr, _, _ in shim.calls]
    assert lent == [0x1000, None, 0x2000, None, 0x3000]   # each withdrawn before the next


def test_flushes_are_the_lenders_per_device_and_stop_a_plan_for_the_run(monkeypatch):
    """Rule 5: a flush while lent, or in a refused allocation, is the lender's on its device
    only (another device's count never goes down); the plan lends no more, also when a trial
    runs it again after another."""
    shim, flushes = FakeShim(held=6 * MiB), {0: 0, 1: 0}
    lender = cuda_lender(monkeypatch, shim, [], flushes=flushes)
    profile, plan = chain_plan(lender)
    lender.at_point(plan.forward, 0, torch.device("cuda:0"))
    flushes[0] += 1
    assert lender.flushes_not_lent(1, torch.device("cuda:0")) == 0   # while lent
    lender.withdraw()
    assert lender.flushes_not_lent(1, torch.device("cuda:0")) == 0
    assert lender.flushes_not_lent(0, torch.device("cuda:1")) == 0
    assert lender.stopped == 1 and lender.plan is None
    other = [OFFLOAD] + [KEEP] * 3
    assert lender.plan_for(profile, other, 2, 0.0, 30 * MiB, MiB) is not None
    assert lender.plan_for(profile, [KEEP] * 4, 2, 0.0, 30 * MiB, MiB) is None

    def refused(size, device):   # the allocator flushes, then refuses
        flushes[1] += 1
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 6.00 MiB")
    plan = lender.plan_for(profile, other, 2, 0.0, 30 * MiB, MiB)
    lender._allocate = refused
    lender.at_point(plan.forward, 0, torch.device("cuda:1"))
    assert lender.plan is None and lender.stopped == 2
    assert lender.flushes_not_lent(1, torch.device("cuda:1")) == 0
    assert lender.flushes_not_lent(1, torch.device("cuda:0")) == 0


def test_a_lend_is_allocated_past_the_sessions_modes_and_an_abandoned_step_withdraws_it(
        monkeypatch):
    """The rescue's dispatch mode (armed in a plan's first steps, where lends start) would move
    the step's tensors for a lend the allocator refused, and the op recorder would record it:
    neither, nor any other mode, sees the allocation. And a step whose graph was dropped without
    a backward withdraws its lend as it ends."""
    from torch.utils._python_dispatch import TorchDispatchMode
    monkeypatch.setattr("mucudnn.torch.lend.LEND_ROUND", 1)

    class SeesLends(TorchDispatchMode):
        seen = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is torch.ops.aten.empty.memory_format and list(args[0]) == [40_000] and \
                    kwargs.get("dtype") == torch.uint8:
                self.seen += 1
            return func(*args, **kwargs)

    model, data = small_cnn(torch.float64), batches(torch.float64, 5)
    shim = FakeShim(held=40_000)
    session = lending_session(model, data, shim, rescue="always", trace=[])
    session.lender = WorkspaceLender(library=shim, least=1)
    with SeesLends() as sees:
        train(model, data, session)
    assert session.lender.lends > 0 and sees.seen == 0
    assert session.lender.plan is not None and 0 in session.lender.plan.forward
    with session:
        model[:3](data[0][0])        # a partial forward (grad enabled), its graph dropped
    assert session.lender._buffer is not None
    with session:                    # a leaf module starts the next step
        model[12](torch.zeros(1, 16, 1, 1, dtype=torch.float64))
    assert any(event[0] == "abandoned" for event in session.trace)
    assert session.lender._buffer is None and shim.calls[-1][:2] == (None, 0)


def test_an_op_refused_while_a_buffer_is_lent_gets_that_buffer_first(monkeypatch):
    """The rescue (armed in a plan's first steps) gives the lend back before it moves any of the
    step's tensors; the op runs again, the step is no rescued one, and the plan lends no more."""
    from torch.utils._python_dispatch import TorchDispatchMode
    monkeypatch.setattr("mucudnn.torch.lend.LEND_ROUND", 1)
    model, data = small_cnn(torch.float64), batches(torch.float64, 5)
    reference = train(copy.deepcopy(model), data)
    shim, said, trace = FakeShim(held=40_000), [], []
    session = lending_session(model, data, shim, rescue="always", say=said.append, trace=trace)

    class RefusedWhileLent(TorchDispatchMode):
        refused = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten.convolution.default and session.lender._buffer is not None:
                self.refused += 1
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB.")
            return func(*args, **(kwargs or {}))

    with RefusedWhileLent() as refuses:
        assert_bitwise(reference, train(model, data, session))
    assert refuses.refused == 1 and session.lender.stopped == 1 and session.lender.lends == 1
    assert not [event for event in trace if event[0] == "rescue"]   # nothing moved
    assert [line for line in said if "lent to the shim" in line and "given back" in line]
    assert not [line for line in said if "moved to the host" in line]
