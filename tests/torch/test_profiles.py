"""mucudnn.torch.profiles and ``mucudnn offload-plan``: recorded profiles read back and replayed
off the GPU. Pure Python (no torch needed), but for the test that holds the replay's defaults
equal to OffloadSession's."""

from __future__ import annotations

import dataclasses
import inspect
import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from mucudnn.cli import main
from mucudnn.errors import MucudnnError
from mucudnn.torch import planner, profiles
from mucudnn.torch import planning
from mucudnn.torch.planner import SavedGroup, StepProfile

GiB = 2**30
ROOT = Path(__file__).resolve().parents[2]
# a session's document as OffloadSession.write_profile wrote it before the format field (format
# 1): R3D-18 under 4.5 GiB on the H200; its plan takes CBC well under a second
COMMITTED = ROOT / "benchmarks/results/pressure/h200/profiles/r3d18-offload-4.5GiB-7c7e2f0.json"
# offload.json's rows: VGG-16 with its leading chain staged
COMMITTED_ROWS = ROOT / "benchmarks/results/offload/h200/offload-vgg16-staged-503a5f4-h200.json"


def chain(n: int = 6) -> StepProfile:
    """6 groups of 1 GiB in a chain, every second one rebuilt from the one before it, 1 GiB of
    baseline; a slow link (5 GB/s: 215 ms a copy)."""
    groups = [SavedGroup(GiB, first_unpack=n - 1 - g, last_unpack=n - 1 - g, producer=f"m{g}",
                         recompute_ms=0.5 if g % 2 else None,
                         recompute_source=(g - 1,) if g % 2 else None) for g in range(n)]
    return StepProfile(groups, forward_ms=30.0, backward_ms=60.0, d2h_gbps=5.0, h2d_gbps=5.0,
                       unpacks=n, baseline_forward=[GiB] * n, baseline_backward=[GiB] * n)


def document(profile: StepProfile | None = None, **fields) -> dict:
    return {"budget": 8 * GiB, "target": 7 * GiB, "plan": "6 kept", "modes": ["keep"] * 6,
            "profile": dataclasses.asdict(profile or chain()), **fields}


def write(tmp_path, data, name="profile.json") -> Path:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


def invoke(*args):
    return CliRunner().invoke(main, ["offload-plan", *[str(a) for a in args]])


def one_error_line(result, *fragments):
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mucudnn: error: "), result.stderr
    assert all(fragment in lines[0] for fragment in fragments), lines[0]
    assert "Traceback" not in result.output


# -- the reader ---------------------------------------------------------------------------------

def test_a_document_without_a_format_is_format_1_and_the_current_one_is_read(tmp_path):
    old = profiles.load_profile(write(tmp_path, document()))
    assert old.format == 1 and old.profile == chain() and old.budget == 8 * GiB
    assert old.target == 7 * GiB and old.plan == "6 kept" and old.stage is None
    assert old.get("modes") == ["keep"] * 6 and old.source == str(tmp_path / "profile.json")
    new = profiles.load_profile(write(tmp_path, document(format=profiles.FORMAT)))
    assert new.format == profiles.FORMAT == 2 and new.profile == old.profile


def test_the_session_writes_the_format_this_reader_reads():
    # the session (torch) writes it as a literal; this holds the two equal without torch
    source = (ROOT / "mucudnn/torch/session_plans.py").read_text()
    assert f'"format": {profiles.FORMAT},' in source


@pytest.mark.parametrize("value, said", [
    (3, "profile format 3 is newer than this mucudnn reads (2)"),
    ("2", "format '2' is not a profile format"),
    (0, "format 0 is not a profile format"),
    (True, "format True is not a profile format"),
])
def test_a_newer_or_bad_format_is_refused_naming_the_file(tmp_path, value, said):
    path = write(tmp_path, document(format=value))
    with pytest.raises(MucudnnError) as raised:
        profiles.load_profile(path)
    assert str(path) in str(raised.value) and said in str(raised.value)
    assert "\n" not in str(raised.value)
    assert isinstance(raised.value, profiles.ProfileFormatError) == (value == 3)


def test_offload_json_rows_give_their_budget_and_configuration(tmp_path):
    rows = [{"model": "x", "method": "pytorch"},
            {**document(), "budget": None, "budget_bytes": 6 * GiB, "config": "mucudnn@6GiB"},
            {**document(), "budget_bytes": 5 * GiB}]   # the session's budget, where given
    path = write(tmp_path, rows, "offload.json")
    first = profiles.load_profile(path)
    assert first.budget == 6 * GiB and first.source == f"{path} row 0 (mucudnn@6GiB)"
    assert profiles.load_profile(path, 1).budget == 8 * GiB
    with pytest.raises(MucudnnError, match="2 rows with a profile, no row 2"):
        profiles.load_profile(path, 2)
    with pytest.raises(MucudnnError, match="no rows"):
        profiles.load_profile(write(tmp_path, document()), 1)


def test_every_committed_kind_of_file_is_read():
    doc = profiles.load_profile(COMMITTED)
    assert doc.format == 1 and doc.budget == 4831838208 and len(doc.profile.groups) == 39
    staged = profiles.load_profile(COMMITTED_ROWS)
    assert staged.budget == 12 * GiB and staged.stage is not None
    assert staged.stage.describe().startswith("its first 5 layers staged")


# -- the replay: as the session plans ----------------------------------------------------------

def test_the_replay_defaults_are_the_sessions():
    pytest.importorskip("torch")
    from mucudnn.torch.offload_session import OffloadSession
    defaults = {name: p.default for name, p in
                inspect.signature(OffloadSession.__init__).parameters.items()}
    assert defaults["headroom"] == profiles.HEADROOM
    assert defaults["lookahead"] == profiles.LOOKAHEAD
    assert defaults["plan_time_limit_s"] == profiles.PLAN_TIME_LIMIT_S
    assert defaults["keep_apart"] == profiles.KEEP_APART


def test_the_cli_defaults_are_the_sessions():
    command = main.commands["offload-plan"]
    defaults = {p.name: p.default for p in command.params}
    assert float(defaults["headroom"]) / 100 == profiles.HEADROOM
    assert defaults["lookahead"] == profiles.LOOKAHEAD
    assert defaults["time_limit"] == profiles.PLAN_TIME_LIMIT_S


def test_a_replay_plans_for_the_budget_less_its_headroom():
    done = profiles.replay(chain(), 5 * GiB, headroom=0.0)
    assert done.error is None and done.target == 5 * GiB and done.plan_s >= 0
    assert done.plan.count("recompute") == 2 and done.plan.count("keep") == 4
    assert done.trials is None and done.trials_s is None


def test_a_replay_falls_back_to_smaller_headrooms_as_the_session_does():
    profile = chain()
    budget = int(planning.least_peak(profile, 0, 0.0) / 0.93)   # the ladder's last rung
    done = profiles.replay(profile, budget, headroom=0.1)
    assert isinstance(done.error, MucudnnError) and "too small for this step" in str(done.error)
    assert done.target == planner.planning_target(budget, 0.05) == done.plan.target
    assert done.plan.peak <= done.target


def test_a_replay_with_trials_makes_the_sessions_other_plans():
    profile = profiles.load_profile(COMMITTED).profile
    done = profiles.replay(profile, 4831838208, trials=True)
    assert done.plan.moved_bytes and done.trials_s is not None
    assert done.trials == planning.trial_plans(
        profile, done.target, done.plan, profiles.LOOKAHEAD, profiles.PLAN_TIME_LIMIT_S,
        [planner.planning_target(4831838208, 0.1 * share)
         for share in planner.TRIAL_HEADROOM_SHARES], keep_apart=profiles.KEEP_APART)


# -- mucudnn offload-plan -----------------------------------------------------------------------

def test_a_committed_profile_replayed_at_its_own_budget_reproduces_a_plan():
    result = invoke(COMMITTED, "--budget", "4831838208", "--groups")
    assert result.exit_code == 0, result.output
    out = result.stdout.splitlines()
    assert out[0].startswith(f"{COMMITTED}: 39 saved groups, 58 backward points, format 1; "
                             "recorded under 4.50 GiB (target 4.05 GiB)")
    recorded = profiles.load_profile(COMMITTED)
    plan = profiles.replay(recorded.profile, recorded.budget).plan
    assert plan.peak <= planner.planning_target(recorded.budget, 0.1)
    assert out[1] == "budget 4.50 GiB, headroom 10%: plan for 4.05 GiB"
    assert out[2] == f"plan: {plan.describe()}"
    assert out[3] == (f"  kept {plan.count('keep')}, offloaded {plan.count('offload')}, "
                      f"recomputed {plan.count('recompute')}, staged: none; predicted step "
                      f"{plan.predicted_ms:.1f} ms, peak {plan.peak / GiB:.2f} GiB")
    assert out[4].startswith("planning took ") and out[4].endswith(" s (wall; the fast planner)")
    assert out[5] == profiles.GROUPS_HEADER
    assert [line.split()[1] for line in out[6:]] == list(plan.modes)
    # without --budget: the one it was recorded under
    assert invoke(COMMITTED).stdout.splitlines()[:3] == out[:3]


def test_offload_plan_options_and_trials(tmp_path):
    result = invoke(COMMITTED, "--budget", "5GiB", "--headroom", "5", "--lookahead", "1",
                    "--time-limit", "10", "--method", "ilp", "--trials")
    assert result.exit_code == 0, result.output
    out = result.stdout.splitlines()
    assert out[1] == "budget 5.00 GiB, headroom 5%: plan for 4.75 GiB"
    assert "CBC at most 10 s a solve" in out[4]
    # the fast planner (the default) and the ILP plan the same step here
    fast = invoke(COMMITTED, "--budget", "5GiB", "--headroom", "5", "--lookahead", "1")
    assert fast.exit_code == 0 and fast.stdout.splitlines()[1:3] == out[1:3]
    assert out[-1].startswith("trial plans: ") and " s (wall)" in out[-1]


def test_offload_plan_says_the_smaller_headroom_it_planned_for(tmp_path):
    profile = chain()
    budget = int(planning.least_peak(profile, 0, 0.0) / 0.93)
    result = invoke(write(tmp_path, document(profile)), "--budget", budget)
    assert result.exit_code == 0, result.output
    out = result.stdout.splitlines()
    assert out[1].startswith(f"no plan for {budget / GiB:.2f} GiB less its headroom (10%): ")
    assert out[2].endswith(f"plan for {planner.planning_target(budget, 0.05) / GiB:.2f} GiB "
                           "(5.0% less than the budget)")


def test_offload_plan_without_any_plan_says_so_with_status_1(tmp_path):
    result = invoke(write(tmp_path, document()), "--budget", "1GiB")
    assert result.exit_code == 1 and "the session offloads every saved tensor" in result.stdout


@pytest.mark.parametrize("content, args, said", [
    (None, [], "cannot be read as JSON"),
    ("not json", [], "cannot be read as JSON"),
    ('{"modes": []}', [], "no recorded profile in it"),
    ('{"profile": {"groups": []}}', [], "not a recorded profile"),
    ("[]", [], "0 rows with a profile, no row 0"),
    ("FORMAT3", [], "profile format 3 is newer than this mucudnn reads (2)"),
    ("NOBUDGET", [], "no budget recorded in it; give --budget"),
    ("VALID", ["--budget", "eight"], "eight"),
    ("VALID", ["--budget", "0"], "not more than 0 bytes"),
    ("VALID", ["--budget", "-1GiB"], "-1GiB"),
    ("VALID", ["--headroom", "100"], "--headroom '100' is not a percent"),
    ("VALID", ["--headroom", "ten"], "--headroom 'ten' is not a percent"),
])
def test_a_bad_file_format_or_budget_is_one_line(tmp_path, content, args, said):
    path = tmp_path / "profile.json"
    if content == "VALID":
        write(tmp_path, document())
    elif content == "FORMAT3":
        write(tmp_path, document(format=3))
    elif content == "NOBUDGET":
        write(tmp_path, document(budget=None))
    elif content is not None:
        write(tmp_path, content)
    one_error_line(invoke(path, *args), said)


def test_a_bad_file_is_one_line_from_the_installed_command(tmp_path):
    path = write(tmp_path, document(format=3))
    done = subprocess.run([sys.executable, "-m", "mucudnn", "offload-plan", str(path)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip().splitlines() == [
        f"mucudnn: error: {path}: profile format 3 is newer than this mucudnn reads (2); "
        "replay it with a newer mucudnn"]


def test_offload_plan_has_help():
    result = CliRunner().invoke(main, ["offload-plan", "--help"])
    assert result.exit_code == 0
    for option in ("--budget", "--headroom", "--lookahead", "--time-limit", "--groups",
                   "--trials", "--row"):
        assert option in result.output
