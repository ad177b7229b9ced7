"""mucudnn.torch.planner_fast: the fast planner against the ILP (pure Python, no torch).

The committed profiles' ILP optima are in tests/data/planner_ilp_reference.json
(benchmarks/planner_gap.py computes them, CBC for up to a minute a target); the synthetic ones
here are solved live (CBC proves them in seconds) or enumerated."""

from __future__ import annotations

import dataclasses
import functools
import json
import random
from pathlib import Path

import numpy as np
import pytest

from benchmarks.planner_gap import GAP, REFERENCE, fast_plans, key, repeated_profile
from mucudnn.errors import InfeasibleError
from mucudnn.torch import planner, planner_fast, profiles
from mucudnn.torch import planning
from mucudnn.torch.planner import KEEP, OFFLOAD, RECOMPUTE, brute_force, memory_at_points, peak_memory, valid
from mucudnn.torch.planning import least_peak, plan_offload
from test_planner import MiB, chain_profile

ROOT = Path(__file__).resolve().parents[2]


def reference_entries() -> dict[tuple[str, int | None], list[dict]]:
    entries = json.loads(REFERENCE.read_text())["entries"]
    by_profile: dict[tuple[str, int | None], list[dict]] = {}
    for entry in entries.values():
        by_profile.setdefault((entry["profile"], entry["row"]), []).append(entry)
    return by_profile


REFERENCE_ENTRIES = reference_entries()


def test_the_reference_covers_the_committed_profiles():
    from benchmarks.planner_gap import committed_profiles, load
    for name, row in committed_profiles(ROOT, shared=False):
        recorded = load(ROOT, name, row)
        if recorded is not None:
            assert (name, row) in REFERENCE_ENTRIES, (name, row)


#: the entries where the fast plan is known to be more than GAP above the ILP's (its ILP plan
#: not proven optimal: CBC reached its minute), with the gap measured (planning-time.md): held
#: as failures, so that a planner that closes them says so
KNOWN_GAPS: dict[str, str] = {}


@functools.lru_cache(maxsize=4)
def fast_plans_of(name: str, row: int | None):
    return fast_plans(profiles.load_profile(ROOT / name, row))


def entry_params():
    for (name, row), entries in sorted(REFERENCE_ENTRIES.items(), key=str):
        for entry in sorted(entries, key=lambda e: e["target"]):
            where = key(name, row, entry["target"])
            marks = [pytest.mark.xfail(strict=True, reason=f"known gap {KNOWN_GAPS[where]}")] \
                if where in KNOWN_GAPS else []
            yield pytest.param(name, row, entry, id=where.replace("benchmarks/results/", ""),
                               marks=marks)


@pytest.mark.parametrize("name,row,entry", list(entry_params()))
def test_the_fast_plan_is_within_two_percent_of_the_ilp_on_every_committed_profile(name, row,
                                                                                   entry):
    if not (ROOT / name).exists():
        pytest.skip(f"{name} is not beside this checkout")
    recorded = profiles.load_profile(ROOT / name, row)
    target = entry["target"]
    plan, where = fast_plans_of(name, row).get(target), key(name, row, target)
    if entry["ilp_step_ms"] is None:
        if entry["proven"]:   # CBC proved no plan fits: nor does the fast one find one
            assert plan is None, where
        return
    assert plan is not None, f"{where}: the ILP has a plan, the fast planner none"
    assert valid(recorded.profile, plan.modes) and plan.peak <= target, where
    assert plan.peak == peak_memory(dataclasses.replace(
        recorded.profile, release_margin=plan.release_margin), plan.modes, plan.lookahead,
        plan.prefetch_margin)
    assert plan.step_ms <= entry["ilp_step_ms"] * (1 + GAP), (
        f"{where}: fast {plan.step_ms:.3f} ms, ILP {entry['ilp_step_ms']:.3f} ms")


@pytest.mark.parametrize("seed", [0, 1, 2, 4, 5])   # 3: CBC takes 10 s to prove it
def test_the_fast_plan_is_within_two_percent_of_the_ilp_solved_live(seed):
    # medium synthetic steps (recipes of one and two sources, chains) over a link of a GPU's
    # speed (the link moves the step's saved bytes in about its forward), budgets between the
    # least peak and everything kept, at prefetch distance 2 and 0: CBC proves these in seconds
    rng = random.Random(300 + seed)
    sizes = [rng.randint(1, 64) * MiB for _ in range(rng.randint(20, 30))]
    profile = chain_profile(sizes, recompute_every=rng.choice([1, 2, 3]), seed=seed,
                            baseline=rng.randint(0, 64) * MiB, sources=rng.choice([1, 2]))
    link = sum(sizes) / 1e9 / (profile.forward_ms / 1e3) * rng.uniform(0.5, 2)
    profile = dataclasses.replace(profile, d2h_gbps=link, h2d_gbps=link * rng.uniform(0.9, 1.1),
                                  copy_exposure=rng.choice([0.0, 0.6]))
    full = peak_memory(profile, [KEEP] * len(sizes), 2)
    for lookahead in (2, 0):
        least = least_peak(profile, lookahead, method="ilp")
        for share in (0.2, 0.6):
            budget = int(least + (full - least) * share)
            ilp = plan_offload(profile, budget, lookahead, 60, method="ilp")
            fast = plan_offload(profile, budget, lookahead)
            assert fast.peak <= budget and valid(profile, fast.modes)
            assert fast.step_ms <= ilp.step_ms * (1 + GAP), (lookahead, share)


@pytest.mark.parametrize("seed", range(30))
def test_the_fast_plan_is_the_optimum_on_tiny_profiles(seed):
    # against enumeration: every mode of every group
    rng = random.Random(500 + seed)
    sizes = [rng.randint(1, 16) * MiB for _ in range(rng.randint(3, 7))]
    profile = chain_profile(sizes, recompute_every=rng.choice([1, 2]), seed=seed,
                            baseline=rng.randint(0, 8) * MiB, sources=rng.choice([1, 2]))
    budget = int(peak_memory(profile, [KEEP] * len(sizes), 2) * rng.uniform(0.4, 0.9))
    best = brute_force(profile, budget)
    if best is None:
        with pytest.raises(InfeasibleError):
            plan_offload(profile, budget)
        return
    plan = plan_offload(profile, budget)
    assert plan.peak <= budget and valid(profile, plan.modes)
    assert plan.step_ms <= best.step_ms * (1 + GAP)


@pytest.mark.parametrize("seed", [0, 1, 3])   # 2: CBC takes 10 s to prove it
def test_the_fast_least_peak_is_reached_and_near_the_ilps(seed):
    # the fast least peak is a plan's peak (so no lower than the ILP's) and near it
    rng = random.Random(700 + seed)
    sizes = [rng.randint(1, 32) * MiB for _ in range(rng.randint(10, 24))]
    profile = chain_profile(sizes, recompute_every=rng.choice([1, 2]), seed=seed,
                            baseline=rng.randint(0, 32) * MiB, sources=rng.choice([1, 2]))
    for lookahead in (2, 0):
        modes = planning._least_peak_modes(profile, lookahead)
        fast = peak_memory(profile, modes, lookahead)
        ilp = least_peak(profile, lookahead, method="ilp")
        assert valid(profile, modes) and ilp <= fast <= ilp * (1 + GAP)


@pytest.mark.parametrize("seed", range(5))
def test_the_incremental_memory_is_the_models_after_every_change(seed):
    # planner_fast.State changed group by group (chains included) holds memory_at_points's
    # bytes at every point, its cost step_time's
    rng = random.Random(900 + seed)
    sizes = [rng.randint(1, 16) * MiB for _ in range(16)]
    profile = chain_profile(sizes, recompute_every=1, seed=seed, baseline=MiB, sources=2)
    groups = [dataclasses.replace(g, rebuild_bytes=g.nbytes * 2 if i % 3 == 0 else None)
              for i, g in enumerate(profile.groups)]
    profile = dataclasses.replace(profile, groups=groups,
                                  floor_backward=[0] * profile.unpacks)
    layout = planner_fast.Layout(profile, 2)
    state = planner_fast.State(layout, [KEEP] * len(sizes))
    taken = 0
    for _ in range(200):
        index = rng.randrange(len(sizes))
        changes = {index: rng.choice(planner.allowed_modes(profile.groups[index]))}
        if not state.valid_change(changes):
            continue
        evaluated = state.change(changes)
        if evaluated is None:   # a chain past planner.MAX_CHAIN
            continue
        state.apply(changes, evaluated)
        taken += 1
        forward, backward = memory_at_points(profile, state.modes, 2)
        assert list(state.memory) == forward + backward
        assert state.rebuilt == planner.rebuild_points(profile, state.modes)
        assert valid(profile, state.modes)
        assert state.cost() == pytest.approx(planner.step_time(profile, state.modes, 2)
                                             + state.traffic * planner_fast.TIE_MS_PER_BYTE)
    assert taken > 50 and RECOMPUTE in state.modes


def test_a_repeated_profile_plans_within_its_budget_with_every_mode():
    # benchmarks/planner_gap.py's larger steps (the planning-time table's ~500 groups) are
    # profiles too: a plan meets their target
    recorded = profiles.load_profile(
        ROOT / "benchmarks/results/offload/h200/offload-min-unet3d-ceabd0c-h200.json", 2)
    profile = repeated_profile(recorded.profile, 3)
    assert len(profile.groups) == 3 * len(recorded.profile.groups)
    target = peak_memory(profile, [KEEP] * len(profile.groups), 2) * 6 // 10
    plan = planning.plan_with_prefetch(profile, target)
    assert plan.peak <= target and valid(profile, plan.modes)
    assert plan.count(OFFLOAD) and plan.count(RECOMPUTE)


@pytest.mark.parametrize("seed", range(3))
def test_the_excess_a_change_frees_and_the_vectorised_costs_are_the_direct_ones(seed):
    # State.excess_change (net pieces, a running sum) against the excess of the memory with the
    # change applied, at targets around the memory; Layout.costs against Layout.cost, float for
    # float (Freeing orders its rows by them)
    rng = random.Random(1100 + seed)
    sizes = [rng.randint(1, 16) * MiB for _ in range(14)]
    profile = chain_profile(sizes, recompute_every=1, seed=seed, baseline=MiB, sources=2)
    layout = planner_fast.Layout(profile, 2)
    state = planner_fast.State(layout, [KEEP] * len(sizes))

    def excess(memory, target):
        return int(sum(max(int(m) - target, 0) for m in memory))
    checked = 0
    for _ in range(300):
        index = rng.randrange(len(sizes))
        changes = {index: rng.choice(planner.allowed_modes(profile.groups[index]))}
        if changes[index] == state.modes[index] or not state.valid_change(changes):
            continue
        evaluated = state.change(changes)
        if evaluated is None:
            continue
        after = state.memory.copy()
        for n, lo, hi in evaluated[0]:
            after[lo:hi] += n
        target = int(state.memory.max() * rng.uniform(0.5, 1.0))
        assert state.excess(target) == excess(state.memory, target)
        assert state.excess_change(evaluated[0], target) == \
            excess(after, target) - excess(state.memory, target)
        checked += 1
        if rng.random() < 0.5:
            state.apply(changes, evaluated)
    assert checked > 50
    moved = np.array([0, 3 * MiB, 10**10], dtype=np.int64)
    recompute_ms = np.array([0.0, 1.25, 7.5])
    traffic = np.array([0, 5 * MiB, 2 * 10**10], dtype=np.int64)
    assert list(layout.costs(moved, recompute_ms, traffic)) == [
        layout.cost(int(m), float(r), int(t)) for m, r, t in zip(moved, recompute_ms, traffic)]
