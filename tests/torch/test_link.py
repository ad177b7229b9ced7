"""mucudnn.torch's host links on CPU torch (link.py) and the session's use of them: polling
and settling, and pinned host buffers."""

import pytest

torch = pytest.importorskip("torch")
if not hasattr(torch, "autograd") or not hasattr(torch.autograd, "graph"):
    pytest.skip("needs a real PyTorch", allow_module_level=True)

from mucudnn.torch.offload_session import OffloadSession  # noqa: E402
from mucudnn.torch.planner import OFFLOAD  # noqa: E402
from session_helpers import batches, RecordingLink, small_cnn, train  # noqa: E402


class PollingLink(RecordingLink):
    """Logs the session's calls that let a link release what finished copies held."""

    def poll(self):
        self.log.append(("poll",))

    def settle(self):
        self.log.append(("settle",))


def test_the_session_lets_the_link_release_at_every_pack_module_and_unpack_and_settles_each_step():
    # a CUDA link holds an offloaded tensor until its copy is done: the session must give it the
    # chance to let go all through the step (not only at the next offload), and all at step end
    model, data = small_cnn(torch.float32), batches(torch.float32, 3)
    trace, link = [], PollingLink()
    session = OffloadSession(force=OFFLOAD, link=link, min_bytes=0, trace=trace)
    train(model, data, session)
    packs = sum(1 for e in trace if e[0] == "pack")
    unpacks = sum(1 for e in trace if e[0] == "unpack")
    modules = sum(1 for m in model.modules() if not any(True for _ in m.children()))
    polls = sum(1 for e in link.log if e[0] == "poll")
    assert polls >= packs + unpacks + modules * len(data)
    # between two offloads of a step there is always a poll (the first pack after it at least)
    kinds = [e[0] for e in link.log if e[0] in ("offload", "poll")]
    assert all(not (a == b == "offload") for a, b in zip(kinds, kinds[1:]))
    assert sum(1 for e in link.log if e[0] == "settle") >= len(data) - 1   # each step that ended


def test_a_pinned_host_buffer_is_on_the_host_whatever_the_default_device(monkeypatch):
    # a script may set another default device (torch.set_default_device("cuda")): the link's
    # pinned buffers still go to the host (pinning needs CUDA, so the factory is only watched)
    from mucudnn.torch.link import CudaLink
    made = []

    def empty_strided(*args, **kwargs):
        made.append(kwargs)
        return torch.empty(0)
    monkeypatch.setattr(torch, "empty_strided", empty_strided)
    CudaLink._new_host(None, torch.ones(2, 3).t())
    assert made == [{"dtype": torch.float32, "device": "cpu", "pin_memory": True}]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_a_fitted_models_cuda_link_copies_and_pickles_as_a_fresh_link():
    # fit(link=CudaLink(...)): an EMA's deep copy and torch.save get a fresh link to the same
    # device with the same speeds (streams and pinned memory are each link's own), and the copy
    # trains as the original does
    import copy
    import io
    import mucudnn.torch
    from mucudnn.torch.link import CudaLink
    link = CudaLink("cuda", 1 << 20)
    link.gbps = (1000.0, 0.001)
    model = mucudnn.torch.fit(small_cnn(torch.float32).cuda(), budget=1 << 30, link=link,
                              min_bytes=0)
    twin = copy.deepcopy(model)
    copied = twin.mucudnn_session.fit_options["link"]
    assert isinstance(copied, CudaLink) and copied is not link
    assert copied.device == link.device and copied.max_pending == 1 << 20
    assert copied.gbps == link.gbps and copied.stream is not link.stream
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False).mucudnn_session.fit_options["link"]
    assert isinstance(loaded, CudaLink) and loaded.gbps == link.gbps
    x, y = [(a.cuda(), b.cuda()) for a, b in batches(torch.float32, 1)][0]
    for net in (model, twin):
        torch.nn.functional.cross_entropy(net(x), y).backward()
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a.grad, b.grad)
