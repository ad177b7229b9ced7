"""mucudnn.torch's saved-tensor hooks on CPU torch (saved_tensors.py): which saves pass through
to autograd (parameters, buffers, small tensors, other layouts), and one group per tensor saved
again; gradients must be bitwise equal to a plain run."""

import copy

import pytest

torch = pytest.importorskip("torch")
if not hasattr(torch, "autograd") or not hasattr(torch.autograd, "graph"):
    pytest.skip("needs a real PyTorch", allow_module_level=True)

from torch import nn  # noqa: E402

from mucudnn.torch.link import SameMemoryLink  # noqa: E402
from mucudnn.torch.offload_session import OffloadSession  # noqa: E402
from mucudnn.torch.planner import KEEP, OFFLOAD, RECOMPUTE  # noqa: E402
from session_helpers import (  # noqa: E402
    assert_bitwise, batches, RecordingLink, small_cnn, train)


class LogsItsInputNorm(nn.Module):
    """Saves its input for a graph it drops at once (a logged statistic), before the next
    module saves the same tensor again."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x):
        h = self.model[:8](x)                # AvgPool2d's output: its maker does not save it
        self.logged = h.pow(2).sum().item()  # saves h; that node is freed right away
        return self.model[8:](h)             # the convolution saves h again


def test_parameters_and_small_tensors_pass_through():
    model, data = small_cnn(torch.float32), batches(torch.float32, 1)
    trace = []
    session = OffloadSession(force=OFFLOAD, link=RecordingLink(), min_bytes=4096, trace=trace)
    train(model, data, session)
    packs = [e for e in trace if e[0] == "pack"]
    parameters = sum(p.numel() * p.element_size() for p in model.parameters())
    assert packs and parameters > 0
    assert all(g.nbytes >= 4096 for g in session._step.groups)


@pytest.mark.parametrize("mode", [OFFLOAD, KEEP, RECOMPUTE])
def test_a_tensor_saved_again_after_its_first_saver_was_freed(mode):
    model, data = LogsItsInputNorm(small_cnn(torch.float64)), batches(torch.float64, 3)
    reference = train(copy.deepcopy(model), data)
    session = OffloadSession(force=mode, link=RecordingLink(), min_bytes=0)
    assert_bitwise(reference, train(model, data, session))


def test_a_parameter_changed_in_place_is_never_a_group():
    # a frozen parameter changed in place by an op of a tensor that requires grad is no leaf;
    # it is still a parameter, which a session never saves as its own
    parameter = nn.Parameter(torch.randn(64, 64), requires_grad=False)
    parameter.mul_(torch.randn(64, 64, requires_grad=True))
    assert not parameter.is_leaf
    session = OffloadSession(force=KEEP, link=RecordingLink(), min_bytes=0)
    with session:
        (torch.randn(2, 64, 64, requires_grad=True).exp() * parameter).sum()
    assert [g.nbytes for g in session._step.groups] == [2 * 64 * 64 * 4]   # the exp's only


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
@pytest.mark.parametrize("layout", ["csr", "coo"])
@pytest.mark.parametrize("force", [KEEP, OFFLOAD, RECOMPUTE])
def test_a_saved_tensor_of_another_layout_is_autograds_to_keep(layout, force):
    # a sparse matrix saved by its product (a graph network's adjacency): no storage to key or
    # copy it by, so the session leaves it to autograd, and the gradient is PyTorch's own
    matrix = torch.randn(4, 4).relu()
    matrix = matrix.to_sparse_csr() if layout == "csr" else matrix.to_sparse()
    x = torch.randn(4, 3, requires_grad=True)
    reference = torch.autograd.grad(torch.sparse.mm(matrix, x * 2).sum(), x)[0]
    with OffloadSession(force=force, link=SameMemoryLink(), min_bytes=0):
        loss = torch.sparse.mm(matrix, x * 2).sum()
    assert torch.equal(torch.autograd.grad(loss, x)[0], reference)


def test_a_step_times_the_hosts_forward_from_its_first_group_to_its_first_unpack(monkeypatch):
    """The host's clock read at the step's first group's pack and at its first unpack: what
    the lifecycle's watch of a settled plan compares with the recording's device forward."""
    import mucudnn.torch.saved_tensors as saved_tensors
    clock = iter([100.0, 100.25])   # the first pack, then the first unpack: 250 ms apart
    monkeypatch.setattr(saved_tensors, "perf_counter", lambda: next(clock))
    model, data = small_cnn(torch.float32), batches(torch.float32, 1)
    session = OffloadSession(force=KEEP, link=SameMemoryLink(), min_bytes=0)
    with session:
        x, y = data[0]
        loss = nn.functional.cross_entropy(model(x), y)
        step = session._step
        assert step.host_start == 100.0 and step.host_forward_ms is None
        loss.backward()
    assert step.host_forward_ms == pytest.approx(250.0)
