"""mucudnn.torch's offload session on CPU torch (offload_session.py): saved tensors packed,
offloaded, kept or recomputed and unpacked, their groups' lifetime, prefetches and releases. The
CPU stands in for both device and host (SameMemoryLink), a recording link checks the order of
copies; gradients must be bitwise equal to a plain run."""

import copy
import dataclasses
import gc
import weakref

import pytest

torch = pytest.importorskip("torch")
if not hasattr(torch, "autograd") or not hasattr(torch.autograd, "graph"):
    pytest.skip("needs a real PyTorch", allow_module_level=True)

from torch import nn  # noqa: E402

from mucudnn.torch import fit  # noqa: E402
from mucudnn.torch import planner  # noqa: E402
from mucudnn.torch.link import SameMemoryLink  # noqa: E402
from mucudnn.torch.offload_session import OffloadSession  # noqa: E402
from mucudnn.torch.planner import KEEP, OFFLOAD, RECOMPUTE  # noqa: E402
from session_helpers import (  # noqa: E402
    assert_bitwise, batches, DTYPES, GiB, HeldBytes, MeteredLink, RecordingLink, saved_bytes,
    small_cnn, split_steps, train, train_through_failures, WithSpike)


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_tensor_offloaded_gives_the_same_gradients(dtype):
    model, data = small_cnn(dtype), batches(dtype, 3)
    reference = train(copy.deepcopy(model), data)
    trace, link = [], RecordingLink()
    session = OffloadSession(force=OFFLOAD, link=link, min_bytes=0, trace=trace)
    assert_bitwise(reference, train(model, data, session))
    offloads = [e for e in trace if e[0] == "offload"]
    packed = [e for e in trace if e[0] == "pack"]
    assert offloads and len(offloads) == sum(1 for e in packed if e[2] == OFFLOAD) >= 3 * 10
    assert all(kind != "fetch" or transfer in link.waited for kind, transfer in link.log)
    # the host pool: later steps copy into the host tensors of the first (bitwise above, so a
    # buffer is never written while a group may still read it)
    assert link.host_allocations == len(offloads) // 3


@pytest.mark.parametrize("arguments, named", [
    (dict(modes="recompute"), "modes='recompute' is not a sequence of modes"),
    (dict(modes=[KEEP, "drop"]), r"modes=\['keep', 'drop'\] is not a sequence of modes"),
    (dict(force="everything"), "force='everything' is not one of"),
])
def test_modes_or_a_force_of_no_mode_are_refused_in_one_line(arguments, named):
    # a string of modes read one character per group recomputed groups without a recipe
    with pytest.raises(ValueError, match=named):
        OffloadSession(**arguments)


def test_modes_given_as_a_generator_are_each_groups(dtype=torch.float64):
    model, data = small_cnn(dtype), batches(dtype, 2)
    reference = train(copy.deepcopy(model), data)
    session = OffloadSession(modes=(OFFLOAD for _ in range(64)), link=SameMemoryLink(),
                             min_bytes=0)
    assert_bitwise(reference, train(copy.deepcopy(model), data, session))
    assert session.modes == [OFFLOAD] * 64
    assert [g.mode for g in session._step.groups] == [OFFLOAD] * len(session._step.groups)


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefetch_runs_lookahead_unpacks_ahead(dtype):
    model, data = small_cnn(dtype), batches(dtype, 3)
    reference = train(copy.deepcopy(model), data)
    trace = []
    session = OffloadSession(force=OFFLOAD, link=RecordingLink(), min_bytes=0, trace=trace,
                             lookahead=2)
    assert_bitwise(reference, train(model, data, session))
    steps, current = [], None
    for event in trace:       # split the trace into steps at each step's first pack
        if event[0] == "pack" and event[1] == 0:
            current = []
            steps.append(current)
        current.append(event)
    assert len(steps) == 3
    first_step, later = steps[0], steps[1:]
    assert not any(e[0] == "prefetch" for e in first_step)   # nothing known yet: on demand
    for step in later:
        first_unpack = {}
        for e in step:
            if e[0] == "unpack":
                first_unpack.setdefault(e[1], e[2])
        prefetched = {e[1]: e[2] for e in step if e[0] == "prefetch"}
        assert prefetched, "a planned step prefetches"
        assert not any(e[0] == "fetch" for e in step)          # none fetched on demand
        for gid, at in prefetched.items():
            assert at == max(0, first_unpack[gid] - 2)
            assert step.index(("prefetch", gid, at)) < step.index(("unpack", gid, first_unpack[gid]))


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_budget_forcing_a_mix(dtype):
    model, data = small_cnn(dtype), batches(dtype, 4)
    reference = train(copy.deepcopy(model), data)
    trace = []
    # the link's bandwidth makes offload dear; baselines are 0 on CPU, so the budget is bytes of
    # saved tensors: about half of what keeping everything needs
    session = OffloadSession(budget=1, link=RecordingLink(), min_bytes=0, trace=trace,
                             headroom=0.0)
    probe = OffloadSession(force=KEEP, link=SameMemoryLink(gbps=(1.0, 1.0)), min_bytes=0)
    train(copy.deepcopy(model), data[:2], probe)
    saved = sum(g.nbytes for g in probe._step.groups)
    session.budget = int(saved * 0.55)
    assert_bitwise(reference, train(model, data, session))
    modes = set(session.plan.modes)
    assert session.plan.peak <= session.budget
    assert {OFFLOAD, KEEP} <= modes or {RECOMPUTE, KEEP} <= modes
    assert session.plan.count(KEEP) < len(session.plan.modes)
    assert [g.mode for g in session._step.groups] == list(session.plan.modes)   # carried out


def test_fit_wraps_the_model_and_plans_after_one_step():
    model, data = small_cnn(torch.float32), batches(torch.float32, 3)
    reference = train(copy.deepcopy(model), data)
    fitted = fit(model, budget="1MiB", link=RecordingLink(), min_bytes=0, headroom=0.0)
    assert_bitwise(reference, train(fitted, data))
    assert fitted.mucudnn_session.plan is not None


def outputs_of(model):
    """Weak references to every module output of the forward passes run after this call."""
    refs = []

    def hook(module, args, output):
        if isinstance(output, torch.Tensor):
            refs.append(weakref.ref(output))

    handles = [m.register_forward_hook(hook) for m in model.modules()]
    return refs, handles


@pytest.mark.parametrize("mode", [KEEP, OFFLOAD, RECOMPUTE])
def test_no_saved_tensor_outlives_the_backward(mode):
    # plain PyTorch frees every activation once the backward ran; the session must not hold one
    # (on the device) until the next step starts
    model, data = small_cnn(torch.float32), batches(torch.float32, 2)
    session = OffloadSession(force=mode, link=RecordingLink(), min_bytes=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in data:
        refs, handles = outputs_of(model)
        with session:
            loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        del loss
        for handle in handles:
            handle.remove()
        alive = [r for r in refs if r() is not None]
        assert refs and not alive, f"{len(alive)} of {len(refs)} activations still alive"
        assert all(g.tensor is None and g.fetch is None for g in session._step.groups)
        optimizer.step()


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_session_holds_no_more_than_the_plan_models(dtype):
    model, data = small_cnn(dtype), batches(dtype, 4)
    reference = train(copy.deepcopy(model), data)
    trace = HeldBytes()
    session = OffloadSession(budget=1, link=RecordingLink(), min_bytes=0, trace=trace,
                             headroom=0.0)
    trace.session = session
    probe = OffloadSession(force=KEEP, link=SameMemoryLink(gbps=(1.0, 1.0)), min_bytes=0)
    train(copy.deepcopy(model), data[:2], probe)
    session.budget = int(sum(g.nbytes for g in probe._step.groups) * 0.55)
    assert_bitwise(reference, train(model, data, session))
    # every pack and unpack of the planned steps (each group packed and unpacked at least once)
    assert KEEP in session.plan.modes and trace.checked >= 2 * 2 * len(session.profile.groups)


def test_a_failed_backward_leaves_no_saved_tensor_behind():
    # a fetch that runs out of memory inside autograd's unpack: its frames keep the step's groups,
    # and the groups kept their tensors, so every later step began with the failed one's memory
    # (VGG-16 at 16 GiB on an H200: 15.7 GiB allocated at each step's start)
    model, data = small_cnn(torch.float32), batches(torch.float32, 3)
    steps = []

    class FailingLink(MeteredLink):
        def fetch(self, host, device, inline=False):
            if len(steps) == 2:
                self.oom()
                raise torch.OutOfMemoryError("out of memory (test)")
            return super().fetch(host, device, inline)

    session = OffloadSession(modes=[KEEP, OFFLOAD] * 50, link=FailingLink(), min_bytes=0)
    kept = []

    def before_step():
        steps.append(None)
        if len(steps) == 3:      # the failed step's groups, as the next step begins
            kept.extend(g.ref for g in session._step.groups)

    train_through_failures(model, data, session, before_step=before_step)
    gc.collect()
    ours = [t for pair in data for t in pair] + list(model.buffers())   # the test holds them
    alive = [ref() for ref in kept if ref() is not None]
    assert len(kept) > 10
    assert all(any(tensor is mine for mine in ours) for tensor in alive)


def test_a_failed_step_s_reference_cycles_are_collected_before_the_next_step():
    # an error's frames in a reference cycle hold a tensor until the collector runs, which may be
    # after the next step needed that memory
    model, data = small_cnn(torch.float32), batches(torch.float32, 3)
    steps, held = [], []

    def out_of_memory():
        if len(steps) == 2:
            cycle = [torch.empty(1000)]
            cycle.append(cycle)
            held.append(weakref.ref(cycle[0]))
            raise torch.OutOfMemoryError("out of memory (test)")

    session = OffloadSession(force=KEEP, link=MeteredLink(), min_bytes=0)
    wrapped = WithSpike(model, out_of_memory)
    alive_at_next_step = []

    class Probe(nn.Module):    # a leaf (wrapped is not registered): the step's first module,
        def forward(self, x):   # whose forward runs once the session has begun the step
            if len(steps) == 3:
                alive_at_next_step.append(held[0]() is not None)
            return wrapped(x)

    gc.disable()
    try:
        train_through_failures(model, data, session, Probe(), lambda: steps.append(None))
    finally:
        gc.enable()
    assert alive_at_next_step == [False]


def test_a_forward_failing_before_its_first_module_is_not_the_last_steps_failure():
    # the step still open when such a forward raises is the last one, which ran to its end
    model, data = small_cnn(torch.float32), batches(torch.float32, 5)
    link, said = MeteredLink(), []
    session = OffloadSession(budget=saved_bytes(model, data) * 2, link=link, min_bytes=0,
                             headroom=0.0, say=said.append, record_steps=1)
    steps = []

    def forward(x):
        if len(steps) == 4:      # e.g. moving the batch to the device runs out of memory
            link.oom()
            raise torch.OutOfMemoryError("out of memory (test)")
        return model(x)

    assert train_through_failures(model, data, session, forward,
                                  lambda: steps.append(None)) == 1
    assert session.replans_used == 0 and not session.fell_back
    assert not any("ran out of device memory" in line for line in said)
    assert [g.mode for g in session._step.groups] == list(session.plan.modes)


def test_reading_a_saved_tensor_outside_the_backward_is_no_failure():
    # Python may read a saved tensor (grad_fn._saved_*): the unpack hook runs outside any backward
    model, data = small_cnn(torch.float32), batches(torch.float32, 4)
    reference = train(copy.deepcopy(model), data)
    said = []
    session = OffloadSession(budget=GiB, link=RecordingLink(), min_bytes=0, say=said.append)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    results = []
    for x, y in data:
        optimizer.zero_grad()
        with session:
            logits = model(x)
        seen = logits.grad_fn._saved_mat1      # the linear layer's input, unpacked here
        assert seen.shape == (x.shape[0], 16)
        nn.functional.cross_entropy(logits, y).backward()
        results.append([p.grad.clone() for p in model.parameters()] +
                       [b.clone() for b in model.buffers()])
        optimizer.step()
    assert_bitwise(reference, results)
    assert session.plan is not None and not any("failed" in line for line in said)


def test_every_recording_step_fetches_on_demand():
    # the second recording step is the profile: its memory is save_on_cpu's and its baselines
    # assume no group arrives before its unpack, so it must not prefetch as a planned step does
    model, data = small_cnn(torch.float32), batches(torch.float32, 3)
    trace = []
    session = OffloadSession(budget=GiB, link=RecordingLink(), min_bytes=0, trace=trace,
                             record_steps=2)
    train(model, data, session)
    first, second, planned = split_steps(trace)
    for recording in (first, second):
        assert any(e[0] == "fetch" for e in recording)
        assert not any(e[0] == "prefetch" for e in recording)


def test_a_graph_dropped_without_a_backward_frees_its_saved_outputs():
    # a ReLU saves its own output: holding that tensor as it is would make its node hold itself
    # (a cycle through autograd's C++ nodes, which the collector never frees)
    model = small_cnn(torch.float32)
    session = OffloadSession(force=KEEP, link=RecordingLink(), min_bytes=0)
    with session:
        outputs, handles = outputs_of(model)
        model(batches(torch.float32, 1)[0][0])   # a forward whose result nobody keeps
    for handle in handles:
        handle.remove()
    gc.collect()
    assert len(outputs) > 10 and not [ref for ref in outputs if ref() is not None]


@pytest.mark.parametrize("dtype", DTYPES)
def test_planned_prefetches_run_where_the_model_puts_them(dtype):
    # the recording step's backward clock is in the profile, and each planned prefetch is issued
    # as many unpacks ahead as planner.prefetch_point says (earlier than ``lookahead`` for a
    # group whose copy is long on this slow link), which the held-bytes test checks against
    model, data = small_cnn(dtype), batches(dtype, 4)
    reference = train(copy.deepcopy(model), data)
    trace = []
    session = OffloadSession(budget=int(saved_bytes(model, data) * 0.5), link=RecordingLink(),
                             min_bytes=0, trace=trace, headroom=0.0, recompute=False)
    assert_bitwise(reference, train(model, data, session))
    profile = session.profile
    clock = profile.backward_clock
    assert len(clock) == profile.unpacks and clock[0] == 0.0
    assert all(a <= b for a, b in zip(clock, clock[1:])) and clock[-1] > 0.0
    last = trace[max(i for i, e in enumerate(trace) if e[0] == "pack" and e[1] == 0):]
    first_unpack = {}
    for e in last:
        if e[0] == "unpack":
            first_unpack.setdefault(e[1], e[2])
    prefetched = {e[1]: e[2] for e in last if e[0] == "prefetch"}
    assert prefetched and set(prefetched) <= {g for g, m in enumerate(session.plan.modes)
                                              if m == OFFLOAD}
    distances = {gid: profile.groups[gid].first_unpack
                 - planner.prefetch_point(profile, gid, session.prefetch_distance,
                                          session.prefetch_margin)
                 for gid in prefetched}
    for gid, at in prefetched.items():
        assert at == max(0, first_unpack[gid] - distances[gid])


def test_the_prefetch_schedule_leads_a_long_copy_by_its_time():
    # the schedule from the plan's model: backward points 1 ms apart, a 3 MB group over 1 GB/s
    # with margin 1.5 is fetched 5 unpacks ahead, a small one ``lookahead`` (2) ahead
    groups = [planner.SavedGroup(1_000, 8, 8), planner.SavedGroup(3_000_000, 9, 9)]
    profile = planner.StepProfile(groups, 5.0, 10.0, 1.0, 1.0, 10,
                                  backward_clock=[float(t) for t in range(10)])
    session = OffloadSession(link=SameMemoryLink(gbps=(1.0, 1.0)))
    session.profile = profile
    session.plan = planner.OffloadPlan((OFFLOAD, OFFLOAD), 2, 0, 0.0, 3_001_000, 1.5)
    session._first_unpacks = [8, 9]
    assert session._prefetch_schedule(session.plan.modes) == {6: [0], 4: [1]}
    session.plan = planner.OffloadPlan((OFFLOAD, OFFLOAD), 2, 0, 0.0, 3_001_000, 0.0)
    assert session._prefetch_schedule(session.plan.modes) == {6: [0], 7: [1]}


def released_at(trace, groups: int) -> list[dict[int, int]]:
    """Per step of ``trace``: offloaded group -> the forward point at which it was let go (the
    number of groups: at the first unpack)."""
    steps = []
    for step in split_steps(trace):
        released, point = {}, 0
        for event in step:
            if event[0] == "pack" and event[1] == point:
                point += 1
            elif event[0] == "unpack":
                point = groups
            elif event[0] == "release":
                released[event[1]] = point
        steps.append(released)
    return steps


def test_a_planned_step_lets_go_of_each_offloaded_tensor_at_the_next_point_over_a_fast_link():
    # the recording step's forward clock is in the profile, and each planned offload's device
    # tensor goes at planner.release_point: over a fast link, before the next group's pack
    model, data = small_cnn(torch.float32), batches(torch.float32, 4)
    reference = train(copy.deepcopy(model), data)
    trace, link = [], RecordingLink()
    session = OffloadSession(budget=int(saved_bytes(model, data) * 0.7), link=link,
                             min_bytes=0, trace=trace, headroom=0.0, recompute=False)
    assert_bitwise(reference, train(model, data, session))
    profile = session.profile
    clock = profile.forward_clock
    assert len(clock) == len(profile.groups) and clock[0] == 0.0
    assert all(a <= b for a, b in zip(clock, clock[1:])) and clock[-1] > 0.0
    offloaded = [g for g, m in enumerate(session.plan.modes) if m == OFFLOAD]
    assert offloaded
    for released in released_at(trace, len(profile.groups))[2:]:     # the planned steps
        assert released == {g: g + 1 for g in offloaded}
    assert sum(entry[0] == "let_go" for entry in link.log) == len(offloaded) * 2
    # held by the link until then (the recording steps' copies are inline, never held)
    assert sum(entry[0] == "offload" and entry[-1] == "held" for entry in link.log) == \
        len(offloaded) * 2


def test_a_planned_step_lets_go_of_each_offloaded_tensor_where_its_copy_is_due():
    # in program order, not when the host sees the copy done: on a profile whose forward points
    # are 1 ms apart, over a link on which a 32 KiB copy takes 1.7 ms (2.5 with the margin), a
    # group goes 3 points after its own, or at the first unpack where the forward ends first
    model, data = small_cnn(torch.float32), batches(torch.float32, 3)
    probe = OffloadSession(force=KEEP, link=SameMemoryLink(gbps=(1.0, 1.0)), min_bytes=0)
    train(copy.deepcopy(model), data[:1], probe)
    groups = [planner.SavedGroup(g.nbytes, 0, 0) for g in probe._step.groups]
    profile = planner.StepProfile(groups, float(len(groups)), 10.0, 1.5 * 32768 / 2.5e6, 1.0, 1,
                                  forward_clock=[float(t) for t in range(len(groups))])
    modes = [OFFLOAD if g.offloadable else KEEP for g in probe._step.groups]
    reference = train(copy.deepcopy(model), data)
    trace, link = [], RecordingLink()
    session = OffloadSession(modes=modes, link=link, min_bytes=0, trace=trace)
    session.profile = profile
    assert_bitwise(reference, train(model, data, session))
    due = {g: planner.release_point(profile, g) for g, m in enumerate(modes) if m == OFFLOAD}
    assert {g: at for g, at in due.items() if groups[g].nbytes == 32768} == {
        g: min(g + 3, len(groups)) for g in due if groups[g].nbytes == 32768}
    assert len(groups) in due.values()          # some at the end of the forward
    for released in released_at(trace, len(groups)):
        assert released == due


def test_fetches_issued_at_one_unpack_go_in_the_order_the_groups_were_saved():
    # the one needed last is allocated first and freed last (stack order for the caching
    # allocator), as planner.simulate plays it (the one needed at that unpack goes first: _unpack)
    groups = [planner.SavedGroup(1000, 3 - g, 3 - g) for g in range(4)]
    modes = [KEEP, OFFLOAD, OFFLOAD, OFFLOAD]
    session = OffloadSession(modes=modes, link=RecordingLink(), min_bytes=0)
    session.profile = planner.StepProfile(groups, 1.0, 1.0, 1.0, 1.0, 4)
    session._first_unpacks = [g.first_unpack for g in groups]
    assert session._prefetch_schedule(modes) == {0: [1, 2, 3]}


class HoldingLink(RecordingLink):
    """RecordingLink that keeps CudaLink's books of held offloads: what is held until let_go."""

    def __init__(self):
        super().__init__()
        self.held = {}

    def offload(self, tensor, inline=False, held=False):
        transfer = super().offload(tensor, inline, held)
        if held:
            self.held[id(transfer)] = transfer
        return transfer

    def let_go(self, transfer):
        self.held.pop(id(transfer), None)
        super().let_go(transfer)


def test_a_held_offload_whose_graph_is_dropped_in_the_forward_still_goes_at_its_release_point():
    # the side branch's saved tensor loses every pack in the forward (its graph dropped): its
    # host copy goes back to the pool, and its device tensor still goes at its release point,
    # not at the next step
    torch.manual_seed(0)
    a, b, c = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 10)

    def forward(x):
        h = torch.tanh(a(x))
        side = torch.exp(b(h))     # exp saves its output: a group only this branch holds
        del side
        return c(torch.sigmoid(h))
    x = torch.randn(8, 16)
    probe = OffloadSession(force=KEEP, link=SameMemoryLink(gbps=(1.0, 1.0)), min_bytes=0)
    with probe:
        forward(x).sum().backward()
    groups = [planner.SavedGroup(g.nbytes, 0, 0) for g in probe._step.groups]
    link = HoldingLink()
    session = OffloadSession(modes=[OFFLOAD] * len(groups), link=link, min_bytes=0)
    session.profile = planner.StepProfile(groups, 1.0, 1.0, 1000.0, 1.0, 1,
                                          forward_clock=[float(i) for i in range(len(groups))])
    for _ in range(2):
        with session:
            loss = forward(x).sum()
        loss.backward()
        assert sum(e[0] == "offload" and e[-1] == "held" for e in link.log) > 0
        assert not link.held             # every held offload let go by the backward's end
        link.log.clear()


def test_with_no_plan_under_a_budget_each_offload_goes_at_the_next_point():
    # every tensor offloaded (no plan met the budget): the least memory, each offload released
    # at the next forward point however slow the link (its copies due far later)
    model, data = small_cnn(torch.float32), batches(torch.float32, 4)
    trace, said = [], []
    session = OffloadSession(budget=1000, link=RecordingLink(gbps=(0.001, 0.001)), min_bytes=0,
                             headroom=0.0, strict=False, say=said.append, trace=trace)
    train(model, data, session)
    assert session.plan is None and not session.fell_back
    offloaded = [g for g, m in enumerate(session.modes) if m == OFFLOAD]
    assert any(planner.release_point(session.profile, g) > g + 1 for g in offloaded)
    for released in released_at(trace, len(session.profile.groups))[2:]:
        assert released == {g: g + 1 for g in offloaded}


class ApartLink(RecordingLink):
    """RecordingLink that notes the bytes of every tensor it is asked to keep apart, and the
    copies it made."""

    def __init__(self):
        super().__init__()
        self.apart: list[int] = []
        self.copies: list[torch.Tensor] = []

    def keep_apart(self, tensor):
        copied = super().keep_apart(tensor)
        self.apart.append(tensor.numel() * tensor.element_size())
        self.copies.append(copied)
        return copied


@pytest.mark.parametrize("keep_apart", [True, False])
def test_small_kept_groups_are_copied_apart_in_planned_steps_only(keep_apart):
    # small_cnn's first activations are 4x its last: under a plan that offloads, kept groups of
    # at most a quarter of the largest are copies the link keeps apart, the others aliases; the
    # recording step and sessions told not to copy nothing; gradients bitwise equal
    model, data = small_cnn(torch.float64), batches(torch.float64, 5)
    reference = train(copy.deepcopy(model), data)
    link = ApartLink()
    session = OffloadSession(budget=saved_bytes(model, data) * 3 // 4, link=link, min_bytes=0,
                             headroom=0.0, record_steps=1, recompute_convolutions=False,
                             trials=False)
    maker = session.lifecycle.maker
    solve = maker.solve

    def plan_for(profile, target, explain=True):   # as if the trial had kept the plan run with
        return dataclasses.replace(solve(profile, target, explain),    # its small kept groups
                                   keep_apart=keep_apart)              # apart
    maker.solve = plan_for
    assert_bitwise(reference, train(model, data, session))
    plan, profile = session.plan, session.profile
    assert plan.count(OFFLOAD) + plan.count(RECOMPUTE) > 0
    largest = max(g.nbytes for g in profile.groups)
    expected = [g.nbytes for g, mode in zip(profile.groups, plan.modes)
                if mode == KEEP and g.offloadable and g.nbytes * 4 <= largest]
    assert expected == [profile.groups[i].nbytes for i in planner.kept_apart(profile, plan.modes)]
    if not keep_apart:
        assert link.apart == []
        return
    # a kept group over a quarter of the largest stays an alias
    assert any(mode == KEEP and 4 * g.nbytes > largest
               for g, mode in zip(profile.groups, plan.modes))
    # the recording step copied nothing; every planned step exactly the expected groups
    assert expected and link.apart == expected * (len(data) - 1)
    assert all(c._version == 1 for c in link.copies)


def test_the_runtime_module_still_names_what_scripts_import_from_it():
    # mucudnn.torch.runtime was split by responsibility; it re-exports the public names
    from mucudnn.torch import link, offload_session, recorder, recording, records, runtime
    assert runtime.OffloadSession is offload_session.OffloadSession
    assert (runtime.SameMemoryLink, runtime.CudaLink, runtime.Transfer, runtime.Mark,
            runtime.measure_bandwidth, runtime.dense) == (
        link.SameMemoryLink, link.CudaLink, link.Transfer, link.Mark, link.measure_bandwidth,
        link.dense)
    assert (runtime.CHEAP, runtime.CONVOLUTIONS, runtime.offload_everything,
            runtime.rerun_as_recorded) == (records.CHEAP, records.CONVOLUTIONS,
                                          records.offload_everything, records.rerun_as_recorded)
    assert (runtime.ADDS, runtime.CONCATS, runtime.LINK_PROBE_BYTES) == (
        recorder.ADDS, recorder.CONCATS, recording.LINK_PROBE_BYTES)
    assert sorted(runtime.__all__) == sorted(
        name for name in vars(runtime) if not name.startswith("_")
        and name not in ("link", "offload_session", "recorder", "recording", "records"))


@pytest.mark.parametrize("plan", ["keep", "offload", "mixed", "budget"])
def test_a_step_leaves_no_reference_cycle_behind(plan):
    """A step's records (its groups, their step, the packs autograd holds) are freed by their
    reference counts once the step is over and its graph dropped: none waits for the collector's
    full collections, which walk every young object and free a step's device tensors late."""
    from mucudnn.torch.records import _Group, _Packed, _Step
    model, data = small_cnn(torch.float32), batches(torch.float32, 6)
    probe = OffloadSession(force=RECOMPUTE, link=RecordingLink(), min_bytes=0)
    train(copy.deepcopy(model), data[:1], probe)
    recomputed = [g.mode == RECOMPUTE for g in probe._step.groups]
    assert any(recomputed)
    if plan == "budget":
        session = OffloadSession(budget=saved_bytes(model, data) * 2 // 3, link=RecordingLink(),
                                 min_bytes=0)
    else:
        modes = {"keep": [KEEP] * len(recomputed), "offload": [OFFLOAD] * len(recomputed),
                 "mixed": [RECOMPUTE if r else (OFFLOAD, KEEP)[i % 2]
                           for i, r in enumerate(recomputed)]}[plan]
        session = OffloadSession(modes=modes, link=RecordingLink(), min_bytes=0)
    gc.collect()
    debug = gc.get_debug()
    gc.disable()
    try:
        gc.set_debug(gc.DEBUG_SAVEALL)   # what a collection finds unreachable stays in gc.garbage
        trained = train(model, data, session)
        del trained
        gc.collect()
        cycles = [type(o).__name__ for o in gc.garbage if isinstance(o, (_Group, _Packed, _Step))]
    finally:
        gc.set_debug(debug)
        gc.garbage.clear()
        gc.enable()
    assert session.steps == len(data) - 1   # the last step ends where a next one would begin
    assert cycles == []


@pytest.mark.parametrize("backward", ["head_only", "retain_graph", "create_graph"])
@pytest.mark.parametrize("plan", ["keep", "offload", "mixed"])
def test_a_graph_dropped_after_a_backward_that_left_it_holding_packs_frees_its_step(
        backward, plan):
    """A backward that leaves saved tensors in the graph (``torch.autograd.grad`` of the head's
    weight alone: the nodes below it never run; ``retain_graph``; ``create_graph``, which retains
    it), then the graph dropped without another (a skipped loss, a probe of a gradient): the
    step's packs, groups and kept tensors go with the graph, the session's current step too.
    The step held the autograd node of its last unpack, whose graph held the packs that hold
    the step: a cycle through autograd's C++ nodes, which the collector cannot see, so every
    such step was kept for good (its kept device tensors with it)."""
    model, data = small_cnn(torch.float32), batches(torch.float32, 4)
    probe = OffloadSession(force=RECOMPUTE, link=RecordingLink(), min_bytes=0)
    train(copy.deepcopy(model), data[:1], probe)
    recomputed = [g.mode == RECOMPUTE for g in probe._step.groups]
    modes = {"keep": [KEEP] * len(recomputed), "offload": [OFFLOAD] * len(recomputed),
             "mixed": [RECOMPUTE if r else (OFFLOAD, KEEP)[i % 2]
                       for i, r in enumerate(recomputed)]}[plan]
    session = OffloadSession(modes=modes, link=RecordingLink(), min_bytes=0)
    head, first = model[-1].weight, model[0].weight
    steps = []
    for x, y in data:
        with session:
            loss = nn.functional.cross_entropy(model(x), y)
        steps.append(weakref.ref(session._step))
        if backward == "head_only":
            grad, = torch.autograd.grad(loss, head)
        elif backward == "retain_graph":
            grad, = torch.autograd.grad(loss, first, retain_graph=True)
        else:
            grad, = torch.autograd.grad(loss, first, create_graph=True)
        assert grad is not None and session._step.unpacks
        del loss, grad
        # the graph is gone: nothing holds a pack of the step, the session's step included
        assert session._step.live == 0
    gc.collect()
    assert steps[-1]() is session._step
    assert [ref() is None for ref in steps[:-1]] == [True] * (len(steps) - 1)
