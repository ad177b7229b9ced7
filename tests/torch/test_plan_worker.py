"""The planner in a worker process (mucudnn/torch/plan_worker.py): the same answers as in-process,
the session's own stage payloads kept home, and the thread's making where the worker fails."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from mucudnn.torch import planner
from mucudnn.torch import plan_worker
from mucudnn.torch.plan_runner import (FIRST, LOWER, TRIALS, InlineRunner, PlanMaker, PlanRequest,
                                       StageCandidate)
from mucudnn.torch.plan_worker import ProcessRunner
from mucudnn.torch.planner_stage import Stage
from mucudnn.torch.profiles import load_profile

ROOT = Path(__file__).resolve().parents[2]
# a 3-D U-Net's recorded step (41 groups): plans in well under a second
PROFILE = ROOT / "benchmarks/results/pressure/h200/profiles/unet3d-offload-7GiB-b3ad89b.json"


def made_by(runner, requests, maker):
    answers = []
    for request in requests:
        runner.submit(request, maker)
        assert runner.wait(120)
        [(asked, made)] = runner.ready()
        assert asked is request
        answers.append(made)
    return answers


def requests_for(recorded):
    budget = recorded.budget
    target = planner.planning_target(budget, 0.1)
    first = PlanRequest(FIRST, recorded.profile, target, budget=budget, headroom=0.1)
    return budget, target, first


def test_a_worker_answers_as_the_planner_does_in_process():
    recorded = load_profile(PROFILE)
    budget, target, first = requests_for(recorded)
    inline = InlineRunner()
    inline.submit(first, PlanMaker())
    [(_, expected)] = inline.ready()
    runner = ProcessRunner()
    try:
        [made] = made_by(runner, [first], PlanMaker())
        assert runner.failed is None
        assert made.request is first and made.plan == expected.plan
        assert made.target == expected.target
        # the profile the session holds comes back, not a copy: the maker's knowledge of it
        # (targets without a plan) holds across requests, in the worker as in-process
        assert made.profile is first.profile
        trials = PlanRequest(TRIALS, made.profile, made.target, plan=made.plan,
                             larger_budgets=tuple(planner.trial_budgets(budget, 0.1)),
                             keep_apart=True)
        lower = PlanRequest(LOWER, made.profile, made.target, budget, 0.1, peak=made.plan.peak)
        remote = made_by(runner, [trials, lower], PlanMaker())
        local = made_by(InlineRunner(), [trials, lower], PlanMaker())
        assert [r.trials for r in remote] == [r.trials for r in local]
        assert [r.plan for r in remote] == [r.plan for r in local]
        assert runner.failed is None
    finally:
        runner.close()


def test_a_stage_candidate_s_payload_stays_home():
    recorded = load_profile(PROFILE)
    budget, target, first = requests_for(recorded)
    payload = object()      # the session's modules: never pickled
    stage = Stage(modules=3, first_group=0, end_group=3, input_group=None,
                  input_bytes=recorded.profile.groups[0].nbytes, chunks=0, forward_ms=1.0)
    request = replace(first, candidates=(StageCandidate(stage, 4, payload),), staging="always")
    runner = ProcessRunner()
    try:
        [made] = made_by(runner, [request], PlanMaker())
    finally:
        runner.close()
    assert runner.failed is None
    assert not isinstance(made, BaseException)
    assert made.stage is not None and made.stage.payload is payload
    assert made.stage.stage.chunks >= 2       # as the worker chose it


def test_a_worker_that_fails_leaves_the_making_to_the_thread(monkeypatch):
    recorded = load_profile(PROFILE)
    _, _, first = requests_for(recorded)
    monkeypatch.setattr(plan_worker.sys, "executable", "/nonexistent/python")
    said = []
    runner = ProcessRunner(say=said.append)
    [made] = made_by(runner, [first], PlanMaker())
    assert runner.failed is not None
    assert len(said) == 1 and "worker process failed" in said[0]
    assert made.plan is not None and made.request is first


def test_the_worker_ends_when_its_input_ends_and_imports_no_torch():
    code = ("import sys, mucudnn.torch.plan_worker as w; w.serve(sys.stdin.buffer, "
            "sys.stdout.buffer); print('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], input=b"", capture_output=True,
                          timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == b"False"


def test_a_worker_that_ended_between_requests_is_started_again():
    recorded = load_profile(PROFILE)
    _, _, first = requests_for(recorded)
    said = []
    runner = ProcessRunner(say=said.append)
    try:
        [made] = made_by(runner, [first], PlanMaker())
        assert runner.failed is None and runner._worker is not None
        runner._worker.kill()
        runner._worker.wait(timeout=30)
        again = replace(first)      # another request, the same question
        [remade] = made_by(runner, [again], PlanMaker())
    finally:
        runner.close()
    assert runner.failed is None and not said
    assert remade.request is again and remade.plan == made.plan


def test_a_worker_that_dies_in_a_request_leaves_it_and_the_next_to_the_thread(monkeypatch):
    recorded = load_profile(PROFILE)
    _, _, first = requests_for(recorded)
    said = []
    runner = ProcessRunner(say=said.append)

    def dying(stream):   # the answer never comes: the worker ended inside the request
        runner._worker.kill()
        raise EOFError("the stream ended")
    try:
        monkeypatch.setattr(plan_worker, "_receive", dying)
        [made] = made_by(runner, [first], PlanMaker())
        monkeypatch.undo()
        [after] = made_by(runner, [replace(first)], PlanMaker())
    finally:
        runner.close()
    assert runner.failed is not None and len(said) == 1 and runner._worker is None
    assert made.plan is not None and after.plan == made.plan


def test_a_warmed_worker_is_the_one_the_first_request_goes_to():
    # started during the recording (its imports then take no planning time), and reused
    recorded = load_profile(PROFILE)
    _, _, first = requests_for(recorded)
    runner = ProcessRunner()
    try:
        runner.warm()
        warmed = runner._worker
        assert warmed is not None and warmed.poll() is None
        runner.warm()                       # a second warm-up starts no other
        assert runner._worker is warmed
        [made] = made_by(runner, [first], PlanMaker())
        assert runner._worker is warmed and runner.failed is None and made.plan is not None
    finally:
        runner.close()


def test_a_worker_that_cannot_start_when_warmed_leaves_it_to_the_first_request(monkeypatch):
    recorded = load_profile(PROFILE)
    _, _, first = requests_for(recorded)
    monkeypatch.setattr(plan_worker.subprocess, "Popen",
                        lambda *args, **kwargs: (_ for _ in ()).throw(OSError("no (test)")))
    said = []
    runner = ProcessRunner(say=said.append)
    runner.warm()                           # says nothing, raises nothing
    assert runner._worker is None and runner.failed is None and not said
    [made] = made_by(runner, [first], PlanMaker())
    assert runner.failed is not None and len(said) == 1 and made.plan is not None


def test_a_lowering_that_takes_a_stage_comes_back_with_the_sessions_own_candidate():
    """LOWER weighs the recording's stages again (PlanMaker._staged_lowering): sent to the worker
    as their index, as FIRST's are, and back as the session's candidate, its chunks as made."""
    import dataclasses
    sys.path.insert(0, str(Path(__file__).parent))
    from test_planner import staged_chain_profile
    MiB = 2**20
    profile = dataclasses.replace(staged_chain_profile(), d2h_gbps=1e-3, h2d_gbps=1e-3)
    payload = object()   # the session's modules: never pickled
    candidate = StageCandidate(Stage(5, 0, 3, 0, 1 * MiB, 1, 3.0), 8, payload)
    budget = int(36.5 * MiB / 0.85)
    first = planner.planning_target(budget, 0.1)
    lower = PlanRequest(LOWER, profile, first, budget, 0.1, peak=first, candidates=(candidate,),
                        recorded=profile)
    runner = ProcessRunner()
    try:
        [made] = made_by(runner, [lower], PlanMaker())
        assert runner.failed is None
    finally:
        runner.close()
    [expected] = made_by(InlineRunner(), [lower], PlanMaker())
    assert made.stage.payload is payload and made.stage == expected.stage
    assert made.plan == expected.plan and made.profile == expected.profile
