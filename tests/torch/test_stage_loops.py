"""mucudnn.torch.stage on the training loops people write (issue 37), on CPU torch in float64: a
staged chain differentiates the tensors its forward read (``torch.func.functional_call``), ends
where its last module returns (one module listed twice in the Sequential), keeps second-order
terms (``create_graph=True``), is undone by an interrupt (``KeyboardInterrupt``), and runs no
global module hook in its backward's reruns. Each step's gradients equal plain PyTorch's to
rounding (1e-13 of the largest; bit for bit where nothing may be staged), and the forwards that
may be staged were."""

import contextlib
import copy

import pytest

torch = pytest.importorskip("torch")
if not hasattr(torch, "autograd") or not hasattr(torch.autograd, "graph"):
    pytest.skip("needs a real PyTorch", allow_module_level=True)

from torch import nn  # noqa: E402
from torch.func import functional_call  # noqa: E402

from mucudnn.torch.stage import StagedForward  # noqa: E402
from session_helpers import train  # noqa: E402
from test_stage import assert_close, batches, staged_session, vgg_like  # noqa: E402

cross_entropy = nn.functional.cross_entropy


def assert_staged(session):
    """The session's last step ran the stage: it saved as many groups as the staged profile has,
    fewer than the recorded one."""
    assert session.stage is not None
    assert len(session._step.groups) == len(session.profile.groups) < len(
        session.recorded_profile.groups)


def staged_in(tensor) -> bool:
    """Whether ``tensor``'s graph holds a staged chain."""
    seen, nodes = set(), [tensor.grad_fn]
    while nodes:
        node = nodes.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node).__name__ == "_StagedChainBackward":
            return True
        nodes.extend(next_node for next_node, _ in node.next_functions)
    return False


def steps_through(model, data, session, step, staged=None):
    """Per step, ``step(model, x, y, forward)``'s tensors (cloned), ``forward`` being the model's
    forward under ``session`` (None: plain); whether each forward was staged appended to
    ``staged``."""
    results = []
    for x, y in data:
        def forward(*args, module=model):
            with session if session is not None else contextlib.nullcontext():
                out = module(*args)
            if staged is not None:
                staged.append(staged_in(out))
            return out
        results.append([t.clone() for t in step(model, x, y, forward)])
    return results


# --- functional_call: the tensors the forward read get the gradients -------------------------
def separate_weights(model, x, y, forward):
    """An ensemble member or a perturbed copy (SAM): leaf tensors apart from the parameters."""
    weights = {name: (param.detach() * 1.01).requires_grad_()
               for name, param in model.named_parameters()}
    cross_entropy(forward(model, weights, (x,), module=functional_call), y).backward()
    return [weights[name].grad for name, _ in model.named_parameters()]


def fast_weights(model, x, y, forward):
    """MAML's outer step: weights made from the parameters, the gradient reaching these."""
    model.zero_grad()
    fast = {name: param * 0.99 for name, param in model.named_parameters()}
    cross_entropy(forward(model, fast, (x,), module=functional_call), y).backward()
    return [param.grad for param in model.parameters()]


@pytest.mark.parametrize("step", [separate_weights, fast_weights])
def test_functional_call_weights_get_their_gradients_through_a_stage(step):
    model, data = vgg_like(), batches()
    session, staged = staged_session(), []
    expected = steps_through(copy.deepcopy(model), data, None, step)
    got = steps_through(model, data, session, step, staged)
    assert all(t is not None for each in got for t in each)
    assert_close(expected, got)
    assert staged == [False] * 2 + [True] * 3   # two recording steps, then staged


def test_maml_inner_and_outer_steps_through_a_stage():
    """The inner step's gradient with ``create_graph``, the outer forward on fast weights: the
    second-order gradient reaches the parameters through both staged forwards."""
    def step(model, x, y, forward):
        model.zero_grad()
        params = dict(model.named_parameters())
        inner = cross_entropy(forward(x), y)
        grads = torch.autograd.grad(inner, list(params.values()), create_graph=True)
        fast = {name: p - 0.1 * g for (name, p), g in zip(params.items(), grads)}
        cross_entropy(forward(model, fast, (x.flip(0),), module=functional_call),
                      y.flip(0)).backward()
        return [param.grad for param in model.parameters()]
    model, data = vgg_like(), batches()
    session, staged = staged_session(), []
    assert_close(steps_through(copy.deepcopy(model), data, None, step),
                 steps_through(model, data, session, step, staged))
    assert staged == [False] * 2 + [True] * 8   # two recording forwards, then inner and outer


def ensemble_step(model, members, x, y):
    """An ensemble's step: ``torch.func.vmap`` over the stacked ``members``' weights
    (``functional_call`` of ``model``) on batch ``x``, ``y``, under a session (or none);
    returns the stacked weights' gradients."""
    def step(session):
        params, buffers = torch.func.stack_module_state(members)
        params = {name: each.detach().requires_grad_() for name, each in params.items()}

        def member(weights, buffers, x):
            return functional_call(model, (weights, buffers), (x,))
        with session if session is not None else contextlib.nullcontext():
            out = torch.func.vmap(member, in_dims=(0, 0, None))(params, buffers, x)
        cross_entropy(out.flatten(0, 1), y.repeat(len(members))).backward()
        return [each.grad for each in params.values()]
    return step


def test_an_ensemble_under_vmap_is_not_staged():
    """``torch.func.vmap`` over stacked members' weights (``functional_call``): an
    ``autograd.Function`` without a vmap rule cannot stand for the chain there, so the forward
    runs unstaged, bit for bit the plain one."""
    model, data = vgg_like(), batches()
    session = staged_session()
    train(model, data[:3], session)
    assert session.stage is not None
    members = [copy.deepcopy(model) for _ in range(2)]
    with torch.no_grad():
        members[1][0][0].weight.mul_(1.1)

    step = ensemble_step(model, members, *data[3])
    assert_close([step(None)], [step(session)], rtol=0)


def test_in_place_change_of_a_staged_weight_before_the_backward_is_pytorchs_error():
    """Plain PyTorch refuses a backward through a convolution whose weight changed since its
    forward; the staged chain, which reruns with that weight, refuses it too."""
    model, data = vgg_like(), batches()
    session = staged_session()
    train(model, data[:3], session)
    x, y = data[3]
    for forward in (model, None):
        with session if forward is not None else contextlib.nullcontext():
            loss = cross_entropy(model(x), y)
        with torch.no_grad():
            model[0][2].weight.add_(1e-3)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()


# --- one module listed twice -------------------------------------------------------------------
def test_a_module_used_twice_in_the_sequential_ends_the_chain_before_its_second_use():
    """One average pooling object first and last: the chain is the modules before its second
    use, which end at no pooling layer that saved anything but the input; nothing is staged."""
    torch.manual_seed(0)
    pool = nn.AvgPool2d(2)
    model = vgg_like(features=nn.Sequential(pool, nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(),
                                            pool))
    data = batches()
    session = staged_session()
    assert_close(train(copy.deepcopy(model), data), train(model, data, session), rtol=0)
    assert session.stage is None


@pytest.mark.parametrize("shared", ["pool", "relu"])
def test_a_module_used_twice_in_the_sequential_stages_the_block_before_it(shared):
    torch.manual_seed(0)
    relu, pool = nn.ReLU(), nn.MaxPool2d(2)
    features = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), relu, pool,
                             nn.Conv2d(8, 16, 3, padding=1),
                             relu if shared == "relu" else nn.ReLU(),
                             pool if shared == "pool" else nn.MaxPool2d(2))
    model, data = vgg_like(features=features), batches()
    session = staged_session()
    assert_close(train(copy.deepcopy(model), data), train(model, data, session))
    assert session.stage is not None and session.stage.stage.modules == 3
    assert_staged(session)


# --- create_graph: gradient penalties -----------------------------------------------------------
def gradients(model, *more):
    """The parameters' gradients (zeros for none: a penalty reaches no last bias), then ``more``."""
    return [torch.zeros_like(p) if p.grad is None else p.grad for p in model.parameters()] + \
        list(more)


def penalty_only(model, x, y, forward):
    model.zero_grad()
    x = x.detach().requires_grad_()
    out = forward(x)
    grad, = torch.autograd.grad(out.sum(), x, create_graph=True)
    grad.norm().backward()
    return gradients(model, x.grad)


def loss_and_r1(model, x, y, forward):
    model.zero_grad()
    x = x.detach().requires_grad_()
    loss = cross_entropy(forward(x), y)
    grad, = torch.autograd.grad(loss, x, create_graph=True)
    (loss + grad.pow(2).sum()).backward()
    return gradients(model, x.grad)


@pytest.mark.parametrize("step", [penalty_only, loss_and_r1])
def test_a_gradient_penalty_through_a_stage(step):
    """Lazy R1: plain steps make the stage, then steps whose backward is differentiated again
    (``create_graph``) run through it: the second-order terms through the chain are kept."""
    model, data = vgg_like(), batches()
    session = staged_session()
    train(model, data[:3], session)
    assert session.stage is not None
    staged = []
    assert_close(steps_through(copy.deepcopy(model), data[3:], None, step),
                 steps_through(model, data[3:], session, step, staged))
    assert staged == [True] * 2


# --- an interrupt inside the staged chain -------------------------------------------------------
def test_an_interrupt_inside_a_staged_chain_leaves_grad_mode_and_the_next_step_as_plain():
    """``KeyboardInterrupt`` from a global forward hook (registered after the session's) as the
    chain's second convolution returns: no ``always_call`` hook sees it; after the ``with`` grad
    mode is on, and the next steps train as the plain ones."""
    model, data = vgg_like(), batches(steps=6)
    session = staged_session()
    train(model, data[:3], session)
    assert session.stage is not None
    second_conv = model[0][2]

    def interrupt(module, args, output):
        if module is second_conv:
            raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        with session:
            handle = torch.nn.modules.module.register_module_forward_hook(interrupt)
            try:
                model(data[3][0])
            finally:
                handle.remove()
    grad_mode = torch.is_grad_enabled()
    torch.set_grad_enabled(True)   # for the tests after this one, whatever it finds
    assert grad_mode and session._staged is None
    reference = copy.deepcopy(model)
    assert_close(train(reference, data[4:]), train(model, data[4:], session))
    assert_staged(session)


def test_aborting_a_staged_forward_twice_changes_nothing_the_second_time():
    model, data = vgg_like(), batches()
    session = staged_session()
    train(model, data[:3], session)
    staged = StagedForward(session.stage, data[3][0])
    assert not torch.is_grad_enabled()
    staged.abort()
    assert torch.is_grad_enabled()
    with torch.no_grad():
        staged.abort()
        assert not torch.is_grad_enabled()
    assert torch.is_grad_enabled()


# --- global module hooks see the user's forward only --------------------------------------------
def test_global_module_hooks_see_each_module_once_a_forward_staged_or_not():
    model, data = vgg_like(), batches()
    calls = []
    hooks = torch.nn.modules.module
    handles = [hooks.register_module_forward_pre_hook(lambda m, args: calls.append(("pre", m))),
               hooks.register_module_forward_hook(lambda m, args, out: calls.append(("post", m)))]
    try:
        train(copy.deepcopy(model), data)
        plain, calls[:] = list(calls), []
        session = staged_session()
        train(model, data, session)
    finally:
        for handle in handles:
            handle.remove()
    assert_staged(session)
    assert [(when, type(m)) for when, m in calls] == [(when, type(m)) for when, m in plain]


def test_a_recording_under_vmap_takes_no_stage_and_runs_as_plain():
    """A recording step whose forward runs under ``torch.func.vmap``, with a budget its unstaged
    chain would not fit: nothing is staged there (as in a planned step), bit for bit the plain
    forward."""
    from mucudnn.torch.offload_session import OffloadSession
    from session_helpers import RecordingLink
    model, data = vgg_like(), batches()
    members = [copy.deepcopy(model) for _ in range(2)]

    step = ensemble_step(model, members, *data[0])
    session = OffloadSession(budget=4096, link=RecordingLink(), min_bytes=0, strict=False)
    assert_close([step(None)], [step(session)], rtol=0)
    assert session.stage is None
