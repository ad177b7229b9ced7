"""mucudnn.torch.fit on CPU torch: a fitted model deep-copies (EMA/teacher/SWA copies), pickles
(torch.save of the whole module) and round-trips its state_dict as the plain module does, each
copy under a session of its own (issue 37, item 1); a compiled model is refused in one line, never
a dynamo crash (item 13)."""

import contextlib
import copy
import io
import pickle

import pytest

torch = pytest.importorskip("torch")
if not hasattr(torch, "autograd") or not hasattr(torch.autograd, "graph"):
    pytest.skip("needs a real PyTorch", allow_module_level=True)

from torch import nn  # noqa: E402

from mucudnn.errors import MucudnnError  # noqa: E402
from mucudnn.torch import fit  # noqa: E402
from mucudnn.torch.compiled import CompiledModelError, compiled_parts  # noqa: E402
from mucudnn.torch.fitted import FitPickleError, FittedForward, FittedSession  # noqa: E402
from mucudnn.torch.planner import OFFLOAD, RECOMPUTE  # noqa: E402
from mucudnn.torch.link import SameMemoryLink  # noqa: E402
from mucudnn.torch.offload_session import OffloadSession  # noqa: E402

MiB = 1 << 20


def small_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                         nn.Flatten(), nn.Linear(8, 4)).double()


def batches(steps, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, 3, 8, 8, generator=generator, dtype=torch.float64),
             torch.randint(0, 4, (4,), generator=generator)) for _ in range(steps)]


def train(model, data):
    """Per step, every gradient and buffer (SGD with momentum: steps depend on each other)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    results = []
    for x, y in data:
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        results.append([p.grad.clone() for p in model.parameters()] +
                       [b.clone() for b in model.buffers()])
        optimizer.step()
    return results


def assert_bitwise(expected, got):
    assert len(expected) == len(got)
    for step_a, step_b in zip(expected, got):
        assert len(step_a) == len(step_b)
        for a, b in zip(step_a, step_b):
            assert torch.equal(a, b)


def fitted_model(**options):
    options = {"link": SameMemoryLink(gbps=(1.0, 1.0)), "min_bytes": 0, "headroom": 0.0, **options}
    return fit(small_model(), budget="1MiB", **options)


def zero_(model):
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()


# -- deep copies ---------------------------------------------------------------------------------

def test_a_deep_copy_runs_its_own_weights():
    model = fitted_model()
    x = batches(1)[0][0]
    before = model(x).detach()
    twin = copy.deepcopy(model)
    assert torch.equal(twin(x), before)
    zero_(twin)
    assert not torch.equal(twin(x), before)          # the copy's weights, not the original's
    assert torch.equal(twin(x), torch.zeros_like(before))
    assert torch.equal(model(x), before)             # the original is untouched


def test_a_deep_copy_has_a_fresh_session_of_its_own_with_the_same_budget_and_options():
    trace = []
    model = fitted_model(trace=trace, say=print, force=OFFLOAD)
    train(model, batches(2))
    session = model.mucudnn_session
    assert session.steps > 0 and trace
    twin = copy.deepcopy(model)
    fresh = twin.mucudnn_session
    assert isinstance(fresh, FittedSession) and isinstance(fresh, OffloadSession)
    assert fresh is not session and fresh.steps == 0 and fresh.profile is None
    assert twin.forward.session is fresh and twin.forward.module is twin
    assert model.forward.session is session and model.forward.module is model
    assert fresh.fit_budget == session.fit_budget == MiB
    assert fresh.fit_options.keys() == session.fit_options.keys()
    assert fresh.fit_options["say"] is print                     # functions are shared
    assert fresh._link is not session._link                       # a link is the copy's own
    assert fresh.trace is not trace and fresh.trace == trace      # so is a trace list
    steps, events, copied = session.steps, len(trace), len(fresh.trace)
    train(twin, batches(2))
    assert session.steps == steps and len(trace) == events        # the copy records its own
    assert fresh.steps == 1 and len(fresh.trace) > copied


@pytest.mark.parametrize("force", [None, OFFLOAD, RECOMPUTE])
def test_a_deep_copy_trains_as_a_plain_copy_does(force):
    data = batches(4)
    plain = copy.deepcopy(small_model())
    reference = train(plain, data)
    model = fitted_model(**({} if force is None else {"force": force}))
    train(model, batches(2, seed=7))                     # the original has recorded and planned
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p, q in zip(twin.parameters(), small_model().parameters()):
            p.copy_(q)
        for b, c in zip(twin.buffers(), small_model().buffers()):
            b.copy_(c)
    assert_bitwise(reference, train(twin, data))


def test_an_ema_teacher_follows_its_own_weights():
    student = fitted_model()
    teacher = copy.deepcopy(student)
    plain_student, plain_teacher = small_model(), small_model()
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (student, plain_student)]
    for x, y in batches(3):
        for model, teacher_of, optimizer in ((student, teacher, optimizers[0]),
                                             (plain_student, plain_teacher, optimizers[1])):
            optimizer.zero_grad()
            with torch.no_grad():
                target = teacher_of(x).softmax(-1)
            loss = nn.functional.cross_entropy(model(x), y) + \
                nn.functional.mse_loss(model(x).softmax(-1), target)
            loss.backward()
            optimizer.step()
            with torch.no_grad():
                for t, s in zip(teacher_of.parameters(), model.parameters()):
                    t.mul_(0.9).add_(s, alpha=0.1)
        assert torch.equal(teacher(x), plain_teacher(x))
        assert not torch.equal(teacher(x), student(x))


def test_a_shallow_copy_of_the_session_is_fresh_too():
    session = fitted_model().mucudnn_session
    other = copy.copy(session)
    assert isinstance(other, FittedSession) and other is not session
    assert other.fit_options == session.fit_options and other.steps == 0


# -- pickle, torch.save ----------------------------------------------------------------------------

def saved_and_loaded(model):
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def test_torch_save_and_load_of_the_whole_fitted_module():
    model = fitted_model(say=print)
    data = batches(3)
    train(model, data[:2])
    x = data[2][0]
    before = model(x).detach()
    loaded = saved_and_loaded(model)
    assert type(loaded) is type(model)
    assert isinstance(loaded.forward, FittedForward) and loaded.forward.module is loaded
    assert loaded.mucudnn_session is loaded.forward.session
    assert loaded.mucudnn_session.steps == 0 and loaded.mucudnn_session.fit_budget == MiB
    assert torch.equal(loaded(x), before)
    zero_(loaded)
    assert torch.equal(model(x), before)
    assert torch.equal(loaded(x), torch.zeros_like(before))


def test_a_loaded_fitted_model_trains_as_the_plain_one():
    data = batches(3)
    reference = train(small_model(), data)
    loaded = saved_and_loaded(fitted_model(force=OFFLOAD))
    assert_bitwise(reference, train(loaded, data))
    assert loaded.mucudnn_session.steps == len(data) - 1   # the last ends at the next pack


def test_pickle_round_trip():
    model = fitted_model()
    x = batches(1)[0][0]
    loaded = pickle.loads(pickle.dumps(model))
    assert torch.equal(loaded(x), model(x)) and loaded.forward.module is loaded


def test_an_option_that_cannot_be_pickled_is_one_clear_error():
    model = fitted_model(say=lambda text: None)
    with pytest.raises(FitPickleError, match=r"say=<function .*cannot be pickled.*state_dict"):
        torch.save(model, io.BytesIO())
    with pytest.raises(pickle.PicklingError):
        pickle.dumps(model)
    assert isinstance(FitPickleError("x"), MucudnnError)
    # its state_dict saves: what the error advises
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)


# -- state_dict ------------------------------------------------------------------------------------

def test_state_dict_round_trip():
    model = fitted_model()
    data = batches(3)
    train(model, data[:2])
    plain = small_model(seed=5)
    state = model.state_dict()
    assert state.keys() == plain.state_dict().keys()
    plain.load_state_dict(state)
    x = data[2][0]
    model.eval(), plain.eval()
    assert torch.equal(plain(x), model(x))
    other = fitted_model()
    other.load_state_dict(plain.state_dict())
    other.eval()
    assert torch.equal(other(x), model(x))
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    buffer.seek(0)
    fresh = fitted_model()
    fresh.load_state_dict(torch.load(buffer))
    fresh.eval()
    assert torch.equal(fresh(x), model(x))


# -- fit again -------------------------------------------------------------------------------------

def test_fitting_a_fitted_model_again_replaces_its_session():
    model = fitted_model()
    data = batches(3)
    train(model, data[:1])
    first = model.mucudnn_session
    again = fit(model, budget="2MiB", link=SameMemoryLink(gbps=(1.0, 1.0)), min_bytes=0)
    assert again is model
    assert model.mucudnn_session is not first and model.mucudnn_session.fit_budget == 2 * MiB
    assert model.forward.inner is None           # not a fitted forward inside a fitted forward
    steps = first.steps
    reference = train(copy.deepcopy(small_model()), data)
    fresh = fit(small_model(), budget="1MiB", link=SameMemoryLink(gbps=(1.0, 1.0)), min_bytes=0)
    fresh = fit(fresh, budget="2MiB", link=SameMemoryLink(gbps=(1.0, 1.0)), min_bytes=0)
    assert_bitwise(reference, train(fresh, data))
    train(model, data[1:])
    assert first.steps == steps and model.mucudnn_session.steps == 1   # ended: 1 of 2


def test_a_forward_set_on_the_instance_is_kept():
    model = small_model()
    calls = []

    class Counting:
        def __init__(self, module):
            self.module = module

        def __call__(self, x):
            calls.append(1)
            return type(self.module).forward(self.module, x) * 2

    model.forward = Counting(model)
    x = batches(1)[0][0]
    expected = model(x).detach()
    fitted = fit(model, budget="1MiB", link=SameMemoryLink(gbps=(1.0, 1.0)), min_bytes=0)
    assert torch.equal(fitted(x), expected) and len(calls) == 2


# -- torch.compile ---------------------------------------------------------------------------------

BACKENDS = ["eager", "aot_eager", "inductor"]


def compiled(model, backend, **options):
    if backend == "inductor":
        pytest.importorskip("torch._inductor")
    return torch.compile(model, backend=backend, **options)


def run_or_skip_inductor(backend, call):
    """``call()``; under inductor, a skip where inductor itself cannot compile here."""
    try:
        return call()
    except CompiledModelError:
        raise
    except Exception as exc:  # noqa: BLE001
        if backend == "inductor" and "mucudnn" not in str(exc):
            pytest.skip(f"inductor does not compile here: {type(exc).__name__}: {exc}"[:200])
        raise


def test_fit_refuses_a_compiled_model():
    with pytest.raises(CompiledModelError, match=r"^mucudnn.torch.fit: the model is compiled "
                       r"\(torch.compile\); mucudnn.torch offloads eager PyTorch only: fit"):
        fit(torch.compile(small_model(), backend="eager"), budget="1GiB")


def test_fit_refuses_a_model_compiled_in_place_or_a_compiled_submodule():
    model = small_model()
    model.compile(backend="eager")
    with pytest.raises(CompiledModelError, match="the model is compiled"):
        fit(model, budget="1GiB")
    model = small_model()
    model[3] = torch.compile(model[3], backend="eager")
    assert compiled_parts(model) == ["3"]
    with pytest.raises(CompiledModelError, match="its submodule '3' is compiled"):
        fit(model, budget="1GiB")
    assert not hasattr(model, "mucudnn_session") and "forward" not in model.__dict__


@pytest.mark.parametrize("backend", BACKENDS)
def test_compiling_a_fitted_model_is_refused_when_it_runs(backend):
    torch._dynamo.reset()
    model = compiled(fitted_model(), backend)
    x = batches(1)[0][0]
    for _ in range(2):   # every call, and no recompilation storm
        with pytest.raises(CompiledModelError, match=r"^a model fitted by mucudnn.torch.fit ran "
                           r"under torch.compile; mucudnn.torch offloads eager PyTorch only"):
            run_or_skip_inductor(backend, lambda: model(x))
    # nothing of the session was left entered: plain autograd afterwards
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    plain = small_model()
    nn.functional.cross_entropy(plain(x), torch.zeros(4, dtype=torch.long)).backward()


def test_a_fitted_model_compiled_with_fullgraph_is_refused_by_dynamo_with_our_reason():
    torch._dynamo.reset()
    model = torch.compile(fitted_model(), backend="eager", fullgraph=True)
    with pytest.raises(Exception, match="mucudnn.torch refuses torch.compile"):
        model(batches(1)[0][0])


def test_a_fitted_model_compiled_in_place_is_refused_when_it_runs():
    torch._dynamo.reset()
    model = fitted_model()
    model.compile(backend="eager")
    with pytest.raises(CompiledModelError, match="ran under torch.compile"):
        model(batches(1)[0][0])


# -- torch.compile inside a session (session(...)): the session's hooks refuse when dynamo traces
# them (OffloadSession.__enter__, the module and pack hooks, the op recorder)

import mucudnn.torch as mt  # noqa: E402


def test_budget_is_the_earlier_name_of_session():
    assert mt.budget is mt.session


def no_session_left():
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    hooks = torch.nn.modules.module
    assert not hooks._global_forward_pre_hooks and not hooks._global_forward_hooks


def trains_plainly_afterwards():
    data = batches(2)
    reference = train(small_model(), data)
    model = fitted_model(force=OFFLOAD)
    assert_bitwise(reference, train(model, data))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("how", ["torch.compile", "model.compile"])
def test_a_compiled_model_run_under_a_session_is_refused(backend, how):
    torch._dynamo.reset()
    if how == "torch.compile":
        model = compiled(small_model(), backend)
    else:
        if backend == "inductor":
            pytest.importorskip("torch._inductor")
        model = small_model()
        model.compile(backend=backend)
    session = mt.session("1MiB", link=SameMemoryLink(gbps=(1.0, 1.0)), min_bytes=0)
    x = batches(1)[0][0]
    for _ in range(2):
        with pytest.raises(CompiledModelError, match="ran under torch.compile; mucudnn.torch "
                           "offloads eager PyTorch only"):
            def step():
                with session:
                    model(x).sum().backward()
            run_or_skip_inductor(backend, step)
        no_session_left()
    trains_plainly_afterwards()


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_compiled_step_that_enters_a_session_is_refused(backend):
    torch._dynamo.reset()
    model = small_model()
    session = mt.session("1MiB", link=SameMemoryLink(gbps=(1.0, 1.0)), min_bytes=0)

    def step(x):
        with session:
            return model(x).sum()

    step = torch.compile(step, backend=backend)
    with pytest.raises(CompiledModelError, match="ran under torch.compile"):
        step(batches(1)[0][0])
    no_session_left()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["forced", "budget"])
def test_a_compiled_region_without_modules_offloads_its_saved_tensors_eagerly(backend, kind):
    # no module hook for dynamo to trace, no add for the op recorder: the compiled graph runs,
    # and the session packs what it saves at run time; gradients equal the compiled plain run's
    torch._dynamo.reset()
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(32, 32, generator=generator, dtype=torch.float64)
    w0 = torch.randn(32, 32, generator=generator, dtype=torch.float64)

    def gradients(session):
        w = w0.clone().requires_grad_()
        function = compiled(lambda a: ((a @ w).sigmoid() @ w).tanh().sum(), backend)
        optimizer = torch.optim.SGD([w], lr=0.1)
        results = []
        for _ in range(4):
            optimizer.zero_grad()
            with session or contextlib.nullcontext():
                loss = run_or_skip_inductor(backend, lambda: function(x))
            loss.backward()
            results.append([w.grad.clone()])
            optimizer.step()
        return results

    trace = []
    if kind == "forced":
        session = OffloadSession(force=OFFLOAD, recompute=False,
                                 link=SameMemoryLink(gbps=(1.0, 1.0)), min_bytes=0, trace=trace)
    else:   # recording, then a plan that offloads one of the three saved tensors
        session = mt.session(70000, link=SameMemoryLink(gbps=(1.0, 1.0)), min_bytes=0, headroom=0.0,
                         trace=trace)
    expected = gradients(None)
    assert_bitwise(expected, gradients(session))
    assert any(event[:1] == ("offload",) for event in trace)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_an_add_in_a_compiled_region_under_a_recording_session_is_refused(backend):
    torch._dynamo.reset()
    w = torch.randn(8, 8, dtype=torch.float64, requires_grad=True)
    function = torch.compile(lambda a: ((a @ w).sigmoid() + a).sum(), backend=backend)
    session = mt.session("1MiB", link=SameMemoryLink(gbps=(1.0, 1.0)), min_bytes=0)
    with pytest.raises(CompiledModelError, match="op recorder ran under torch.compile"):
        with session:
            function(torch.randn(8, 8, dtype=torch.float64))
    no_session_left()
