"""benchmarks/models.py: every benchmark model's input, labels and loss in one table; the U-Net
and the data-type modes run on CPU torch where it is installed (skipped otherwise)."""

from __future__ import annotations

import pytest

from benchmarks.models import ISSUE_MODELS, MODELS, parse_model, spec_of


@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_model_has_its_input_labels_and_loss(name):
    spec = MODELS[name]
    assert spec.name == name and spec.batch > 0 and spec.classes > 1
    assert spec.loss in ("cross_entropy", "dice_cross_entropy")
    shape = spec.input_shape(spec.batch)
    assert shape[0] == spec.batch and len(shape) in (4, 5)
    if spec.task == "classification":
        assert spec.label_shape(spec.batch) == (spec.batch,)
    else:  # one label per pixel or voxel
        assert spec.label_shape(spec.batch) == (spec.batch, *shape[2:])


def test_the_issue_models_at_the_issue_batches():
    assert set(ISSUE_MODELS) <= set(MODELS) and "densenet121" in MODELS
    assert {n: MODELS[n].batch for n in ISSUE_MODELS} == {
        "resnet50": 256, "vgg16": 256, "r3d_18": 32, "unet3d": 2, "deeplabv3_resnet50": 16}
    assert MODELS["unet3d"].input_shape(2) == (2, 1, 128, 128, 128)
    assert MODELS["deeplabv3_resnet50"].input_shape(16) == (16, 3, 512, 512)


def test_models_outside_the_table_are_trained_as_classification_or_video():
    assert spec_of("alexnet").input_shape(8) == (8, 3, 224, 224)
    # issue 40's ResNet-152 (host_cost, plan_timeline, batch_size): torchvision's, ImageNet images
    resnet152 = spec_of("resnet152")
    assert (resnet152.source, resnet152.task, resnet152.loss) == (
        "torchvision", "classification", "cross_entropy")
    assert resnet152.input_shape(8) == (8, 3, 224, 224) and resnet152.classes == 1000
    assert spec_of("r2plus1d_18").input_shape(4) == (4, 3, 16, 112, 112)
    assert parse_model("r3d_18") == ("r3d_18", 32)
    assert parse_model("resnet50:128") == ("resnet50", 128)


# -- with torch --------------------------------------------------------------------------------

SMALL = (1, 32, 32, 32)  # a U-Net patch small enough for the CPU (sides divisible by 2^4)


def test_the_unet_output_matches_its_labels_and_trains():
    torch = pytest.importorskip("torch")
    from benchmarks.models import prepare
    training = prepare("unet3d", 2, device="cpu", generator=torch.Generator().manual_seed(1),
                       sample=SMALL)
    output = training.model(training.inputs)
    assert output.shape == (2, MODELS["unet3d"].classes, *training.labels.shape[1:])
    assert training.labels.shape == (2, 32, 32, 32)
    loss = training.forward_loss()
    loss.backward()
    assert torch.isfinite(loss) and all(p.grad is not None for p in training.model.parameters())


def test_the_unet_is_nnunet_like():
    torch = pytest.importorskip("torch")
    from benchmarks.models import unet3d
    net = unet3d(levels=6)
    convs = [m for m in net.encoder.modules() if isinstance(m, torch.nn.Conv3d)]
    widths = [c.out_channels for c in convs[::2]]
    assert widths == [32, 64, 128, 256, 320, 320]  # doubling, capped at 320
    assert [c.stride for c in convs[::2]] == [(1, 1, 1)] + [(2, 2, 2)] * 5
    assert sum(isinstance(m, torch.nn.InstanceNorm3d) for m in net.modules()) == 4 * 6 - 2
    assert sum(isinstance(m, torch.nn.ConvTranspose3d) for m in net.modules()) == 5
    default = unet3d()
    assert [m.out_channels for m in default.up] == [32, 64, 128, 256]  # 5 levels


def test_bf16_runs_under_autocast_channels_last_3d_for_5d_inputs():
    torch = pytest.importorskip("torch")
    from benchmarks.models import prepare
    training = prepare("unet3d", 1, device="cpu", dtype="bf16",
                       generator=torch.Generator().manual_seed(1), sample=SMALL)
    assert training.inputs.is_contiguous(memory_format=torch.channels_last_3d)
    weight = training.model.encoder[0][3].weight  # 32 -> 32 channels: the layouts differ
    assert weight.is_contiguous(memory_format=torch.channels_last_3d) and not weight.is_contiguous()
    with training.autocast:
        assert training.model(training.inputs).dtype == torch.bfloat16
    assert training.forward_loss().dtype == torch.float32  # dice and cross-entropy in fp32


def test_fp32_and_double_modes():
    torch = pytest.importorskip("torch")
    from benchmarks.models import prepare
    fp32 = prepare("unet3d", 1, device="cpu", generator=torch.Generator().manual_seed(1),
                   sample=SMALL)
    assert fp32.model.encoder[0][3].weight.is_contiguous()
    assert fp32.forward_loss().dtype == torch.float32
    double = prepare("unet3d", 1, device="cpu", double=True,
                     generator=torch.Generator().manual_seed(1), sample=SMALL)
    assert double.inputs.dtype == torch.float64 and double.forward_loss().dtype == torch.float64


def test_segmentation_losses_read_the_out_head_of_a_dict():
    torch = pytest.importorskip("torch")
    from benchmarks.models import loss_function, make_batch
    spec = MODELS["deeplabv3_resnet50"]
    inputs, labels = make_batch(spec, 2, torch.Generator().manual_seed(0), sample=(3, 8, 8))
    logits = torch.randn(2, spec.classes, 8, 8)
    loss = loss_function(spec)({"out": logits, "aux": None}, labels)
    assert torch.allclose(loss, torch.nn.functional.cross_entropy(logits, labels))


def test_dice_is_zero_loss_for_a_perfect_prediction():
    torch = pytest.importorskip("torch")
    from benchmarks.models import soft_dice_loss
    labels = torch.randint(0, 3, (2, 4, 4, 4), generator=torch.Generator().manual_seed(0))
    perfect = torch.nn.functional.one_hot(labels, 3).movedim(-1, 1).float() * 100
    assert soft_dice_loss(perfect, labels, 3) < 1e-3
    assert soft_dice_loss(-perfect, labels, 3) > 0.9


def test_torchvision_models_build_without_downloading():
    torch = pytest.importorskip("torch")
    pytest.importorskip("torchvision")
    from benchmarks.models import build_network
    net = build_network(MODELS["deeplabv3_resnet50"])
    out = net.eval()(torch.randn(1, 3, 64, 64))
    assert out["out"].shape == (1, 21, 64, 64) and "aux" not in out

