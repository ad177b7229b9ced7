"""mucudnn.torch's recipes on CPU torch (recipes.py finds them from what recorder.py records,
records.py reruns them): saved tensors rebuilt from saved groups through modules, adds and
concatenations, bitwise equal to a plain run, and never from a source changed since it was
saved."""

import contextlib
import copy
import threading

import pytest

torch = pytest.importorskip("torch")
if not hasattr(torch, "autograd") or not hasattr(torch.autograd, "graph"):
    pytest.skip("needs a real PyTorch", allow_module_level=True)

from torch import nn  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402

from benchmarks.host_overhead import resnet_of  # noqa: E402
from mucudnn.torch import planner  # noqa: E402
from mucudnn.torch.offload_session import OffloadSession  # noqa: E402
from mucudnn.torch.planner import KEEP, OFFLOAD, RECOMPUTE  # noqa: E402
from session_helpers import (  # noqa: E402
    assert_bitwise, batches, conv1x1, conv3x3, DTYPES, GiB, HeldBytes, joined, MeteredLink,
    RecordingLink, saved_bytes, small_cnn, split_steps, TinyUNet, train, volumes)


@pytest.mark.parametrize("dtype", DTYPES)
def test_recompute_gives_the_same_gradients(dtype):
    model, data = small_cnn(dtype), batches(dtype, 3)
    reference = train(copy.deepcopy(model), data)
    trace = []
    session = OffloadSession(force=RECOMPUTE, link=RecordingLink(), min_bytes=0, trace=trace)
    assert_bitwise(reference, train(model, data, session))
    recomputed = [e for e in trace if e[0] == "recompute"]
    assert len(recomputed) >= 3 * 3          # relu / pool outputs of each block, each step
    # an in-place ReLU's output is rebuilt from the batch norm's input (batch norm, then ReLU):
    # its own input is gone, so it is never its own source
    groups = session._step.groups
    inplace = [g for g in groups if g.recipe is not None and g.recipe.calls[-1].in_place]
    assert len(inplace) == 2 and all(g not in g.recipe.sources for g in inplace)
    assert all([c.name for c in g.recipe.calls] == ["BatchNorm2d", "ReLU"] for g in inplace)
    assert all(g.mode == RECOMPUTE for g in inplace)


def conv_bn_relu_twice(dtype, seed):
    """ResNet's conv-bn-relu(inplace) twice, then a convolution and a classifier."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=True),
                         nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=True),
                         nn.Conv2d(8, 8, 3, padding=1), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(8, 10)).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_an_in_place_relu_feeding_a_convolution_is_recomputed_exactly(dtype):
    # ResNet's conv-bn-relu(inplace)-conv: the next convolution's weight gradient reads the ReLU's
    # output, so a recipe that stopped at the batch norm would change gradients
    model = conv_bn_relu_twice(dtype, seed=0)
    data = batches(dtype, 3)
    reference = train(copy.deepcopy(model), data)
    session = OffloadSession(force=RECOMPUTE, link=RecordingLink(), min_bytes=0,
                             recompute_convolutions=False)
    assert_bitwise(reference, train(model, data, session))
    relus = [g for g in session._step.groups if g.mode == RECOMPUTE]
    assert len(relus) == 2
    assert all([c.name for c in g.recipe.calls] == ["BatchNorm2d", "ReLU"] for g in relus)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("running", [False, True])
@pytest.mark.parametrize("convolutions", [True, False])
def test_an_instance_norm_without_running_statistics_is_recomputed(dtype, running, convolutions):
    # nnU-Net's stage: Conv3d, InstanceNorm3d(affine), LeakyReLU(inplace); an instance norm that
    # tracks running statistics would update them again in a replay: never recomputed
    torch.manual_seed(2)
    stage = [nn.Conv3d(2, 4, 3, padding=1), nn.InstanceNorm3d(4, affine=True,
                                                              track_running_stats=running),
             nn.LeakyReLU(0.01, inplace=True)]
    model = nn.Sequential(*stage, nn.Conv3d(4, 4, 3, padding=1), nn.AdaptiveAvgPool3d(1),
                          nn.Flatten(), nn.Linear(4, 10)).to(dtype)
    generator = torch.Generator().manual_seed(3)
    data = [(torch.randn(2, 2, 6, 6, 6, generator=generator, dtype=dtype),
             torch.randint(0, 10, (2,), generator=generator)) for _ in range(3)]
    reference = train(copy.deepcopy(model), data)
    session = OffloadSession(force=RECOMPUTE, link=RecordingLink(), min_bytes=0,
                             recompute_convolutions=convolutions)
    assert_bitwise(reference, train(model, data, session))
    rebuilt = [[c.name for c in g.recipe.calls] for g in session._step.groups
               if g.mode == RECOMPUTE]
    # the norm saves a reshaped view of the convolution's output, whose own tensor is then
    # freed: the view is rebuilt by the convolution, viewed back (where convolutions are
    # recomputed), and the norm's output from that view (test_unet_stage... below)
    assert rebuilt == [["Conv3d"]] * convolutions + [["InstanceNorm3d", "LeakyReLU"]] * (
        not running)


class PerSampleNorm(nn.Module):
    """InstanceNorm3d without affine, ``F.instance_norm`` on the whole batch (``cover``) or on
    each sample apart, whose reshaped inputs (saved by batch norm) are slices of the input: the
    first at its address and offset, over fewer elements."""

    def __init__(self, cover):
        super().__init__()
        self.cover = cover

    def forward(self, x):
        if self.cover:
            return nn.functional.instance_norm(x)
        return torch.cat([nn.functional.instance_norm(x[i:i + 1]) for i in range(len(x))])


def unet_stages(dtype, seed, norm=None):
    """nnU-Net's stage twice: Conv3d, InstanceNorm3d(affine), LeakyReLU(inplace); then a
    convolution and a classifier. ``norm()`` makes the norms instead (:class:`PerSampleNorm`)."""
    torch.manual_seed(seed)
    norm = norm or (lambda: nn.InstanceNorm3d(4, affine=True))
    return nn.Sequential(nn.Conv3d(2, 4, 3, padding=1), norm(), nn.LeakyReLU(0.01, inplace=True),
                         nn.Conv3d(4, 4, 3, padding=1), norm(), nn.LeakyReLU(0.01, inplace=True),
                         nn.Conv3d(4, 4, 3, padding=1), nn.AdaptiveAvgPool3d(1), nn.Flatten(),
                         nn.Linear(4, 10)).to(dtype)


def test_unet_stage_s_activation_is_recomputed_from_the_norm_s_saved_view():
    # F.instance_norm saves its input reshaped to (1, N*C, ...), a view of the convolution's
    # output, whose own object is freed when the norm returns: that view holds the
    # convolution's output, so the LeakyReLU's output is rebuilt from it by the norm and the
    # LeakyReLU, not through the convolution from the previous stage (convolutions not
    # recomputed here: test_unet_stages_convolution_outputs_... below)
    dtype = torch.float64
    model, data = unet_stages(dtype, seed=0), volumes(dtype, 3)
    session = OffloadSession(budget=2**50, link=RecordingLink(), min_bytes=0)
    train(model, data, session)
    groups = session.profile.groups
    relus = [gid for gid, g in enumerate(groups) if g.producer == "LeakyReLU"]
    assert len(relus) == 2
    for gid in relus:
        (source,) = groups[gid].recompute_source
        # the convolution rebuilds the view (and names it)
        assert groups[source].producer == "Conv3d" and groups[source].nbytes == groups[gid].nbytes
    trace = []
    session = OffloadSession(force=RECOMPUTE, link=RecordingLink(), min_bytes=0, trace=trace,
                             recompute_convolutions=False)
    train(model, data, session)
    recomputed = [g for g in session._step.groups if g.mode == RECOMPUTE]
    assert [[c.name for c in g.recipe.calls] for g in recomputed] == [
        ["InstanceNorm3d", "LeakyReLU"]] * 2
    for group in recomputed:
        (view,) = group.recipe.sources
        assert view.mode == KEEP and view.gid < group.gid
        assert view.nbytes == group.nbytes and view.producer == "op"
    steps = split_steps(trace)
    assert len(steps) == 3
    for step in steps:
        assert {e[1:] for e in step if e[0] == "recompute"} == {
            (g.gid, (g.recipe.sources[0].gid,)) for g in recomputed}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("plan", ["force", "modes"])
def test_unet_stages_recomputed_from_the_norm_s_view_give_the_same_gradients(dtype, plan):
    model, data = unet_stages(dtype, seed=1), volumes(dtype, 4)
    reference = train(copy.deepcopy(model), data)
    probe = OffloadSession(force=RECOMPUTE, link=RecordingLink(), min_bytes=0,
                           recompute_convolutions=False)
    train(copy.deepcopy(model), data[:1], probe)
    relus = [g for g in probe._step.groups if g.mode == RECOMPUTE]
    assert len(relus) == 2
    if plan == "force":
        session = OffloadSession(force=RECOMPUTE, link=RecordingLink(), min_bytes=0,
                                 recompute_convolutions=False)
        expected = [g.mode for g in probe._step.groups]
    else:   # the activations recomputed from their views, kept; every other group offloaded
        modes = [OFFLOAD] * len(probe._step.groups)
        for group in relus:
            modes[group.gid] = RECOMPUTE
            modes[group.recipe.sources[0].gid] = KEEP
        session = OffloadSession(modes=modes, link=RecordingLink(), min_bytes=0,
                                 recompute_convolutions=False)
        expected = [KEEP if mode == OFFLOAD and not g.offloadable else mode
                    for mode, g in zip(modes, probe._step.groups)]
        assert expected.count(OFFLOAD) >= 3
    assert_bitwise(reference, train(model, data, session))
    groups = session._step.groups
    assert [g.mode for g in groups] == expected
    assert all([c.name for c in g.recipe.calls] == ["InstanceNorm3d", "LeakyReLU"]
               for g in groups if g.mode == RECOMPUTE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activations", [RECOMPUTE, KEEP])
def test_unet_stages_convolution_outputs_are_rebuilt_by_the_convolution_viewed_back(
        dtype, activations):
    # the norm's saved view of a convolution's output has no call of its own: the convolution
    # rebuilds its input (the output), viewed back as the norm saved it; a LeakyReLU output read
    # by the next convolution rebuilt from the view (recomputed too) or kept
    model, data = unet_stages(dtype, seed=4), volumes(dtype, 4)
    reference = train(copy.deepcopy(model), data)
    probe = OffloadSession(force=RECOMPUTE, link=RecordingLink(), min_bytes=0)
    train(copy.deepcopy(model), data[:1], probe)
    views = [g for g in probe._step.groups if g.mode == RECOMPUTE and g.recipe.view]
    relus = [g for g in probe._step.groups if g.producer == "LeakyReLU"]
    assert [[c.name for c in g.recipe.calls] for g in views] == [["Conv3d"]] * 2
    assert len(relus) == 2
    modes = [KEEP] * len(probe._step.groups)
    for group in views:
        modes[group.gid] = RECOMPUTE
    for group in relus:
        modes[group.gid] = activations
    trace = []
    session = OffloadSession(modes=modes, link=RecordingLink(), min_bytes=0, trace=trace)
    assert_bitwise(reference, train(model, data, session))
    groups = session._step.groups
    assert [g.mode for g in groups] == modes
    for view in views:
        rebuilt = groups[view.gid]
        # the convolution's input: the batch (kept, no recipe) or the first LeakyReLU's output
        # (named as the probe named it: a planned step that records only its recipes' calls
        # names no other group)
        (source,) = rebuilt.recipe.sources
        assert source.gid < rebuilt.gid and source.nbytes * 2 == rebuilt.nbytes \
            or probe._step.groups[source.gid].producer == "LeakyReLU"
        assert rebuilt.recipe.view[0][0] == 1   # (1, N*C, D, H, W)
    rebuilt = {e[1] for step in split_steps(trace) for e in step if e[0] == "recompute"}
    assert {g.gid for g in views} <= rebuilt


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sized", [False, True])
def test_a_u_net_s_concatenation_is_rebuilt_by_the_transposed_convolution_and_the_cat(
        dtype, sized):
    # the decoder's convolution saves cat((up(low), skip)): rebuilt from the two saved groups
    # that read into it, the transposed convolution's input and the skip; ``sized``: the
    # transposed convolution reruns to the size output_size chose (one more than its natural
    # size, which the cat would refuse)
    model, data = TinyUNet(dtype, seed=5, sized=sized), volumes(dtype, 4)
    reference = train(copy.deepcopy(model), data)
    probe = OffloadSession(force=RECOMPUTE, link=RecordingLink(), min_bytes=0)
    train(copy.deepcopy(model), data[:1], probe)
    (group,) = joined(probe._step.groups)
    assert [c.name for c in group.recipe.calls] == ["ConvTranspose3d", "cat"]
    low, skip = group.recipe.sources
    assert low.producer == skip.producer == "LeakyReLU" and low.nbytes * 8 == skip.nbytes * 2
    modes = [KEEP] * len(probe._step.groups)
    modes[group.gid] = RECOMPUTE
    trace = []
    session = OffloadSession(modes=modes, link=RecordingLink(), min_bytes=0, trace=trace)
    assert_bitwise(reference, train(model, data, session))
    assert [g.mode for g in session._step.groups] == modes
    for step in split_steps(trace):
        assert {e[1:] for e in step if e[0] == "recompute"} == {
            (group.gid, (low.gid, skip.gid))}
    # every group recomputed that can be: the skip and the low stage rebuilt first (chains)
    forced = OffloadSession(force=RECOMPUTE, link=RecordingLink(), min_bytes=0)
    assert_bitwise(reference, train(TinyUNet(dtype, seed=5, sized=sized), data, forced))
    assert joined(forced._step.groups)[0].mode == RECOMPUTE


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_transposed_convolution_whose_output_padding_passes_its_stride_is_rebuilt(dtype):
    # dilation 2, stride 1, output_padding 1: a size no output_size could ask for, so its
    # replay runs as it was called, with its own output padding (a helper's reproducer)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(),
                          nn.ConvTranspose2d(4, 4, 3, stride=1, dilation=2, output_padding=1),
                          nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Linear(4, 10)).to(dtype)
    data = batches(dtype, 3)
    reference = train(copy.deepcopy(model), data)
    session = OffloadSession(force=RECOMPUTE, link=RecordingLink(), min_bytes=0)
    assert_bitwise(reference, train(model, data, session))
    assert any([c.name for c in g.recipe.calls] == ["ConvTranspose2d", "ReLU"]
               for g in session._step.groups if g.mode == RECOMPUTE)


@pytest.mark.parametrize("join", [
    lambda up, skip: torch.cat((up, up), dim=1),                  # one tensor twice
    lambda up, skip: torch.cat([up, skip.clone().mul_(2.0)], dim=1),  # made by no call
    lambda up, skip: torch.cat((up, skip), dim=1).mul_(2.0),       # the join changed after
], ids=["twice", "unrecorded-operand", "changed-after"])
def test_a_concatenation_not_replayable_as_recorded_is_kept(join):
    # no recipe for what a replay of the recorded cat would not give bit for bit: the step
    # keeps it and the gradients stay those of plain PyTorch
    dtype = torch.float64
    model, data = TinyUNet(dtype, seed=6, join=join), volumes(dtype, 3)
    reference = train(copy.deepcopy(model), data)
    session = OffloadSession(force=RECOMPUTE, link=RecordingLink(), min_bytes=0)
    assert_bitwise(reference, train(model, data, session))
    assert all(g.mode != RECOMPUTE for g in joined(session._step.groups))
    saved_by_decoder = [g for g in session._step.groups if g.nbytes == 2 * 4 * 6 ** 3 * 8 * 2]
    assert saved_by_decoder and all(g.mode == KEEP for g in saved_by_decoder)


class ViewSigmoid(nn.Module):
    """Changes a flattened view of its input in place (``sigmoid_`` saves its result: a view over
    exactly the input's elements, at a later version than the module was given)."""

    def forward(self, x):
        return torch.sigmoid_(x.view(x.shape[0], -1))


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_saved_view_changed_in_place_is_not_rebuilt_by_its_input_s_maker(dtype):
    # the view's values are the convolution's output changed: rerunning the convolution would
    # rebuild the values before the change
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), ViewSigmoid(),
                          nn.Linear(4 * 16 * 16, 10)).to(dtype)
    data = batches(dtype, 3)
    reference = train(copy.deepcopy(model), data)
    session = OffloadSession(force=RECOMPUTE, link=RecordingLink(), min_bytes=0)
    assert_bitwise(reference, train(model, data, session))
    assert not any(g.recipe is not None and g.recipe.view for g in session._step.groups)


def test_a_recorded_convolution_s_workspace_is_in_what_its_rebuild_allocates(monkeypatch):
    # a convolution whose forward allocates 1 GiB beyond its output (its workspace): a rebuild
    # through it allocates that too, as the recording step measured
    model, data = unet_stages(torch.float64, seed=5), volumes(torch.float64, 3)
    link = MeteredLink()
    convolve = nn.Conv3d._conv_forward

    def with_workspace(self, *args):
        link.spike(GiB)
        return convolve(self, *args)

    monkeypatch.setattr(nn.Conv3d, "_conv_forward", with_workspace)
    session = OffloadSession(budget=2**50, link=link, min_bytes=0)
    train(model, data, session)
    groups = session.profile.groups
    rebuilt = [g for g in groups if g.producer == "Conv3d"]   # the two the norms save
    assert len(rebuilt) == 2
    assert all(g.rebuild_bytes == GiB for g in rebuilt)   # the meter's peak: its spike alone
    relus = [g for g in groups if g.producer == "LeakyReLU"]
    # the norm and the LeakyReLU allocate no workspace: the norm's output
    assert relus and all(g.rebuild_bytes == g.nbytes for g in relus), relus
    # the baselines still see every spike (one a convolution): the peak between two points
    # carries across the convolutions' own measures
    saved = sum(g.nbytes for g in groups)
    assert sum(b >= GiB - saved for b in session.profile.baseline_forward) == 3


@pytest.mark.parametrize("cover", [True, False])
def test_a_saved_view_over_part_of_a_norm_s_input_is_no_source(monkeypatch, cover):
    # per sample, the norm saves slices of the convolution's output, which hold part of it
    # only: the recipe goes back through the convolution, as without a view
    from mucudnn.torch import recorder as recorder_module   # where recipes read it
    monkeypatch.setattr(recorder_module, "CHEAP", recorder_module.CHEAP + (PerSampleNorm,))
    dtype = torch.float64
    model = unet_stages(dtype, seed=2, norm=lambda: PerSampleNorm(cover))
    data = volumes(dtype, 3)
    reference = train(copy.deepcopy(model), data)
    session = OffloadSession(force=RECOMPUTE, link=RecordingLink(), min_bytes=0)
    assert_bitwise(reference, train(model, data, session))
    groups = session._step.groups
    recomputed = [g for g in groups if g.producer == "LeakyReLU"]
    assert len(recomputed) == 2 and all(g.mode == RECOMPUTE for g in recomputed)
    if cover:
        assert all([c.name for c in g.recipe.calls] == ["PerSampleNorm", "LeakyReLU"]
                   for g in recomputed)
    else:    # from the kept input, then from the first stage's (recomputed) activation
        assert [[c.name for c in g.recipe.calls] for g in recomputed] == [
            ["Conv3d", "PerSampleNorm", "LeakyReLU"]] * 2
        assert recomputed[1].recipe.sources == [recomputed[0]]
        assert recomputed[0].recipe.sources == [groups[0]]


@pytest.mark.parametrize("dtype", DTYPES)
def test_recomputed_convolutions_rebuild_a_chain_from_the_input_each_once(dtype):
    # conv-bn-relu twice: with convolutions recomputable, everything but the input is rebuilt
    # from it at the backward's first unpack of the chain, each recipe run once per step
    model = conv_bn_relu_twice(dtype, seed=1)
    data = batches(dtype, 3)
    reference = train(copy.deepcopy(model), data)
    trace = []
    session = OffloadSession(force=RECOMPUTE, link=RecordingLink(), min_bytes=0, trace=trace)
    assert_bitwise(reference, train(model, data, session))
    groups = session._step.groups
    activations = [g for g in groups if g.nbytes >= groups[0].nbytes]   # not batch statistics
    # the input (no recipe) kept; two convolution outputs and two ReLU outputs recomputed
    assert [(g.gid, g.mode) for g in activations if g.mode == KEEP] == [(0, KEEP)]
    chain = [g for g in activations if g.mode == RECOMPUTE]
    assert [c.name for g in chain for c in g.recipe.calls] == [
        "Conv2d", "BatchNorm2d", "ReLU", "Conv2d", "BatchNorm2d", "ReLU"]
    # each reads the one before it (one level: a saved group is a source, recomputed or not)
    assert [[s.gid for s in g.recipe.sources] for g in chain] == [
        [0]] + [[g.gid] for g in chain[:-1]]
    last_step = trace[max(i for i, e in enumerate(trace) if e[0] == "pack" and e[1] == 0):]
    events = [e[:2] for e in last_step if e[0] in ("recompute", "unpack")]
    # rebuilt, each once, sources first, right before the last one's first unpack
    start = events.index(("recompute", chain[0].gid))
    assert events[start:start + 5] == [("recompute", g.gid) for g in chain] + [
        ("unpack", chain[-1].gid)]
    assert sum(e[0] == "recompute" for e in events) == len(chain)


def test_every_step_finds_the_same_recipes_when_the_model_starts_with_cheap_modules():
    torch.manual_seed(0)
    model = nn.Sequential(nn.BatchNorm2d(3), nn.ReLU(), nn.Conv2d(3, 8, 3), nn.ReLU(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))
    data = batches(torch.float32, 3)
    reference = train(copy.deepcopy(model), data)
    trace = []
    session = OffloadSession(force=RECOMPUTE, link=RecordingLink(), min_bytes=0, trace=trace)
    assert_bitwise(reference, train(model, data, session))
    per_step = []
    for event in trace:
        if event[:2] == ("pack", 0):
            per_step.append(0)
        if event[0] == "recompute":
            per_step[-1] += 1
    assert len(per_step) == 3 and per_step[0] >= 1 and len(set(per_step)) == 1


def pooled_cnn(dtype, dims, pool, seed=0):
    """Conv-BN-ReLU(inplace), the max pooling ``pool``, a convolution, a classifier: VGG's
    block end, in ``dims`` spatial dimensions."""
    torch.manual_seed(seed)
    conv, norm = (nn.Conv2d, nn.BatchNorm2d) if dims == 2 else (nn.Conv3d, nn.BatchNorm3d)
    average = nn.AdaptiveAvgPool2d(1) if dims == 2 else nn.AdaptiveAvgPool3d(1)
    return nn.Sequential(conv(3, 8, 3, padding=1), norm(8), nn.ReLU(inplace=True), pool,
                         conv(8, 8, 3, padding=1), nn.ReLU(), average, nn.Flatten(),
                         nn.Linear(8, 10)).to(dtype)


def pooled_batches(dtype, dims, steps=3, channels_last=False):
    generator = torch.Generator().manual_seed(4)
    size = (4, 3, 12, 12) if dims == 2 else (2, 3, 6, 6, 6)
    data = [(torch.randn(size, generator=generator, dtype=dtype),
             torch.randint(0, 10, (size[0],), generator=generator)) for _ in range(steps)]
    if channels_last:
        data = [(x.contiguous(memory_format=torch.channels_last), y) for x, y in data]
    return data


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dims, pool, channels_last", [
    (2, nn.MaxPool2d(2), False),
    (2, nn.MaxPool2d(3, stride=2, padding=1), True),            # ResNet's stem
    (2, nn.MaxPool2d(3, stride=2, dilation=2, ceil_mode=True), False),
    (3, nn.MaxPool3d(2), False),
    (3, nn.MaxPool3d((1, 2, 2), stride=(1, 2, 2)), False)])      # a video net's spatial pooling
def test_a_max_poolings_indices_are_rebuilt_by_the_pooling(dtype, dims, pool, channels_last):
    # the indices (int64: twice an fp32 output's bytes) were kept, made by no call; the pooling
    # makes them again from its input, as it makes its output
    model = pooled_cnn(dtype, dims, pool)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    data = pooled_batches(dtype, dims, channels_last=channels_last)
    reference = train(copy.deepcopy(model), data)
    trace = []
    session = OffloadSession(force=RECOMPUTE, link=RecordingLink(), min_bytes=0, trace=trace)
    assert_bitwise(reference, train(model, data, session))
    name = type(pool).__name__
    indices = [g for g in session._step.groups if g.producer == f"{name} indices"]
    assert len(indices) == 1 and indices[0].mode == RECOMPUTE
    recipe = indices[0].recipe
    assert recipe.indices and [c.name for c in recipe.calls] == [name]
    # its source is the pooling's input: the ReLU's output, rebuilt itself or kept
    assert [s.producer for s in recipe.sources] == ["ReLU"]
    rebuilt = {e[1] for e in trace if e[0] == "recompute"}
    assert indices[0].gid in rebuilt


@pytest.mark.parametrize("pool", ["returned", "1d"])
def test_max_pooling_indices_a_recipe_cannot_make_are_kept(pool):
    # indices the script is given may be changed before the backward (PyTorch alone raises
    # then); a 1-D pooling saves the 4-D indices of the 2-D kernel it runs on a view
    torch.manual_seed(0)

    class Pooled(nn.Module):
        def __init__(self):
            super().__init__()
            if pool == "returned":
                self.conv = nn.Conv2d(3, 8, 3, padding=1)
                self.pool, self.unpool = nn.MaxPool2d(2, return_indices=True), nn.MaxUnpool2d(2)
            else:
                self.conv, self.pool = nn.Conv1d(3, 8, 3, padding=1), nn.MaxPool1d(2)
            self.head = nn.Linear(8, 10)

        def forward(self, x):
            if pool == "returned":
                y, where = self.pool(torch.relu(self.conv(x)))
                y = self.unpool(y, where)
            else:
                y = self.pool(torch.relu(self.conv(x.flatten(2))))
            return self.head(y.flatten(2).mean(2))

    model = Pooled()
    data = batches(torch.float32, 3)          # 4 x 3 x 16 x 16
    reference = train(copy.deepcopy(model), data)
    session = OffloadSession(force=RECOMPUTE, link=RecordingLink(), min_bytes=0)
    assert_bitwise(reference, train(model, data, session))
    # the indices (4 x 8 x 8 x 8 or 4 x 8 x 1 x 128 int64 elements) kept, made by no call
    groups = session._step.groups
    index_bytes = 8 * (4 * 8 * 8 * 8 if pool == "returned" else 4 * 8 * 128)
    assert any(g.nbytes == index_bytes and g.mode == KEEP and g.recipe is None for g in groups)
    assert not any(g.recipe is not None and g.recipe.indices for g in groups)
    assert not any(g.producer.endswith("indices") for g in groups)


class BasicBlock(nn.Module):
    """torchvision.models.resnet.BasicBlock's forward: the batch norm's output takes the shortcut
    in place (``out += identity``, no module) before the in-place ReLU saves it. ``shortcut``
    (tests) runs on the shortcut tensor before or after that add."""

    expansion = 1

    def __init__(self, inplanes, planes, stride=1, downsample=None):
        super().__init__()
        self.conv1, self.bn1 = conv3x3(inplanes, planes, stride), nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2, self.bn2 = conv3x3(planes, planes), nn.BatchNorm2d(planes)
        self.downsample = downsample
        self.shortcut = {}

    def forward(self, x):
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        return self.add_and_relu(out, identity)

    def add_and_relu(self, out, identity):
        if "before" in self.shortcut:
            self.shortcut["before"](identity)
        out += identity
        if "after" in self.shortcut:
            self.shortcut["after"](identity)
        return self.relu(out)


class Bottleneck(BasicBlock):
    """torchvision.models.resnet.Bottleneck's forward (1x1, 3x3, 1x1 convolutions)."""

    expansion = 4

    def __init__(self, inplanes, planes, stride=1, downsample=None):
        super().__init__(inplanes, planes, stride, downsample)
        self.conv1, self.bn1 = conv1x1(inplanes, planes), nn.BatchNorm2d(planes)
        self.conv2, self.bn2 = conv3x3(planes, planes, stride), nn.BatchNorm2d(planes)
        self.conv3 = conv1x1(planes, planes * self.expansion)
        self.bn3 = nn.BatchNorm2d(planes * self.expansion)

    def forward(self, x):
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        return self.add_and_relu(out, identity)


def resnet(block, layers, widths, dtype, stem=8):
    """torchvision.models.resnet.ResNet's structure with ``block`` (benchmarks.host_overhead's
    builder): ``resnet(BasicBlock, [2, 2, 2, 2], [64, 128, 256, 512], ...)`` is ResNet-18."""
    return resnet_of(block, layers, widths, stem).to(dtype)


RESNETS = {"basic": (BasicBlock, [3, 2], [8, 16]), "bottleneck": (Bottleneck, [3, 2], [4, 8]),
           "resnet18": (BasicBlock, [2, 2, 2, 2], [64, 128, 256, 512])}


def through_adds(groups):
    """The groups whose recipe includes a recorded add (ResNet blocks' outputs)."""
    return [g for g in groups if g.recipe is not None
            and any(c.op is not None for c in g.recipe.calls)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", sorted(RESNETS))
def test_a_residual_blocks_output_is_recomputed_through_its_add(kind, dtype):
    block, layers, widths = RESNETS[kind]
    model = resnet(block, layers, widths, dtype)
    steps = 2 if kind == "resnet18" else 3
    data = batches(dtype, steps)
    reference = train(copy.deepcopy(model), data)
    trace = []
    session = OffloadSession(force=RECOMPUTE, link=RecordingLink(), min_bytes=0, trace=trace,
                             recompute_convolutions=False)
    assert_bitwise(reference, train(model, data, session))
    # A block's output is rebuilt from its last convolution's output (its batch norm's input,
    # kept: convolutions are not recomputed here) and its shortcut: the block's input (the
    # previous block's output, itself recomputed, or the stem's kept output), or the
    # downsampling convolution's output through its batch norm.
    blocks = sum(layers)
    added = through_adds(session._step.groups)
    assert len(added) == blocks and all(g.mode == RECOMPUTE for g in added)
    for group in added:
        names = [c.name for c in group.recipe.calls]
        assert names in (["BatchNorm2d", "add_", "ReLU"],
                         ["BatchNorm2d", "BatchNorm2d", "add_", "ReLU"])
        assert len(group.recipe.sources) == 2
        assert group.recipe.sources[0].mode == KEEP        # the convolution's output
        assert group.recipe.sources[1].mode in (KEEP, RECOMPUTE)
    for step in split_steps(trace):
        recomputed = {e[1] for e in step if e[0] == "recompute" and len(e[2]) == 2}
        assert recomputed == {g.gid for g in added}


def shortcut_model(where, dtype):
    """A stem, one downsampling basic block whose shortcut (the downsampling batch norm's
    output, saved by nothing) is halved in place by no module ``where`` (before or after the
    add, or nowhere), and the head."""
    torch.manual_seed(0)
    block = BasicBlock(8, 16, 2, nn.Sequential(conv1x1(8, 16, 2), nn.BatchNorm2d(16)))
    if where is not None:
        block.shortcut[where] = lambda identity: identity.mul_(0.5)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), block, nn.AdaptiveAvgPool2d(1),
                         nn.Flatten(), nn.Linear(16, 10)).to(dtype)


@pytest.mark.parametrize("where", [None, "before", "after"])
def test_a_shortcut_changed_in_place_by_no_op_recorded_is_not_recomputed_without_the_change(
        where):
    # before the add: the add read the shortcut at a version no recorded call made, so the
    # block's output is kept; after it: the recipe rebuilds the shortcut as the add read it
    dtype = torch.float64
    model, data = shortcut_model(where, dtype), batches(dtype, 3)
    reference = train(copy.deepcopy(model), data)
    session = OffloadSession(force=RECOMPUTE, link=RecordingLink(), min_bytes=0)
    assert_bitwise(reference, train(model, data, session))
    added = through_adds(session._step.groups)
    assert len(added) == (0 if where == "before" else 1)
    assert all(g.mode == RECOMPUTE for g in added)
    assert any(g.mode == RECOMPUTE for g in session._step.groups)   # bn1's ReLU still is


def test_a_source_changed_after_it_was_saved_is_never_recomputed_from():
    # the block's input, kept as its output's source, changed after the forward: the recipe
    # refuses (plain PyTorch's backward refuses it too), never a wrong tensor
    torch.manual_seed(0)
    stem = nn.Conv2d(3, 8, 3, padding=1)
    model = nn.Sequential(stem, BasicBlock(8, 8), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Linear(8, 10)).to(torch.float64)
    x, y = batches(torch.float64, 1)[0]
    session = OffloadSession(force=RECOMPUTE, link=RecordingLink(), min_bytes=0)
    stem_outputs = []
    handle = stem.register_forward_hook(lambda module, args, output: stem_outputs.append(output))
    with session:
        loss = nn.functional.cross_entropy(model(x), y)
    handle.remove()
    added = through_adds(session._step.groups)
    assert len(added) == 1 and added[0].mode == RECOMPUTE
    assert any(source.ref() is stem_outputs[0] for source in added[0].recipe.sources)
    with torch.no_grad():
        stem_outputs[0].add_(1.0)
    with pytest.raises(RuntimeError, match="changed after it was saved"):
        loss.backward()


def test_a_freed_inputs_group_is_that_tensors_not_one_at_its_address(monkeypatch):
    # The caching allocator gives a freed block to the next tensor of its size: the output of a
    # block's last convolution, freed once its batch norm ran, and the downsampling
    # convolution's output then share an address. Here every two tensors of one layout do.
    monkeypatch.setattr(OffloadSession, "_key", staticmethod(
        lambda tensor: (tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype)))
    dtype = torch.float64
    model, data = resnet(Bottleneck, [1, 1], [4, 8], dtype), batches(dtype, 3)
    reference = train(copy.deepcopy(model), data)
    session = OffloadSession(force=RECOMPUTE, link=RecordingLink(), min_bytes=0)
    assert_bitwise(reference, train(model, data, session))
    added = through_adds(session._step.groups)
    assert len(added) == 2 and all(g.mode == RECOMPUTE for g in added)
    assert all(len(g.recipe.sources) == 2 for g in added)


def test_offloaded_and_recomputed_through_adds_in_one_step():
    # the blocks' outputs recomputed, their sources kept, every other group offloaded
    dtype = torch.float64
    model, data = resnet(Bottleneck, [3, 2], [4, 8], dtype), batches(dtype, 3)
    reference = train(copy.deepcopy(model), data)
    probe = OffloadSession(force=RECOMPUTE, link=RecordingLink(), min_bytes=0)
    train(copy.deepcopy(model), data[:1], probe)
    added = []     # blocks' outputs, none another one's source
    for group in through_adds(probe._step.groups):
        if not any(source in added for source in group.recipe.sources):
            added.append(group)
    modes = [OFFLOAD] * len(probe._step.groups)
    for group in added:
        modes[group.gid] = RECOMPUTE
        for source in group.recipe.sources:
            modes[source.gid] = KEEP
    trace = []
    session = OffloadSession(modes=modes, link=RecordingLink(), min_bytes=0, trace=trace)
    assert_bitwise(reference, train(model, data, session))
    carried_out = [KEEP if mode == OFFLOAD and not g.offloadable else mode
                   for mode, g in zip(modes, probe._step.groups)]
    assert [g.mode for g in session._step.groups] == carried_out
    assert carried_out.count(OFFLOAD) > len(modes) // 2
    for step in split_steps(trace):
        assert {e[1] for e in step if e[0] == "recompute"} == {g.gid for g in added}
        assert sum(e[0] == "offload" for e in step) == carried_out.count(OFFLOAD)


def test_a_plan_recomputes_blocks_outputs_through_their_adds():
    # over a slow link (both ways: an offloaded group holds its memory to the end of the
    # forward) the planner recomputes what it can: the blocks' outputs among them, with both
    # their sources kept or recomputed; the session holds no more than the plan models. The
    # link (10 kB/s: seconds a copy) is far slower than any module's recorded time can be on a
    # loaded machine (at 1 MB/s, one CI run under load planned no such recompute)
    dtype = torch.float64
    model, data = resnet(BasicBlock, [3, 2], [8, 16], dtype), batches(dtype, 4)
    reference = train(copy.deepcopy(model), data)
    trace = HeldBytes()
    session = OffloadSession(budget=1, link=RecordingLink(gbps=(1e-5, 1e-5)), min_bytes=0,
                             trace=trace, headroom=0.0)
    trace.session = session
    session.budget = int(saved_bytes(model, data) * 0.5)
    assert_bitwise(reference, train(model, data, session))
    groups = session.profile.groups
    chosen = [gid for gid, mode in enumerate(session.plan.modes)
              if mode == RECOMPUTE and len(groups[gid].recompute_source) == 2]
    assert chosen and all(session.plan.modes[s] in (KEEP, RECOMPUTE)
                          for gid in chosen for s in groups[gid].recompute_source)
    assert planner.valid(session.profile, session.plan.modes)
    assert [g.mode for g in session._step.groups] == list(session.plan.modes)
    assert trace.checked > 0


@pytest.mark.parametrize("force", [KEEP, RECOMPUTE])
def test_adds_are_recorded_only_in_a_forward_whose_recipes_may_be_used(force):
    # not under no_grad, not in the backward or a recipe's replay, not after the session: only
    # the blocks' adds of the forward, and none where nothing is recomputed
    dtype = torch.float64
    model, data = resnet(BasicBlock, [2], [8], dtype), batches(dtype, 1)
    session = OffloadSession(force=force, link=RecordingLink(), min_bytes=0)
    x, y = data[0]
    with session:
        loss = nn.functional.cross_entropy(model(x), y)
        with torch.no_grad():
            x + x.clone()
        loss.backward()         # on CPU, in this thread: recipes replay their adds here
        ops = [c for c in session._step.calls if c.op is not None]
    x.clone() + x.clone()
    assert len(ops) == (2 if force == RECOMPUTE else 0)
    assert [c for c in session._step.calls if c.op is not None] == ops


def test_a_module_with_hooks_of_its_own_is_never_recomputed():
    # spectral_norm's pre-hook runs a power iteration per forward: a replay would change the
    # weight it uses and its buffers
    torch.manual_seed(0)
    conv = nn.utils.spectral_norm(nn.Conv2d(3, 8, 3, padding=1))
    model = nn.Sequential(conv, nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10)).double()
    data = batches(torch.float64, 3)
    reference = train(copy.deepcopy(model), data)
    session = OffloadSession(force=RECOMPUTE, link=RecordingLink(), min_bytes=0)
    assert_bitwise(reference, train(model, data, session))
    names = [[c.module for c in g.recipe.calls] for g in session._step.groups
             if g.mode == RECOMPUTE]
    assert names and not any(model[0] in calls for calls in names)


def test_a_profile_counts_what_a_rebuild_allocates():
    # a convolution feeding a global average pool: rebuilding the pool's output allocates the
    # convolution's output first, 32 times larger
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.AdaptiveAvgPool2d(1),
                          nn.Conv2d(32, 8, 1), nn.Flatten(), nn.Linear(8, 10)).double()
    data = batches(torch.float64, 3)
    session = OffloadSession(budget=2**50, link=RecordingLink(), min_bytes=0)
    train(model, data, session)
    pooled = [g for g in session.profile.groups if g.producer == "AdaptiveAvgPool2d"]
    assert len(pooled) == 1 and pooled[0].recompute_source is not None
    convolution_output = 4 * 32 * 16 * 16 * 8
    assert pooled[0].rebuild_bytes == convolution_output + pooled[0].nbytes
    # beside the pooled output itself, which stays (live from its rebuild)
    assert pooled[0].transient == convolution_output


def first_planned_step_after_one_run_as_recorded(inner_mode=None, wrap=None):
    """A budget session on a ResNet whose plan is made in the background (completed by hand
    before step 3, so step 2 runs as recorded, every tensor offloaded, no recipe used): per step,
    the groups its plan recomputes that were kept, and the gradients against a plain run.
    ``inner_mode``: a torch function mode the script enters inside the ``with``; ``wrap``: a
    function of the ResNet giving the model trained."""
    from test_lifecycle import ManualRunner

    dtype = torch.float64
    model, data = resnet(BasicBlock, [3, 2], [8, 16], dtype), batches(dtype, 6)
    if wrap is not None:
        model = wrap(model)
    reference = train(copy.deepcopy(model), data)
    session = OffloadSession(budget=1, link=RecordingLink(gbps=(1e-5, 1e-5)), min_bytes=0,
                             headroom=0.0, trials=False)
    session.budget = int(saved_bytes(model, data) * 0.5)
    runner = session.lifecycle.runner = ManualRunner()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    results, kept, modes_in_with = [], [], []
    for step, (x, y) in enumerate(data):
        if step == 3:
            runner.complete()       # the plan takes over at step 3's first module
        optimizer.zero_grad()
        with session:
            with inner_mode() if inner_mode else contextlib.nullcontext():
                loss = nn.functional.cross_entropy(model(x), y)
            modes_in_with.append(session.modes)
        loss.backward()
        kept.append([g.gid for g in session._step.groups
                     if g.wanted == RECOMPUTE and g.mode == KEEP])
        results.append([p.grad.clone() for p in model.parameters()] +
                       [b.clone() for b in model.buffers()])
        optimizer.step()
    assert_bitwise(reference, results)
    assert modes_in_with[2] is not None and RECOMPUTE not in modes_in_with[2]   # as recorded
    assert RECOMPUTE in modes_in_with[3]
    return session, kept


def test_the_first_planned_step_after_one_run_as_recorded_recomputes_through_adds():
    # the ``with`` of step 3 is entered under step 2's modes (no recompute): the op recorder
    # goes on at the step's start, once the plan is in force, so blocks' outputs have recipes
    session, kept = first_planned_step_after_one_run_as_recorded()
    assert kept[3:] == [[], [], []]
    added = through_adds(session._step.groups)
    assert added and all(g.mode == RECOMPUTE for g in added)


def test_a_function_mode_the_script_entered_keeps_the_op_recorder_out_and_the_groups_kept():
    # above the script's own mode the recorder would be popped by its exit: it stays out, and
    # the groups whose recipes pass through an add are kept that step (never a wrong gradient)
    class Passing(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    session, kept = first_planned_step_after_one_run_as_recorded(Passing)
    assert kept[3] and kept[4:] == [[], []]


class StemOnAThread(nn.Module):
    """``model`` (a Sequential) with its first layer run on a worker thread, as
    ``torch.nn.parallel.parallel_apply`` runs replicas; ``worker_modes``: the torch function
    modes on the worker's stack after each call."""

    def __init__(self, model):
        super().__init__()
        self.model = model
        self.worker_modes = []

    def forward(self, x):
        out = {}

        def stem():
            with torch.enable_grad():
                out["stem"] = self.model[0](x)
            self.worker_modes.append(torch._C._len_torch_function_stack())
        worker = threading.Thread(target=stem)
        worker.start()
        worker.join()
        out = out["stem"]
        for layer in list(self.model)[1:]:
            out = layer(out)
        return out


def test_a_first_leaf_module_on_another_thread_leaves_the_op_recorder_to_the_with_s_thread():
    # step 3's first leaf module runs on a worker thread, whose stack of torch function modes
    # is not the ``with``'s: the op recorder goes on the stack of the thread that entered the
    # ``with`` (at its first leaf module there), and leaves with it; the worker's stays empty
    models = []

    def wrap(model):
        models.append(StemOnAThread(model))
        return models[0]

    session, kept = first_planned_step_after_one_run_as_recorded(wrap=wrap)
    assert torch._C._len_torch_function_stack() == 0 and session.recorder.ops is None
    assert models[0].worker_modes == [0] * 6
    assert kept[3:] == [[], [], []]
