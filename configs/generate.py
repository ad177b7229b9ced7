#!/usr/bin/env python3
"""Write the shipped network configs derived from architecture rules.

    python3 configs/generate.py          # rewrite alexnet, resnet18, resnet50 and vgg16 .yaml
    python3 configs/generate.py --check  # exit 1 if a committed file differs from what it would write

The committed YAML files are the source of truth; this script only records how their shapes were
derived (torchvision's module structure, Caffe's bvlc_alexnet) so that they can be checked and
regenerated. deepbench.yaml is a transcription of DeepBench's table and is not generated here.

Layers whose geometry is identical are written once with ``count``; the entry's name joins the
module names it stands for (``layer3.1-5.conv1`` = layer3.1.conv1 ... layer3.5.conv1).
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

CONFIG_DIR = Path(__file__).resolve().parent
BATCH = 256
IMAGENET = 224


@dataclasses.dataclass(frozen=True)
class Conv:
    """One square 2-D convolution module: ``size`` is its input's height (= width)."""

    name: str
    c: int
    size: int
    k: int
    f: int
    pad: int = 0
    stride: int = 1
    groups: int = 1

    @property
    def out(self) -> int:
        return (self.size + 2 * self.pad - self.f) // self.stride + 1

    @property
    def geometry(self) -> tuple[int, ...]:
        return (self.c, self.size, self.k, self.f, self.pad, self.stride, self.groups)


def pooled(size: int, window: int = 3, stride: int = 2, pad: int = 0, ceil: bool = False) -> int:
    """Output size of a max pooling layer (Caffe rounds up, PyTorch down by default)."""
    span = size + 2 * pad - window
    return (-(-span // stride) if ceil else span // stride) + 1


# -- architectures: each yields its convolutions in execution order ------------------------------

def alexnet() -> Iterator[Conv]:
    """Caffe's bvlc_alexnet (train_val.prototxt): 227x227 crops, grouped conv2/4/5, 3x3 s2 pooling."""
    conv1 = Conv("conv1", 3, 227, 96, 11, stride=4)
    conv2 = Conv("conv2", 96, pooled(conv1.out, ceil=True), 256, 5, pad=2, groups=2)
    conv3 = Conv("conv3", 256, pooled(conv2.out, ceil=True), 384, 3, pad=1)
    conv4 = Conv("conv4", 384, conv3.out, 384, 3, pad=1, groups=2)
    conv5 = Conv("conv5", 384, conv4.out, 256, 3, pad=1, groups=2)
    yield from (conv1, conv2, conv3, conv4, conv5)


def vgg16() -> Iterator[Conv]:
    """torchvision.models.vgg16 (configuration D): 3x3 pad 1 convs, 2x2 s2 max pooling."""
    plan = [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"]
    channels, size = 3, IMAGENET
    module = 0  # position in model.features, where each conv is followed by its ReLU
    for item in plan:
        if item == "M":
            size = pooled(size, window=2, stride=2)
            module += 1
            continue
        yield Conv(f"features.{module}", channels, size, item, 3, pad=1)
        channels = item
        module += 2


RESNET_STEM = Conv("conv1", 3, IMAGENET, 64, 7, pad=3, stride=2)
RESNET_STAGE1_SIZE = pooled(RESNET_STEM.out, pad=1)  # after the 3x3 s2 pad 1 max pooling


STAGES = ((1, 64), (2, 128), (3, 256), (4, 512))  # (stage, planes); stages 2-4 halve the size


def resnet18() -> Iterator[Conv]:
    """torchvision.models.resnet18: BasicBlocks [2, 2, 2, 2], 1x1 stride-2 downsample convs."""
    yield RESNET_STEM
    channels, size = RESNET_STEM.k, RESNET_STAGE1_SIZE
    for stage, planes in STAGES:
        for block in range(2):
            stride = 2 if stage > 1 and block == 0 else 1
            prefix = f"layer{stage}.{block}"
            conv1 = Conv(f"{prefix}.conv1", channels, size, planes, 3, pad=1, stride=stride)
            yield conv1
            yield Conv(f"{prefix}.conv2", planes, conv1.out, planes, 3, pad=1)
            if stride != 1 or channels != planes:
                yield Conv(f"{prefix}.downsample.0", channels, size, planes, 1, stride=stride)
            channels, size = planes, conv1.out


def resnet50() -> Iterator[Conv]:
    """torchvision.models.resnet50 (v1.5): Bottlenecks [3, 4, 6, 3], stride on the 3x3 conv."""
    yield RESNET_STEM
    channels, size = RESNET_STEM.k, RESNET_STAGE1_SIZE
    for (stage, width), blocks in zip(STAGES, (3, 4, 6, 3)):
        out_channels = width * 4
        for block in range(blocks):
            stride = 2 if stage > 1 and block == 0 else 1
            prefix = f"layer{stage}.{block}"
            yield Conv(f"{prefix}.conv1", channels, size, width, 1)
            conv2 = Conv(f"{prefix}.conv2", width, size, width, 3, pad=1, stride=stride)
            yield conv2
            yield Conv(f"{prefix}.conv3", width, conv2.out, out_channels, 1)
            if stride != 1 or channels != out_channels:
                yield Conv(f"{prefix}.downsample.0", channels, size, out_channels, 1, stride=stride)
            channels, size = out_channels, conv2.out


@dataclasses.dataclass(frozen=True)
class Network:
    name: str
    source: str
    convs: Callable[[], Iterator[Conv]]


NETWORKS = (
    Network("alexnet", "Caffe bvlc_alexnet train_val.prototxt, as in the mu-cuDNN paper "
            "(227x227 crops)", alexnet),
    Network("resnet18", "torchvision.models.resnet18 (ImageNet 224x224)", resnet18),
    Network("resnet50", "torchvision.models.resnet50, v1.5 (ImageNet 224x224)", resnet50),
    Network("vgg16", "torchvision.models.vgg16 (ImageNet 224x224)", vgg16),
)


# -- writing --------------------------------------------------------------------------------------

def group_by_geometry(convs: list[Conv]) -> list[list[Conv]]:
    """Convs with equal geometry, grouped, groups in first-seen order."""
    groups: dict[tuple[int, ...], list[Conv]] = {}
    for conv in convs:
        groups.setdefault(conv.geometry, []).append(conv)
    return list(groups.values())


_BLOCK_NAME = re.compile(r"^(?P<stage>layer\d+)\.(?P<block>\d+)\.(?P<module>.+)$")


@dataclasses.dataclass
class BlockRun:
    """The same module of consecutive blocks of one ResNet stage: ``layer3.1-5.conv1``."""

    stage: str
    module: str
    first: int
    last: int

    def __str__(self) -> str:
        blocks = str(self.first) if self.first == self.last else f"{self.first}-{self.last}"
        return f"{self.stage}.{blocks}.{self.module}"


def group_name(names: list[str]) -> str:
    """One name for several modules: runs of blocks fold (layer1.0-2.conv1), the rest join by +."""
    parts: list[BlockRun | str] = []
    for name in names:
        match = _BLOCK_NAME.match(name)
        if match is None:
            parts.append(name)
            continue
        stage, block, module = match["stage"], int(match["block"]), match["module"]
        run = next((part for part in parts if isinstance(part, BlockRun)
                    and (part.stage, part.module, part.last) == (stage, module, block - 1)), None)
        if run is None:
            parts.append(BlockRun(stage, module, block, block))
        else:
            run.last = block
    return "+".join(str(part) for part in parts)


def layer_line(group: list[Conv], first: bool) -> str:
    conv = group[0]
    fields = [f"name: {group_name([c.name for c in group])}", f"c: {conv.c}",
              f"in: [{conv.size}, {conv.size}]", f"k: {conv.k}", f"f: [{conv.f}, {conv.f}]"]
    if conv.pad:
        fields.append(f"pad: [{conv.pad}, {conv.pad}]")
    if conv.stride != 1:
        fields.append(f"stride: [{conv.stride}, {conv.stride}]")
    if conv.groups != 1:
        fields.append(f"groups: {conv.groups}")
    if len(group) > 1:
        fields.append(f"count: {len(group)}")
    if first:
        fields.append("directions: [fwd, bwd_filter]")
    return "  - {" + ", ".join(fields) + "}"


def render(network: Network) -> str:
    convs = list(network.convs())
    groups = group_by_geometry(convs)
    lines = [
        f"# {network.name}: {len(convs)} convolution layers, {len(groups)} distinct geometries.",
        "# Written by configs/generate.py; see docs/configs.md for the format.",
        "# The first layer skips bwd_data: frameworks compute no gradient for the input images.",
        "# math: fma is fp32 with TF32 off (PyTorch's torch.backends.cudnn.allow_tf32 = False);",
        "# PyTorch's default allows TF32, math: default (docs/configs.md).",
        f"name: {network.name}",
        f"source: {network.source}",
        f"batch: {BATCH}",
        ("defaults: {dtype: f32, compute_type: f32, math: fma, layout: nchw, "
         "directions: [fwd, bwd_data, bwd_filter]}"),
        "layers:",
    ]
    lines += [layer_line(group, first=index == 0) for index, group in enumerate(groups)]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="compare with the committed files instead of writing them")
    args = parser.parse_args(argv)
    stale = []
    for network in NETWORKS:
        path = CONFIG_DIR / f"{network.name}.yaml"
        text = render(network)
        if args.check:
            if not path.is_file() or path.read_text(encoding="utf-8") != text:
                stale.append(path.name)
        else:
            path.write_text(text, encoding="utf-8")
            print(f"wrote {path}")
    if stale:
        print("differs from configs/generate.py: " + ", ".join(stale), file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
