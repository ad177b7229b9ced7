"""Helpers shared by mucudnn.torch's CPU tests of the session (test_offload_session.py,
test_session_plans.py, test_recorder.py, test_recipes.py, test_records.py, test_link.py
and the training-loop
tests): recording links, small models and the training loop they run, compared bitwise with a
plain run. Imported by plain name (pytest's prepend import mode)."""

import copy
import time

import torch
from torch import nn

from mucudnn.torch import planner
from mucudnn.torch.link import SameMemoryLink
from mucudnn.torch.offload_session import OffloadSession
from mucudnn.torch.planner import KEEP


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


def probed_groups(model, data):
    """The groups of one step of ``model`` on ``data``'s first batch under a session forcing
    recompute: each group's maker (``producer``) and, as its ``mode``, whether a recipe could
    rebuild it (the model's gradients are cleared after)."""
    probe = OffloadSession(force=planner.RECOMPUTE, link=SameMemoryLink(), min_bytes=0)
    x, y = data[0]
    with probe:
        nn.functional.cross_entropy(model(x), y).backward()
    model.zero_grad(set_to_none=True)
    return probe._step.groups


def steps_against_plain(model, data, modes, before=None, replay=True, momentum=0.9,
                        lean=True):
    """SGD steps of ``model`` under fixed ``modes`` and of a plain copy (``before(index, ours,
    theirs)`` first in each), each step's gradients and buffers equal bit for bit. Per step:
    (replayed, calls recorded, groups recomputed); and the session. ``replay``: the session's,
    ``lean``: its ``lean_steps`` (replay.py, rule 4)."""
    plain = copy.deepcopy(model)
    session = OffloadSession(modes=modes, link=SameMemoryLink(), min_bytes=0, replay=replay)
    session.lean_steps = lean
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=momentum)
                  for m in (model, plain)]
    seen = []
    for index, (x, y) in enumerate(data):
        if before is not None:
            before(index, model, plain)
        for optimizer in optimizers:
            optimizer.zero_grad()
        nn.functional.cross_entropy(plain(x), y).backward()
        with session:
            loss = nn.functional.cross_entropy(model(x), y)
            step = session._step
            seen.append((step.replays is not None, len(step.calls),
                         sum(g.mode == planner.RECOMPUTE for g in step.groups)))
            loss.backward()
        for ours, theirs in zip(model.parameters(), plain.parameters()):
            assert torch.equal(ours.grad, theirs.grad), index
        for ours, theirs in zip(model.buffers(), plain.buffers()):
            assert torch.equal(ours, theirs), index
        for optimizer in optimizers:
            optimizer.step()
    return seen, session


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


def volumes(dtype, steps):
    generator = torch.Generator().manual_seed(3)
    return [(torch.randn(2, 2, 6, 6, 6, generator=generator, dtype=dtype),
             torch.randint(0, 10, (2,), generator=generator)) for _ in range(steps)]


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


class SlowHostLink(RecordingLink):
    """Making a host tensor blocks the host thread (pinning fresh memory), ``WAIT_MS`` each: long
    against any small CNN's compute on a loaded machine, so that tests telling waits from
    compute hold however busy the machine is."""

    WAIT_MS = 200

    def _new_host(self, tensor):
        time.sleep(self.WAIT_MS / 1e3)
        return super()._new_host(tensor)


def split_steps(trace):
    """The trace's events per step (a step starts at its first pack)."""
    steps = []
    for event in trace:
        if event[0] == "pack" and event[1] == 0:
            steps.append([])
        steps[-1].append(event)
    return steps


def conv3x3(inplanes, planes, stride=1):
    return nn.Conv2d(inplanes, planes, 3, stride, padding=1, bias=False)


def conv1x1(inplanes, planes, stride=1):
    return nn.Conv2d(inplanes, planes, 1, stride, bias=False)
