"""The life of a session's plan: record, plan, trial, watch, lower, replan, fall back (torch-free).

One controller, :class:`Lifecycle` (its trials and the watch of the plan kept in
:class:`TrialsAndWatch`), in one of these states (:attr:`Lifecycle.state`):

- ``fixed``: modes given, every group forced, or no budget: nothing is planned;
- ``recording``: the first :data:`planner.RECORD_STEPS` steps record (every saved tensor offloaded
  inline, fetched on demand); the profile is the last, each time the least any recorded;
- ``planning``: the first plan is being made; each step meanwhile runs as the recording did
  (every saved tensor offloaded inline: it fits);
- ``trial``: the plan made runs against the others :func:`planning.trial_plans` finds (each
  :data:`planner.TRIAL_STEPS` steps; those others are made while the plan made runs), and the
  fastest that did not flush the caching allocator's cache stays (:meth:`Trial.kept`);
- ``watching``: a plan in force; once :data:`planner.WATCH_FLUSHING` of its last
  :data:`planner.WATCH_STEPS` steps flushed the allocator's cache, the plan for a target half
  the headroom lower is made (while this one runs) and tried, unless this one flushed in none
  of its last :data:`planner.WATCH_STEPS` steps by the time it comes (it was settling);
- ``planned``: a plan in force, trials off: nothing watched;
- ``replanning``: a planned step ran out of memory; the plan for a lower target is being made,
  each step meanwhile running as the recording did, or, where the step was rescued
  (rescue.py: it ran to its end), under the plan that ran out, rescued again where it must;
- ``unplanned``: no plan met the budget (``strict`` off): every saved tensor offloaded;
- ``fallback``: planned steps ran out of memory past the replans: every saved tensor offloaded
  inline from now on.

:meth:`Lifecycle.end_step` is the one transition: fed each step's :class:`StepOutcome` (ok,
failed, out of memory or abandoned; its end on the link's clock, its links' flush counts; a
recording step's profile), it asks for plans (:class:`~.plan_runner.PlanRequest`: a runner
makes them, inline or in the background), takes those made since the last step as they come,
and returns the :class:`Decision`: what the next step runs and the lines to say. No step waits
for a plan: one being made leaves the step as it would run without it, and the plan takes over
at the step boundary after it is ready. With an :class:`~.plan_runner.InlineRunner` every plan
is ready at the boundary that asked for it, which is how the session planned when it planned in
its step: the same lines, plans and targets, in the same order.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Mapping

from . import planner
from .plan_runner import (FIRST, LOWER, REPLAN, TRIALS, InlineRunner, PlanMaker, PlanRequest,
                          PlanResult, least_rerun_times)
from .planner import KEEP, OFFLOAD, OffloadPlan, StepProfile
from .trial import Trial

# the states (module docstring)
FIXED = "fixed"
RECORDING = "recording"
PLANNING = "planning"
TRIAL = "trial"
WATCHING = "watching"
PLANNED = "planned"
REPLANNING = "replanning"
UNPLANNED = "unplanned"
FALLBACK = "fallback"
#: the states whose steps run one set of modes until a step's outcome changes it (no trial
#: alternating plans, no plan being made)
SETTLED = frozenset({WATCHING, PLANNED, UNPLANNED, FALLBACK})

# how a step ended (StepOutcome.status)
OK = "ok"
FAILED = "failed"
OUT_OF_MEMORY = "out of memory"
RESCUED = "rescued"   # out of memory, and ran to its end once rescue.py moved tensors off
ABANDONED = "abandoned"

# what the next step runs (Decision.run)
RECORD = "record"               # a recording step
AS_RECORDED = "as recorded"     # every saved tensor offloaded inline, fetched on demand
MODES = "modes"                 # Lifecycle.modes as a planned step runs them (None: each kept)

#: a watched plan's steps (moving nothing, flushing nothing) whose host took at least this share
#: of the recording's device forward to issue their forward (the median of
#: :data:`planner.WATCH_STEPS`) are said to wait for the host, once a run: the prediction counts
#: the device alone. Above 1, since a forward the device runs as fast as the host issues it (a
#: launch queue full, a script's wait for the device in its forward) takes the host about the
#: device's time
HOST_BOUND_SHARE = 1.25

#: the label, in a trial after a lowering, of the plan the lowering replaced
BEFORE_LOWERING = "from before the lowering"


def offload_everything(groups) -> list[str]:
    """The recording steps' modes: every group offloaded where it can be (else kept); ``groups``
    have ``offloadable`` (a profile's, or a step's)."""
    return [OFFLOAD if g.offloadable else KEEP for g in groups]


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB"


@dataclass(frozen=True)
class StepOutcome:
    """What one step did, as the lifecycle needs it."""

    status: str = OK
    #: whether it ran as the lifecycle had it run (False: a step that began under a cached plan
    #: which did not fit it, and went on as recorded: no recording, nothing learnt)
    recorded: bool = True
    #: a recording step's profile (None: it saved nothing) and the stages its chain allows
    profile: StepProfile | None = None
    stage_candidates: tuple = ()
    #: per saved group, whether it can be offloaded (a fall-back without a profile)
    offloadable: tuple = ()
    #: its backward's points (unpacks)
    unpacks: int = 0
    #: its end on the link's clock (timing a trial's steps: ``Lifecycle.elapsed_ms``)
    mark: object = None
    #: each link in use -> its caching allocator's flush count at the step's end (the session's
    #: first link first)
    flush_counts: Mapping = field(default_factory=dict)
    #: ms from its first saved group's pack to its first unpack on the host's clock: how long the
    #: host took to issue its forward (None: not measured)
    host_forward_ms: float | None = None


@dataclass(frozen=True)
class Decision:
    """What the next step runs, and what to do before it."""

    run: str                        # RECORD, AS_RECORDED or MODES
    modes: list | None
    plan: OffloadPlan | None
    #: the lines to say, in order
    lines: tuple = ()
    #: the session's profile document is due (a plan made or kept, a fall-back)
    write_profile: bool = False
    #: the next step runs other modes than the last (its caching allocator may start empty)
    changed: bool = False
    #: a stage came into force (the profile is the staged one from now)
    staged: bool = False
    #: ``strict``: no plan met the budget (or the background planner failed); the session
    #: raises this
    error: BaseException | None = None
    #: the plan in force settled (its trial over, or made where none runs): what a plan cache
    #: keeps for the next run
    settled: bool = False
    #: the session fell back to offloading everything: a cached plan is forgotten
    fell_back: bool = False
    #: no plan met any target: the least peak any plan reached, the step's floor a plan cache
    #: keeps for later runs (plancache.StepFloor); None where the planner found none or a plan
    least_peak: int | None = None


def _mark_ms(start, end) -> float:
    """A mark's own clock: a link's :class:`Mark` (its link times it), else a number of ms."""
    link = getattr(start, "link", None)
    return link.elapsed_ms(start, end) if link is not None else end - start


class TrialsAndWatch:
    """The plans judged by their steps on the device, :class:`Lifecycle`'s part: a trial runs
    the plan made against the others (each :data:`planner.TRIAL_STEPS` steps, timed by the
    marks at their ends, their flushes read at every unpack) and keeps the fastest that did not
    flush; the plan kept is watched, and one that flushes the caching allocator's cache is
    lowered (the plan for half the headroom less asked for, tried, kept where it does not
    flush). Its state is the lifecycle's (:attr:`Lifecycle.trial`, the watch's flush counts)."""

    # --- the flushes read and watched ----------------------------------------------------
    @property
    def watches_flush_points(self) -> bool:
        """Whether the session reads each link's flush count at each unpack
        (:meth:`saw_flushes`): a trial's plan runs its timed steps."""
        return self.trial is not None and self.trial.timing()

    def saw_flushes(self, link, count: int, point: int) -> None:
        """A planned step's unpack at backward ``point`` read ``link``'s flush count ``count``
        (:meth:`Trial.saw_flushes`)."""
        if self.watches_flush_points:
            self.trial.saw_flushes(link, count, point)

    def _watch_from_now(self) -> None:
        """The watch of the plan that comes into force: no step of it yet, and flushes counted
        from here."""
        self._flushing.clear()
        self._host_forwards.clear()
        self._flush_counts = dict(self._counts_now)

    def _watch_flushes(self) -> bool:
        """A planned step of the plan in force ended after its trial: once
        :data:`planner.WATCH_FLUSHING` of its last :data:`planner.WATCH_STEPS` steps flushed the
        caching allocator's cache, the plan for less is asked for (:meth:`_lower`); it stays
        in force until that plan comes, and stays where none is left or none is found. Whether
        this step flushed."""
        counts = self._counts_now
        flushed_now = any(count > self._flush_counts.get(link, count)
                          for link, count in counts.items())
        self._flushing.append(flushed_now)
        self._flush_counts = counts
        if self._awaiting is not None:   # the plan for less is being made: watched for
            return flushed_now           # :meth:`_lower_made`, nothing asked
        flushed = sum(self._flushing)
        if flushed >= planner.WATCH_FLUSHING:
            steps = len(self._flushing)
            self._flushing.clear()
            self._lower(self.plan.peak, ("watch", flushed, steps), self.plan)
        return flushed_now

    def _watch_host(self, host_forward_ms: float | None) -> None:
        """A planned step of the watched plan ended without a flush, its host having taken
        ``host_forward_ms`` to issue its forward: once the median of the last
        :data:`planner.WATCH_STEPS` such steps is :data:`HOST_BOUND_SHARE` of the recording's
        device forward or more, one line says so (once a run). Only for a plan that moves
        nothing: one that offloads has the compute stream wait for its copies in the forward
        (``planner.simulate``'s forward waits), so its device forward is not the recording's."""
        if self._host_bound_said or host_forward_ms is None or self.plan is None or \
                self.plan.moved_bytes or self.profile is None or self.profile.forward_ms <= 0:
            return
        self._host_forwards.append(host_forward_ms)
        if len(self._host_forwards) < planner.WATCH_STEPS:
            return
        host, device = statistics.median(self._host_forwards), self.profile.forward_ms
        if host >= device * HOST_BOUND_SHARE:
            self._host_bound_said = True
            self._say(f"the host takes {host:.1f} ms to issue each planned step's forward (the "
                      f"median of the last {planner.WATCH_STEPS}), which the device ran in "
                      f"{device:.1f} ms in the recording: the device waits for the host, and "
                      f"steps run longer than the plan's predicted {self.plan.predicted_ms:.1f} "
                      "ms, which counts the device alone (docs/torch.md, \"The host's time\")")

    def _lower(self, flushed_peak: int, after: tuple, replaced: OffloadPlan) -> bool:
        """After a trial whose every plan flushed the caching allocator's cache, or a plan that
        flushes after its trial (fragmentation the model does not see needs more room than its
        headroom): the plan for a target half the headroom lower is asked for (True), at most
        ``replans`` such lowerings apart from the replans after running out of memory; none
        without a headroom. A flush costs a step more than the room does
        (benchmarks/results/pressure)."""
        if self.lowerings_left <= 0 or not self.headroom:
            return False
        self._before_lowering = replaced
        recorded, candidates = self._weighed
        self._ask(PlanRequest(LOWER, self.profile, self.target, self.budget, self.headroom,
                              peak=flushed_peak, candidates=candidates, staging=self.staging,
                              recorded=recorded), after)
        return True

    # --- trials -----------------------------------------------------------------------------
    def _advance_trial(self, outcome: StepOutcome) -> None:
        """A planned step of the trial ended (its backward ``unpacks`` points; a flush since the
        last unpack came after the last point's op): the next plan's turn after
        :data:`planner.TRIAL_STEPS` steps, and after the last plan's, :meth:`Trial.kept` stays."""
        trial = self.trial
        if not trial.timing():    # the plan made, timed, runs on while the others are made
            return
        for link, count in self._counts_now.items():   # after the last unpack: its op, the
            trial.saw_flushes(link, count, outcome.unpacks - 1)   # optimizer's
        trial.marks[trial.current].append(outcome.mark)
        trial.flushes[trial.current].append(next(iter(self._counts_now.values()), 0))
        if trial.timing():   # a timed step follows: only the last one's points are said
            trial.flush_points[trial.current].clear()
        if not trial.timing() and not trial.awaiting:
            self._next_in_trial()

    def _next_in_trial(self) -> None:
        trial = self.trial
        ahead = trial.current + 1
        if ahead < len(trial.plans) and trial.labels[ahead] == BEFORE_LOWERING and any(
                not trial.flushes_in(index) for index in range(ahead)):
            # the plan a lowering replaced flushed (that is why it was lowered), and a plan of
            # this trial did not: the trial keeps no plan that flushes where one did not
            # (:meth:`Trial.kept`), so it is not run again (it is the trial's last)
            self._end_trial(trial, ahead, "offload plans tried (not the one from before the "
                                          "lowering, which flushed)")
            return
        if ahead < len(trial.plans):
            trial.current = ahead
            self.plan = trial.plans[trial.current]
            self.modes = list(self.plan.modes)
            return
        self._end_trial(trial, len(trial.plans), "offload plans tried")

    def _end_trial(self, trial: Trial, ran: int, why: str) -> None:
        """:meth:`Trial.kept` of the trial's first ``ran`` plans (each timed) stays, said in one
        line that starts with ``why``; where every plan of a whole trial flushed, the plan for
        less is asked for first (the fastest runs meanwhile)."""
        times = [trial.step_ms(index, self.elapsed_ms) for index in range(ran)]
        best = trial.kept(times)
        self.trial = None
        self.state = WATCHING
        self._watch_from_now()   # the plan kept, or made for less below
        if ran == len(trial.plans) and all(trial.flushes_in(index) for index in range(ran)):
            if self._lower(min(plan.peak for plan in trial.plans),
                           ("trial", trial, times, best, why), trial.plans[best]):
                self.plan = trial.plans[best]
                self.modes = list(self.plan.modes)
                return
        self._keep(trial, times, best, why)

    def _timed(self, trial: Trial, times: list[float]) -> str:
        return ", ".join(f"{trial.labels[index]} {ms:.1f} ms a step{trial.flush_note(index)}"
                         for index, ms in enumerate(times))

    def _keep(self, trial: Trial, times: list[float], best: int, why: str) -> None:
        self._settled = True
        if len(trial.plans) == 1:   # it stays, flushing or not (no lower target): nothing to say
            return
        self.kept_after_trial = trial.labels[best] if best else None
        self.plan = trial.plans[best]
        self.modes = list(self.plan.modes)
        self._write = True
        self._say(f"{why}: {self._timed(trial, times)}; keeping the plan {trial.labels[best]}")

    def _trials_made(self, made: PlanResult, after: tuple) -> None:
        """The others to run against the plan in force: a trial where there are any, or where
        a lower target can follow (alone, the plan is still run as a trial: whether it flushes
        the caching allocator's cache); one line naming them."""
        trial, others = self.trial, list(made.trials)
        if made.refined is not None:
            self._refined(made.refined)
        if trial is None:   # a failed step ended the quick plan's trial (:meth:`_failed`)
            return
        replaced, self._before_lowering = self._before_lowering, None
        if replaced is not None and all(replaced != plan for plan in trial.plans) and \
                all(replaced != plan for _, plan in others):
            others.append((BEFORE_LOWERING, replaced))
        if not (others or (self.headroom and self.lowerings_left > 0)):
            self.trial = None
            self.state = WATCHING
            self._settled = True
            return
        trial.add(others)
        trial.awaiting = False
        if others:
            self._say("trying it against " + "; ".join(
                f"the plan {label} ({plan.describe()})"
                + " where the plans for less flush too" * (label == BEFORE_LOWERING)
                for label, plan in others)
                + f", {planner.TRIAL_STEPS} steps each")
        if not trial.timing():   # the plan made ran its timed steps meanwhile
            self._next_in_trial()

    def _refined(self, plan: OffloadPlan) -> None:
        """The full search's ``plan`` replaces the quick construction's in force as the trial's
        first (its steps so far untimed for it; where a failed step ended the trial, alone),
        with one line."""
        if self.trial is not None:
            self.trial.put(0, plan)
        self.plan = plan
        self.modes = list(plan.modes)
        self._watch_from_now()
        self._write = True
        self._say(f"offload plan for {_gib(self.budget)}, made by the full search (the quick "
                  f"one ran meanwhile): {plan.describe()}")

    def _lower_made(self, made: PlanResult, after: tuple) -> None:
        """The plan for less after flushes: in force and tried, with one line; where none was
        found, the plan stays (after a trial, the one it keeps, said)."""
        if made.plan is None:
            self._before_lowering = None   # the plan in force stays
            if made.lowerings_spent:   # nor any lower target: not solved again
                self.lowerings_left = 0
            if after[0] == "trial":
                _, trial, times, best, why = after
                self._keep(trial, times, best, why)
            return
        self.lowerings_left -= 1
        if len(self._flushing) == planner.WATCH_STEPS and not any(self._flushing):
            # The plan in force flushed none of its last steps while this one was made: its
            # flushes were the caching allocator settling into its layout (a trial's steps,
            # each plan's first after the cache was emptied), and a plan for less is slower.
            self._before_lowering = None
            self._say(f"the offload plan flushed the caching allocator's cache in none of its "
                      f"last {planner.WATCH_STEPS} steps while the plan for "
                      f"{_gib(made.target)} was made: it stays")
            if after[0] == "trial":
                _, trial, times, best, why = after
                self._keep(trial, times, best, why)
            return
        self.replans_used += 1
        self._lowered_target = made.target
        self.kept_after_trial = None   # the plan as made, unless its own trial keeps another
        if made.stage is not None:
            # another of the recording's stages meets the lower target faster: in force from
            # the next step, its plans made on its profile; the plan it replaces, of the other
            # stage's groups, is not tried against it
            self.recorded_profile = self._weighed[0]
            self.stage, self._staged, self.profile = made.stage, True, made.profile
            self._before_lowering = None
        if after[0] == "trial":
            _, trial, times, _, why = after
            self._say((f"the offload plan ran {times[0]:.1f} ms a step{trial.flush_note(0)}; "
                       "it flushed" if len(trial.plans) == 1
                       else f"{why}: {self._timed(trial, times)}; each flushed")
                      + f" the caching allocator's cache, so planning for {_gib(self.target)}")
        else:
            _, flushed, steps = after
            self._say(f"the offload plan flushed the caching allocator's cache in {flushed} of "
                      f"its last {steps} steps, so planning for {_gib(self.target)}")
        self._in_force(made.plan)

class Lifecycle(TrialsAndWatch):
    """The plan's lifecycle of one session (module docstring). ``budget`` (bytes; None: nothing
    planned), ``modes``/``force`` (a fixed plan), ``headroom``, ``replans``/``replan_step``,
    ``record_steps``, ``trials``, ``keep_apart``, ``staging``, ``strict``: as
    ``OffloadSession``'s. ``maker``: what makes the plans (default a :class:`PlanMaker` with
    ``lookahead`` and ``plan_time_limit_s``); ``runner``: what runs it (default inline).
    ``elapsed_ms(a, b)``: ms between two step-end marks (default: a link's mark times itself,
    numbers are ms)."""

    def __init__(self, budget: int | None = None, *, modes=None, force: str | None = None,
                 headroom: float = 0.1, lookahead: int = 2, replans: int = 3,
                 replan_step: float = 0.1, record_steps: int | None = None, trials: bool = True,
                 keep_apart: bool = False, staging: bool | str = True, strict: bool = True,
                 plan_time_limit_s: float | None = 20, maker: PlanMaker | None = None,
                 runner=None, elapsed_ms: Callable | None = None):
        self.budget, self.headroom = budget, headroom
        self.replans, self.replans_left, self.replan_step = replans, replans, replan_step
        # lower targets after flushing trials: as many, apart, so that a step that later runs
        # out of memory still has its replans
        self.lowerings_left = replans
        self.replans_used = 0
        #: while replanning (set as it begins, read only then): after a rescued step, the plan
        #: that ran out stays in force meanwhile
        self._replan_under_plan = False
        self.trials, self.keep_apart = trials, keep_apart
        self.staging, self.strict = staging, strict
        self.maker = maker or PlanMaker(lookahead, plan_time_limit_s)
        self.runner = runner or InlineRunner()
        self.elapsed_ms = elapsed_ms or _mark_ms
        self.record_steps = max(1, planner.RECORD_STEPS if record_steps is None
                                 else record_steps)
        self._recordings_left = self.record_steps
        #: this recording's steps so far: each one's profile and the stages it allowed
        self._recorded: list[tuple[StepProfile, tuple]] = []
        self._stage_candidates: tuple = ()
        #: the recorded profile and the stages its first plan weighed: a lowering weighs them
        #: again at its lower target (plan_runner.PlanMaker._staged_lowering)
        self._weighed: tuple = (None, ())
        self._lowered_target: int | None = None
        #: the profile plans are made on (the staged one where a stage is in force), the
        #: recorded one where a stage is, and the stage (plan_runner.StageCandidate)
        self.profile: StepProfile | None = None
        self.recorded_profile: StepProfile | None = None
        self.stage = None
        self.plan: OffloadPlan | None = None
        self.modes = list(modes) if modes is not None else None
        self.fell_back = False
        #: how the plan in force was made, after a trial kept another than the one made
        #: (:func:`planning.trial_plans`' label; None: as made)
        self.kept_after_trial: str | None = None
        self.trial: Trial | None = None
        #: the plan in force after its trial: per planned step (the last WATCH_STEPS), whether
        #: it flushed the caching allocator's cache, and each link's flush count at its end
        self._flushing: deque = deque(maxlen=planner.WATCH_STEPS)
        #: the settled plan's last planned steps' host forward ms (:meth:`_watch_host`), and
        #: whether this run said its steps wait for the host
        self._host_forwards: deque = deque(maxlen=planner.WATCH_STEPS)
        self._host_bound_said = False
        #: the plan a lowering after flushes replaces: tried again against the lower target's
        #: plans (:data:`BEFORE_LOWERING`), since a flush that comes from what no plan holds (a
        #: convolution's workspace) flushes at every target, and a lower one is then only slower
        self._before_lowering: OffloadPlan | None = None
        self._flush_counts: dict = {}
        self._counts_now: dict = {}     # each link's flush count at the last step's end
        #: the request whose plan is awaited (one at a time), and what its answer continues
        self._awaiting: PlanRequest | None = None
        self._after: tuple = ()
        self._steps_waited = 0
        #: per request answered: (kind, seconds its making took, steps run while it was made)
        self.timings: list[tuple[str, float, int]] = []
        #: why the first plan's target (the headroom's) had no plan (None: it had one): the
        #: error's text only, since the error's traceback, made inline, holds the training
        #: thread's frames (the step that ended, the next one's input) for the session's life
        self.first_error_message: str | None = None
        self._least_peak: int | None = None   # the decision's (Decision.least_peak)
        self._lines: list[str] = []
        self._write = False
        self._staged = False
        self._settled = False
        self._forget = False
        self.state = FIXED if budget is None or modes is not None or force is not None \
            else RECORDING

    # --- what the next step runs ----------------------------------------------------------
    @property
    def target(self) -> int | None:
        """What plans are made for: ``budget * (1 - headroom)``, lower after a planned step that
        ran out of memory or a plan that flushed, higher where no plan met it."""
        if self._lowered_target is not None:
            return self._lowered_target
        return (planner.planning_target(self.budget, self.headroom) if self.budget is not None
                else None)

    @property
    def recording(self) -> bool:
        return self.state == RECORDING

    @property
    def flush_counts(self) -> dict:
        """Each link's flush count at the end of the last step the lifecycle learnt from."""
        return self._counts_now

    @property
    def replanning_under_plan(self) -> bool:
        """The plan for less is being made after a rescued step, and the plan that ran out runs
        meanwhile (its steps may need rescuing again)."""
        return self.state == REPLANNING and self._replan_under_plan

    @property
    def recorded_steps(self) -> int:
        """The steps of the recording in progress recorded so far (0: the next is its first)."""
        return len(self._recorded)

    @property
    def inline(self) -> bool:
        """The next step offloads every saved tensor inline, fetched on demand, as the recording
        did: a plan is being made in its place (unless a rescued step's plan runs meanwhile),
        or the session fell back."""
        return self.state in (PLANNING, REPLANNING, FALLBACK) and not self.replanning_under_plan

    @property
    def run(self) -> str:
        """What the next step runs: RECORD, AS_RECORDED or MODES (:attr:`modes`)."""
        return RECORD if self.recording else AS_RECORDED if self.inline else MODES

    @property
    def awaiting(self) -> str | None:
        """The kind of request whose plan is being made (None: none)."""
        return self._awaiting.kind if self._awaiting is not None else None

    # --- the transition -------------------------------------------------------------------
    def end_step(self, outcome: StepOutcome) -> Decision:
        """A step ended as ``outcome`` says; then the plans made since the last step take over.
        Returns what the next step runs. An abandoned step (its graph dropped without a
        backward) teaches nothing: the next runs as it would have."""
        if outcome.status == ABANDONED or not outcome.recorded:
            return self._between(lambda: None)

        def ended():
            self._counts_now = dict(outcome.flush_counts)
            if self._awaiting is not None:
                self._steps_waited += 1
            self._step_ended(outcome)
            self._take_plans()
        return self._between(ended)

    def take_plans(self) -> Decision:
        """Between steps without a step's outcome (a driver that waited for the runner): the
        plans made since the last step take over."""
        return self._between(self._take_plans)

    def _between(self, transition: Callable) -> Decision:
        """``transition()`` run, and what the next step runs after it. An error it raises (a
        ``strict`` session's plan that none meets, a failure of the background planner) is
        the decision's, raised by the session after the lines are said."""
        before = (self.plan, list(self.modes) if self.modes is not None else None)
        self._lines, self._write, self._staged = [], False, False
        self._settled = self._forget = False
        self._least_peak = None
        error = None
        try:
            transition()
        except Exception as exc:
            error = exc
        changed = self.modes != before[1] or self.plan is not before[0]
        return Decision(self.run, self.modes, self.plan, tuple(self._lines), self._write, changed,
                        self._staged, error, self._settled, self._forget, self._least_peak)

    def _say(self, line: str) -> None:
        self._lines.append(line)

    def _step_ended(self, outcome: StepOutcome) -> None:
        failed = outcome.status in (FAILED, OUT_OF_MEMORY, RESCUED)
        out_of_memory = outcome.status in (OUT_OF_MEMORY, RESCUED)
        if self.state == RECORDING:
            self._recording_ended(outcome, failed, out_of_memory)
            return
        if failed:
            self._failed(outcome, out_of_memory)
        elif self.trial is not None:
            self._advance_trial(outcome)
        elif self.state == WATCHING:
            # a flush waits for the device: its step's host forward is no measure of the host
            if not self._watch_flushes():
                self._watch_host(outcome.host_forward_ms)

    def _recording_ended(self, outcome: StepOutcome, failed: bool, out_of_memory: bool) -> None:
        """The first recording pins the host pool (seconds of the host waiting, which leave the
        copies' own time uncertain); the profile is the last of ``record_steps``, with each time
        the least of them all (:func:`planner.least_times`: a host that fell behind in one
        recording stretched its times there). A step that saved nothing is no recording."""
        if failed:
            self._say("the recording step failed" + (" (out of device memory)" if out_of_memory
                                                    else "") + "; recording the next one")
            return
        if outcome.profile is None:
            return
        self._recorded.append((outcome.profile, tuple(outcome.stage_candidates)))
        self._recordings_left -= 1
        if self._recordings_left > 0:
            return
        self.profile = planner.least_times([profile for profile, _ in self._recorded])
        self._stage_candidates = least_rerun_times([stages for _, stages in self._recorded])
        if self.stage is not None:   # a stage the recording took: the recorded profile is staged
            self.recorded_profile = self.profile
        self._recorded = []
        self.state = PLANNING
        self.modes = offload_everything(self.profile.groups)
        # with trials, the quick construction's plan first (in force steps sooner), the full
        # search's with the trial's plans
        self._ask(PlanRequest(FIRST, self.profile, self.target, self.budget, self.headroom,
                              candidates=self._stage_candidates, staging=self.staging,
                              quick=self.trials))
        self._weighed = (self.profile, self._stage_candidates)
        self._stage_candidates = ()

    def _failed(self, outcome: StepOutcome, out_of_memory: bool) -> None:
        """A planned step failed: in a trial after its first plan, the fastest of those that ran
        stays; else, out of memory, a plan for a lower target (:meth:`_plan_again`) or, past the
        replans, the fall-back. A step run as recorded while a plan is made changes nothing."""
        trial, self.trial = self.trial, None
        if trial is not None and trial.current > 0:
            label = trial.labels[trial.current]
            self._end_trial(trial, trial.current,
                            f"the plan {label} ran out of device memory in its trial"
                            if out_of_memory else f"a step of the plan {label} failed in its trial")
            return
        awaited = self._awaiting
        if trial is not None and awaited is not None and awaited.kind == TRIALS and \
                not (awaited.refine and not out_of_memory):
            # the trial is over before its other plans were made; a quick plan's full search
            # still comes where no plan for less is asked (else the quick one stays unchecked)
            self._awaiting = None
        if trial is not None:
            self.state = WATCHING
        if outcome.status == OUT_OF_MEMORY and self.replanning_under_plan:
            # the plan in force raised while the one for less is made: the recording's way
            self._replan_under_plan = False
            self.modes = offload_everything(self.profile.groups)
        if out_of_memory and not self.fell_back and self.budget is not None \
                and self.state not in (PLANNING, REPLANNING):
            if not self._plan_again(rescued=outcome.status == RESCUED):
                self._fall_back(outcome)

    def _plan_again(self, rescued: bool = False) -> bool:
        """After a planned step ran out of memory: the plan for a lower target is asked for
        (``min(target, modelled peak) - replan_step * budget``) where replans are left and that
        target is above zero (True); each step runs as recorded until it comes, or, after a
        step that was ``rescued`` and so ran to its end, under the plan in force (its steps
        rescued again where they must: several times faster than the recording's way)."""
        if self.plan is None or self.profile is None or self.replans_left <= 0:
            return False
        self.replans_left -= 1
        self.replans_used += 1
        modelled = self.plan.peak
        target = min(self.target, modelled) - int(self.replan_step * self.budget)
        if target <= 0:     # nothing left to plan for: the fall-back (everything offloaded)
            return False
        self.state = REPLANNING
        self._replan_under_plan = rescued
        if not rescued:
            self.modes = offload_everything(self.profile.groups)
        self._ask(PlanRequest(REPLAN, self.profile, target, self.budget, self.headroom,
                              peak=modelled))
        return True

    def _fall_back(self, outcome: StepOutcome | None = None) -> None:
        """Every later step offloads every saved tensor inline, as the recording step ran."""
        self.state = FALLBACK
        self.fell_back = self._forget = True
        self.trial, self._awaiting = None, None
        self.modes = offload_everything(self.profile.groups) if self.profile is not None else [
            OFFLOAD if offloadable else KEEP for offloadable in outcome.offloadable]
        self._write = True
        self._say(f"a step under the offload plan for {_gib(self.budget)} ran out of device "
                  "memory; offloading every saved tensor from now on")

    # --- plans asked for and made ---------------------------------------------------------
    def _ask(self, request: PlanRequest, after: tuple = ()) -> None:
        """``request`` goes to the runner; its answer is awaited (an earlier one awaited no
        longer counts)."""
        self._awaiting, self._after, self._steps_waited = request, after, 0
        self.runner.submit(request, self.maker)

    def _take_plans(self) -> None:
        """The answers made since the last step, in order; those no longer awaited are left."""
        while True:
            done = self.runner.ready()
            if not done:
                return
            for request, made in done:
                if request is not self._awaiting:
                    continue
                self._awaiting, after = None, self._after
                if isinstance(made, BaseException):
                    raise made
                self.timings.append((request.kind, made.seconds, self._steps_waited))
                {FIRST: self._first_made, TRIALS: self._trials_made, LOWER: self._lower_made,
                 REPLAN: self._replan_made}[request.kind](made, after)

    def _first_made(self, made: PlanResult, after: tuple) -> None:
        """The first plan: in force, said in one line, and the trial of the others asked for;
        where none met the headroom's target, a smaller headroom's (one line more); where none
        met any, ``strict`` raises its error, else every saved tensor is offloaded."""
        if made.stage is not None:
            self.stage, self._staged = made.stage, True
            self.recorded_profile, self.profile = self.profile, made.profile
        plan = made.plan
        self.first_error_message = None if made.error is None else str(made.error)
        if made.error is not None:
            if plan is None:
                # as the recorded step ran (everything offloaded): what goes on after an error
                # a script catches, and an unmodified script's way without ``strict``
                self.state = UNPLANNED
                self._least_peak = getattr(made.error, "least_peak", None)
                self.modes = offload_everything(self.profile.groups)
                if self.strict:
                    raise made.error
                self._write = True
                self._say(f"{made.error}; offloading every saved tensor")
                return
            self._lowered_target = plan.target
            self.lowerings_left = 0
            target = self.target
            self._say(f"no offload plan for {_gib(self.budget)} less its headroom "
                      f"({self.headroom:.0%}); planning for {_gib(target)}, "
                      f"{1 - target / self.budget:.1%} less")
        self._in_force(plan, refine=made.quick)

    def _in_force(self, plan: OffloadPlan, refine: bool = False) -> None:
        """``plan`` (made for :attr:`target`) in force, said in one line; with ``trials``, the
        plans to try against it asked for (for smaller headrooms too, unless the target was
        lowered; with ``refine``, ``plan`` being a quick construction's, the full search's
        first), the plan running as the trial's first meanwhile."""
        target = self.target
        self.plan = plan
        self.modes = list(plan.modes)
        self._watch_from_now()
        self._say(f"offload plan for {_gib(self.budget)}"
                  + (f" (planned for {_gib(target)})" if self._lowered_target is not None else "")
                  + f": {plan.describe()}"
                  + (f"; {self.stage.stage.describe()}" if self.stage is not None else ""))
        self._write = True
        if not self.trials:
            self.state = PLANNED
            self._settled = True
            return
        self.state = TRIAL
        self.trial = Trial([plan], ["as made"], seen=dict(self._counts_now), awaiting=True)
        self._ask(PlanRequest(
            TRIALS, self.profile, target, self.budget, self.headroom, plan=plan,
            larger_budgets=tuple(planner.trial_budgets(self.budget, self.headroom))
            if self._lowered_target is None else (), keep_apart=self.keep_apart, refine=refine))

    def _replan_made(self, made: PlanResult, after: tuple) -> None:
        """The plan for less after running out of memory: in force (watched, not tried), with
        one line; where none meets that target, the fall-back."""
        if made.plan is None:
            self._fall_back()
            return
        self._lowered_target = made.target
        self.plan = made.plan
        self.modes = list(made.plan.modes)
        self.kept_after_trial = None
        self.state = WATCHING if self.trials else PLANNED
        self._watch_from_now()   # not the flush of the step that failed (a retry before it)
        self._write = self._settled = True
        self._say(f"a step under the offload plan for {_gib(self.budget)} ran out of device "
                  f"memory (modelled peak {_gib(made.request.peak)}); planning for "
                  f"{_gib(made.target)}: {made.plan.describe()}")

    # --- a plan from an earlier run ---------------------------------------------------------
    def start_cached(self, plan: OffloadPlan, profile: StepProfile, *,
                     recorded_profile: StepProfile | None = None, stage=None,
                     kept_after_trial: str | None = None) -> Decision:
        """Before the first step: ``plan``, made on ``profile`` by an earlier run of the same
        script (a plan cache's entry, the plan its trial kept), in force from the first step,
        watched as a plan after its trial (no recording, no solve, no trial); ``stage`` with
        ``recorded_profile`` where it stages. One line says so."""
        def start():
            self.profile, self.recorded_profile, self.stage = profile, recorded_profile, stage
            self.plan, self.modes = plan, list(plan.modes)
            self.kept_after_trial = kept_after_trial
            own = self.target
            self._lowered_target = plan.target if plan.target and plan.target != own else None
            self._recorded, self._stage_candidates, self._weighed = [], (), (None, ())
            self.state = WATCHING if self.trials else PLANNED
            self._watch_from_now()
            self._staged = stage is not None
            self._say(f"offload plan for {_gib(self.budget)} from the plan cache"
                      + (f" (planned for {_gib(self.target)})"
                         if self._lowered_target is not None else "")
                      + f": {plan.describe()}"
                      + (f"; {stage.stage.describe()}" if stage is not None else ""))
        return self._between(start)

    def stage_in_recording(self, stage) -> None:
        """A recording step took ``stage`` (a :class:`~.plan_runner.StageCandidate`; the session's
        ``_stage_starts``): the profiles recorded from now on are staged ones, and the plans are
        made on them with it in force."""
        if self.state == RECORDING:
            self.stage = stage

    def record_anew(self, reason: str) -> Decision:
        """The plan from an earlier run does not fit this run's step (``reason``, one line): the
        step goes on as recorded and the next ones record, as on a first run."""
        def anew():
            self.profile = self.recorded_profile = self.stage = self.plan = None
            self.modes, self.kept_after_trial, self._lowered_target = None, None, None
            self.trial, self._awaiting = None, None
            self._recorded, self._weighed = [], (None, ())
            self._recordings_left = self.record_steps
            self.state = RECORDING
            self._say(f"the cached offload plan does not fit this step: {reason}; recording "
                      "anew")
        return self._between(anew)
