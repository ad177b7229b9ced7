"""benchmarks/torch_f64.py on CPU PyTorch: its core (check_model) on a tiny float64 network with a
host link of one memory passes where the sessions train as plain PyTorch, and its checks fail where
a difference is injected or a session does not do what its row is for."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
if not hasattr(torch, "autograd") or not hasattr(torch.autograd, "graph"):
    pytest.skip("needs a real PyTorch", allow_module_level=True)

from torch import nn  # noqa: E402

from benchmarks import torch_f64  # noqa: E402
from benchmarks.torch_f64 import Case, Run, check_model, check_run, compare, train  # noqa: E402
from mucudnn.torch.link import SameMemoryLink  # noqa: E402
from mucudnn.torch.offload_session import OffloadSession  # noqa: E402

STEPS = 4   # two recording steps, two planned ones


def tiny_case(steps=STEPS) -> Case:
    """A VGG-like first block (stageable), a conv + batch norm block (recomputable), dropout."""
    torch.manual_seed(0)
    features = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(inplace=True),
                             nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2))
    model = nn.Sequential(features, nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8),
                          nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Dropout(0.2),
                          nn.Linear(8 * 4 * 4, 10)).double()
    generator = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 3, 16, 16, generator=generator, dtype=torch.float64),
                torch.randint(0, 10, (4,), generator=generator)) for _ in range(steps)]
    return Case("tiny", model, batches, nn.functional.cross_entropy, torch.device("cpu"),
                description="N=4 x 3x16x16")


def options():
    # CPU tensors stay on a session without a link: one of one memory, with fixed speeds
    return {"link": SameMemoryLink(gbps=(1000.0, 1000.0)), "min_bytes": 0}


def rows_by_mode(result):
    return {row["mode"]: row for row in result["rows"]}


def test_the_sessions_train_as_plain_pytorch_and_the_rows_say_what_each_did():
    said = []
    result = check_model(tiny_case(), stage=True, fractions=[0.5],
                         session_options=options(), say=said.append)
    rows = rows_by_mode(result)
    assert {"plain-again", "offload", "recompute", "budget@0.5", "staged"} <= set(rows)
    for mode in ("plain-again", "offload", "recompute"):
        assert rows[mode]["status"] == "PASS" and rows[mode]["bitwise"], rows[mode]
    assert all(step["offloaded"] > 0 for step in rows["offload"]["steps"])
    assert all(step["recomputed"] > 0 for step in rows["recompute"]["steps"])
    staged = rows["staged"]
    assert staged["status"] == "PASS", staged
    assert staged["staged"] and staged["tolerance"] == 1e-12
    assert staged["session"]["stage"]["chunks"] >= 2
    planned = [s for s in staged["steps"] if s["planned"]]
    assert planned and all(s["groups"] < staged["steps"][0]["groups"] for s in planned)
    budget = rows["budget@0.5"]
    assert budget["status"] in ("PASS", "INFEASIBLE"), budget
    if budget["status"] == "PASS":
        assert rows["fit@0.5"]["status"] == "PASS", rows["fit@0.5"]
    # the page has one line per row and one per check
    page = torch_f64.markdown([result], 1e-12)
    assert page.count("| tiny |") == len(result["rows"])
    assert any("staged" in line for line in said)


def test_a_changed_saved_tensor_fails_the_check():
    case = tiny_case()
    reference = train(case)

    def unpack(tensor):
        return tensor * (1 + 2.0 ** -40) if tensor.is_floating_point() else tensor

    def perturbed():   # every saved tensor read back a little larger: a wrong "session"
        return torch.autograd.graph.saved_tensors_hooks(lambda tensor: tensor, unpack)

    row = check_run(case, reference, "perturbed", "plain", context=perturbed)
    assert row["status"] == "FAIL" and not row["bitwise"], row.get("error")
    assert row["grads"]["unequal_tensors"] > 0 and 0 < row["grads"]["max_rel"]
    assert any(reason.startswith("grads:") for reason in row["reasons"])
    again = check_run(case, reference, "plain-again", "plain")
    assert again["status"] == "PASS" and again["bitwise"]


def test_a_session_that_did_not_do_its_rows_work_fails():
    case = tiny_case()
    reference = train(case)
    row = check_run(case, reference, "offload", "offload", make_session=lambda trace, say:
                    OffloadSession(force="keep", trace=trace, say=say, **options()))
    assert row["bitwise"] and row["requirement_met"] is False and row["status"] == "FAIL"


def test_staged_rows_are_held_to_the_tolerance_relative_to_each_tensors_magnitude():
    grad = torch.tensor([1.0, -4.0, 2.0], dtype=torch.float64)

    def run_of(scale):
        return Run(losses=[1.0], grads=[[grad * scale]], params=[grad], buffers=[])

    reference = run_of(1.0)
    close = compare(reference, run_of(1 + 1e-14), ["w"], [])["grads"]
    far = compare(reference, run_of(1 + 1e-10), ["w"], [])["grads"]
    assert close.unequal == 1 and close.passes(1e-12) and not close.passes(0.0)
    assert not far.passes(1e-12) and far.where == "step 0 w.grad"
    assert far.abs == pytest.approx(4e-10, rel=1e-3) and far.rel == pytest.approx(1e-10, rel=1e-3)
    missing = compare(reference, Run(losses=[1.0], grads=[[None]], params=[grad], buffers=[]),
                      ["w"], [])["grads"]
    assert not missing.passes(1.0)
