"""Issue 39 item 6 / issue 40: the offload session's host (Python) overhead per planned step, on
the CPU.

With tiny tensors on the CPU a step's time is the host's: Python and PyTorch's dispatch. This
times the forward (with the loss) and the backward of a ResNet of torchvision's structure
(bottleneck blocks; the default ``--layers 3 8 36 3`` has ResNet-152's modules: 50 blocks, 465
leaf modules) in three configurations of one process, each on its own copy of the same model:

- ``pytorch``: PyTorch alone;
- ``mixed``: an :class:`~mucudnn.torch.offload_session.OffloadSession` running a fixed plan
  (``modes=``) that keeps some saved tensors and recomputes the others: every group that a probe
  step (``force="recompute"``) could recompute and that a cheap module made (batch norm, ReLU,
  pooling, through the residual add), the convolutions' outputs kept, like the GPU's plans;
- ``kept``: a session whose plan keeps every saved tensor (its hooks' cost alone);
- ``hooks`` and ``hooks-mode`` (only where ``--configs`` names them): the hook mechanism the
  session is built on, doing nothing (:class:`_Mechanism`): the floor under any session made of
  the same hooks;
- ``mixed-recorded`` (only where named): ``mixed`` without replay (its steady steps record their
  recipes' calls, as before mucudnn/torch/replay.py);
- ``mixed-whole`` (only where named): ``mixed`` replaying without the module hooks' short path
  (replay.py, rule 4: ``lean_steps`` off).

The session is entered once around a round's steps, forward, backward and optimizer, as
``mucudnn run --offload`` enters it for the whole process. Rounds alternate the configurations'
order; each round runs ``--steps`` steps of each after ``--warmup`` untimed ones at the start.
Printed: per configuration and phase the median host ms (least-most) over every timed step, and
the ratio of the medians to PyTorch alone's (the optimizer's step and ``zero_grad`` are timed
too: the session's op recorder, where entered, sees their torch functions); the parameters after
the last step are compared bitwise with PyTorch alone's (every configuration sees the same
batches). ``--json PATH`` writes the samples.

    python -m benchmarks.host_overhead                        # ResNet-152's module count
    python -m benchmarks.host_overhead --layers 1 1 1 1 --steps 2 --rounds 2   # dry run
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import statistics
import time

CONFIGS = ("pytorch", "mixed", "kept", "hooks", "hooks-mode", "mixed-recorded", "mixed-whole")
#: what runs without ``--configs``
DEFAULT_CONFIGS = ("pytorch", "mixed", "kept")


def resnet_of(block, layers, widths, stem):
    """torchvision.models.resnet.ResNet's structure (its ``_make_layer``) with ``block`` (a class
    of torchvision's block signature and ``expansion``), built without torchvision: a stem,
    ``layers[i]`` blocks of ``widths[i]`` planes, pooling, a linear head of 10 classes; the
    weights from seed 0."""
    import torch
    import torch.nn as nn

    torch.manual_seed(0)
    modules = [nn.Conv2d(3, stem, 7, 2, padding=3, bias=False), nn.BatchNorm2d(stem),
               nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, padding=1)]
    inplanes = stem
    for index, (blocks, planes) in enumerate(zip(layers, widths)):
        stride = 1 if index == 0 else 2
        downsample = None
        if stride != 1 or inplanes != planes * block.expansion:
            downsample = nn.Sequential(
                nn.Conv2d(inplanes, planes * block.expansion, 1, stride, bias=False),
                nn.BatchNorm2d(planes * block.expansion))
        modules.append(block(inplanes, planes, stride, downsample))
        inplanes = planes * block.expansion
        modules += [block(inplanes, planes) for _ in range(1, blocks)]
    modules += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(inplanes, 10)]
    return nn.Sequential(*modules)


def _model(layers, widths, stem):
    """:func:`resnet_of` with torchvision's Bottleneck."""
    import torch.nn as nn

    class Bottleneck(nn.Module):
        expansion = 4

        def __init__(self, inplanes, planes, stride=1, downsample=None):
            super().__init__()
            self.conv1 = nn.Conv2d(inplanes, planes, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(planes)
            self.conv2 = nn.Conv2d(planes, planes, 3, stride, padding=1, bias=False)
            self.bn2 = nn.BatchNorm2d(planes)
            self.conv3 = nn.Conv2d(planes, planes * 4, 1, bias=False)
            self.bn3 = nn.BatchNorm2d(planes * 4)
            self.relu = nn.ReLU(inplace=True)
            self.downsample = downsample

        def forward(self, x):
            identity = x
            out = self.relu(self.bn1(self.conv1(x)))
            out = self.relu(self.bn2(self.conv2(out)))
            out = self.bn3(self.conv3(out))
            if self.downsample is not None:
                identity = self.downsample(x)
            out += identity
            return self.relu(out)

    return resnet_of(Bottleneck, layers, widths, stem)


class _Config:
    """One configuration: its model, optimizer and session (None: PyTorch alone)."""

    def __init__(self, name, model, session):
        import torch
        self.name, self.model, self.session = name, model, session
        self.optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        self.samples = []   # (forward ms, backward ms, optimizer ms) per timed step

    def steps(self, batches, timed: bool) -> None:
        import torch.nn.functional as F
        if self.session is not None:
            self.session.__enter__()
        try:
            for inputs, labels in batches:
                start = time.perf_counter()
                loss = F.cross_entropy(self.model(inputs), labels)
                forward = time.perf_counter()
                loss.backward()
                backward = time.perf_counter()
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
                if timed:
                    self.samples.append(((forward - start) * 1e3, (backward - forward) * 1e3,
                                         (time.perf_counter() - backward) * 1e3))
        finally:
            if self.session is not None:
                self.session.__exit__(None, None, None)


class _Mechanism:
    """PyTorch's hooks as the session registers them, each doing nothing: a global forward
    pre-hook and an always-called global forward hook, saved-tensor hooks that hand back what
    they are given, and (``mode``) a torch function mode that calls each function as given (the
    session's op recorder, which it takes off the stack inside leaf modules, is one). Entered and
    left as a session is."""

    def __init__(self, mode: bool):
        self.mode, self._undo = mode, []

    def __enter__(self):
        import torch
        import torch.nn.modules.module as hooks
        from torch.overrides import TorchFunctionMode

        class Through(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                return func(*args, **(kwargs or {}))

        before = hooks.register_module_forward_pre_hook(lambda module, args: None)
        after = hooks.register_module_forward_hook(lambda module, args, output: None,
                                                   always_call=True)
        saved = torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
        saved.__enter__()
        self._undo = [before.remove, after.remove, lambda: saved.__exit__(None, None, None)]
        if self.mode:
            through = Through()
            through.__enter__()
            self._undo.append(lambda: through.__exit__(None, None, None))
        return self

    def __exit__(self, *exc_info):
        for undo in reversed(self._undo):
            undo()
        self._undo = []


def _mixed_modes(model, batch):
    """The ``mixed`` plan: recompute each group a probe step could recompute whose producer is
    not a convolution, keep the rest; (modes, kept, recomputed)."""
    import torch.nn.functional as F
    from mucudnn.torch.link import SameMemoryLink
    from mucudnn.torch.offload_session import OffloadSession
    from mucudnn.torch.planner import KEEP, RECOMPUTE

    probe = OffloadSession(force=RECOMPUTE, link=SameMemoryLink(), min_bytes=0)
    inputs, labels = batch
    with probe:
        F.cross_entropy(model(inputs), labels).backward()
    model.zero_grad(set_to_none=True)
    modes = [RECOMPUTE if group.mode == RECOMPUTE and not group.producer.startswith("Conv")
             else KEEP for group in probe._step.groups]
    return modes, modes.count(KEEP), modes.count(RECOMPUTE)


def _batches(args, count, seed):
    import torch
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(args.batch, 3, args.size, args.size, generator=generator),
             torch.randint(0, 10, (args.batch,), generator=generator)) for _ in range(count)]


def _summary(values):
    return {"median": statistics.median(values), "least": min(values), "most": max(values)}


def run(args) -> dict:
    import torch
    from mucudnn.torch.link import SameMemoryLink
    from mucudnn.torch.offload_session import OffloadSession
    from mucudnn.torch.planner import KEEP

    torch.set_num_threads(args.threads)
    model = _model(args.layers, args.widths, args.stem)
    modes, kept, recomputed = _mixed_modes(copy.deepcopy(model), _batches(args, 1, -1)[0])
    sessions = {
        "pytorch": None,
        "mixed": OffloadSession(modes=modes, link=SameMemoryLink(), min_bytes=0),
        # standing aside would leave PyTorch's own steps: this measures the hooks
        "kept": OffloadSession(modes=[KEEP] * len(modes), link=SameMemoryLink(), min_bytes=0,
                               stand_aside=False),
        "mixed-recorded": OffloadSession(modes=modes, link=SameMemoryLink(), min_bytes=0,
                                         replay=False),
        "mixed-whole": OffloadSession(modes=modes, link=SameMemoryLink(), min_bytes=0),
        "hooks": _Mechanism(mode=False),
        "hooks-mode": _Mechanism(mode=True),
    }
    sessions["mixed-whole"].lean_steps = False
    configs = [_Config(name, copy.deepcopy(model), sessions[name]) for name in args.configs]
    for config in configs:
        config.steps(_batches(args, args.warmup, 0), timed=False)
    gc.collect()
    for round_index in range(args.rounds):
        shift = round_index % len(configs)
        batches = _batches(args, args.steps, round_index + 1)
        for config in configs[shift:] + configs[:shift]:
            config.steps(batches, timed=True)
    reference = {name: parameter for name, parameter in configs[0].model.named_parameters()}
    document = {"layers": args.layers, "widths": args.widths, "batch": args.batch,
                "size": args.size, "groups": len(modes), "mixed_kept": kept,
                "mixed_recomputed": recomputed, "steps": args.steps, "rounds": args.rounds,
                "torch": torch.__version__, "configs": {}}
    for config in configs:
        same = all(torch.equal(parameter, reference[name])
                   for name, parameter in config.model.named_parameters())
        document["configs"][config.name] = {
            "forward_ms": _summary([f for f, _, _ in config.samples]),
            "backward_ms": _summary([b for _, b, _ in config.samples]),
            "optimizer_ms": _summary([o for _, _, o in config.samples]),
            "step_ms": _summary([sum(sample) for sample in config.samples]),
            "samples": config.samples, "same_parameters_as": configs[0].name if same else None}
    return document


def table(document: dict) -> str:
    configs = document["configs"]
    base = configs.get("pytorch")
    lines = [f"ResNet layers {document['layers']} widths {document['widths']}, N="
             f"{document['batch']} {document['size']}x{document['size']}, CPU, torch "
             f"{document['torch']}; {document['groups']} saved groups (mixed: "
             f"{document['mixed_kept']} kept / {document['mixed_recomputed']} recomputed); "
             f"{document['rounds']} rounds x {document['steps']} steps",
             "| config | forward ms | backward ms | optimizer ms | step ms | forward / pytorch | "
             "backward / pytorch | same parameters |", "|---|---|---|---|---|---|---|---|"]
    for name, row in configs.items():
        cells = [name]
        for phase in ("forward_ms", "backward_ms", "optimizer_ms", "step_ms"):
            s = row[phase]
            cells.append(f"{s['median']:.2f} ({s['least']:.2f}-{s['most']:.2f})")
        for phase in ("forward_ms", "backward_ms"):
            cells.append(f"{row[phase]['median'] / base[phase]['median']:.2f}" if base else "-")
        cells.append("yes" if row["same_parameters_as"] else "NO")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs=4, default=[3, 8, 36, 3],
                        help="blocks per stage (default: ResNet-152's)")
    parser.add_argument("--widths", type=int, nargs=4, default=[4, 8, 16, 32],
                        help="planes per stage (tiny: the host's time, not the arithmetic)")
    parser.add_argument("--stem", type=int, default=8)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--size", type=int, default=32, help="input height and width")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per round and config")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per config first")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    parser.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(DEFAULT_CONFIGS))
    parser.add_argument("--json", help="write the samples here")
    args = parser.parse_args(argv)
    if min(args.layers) < 1 or min(args.widths) < 1 or args.steps < 1 or args.rounds < 1:
        parser.error("--layers, --widths, --steps and --rounds must be positive")
    return args


def main(argv=None) -> dict:
    args = parse(argv)
    document = run(args)
    print(table(document))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(document, out, indent=1)
    return document


if __name__ == "__main__":
    main()
