"""The model-zoo differential (zoo.py) on a few torchvision models, where torchvision is
installed (the device's environment; CI's has none): each session's run bit for bit the plain
run's. The whole zoo runs on the device as a script: ``python tests/torch/zoo.py cuda``."""

import pytest
import torch

import zoo


@pytest.mark.parametrize("family,name", [("image", "resnet18"), ("image", "mobilenet_v3_small"),
                                         ("image", "squeezenet1_1"), ("image", "shufflenet_v2_x0_5"),
                                         ("video", "r2plus1d_18"), ("segmentation", "lraspp_mobilenet_v3_large")])
def test_a_zoo_model_trains_under_every_session_as_plainly(family, name):
    pytest.importorskip("torchvision")
    zoo.patterns.use_device("cpu")
    result = zoo.run_model(family, name)
    assert result.verdict == "equal", (result.detail, result.sessions)
    assert set(result.sessions) == set(zoo.SESSIONS)


def test_the_zoo_tells_a_difference():
    """The comparison fails where one observed tensor differs in its last bit."""
    plain = [torch.tensor([1.0, 2.0]), None, torch.tensor([3.0])]
    ours = [plain[0].clone(), None, torch.nextafter(plain[2], torch.tensor([4.0]))]
    assert zoo._difference(plain, plain) == ""
    assert "tensor 2 differs" in zoo._difference(plain, ours)
    assert "observed" in zoo._difference(plain, ours[:2])
