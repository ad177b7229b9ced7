"""mucudnn.torch's runtime on CPU torch: the CPU stands in for both device and host
(SameMemoryLink), a recording link checks the order of copies; gradients must be bitwise equal to
a plain run."""

import contextlib
import copy
import dataclasses
import gc
import json
import os
import sys
import time
import weakref

import pytest

torch = pytest.importorskip("torch")
if not hasattr(torch, "autograd") or not hasattr(torch.autograd, "graph"):
    pytest.skip("needs a real PyTorch", allow_module_level=True)

from torch import nn  # noqa: E402

from mucudnn.errors import InfeasibleError  # noqa: E402
from mucudnn.torch import fit  # noqa: E402
from mucudnn.torch import planner  # noqa: E402
from mucudnn.torch.planner import KEEP, OFFLOAD, RECOMPUTE  # noqa: E402
from mucudnn.torch.runtime import SameMemoryLink, OffloadSession  # noqa: E402


class RecordingLink(SameMemoryLink):
    """Copies as SameMemoryLink; logs each call; a fetched tensor may be used only after wait()."""

    def __init__(self, gbps=(1000.0, 0.001)):
        # 1 MB/s back: a slow link makes the planner choose; a fast one out, so that an
        # offloaded group leaves the device at the next forward point (planner.release_point)
        super().__init__(gbps=gbps)
        self.log = []
        self.waited = set()

    def offload(self, tensor, inline=False, held=False):
        self.log.append(("offload", tensor.shape) + (("held",) if held else ()))
        return super().offload(tensor, inline, held)

    def let_go(self, transfer):
        self.log.append(("let_go", id(transfer)))
        super().let_go(transfer)

    def fetch(self, host, device, inline=False):
        transfer = super().fetch(host, device, inline)
        self.log.append(("fetch", id(transfer)))
        return transfer

    def wait(self, transfer):
        self.log.append(("wait", id(transfer)))
        self.waited.add(id(transfer))
        return super().wait(transfer)


def small_cnn(dtype):
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=True), nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.AvgPool2d(2),
        nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(inplace=True),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10)).to(dtype)


def batches(dtype, steps):
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 3, 16, 16, generator=generator, dtype=dtype),
             torch.randint(0, 10, (4,), generator=generator)) for _ in range(steps)]


def train(model, data, session=None):
    """Per step: every gradient and buffer after that step (SGD, so steps depend on each other)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    results = []
    for x, y in data:
        optimizer.zero_grad()
        if session is None:
            loss = nn.functional.cross_entropy(model(x), y)
        else:
            with session:
                loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        results.append([p.grad.clone() for p in model.parameters()] +
                       [b.clone() for b in model.buffers()])
        optimizer.step()
    return results


def train_through_failures(model, data, session, forward=None, before_step=None,
                           errors=(torch.OutOfMemoryError,)) -> int:
    """SGD steps of ``forward`` (default ``model``) under ``session``, as a script that catches
    ``errors`` (out of memory) runs them: a step that raises one is skipped and its graph let
    go. ``before_step()`` runs first in each step. The number of steps that failed."""
    forward = forward or model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    failures = 0
    for x, y in data:
        if before_step is not None:
            before_step()
        optimizer.zero_grad()
        try:
            with session:
                loss = nn.functional.cross_entropy(forward(x), y)
            loss.backward()
        except errors:
            loss = None
            failures += 1
            continue
        optimizer.step()
    return failures


def assert_bitwise(expected, actual):
    assert len(expected) == len(actual)
    for step, (a, b) in enumerate(zip(expected, actual)):
        for i, (u, v) in enumerate(zip(a, b)):
            assert u.dtype == v.dtype and torch.equal(u, v), f"step {step} tensor {i} differs"


DTYPES = [torch.float64, torch.float32]


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


def volumes(dtype, steps):
    generator = torch.Generator().manual_seed(3)
    return [(torch.randn(2, 2, 6, 6, 6, generator=generator, dtype=dtype),
             torch.randint(0, 10, (2,), generator=generator)) for _ in range(steps)]


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
        (source,) = rebuilt.recipe.sources
        assert source.gid < rebuilt.gid and source.nbytes * 2 == rebuilt.nbytes \
            or source.producer == "LeakyReLU"
        assert rebuilt.recipe.view[0][0] == 1   # (1, N*C, D, H, W)
    rebuilt = {e[1] for step in split_steps(trace) for e in step if e[0] == "recompute"}
    assert {g.gid for g in views} <= rebuilt


class TinyUNet(nn.Module):
    """One level of a 3-D U-Net: a stage, a strided stage, a transposed convolution up (to the
    skip's size given as ``output_size`` where ``sized``: kernel 3, whose natural size is one
    short), the skip joined by ``join`` (``torch.cat`` on dim 1 by default), a stage, a head."""

    def __init__(self, dtype, seed, sized=False, join=None):
        super().__init__()
        torch.manual_seed(seed)

        def stage(cin, cout, stride=1):
            return nn.Sequential(nn.Conv3d(cin, cout, 3, stride=stride, padding=1),
                                 nn.InstanceNorm3d(cout, affine=True),
                                 nn.LeakyReLU(0.01, inplace=True))
        self.encoder, self.down, self.decoder = stage(2, 4), stage(4, 8, 2), stage(8, 4)
        self.up = (nn.ConvTranspose3d(8, 4, 3, stride=2, padding=1) if sized
                   else nn.ConvTranspose3d(8, 4, 2, stride=2))
        self.sized, self.join = sized, join or (lambda up, skip: torch.cat((up, skip), dim=1))
        self.head = nn.Sequential(nn.AdaptiveAvgPool3d(1), nn.Flatten(), nn.Linear(4, 10))
        self.to(dtype)

    def forward(self, x):
        skip = self.encoder(x)
        low = self.down(skip)
        up = self.up(low, output_size=skip.shape) if self.sized else self.up(low)
        return self.head(self.decoder(self.join(up, skip)))


def joined(groups):
    """The groups whose recipe ends in a recorded concatenation."""
    return [g for g in groups if g.recipe is not None and g.recipe.calls[-1].name == "cat"]


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
    from mucudnn.torch import runtime
    monkeypatch.setattr(runtime, "CHEAP", runtime.CHEAP + (PerSampleNorm,))
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


def test_an_in_place_call_on_a_view_of_a_kept_group_changes_a_copy():
    # a recipe whose in-place call reads a kept group through a view: the group's tensor (which
    # autograd and other recipes read) stays as saved
    from mucudnn.torch.runtime import _Call, _Group, _Recipe, _ViewOf
    saved = torch.randn(1, 6, 4, dtype=torch.float64)
    kept = saved.detach()
    source = _Group(0, KEEP, saved.numel() * 8, saved.device, weakref.ref(saved),
                    saved._version, "op", True, tensor=kept)
    relu = nn.LeakyReLU(0.5, inplace=True)
    call = _Call(relu, "LeakyReLU", (), None, None, in_place=True, recomputable=True)
    recipe = _Recipe([call], [(_ViewOf(source, (2, 3, 4), (12, 4, 1)),)])
    target = _Group(1, RECOMPUTE, source.nbytes, saved.device, weakref.ref(saved), 0, "LeakyReLU",
                    True, recipe=recipe)
    before = kept.clone()
    rebuilt = OffloadSession(link=SameMemoryLink())._recompute_group(target, SameMemoryLink())
    assert torch.equal(kept, before) and kept._version == source.version
    assert rebuilt.shape == (2, 3, 4)
    assert torch.equal(rebuilt, nn.functional.leaky_relu(before.view(2, 3, 4), 0.5))


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


def test_an_impossible_budget_is_one_clear_error():
    model, data = small_cnn(torch.float32), batches(torch.float32, 3)   # two steps record
    session = OffloadSession(budget=1000, link=RecordingLink(), min_bytes=0, headroom=0.0)
    with pytest.raises(InfeasibleError, match="too small for this step"):
        train(model, data, session)


def test_parameters_and_small_tensors_pass_through():
    model, data = small_cnn(torch.float32), batches(torch.float32, 1)
    trace = []
    session = OffloadSession(force=OFFLOAD, link=RecordingLink(), min_bytes=4096, trace=trace)
    train(model, data, session)
    packs = [e for e in trace if e[0] == "pack"]
    parameters = sum(p.numel() * p.element_size() for p in model.parameters())
    assert packs and parameters > 0
    assert all(g.nbytes >= 4096 for g in session._step.groups)


def test_an_impossible_budget_in_an_unmodified_script_offloads_everything():
    model, data = small_cnn(torch.float32), batches(torch.float32, 3)
    reference = train(copy.deepcopy(model), data)
    said = []
    session = OffloadSession(budget=1000, link=RecordingLink(), min_bytes=0, headroom=0.0,
                             strict=False, say=said.append)
    assert_bitwise(reference, train(model, data, session))
    assert session.plan is None
    assert session.modes == [OFFLOAD if g.offloadable else KEEP for g in session.profile.groups]
    assert session.modes.count(OFFLOAD) > len(session.modes) // 2
    assert any("too small for this step" in text for text in said)


def test_each_plan_writes_the_profile_it_was_made_from(tmp_path):
    import json
    from mucudnn.torch import planner
    model, data = small_cnn(torch.float32), batches(torch.float32, 3)
    path = tmp_path / "profile.json"
    session = OffloadSession(budget=4 * GiB, link=RecordingLink(), min_bytes=0, headroom=0.0,
                             profile_to=path)
    train(model, data, session)
    document = json.loads(path.read_text())
    assert document["budget"] == 4 * GiB and document["target"] == session.target
    assert document["modes"] == session.modes and document["plan"] == session.plan.describe()
    assert document["releases"] == list(session.plan.releases)
    assert document["release_margin"] == session.plan.release_margin
    # the planner replays on it off the GPU: the same plan, released at the same points
    profile = planner.profile_from_dict(document["profile"])
    replayed = planner.plan_with_prefetch(profile, document["target"], session.lookahead)
    assert (replayed.modes, list(replayed.releases)) == (session.plan.modes, document["releases"])


def test_no_plan_writes_the_profile_too_and_an_unwritable_path_is_one_line(tmp_path):
    import json
    model, data = small_cnn(torch.float32), batches(torch.float32, 3)
    said, path = [], tmp_path / "profile.json"
    session = OffloadSession(budget=1000, link=RecordingLink(), min_bytes=0, headroom=0.0,
                             strict=False, say=said.append, profile_to=path)
    train(model, data, session)
    document = json.loads(path.read_text())
    assert document["plan"] is None and document["modes"] == session.modes
    assert document["fell_back"] is False
    said.clear()
    session.profile_to = tmp_path / "no such directory" / "profile.json"
    assert not session.write_profile()
    assert len(said) == 1 and said[0].startswith("the offload profile was not written to ")


def test_a_numpy_budget_writes_its_profile_and_what_json_cannot_write_is_one_line(tmp_path):
    import json
    import numpy as np
    said, path = [], tmp_path / "profile.json"
    session = OffloadSession(budget=np.int64(4 * GiB), link=RecordingLink(), min_bytes=0,
                             headroom=0.0, say=said.append, profile_to=path)
    train(small_cnn(torch.float32), batches(torch.float32, 3), session)  # the step goes on
    assert json.loads(path.read_text())["budget"] == 4 * GiB
    said.clear()
    session.profile.forward_ms = object()  # nothing JSON writes: one line, never an exception
    assert not session.write_profile()
    assert len(said) == 1 and "not JSON serializable" in said[0]


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


class HeldBytes(list):
    """A trace that, at each unpack of a planned step, compares the bytes of device tensors the
    session holds with what the planner modelled live at that backward point."""

    def __init__(self):
        super().__init__()
        self.session = None
        self.checked = 0

    def append(self, event):
        super().append(event)
        session = self.session
        if event[0] not in ("pack", "unpack") or session.plan is None or \
                session._step.profiling:
            return
        held = sum(g.nbytes for g in session._step.groups
                   if g.tensor is not None or g.fetch is not None)
        backward = event[0] == "unpack"
        index = event[2] if backward else event[1]
        modelled = sum(nbytes for added in planner.plan_contributions(
                           session.profile, session.plan.modes, session.prefetch_distance,
                           session.prefetch_margin)
                       for nbytes, forward_points, backward_points in added
                       if index in (backward_points if backward else forward_points))
        assert held <= modelled, f"{event}: session holds {held} B, plan models {modelled}"
        self.checked += 1


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


def saved_bytes(model, data):
    """The bytes a step of ``model`` saves (every group kept)."""
    probe = OffloadSession(force=KEEP, link=SameMemoryLink(gbps=(1.0, 1.0)), min_bytes=0)
    train(copy.deepcopy(model), data[:2], probe)
    return sum(g.nbytes for g in probe._step.groups)


class MeteredLink(RecordingLink):
    """SameMemoryLink with a device-memory meter that tests drive: ``spike(nbytes)`` is a transient
    allocation (a workspace), ``oom()`` a refused one."""

    def __init__(self):
        super().__init__()
        self._peak = 0
        self.refused = 0

    def spike(self, nbytes):
        self._peak = max(self._peak, nbytes)

    def peak_allocated(self):
        peak, self._peak = self._peak, 0
        return peak

    def oom(self):
        self.refused += 1

    def ooms(self):
        return self.refused


class Spike(torch.autograd.Function):
    """Identity; its backward allocates (per ``action``) what the link then reports."""

    @staticmethod
    def forward(ctx, x, action):
        ctx.action = action
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.action()
        return grad, None


class WithSpike(nn.Module):
    def __init__(self, model, action):
        super().__init__()
        self.model, self.action = model, action

    def forward(self, x):   # the spike between the first convolution and the rest
        x = self.model[0](x)
        return self.model[1:](Spike.apply(x, self.action) if self.action else x)


GiB = 2**30


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


@pytest.mark.parametrize("where", ["forward", "backward", "caught"])
def test_a_planned_step_out_of_memory_falls_back_to_offloading_everything(where):
    # "caught": an op's refused allocation that it handles (cuDNN trying a workspace) is no
    # failed step. No replans: the first failure falls back.
    model, data = small_cnn(torch.float32), batches(torch.float32, 4)
    link, said, steps = MeteredLink(), [], []

    def out_of_memory():
        if len(steps) == 2:          # the first planned step
            link.oom()
            if where != "caught":
                raise torch.OutOfMemoryError("out of memory (test)")

    class Fail(nn.Module):
        def forward(self, x):
            if where == "forward":
                out_of_memory()
                return x
            return Spike.apply(x, out_of_memory)

    wrapped = nn.Sequential(model, Fail())
    trace = []
    # (convolutions not recomputed: on the CPU they cost next to nothing, and the plan must
    # offload for the fall-back to differ from it)
    session = OffloadSession(budget=saved_bytes(model, data) * 2 // 3, link=link, min_bytes=0,
                             headroom=0.0, say=said.append, trace=trace, replans=0,
                             record_steps=1, recompute_convolutions=False, trials=False)
    failures = train_through_failures(model, data, session, wrapped,
                                      lambda: steps.append(None))
    if where == "caught":
        assert failures == 0 and not session.fell_back and not said[1:]
        assert [g.mode for g in session._step.groups] == list(session.plan.modes)
        return
    assert failures == 1 and session.fell_back and session.plan.count(OFFLOAD)
    assert [g.mode for g in session._step.groups] == \
        [OFFLOAD if g.offloadable else KEEP for g in session.profile.groups]
    assert sum("ran out of device memory" in line for line in said) == 1
    # the last step ran as the recording step did: every fetch on demand
    last_step = trace[max(i for i, e in enumerate(trace) if e[:2] == ("pack", 0)):]
    assert any(e[0] == "fetch" for e in last_step)
    assert not any(e[0] == "prefetch" for e in last_step)


@pytest.mark.parametrize("failing_steps", [1, 99])
def test_a_planned_step_out_of_memory_plans_again_for_less_then_falls_back(failing_steps,
                                                                           tmp_path):
    # the peak model fell short: the next plan aims lower (replan_step of the budget below the
    # failed plan's modelled peak); when every planned step fails, after `replans` plans it falls
    # back to offloading everything
    model, data = small_cnn(torch.float32), batches(torch.float32, 7)
    link, said, steps = MeteredLink(), [], []

    class Fail(nn.Module):
        def forward(self, x):
            def out_of_memory():
                if 2 <= len(steps) < 2 + failing_steps:     # planned steps
                    link.oom()
                    raise torch.OutOfMemoryError("out of memory (test)")
            return Spike.apply(x, out_of_memory)

    budget = saved_bytes(model, data) * 2
    session = OffloadSession(budget=budget, link=link, min_bytes=0, headroom=0.0,
                             say=said.append, replans=2, replan_step=0.1,
                             record_steps=1, profile_to=tmp_path / "profile.json")
    peaks = []

    def before_step():
        steps.append(None)
        if session.plan is not None:
            peaks.append((session.target, session.plan.peak))

    failures = train_through_failures(model, data, session, nn.Sequential(model, Fail()),
                                      before_step)
    replanned = [line for line in said if "planning for" in line]
    if failing_steps == 1:
        assert failures == 1 and not session.fell_back and len(replanned) == 1
        first_target, first_peak = peaks[0]
        assert session.target == min(first_target, first_peak) - int(0.1 * budget)
        assert session.plan.peak <= session.target < first_peak
        assert [g.mode for g in session._step.groups] == list(session.plan.modes)
        written = json.loads((tmp_path / "profile.json").read_text())
        assert written["target"] == session.target and written["modes"] == list(session.plan.modes)
    else:
        # two replans (each lower), then the third failure falls back
        assert len(replanned) == 2 and session.fell_back and failures == len(data) - 1
        assert sum("offloading every saved tensor from now on" in line for line in said) == 1
        targets = [t for t, _ in peaks]
        assert targets[0] > targets[1] > targets[2]
        written = json.loads((tmp_path / "profile.json").read_text())  # the modes in force
        assert written["fell_back"] and written["modes"] == session.modes != list(session.plan.modes)


def test_after_the_fall_back_flushes_bring_no_plan_back(monkeypatch):
    # every planned step runs out of memory: two replans, then the fall-back (everything
    # offloaded); the caching allocator then flushes in every step, and the watch of a plan kept
    # after its trial does not make a plan for less in place of the fall-back
    monkeypatch.setattr(planner, "trial_plans", lambda *args, **kwargs: [])
    model, data = small_cnn(torch.float32), batches(torch.float32, 5 + 2 * planner.WATCH_STEPS)
    said, steps = [], []
    link = flushing_while(MeteredLink, lambda link: session.fell_back)

    class Fail(nn.Module):
        def forward(self, x):
            def out_of_memory():
                if len(steps) >= 2 and not session.fell_back:     # planned steps
                    link.oom()
                    raise torch.OutOfMemoryError("out of memory (test)")
            return Spike.apply(x, out_of_memory)

    session = OffloadSession(budget=saved_bytes(model, data) * 2, link=link, min_bytes=0,
                             headroom=0.1, say=said.append, replans=2, record_steps=1)
    failures = train_through_failures(model, data, session, nn.Sequential(model, Fail()),
                                      lambda: steps.append(None))
    assert failures == 3 and session.fell_back
    assert not [line for line in said if line.startswith("the offload plan flushed")]
    assert [g.mode for g in session._step.groups] == \
        [OFFLOAD if g.offloadable else KEEP for g in session.profile.groups]


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


def test_two_steps_record_and_the_second_is_profiled():
    # the first recording pins the host pool; the second, which copies into it, is the profile
    model, data = small_cnn(torch.float32), batches(torch.float32, 3)
    link = SlowHostLink()
    session = OffloadSession(budget=GiB, link=link, min_bytes=0)
    train(model, data[:2], session)
    assert session.plan is None and session.profile is None
    allocations = link.host_allocations
    train(model, data[2:], session)
    assert session.plan is not None and link.host_allocations == allocations
    # no pinning waited for in the profiled step: that would be 30 ms per group (the bound
    # leaves a loaded CI machine's slow forward room)
    assert session.profile.forward_ms < 15 * len(session.profile.groups)
    assert len(session.profile.groups) >= 4


def test_a_session_records_planner_record_steps_by_default(monkeypatch):
    # the default is read when a session is made (conftest.py sets two for the other tests)
    monkeypatch.setattr(planner, "RECORD_STEPS", 3)
    model, data = small_cnn(torch.float32), batches(torch.float32, 4)
    session = OffloadSession(budget=GiB, link=SlowHostLink(), min_bytes=0)
    train(model, data[:3], session)
    assert session.plan is None and session.profile is None
    train(model, data[3:], session)
    assert session.plan is not None


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


@pytest.mark.parametrize("probe_bytes", [0, 1 << 40])
def test_the_host_link_is_timed_on_the_recording_steps_own_copies(monkeypatch, probe_bytes):
    # no probe buffer allocated after the recording (at the tightest moment) when the recording's
    # copies were large enough to time the link; a probe only when they were not
    import mucudnn.torch.runtime as runtime
    probed = []

    def probe(link, device):
        probed.append(device)
        return 1.5, 2.5

    monkeypatch.setattr(runtime, "LINK_PROBE_BYTES", probe_bytes)
    monkeypatch.setattr(runtime, "measure_bandwidth", probe)
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


class SlowHostLink(RecordingLink):
    """Making a host tensor blocks the host thread (pinning fresh memory), 30 ms each."""

    def _new_host(self, tensor):
        time.sleep(0.03)
        return super()._new_host(tensor)


def test_the_recorded_times_leave_out_the_hosts_waits():
    # the recording step offloads everything; the host's waits there (pinning memory, the copy
    # queue) are no module's compute: counted, they made offloading look free and recomputing dear
    model, data = small_cnn(torch.float32), batches(torch.float32, 3)
    link = SlowHostLink()
    session = OffloadSession(budget=GiB, link=link, min_bytes=0)
    train(model, data, session)
    profile = session.profile
    waited_ms = 30 * link.host_allocations
    assert link.host_allocations >= 10 and link.stalls == [] and not link.timing
    assert profile.forward_ms < waited_ms / 3
    recipes = [g.recompute_ms for g in profile.groups if g.recompute_ms is not None]
    assert recipes and max(recipes) < 30


def test_groups_a_plan_moves_but_the_step_keeps_are_one_line():
    # convolution outputs have no recipe: a plan recomputing every group keeps those
    model, data = small_cnn(torch.float32), batches(torch.float32, 3)
    said = []
    session = OffloadSession(modes=[RECOMPUTE] * 100, link=RecordingLink(), min_bytes=0,
                             say=said.append)
    train(model, data, session)
    lines = [line for line in said if "were kept" in line]
    assert len(lines) == 1 and "wanted recompute" in lines[0]


def split_steps(trace):
    """The trace's events per step (a step starts at its first pack)."""
    steps = []
    for event in trace:
        if event[0] == "pack" and event[1] == 0:
            steps.append([])
        steps[-1].append(event)
    return steps


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


class LogsItsInputNorm(nn.Module):
    """Saves its input for a graph it drops at once (a logged statistic), before the next
    module saves the same tensor again."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x):
        h = self.model[:8](x)                # AvgPool2d's output: its maker does not save it
        self.logged = h.pow(2).sum().item()  # saves h; that node is freed right away
        return self.model[8:](h)             # the convolution saves h again


@pytest.mark.parametrize("mode", [OFFLOAD, KEEP, RECOMPUTE])
def test_a_tensor_saved_again_after_its_first_saver_was_freed(mode):
    model, data = LogsItsInputNorm(small_cnn(torch.float64)), batches(torch.float64, 3)
    reference = train(copy.deepcopy(model), data)
    session = OffloadSession(force=mode, link=RecordingLink(), min_bytes=0)
    assert_bitwise(reference, train(model, data, session))


def conv3x3(inplanes, planes, stride=1):
    return nn.Conv2d(inplanes, planes, 3, stride, padding=1, bias=False)


def conv1x1(inplanes, planes, stride=1):
    return nn.Conv2d(inplanes, planes, 1, stride, bias=False)


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
    """torchvision.models.resnet.ResNet's structure (its ``_make_layer``) with ``block``:
    ``resnet(BasicBlock, [2, 2, 2, 2], [64, 128, 256, 512], ...)`` is ResNet-18."""
    torch.manual_seed(0)
    modules = [nn.Conv2d(3, stem, 7, 2, padding=3, bias=False), nn.BatchNorm2d(stem),
               nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, padding=1)]
    inplanes = stem
    for index, (blocks, planes) in enumerate(zip(layers, widths)):
        stride = 1 if index == 0 else 2
        downsample = None
        if stride != 1 or inplanes != planes * block.expansion:
            downsample = nn.Sequential(conv1x1(inplanes, planes * block.expansion, stride),
                                       nn.BatchNorm2d(planes * block.expansion))
        modules.append(block(inplanes, planes, stride, downsample))
        inplanes = planes * block.expansion
        modules += [block(inplanes, planes) for _ in range(1, blocks)]
    modules += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(inplanes, 10)]
    return nn.Sequential(*modules).to(dtype)


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


def test_a_function_that_cannot_be_hashed_passes_the_op_recorder():
    class Unhashable:
        __hash__ = None

        def __call__(self, tensor):
            return tensor + 1

    x = torch.zeros(2)
    with OffloadSession(force=RECOMPUTE, link=RecordingLink(), min_bytes=0):
        assert torch.overrides.handle_torch_function(Unhashable(), (x,), x).tolist() == [1, 1]


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


def test_a_chain_longer_than_pythons_stack_is_rebuilt():
    # force recomputes a chain as long as the model: rebuilt without recursion
    torch.manual_seed(0)
    layers = [m for _ in range(300) for m in (nn.Conv1d(2, 2, 1), nn.ReLU())]
    model = nn.Sequential(*layers).double()
    x = torch.randn(2, 2, 8, dtype=torch.float64)
    session = OffloadSession(force=RECOMPUTE, link=RecordingLink(), min_bytes=0)
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(250)
    try:
        for _ in range(2):
            with session:
                loss = model(x).sum()
            loss.backward()
    finally:
        sys.setrecursionlimit(limit)
    assert sum(g.mode == RECOMPUTE for g in session._step.groups) == 300   # each ReLU output


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


class PollingLink(RecordingLink):
    """Logs the session's calls that let a link release what finished copies held."""

    def poll(self):
        self.log.append(("poll",))

    def settle(self):
        self.log.append(("settle",))


def test_the_session_lets_the_link_release_at_every_pack_module_and_unpack_and_settles_each_step():
    # a CUDA link holds an offloaded tensor until its copy is done: the session must give it the
    # chance to let go all through the step (not only at the next offload), and all at step end
    model, data = small_cnn(torch.float32), batches(torch.float32, 3)
    trace, link = [], PollingLink()
    session = OffloadSession(force=OFFLOAD, link=link, min_bytes=0, trace=trace)
    train(model, data, session)
    packs = sum(1 for e in trace if e[0] == "pack")
    unpacks = sum(1 for e in trace if e[0] == "unpack")
    modules = sum(1 for m in model.modules() if not any(True for _ in m.children()))
    polls = sum(1 for e in link.log if e[0] == "poll")
    assert polls >= packs + unpacks + modules * len(data)
    # between two offloads of a step there is always a poll (the first pack after it at least)
    kinds = [e[0] for e in link.log if e[0] in ("offload", "poll")]
    assert all(not (a == b == "offload") for a, b in zip(kinds, kinds[1:]))
    assert sum(1 for e in link.log if e[0] == "settle") >= len(data) - 1   # each step that ended


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


def fake_trial_plans(monkeypatch, others: int = 1, larger: list | None = None) -> list:
    """planner.trial_plans replaced: ``others`` plans, the ``k``-th the plan made with its
    ``k``-th moved or recomputed group kept instead. The list it returns receives [the plan
    made, those] once the session plans; ``larger``, the larger budgets it was given."""
    plans = []

    def made(profile, budget, plan, lookahead, time_limit_s, larger_budgets, keep_apart=False):
        if larger is not None:
            larger.append(list(larger_budgets))
        changed = [i for i, m in enumerate(plan.modes) if m != KEEP]
        plans.append(plan)
        for k in range(others):
            modes = list(plan.modes)
            modes[changed[k]] = KEEP
            plans.append(dataclasses.replace(plan, modes=tuple(modes)))
        return [(f"other {k + 1}", other) for k, other in enumerate(plans[1:])]
    monkeypatch.setattr(planner, "trial_plans", made)
    return plans


@pytest.mark.parametrize("plan_ms, kept", [((10.0, 5.0, 7.0), 1), ((5.0, 10.0, 7.0), 0),
                                           ((10.0, 7.0, 5.0), 2)])
def test_a_session_tries_the_other_plans_and_keeps_the_fastest(monkeypatch, plan_ms, kept):
    # the plan made runs TRIAL_STEPS steps, then each other as many; the fastest by the link's
    # clock (here one whose ticks each plan sets) stays, said in one line
    trial = planner.TRIAL_STEPS
    model, data = small_cnn(torch.float64), batches(torch.float64, 2 + 3 * trial + 2)
    reference = train(copy.deepcopy(model), data)
    plans = fake_trial_plans(monkeypatch, others=2)

    class Ticking(RecordingLink):
        now = 0.0

        def _stamp(self):    # seconds, as SameMemoryLink's clock
            plan = session.plan
            self.now += 1e-3 * (1.0 if plan is None else plan_ms[plans.index(plan)])
            return self.now
    said, trace = [], []
    session = OffloadSession(budget=1, link=Ticking(), min_bytes=0, trace=trace,
                             headroom=0.0, say=said.append)
    session.budget = int(saved_bytes(model, data) * 0.6)
    assert_bitwise(reference, train(model, data, session))
    assert session.plan is plans[kept] and session._trial is None
    labels = ["as made", "other 1", "other 2"]
    assert session.kept_after_trial == (labels[kept] if kept else None)
    assert said[-1] == ("offload plans tried: " + ", ".join(
        f"{label} {ms:.1f} ms a step" for label, ms in zip(labels, plan_ms))
        + f"; keeping the plan {labels[kept]}")
    assert said[-2].startswith("trying it against the plan other 1 (") and "the plan other 2 (" \
        in said[-2]
    steps = split_steps(trace)
    assert len(steps) == len(data)
    ran = [tuple(e[2] for e in step if e[0] == "pack") for step in steps[2:]]
    expected = [p.modes for p in [plans[0]] * trial + [plans[1]] * trial + [plans[2]] * trial
                + [plans[kept]] * 2]
    # each step's groups in the modes of the plan then in force (groups saved once each here)
    assert [r[:len(m)] for r, m in zip(ran, expected)] == expected
    # the cache is emptied before each plan's first step: after the recording, at each switch,
    # and after the trial unless the plan kept is the one that ran last
    emptied = [e[1] for e in trace if e[0] == "empty_cache"]
    assert emptied == [2, 2 + trial, 2 + 2 * trial] + ([2 + 3 * trial] if kept != 2 else [])


def test_a_plan_of_the_same_modes_still_starts_with_the_cache_emptied(monkeypatch):
    # the trial's other plan differs from the plan made only in how far ahead it fetches
    trial = planner.TRIAL_STEPS
    model, data = small_cnn(torch.float64), batches(torch.float64, 2 + 2 * trial + 1)
    monkeypatch.setattr(planner, "trial_plans", lambda profile, budget, plan, *rest, **named: [
        ("further ahead", dataclasses.replace(plan, lookahead=plan.lookahead + 1))])
    trace = []
    session = OffloadSession(budget=1, link=RecordingLink(), min_bytes=0, headroom=0.0,
                             trace=trace, say=lambda line: None)
    session.budget = int(saved_bytes(model, data) * 0.6)
    train(model, data, session)
    assert [e[1] for e in trace if e[0] == "empty_cache"][:2] == [2, 2 + trial]


def test_steps_in_the_same_modes_leave_the_cache_alone():
    model, data = small_cnn(torch.float64), batches(torch.float64, 4)
    trace = []
    session = OffloadSession(modes=[OFFLOAD] * 64, link=RecordingLink(), min_bytes=0,
                             trace=trace)
    train(model, data, session)
    assert not [e for e in trace if e[0] == "empty_cache"]


@pytest.mark.parametrize("headroom", [0.1, 0.0])
def test_the_trial_plans_for_the_headroom_shares_too(monkeypatch, headroom):
    # besides the plan made for budget x (1 - headroom), plans for each share of the headroom
    # (planner.TRIAL_HEADROOM_SHARES); with no headroom, none
    model, data = small_cnn(torch.float64), batches(torch.float64, 3)
    larger = []
    fake_trial_plans(monkeypatch, larger=larger)
    budget = int(saved_bytes(model, data) * 0.8)
    session = OffloadSession(budget=budget, link=RecordingLink(), min_bytes=0, headroom=headroom,
                             say=lambda line: None)
    train(model, data, session)
    assert session.target == planner.planning_target(budget, headroom)
    assert larger == [[planner.planning_target(budget, headroom * share)
                       for share in planner.TRIAL_HEADROOM_SHARES] if headroom else []]


def test_fetches_issued_at_one_unpack_go_in_the_order_the_groups_were_saved():
    # the one needed last is allocated first and freed last (stack order for the caching
    # allocator), as planner.simulate plays it (the one needed at that unpack goes first: _unpack)
    groups = [planner.SavedGroup(1000, 3 - g, 3 - g) for g in range(4)]
    modes = [KEEP, OFFLOAD, OFFLOAD, OFFLOAD]
    session = OffloadSession(modes=modes, link=RecordingLink(), min_bytes=0)
    session.profile = planner.StepProfile(groups, 1.0, 1.0, 1.0, 1.0, 4)
    session._first_unpacks = [g.first_unpack for g in groups]
    assert session._prefetch_schedule(modes) == {0: [1, 2, 3]}


def test_no_trial_where_the_plan_moves_nothing():
    profile = planner.StepProfile([planner.SavedGroup(1000, 0, 0)] * 2, 1.0, 1.0, 1.0, 1.0, 1,
                                  baseline_forward=[0, 0], baseline_backward=[0],
                                  copy_exposure=0.6)
    plan = planner.plan_with_prefetch(profile, 10**9)
    assert plan.moved_bytes == 0
    assert planner.trial_plans(profile, 10**9, plan, larger_budgets=[2 * 10**9]) == []


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


@pytest.mark.parametrize("failing", [1, 2])
@pytest.mark.parametrize("out_of_memory", [True, False])
def test_a_trial_plan_that_fails_leaves_the_fastest_that_ran_without_a_replan(
        monkeypatch, failing, out_of_memory):
    # the plan tried second (or third) runs out of memory, or its step fails otherwise: the
    # trial ends there, and the fastest of the plans before it stays (the plan made runs 5 ms a
    # step, the other 4), no replan
    trial = planner.TRIAL_STEPS
    model, data = small_cnn(torch.float32), batches(torch.float32, 2 + 3 * trial + 3)
    said, steps = [], []
    plans = fake_trial_plans(monkeypatch, others=2)

    class Ticking(MeteredLink):
        now = 0.0

        def _stamp(self):
            plan = session.plan
            self.now += 1e-3 * (4.0 if plans and plan is plans[1] else 5.0)
            return self.now
    link = Ticking()

    class Fail(nn.Module):
        def forward(self, x):
            def fail():
                if plans and session.plan is plans[failing]:
                    if not out_of_memory:
                        raise ValueError("a bad batch (test)")
                    link.oom()
                    raise torch.OutOfMemoryError("out of memory (test)")
            return Spike.apply(x, fail)

    session = OffloadSession(budget=saved_bytes(model, data) * 3 // 4, link=link, min_bytes=0,
                             headroom=0.0, say=said.append, recompute_convolutions=False)
    failures = train_through_failures(model, data, session, nn.Sequential(model, Fail()),
                                      lambda: steps.append(None),
                                      (torch.OutOfMemoryError, ValueError))
    kept = 1 if failing == 2 else 0
    assert failures == 1 and session.plan is plans[kept] and session._trial is None
    assert session.replans_used == 0 and not session.fell_back
    timed = "as made 5.0 ms a step" + (", other 1 4.0 ms a step" if failing == 2 else "")
    why = (f"the plan other {failing} ran out of device memory in its trial" if out_of_memory
           else f"a step of the plan other {failing} failed in its trial")
    assert said[-1] == f"{why}: {timed}; keeping the plan {['as made', 'other 1'][kept]}"
    assert [g.mode for g in session._step.groups] == list(plans[kept].modes)


def test_after_a_forward_that_failed_the_cache_is_emptied_as_the_next_step_starts(monkeypatch):
    # the trial's other plan runs out of memory in its forward: the plan made stays, and the
    # cache is emptied for it once the next step starts (until the script lets go of the error,
    # its traceback holds the failed forward's tensors), not as the error leaves the session
    trial = planner.TRIAL_STEPS
    model, data = small_cnn(torch.float32), batches(torch.float32, 2 + 2 * trial + 2)
    plans = fake_trial_plans(monkeypatch)

    class Counting(MeteredLink):
        empties = 0

        def empty_cache(self):
            self.empties += 1
    link, empties_at_start = Counting(), []

    class FailForward(nn.Module):
        def forward(self, x):
            if plans and session.plan is plans[1]:
                link.oom()
                raise torch.OutOfMemoryError("out of memory (test)")
            return x
    session = OffloadSession(budget=saved_bytes(model, data) * 3 // 4, link=link, min_bytes=0,
                             headroom=0.0, say=lambda line: None, recompute_convolutions=False)
    failures = train_through_failures(model, data, session, nn.Sequential(model, FailForward()),
                                      lambda: empties_at_start.append(link.empties))
    failed = 2 + trial      # the step (0-based) of the other plan's first, which fails
    assert failures == 1 and session.plan is plans[0]
    # per step: emptied at its start (the plan made, the other plan), then for the plan kept at
    # the start of the step after the failure
    during = [b - a for a, b in zip(empties_at_start, empties_at_start[1:])]
    assert during[2] == 1 and during[failed] == 1 and during[failed + 1] == 1
    assert sum(during) == 3


def run_trial(model, data, link):
    """(session, lines said) after training ``model`` on ``data`` with a session under half of its
    saved bytes and no headroom (so a trial), ``link`` its link (``link.session``: the session)."""
    said = []
    session = OffloadSession(budget=1, link=link, min_bytes=0, headroom=0.0, say=said.append)
    link.session = session
    session.budget = int(saved_bytes(model, data) * 0.5)
    train(model, data, session)
    return session, said


def test_a_trial_times_each_plan_by_its_fastest_step(monkeypatch):
    # one slow step (the script's own work between steps) does not make the plan lose: the plan
    # made runs 10 then 30 ms a step (mean 20), the other 15 and 15: the plan made stays
    trial = planner.TRIAL_STEPS
    model, data = small_cnn(torch.float64), batches(torch.float64, 2 + 2 * trial + 1)
    plans = fake_trial_plans(monkeypatch)
    ticks = {0: iter([1.0, 10.0, 30.0]), 1: iter([1.0, 15.0, 15.0])}

    class Ticking(RecordingLink):
        now = 0.0

        def _stamp(self):    # seconds; a step's end mark advances by that plan's next tick
            session = self.session
            if session._trial is not None and session.plan in plans:
                self.now += 1e-3 * next(ticks[plans.index(session.plan)])
            else:
                self.now += 1e-3
            return self.now
    session, said = run_trial(model, data, Ticking())
    assert said[-1] == ("offload plans tried: as made 10.0 ms a step, other 1 15.0 ms a "
                        "step; keeping the plan as made")
    assert session.plan is plans[0]


def flushing_while(link_type, due):
    """A ``link_type`` whose caching allocator's flush count grows by one at each read where
    ``due(link)``."""
    class Flushing(link_type):
        count = 0

        def flushes(self):
            self.count += bool(due(self))
            return self.count
    return Flushing()


def flushing_link(plans, step_ms, flushing, flush_after: int = 2):
    """A RecordingLink (``link.session``: the session) whose clock runs ``step_ms[k]`` a step
    under ``plans[k]`` and whose caching allocator flushes once a step, in the op after backward
    point ``flush_after`` (-1: in the forward; None: after the backward, in the optimizer's
    step), under each plan ``k`` with ``flushing[k]``."""
    def index(plan):
        return plans.index(plan) if plan in plans else 0

    class Flushing(RecordingLink):
        now, count, step = 0.0, 0, None

        def _stamp(self):
            self.now += 1e-3 * step_ms[index(self.session.plan)]
            return self.now

        def flushes(self):
            session = self.session
            unpacks = session._step.unpacks   # 0 after a backward (a new step begins)
            due = unpacks == 0 if flush_after is None else unpacks > flush_after + 1
            if flushing[index(session.plan)] and due and self.step != session.steps:
                self.step, self.count = session.steps, self.count + 1
            return self.count
    return Flushing()


@pytest.mark.parametrize("flushing, kept", [((False, True), 0), ((True, True), 1),
                                            ((False, False), 1), ((True, False), 1)])
def test_a_trial_keeps_a_plan_that_flushed_only_where_every_plan_did(monkeypatch, flushing, kept):
    # the other plan runs 5 ms a step against 10 as made; a plan whose timed steps flushed the
    # caching allocator's cache (the link's counter grew) loses to one whose did not
    trial = planner.TRIAL_STEPS
    model, data = small_cnn(torch.float64), batches(torch.float64, 2 + 2 * trial + 1)
    plans = fake_trial_plans(monkeypatch)
    session, said = run_trial(model, data, flushing_link(plans, (10.0, 5.0), flushing))
    flushed = [" (2 flushes after backward point 2)" if f else "" for f in flushing]
    assert said[-1] == (f"offload plans tried: as made 10.0 ms a step{flushed[0]}, other 1 5.0 ms "
                        f"a step{flushed[1]}; keeping the plan {['as made', 'other 1'][kept]}")
    assert session.plan is plans[kept]


@pytest.mark.parametrize("replans", [3, 0])
def test_a_trial_whose_every_plan_flushed_plans_for_less_and_tries_again(monkeypatch, replans):
    # both plans flush: the next plans are made for half the headroom less (a replan) and tried
    # in turn; of those, the one that does not flush stays, slower as it is. Without replans
    # left, the fastest of the flushing plans stays
    trial = planner.TRIAL_STEPS
    model, data = small_cnn(torch.float64), batches(torch.float64, 2 + 4 * trial + 2)
    plans = []   # each trial's: the plan made, the other (its first moved group kept)

    def made(profile, budget, plan, lookahead, time_limit_s, larger_budgets, keep_apart=False):
        modes = list(plan.modes)
        modes[next(i for i, m in enumerate(modes) if m != KEEP)] = KEEP
        plans.extend([plan, dataclasses.replace(plan, modes=tuple(modes))])
        return [("other 1", plans[-1])]
    monkeypatch.setattr(planner, "trial_plans", made)
    link = flushing_link(plans, (10.0, 5.0, 12.0, 11.0), (True, True, False, True))
    said = []
    session = OffloadSession(budget=1, link=link, min_bytes=0, headroom=0.1, say=said.append,
                             replans=replans)
    link.session = session
    session.budget = int(saved_bytes(model, data) * 0.6)
    first = session.target
    train(model, data, session)
    tried = [line for line in said if line.startswith("offload plans tried")]
    if not replans:
        assert session.target == first and len(plans) == 2 and session.plan is plans[1]
        assert len(tried) == 1 and tried[0].endswith("keeping the plan other 1")
        return
    lowered = first - int(0.05 * session.budget)
    assert session.target == lowered and session.replans_used == 1 and len(plans) == 4
    assert tried[0].endswith(f"each flushed the caching allocator's cache, so planning for "
                             f"{lowered / 2**30:.2f} GiB")
    assert any(line.startswith("offload plan for") and
               f"(planned for {lowered / 2**30:.2f} GiB)" in line for line in said)
    assert tried[1] == ("offload plans tried: as made 12.0 ms a step, other 1 11.0 ms a step "
                        "(2 flushes after backward point 2); keeping the plan as made")
    assert session.plan is plans[2] and session.plan.target == lowered


@pytest.mark.parametrize("flushing", [True, False])
def test_a_plan_with_no_other_to_try_is_watched_for_flushes_alone(monkeypatch, flushing):
    # no other plan worth trying: the plan still runs TRIAL_STEPS steps as a trial of one; if it
    # flushes the caching allocator's cache, the next is made for half the headroom less, as
    # long as replans are left (3); if not, it stays, with nothing said
    trial = planner.TRIAL_STEPS
    model, data = small_cnn(torch.float64), batches(torch.float64, 2 + 4 * trial + 1)
    monkeypatch.setattr(planner, "trial_plans", lambda *args, **kwargs: [])
    link = flushing_link([], (10.0,), (flushing,))
    said = []
    session = OffloadSession(budget=1, link=link, min_bytes=0, headroom=0.1, say=said.append)
    link.session = session
    session.budget = int(saved_bytes(model, data) * 0.7)
    first = session.target
    train(model, data, session)
    lowered = [line for line in said if "it flushed the caching allocator's cache" in line]
    assert session._trial is None
    if not flushing:
        assert session.target == first and session.replans_used == 0 and not lowered
        assert [line for line in said if line.startswith("offload plan")] == said[:1]
        return
    assert session.replans_used == 3 and len(lowered) == 3
    assert session.replans_left == 3     # a step out of memory still has its own
    assert session.target == first - 3 * int(0.05 * session.budget)
    assert lowered[0].startswith("the offload plan ran 10.0 ms a step (2 flushes after backward "
                                 "point 2); it flushed")


@pytest.mark.parametrize("flushing_steps", [2, 1])
def test_a_plan_that_flushes_after_its_trial_is_replaced_by_one_for_less(monkeypatch,
                                                                        flushing_steps):
    # calm in its trial (a trial of one), the plan as made flushes the caching allocator's cache
    # in the steps after it, from the second on: after WATCH_FLUSHING such steps of its last
    # WATCH_STEPS, the plan for half the headroom less is made and tried, and (calm) stays; a
    # plan that flushed in fewer steps stays
    assert planner.WATCH_FLUSHING == 2
    trial = planner.TRIAL_STEPS
    first_watched = 2 + trial            # the steps before: recording, the trial
    model, data = small_cnn(torch.float64), batches(torch.float64, first_watched + 4 + trial + 1)
    monkeypatch.setattr(planner, "trial_plans", lambda *args, **kwargs: [])

    class LateFlushing(RecordingLink):
        count = 0

        def flushes(self):   # read once at each watched step's end (steps: those ended)
            session = self.session
            step = session.steps - 1
            if (session._lowered_target is None and session._trial is None
                    and first_watched < step <= first_watched + flushing_steps
                    and step != getattr(self, "last", None)):
                self.last, self.count = step, self.count + 1
            return self.count
    link, said = LateFlushing(), []
    session = OffloadSession(budget=1, link=link, min_bytes=0, headroom=0.1, say=said.append)
    link.session = session
    session.budget = int(saved_bytes(model, data) * 0.6)
    first = session.target
    train(model, data, session)
    lowered = [line for line in said if line.startswith("the offload plan flushed")]
    if flushing_steps < planner.WATCH_FLUSHING:
        assert not lowered and session.target == first and session.replans_used == 0
        return
    assert lowered == [f"the offload plan flushed the caching allocator's cache in 2 of its last "
                       f"3 steps, so planning for {session.target / 2**30:.2f} GiB"]
    assert session.target == first - int(0.05 * session.budget) and session.replans_used == 1
    assert said[-1].startswith("offload plan for") and "(planned for" in said[-1]
    assert session._trial is None and session.plan.target == session.target


@pytest.mark.parametrize("flush_after", [-1, 0, 3, None])
def test_a_trial_says_after_which_op_a_plan_flushed(monkeypatch, flush_after):
    # the link's flush count, read at each unpack of a trial's steps and after its backward,
    # grows once a step in the op after backward point flush_after (-1: in the forward; None:
    # after the backward) under the other plan
    trial = planner.TRIAL_STEPS
    model, data = small_cnn(torch.float64), batches(torch.float64, 2 + 2 * trial + 1)
    plans = fake_trial_plans(monkeypatch)
    session, lines = run_trial(model, data, flushing_link(plans, (10.0, 5.0), (False, True),
                                                          flush_after=flush_after))
    said = ("after the forward" if flush_after == -1 else
            f"after backward point {session.profile.unpacks - 1 if flush_after is None else flush_after}")
    assert lines[-1] == ("offload plans tried: as made 10.0 ms a step, other 1 5.0 ms a step "
                         f"(2 flushes {said}); keeping the plan as made")


def test_a_flush_in_a_fetch_is_said_after_the_point_that_fetched(monkeypatch):
    # under the other plan each fetch (prefetched or on demand) flushes the cache: the trial's
    # line names the backward points whose unpack issued them
    trial = planner.TRIAL_STEPS
    model, data = small_cnn(torch.float64), batches(torch.float64, 2 + 2 * trial + 1)
    plans = fake_trial_plans(monkeypatch)
    fetched_at = set()

    class FetchFlushes(RecordingLink):
        count = 0

        def fetch(self, host, device, inline=False):
            session = self.session
            if session._trial is not None and session.plan is plans[1]:
                self.count += 1
                if session._trial.marks[1]:    # a timed step
                    fetched_at.add(session._step.unpacks - 1)
            return super().fetch(host, device, inline)

        def flushes(self):
            return self.count
    session, lines = run_trial(model, data, FetchFlushes())
    assert plans[1].count(OFFLOAD) and fetched_at
    points = sorted(fetched_at)
    where = (f"after backward point{'s' if len(points) > 1 else ''} "
             + ", ".join(map(str, points)))
    assert f"other 1 " in lines[-1] and f"flushes {where})" in lines[-1]


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
    made = session._make_plan

    def make_plan():   # as if the trial had kept the plan run with its small kept groups apart
        made()
        session.plan = dataclasses.replace(session.plan, keep_apart=keep_apart)
    session._make_plan = make_plan
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


def test_a_kept_copy_changed_in_place_is_refused_as_a_recipe_source():
    # a recipe reads a kept group's copy; if the copy was changed after it was saved, the
    # rebuild refuses as it does for a changed alias
    from mucudnn.torch.runtime import _Call, _Group, _Recipe
    saved = torch.randn(2, 3, dtype=torch.float64)
    link = SameMemoryLink()
    with torch.no_grad():
        copied = link.keep_apart(saved)
    source = _Group(0, KEEP, saved.numel() * 8, saved.device, weakref.ref(saved),
                    saved._version, "op", True, tensor=copied, kept_version=copied._version)
    relu = nn.ReLU()
    recipe = _Recipe([_Call(relu, "ReLU", (), None, None, recomputable=True)], [(source,)])
    target = _Group(1, RECOMPUTE, source.nbytes, saved.device, weakref.ref(saved), 0, "ReLU",
                    True, recipe=recipe)
    session = OffloadSession(link=link)
    assert torch.equal(session._recompute_group(target, link), torch.relu(saved))
    copied.add_(1.0)
    with pytest.raises(RuntimeError, match="changed after it was saved"):
        session._recompute_group(target, link)


class LaggingHostLink(RecordingLink):
    """A link on a fake clock: each stamp reads 1 µs after the one before (wall-clock time plays
    no part: how busy the machine is cannot change a time), and the host falls 50 ms behind (the
    device idle meanwhile, as its clock shows) at every pack of ``lagging`` recording steps
    (counted from 1)."""

    TICK = 1e-6

    def __init__(self, lagging):
        super().__init__()
        self.lagging, self.packs, self.lag, self.ticks = lagging, 0, 0.0, 0

    def _stamp(self):
        self.ticks += 1
        return self.ticks * self.TICK + self.lag

    def offload(self, tensor, inline=False, held=False):
        if inline and self.packs // self.groups + 1 in self.lagging:
            self.lag += 0.05
        self.packs += 1
        return super().offload(tensor, inline, held)


@pytest.mark.parametrize("lagging", [{1}, {2}])
def test_a_host_lagging_in_one_recording_step_stretches_no_time_of_the_profile(lagging,
                                                                              monkeypatch):
    # whichever recording lagged, the profile's times are those of the one that did not. On the
    # fake clock an unlagged recording's times are its stamps, a µs each (about 0.1 ms here), and
    # a lagged one's at least 50 ms: deterministic on any machine, however busy
    model, data = small_cnn(torch.float32), batches(torch.float32, 3)
    probe = OffloadSession(budget=GiB, link=RecordingLink(), min_bytes=0)
    train(copy.deepcopy(model), data[:1], probe)
    link = LaggingHostLink(lagging)
    link.groups = len([g for g in probe._step.groups if g.offloadable])
    recordings = []
    least_times = planner.least_times
    monkeypatch.setattr(planner, "least_times",
                        lambda profiles: recordings.extend(profiles) or least_times(profiles))
    session = OffloadSession(budget=GiB, link=link, min_bytes=0, record_steps=2)
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
    from mucudnn.torch import runtime
    callers = []
    passed = runtime._OpRecorder.__torch_function__
    torch_files = os.path.dirname(torch.__file__) + os.sep

    def counting(self, func, types, args=(), kwargs=None):
        frame = sys._getframe(1)   # the first caller outside torch
        while frame is not None and frame.f_code.co_filename.startswith(torch_files):
            frame = frame.f_back
        callers.append(frame.f_code.co_filename if frame is not None else "")
        return passed(self, func, types, args, kwargs)
    monkeypatch.setattr(runtime._OpRecorder, "__torch_function__", counting)
    dtype = torch.float64
    model, data = TinyUNet(dtype, seed=0), volumes(dtype, 2)
    session = OffloadSession(force=RECOMPUTE, link=RecordingLink(), min_bytes=0)
    train(model, data, session)
    assert callers and not [c for c in callers if c.endswith("mucudnn/torch/runtime.py")]
    assert joined(session._step.groups)   # the cat was recorded, and rebuilds its group


def test_a_leaf_modules_forward_runs_without_the_op_recorder_even_after_one_raised(monkeypatch):
    # no op inside a leaf module is recorded, so none goes through the recorder (a Python call
    # each); a leaf whose forward raises puts it back all the same, and the next step's
    # concatenation is still recorded
    from mucudnn.torch import runtime
    passed, through = runtime._OpRecorder.__torch_function__, []

    def counting(self, func, types, args=(), kwargs=None):
        through.append(getattr(func, "__name__", ""))
        return passed(self, func, types, args, kwargs)
    monkeypatch.setattr(runtime._OpRecorder, "__torch_function__", counting)
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
            recorder = session._ops
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
            assert stack() == before == [session._ops]
        finally:
            for handle in handles:
                handle.remove()
    assert stack() == []


def test_a_parameter_changed_in_place_is_never_a_group():
    # a frozen parameter changed in place by an op of a tensor that requires grad is no leaf;
    # it is still a parameter, which a session never saves as its own
    parameter = nn.Parameter(torch.randn(64, 64), requires_grad=False)
    parameter.mul_(torch.randn(64, 64, requires_grad=True))
    assert not parameter.is_leaf
    session = OffloadSession(force=KEEP, link=RecordingLink(), min_bytes=0)
    with session:
        (torch.randn(2, 64, 64, requires_grad=True).exp() * parameter).sum()
    assert [g.nbytes for g in session._step.groups] == [2 * 64 * 64 * 4]   # the exp's only


def test_a_replan_after_running_out_of_memory_is_not_blamed_for_the_old_plans_flushes(
        monkeypatch):
    # the plan kept after its trial (of one) flushes in one watched step (4); step 5 runs out of
    # memory (the caching allocator flushes before it refuses: num_alloc_retries grows), and the
    # plan is made again for less. That new plan never flushes: neither the failed step's flush
    # nor the old plan's step 4 counts in its watch
    monkeypatch.setattr(planner, "trial_plans", lambda *args, **kwargs: [])
    dtype = torch.float64
    model, data = small_cnn(dtype), batches(dtype, 9)
    said, steps = [], []

    class Flushing(MeteredLink):
        count = 0

        def flushes(self):
            return self.count
    link = Flushing()

    class Fail(nn.Module):
        def forward(self, x):
            step = len(steps) - 1
            if step == 4:
                link.count += 1                      # the old plan flushes once
            if step == 5:
                link.count += 1                      # the allocator's retry before the refusal
                link.oom()
                raise torch.OutOfMemoryError("out of memory (test)")
            return x

    session = OffloadSession(budget=saved_bytes(model, data) * 2, link=link, min_bytes=0,
                             headroom=0.1, say=said.append, replans=2, record_steps=1)
    failures = train_through_failures(model, data, session, nn.Sequential(model, Fail()),
                                      lambda: steps.append(None))
    assert failures == 1
    assert any("ran out of device memory" in line and "planning for" in line for line in said)
    assert not [line for line in said if line.startswith("the offload plan flushed")]


def test_an_infeasible_lower_target_is_not_solved_again_at_every_watch(monkeypatch):
    # the plan kept after its trial flushes in every step; the plan for less is infeasible:
    # it is solved once (a whole plan_with_prefetch ladder, up to plan_time_limit_s a rung),
    # not again at every WATCH_FLUSHING flushing steps
    monkeypatch.setattr(planner, "trial_plans", lambda *args, **kwargs: [])
    dtype = torch.float64
    model, data = small_cnn(dtype), batches(dtype, 2 + planner.TRIAL_STEPS + 12)
    said, solves = [], []

    class Flushing(RecordingLink):
        count = 0

        def flushes(self):
            session = self.session
            if session.plan is not None and session._trial is None \
                    and session._step.unpacks == 0:
                self.count += 1
            return self.count
    link = Flushing()
    session = OffloadSession(budget=1, link=link, min_bytes=0, headroom=0.1, say=said.append)
    link.session = session
    session.budget = int(saved_bytes(model, data) * 0.6)
    real = session._plan_for
    first = session.target

    def plan_for(target):
        if target < first:
            solves.append(target)
            raise InfeasibleError("no plan (test)")
        return real(target)
    session._plan_for = plan_for
    train(model, data, session)
    assert len(solves) == 1 and session.lowerings_left == 0


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


def plans_from(monkeypatch, budget: int, least_headroom: float, solved: list) -> None:
    """The planner makes plans only for targets of at least ``budget`` less ``least_headroom``
    of it (InfeasibleError below, with no least peak); ``solved`` receives every target asked."""
    real = planner.plan_with_prefetch

    def plan_with_prefetch(profile, target, *args, **kwargs):
        solved.append(target)
        if target < planner.planning_target(budget, least_headroom):
            raise InfeasibleError(f"no plan within {target} (test)")
        return real(profile, target, *args, **kwargs)
    monkeypatch.setattr(planner, "plan_with_prefetch", plan_with_prefetch)


@pytest.mark.parametrize("feasible_headroom", [0.05, 0.025, 0.0])
def test_where_no_plan_meets_the_headroom_a_session_plans_with_less(monkeypatch,
                                                                   feasible_headroom):
    # plans meet only targets of at least the budget less feasible_headroom: the session's 10 %
    # leaves none, so it plans with half of it, then a quarter, down to planner.LEAST_HEADROOM;
    # below that, the budget is too small as before (the error of the target the headroom left)
    model, data = small_cnn(torch.float64), batches(torch.float64, 3)
    said, solved = [], []
    plans_from(monkeypatch, 4 * GiB, feasible_headroom, solved)
    session = OffloadSession(budget=4 * GiB, link=RecordingLink(), min_bytes=0, headroom=0.1,
                             say=said.append, trials=False)
    tried = [planner.planning_target(4 * GiB, h) for h in (0.1, 0.05, 0.025)]
    if feasible_headroom < planner.LEAST_HEADROOM:
        with pytest.raises(InfeasibleError) as raised:
            train(model, data, session)
        assert str(raised.value) == f"no plan within {tried[0]} (test)" and solved == tried
        return
    train(model, data, session)
    target = planner.planning_target(4 * GiB, feasible_headroom)
    assert session.target == target and session.plan.target == target
    assert solved == tried[:{0.05: 2, 0.025: 3}[feasible_headroom]]
    assert said[0] == (f"no offload plan for 4.00 GiB less its headroom (10%); planning for "
                       f"{target / 2**30:.2f} GiB, {feasible_headroom:.1%} less")
    assert said[1].startswith(f"offload plan for 4.00 GiB (planned for {target / 2**30:.2f} GiB)")


def test_no_target_below_one_without_a_plan_is_solved_after_less_headroom(monkeypatch):
    # planned with 5 % (10 % had no plan); the plan, alone, flushes in every step: the plan for
    # less would be at or below the 10 % target, so none is solved (and no trial looks for
    # flushes that could lead nowhere); nor after running out of memory: the fall-back at once
    monkeypatch.setattr(planner, "trial_plans", lambda *args, **kwargs: [])
    model, data = small_cnn(torch.float64), batches(torch.float64, 2 + 2 * planner.TRIAL_STEPS)
    said, solved = [], []
    link = flushing_while(RecordingLink, lambda link: link.session.plan is not None
                          and link.session._step.unpacks == 0)
    plans_from(monkeypatch, 4 * GiB, 0.05, solved)
    session = OffloadSession(budget=4 * GiB, link=link, min_bytes=0, headroom=0.1,
                             say=said.append)
    link.session = session
    train(model, data, session)
    assert solved == [planner.planning_target(4 * GiB, h) for h in (0.1, 0.05)]
    assert session._trial is None and session.lowerings_left == 0
    assert not [line for line in said if "flushed" in line]


def test_out_of_memory_after_less_headroom_falls_back_without_a_solve(monkeypatch):
    monkeypatch.setattr(planner, "trial_plans", lambda *args, **kwargs: [])
    model, data = small_cnn(torch.float32), batches(torch.float32, 5)
    said, solved, steps = [], [], []
    link = MeteredLink()

    class Fail(nn.Module):
        def forward(self, x):
            def out_of_memory():
                if len(steps) == 3:   # the first planned step
                    link.oom()
                    raise torch.OutOfMemoryError("out of memory (test)")
            return Spike.apply(x, out_of_memory)
    budget = saved_bytes(model, data) * 2
    plans_from(monkeypatch, budget, 0.05, solved)
    session = OffloadSession(budget=budget, link=link, min_bytes=0, headroom=0.1,
                             say=said.append, replans=2, record_steps=1, trials=False,
                             strict=False)
    train_through_failures(model, data, session, nn.Sequential(model, Fail()),
                           lambda: steps.append(None))
    assert session.fell_back
    assert solved == [planner.planning_target(budget, h) for h in (0.1, 0.05)]


def test_an_unmeetable_budget_solves_its_least_peak_once(monkeypatch):
    # the least peak is solved for the error of the headroom's target, and no smaller headroom
    # whose target is below it is tried
    calls = []
    real = planner._least_peak_modes
    monkeypatch.setattr(planner, "_least_peak_modes",
                        lambda *args, **kwargs: calls.append(1) or real(*args, **kwargs))
    model, data = small_cnn(torch.float64), batches(torch.float64, 3)
    said = []
    session = OffloadSession(budget=4096, link=RecordingLink(), min_bytes=0, strict=False,
                             trials=False, say=said.append)
    train(model, data, session)
    assert session.plan is None and len(calls) == 1
    assert any("too small for this step" in line for line in said)


def test_a_pinned_host_buffer_is_on_the_host_whatever_the_default_device(monkeypatch):
    # a script may set another default device (torch.set_default_device("cuda")): the link's
    # pinned buffers still go to the host (pinning needs CUDA, so the factory is only watched)
    from mucudnn.torch.runtime import CudaLink
    made = []

    def empty_strided(*args, **kwargs):
        made.append(kwargs)
        return torch.empty(0)
    monkeypatch.setattr(torch, "empty_strided", empty_strided)
    CudaLink._new_host(None, torch.ones(2, 3).t())
    assert made == [{"dtype": torch.float32, "device": "cpu", "pin_memory": True}]


@pytest.mark.parametrize("case", ["cliff", "no gain", "no room"])
def test_a_lowering_after_flushes_stops_short_of_a_step_in_the_plans_time(monkeypatch, case):
    # the plan for half the headroom lower (0.85 of the budget) moves much more than the one
    # for a quarter lower (0.875), which still peaks below the plan that flushed: that one
    # is made, unless it is not faster by LOWERING_MIN_GAIN or gives no room
    budget = 1000 << 20
    flushing = planner.OffloadPlan((KEEP,), 2, int(0.89 * budget), 85.0, 0)
    quarter_peak = {"cliff": 0.87, "no gain": 0.87, "no room": 0.89}[case]
    quarter_ms = {"cliff": 85.5, "no gain": 95.5, "no room": 85.5}[case]
    solved = []

    def plan_for(target, explain=True):
        solved.append(target)
        if target >= int(0.875 * budget):
            return planner.OffloadPlan((KEEP,), 2, int(quarter_peak * budget), quarter_ms, 0)
        return planner.OffloadPlan((OFFLOAD,), 2, int(0.84 * budget), 103.6, 800 << 20,
                                   simulated_ms=100.0)
    session = OffloadSession(budget, headroom=0.1)
    lowerings = session.lowerings_left
    monkeypatch.setattr(session, "_plan_for", plan_for)
    lower = session._plan_below_flushes(flushing.peak)
    assert solved == [int(0.9 * budget) - int(0.05 * budget),
                      int(0.9 * budget) - int(0.05 * budget) + int(0.05 * budget) // 2]
    if case == "cliff":
        assert session.target == solved[1] and lower.step_ms == 85.5
    else:
        assert session.target == solved[0] and lower.moved_bytes == 800 << 20
    assert session.lowerings_left == lowerings - 1
