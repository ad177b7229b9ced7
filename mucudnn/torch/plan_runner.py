"""The plans a session's lifecycle asks for (:mod:`.lifecycle`), made inline or on a thread of
their own (torch-free).

A :class:`PlanRequest` says what to plan and for what; :class:`PlanMaker` makes it with
:mod:`.planner`'s solves and hands back a :class:`PlanResult`; a runner runs the maker:

- :class:`InlineRunner` at once, in the caller's thread (links without a GPU, tests, off-GPU
  replays): the plan is ready at the step boundary that asked for it;
- :class:`BackgroundRunner` on a daemon thread, so that no training step waits for a solver (the
  planner is pure Python and CBC subprocesses): the plan is ready at a later boundary;
  :class:`~.plan_worker.ProcessRunner`, the session's on a GPU, hands it on from that thread to a
  worker process, so that the planner's Python does not hold the training thread's interpreter
  lock.

Either hands back, from ``ready()``, each request with its result or the exception its making
raised, in the order asked. One maker serves one session, one request at a time (a runner runs
them in turn): it remembers the highest target found to have no plan.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, replace

from ..errors import InfeasibleError, MucudnnError
from ..sizes import describe_size
from . import planner
from . import planner_fast
from . import planner_stage
from . import planning
from .planner import OffloadPlan, StepProfile

#: the kinds of request
FIRST = "first plan"        # the recorded profile's plan (its stage weighed; smaller headrooms)
TRIALS = "trial plans"      # planning.trial_plans: the plans a trial runs against the one in force
LOWER = "lower target"      # after flushes: the plan for half the headroom less (or a quarter)
REPLAN = "replan"           # after a planned step ran out of memory: the plan for a lower target


@dataclass(frozen=True)
class StageCandidate:
    """A stage the recording's leading chain allows (stage.py): the planner's :class:`Stage`, the
    chain's batch, what the session needs to run it (``payload``: its modules and their
    container; opaque here), and each of its calls' recorded time (``call_ms``; None where the
    recording did not time it: its rerun's time, :attr:`Stage.forward_ms`, counts it 0)."""

    stage: planner_stage.Stage
    batch: int
    payload: object = None
    call_ms: tuple = ()


def least_rerun_times(recorded: list[tuple[StageCandidate, ...]]) -> tuple[StageCandidate, ...]:
    """The last recording's stage candidates (``recorded``: each recording's, in order), each
    with its rerun time (:attr:`Stage.forward_ms`) the sum over its calls of the least time any
    recording timed the call in, as :func:`planner.least_times` takes the recipes' (a host that
    fell behind in one recording stretched its times there, never shortened them; a first
    recording leaves its chain's first call untimed)."""
    def chain(candidate: StageCandidate) -> tuple:
        # the same chain on the same input: a recording of another batch or image size timed
        # other work
        stage = candidate.stage
        return (candidate.batch, stage.input_bytes, stage.modules, stage.first_group,
                stage.end_group, stage.recorded_chunks, len(candidate.call_ms))
    least = []
    for candidate in recorded[-1] if recorded else ():
        timings = [other.call_ms for each in recorded for other in each
                   if chain(other) == chain(candidate)]
        calls = [[ms for ms in at if ms is not None] for at in zip(*timings)]
        fastest = sum(min(at, default=0.0) for at in calls) if calls else \
            candidate.stage.forward_ms
        least.append(candidate if fastest == candidate.stage.forward_ms else
                     replace(candidate, stage=replace(candidate.stage, forward_ms=fastest)))
    return tuple(least)


@dataclass(frozen=True, eq=False)
class PlanRequest:
    """What to plan (``kind``) on ``profile`` for ``target`` bytes. Compared by identity: a
    result answers the request it was made for, not an equal one asked later."""

    kind: str
    profile: StepProfile
    target: int
    budget: int | None = None
    headroom: float = 0.0
    #: TRIALS: the plan in force, and the larger targets to try (smaller headrooms)
    plan: OffloadPlan | None = None
    larger_budgets: tuple = ()
    keep_apart: bool = False
    #: LOWER: the least peak of the plans that flushed; REPLAN: the modelled peak of the plan
    #: that ran out of memory (for its line)
    peak: int | None = None
    #: FIRST: the stages to weigh, and the session's ``stage`` setting (True, False, "always");
    #: LOWER: the same stages, weighed again at the lower target, on ``recorded``
    candidates: tuple = ()
    staging: bool | str = True
    #: LOWER: the profile the FIRST request weighed ``candidates`` on (the recorded one)
    recorded: StepProfile | None = None
    #: FIRST: the plain plan by the fast planner's quick construction (one-group changes from
    #: everything kept: a plan in a few hundredths of a second where the full search takes a
    #: second), the full search's then coming with the TRIALS request (``refine``); only for a
    #: session that runs trials, since nothing else would bring the full search's plan in
    quick: bool = False
    #: TRIALS: ``plan`` is a quick construction's: the full search's plan is made and replaces
    #: it where predicted faster by planner.TRIAL_MIN_GAIN (PlanResult.refined)
    refine: bool = False


@dataclass(frozen=True)
class PlanResult:
    """What a :class:`PlanRequest` found."""

    request: PlanRequest
    #: the plan made (None: none met the target)
    plan: OffloadPlan | None = None
    #: the target ``plan`` was made for
    target: int | None = None
    #: FIRST: why the request's target had no plan (then ``plan``, where any, is for a smaller
    #: headroom: :func:`planning.plan_with_less_headroom`)
    error: MucudnnError | None = None
    #: FIRST: the stage taken (its ``chunks`` set) and the profile plans are made on from now
    #: (the staged one; else the request's)
    stage: StageCandidate | None = None
    profile: StepProfile | None = None
    #: TRIALS: (how it was made, plan), in the order to run them
    trials: tuple = ()
    #: LOWER: no plan met the lower target (nor will any lower one): no lowering again
    lowerings_spent: bool = False
    #: FIRST: ``plan`` is the quick construction's (the request's ``quick``, no stage taken, and
    #: the construction met the target: where it fell short, the full search made ``plan``)
    quick: bool = False
    #: TRIALS with ``refine``: the full search's plan, predicted faster than the quick one in
    #: force, which it replaces (the trial's plans are made against it); None: the quick stays
    refined: OffloadPlan | None = None
    #: wall seconds the making took
    seconds: float = 0.0


class PlanMaker:
    """Makes a :class:`PlanRequest`'s plan with the session's ``lookahead``, the planner's
    ``method`` (planning.py: the fast one, or the ILP with CBC's ``time_limit_s`` a solve).
    :meth:`solve` is its one call of the planner for a target (tests replace it);
    :attr:`no_plan_at` is the highest target found to have no plan on the current profile: no
    target at or below it is solved again."""

    def __init__(self, lookahead: int = 2, time_limit_s: float | None = 20,
                 method: str = planning.FAST):
        self.lookahead = lookahead
        self.time_limit_s = time_limit_s
        self.method = method
        self.no_plan_at: int | None = None
        self._profile: StepProfile | None = None
        #: :meth:`solve` makes the quick construction's plan (set by :meth:`_quick_plan_for`)
        self.quick = False
        #: while :attr:`quick` is set: the searches that made :meth:`solve`'s plans
        #: (planner_fast.plan_modes' ``made_by``)
        self._made_by: list = []

    def __call__(self, request: PlanRequest) -> PlanResult:
        start = time.perf_counter()
        make = {FIRST: self._first, TRIALS: self._trials, LOWER: self._lower,
                REPLAN: self._replan}[request.kind]
        result = make(request)
        return replace(result, seconds=time.perf_counter() - start)

    # --- the solves ------------------------------------------------------------------------
    def solve(self, profile: StepProfile, target: int, explain: bool = True) -> OffloadPlan:
        """:func:`planning.plan_with_prefetch` for ``target`` (its errors as it raises them);
        while :attr:`quick` is set, the fast planner's construction from everything kept alone
        where it meets the target (else its full search, as without)."""
        start = [planner.KEEP] * len(profile.groups) if self.quick else None
        return planning.plan_with_prefetch(profile, target, self.lookahead, self.time_limit_s,
                                          explain=explain, method=self.method, start=start,
                                          quick=self.quick,
                                          made_by=self._made_by if self.quick else None)

    def plan_for(self, profile: StepProfile, target: int, explain: bool = True) -> OffloadPlan:
        """The plan for ``target``. Where none meets it, :class:`InfeasibleError` (with
        ``explain``: saying the least peak, solved for) and :attr:`no_plan_at` raised to it."""
        if profile is not self._profile:   # another profile (a stage taken): nothing known yet
            self._profile, self.no_plan_at = profile, None
        if self.no_plan_at is not None and target <= self.no_plan_at:
            raise InfeasibleError(f"no plan within {describe_size(target)}: none within "
                                  f"{describe_size(self.no_plan_at)} either")
        try:
            return self.solve(profile, target, explain)
        except InfeasibleError:
            self.no_plan_at = max(target, self.no_plan_at or 0)
            raise

    def _quick_plan_for(self, profile: StepProfile, target: int) -> tuple[OffloadPlan, bool]:
        """:meth:`plan_for` with :attr:`quick` set around it (its :meth:`solve` the quick
        construction's where that meets the target, else the full search's), and whether the
        quick construction made the plan (not where it fell short, nor where everything kept
        fits: no search then)."""
        self.quick, self._made_by = True, []
        try:
            plan = self.plan_for(profile, target)
            return plan, self._made_by[-1:] == [planner_fast.QUICK]
        finally:
            self.quick = False

    # --- the kinds of request --------------------------------------------------------------
    def _first(self, request: PlanRequest) -> PlanResult:
        """The plan for the request's target (a stage weighed first where the recording allows
        one: :meth:`choose_stage`; else, with the request's ``quick``, the quick construction's
        where the fast planner runs); where none meets it, an :class:`InfeasibleError`'s
        smaller headrooms (:func:`planning.plan_with_less_headroom`)."""
        profile, target, plan, stage = request.profile, request.target, None, None
        if request.candidates:
            plan, chosen = self.choose_stage(profile, target, request.candidates, request.staging)
            if chosen is not None:
                stage, profile = chosen
        quick = request.quick and plan is None and self.method == planning.FAST
        try:
            if quick:   # no stage's plan: a plain one, quick
                plan, quick = self._quick_plan_for(profile, target)
            elif plan is None:
                plan = self.plan_for(profile, target)
        except MucudnnError as exc:   # infeasible, or CBC failed
            lower = None
            if request.budget is not None:
                lower = planning.plan_with_less_headroom(
                    exc, request.budget, request.headroom,
                    lambda smaller: self.plan_for(profile, smaller, explain=False))
            # the error without its traceback: made inline, that holds this frame (``exc``
            # among its locals: a cycle) and the training thread's frames below it, the ended
            # step and the next one's input, until the collector finds the cycle
            return PlanResult(request, lower, lower.target if lower is not None else target,
                              error=exc.with_traceback(None), stage=stage, profile=profile)
        return PlanResult(request, plan, target, stage=stage, profile=profile, quick=quick)

    def choose_stage(self, profile: StepProfile, target: int, candidates, staging
                     ) -> tuple[OffloadPlan | None, tuple | None]:
        """Whether a plan stages the leading chain (stage.py), weighed once on the recorded
        profile: the plain plan for ``target`` against each candidate's plan on its
        :func:`planner_stage.staged_profile` (its micro-batches :func:`planner_stage.stage_chunks`). A staged
        plan is taken where it is predicted faster by :data:`planner_stage.STAGE_MIN_GAIN` or the
        plain one has none; where none has a plan, the candidate of the least peak, if lower
        than the plain profile's (its headroom is then lowered as ever). Returns (the plan taken,
        None: none meets ``target``; (the stage taken, its profile), None where none is)."""
        plain = self._plan_or_none(profile, target)
        options = self._stage_options(profile, target, candidates)
        planned = [option for option in options if option[0] is not None]
        if planned:
            best = min(planned, key=lambda option: option[0].predicted_ms)
            if plain is not None and staging != "always" and \
                    best[0].predicted_ms >= plain.predicted_ms * (1 - planner_stage.STAGE_MIN_GAIN):
                return plain, None
        elif plain is None and options:
            peaks = [planning.least_peak(option[1], self.lookahead) for option in options]
            lowest = min(peaks)
            best = options[peaks.index(lowest)]
            if lowest >= planning.least_peak(profile, self.lookahead) and staging != "always":
                return None, None
        else:
            return plain, None
        plan, staged, candidate = best
        return plan, (candidate, staged)

    def _plan_or_none(self, profile: StepProfile, target: int) -> OffloadPlan | None:
        try:
            return self.solve(profile, target, explain=False)
        except MucudnnError:
            return None

    def _stage_options(self, profile: StepProfile, target: int, candidates) -> list:
        """(the plan for ``target`` or None, the staged profile, the candidate with its
        micro-batches) of each candidate that stages ``profile`` in at least 2 micro-batches."""
        options = []
        for candidate in candidates:
            chunks = planner_stage.stage_chunks(profile, candidate.stage)
            if chunks is None or min(chunks, candidate.batch) < 2:
                continue
            candidate = replace(candidate,
                                stage=replace(candidate.stage, chunks=min(chunks, candidate.batch)))
            staged = planner_stage.staged_profile(profile, candidate.stage)
            if staged is not None:   # None: it would leave the step no group to plan
                options.append((self._plan_or_none(staged, target), staged, candidate))
        return options

    def _staged_lowering(self, request: PlanRequest, target: int,
                         plan: OffloadPlan | None) -> PlanResult | None:
        """Where the recording's stages are weighed again (``request.candidates``, on
        ``request.recorded``): the fastest plan for ``target`` of a stage other than the one in
        force, where it beats ``plan`` (the stage in force's, None: none) by
        :data:`planner_stage.STAGE_MIN_GAIN`, with that stage and its profile; else None. A
        lower target can be met faster by a longer stage than by moving more of the stage in
        force's groups (VGG-16 N=176 under 6.5 GiB: the recording's first block staged flushes;
        for less, both blocks staged run 159 ms where moving more runs 201)."""
        if not request.candidates or request.recorded is None or request.staging is False:
            return None
        planned = [option for option in
                   self._stage_options(request.recorded, target, request.candidates)
                   if option[0] is not None and option[1] != request.profile]
        if not planned:
            return None
        best, staged, candidate = min(planned, key=lambda option: option[0].predicted_ms)
        if plan is not None and \
                best.predicted_ms >= plan.predicted_ms * (1 - planner_stage.STAGE_MIN_GAIN):
            return None
        return PlanResult(request, best, target, stage=candidate, profile=staged)

    def trial_plans(self, request: PlanRequest) -> list:
        """:func:`planning.trial_plans` for the request's plan (tests replace it)."""
        return planning.trial_plans(request.profile, request.target, request.plan,
                                   self.lookahead, self.time_limit_s, request.larger_budgets,
                                   keep_apart=request.keep_apart, method=self.method)

    def _trials(self, request: PlanRequest) -> PlanResult:
        """:meth:`trial_plans` against the plan in force; with ``refine`` (that plan is a quick
        construction's), the full search's plan where it is predicted faster by
        :data:`planner.TRIAL_MIN_GAIN` (``refined``: it replaces the quick one) and the trial's
        plans made against it instead."""
        refined = self._refined(request) if request.refine else None
        if refined is None:
            return PlanResult(request, request.plan, request.target,
                              trials=tuple(self.trial_plans(request)))
        others = [(label, plan) for label, plan in self.trial_plans(replace(request, plan=refined))
                  if plan != request.plan]
        return PlanResult(request, request.plan, request.target, trials=tuple(others),
                          refined=refined)

    def _refined(self, request: PlanRequest) -> OffloadPlan | None:
        """The full search's plan for the request's target where it beats the request's
        (a quick construction's) by :data:`planner.TRIAL_MIN_GAIN`, else None."""
        try:
            full = self.plan_for(request.profile, request.target, explain=False)
        except MucudnnError:   # none, or CBC failed: the quick plan stays alone
            return None
        if full == request.plan or \
                full.predicted_ms >= request.plan.predicted_ms * (1 - planner.TRIAL_MIN_GAIN):
            return None
        return replace(full, target=request.plan.target)

    def _lower(self, request: PlanRequest) -> PlanResult:
        """The plan for the request's target less half the headroom; where the plan for a
        quarter less peaks below the request's ``peak`` (the least of the plans that flushed:
        it gives room all the same) and is predicted faster by
        :data:`planner.LOWERING_MIN_GAIN`, that one (a plan's time steps up at some peaks, and
        a lowering by half the headroom may pass a step that a quarter does not); where another
        of the recording's stages meets it faster, that stage's plan
        (:meth:`_staged_lowering`). None where no plan meets the lower target, nor then any
        lower one (``lowerings_spent``)."""
        profile = request.profile
        step = int(request.headroom / 2 * request.budget)
        target = request.target - step
        try:
            plan = self.plan_for(profile, target)
        except MucudnnError:
            plan = None
        staged = self._staged_lowering(request, target, plan)
        if staged is not None:
            return staged
        if plan is None:
            return PlanResult(request, lowerings_spent=True)
        nearer = target + step // 2
        try:
            near = self.plan_for(profile, nearer, explain=False)
        except MucudnnError:   # CBC failed (a lower target has a plan)
            near = None
        if near is not None and near.peak < request.peak and \
                near.predicted_ms < plan.predicted_ms * (1 - planner.LOWERING_MIN_GAIN):
            return PlanResult(request, near, nearer)
        return PlanResult(request, plan, target)

    def _replan(self, request: PlanRequest) -> PlanResult:
        try:
            return PlanResult(request, self.plan_for(request.profile, request.target),
                              request.target)
        except MucudnnError:
            return PlanResult(request, None, request.target)


def _made(request: PlanRequest, work) -> PlanResult | BaseException:
    try:
        return work(request)
    except Exception as exc:   # handed to the training thread, raised there
        return exc


class InlineRunner:
    """Makes each request as it is submitted, in the caller's thread."""

    background = False

    def __init__(self):
        self._done: deque = deque()

    def submit(self, request: PlanRequest, work) -> None:
        self._done.append((request, _made(request, work)))

    def ready(self) -> list:
        """(request, its :class:`PlanResult` or the exception its making raised), each made
        since the last call, in the order submitted."""
        done, self._done = list(self._done), deque()
        return done

    def busy(self) -> bool:
        return False

    def wait(self, timeout: float | None = None) -> bool:
        return True


class BackgroundRunner(InlineRunner):
    """Makes the requests in turn on a daemon thread, which starts at a submit and ends when
    nothing is left to make."""

    background = True

    def __init__(self, name: str = "mucudnn-planner"):
        super().__init__()
        self.name = name
        self._queue: deque = deque()
        self._lock = threading.Condition()
        self._thread: threading.Thread | None = None

    def submit(self, request: PlanRequest, work) -> None:
        with self._lock:
            self._queue.append((request, work))
            if self._thread is None:
                self._thread = threading.Thread(target=self._drain, name=self.name, daemon=True)
                self._thread.start()

    def _drain(self) -> None:
        while True:
            with self._lock:
                if not self._queue:
                    self._thread = None
                    self._lock.notify_all()
                    return
                request, work = self._queue.popleft()
            made = self._make(request, work)
            with self._lock:
                self._done.append((request, made))
                self._lock.notify_all()

    def _make(self, request: PlanRequest, work) -> PlanResult | BaseException:
        """``request`` made by ``work`` (on the runner's thread)."""
        return _made(request, work)

    def ready(self) -> list:
        with self._lock:
            return super().ready()

    def busy(self) -> bool:
        """Whether a request is being made or waits to be."""
        with self._lock:
            return self._thread is not None

    def wait(self, timeout: float | None = None) -> bool:
        """Blocks until every request submitted is made (True), or ``timeout`` seconds passed
        (False): for benchmarks and tests, never for a training step."""
        with self._lock:
            return self._lock.wait_for(lambda: self._thread is None, timeout)
