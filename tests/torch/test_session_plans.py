"""The plan's lifecycle in mucudnn.torch's session on CPU torch (session_plans.py): recording
steps, the plan made, trials of plans, flushes watched and targets lowered, replans after running
out of memory, the fall-back, and the profile written for a replay."""

import copy
import dataclasses
import json

import pytest

torch = pytest.importorskip("torch")
if not hasattr(torch, "autograd") or not hasattr(torch.autograd, "graph"):
    pytest.skip("needs a real PyTorch", allow_module_level=True)

from torch import nn  # noqa: E402

from mucudnn.errors import InfeasibleError  # noqa: E402
from mucudnn.sizes import format_size  # noqa: E402
from mucudnn.torch import planner  # noqa: E402
from mucudnn.torch import planning  # noqa: E402
from mucudnn.torch.lifecycle import OUT_OF_MEMORY, StepOutcome  # noqa: E402
from mucudnn.torch.offload_session import OffloadSession  # noqa: E402
from mucudnn.torch.planner import KEEP, OFFLOAD, RECOMPUTE  # noqa: E402
from session_helpers import (  # noqa: E402
    assert_bitwise, batches, GiB, MeteredLink, RecordingLink, saved_bytes, SlowHostLink, small_cnn,
    Spike, split_steps, train, train_through_failures)


def test_an_impossible_budget_is_one_clear_error():
    model, data = small_cnn(torch.float32), batches(torch.float32, 3)   # two steps record
    session = OffloadSession(budget=1000, link=RecordingLink(), min_bytes=0, headroom=0.0)
    with pytest.raises(InfeasibleError, match="too small for this step"):
        train(model, data, session)


def test_an_impossible_budget_in_an_unmodified_script_offloads_everything():
    model, data = small_cnn(torch.float32), batches(torch.float32, 3)
    reference = train(copy.deepcopy(model), data)
    said = []
    session = OffloadSession(budget=1000, link=RecordingLink(), min_bytes=0, headroom=0.0,
                             strict=False, say=said.append)
    assert_bitwise(reference, train(model, data, session))
    assert session.plan is None
    assert session.modes == [OFFLOAD if g.offloadable else KEEP for g in session.profile.groups]
    assert session.modes.count(OFFLOAD) > len(session.modes) // 2
    assert any("too small for this step" in text for text in said)


def test_each_plan_writes_the_profile_it_was_made_from(tmp_path):
    import json
    from mucudnn.torch import planner
    model, data = small_cnn(torch.float32), batches(torch.float32, 3)
    path = tmp_path / "profile.json"
    session = OffloadSession(budget=4 * GiB, link=RecordingLink(), min_bytes=0, headroom=0.0,
                             profile_to=path)
    train(model, data, session)
    document = json.loads(path.read_text())
    assert document["budget"] == 4 * GiB and document["target"] == session.target
    assert document["modes"] == session.modes and document["plan"] == session.plan.describe()
    assert document["releases"] == list(session.plan.releases)
    assert document["release_margin"] == session.plan.release_margin
    # the planner replays on it off the GPU: the same plan, released at the same points
    profile = planner.profile_from_dict(document["profile"])
    replayed = planning.plan_with_prefetch(profile, document["target"], session.lookahead)
    assert (replayed.modes, list(replayed.releases)) == (session.plan.modes, document["releases"])


def test_no_plan_writes_the_profile_too_and_an_unwritable_path_is_one_line(tmp_path):
    import json
    model, data = small_cnn(torch.float32), batches(torch.float32, 3)
    said, path = [], tmp_path / "profile.json"
    session = OffloadSession(budget=1000, link=RecordingLink(), min_bytes=0, headroom=0.0,
                             strict=False, say=said.append, profile_to=path)
    train(model, data, session)
    document = json.loads(path.read_text())
    assert document["plan"] is None and document["modes"] == session.modes
    assert document["fell_back"] is False
    said.clear()
    session.profile_to = tmp_path / "no such directory" / "profile.json"
    assert not session.write_profile()
    assert len(said) == 1 and said[0].startswith("the offload profile was not written to ")


def test_a_numpy_budget_writes_its_profile_and_what_json_cannot_write_is_one_line(tmp_path):
    import json
    import numpy as np
    said, path = [], tmp_path / "profile.json"
    session = OffloadSession(budget=np.int64(4 * GiB), link=RecordingLink(), min_bytes=0,
                             headroom=0.0, say=said.append, profile_to=path)
    train(small_cnn(torch.float32), batches(torch.float32, 3), session)  # the step goes on
    assert json.loads(path.read_text())["budget"] == 4 * GiB
    said.clear()
    session.profile.forward_ms = object()  # nothing JSON writes: one line, never an exception
    assert not session.write_profile()
    assert len(said) == 1 and "not JSON serializable" in said[0]


@pytest.mark.parametrize("where", ["forward", "backward", "caught"])
def test_a_planned_step_out_of_memory_falls_back_to_offloading_everything(where):
    # "caught": an op's refused allocation that it handles (cuDNN trying a workspace) is no
    # failed step. No replans: the first failure falls back.
    model, data = small_cnn(torch.float32), batches(torch.float32, 4)
    link, said, steps = MeteredLink(), [], []

    def out_of_memory():
        if len(steps) == 2:          # the first planned step
            link.oom()
            if where != "caught":
                raise torch.OutOfMemoryError("out of memory (test)")

    class Fail(nn.Module):
        def forward(self, x):
            if where == "forward":
                out_of_memory()
                return x
            return Spike.apply(x, out_of_memory)

    wrapped = nn.Sequential(model, Fail())
    trace = []
    # (convolutions not recomputed: on the CPU they cost next to nothing, and the plan must
    # offload for the fall-back to differ from it; at two thirds of the saved bytes a plan
    # recomputing the pooling's indices needs no offload)
    session = OffloadSession(budget=saved_bytes(model, data) * 1 // 2, link=link, min_bytes=0,
                             headroom=0.0, say=said.append, trace=trace, replans=0,
                             record_steps=1, recompute_convolutions=False, trials=False)
    failures = train_through_failures(model, data, session, wrapped,
                                      lambda: steps.append(None))
    if where == "caught":
        assert failures == 0 and not session.fell_back and not said[1:]
        assert [g.mode for g in session._step.groups] == list(session.plan.modes)
        return
    assert failures == 1 and session.fell_back and session.plan.count(OFFLOAD)
    assert [g.mode for g in session._step.groups] == \
        [OFFLOAD if g.offloadable else KEEP for g in session.profile.groups]
    assert sum("ran out of device memory" in line for line in said) == 1
    # the last step ran as the recording step did: every fetch on demand
    last_step = trace[max(i for i, e in enumerate(trace) if e[:2] == ("pack", 0)):]
    assert any(e[0] == "fetch" for e in last_step)
    assert not any(e[0] == "prefetch" for e in last_step)


@pytest.mark.parametrize("failing_steps", [1, 99])
def test_a_planned_step_out_of_memory_plans_again_for_less_then_falls_back(failing_steps,
                                                                           tmp_path):
    # the peak model fell short: the next plan aims lower (replan_step of the budget below the
    # failed plan's modelled peak); when every planned step fails, after `replans` plans it falls
    # back to offloading everything
    model, data = small_cnn(torch.float32), batches(torch.float32, 7)
    link, said, steps = MeteredLink(), [], []

    class Fail(nn.Module):
        def forward(self, x):
            def out_of_memory():
                if 2 <= len(steps) < 2 + failing_steps:     # planned steps
                    link.oom()
                    raise torch.OutOfMemoryError("out of memory (test)")
            return Spike.apply(x, out_of_memory)

    budget = saved_bytes(model, data) * 2
    session = OffloadSession(budget=budget, link=link, min_bytes=0, headroom=0.0,
                             say=said.append, replans=2, replan_step=0.1,
                             record_steps=1, profile_to=tmp_path / "profile.json")
    peaks = []

    def before_step():
        steps.append(None)
        if session.plan is not None:
            peaks.append((session.target, session.plan.peak))

    failures = train_through_failures(model, data, session, nn.Sequential(model, Fail()),
                                      before_step)
    replanned = [line for line in said if "planning for" in line]
    if failing_steps == 1:
        assert failures == 1 and not session.fell_back and len(replanned) == 1
        first_target, first_peak = peaks[0]
        assert session.target == min(first_target, first_peak) - int(0.1 * budget)
        assert session.plan.peak <= session.target < first_peak
        assert [g.mode for g in session._step.groups] == list(session.plan.modes)
        written = json.loads((tmp_path / "profile.json").read_text())
        assert written["target"] == session.target and written["modes"] == list(session.plan.modes)
    else:
        # two replans (each lower), then the third failure falls back
        assert len(replanned) == 2 and session.fell_back and failures == len(data) - 1
        assert sum("offloading every saved tensor from now on" in line for line in said) == 1
        targets = [t for t, _ in peaks]
        assert targets[0] > targets[1] > targets[2]
        written = json.loads((tmp_path / "profile.json").read_text())  # the modes in force
        assert written["fell_back"] and written["modes"] == session.modes != list(session.plan.modes)


def test_after_the_fall_back_flushes_bring_no_plan_back(monkeypatch):
    # every planned step runs out of memory: two replans, then the fall-back (everything
    # offloaded); the caching allocator then flushes in every step, and the watch of a plan kept
    # after its trial does not make a plan for less in place of the fall-back
    monkeypatch.setattr(planning, "trial_plans", lambda *args, **kwargs: [])
    model, data = small_cnn(torch.float32), batches(torch.float32, 5 + 2 * planner.WATCH_STEPS)
    said, steps = [], []
    link = flushing_while(MeteredLink, lambda link: session.fell_back)

    class Fail(nn.Module):
        def forward(self, x):
            def out_of_memory():
                if len(steps) >= 2 and not session.fell_back:     # planned steps
                    link.oom()
                    raise torch.OutOfMemoryError("out of memory (test)")
            return Spike.apply(x, out_of_memory)

    session = OffloadSession(budget=saved_bytes(model, data) * 2, link=link, min_bytes=0,
                             headroom=0.1, say=said.append, replans=2, record_steps=1)
    failures = train_through_failures(model, data, session, nn.Sequential(model, Fail()),
                                      lambda: steps.append(None))
    assert failures == 3 and session.fell_back
    assert not [line for line in said if line.startswith("the offload plan flushed")]
    assert [g.mode for g in session._step.groups] == \
        [OFFLOAD if g.offloadable else KEEP for g in session.profile.groups]


def test_two_steps_record_and_the_second_is_profiled():
    # the first recording pins the host pool; the second, which copies into it, is the profile
    model, data = small_cnn(torch.float32), batches(torch.float32, 3)
    link = SlowHostLink()
    session = OffloadSession(budget=GiB, link=link, min_bytes=0)
    train(model, data[:2], session)
    assert session.plan is None and session.profile is None
    allocations = link.host_allocations
    train(model, data[2:], session)
    assert session.plan is not None and link.host_allocations == allocations
    # no pinning waited for in the profiled step: that would be WAIT_MS per group (the bound
    # leaves a loaded CI machine's slow forward room)
    assert session.profile.forward_ms < link.WAIT_MS / 2 * len(session.profile.groups)
    assert len(session.profile.groups) >= 4


def test_a_session_records_planner_record_steps_by_default(monkeypatch):
    # the default is read when a session is made (conftest.py sets two for the other tests)
    monkeypatch.setattr(planner, "RECORD_STEPS", 3)
    model, data = small_cnn(torch.float32), batches(torch.float32, 4)
    session = OffloadSession(budget=GiB, link=SlowHostLink(), min_bytes=0)
    train(model, data[:3], session)
    assert session.plan is None and session.profile is None
    train(model, data[3:], session)
    assert session.plan is not None


def test_groups_a_plan_moves_but_the_step_keeps_are_one_line():
    # convolution outputs have no recipe: a plan recomputing every group keeps those
    model, data = small_cnn(torch.float32), batches(torch.float32, 3)
    said = []
    session = OffloadSession(modes=[RECOMPUTE] * 100, link=RecordingLink(), min_bytes=0,
                             say=said.append)
    train(model, data, session)
    lines = [line for line in said if "were kept" in line]
    assert len(lines) == 1 and "wanted recompute" in lines[0]


def fake_trial_plans(monkeypatch, others: int = 1, larger: list | None = None) -> list:
    """planning.trial_plans replaced: ``others`` plans, the ``k``-th the plan made with its
    ``k``-th moved or recomputed group kept instead. The list it returns receives [the plan
    made, those] once the session plans; ``larger``, the larger budgets it was given."""
    plans = []

    def made(profile, budget, plan, lookahead, time_limit_s, larger_budgets, keep_apart=False,
             method=planning.FAST):
        if larger is not None:
            larger.append(list(larger_budgets))
        changed = [i for i, m in enumerate(plan.modes) if m != KEEP]
        plans.append(plan)
        for k in range(others):
            modes = list(plan.modes)
            modes[changed[k]] = KEEP
            plans.append(dataclasses.replace(plan, modes=tuple(modes)))
        return [(f"other {k + 1}", other) for k, other in enumerate(plans[1:])]
    monkeypatch.setattr(planning, "trial_plans", made)
    return plans


def plan_ticking_link(plans, plan_ms):
    """A RecordingLink (``link.session``: the session) whose clock runs ``plan_ms[k]`` ms a step
    under ``plans[k]``, 1 ms under no plan."""
    class Ticking(RecordingLink):
        now, session = 0.0, None

        def _stamp(self):    # seconds, as SameMemoryLink's clock
            plan = self.session.plan
            self.now += 1e-3 * (1.0 if plan is None else plan_ms[plans.index(plan)])
            return self.now
    return Ticking()


@pytest.mark.parametrize("plan_ms, kept", [((10.0, 5.0, 7.0), 1), ((5.0, 10.0, 7.0), 0),
                                           ((10.0, 7.0, 5.0), 2)])
def test_a_session_tries_the_other_plans_and_keeps_the_fastest(monkeypatch, plan_ms, kept):
    # the plan made runs TRIAL_STEPS steps, then each other as many; the fastest by the link's
    # clock (here one whose ticks each plan sets) stays, said in one line
    trial = planner.TRIAL_STEPS
    model, data = small_cnn(torch.float64), batches(torch.float64, 2 + 3 * trial + 2)
    reference = train(copy.deepcopy(model), data)
    plans = fake_trial_plans(monkeypatch, others=2)
    said, trace = [], []
    link = plan_ticking_link(plans, plan_ms)
    session = link.session = OffloadSession(budget=1, link=link, min_bytes=0, trace=trace,
                                            headroom=0.0, say=said.append)
    session.budget = int(saved_bytes(model, data) * 0.6)
    assert_bitwise(reference, train(model, data, session))
    assert session.plan is plans[kept] and session.lifecycle.trial is None
    labels = ["as made", "other 1", "other 2"]
    assert session.kept_after_trial == (labels[kept] if kept else None)
    assert said[-1] == ("offload plans tried: " + ", ".join(
        f"{label} {ms:.1f} ms a step" for label, ms in zip(labels, plan_ms))
        + f"; keeping the plan {labels[kept]}")
    assert said[-2].startswith("trying it against the plan other 1 (") and "the plan other 2 (" \
        in said[-2]
    steps = split_steps(trace)
    assert len(steps) == len(data)
    ran = [tuple(e[2] for e in step if e[0] == "pack") for step in steps[2:]]
    expected = [p.modes for p in [plans[0]] * trial + [plans[1]] * trial + [plans[2]] * trial
                + [plans[kept]] * 2]
    # each step's groups in the modes of the plan then in force (groups saved once each here)
    assert [r[:len(m)] for r, m in zip(ran, expected)] == expected
    # the cache is emptied before each plan's first step: after the recording, at each switch,
    # and after the trial unless the plan kept is the one that ran last
    emptied = [e[1] for e in trace if e[0] == "empty_cache"]
    assert emptied == [2, 2 + trial, 2 + 2 * trial] + ([2 + 3 * trial] if kept != 2 else [])


def test_a_plan_of_the_same_modes_still_starts_with_the_cache_emptied(monkeypatch):
    # the trial's other plan differs from the plan made only in how far ahead it fetches
    trial = planner.TRIAL_STEPS
    model, data = small_cnn(torch.float64), batches(torch.float64, 2 + 2 * trial + 1)
    monkeypatch.setattr(planning, "trial_plans", lambda profile, budget, plan, *rest, **named: [
        ("further ahead", dataclasses.replace(plan, lookahead=plan.lookahead + 1))])
    trace = []
    session = OffloadSession(budget=1, link=RecordingLink(), min_bytes=0, headroom=0.0,
                             trace=trace, say=lambda line: None)
    session.budget = int(saved_bytes(model, data) * 0.6)
    train(model, data, session)
    assert [e[1] for e in trace if e[0] == "empty_cache"][:2] == [2, 2 + trial]


def test_steps_in_the_same_modes_leave_the_cache_alone():
    model, data = small_cnn(torch.float64), batches(torch.float64, 4)
    trace = []
    session = OffloadSession(modes=[OFFLOAD] * 64, link=RecordingLink(), min_bytes=0,
                             trace=trace)
    train(model, data, session)
    assert not [e for e in trace if e[0] == "empty_cache"]


@pytest.mark.parametrize("headroom", [0.1, 0.0])
def test_the_trial_plans_for_the_headroom_shares_too(monkeypatch, headroom):
    # besides the plan made for budget x (1 - headroom), plans for each share of the headroom
    # (planner.TRIAL_HEADROOM_SHARES); with no headroom, none
    model, data = small_cnn(torch.float64), batches(torch.float64, 3)
    larger = []
    fake_trial_plans(monkeypatch, larger=larger)
    budget = int(saved_bytes(model, data) * 0.8)
    session = OffloadSession(budget=budget, link=RecordingLink(), min_bytes=0, headroom=headroom,
                             say=lambda line: None)
    train(model, data, session)
    assert session.target == planner.planning_target(budget, headroom)
    assert larger == [[planner.planning_target(budget, headroom * share)
                       for share in planner.TRIAL_HEADROOM_SHARES] if headroom else []]


def test_no_trial_where_the_plan_moves_nothing():
    profile = planner.StepProfile([planner.SavedGroup(1000, 0, 0)] * 2, 1.0, 1.0, 1.0, 1.0, 1,
                                  baseline_forward=[0, 0], baseline_backward=[0],
                                  copy_exposure=0.6)
    plan = planning.plan_with_prefetch(profile, 10**9)
    assert plan.moved_bytes == 0
    assert planning.trial_plans(profile, 10**9, plan, larger_budgets=[2 * 10**9]) == []


@pytest.mark.parametrize("failing", [1, 2])
@pytest.mark.parametrize("out_of_memory", [True, False])
def test_a_trial_plan_that_fails_leaves_the_fastest_that_ran_without_a_replan(
        monkeypatch, failing, out_of_memory):
    # the plan tried second (or third) runs out of memory, or its step fails otherwise: the
    # trial ends there, and the fastest of the plans before it stays (the plan made runs 5 ms a
    # step, the other 4), no replan
    trial = planner.TRIAL_STEPS
    model, data = small_cnn(torch.float32), batches(torch.float32, 2 + 3 * trial + 3)
    said, steps = [], []
    plans = fake_trial_plans(monkeypatch, others=2)

    class Ticking(MeteredLink):
        now = 0.0

        def _stamp(self):
            plan = session.plan
            self.now += 1e-3 * (4.0 if plans and plan is plans[1] else 5.0)
            return self.now
    link = Ticking()

    class Fail(nn.Module):
        def forward(self, x):
            def fail():
                if plans and session.plan is plans[failing]:
                    if not out_of_memory:
                        raise ValueError("a bad batch (test)")
                    link.oom()
                    raise torch.OutOfMemoryError("out of memory (test)")
            return Spike.apply(x, fail)

    session = OffloadSession(budget=saved_bytes(model, data) * 3 // 4, link=link, min_bytes=0,
                             headroom=0.0, say=said.append, recompute_convolutions=False)
    failures = train_through_failures(model, data, session, nn.Sequential(model, Fail()),
                                      lambda: steps.append(None),
                                      (torch.OutOfMemoryError, ValueError))
    kept = 1 if failing == 2 else 0
    assert failures == 1 and session.plan is plans[kept] and session.lifecycle.trial is None
    assert session.replans_used == 0 and not session.fell_back
    timed = "as made 5.0 ms a step" + (", other 1 4.0 ms a step" if failing == 2 else "")
    why = (f"the plan other {failing} ran out of device memory in its trial" if out_of_memory
           else f"a step of the plan other {failing} failed in its trial")
    assert said[-1] == f"{why}: {timed}; keeping the plan {['as made', 'other 1'][kept]}"
    assert [g.mode for g in session._step.groups] == list(plans[kept].modes)


def test_after_a_forward_that_failed_the_cache_is_emptied_as_the_next_step_starts(monkeypatch):
    # the trial's other plan runs out of memory in its forward: the plan made stays, and the
    # cache is emptied for it once the next step starts (until the script lets go of the error,
    # its traceback holds the failed forward's tensors), not as the error leaves the session
    trial = planner.TRIAL_STEPS
    model, data = small_cnn(torch.float32), batches(torch.float32, 2 + 2 * trial + 2)
    plans = fake_trial_plans(monkeypatch)

    class Counting(MeteredLink):
        empties = 0

        def empty_cache(self):
            self.empties += 1
    link, empties_at_start = Counting(), []

    class FailForward(nn.Module):
        def forward(self, x):
            if plans and session.plan is plans[1]:
                link.oom()
                raise torch.OutOfMemoryError("out of memory (test)")
            return x
    session = OffloadSession(budget=saved_bytes(model, data) * 3 // 4, link=link, min_bytes=0,
                             headroom=0.0, say=lambda line: None, recompute_convolutions=False)
    failures = train_through_failures(model, data, session, nn.Sequential(model, FailForward()),
                                      lambda: empties_at_start.append(link.empties))
    failed = 2 + trial      # the step (0-based) of the other plan's first, which fails
    assert failures == 1 and session.plan is plans[0]
    # per step: emptied at its start (the plan made, the other plan), then for the plan kept at
    # the start of the step after the failure
    during = [b - a for a, b in zip(empties_at_start, empties_at_start[1:])]
    assert during[2] == 1 and during[failed] == 1 and during[failed + 1] == 1
    assert sum(during) == 3


@pytest.mark.parametrize("plan_ms, kept", [((5.0, 10.0), 0), ((10.0, 5.0), 1)])
def test_the_plan_a_trial_keeps_is_armed_again_only_where_it_comes_back(monkeypatch, plan_ms,
                                                                       kept):
    # each plan of the trial ran its first armed steps with no rescue (rescue.py, rule 5): the
    # plan kept after another ran comes back armed for PROVEN_ARMED_STEPS (the allocator's cache
    # emptied before it); the one that ran last runs on, armed no more
    from mucudnn.torch import rescue
    trial = planner.TRIAL_STEPS
    assert trial >= rescue.ARMED_STEPS   # each plan of the trial is proven in it
    model, data = small_cnn(torch.float64), batches(torch.float64, 2 + 2 * trial + 4)
    reference = train(copy.deepcopy(model), data)
    plans = fake_trial_plans(monkeypatch, others=1)
    link = plan_ticking_link(plans, plan_ms)
    session = link.session = OffloadSession(budget=1, link=link, min_bytes=0, headroom=0.0)
    session.budget = int(saved_bytes(model, data) * 0.6)
    armed, in_force = [], []   # at each step's first module (the session's hook runs first)
    model[0].register_forward_pre_hook(
        lambda module, args: armed.append(session.rescuer.armed) or in_force.append(session.plan))
    assert_bitwise(reference, train(model, data, session))
    assert session.plan is plans[kept] and session.lifecycle.trial is None
    ran = [None if plan is None else plans.index(plan) for plan in in_force]
    assert ran == [None] * 2 + [0] * trial + [1] * trial + [kept] * 4
    # each plan of the trial armed in its first steps; after it, the plan kept
    rearmed = rescue.PROVEN_ARMED_STEPS if kept == 0 else 0
    assert armed == [False] * 2 + ([True] * rescue.ARMED_STEPS + [False] * (
        trial - rescue.ARMED_STEPS)) * 2 + [True] * rearmed + [False] * (4 - rearmed)


def run_trial(model, data, link):
    """(session, lines said) after training ``model`` on ``data`` with a session under half of its
    saved bytes and no headroom (so a trial), ``link`` its link (``link.session``: the session)."""
    said = []
    session = OffloadSession(budget=1, link=link, min_bytes=0, headroom=0.0, say=said.append)
    link.session = session
    session.budget = int(saved_bytes(model, data) * 0.5)
    train(model, data, session)
    return session, said


def test_a_trial_times_each_plan_by_its_fastest_step(monkeypatch):
    # one slow step (the script's own work between steps) does not make the plan lose: the plan
    # made runs 10 then 30 ms a step (mean 20), the other 15 and 15: the plan made stays
    trial = planner.TRIAL_STEPS
    model, data = small_cnn(torch.float64), batches(torch.float64, 2 + 2 * trial + 1)
    plans = fake_trial_plans(monkeypatch)
    ticks = {0: iter([1.0, 10.0, 30.0]), 1: iter([1.0, 15.0, 15.0])}

    class Ticking(RecordingLink):
        now = 0.0

        def _stamp(self):    # seconds; a step's end mark advances by that plan's next tick
            session = self.session
            if session.lifecycle.trial is not None and session.plan in plans:
                self.now += 1e-3 * next(ticks[plans.index(session.plan)])
            else:
                self.now += 1e-3
            return self.now
    session, said = run_trial(model, data, Ticking())
    assert said[-1] == ("offload plans tried: as made 10.0 ms a step, other 1 15.0 ms a "
                        "step; keeping the plan as made")
    assert session.plan is plans[0]


def flushing_while(link_type, due):
    """A ``link_type`` whose caching allocator's flush count grows by one at each read where
    ``due(link)``."""
    class Flushing(link_type):
        count = 0

        def flushes(self):
            self.count += bool(due(self))
            return self.count
    return Flushing()


def flushing_link(plans, step_ms, flushing, flush_after: int = 2):
    """A RecordingLink (``link.session``: the session) whose clock runs ``step_ms[k]`` a step
    under ``plans[k]`` and whose caching allocator flushes once a step, in the op after backward
    point ``flush_after`` (-1: in the forward; None: after the backward, in the optimizer's
    step), under each plan ``k`` with ``flushing[k]``."""
    def index(plan):
        return plans.index(plan) if plan in plans else 0

    class Flushing(RecordingLink):
        now, count, step = 0.0, 0, None

        def _stamp(self):
            self.now += 1e-3 * step_ms[index(self.session.plan)]
            return self.now

        def flushes(self):
            session = self.session
            unpacks = session._step.unpacks   # 0 after a backward (a new step begins)
            due = unpacks == 0 if flush_after is None else unpacks > flush_after + 1
            if flushing[index(session.plan)] and due and self.step != session.steps:
                self.step, self.count = session.steps, self.count + 1
            return self.count
    return Flushing()


@pytest.mark.parametrize("flushing, kept", [((False, True), 0), ((True, True), 1),
                                            ((False, False), 1), ((True, False), 1)])
def test_a_trial_keeps_a_plan_that_flushed_only_where_every_plan_did(monkeypatch, flushing, kept):
    # the other plan runs 5 ms a step against 10 as made; a plan whose timed steps flushed the
    # caching allocator's cache (the link's counter grew) loses to one whose did not
    trial = planner.TRIAL_STEPS
    model, data = small_cnn(torch.float64), batches(torch.float64, 2 + 2 * trial + 1)
    plans = fake_trial_plans(monkeypatch)
    session, said = run_trial(model, data, flushing_link(plans, (10.0, 5.0), flushing))
    flushed = [" (1 flush after backward point 2)" if f else "" for f in flushing]
    assert said[-1] == (f"offload plans tried: as made 10.0 ms a step{flushed[0]}, other 1 5.0 ms "
                        f"a step{flushed[1]}; keeping the plan {['as made', 'other 1'][kept]}")
    assert session.plan is plans[kept]


@pytest.mark.parametrize("replans", [3, 0])
def test_a_trial_whose_every_plan_flushed_plans_for_less_and_tries_again(monkeypatch, replans):
    # both plans flush: the next plans are made for half the headroom less (a replan) and tried
    # in turn; of those, the one that does not flush stays, slower as it is. Without replans
    # left, the fastest of the flushing plans stays
    trial = planner.TRIAL_STEPS
    model, data = small_cnn(torch.float64), batches(torch.float64, 2 + 5 * trial + 2)
    plans = []   # each trial's: the plan made, the other (its first moved group kept)

    def made(profile, budget, plan, lookahead, time_limit_s, larger_budgets, keep_apart=False,
             method=planning.FAST):
        modes = list(plan.modes)
        modes[next(i for i, m in enumerate(modes) if m != KEEP)] = KEEP
        plans.extend([plan, dataclasses.replace(plan, modes=tuple(modes))])
        return [("other 1", plans[-1])]
    monkeypatch.setattr(planning, "trial_plans", made)
    link = flushing_link(plans, (10.0, 5.0, 12.0, 11.0), (True, True, False, True))
    said = []
    session = OffloadSession(budget=1, link=link, min_bytes=0, headroom=0.1, say=said.append,
                             replans=replans)
    link.session = session
    session.budget = int(saved_bytes(model, data) * 0.6)
    first = session.target
    train(model, data, session)
    tried = [line for line in said if line.startswith("offload plans tried")]
    if not replans:
        assert session.target == first and len(plans) == 2 and session.plan is plans[1]
        assert len(tried) == 1 and tried[0].endswith("keeping the plan other 1")
        return
    lowered = first - int(0.05 * session.budget)
    assert session.target == lowered and session.replans_used == 1 and len(plans) == 4
    assert tried[0].endswith(f"each flushed the caching allocator's cache, so planning for "
                             f"{lowered / 2**30:.2f} GiB")
    assert any(line.startswith("offload plan for") and
               f"(planned for {lowered / 2**30:.2f} GiB)" in line for line in said)
    # the lower target's plans, one of which does not flush: it stays, and the fastest
    # before the lowering (plans[1], which flushed) is not run again
    assert tried[1] == ("offload plans tried (not the one from before the lowering, which "
                        "flushed): as made 12.0 ms a step, other 1 11.0 ms a step (1 flush "
                        "after backward point 2); keeping the plan as made")
    assert session.plan is plans[2] and session.plan.target == lowered


@pytest.mark.parametrize("flushing", [True, False])
def test_a_plan_with_no_other_to_try_is_watched_for_flushes_alone(monkeypatch, flushing):
    # no other plan worth trying: the plan still runs TRIAL_STEPS steps as a trial of one; if it
    # flushes the caching allocator's cache, the next is made for half the headroom less, as
    # long as replans are left (3); if not, it stays, with nothing said
    trial = planner.TRIAL_STEPS
    model, data = small_cnn(torch.float64), batches(torch.float64, 2 + 7 * trial + 1)
    monkeypatch.setattr(planning, "trial_plans", lambda *args, **kwargs: [])
    link = flushing_link([], (10.0,), (flushing,))
    said = []
    session = OffloadSession(budget=1, link=link, min_bytes=0, headroom=0.1, say=said.append)
    link.session = session
    session.budget = int(saved_bytes(model, data) * 0.7)
    first = session.target
    train(model, data, session)
    lowered = [line for line in said if "flushed the caching allocator's cache, so planning"
               in line]
    assert session.lifecycle.trial is None
    if not flushing:
        assert session.target == first and session.replans_used == 0 and not lowered
        assert [line for line in said if line.startswith("offload plan")] == said[:1]
        return
    assert session.replans_used == 3 and len(lowered) == 3
    assert session.replans_left == 3     # a step out of memory still has its own
    assert session.target == first - 3 * int(0.05 * session.budget)
    assert lowered[0].startswith("the offload plan ran 10.0 ms a step (1 flush after backward "
                                 "point 2); it flushed")


@pytest.mark.parametrize("flushing_steps", [2, 1])
def test_a_plan_that_flushes_after_its_trial_is_replaced_by_one_for_less(monkeypatch,
                                                                        flushing_steps):
    # calm in its trial (a trial of one), the plan as made flushes the caching allocator's cache
    # in the steps after it, from the second on: after WATCH_FLUSHING such steps of its last
    # WATCH_STEPS, the plan for half the headroom less is made and tried, and (calm) stays; a
    # plan that flushed in fewer steps stays
    assert planner.WATCH_FLUSHING == 2
    trial = planner.TRIAL_STEPS
    first_watched = 2 + trial            # the steps before: recording, the trial
    model, data = small_cnn(torch.float64), batches(torch.float64,
                                                    first_watched + 4 + 2 * trial + 1)
    monkeypatch.setattr(planning, "trial_plans", lambda *args, **kwargs: [])

    class LateFlushing(RecordingLink):
        count, flushing_plan = 0, None

        def flushes(self):   # read once at each watched step's end (steps: those ended)
            session = self.session
            step = session.steps - 1
            watched = (session.lifecycle._lowered_target is None and session.lifecycle.trial
                       is None and first_watched < step <= first_watched + flushing_steps)
            if watched:
                self.flushing_plan = session.plan
            # the plan that flushed in its watch flushes again where a trial runs it
            again = session.plan is self.flushing_plan and session.lifecycle.trial is not None
            if (watched or again) and step != getattr(self, "last", None):
                self.last, self.count = step, self.count + 1
            return self.count
    link, said = LateFlushing(), []
    session = OffloadSession(budget=1, link=link, min_bytes=0, headroom=0.1, say=said.append)
    link.session = session
    session.budget = int(saved_bytes(model, data) * 0.6)
    first = session.target
    train(model, data, session)
    lowered = [line for line in said if line.startswith("the offload plan flushed")]
    if flushing_steps < planner.WATCH_FLUSHING:
        assert not lowered and session.target == first and session.replans_used == 0
        return
    assert lowered == [f"the offload plan flushed the caching allocator's cache in 2 of its last "
                       f"3 steps, so planning for {session.target / 2**30:.2f} GiB"]
    assert session.target == first - int(0.05 * session.budget) and session.replans_used == 1
    assert said[-3].startswith("offload plan for") and "(planned for" in said[-3]
    # to be tried against the plan it replaced where the plan for less flushes too; it is calm,
    # so it stays, and the plan that flushed is not run again
    assert said[-2].startswith("trying it against the plan from before the lowering (") and \
        said[-2].endswith(" where the plans for less flush too, 3 steps each")
    assert said[-1].startswith("offload plans tried (not the one from before the lowering, "
                               "which flushed): as made ") and \
        said[-1].endswith("keeping the plan as made")
    assert not any(line.startswith("offload plans tried") and "from before the lowering 5" in line
                   for line in said)
    assert session.lifecycle.trial is None and session.plan.target == session.target


@pytest.mark.parametrize("flush_after", [-1, 0, 3, None])
def test_a_trial_says_after_which_op_a_plan_flushed(monkeypatch, flush_after):
    # the link's flush count, read at each unpack of a trial's steps and after its backward,
    # grows once a step in the op after backward point flush_after (-1: in the forward; None:
    # after the backward) under the other plan
    trial = planner.TRIAL_STEPS
    model, data = small_cnn(torch.float64), batches(torch.float64, 2 + 2 * trial + 1)
    plans = fake_trial_plans(monkeypatch)
    session, lines = run_trial(model, data, flushing_link(plans, (10.0, 5.0), (False, True),
                                                          flush_after=flush_after))
    said = ("after the forward" if flush_after == -1 else
            f"after backward point {session.profile.unpacks - 1 if flush_after is None else flush_after}")
    assert lines[-1] == ("offload plans tried: as made 10.0 ms a step, other 1 5.0 ms a step "
                         f"(1 flush {said}); keeping the plan as made")


def test_a_flush_in_a_fetch_is_said_after_the_point_that_fetched(monkeypatch):
    # under the other plan each fetch (prefetched or on demand) flushes the cache: the trial's
    # line names the backward points whose unpack issued them in its last timed step
    trial = planner.TRIAL_STEPS
    model, data = small_cnn(torch.float64), batches(torch.float64, 2 + 2 * trial + 1)
    plans = fake_trial_plans(monkeypatch)
    fetched_at = set()

    class FetchFlushes(RecordingLink):
        count = 0

        def fetch(self, host, device, inline=False):
            session = self.session
            if session.lifecycle.trial is not None and session.plan is plans[1]:
                self.count += 1
                if len(session.lifecycle.trial.marks[1]) == trial - 1:   # its last timed step
                    fetched_at.add(session._step.unpacks - 1)
            return super().fetch(host, device, inline)

        def flushes(self):
            return self.count
    session, lines = run_trial(model, data, FetchFlushes())
    assert plans[1].count(OFFLOAD) and fetched_at
    points = sorted(fetched_at)
    where = (f"after backward point{'s' if len(points) > 1 else ''} "
             + ", ".join(map(str, points)))
    assert f"other 1 " in lines[-1] and f" {where})" in lines[-1]


def test_a_replan_after_running_out_of_memory_is_not_blamed_for_the_old_plans_flushes(
        monkeypatch):
    # the plan kept after its trial (of one) flushes in one watched step (4); step 5 runs out of
    # memory (the caching allocator flushes before it refuses: num_alloc_retries grows), and the
    # plan is made again for less. That new plan never flushes: neither the failed step's flush
    # nor the old plan's step 4 counts in its watch
    monkeypatch.setattr(planning, "trial_plans", lambda *args, **kwargs: [])
    dtype = torch.float64
    model, data = small_cnn(dtype), batches(dtype, 9)
    said, steps = [], []

    class Flushing(MeteredLink):
        count = 0

        def flushes(self):
            return self.count
    link = Flushing()

    class Fail(nn.Module):
        def forward(self, x):
            step = len(steps) - 1
            if step == 4:
                link.count += 1                      # the old plan flushes once
            if step == 5:
                link.count += 1                      # the allocator's retry before the refusal
                link.oom()
                raise torch.OutOfMemoryError("out of memory (test)")
            return x

    session = OffloadSession(budget=saved_bytes(model, data) * 2, link=link, min_bytes=0,
                             headroom=0.1, say=said.append, replans=2, record_steps=1)
    failures = train_through_failures(model, data, session, nn.Sequential(model, Fail()),
                                      lambda: steps.append(None))
    assert failures == 1
    assert any("ran out of device memory" in line and "planning for" in line for line in said)
    assert not [line for line in said if line.startswith("the offload plan flushed")]


def test_an_infeasible_lower_target_is_not_solved_again_at_every_watch(monkeypatch):
    # the plan kept after its trial flushes in every step; the plan for less is infeasible:
    # it is solved once (a whole plan_with_prefetch ladder, up to plan_time_limit_s a rung),
    # not again at every WATCH_FLUSHING flushing steps
    monkeypatch.setattr(planning, "trial_plans", lambda *args, **kwargs: [])
    dtype = torch.float64
    model, data = small_cnn(dtype), batches(dtype, 2 + planner.TRIAL_STEPS + 12)
    said, solves = [], []

    class Flushing(RecordingLink):
        count = 0

        def flushes(self):
            session = self.session
            if session.plan is not None and session.lifecycle.trial is None \
                    and session._step.unpacks == 0:
                self.count += 1
            return self.count
    link = Flushing()
    session = OffloadSession(budget=1, link=link, min_bytes=0, headroom=0.1, say=said.append)
    link.session = session
    session.budget = int(saved_bytes(model, data) * 0.6)
    maker = session.lifecycle.maker
    real = maker.plan_for
    first = session.target

    def plan_for(profile, target, explain=True):
        if target < first:
            solves.append(target)
            raise InfeasibleError("no plan (test)")
        return real(profile, target, explain)
    maker.plan_for = plan_for
    train(model, data, session)
    assert len(solves) == 1 and session.lowerings_left == 0


def plans_from(monkeypatch, budget: int, least_headroom: float, solved: list) -> None:
    """The planner makes plans only for targets of at least ``budget`` less ``least_headroom``
    of it (InfeasibleError below, with no least peak); ``solved`` receives every target asked."""
    real = planning.plan_with_prefetch

    def plan_with_prefetch(profile, target, *args, **kwargs):
        solved.append(target)
        if target < planner.planning_target(budget, least_headroom):
            raise InfeasibleError(f"no plan within {target} (test)")
        return real(profile, target, *args, **kwargs)
    monkeypatch.setattr(planning, "plan_with_prefetch", plan_with_prefetch)


@pytest.mark.parametrize("feasible_headroom", [0.05, 0.025, 0.0])
def test_where_no_plan_meets_the_headroom_a_session_plans_with_less(monkeypatch,
                                                                   feasible_headroom):
    # plans meet only targets of at least the budget less feasible_headroom: the session's 10 %
    # leaves none, so it plans with half of it, then a quarter, down to planner.LEAST_HEADROOM;
    # below that, the budget is too small as before (the error of the target the headroom left)
    model, data = small_cnn(torch.float64), batches(torch.float64, 3)
    said, solved = [], []
    plans_from(monkeypatch, 4 * GiB, feasible_headroom, solved)
    session = OffloadSession(budget=4 * GiB, link=RecordingLink(), min_bytes=0, headroom=0.1,
                             say=said.append, trials=False)
    tried = [planner.planning_target(4 * GiB, h) for h in (0.1, 0.05, 0.025)]
    if feasible_headroom < planner.LEAST_HEADROOM:
        with pytest.raises(InfeasibleError) as raised:
            train(model, data, session)
        assert str(raised.value) == f"no plan within {tried[0]} (test)" and solved == tried
        return
    train(model, data, session)
    target = planner.planning_target(4 * GiB, feasible_headroom)
    assert session.target == target and session.plan.target == target
    assert solved == tried[:{0.05: 2, 0.025: 3}[feasible_headroom]]
    assert said[0] == (f"no offload plan for 4.00 GiB less its headroom (10%); planning for "
                       f"{target / 2**30:.2f} GiB, {feasible_headroom:.1%} less")
    assert said[1].startswith(f"offload plan for 4.00 GiB (planned for {target / 2**30:.2f} GiB)")


def test_no_target_below_one_without_a_plan_is_solved_after_less_headroom(monkeypatch):
    # planned with 5 % (10 % had no plan); the plan, alone, flushes in every step: the plan for
    # less would be at or below the 10 % target, so none is solved (and no trial looks for
    # flushes that could lead nowhere); nor after running out of memory: the fall-back at once
    monkeypatch.setattr(planning, "trial_plans", lambda *args, **kwargs: [])
    model, data = small_cnn(torch.float64), batches(torch.float64, 2 + 2 * planner.TRIAL_STEPS)
    said, solved = [], []
    link = flushing_while(RecordingLink, lambda link: link.session.plan is not None
                          and link.session._step.unpacks == 0)
    plans_from(monkeypatch, 4 * GiB, 0.05, solved)
    session = OffloadSession(budget=4 * GiB, link=link, min_bytes=0, headroom=0.1,
                             say=said.append)
    link.session = session
    train(model, data, session)
    assert solved == [planner.planning_target(4 * GiB, h) for h in (0.1, 0.05)]
    assert session.lifecycle.trial is None and session.lowerings_left == 0
    assert not [line for line in said if "flushed" in line]


def test_out_of_memory_after_less_headroom_falls_back_without_a_solve(monkeypatch):
    monkeypatch.setattr(planning, "trial_plans", lambda *args, **kwargs: [])
    model, data = small_cnn(torch.float32), batches(torch.float32, 5)
    said, solved, steps = [], [], []
    link = MeteredLink()

    class Fail(nn.Module):
        def forward(self, x):
            def out_of_memory():
                if len(steps) == 3:   # the first planned step
                    link.oom()
                    raise torch.OutOfMemoryError("out of memory (test)")
            return Spike.apply(x, out_of_memory)
    budget = saved_bytes(model, data) * 2
    plans_from(monkeypatch, budget, 0.05, solved)
    session = OffloadSession(budget=budget, link=link, min_bytes=0, headroom=0.1,
                             say=said.append, replans=2, record_steps=1, trials=False,
                             strict=False)
    train_through_failures(model, data, session, nn.Sequential(model, Fail()),
                           lambda: steps.append(None))
    assert session.fell_back
    assert solved == [planner.planning_target(budget, h) for h in (0.1, 0.05)]


def test_an_unmeetable_budget_solves_its_least_peak_once(monkeypatch):
    # the least peak is solved for the error of the headroom's target, and no smaller headroom
    # whose target is below it is tried
    calls = []
    real = planning._least_peak_modes
    monkeypatch.setattr(planning, "_least_peak_modes",
                        lambda *args, **kwargs: calls.append(1) or real(*args, **kwargs))
    model, data = small_cnn(torch.float64), batches(torch.float64, 3)
    said = []
    session = OffloadSession(budget=4096, link=RecordingLink(), min_bytes=0, strict=False,
                             trials=False, say=said.append)
    train(model, data, session)
    assert session.plan is None and len(calls) == 1
    assert any("too small for this step" in line for line in said)


# -- the plan cache -----------------------------------------------------------------------------

def cached_run(model, data, cache, budget, **options):
    """(session, lines said, gradients) of a run under ``cache`` (a PlanCache)."""
    said = []
    session = OffloadSession(budget=budget, link=RecordingLink(), min_bytes=0, headroom=0.0,
                             say=said.append, plan_cache=cache, **options)
    return session, said, train(model, data, session)


def test_a_second_run_loads_the_plan_its_first_run_settled_on(tmp_path, monkeypatch):
    from mucudnn.torch.plancache import PlanCache
    # enough steps for the longest trial: the plan it keeps settles before the run ends
    steps = planner.RECORD_STEPS + planner.TRIAL_PLANS * planner.TRIAL_STEPS + 2
    model, data = small_cnn(torch.float64), batches(torch.float64, steps)
    reference = train(copy.deepcopy(model), data)
    budget = int(saved_bytes(model, data) * 0.6)
    cache = PlanCache(tmp_path)
    first, said, trained = cached_run(copy.deepcopy(model), data, cache, budget)
    assert_bitwise(reference, trained)
    assert first.plan is not None and first.lifecycle.trial is None
    # its entry, and the script's latest (the same plan)
    assert len(list(tmp_path.glob("*.json"))) == 2
    assert not any("plan cache" in line for line in said)

    def no_solve(*args, **kwargs):
        raise AssertionError("a cached run solves nothing")
    monkeypatch.setattr(planning, "plan_with_prefetch", no_solve)
    monkeypatch.setattr(planning, "trial_plans", no_solve)
    trace = []
    second, said, trained = cached_run(copy.deepcopy(model), data, PlanCache(tmp_path), budget,
                                       trace=trace)
    assert_bitwise(reference, trained)
    assert said[0] == f"offload plan for {budget / GiB:.2f} GiB from the plan cache: " + \
        f"{first.plan.describe()}"
    assert second.plan == first.plan and second.modes == first.modes
    assert second.kept_after_trial == first.kept_after_trial
    # its first step ran the plan: each group packed in the plan's mode, none recorded
    first_step = trace[:next(i for i, e in enumerate(trace) if e[0] == "unpack")]
    packed = [e[2] for e in first_step if e[0] == "pack"]
    assert packed == [m if g.offloadable or m != OFFLOAD else KEEP
                      for m, g in zip(first.plan.modes, first.profile.groups)]
    assert second.lifecycle.state in ("watching", "planned") and len(said) == 1


def test_a_run_with_other_arguments_runs_the_plan_a_run_of_the_script_settled_on(
        tmp_path, monkeypatch):
    """``train.py --epochs 4`` after ``train.py --epochs 3``: its first step runs the first run's
    plan (checked as it goes), solving nothing, bitwise as PyTorch."""
    import sys
    from mucudnn.torch.plancache import PlanCache
    model, data = small_cnn(torch.float64), batches(torch.float64, 4)
    reference = train(copy.deepcopy(model), data)
    budget = int(saved_bytes(model, data) * 0.6)
    monkeypatch.setattr(sys, "argv", ["/work/train.py", "--epochs", "3"])
    first, _, _ = cached_run(copy.deepcopy(model), data, PlanCache(tmp_path), budget,
                             trials=False)
    monkeypatch.setattr(sys, "argv", ["/work/train.py", "--epochs", "4"])

    def no_solve(*args, **kwargs):
        raise AssertionError("a run that finds a cached plan solves nothing")
    monkeypatch.setattr(planning, "plan_with_prefetch", no_solve)
    cache_said = []   # the session's own ``say`` under ``mucudnn run`` (from_environment)
    second, said, trained = cached_run(copy.deepcopy(model), data,
                                       PlanCache(tmp_path, cache_said.append), budget,
                                       trials=False)
    assert_bitwise(reference, trained)
    assert cache_said == ["no offload plan is cached for this script's arguments; its first "
                          "step runs the one cached for the arguments '--epochs 3', checked as "
                          "it goes"]
    assert said == [f"offload plan for {budget / GiB:.2f} GiB from the plan cache: "
                    f"{first.plan.describe()}"]
    assert second.plan == first.plan and second.lifecycle.state == "planned"
    # stored as its own too: the third run with these arguments finds it first
    assert PlanCache(tmp_path).load(second._cache_key).plan == first.plan


def test_a_cached_plan_that_does_not_fit_the_first_step_records_anew(tmp_path):
    from mucudnn.torch.plancache import PlanCache
    model, data = small_cnn(torch.float64), batches(torch.float64, 4)
    budget = int(saved_bytes(model, data) * 0.6)
    cached_run(copy.deepcopy(model), data, PlanCache(tmp_path), budget, trials=False)
    # the same script, another batch (each sample's activations: the groups are halved)
    halves = [(x[:2], y[:2]) for x, y in data]
    reference = train(copy.deepcopy(model), halves)
    session, said, trained = cached_run(copy.deepcopy(model), halves, PlanCache(tmp_path),
                                        budget, trials=False)
    assert_bitwise(reference, trained)
    assert said[0].startswith("offload plan for") and "from the plan cache" in said[0]
    assert said[1].startswith("the cached offload plan does not fit this step: group 0: ")
    assert said[1].endswith(" now (the batch changed?); recording anew")
    # the mixed step is no recording: the two after it record, then the plan is made
    assert said[2].startswith("offload plan for") and "plan cache" not in said[2]
    # the plan made anew replaced the entry
    stored = PlanCache(tmp_path).load(session._cache_key)
    assert [g.nbytes for g in stored.profile.groups] == [g.nbytes for g in session.profile.groups]
    assert session.plan is not None and session.lifecycle.state == "planned"


def test_a_fall_back_forgets_the_cached_plan(tmp_path):
    from mucudnn.torch.plancache import PlanCache
    model, data = small_cnn(torch.float64), batches(torch.float64, 4)
    budget = int(saved_bytes(model, data) * 0.6)
    cache = PlanCache(tmp_path)
    session, said, _ = cached_run(copy.deepcopy(model), data, cache, budget, trials=False)
    assert cache.load(session._cache_key) is not None
    session.lifecycle.replans_left = 0    # a planned step out of memory past its replans
    session._apply(session.lifecycle.end_step(StepOutcome(OUT_OF_MEMORY)))
    assert session.fell_back and cache.load(session._cache_key) is None


def test_a_cached_plan_recomputing_what_a_module_saves_of_its_own_output_fits(tmp_path,
                                                                               monkeypatch):
    # a ReLU saves its own output before its forward hook names it: its recipe (and its name)
    # come when it returns, so the first step under the cached plan checks them at its end
    from mucudnn.torch.plancache import PlanCache
    torch.manual_seed(0)
    layers, width = [], 3
    for out in (8, 8, 16):
        layers += [nn.Conv2d(width, out, 3, padding=1), nn.BatchNorm2d(out), nn.ReLU()]
        width = out
    model = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Linear(width, 10)).double()
    data = batches(torch.float64, 6)
    reference = train(copy.deepcopy(model), data)
    real = planning.plan_with_prefetch

    def recompute_all(profile, target, *args, **kwargs):   # every group with a recipe
        plan = real(profile, 1 << 40, *args, **kwargs)
        modes = tuple(RECOMPUTE if g.recompute_source else KEEP for g in profile.groups)
        return dataclasses.replace(plan, modes=modes, releases=())
    monkeypatch.setattr(planning, "plan_with_prefetch", recompute_all)
    budget = saved_bytes(model, data)
    first, _, _ = cached_run(copy.deepcopy(model), data, PlanCache(tmp_path), budget,
                             trials=False)
    relus = [g for g, m in zip(first.profile.groups, first.plan.modes)
             if m == RECOMPUTE and g.producer == "ReLU"]
    assert relus
    trace = []
    second, said, trained = cached_run(copy.deepcopy(model), data, PlanCache(tmp_path), budget,
                                       trials=False, trace=trace)
    assert_bitwise(reference, trained)
    assert len(said) == 1 and "from the plan cache" in said[0]
    first_step = trace[:next(i for i, e in enumerate(trace) if e[0] == "empty_cache" or
                             (e[0] == "pack" and e[1] == 0 and i > 0))]
    assert sum(e[0] == "recompute" for e in first_step) >= first.plan.count(RECOMPUTE)


def steps_reading(model, data, session, read) -> list:
    """``read()`` after each SGD step of ``model`` on ``data``, its forward in ``session``."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    readings = []
    for x, y in data:
        optimizer.zero_grad()
        with session:
            loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        readings.append(read())
    return readings


@pytest.mark.parametrize("freeze", [True, False])
def test_a_session_told_to_freezes_the_collector_once_its_recording_is_over(freeze):
    import gc
    model, data = small_cnn(torch.float32), batches(torch.float32, 5)
    budget = saved_bytes(model, data) * 2 // 3
    session = OffloadSession(budget=budget, link=RecordingLink(), min_bytes=0, freeze_gc=freeze)
    gc.unfreeze()
    try:
        frozen = steps_reading(model, data, session,
                               lambda: (session.lifecycle.state, gc.get_freeze_count() > 0))
    finally:
        gc.unfreeze()
    assert session.plan is not None
    # recording steps leave the collector alone; the first step boundary past the recording
    # (a step run as recorded while the plan is made, not the first planned one) freezes it,
    # with the session's option only
    assert frozen[0] == ("recording", False)
    assert any(is_frozen for _, is_frozen in frozen) == freeze
    first_frozen = next((i for i, (_, f) in enumerate(frozen) if f), None)
    if freeze:
        assert frozen[first_frozen - 1][0] == "recording"
        assert all(state == "recording" for state, _ in frozen[:first_frozen])


def test_the_collector_is_frozen_in_a_step_run_as_recorded_not_the_first_planned_one(monkeypatch):
    """The collection before the freeze takes about a step: it falls at the first boundary past
    the recording, whose step runs as recorded while the plan is made, so the first planned step
    runs without it."""
    import gc
    from test_first_planned_patterns import PlanAfter
    at_freeze = []
    monkeypatch.setattr(gc, "collect", lambda *args: 0)
    monkeypatch.setattr(gc, "freeze", lambda: at_freeze.append(
        (session.lifecycle.state, session.plan is None)))
    model, data = small_cnn(torch.float32), batches(torch.float32, 6)
    session = OffloadSession(budget=saved_bytes(model, data) // 2, link=RecordingLink(),
                             min_bytes=0, headroom=0.0, strict=False, trials=False,
                             record_steps=1, freeze_gc=True)
    session.lifecycle.runner = PlanAfter(3)   # the plan comes 3 boundaries after the recording
    states = steps_reading(model, data, session, lambda: session.lifecycle.state)
    assert "planning" in states and session.plan is not None
    assert at_freeze == [("planning", True)]


def test_the_step_that_freezes_the_collector_prefetches_as_its_plan_says(monkeypatch):
    """The step boundary where the first plan takes over and the collector is frozen also makes
    that plan's prefetch schedule: its first planned step fetches ahead, as one without the
    freeze does, not on demand."""
    import gc
    monkeypatch.setattr(gc, "freeze", lambda: None)   # the test process's collector left alone
    model, data = small_cnn(torch.float32), batches(torch.float32, 6)
    budget = saved_bytes(model, data) * 1 // 2
    schedules = {}

    class TickingLink(RecordingLink):
        """A clock that ticks 1 ms a mark: both sessions record the same times, so they plan
        the same whatever else the machine runs (the host's clock made them differ under load)."""
        ticks = 0

        def _stamp(self):
            self.ticks += 1
            return self.ticks / 1000.0

    for freeze in (False, True):
        session = OffloadSession(budget=budget, link=TickingLink(), min_bytes=0,
                                 freeze_gc=freeze, trials=False)
        schedules[freeze] = steps_reading(
            copy.deepcopy(model), data, session,
            lambda: (session.lifecycle.state, dict(session._schedule)))
        assert session._gc_frozen == freeze
        assert session.plan is not None and session.plan.count(OFFLOAD)
    assert any(schedule for _, schedule in schedules[False])
    assert schedules[True] == schedules[False]


# -- the step's floor, known before the first step (issue 40 item 2) ----------------------------

def floored_run(model, data, cache, budget, **options):
    """:func:`cached_run` whose lines (``say`` and ``warn``, the latter marked) are one list,
    with the lines said by the time the first leaf module began its forward."""
    said, before_first = [], []
    first = next(m for m in model.modules() if not list(m.children()))
    handle = first.register_forward_pre_hook(
        lambda module, args: before_first.append(list(said)) if not before_first else None)
    session = OffloadSession(budget=budget, link=RecordingLink(), min_bytes=0, headroom=0.0,
                             say=said.append, warn=lambda text: said.append("warn: " + text),
                             plan_cache=cache, strict=False, trials=False, **options)
    trained = train(model, data, session)
    handle.remove()
    return session, said, before_first[0], trained


def test_a_run_under_a_budget_an_earlier_run_found_no_plan_for_is_told_before_its_first_step(
        tmp_path):
    from mucudnn.torch.plancache import PlanCache, StepFloor
    model, data = small_cnn(torch.float64), batches(torch.float64, 3)
    reference = train(copy.deepcopy(model), data)
    first, said, before, trained = floored_run(copy.deepcopy(model), data, PlanCache(tmp_path),
                                               4096)
    assert_bitwise(reference, trained)
    assert first.plan is None and any("too small for this step" in line for line in said)
    assert before == []                      # nothing known of this step yet
    least = planning.least_peak(first.profile, 0)   # fetched when first unpacked: the least
    floor = PlanCache(tmp_path).load_floor(first._cache_key)
    assert floor == StepFloor(4096, least, 0.0)
    # a later run under another budget the floor rules out: one warning, before its first step
    second, said, before, trained = floored_run(copy.deepcopy(model), data, PlanCache(tmp_path),
                                                least - 1)
    assert_bitwise(reference, trained)
    assert before == [f"warn: {floor.line(least - 1)}"]
    assert [line for line in said if line.startswith("warn: ")] == before
    # one the floor leaves: no line, and a plan meets it
    third, said, before, trained = floored_run(copy.deepcopy(model), data, PlanCache(tmp_path),
                                               4 * least)
    assert_bitwise(reference, trained)
    assert before == [] and not any(line.startswith("warn: ") for line in said)
    assert third.plan is not None


def test_a_plan_that_meets_a_budget_the_floor_ruled_out_removes_the_floor(tmp_path):
    from mucudnn.torch.plancache import PlanCache, StepFloor
    model, data = small_cnn(torch.float64), batches(torch.float64, 3)
    budget = int(saved_bytes(model, data) * 4)
    probe, _, _, _ = floored_run(copy.deepcopy(model), data, PlanCache(tmp_path), budget)
    assert probe.plan is not None
    cache = PlanCache(tmp_path)
    path = next(tmp_path.glob("*.json"))
    for entry in tmp_path.glob("*.json"):    # no entry: the next run records and plans
        entry.unlink()
    cache.store_floor(probe._cache_key, StepFloor(budget * 2))   # wrong: the plan met budget
    session, said, before, _ = floored_run(copy.deepcopy(model), data, cache, budget)
    assert before == [f"warn: {StepFloor(budget * 2).line(budget)}"]
    assert session.plan is not None and not cache.floor_path(session._cache_key).exists()
    assert path.exists()                     # the plan it settled on, cached anew


def test_a_script_out_of_memory_while_offloading_everything_keeps_its_budget_as_too_small(
        tmp_path):
    from mucudnn.torch.plancache import PlanCache, StepFloor
    model, data = small_cnn(torch.float64), batches(torch.float64, 1)
    cache = PlanCache(tmp_path)
    budget = int(saved_bytes(model, data) * 4)
    session = OffloadSession(budget=budget, link=RecordingLink(), min_bytes=0, headroom=0.0,
                             plan_cache=cache, strict=False)
    train(model, data, session)             # one recording step of two
    assert session.state == "recording"
    line = session.script_ran_out_of_memory()
    assert line.startswith("the step ran out of device memory with every saved tensor offloaded: "
                           f"the {format_size(budget)} memory budget is below what one step needs "
                           "at least") and "give it a larger --memory-budget" in line
    assert cache.load_floor(session._cache_key) == StepFloor(budget, None, 0.0)
    # a step a cached plan ran until it no longer fitted kept its first groups: not a floor
    other = OffloadSession(budget=budget, link=RecordingLink(), min_bytes=0, headroom=0.0,
                           plan_cache=PlanCache(tmp_path / "c"), strict=False)
    train(model, data, other)
    other._offload_rest = True
    assert other.script_ran_out_of_memory().startswith(
        "the step ran out of device memory under the offload plan from the plan cache, which "
        "this step did not fit")
    assert other._plan_cache.load_floor(other._cache_key) is None
    other._offload_rest = False
    # a replan made inline (no plan runs meanwhile): its steps offload everything, as recorded
    other.lifecycle.state, other.lifecycle._replan_under_plan = "replanning", False
    assert other.lifecycle.inline and other.offloads_as_recorded
    assert "with every saved tensor offloaded" in other.script_ran_out_of_memory()
    assert other._plan_cache.load_floor(other._cache_key) == StepFloor(budget, None, 0.0)
    # before any tensor was saved: what the script allocated, not a step; nothing kept
    fresh = OffloadSession(budget=budget, link=RecordingLink(), plan_cache=PlanCache(tmp_path / "b"))
    assert fresh.script_ran_out_of_memory() == (
        f"the script ran out of device memory before the offload session saved any tensor: the "
        f"model, its inputs and what else it allocated take more than the "
        f"{format_size(budget)} memory budget")
    assert not (tmp_path / "b").exists()
