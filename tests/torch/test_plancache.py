"""mucudnn.torch.plancache: offload plans kept between runs (torch-free): the key, the step's
signature, the entry's file, and what a cache does with files it cannot use."""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mucudnn import settings
from mucudnn.errors import MucudnnError
from mucudnn.torch import planner, plancache, profiles
from mucudnn.torch import planner_stage
from mucudnn.torch import planning
from mucudnn.torch.plancache import CachedPlan, PlanCache, PlanKey, StepSignature
from mucudnn.torch.planner import SavedGroup, StepProfile

GiB = 2**30


def chain(n: int = 6) -> StepProfile:
    """6 groups of 1 GiB in a chain, every second one rebuilt from the one before it, 1 GiB of
    baseline; a slow link (5 GB/s: 215 ms a copy): its plans mix all three modes."""
    groups = [SavedGroup(GiB, first_unpack=n - 1 - g, last_unpack=n - 1 - g, producer=f"m{g}",
                         recompute_ms=0.5 if g % 2 else None,
                         recompute_source=(g - 1,) if g % 2 else None) for g in range(n)]
    return StepProfile(groups, forward_ms=30.0, backward_ms=60.0, d2h_gbps=5.0, h2d_gbps=5.0,
                       unpacks=n, baseline_forward=[GiB] * n, baseline_backward=[GiB] * n)

OPTIONS = {"headroom": 0.1, "lookahead": 2, "recompute": True, "recompute_convolutions": True,
           "staging": True, "copy_exposure": 0.6, "trials": True, "keep_apart": True}
KEY_FIELDS = dict(gpu_name="NVIDIA H100 80GB HBM3", gpu_memory=85_045_411_840,
                  torch_version="2.11.0+cu130", cudnn_version=91900,
                  argv=["/work/train.py", "--epochs", "3"])


def key(budget: int = 8 * GiB, options=None, **fields) -> PlanKey:
    return PlanKey.make(budget, OPTIONS if options is None else options,
                        **{**KEY_FIELDS, **fields})


def entry(target: int = 4 * GiB) -> CachedPlan:
    profile = chain()
    plan = planning.plan_with_prefetch(profile, target, 2, 20)
    return CachedPlan.make(dataclasses.replace(plan, keep_apart=True), profile,
                           kept_after_trial="at copy exposure 0.2")


def staged_entry() -> CachedPlan:
    recorded = chain()
    stage = planner_stage.Stage(modules=3, first_group=0, end_group=3, input_group=0,
                          input_bytes=GiB, chunks=2, forward_ms=5.0)
    staged = planner_stage.staged_profile(recorded, stage)
    plan = planning.plan_with_prefetch(staged, 4 * GiB, 2, 20)
    return CachedPlan.make(plan, staged, recorded_profile=recorded, stage=stage)


class Said(list):
    def __call__(self, text: str) -> None:
        assert "\n" not in text
        self.append(text)


@pytest.fixture
def cache(tmp_path):
    return PlanCache(tmp_path / "plans", Said())


# -- the round trip -----------------------------------------------------------------------------

def test_an_entry_stored_loads_as_it_was_with_every_field_of_its_plan(cache):
    stored = entry()
    assert set(stored.plan.modes) == set(planner.MODES) and stored.plan.releases
    assert cache.store(key(), stored)
    # its own file, and the script's latest entry (the same text): named by the key less its
    # arguments
    assert sorted(cache.directory.iterdir()) == sorted(
        [cache.path_for(key()), cache.path_for(key().for_script())])
    assert cache.path_for(key()).name == key().digest() + ".json"
    assert cache.path_for(key()).read_text() == cache.path_for(key().for_script()).read_text()
    loaded = cache.load(key())
    assert loaded == stored and cache.say == []
    # the fields equality leaves out: how it runs and what it was made for
    assert loaded.plan.target == 4 * GiB and loaded.plan.keep_apart is True
    assert loaded.plan.releases == stored.plan.releases and loaded.plan.modes == stored.plan.modes
    assert loaded.kept_after_trial == "at copy exposure 0.2"
    assert loaded.description == stored.plan.describe() and loaded.stage is None
    assert loaded.signature == StepSignature.of(chain())


def test_an_entry_says_whether_a_run_proved_its_plan_and_one_that_does_not_say_is_unproven(
        cache):
    assert not entry().proven
    proven = dataclasses.replace(entry(), proven=True)
    cache.store(key(), proven)
    assert cache.load(key()) == proven and cache.load(key()).proven
    # a file written before entries said it (or with a value that is not true) is unproven
    for value in (None, "yes", 1):
        document = json.loads(cache.path_for(key()).read_text())
        if value is None:
            del document["proven"]
        else:
            document["proven"] = value
        cache.path_for(key()).write_text(json.dumps(document))
        loaded = cache.load(key())
        assert loaded is not None and not loaded.proven and cache.say == []


def test_a_staged_entry_keeps_its_stage_and_recorded_profile(cache):
    stored = staged_entry()
    assert stored.stage is not None and len(stored.profile.groups) < len(chain().groups)
    cache.store(key(), stored)
    loaded = cache.load(key())
    assert loaded == stored and loaded.stage == stored.stage
    assert loaded.recorded_profile == chain() and cache.say == []


def test_a_staged_entry_whose_input_autograd_keeps_round_trips(cache):
    entry = staged_entry()
    entry = dataclasses.replace(entry, stage=dataclasses.replace(entry.stage, input_saved=False))
    cache.store(key(), entry)
    assert cache.load(key()).stage.input_saved is False and not cache.say
    # an entry written before the field: its stage saves its input, as stages then did
    path = cache.path_for(key())
    document = json.loads(path.read_text())
    del document["stage"]["input_saved"]
    path.write_text(json.dumps(document))
    assert cache.load(key()).stage.input_saved is True


def test_an_entry_is_a_profile_document_the_replay_reads(cache):
    cache.store(key(), entry())
    recorded = profiles.load_profile(cache.path_for(key()))
    assert recorded.profile == chain() and recorded.budget == 8 * GiB
    assert recorded.target == 4 * GiB and recorded.plan == entry().description
    assert recorded.get("modes") == list(entry().plan.modes)


def test_a_plan_that_does_not_go_with_its_profile_is_refused():
    plan = entry().plan
    with pytest.raises(ValueError, match="5 modes"):
        CachedPlan.make(dataclasses.replace(plan, modes=plan.modes[:5]), chain())
    with pytest.raises(ValueError, match="stage"):
        CachedPlan.make(plan, chain(), recorded_profile=chain())


def test_storing_again_replaces_the_entry(cache):
    cache.store(key(), entry(4 * GiB))
    cache.store(key(), entry(5 * GiB))
    assert cache.load(key()).plan.target == 5 * GiB
    assert sorted(p.name for p in cache.directory.iterdir()) == sorted(
        [key().digest() + ".json", key().for_script().digest() + ".json"])


def test_forget_removes_its_own_entry_only(cache):
    cache.store(key(), entry())
    other = cache.directory / "notes.txt"
    other.write_text("mine")
    assert cache.forget(key()) and not cache.forget(key())
    assert cache.load(key()) is None and other.read_text() == "mine" and cache.say == []


# -- the key ------------------------------------------------------------------------------------

KEY_CHANGES = {
    "budget": dict(budget=6 * GiB),
    "gpu name": dict(gpu_name="NVIDIA H200"),
    "gpu memory": dict(gpu_memory=150_000_000_000),
    "torch": dict(torch_version="2.12.0+cu130"),
    "cudnn": dict(cudnn_version=92000),
    "cudnn absent": dict(cudnn_version=None),
    "mucudnn": dict(mucudnn_version="0.2.0"),
    "script": dict(argv=["/work/other.py", "--epochs", "3"]),
    **{f"option {name}": dict(options={**OPTIONS, name: value}) for name, value in
       [("headroom", 0.2), ("lookahead", 3), ("recompute", False),
        ("recompute_convolutions", False), ("staging", "always"), ("copy_exposure", 0.0),
        ("keep_apart", False)]},
    "an option more": dict(options={**OPTIONS, "min_bytes": 1 << 20}),
    "an option less": dict(options={n: v for n, v in OPTIONS.items() if n != "trials"}),
}


@pytest.mark.parametrize("change", KEY_CHANGES, ids=list(KEY_CHANGES))
def test_a_key_differing_in_any_field_but_the_arguments_misses(cache, change):
    cache.store(key(), entry())
    other = key(**KEY_CHANGES[change])
    assert other != key() and other.digest() != key().digest()
    assert cache.load(other) is None and cache.say == []   # another file: none there
    assert cache.load(key()) is not None


OTHER_ARGUMENTS = {"arguments": dict(argv=["/work/train.py", "--epochs", "4"]),
                   "no arguments": dict(argv=["/work/train.py"])}


@pytest.mark.parametrize("change", ["budget", "cudnn", "option headroom", "arguments"])
def test_a_file_under_the_name_holding_another_key_is_one_line_and_a_miss(cache, change):
    # a hash collision, or a file edited or copied: the key in the file decides
    other = key(**{**KEY_CHANGES, **OTHER_ARGUMENTS}[change])
    cache.store(other, entry())
    cache.directory.joinpath(key().digest() + ".json").write_bytes(
        cache.path_for(other).read_bytes())
    assert cache.load(key()) is None
    [line] = cache.say
    assert "another run's key" in line and key().digest() in line


@pytest.mark.parametrize("change", OTHER_ARGUMENTS)
def test_a_run_with_other_arguments_runs_the_scripts_latest_entry_with_one_line(cache, change):
    """``--epochs 4`` after ``--epochs 3``: the first run's plan, its first step checked as any
    cached plan's (the session records anew where the arguments changed the step)."""
    cache.store(key(), entry(4 * GiB))
    other = key(**OTHER_ARGUMENTS[change])
    assert other.digest() != key().digest() and other.for_script() == key().for_script()
    loaded = cache.load(other)
    assert loaded == entry(4 * GiB) and loaded.arguments == ("--epochs", "3")
    assert cache.say == ["no offload plan is cached for this script's arguments; its first step "
                         "runs the one cached for the arguments '--epochs 3', checked as it goes"]
    # its own entry, once stored, comes first; and is the script's latest from then on
    cache.store(other, entry(5 * GiB))
    assert cache.load(other).plan.target == 5 * GiB and cache.load(key()).plan.target == 4 * GiB
    assert cache.load(key(argv=["/work/train.py", "--lr", "1"])).plan.target == 5 * GiB


def test_another_script_or_budget_never_runs_the_scripts_latest_entry(cache):
    cache.store(key(), entry())
    for other in (key(argv=["/work/other.py", "--epochs", "3"]), key(budget=6 * GiB),
                  key(cudnn_version=92000)):
        assert cache.load(other) is None
    assert cache.say == []
    # a script's latest entry holding another script's key (edited, copied): one line, a miss
    moved = key(argv=["/work/other.py", "--epochs", "4"])
    cache.path_for(moved.for_script()).write_bytes(cache.path_for(key()).read_bytes())
    assert cache.load(moved) is None
    [line] = cache.say
    assert "another script's key" in line and moved.for_script().digest() in line


def test_programs_that_name_no_script_share_no_entry(cache):
    """``python -c`` (argv[0] "-c") and an interactive session (""): other arguments are another
    program, not another run of one."""
    for program in ("-c", ""):
        cache.store(key(argv=[program, "a"]), entry())
        assert cache.load(key(argv=[program, "b"])) is None
    assert cache.say == [] and len(list(cache.directory.iterdir())) == 2


def test_forget_takes_the_scripts_latest_entry_only_where_it_is_its_own(cache):
    other = key(argv=["/work/train.py", "--epochs", "4"])
    cache.store(key(), entry(4 * GiB))
    cache.store(other, entry(5 * GiB))   # the script's latest now
    assert cache.forget(key())
    assert cache.load(key()).plan.target == 5 * GiB   # the other run's, as the latest
    cache.say.clear()
    assert cache.forget(other)
    assert cache.load(other) is None and cache.load(key()) is None and cache.say == []
    assert list(cache.directory.iterdir()) == []


def test_the_key_takes_options_in_any_order_and_the_script_resolved(tmp_path, monkeypatch):
    script = tmp_path / "train.py"
    script.write_text("")
    link = tmp_path / "link.py"
    link.symlink_to(script)
    monkeypatch.chdir(tmp_path)
    made = key(options=dict(reversed(list(OPTIONS.items()))), argv=["link.py", "-x"])
    assert made.script == str(script.resolve()) and made.arguments == ("-x",)
    assert made == key(argv=[str(script), "-x"]) and made.options == key().options
    # a program that names no file (python -c) keeps argv[0] as given
    assert key(argv=["-c", "a"]).script == "-c"
    monkeypatch.setattr(sys, "argv", [str(script), "--lr", "0.1"])
    assert PlanKey.make(GiB, OPTIONS, gpu_name="g", gpu_memory=1, torch_version="t",
                        cudnn_version=None).arguments == ("--lr", "0.1")


def test_the_key_holds_mucudnns_version_and_refuses_values_that_are_not_plain():
    from mucudnn._version import __version__
    assert PlanKey.make(GiB, {}, gpu_name="g", gpu_memory=1, torch_version="t",
                        cudnn_version=1, argv=["x"]).mucudnn_version == __version__
    with pytest.raises(plancache.PlanCacheError, match="'profile_to' is a PosixPath") as error:
        key(options={**OPTIONS, "profile_to": Path("/tmp/x")})
    assert isinstance(error.value, MucudnnError)
    with pytest.raises(plancache.PlanCacheError, match="finite"):
        key(options={**OPTIONS, "headroom": float("nan")})
    assert key(options={**OPTIONS, "shares": (0.5, 0.25)}).document()["options"]["shares"] == \
        [0.5, 0.25]


# -- the signature ------------------------------------------------------------------------------

SIGNATURE = StepSignature.of(chain())


def test_the_recorded_step_passes_every_check():
    profile = chain()
    for index, group in enumerate(profile.groups):
        assert SIGNATURE.check_group(index, group.nbytes, group.producer, group.offloadable,
                                     group.recompute_source) is None
        assert SIGNATURE.check_group(index, group.nbytes) is None   # the rest not known yet
    assert SIGNATURE.check_step(6, 6, [g.first_unpack for g in profile.groups],
                                [g.last_unpack for g in profile.groups]) is None
    assert SIGNATURE.check_step(6) is None


def test_each_group_mismatch_says_what_changed_in_one_line():
    assert SIGNATURE.check_group(1, GiB // 2, "m1") == \
        "group 1: 1.0 GiB recorded, 512.0 MiB now (the batch changed?)"
    assert SIGNATURE.check_group(1, GiB + 8, "m1") == \
        f"group 1: {GiB} bytes recorded, {GiB + 8} bytes now (the batch changed?)"
    assert SIGNATURE.check_group(2, GiB, "Conv2d") == \
        "group 2: made by m2 recorded, by Conv2d now (the model changed?)"
    assert SIGNATURE.check_group(2, GiB, "m2", offloadable=False) == \
        "group 2: offloadable recorded, not offloadable now (its layout changed?)"
    assert SIGNATURE.check_group(3, GiB, "m3", True, None) == \
        "group 3: a recipe reading group 2 recorded, no recipe now (the model changed?)"
    assert SIGNATURE.check_group(3, GiB, "m3", True, (0, 2)) == \
        "group 3: a recipe reading group 2 recorded, a recipe reading groups 0, 2 now (the " \
        "model changed?)"
    # no recipe recorded: the plan never recomputes it, so a recipe now changes nothing
    assert SIGNATURE.check_group(2, GiB, "m2", True, (1,)) is None
    assert SIGNATURE.check_group(6, GiB) == \
        "group 6: the recorded step saved 6 groups, this one saves more (the model or its " \
        "input changed?)"


def test_each_step_mismatch_says_what_changed_in_one_line():
    firsts = [5, 4, 3, 2, 1, 0]
    assert SIGNATURE.check_step(5) == \
        "6 saved groups recorded, 5 now (the model or its input changed?)"
    assert SIGNATURE.check_step(6, 7) == \
        "6 backward points recorded, 7 now (the backward changed?)"
    assert SIGNATURE.check_step(6, 6, [5, 4, 2, 2, 1, 0], firsts) == \
        "group 2: unpacked at backward points 3-3 recorded, 2-3 now (the backward changed?)"
    assert SIGNATURE.check_step(6, 6, firsts, [5, 4, 3, 2, 1, 1]) == \
        "group 5: unpacked at backward points 0-0 recorded, 0-1 now (the backward changed?)"
    # never unpacked: at the last point, as the profile records it
    assert SIGNATURE.check_step(6, 6, [None, 4, 3, 2, 1, 0], [None, 4, 3, 2, 1, 0]) is None
    assert SIGNATURE.check_step(6, 6, [5, 4, 3, 2, 1, None], firsts) == \
        "group 5: unpacked at backward points 0-0 recorded, 5-0 now (the backward changed?)"


# -- files it cannot use: a miss and one line, the file left as it was ---------------------------

CORRUPT = {
    "truncated": lambda text: text[: len(text) // 2],
    "not JSON": lambda text: "{plans: yes}",
    "not an object": lambda text: "[1, 2]",
    "no format": lambda text: json.dumps({k: v for k, v in json.loads(text).items()
                                          if k != "plan_cache_format"}),
    "no profile": lambda text: json.dumps({k: v for k, v in json.loads(text).items()
                                           if k != "profile"}),
    "modes for other groups": lambda text: json.dumps(
        {**json.loads(text), "offload_plan": {**json.loads(text)["offload_plan"],
                                              "modes": ["keep"] * 5}}),
    "an unknown mode": lambda text: json.dumps(
        {**json.loads(text), "offload_plan": {**json.loads(text)["offload_plan"],
                                              "modes": ["keep"] * 5 + ["drop"]}}),
    "a plan field unknown": lambda text: json.dumps(
        {**json.loads(text), "offload_plan": {**json.loads(text)["offload_plan"], "x": 1}}),
    "a signature not its profile's": lambda text: json.dumps(
        {**json.loads(text), "signature": {**json.loads(text)["signature"], "unpacks": 7}}),
    "a signature that is none": lambda text: json.dumps({**json.loads(text), "signature": 3}),
    "a profile that is none": lambda text: json.dumps({**json.loads(text), "profile": [1]}),
}


@pytest.mark.parametrize("damage", CORRUPT, ids=list(CORRUPT))
def test_a_corrupt_file_is_one_line_and_a_miss_and_is_kept(cache, damage):
    cache.store(key(), entry())
    path = cache.path_for(key())
    path.write_text(CORRUPT[damage](path.read_text()))
    before = path.read_bytes()
    assert cache.load(key()) is None
    [line] = cache.say
    assert line.startswith(f"the cached offload plan {path} is not used: ") and \
        line.endswith("; recording anew")
    assert path.read_bytes() == before
    assert cache.store(key(), entry()) and cache.load(key()) == entry()   # its entry replaces it


def test_a_file_that_is_not_text_or_cannot_be_read_is_one_line(cache):
    cache.directory.mkdir()
    path = cache.path_for(key())
    path.write_bytes(b"\xff\xfe\x00garbage")
    assert cache.load(key()) is None
    assert "cannot be read" in cache.say[-1] and len(cache.say) == 1
    path.unlink()
    path.mkdir()   # not a file: the user's, never removed
    assert cache.load(key()) is None and len(cache.say) == 2 and "cannot be read" in cache.say[-1]
    assert not cache.forget(key()) and path.is_dir() and len(cache.say) == 3


@pytest.mark.parametrize("field, value, said", [
    ("plan_cache_format", plancache.FORMAT + 1, "newer mucudnn (plan_cache_format 2"),
    ("format", profiles.FORMAT + 1, "newer mucudnn (format 3"),
    ("plan_cache_format", plancache.FORMAT - 1, "older mucudnn"),
    ("plan_cache_format", True, "no plan_cache_format"),
])
def test_a_file_of_another_format_is_one_line_and_a_miss(cache, field, value, said):
    cache.store(key(), entry())
    path = cache.path_for(key())
    path.write_text(json.dumps({**json.loads(path.read_text()), field: value}))
    assert cache.load(key()) is None
    [line] = cache.say
    assert said in line, line


# -- several processes at once ------------------------------------------------------------------

def _store_many(directory: str, target: int, times: int) -> None:
    said = Said()
    cache = PlanCache(directory, said)
    made = entry(target)
    for _ in range(times):
        assert cache.store(key(), made)
    assert said == []


def test_processes_storing_one_key_at_once_leave_one_whole_entry(tmp_path):
    directory = tmp_path / "plans"
    targets = [4 * GiB, 5 * GiB, 6 * GiB, 7 * GiB]
    written = {target: entry(target) for target in targets}
    # one entry there before the race: a reader that found no file for the key and then, its
    # writer having stored both meanwhile, the script's latest would say so in a line
    assert PlanCache(directory, Said()).store(key(), written[targets[0]])
    context = multiprocessing.get_context("fork")
    writers = [context.Process(target=_store_many, args=(str(directory), target, 25))
               for target in targets]
    for writer in writers:
        writer.start()
    reader = PlanCache(directory, Said())
    seen = set()
    while any(writer.is_alive() for writer in writers):
        loaded = reader.load(key())
        if loaded is not None:   # a reader sees a whole entry, one of those written
            assert loaded == written[loaded.plan.target]
            seen.add(loaded.plan.target)
    for writer in writers:
        writer.join()
        assert writer.exitcode == 0
    last = reader.load(key())
    assert last == written[last.plan.target] and reader.say == []
    assert sorted(p.name for p in directory.iterdir()) == sorted(   # no temp file left
        [key().digest() + ".json", key().for_script().digest() + ".json"])


# -- a directory it cannot write, and the setting -------------------------------------------------

def test_a_directory_that_cannot_be_made_is_one_line_and_no_cache(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("the user's")
    cache = PlanCache(blocker / "plans", Said())
    assert cache.load(key()) is None and cache.say == []   # nothing there: no entry
    assert not cache.store(key(), entry())
    [line] = cache.say
    assert line.startswith("offload plans are not cached: ") and "MUCUDNN_PLAN_CACHE" in line
    assert not cache.store(key(), entry()) and len(cache.say) == 1   # said once
    assert blocker.read_text() == "the user's"


def test_a_directory_that_cannot_be_written_is_one_line_and_no_cache(cache, monkeypatch):
    import tempfile

    def refused(*args, **kwargs):
        raise PermissionError(13, "Permission denied")
    monkeypatch.setattr(tempfile, "mkstemp", refused)
    assert not cache.store(key(), entry()) and not cache.store(key(), entry())
    [line] = cache.say
    assert "Permission denied" in line and "training goes on" in line


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes a read-only directory")
def test_a_read_only_directory_is_one_line_and_no_cache(cache):
    cache.directory.mkdir()
    cache.directory.chmod(0o500)
    try:
        assert not cache.store(key(), entry())
        [line] = cache.say
        assert "Permission denied" in line
    finally:
        cache.directory.chmod(0o700)


def test_the_default_directory_is_the_user_caches(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    for environ in ({}, {"MUCUDNN_PLAN_CACHE": ""}):
        made = PlanCache.from_environment(Said(), environ)
        assert made.directory == tmp_path / "mucudnn" / "offload-plans" and made.say == []
    made.store(key(), entry())
    assert made.path_for(key()).is_file() and made.load(key()) == entry()


def test_the_setting_names_a_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    made = PlanCache.from_environment(Said(), {"MUCUDNN_PLAN_CACHE": "~/plans"})
    assert made.directory == tmp_path / "plans"
    assert made.store(key(), entry()) and made.load(key()) == entry()


def test_off_keeps_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    for value in ("off", "OFF", " off "):
        made = PlanCache.from_environment(Said(), {"MUCUDNN_PLAN_CACHE": value})
        assert not made.enabled and made.path_for(key()) is None
        assert not made.store(key(), entry()) and made.load(key()) is None
        assert not made.forget(key()) and made.say == []
    assert list(tmp_path.iterdir()) == []


def test_a_value_the_setting_refuses_is_one_line_and_the_default(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    said = Said()
    made = PlanCache.from_environment(said, {"MUCUDNN_PLAN_CACHE": "relative/plans"})
    assert made.directory == tmp_path / "mucudnn" / "offload-plans"
    [line] = said
    assert "MUCUDNN_PLAN_CACHE='relative/plans' is not valid" in line
    assert settings.PLAN_CACHE.accepted in line


def test_the_module_imports_neither_torch_nor_pulp():
    code = ("import sys, mucudnn.torch.plancache; "
            "print([m for m in ('torch', 'pulp') if m in sys.modules])")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


@pytest.mark.parametrize("field, value", [("chunks", 0), ("chunks", -2), ("chunks", "4"),
                                          ("chunks", 2.5), ("chunks", None), ("modules", "3"),
                                          ("modules", 3.0), ("modules", 0), ("modules", True),
                                          ("first_group", "0"), ("end_group", -1),
                                          ("input_group", "x"), ("input_saved", 1),
                                          ("input_saved", None)])
def test_a_staged_entry_whose_stage_is_no_stage_is_one_line_and_a_miss(cache, field, value):
    # a cached run stages its first step with the entry's stage (its modules' count, its
    # micro-batches): a file whose stage holds no such numbers is corrupt, not a crash there
    cache.store(key(), staged_entry())
    path = cache.path_for(key())
    document = json.loads(path.read_text())
    document["stage"][field] = value
    path.write_text(json.dumps(document))
    assert cache.load(key()) is None
    [line] = cache.say
    assert line.startswith(f"the cached offload plan {path} is not used: ")


# -- the step's floor (rule 5) ------------------------------------------------------------------

def test_a_floor_found_under_one_budget_rules_out_the_budgets_below_what_it_needs(cache):
    from mucudnn.torch.plancache import StepFloor
    floor = StepFloor(4 * GiB, least_peak=5 * GiB, least_headroom=0.025)
    assert cache.store_floor(key(4 * GiB), floor)
    # read by a run of the same step under any budget, none of whose entries exist
    found = cache.load_floor(key(5 * GiB))
    assert found == floor and cache.load(key(5 * GiB)) is None and not cache.say
    needs = -(-5 * GiB * 40 // 39)          # the least-headroom target reaching the least peak
    assert found.needs() == needs
    assert found.rules_out(needs - 1) and not found.rules_out(needs)
    line = found.line(5 * GiB)
    assert line.startswith("the 5.0 GiB memory budget is below what this training step needs at "
                           "least: a run of it under 4.0 GiB found no offload plan, the least peak "
                           "any plan reached being 5.0 GiB") and "give it at least 5.1 GiB" in line
    # another step (another argument, option, GPU) reads none
    assert cache.load_floor(key(argv=["/work/train.py", "--epochs", "4"])) is None
    assert cache.load_floor(key(gpu_name="NVIDIA H200")) is None and not cache.say


def test_a_floor_of_running_out_of_memory_rules_out_that_budget_and_less():
    from mucudnn.torch.plancache import StepFloor
    floor = StepFloor(3 * GiB)
    assert floor.rules_out(3 * GiB) and floor.rules_out(2 * GiB) and not floor.rules_out(3 * GiB + 1)
    assert "a run of it under 3.0 GiB ran out of device memory with every saved tensor offloaded" \
        in floor.line(2 * GiB) and "give it more than 3.0 GiB" in floor.line(2 * GiB)


def test_the_floor_that_rules_out_more_is_kept_and_a_plan_below_it_removes_it(cache):
    from mucudnn.torch.plancache import StepFloor
    assert cache.store_floor(key(3 * GiB), StepFloor(3 * GiB))
    assert cache.store_floor(key(4 * GiB), StepFloor(4 * GiB, least_peak=5 * GiB))
    assert not cache.store_floor(key(2 * GiB), StepFloor(2 * GiB))       # rules out less
    assert cache.load_floor(key()).least_peak == 5 * GiB
    path = cache.floor_path(key())
    assert not cache.forget_floor_below(key(6 * GiB), 6 * GiB) and path.exists()   # not ruled out
    assert cache.forget_floor_below(key(5 * GiB), 5 * GiB) and not path.exists()
    assert cache.load_floor(key()) is None and not cache.say
    # a plan entry and its floor record are apart: the entry stays
    cache.store(key(), entry())
    cache.store_floor(key(), StepFloor(8 * GiB))
    assert cache.forget_floor_below(key(), 8 * GiB) and cache.load(key()) == entry()


@pytest.mark.parametrize("damage, said", [
    (lambda d: "{not json", "cannot be read as JSON"),
    (lambda d: json.dumps([1]), "not a floor record"),
    (lambda d: json.dumps({**d, "floor": False}), "not a floor record"),
    (lambda d: json.dumps({**d, "plan_cache_format": plancache.FORMAT + 1}), "plan_cache_format 2"),
    (lambda d: json.dumps({**d, "key": {**d["key"], "script": "/other.py"}}), "another run's key"),
    (lambda d: json.dumps({**d, "budget": "8GiB"}), "are not a floor's"),
    (lambda d: json.dumps({**d, "least_peak": -1}), "are not a floor's"),
    (lambda d: json.dumps({**d, "least_headroom": 1.5}), "are not a floor's"),
    (lambda d: json.dumps({**d, "least_peak": 10**400}), "least peak 1000000000000000000000000000000000000..."),
    (lambda d: json.dumps({**d, "budget": 10**400, "least_peak": None}), "are not a floor's"),
    (lambda d: "[" * 100000, "nested too deep"),
], ids=["json", "list", "no-floor", "format", "key", "budget", "peak", "headroom", "huge-peak",
        "huge-budget", "nested"])
def test_a_floor_record_that_is_none_is_one_line_and_replaced(cache, damage, said):
    from mucudnn.torch.plancache import StepFloor
    cache.store_floor(key(), StepFloor(2 * GiB))
    path = cache.floor_path(key())
    path.write_text(damage(json.loads(path.read_text())))
    assert cache.load_floor(key()) is None
    [line] = cache.say
    assert line.startswith(f"the offload floor record {path} is not used: ") and said in line, line
    assert cache.store_floor(key(), StepFloor(2 * GiB)) and len(cache.say) == 1   # replaced, quietly
    assert cache.load_floor(key()) == StepFloor(2 * GiB)


def test_a_floor_of_numpy_numbers_is_stored_as_plain_ones(cache):
    import numpy as np
    from mucudnn.torch.plancache import StepFloor
    floor = StepFloor(np.int64(2 * GiB), np.int64(3 * GiB), np.float32(0.025))
    assert cache.store_floor(key(), floor) and not cache.say
    assert cache.load_floor(key()) == StepFloor(2 * GiB, 3 * GiB, float(np.float32(0.025)))


def test_an_entry_nested_too_deep_is_one_line_and_a_miss(cache):
    cache.directory.mkdir()
    cache.path_for(key()).write_text("[" * 100000)
    assert cache.load(key()) is None
    [line] = cache.say
    assert line.endswith("is not used: it is not JSON (nested too deep); recording anew")


def test_a_key_takes_numpy_numbers_as_plain_ones():
    import numpy as np
    made = key(options={**OPTIONS, "headroom": np.float32(0.1), "lookahead": np.int64(2)})
    assert made == key(options={**OPTIONS, "headroom": float(np.float32(0.1)), "lookahead": 2})
    assert type(dict(made.options)["lookahead"]) is int


def test_a_floor_no_record_could_hold_is_not_written(cache):
    from mucudnn.torch.plancache import LARGEST_SIZE, StepFloor
    assert not cache.store_floor(key(), StepFloor(LARGEST_SIZE + 1))
    assert not cache.store_floor(key(), StepFloor(GiB, LARGEST_SIZE + 1))
    assert cache.load_floor(key()) is None and not cache.say
    assert cache.store_floor(key(), StepFloor(LARGEST_SIZE))


def test_no_cache_keeps_no_floor():
    from mucudnn.torch.plancache import StepFloor
    cache = PlanCache(None)
    assert cache.floor_path(key()) is None and not cache.store_floor(key(), StepFloor(GiB))
    assert cache.load_floor(key()) is None and not cache.forget_floor_below(key(), GiB)
