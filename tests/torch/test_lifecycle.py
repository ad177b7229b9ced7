"""mucudnn.torch.lifecycle and plan_runner: the plan's lifecycle fed step outcomes, without torch.

Plans come from a maker whose solve is a table (target -> plan) and whose trial plans are given;
the runner is one the test completes by hand (:class:`ManualRunner`), so what a step runs while a
plan is being made does not depend on how busy the machine is. One test runs the real planner
(CBC) inline and holds its plans equal to the off-GPU replay's."""

from __future__ import annotations

import dataclasses
import sys
import threading

import pytest

from mucudnn.errors import InfeasibleError, SolverError
from mucudnn.torch import planner, profiles
from mucudnn.torch import planner_fast, planner_stage
from mucudnn.torch.lifecycle import (ABANDONED, AS_RECORDED, FAILED, FALLBACK, FIXED, MODES, OK,
                                     OUT_OF_MEMORY, PLANNED, PLANNING, RECORD, RECORDING,
                                     RESCUED,
                                     REPLANNING, TRIAL, UNPLANNED, WATCHING, Lifecycle,
                                     StepOutcome)
from mucudnn.torch.plan_runner import (FIRST, LOWER, REPLAN, TRIALS, BackgroundRunner,
                                       InlineRunner, PlanMaker, PlanRequest, PlanResult,
                                       StageCandidate)
from mucudnn.torch.planner import KEEP, OFFLOAD, RECOMPUTE, OffloadPlan, SavedGroup, StepProfile

GiB = 2**30
MiB = 2**20
STEPS = planner.TRIAL_STEPS


def profile(n: int = 4, forward_ms: float = 10.0) -> StepProfile:
    """``n`` groups of 256 MiB, the last not offloadable."""
    groups = [SavedGroup(256 * MiB, n - 1 - g, n - 1 - g, producer=f"m{g}",
                         offloadable=g < n - 1) for g in range(n)]
    return StepProfile(groups, forward_ms, 2 * forward_ms, 10.0, 10.0, n)


def plan(peak: int, ms: float = 20.0, modes=(OFFLOAD, KEEP, RECOMPUTE, KEEP),
         target: int | None = None) -> OffloadPlan:
    return OffloadPlan(tuple(modes), 2, peak, ms, 256 * MiB, simulated_ms=ms,
                       target=target or peak)


class TableMaker(PlanMaker):
    """Solves from a table: a target at or above ``least`` gets a plan peaking at the target
    (its time ``ms(target)``), a lower one :class:`InfeasibleError`; ``others`` are the trial's
    plans (a function of the request); ``solved`` receives each target solved."""

    def __init__(self, least: int = 0, ms=lambda target: 20.0, others=lambda request: [],
                 quick_ms=None, quick_meets=True):
        super().__init__()
        self.least, self.ms, self.others, self.solved = least, ms, others, []
        self.trial_requests, self.quick_solves, self.quick_ms = [], [], quick_ms
        self.quick_meets = quick_meets

    def solve(self, profile, target, explain=True):
        """``quick_ms``: a quick construction's plan takes that long (another plan: other modes);
        ``quick_meets`` False: the quick construction falls short, the full search makes it."""
        self.solved.append(target)
        self.quick_solves.append(self.quick)
        if target < self.least:
            error = InfeasibleError(f"{target} is too small for this step (test)")
            error.least_peak = self.least
            raise error
        if self.quick:
            self._made_by.append(planner_fast.QUICK if self.quick_meets else planner_fast.FULL)
        if self.quick and self.quick_meets and self.quick_ms is not None:
            return plan(target, self.quick_ms, modes=(RECOMPUTE, KEEP, RECOMPUTE, KEEP))
        return plan(target, self.ms(target))

    def trial_plans(self, request):
        self.trial_requests.append(request)
        return self.others(request)


class ManualRunner:
    """A runner the test completes by hand: ``complete()`` makes the oldest request waiting."""

    background = True

    def __init__(self):
        self.waiting, self.done, self.kinds = [], [], []

    def submit(self, request, work):
        self.waiting.append((request, work))
        self.kinds.append(request.kind)

    def complete(self, count: int = 1):
        for _ in range(count):
            request, work = self.waiting.pop(0)
            try:
                self.done.append((request, work(request)))
            except Exception as exc:
                self.done.append((request, exc))

    def ready(self):
        done, self.done = self.done, []
        return done


class Steps:
    """Feeds a lifecycle step outcomes on a clock (ms) and one link's flush count."""

    def __init__(self, lifecycle: Lifecycle, recorded: StepProfile | None = None):
        self.lifecycle, self.recorded = lifecycle, recorded or profile()
        self.now, self.flushes, self.lines, self.decisions = 0.0, 0, [], []

    def step(self, ms: float = 10.0, status: str = OK, flushes: int = 0, **fields):
        self.now += ms
        self.flushes += flushes
        if self.lifecycle.recording and status == OK:
            fields.setdefault("profile", self.recorded)
        decision = self.lifecycle.end_step(StepOutcome(
            status, unpacks=4, mark=self.now, flush_counts={"link": self.flushes},
            offloadable=(True, True, False), **fields))
        self.lines += decision.lines
        self.decisions.append(decision)
        if decision.error is not None:
            raise decision.error
        return decision

    def record(self):
        for _ in range(planner.RECORD_STEPS):
            decision = self.step()
        return decision

    def run(self, plan_ms, flushes=0):
        """TRIAL_STEPS steps of the plan in force, each ``plan_ms`` (flushing ``flushes``)."""
        for _ in range(STEPS):
            decision = self.step(plan_ms, flushes=flushes)
        return decision


def others(*labelled):
    return lambda request: [(label, dataclasses.replace(request.plan, step_ms=ms,
                                                        simulated_ms=ms, moved_bytes=ms * MiB))
                            for label, ms in labelled]


def test_recording_then_the_plan_then_its_trial_keeps_the_fastest():
    maker = TableMaker(others=others(("other 1", 18.0), ("other 2", 19.0)))
    lifecycle = Lifecycle(8 * GiB, maker=maker)
    steps = Steps(lifecycle)
    assert lifecycle.state == RECORDING and lifecycle.run == RECORD
    first = steps.step()
    assert first.run == RECORD and not first.lines and lifecycle.state == RECORDING
    made = steps.step()                   # the last recording: the plan is made inline
    target = planner.planning_target(8 * GiB, 0.1)
    # the first plan quick (PlanRequest.quick), then the full search with the trial's request;
    # here both are the table's one plan, so nothing more is tried for it
    assert maker.solved == [target, target] and lifecycle.target == target
    assert maker.quick_solves == [True, False]
    assert made.run == MODES and made.plan is lifecycle.plan and made.plan.peak == target
    assert made.modes == list(made.plan.modes) and made.changed and made.write_profile
    trial = maker.trial_requests[0]
    assert trial.plan is made.plan and trial.target == target and not trial.keep_apart   # off by default
    assert trial.larger_budgets == tuple(planner.trial_budgets(8 * GiB, 0.1))
    plans = lifecycle.trial.plans
    assert made.lines == (
        f"offload plan for 8.00 GiB: {made.plan.describe()}",
        "trying it against " + "; ".join(f"the plan {label} ({p.describe()})" for label, p in
                                          zip(["other 1", "other 2"], plans[1:]))
        + f", {STEPS} steps each")
    assert lifecycle.state == TRIAL and not made.settled     # not before its trial is over
    # each plan TRIAL_STEPS steps; its time the fastest of those after its first
    steps.run(12.0)
    assert lifecycle.plan is plans[1] and steps.decisions[-1].changed
    steps.run(9.0)
    assert lifecycle.plan is plans[2]
    done = steps.run(11.0)
    assert lifecycle.plan is plans[1] and lifecycle.kept_after_trial == "other 1"
    assert done.write_profile and done.changed and lifecycle.state == WATCHING and done.settled
    assert done.lines == ("offload plans tried: as made 12.0 ms a step, other 1 9.0 ms a step, "
                          "other 2 11.0 ms a step; keeping the plan other 1",)
    quiet = steps.step(9.0)
    assert not quiet.lines and not quiet.changed and quiet.plan is plans[1]


def test_a_first_plan_the_full_search_made_is_not_searched_for_again():
    # the quick construction falls short of the target, so the full search makes the first
    # plan inside the same solve: the trial's request does not ask for the full search again
    maker = TableMaker(others=others(("other 1", 18.0)), quick_meets=False)
    lifecycle = Lifecycle(8 * GiB, maker=maker)
    steps = Steps(lifecycle)
    steps.step()
    made = steps.step()
    target = planner.planning_target(8 * GiB, 0.1)
    assert maker.solved == [target] and maker.quick_solves == [True]
    assert made.plan is lifecycle.plan and lifecycle.state == TRIAL
    assert len(maker.trial_requests) == 1 and not maker.trial_requests[0].refine


def test_planning_never_stalls_a_step_the_recording_mode_runs_until_the_plan_comes():
    runner = ManualRunner()
    maker = TableMaker(others=others(("other 1", 15.0)))
    lifecycle = Lifecycle(8 * GiB, maker=maker, runner=runner)
    steps = Steps(lifecycle)
    waiting = steps.record()
    assert lifecycle.state == PLANNING and runner.kinds == [FIRST]
    # as recorded: every saved tensor offloaded where it can be, inline, no plan
    assert waiting.run == AS_RECORDED and lifecycle.inline and waiting.plan is None
    assert waiting.modes == [OFFLOAD, OFFLOAD, OFFLOAD, KEEP] and waiting.changed
    assert not waiting.lines and not waiting.write_profile
    for _ in range(3):                    # steps go on while the plan is made
        assert steps.step().run == AS_RECORDED and not steps.decisions[-1].changed
    assert lifecycle.plan is None and not steps.lines
    runner.complete()
    taken = steps.step()                  # the plan takes over at the next step boundary
    assert taken.run == MODES and taken.plan is lifecycle.plan is not None and taken.changed
    assert taken.lines == (f"offload plan for 8.00 GiB: {taken.plan.describe()}",)
    assert runner.kinds == [FIRST, TRIALS] and lifecycle.timings[0][::2] == (FIRST, 4)
    # the plan made runs as its trial's first while the others are made; its timed steps
    # done, it runs on untimed
    steps.run(12.0)
    steps.step(50.0)
    steps.step(50.0)
    assert lifecycle.plan is taken.plan and lifecycle.state == TRIAL
    runner.complete()
    switched = steps.step(50.0)
    assert switched.lines[0].startswith("trying it against the plan other 1")
    assert lifecycle.plan is lifecycle.trial.plans[1] and switched.changed
    done = steps.run(10.0)
    assert done.lines == ("offload plans tried: as made 12.0 ms a step, other 1 10.0 ms a step; "
                          "keeping the plan other 1",)


def test_a_plan_ready_at_once_is_in_force_before_the_next_step_inline():
    lifecycle = Lifecycle(8 * GiB, maker=TableMaker(), trials=False)
    made = Steps(lifecycle).record()
    assert made.run == MODES and lifecycle.state == PLANNED and lifecycle.trial is None
    assert made.settled            # no trial runs: the plan made is the one a cache keeps
    assert lifecycle.timings == [(FIRST, lifecycle.timings[0][1], 0)]


@pytest.mark.parametrize("flushing, kept", [((False, True), 0), ((True, False), 1),
                                            ((False, False), 1)])
def test_a_trial_keeps_a_plan_that_flushed_only_where_none_did_not(flushing, kept):
    lifecycle = Lifecycle(8 * GiB, maker=TableMaker(others=others(("other 1", 15.0))))
    steps = Steps(lifecycle)
    steps.record()
    plans = lifecycle.trial.plans
    for ms, flushes in zip((10.0, 5.0), flushing):
        steps.step(ms)   # its first step, untimed
        for _ in range(STEPS - 1):
            steps.step(ms, flushes=int(flushes))
    assert lifecycle.plan is plans[kept]
    notes = ["" if not flushed else f" (1 flush after backward point 3)"
             for flushed in flushing]
    assert steps.lines[-1] == (f"offload plans tried: as made 10.0 ms a step{notes[0]}, "
                               f"other 1 5.0 ms a step{notes[1]}; keeping the plan "
                               + ("as made" if kept == 0 else "other 1"))


def test_a_trial_says_after_which_op_a_plan_flushed():
    lifecycle = Lifecycle(8 * GiB, maker=TableMaker(others=others(("other 1", 15.0))))
    steps = Steps(lifecycle)
    steps.record()
    steps.run(10.0)
    steps.step(5.0)                  # its first step, untimed
    count = steps.flushes
    # at unpacks of its timed steps: the first after backward point 1, the last after the forward
    # and after point 2; the line says the last step's (a first may be the allocator settling)
    for points in ((1,), (-1, 2)):
        for point in points:
            assert lifecycle.watches_flush_points
            count += 1
            lifecycle.saw_flushes("link", count, point)
        steps.flushes = count
        steps.step(5.0)
    assert steps.lines[-1] == ("offload plans tried: as made 10.0 ms a step, other 1 5.0 ms a "
                               "step (2 flushes after the forward and after backward point 2); "
                               "keeping the plan as made")


def test_a_trial_whose_every_plan_flushed_plans_for_less_while_the_fastest_runs():
    runner = ManualRunner()
    maker = TableMaker(others=others(("other 1", 15.0)))
    lifecycle = Lifecycle(8 * GiB, maker=maker, runner=runner)
    steps = Steps(lifecycle)
    steps.record()
    runner.complete()
    steps.step(10.0)                     # the plan takes over; its trial's plans asked for
    runner.complete()
    first = lifecycle.target
    plans = lifecycle.trial.plans        # the others join it at the next step's end
    steps.run(10.0, flushes=1)
    steps.run(5.0, flushes=1)
    assert runner.kinds[-1] == LOWER and lifecycle.state == WATCHING
    assert lifecycle.plan is plans[1]        # the fastest runs while the plan for less is made
    steps.step(5.0)
    runner.complete()
    lowered = steps.step(5.0)
    step = int(0.1 / 2 * 8 * GiB)
    assert lifecycle.target == first - step == lifecycle.plan.target
    assert lifecycle.replans_used == 1 and lifecycle.lowerings_left == 2
    assert lowered.lines == (
        f"offload plans tried: as made 10.0 ms a step (1 flush after backward point "
        f"3), other 1 5.0 ms a step (1 flush after backward point 3); each flushed the "
        f"caching allocator's cache, so planning for {(first - step) / GiB:.2f} GiB",
        f"offload plan for 8.00 GiB (planned for {(first - step) / GiB:.2f} GiB): "
        f"{lifecycle.plan.describe()}")
    # the plan for less is tried as ever, without the larger targets (the target was lowered)
    assert runner.kinds[-1] == TRIALS and lifecycle.state == TRIAL
    runner.complete()
    steps.step()
    assert maker.trial_requests[-1].larger_budgets == ()


def test_a_lowering_stops_a_quarter_short_where_that_plan_is_faster_and_gives_room():
    step = int(0.1 / 2 * 8 * GiB)
    first = planner.planning_target(8 * GiB, 0.1)
    # the plan for a quarter of the headroom less is 10 % faster than the one for half
    nearer = first - step + step // 2
    maker = TableMaker(ms=lambda target: 18.0 if target == nearer else 20.0,
                       others=others(("other 1", 15.0)))
    lifecycle = Lifecycle(8 * GiB, maker=maker)
    steps = Steps(lifecycle)
    steps.record()
    steps.run(10.0, flushes=1)
    steps.run(5.0, flushes=1)
    assert lifecycle.target == nearer and lifecycle.plan.step_ms == 18.0
    assert maker.solved[-2:] == [first - step, nearer]


def test_a_lone_plan_that_flushed_in_its_trial_says_so_and_plans_for_less():
    lifecycle = Lifecycle(8 * GiB, maker=TableMaker())
    steps = Steps(lifecycle)
    steps.record()
    assert lifecycle.state == TRIAL and len(lifecycle.trial.plans) == 1   # alone: lowerings left
    replaced = lifecycle.plan
    steps.run(10.0, flushes=1)
    lowered = lifecycle.target
    assert steps.lines[-3] == (f"the offload plan ran 10.0 ms a step (1 flush "
                               "after backward point 3); it flushed the caching allocator's "
                               f"cache, so planning for {lowered / GiB:.2f} GiB")
    # the plan for less is tried against the one it replaced (a flush that no plan's saved
    # tensors cause flushes at every target)
    assert steps.lines[-1].startswith("trying it against the plan from before the lowering (")
    assert lifecycle.trial.plans[-1] is replaced and lifecycle.trial.labels[-1] == \
        "from before the lowering"


@pytest.mark.parametrize("settling", [1, STEPS - 1])
def test_a_lone_plan_that_flushed_only_while_the_allocator_settled_stays(settling):
    # VGG-16 N=256 at 12 GiB on an H200: the plan taking over from the recording flushed in its
    # first two steps, as the caching allocator cut its segments anew (reserved memory growing),
    # and in none after; a plan too large for its room flushes in every step, its last one too
    lifecycle = Lifecycle(8 * GiB, maker=TableMaker())
    steps = Steps(lifecycle)
    steps.record()
    plan = lifecycle.plan
    for index in range(STEPS):   # its first step untimed, then flushing till its last
        steps.step(10.0, flushes=int(index < settling))
    assert lifecycle.plan is plan and lifecycle.state == WATCHING
    for _ in range(planner.WATCH_STEPS):
        steps.step(10.0)
    assert lifecycle.plan is plan and lifecycle.state == WATCHING
    assert not any("flushed" in line or "planning for" in line for line in steps.lines)


def test_a_lone_plan_that_flushed_in_its_last_trial_step_plans_for_less():
    lifecycle = Lifecycle(8 * GiB, maker=TableMaker())
    steps = Steps(lifecycle)
    steps.record()
    for index in range(STEPS):
        steps.step(10.0, flushes=int(index == STEPS - 1))
    assert any(line.startswith("the offload plan ran 10.0 ms a step (1 flush") and
               "so planning for" in line for line in steps.lines)


def _lowered_after_a_flushing_plan():
    """A lifecycle (one lowering) whose first plan, a trial of one, flushed: the plan for less
    is in force, its trial ending with the plan it replaced. (lifecycle, steps, that plan)"""
    lifecycle = Lifecycle(8 * GiB, maker=TableMaker(), replans=1)
    steps = Steps(lifecycle)
    steps.record()
    first = lifecycle.plan
    steps.run(5.0, flushes=1)                    # a trial of one: it flushed, so planning for less
    assert lifecycle.plan is not first and lifecycle.trial.plans[-1] is first
    return lifecycle, steps, first


def test_a_lowering_that_only_slows_the_step_gives_back_the_plan_it_replaced():
    # every plan flushes (a flush no plan's saved tensors cause: a convolution's workspace); the
    # plan for less runs slower, so the one it replaced, tried again beside it, stays once no
    # lowering is left
    lifecycle, steps, first = _lowered_after_a_flushing_plan()
    steps.run(10.0, flushes=1)                   # the plan for less
    steps.run(5.0, flushes=1)                    # the plan it replaced
    assert lifecycle.lowerings_left == 0 and lifecycle.state == WATCHING
    assert lifecycle.plan is first and lifecycle.kept_after_trial == "from before the lowering"
    assert steps.lines[-1] == (
        f"offload plans tried: as made 10.0 ms a step (1 flush after backward point "
        f"3), from before the lowering 5.0 ms a step (1 flush after backward point "
        f"3); keeping the plan from before the lowering")


def test_a_lowering_whose_plan_is_calm_does_not_run_the_plan_it_replaced_again():
    # the plan for less does not flush: the one it replaced flushed (that is why it was
    # lowered) and a trial keeps no plan that flushes where one did not, so the trial ends with
    # the plan for less and the replaced one's steps are not spent on it again
    lifecycle, steps, first = _lowered_after_a_flushing_plan()
    lowered = lifecycle.plan
    assert steps.lines[-1].endswith(" where the plans for less flush too, 3 steps each")
    steps.run(10.0)                              # the plan for less, calm
    assert lifecycle.state == WATCHING and lifecycle.trial is None
    assert lifecycle.plan is lowered and lifecycle.kept_after_trial is None
    assert steps.lines[-1] == ("offload plans tried (not the one from before the lowering, "
                               "which flushed): as made 10.0 ms a step; keeping the plan as made")


def test_a_lone_plan_without_a_lower_target_stays_and_nothing_is_said():
    lifecycle = Lifecycle(8 * GiB, maker=TableMaker(least=int(7.2 * GiB)))
    steps = Steps(lifecycle)
    steps.record()
    steps.run(10.0, flushes=1)
    assert len(steps.lines) == 1 and lifecycle.lowerings_left == 0
    assert lifecycle.state == WATCHING and lifecycle.replans_used == 0


def test_a_plan_that_flushes_after_its_trial_is_replaced_by_one_for_less():
    lifecycle = Lifecycle(8 * GiB, maker=TableMaker(others=others(("other 1", 15.0))))
    steps = Steps(lifecycle)
    steps.record()
    steps.run(10.0)
    steps.run(5.0)
    first = lifecycle.target
    assert lifecycle.state == WATCHING
    steps.step(5.0, flushes=1)
    steps.step(5.0)
    assert lifecycle.target == first
    steps.step(5.0, flushes=1)         # the second flush in the last WATCH_STEPS steps
    lowered = first - int(0.05 * 8 * GiB)
    assert lifecycle.target == lowered == lifecycle.plan.target
    assert steps.lines[-3:-1] == [
        f"the offload plan flushed the caching allocator's cache in 2 of its last 3 steps, so "
        f"planning for {lowered / GiB:.2f} GiB",
        f"offload plan for 8.00 GiB (planned for {lowered / GiB:.2f} GiB): "
        f"{lifecycle.plan.describe()}"]
    assert steps.lines[-1].startswith("trying it against") and lifecycle.state == TRIAL


def test_a_quick_first_plan_gives_way_to_the_full_searchs_where_that_is_faster():
    # the first plan in force is the quick construction's (in force steps sooner); the full
    # search's, made with the trial's request, replaces it where predicted faster, and the
    # trial's other plans are made against it
    maker = TableMaker(quick_ms=30.0, others=others(("other 1", 19.0)))
    lifecycle = Lifecycle(8 * GiB, maker=maker)
    steps = Steps(lifecycle)
    made = steps.record()                 # both requests made inline at its end
    assert maker.quick_solves == [True, False]
    assert made.lines[0].startswith("offload plan for 8.00 GiB: ") and "step 30.0 ms" in made.lines[0]
    (trial,) = maker.trial_requests
    full = trial.plan
    assert trial.refine and full.step_ms == 20.0 and full.modes != (RECOMPUTE, KEEP, RECOMPUTE, KEEP)
    assert lifecycle.plan is full and made.plan is full and made.changed
    assert lifecycle.trial.labels == ["as made", "other 1"]
    assert lifecycle.trial.plans[0] is full and lifecycle.trial.plans[1].step_ms == 19.0
    assert made.lines[1] == ("offload plan for 8.00 GiB, made by the full search (the quick one "
                             f"ran meanwhile): {full.describe()}")
    assert made.lines[2].startswith("trying it against the plan other 1 (")
    steps.run(20.0)
    steps.run(21.0)
    assert lifecycle.plan is full and lifecycle.state == WATCHING
    assert steps.lines[-1].endswith("keeping the plan as made")


def test_a_quick_first_plan_the_full_search_does_not_beat_stays_untried():
    maker = TableMaker(quick_ms=20.05)    # within TRIAL_MIN_GAIN of the full search's 20 ms
    lifecycle = Lifecycle(8 * GiB, maker=maker)
    steps = Steps(lifecycle)
    made = steps.record()
    assert maker.quick_solves == [True, False] and lifecycle.plan is made.plan
    assert made.plan.step_ms == 20.05 and len(made.lines) == 1


def test_a_quick_first_plan_whose_trial_a_failed_step_ended_still_gives_way_to_the_full_searchs():
    # a step of the quick plan fails (not out of memory: no plan for less follows) while the
    # trial's request, which makes the full search's plan, is being made: the trial is over,
    # but the quick construction's plan (here 50 % slower) does not stay unchecked
    maker = TableMaker(quick_ms=30.0, others=others(("other 1", 19.0)))
    runner = ManualRunner()
    lifecycle = Lifecycle(8 * GiB, maker=maker, runner=runner)
    steps = Steps(lifecycle)
    steps.record()
    runner.complete()                     # the first plan: the quick one, in force
    steps.step()
    assert lifecycle.plan.step_ms == 30.0 and lifecycle.awaiting == TRIALS
    steps.step(status=FAILED)
    assert lifecycle.state == WATCHING and lifecycle.trial is None
    runner.complete()                     # the trial's request, the full search's plan with it
    made = steps.step()
    assert lifecycle.plan.step_ms == 20.0 and made.changed and made.plan is lifecycle.plan
    assert made.lines == ("offload plan for 8.00 GiB, made by the full search (the quick one "
                          f"ran meanwhile): {lifecycle.plan.describe()}",)
    assert lifecycle.state == WATCHING and lifecycle.trial is None
    steps.run(20.0)                       # the trial's other plans are not run
    assert lifecycle.plan.step_ms == 20.0 and not runner.waiting


def test_without_trials_the_first_plan_is_the_full_searchs():
    maker = TableMaker(quick_ms=30.0)
    lifecycle = Lifecycle(8 * GiB, maker=maker, trials=False)
    steps = Steps(lifecycle)
    made = steps.record()
    assert maker.quick_solves == [False] and made.plan.step_ms == 20.0
    assert lifecycle.state == PLANNED and not maker.trial_requests


def test_lowerings_end_where_no_plan_meets_the_lower_target():
    first = planner.planning_target(8 * GiB, 0.1)
    maker = TableMaker(least=first - 1)
    lifecycle = Lifecycle(8 * GiB, maker=maker)
    steps = Steps(lifecycle)
    steps.record()
    steps.run(10.0, flushes=1)
    assert lifecycle.lowerings_left == 0 and lifecycle.target == first and len(steps.lines) == 1
    for _ in range(planner.WATCH_STEPS):   # the watch asks for nothing more
        steps.step(10.0, flushes=1)
    # the first plan, its full search with the trial's request, the lower target
    assert lifecycle.awaiting is None and len(maker.solved) == 3


def test_a_planned_step_out_of_memory_plans_for_less_then_falls_back():
    maker = TableMaker()
    lifecycle = Lifecycle(8 * GiB, maker=maker, trials=False, replans=2, replan_step=0.1)
    steps = Steps(lifecycle)
    steps.record()
    first = lifecycle.plan
    replanned = steps.step(status=OUT_OF_MEMORY)
    target = min(lifecycle.profile and first.target, first.peak) - int(0.1 * 8 * GiB)
    assert replanned.run == MODES and lifecycle.plan.target == target == lifecycle.target
    assert replanned.lines == (
        f"a step under the offload plan for 8.00 GiB ran out of device memory (modelled peak "
        f"{first.peak / GiB:.2f} GiB); planning for {target / GiB:.2f} GiB: "
        f"{lifecycle.plan.describe()}",)
    assert replanned.write_profile and replanned.settled and lifecycle.replans_used == 1
    assert lifecycle.state == PLANNED
    steps.step(status=OUT_OF_MEMORY)
    last = lifecycle.plan
    fell = steps.step(status=OUT_OF_MEMORY)
    assert fell.lines == ("a step under the offload plan for 8.00 GiB ran out of device memory; "
                          "offloading every saved tensor from now on",)
    assert lifecycle.fell_back and lifecycle.state == FALLBACK and fell.run == AS_RECORDED
    assert fell.modes == [OFFLOAD, OFFLOAD, OFFLOAD, KEEP] and fell.write_profile
    assert fell.fell_back and not fell.settled     # a cached plan is forgotten
    assert lifecycle.plan is last        # the last plan tried, as the profile document says
    assert not steps.step(status=OUT_OF_MEMORY).lines and not steps.step().lines


def planned_by_hand() -> tuple:
    """A lifecycle (no trials) whose plans come when completed by hand, past its recording and
    its first planned step: its runner, itself and its steps."""
    runner = ManualRunner()
    lifecycle = Lifecycle(8 * GiB, maker=TableMaker(), runner=runner, trials=False)
    steps = Steps(lifecycle)
    steps.record()
    runner.complete()
    steps.step()
    return runner, lifecycle, steps


def test_while_a_replan_is_made_the_steps_run_as_recorded():
    runner, lifecycle, steps = planned_by_hand()
    waiting = steps.step(status=OUT_OF_MEMORY)
    assert lifecycle.state == REPLANNING and waiting.run == AS_RECORDED and waiting.changed
    assert runner.kinds[-1] == REPLAN and not waiting.lines
    assert not steps.step(status=OUT_OF_MEMORY).lines   # as recorded: nothing lower to plan
    runner.complete()
    assert steps.step().lines[0].startswith("a step under the offload plan for 8.00 GiB ran out")
    assert lifecycle.state == PLANNED and lifecycle.replans_left == 2


def test_a_replan_that_finds_no_plan_falls_back():
    first = planner.planning_target(8 * GiB, 0.1)
    lifecycle = Lifecycle(8 * GiB, maker=TableMaker(least=first), trials=False)
    steps = Steps(lifecycle)
    steps.record()
    fell = steps.step(status=OUT_OF_MEMORY)
    assert lifecycle.fell_back and fell.lines[0].endswith("offloading every saved tensor from "
                                                          "now on")


def test_a_trial_plan_out_of_memory_leaves_the_fastest_that_ran_without_a_replan():
    lifecycle = Lifecycle(8 * GiB, maker=TableMaker(others=others(("other 1", 15.0),
                                                                  ("other 2", 14.0))))
    steps = Steps(lifecycle)
    steps.record()
    plans = lifecycle.trial.plans
    steps.run(10.0)
    steps.run(8.0)
    failed = steps.step(status=OUT_OF_MEMORY)
    assert failed.lines == ("the plan other 2 ran out of device memory in its trial: as made "
                            "10.0 ms a step, other 1 8.0 ms a step; keeping the plan other 1",)
    assert lifecycle.plan is plans[1] and lifecycle.replans_used == 0 and lifecycle.trial is None
    steps2 = Steps(Lifecycle(8 * GiB, maker=TableMaker(others=others(("other 1", 15.0)))))
    steps2.record()
    steps2.run(10.0)
    assert steps2.step(status=FAILED).lines[0].startswith("a step of the plan other 1 failed in "
                                                          "its trial: as made 10.0 ms a step; ")


def test_a_step_of_the_plan_made_out_of_memory_in_its_trial_replans_and_drops_the_trial():
    runner = ManualRunner()
    lifecycle = Lifecycle(8 * GiB, maker=TableMaker(others=others(("other 1", 15.0))),
                          runner=runner)
    steps = Steps(lifecycle)
    steps.record()
    runner.complete()
    steps.step()
    assert runner.kinds == [FIRST, TRIALS]
    steps.step(status=OUT_OF_MEMORY)     # the trial's plans still being made
    assert runner.kinds[-1] == REPLAN and lifecycle.trial is None
    runner.complete(2)                   # the trial's answer comes first: no longer awaited
    replanned = steps.step()
    assert lifecycle.state == WATCHING and lifecycle.trial is None
    assert len(replanned.lines) == 1 and "ran out of device memory (modelled" in replanned.lines[0]


def test_no_plan_at_the_headrooms_target_plans_for_a_smaller_headroom():
    first = planner.planning_target(8 * GiB, 0.1)
    lifecycle = Lifecycle(8 * GiB, maker=TableMaker(least=first + 1))
    steps = Steps(lifecycle)
    steps.record()
    target = planner.planning_target(8 * GiB, 0.05)
    assert lifecycle.target == target == lifecycle.plan.target and lifecycle.lowerings_left == 0
    assert steps.lines[:2] == [
        f"no offload plan for 8.00 GiB less its headroom (10%); planning for "
        f"{target / GiB:.2f} GiB, 5.0% less",
        f"offload plan for 8.00 GiB (planned for {target / GiB:.2f} GiB): "
        f"{lifecycle.plan.describe()}"]
    # why, as text: the lifecycle keeps no error, whose traceback would hold the frames it was
    # made in for the session's life
    assert lifecycle.first_error_message == f"{first} is too small for this step (test)"
    assert not any(isinstance(value, BaseException) for value in vars(lifecycle).values())


def test_no_plan_at_all_raises_where_strict_else_offloads_everything():
    maker = TableMaker(least=9 * GiB)
    strict = Steps(Lifecycle(8 * GiB, maker=maker))
    strict.step()
    with pytest.raises(InfeasibleError, match="too small for this step"):
        strict.step()
    assert strict.lifecycle.state == UNPLANNED and not strict.decisions[-1].write_profile
    lifecycle = Lifecycle(8 * GiB, maker=TableMaker(least=9 * GiB), strict=False)
    steps = Steps(lifecycle)
    unplanned = steps.record()
    assert unplanned.lines == (f"{planner.planning_target(8 * GiB, 0.1)} is too small for this "
                               "step (test); offloading every saved tensor",)
    assert unplanned.run == MODES and unplanned.plan is None and unplanned.write_profile
    assert unplanned.modes == [OFFLOAD, OFFLOAD, OFFLOAD, KEEP] and not lifecycle.inline
    # the least peak the planner found is the step's floor, for the plan cache, once
    assert unplanned.least_peak == 9 * GiB and steps.step().least_peak is None
    fell = steps.step(status=OUT_OF_MEMORY)     # no plan to make again: the fall-back
    assert lifecycle.fell_back and fell.run == AS_RECORDED and len(fell.lines) == 1


def test_a_solver_failure_has_no_smaller_headroom():
    class Failing(TableMaker):
        def solve(self, profile, target, explain=True):
            self.solved.append(target)
            raise SolverError("CBC failed (test)")
    maker = Failing()
    steps = Steps(Lifecycle(8 * GiB, maker=maker, strict=False))
    assert steps.record().lines == ("CBC failed (test); offloading every saved tensor",)
    assert len(maker.solved) == 1


def test_the_profile_is_the_least_of_the_recordings_and_a_failed_recording_records_again():
    lifecycle = Lifecycle(8 * GiB, maker=TableMaker(), record_steps=2, trials=False)
    steps = Steps(lifecycle)
    steps.step(profile=profile(forward_ms=30.0))
    failed = steps.step(status=OUT_OF_MEMORY)
    assert failed.lines == ("the recording step failed (out of device memory); recording the "
                            "next one",) and failed.run == RECORD
    assert steps.step(status=FAILED).lines == ("the recording step failed; recording the next "
                                               "one",)
    steps.step(ms=5.0, status=ABANDONED)      # nothing learnt: still recording
    assert lifecycle.state == RECORDING
    steps.step(profile=profile(forward_ms=20.0))
    assert lifecycle.profile.forward_ms == 20.0 and lifecycle.state == PLANNED
    one = Lifecycle(8 * GiB, maker=TableMaker(), record_steps=1)
    Steps(one).step()
    assert one.plan is not None


def test_a_fixed_plan_changes_nothing_until_a_budgeted_step_runs_out_of_memory():
    for lifecycle in (Lifecycle(None), Lifecycle(8 * GiB, force=KEEP),
                      Lifecycle(8 * GiB, modes=[KEEP, OFFLOAD, KEEP])):
        steps = Steps(lifecycle)
        assert lifecycle.state == FIXED and lifecycle.run == MODES
        modes = lifecycle.modes
        for status in (OK, FAILED, OK):
            decision = steps.step(status=status)
            assert decision.modes == modes and not decision.changed and not decision.lines
        fell = steps.step(status=OUT_OF_MEMORY)
        if lifecycle.budget is None:
            assert not fell.lines and not lifecycle.fell_back
        else:    # no profile: the step's own groups, offloaded where they can be
            assert lifecycle.fell_back and fell.modes == [OFFLOAD, OFFLOAD, KEEP]


def test_a_stage_taken_makes_the_staged_profile_the_one_planned_on():
    staged = profile(3)
    stage = planner_stage.Stage(modules=2, first_group=0, end_group=2, input_group=0,
                          input_bytes=MiB, chunks=4, forward_ms=1.0)

    class Staging(TableMaker):
        def choose_stage(self, profile, target, candidates, staging):
            self.asked = (candidates, staging)
            return plan(target, modes=(KEEP,) * 3), (candidates[0], staged)
    maker = Staging()
    lifecycle = Lifecycle(8 * GiB, maker=maker, trials=False, staging="always")
    steps = Steps(lifecycle)
    candidate = StageCandidate(stage, 8, payload="modules")
    steps.step(stage_candidates=(candidate,))
    made = steps.step(stage_candidates=(candidate,))
    assert maker.asked == ((candidate,), "always") and made.staged
    assert lifecycle.profile is staged and lifecycle.recorded_profile is not staged
    assert lifecycle.stage is candidate and made.lines[0].endswith("; " + stage.describe())


def test_an_error_in_the_planner_is_raised_at_the_next_step_boundary():
    class Broken(TableMaker):
        def trial_plans(self, request):
            raise RuntimeError("a bug (test)")
    runner = ManualRunner()
    steps = Steps(Lifecycle(8 * GiB, maker=Broken(), runner=runner))
    steps.record()
    runner.complete()
    steps.step()
    runner.complete()
    with pytest.raises(RuntimeError, match="a bug"):
        steps.step()


def test_the_background_runner_plans_on_its_own_thread_while_steps_go_on():
    release, threads = threading.Event(), []

    class Slow(TableMaker):
        def solve(self, profile, target, explain=True):
            threads.append(threading.current_thread())
            assert release.wait(10)
            return super().solve(profile, target, explain)
    runner = BackgroundRunner()
    lifecycle = Lifecycle(8 * GiB, maker=Slow(), runner=runner, trials=False)
    steps = Steps(lifecycle)
    waiting = steps.record()
    assert waiting.run == AS_RECORDED and runner.busy()
    assert steps.step().run == AS_RECORDED       # no step waits for the solver
    release.set()
    assert runner.wait(10) and not runner.busy()
    taken = steps.step()
    assert taken.run == MODES and lifecycle.plan is not None
    assert threads and threads[0] is not threading.current_thread()
    assert lifecycle.timings[0][2] == 2     # steps that ended while it was made


def test_inline_runner_hands_back_what_it_made_and_what_failed():
    runner = InlineRunner()
    runner.submit("request", lambda request: 1 / 0)
    [(request, made)] = runner.ready()
    assert request == "request" and isinstance(made, ZeroDivisionError) and not runner.ready()


def test_the_lifecycle_is_torch_free():
    code = ("import sys, mucudnn.torch.lifecycle, mucudnn.torch.plan_runner; "
            "print('torch' in sys.modules, 'pulp' in sys.modules)")
    import subprocess
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_inline_with_the_real_planner_makes_the_replays_plan_and_trial_plans():
    # a chain of 1 GiB groups, every second rebuilt from the one before, a slow link: its plan
    # and trial plans as mucudnn.torch.profiles.replay makes them (CBC, a second or so)
    n = 6
    groups = [SavedGroup(GiB, first_unpack=n - 1 - g, last_unpack=n - 1 - g, producer=f"m{g}",
                         recompute_ms=0.5 if g % 2 else None,
                         recompute_source=(g - 1,) if g % 2 else None) for g in range(n)]
    recorded = StepProfile(groups, forward_ms=30.0, backward_ms=60.0, d2h_gbps=5.0,
                           h2d_gbps=5.0, unpacks=n, baseline_forward=[GiB] * n,
                           baseline_backward=[GiB] * n)
    budget = 6 * GiB
    lifecycle = Lifecycle(budget, record_steps=1)
    decision = lifecycle.end_step(StepOutcome(OK, profile=recorded, mark=0.0))
    replayed = profiles.replay(recorded, budget, trials=True)
    assert decision.plan == replayed.plan and lifecycle.target == replayed.target
    assert decision.lines[0] == f"offload plan for 6.00 GiB: {replayed.plan.describe()}"
    assert lifecycle.trial is not None or not replayed.trials
    if lifecycle.trial is not None:
        assert lifecycle.trial.plans[1:] == [p for _, p in replayed.trials]


def test_a_cached_plan_runs_from_the_first_step_without_recording_or_a_solve():
    maker = TableMaker()
    lifecycle = Lifecycle(8 * GiB, maker=maker)
    cached = plan(int(6.5 * GiB), target=int(6.5 * GiB))
    recorded = profile()
    started = lifecycle.start_cached(cached, recorded, kept_after_trial="other 1")
    assert started.run == MODES and started.plan is cached and started.changed
    assert started.lines == (f"offload plan for 8.00 GiB from the plan cache (planned for 6.50 "
                             f"GiB): {cached.describe()}",)
    assert lifecycle.state == WATCHING and lifecycle.target == int(6.5 * GiB)
    assert lifecycle.kept_after_trial == "other 1" and lifecycle.profile is recorded
    steps = Steps(lifecycle)
    for _ in range(3):
        assert steps.step().plan is cached
    assert not maker.solved and not steps.lines
    # out of memory: a plan for less than its target, as after a trial
    steps.step(status=OUT_OF_MEMORY)
    assert maker.solved == [int(6.5 * GiB) - int(0.1 * 8 * GiB)]


def test_a_cached_plan_that_does_not_fit_the_step_records_anew():
    lifecycle = Lifecycle(8 * GiB, maker=TableMaker(), trials=False)
    lifecycle.start_cached(plan(7 * GiB), profile())
    steps = Steps(lifecycle)
    anew = lifecycle.record_anew("group 2: 256 MiB recorded, 128 MiB now (the batch changed?)")
    assert anew.lines == ("the cached offload plan does not fit this step: group 2: 256 MiB "
                          "recorded, 128 MiB now (the batch changed?); recording anew",)
    assert anew.run == RECORD and anew.plan is None and lifecycle.profile is None
    # the step that began under the cached plan went on as recorded: no recording
    mixed = steps.step(recorded=False)
    assert mixed.run == RECORD and lifecycle.state == RECORDING
    steps.record()
    assert lifecycle.state == PLANNED and lifecycle.target == planner.planning_target(8 * GiB, 0.1)


@pytest.mark.parametrize("case", ["cliff", "no gain", "no room"])
def test_a_lowering_after_flushes_stops_short_of_a_step_in_the_plans_time(case):
    # the plan for half the headroom lower (0.85 of the budget) moves much more than the one
    # for a quarter lower (0.875), which still peaks below the plan that flushed: that one
    # is made, unless it is not faster by LOWERING_MIN_GAIN or gives no room
    budget = 1000 << 20
    flushed_peak = int(0.89 * budget)
    quarter_peak = {"cliff": 0.87, "no gain": 0.87, "no room": 0.89}[case]
    quarter_ms = {"cliff": 85.5, "no gain": 95.5, "no room": 85.5}[case]

    class Cliff(TableMaker):
        def solve(self, profile, target, explain=True):
            self.solved.append(target)
            if target >= int(0.875 * budget):
                return OffloadPlan((KEEP,), 2, int(quarter_peak * budget), quarter_ms, 0)
            return OffloadPlan((OFFLOAD,), 2, int(0.84 * budget), 103.6, 800 << 20,
                               simulated_ms=100.0)
    maker = Cliff()
    made = maker(PlanRequest(LOWER, profile(), int(0.9 * budget), budget, 0.1,
                             peak=flushed_peak))
    assert maker.solved == [int(0.9 * budget) - int(0.05 * budget),
                            int(0.9 * budget) - int(0.05 * budget) + int(0.05 * budget) // 2]
    if case == "cliff":
        assert made.target == maker.solved[1] and made.plan.step_ms == 85.5
    else:
        assert made.target == maker.solved[0] and made.plan.moved_bytes == 800 << 20


def test_while_a_replan_is_made_after_a_rescued_step_the_plan_that_ran_out_runs():
    """A rescued step (rescue.py) ran to its end: its plan stays in force until the plan for
    less comes, rather than the recording's way; a step that raised falls to that way."""
    runner, lifecycle, steps = planned_by_hand()
    in_force, plan_in_force = list(lifecycle.modes), lifecycle.plan
    waiting = steps.step(status=RESCUED)
    assert lifecycle.state == REPLANNING and runner.kinds[-1] == REPLAN
    assert waiting.run == MODES and waiting.modes == in_force and not waiting.changed
    assert steps.step(status=RESCUED).run == MODES    # rescued again: nothing more asked
    assert runner.kinds.count(REPLAN) == 1
    raised = steps.step(status=OUT_OF_MEMORY)          # one step raised after all
    assert raised.run == AS_RECORDED and raised.changed and runner.kinds.count(REPLAN) == 1
    runner.complete()
    done = steps.step()
    assert done.lines[0].startswith("a step under the offload plan for 8.00 GiB ran out")
    assert lifecycle.state == PLANNED and done.run == MODES and done.changed
    assert lifecycle.plan is not plan_in_force
    assert lifecycle.replans_left == 2


def lone_plan_lowering_asked() -> tuple:
    """A lifecycle whose plans come when completed by hand, past a trial of one plan that
    flushed: the plan for less asked for, the plan in force watched meanwhile. Its runner,
    itself, its steps, that plan and its target."""
    runner = ManualRunner()
    lifecycle = Lifecycle(8 * GiB, maker=TableMaker(), runner=runner)
    steps = Steps(lifecycle)
    steps.record()
    runner.complete()
    steps.step(10.0)                     # the plan takes over; its trial's plans asked for
    runner.complete()                    # none: a trial of one
    first, target = lifecycle.plan, lifecycle.target
    steps.run(10.0, flushes=1)
    assert runner.kinds[-1] == LOWER and lifecycle.state == WATCHING
    return runner, lifecycle, steps, first, target


def test_a_plan_for_less_that_comes_after_the_plan_in_force_stopped_flushing_is_not_taken():
    # the lone plan flushed in its trial (the caching allocator settling: each plan starts from
    # an emptied cache); by the time the plan for less is made in the background it has run
    # WATCH_STEPS steps without a flush: it stays, and the lowering counts as one
    runner, lifecycle, steps, first, target = lone_plan_lowering_asked()
    for _ in range(planner.WATCH_STEPS):
        steps.step(10.0)
    runner.complete()
    stays = steps.step(10.0)
    assert lifecycle.plan is first and lifecycle.target == target and not stays.changed
    assert lifecycle.state == WATCHING and lifecycle.lowerings_left == 2
    assert lifecycle.replans_used == 0 and runner.kinds[-1] == LOWER
    assert stays.lines == (
        f"the offload plan flushed the caching allocator's cache in none of its last "
        f"{planner.WATCH_STEPS} steps while the plan for "
        f"{(target - int(0.1 / 2 * 8 * GiB)) / GiB:.2f} GiB was made: it stays",)
    # it is watched on: two flushes in its last WATCH_STEPS steps ask for less again
    steps.step(10.0, flushes=1)
    steps.step(10.0, flushes=1)
    assert runner.kinds[-1] == LOWER and lifecycle._awaiting is not None


def test_a_plan_for_less_that_comes_while_the_plan_in_force_still_flushes_takes_over():
    runner, lifecycle, steps, first, target = lone_plan_lowering_asked()
    for flushes in (0, 0, 1, 0):         # one flush in the last WATCH_STEPS steps
        steps.step(10.0, flushes=flushes)
    runner.complete()
    lowered = steps.step(10.0)
    assert lifecycle.plan is not first and lifecycle.target < target and lowered.changed
    assert lifecycle.replans_used == 1
    assert lowered.lines[0].startswith("the offload plan ran 10.0 ms a step")


QUICK_WORSE = ("benchmarks/results/offload/h200/offload-mucudnn-7b2214f-h200.json", 4)


def committed_profile(name: str, row: int | None):
    """The recorded profile of row ``row`` of committed results file ``name`` (skipped where the
    file is not beside this checkout)."""
    from pathlib import Path
    path = Path(__file__).resolve().parents[2] / name
    if not path.exists():
        pytest.skip(f"{name} is not beside this checkout")
    return profiles.load_profile(path, row)


def test_the_makers_quick_first_plan_is_refined_by_the_trial_request_where_the_full_search_wins():
    # a committed ResNet-50 profile whose quick construction (one-group changes from
    # everything kept) is 11 % slower than the full search at 14.4 GiB: the first plan is the
    # quick one, and the trial's request brings the full search's, predicted faster, first
    recorded = committed_profile(*QUICK_WORSE)
    target = 15461882265
    maker = PlanMaker()
    first = maker(PlanRequest(FIRST, recorded.profile, target, quick=True))
    full = maker(PlanRequest(FIRST, recorded.profile, target)).plan
    assert first.quick and first.plan.peak <= target and full.peak <= target
    assert first.plan.predicted_ms > full.predicted_ms * (1 + planner.TRIAL_MIN_GAIN)
    made = maker(PlanRequest(TRIALS, recorded.profile, target, plan=first.plan, refine=True))
    assert made.refined is not None and made.refined.modes == full.modes
    assert made.refined.target == first.plan.target
    assert all(plan != first.plan for _, plan in made.trials)
    # without refine, nothing replaces it
    plain = maker(PlanRequest(TRIALS, recorded.profile, target, plan=first.plan))
    assert plain.refined is None


QUICK_SHORT = ("benchmarks/results/offload/h200/exposure-r3d18-b4dd857-h200.json", 0, 4348654387)


def test_the_makers_first_plan_is_not_quick_where_the_quick_construction_falls_short():
    # a committed R3D-18 profile whose quick construction does not meet the target: the full
    # search makes the first plan in the same request, and the result says it is not the quick
    # one (so the trial's request does not search again), the same plan as without ``quick``
    recorded = committed_profile(*QUICK_SHORT[:2])
    maker = PlanMaker()
    first = maker(PlanRequest(FIRST, recorded.profile, QUICK_SHORT[2], quick=True))
    full = maker(PlanRequest(FIRST, recorded.profile, QUICK_SHORT[2])).plan
    assert not first.quick and first.plan.modes == full.modes
    made = []
    planner_fast.plan_modes(recorded.profile, QUICK_SHORT[2], 2,
                            start=[KEEP] * len(recorded.profile.groups), quick=True,
                            made_by=made)
    assert made == [planner_fast.FULL]


def test_a_lowering_that_another_of_the_recordings_stages_meets_faster_takes_that_stage():
    # VGG-16 N=176 under 6.5 GiB: the first plan, on the recorded profile, flushed; for half the
    # headroom less, a longer stage of the recording's meets the target faster than moving more
    staged = profile(3)
    stage = planner_stage.Stage(modules=2, first_group=0, end_group=2, input_group=0,
                                input_bytes=MiB, chunks=4, forward_ms=1.0)
    candidate = StageCandidate(stage, 8, payload="modules")

    class StagingWhenLower(TableMaker):
        def choose_stage(self, profile, target, candidates, staging):
            self.weighed = (profile, candidates)
            return plan(target, modes=(KEEP,) * 4), None      # the plain plan first

        def _staged_lowering(self, request, target, made):
            self.lowered = request
            return PlanResult(request, plan(target, 15.0, modes=(KEEP,) * 3), target,
                              stage=candidate, profile=staged)
    maker = StagingWhenLower()
    lifecycle = Lifecycle(8 * GiB, maker=maker)
    steps = Steps(lifecycle)
    for _ in range(planner.RECORD_STEPS):     # the recording, its stages the last step's
        steps.step(stage_candidates=(candidate,))
    recorded = lifecycle.profile
    assert lifecycle.stage is None and maker.weighed == (recorded, (candidate,))
    # (its trial alone, the plan made flushes: a plan for less is asked for)
    decision = steps.run(10.0, flushes=1)
    request = maker.lowered
    assert request.kind == LOWER and request.candidates == (candidate,) and \
        request.recorded is recorded and request.profile is recorded
    assert decision.staged and lifecycle.stage is candidate
    assert lifecycle.profile is staged and lifecycle.recorded_profile is recorded
    assert lifecycle.plan.modes == (KEEP,) * 3 and lifecycle.target < planner.planning_target(
        8 * GiB, 0.1)
    # the plan it replaced saves the other stage's groups: it is not tried against it
    assert "from before the lowering" not in lifecycle.trial.labels
    assert all(len(p.modes) == 3 for p in lifecycle.trial.plans)
    assert any(line.startswith(f"offload plan for 8.00 GiB (planned for ") and
               line.endswith("; " + stage.describe()) for line in steps.lines)


def test_a_stages_rerun_time_sums_the_least_time_any_recording_took_for_each_call():
    # as the recipes' times are (planner.least_times): a host behind the device in one recording
    # stretched that recording's calls; a first recording's calls before its first save are
    # untimed (None), and each call takes its time from the recordings that timed it
    def candidate(times):
        times, batch = (times[:3], times[3]) if len(times) > 3 else (times, 8)
        stage = planner_stage.Stage(modules=3, first_group=0, end_group=2, input_group=0,
                                    input_bytes=MiB * batch // 8, chunks=4,
                                    forward_ms=sum(ms or 0.0 for ms in times))
        return StageCandidate(stage, batch, payload="modules", call_ms=times)
    for recordings, rerun in (([(1.0, 2.0, 3.0), (2.0, 9.0, 3.5)], 6.0),
                              ([(None, 2.0, 3.0), (4.0, 9.0, 3.5)], 9.0),
                              ([(4.0, 9.0, 3.5), (None, 2.0, 3.0)], 9.0),
                              ([(None, 2.0, 3.0), (None, 9.0, 1.0)], 3.0),
                              ([(5.0, 5.0, 5.0)], 15.0),
                              # another batch (a smaller first step): other work, not timed
                              ([(1.0, 1.0, 1.0, 4), (5.0, 5.0, 5.0)], 15.0)):
        class Staging(TableMaker):
            def choose_stage(self, profile, target, candidates, staging):
                self.asked = candidates
                return plan(target, modes=(KEEP,) * 3), None
        maker = Staging()
        lifecycle = Lifecycle(8 * GiB, maker=maker, trials=False, record_steps=len(recordings))
        steps = Steps(lifecycle)
        for times in recordings:
            steps.step(stage_candidates=(candidate(times),))
        steps.step()
        (asked,) = maker.asked
        assert asked.stage.forward_ms == rerun and asked.payload == "modules"


class MovesNothingMaker(TableMaker):
    """:class:`TableMaker`'s plans, keeping and recomputing only (nothing moved)."""

    def solve(self, profile, target, explain=True):
        return dataclasses.replace(super().solve(profile, target, explain),
                                   modes=(KEEP, KEEP, RECOMPUTE, KEEP), moved_bytes=0)


def _watching_plan(maker=None):
    """A lifecycle whose one plan (20 ms predicted, moving nothing, on a recording whose device
    forward took 10 ms) was kept after its trial and is watched."""
    lifecycle = Lifecycle(8 * GiB, maker=maker or MovesNothingMaker(least=int(7.2 * GiB)))
    steps = Steps(lifecycle)
    steps.record()
    steps.run(10.0)
    assert lifecycle.state == WATCHING and lifecycle.profile.forward_ms == 10.0
    return lifecycle, steps


def test_steps_whose_host_issues_the_forward_slower_than_the_device_ran_it_say_so_once():
    lifecycle, steps = _watching_plan()
    said = len(steps.lines)
    for host in (14.0, 13.0, 11.0):   # the median of fewer than WATCH_STEPS steps: nothing yet
        steps.step(30.0, host_forward_ms=host)
    assert len(steps.lines) == said
    steps.step(30.0, host_forward_ms=12.5)   # median 12.75 ms, 1.275x the device's 10
    assert steps.lines[said:] == [
        f"the host takes 12.8 ms to issue each planned step's forward (the median of the last "
        f"{planner.WATCH_STEPS}), which the device ran in 10.0 ms in the recording: the device "
        "waits for the host, and steps run longer than the plan's predicted 20.0 ms, which "
        "counts the device alone (docs/torch.md, \"The host's time\")"]
    for _ in range(2 * planner.WATCH_STEPS):   # once a run
        steps.step(30.0, host_forward_ms=20.0)
    assert len(steps.lines) == said + 1 and lifecycle.state == WATCHING


@pytest.mark.parametrize("hosts", [(12.0, 12.0, 12.0, 12.0),      # under HOST_BOUND_SHARE
                                   (30.0, 30.0, None, 30.0)])     # not measured in one step
def test_a_host_that_keeps_up_or_a_step_not_measured_says_nothing(hosts):
    lifecycle, steps = _watching_plan()
    said = len(steps.lines)
    for host in hosts:
        steps.step(20.0, host_forward_ms=host)
    assert len(steps.lines) == said


def test_the_host_watch_leaves_out_a_plan_that_offloads_and_steps_that_flushed():
    """An offloading plan's device forward waits for its copies (not the recording's forward);
    a step that flushed waited for the device: neither is a measure of the host."""
    lifecycle, steps = _watching_plan(TableMaker(least=int(7.2 * GiB)))   # it offloads
    assert lifecycle.plan.moved_bytes > 0
    said = len(steps.lines)
    for _ in range(planner.WATCH_STEPS):
        steps.step(30.0, host_forward_ms=30.0)
    assert len(steps.lines) == said
    lifecycle, steps = _watching_plan()
    said = len(steps.lines)
    steps.step(30.0, host_forward_ms=30.0, flushes=1)   # not counted
    for _ in range(planner.WATCH_STEPS - 1):
        steps.step(30.0, host_forward_ms=30.0)
    assert len(steps.lines) == said
    steps.step(30.0, host_forward_ms=30.0)              # the fourth that did not flush
    assert len(steps.lines) == said + 1 and steps.lines[-1].startswith("the host takes 30.0 ms")
