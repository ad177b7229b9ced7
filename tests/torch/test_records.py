"""The records of a session's step on CPU torch (records.py): recipes run from their groups
directly."""

import sys
import weakref

import pytest

torch = pytest.importorskip("torch")
if not hasattr(torch, "autograd") or not hasattr(torch.autograd, "graph"):
    pytest.skip("needs a real PyTorch", allow_module_level=True)

from torch import nn  # noqa: E402

from mucudnn.torch.link import SameMemoryLink  # noqa: E402
from mucudnn.torch.offload_session import OffloadSession  # noqa: E402
from mucudnn.torch.planner import KEEP, RECOMPUTE  # noqa: E402
from session_helpers import RecordingLink  # noqa: E402


def test_an_in_place_call_on_a_view_of_a_kept_group_changes_a_copy():
    # a recipe whose in-place call reads a kept group through a view: the group's tensor (which
    # autograd and other recipes read) stays as saved
    from mucudnn.torch.records import _Call, _Group, _Recipe, _ViewOf
    saved = torch.randn(1, 6, 4, dtype=torch.float64)
    kept = saved.detach()
    source = _Group(0, KEEP, saved.numel() * 8, saved.device, weakref.ref(saved),
                    saved._version, "op", True, tensor=kept)
    relu = nn.LeakyReLU(0.5, inplace=True)
    call = _Call(relu, "LeakyReLU", (), None, None, in_place=True, recomputable=True)
    recipe = _Recipe([call], [(_ViewOf(source, (2, 3, 4), (12, 4, 1)),)])
    target = _Group(1, RECOMPUTE, source.nbytes, saved.device, weakref.ref(saved), 0, "LeakyReLU",
                    True, recipe=recipe)
    before = kept.clone()
    rebuilt = OffloadSession(link=SameMemoryLink())._recompute_group(target, SameMemoryLink())
    assert torch.equal(kept, before) and kept._version == source.version
    assert rebuilt.shape == (2, 3, 4)
    assert torch.equal(rebuilt, nn.functional.leaky_relu(before.view(2, 3, 4), 0.5))


def test_a_chain_longer_than_pythons_stack_is_rebuilt():
    # force recomputes a chain as long as the model: rebuilt without recursion
    torch.manual_seed(0)
    layers = [m for _ in range(300) for m in (nn.Conv1d(2, 2, 1), nn.ReLU())]
    model = nn.Sequential(*layers).double()
    x = torch.randn(2, 2, 8, dtype=torch.float64)
    session = OffloadSession(force=RECOMPUTE, link=RecordingLink(), min_bytes=0)
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(250)
    try:
        for _ in range(2):
            with session:
                loss = model(x).sum()
            loss.backward()
    finally:
        sys.setrecursionlimit(limit)
    assert sum(g.mode == RECOMPUTE for g in session._step.groups) == 300   # each ReLU output


def test_a_kept_copy_changed_in_place_is_refused_as_a_recipe_source():
    # a recipe reads a kept group's copy; if the copy was changed after it was saved, the
    # rebuild refuses as it does for a changed alias
    from mucudnn.torch.records import _Call, _Group, _Recipe
    saved = torch.randn(2, 3, dtype=torch.float64)
    link = SameMemoryLink()
    with torch.no_grad():
        copied = link.keep_apart(saved)
    source = _Group(0, KEEP, saved.numel() * 8, saved.device, weakref.ref(saved),
                    saved._version, "op", True, tensor=copied, kept_version=copied._version)
    relu = nn.ReLU()
    recipe = _Recipe([_Call(relu, "ReLU", (), None, None, recomputable=True)], [(source,)])
    target = _Group(1, RECOMPUTE, source.nbytes, saved.device, weakref.ref(saved), 0, "ReLU",
                    True, recipe=recipe)
    session = OffloadSession(link=link)
    assert torch.equal(session._recompute_group(target, link), torch.relu(saved))
    copied.add_(1.0)
    with pytest.raises(RuntimeError, match="changed after it was saved"):
        session._recompute_group(target, link)
