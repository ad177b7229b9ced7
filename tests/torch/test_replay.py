"""Recipes replayed from autograd's graph (replay.py) on CPU torch: once a planned step has found
every recipe its plan needs, the next steps under that plan check those recipes against the
graph at their packs and record next to nothing, bit for bit as PyTorch alone; where the graph,
a module's arguments, a tensor's version or a pass-through module say the recipe may not hold,
the group is kept, the steps record again, and the session never replays under that plan."""

import copy

import pytest

torch = pytest.importorskip("torch")
if not hasattr(torch, "autograd") or not hasattr(torch.autograd, "graph"):
    pytest.skip("needs a real PyTorch", allow_module_level=True)

from torch import nn  # noqa: E402

from mucudnn.torch.link import SameMemoryLink  # noqa: E402
from mucudnn.torch.offload_session import OffloadSession  # noqa: E402
from mucudnn.torch.planner import KEEP, RECOMPUTE  # noqa: E402
from session_helpers import probed_groups, steps_against_plain  # noqa: E402


class _Block(nn.Module):
    """torchvision's Bottleneck shape: in-place ReLUs, a residual add, a downsample where the
    width changes (its batch norm's output is an intermediate no pack shows: a watched call)."""

    def __init__(self, inplanes, planes, downsample):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(inplanes, planes, 1, bias=False), nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, padding=1, bias=False)
        self.bn2, self.relu = nn.BatchNorm2d(planes), nn.ReLU(inplace=True)
        self.downsample = nn.Sequential(nn.Conv2d(inplanes, planes, 1, bias=False),
                                        nn.BatchNorm2d(planes)) if downsample else None

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += identity
        return self.relu(out)


class _Net(nn.Module):
    def __init__(self, dtype, act=None):
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8),
                                  nn.ReLU(inplace=True), nn.MaxPool2d(2))
        self.blocks = nn.Sequential(_Block(8, 8, False), _Block(8, 16, True))
        self.act = act or nn.Identity()
        self.spare = None          # a module run in ``act``'s place where set
        self.post = nn.Conv2d(16, 16, 1)   # saves ``act``'s output: a group it may recompute
        self.head = nn.Linear(16, 10)
        self.to(dtype)

    def forward(self, x):
        x = self.blocks(self.stem(x))
        x = self.post((self.spare or self.act)(x))
        return self.head(x.mean((2, 3)))


def _data(steps, dtype=torch.float64):
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 3, 16, 16, generator=generator, dtype=dtype),
             torch.randint(0, 10, (4,), generator=generator)) for _ in range(steps)]


def _modes(model, data):
    """Every group a forced recompute could rebuild whose maker is no convolution, recomputed."""
    modes = [RECOMPUTE if g.mode == RECOMPUTE and not g.producer.startswith("Conv") else KEEP
             for g in probed_groups(model, data)]
    assert RECOMPUTE in modes and KEEP in modes
    return modes


def _relu_output_recomputed(model, data):
    """Modes recomputing the one group a ReLU made (a probe step on a copy names each group's
    maker), keeping the others."""
    modes = [RECOMPUTE if g.producer == "ReLU" else KEEP
             for g in probed_groups(copy.deepcopy(model), data)]
    assert modes.count(RECOMPUTE) == 1
    return modes


def _from_third_step(attribute, make=lambda: True, otherwise=False):
    """A ``before`` for :func:`session_helpers.steps_against_plain`: each model's ``attribute`` set to a ``make()`` of
    its own from the third step on, to ``otherwise`` before it."""
    def before(index, *models):
        for model in models:
            setattr(model, attribute, make() if index >= 2 else otherwise)
    return before


def test_a_steady_planned_step_replays_its_recipes_and_records_next_to_nothing():
    data = _data(6)
    model = _Net(torch.float64)
    modes = _modes(copy.deepcopy(model), data)
    seen, session = steps_against_plain(model, data, modes)
    replayed, calls, recomputed = zip(*seen)
    assert replayed == (False, True, True, True, True, True)   # learnt from step 1
    assert set(recomputed) == {modes.count(RECOMPUTE)}          # every planned group, each step
    # recorded in a step that replays: the downsample's batch norm (its output an intermediate
    # no pack shows) and the max pooling (its indices' recipe, found from its call)
    assert calls[1:] == (2,) * 5 and calls[0] > 10
    # on the module hooks' short path (rule 4) once the rescue the first steps under new modes
    # arm (rescue.py, rule 5; it watches every module's output) is over: the last three
    assert session.lean_steps_run == 3


def test_a_step_that_replays_without_the_short_path_records_the_same():
    # rule 4's short path against the whole one: the same calls recorded, the same groups
    # recomputed, bit for bit as PyTorch alone either way
    data = _data(5)
    model = _Net(torch.float64)
    modes = _modes(copy.deepcopy(model), data)
    lean, session = steps_against_plain(copy.deepcopy(model), data, modes)
    whole, other = steps_against_plain(model, data, modes, lean=False)
    assert whole == lean and session.lean_steps_run == 2 and other.lean_steps_run == 0


def test_without_replay_the_steps_record_their_recipes_calls():
    data = _data(3)
    model = _Net(torch.float64)
    seen, _ = steps_against_plain(model, data, _modes(copy.deepcopy(model), data), replay=False)
    assert [s[0] for s in seen] == [False] * 3 and seen[2][1] > 10


def test_another_module_of_the_same_op_and_arguments_replays():
    # the graph shows the op and its arguments, not the module object: a spare LeakyReLU alike
    # computes what the learnt one would
    data = _data(5)
    model = _Net(torch.float64, act=nn.LeakyReLU(0.1))

    seen, _ = steps_against_plain(model, data, _modes(copy.deepcopy(model), data),
                             _from_third_step("spare", lambda: nn.LeakyReLU(0.1), None))
    assert [s[0] for s in seen] == [False, True, True, True, True]
    assert len({s[2] for s in seen}) == 1


def test_another_argument_keeps_the_group_and_ends_replay_under_the_plan():
    # a spare LeakyReLU of another slope from step 3: its node's argument differs from the
    # template's, so that group is kept (never a recipe through the wrong slope), the next steps
    # record their calls again, and the session does not replay under these modes again
    data = _data(6)
    model = _Net(torch.float64, act=nn.LeakyReLU(0.1))
    modes = _modes(copy.deepcopy(model), data)

    seen, session = steps_against_plain(model, data, modes,
                                   _from_third_step("spare", lambda: nn.LeakyReLU(0.3), None))
    replayed, _, recomputed = zip(*seen)
    assert replayed[:3] == (False, True, True)
    assert recomputed[2] == recomputed[1] - 1          # the spare's group kept
    assert not any(replayed[3:])
    learnt = session.recorder._recipe_modules[tuple(modes)]
    assert learnt.replay_failed and learnt.templates is None


def test_a_changed_hyperparameter_of_the_learnt_module_is_not_replayed():
    data = _data(5)
    model = _Net(torch.float64, act=nn.LeakyReLU(0.1))
    modes = _modes(copy.deepcopy(model), data)

    def steeper(index, *models):
        if index == 2:
            for m in models:
                m.act.negative_slope = 0.2

    seen, _ = steps_against_plain(model, data, modes, steeper)
    assert seen[2][0] and seen[2][2] == seen[1][2] - 1 and not seen[3][0]


class _Shifted(nn.Module):
    """conv, batch norm, then (from ``shift``) its output lowered in place under no_grad, out of
    autograd's sight, before a ReLU that is not in place reads it."""

    def __init__(self, dtype):
        super().__init__()
        torch.manual_seed(0)
        self.conv, self.norm, self.act = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU()
        self.conv2, self.head = nn.Conv2d(8, 8, 3, padding=1), nn.Linear(8, 10)
        self.shift = False
        self.to(dtype)

    def forward(self, x):
        out = self.norm(self.conv(x))
        if self.shift:
            with torch.no_grad():
                out.sub_(0.5)
        return self.head(self.conv2(self.act(out)).mean((2, 3)))


def test_an_intermediate_changed_out_of_autograds_sight_is_not_replayed():
    # the ReLU's input is the batch norm's output, no pack's: its module's calls are recorded
    # in a step that replays, and a version other than the one it returned at keeps the group
    data = _data(5)
    model = _Shifted(torch.float64)
    modes = _relu_output_recomputed(model, data)

    seen, _ = steps_against_plain(model, data, modes, _from_third_step("shift"))
    replayed, calls, recomputed = zip(*seen)
    assert replayed[:3] == (False, True, True) and calls[1] == 1   # the batch norm's call
    assert recomputed[:2] == (1, 1) and recomputed[2] == 0


class _ThroughData(nn.Module):
    """Returns its input, halved through ``.data`` (no version counter sees it)."""

    def forward(self, x):
        x.data.mul_(0.5)
        return x


def test_a_module_passing_on_its_input_ends_the_steps_replays():
    # from the sixth step, on the module hooks' short path (rule 4) as from the fourth
    data = _data(7)
    model = _Net(torch.float64)
    modes = _modes(copy.deepcopy(model), data)

    def halving(index, *models):
        for m in models:
            m.blocks[1].bn2 = nn.Sequential(m.blocks[1].bn2, _ThroughData()) if index == 5 \
                else (m.blocks[1].bn2[0] if isinstance(m.blocks[1].bn2, nn.Sequential)
                      else m.blocks[1].bn2)

    seen, session = steps_against_plain(model, data, modes, halving)
    assert seen[4][0] and seen[5][0] and session.lean_steps_run == 3   # steps 4, 5 and 6
    assert seen[5][2] < seen[4][2]     # the groups after the module's return: kept
    assert not seen[6][0]              # and the steps under that plan record again


def test_a_dropped_graph_is_still_let_go_while_the_session_replays():
    # the session names nodes by number and holds none: a forward whose graph is dropped
    # (a validation forward with grad) frees its packs, and the next step starts afresh
    data = _data(5)
    model = _Net(torch.float64)
    modes = _modes(copy.deepcopy(model), data)
    trace = []
    session = OffloadSession(modes=modes, link=SameMemoryLink(), min_bytes=0, trace=trace)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for index, (x, y) in enumerate(data):
        optimizer.zero_grad()
        with session:
            if index == 3:
                model(x)                        # dropped: no backward
            loss = nn.functional.cross_entropy(model(x), y)
            replays = session._step.replays is not None
        loss.backward()
        optimizer.step()
        if index >= 1:
            assert replays, index
    assert any(event[0] == "abandoned" for event in trace)


class _Chunked(nn.Module):
    """Two chunks of one tensor (one autograd node, two outputs): a convolution reads the first;
    a batch norm and a ReLU read the first, or (``swap``) the second."""

    def __init__(self, dtype):
        super().__init__()
        torch.manual_seed(0)
        self.stem, self.left = nn.Conv2d(3, 16, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1)
        self.norm, self.act = nn.BatchNorm2d(8), nn.ReLU()
        self.right, self.head = nn.Conv2d(8, 8, 3, padding=1), nn.Linear(16, 10)
        self.swap = False
        self.to(dtype)

    def forward(self, x):
        first, second = self.stem(x).chunk(2, dim=1)
        left = self.left(first)
        right = self.right(self.act(self.norm(second if self.swap else first)))
        return self.head(torch.cat((left, right), 1).mean((2, 3)))


def test_the_other_chunk_of_a_node_is_not_taken_for_a_source():
    # from step 3 the batch norm reads the other chunk (another output of the same node): the
    # ReLU's group is kept there, never rebuilt from the first chunk
    data = _data(5)
    model = _Chunked(torch.float64)
    modes = _relu_output_recomputed(model, data)

    seen, _ = steps_against_plain(model, data, modes, _from_third_step("swap"))
    assert seen[1] == (True, 1, 1)   # replayed (the batch norm's call recorded: watched), recomputed
    assert seen[2][0] and seen[2][2] == 0   # the other chunk: kept, not rebuilt from the first


def test_a_container_a_keyboard_interrupt_left_does_not_stretch_the_short_path_into_the_next_step():
    # a KeyboardInterrupt raised inside another model's forward, caught inside a ``with``
    # entered once, skips that model's always-called hooks: it stays on the session's stack of
    # containers and the short path takes it for its root, which never returns. The next step's
    # first module still starts that step (rule 4: a module called once the backward has begun
    # takes the whole path), and every step is PyTorch's, bit for bit
    def run(interrupt):
        data = _data(7)
        model = _Net(torch.float64)
        modes = _modes(copy.deepcopy(model), data)
        plain = copy.deepcopy(model)
        expected = []   # PyTorch alone's gradients, step by step (SGD: each step on the last)
        optimizer = torch.optim.SGD(plain.parameters(), lr=0.1)
        for x, y in data:
            optimizer.zero_grad()
            nn.functional.cross_entropy(plain(x), y).backward()
            expected.append([p.grad.clone() for p in plain.parameters()])
            optimizer.step()
        other = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16)).to(torch.float64)

        def stop(module, args):
            raise KeyboardInterrupt
        other[1].register_forward_pre_hook(stop)
        session = OffloadSession(modes=modes, link=SameMemoryLink(), min_bytes=0)
        started = []   # the session's step count at each step's first leaf module
        model.stem[0].register_forward_pre_hook(lambda module, args: started.append(session.steps))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        with session:
            for index, (x, y) in enumerate(data):
                if interrupt and index == 3:
                    with pytest.raises(KeyboardInterrupt):
                        other(torch.randn(2, 16, dtype=torch.float64))
                optimizer.zero_grad()
                nn.functional.cross_entropy(model(x), y).backward()
                for ours, theirs in zip(model.parameters(), expected[index]):
                    assert torch.equal(ours.grad, theirs), index
                optimizer.step()
        return started, session

    started, session = run(interrupt=True)
    assert session._containers == [] and session.lean_steps_run >= 2
    assert started == run(interrupt=False)[0]
