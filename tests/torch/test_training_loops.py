"""mucudnn.torch on the training loops people write (issue 37): module state read at backward
time, functional parameters, in-place changes of saved tensors, forwards whose backward never
runs, nested forwards, user hooks. Each result equals plain PyTorch's bit for bit, or the session
raises what PyTorch raises."""

import copy
import gc
import weakref

import pytest

torch = pytest.importorskip("torch")
if not hasattr(torch, "autograd") or not hasattr(torch.autograd, "graph"):
    pytest.skip("needs a real PyTorch", allow_module_level=True)

from torch import nn  # noqa: E402

from mucudnn.torch.planner import KEEP, OFFLOAD, RECOMPUTE  # noqa: E402
from mucudnn.torch.link import SameMemoryLink  # noqa: E402
from mucudnn.torch.offload_session import OffloadSession  # noqa: E402

from session_helpers import MeteredLink, Spike, batches, small_cnn  # noqa: E402

FORCED = [OFFLOAD, RECOMPUTE, KEEP]


def session_for(force, **options):
    return OffloadSession(force=force, link=SameMemoryLink(gbps=(1.0, 1.0)), min_bytes=0, **options)


def grads(model):
    return [p.grad.clone() for p in model.parameters()]


def assert_equal(expected, actual):
    assert len(expected) == len(actual)
    for i, (u, v) in enumerate(zip(expected, actual)):
        assert u.dtype == v.dtype and torch.equal(u, v), f"tensor {i} differs"


def run_both(step, model, force, **options):
    torch.manual_seed(7)
    plain = step(copy.deepcopy(model), None)
    torch.manual_seed(7)
    session = session_for(force, **options)
    return plain, step(copy.deepcopy(model), session), session


def assert_as_plain(step, model, force, **options):
    """``step`` under a session forcing ``force`` equals it plainly, bit for bit; a forced
    recompute recomputed something (the test reaches a replay)."""
    plain, fitted, session = run_both(step, model, force, **options)
    assert_equal(plain, fitted)
    if force == RECOMPUTE:
        assert any(g.mode == RECOMPUTE for g in session._step.groups)


def within(session):
    return session if session is not None else _nothing()


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# --- item 2: a recomputed module runs as its forward ran ---------------------------------------
@pytest.mark.parametrize("force", FORCED)
def test_eval_before_backward_recomputes_in_the_forward_mode(force):
    model, ((x, y),) = small_cnn(torch.float64), batches(torch.float64, 1)

    def step(model, session):
        model.train()
        with within(session):
            loss = nn.functional.cross_entropy(model(x), y)
        model.eval()               # before the backward: a replay must not run in eval mode
        loss.backward()
        return grads(model)

    plain, fitted, _ = run_both(step, model, force)
    assert_equal(plain, fitted)


@pytest.mark.parametrize("force", FORCED)
def test_train_and_eval_forwards_in_one_step(force):
    # a consistency loss: an eval-mode forward with grad after a train-mode one, which changed
    # the running statistics the eval-mode forward read
    model, ((x, y),) = small_cnn(torch.float64), batches(torch.float64, 1)

    def step(model, session):
        with within(session):
            model.eval()
            teacher = model(x)
            model.train()
            student = model(x)
            model.eval()
            again = model(x)
        loss = nn.functional.cross_entropy(student, y) + (teacher - again).pow(2).mean() + \
            again.square().mean()
        loss.backward()
        return grads(model) + [b.clone() for b in model.buffers()]

    assert_as_plain(step, model, force)


# --- item 3: functional_call --------------------------------------------------------------------
@pytest.mark.parametrize("force", FORCED)
def test_functional_call_recomputes_with_the_parameters_the_forward_used(force):
    model, ((x, y),) = small_cnn(torch.float64), batches(torch.float64, 1)

    def step(model, session):
        params = dict(model.named_parameters())
        fast = {name: (p * 1.5).detach().requires_grad_() for name, p in params.items()}
        with within(session):
            out = torch.func.functional_call(model, fast, (x,))
        loss = nn.functional.cross_entropy(out, y)
        loss.backward()
        return [fast[name].grad.clone() for name in params]

    assert_as_plain(step, model, force)


# --- item 7: an op that writes a tensor it saved, after the pack ----------------------------------
@pytest.mark.parametrize("force", FORCED)
def test_rrelu_in_training_mode(force):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.RReLU(), nn.Conv2d(4, 2, 3)).double()
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64, requires_grad=True)

    def step(model, session):
        with within(session):
            out = model(x)
        out.square().sum().backward()
        grad, x.grad = x.grad.clone(), None
        return grads(model) + [grad]

    plain, fitted, _ = run_both(step, model, force)
    assert_equal(plain, fitted)


def test_rrelu_under_a_budget_in_the_recording_steps():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.RReLU(), nn.Conv2d(4, 2, 3)).double()
    data = [torch.randn(2, 3, 8, 8, dtype=torch.float64) for _ in range(3)]

    def run(session):
        torch.manual_seed(3)
        copied = copy.deepcopy(model)
        results = []
        for x in data:
            x = x.clone().requires_grad_()
            with within(session):
                out = copied(x)
            out.square().sum().backward()
            results.append(x.grad.clone())
        return results

    plain = run(None)
    budget = OffloadSession(budget=2**36, link=SameMemoryLink(gbps=(1.0, 1.0)), min_bytes=0)
    assert_equal(plain, run(budget))


# --- item 8: autograd's in-place check ----------------------------------------------------------
@pytest.mark.parametrize("force", FORCED + [None])
def test_a_parameter_stepped_before_the_backward_raises_as_pytorch_does(force):
    # the GAN ordering bug: D's optimizer steps before G's backward through D
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 8)
    session = session_for(force) if force else None
    with within(session):
        loss = model(x).sum()
    model(x).sum().backward()
    optimizer.step()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


@pytest.mark.parametrize("force", FORCED + [None])
def test_a_saved_activation_changed_in_place_raises_as_pytorch_does(force):
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 4, 3)
    x = torch.randn(2, 3, 8, 8)
    session = session_for(force) if force else None
    with within(session):
        hidden = conv(x)
        out = hidden.sigmoid()          # saves its output
        total = (out * 2).sum()
    out.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        total.backward()


# --- item 9: a forward whose backward never runs --------------------------------------------------
@pytest.mark.parametrize("budget", [True, False])
def test_a_forward_without_backward_starts_no_unbounded_step(budget):
    model, data = small_cnn(torch.float32), batches(torch.float32, 6)
    session = OffloadSession(budget=2**36, link=SameMemoryLink(gbps=(1.0, 1.0)), min_bytes=0,
                             record_steps=1) if budget else session_for(OFFLOAD)
    reference = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    plain_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for index, (x, y) in enumerate(data):
        for net, opt, sess in ((reference, plain_optimizer, None), (model, optimizer, session)):
            opt.zero_grad()
            with within(sess):
                loss = nn.functional.cross_entropy(net(x), y)
            if index % 2 == 1:          # a skipped step (a non-finite loss, say)
                del loss
                continue
            loss.backward()
            opt.step()
        if index % 2 == 0:
            assert_equal(grads(reference), grads(model))
        # one forward's groups, not those of every forward since the last backward
        one_step = one_step if index else len(session._step.groups)
        assert 0 < len(session._step.groups) <= one_step
    assert_equal(list(reference.parameters()), list(model.parameters()))


# --- item 10: a dropped graph frees what it saved -------------------------------------------------
@pytest.mark.parametrize("min_bytes", [0, 1 << 20])
def test_a_dropped_graph_frees_its_small_saved_outputs(min_bytes):
    kept = []

    class Remember(nn.Module):
        def forward(self, x):
            out = torch.sigmoid(x)       # saves its own output
            kept.append(weakref.ref(out))
            return out

    model = nn.Sequential(nn.Linear(8, 8), Remember(), nn.Linear(8, 2))
    session = OffloadSession(force=KEEP, link=SameMemoryLink(gbps=(1.0, 1.0)), min_bytes=min_bytes)
    x = torch.randn(4, 8)
    with session:
        out = model(x)
    del out
    gc.collect()
    assert kept[0]() is None


# --- item 11: replans never aim below nothing ----------------------------------------------------
def test_a_replan_that_would_aim_below_zero_keeps_the_scripts_out_of_memory_error():
    model, data = small_cnn(torch.float32), batches(torch.float32, 4)
    link, steps = MeteredLink(), []

    class Fail(nn.Module):
        def forward(self, x):
            def out_of_memory():
                if len(steps) >= 2:
                    link.oom()
                    raise torch.OutOfMemoryError("out of memory (test)")
            return Spike.apply(x, out_of_memory)

    wrapped = nn.Sequential(model, Fail())
    # a large replan step: min(target, peak) - 2 * budget is below zero
    session = OffloadSession(budget=2**30, link=link, min_bytes=0, replans=2, replan_step=2.0,
                             record_steps=1, trials=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    caught = 0
    for x, y in data:
        steps.append(None)
        optimizer.zero_grad()
        try:
            with session:
                loss = nn.functional.cross_entropy(wrapped(x), y)
            loss.backward()
        except torch.OutOfMemoryError:
            caught += 1
    assert caught == len(data) - 1


# --- item 12: a forward that calls the model again ------------------------------------------------
@pytest.mark.parametrize("force", FORCED)
def test_a_nested_forward_under_one_session(force):
    torch.manual_seed(0)
    inner = small_cnn(torch.float64)
    x, x2 = torch.randn(2, 3, 16, 16, dtype=torch.float64), torch.randn(2, 3, 16, 16,
                                                                         dtype=torch.float64)

    def step(model, session):
        with within(session):
            a = model(x)
            with within(session):      # a siamese wrapper calling itself through the session
                b = model(x2)
            loss = (a - b).square().sum()
        loss.backward()
        return grads(model)

    plain, fitted, session = run_both(step, inner, force)
    assert_equal(plain, fitted)
    # nothing of the session stays installed: another model's forward saves nothing of ours
    other = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    seen = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: seen.append(t) or t, lambda t: t):
        other(torch.randn(2, 4)).sum().backward()
    assert seen and not torch.nn.modules.module._global_forward_hooks
    assert session._hooks is None


# --- item 14: a user's global module hooks see only the user's forward ----------------------------
@pytest.mark.parametrize("force", FORCED)
def test_global_forward_hooks_see_no_replay(force):
    model, ((x, y),) = small_cnn(torch.float64), batches(torch.float64, 1)
    calls = []
    handle = torch.nn.modules.module.register_module_forward_hook(
        lambda module, args, output: calls.append(type(module).__name__))
    try:
        def step(model, session):
            calls.clear()
            with within(session):
                loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            return list(calls)

        plain, fitted, session = run_both(step, model, force)
    finally:
        handle.remove()
    assert plain == fitted
    if force == RECOMPUTE:
        assert any(g.mode == RECOMPUTE for g in session._step.groups)
