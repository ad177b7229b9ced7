"""mucudnn.torch's recorder on CPU torch (recorder.py): leaf modules and ops recorded into a
step, the recipes found from them (recomputed tensors bitwise equal to a plain run), and the
step's profile (times, baselines, the link's speeds). Its recipes: test_recipes.py."""

import contextlib
import copy
import os
import sys
import time

import pytest

torch = pytest.importorskip("torch")
if not hasattr(torch, "autograd") or not hasattr(torch.autograd, "graph"):
    pytest.skip("needs a real PyTorch", allow_module_level=True)

from torch import nn  # noqa: E402

from mucudnn.torch import planner  # noqa: E402
from mucudnn.torch.link import SameMemoryLink  # noqa: E402
from mucudnn.torch.offload_session import OffloadSession  # noqa: E402
from mucudnn.torch.planner import KEEP, OFFLOAD, RECOMPUTE  # noqa: E402
from session_helpers import (  # noqa: E402
    assert_bitwise, batches, GiB, joined, MeteredLink, probed_groups, RecordingLink, SlowHostLink,
    small_cnn, steps_against_plain, TinyUNet, train, volumes, WithSpike)


@pytest.mark.parametrize("where", ["backward", "optimizer"])
def test_the_plan_counts_the_measured_peak_between_points(where):
    # a backward node's workspace (or the optimizer's temporaries) that no point's allocated bytes
    # show: the profile's baseline takes the peak between points, and the plan's peak includes it
    model, data = small_cnn(torch.float32), batches(torch.float32, 3)
    link = MeteredLink()
    spike = lambda: link.spike(GiB)   # noqa: E731
    wrapped = WithSpike(model, spike if where == "backward" else None)
    session = OffloadSession(budget=4 * GiB, link=link, min_bytes=0, headroom=0.0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in data:
        with session:
            loss = nn.functional.cross_entropy(wrapped(x), y)
        loss.backward()
        if where == "optimizer":
            spike()
        optimizer.step()
    saved = sum(g.nbytes for g in session.profile.groups)
    assert max(session.profile.baseline_backward) >= GiB - saved
    assert session.plan.peak >= GiB


def test_what_the_recorded_step_leaves_behind_is_in_every_baseline():
    # the optimizer's state, made by the first step, is on the device in every later step
    model, data = small_cnn(torch.float32), batches(torch.float32, 3)

    class GrowingLink(MeteredLink):
        def __init__(self):
            super().__init__()
            self.resident = 0

        def allocated(self):
            return self.resident

    link = GrowingLink()
    session = OffloadSession(budget=4 * GiB, link=link, min_bytes=0, headroom=0.0,
                             record_steps=1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in data:
        with session:
            loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        link.resident = GiB          # the first optimizer step's state
    assert min(session.profile.baseline_forward + session.profile.baseline_backward) >= GiB
    assert session.plan.peak >= GiB


@pytest.mark.parametrize("probe_bytes", [0, 1 << 40])
def test_the_host_link_is_timed_on_the_recording_steps_own_copies(monkeypatch, probe_bytes):
    # no probe buffer allocated after the recording (at the tightest moment) when the recording's
    # copies were large enough to time the link; a probe only when they were not
    from mucudnn.torch import link as link_module
    from mucudnn.torch import recording as recording_module
    probed = []

    def probe(link, device):
        probed.append(device)
        return 1.5, 2.5

    monkeypatch.setattr(recording_module, "LINK_PROBE_BYTES", probe_bytes)
    monkeypatch.setattr(link_module, "measure_bandwidth", probe)
    model, data = small_cnn(torch.float32), batches(torch.float32, 3)
    session = OffloadSession(budget=GiB, link=SameMemoryLink(), min_bytes=0)
    train(model, data, session)
    speeds = (session.profile.d2h_gbps, session.profile.h2d_gbps)
    if probe_bytes:
        assert probed and speeds == (1.5, 2.5)
    else:
        assert not probed and min(speeds) > 0 and speeds != (1.5, 2.5)


class SlowBackward(torch.autograd.Function):
    """Identity that saves nothing; its backward takes 50 ms (the first layer's weight gradient
    and the rest of a backward after its last unpack)."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(0.05)
        return grad


def test_the_recorded_backward_runs_to_its_end():
    model, data = small_cnn(torch.float32), batches(torch.float32, 3)

    class First(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, x):
            return self.model(SlowBackward.apply(x.detach().requires_grad_()))

    session = OffloadSession(budget=GiB, link=SameMemoryLink(gbps=(1e3, 1e3)), min_bytes=0)
    train(First(), data, session)
    assert session.profile.backward_ms >= 50


def test_the_recorded_times_leave_out_the_hosts_waits():
    # the recording step offloads everything; the host's waits there (pinning memory, the copy
    # queue) are no module's compute: counted, they made offloading look free and recomputing dear
    model, data = small_cnn(torch.float32), batches(torch.float32, 3)
    link = SlowHostLink()
    session = OffloadSession(budget=GiB, link=link, min_bytes=0)
    train(model, data, session)
    profile = session.profile
    waited_ms = link.WAIT_MS * link.host_allocations
    assert link.host_allocations >= 10 and link.stalls == [] and not link.timing
    assert profile.forward_ms < waited_ms / 3
    recipes = [g.recompute_ms for g in profile.groups if g.recompute_ms is not None]
    assert recipes and max(recipes) < link.WAIT_MS


def test_a_function_that_cannot_be_hashed_passes_the_op_recorder():
    class Unhashable:
        __hash__ = None

        def __call__(self, tensor):
            return tensor + 1

    x = torch.zeros(2)
    with OffloadSession(force=RECOMPUTE, link=RecordingLink(), min_bytes=0):
        assert torch.overrides.handle_torch_function(Unhashable(), (x,), x).tolist() == [1, 1]


def test_a_convolution_recorded_under_autocast_is_replayed_under_it():
    # bf16 autocast on the CPU: the rerun convolution must cast as its forward did (outside
    # autocast, a bf16 input meets float32 weights and the backward fails)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                          nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))
    data = batches(torch.float32, 2)

    def steps(model, session=None):
        optimizer, grads = torch.optim.SGD(model.parameters(), lr=0.1), []
        for x, y in data:
            optimizer.zero_grad()
            with session or contextlib.nullcontext(), torch.autocast("cpu", dtype=torch.bfloat16):
                loss = nn.functional.cross_entropy(model(x).float(), y)
            loss.backward()
            grads.append([p.grad.clone() for p in model.parameters()])
            optimizer.step()
        return grads

    reference = steps(copy.deepcopy(model))
    session = OffloadSession(force=RECOMPUTE, link=RecordingLink(), min_bytes=0)
    assert_bitwise(reference, steps(model, session))
    assert any(g.mode == RECOMPUTE and g.recipe.calls[0].name == "Conv2d"
               for g in session._step.groups)


class LaggingHostLink(RecordingLink):
    """A link on a fake clock: each stamp reads 1 µs after the one before (wall-clock time plays
    no part: how busy the machine is cannot change a time), and the host falls 50 ms behind (the
    device idle meanwhile, as its clock shows) at every saved group of ``lagging`` recording
    steps (counted from 1), between the group's copy and the next (where a lag is compute time
    to the clock, as the host's interpreter would make it, not a copy's)."""

    TICK = 1e-6

    def __init__(self, lagging):
        super().__init__()
        self.lagging, self.lag, self.ticks, self.session = lagging, 0.0, 0, None

    def _stamp(self):
        self.ticks += 1
        return self.ticks * self.TICK + self.lag

    def keep_device_behind(self):   # at each saved group of a recording step, before its mark
        if self.session.lifecycle.recorded_steps + 1 in self.lagging:
            self.lag += 0.05


@pytest.mark.parametrize("lagging", [{1}, {2}])
def test_a_host_lagging_in_one_recording_step_stretches_no_time_of_the_profile(lagging,
                                                                              monkeypatch):
    # whichever recording lagged, the profile's times are those of the one that did not. On the
    # fake clock an unlagged recording's times are its stamps, a µs each (about 0.1 ms here), and
    # a lagged one's at least 50 ms: deterministic on any machine, however busy
    model, data = small_cnn(torch.float32), batches(torch.float32, 3)
    link = LaggingHostLink(lagging)
    recordings = []
    least_times = planner.least_times
    monkeypatch.setattr(planner, "least_times",
                        lambda profiles: recordings.extend(profiles) or least_times(profiles))
    session = link.session = OffloadSession(budget=GiB, link=link, min_bytes=0, record_steps=2)
    train(model, data, session)
    profile = session.profile
    assert link.lag >= 0.05 * 5
    # the lagged recording's times show the lag; the profile's do not
    assert len(recordings) == 2
    (lagged,) = [recordings[step - 1] for step in lagging]
    assert lagged.forward_ms >= 50
    assert profile.forward_ms < 40
    assert profile.forward_clock[-1] < 40
    recipes = [g.recompute_ms for g in profile.groups if g.recompute_ms is not None]
    assert recipes and max(recipes) < 40


class ProbingLink(MeteredLink):
    """A link whose speed is unknown until probed; the probe allocates 1 GiB (its buffer)."""

    def __init__(self):
        super().__init__()
        self.gbps, self.probes = None, 0

    def bandwidth_gbps(self):
        self.probes += 1
        self.spike(GiB)
        self.gbps = (1000.0, 0.001)
        return self.gbps


def test_a_probe_of_the_link_between_recording_steps_is_in_no_baseline():
    # the first recording's profile probes the link (no copy there was long enough to time it)
    # as the next recording starts: what the probe allocated is not that step's
    model, data = small_cnn(torch.float32), batches(torch.float32, 3)
    link = ProbingLink()
    session = OffloadSession(budget=4 * GiB, link=link, min_bytes=0, record_steps=2)
    train(model, data, session)
    assert link.probes == 1
    profile = session.profile
    assert max(profile.baseline_forward + profile.baseline_backward) < GiB // 2


@pytest.mark.parametrize("force", [KEEP, OFFLOAD, RECOMPUTE])
def test_a_step_records_its_calls_only_where_its_groups_may_find_recipes(force):
    # a module's hooks in a step that recomputes nothing (no recipe, no alias to start one
    # from) do no more than the host must: no call recorded, no group named; gradients alike
    dtype = torch.float64
    model, data = TinyUNet(dtype, seed=0), volumes(dtype, 2)
    reference = train(copy.deepcopy(model), data)
    session = OffloadSession(force=force, link=RecordingLink(), min_bytes=0)
    x, y = data[0]
    with session:
        loss = nn.functional.cross_entropy(model(x), y)
    step = session._step
    assert bool(step.calls) == (force == RECOMPUTE)
    assert bool(step.by_view) == (force == RECOMPUTE)   # the instance norms' aliases
    assert all(bool(g.producer) == (force == RECOMPUTE) for g in step.groups)
    loss.backward()
    session = OffloadSession(force=force, link=RecordingLink(), min_bytes=0)
    assert_bitwise(reference, train(model, data, session))


def test_the_sessions_own_hooks_go_past_its_op_recorder(monkeypatch):
    # while the op recorder (a torch function mode) is entered, every torch function called in
    # the forward is a Python call through it: the session's own hooks' reads of tensors are not
    # (the model's ops still are, and a cat is still recorded)
    from mucudnn.torch import recorder as recorder_module
    callers = []
    passed = recorder_module._OpRecorder.__torch_function__
    torch_files = os.path.dirname(torch.__file__) + os.sep

    def counting(self, func, types, args=(), kwargs=None):
        frame = sys._getframe(1)   # the first caller outside torch
        while frame is not None and frame.f_code.co_filename.startswith(torch_files):
            frame = frame.f_back
        callers.append(frame.f_code.co_filename if frame is not None else "")
        return passed(self, func, types, args, kwargs)
    monkeypatch.setattr(recorder_module._OpRecorder, "__torch_function__", counting)
    dtype = torch.float64
    model, data = TinyUNet(dtype, seed=0), volumes(dtype, 2)
    session = OffloadSession(force=RECOMPUTE, link=RecordingLink(), min_bytes=0)
    train(model, data, session)
    own = {f"mucudnn/torch/{name}.py" for name in (
        "offload_session", "session_plans", "recorder", "records", "link")}
    assert callers and not [c for c in callers if any(c.endswith(path) for path in own)]
    assert joined(session._step.groups)   # the cat was recorded, and rebuilds its group


def functions_through_the_op_recorder(monkeypatch) -> list:
    """The names of the torch functions that pass through the session's op recorder from now
    on, in order (its ``__torch_function__`` wrapped for the test)."""
    from mucudnn.torch import recorder as recorder_module
    passed, through = recorder_module._OpRecorder.__torch_function__, []

    def counting(self, func, types, args=(), kwargs=None):
        through.append(getattr(func, "__name__", ""))
        return passed(self, func, types, args, kwargs)
    monkeypatch.setattr(recorder_module._OpRecorder, "__torch_function__", counting)
    return through


def test_a_leaf_modules_forward_runs_without_the_op_recorder_even_after_one_raised(monkeypatch):
    # no op inside a leaf module is recorded, so none goes through the recorder (a Python call
    # each); a leaf whose forward raises puts it back all the same, and the next step's
    # concatenation is still recorded
    through = functions_through_the_op_recorder(monkeypatch)
    dtype = torch.float64
    model, data = TinyUNet(dtype, seed=0), volumes(dtype, 2)
    reference = train(copy.deepcopy(model), data)

    class Raising(nn.Module):
        def forward(self, x):
            raise ValueError("a leaf that fails")
    session = OffloadSession(force=RECOMPUTE, link=RecordingLink(), min_bytes=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    results = []
    for x, y in data:
        optimizer.zero_grad()
        with session:
            with pytest.raises(ValueError):
                Raising()(x)
            recorder = session.recorder.ops
            top = torch._C._get_function_stack_at(torch._C._len_torch_function_stack() - 1)
            assert recorder is not None and top is recorder
            loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        results.append([p.grad.clone() for p in model.parameters()] +
                       [b.clone() for b in model.buffers()])
        optimizer.step()
    assert_bitwise(reference, results)
    assert "cat" in through and not {"conv3d", "instance_norm", "leaky_relu_"} & set(through)
    assert joined(session._step.groups)   # the cat was recorded, and rebuilds its group
    assert torch._C._len_torch_function_stack() == 0


@pytest.mark.parametrize("where", ["own hooks", "a global hook registered later"])
def test_a_mode_entered_and_left_by_hooks_around_a_leaf_leaves_the_op_recorder_on_top(where):
    # hooks that run after the session's pre-hook enter a mode and leave it after the forward:
    # the recorder is then not set aside for that module (put back on top of the mode, the
    # mode's exit would pop it)
    from torch.nn.modules import module as modules

    class Mode(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    def stack():
        return [torch._C._get_function_stack_at(i)
                for i in range(torch._C._len_torch_function_stack())]
    mode, leaf = Mode(), nn.Linear(8, 8).double()

    def enter(*args):
        mode.__enter__()

    def leave(*args):
        mode.__exit__(None, None, None)
    session = OffloadSession(force=RECOMPUTE, link=RecordingLink(), min_bytes=0)
    with session:
        handles = ([leaf.register_forward_pre_hook(enter), leaf.register_forward_hook(leave)]
                   if where == "own hooks" else
                   [modules.register_module_forward_pre_hook(enter),
                    modules.register_module_forward_hook(leave)])
        try:
            before = stack()
            leaf(torch.randn(4, 8, dtype=torch.float64, requires_grad=True)).sum().backward()
            assert stack() == before == [session.recorder.ops]
        finally:
            for handle in handles:
                handle.remove()
    assert stack() == []


class UnregisteredPool(nn.Module):
    """A leaf module (no children) that runs a module it does not register: its call starts
    before the pool's and returns after it, with the pool's output."""

    def __init__(self):
        super().__init__()
        self.__dict__["pool"] = nn.AvgPool2d(2)   # not a child

    def forward(self, x):
        return self.pool(x)


def test_the_last_call_that_returned_a_tensor_is_found_where_calls_nest():
    # calls: conv (0), UnregisteredPool (1), AvgPool2d (2); AvgPool2d returns first, the
    # leaf then returns the same tensor: the last call before the pack that returned it is
    # AvgPool2d (recomputable, from the conv's output, saved), not the leaf (not recomputable)
    dtype = torch.float64
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), UnregisteredPool(),
                          nn.Conv2d(8, 8, 3, padding=1), nn.Flatten(),
                          nn.Linear(8 * 8 * 8, 10)).to(dtype)
    data = batches(dtype, 2)
    expected = train(copy.deepcopy(model), data)
    session = OffloadSession(force=RECOMPUTE, link=RecordingLink(), min_bytes=0,
                             recompute_convolutions=False)
    assert_bitwise(expected, train(model, data, session))
    pooled = next(g for g in session._step.groups if g.nbytes == 4 * 8 * 8 * 8 * 8 and g.gid > 0)
    assert pooled.recipe is not None and pooled.mode == RECOMPUTE
    assert [c.name for c in pooled.recipe.calls] == ["AvgPool2d"]


class SlowCopyLink(LaggingHostLink):
    """:class:`LaggingHostLink`'s fake clock, lagging nowhere, where each inline copy (either
    way) takes 5 ms on the clock though the link's speed (1000 GB/s) would move its bytes in
    nanoseconds: a recording's copies slower than the link's best."""

    def __init__(self):
        super().__init__(lagging=set())

    def keep_device_behind(self):
        pass

    def offload(self, tensor, inline=False, held=False):
        if inline:
            self.lag += 0.005
        return super().offload(tensor, inline, held)

    def fetch(self, host, device, inline=False):
        if inline:
            self.lag += 0.005
        return super().fetch(host, device, inline)


def test_a_recordings_copies_are_no_compute_time_however_slow():
    # every saved tensor is copied inline to the host and back in a recording: the forward's
    # and the backward's compute times leave out each copy as long as it took (a copy slower
    # than the link's speed says would otherwise count as compute: 5 ms a copy, against the
    # step's ~0.1 ms of fake-clock compute)
    model, data = small_cnn(torch.float32), batches(torch.float32, 3)
    link = SlowCopyLink()
    session = link.session = OffloadSession(budget=GiB, link=link, min_bytes=0, record_steps=2)
    train(model, data, session)
    profile = session.profile
    copies = sum(g.offloadable for g in profile.groups)
    assert copies >= 5 and link.lag >= 2 * 2 * copies * 0.005   # both ways, both recordings
    assert profile.forward_ms < 1 and profile.backward_ms < 1
    assert profile.forward_clock[-1] < 1 and profile.backward_clock[-1] < 1


class _Rerouted(nn.Module):
    """small_cnn whose second ReLU is one of two modules alike, picked by ``other``."""

    def __init__(self, dtype):
        super().__init__()
        self.net = small_cnn(dtype)
        self.spare = nn.ReLU()
        self.other = False

    def forward(self, x):
        for index, layer in enumerate(self.net):
            x = (self.spare if index == 6 and self.other else layer)(x)
        return x


def _probed_modes(model, data):
    # every group a forced recompute could rebuild, recomputed (a convolution's output too)
    return [group.mode for group in probed_groups(model, data)]


def _small_cnn_and_modes(steps):
    """``steps`` float64 batches, small_cnn and its probed modes (some kept, some recomputed)."""
    data = batches(torch.float64, steps)
    model = small_cnn(torch.float64)
    modes = _probed_modes(copy.deepcopy(model), data)
    assert RECOMPUTE in modes and KEEP in modes
    return data, model, modes


def test_a_planned_step_records_only_the_modules_its_recipes_ran():
    # after a planned step that recorded every call, a step under the same modes records only
    # the calls its recomputed groups' recipes ran (the host's cost of a leaf module is mostly
    # its call's record), finds the same recipes, and trains bit for bit as PyTorch alone
    data, model, modes = _small_cnn_and_modes(4)
    reference = train(copy.deepcopy(model), data)
    session = OffloadSession(modes=modes, link=SameMemoryLink(), min_bytes=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    results, calls, recomputed = [], [], []
    for x, y in data:
        optimizer.zero_grad()
        with session:
            loss = nn.functional.cross_entropy(model(x), y)
            step = session._step
            calls.append(len(step.calls))
            recomputed.append([g.gid for g in step.groups if g.mode == RECOMPUTE])
            loss.backward()
        results.append([p.grad.clone() for p in model.parameters()] +
                       [b.clone() for b in model.buffers()])
        optimizer.step()
    assert recomputed[0] and all(gids == recomputed[0] for gids in recomputed)
    assert calls[1] < calls[0] and calls[1:] == [calls[1]] * 3
    assert_bitwise(reference, results)


def _steps_against_plain(model, data, modes, switch, replay=True):
    """SGD steps (no momentum) of ``model`` under fixed ``modes`` and of its plain copy,
    ``switch(index)`` setting both models' ``other`` (or ``halve``) before step ``index``; each
    step's gradients equal bit for bit (session_helpers.steps_against_plain). Per step: the calls
    it recorded and the groups it recomputed."""
    seen, _ = steps_against_plain(model, data, modes, switch, replay=replay, momentum=0.0)
    return [calls for _, calls, _ in seen], [recomputed for _, _, recomputed in seen]


def _rerouted_from(first):
    """A ``switch`` taking the spare ReLU from step ``first`` on (``first(index)`` where
    callable)."""
    def switch(index, *models):
        for model in models:
            model.other = first(index) if callable(first) else index >= first
    return switch


def test_a_step_that_finds_fewer_recipes_has_the_next_record_every_call():
    # a module that the learnt recipes never ran (another ReLU in its place from step 3 on):
    # the step that records only the learnt ones keeps that group (no recipe, no wrong one),
    # and the next two steps record every call again (twice the one step learnt from before),
    # and recompute it; the step after them records only the modules learnt. (Without replay:
    # a step that replays sees the same op in the graph and recomputes it: test_replay.py.)
    dtype = torch.float64
    data = batches(dtype, 6)
    model = _Rerouted(dtype)
    calls, recomputed = _steps_against_plain(
        model, data, _probed_modes(copy.deepcopy(model), data), _rerouted_from(2), replay=False)
    full = calls[0]
    assert calls[1] < full                                  # learnt from step 1
    assert recomputed[2] < recomputed[1] and calls[2] < full   # the spare ReLU: no recipe
    assert calls[3] == calls[4] == full                       # every call recorded again
    assert recomputed[3] == recomputed[4] == recomputed[0]
    assert calls[5] < full and recomputed[5] == recomputed[0]    # learnt again, with the spare


class _HalvedThroughData(nn.Module):
    """Halves its input through ``.data`` (a change no version counter sees) and returns it."""

    def forward(self, x):
        x.data.mul_(0.5)
        return x


class _Halving(nn.Module):
    """A convolution, a batch norm and a ReLU; from ``halve`` on, the convolution's output is
    halved in place through ``.data`` by a leaf module between them."""

    def __init__(self, dtype):
        super().__init__()
        torch.manual_seed(0)
        self.conv1, self.norm = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.act, self.conv2 = nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1)
        self.head, self.halving = nn.Linear(8, 10), _HalvedThroughData()
        self.halve = False
        self.to(dtype)

    def forward(self, x):
        out = self.conv1(x)
        if self.halve:
            out = self.halving(out)
        return self.head(self.conv2(self.act(self.norm(out))).mean((2, 3)))


def test_a_module_returning_its_changed_input_is_its_maker_in_a_step_that_records_recipes_only():
    # the convolution's output, halved through ``.data`` by a module that returns it: where that
    # module's call is recorded, it made the batch norm's input (no recipe reruns the
    # convolution in its place); a step that records only the learnt recipes' modules must not
    # rebuild it by the convolution alone either (a gradient of the unhalved output)
    dtype = torch.float64
    data = batches(dtype, 4)
    model = _Halving(dtype)
    modes = _probed_modes(copy.deepcopy(model), data)
    assert modes[1] == RECOMPUTE   # the batch norm's input, by the convolution

    def halve_from_step_3(index, *models):
        for halving in models:
            halving.halve = index >= 2
    _steps_against_plain(model, data, modes, halve_from_step_3)


def test_steps_of_another_batch_size_do_not_stop_the_plans_recomputes_for_good():
    # a planned step at another batch size than the profile's (a multi-scale loop, an epoch's
    # last batch) wants nothing recomputed (its groups are other sizes): one that records every
    # call learns no module from it, and the steps at the profile's size after it must still
    # find their recipes (they keep the plan's recomputed groups at most until a step that
    # records every call again), not keep them for good
    dtype = torch.float64
    model = small_cnn(dtype)
    full = batches(dtype, 7)
    data = [(x[:3], y[:3]) if index in (1, 2) else (x, y) for index, (x, y) in enumerate(full)]
    probe = OffloadSession(force=RECOMPUTE, link=SameMemoryLink(), min_bytes=0)
    with probe:
        nn.functional.cross_entropy(copy.deepcopy(model)(full[0][0]), full[0][1]).backward()
    modes = [group.mode for group in probe._step.groups]
    assert RECOMPUTE in modes and KEEP in modes
    reference = train(copy.deepcopy(model), data)
    session = OffloadSession(modes=modes, link=SameMemoryLink(), min_bytes=0)
    session.profile = planner.StepProfile(
        [planner.SavedGroup(g.nbytes, 0, 0) for g in probe._step.groups], 1.0, 1.0, 1.0, 1.0, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    results, recomputed = [], []
    for x, y in data:
        optimizer.zero_grad()
        with session:
            loss = nn.functional.cross_entropy(model(x), y)
            recomputed.append([g.gid for g in session._step.groups if g.mode == RECOMPUTE])
            loss.backward()
        results.append([p.grad.clone() for p in model.parameters()] +
                       [b.clone() for b in model.buffers()])
        optimizer.step()
    assert_bitwise(reference, results)
    assert recomputed[0] and recomputed[1] == recomputed[2] == []
    assert recomputed[-2:] == [recomputed[0]] * 2


def test_a_forward_that_alternates_between_two_modules_recomputes_in_both():
    # the second ReLU is one of two modules alike, every other step (two tasks' heads taken in
    # turn, a GAN's generator and discriminator steps): a step that records every call is always
    # the one after a step that found fewer recipes, so the same forward, and the other forward's
    # steps, recording only its modules, keep that group in every step (recording every call,
    # both recompute it)
    dtype = torch.float64
    data = batches(dtype, 8)
    model = _Rerouted(dtype)
    _, recomputed = _steps_against_plain(
        model, data, _probed_modes(copy.deepcopy(model), data),
        _rerouted_from(lambda index: index % 2 == 1))
    assert recomputed[-2:] == [recomputed[0]] * 2


def test_a_gradient_penalty_does_not_stop_the_plans_recomputes_for_good():
    # a gradient penalty (WGAN-GP, R1): the penalty's ops after ``autograd.grad`` save after an
    # unpack, so they are a step of their own, which wants nothing recomputed; it teaches no
    # module, and every later forward still rebuilds what its plan recomputes
    data, model, modes = _small_cnn_and_modes(5)

    def run(session):
        trained = copy.deepcopy(model)
        optimizer = torch.optim.SGD(trained.parameters(), lr=0.01)
        results, recomputed = [], []
        for x, y in data:
            optimizer.zero_grad()
            x = x.clone().requires_grad_()
            with session if session is not None else contextlib.nullcontext():
                loss = nn.functional.cross_entropy(trained(x), y)
                if session is not None:
                    recomputed.append([g.gid for g in session._step.groups
                                       if g.mode == RECOMPUTE])
                grad, = torch.autograd.grad(loss, x, create_graph=True)
                (loss + grad.pow(2).sum()).backward()
            results.append([p.grad.clone() for p in trained.parameters()] +
                           [b.clone() for b in trained.buffers()])
            optimizer.step()
        return results, recomputed

    reference, _ = run(None)
    results, recomputed = run(OffloadSession(modes=modes, link=SameMemoryLink(), min_bytes=0))
    assert_bitwise(reference, results)
    assert recomputed[0] and recomputed == [recomputed[0]] * len(data)


def test_a_plan_run_again_after_another_records_only_what_it_learnt():
    # a trial runs plan A, then plan B, then keeps A: A's steps after B's record only the
    # modules A learnt (no step recording every call again), B's first step records every call
    # (nothing learnt under B yet), and every step trains bit for bit as PyTorch alone
    data, model, modes = _small_cnn_and_modes(6)
    other = list(modes)
    other[other.index(RECOMPUTE)] = KEEP   # B: one group fewer recomputed
    plans = [modes, modes, other, other, modes, modes]
    reference = train(copy.deepcopy(model), data)
    session = OffloadSession(modes=modes, link=SameMemoryLink(), min_bytes=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    results, calls = [], []
    for (x, y), plan in zip(data, plans):
        session.lifecycle.modes = list(plan)
        optimizer.zero_grad()
        with session:
            loss = nn.functional.cross_entropy(model(x), y)
            calls.append(len(session._step.calls))
            loss.backward()
        results.append([p.grad.clone() for p in model.parameters()] +
                       [b.clone() for b in model.buffers()])
        optimizer.step()
    full = calls[0]
    assert calls[1] < full            # A learnt from step 0
    assert calls[2] == full           # B's first step: nothing learnt under B
    assert calls[3] < full            # B learnt
    assert calls[4] == calls[5] == calls[1]   # A again: what it learnt, at once
    assert_bitwise(reference, results)


@pytest.mark.parametrize("default_device", [False, True])
def test_a_step_whose_modes_recompute_nothing_runs_without_the_op_recorder(monkeypatch,
                                                                           default_device):
    # one ``with`` over the whole loop (as ``mucudnn run --offload`` enters it): the recording
    # steps enter the op recorder; once a plan that keeps everything is in force its steps leave
    # it at their first leaf module (no torch function goes through it: a Python call each), and
    # a later step whose modes recompute enters it again and records the concatenation; every
    # gradient is the plain run's, bit for bit. ``torch.set_default_device`` inside the ``with``
    # (a script's first line under ``mucudnn run``) puts its mode below the recorder: the
    # recorder comes back above it
    through = functions_through_the_op_recorder(monkeypatch)
    dtype = torch.float64
    model, data = TinyUNet(dtype, seed=0), volumes(dtype, 8)
    reference = train(copy.deepcopy(model), data)
    session = OffloadSession(budget=GiB, link=RecordingLink(), min_bytes=0,
                             plan_in_background=False, trials=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    results, per_step, stacks = [], [], []
    with session:
        if default_device:
            torch.set_default_device("cpu")
        try:
            for index, (x, y) in enumerate(data):
                if index == 6:   # another plan: every group recomputed where it can be
                    session.modes = [RECOMPUTE] * len(session.modes)
                optimizer.zero_grad()
                through.clear()
                loss = nn.functional.cross_entropy(model(x), y)
                stacks.append(torch._C._len_torch_function_stack() - default_device)
                loss.backward()
                per_step.append((session.modes is not None and RECOMPUTE not in session.modes,
                                 len(through), "cat" in through))
                results.append([p.grad.clone() for p in model.parameters()] +
                               [b.clone() for b in model.buffers()])
                optimizer.step()
        finally:
            if default_device:
                torch.set_default_device(None)
    assert_bitwise(reference, results)
    kept_only = [index for index, (keeps, _, _) in enumerate(per_step) if keeps]
    assert kept_only and kept_only[-1] == 5 and per_step[0][1] > 0 and stacks[0] == 1
    for index in kept_only:
        assert per_step[index][1] == 0 and stacks[index] == 0, (index, per_step, stacks)
    assert per_step[6][2] and per_step[7][2] and stacks[6:] == [1, 1]
    assert joined(session._step.groups)   # the cat was recorded, and rebuilds its group
    assert torch._C._len_torch_function_stack() == 0
