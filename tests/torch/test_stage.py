"""mucudnn.torch.stage on CPU torch: a staged chain's gradients equal the plain step's in float64 to
rounding (its parameter gradients are sums over micro-batches), only chains of per-sample layers in
a plain nn.Sequential are staged, and a staged forward that raises leaves grad mode as it was."""

import copy
import dataclasses
import types

import pytest

torch = pytest.importorskip("torch")
if not hasattr(torch, "autograd") or not hasattr(torch.autograd, "graph"):
    pytest.skip("needs a real PyTorch", allow_module_level=True)

from torch import nn  # noqa: E402

from mucudnn.errors import InfeasibleError  # noqa: E402
from mucudnn.torch import planner  # noqa: E402
from mucudnn.torch import planner_stage  # noqa: E402
from mucudnn.torch import planning  # noqa: E402
from mucudnn.torch.planner import KEEP  # noqa: E402
from mucudnn.torch.offload_session import OffloadSession  # noqa: E402
from mucudnn.torch.plan_runner import PlanMaker, StageCandidate  # noqa: E402
from session_helpers import RecordingLink, train  # noqa: E402

STEPS = 5   # two recording steps, three staged ones


def vgg_like(dtype=torch.float64, features=None):
    torch.manual_seed(0)
    features = features or nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(inplace=True), nn.Conv2d(8, 8, 3, padding=1),
        nn.ReLU(inplace=True), nn.MaxPool2d(2), nn.Conv2d(8, 16, 3, padding=1),
        nn.ReLU(inplace=True), nn.MaxPool2d(2))
    return nn.Sequential(features, nn.Flatten(), nn.Linear(16 * 4 * 4, 10)).to(dtype)


def batches(dtype=torch.float64, batch=8, steps=STEPS, input_grad=False):
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(batch, 3, 16, 16, generator=generator, dtype=dtype)
             .requires_grad_(input_grad), torch.randint(0, 10, (batch,), generator=generator))
            for _ in range(steps)]


def staged_session(**options):
    return OffloadSession(budget=2**50, link=RecordingLink(), min_bytes=0,
                          **{"stage": "always", **options})


def assert_close(expected, actual, rtol=1e-13):
    for step, (a, b) in enumerate(zip(expected, actual, strict=True)):
        for i, (u, v) in enumerate(zip(a, b, strict=True)):
            scale = max(u.abs().max().item(), 1e-300)
            assert (u - v).abs().max().item() <= rtol * scale, f"step {step} tensor {i}"


def test_a_staged_chain_trains_as_the_plain_step_in_float64():
    model, data = vgg_like(), batches()
    reference = train(copy.deepcopy(model), data)
    said = []
    session = staged_session(say=said.append)
    staged = train(copy.deepcopy(model), data, session)
    assert_close(reference, staged)
    # the first block (conv, relu, conv, relu, pool) staged, in 2 or more micro-batches
    stage = session.stage.stage
    assert (stage.modules, stage.first_group, stage.input_group) == (5, 0, 0)
    assert stage.chunks >= 2 and "staged" in said[-1]
    # its steps saved what the staged profile has: the input, then what follows the block
    recorded, profile = session.recorded_profile, session.profile
    assert [g.nbytes for g in session._step.groups] == [g.nbytes for g in profile.groups]
    assert len(profile.groups) == len(recorded.groups) - (stage.end_group - 1)
    assert profile.unpacks < recorded.unpacks


def test_the_inputs_gradient_through_a_staged_chain():
    model, data = vgg_like(), batches(input_grad=True)
    reference = copy.deepcopy(model)
    session = staged_session()
    for x, y in data:
        expected = x.detach().clone().requires_grad_()
        nn.functional.cross_entropy(reference(expected), y).backward()
        with session:
            loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        assert torch.allclose(x.grad, expected.grad, rtol=1e-13, atol=0)
    assert session.stage is not None


def test_a_staged_plan_whose_input_requires_grad_saves_what_its_profile_has():
    # a gradient penalty's input, or any input that requires grad, is autograd's to keep: the
    # staged step saves no group for it, and its profile has none (before, the profile's extra
    # "stage input" group shifted every group, and the steps kept them all)
    model, data = vgg_like(), batches(input_grad=True)
    said = []
    session = staged_session(say=said.append)
    assert_close(train(copy.deepcopy(model), data), train(model, data, session))
    stage = session.stage.stage
    assert stage.input_group is None and not stage.input_saved
    assert "stage input" not in [g.producer for g in session.profile.groups]
    assert [g.nbytes for g in session._step.groups] == [g.nbytes for g in session.profile.groups]
    assert not any("saves other tensors" in line for line in said), said
    # the same chain on an input that does not require grad: its input is a group
    plain = staged_session()
    train(vgg_like(), batches(), plain)
    assert plain.stage.stage.input_saved and plain.profile.groups[0].nbytes == \
        batches()[0][0].numel() * 8


@pytest.mark.parametrize("budget, stage", [(2**40, True), (60_000_000, True), (2**40, "always")])
def test_a_stage_that_would_leave_no_group_is_not_weighed(budget, stage):
    # found by a review: the input requires grad (autograd keeps it) and every save after the
    # second pooling layer is under min_bytes, so staging both blocks leaves no group to plan
    torch.manual_seed(0)
    model = nn.Sequential(nn.Sequential(
        nn.Conv2d(3, 64, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2),
        nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2)),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10)).double()
    generator = torch.Generator().manual_seed(2)
    data = [(torch.randn(32, 3, 64, 64, generator=generator, dtype=torch.float64)
             .requires_grad_(), torch.randint(0, 10, (32,), generator=generator))
            for _ in range(6)]
    session = OffloadSession(budget=budget, link=RecordingLink(), stage=stage, strict=False)
    assert_close(train(copy.deepcopy(model), data), train(model, data, session))
    # (under the small budget the recording stages both blocks itself and saves no group: it
    # records on, having nothing to plan)
    assert session.lifecycle.state not in ("recording", "planning") or session.stage is not None


@pytest.mark.parametrize("change", ["batch norm", "own hook", "own forward", "in place first",
                                    "functional"])
def test_only_a_plain_sequential_of_per_sample_layers_is_staged(change):
    features = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(inplace=True),
                             nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                             nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))
    if change == "batch norm":        # couples the batch's samples
        features.insert(1, nn.BatchNorm2d(8))
    elif change == "own hook":        # a rerun would run it again
        features[2].register_forward_hook(lambda module, args, output: None)
    elif change == "own forward":     # a rerun calls the class's
        features[2].forward = types.MethodType(lambda self, x: nn.Conv2d.forward(self, x) * 2,
                                               features[2])
    elif change == "in place first":  # the input it changes is the one saved
        features.insert(0, nn.ReLU(inplace=True))

    class Functional(nn.Sequential):   # a forward of its own: its children's reads are unknown
        def forward(self, x):
            for module in self:
                x = module(x)
            return x
    if change == "functional":
        features = Functional(*features)
    model, data = vgg_like(features=features), batches()
    reference = train(copy.deepcopy(model), data)
    session = staged_session()
    assert_close(reference, train(model, data, session), rtol=0)   # bit for bit: not staged
    assert session.stage is None


def test_no_staging_where_convolutions_may_not_rerun_or_staging_is_off():
    model, data = vgg_like(), batches()
    for options in ({"recompute_convolutions": False}, {"stage": False}):
        session = staged_session(**options)
        train(copy.deepcopy(model), data, session)
        assert session.stage is None


def test_a_staged_forward_that_raises_leaves_grad_mode_on():
    model, data = vgg_like(), batches()
    session = staged_session()
    train(model, data[:3], session)
    assert session.stage is not None
    wrong = torch.randn(8, 4, 16, 16, dtype=torch.float64)   # 4 channels: the first conv raises
    with pytest.raises(RuntimeError):
        with session:
            model(wrong)
    assert torch.is_grad_enabled() and session._staged is None
    # the next steps are staged again (a batch smaller than the chunks too: a chunk a sample),
    # and train as the plain ones
    data[-1] = (data[-1][0][:1], data[-1][1][:1])
    reference = copy.deepcopy(model)
    assert_close(train(reference, data[3:]), train(model, data[3:], session))
    # the last step (one sample) saved as many groups as the staged profile has: staged
    assert len(session._step.groups) == len(session.profile.groups) < len(
        session.recorded_profile.groups)


def test_a_staged_plan_is_taken_where_the_plain_one_does_not_fit():
    """The plan maker's choice of a stage (plan_runner.PlanMaker.choose_stage) on a profile whose
    block sets the floor: the plain plan has no room, the staged one does."""
    from test_planner import staged_chain_profile
    MiB = 2**20
    profile = dataclasses.replace(staged_chain_profile(), d2h_gbps=1e-3, h2d_gbps=1e-3)
    modules = list(vgg_like()[0])[:5]
    stage = planner_stage.Stage(5, 0, 3, 0, 1 * MiB, 1, 3.0)
    candidate = StageCandidate(stage, 8, (modules, vgg_like()[0]))
    target = 30 * MiB
    with pytest.raises(InfeasibleError):
        planning.plan_with_prefetch(profile, target, 2, 5)
    plan, chosen = PlanMaker(2, 20).choose_stage(profile, target, [candidate], True)
    assert plan is not None and plan.peak <= target
    assert chosen is not None and chosen[0].payload is candidate.payload
    assert chosen[0].stage.chunks == min(planner_stage.stage_chunks(profile, stage), 8)
    assert chosen[1] is not profile and len(plan.modes) == 3 and KEEP in plan.modes


def test_a_lowering_weighs_the_recordings_stages_again_at_its_lower_target():
    """PlanMaker's LOWER (plan_runner.PlanMaker._staged_lowering): at the first target the
    plain plan is the faster and is taken; at half the headroom less, moving more of the plain
    profile's groups over a slow link is far slower than staging the block, so the lowering
    takes the stage (VGG-16 N=176 under 6.5 GiB on the H200: 201 ms against 159)."""
    from test_planner import staged_chain_profile
    from mucudnn.torch.plan_runner import FIRST, LOWER, PlanRequest
    MiB = 2**20
    profile = dataclasses.replace(staged_chain_profile(), d2h_gbps=1e-3, h2d_gbps=1e-3)
    modules = list(vgg_like()[0])[:5]
    candidate = StageCandidate(planner_stage.Stage(5, 0, 3, 0, 1 * MiB, 1, 3.0), 8,
                               (modules, vgg_like()[0]))
    budget, headroom = int(36.5 * MiB / 0.85), 0.1
    maker = PlanMaker(2, 5)
    first = maker(PlanRequest(FIRST, profile, planner.planning_target(budget, headroom), budget,
                              headroom, candidates=(candidate,)))
    assert first.stage is None and first.profile is profile and first.plan is not None
    lower = PlanRequest(LOWER, profile, first.target, budget, headroom, peak=first.plan.peak,
                        candidates=(candidate,), recorded=profile)
    staged = maker(lower)
    target = first.target - int(headroom / 2 * budget)
    assert staged.target == target and staged.plan.peak <= target
    assert staged.stage is not None and staged.stage.payload is candidate.payload
    assert staged.profile == planner_stage.staged_profile(profile, staged.stage.stage)
    # the same lowering not weighing the stages: the plain profile's plan for less, far slower
    plain = maker(dataclasses.replace(lower, candidates=()))
    assert plain.stage is None and plain.plan.peak <= target
    assert plain.plan.predicted_ms > 10 * staged.plan.predicted_ms
    assert maker(dataclasses.replace(lower, staging=False)).stage is None
    # where the stage in force is that stage, it is not weighed against itself
    again = maker(dataclasses.replace(lower, profile=staged.profile, target=staged.target))
    assert again.stage is None


def test_an_unknown_stage_value_is_one_clear_error():
    with pytest.raises(ValueError, match="stage='never' is not True, False or 'always'"):
        OffloadSession(budget=2**30, stage="never")


def weighed_stages(monkeypatch) -> list:
    """The candidates :meth:`PlanMaker.choose_stage` is given, a tuple per call, from now on."""
    weighed = []
    original = PlanMaker.choose_stage

    def recorded(self, profile, target, candidates, staging):
        weighed.append(candidates)
        return original(self, profile, target, candidates, staging)
    monkeypatch.setattr(PlanMaker, "choose_stage", recorded)
    return weighed


def leading_chain_bytes(model, batch):
    """Three of the first block's largest tensors at ``batch`` (what its backward holds)."""
    x = batches(batch=batch, steps=1)[0][0]
    largest = x.numel() * x.element_size()
    with torch.no_grad():
        for module in list(model[0])[:5]:
            x = module(x)
            largest = max(largest, x.numel() * x.element_size())
    return 3 * largest


def test_a_recording_that_would_not_fit_stages_the_first_block_and_trains_as_plain():
    from mucudnn.torch import stage as stage_module
    model, data = vgg_like(), batches()
    reference = train(copy.deepcopy(model), data)
    floor = leading_chain_bytes(model, 8)
    said = []
    # the first block's backward alone would hold more than RECORDING_STAGE_SHARE of this budget
    session = OffloadSession(budget=int(floor / (stage_module.RECORDING_STAGE_SHARE + 0.1)),
                             link=RecordingLink(), min_bytes=0, say=said.append, headroom=0.0,
                             strict=False)
    steps = []
    original = session._close_step

    def close(failed, out_of_memory):
        steps.append((session.lifecycle.state, session.stage is not None))
        original(failed, out_of_memory)
    session._close_step = close
    staged = train(copy.deepcopy(model), data, session)
    assert_close(reference, staged)
    assert said[0].startswith("the recording stages the first 5 layers in ")
    # staged from the first recording step on, and its plans made on the staged profile
    assert steps[0] == ("recording", True) and all(is_staged for _, is_staged in steps)
    stage = session.stage.stage
    assert stage.modules == 5 and stage.chunks >= 2
    assert session.recorded_profile is session.lifecycle.recorded_profile
    # a staged step saves the block's input and nothing of the block: the recorded profile's
    # first group is the input, its next what the second block saved
    first = session.recorded_profile.groups[0]
    assert first.nbytes == data[0][0].numel() * data[0][0].element_size()


def staged_recording(model, **options):
    """A session whose recording stages the first block of ``model`` (its backward alone would
    hold more than RECORDING_STAGE_SHARE of the budget)."""
    from mucudnn.torch import stage as stage_module
    floor = leading_chain_bytes(model, 8)
    return OffloadSession(budget=int(floor / (stage_module.RECORDING_STAGE_SHARE + 0.1)),
                          link=RecordingLink(), min_bytes=0, headroom=0.0, strict=False,
                          **options)


@pytest.mark.parametrize("staging", [True, "always"])
def test_a_recording_that_staged_weighs_its_stage_extended_to_the_next_pooling_layer(
        staging, monkeypatch):
    # VGG-16 at N=176 under 5.5 GiB: the recording stages the first block, and the second
    # block's backward then sets the floor; staging both blocks is the faster plan there
    model, data = vgg_like(), batches()
    reference = train(copy.deepcopy(model), data)
    said, weighed = [], []
    session = staged_recording(model, say=said.append, stage=staging)
    original = PlanMaker.choose_stage

    def recorded(self, profile, target, candidates, staging):
        weighed.extend(candidates)
        return original(self, profile, target, candidates, staging)
    monkeypatch.setattr(PlanMaker, "choose_stage", recorded)
    staged = train(copy.deepcopy(model), data, session)
    assert_close(reference, staged)
    assert said[0].startswith("the recording stages the first 5 layers in ")
    # the one candidate: the recorded stage and the next block, to its pooling layer
    (candidate,) = weighed
    recorded_chunks = candidate.stage.recorded_chunks
    assert (candidate.stage.modules, candidate.stage.first_group, candidate.stage.input_group) \
        == (8, 0, 0)
    assert recorded_chunks >= 2 and candidate.stage.forward_ms > 0
    assert [type(m) for m in candidate.payload[0]] == [type(m) for m in model[0]]
    stage = session.stage.stage
    # "always" takes it; otherwise it is taken where predicted faster (this CPU's times say)
    assert stage.modules == 8 or (staging is True and stage.modules == 5)
    if stage.modules == 8:
        assert stage.chunks >= recorded_chunks and "its first 8 layers staged" in said[1]
        # planned on the longer stage's profile, made from the recorded (staged) one
        assert session.profile == planner_stage.staged_profile(session.recorded_profile, stage)
    else:
        assert session.profile is session.recorded_profile
    # the planned steps saved what the profile planned on has
    assert [g.nbytes for g in session._step.groups] == [g.nbytes for g in session.profile.groups]


def test_a_lowering_that_takes_the_longer_stage_trains_as_the_plain_step(monkeypatch):
    # VGG-16 N=176 under 6.5 GiB on the H200: the recording staged the first block, the plan on
    # it flushed the caching allocator, and the lowering took both blocks staged (c7fe7ae). Here
    # the first plan is the recorded stage's, its steps flush, and the lowering is made to take
    # the longer stage: from the step after it, the steps stage both blocks, and every step's
    # gradients are PyTorch alone's (float64)
    from mucudnn.torch import stage as stage_module
    model, data = vgg_like(), batches(steps=14)
    reference = train(copy.deepcopy(model), data)
    monkeypatch.setattr(planning, "trial_plans", lambda *args, **kwargs: [])
    original = PlanMaker.choose_stage
    monkeypatch.setattr(PlanMaker, "choose_stage",   # the first plan: the recorded stage's
                        lambda self, profile, target, candidates, staging:
                        original(self, profile, target, (), staging))
    monkeypatch.setattr(planner_stage, "STAGE_MIN_GAIN", -10.0)   # the lowering: the longer

    class FlushingFirstPlan(RecordingLink):
        count, last = 0, None

        def flushes(self):
            session = self.session
            if session.plan is not None and session.lifecycle._lowered_target is None and \
                    self.last != session.steps:
                self.last, self.count = session.steps, self.count + 1
            return self.count
    link, said, stages = FlushingFirstPlan(), [], []
    floor = leading_chain_bytes(model, 8)
    session = OffloadSession(budget=int(floor / (stage_module.RECORDING_STAGE_SHARE + 0.1)),
                             link=link, min_bytes=0, headroom=0.1, strict=False,
                             say=said.append)
    link.session = session
    original_close = session._close_step

    def close_step(*args):
        stages.append(session.stage.stage.modules if session.stage is not None else None)
        return original_close(*args)
    session._close_step = close_step
    assert_close(reference, train(copy.deepcopy(model), data, session))
    assert said[0].startswith("the recording stages the first 5 layers in ")
    lowered = next(i for i, line in enumerate(said) if "so planning for" in line)
    assert "(planned for " in said[lowered + 1] and \
        said[lowered + 1].endswith("its first 8 layers staged (rerun in "
                                   f"{session.stage.stage.chunks} micro-batches in the "
                                   f"backward, {session.stage.stage.forward_ms:.1f} ms)")
    assert stages[0] == 5 and stages[-1] == 8 and stages == sorted(stages, key=lambda m: m or 0)
    assert session.profile == planner_stage.staged_profile(session.recorded_profile,
                                                           session.stage.stage)
    # the steps after the switch saved what the longer stage's profile has
    assert [g.nbytes for g in session._step.groups] == [g.nbytes for g in session.profile.groups]


def test_a_recording_stages_through_the_next_block_whose_backward_would_not_fit_either(
        monkeypatch):
    # VGG-16 at N=176 under 4.5 GiB: staged to its first pooling layer, the recording ran out
    # of memory in the second block's backward. Here the second block's three largest tensors
    # (8 KiB a sample, 8 samples) take more than half of the budget too: the recording stages
    # both blocks, and no other stage is weighed on its profile
    from mucudnn.torch import stage as stage_module
    model, data = vgg_like(), batches()
    reference = train(copy.deepcopy(model), data)
    floor = leading_chain_bytes(model, 8)
    second = 3 * 16 * 8 * 8 * 8 * 8    # the second convolution's output, float64, three times
    said = []
    weighed = weighed_stages(monkeypatch)
    for budget, modules in ((int(second / stage_module.RECORDING_FLOOR_SHARE) - 1024, 8),
                            (int(second / stage_module.RECORDING_FLOOR_SHARE) + 1024, 5)):
        assert floor > stage_module.RECORDING_FLOOR_SHARE * budget
        said.clear()
        weighed.clear()
        session = OffloadSession(budget=budget, link=RecordingLink(), min_bytes=0,
                                 headroom=0.0, strict=False, say=said.append)
        assert_close(reference, train(copy.deepcopy(model), data, session))
        assert said[0].startswith(f"the recording stages the first {modules} layers in ")
        assert session.recorded_profile.groups[0].nbytes == \
            data[0][0].numel() * data[0][0].element_size()
        # staged through both blocks by the recording: nothing longer to weigh; else the
        # first block's stage extended through the second
        assert [c.stage.modules for c in sum(weighed, ())] == ([] if modules == 8 else [8])


def test_a_recording_stage_through_a_larger_second_block_takes_that_blocks_micro_batches():
    # found by a review: the second block's tensors are the chain's largest, and the micro-batch
    # count chosen for the first block alone left a chunk of it over the whole budget
    from mucudnn.torch import stage as stage_module
    features = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(inplace=True),
                             nn.MaxPool2d(2), nn.Conv2d(4, 128, 3, padding=1),
                             nn.ReLU(inplace=True), nn.MaxPool2d(2)).double()
    x = torch.randn(32, 3, 16, 16, dtype=torch.float64)
    budget = int(3 * 4 * 16 * 16 * 8 * 32 / (stage_module.RECORDING_STAGE_SHARE + 0.1))
    chain, chunks = stage_module.recording_stage(features[0], features, x, budget)
    assert len(chain) == 6
    second = 3 * 128 * 8 * 8 * 8 * 32   # three of the second block's largest, the whole batch
    assert second / chunks <= stage_module.RECORDING_CHUNK_SHARE * budget or chunks == 32


def test_no_longer_stage_where_the_chain_does_not_go_on_in_the_recorded_stages_container(
        monkeypatch):
    # the second block in a container of its own: no chain goes on from the recorded stage
    first = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(inplace=True),
                          nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2))
    second = nn.Sequential(nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(inplace=True),
                           nn.MaxPool2d(2))
    model = vgg_like(features=nn.Sequential(first, second))
    data = batches()
    reference = train(copy.deepcopy(model), data)
    weighed = weighed_stages(monkeypatch)
    floor = leading_chain_bytes(nn.Sequential(first), 8)
    from mucudnn.torch import stage as stage_module
    session = OffloadSession(budget=int(floor / (stage_module.RECORDING_STAGE_SHARE + 0.1)),
                             link=RecordingLink(), min_bytes=0, headroom=0.0, strict=False,
                             stage="always")
    assert_close(reference, train(copy.deepcopy(model), data, session))
    assert session.stage.stage.modules == 5 and not any(weighed)


def test_a_recording_that_fits_is_not_staged_and_stage_false_never_stages():
    from mucudnn.torch import stage as stage_module
    model, data = vgg_like(), batches(steps=3)
    floor = leading_chain_bytes(model, 8)
    for budget, staging in ((int(floor / stage_module.RECORDING_STAGE_SHARE * 1.5), True),
                            (int(floor), False)):
        said = []
        session = OffloadSession(budget=budget, link=RecordingLink(), min_bytes=0,
                                 say=said.append, stage=staging, strict=False)
        train(copy.deepcopy(model), data[:1], session)
        assert session.stage is None
        assert not any("recording stages" in line for line in said)


def test_a_recording_whose_chains_backward_takes_under_the_stage_share_is_plain_and_weighs_staging(
        monkeypatch):
    # VGG-16 at N=176 under 12 GiB: its first block's backward takes 0.53 of the budget; a plain
    # recording fits, and its plain plan ran faster than the staged one a staged recording
    # leaves the planner (plan-accuracy/README.md). Here 0.55: the recording runs unstaged, the
    # planner weighs the stage on its plain profile, and the steps train as PyTorch alone
    from mucudnn.torch import stage as stage_module
    from mucudnn.torch.stage import leading_chain, recording_chunks
    model, data = vgg_like(), batches()
    floor = leading_chain_bytes(model, 8)
    chain = leading_chain(model[0][0], model[0])
    x = data[0][0]
    assert recording_chunks(chain, x, int(floor / stage_module.RECORDING_STAGE_SHARE) + 1) is None
    assert recording_chunks(chain, x, int(floor / stage_module.RECORDING_STAGE_SHARE) - 1024) >= 2
    budget = int(floor / 0.55)
    assert stage_module.RECORDING_FLOOR_SHARE * budget < floor < \
        stage_module.RECORDING_STAGE_SHARE * budget
    said = []
    weighed = weighed_stages(monkeypatch)
    reference = train(copy.deepcopy(model), data)
    session = OffloadSession(budget=budget, link=RecordingLink(), min_bytes=0, headroom=0.0,
                             strict=False, say=said.append)
    assert_close(reference, train(copy.deepcopy(model), data, session))
    assert not any("recording stages" in line for line in said)
    # the recorded profile is the plain one (the plan's, or the one a staged plan was made
    # from): its first groups are the first block's
    recorded = session.recorded_profile or session.profile
    assert recorded.groups[0].nbytes == x.numel() * x.element_size()
    assert recorded.groups[1].nbytes == 8 * 8 * 16 * 16 * 8    # the first convolution's output
    assert [c.stage.modules for c in sum(weighed, ())][:1] == [5]


def test_a_plain_recordings_stages_carry_each_calls_time_to_the_lifecycle(monkeypatch):
    # the lifecycle sums each call's least time over the recordings (least_rerun_times): each
    # recording's candidates carry their calls' times, and their rerun is those times' sum
    from mucudnn.torch import lifecycle as lifecycle_module
    model, data = vgg_like(), batches()
    floor = leading_chain_bytes(model, 8)
    seen = []
    original = lifecycle_module.least_rerun_times
    monkeypatch.setattr(lifecycle_module, "least_rerun_times",
                        lambda recorded: seen.append(list(recorded)) or original(recorded))
    session = OffloadSession(budget=int(floor / 0.55), link=RecordingLink(), min_bytes=0,
                             headroom=0.0, strict=False)
    train(copy.deepcopy(model), data, session)
    (recorded,) = seen
    assert len(recorded) == 2 and all(recorded)
    for candidates in recorded:
        for candidate in candidates:
            assert len(candidate.call_ms) == candidate.stage.modules
            assert candidate.stage.forward_ms == sum(ms or 0.0 for ms in candidate.call_ms)
    assert all(ms is not None and ms > 0 for c in recorded[-1] for ms in c.call_ms)


def test_recording_chunks_are_the_fewest_within_their_share():
    from mucudnn.torch.stage import RECORDING_CHUNK_SHARE, leading_chain, recording_chunks
    model = vgg_like()
    chain = leading_chain(model[0][0], model[0])
    assert chain == list(model[0])[:5]
    x = batches(batch=16, steps=1)[0][0]
    held = leading_chain_bytes(model, 16)
    assert recording_chunks(chain, x, held * 10) is None
    chunks = recording_chunks(chain, x, held)
    assert chunks == next(c for c in (2, 4, 8, 16) if held / c <= RECORDING_CHUNK_SHARE * held)
    # no chain where the container is no plain Sequential, or where a module is not stageable
    assert leading_chain(model[0][0], model) is None
    features = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.MaxPool2d(2))
    assert leading_chain(features[0], features) is None


def test_a_stage_says_its_rerun_time_only_where_it_has_one():
    recorded = planner_stage.Stage(5, 0, 3, 0, 1024, 4, 12.5)
    assert recorded.describe() == ("its first 5 layers staged (rerun in 4 micro-batches in the "
                                   "backward, 12.5 ms)")
    taken_in_recording = dataclasses.replace(recorded, forward_ms=0.0)
    assert taken_in_recording.describe() == ("its first 5 layers staged (rerun in 4 "
                                             "micro-batches in the backward)")


def test_a_staged_plan_is_cached_and_a_second_run_stages_from_its_first_step(tmp_path,
                                                                              monkeypatch):
    from mucudnn.torch import planning as planning_module
    from mucudnn.torch.plancache import PlanCache
    model, data = vgg_like(), batches(steps=STEPS + 1)
    reference = train(copy.deepcopy(model), data)
    said = []
    first = staged_session(say=said.append, plan_cache=PlanCache(tmp_path), trials=False)
    assert_close(reference, train(copy.deepcopy(model), data, first))
    stage = first.stage.stage
    entry = PlanCache(tmp_path).load(first._cache_key)
    assert entry is not None and entry.stage == stage
    assert entry.recorded_profile == first.recorded_profile and entry.profile == first.profile

    def no_solve(*args, **kwargs):
        raise AssertionError("a cached run solves nothing")
    monkeypatch.setattr(planning_module, "plan_with_prefetch", no_solve)
    said, staged_steps = [], []
    second = staged_session(say=said.append, plan_cache=PlanCache(tmp_path), trials=False)
    real_finish = type(first)._after_module

    def after_module(self, module, args, output):
        if self._staged is not None and module is self._staged.modules[-1]:
            staged_steps.append(self.steps)
        return real_finish(self, module, args, output)
    monkeypatch.setattr(type(first), "_after_module", after_module)
    assert_close(reference, train(copy.deepcopy(model), data, second))
    assert said[0].startswith("offload plan for ") and "from the plan cache" in said[0]
    assert "staged" in said[0] and len(said) == 1   # nothing recorded anew
    # every step staged, the first among them, under the cached plan
    assert staged_steps == list(range(len(data)))
    assert second.plan == first.plan and second.stage.stage == stage


def test_a_cached_staged_plan_whose_chain_is_gone_records_anew_in_one_line(tmp_path):
    from mucudnn.torch.plancache import PlanCache
    model, data = vgg_like(), batches(steps=STEPS)
    first = staged_session(plan_cache=PlanCache(tmp_path), trials=False)
    train(copy.deepcopy(model), data, first)
    assert PlanCache(tmp_path).load(first._cache_key).stage is not None
    # the same script's model with a hook on its first convolution: no chain starts there
    changed = copy.deepcopy(model)
    changed[0][0].register_forward_hook(lambda module, args, output: None)
    said = []
    second = staged_session(say=said.append, plan_cache=PlanCache(tmp_path), trials=False)
    reference = train(copy.deepcopy(changed), data)
    assert_close(reference, train(changed, data, second))
    assert said[0] == ("the cached offload plan stages its first 5 layers, which this step's "
                       "first module does not start; recording anew")
    # it recorded and planned anew: a plan of its own, no stage (the hooked layer is no chain's)
    assert second.plan is not None and second.stage is None


def test_a_cached_staged_plan_whose_last_pool_now_returns_indices_is_not_staged(tmp_path):
    # a pooling layer returning its indices gives a tuple, which a staged chain cannot end in
    # (a recording's chain ends before it): the cached run must not stage the chain that ends
    # there, else its forward goes on with the chain's output on the batch's first sample alone
    from mucudnn.torch.plancache import PlanCache

    class Indexed(nn.Module):   # takes the pooled output where the pool gives its indices too
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.features = nn.Sequential(
                nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(inplace=True),
                nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2))
            self.head = nn.Sequential(nn.Flatten(), nn.Linear(8 * 8 * 8, 10))

        def forward(self, x):
            x = self.features(x)
            return self.head(x[0] if isinstance(x, tuple) else x)
    model, data = Indexed().double(), batches(steps=STEPS)
    first = staged_session(plan_cache=PlanCache(tmp_path), trials=False)
    train(copy.deepcopy(model), data, first)
    assert PlanCache(tmp_path).load(first._cache_key).stage.modules == 5
    changed = copy.deepcopy(model)
    changed.features[4].return_indices = True
    reference = train(copy.deepcopy(changed), data)
    said = []
    second = staged_session(say=said.append, plan_cache=PlanCache(tmp_path), trials=False)
    assert_close(reference, train(changed, data, second))
    assert said[0] == ("the cached offload plan stages its first 5 layers, which this step's "
                       "first module does not start; recording anew")
    assert second.stage is None


def test_a_cached_staged_plan_is_not_staged_on_an_unbatched_input(tmp_path):
    # a convolution takes an unbatched image (C, H, W) too: its first dimension is no batch,
    # so the chain is not staged on it (a first "sample" of one channel would reach the
    # convolution); the cached plan's first step then records anew
    from mucudnn.torch.plancache import PlanCache

    class Unflattened(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.features = nn.Sequential(
                nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1),
                nn.ReLU(), nn.MaxPool2d(2))
            self.head = nn.Linear(8 * 8 * 8, 10)

        def forward(self, x):
            return self.head(self.features(x).flatten(-3))
    model, data = Unflattened().double(), batches(steps=STEPS)
    first = staged_session(plan_cache=PlanCache(tmp_path), trials=False)
    train(copy.deepcopy(model), data, first)
    assert PlanCache(tmp_path).load(first._cache_key).stage.modules == 5
    unbatched = [(x[0], y[0]) for x, y in data]
    reference = train(copy.deepcopy(model), unbatched)
    second = staged_session(plan_cache=PlanCache(tmp_path), trials=False)
    assert_close(reference, train(copy.deepcopy(model), unbatched, second), rtol=0)


def test_a_plan_is_looked_up_at_the_first_save_where_the_first_layer_runs_on_the_host_of_a_gpu(
        tmp_path, monkeypatch):
    # with a GPU there, a first leaf module given a host tensor (a preprocessing layer before
    # the model's device) is not where the plan's device, and so its key's GPU, is known
    from mucudnn.torch.offload_session import OffloadSession as Session
    from mucudnn.torch.plancache import PlanCache
    calls = []
    real = Session._look_up_plan
    monkeypatch.setattr(Session, "_look_up_plan",
                        lambda self, device, first=None: calls.append(first is not None) or
                        real(self, device, first))
    model, data = vgg_like(), batches(steps=1)
    for gpu in (False, True):
        monkeypatch.setattr(torch.cuda, "is_available", lambda gpu=gpu: gpu)
        calls.clear()
        train(copy.deepcopy(model), data, staged_session(plan_cache=PlanCache(tmp_path)))
        # without a GPU, at the first leaf module; with one, at the first save
        assert calls == [not gpu]


class ChainClockLink(RecordingLink):
    """A link on a fake clock (each stamp 1 µs after the one before: how busy the machine is
    plays no part) on which each run of the staged chain takes 50 ms: its forward under
    ``no_grad`` and each micro-batch's rerun in the backward."""

    TICK, CHAIN_S = 1e-6, 0.05

    def __init__(self):
        super().__init__()
        self.ticks, self.lag, self.forwards, self.reruns = 0, 0.0, 0, 0

    def _stamp(self):
        self.ticks += 1
        return self.ticks * self.TICK + self.lag


def staged_recording_session(model, link, record_steps: int) -> OffloadSession:
    """A session on ``link`` whose recording stages ``model``'s first block (its backward holds
    more than :data:`stage.RECORDING_STAGE_SHARE` of the budget) at batch 8."""
    from mucudnn.torch import stage as stage_module
    floor = leading_chain_bytes(model, 8)
    return OffloadSession(budget=int(floor / (stage_module.RECORDING_STAGE_SHARE + 0.1)),
                          link=link, min_bytes=0, headroom=0.0, strict=False,
                          record_steps=record_steps)


def test_a_staged_recordings_times_count_the_chains_forward_and_its_reruns(monkeypatch):
    # a recording that stages runs its chain's forward before its first save (the chain saves
    # nothing; the stage's input is saved after the chain's output is made): the profile's
    # forward starts where the chain started, not at that save, and its backward holds the
    # chain's reruns. Else a staged plan is predicted a chain's forward too fast (VGG-16 N=176
    # at 9.7 GiB on an H100: predicted 140 ms, ran 161)
    from mucudnn.torch import stage as stage_module
    link = ChainClockLink()
    run_chain = stage_module.run_chain

    def timed_chain(modules, weights, value, autocast):
        if torch.is_grad_enabled():
            link.reruns += 1
        else:
            link.forwards += 1
        link.lag += link.CHAIN_S
        return run_chain(modules, weights, value, autocast)
    monkeypatch.setattr(stage_module, "run_chain", timed_chain)
    model, data = vgg_like(), batches(steps=3)
    session = staged_recording_session(model, link, record_steps=2)
    train(copy.deepcopy(model), data, session)
    stage = session.stage.stage
    assert link.forwards >= 2 * stage.chunks and link.reruns >= 2 * stage.chunks
    profile = session.recorded_profile
    chain_ms = stage.chunks * link.CHAIN_S * 1e3   # a step's chain: one run per micro-batch
    assert chain_ms <= profile.forward_ms < chain_ms + 20
    assert chain_ms <= profile.backward_ms < chain_ms + 20
    # the groups saved after the chain are saved a chain's time into the forward
    assert profile.forward_clock[0] >= chain_ms


def test_a_staged_recordings_forward_that_raised_before_its_first_save_is_not_timed(
        monkeypatch):
    # the chain raises (out of memory) in a recording step's forward, before the step saved
    # anything, and the script skips that batch: the step stays open for the next forward, whose
    # chain's start is where its forward starts (not the start of the one that raised, a second
    # of the script's handling before it). One recording: the least of two would hide it
    from mucudnn.torch import stage as stage_module
    from session_helpers import train_through_failures
    link = ChainClockLink()
    run_chain = stage_module.run_chain

    def timed_chain(modules, weights, value, autocast):
        link.lag += link.CHAIN_S
        if not link.forwards and not torch.is_grad_enabled():
            link.forwards += 1
            link.lag += 1.0
            raise torch.OutOfMemoryError("the chain ran out of memory (test)")
        return run_chain(modules, weights, value, autocast)
    monkeypatch.setattr(stage_module, "run_chain", timed_chain)
    model, data = vgg_like(), batches(steps=4)
    session = staged_recording_session(model, link, record_steps=1)
    assert train_through_failures(copy.deepcopy(model), data, session) == 1
    stage = session.stage.stage
    chain_ms = stage.chunks * link.CHAIN_S * 1e3
    profile = session.recorded_profile
    assert profile is not None and chain_ms <= profile.forward_ms < chain_ms + 20
    assert profile.forward_clock[0] < chain_ms + 20
