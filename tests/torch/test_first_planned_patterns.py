"""The first planned step after steps run as recorded (offload_session.py's
``_start_ops_if_due``), on the training loops users write (training_patterns.py).

Each case's loop runs under a budget session whose first plan is answered by hand
(:class:`PlanAfter`, a ``ManualRunner`` of test_lifecycle.py) a set number of step boundaries
after the recording asked for it, so that steps run as recorded first and the ``with`` of the
first planned step is entered under their modes (no recompute); the plan is fixed by the
recorded profile (every group with a recipe recomputed, its sources kept, the rest offloaded),
so nothing depends on the recording's measured times or on the machine. Four ways to enter the
session (:data:`WAYS`):

- ``per_step``: the loop's own ``with`` around each forward (the backward outside it);
- ``spanning``: one ``with`` entered at the first step run as recorded and left after the last
  step (a training loop inside one ``with``; the loop's own ``with`` nested in it), so the plan
  takes over in the middle of it;
- ``mode_inside``: the script's own torch function mode entered just inside each ``with``;
- ``mode_outside``: the script's own torch function mode entered just outside each ``with``.

Every case's losses, gradients, buffers and parameters must be the plain run's bit for bit
(:func:`training_patterns.compare`); each outermost ``with`` must leave the stack of torch
function modes as it found it; and each step must run its groups in the modes, keeping
(``g.wanted == RECOMPUTE and g.mode == KEEP``) exactly the groups, that a control run does: the
same case under a session whose op recorder is entered at every ``with`` (as one entered under
modes that recompute is). So the first planned step keeps no group the control recomputes
through an add or a cat; except under the script's own mode inside the ``with``, where the
recorder stays out of the first planned step: kept there, never a wrong gradient.
:func:`test_the_differential_reaches_first_planned_steps_that_recompute_through_ops` holds the
cases to reaching such groups, which the first planned step would keep without the recorder
entered mid-``with``.
"""

import dataclasses

import pytest

torch = pytest.importorskip("torch")
if not hasattr(torch, "autograd") or not hasattr(torch.autograd, "graph"):
    pytest.skip("needs a real PyTorch", allow_module_level=True)

from torch.overrides import TorchFunctionMode  # noqa: E402

import training_patterns as patterns  # noqa: E402
from mucudnn.torch.offload_session import OffloadSession  # noqa: E402
from mucudnn.torch.plan_runner import FIRST, PlanResult  # noqa: E402
from mucudnn.torch.planner import KEEP, OFFLOAD, RECOMPUTE, OffloadPlan  # noqa: E402
from session_helpers import RecordingLink  # noqa: E402
from test_lifecycle import ManualRunner  # noqa: E402

WAYS = ("per_step", "spanning", "mode_inside", "mode_outside")
#: the training-pattern cases run: not ``fit``'s (the loop enters no ``with`` there), nor a
#: gradient penalty's (its recording step is the penalty's forward, which has no recipe: no plan
#: recomputes)
CASES = [case for case in map(patterns.make_case, range(60))
         if case.session != "fit" and not case.has("create_graph")][:20]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """As test_training_patterns.py: tiny tensors, one thread (both runs alike)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def fixed_plan(request) -> PlanResult:
    """The recorded profile's plan, without the planner: a group with a recipe recomputed, a
    source of one kept, any other offloaded where it can be."""
    groups = request.profile.groups
    sources = {s for g in groups if g.recompute_ms is not None for s in g.recompute_source}
    modes = tuple(RECOMPUTE if g.recompute_ms is not None else
                  KEEP if gid in sources or not g.offloadable else OFFLOAD
                  for gid, g in enumerate(groups))
    peak = sum(g.nbytes for g in groups)
    plan = OffloadPlan(modes, 2, peak, 1.0, 0, simulated_ms=1.0, target=request.target)
    return PlanResult(request, plan=plan, target=request.target)


class PlanAfter(ManualRunner):
    """Answers the first plan's request with :func:`fixed_plan` at the ``boundaries``-th step
    boundary that polls it (the lifecycle polls once a boundary while it waits); any other
    request waits for ever (none is asked without trials, flushes or a step out of memory)."""

    def __init__(self, boundaries: int):
        super().__init__()
        self.boundaries, self.polled = boundaries, 0

    def ready(self):
        if self.waiting and self.waiting[0][0].kind == FIRST:
            self.polled += 1
            if self.polled >= self.boundaries:
                request, _ = self.waiting.pop(0)
                self.done.append((request, fixed_plan(request)))
        return super().ready()


class Passing(TorchFunctionMode):
    """The script's own torch function mode: every function passed through."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


@dataclasses.dataclass
class Logged:
    """A step as the session ran it: whether it recorded, the modes in force, each group's mode,
    the gids its plan recomputes that it kept, and those it recomputes through a recorded op
    (an add, a cat)."""

    profiling: bool
    modes: list | None
    group_modes: list
    kept: list
    through_ops: list

    @classmethod
    def of(cls, session: OffloadSession, step) -> "Logged":
        return cls(step.profiling, session.modes, [g.mode for g in step.groups],
                   [g.gid for g in step.groups if g.wanted == RECOMPUTE and g.mode == KEEP],
                   [g.gid for g in step.groups if g.mode == RECOMPUTE
                    and any(call.op is not None for call in g.recipe.calls)])

    @property
    def planned(self) -> bool:   # under a plan that recomputes
        return not self.profiling and self.modes is not None and RECOMPUTE in self.modes

    @property
    def as_recorded(self) -> bool:
        return not self.profiling and self.modes is not None and RECOMPUTE not in self.modes


class StepLog:
    """Per step of the session, :class:`Logged`; per outermost ``with`` left, whether the stack
    of torch function modes was as it found it."""

    def __init__(self, session: OffloadSession):
        self.session, self.steps, self.stacks = session, [], []
        close = session._close_step

        def closed(failed, out_of_memory):
            self.steps.append(Logged.of(session, session._step))
            return close(failed, out_of_memory)
        session._close_step = closed

    def finish(self) -> None:
        """After the loop: the last step too (no step follows to close it), where it saved."""
        if self.session._step.groups:
            self.steps.append(Logged.of(self.session, self.session._step))

    def first_planned(self) -> int | None:
        """The index of the first step run under a plan that recomputes."""
        return next((index for index, step in enumerate(self.steps) if step.planned), None)


def function_modes() -> tuple:
    """The thread's stack of torch function modes, innermost last (the objects)."""
    return tuple(torch._C._get_function_stack_at(index)
                 for index in range(torch._C._len_torch_function_stack()))


class Entered:
    """The session as the loop enters it (``way`` of :data:`WAYS`); ``stage`` read through.
    Each outermost ``with`` of the session and each ``with`` of the script's mode must leave the
    stack of torch function modes as it found it, the same objects (:attr:`StepLog.stacks`):
    where the recorder went above the script's mode, the mode's exit would pop the recorder and
    leave itself on."""

    def __init__(self, session: OffloadSession, way: str, log: StepLog):
        self.session, self.way, self.log = session, way, log
        self.spanning = False   # the spanning ``with`` is entered
        self.spanning_from = None   # the log's index of the first step run inside it
        self.below: list = []   # per ``with`` entered (the session's, the mode's): the stack then
        self.modes: list = []

    @property
    def stage(self):
        return self.session.stage

    def _enter_mode(self):
        self.below.append(function_modes())
        self.modes.append(Passing().__enter__())

    def _exit_mode(self, exc_info):
        self.modes.pop().__exit__(*exc_info)
        self.log.stacks.append(function_modes() == self.below.pop())

    def _enter_session(self):
        self.below.append(function_modes())
        self.session.__enter__()

    def _exit_session(self, exc_info):
        self.session.__exit__(*exc_info)
        below = self.below.pop()
        if self.session._depth == 0:   # the outermost: a nested one leaves the recorder on
            self.log.stacks.append(function_modes() == below)

    def __enter__(self):
        session, log = self.session, self.log
        if self.way == "spanning" and not self.spanning and session.offloads_as_recorded:
            # the step open now (its backward ran) ends at the next one's first module or save
            self.spanning = True
            self.spanning_from = len(log.steps) + bool(session._step.groups)
            self._enter_session()
        if self.way == "mode_outside":
            self._enter_mode()
        self._enter_session()
        if self.way == "mode_inside":
            self._enter_mode()
        return self

    def __exit__(self, *exc_info):
        if self.way == "mode_inside":
            self._exit_mode(exc_info)
        self._exit_session(exc_info)
        if self.way == "mode_outside":
            self._exit_mode(exc_info)
        return False

    def close(self):
        """After the loop: the spanning ``with`` left."""
        if self.spanning:
            self.spanning = False
            self._exit_session((None, None, None))


def budget_session(case, model, boundaries: int, control: bool) -> OffloadSession:
    """One recording step (the profile's only use is :func:`fixed_plan`'s), then the steps run
    as recorded until :class:`PlanAfter` answers."""
    # replay off: a step that replays leaves the op recorder off and keeps a group whose
    # template does not hold, so the run and its control would keep different groups for reasons
    # of replay's, not of the recorder's entry this compares (replay: test_replay.py)
    session = OffloadSession(budget=max(1, patterns.saved_bytes(case, model) // 2),
                             link=RecordingLink(), min_bytes=0, headroom=0.0, strict=False,
                             stage=False, trials=False, record_steps=1, replay=False)
    session.lifecycle.runner = PlanAfter(boundaries)
    if control:   # the op recorder entered at every ``with``, as under modes that recompute
        session._recipes_used = lambda: True
    return session


def plain_run(case) -> patterns.Run:
    model, parts = patterns.build_model(case)
    return patterns.train(case, model, parts)


def run(case, way: str, boundaries: int, control: bool, plain: patterns.Run):
    """The case trained under a session entered ``way``: (its outcome against the ``plain``
    run, its :class:`StepLog`, the :class:`Entered`)."""
    model, parts = patterns.build_model(case)
    before = patterns._global_state()
    session = budget_session(case, model, boundaries, control)
    log = StepLog(session)
    entered = Entered(session, way, log)
    try:
        ours = patterns.train(case, model, parts, entered)
    finally:
        entered.close()
    log.finish()
    after = patterns._global_state()
    if after != before:
        patterns._put_back(before)
        left = ", ".join(kind for kind in before if before[kind] != after[kind])
        return patterns.Outcome(case, "failed", f"state left behind: {left}"), log, entered
    return patterns.compare(case, plain, ours), log, entered


def boundaries_for(case, way: str) -> int:
    """The boundaries polled until the plan is answered, the one that asks for it the first:
    one step run as recorded; one more where the spanning ``with`` is entered (at the second
    step run as recorded: at the first one's ``with`` the recording had not ended yet), and
    where a loop step is two steps of the session (micro-batches)."""
    return 2 + (way == "spanning") + case.has("accumulate")


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("case", CASES, ids=[case.label for case in CASES])
def test_the_first_planned_step_after_steps_run_as_recorded_trains_as_plain_pytorch(case, way):
    boundaries, plain = boundaries_for(case, way), plain_run(case)
    outcome, log, entered = run(case, way, boundaries, False, plain)
    assert outcome.ok, f"{outcome.verdict}: {outcome.detail}"
    assert log.stacks and all(log.stacks), "a with left the stack of torch function modes changed"
    control_outcome, control, _ = run(case, way, boundaries, True, plain)
    assert control_outcome.ok, f"control {control_outcome.verdict}: {control_outcome.detail}"
    first = log.first_planned()
    if first is None:   # too few whole steps for a plan (exceptions, skipped backwards)
        assert control.first_planned() is None
        return
    assert any(step.as_recorded for step in log.steps[:first])
    if way == "spanning":   # entered under modes without recompute: the plan takes over in it
        assert entered.spanning_from is not None and entered.spanning_from <= first
    if way != "mode_inside":
        assert not set(log.steps[first].kept) & set(control.steps[first].through_ops)
    assert [(s.profiling, s.modes) for s in log.steps] == \
        [(s.profiling, s.modes) for s in control.steps]
    for step, controlled in zip(log.steps, control.steps):
        if way == "mode_inside":   # the recorder out while the script's mode is above it
            assert set(controlled.kept) <= set(step.kept)
            assert all(mode == other or (mode == KEEP and other == RECOMPUTE)
                       for mode, other in zip(step.group_modes, controlled.group_modes))
        else:
            assert (step.group_modes, step.kept, step.through_ops) == \
                (controlled.group_modes, controlled.kept, controlled.through_ops)


def test_the_differential_reaches_first_planned_steps_that_recompute_through_ops():
    """The cases above are no test of the new path unless some first planned steps recompute
    groups whose recipe runs a recorded op (an add, a cat), and unless, with the recorder never
    entered mid-``with``, those steps would keep them: with the loop's ``with`` per step, and
    with one ``with`` where a step ran as recorded before the plan took over."""
    for way in ("per_step", "spanning"):
        reached, would_keep = 0, 0
        for case in CASES:
            boundaries, plain = boundaries_for(case, way), plain_run(case)
            _, log, entered = run(case, way, boundaries, False, plain)
            first = log.first_planned()
            if first is None or not log.steps[first].through_ops or \
                    way == "spanning" and not entered.spanning_from < first:
                continue
            reached += 1
            with pytest.MonkeyPatch.context() as monkeypatch:
                monkeypatch.setattr(OffloadSession, "_start_ops_if_due",
                                    lambda self, step: setattr(step, "ops_looked_at", True))
                _, without, _ = run(case, way, boundaries, False, plain)
            would_keep += set(log.steps[first].through_ops) <= set(without.steps[first].kept)
        # (not every one: where the plan took over in a step whose graph was dropped without a
        # backward, the next, logged first, entered its ``with`` under modes that recompute)
        assert would_keep >= 3, (way, reached, would_keep)
