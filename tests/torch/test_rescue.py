"""mucudnn.torch's rescue of a step that runs out of device memory (rescue.py), on CPU torch: a
mode below the session's refuses an op as the caching allocator would (``torch.OutOfMemoryError``
with its message) until the session has moved enough of the step off the device. The step must
go on and its gradients and buffers be bitwise those of a plain run; what cannot be rescued
raises as PyTorch does; the mode is on the op stack only in armed steps and never outlives the
session's ``with``."""

import copy
import inspect

import pytest

torch = pytest.importorskip("torch")
if not hasattr(torch, "autograd") or not hasattr(torch.autograd, "graph"):
    pytest.skip("needs a real PyTorch", allow_module_level=True)

from torch import nn  # noqa: E402
from torch.utils._python_dispatch import (TorchDispatchMode,  # noqa: E402
                                          _get_current_dispatch_mode_stack)

from mucudnn.torch import rescue  # noqa: E402
from mucudnn.torch.offload_session import OffloadSession  # noqa: E402
from mucudnn.torch.planner import KEEP, OFFLOAD, RECOMPUTE  # noqa: E402
from session_helpers import (RecordingLink, assert_bitwise, batches, saved_bytes,  # noqa: E402
                             small_cnn, train)

CONV_BACKWARD = torch.ops.aten.convolution_backward.default
CONV = torch.ops.aten.convolution.default
BATCH_NORM = torch.ops.aten.native_batch_norm.default


class Refuses(TorchDispatchMode):
    """The caching allocator in miniature: ``op`` is refused, in the session's steps ``steps``
    after it has run ``after`` times in that step, until the step has moved ``needed`` bytes to
    the host (``needed`` None: always; a function: what it returns then)."""

    def __init__(self, session, op, steps=(0,), after=0, needed=1, asked="2.00 MiB"):
        super().__init__()
        self.session, self.op, self.steps, self.after, self.needed = \
            session, op, steps, after, needed
        self.asked = asked
        self.calls, self.refused = {}, 0

    def refuses(self, func) -> bool:
        """Whether this call of ``func`` is refused (each call counted)."""
        step = self.session.steps
        if func is not self.op or step not in self.steps:
            return False
        seen = self.calls[step] = self.calls.get(step, 0) + 1
        needed = self.needed() if callable(self.needed) else self.needed
        return seen > self.after and (needed is None or self.session._step.rescued < needed)

    def refusal(self):
        self.refused += 1
        return torch.OutOfMemoryError(
            f"CUDA out of memory. Tried to allocate {self.asked}. GPU 0 has a total "
            "capacity of 79.18 GiB of which 70.00 GiB is free. 5.00 GiB allowed")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.refuses(func):
            raise self.refusal()
        return func(*args, **(kwargs or {}))


def kept_session(trace, said, **options):
    return OffloadSession(modes=[KEEP] * 64, link=RecordingLink(), min_bytes=0, trace=trace,
                          say=said.append, **options)


def armed_steps(model, data, session, after_each=None) -> list:
    """Trains ``model`` on ``data`` under ``session`` (``after_each()`` after every step):
    whether each step was armed."""
    armed = []
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)   # as train()'s
    for x, y in data:
        optimizer.zero_grad()
        with session:
            loss = nn.functional.cross_entropy(model(x), y)
            armed.append(session.rescuer.armed)   # decided at the step's first module
        loss.backward()
        optimizer.step()
        if after_each is not None:
            after_each()
    return armed


def test_the_allocators_message_says_what_was_asked():
    assert rescue.asked_bytes("Tried to allocate 564.00 MiB. GPU 0") == 564 << 20
    assert rescue.asked_bytes("Tried to allocate 2.11 GiB.") == int(2.11 * 2**30)
    assert rescue.asked_bytes("out of memory") == rescue.DEFAULT_ASK


@pytest.mark.parametrize("where", ["backward outside the with", "backward inside the with"])
def test_an_op_refused_in_the_backward_runs_again_once_kept_tensors_moved(where):
    dtype = torch.float64
    model, data = small_cnn(dtype), batches(dtype, 3)
    reference = train(copy.deepcopy(model), data)
    trace, said = [], []
    session = kept_session(trace, said)
    refuses = Refuses(session, CONV_BACKWARD, steps=(0, 2), after=1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    results = []
    with refuses:
        for x, y in data:
            optimizer.zero_grad()
            with session:
                loss = nn.functional.cross_entropy(model(x), y)
                if where == "backward inside the with":
                    loss.backward()
            if where == "backward outside the with":
                loss.backward()
            results.append([p.grad.clone() for p in model.parameters()] +
                           [b.clone() for b in model.buffers()])
            optimizer.step()
    assert_bitwise(reference, results)
    assert refuses.refused == 2   # once in each of steps 0 and 2, each then run again
    moved = [event[1] for event in trace if event[0] == "rescue"]
    assert moved, "nothing was moved to the host"
    rescued_lines = [line for line in said if line.startswith("out of device memory in aten."
                                                              "convolution_backward")]
    assert len(rescued_lines) == 2 and "run again" in rescued_lines[0]
    # moved groups were fetched back at their unpack, as offloaded ones are
    assert any(entry[0] == "fetch" for entry in session._link.log)


def moved_in_training(op, steps, after, asked="1 B"):
    """Two steps of the small CNN under a session keeping every group, ``op`` refused in
    ``steps`` after ``after`` calls until a group moved; bitwise a plain run's. The session and
    the groups moved, in order."""
    dtype = torch.float64
    model, data = small_cnn(dtype), batches(dtype, 2)
    reference = train(copy.deepcopy(model), data)
    trace = []
    session = kept_session(trace, [])
    with Refuses(session, op, steps=steps, after=after, asked=asked):
        assert_bitwise(reference, train(model, data, session))
    return session, [event[1] for event in trace if event[0] == "rescue"]


def test_the_backward_moves_the_group_it_needs_last_first():
    # a byte asked: the first round moves one group, and that is enough
    session, moved = moved_in_training(CONV_BACKWARD, steps=(1,), after=1)
    first_unpacks = session._first_unpacks   # step 1's, as step 0's: one model
    last = max(range(len(first_unpacks)), key=lambda gid: first_unpacks[gid] or -1)
    assert moved == [last]


def test_an_op_refused_in_the_forward_runs_again_and_the_earliest_saved_moves_first():
    _, moved = moved_in_training(CONV, steps=(0,), after=2)   # the third convolution
    assert moved == [0]


def test_each_round_moves_twice_the_last_until_the_op_runs():
    dtype = torch.float64
    model, data = small_cnn(dtype), batches(dtype, 1)
    trace, said = [], []
    session = kept_session(trace, said)
    # refused until the step has moved more than its first group: a second round
    with Refuses(session, CONV, steps=(0,), after=2, asked="1 B",
                 needed=lambda: session._step.groups[0].nbytes + 1) as refuses:
        train(model, data, session)
    moved = [event[1] for event in trace if event[0] == "rescue"]
    assert refuses.refused == 2 and moved[:2] == [0, 1]
    assert len([line for line in said if "run again" in line]) == 1   # one line a step


@pytest.mark.parametrize("op", [torch.ops.aten.relu_.default, BATCH_NORM],
                         ids=["declared (relu_)", "undeclared (batch norm's statistics)"])
def test_an_op_writing_more_than_is_copied_is_not_run_again(op, monkeypatch):
    monkeypatch.setattr(rescue, "RESTORED_BYTES", 0)   # nothing this op writes is copied
    dtype = torch.float64
    model, data = small_cnn(dtype), batches(dtype, 1)
    trace, said = [], []
    session = kept_session(trace, said)
    with Refuses(session, op, steps=(0,), after=1) as refuses:
        with pytest.raises(torch.OutOfMemoryError):
            train(model, data, session)
    assert refuses.refused == 1
    assert not [event for event in trace if event[0] == "rescue"] and not said


class WritesThenRefuses(Refuses):
    """Batch norm's running statistics written (as a kernel that updates them before the
    allocator refuses it would), then the refusal."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.refuses(func):
            args[3].add_(1.0)
            args[4].mul_(3.0)
            raise self.refusal()
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("op", [torch.ops.aten.relu_.default, BATCH_NORM],
                         ids=["declared (relu_)", "undeclared (batch norm's statistics)"])
def test_an_op_writing_a_little_runs_again_on_what_it_first_read(op):
    dtype = torch.float64
    model, data = small_cnn(dtype), batches(dtype, 2)
    reference = train(copy.deepcopy(model), data)
    said = []
    session = kept_session([], said)
    refusing = WritesThenRefuses if op is BATCH_NORM else Refuses
    with refusing(session, op, steps=(0, 1), after=1, asked="1 B") as refuses:
        assert_bitwise(reference, train(model, data, session))   # buffers too
    assert refuses.refused == 2 and len([line for line in said if "run again" in line]) == 2


def test_with_nothing_left_to_move_the_error_goes_on_after_one_line():
    dtype = torch.float64
    model, data = small_cnn(dtype), batches(dtype, 1)
    trace, said = [], []
    session = OffloadSession(modes=[OFFLOAD] * 64, link=RecordingLink(), min_bytes=0,
                             trace=trace, say=said.append)
    with Refuses(session, CONV, steps=(0,), after=1, needed=None):
        with pytest.raises(torch.OutOfMemoryError, match="Tried to allocate"):
            train(model, data, session)
    assert len(said) == 1 and "nothing of this step left to move" in said[0]


def test_the_mode_is_on_the_stack_in_armed_steps_only_and_never_past_the_with():
    dtype = torch.float64
    model, data = small_cnn(dtype), batches(dtype, rescue.ARMED_STEPS + 3)
    session = kept_session([], [])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = []
    for step, (x, y) in enumerate(data):
        optimizer.zero_grad()
        with session:
            out = model(x)   # the step has started: armed or not is decided
            seen.append(session.rescuer.mode in _get_current_dispatch_mode_stack())
            loss = nn.functional.cross_entropy(out, y)
        assert _get_current_dispatch_mode_stack() == []
        loss.backward()
        assert _get_current_dispatch_mode_stack() == []
        optimizer.step()
    assert seen == [True] * rescue.ARMED_STEPS + [False] * 3


def test_a_rescued_step_arms_the_next_ones_again():
    dtype = torch.float64
    model, data = small_cnn(dtype), batches(dtype, rescue.ARMED_STEPS + 4)
    session = kept_session([], [])
    refused_at = rescue.ARMED_STEPS - 1   # the last armed step
    with Refuses(session, CONV_BACKWARD, steps=(refused_at,), asked="1 B"):
        armed = armed_steps(model, data, session)
    assert armed == [True] * (refused_at + 1 + rescue.ARMED_STEPS) + [False] * (
        len(data) - refused_at - 1 - rescue.ARMED_STEPS)


class FlushingLink(RecordingLink):
    """A link whose caching allocator has flushed once more each time its count is read while
    the session's step count is one of ``steps`` (the count read as a step ends, after the
    session counted it: the session's third step ends at 3)."""

    def __init__(self, session_steps, steps=()):
        super().__init__()
        self.session_steps, self.steps, self.count, self.flushed_in = session_steps, steps, 0, set()

    def flushes(self):
        step = self.session_steps()
        if step in self.steps and step not in self.flushed_in:
            self.flushed_in.add(step)
            self.count += 1
        return self.count


def clean_run(monkeypatch, recovers=True, flush_steps=(), **options):
    """Whether each of 7 steps (2 recording) was armed, under a budget session whose link
    flushes in ``flush_steps``, the allocator's flush ``recovers`` (rescue.flush_recovers) or
    not."""
    monkeypatch.setattr(rescue, "flush_recovers", lambda device: recovers)
    dtype = torch.float64
    model, data = small_cnn(dtype), batches(dtype, 7)
    holder = []
    link = FlushingLink(lambda: holder[0].steps if holder else 0, flush_steps)
    options = {"budget": 1 << 40, **options}
    session = OffloadSession(link=link, min_bytes=0, record_steps=2, trials=False, **options)
    holder.append(session)
    return armed_steps(model, data, session), session


def test_a_plan_whose_first_armed_step_runs_clean_is_proven_by_it(monkeypatch):
    armed, session = clean_run(monkeypatch)
    assert OFFLOAD not in session.modes
    assert armed == [False, False, True, False, False, False, False]
    assert session.rescuer.is_proven(session.plan)


def test_an_armed_step_that_flushed_or_an_allocator_that_may_not_recover_proves_nothing(
        monkeypatch):
    three = [False, False] + [True] * rescue.ARMED_STEPS + [False] * (5 - rescue.ARMED_STEPS)
    # the first armed step (the session's third) flushed the allocator's cache: the next is
    # armed, and proves the plan where it runs clean
    assert clean_run(monkeypatch, flush_steps=(3,))[0] == [False, False, True, True] + [False] * 3
    assert clean_run(monkeypatch, flush_steps=(3, 4, 5))[0] == three
    # an allocator whose flush may leave too little whole (no expandable segments; the host)
    assert clean_run(monkeypatch, recovers=False)[0] == three


def test_a_plan_that_offloads_is_armed_for_all_its_armed_steps(monkeypatch):
    dtype = torch.float64
    budget = saved_bytes(small_cnn(dtype), batches(dtype, 1)) // 2
    armed, session = clean_run(monkeypatch, budget=budget, recompute=False, headroom=0.0)
    assert OFFLOAD in session.modes
    assert armed == [False, False] + [True] * rescue.ARMED_STEPS + [False] * (
        5 - rescue.ARMED_STEPS)


def stub_session(link, plan, modes, counts, trial=None):
    """What StepRescue.arm reads of a session, with ``plan_proven`` calls noted."""
    from types import SimpleNamespace
    session = SimpleNamespace(
        plan=plan, modes=modes, _step=SimpleNamespace(profiling=False), _depth=0,
        offloads_as_recorded=False, _links_in_use=lambda: [link], proven_said=[],
        lender=SimpleNamespace(on=False), _flush_counts_now=lambda: {link: counts[0]},
        lifecycle=SimpleNamespace(flush_counts={}, state="watching", trial=trial,
                                  replanning_under_plan=False))
    session.plan_proven = session.proven_said.append
    return session


def test_a_clean_step_is_judged_by_the_modes_it_ran_not_those_put_in_force_after_it(
        monkeypatch):
    monkeypatch.setattr(rescue, "flush_recovers", lambda device: True)
    link = object()
    session = stub_session(link, None, [KEEP, OFFLOAD], [0])
    session.lifecycle.flush_counts = {link: 0}
    rescuer = rescue.StepRescue(session)
    rescuer._flushes_at_start = {link: 0}
    rescuer.counted_for = (None, [KEEP, RECOMPUTE])   # what the step ran
    assert rescuer.ran_clean()
    session.modes = [KEEP, RECOMPUTE]
    rescuer.counted_for = (None, [KEEP, OFFLOAD])
    assert not rescuer.ran_clean()
    rescuer.counted_for = (None, [KEEP, RECOMPUTE])
    session.lifecycle.flush_counts = {link: 1}        # it flushed
    assert not rescuer.ran_clean()
    session.lifecycle.flush_counts, session.lender.on = {link: 0}, True   # lends may be made
    assert not rescuer.ran_clean()


def test_a_clean_step_proves_its_plan_for_this_process_only_and_not_in_a_trial_of_plans(
        monkeypatch):
    from types import SimpleNamespace
    monkeypatch.setattr(rescue, "flush_recovers", lambda device: True)
    def a_plan():
        return SimpleNamespace(keep_apart=False)
    link, plan, counts = object(), a_plan(), [5]
    session = stub_session(link, plan, [KEEP, RECOMPUTE], counts)
    rescuer = rescue.StepRescue(session)
    # a cached plan's first step, armed before any step ended: its start read from the links
    rescuer.arm()
    assert rescuer.armed and rescuer._flushes_at_start == {link: 5}
    session.lifecycle.flush_counts = {link: 5}
    rescuer.arm(ended=True)
    assert not rescuer.armed and rescuer.is_proven(plan)
    # proven by a clean step: not said to the plan cache (another run's allocator may differ)
    assert session.proven_said == []
    # by its 3 steps, as ever: said
    other = a_plan()
    session.plan, session.modes = other, [KEEP, OFFLOAD]
    rescuer.arm()
    for _ in range(rescue.ARMED_STEPS):
        assert rescuer.armed
        rescuer.arm(ended=True)
    assert not rescuer.armed and session.proven_said == [other]
    # a trial comparing plans: each armed for all its steps, clean or not
    third = a_plan()
    session.plan, session.modes = third, [KEEP, RECOMPUTE]
    session.lifecycle.trial = SimpleNamespace(plans=[other, third])
    rescuer.arm()
    armed = []
    for _ in range(rescue.ARMED_STEPS + 1):
        armed.append(rescuer.armed)
        rescuer.arm(ended=True)
    assert armed == [True] * rescue.ARMED_STEPS + [False]


def test_flush_recovers_reads_expandable_segments_from_the_allocators_settings(monkeypatch):
    settings = ["max_split_size_mb:64, expandable_segments:True"]
    monkeypatch.setattr(torch._C, "_accelerator_getAllocatorSettings", lambda: settings[0],
                        raising=False)
    assert rescue.flush_recovers(torch.device("cuda", 0)) and rescue.flush_recovers("cuda")
    assert not rescue.flush_recovers(None) and not rescue.flush_recovers(torch.device("cpu"))
    # the last one given counts, as in PyTorch; settings made at run time are read
    settings[0] = "expandable_segments:True,expandable_segments:False"
    assert not rescue.flush_recovers("cuda")
    settings[0] = ""
    assert not rescue.flush_recovers("cuda")


def test_flush_recovers_reads_the_environment_where_pytorch_says_nothing(monkeypatch):
    monkeypatch.delattr(torch._C, "_accelerator_getAllocatorSettings", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:64, expandable_segments:True")
    assert rescue.flush_recovers("cuda")
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False")
    assert not rescue.flush_recovers("cuda")
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    assert not rescue.flush_recovers("cuda")
    # PyTorch's newer name is read first, set even where empty
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "")
    assert not rescue.flush_recovers("cuda")
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:true")
    assert rescue.flush_recovers("cuda")


def test_recording_steps_are_never_armed_and_rescue_false_never():
    dtype = torch.float64
    model, data = small_cnn(dtype), batches(dtype, 3)
    session = OffloadSession(budget=1 << 40, link=RecordingLink(), min_bytes=0, record_steps=2)
    assert armed_steps(model, data, session) == [False, False, True]
    never = kept_session([], [], rescue=False)
    train(small_cnn(dtype), batches(dtype, 2), never)
    assert not never.rescuer.armed
    with pytest.raises(ValueError, match="rescue='sometimes'"):
        OffloadSession(rescue="sometimes")


def test_a_rescued_planned_step_has_the_next_plan_made_for_less():
    dtype = torch.float64
    model, data = small_cnn(dtype), batches(dtype, 6)
    reference = train(copy.deepcopy(model), data)
    said = []
    session = OffloadSession(budget=1 << 40, link=RecordingLink(), min_bytes=0, record_steps=2,
                             say=said.append)
    with Refuses(session, CONV_BACKWARD, steps=(2,), after=1, asked="1 B"):
        assert_bitwise(reference, train(model, data, session))
    assert session.lifecycle.replans_used == 1
    assert any("run again" in line for line in said)


def test_an_op_run_again_leaves_no_frame_holding_its_inputs():
    """The refused op's frame (and its inputs: a step's activations) must go when it returns, not
    when the collector finds a cycle through the error's traceback."""
    import gc
    import types

    dtype = torch.float64
    model, data = small_cnn(dtype), batches(dtype, 1)
    session = kept_session([], [])
    # its own code: PyTorch wraps every mode's __torch_dispatch__ in one shared function
    code = inspect.unwrap(rescue.OomRescue.__torch_dispatch__).__code__
    gc.collect()
    gc.disable()
    try:
        with Refuses(session, CONV, steps=(0,), after=1, asked="1 B") as refuses:
            with session:
                loss = nn.functional.cross_entropy(model(data[0][0]), data[0][1])
            frames = [o for o in gc.get_objects()
                      if isinstance(o, types.FrameType) and o.f_code is code]
            loss.backward()
    finally:
        gc.enable()
    assert refuses.refused == 1 and session._step.rescued
    assert frames == []


@pytest.mark.parametrize("op", [CONV, CONV_BACKWARD], ids=["forward", "backward"])
def test_a_source_of_a_recomputed_group_moved_comes_back_before_its_recomputation(op):
    dtype = torch.float64
    model, data = small_cnn(dtype), batches(dtype, 2)
    reference = train(copy.deepcopy(model), data)
    trace = []
    session = OffloadSession(modes=[KEEP, RECOMPUTE] * 32, link=RecordingLink(), min_bytes=0,
                             trace=trace)
    # in step 1 (step 0 found the recipes), everything movable moves at the first refusal
    with Refuses(session, op, steps=(1,), after=1, asked="1 GiB"):
        assert_bitwise(reference, train(model, data, session))
    moved = {event[1] for event in trace if event[0] == "rescue"}
    recomputed = [event for event in trace if event[0] == "recompute"]
    sources = {gid for event in recomputed for gid in event[2]}
    assert moved & sources, (moved, sources)


def test_a_node_that_unpacks_nothing_of_the_step_is_rescued_by_its_module():
    """The classifier's input is under ``min_bytes`` (passed through): its backward node unpacks
    no group, and gets the mode as the output node of a leaf module, the backward run outside
    the session's ``with``."""
    dtype = torch.float64
    model, data = small_cnn(dtype), batches(dtype, 1)
    reference = train(copy.deepcopy(model), data)
    said = []
    session = OffloadSession(modes=[KEEP] * 64, link=RecordingLink(), min_bytes=4096,
                             say=said.append)
    with Refuses(session, torch.ops.aten.mm.default, steps=(0,), asked="1 B") as refuses:
        assert_bitwise(reference, train(model, data, session))
    assert refuses.refused == 1 and any("aten.mm.default" in line for line in said)


def test_an_op_runs_again_where_it_draws_nothing_and_what_it_writes_is_small():
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    weight = torch.randn(4, 3, 3, 3, dtype=torch.float64)
    conv = (x, weight, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)
    assert rescue.writes(CONV) == () and rescue.written_arguments(CONV, conv, {}) == []
    mean, var = torch.zeros(3), torch.ones(3)
    written = rescue.written_arguments(BATCH_NORM, (x, None, None, mean, var, True, 0.1, 1e-5), {})
    assert len(written) == 2 and written[0] is mean and written[1] is var
    assert rescue.written_arguments(BATCH_NORM, (x, None, None, None, None, True, 0.1, 1e-5),
                                    {}) == []
    small, large = torch.zeros(16), torch.zeros(rescue.RESTORED_BYTES // 4 + 1)
    assert rescue.written_arguments(torch.ops.aten.relu_.default, (small,), {})[0] is small
    assert rescue.written_arguments(torch.ops.aten.relu_.default, (large,), {}) is None
    assert rescue.writes(torch.ops.aten.bernoulli.default) is None
    assert rescue.written_arguments(torch.ops.aten.randperm.generator, (4,),
                                    {"generator": None}) is None


def test_the_copies_of_what_an_op_writes_refused_too_are_made_again():
    dtype = torch.float64
    model, data = small_cnn(dtype), batches(dtype, 1)
    reference = train(copy.deepcopy(model), data)
    said = []
    session = kept_session([], said)
    # the second batch norm's copy of its running mean: refused until a group moved
    with Refuses(session, torch.ops.aten.clone.default, steps=(0,), after=2, asked="1 B"):
        assert_bitwise(reference, train(model, data, session))
    assert len([line for line in said if "native_batch_norm" in line]) == 1


# -- reproductions from a review of the rescue -----------------------------------------------

def rrelu_grads(x, y, session=None):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.RReLU(), nn.Conv2d(8, 8, 3, padding=1),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10)).double()
    torch.manual_seed(100)   # rrelu's noise
    with session if session is not None else torch.enable_grad():
        loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    return [p.grad.clone() for p in model.parameters()]


def test_rrelus_noise_is_not_moved_before_rrelu_writes_it():
    """rrelu_with_noise saves ``noise`` before it fills it (no version bump). A refusal inside
    the pack of its next saved tensor (here the kept alias's detach; on a GPU, e.g., the
    keep-apart copy a pack makes of an earlier op's group) must not move that noise."""
    x, y = batches(torch.float64, 1)[0]
    reference = rrelu_grads(x, y)
    session = OffloadSession(modes=[KEEP] * 64, link=RecordingLink(), min_bytes=0)
    # the third detach of step 0: the pack of rrelu's second saved tensor; everything movable
    with Refuses(session, torch.ops.aten.detach.default, steps=(0,), after=2, asked="1 GiB"):
        ours = rrelu_grads(x, y, session)
    assert session._step.rescued
    assert all(torch.equal(a, b) for a, b in zip(reference, ours))


def test_steps_under_the_plan_that_ran_out_stay_armed_until_the_plan_for_less_comes():
    """The plan for less after a rescue is made while the plan that ran out runs (on a GPU in a
    process of its own: many steps): every one of those steps is armed, past ARMED_STEPS."""
    from test_lifecycle import ManualRunner

    dtype = torch.float64
    model, data = small_cnn(dtype), batches(dtype, 10)
    session = OffloadSession(budget=400_000, link=RecordingLink(), min_bytes=0,
                             record_steps=1, trials=False)
    runner = session.lifecycle.runner = ManualRunner()   # plans come when completed by hand

    def first_plan_only():
        if runner.waiting and runner.kinds[-1] == "first plan":
            runner.complete()
    with Refuses(session, CONV_BACKWARD, steps=(4, 9), after=1, asked="1 B") as refuses:
        armed = armed_steps(model, data, session, first_plan_only)
    assert refuses.refused == 2 and armed[4:] == [True] * 6
    assert session.lifecycle.state == "replanning" and session.lifecycle.replans_used == 1


class ResidualBlock(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv, self.bn, self.relu = nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU()

    def forward(self, x):
        return self.relu(self.bn(self.conv(x)) + x)


def test_a_rescue_while_a_recomputation_fetches_a_source_leaves_its_other_sources():
    """Group 3 (a residual block's add and ReLU) is recomputed from kept groups 2 and 1. Group 1
    was moved by an earlier rescue of the step; at group 3's unpack its fetch is refused, and
    the rescue must not move group 2, which the recomputation reads next."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), ResidualBlock(8),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10)).double()
    data = batches(torch.float64, 2)
    session = OffloadSession(modes=[KEEP, KEEP, KEEP, RECOMPUTE] + [KEEP] * 10,
                             link=RecordingLink(), min_bytes=0)
    for x, y in data:   # step 0 finds the recipes; step 1's backward is run below
        model.zero_grad()
        with session:
            loss = nn.functional.cross_entropy(model(x), y)
        if session.steps == 0:
            loss.backward()
    group = session._step.groups[3]
    assert group.mode == RECOMPUTE and [s.gid for s in group.recipe.sources] == [2, 1]
    session.copies.move_to_host(session._step.groups[1])   # as a rescue earlier in the step

    class RefusesTheFetch(TorchDispatchMode):
        refused = False

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not self.refused and func is torch.ops.aten.empty_strided.default and \
                    session._step.unpacks:
                self.refused = True
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1 GiB.")
            return func(*args, **(kwargs or {}))

    with RefusesTheFetch() as refuses, session:   # armed; the backward inside the with
        loss.backward()
    assert refuses.refused and session._step.rescued
    assert session._step.groups[2].mode == KEEP   # read by the recomputation: not moved


# -- a plan proven by an earlier run (rule 5) ---------------------------------------------------

def cached_armed_run(model, data, directory, budget, refuses_steps=()):
    """(session, whether each step was armed, gradients) of a run under the plan cache in
    ``directory``; the ops of steps ``refuses_steps`` refused once each (then rescued)."""
    from mucudnn.torch.plancache import PlanCache
    session = OffloadSession(budget=budget, link=RecordingLink(), min_bytes=0, record_steps=2,
                             trials=False, plan_cache=PlanCache(directory))
    grads = []

    def after_each():
        grads.append([p.grad.clone() for p in model.parameters()] +
                     [b.clone() for b in model.buffers()])
    with Refuses(session, CONV_BACKWARD, steps=refuses_steps, asked="1 B"):
        armed = armed_steps(model, data, session, after_each)
    return session, armed, grads


def test_a_cached_plan_its_first_run_proved_is_armed_in_the_first_step_only(tmp_path):
    from mucudnn.torch.plancache import PlanCache
    dtype = torch.float64
    model, data = small_cnn(dtype), batches(dtype, 2 + rescue.ARMED_STEPS + 2)
    reference = train(copy.deepcopy(model), data)
    first, armed, grads = cached_armed_run(copy.deepcopy(model), data, tmp_path, 1 << 40)
    assert_bitwise(reference, grads)
    # two recording steps, then the plan's armed steps, then none
    assert armed == [False, False] + [True] * rescue.ARMED_STEPS + [False] * 2
    entry = PlanCache(tmp_path).load(first._cache_key)
    assert entry is not None and entry.proven and entry.plan == first.plan
    second, armed, grads = cached_armed_run(copy.deepcopy(model), data, tmp_path, 1 << 40)
    assert_bitwise(reference, grads)
    assert second._cached is None and second.plan == first.plan   # it ran the cached plan
    assert armed == [True] * rescue.PROVEN_ARMED_STEPS + [False] * (
        len(data) - rescue.PROVEN_ARMED_STEPS)


def test_a_plan_rescued_in_its_armed_steps_is_not_proven_and_its_replacement_is(
        tmp_path, monkeypatch):
    from mucudnn.torch.plancache import PlanCache
    dtype = torch.float64
    model, data = small_cnn(dtype), batches(dtype, 2 + 3 * rescue.ARMED_STEPS)
    reference = train(copy.deepcopy(model), data)
    in_force, proven = {}, []
    real_proven, real_close = OffloadSession.plan_proven, OffloadSession._close_step

    def plan_proven(self, plan):
        proven.append(plan)
        real_proven(self, plan)

    def close_step(self, *args):
        in_force[self.steps] = self.plan   # the plan of the step that ends
        real_close(self, *args)
    monkeypatch.setattr(OffloadSession, "plan_proven", plan_proven)
    monkeypatch.setattr(OffloadSession, "_close_step", close_step)
    # rescued in the plan's second step: the plan for less (3x the saved bytes leave room for
    # one) replaces it, and is proven by its own armed steps
    budget = saved_bytes(model, data) * 3
    first, armed, grads = cached_armed_run(copy.deepcopy(model), data, tmp_path, budget,
                                           refuses_steps=(3,))
    assert_bitwise(reference, grads)
    rescued_plan = in_force[3]
    assert first.lifecycle.replans_used == 1 and first.plan is not rescued_plan
    assert proven == [first.plan]
    entry = PlanCache(tmp_path).load(first._cache_key)
    assert entry is not None and entry.proven and entry.plan == first.plan


def test_a_rescued_plan_that_runs_on_while_its_replacement_is_made_is_not_proven(tmp_path,
                                                                                 monkeypatch):
    # a plan rescued in its armed steps ran past its budget: however many steps it runs on
    # while the plan for less is made (in the background, on a GPU), it is no proven plan, and
    # the cache never says so (a next run would arm its first step only, and run out of memory
    # unrescued in the next)
    from mucudnn.torch import plan_runner
    from mucudnn.torch.plancache import PlanCache
    dtype = torch.float64
    model, data = small_cnn(dtype), batches(dtype, 2 + 2 + rescue.ARMED_STEPS + 2)

    class Delayed(plan_runner.InlineRunner):   # the plan for less comes 4 steps late
        held = None

        def submit(self, request, work):
            super().submit(request, work)
            if request.kind == plan_runner.REPLAN:
                self.held, self.steps = list(self._done), 0
                self._done.clear()

        def ready(self):
            if self.held is not None:
                self.steps += 1
                if self.steps > rescue.ARMED_STEPS + 1:
                    self._done.extend(self.held)
                    self.held = None
            return super().ready()
    proven, stored = [], []
    real_proven = OffloadSession.plan_proven
    monkeypatch.setattr(OffloadSession, "plan_proven",
                        lambda self, plan: proven.append(plan) or real_proven(self, plan))
    reference = train(copy.deepcopy(model), data)
    session = OffloadSession(budget=saved_bytes(model, data) * 3, link=RecordingLink(),
                             min_bytes=0, record_steps=2, trials=False,
                             plan_cache=PlanCache(tmp_path))
    session.lifecycle.runner = Delayed()
    grads, rescued_plan = [], []

    def after_each():
        grads.append([p.grad.clone() for p in model.parameters()] +
                     [b.clone() for b in model.buffers()])
        if session.steps == 4:   # the step rescued (step 3) has ended: its plan still in force
            rescued_plan.append(session.plan)
        entry = PlanCache(tmp_path).load(session._cache_key)
        stored.append(entry is not None and entry.proven and entry.plan == rescued_plan[0]
                      if rescued_plan else False)
    model = copy.deepcopy(model)
    with Refuses(session, CONV_BACKWARD, steps=(3,), asked="1 B"):
        armed = armed_steps(model, data, session, after_each)
    assert_bitwise(reference, grads)
    assert session._step.rescued == 0 and session.lifecycle.replans_used == 1
    assert rescued_plan and session.plan is not rescued_plan[0]
    assert all(armed[2:])   # the plan, rescued, and the plan for less: each in its armed steps
    assert not any(plan is rescued_plan[0] for plan in proven)
    assert not any(stored)
