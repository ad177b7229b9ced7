"""The training-pattern differential (issue 37): seeded random small models and training loops,
each trained a few optimizer steps plainly and under one mucudnn.torch session, compared.

A case is a seed: :func:`make_case` draws the session (forced keep, offload or recompute, a stage,
a budget that forces a mixed plan, ``fit``), the dtype and a set of patterns (:data:`STRUCTURE`
of the model, :data:`LOOP` of the training loop); :func:`run_case` trains it twice and returns an
:class:`Outcome`. :func:`planned_case` and :func:`cached_case` run a seed's patterns under fixed
recomputing modes, or under the plan a first run of the case stored in a plan cache (the second
run, compared, loads it). The rule: every loss, gradient, buffer, parameter and observation of the
session's run equals the plain run's bit for bit (a stage session: within ``STAGE_RTOL`` of each
tensor's largest magnitude, float64: its parameter gradients are sums over micro-batches), and
both runs raise the same exception type at the same step; or the session's run stops with a
``MucudnnError`` of one line (a clear refusal). The hooks' observations of the step that raised
are not compared: PyTorch raises its in-place error in the backward at the node whose saved
tensor changed, after the nodes before it ran (a checkpoint's recomputation calls the module
hooks), and a session raises it where a recomputed group's recipe reads that tensor, which may
be an earlier node's unpack: the same error in the same step, fewer hooks run before it. After the session's run, grad mode, saved-tensor
hooks and global module hooks are as before it.

:func:`minimize` drops patterns of a failing case while it still fails: the patterns left name
the defect. Run as a script for a long run: ``python tests/torch/training_patterns.py CASES
[SEED [DEVICE [KIND]]]`` prints each failure, minimized (:func:`main`; DEVICE "cuda": the cases
on a GPU, :func:`use_device`).
"""

from __future__ import annotations

import copy
import dataclasses
import random
import sys
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.nn.modules.module as module_hooks
import torch.utils.checkpoint

import mucudnn.torch
from mucudnn.errors import MucudnnError
from mucudnn.torch.planner import KEEP, OFFLOAD, RECOMPUTE
from mucudnn.torch.link import CudaLink, SameMemoryLink
from mucudnn.torch.offload_session import OffloadSession

#: sessions a case runs under (``budget``: about half the step's saved bytes, a mixed plan)
SESSIONS = ("keep", "offload", "recompute", "stage", "budget", "fit")
#: a session no case draws, which :func:`planned_case` gives: fixed modes recomputing every group
#: a probe step could rebuild, so that from its second step on a step records only the modules
#: its recipes ran (recorder.py's ``recorded_modules``) under every pattern
PLANNED = "planned"
#: a session no case draws, which :func:`cached_case` gives: a budget's plan stored by a first
#: run in a plan cache (staged in even seeds), the run compared being the second, which loads it
#: and runs it from its first step
CACHED = "cached"
#: model patterns: each adds a block (or changes the stem) where drawn
STRUCTURE = ("residual", "dense", "batchnorm", "groupnorm", "layernorm", "dropout", "inplace",
             "shared", "custom_function", "module_hook", "global_hook", "checkpoint", "rrelu",
             "repeated_pool", "frozen", "reentrant", "spectral_norm", "tied_weight", "updown",
             "instancenorm", "tensor_hook")
#: loop patterns
LOOP = ("functional_call", "eval_train", "eval_backward", "skip_backward", "create_graph",
        "exception", "interrupt", "resize", "ema", "accumulate", "autocast", "channels_last",
        "backward_inside", "version_error", "retain_graph", "no_grad_eval", "input_grad",
        "transposed_input", "reload")
#: a stage session's tolerance, relative to each tensor's largest magnitude (float64)
STAGE_RTOL = 1e-12
CLASSES = 5
#: where the cases' models and data live (:func:`use_device`): the CPU, or a GPU, where every
#: session runs on the real host link (:class:`~mucudnn.torch.link.CudaLink`: pinned host memory,
#: copy streams, prefetches)
DEVICE = torch.device("cpu")


def use_device(device) -> None:
    """The cases from now on on ``device`` ("cpu", "cuda"). On a GPU, cuDNN and cuBLAS are made
    deterministic (a nondeterministic kernel would differ between the plain run and the
    session's by itself), and :func:`run_case` runs the plain loop twice: a case whose plain runs
    differ is "nondeterministic", not compared."""
    global DEVICE
    DEVICE = torch.device(device)
    settings = (torch.backends.cudnn, "deterministic"), (torch.backends.cudnn, "benchmark"), \
        (torch.backends.cudnn, "allow_tf32"), (torch.backends.cuda.matmul, "allow_tf32")
    if DEVICE.type == "cuda":
        _SET_ASIDE.extend((where, name, getattr(where, name)) for where, name in settings)
        for (where, name), value in zip(settings, (True, False, False, False)):
            setattr(where, name, value)
    else:   # the settings a GPU run changed, as they were
        while _SET_ASIDE:
            where, name, value = _SET_ASIDE.pop()
            setattr(where, name, value)


#: (object, attribute, value before) that :func:`use_device` changed for a GPU
_SET_ASIDE: list = []


def _link():
    """The host link of a forced or planned session: the CPU's, or on a GPU the default one."""
    return SameMemoryLink() if DEVICE.type == "cpu" else None


def _planning_link():
    """The host link of a session that plans: one slow back (1 MB/s), so that the planner must
    choose between moves, recomputation and keeping; on a GPU the real one (copy streams, pinned
    memory, prefetches) said to be that slow."""
    from session_helpers import RecordingLink
    if DEVICE.type == "cpu":
        return RecordingLink()
    link = CudaLink(DEVICE)
    link.gbps = RecordingLink().gbps
    return link


@dataclass(frozen=True)
class Case:
    seed: int
    session: str
    dtype: str
    patterns: frozenset
    steps: int

    @property
    def label(self) -> str:
        return f"{self.seed}-{self.session}-{self.dtype}-" + "+".join(sorted(self.patterns))

    def has(self, pattern: str) -> bool:
        return pattern in self.patterns


@dataclass
class Outcome:
    """``verdict``: "equal", "refused" (a one-line MucudnnError), "nondeterministic" (on a GPU:
    the plain runs differ, nothing compared) or "failed"; ``detail``: why."""

    case: Case
    verdict: str
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.verdict != "failed"


def make_case(seed: int) -> Case:
    rng = random.Random(seed)
    session = rng.choice(SESSIONS)
    patterns = {p for p in STRUCTURE + LOOP if rng.random() < 0.22}
    if "version_error" in patterns and rng.random() < 0.7:   # it ends the run: seldom
        patterns.discard("version_error")
    # float64 where a stage may run (its sums are compared to rounding)
    dtype = "float64" if session in ("stage", "budget", "fit") or rng.random() < 0.5 \
        else "float32"
    if "autocast" in patterns:
        if session == "stage":
            patterns.discard("autocast")
        else:
            dtype = "float32"
    return Case(seed, session, dtype, frozenset(patterns), rng.choice((4, 5)))


def planned_case(seed: int) -> Case:
    """:func:`make_case`'s patterns of ``seed`` under the :data:`PLANNED` session, in float64
    and over 5 steps (the more steps run recording only the learnt modules)."""
    case = make_case(seed)
    return dataclasses.replace(case, session=PLANNED, dtype="float32" if case.has("autocast")
                               else "float64", steps=5)


def cached_case(seed: int) -> Case:
    """:func:`make_case`'s patterns of ``seed`` under the :data:`CACHED` session, in float64 (a
    stage's sums are compared to rounding) and over 5 steps."""
    case = make_case(seed)
    return dataclasses.replace(case, session=CACHED, dtype="float32" if case.has("autocast")
                               else "float64", steps=5)


def _rng(case: Case, what: str) -> random.Random:
    """One stream per decision: dropping a pattern leaves the others' draws as they were."""
    return random.Random(f"{case.seed}/{what}")


# --- the model -------------------------------------------------------------------------------
class PatternError(Exception):
    """What a :class:`Raiser` raises on purpose; the loop catches it and goes on."""


class Raiser(nn.Module):
    """Raises ``error`` while ``armed`` (an exception mid-forward)."""

    def __init__(self):
        super().__init__()
        self.armed: type | None = None

    def forward(self, x):
        if self.armed is not None:
            raise self.armed("raised mid-forward on purpose")
        return x


class TanhGate(torch.autograd.Function):
    """x * tanh(x) * w, a custom Function saving its input, an intermediate and a parameter."""

    @staticmethod
    def forward(ctx, x, w):
        t = torch.tanh(x)
        ctx.save_for_backward(x, t, w)
        return x * t * w

    @staticmethod
    def backward(ctx, grad):
        x, t, w = ctx.saved_tensors
        dx = grad * w * (t + x * (1 - t * t))
        dw = (grad * x * t).sum(dim=(0, 2, 3), keepdim=True)
        return dx, dw


class Gate(nn.Module):
    def __init__(self, channels):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(1, channels, 1, 1) * 0.9)

    def forward(self, x):
        return TanhGate.apply(x, self.weight)


class ChannelLayerNorm(nn.Module):
    """LayerNorm over channels (a ConvNeXt's): any resolution."""

    def __init__(self, channels):
        super().__init__()
        self.norm = nn.LayerNorm(channels)

    def forward(self, x):
        return self.norm(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


def _act(rng: random.Random, inplace: bool, rrelu: bool = False) -> nn.Module:
    if rrelu:
        return nn.RReLU()
    kind = rng.choice(("relu", "silu", "leaky", "tanh"))
    if kind == "relu":
        return nn.ReLU(inplace=inplace)
    if kind == "silu":
        return nn.SiLU(inplace=inplace)
    if kind == "leaky":
        return nn.LeakyReLU(0.1, inplace=inplace)
    return nn.Tanh()


#: batch and instance norms' variants (a case draws one of each)
NORM_VARIANTS = {"batchnorm": ({}, {"momentum": None}, {"track_running_stats": False},
                               {"affine": False}),
                 "instancenorm": ({"affine": True}, {"track_running_stats": True})}


def _norm(kind: str | None, channels: int) -> nn.Module:
    if kind and kind.startswith("batchnorm"):
        return nn.BatchNorm2d(channels, **NORM_VARIANTS["batchnorm"][int(kind[-1])])
    if kind and kind.startswith("instancenorm"):
        return nn.InstanceNorm2d(channels, **NORM_VARIANTS["instancenorm"][int(kind[-1])])
    if kind == "groupnorm":
        return nn.GroupNorm(2, channels)
    if kind == "layernorm":
        return ChannelLayerNorm(channels)
    return nn.Identity()


class Residual(nn.Module):
    def __init__(self, channels, norm, rng, inplace):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.norm1, self.act1 = _norm(norm, channels), _act(rng, inplace)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.norm2, self.act2 = _norm(norm, channels), _act(rng, inplace)
        self.add_in_place = rng.random() < 0.5    # ResNet's ``out += identity``

    def forward(self, x):
        out = self.norm2(self.conv2(self.act1(self.norm1(self.conv1(x)))))
        if self.add_in_place:
            out += x
        else:
            out = out + x
        return self.act2(out)


class Dense(nn.Module):
    """DenseNet's join: the input beside a convolution of it, reduced back by a 1x1."""

    def __init__(self, channels, norm, rng, inplace):
        super().__init__()
        # not in place: the input is also joined (PyTorch refuses a backward through that)
        self.grow = nn.Sequential(_norm(norm, channels), _act(rng, False),
                                  nn.Conv2d(channels, channels, 3, padding=1))
        self.reduce = nn.Conv2d(2 * channels, channels, 1)

    def forward(self, x):
        return self.reduce(torch.cat([x, self.grow(x)], 1))


class Shared(nn.Module):
    """One convolution used twice."""

    def __init__(self, channels, rng, inplace):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)
        self.act = _act(rng, inplace)

    def forward(self, x):
        return self.conv(self.act(self.conv(x)))


class UpDown(nn.Module):
    """A U-Net level: down by a strided convolution, up by a transposed one to the input's size
    (odd sizes need ``output_size``), joined with the input."""

    def __init__(self, channels, rng):
        super().__init__()
        self.down = nn.Conv2d(channels, channels, 3, stride=2, padding=1)
        self.act = _act(rng, False)
        self.up = nn.ConvTranspose2d(channels, channels, 3, stride=2, padding=1)
        self.merge = nn.Conv2d(2 * channels, channels, 1)

    def forward(self, x):
        up = self.up(self.act(self.down(x)), output_size=x.shape[-2:])
        return self.merge(torch.cat([x, up], 1))


class Checkpointed(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.inner, x, use_reentrant=False)


class Net(nn.Module):
    def __init__(self, stem: nn.Sequential, blocks: list[nn.Module], channels: int):
        super().__init__()
        self.stem = stem
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(channels, CLASSES)
        #: a siamese forward: the model called on the input and its mirror image (through
        #: ``self(...)``: a fitted model's forward entered again inside its own)
        self.siamese = False
        self._inside = False
        self.tensor_hook = False   # the stem output's gradient halved by a tensor hook

    def forward(self, x):
        if self.siamese and not self._inside:
            self._inside = True
            try:
                return self(x) + self(x.flip(-1))
            finally:
                self._inside = False
        x = self.stem(x)
        if self.tensor_hook and x.requires_grad:
            x.register_hook(lambda grad: grad * 0.5)
        for block in self.blocks:
            x = block(x)
        return self.head(F.adaptive_avg_pool2d(x, 1).flatten(1))


def build_model(case: Case) -> tuple[Net, dict]:
    """The case's model (weights from its seed) and its parts the loop drives (``raiser``,
    ``hooked``: the module whose hooks log)."""
    torch.manual_seed(case.seed)
    rng = _rng(case, "model")
    c = 4
    inplace = case.has("inplace")
    # the stem: a plain Sequential of per-sample layers ending at a pooling layer (stage.py's
    # leading chain); its first layer never in place (the staged input is saved)
    pool = nn.MaxPool2d(2) if rng.random() < 0.5 else nn.AvgPool2d(2)
    stem = [nn.Conv2d(3, c, 3, padding=1), nn.ReLU(inplace=inplace),
            nn.Conv2d(c, c, 3, padding=1), nn.ReLU(), pool]
    if case.has("repeated_pool"):   # one pooling object listed twice
        stem += [nn.Conv2d(c, c, 3, padding=1), pool]
    blocks, parts = [], {}
    norms = [n for n in ("batchnorm", "groupnorm", "layernorm", "instancenorm")
             if case.has(n)] or [None]
    norms = [f"{n}{_rng(case, n).randrange(len(NORM_VARIANTS[n]))}" if n in NORM_VARIANTS
             else n for n in norms]
    blocks.append(nn.Sequential(nn.Conv2d(c, c, 3, padding=1), _norm(norms[0], c),
                                _act(rng, inplace, case.has("rrelu"))))
    for norm in norms[1:]:
        blocks.append(nn.Sequential(nn.Conv2d(c, c, 3, padding=1), _norm(norm, c),
                                    _act(rng, inplace)))
    if case.has("residual"):
        blocks.append(Residual(c, rng.choice(norms), rng, inplace))
    if case.has("dense"):
        blocks.append(Dense(c, rng.choice(norms), rng, inplace))
    if case.has("dropout"):
        blocks.append(nn.Dropout(0.3) if rng.random() < 0.5 else nn.Dropout2d(0.3))
    if case.has("custom_function"):
        blocks.append(Gate(c))
    if case.has("shared"):
        shared = Shared(c, rng, inplace)
        blocks.append(shared)
        twice = rng.random() < 0.5
        # and the same block twice in the model (not under functional_call: PyTorch leaves a
        # block reached by two paths with the call's tensors as its parameters)
        if twice and not case.has("functional_call"):
            blocks.append(nn.Sequential(nn.Conv2d(c, c, 1), nn.ReLU()))
            blocks.append(shared)
    if case.has("updown"):
        blocks.append(UpDown(c, rng))
    if case.has("tied_weight"):   # a convolution sharing the stem's weight (not its bias)
        tied = nn.Conv2d(c, c, 3, padding=1)
        tied.weight = stem[2].weight
        blocks.append(nn.Sequential(tied, nn.ReLU()))
    if case.has("spectral_norm"):   # a parametrized weight, its power iteration per forward
        torch.nn.utils.parametrizations.spectral_norm(blocks[0][0])
    if case.has("checkpoint"):
        blocks.append(Checkpointed(nn.Sequential(nn.Conv2d(c, c, 3, padding=1),
                                                 _norm(rng.choice(norms), c), _act(rng, False))))
    if case.has("exception") or case.has("interrupt"):
        parts["raiser"] = Raiser()
        blocks.insert(rng.randrange(len(blocks) + 1), parts["raiser"])
    if case.has("module_hook"):
        parts["hooked"] = rng.choice([b for b in blocks if not isinstance(b, Raiser)])
    model = Net(nn.Sequential(*stem), blocks, c)
    model.siamese = case.has("reentrant")
    model.tensor_hook = case.has("tensor_hook")
    if case.has("frozen"):   # fine-tuning: the first layer's parameters need no gradient
        model.stem[0].requires_grad_(False)
    model.to(DEVICE, getattr(torch, case.dtype))
    if case.has("channels_last"):
        model.to(memory_format=torch.channels_last)
    return model, parts


# --- the loop --------------------------------------------------------------------------------
def make_data(case: Case) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Per step, its micro-batches (two where accumulating)."""
    generator = torch.Generator().manual_seed(case.seed)
    rng = _rng(case, "data")
    dtype = getattr(torch, case.dtype)
    steps = []
    for _ in range(case.steps):
        batch, size = 4, 8
        if case.has("resize"):
            batch, size = rng.choice((2, 3, 4)), rng.choice((8, 10, 12))
        micro = []
        for _ in range(2 if case.has("accumulate") else 1):
            x = torch.randn(batch, 3, size, size, generator=generator, dtype=dtype).to(DEVICE)
            if case.has("channels_last"):
                x = x.contiguous(memory_format=torch.channels_last)
            if case.has("transposed_input"):   # a strided view, neither layout
                x = x.transpose(-1, -2)
            micro.append((x, torch.randint(0, CLASSES, (batch,), generator=generator)
                          .to(DEVICE)))
        steps.append(micro)
    return steps


@dataclass
class Run:
    """What a run observed: tensors in order (compared), and how it ended."""

    tensors: list = dataclasses.field(default_factory=list)
    names: list = dataclasses.field(default_factory=list)
    error: BaseException | None = None
    error_step: int | None = None
    staged: bool = False   # a stage was in force in some step (sums compared to rounding)

    def add(self, name: str, tensor: torch.Tensor | None) -> None:
        self.names.append(name)
        self.tensors.append(None if tensor is None else tensor.detach().clone())


def train(case: Case, model: nn.Module, parts: dict, session=None) -> Run:
    """The case's loop: SGD with momentum, ``case.steps`` steps. ``session``: an OffloadSession
    entered around each forward (around the backward too with ``backward_inside``), or None
    (plain, or a fitted model)."""
    run, data = Run(), make_data(case)
    rng = _rng(case, "loop")
    special = {p: rng.randrange(1, case.steps) for p in
               ("skip_backward", "exception", "interrupt", "eval_backward", "ema", "reload",
                "unfreeze")}
    # a forward that raises at its stem's second convolution (inside a staged chain), else at
    # the Raiser block
    interrupt_in_stem = rng.random() < 0.5
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    handles, log = [], []
    if "hooked" in parts:
        def logs_and_scales(module, args, out):
            log.append(out.detach().double().sum())
            return out * 0.9
        handles.append(parts["hooked"].register_forward_hook(logs_and_scales))
    calls = [0]
    if case.has("global_hook"):
        handles.append(module_hooks.register_module_forward_hook(
            lambda module, args, out: calls.__setitem__(0, calls[0] + 1)))
    stem_conv = model.stem[2]

    def raise_in_stem(module, args):
        if module is stem_conv:
            raise KeyboardInterrupt

    ema = None

    def forward(x):
        if case.has("functional_call"):
            # SAM-like perturbed weights: the gradient reaches the registered parameters
            noise = {n: p + 0.01 * torch.randn_like(p) for n, p in model.named_parameters()}
            return torch.func.functional_call(model, noise, (x,))
        return model(x)

    def losses(x, y):
        out = forward(x)
        loss = F.cross_entropy(out.float(), y)
        if case.has("eval_train"):   # a consistency loss: an eval-mode forward with grad
            model.eval()
            try:
                other = forward(x)
            finally:
                model.train()
            loss = loss + F.mse_loss(out.float(), other.float())
        return loss

    autocast = torch.autocast(DEVICE.type, dtype=torch.bfloat16, enabled=case.has("autocast"))
    before_step = (0, 0)   # the global hook's calls and the hook log's length at a step's start
    try:
        for step, micro in enumerate(data):
            run.error_step = step
            before_step = (calls[0], len(log))
            torch.manual_seed(case.seed * 1000 + step)
            optimizer.zero_grad()
            for index, (x, y) in enumerate(micro):
                penalty = case.has("create_graph") and index == 0
                if penalty or case.has("input_grad"):
                    x = x.clone().requires_grad_()
                raiser = parts.get("raiser")
                hook = None
                if case.has("exception") and step == special["exception"]:
                    raiser.armed = PatternError
                if case.has("interrupt") and step == special["interrupt"]:
                    if interrupt_in_stem:
                        hook = module_hooks.register_module_forward_pre_hook(raise_in_stem)
                    else:
                        raiser.armed = KeyboardInterrupt
                version_error = case.has("version_error") and step == case.steps - 1
                try:
                    with (session if session is not None else _nothing()), autocast:
                        loss = losses(x, y)
                        if version_error:   # a saved weight changed: PyTorch refuses
                            with torch.no_grad():   # the backward (GAN's D stepped too early)
                                stem_conv.weight.mul_(1.0)
                        if penalty:
                            grad, = torch.autograd.grad(loss, x, create_graph=True)
                            loss = loss + grad.pow(2).sum()
                        if case.has("backward_inside"):
                            _backward(case, model, loss, step, special)
                except (PatternError, KeyboardInterrupt) as error:
                    run.add(f"step {step}: raised {type(error).__name__}", None)
                    continue
                finally:
                    if raiser is not None:
                        raiser.armed = None
                    if hook is not None:
                        hook.remove()
                run.add(f"step {step} micro {index} loss", loss)
                if case.has("skip_backward") and step == special["skip_backward"]:
                    del loss      # a forward whose backward never runs
                    continue
                if not case.has("backward_inside"):
                    _backward(case, model, loss, step, special)
                if x.requires_grad:
                    run.add(f"step {step} micro {index} input grad", x.grad)
            watched = session or getattr(model, "mucudnn_session", None)
            # a stage in force now, or a staged forward run in the step (a cached plan's stage
            # runs at the step's first module, and a group found unlike the cached plan's drops
            # it later in that step: the step recorded anew)
            run.staged |= getattr(watched, "stage", None) is not None or \
                getattr(watched, "staged_forwards", 0) > 0
            for name, p in model.named_parameters():
                run.add(f"step {step} grad {name}", p.grad)
            optimizer.step()
            if case.has("no_grad_eval"):   # validation under no_grad, in the session
                model.eval()
                try:
                    with torch.no_grad(), (session or _nothing()), autocast:
                        run.add(f"step {step} validation", forward(data[0][0][0]))
                finally:
                    model.train()
            for name, b in model.named_buffers():
                run.add(f"step {step} buffer {name}", b)
            if case.has("reload") and step == special["reload"]:   # a checkpoint restored
                model.load_state_dict(copy.deepcopy(model.state_dict()))
            if case.has("frozen") and step == special["unfreeze"]:   # fine-tuning unfreezes
                model.stem[0].requires_grad_(True)
            if case.has("ema"):
                if step == special["ema"]:
                    ema = copy.deepcopy(model)
                elif ema is not None:
                    with torch.no_grad():
                        for e, p in zip(ema.parameters(), model.parameters()):
                            e.lerp_(p, 0.5)
                    ema.eval()
                    with torch.no_grad(), autocast:
                        run.add(f"step {step} ema output", ema(data[0][0][0]))
                    ema.train()
        run.error_step = None
    except BaseException as error:   # noqa: B036 - compared with the other run's
        run.error = error
    finally:
        for handle in handles:
            handle.remove()
    for name, p in model.named_parameters():
        run.add(f"final {name}", p)
    if run.error is not None:   # the step that raised is compared by its error alone
        calls[0], log[before_step[1]:] = before_step[0], []
    run.add("hook log", torch.stack(log) if log else None)
    run.add("global hook calls", torch.tensor(calls[0]))
    return run


def _backward(case, model, loss, step, special):
    if case.has("eval_backward") and step == special["eval_backward"]:
        model.eval()      # model.eval() before backward (a logging habit)
        try:
            loss.backward()
        finally:
            model.train()
    elif case.has("retain_graph"):   # two backwards through one graph (gradients summed)
        loss.backward(retain_graph=True)
        loss.backward()
    else:
        loss.backward()


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# --- sessions and the comparison -------------------------------------------------------------
def saved_bytes(case: Case, model: nn.Module) -> int:
    """What the case's first step saves (parameters aside): the budget sessions' scale."""
    x, y = make_data(case)[0][0]
    return saved_bytes_of(model, lambda copied: F.cross_entropy(copied(x).float(), y))


def saved_bytes_of(model: nn.Module, forward_loss) -> int:
    """What ``forward_loss`` (called with a copy of ``model``) saves for its backward, the
    parameters aside."""
    model = copy.deepcopy(model)
    params = {id(p) for p in model.parameters()}
    total = [0]

    def pack(tensor):
        if id(tensor) not in params:
            total[0] += tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward_loss(model)
    return total[0]


def probed_modes(case: Case, model: nn.Module) -> list:
    """Per group of a probe step (a copy of ``model``, the first batch, every group a recipe
    can rebuild recomputed), its mode there: recomputed, or kept."""
    x, y = make_data(case)[0][0]
    return probed_modes_of(model, lambda copied: F.cross_entropy(copied(x).float(), y))


def probed_modes_of(model: nn.Module, forward_loss) -> list:
    """Per group that ``forward_loss`` (called with a copy of ``model``) saves, under a session
    recomputing every group a recipe can rebuild, its mode there: recomputed, or kept."""
    probe = OffloadSession(force=RECOMPUTE, link=SameMemoryLink(), min_bytes=0)
    with probe:
        loss = forward_loss(copy.deepcopy(model))
    loss.backward()
    return [RECOMPUTE if group.mode == RECOMPUTE else KEEP for group in probe._step.groups]


#: the forced sessions' modes, by their name
FORCED = {"keep": KEEP, "offload": OFFLOAD, "recompute": RECOMPUTE}


def make_session(case: Case, model: nn.Module, cache=None):
    """(model to train, session to enter per step or None); ``cache``: the plan cache's
    directory of a :data:`CACHED` session."""
    if case.session in FORCED:
        return model, OffloadSession(force=FORCED[case.session], link=_link(), min_bytes=0)
    if case.session == "stage":
        return model, OffloadSession(budget=2**50, link=_planning_link(), min_bytes=0,
                                     stage="always")
    if case.session == PLANNED:
        return model, OffloadSession(modes=probed_modes(case, model), link=_link(),
                                     min_bytes=0)
    budget = max(1, int(saved_bytes(case, model) * 0.5))
    # a plan may stage where it fits better: float64 only (bf16 autocast's sums are coarser)
    options = dict(link=_planning_link(), min_bytes=0, headroom=0.0, strict=False,
                   stage=case.dtype == "float64")
    if case.session == CACHED:
        from mucudnn.torch.plancache import PlanCache
        if case.dtype == "float64" and case.seed % 2 == 0:
            options["stage"] = "always"
        return model, OffloadSession(budget=budget, plan_cache=PlanCache(cache), **options)
    if case.session == "budget":
        return model, OffloadSession(budget=budget, **options)
    return mucudnn.torch.fit(model, budget=budget, **options), None


def _global_state() -> dict:
    """What a session changes while entered and must put back at its end."""
    return {"grad mode": torch.is_grad_enabled(),
            "saved-tensor hooks": torch._C._autograd._top_saved_tensors_default_hooks(False),
            "global forward hooks": set(module_hooks._global_forward_hooks),
            "global forward pre-hooks": set(module_hooks._global_forward_pre_hooks),
            "torch function modes": torch._C._len_torch_function_stack(),
            "torch dispatch modes": torch._C._len_torch_dispatch_stack(),
            "autocast": torch.is_autocast_enabled(DEVICE.type)}


def _put_back(before: dict) -> None:
    """Undoes what a session left behind, so that the next case (its plain run too) starts
    clean: the case that left it fails, the next ones do not."""
    torch.set_grad_enabled(before["grad mode"])
    while torch._C._autograd._top_saved_tensors_default_hooks(False) != \
            before["saved-tensor hooks"]:
        torch._C._autograd._pop_saved_tensors_default_hooks()
    for hooks, kind in ((module_hooks._global_forward_hooks, "global forward hooks"),
                        (module_hooks._global_forward_pre_hooks, "global forward pre-hooks")):
        for key in set(hooks) - before[kind]:
            del hooks[key]
    while torch._C._len_torch_function_stack() > before["torch function modes"]:
        torch._C._pop_torch_function_stack()
    while torch._C._len_torch_dispatch_stack() > before["torch dispatch modes"]:
        torch._C._pop_torch_dispatch_stack()
    torch.set_autocast_enabled(DEVICE.type, before["autocast"])


def run_case(case: Case) -> Outcome:
    model, parts = build_model(case)
    plain_model = copy.deepcopy(model)
    plain_parts = _same_parts(model, plain_model, parts)
    plain = train(case, plain_model, plain_parts)
    if DEVICE.type != "cpu":   # a GPU: only a loop that is deterministic plainly is compared
        again = copy.deepcopy(model)
        if compare(case, plain, train(case, again, _same_parts(model, again, parts))
                   ).verdict != "equal":
            return Outcome(case, "nondeterministic", "the plain runs differ")
    before = _global_state()
    cache = None
    try:
        if case.session == CACHED:   # a first run stores its plan; the second is compared
            import tempfile
            cache = tempfile.TemporaryDirectory()
            first_model = copy.deepcopy(model)
            first_session = make_session(case, first_model, cache.name)[1]
            train(case, first_model, _same_parts(model, first_model, parts), first_session)
        trained, session = make_session(case, model) if cache is None else \
            make_session(case, model, cache.name)
        ours = train(case, trained, parts, session)
    except MucudnnError as error:   # a refusal while making the session
        ours = Run(error=error)
    finally:
        if cache is not None:
            cache.cleanup()
    after = _global_state()
    if after != before:
        _put_back(before)
        left = ", ".join(kind for kind in before if before[kind] != after[kind])
        return Outcome(case, "failed", f"state left behind: {left}")
    return compare(case, plain, ours)


def _same_parts(model, other, parts):
    """``parts`` of ``model`` as the same modules of ``other`` (its deep copy)."""
    where = {id(m): name for name, m in model.named_modules()}
    found = dict(other.named_modules())
    return {key: found[where[id(m)]] for key, m in parts.items()}


def compare(case: Case, plain: Run, ours: Run) -> Outcome:
    # PyTorch's own error (its in-place check) is raised as an error of its type, which a
    # MucudnnError may also be
    same_error = plain.error_step == ours.error_step and (
        isinstance(ours.error, type(plain.error)) if plain.error is not None
        else ours.error is None)
    if not same_error and isinstance(ours.error, MucudnnError):
        text = str(ours.error)
        if "\n" in text.strip():
            return Outcome(case, "failed", f"a refusal of more than one line: {text!r}")
        return Outcome(case, "refused", f"{type(ours.error).__name__}: {text}")
    if not same_error:
        return Outcome(case, "failed", f"plain raised {_said(plain.error)} at step "
                                       f"{plain.error_step}; the session {_said(ours.error)} "
                                       f"at step {ours.error_step}")
    if plain.names != ours.names:
        return Outcome(case, "failed", f"observations differ: {len(plain.names)} vs "
                                       f"{len(ours.names)}; first differing: "
                                       f"{_first_difference(plain.names, ours.names)}")
    # staged sums are compared to rounding relative to the largest tensor of their kind in
    # their step: a gradient that is rounding noise itself (a bias before a batch norm) too
    scales: dict = {}
    for name, a in zip(plain.names, plain.tensors):
        if a is not None and a.is_floating_point() and a.numel():
            scales[_kind(name)] = max(scales.get(_kind(name), 0.0), a.abs().max().item())
    for name, a, b in zip(plain.names, plain.tensors, ours.tensors):
        why = _differs(scales.get(_kind(name), 0.0) if ours.staged else None, a, b)
        if why:
            return Outcome(case, "failed", f"{name}: {why}")
    return Outcome(case, "equal")


def _said(error):
    return "nothing" if error is None else f"{type(error).__name__}({str(error)[:160]!r})"


def _first_difference(a, b):
    for x, y in zip(a, b):
        if x != y:
            return f"{x!r} vs {y!r}"
    return f"{(a + b)[min(len(a), len(b))]!r} in one only"


def _kind(name: str) -> str:
    """The kind of a named tensor: "step 3 grad" of "step 3 grad head.weight"."""
    return name.rsplit(" ", 1)[0]


def _differs(scale: float | None, a, b) -> str:
    """Why ``b`` is not ``a``: bit for bit, or with ``scale`` (staged) within
    ``STAGE_RTOL * scale``."""
    if a is None or b is None:
        return "" if a is None and b is None else f"None in one run ({a is None}, {b is None})"
    if a.dtype != b.dtype or a.shape != b.shape:
        return f"{a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
    if torch.equal(a, b) or (a.is_floating_point() and torch.equal(a.isnan(), b.isnan())
                             and torch.equal(a.nan_to_num(), b.nan_to_num())):
        return ""
    if scale is not None and a.is_floating_point():
        scale = max(scale, 1e-300)
        error = (a - b).abs().max().item()
        if error <= STAGE_RTOL * scale:
            return ""
        return f"relative error {error / scale:.3g} > {STAGE_RTOL} (staged)"
    if a.is_floating_point():
        scale = max(a.abs().max().item(), 1e-300)
        return f"not bitwise: relative error {(a - b).abs().max().item() / scale:.3g}"
    return "not equal"


def minimize(case: Case) -> Case:
    """``case`` with patterns dropped while it still fails (each tried once, greedily)."""
    for pattern in sorted(case.patterns):
        smaller = dataclasses.replace(case, patterns=case.patterns - {pattern})
        if _valid(smaller) and not run_case(smaller).ok:
            case = smaller
    return case


def _valid(case: Case) -> bool:
    return not (case.has("autocast") and case.dtype != "float32")


#: the kinds of case :func:`main` runs: drawn (:func:`make_case`), or a seed's patterns under
#: fixed recomputing modes or a cached plan
KINDS = {"drawn": make_case, "planned": planned_case, "cached": cached_case}


def main(argv):
    """``CASES [SEED [DEVICE [KIND]]]``: DEVICE "cpu" (the default) or "cuda", KIND of
    :data:`KINDS` ("drawn", the default)."""
    cases, seed = int(argv[1]) if len(argv) > 1 else 300, int(argv[2]) if len(argv) > 2 else 0
    use_device(argv[3] if len(argv) > 3 else "cpu")
    kind = KINDS[argv[4] if len(argv) > 4 else "drawn"]
    torch.set_num_threads(1)   # tiny tensors: one thread is several times faster
    failures, verdicts = 0, {}
    for s in range(seed, seed + cases):
        outcome = run_case(kind(s))
        verdicts[outcome.verdict] = verdicts.get(outcome.verdict, 0) + 1
        if not outcome.ok:
            failures += 1
            small = minimize(outcome.case)
            print(f"FAIL {outcome.case.label}\n  minimal {small.label}: "
                  f"{run_case(small).detail}\n  {outcome.detail}", flush=True)
    print(f"{failures} of {cases} cases failed ({DEVICE}; "
          + ", ".join(f"{count} {verdict}" for verdict, count in sorted(verdicts.items())) + ")")


if __name__ == "__main__":
    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    main(sys.argv)
