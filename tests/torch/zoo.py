"""The model-zoo differential (issue 40: "build for any CNN, not for the table"): every model
torchvision builds for classification, video classification and semantic segmentation, at a
tiny input, trained a few SGD steps plainly and under each kind of mucudnn.torch session, its
losses, gradients, parameters and buffers compared bit for bit.

:func:`run_model` builds one model (seeded, ``num_classes`` small), trains it plainly, then under
each session of :data:`SESSIONS` from the same weights, data and random state:

- ``keep``, ``offload``, ``recompute``: every saved group forced to that mode where it can be;
- ``planned``: the modes a probe step finds (every group a recipe can rebuild recomputed, the
  rest kept), from the second step on a step recording only the modules its recipes ran;
- ``budget``: a budget half the step's saved bytes short of what it needs (:func:`budget_for`),
  over a link said to be slow, so that the plan mixes keeping, moving and recomputing: its first
  :data:`~mucudnn.torch.planner.RECORD_STEPS` steps record (every group offloaded), the next
  ones run the plan made inline after them (where none meets the budget: every group offloaded,
  the session ``unplanned``).

Each session's run must equal the plain run bit for bit (no session here stages: a stage sums
micro-batches), leave grad mode, the saved-tensor hooks, the global module hooks and the torch
function and dispatch modes as it found them, or stop with one line
(:class:`~mucudnn.errors.MucudnnError`). On a GPU (``cuda``) the plain loop runs twice under
deterministic cuDNN and cuBLAS with TF32 off, and a model whose plain runs differ is reported
``nondeterministic``, not compared (training_patterns.use_device's settings).

Run as a script (torchvision needed; on the device for ``cuda``)::

    python tests/torch/zoo.py cuda              # every model
    python tests/torch/zoo.py cpu resnet18 mobilenet_v3_small
"""

from __future__ import annotations

import copy
import sys
import time
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

import training_patterns as patterns
from mucudnn.errors import MucudnnError
from mucudnn.torch.offload_session import OffloadSession
from mucudnn.torch.planner import KEEP, OFFLOAD, RECOMPUTE

SESSIONS = ("keep", "offload", "recompute", "planned", "budget")
#: the budget session records its first RECORD_STEPS (2) and runs its plan in the third
STEPS = 3
BATCH = 2
CLASSES = 10
#: models whose parameters alone pass this are left out (tiny inputs, but their weights are
#: built and copied per session: ViT-H/14, RegNet-Y 128GF)
MOST_PARAMETERS = 150_000_000
#: input sizes by family: the smallest each family's architecture takes (inception: 75 px;
#: ViT: its patch size divides the side; video: 8 frames, of which S3D's pooling needs some)
IMAGE, VIDEO, SEGMENTATION = (3, 64, 64), (3, 8, 64, 64), (3, 64, 64)
#: builder keywords where torchvision's defaults need a larger input than the family's
KEYWORDS = {"inception_v3": {"aux_logits": False, "init_weights": True},
            "googlenet": {"aux_logits": False, "init_weights": True},
            "vit_b_16": {"image_size": 64}, "vit_b_32": {"image_size": 64},
            "vit_l_16": {"image_size": 64}, "vit_l_32": {"image_size": 64},
            "vit_h_14": {"image_size": 70}}
#: input sizes where a model needs another than its family's: MaxViT's partitions, S3D's and
#: MViT's pooling and positions; AlexNet's and VGG's classifiers pool to 6x6 and 7x7, which from
#: a smaller map is a backward of overlapping windows, nondeterministic on a GPU
SAMPLES = {"inception_v3": (3, 80, 80), "maxvit_t": (3, 224, 224), "s3d": (3, 16, 224, 224),
           "mvit_v1_b": (3, 16, 224, 224), "mvit_v2_s": (3, 16, 224, 224),
           "alexnet": (3, 224, 224), **{name: (3, 224, 224) for name in (
               "vgg11", "vgg11_bn", "vgg13", "vgg13_bn", "vgg16", "vgg16_bn", "vgg19",
               "vgg19_bn")}}


@dataclass
class Result:
    model: str
    verdict: str            # "equal", "differs", "refused", "failed", "skipped", ...
    detail: str = ""
    sessions: dict = field(default_factory=dict)   # session -> (verdict, detail)
    seconds: float = 0.0


def models() -> list[tuple[str, str]]:
    """(family, name) of every model torchvision builds for classification, video and
    semantic segmentation."""
    import torchvision.models as zoo
    return [("image", name) for name in zoo.list_models(module=zoo)] + \
        [("video", name) for name in zoo.list_models(module=zoo.video)] + \
        [("segmentation", name) for name in zoo.list_models(module=zoo.segmentation)]


def build(family: str, name: str) -> tuple[nn.Module, tuple]:
    import torchvision.models as zoo
    torch.manual_seed(0)
    keywords = dict(KEYWORDS.get(name, {}))
    if family == "segmentation":   # no backbone weights to download; the auxiliary head on
        keywords["weights_backbone"] = None
        if "lraspp" not in name:
            keywords["aux_loss"] = True
    model = zoo.get_model(name, weights=None, num_classes=CLASSES, **keywords)
    sample = SAMPLES.get(name) or {"image": IMAGE, "video": VIDEO,
                                   "segmentation": SEGMENTATION}[family]
    return model.to(patterns.DEVICE), sample


def data(family: str, sample: tuple) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(STEPS):
        x = torch.randn(BATCH, *sample, generator=generator)
        shape = (BATCH, *sample[1:]) if family == "segmentation" else (BATCH,)
        y = torch.randint(0, CLASSES, shape, generator=generator)
        batches.append((x.to(patterns.DEVICE), y.to(patterns.DEVICE)))
    return batches


def _outputs(output) -> list[torch.Tensor]:
    """The logits a model returns: a tensor, a named tuple of the main and auxiliary logits, a
    segmentation model's dict."""
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, dict):
        return [value for value in output.values() if isinstance(value, torch.Tensor)]
    return [value for value in output if isinstance(value, torch.Tensor)]


def train(model: nn.Module, batches, session=None) -> list[torch.Tensor]:
    """SGD with momentum, one step per batch, ``session`` entered around each forward and
    backward; what was observed, in order: each loss, then every gradient, parameter and
    buffer after the last step."""
    torch.manual_seed(2)   # dropout and stochastic depth draw the same in every run
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    seen = []
    model.train()
    for x, y in batches:
        optimizer.zero_grad(set_to_none=True)
        context = session if session is not None else patterns._nothing()
        with context:
            loss = loss_of(model(x), y)
            loss.backward()
        seen.append(loss.detach().clone())
        optimizer.step()
    for _, parameter in model.named_parameters():
        seen.append(None if parameter.grad is None else parameter.grad.detach().clone())
        seen.append(parameter.detach().clone())
    seen.extend(buffer.detach().clone() for buffer in model.buffers())
    return seen


def _difference(plain: list, ours: list) -> str:
    if len(plain) != len(ours):
        return f"{len(ours)} tensors observed against {len(plain)}"
    for index, (a, b) in enumerate(zip(plain, ours)):
        if (a is None) != (b is None) or a is not None and not torch.equal(a, b):
            what = "loss of step" if index < STEPS else "tensor"
            return f"{what} {index} differs" + (
                "" if a is None or b is None else
                f" (largest difference {(a.double() - b.double()).abs().max().item():.3g})")
    return ""


def saved_bytes(model: nn.Module, batch) -> int:
    x, y = batch
    return patterns.saved_bytes_of(model, lambda copied: loss_of(copied(x), y))


def loss_of(output, y) -> torch.Tensor:
    """The sum of the cross entropies of every logits ``output`` holds (:func:`_outputs`)."""
    return sum(F.cross_entropy(out.float(), y) for out in _outputs(output))


def probed_modes(model: nn.Module, batch) -> list:
    x, y = batch

    def forward_loss(copied):
        torch.manual_seed(2)   # as :func:`train` draws
        return loss_of(copied(x), y)
    return patterns.probed_modes_of(model, forward_loss)


def session_for(kind: str, model: nn.Module, batch) -> OffloadSession:
    if kind in patterns.FORCED:
        return OffloadSession(force=patterns.FORCED[kind], link=patterns._link(), min_bytes=0)
    if kind == "planned":
        return OffloadSession(modes=probed_modes(model, batch), link=patterns._link(),
                              min_bytes=0)
    return OffloadSession(budget=budget_for(model, batch), link=patterns._planning_link(),
                          min_bytes=0, headroom=0.0, strict=False, stage=False,
                          plan_in_background=False)


def budget_for(model: nn.Module, batch) -> int:
    """The budget session's: half the step's saved bytes fewer than it needs. On the CPU the
    session counts only the tensors it saves; on a GPU the caching allocator's bytes, so the
    budget is a plain step's peak allocated (parameters, gradients, momentum, the batch and
    every saved tensor) in a forward and backward, less half the saved bytes."""
    saved = saved_bytes(model, batch)
    if patterns.DEVICE.type == "cpu":
        return max(1, saved // 2)
    copied = copy.deepcopy(model)
    train(copied, batches=[batch])   # the gradients and momentum buffers, as in a later step
    x, y = batch
    torch.cuda.synchronize(patterns.DEVICE)
    torch.cuda.reset_peak_memory_stats(patterns.DEVICE)
    loss_of(copied(x), y).backward()   # the forward and backward a plan is made for (the
    peak = torch.cuda.max_memory_allocated(patterns.DEVICE)   # optimizer's own peak aside)
    del copied
    return max(1, peak - saved // 2)


def modes_run(session: OffloadSession) -> str:
    """The modes its last step ran its groups in, and the state of a budget's plan ("12 kept,
    3 offloaded, 40 recomputed; watching"): what the comparison covered."""
    groups = session._step.groups
    counts = [(sum(group.mode == mode for group in groups), word) for mode, word in
              ((KEEP, "kept"), (OFFLOAD, "offloaded"), (RECOMPUTE, "recomputed"))]
    said = ", ".join(f"{count} {word}" for count, word in counts if count) or "no group"
    return said if session.budget is None else f"{said}; {session.lifecycle.state}"


def run_model(family: str, name: str, sessions=SESSIONS) -> Result:
    start = time.monotonic()
    try:
        model, sample = build(family, name)
    except Exception as error:   # a builder that refuses the small sizes: not ours
        return Result(name, "skipped", f"not built: {type(error).__name__}: {error}")
    count = sum(p.numel() for p in model.parameters())
    if count > MOST_PARAMETERS:
        return Result(name, "skipped", f"{count / 1e6:.0f}M parameters")
    batches = data(family, sample)
    try:
        plain = train(copy.deepcopy(model), batches)
    except Exception as error:   # the plain loop fails at this size: nothing to compare
        return Result(name, "skipped", f"plain run: {type(error).__name__}: "
                                       f"{str(error).splitlines()[0][:120]}")
    if patterns.DEVICE.type != "cpu" and _difference(plain, train(copy.deepcopy(model),
                                                                  batches)):
        return Result(name, "nondeterministic", "the plain runs differ")
    result = Result(name, "equal")
    for kind in sessions:
        before = patterns._global_state()
        trained = copy.deepcopy(model)
        try:
            session = session_for(kind, trained, batches[0])
            ours = train(trained, batches, session)
            verdict, detail = ("differs", difference) if (difference := _difference(
                plain, ours)) else ("equal", modes_run(session))
        except MucudnnError as error:
            verdict, detail = "refused", str(error).splitlines()[0][:160]
        except Exception as error:
            verdict, detail = "failed", f"{type(error).__name__}: " \
                                        f"{str(error).splitlines()[0][:160]}"
        after = patterns._global_state()
        if after != before:
            patterns._put_back(before)
            verdict = "failed"
            detail = "state left behind: " + ", ".join(k for k in before
                                                       if before[k] != after[k])
        result.sessions[kind] = (verdict, detail)
    verdicts = {verdict for verdict, _ in result.sessions.values()}
    result.verdict = next((v for v in ("failed", "differs", "refused") if v in verdicts),
                          "equal")
    result.seconds = time.monotonic() - start
    return result


def main(argv) -> int:
    device = argv[1] if len(argv) > 1 else "cpu"
    patterns.use_device(device)
    wanted = set(argv[2:])
    chosen = [(family, name) for family, name in models() if not wanted or name in wanted]
    print(f"zoo: {len(chosen)} models on {device}, torch {torch.__version__}, sessions "
          f"{', '.join(SESSIONS)}, {STEPS} steps of batch {BATCH}", flush=True)
    bad = 0
    for family, name in chosen:
        result = run_model(family, name)
        cells = "; ".join(f"{kind} {verdict}" + (f" ({detail})" if detail else "")
                          for kind, (verdict, detail) in result.sessions.items())
        print(f"| {family} | {name} | {result.verdict} | {result.seconds:.1f} s | "
              f"{cells or result.detail} |", flush=True)
        bad += result.verdict in ("failed", "differs")
    print(f"zoo: {bad} of {len(chosen)} models failed or differed", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
