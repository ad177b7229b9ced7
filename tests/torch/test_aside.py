"""A session standing aside on CPU torch (aside.py): a budget whose plan keeps every saved tensor
runs settled, then the session's hooks go and the steps are PyTorch's own, bitwise as before; it
comes back where the model's input changes or the caching allocator flushes, and leaves no hook
behind."""

import copy

import pytest

torch = pytest.importorskip("torch")
if not hasattr(torch, "autograd") or not hasattr(torch.autograd, "graph"):
    pytest.skip("needs a real PyTorch", allow_module_level=True)

from torch import nn  # noqa: E402

from mucudnn.torch import aside as aside_module  # noqa: E402
from mucudnn.torch.aside import QUIET_STEPS  # noqa: E402
from mucudnn.torch.lifecycle import WATCHING  # noqa: E402
from mucudnn.torch.offload_session import OffloadSession  # noqa: E402
from mucudnn.torch.planner import KEEP, RECORD_STEPS  # noqa: E402
from session_helpers import (  # noqa: E402
    assert_bitwise, batches, GiB, RecordingLink, small_cnn, train)

if aside_module._TOP_HOOKS is None:
    pytest.skip("this PyTorch cannot read the saved-tensor hooks' stack", allow_module_level=True)

#: steps before the session stands aside: the recording, then the quiet ones under the plan, made
#: at the recording's end on the CPU (a plan that keeps everything has no trial)
BEFORE = RECORD_STEPS + QUIET_STEPS


class FlushingLink(RecordingLink):
    """A link whose caching allocator's flush count a test sets."""

    def __init__(self):
        super().__init__()
        self.flush_count = 0

    def flushes(self):
        return self.flush_count


def watching(session) -> bool:
    """The session's watch (a global forward pre-hook) is registered."""
    hooks = torch.nn.modules.module._global_forward_pre_hooks.values()
    return any(getattr(hook, "__self__", None) is session.aside for hook in list(hooks))


def session_hooks_installed(session) -> bool:
    """The session's global module hooks are registered, or its saved-tensor hooks pushed."""
    hooks = torch.nn.modules.module
    registered = any(getattr(hook, "__self__", None) is session
                     for hook in list(hooks._global_forward_pre_hooks.values())
                     + list(hooks._global_forward_hooks.values()))
    top = aside_module._TOP_HOOKS(False)
    return registered or (top is not None and top[0] == session._pack)


def kept_session(**options):
    return OffloadSession(budget=4 * GiB, link=options.pop("link", None) or RecordingLink(),
                          min_bytes=0, headroom=0.0, **options)


def train_in_one_with(model, data, session):
    """As ``session_helpers.train``, the session entered once around every step (as
    ``mucudnn run --offload`` enters it for the process), and whether it stood aside after
    each step."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    results, standing = [], []
    with session:
        for x, y in data:
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            results.append([p.grad.clone() for p in model.parameters()] +
                           [b.clone() for b in model.buffers()])
            optimizer.step()
            standing.append(session.aside.standing)
    return results, standing


def steps_until_aside(model, data, session):
    """SGD steps of ``data`` under ``session``, entered: those before it stands aside, and the
    first one aside."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in data[:BEFORE + 1]:
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()


def test_a_plan_that_keeps_everything_stands_aside_once_settled_bitwise():
    model, data = small_cnn(torch.float32), batches(torch.float32, BEFORE + 4)
    reference = train(copy.deepcopy(model), data)
    said = []
    session = kept_session(say=said.append)
    results, standing = train_in_one_with(model, data, session)
    assert_bitwise(reference, results)
    assert session.lifecycle.state == WATCHING and set(session.modes) == {KEEP}
    # one line says so, once
    assert [line for line in said if "removed its hooks" in line] == [
        "the offload plan keeps every saved tensor and ran settled: the session removed its "
        "hooks, and the steps run as PyTorch's own until the model's input changes or the "
        "caching allocator flushes (it comes back then)"]
    # it stands aside at the first step after the quiet ones, and stays
    assert standing.index(True) == BEFORE
    assert all(standing[BEFORE:])
    assert (session.aside.stood_aside, session.aside.came_back) == (1, 0)
    assert session.aside.root is model
    # the session's exit leaves nothing of it behind; the model never had a hook of its own
    assert not session_hooks_installed(session) and not watching(session)
    assert not model._forward_pre_hooks and not session.aside.standing


def test_standing_aside_removes_its_hooks_and_autograd_checks_versions_itself():
    model, data = small_cnn(torch.float32), batches(torch.float32, BEFORE + 2)
    session = kept_session()
    with session:
        steps_until_aside(model, data, session)
        assert session.aside.standing and not session_hooks_installed(session)
        assert watching(session) and not model._forward_pre_hooks
        # a saved tensor changed in place before the backward: PyTorch's own error
        x, y = data[-1]
        out = model[0](x)
        saved = torch.sigmoid(out)   # sigmoid saves its output
        saved.mul_(2)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            saved.sum().backward()
    assert not watching(session)


def test_it_comes_back_where_the_input_changes_and_stands_aside_again():
    model = small_cnn(torch.float32)
    data = batches(torch.float32, BEFORE + 2)
    generator = torch.Generator().manual_seed(3)
    larger = [(torch.randn(6, 3, 16, 16, generator=generator),
               torch.randint(0, 10, (6,), generator=generator)) for _ in range(3)]
    data = data + larger + data[:2]
    reference = train(copy.deepcopy(model), data)
    said = []
    session = kept_session(say=said.append)
    results, standing = train_in_one_with(model, data, session)
    assert_bitwise(reference, results)
    # aside for the last two steps of the first batch size; the larger batch brings it back
    assert standing[BEFORE:BEFORE + 2] == [True, True]
    assert not any(standing[BEFORE + 2:])
    assert session.aside.came_back == 1
    assert "the model's input changed: the session's hooks are back" in said
    assert session_hooks_installed(session) is False   # left: the ``with`` is over


def test_it_comes_back_where_the_caching_allocator_flushes():
    model, data = small_cnn(torch.float32), batches(torch.float32, BEFORE + 4)
    link = FlushingLink()
    session = kept_session(link=link)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)   # as train's
    reference = train(copy.deepcopy(model), data)
    results = []
    with session:
        for step, (x, y) in enumerate(data):
            if step == BEFORE + 2:
                assert session.aside.standing
                link.flush_count += 1   # the allocator flushed since the last step
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            if step == BEFORE + 2:   # back from this step's root call: hooked again
                assert not session.aside.standing and session_hooks_installed(session)
            loss.backward()
            results.append([p.grad.clone() for p in model.parameters()] +
                           [b.clone() for b in model.buffers()])
            optimizer.step()
    assert session.aside.came_back == 1
    # the steps after it are the session's again: the last one saved its groups
    assert len(session._step.groups) > 0
    assert_bitwise(reference, results)


def test_a_plan_that_recomputes_never_stands_aside():
    model, data = small_cnn(torch.float32), batches(torch.float32, BEFORE + 3)
    session = OffloadSession(modes=None, budget=4 * GiB, link=RecordingLink(), min_bytes=0,
                             headroom=0.0, force=None)
    # a fixed plan (no budget) that recomputes what it can: the lifecycle plans nothing
    fixed = OffloadSession(force="recompute", link=RecordingLink(), min_bytes=0)
    _, standing = train_in_one_with(copy.deepcopy(model), data, fixed)
    assert not any(standing)
    _, standing = train_in_one_with(model, data, session)
    assert any(standing)   # the same steps under a plan that keeps everything do


def test_off_it_never_stands_aside():
    model, data = small_cnn(torch.float32), batches(torch.float32, BEFORE + 3)
    session = kept_session(stand_aside=False)
    _, standing = train_in_one_with(model, data, session)
    assert not any(standing) and session.aside.stood_aside == 0


def test_a_with_per_forward_stands_aside_at_most_until_its_exit():
    # session_helpers.train enters the session at each forward: an OffloadSession's exit ends
    # its standing aside (a fitted model's does not: test_fit.py)
    model, data = small_cnn(torch.float32), batches(torch.float32, BEFORE + 3)
    reference = train(copy.deepcopy(model), data)
    session = kept_session()
    assert_bitwise(reference, train(model, data, session))
    assert session.aside.stood_aside >= 1 and not session.aside.standing
    assert not watching(session) and not session_hooks_installed(session)


def test_a_copy_of_the_model_carries_nothing_and_training_another_model_brings_it_back():
    import pickle
    model, data = small_cnn(torch.float32), batches(torch.float32, BEFORE + 3)
    session = kept_session()
    with session:
        steps_until_aside(model, data, session)
        assert session.aside.standing
        ema = copy.deepcopy(model)   # an EMA copy, made while the session stands aside
        restored = pickle.loads(pickle.dumps(model))
        assert not ema._forward_pre_hooks and not restored._forward_pre_hooks
        x, y = data[-1]
        with torch.no_grad():        # the EMA model evaluated: no step of the session's
            ema(x)
        assert session.aside.standing
        # another model trained: the session comes back, to plan it
        nn.functional.cross_entropy(restored(x), y).backward()
        assert not session.aside.standing and session.aside.came_back == 1
        assert session_hooks_installed(session)
    assert not watching(session)


def test_a_fitted_model_stands_aside_across_its_forwards():
    from mucudnn.torch import fit
    model, data = small_cnn(torch.float32), batches(torch.float32, BEFORE + 4)
    reference = train(copy.deepcopy(model), data)
    fitted = fit(model, budget="4GiB", link=RecordingLink(), min_bytes=0, headroom=0.0)
    session = fitted.mucudnn_session
    standing = []
    optimizer = torch.optim.SGD(fitted.parameters(), lr=0.1, momentum=0.9)
    results = []
    for x, y in data:   # the fitted forward enters its session at each call
        optimizer.zero_grad()
        nn.functional.cross_entropy(fitted(x), y).backward()
        results.append([p.grad.clone() for p in fitted.parameters()] +
                       [b.clone() for b in fitted.buffers()])
        optimizer.step()
        standing.append(session.aside.standing)
    assert_bitwise(reference, results)
    assert standing.index(True) == BEFORE and all(standing[BEFORE:])
    assert session.aside.stood_aside == 1 and not session_hooks_installed(session)
    assert watching(session)   # across the fitted forwards, until the session comes back


def test_it_comes_back_only_where_the_stacks_are_as_it_left_them():
    # a larger batch under the script's own saved-tensor hooks (save_on_cpu) and inside a torch
    # function mode: the session waits till both are left, so neither stack is disturbed
    model = small_cnn(torch.float32)
    data = batches(torch.float32, BEFORE + 1)
    generator = torch.Generator().manual_seed(3)
    x6, y6 = torch.randn(6, 3, 16, 16, generator=generator), torch.randint(0, 10, (6,))
    session = kept_session()
    with session:
        steps_until_aside(model, data, session)
        below = aside_module._TOP_HOOKS(False)
        with torch.autograd.graph.save_on_cpu():
            nn.functional.cross_entropy(model(x6), y6).backward()
            assert session.aside.standing   # not under save_on_cpu's hooks
        assert aside_module._TOP_HOOKS(False) == below
        with torch.device("cpu"):   # a torch function mode
            nn.functional.cross_entropy(model(x6), y6).backward()
            assert session.aside.standing
        nn.functional.cross_entropy(model(x6), y6).backward()
        assert not session.aside.standing and session_hooks_installed(session)
        assert session._function_modes_below == 0
    assert aside_module._TOP_HOOKS(False) is None and not watching(session)


def test_hooks_that_cannot_be_pushed_leave_it_aside():
    # torch.func's transforms turn saved-tensor hooks off: coming back inside one waits
    from torch.func import functional_call, grad
    model = small_cnn(torch.float32)
    data = batches(torch.float32, BEFORE + 1)
    session = kept_session()
    with session:
        steps_until_aside(model, data, session)
        x, y = data[0]
        params = {name: p.detach() for name, p in model.named_parameters()}
        buffers = {name: b.clone() for name, b in model.named_buffers()}

        def loss(p, x, y):
            return nn.functional.cross_entropy(
                functional_call(model, (p, buffers), (x,)), y)
        model.eval()   # (a train-mode batch norm would change a buffer inside the transform)
        grad(loss)(params, x[:2], y[:2])   # another batch size, inside the transform
        model.train()
        assert session.aside.standing
        nn.functional.cross_entropy(model(x[:2]), y[:2]).backward()
        assert not session.aside.standing
    assert aside_module._TOP_HOOKS(False) is None and not watching(session)


def test_a_session_that_keeps_coming_back_stands_aside_no_more():
    # the root called at two sizes in each step (two crops): each time it stood aside the second
    # call brought it back; after MOST_RETURNS it stays
    from mucudnn.torch.aside import MOST_RETURNS
    model = small_cnn(torch.float32)
    generator = torch.Generator().manual_seed(5)
    steps = BEFORE + (QUIET_STEPS + 1) * (MOST_RETURNS + 1)
    crops = [(torch.randn(4, 3, 16, 16, generator=generator),
              torch.randn(2, 3, 16, 16, generator=generator),
              torch.randint(0, 10, (4,), generator=generator)) for _ in range(steps)]
    reference = None
    for attempt in ("plain", "session"):
        torch.manual_seed(0)
        net = copy.deepcopy(model)
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
        session = kept_session() if attempt == "session" else None
        results = []
        with session if session is not None else torch.enable_grad():
            for big, small, y in crops:
                optimizer.zero_grad()
                (nn.functional.cross_entropy(net(big), y) +
                 nn.functional.cross_entropy(net(small), y[:2])).backward()
                results.append([p.grad.clone() for p in net.parameters()])
                optimizer.step()
        if reference is None:
            reference = results
    assert_bitwise(reference, results)
    assert session.aside.came_back == MOST_RETURNS == session.aside.stood_aside


def test_a_model_compiled_while_it_stands_aside_is_refused():
    from mucudnn.torch.compiled import CompiledModelError
    torch._dynamo.reset()
    model, data = small_cnn(torch.float32), batches(torch.float32, BEFORE + 1)
    session = kept_session()
    with session:
        steps_until_aside(model, data, session)
        assert session.aside.standing
        compiled = torch.compile(model, backend="eager")
        x, y = data[0]
        with pytest.raises(CompiledModelError, match="offloads eager PyTorch only"):
            nn.functional.cross_entropy(compiled(x), y).backward()
    torch._dynamo.reset()
    assert not watching(session)


def test_a_return_after_a_long_stretch_aside_starts_the_count_again(monkeypatch):
    # an epoch's last batch is smaller: the session comes back once an epoch, after a long
    # stretch aside, and stands aside again each time (MOST_RETURNS counts quick returns only)
    from mucudnn.torch.aside import MOST_RETURNS
    monkeypatch.setattr(aside_module, "QUIET_STEPS", 2)
    model = small_cnn(torch.float32)
    generator = torch.Generator().manual_seed(7)
    epoch = [(torch.randn(4, 3, 16, 16, generator=generator),
              torch.randint(0, 10, (4,), generator=generator)) for _ in range(7)]
    last = (torch.randn(2, 3, 16, 16, generator=generator), torch.randint(0, 10, (2,)))
    data = (epoch + [last]) * (MOST_RETURNS + 2)
    reference = train(copy.deepcopy(model), data)
    session = kept_session()
    results, _ = train_in_one_with(model, data, session)
    assert_bitwise(reference, results)
    assert session.aside.came_back > MOST_RETURNS
    assert session.aside.stood_aside > MOST_RETURNS
