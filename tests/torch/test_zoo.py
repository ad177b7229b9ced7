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
    """The comparison fails where one observed tensor differs in its last bit: a step's loss,
    a gradient, parameter or buffer after the last step, or how many were observed."""
    losses = [torch.tensor(float(step)) for step in range(zoo.STEPS)]
    plain = losses + [torch.tensor([1.0, 2.0]), None, torch.tensor([3.0])]
    last = plain[:-1] + [torch.nextafter(plain[-1], torch.tensor([4.0]))]
    first_loss = [torch.nextafter(losses[0], torch.tensor(1.0))] + plain[1:]
    assert zoo._difference(plain, [t if t is None else t.clone() for t in plain]) == ""
    assert f"tensor {zoo.STEPS + 2} differs" in zoo._difference(plain, last)
    assert "loss of step 0 differs" in zoo._difference(plain, first_loss)
    assert "observed" in zoo._difference(plain, plain[:-1])
