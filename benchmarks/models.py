"""The networks the GPU benchmarks train, each with its input, labels and loss in one place.

benchmarks/shim_pytorch.py's worker (and so every driver that runs it: never_slower, pressure,
memory_budget, tuning_cost) builds its network, data and loss here. The table names the issue's
models with their batch N; any other torchvision classification model (``alexnet``,
``resnext50_32x4d``, ...) or video model (``r2plus1d_18``, ...) is trained as the table's
classification or video rows are.

- ``unet3d``: a 3-D U-Net written here, nnU-Net-like (5 resolution levels, 32 base channels
  doubling per level up to 320, two 3x3x3 convolution + InstanceNorm + LeakyReLU per stage,
  strided-convolution downsampling, transposed-convolution upsampling, skip concatenation),
  1-channel 128^3 patches, 3 classes, dice + cross-entropy per voxel;
- ``deeplabv3_resnet50``: torchvision's, no pre-trained weights (nor backbone weights: the GPU
  machine has no internet), 512x512, 21 classes, per-pixel cross-entropy on the ``out`` head.

torch (and torchvision, for its models) are imported only where a network is built, so that this
table imports without them. ``python -m benchmarks.models`` prints the table.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class ModelSpec:
    name: str
    batch: int                 # the issue's N
    sample: tuple[int, ...]    # one input: (C, H, W) or (C, D, H, W)
    classes: int
    task: str                  # "classification" (one label per input) or "segmentation" (per voxel)
    loss: str                  # "cross_entropy" or "dice_cross_entropy"
    source: str                # "torchvision", "torchvision.video", "torchvision.segmentation", "benchmarks"

    def input_shape(self, batch: int) -> tuple[int, ...]:
        return (batch, *self.sample)

    def label_shape(self, batch: int) -> tuple[int, ...]:
        return (batch,) if self.task == "classification" else (batch, *self.sample[1:])


_IMAGE, _CLIP = (3, 224, 224), (3, 16, 112, 112)  # ImageNet images; Kinetics clips of 16 frames
MODELS = {spec.name: spec for spec in (
    ModelSpec("resnet50", 256, _IMAGE, 1000, "classification", "cross_entropy", "torchvision"),
    ModelSpec("vgg16", 256, _IMAGE, 1000, "classification", "cross_entropy", "torchvision"),
    ModelSpec("densenet121", 256, _IMAGE, 1000, "classification", "cross_entropy", "torchvision"),
    ModelSpec("r3d_18", 32, _CLIP, 1000, "classification", "cross_entropy", "torchvision.video"),
    ModelSpec("unet3d", 2, (1, 128, 128, 128), 3, "segmentation", "dice_cross_entropy",
              "benchmarks"),
    ModelSpec("deeplabv3_resnet50", 16, (3, 512, 512), 21, "segmentation", "cross_entropy",
              "torchvision.segmentation"),
)}
# The issue's training models (tuning_cost also times densenet121's tuning)
ISSUE_MODELS = ("resnet50", "vgg16", "r3d_18", "unet3d", "deeplabv3_resnet50")
VIDEO_MODELS = ("r3d_18", "mc3_18", "r2plus1d_18", "s3d", "mvit_v1_b", "mvit_v2_s", "swin3d_t",
                "swin3d_s", "swin3d_b")


def spec_of(name: str) -> ModelSpec:
    """The table's row, or a torchvision classification (video: clip) model's by its name."""
    if name in MODELS:
        return MODELS[name]
    if name in VIDEO_MODELS:
        return ModelSpec(name, 32, _CLIP, 1000, "classification", "cross_entropy",
                         "torchvision.video")
    return ModelSpec(name, 256, _IMAGE, 1000, "classification", "cross_entropy", "torchvision")


def parse_model(text: str) -> tuple[str, int]:
    """MODEL or MODEL:BATCH (the table's N when none is given)."""
    name, _, batch = text.partition(":")
    return name, int(batch) if batch else spec_of(name).batch


# -- networks ------------------------------------------------------------------------------------

def build_network(spec: ModelSpec, sample: tuple[int, ...] | None = None):
    """A freshly initialised network (torch's current seed). ``sample`` only matters to networks
    whose layers depend on the input size (none of the table's)."""
    if spec.source == "benchmarks":
        return unet3d(in_channels=spec.sample[0], classes=spec.classes)
    import torchvision  # only here: the U-Net needs torch alone
    if spec.source == "torchvision.segmentation":
        return getattr(torchvision.models.segmentation, spec.name)(
            weights=None, weights_backbone=None, num_classes=spec.classes, aux_loss=False)
    family = torchvision.models.video if spec.source == "torchvision.video" else torchvision.models
    return getattr(family, spec.name)(num_classes=spec.classes)


def unet3d(in_channels: int = 1, classes: int = 3, base: int = 32, levels: int = 5,
           max_channels: int = 320, negative_slope: float = 0.01):
    """nnU-Net-like 3-D U-Net: level l has min(base * 2^l, max_channels) channels; the first
    convolution of every level below the top halves each spatial size (stride 2), so inputs need
    sides divisible by 2^(levels - 1). Output: (N, classes, D, H, W) logits."""
    import torch
    from torch import nn

    def stage(cin: int, cout: int, stride: int) -> nn.Sequential:
        layers = []
        for i, (a, b) in enumerate(((cin, cout), (cout, cout))):
            layers += [nn.Conv3d(a, b, 3, stride=stride if i == 0 else 1, padding=1),
                       nn.InstanceNorm3d(b, affine=True),
                       nn.LeakyReLU(negative_slope, inplace=True)]
        return nn.Sequential(*layers)

    class UNet3d(nn.Module):
        def __init__(self):
            super().__init__()
            widths = [min(base * 2 ** level, max_channels) for level in range(levels)]
            self.encoder = nn.ModuleList(
                stage(in_channels if level == 0 else widths[level - 1], widths[level],
                      1 if level == 0 else 2) for level in range(levels))
            self.up = nn.ModuleList(nn.ConvTranspose3d(widths[level + 1], widths[level], 2, stride=2)
                                    for level in range(levels - 1))
            self.decoder = nn.ModuleList(stage(2 * widths[level], widths[level], 1)
                                         for level in range(levels - 1))
            self.head = nn.Conv3d(widths[0], classes, 1)

        def forward(self, x):
            skips = []
            for level, block in enumerate(self.encoder):
                x = block(x)
                if level < levels - 1:
                    skips.append(x)
            for level in reversed(range(levels - 1)):
                x = self.decoder[level](torch.cat((self.up[level](x), skips[level]), dim=1))
            return self.head(x)

    return UNet3d()


# -- data and loss ---------------------------------------------------------------------------------

def make_batch(spec: ModelSpec, batch: int, generator, sample: tuple[int, ...] | None = None):
    """Random inputs and labels of ``batch`` samples (on the CPU; ``sample`` overrides the
    table's input shape, e.g. a small U-Net patch for a test)."""
    import torch
    sample = sample or spec.sample
    inputs = torch.randn(batch, *sample, generator=generator)
    labels_shape = (batch,) if spec.task == "classification" else (batch, *sample[1:])
    labels = torch.randint(0, spec.classes, labels_shape, generator=generator)
    return inputs, labels


def loss_function(spec: ModelSpec):
    """loss(network output, labels) -> scalar; segmentation networks of torchvision return a dict
    whose ``out`` is the per-pixel logits."""
    import torch
    cross_entropy = torch.nn.CrossEntropyLoss()

    def logits_of(output):
        return output["out"] if isinstance(output, dict) else output

    if spec.loss == "cross_entropy":
        return lambda output, labels: cross_entropy(logits_of(output), labels)
    if spec.loss == "dice_cross_entropy":
        return lambda output, labels: (cross_entropy(output, labels)
                                       + soft_dice_loss(output, labels, spec.classes))
    raise ValueError(f"unknown loss {spec.loss!r}")


def soft_dice_loss(logits, labels, classes: int, smooth: float = 1e-5):
    """nnU-Net's soft dice (per sample and class, background excluded), as 1 - mean dice, in
    float32 whatever autocast computed the logits in."""
    import torch
    probs = torch.softmax(logits.float(), dim=1)[:, 1:]
    one_hot = torch.nn.functional.one_hot(labels, classes).movedim(-1, 1)[:, 1:].float()
    axes = tuple(range(2, probs.dim()))
    intersection = (probs * one_hot).sum(axes)
    total = probs.sum(axes) + one_hot.sum(axes)
    return 1 - ((2 * intersection + smooth) / (total + smooth)).mean()


@dataclass
class Training:
    model: object
    inputs: object
    labels: object
    loss: object               # loss(output, labels)
    autocast: object           # a context manager: autocast in fp16/bf16, else nothing

    def forward_loss(self):
        with self.autocast:
            return self.loss(self.model(self.inputs), self.labels)


def prepare(name: str, batch: int, *, device: str = "cuda", dtype: str = "fp32",
            double: bool = False, generator=None, sample: tuple[int, ...] | None = None) -> Training:
    """Network, data and loss of one training step as users run it: fp32, or under autocast in
    fp16/bf16 with the network and inputs channels-last (channels_last_3d for 5-D inputs);
    ``double``: all in float64 (a reference for gradient checks)."""
    import torch
    spec = spec_of(name)
    model = build_network(spec, sample).to(device)
    inputs, labels = make_batch(spec, batch, generator, sample)
    inputs, labels = inputs.to(device), labels.to(device)
    autocast = contextlib.nullcontext()
    if double:
        model, inputs = model.double(), inputs.double()
    elif dtype != "fp32":
        layout = torch.channels_last_3d if inputs.dim() == 5 else torch.channels_last
        model = model.to(memory_format=layout)
        inputs = inputs.contiguous(memory_format=layout)
        autocast = torch.autocast(device.split(":")[0],
                                  dtype=torch.float16 if dtype == "fp16" else torch.bfloat16)
    return Training(model, inputs, labels, loss_function(spec), autocast)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.parse_args()
    print(f"{'model':20s} {'N':>4s}  {'input':24s} {'labels':20s} {'classes':>7s}  loss")
    for spec in MODELS.values():
        print(f"{spec.name:20s} {spec.batch:4d}  {str(spec.input_shape(spec.batch)):24s} "
              f"{str(spec.label_shape(spec.batch)):20s} {spec.classes:7d}  {spec.loss}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
