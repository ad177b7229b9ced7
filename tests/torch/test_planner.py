"""mucudnn.torch.planner: pure Python (no torch needed)."""

import dataclasses
import random
import re

import pytest

from mucudnn.errors import InfeasibleError
from mucudnn.torch import planner
from mucudnn.torch import planner_stage
from mucudnn.torch import planning
from mucudnn.torch import planner_ilp
from mucudnn.sizes import describe_size
from mucudnn.torch.planner import KEEP, OFFLOAD, RECOMPUTE, SavedGroup, StepProfile, brute_force, memory_at_points, peak_memory, step_time, valid
from mucudnn.torch.planning import least_peak, plan_offload, plan_with_prefetch

MiB = 2**20


def chain_profile(sizes, recompute_every=0, seed=0, baseline=0, sources=1):
    """A CNN-like step: group g saved at forward point g, unpacked in reverse order (one unpack
    each), forward time proportional to bytes; every ``recompute_every``-th group has a recipe
    reading the group before it (and, with ``sources`` 2, the one before that where there is
    one: a residual add)."""
    rng = random.Random(seed)
    n = len(sizes)
    groups = []
    for g, size in enumerate(sizes):
        recipe = recompute_every and g % recompute_every == recompute_every - 1 and g > 0
        groups.append(SavedGroup(size, first_unpack=n - 1 - g, last_unpack=n - 1 - g,
                                 producer=f"m{g}",
                                 recompute_ms=rng.uniform(0.05, 0.5) if recipe else None,
                                 recompute_source=tuple(range(max(0, g - sources), g))
                                 if recipe else None))
    return StepProfile(groups, forward_ms=sum(sizes) / MiB * 0.05, backward_ms=sum(sizes) / MiB * 0.1,
                       d2h_gbps=0.02, h2d_gbps=0.025, unpacks=n,
                       baseline_forward=[baseline] * n, baseline_backward=[baseline] * n)


def test_everything_kept_when_it_fits():
    profile = chain_profile([4 * MiB] * 5)
    plan = plan_offload(profile, budget=10**12)
    assert plan.modes == (KEEP,) * 5 and plan.moved_bytes == 0


@pytest.mark.parametrize("sources,every,seed", [(1, 2, seed) for seed in range(6)]
                         + [(2, 2, 50 + seed) for seed in range(4)]
                         + [(1, 1, 70 + seed) for seed in range(4)]
                         + [(2, 1, 90 + seed) for seed in range(3)])
def test_optimal_on_small_profiles(sources, every, seed):
    # recipes of one source, then of two; with ``every`` 1 each group but the first has a recipe,
    # so recomputed groups read recomputed ones (chains): the ILP against enumeration
    rng = random.Random(seed)
    sizes = [rng.randint(1, 16) * MiB for _ in range(rng.randint(3 + (sources > 1), 6))]
    profile = chain_profile(sizes, recompute_every=every, seed=seed,
                            baseline=rng.randint(0, 8) * MiB, sources=sources)
    if sources > 1:
        assert any(len(g.recompute_source or ()) == 2 for g in profile.groups)
    budget = int(peak_memory(profile, [KEEP] * len(sizes), 2) * rng.uniform(0.4, 0.9))
    best = brute_force(profile, budget)
    if best is None:
        with pytest.raises(InfeasibleError):
            plan_offload(profile, budget)
        return
    plan = plan_offload(profile, budget)
    assert plan.peak <= budget and valid(profile, plan.modes)
    assert plan.step_ms == pytest.approx(best.step_ms, rel=1e-6, abs=1e-9)


@pytest.mark.parametrize("seed", range(4))
def test_peak_within_budget_on_larger_profiles(seed):
    rng = random.Random(100 + seed)
    sizes = [rng.randint(1, 64) * MiB for _ in range(60)]
    profile = chain_profile(sizes, recompute_every=3, seed=seed, baseline=32 * MiB)
    full = peak_memory(profile, [KEEP] * len(sizes), 2)
    least = least_peak(profile)
    budget = least + (full - least) // 3
    plan = plan_offload(profile, budget)
    assert least < full and plan.peak <= budget
    assert step_time(profile, plan.modes) == pytest.approx(plan.step_ms)
    assert plan.count(OFFLOAD) + plan.count(RECOMPUTE) > 0


def test_recompute_preferred_when_the_link_is_slow():
    # four 8 MiB groups, unpacked in reverse; the second recomputable from the first in 0.01 ms:
    # over a link this slow recomputing it is far faster than moving anything
    groups = [SavedGroup(8 * MiB, 3, 3), SavedGroup(8 * MiB, 2, 2, recompute_ms=0.01,
                                                    recompute_source=0),
              SavedGroup(8 * MiB, 1, 1), SavedGroup(8 * MiB, 0, 0)]
    profile = StepProfile(groups, 1.0, 2.0, d2h_gbps=0.001, h2d_gbps=0.001, unpacks=4)
    plan = plan_offload(profile, budget=24 * MiB)
    assert plan.modes == (KEEP, RECOMPUTE, KEEP, KEEP) and plan.peak == 24 * MiB


def test_recompute_needs_its_source_kept_or_recomputed():
    groups = [SavedGroup(8 * MiB, 1, 1), SavedGroup(8 * MiB, 0, 0, recompute_ms=0.01,
                                                    recompute_source=0)]
    profile = StepProfile(groups, 1.0, 2.0, 10.0, 10.0, unpacks=2)
    assert not valid(profile, [OFFLOAD, RECOMPUTE])
    assert valid(profile, [KEEP, RECOMPUTE])


def test_a_recipe_reading_two_groups_needs_both_kept():
    # a residual block's output (group 2), rebuilt from its last convolution's output and its
    # shortcut (groups 0 and 1), both unpacked after it; groups 3 and 4 come later
    groups = [SavedGroup(8 * MiB, 4, 4), SavedGroup(8 * MiB, 4, 4),
              SavedGroup(8 * MiB, 3, 3, recompute_ms=0.01, recompute_source=(0, 1)),
              SavedGroup(8 * MiB, 0, 0), SavedGroup(8 * MiB, 1, 2)]
    profile = StepProfile(groups, 1.0, 2.0, d2h_gbps=0.001, h2d_gbps=0.001, unpacks=5)
    recomputed = [KEEP, KEEP, RECOMPUTE, KEEP, KEEP]
    assert valid(profile, recomputed)
    assert not valid(profile, [KEEP, OFFLOAD, RECOMPUTE, KEEP, KEEP])
    assert not valid(profile, [OFFLOAD, KEEP, RECOMPUTE, KEEP, KEEP])
    assert peak_memory(profile, [KEEP] * 5, 2) == 40 * MiB
    assert peak_memory(profile, recomputed, 2) == 32 * MiB
    # over this link recomputing is far faster than moving any group
    plan = plan_offload(profile, budget=32 * MiB)
    assert plan.modes == tuple(recomputed)
    assert plan == brute_force(profile, 32 * MiB)
    # tighter: recomputing with the shortcut offloaded would be cheapest, and is no plan
    tighter = plan_offload(profile, budget=24 * MiB, lookahead=0)
    assert valid(profile, tighter.modes) and tighter == brute_force(profile, 24 * MiB, 0)


def test_a_recipe_holds_each_source_until_its_last_unpack():
    # group 2 reads groups 0 and 1 and is unpacked last: both stay on the device until then;
    # its rebuild allocates an intermediate of its size too
    groups = [SavedGroup(4 * MiB, 0, 0), SavedGroup(2 * MiB, 1, 1),
              SavedGroup(1 * MiB, 0, 3, recompute_ms=0.01, recompute_source=[0, 1],
                         rebuild_bytes=2 * MiB)]
    profile = StepProfile(groups, 1.0, 2.0, 10.0, 10.0, unpacks=4)
    assert groups[2].recompute_source == (0, 1)
    _, backward = memory_at_points(profile, [KEEP, KEEP, RECOMPUTE], 0)
    assert backward == [4 * MiB + 2 * MiB + 2 * MiB, 4 * MiB + 2 * MiB + 1 * MiB,
                        4 * MiB + 2 * MiB + 1 * MiB, 4 * MiB + 2 * MiB + 1 * MiB]


def test_a_chain_is_rebuilt_at_its_first_readers_unpack_as_a_checkpoint_reruns_a_segment():
    # groups 1..3 each rebuilt from the one before (a block: conv, batch norm, ReLU), group 0
    # its kept input; unpacked in reverse, so rebuilding group 3 at point 0 rebuilds 2 and 1;
    # each rebuild allocates a workspace of its group's size beside it
    groups = [SavedGroup(8 * MiB, 3, 3)] + [
        SavedGroup(4 * MiB, 3 - g, 3 - g, recompute_ms=1.0, recompute_source=g - 1,
                   rebuild_bytes=8 * MiB) for g in range(1, 4)]
    profile = StepProfile(groups, 4.0, 8.0, d2h_gbps=0.001, h2d_gbps=0.001, unpacks=4)
    chain = [KEEP, RECOMPUTE, RECOMPUTE, RECOMPUTE]
    assert valid(profile, chain) and not valid(profile, [OFFLOAD, RECOMPUTE, KEEP, KEEP])
    assert planner.rebuild_points(profile, chain) == [None, 0, 0, 0]
    assert planner.rebuild_points(profile, [KEEP, RECOMPUTE, KEEP, RECOMPUTE]) == [None, 2, None, 0]
    _, backward = memory_at_points(profile, chain, 0)
    # point 0: the input, the three rebuilt groups and group 3's transient; then each goes
    assert backward == [8 * MiB + 16 * MiB, 8 * MiB + 8 * MiB, 8 * MiB + 4 * MiB, 8 * MiB]
    # every recipe once: the chain costs what its three recipes cost, not 1 + 2 + 3 of them
    assert step_time(profile, chain) == pytest.approx(4.0 + 8.0 + 3.0)

    # two such blocks: only a rebuilt chain lowers the backward's first point enough
    blocks = [SavedGroup(8 * MiB, 7, 7)] + [
        SavedGroup(4 * MiB, 7 - g, 7 - g, recompute_ms=1.0, recompute_source=g - 1,
                   rebuild_bytes=8 * MiB) for g in range(1, 4)] + [SavedGroup(8 * MiB, 3, 3)] + [
        SavedGroup(4 * MiB, 7 - g, 7 - g, recompute_ms=1.0, recompute_source=g - 1,
                   rebuild_bytes=8 * MiB) for g in range(5, 8)]
    profile = StepProfile(blocks, 4.0, 8.0, d2h_gbps=0.001, h2d_gbps=0.001, unpacks=8)
    assert peak_memory(profile, [KEEP] * 8, 2) == 40 * MiB
    plan = plan_offload(profile, budget=24 * MiB)
    assert plan == brute_force(profile, 24 * MiB) and plan.peak <= 24 * MiB
    assert planner.rebuild_points(profile, plan.modes)[1:4] == [4, 4, 4]   # group 3's unpack
    assert brute_force(profile, 22 * MiB) is None


def test_a_chain_longer_than_the_planners_limit_is_not_planned():
    n = planner.MAX_CHAIN + 3
    groups = [SavedGroup(MiB, n - 1, n - 1)] + [
        SavedGroup(MiB, n - 1 - g, n - 1 - g, recompute_ms=0.01, recompute_source=g - 1)
        for g in range(1, n)]
    profile = StepProfile(groups, 1.0, 1.0, d2h_gbps=1e-6, h2d_gbps=1e-6, unpacks=n)
    assert max(len(c) for c in planner.rebuild_candidates(profile)) == planner.MAX_CHAIN + 1
    plan = plan_offload(profile, budget=peak_memory(profile, [KEEP] * n, 2) - 1)
    rebuilt = planner.rebuild_points(profile, plan.modes)
    assert any(mode == KEEP for mode in plan.modes[1:]) and valid(profile, plan.modes)
    # no group rebuilt more than MAX_CHAIN recipes before its own first unpack
    assert all(point is None or groups[g].first_unpack - point <= planner.MAX_CHAIN
               for g, point in enumerate(rebuilt))


def test_a_recompute_source_outside_the_step_is_refused():
    with pytest.raises(ValueError, match="recompute sources"):
        StepProfile([SavedGroup(1, 0, 0), SavedGroup(1, 0, 0, recompute_ms=0.1,
                                                     recompute_source=(0, 2))],
                    1.0, 1.0, 1.0, 1.0, unpacks=1)


def test_infeasible_budget_is_one_clear_error():
    profile = chain_profile([8 * MiB] * 4, baseline=100 * MiB)
    with pytest.raises(InfeasibleError, match=r"too small for this step.*at least") as info:
        plan_offload(profile, budget=50 * MiB)
    assert "\n" not in str(info.value)


def test_bad_profile_is_refused():
    with pytest.raises(ValueError, match="outside"):
        StepProfile([SavedGroup(1, 3, 3)], 1.0, 1.0, 1.0, 1.0, unpacks=2)


def test_importing_mucudnn_and_the_planner_needs_no_torch():
    import subprocess
    import sys
    code = ("import sys, mucudnn, mucudnn.torch, mucudnn.torch.planner, mucudnn.batchsize;"
            "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_recompute_counts_its_transient_and_holds_its_source_until_its_last_unpack():
    # group 1 is recomputed from group 0, and unpacked after group 0's last unpack: group 0 stays
    # on the device through point 2; at its first unpack the recipe's intermediate doubles it
    groups = [SavedGroup(8 * MiB, 0, 0), SavedGroup(4 * MiB, 1, 2, recompute_ms=0.01,
                                                    recompute_source=0, rebuild_bytes=8 * MiB)]
    profile = StepProfile(groups, 1.0, 2.0, 10.0, 10.0, unpacks=3)
    kept = peak_memory(profile, [KEEP, KEEP], 2)
    assert kept == 12 * MiB
    assert peak_memory(profile, [KEEP, RECOMPUTE], 2) == 8 * MiB + 2 * 4 * MiB
    plan = plan_offload(profile, budget=12 * MiB)
    assert plan.modes != (KEEP, RECOMPUTE) and plan.peak <= 12 * MiB


def test_a_rebuild_that_allocates_only_its_group_adds_nothing_beside_it():
    # an in-place recipe (a copy of its kept source, changed in place: the copy is the group)
    # or a convolution with no workspace: the group, live from its rebuild, is all it needs.
    # The forward's last op peaks (4 MiB): keeping group 1 through it is what costs
    groups = [SavedGroup(8 * MiB, 2, 2), SavedGroup(4 * MiB, 0, 0, recompute_ms=0.01,
                                                    recompute_source=0),
              SavedGroup(MiB, 1, 1), SavedGroup(MiB, 1, 1)]
    profile = StepProfile(groups, 1.0, 2.0, d2h_gbps=0.001, h2d_gbps=0.001, unpacks=3,
                          baseline_forward=[0, 0, 0, 4 * MiB])
    assert groups[1].transient == 0
    recomputed = [KEEP, RECOMPUTE, KEEP, KEEP]
    assert peak_memory(profile, [KEEP] * 4, 2) == 18 * MiB
    forward, backward = memory_at_points(profile, recomputed, 2)
    assert (forward, backward) == ([8 * MiB, 12 * MiB, 13 * MiB, 14 * MiB],
                                   [14 * MiB, 10 * MiB, 8 * MiB])
    assert plan_offload(profile, budget=14 * MiB).modes == tuple(recomputed)


def test_a_rebuild_s_transient_sits_on_the_floor_at_its_unpack_not_on_the_node_s_peak():
    # backward point 1's node allocates 10 MiB once it runs (its baseline), after the unpack
    # that rebuilt group 1 with 8 MiB of workspace, freed before the node runs: the rebuild
    # peaks on the floor there (1 MiB), the node on its baseline, never both at once. The
    # forward's last op (14 MiB) is where keeping group 1 costs
    groups = [SavedGroup(8 * MiB, 0, 2), SavedGroup(4 * MiB, 1, 2, recompute_ms=0.01,
                                                    recompute_source=0, rebuild_bytes=12 * MiB),
              SavedGroup(MiB, 0, 0), SavedGroup(MiB, 0, 0)]
    recomputed = [KEEP, RECOMPUTE, KEEP, KEEP]
    bound = StepProfile(groups, 1.0, 2.0, d2h_gbps=0.001, h2d_gbps=0.001, unpacks=3,
                        baseline_forward=[0, 0, 0, 14 * MiB],
                        baseline_backward=[MiB, 10 * MiB, MiB])
    floored = dataclasses.replace(bound, floor_backward=[MiB, MiB, MiB])
    assert bound.floor(1) == 10 * MiB and floored.floor(1) == MiB
    assert peak_memory(bound, [KEEP] * 4, 2) == 28 * MiB    # the forward's last op
    # live at point 1: groups 0 and 1 (12 MiB)
    assert memory_at_points(bound, recomputed, 2)[1][1] == 10 * MiB + 8 * MiB + 12 * MiB
    assert memory_at_points(floored, recomputed, 2)[1][1] == 10 * MiB + 12 * MiB
    assert peak_memory(floored, recomputed, 2) == 24 * MiB  # the forward's last op again
    budget = 24 * MiB
    assert plan_offload(floored, budget).modes == tuple(recomputed)
    assert plan_offload(floored, budget) == brute_force(floored, budget)
    assert RECOMPUTE not in plan_offload(bound, budget).modes
    # a floor with the rebuild above the node's peak: the rebuild's is the point's peak
    high = dataclasses.replace(bound, floor_backward=[MiB, 12 * MiB, MiB])
    assert memory_at_points(high, recomputed, 2)[1][1] == 12 * MiB + 8 * MiB + 12 * MiB
    assert planner.peak_point(high, recomputed, 2)[:3] == ("backward", 1, 12 * MiB)
    with pytest.raises(ValueError, match="2 floors for 3 unpacks"):
        dataclasses.replace(bound, floor_backward=[MiB, MiB])


def test_never_over_budget_by_the_solvers_tolerance():
    # keeping everything is 100 bytes over a 12 GiB budget: within CBC's feasibility tolerance,
    # so the solver may call it feasible; the plan must still be within the budget
    GiB = 2**30
    profile = chain_profile([3 * GiB, 3 * GiB, 3 * GiB, 3 * GiB], baseline=0)
    full = peak_memory(profile, [KEEP] * 4, 0)
    plan = plan_offload(profile, budget=full - 100, lookahead=0)
    assert plan.peak <= full - 100 and plan.modes != (KEEP,) * 4


def test_prefetch_distance_shrinks_when_prefetching_does_not_fit():
    # a prefetch puts a group on the device two unpacks early: here only fetching each group when
    # first unpacked fits, and the plan says so (its time counts the fetches as not overlapped)
    profile = chain_profile([8 * MiB] * 6, baseline=0)
    budget = least_peak(profile, lookahead=0)
    assert least_peak(profile, lookahead=2) > budget
    with pytest.raises(InfeasibleError):
        plan_offload(profile, budget, lookahead=2)
    plan = plan_with_prefetch(profile, budget, lookahead=2)
    assert plan.lookahead < 2 and plan.peak <= budget
    assert plan.step_ms == pytest.approx(step_time(profile, plan.modes, plan.lookahead))
    if plan.lookahead == 0:
        assert plan.step_ms > step_time(profile, plan.modes, 2)
    assert "prefetch" in plan.describe()


def test_a_prefetch_starts_early_enough_for_its_copy():
    # backward points 1 ms apart; a 3 MB group over a 1 GB/s link needs 3 ms, with the margin
    # 4.5 ms: issued 5 points before its first unpack, not 2; a small one 2 points before
    big, small = 3_000_000, 1_000
    groups = [SavedGroup(small, 8, 8), SavedGroup(big, 9, 9)]
    profile = StepProfile(groups, forward_ms=5.0, backward_ms=10.0, d2h_gbps=1.0, h2d_gbps=1.0,
                          unpacks=10, backward_clock=[float(t) for t in range(10)])
    assert planner.PREFETCH_MARGIN == 1.5
    assert planner.prefetch_point(profile, 1, lookahead=2) == 4
    assert planner.prefetch_point(profile, 0, lookahead=2) == 6
    assert planner.prefetch_point(profile, 1, lookahead=0) == 9        # on demand
    assert planner.live_points(profile, 1, OFFLOAD, 2)[1] == range(4, 10)
    # a backward too short for the copy: as early as the backward's start
    slow = StepProfile(groups, 5.0, 10.0, 1.0, 0.1, 10, backward_clock=[float(t) for t in range(10)])
    assert planner.prefetch_point(slow, 1, lookahead=2) == 0
    # no recorded clock: the backward spread evenly over its points
    even = StepProfile(groups, 5.0, 10.0, 1.0, 1.0, 10)
    assert even.backward_clock == [float(t) for t in range(10)]


@pytest.mark.parametrize("clock", [[0.0, 2.0, 1.0], [0.0, 1.0]])
def test_a_backward_clock_must_name_every_point_in_order(clock):
    with pytest.raises(ValueError, match="backward clock"):
        StepProfile([SavedGroup(10, 0, 2)], 1.0, 1.0, 1.0, 1.0, 3, backward_clock=clock)


@pytest.mark.parametrize("clock", [[0.0, 2.0, 1.0], [0.0, 1.0]])
def test_a_forward_clock_must_name_every_point_in_order(clock):
    with pytest.raises(ValueError, match="forward clock"):
        StepProfile([SavedGroup(10, 0, 0)] * 3, 1.0, 1.0, 1.0, 1.0, 1, forward_clock=clock)


def test_an_offloaded_group_leaves_the_device_once_its_copy_is_due():
    # forward points 1 ms apart; 3 MB over 1 GB/s is 3 ms, 4.5 with the margin: due at point 5
    # (the group is on the device through it); a copy longer than the rest of the forward keeps
    # it to the end (the first unpack); margin 0 and an untimed profile: the next point
    groups = [SavedGroup(3_000_000, 9, 9), SavedGroup(1_000, 8, 8)] + [SavedGroup(1_000, 7, 7)] * 6
    profile = StepProfile(groups, 8.0, 10.0, 1.0, 1.0, 10,
                          forward_clock=[float(t) for t in range(8)])
    assert planner.release_point(profile, 0) == 5
    assert planner.live_points(profile, 0, OFFLOAD, 2)[0] == range(0, 6)
    assert planner.release_point(profile, 0, release_margin=0) == 1
    assert planner.live_points(profile, 0, OFFLOAD, 2, release_margin=0)[0] == range(0, 2)
    assert planner.release_point(profile, 1) == 2            # 1.5 µs: the next point
    late = StepProfile([SavedGroup(3_000_000, 9, 9)] * 4, 4.0, 10.0, 1.0, 1.0, 10,
                       forward_clock=[0.0, 1.0, 2.0, 3.0])
    assert planner.release_point(late, 1) == 4
    assert planner.live_points(late, 1, OFFLOAD, 2)[0] == range(1, 4)   # to the forward's end
    untimed = StepProfile(groups, 8.0, 10.0, 1.0, 1.0, 10)
    assert untimed.forward_clock == [] and planner.release_point(untimed, 0) == 1
    # a group held longer weighs on the points until its release
    keep_rest = [OFFLOAD] + [KEEP] * 7
    assert planner.memory_at_points(profile, keep_rest, 2)[0][:6] == [
        3_000_000 + 1_000 * t for t in range(6)]
    assert planner.memory_at_points(untimed, keep_rest, 2)[0][:3] == [3_000_000, 3_001_000, 2_000]


def test_where_no_plan_fits_with_offloads_released_when_due_they_go_at_the_next_point():
    # three 3 MB groups 1 ms apart over 1 GB/s: a copy is due 4.5 ms on, past the forward's end,
    # so offloading lowers no forward point; released at the next point (the compute stream
    # waiting for the copy there) two offloads bring the forward's peak to 6 MB
    groups = [SavedGroup(3_000_000, 2, 2), SavedGroup(3_000_000, 1, 1), SavedGroup(3_000_000, 0, 0)]
    profile = StepProfile(groups, 3.0, 3.0, 1.0, 1.0, 3, forward_clock=[0.0, 1.0, 2.0])
    for distance in (2, 1, 0):
        with pytest.raises(InfeasibleError):
            plan_offload(profile, 7_000_000, lookahead=distance)
    plan = plan_with_prefetch(profile, 7_000_000)
    assert plan.peak <= 7_000_000 and plan.release_margin == 0
    assert [r for r in plan.releases if r >= 0] and all(
        r == index + 1 for index, r in enumerate(plan.releases) if r >= 0)
    assert "each offload released at the next point" in plan.describe()
    timed = plan_with_prefetch(profile, 9_000_000)        # fits as is: released when due
    assert timed.release_margin == planner.RELEASE_MARGIN


def test_infeasible_with_prefetch_says_the_least_peak_of_any_prefetch_distance():
    # prefetching two unpacks ahead puts more on the device than fetching on demand: when no
    # distance fits, the least peak quoted is the on-demand one (VGG-16 at 12 GiB quoted 14.7 GiB,
    # the peak with a two-unpack prefetch, where fetching on demand reached about 12 GiB)
    profile = chain_profile([8 * MiB] * 6, baseline=0)
    on_demand, prefetched = least_peak(profile, lookahead=0), least_peak(profile, lookahead=2)
    assert prefetched > on_demand
    with pytest.raises(InfeasibleError) as info:
        plan_with_prefetch(profile, on_demand - MiB, lookahead=2)
    assert f"reaches a peak of {describe_size(on_demand)} at least," in str(info.value)
    assert "prefetching" not in str(info.value)
    with pytest.raises(InfeasibleError, match=r"at least \(prefetching 2 unpacks ahead\)"):
        plan_offload(profile, on_demand - MiB, lookahead=2)


def test_infeasible_names_the_point_of_the_least_peak_and_its_baseline():
    # the largest baseline (40 MiB, forward point 0) is not where the least peak is: backward
    # point 1, a 30 MiB baseline beside a 16 MiB group that cannot be moved
    groups = [SavedGroup(4 * MiB, 0, 0, producer="conv"),
              SavedGroup(16 * MiB, 1, 1, producer="view", offloadable=False)]
    profile = StepProfile(groups, 1.0, 2.0, 10.0, 10.0, unpacks=2,
                          baseline_forward=[40 * MiB, 0], baseline_backward=[0, 30 * MiB])
    assert least_peak(profile) == 46 * MiB
    with pytest.raises(InfeasibleError) as info:
        plan_offload(profile, 45 * MiB)
    message = str(info.value)
    assert f"{describe_size(46 * MiB)} at least" in message
    assert f"at backward point 1: {describe_size(30 * MiB)} not saved tensors" in message
    assert f"{describe_size(16 * MiB)} saved (group 1 (view, keep" in message
    assert describe_size(40 * MiB) not in message


def test_a_budget_a_byte_below_the_least_peak_is_infeasible_not_a_solver_failure():
    # CBC's tolerance accepts a plan one byte over; the limit lowered below the budget is then
    # infeasible, which is the budget's infeasibility, not CBC's failure
    profile = chain_profile([8 * MiB] * 6, baseline=0)
    least = least_peak(profile, lookahead=0)
    quoted = re.escape(f"reaches a peak of {describe_size(least)}")
    with pytest.raises(InfeasibleError, match=quoted):
        plan_offload(profile, least - 1, lookahead=0)


def test_a_chained_program_with_no_plan_in_time_falls_back_to_rebuilds_at_first_unpacks(
        monkeypatch):
    # CBC can reach its time limit on the program with chains without any plan: the program
    # without them (every group rebuilt at its first unpack) then gives the plan
    profile = chain_profile([8 * MiB] * 6, recompute_every=1, seed=3)
    assert any(len(points) > 1 for points in planner.rebuild_candidates(profile))
    solve, calls = planner_ilp._solve, []

    def first_finds_nothing(problem, time_limit_s):
        calls.append(problem)
        return "Not Solved / No Solution Found" if len(calls) == 1 else solve(problem, time_limit_s)

    monkeypatch.setattr(planner_ilp, "_solve", first_finds_nothing)
    budget = int(peak_memory(profile, [KEEP] * 6, 2) * 0.7)
    plan = plan_offload(profile, budget, method="ilp")
    assert len(calls) == 2 and plan.peak <= budget and valid(profile, plan.modes)
    assert all(point is None or point == profile.groups[g].first_unpack
               for g, point in enumerate(planner.rebuild_points(profile, plan.modes)))


def test_copy_exposure_charges_copies_beyond_the_bound_and_shifts_plans_to_recompute():
    import dataclasses
    rng = random.Random(7)
    sizes = [rng.randint(1, 16) * MiB for _ in range(6)]
    free = chain_profile(sizes, recompute_every=2, seed=7, baseline=2 * MiB)
    exposed = dataclasses.replace(free, copy_exposure=0.6)
    modes = [OFFLOAD, RECOMPUTE, OFFLOAD, KEEP, KEEP, KEEP]
    both_ways = (planner.transfer_ms(sizes[0] + sizes[2], free.d2h_gbps)
                 + planner.transfer_ms(sizes[0] + sizes[2], free.h2d_gbps))
    assert step_time(exposed, modes) == pytest.approx(step_time(free, modes) + 0.6 * both_ways)
    full, least = peak_memory(free, [KEEP] * 6, 2), least_peak(free)
    budget = (full + least) // 2
    cheap, dear = plan_offload(free, budget), plan_offload(exposed, budget)
    assert dear.step_ms == pytest.approx(brute_force(exposed, budget).step_ms)
    assert dear.moved_bytes <= cheap.moved_bytes


@pytest.mark.parametrize("seed", range(3))
def test_the_programs_rebuild_points_are_the_runtimes(seed):
    # the program rebuilds each recomputed group where the runtime does, given the plan's modes
    # (rebuild_points): a source rebuilt earlier in the program than in the runtime missed the
    # runtime's transient there, and a plan went over its budget (VGG-16 at 16 GiB)
    rng = random.Random(200 + seed)
    sizes = [rng.randint(1, 16) * MiB for _ in range(8)]
    profile = chain_profile(sizes, recompute_every=1, seed=seed, baseline=MiB, sources=2)
    budget = (peak_memory(profile, [KEEP] * 8, 2) + least_peak(profile)) // 2
    problem, picks, _ = planner_ilp._program(profile, 2, budget)
    assert planner_ilp._solve(problem, 60) == "Optimal"
    modes = planner_ilp._picked(picks)
    rebuilt = planner.rebuild_points(profile, modes)
    chosen = {int(v.name.split("_")[1]): int(v.name.split("_")[2]) for v in problem.variables()
              if v.name.startswith("r_") and (v.varValue or 0) > 0.5}
    assert chosen == {g: point for g, point in enumerate(rebuilt) if point is not None}


def test_an_infeasible_budget_solves_for_the_least_peak_once(monkeypatch):
    # each rung of the prefetch ladder fails; only the last one explains (its least peak), since
    # that program can take its whole time limit
    profile = chain_profile([8 * MiB] * 5, recompute_every=2, baseline=4 * MiB)
    least, calls = planning._least_peak_modes, []
    monkeypatch.setattr(planning, "_least_peak_modes",
                        lambda *args: calls.append(args) or least(*args))
    with pytest.raises(InfeasibleError, match="at least"):
        plan_with_prefetch(profile, budget=least_peak(profile, 0, 0.0) - 1)
    assert len(calls) == 2        # least_peak here and the last rung's explanation
    assert calls[-1][1] == 0      # at distance 0


def test_a_rung_where_cbc_finds_no_plan_in_time_goes_on_to_prefetch_less(monkeypatch):
    profile = chain_profile([8 * MiB] * 6, recompute_every=2, baseline=2 * MiB)
    budget = (peak_memory(profile, [KEEP] * 6, 2) + least_peak(profile, 0, 0.0)) // 2
    solve, calls = planner_ilp._solve, []

    def nothing_at_first(problem, time_limit_s):
        calls.append(problem)
        if len(calls) == 1:          # the first rung's program (no chains in this profile)
            return "Not Solved / No Solution Found"
        return solve(problem, time_limit_s)

    monkeypatch.setattr(planner_ilp, "_solve", nothing_at_first)
    plan = plan_with_prefetch(profile, budget, method="ilp")
    assert not any(len(p) > 1 for p in planner.rebuild_candidates(profile))
    assert len(calls) == 2 and plan.peak <= budget and valid(profile, plan.modes)
    assert plan.prefetch_margin == planner.PREFETCH_MARGIN / 2      # the second rung's


def test_simulate_queues_copies_and_the_compute_stream_waits_where_they_are_due():
    # three 3 MB groups 1 ms apart, 3 ms a copy each way (1 GB/s), unpacked in reverse order
    # 1 ms apart. Released at the next point (margin 0): group 0's copy runs 0-3 ms, so the
    # compute waits 2 ms at point 1; group 1's then runs 3-6 and the compute, at 4, waits 2 more:
    # the forward ends at 7. Both fetches are issued at the backward's start (the backward is
    # shorter than a copy) in the order the groups were saved, as the runtime issues them:
    # group 0's 7-10, group 1's 10-13, waited for at 8 (5 ms); group 0's is done by 14. The
    # step: 7 + 3 + 5 = 15 ms.
    groups = [SavedGroup(3_000_000, 2 - g, 2 - g) for g in range(3)]
    clocks = dict(forward_clock=[0.0, 1.0, 2.0], backward_clock=[0.0, 1.0, 2.0])
    profile = StepProfile(groups, 3.0, 3.0, 1.0, 1.0, 3, release_margin=0.0, **clocks)
    run = planner.simulate(profile, [OFFLOAD, OFFLOAD, KEEP], lookahead=2)
    assert (run.step_ms, run.forward_wait_ms, run.backward_wait_ms, run.recompute_ms) == (
        pytest.approx(15.0), pytest.approx(4.0), pytest.approx(5.0), 0.0)
    # released when due (1.5 copy times on: past the forward's end), both wait at its end, where
    # group 1's copy has 3 ms to go
    timed = StepProfile(groups, 3.0, 3.0, 1.0, 1.0, 3, **clocks)
    run = planner.simulate(timed, [OFFLOAD, OFFLOAD, KEEP], lookahead=2)
    assert run.forward_wait_ms == pytest.approx(3.0) and run.step_ms == pytest.approx(6.0 + 3 + 5)
    # a fetch issued at the point of its own unpack (on demand) goes before the others there:
    # all three offloaded (group 2's copy, 6-9, waited for at the forward's end: 9), fetched at
    # the backward's start: group 2's 9-12 waited for at once (3 ms), then group 0's 12-15 and
    # group 1's 15-18, waited for at 13 (5 ms); group 0's is done by 19
    demand = planner.simulate(profile, [OFFLOAD, OFFLOAD, OFFLOAD], lookahead=2)
    assert demand.backward_wait_ms == pytest.approx(3.0 + 5.0)
    # alone, group 0's copy ends with the forward, and its fetch (3-6 ms) ends 1 ms after the
    # compute reaches its unpack (at 5)
    assert planner.simulate(timed, [OFFLOAD, KEEP, KEEP], 2).step_ms == pytest.approx(6.0 + 1)
    assert planner.simulate(timed, [KEEP] * 3, 2).step_ms == pytest.approx(6.0)
    # a rebuild runs its recipe on the compute stream at the group's first unpack
    recipe = groups[:2] + [SavedGroup(3_000_000, 0, 0, recompute_ms=0.5, recompute_source=1)]
    rebuilt = planner.simulate(StepProfile(recipe, 3.0, 3.0, 1.0, 1.0, 3, **clocks),
                               [KEEP, KEEP, RECOMPUTE], 2)
    assert (rebuilt.step_ms, rebuilt.recompute_ms) == (pytest.approx(6.5), 0.5)


def queued_copies_profile():
    """Four 100 MB groups 1 ms apart in a 4 ms forward, unpacked in reverse 2 ms apart, over a
    10 GB/s link (10 ms a copy each way): nothing offloaded can leave before the forward's end
    unless the compute waits for its copy."""
    groups = [SavedGroup(100 * 10**6, 3 - g, 3 - g) for g in range(4)]
    return StepProfile(groups, 4.0, 8.0, 10.0, 10.0, 4, forward_clock=[0.0, 1.0, 2.0, 3.0],
                       copy_exposure=planner.COPY_EXPOSURE)


def test_a_plan_carries_its_simulated_step():
    # under 250 MB two groups go, each at the next point (release margin 0): the forward waits
    # 9 ms at points 1 and 2 (ends at 22); with prefetch 1 unpack ahead the fetches run 24-34
    # and 34-44, waited for at 26 (8 ms) and 36 (8 ms): 22 + 8 + 16 = 46 ms
    profile = queued_copies_profile()
    plan = plan_with_prefetch(profile, 250 * 10**6)
    assert (plan.modes, plan.lookahead, plan.prefetch_margin, plan.release_margin) == (
        (OFFLOAD, OFFLOAD, KEEP, KEEP), 1, 0.0, 0.0)
    assert plan.simulated_ms == pytest.approx(46.0)
    assert plan.simulated_ms == pytest.approx(planner.simulate(
        dataclasses.replace(profile, release_margin=0.0), plan.modes, 1, 0.0).step_ms)


def test_trial_plans_offer_a_larger_budgets_plan_where_copies_queue():
    # the plan for 250 MB (46 ms simulated, above) against the one for 300 MB: one group
    # offloaded, the forward waiting 9 ms, its fetch (15-25) waited for at 19: 13 + 8 + 6 =
    # 27 ms; 350 MB gives the same plan, tried once
    profile = queued_copies_profile()
    made = plan_with_prefetch(profile, 250 * 10**6)
    tried = planning.trial_plans(profile, 250 * 10**6, made,
                                larger_budgets=[350 * 10**6, 300 * 10**6])
    assert [label for label, _ in tried] == [
        f"made at copy exposure 0.6 for {300 * 10**6 / 2**30:.2f} GiB"]
    plan = tried[0][1]
    assert plan.modes == (OFFLOAD, KEEP, KEEP, KEEP) and plan.peak <= 300 * 10**6
    assert plan.simulated_ms == pytest.approx(27.0)
    # without a larger budget nothing beats it: at exposures 0 and 0.2 the same two groups go
    assert planning.trial_plans(profile, 250 * 10**6, made) == []


def _fake_plan(name, simulated_ms, moved=MiB):
    return planner.OffloadPlan((name,), 2, 0, simulated_ms, moved, simulated_ms=simulated_ms)


def test_trial_plans_tries_per_budget_the_simulated_fastest_if_it_beats_all_before(monkeypatch):
    profile = dataclasses.replace(chain_profile([MiB] * 3), copy_exposure=0.6)
    made = _fake_plan("made", 100.0)
    assert planner.TRIAL_EXPOSURES == (0.0, 0.2) and planner.TRIAL_MIN_GAIN == 0.005
    times = {(0.0, 10): 95.0, (0.2, 10): 97.0,                   # the same budget: 95 is tried
             (0.6, 20): 99.0, (0.0, 20): 94.7, (0.2, 20): 96.0,  # 0.3 % faster: not tried
             (0.6, 30): 91.0, (0.0, 30): 90.0, (0.2, 30): 92.0}  # the largest: 90
    monkeypatch.setattr(planning, "plan_with_prefetch", lambda p, budget, *args, **kwargs: (
        _fake_plan(f"{p.copy_exposure}@{budget}", times[(p.copy_exposure, budget)])))
    tried = planning.trial_plans(profile, 10, made, larger_budgets=[30, 20, 5])
    assert [(label, plan.simulated_ms) for label, plan in tried] == [
        ("made at copy exposure 0", 95.0),
        (f"made at copy exposure 0 for {30 / 2**30:.2f} GiB", 90.0)]
    # at most TRIAL_MADE, one a budget, in the order of the budgets
    times.update({(0.0, 20): 93.0, (0.6, 40): 80.0, (0.0, 40): 85.0, (0.2, 40): 85.0})
    tried = planning.trial_plans(profile, 10, made, larger_budgets=[20, 30, 40])
    assert [plan.simulated_ms for _, plan in tried] == [95.0, 93.0, 90.0][:planner.TRIAL_MADE]
    # keep_apart: last, the simulated fastest of them again, run with its small kept groups
    # apart (the same choices, told apart only by how the runtime runs them), where it has any
    assert planning.trial_plans(profile, 10, made, larger_budgets=[20, 30, 40],
                               keep_apart=True) == tried    # these fake plans keep nothing
    monkeypatch.setattr(planner, "kept_apart", lambda profile, modes: [0])
    apart = planning.trial_plans(profile, 10, made, larger_budgets=[20, 30, 40], keep_apart=True)
    monkeypatch.undo()
    monkeypatch.setattr(planning, "plan_with_prefetch", lambda p, budget, *args, **kwargs: (
        _fake_plan(f"{p.copy_exposure}@{budget}", times[(p.copy_exposure, budget)])))
    assert [p for _, p in apart[:-1]] == [p for _, p in tried]
    assert not any(p.keep_apart for _, p in apart[:-1])
    label, last = apart[-1]
    assert last.keep_apart and last == tried[-1][1] and last is not tried[-1][1]
    assert label == tried[-1][0] + ", its small kept groups apart"
    assert len(apart) <= planner.TRIAL_PLANS - 1
    # none faster than the plan made: none tried; one already made: not again
    for key in times:
        times[key] += 20
    assert planning.trial_plans(profile, 10, made, larger_budgets=[20]) == []
    monkeypatch.setattr(planning, "plan_with_prefetch",
                        lambda p, budget, *args, **kwargs: _fake_plan("made", 50.0))
    assert planning.trial_plans(profile, 10, made, larger_budgets=[20]) == []
    # a plan that moves nothing is tried against nothing; a budget the solver cannot meet is
    # skipped
    assert planning.trial_plans(profile, 10, _fake_plan("kept", 100.0, moved=0)) == []

    def infeasible_at_zero(p, budget, lookahead, limit, **kwargs):
        if p.copy_exposure == 0.0:
            raise InfeasibleError("no plan")
        return _fake_plan("at 0.2", 80.0)
    monkeypatch.setattr(planning, "plan_with_prefetch", infeasible_at_zero)
    assert [label for label, _ in planning.trial_plans(profile, 10, made)] == [
        "made at copy exposure 0.2"]


def slow_offload_plan():
    """(profile, plan): test_recompute_preferred_when_the_link_is_slow's profile and a plan for
    24 MiB that offloads group 1 over its slow link (fetched on demand) where recomputing it is
    far faster."""
    groups = [SavedGroup(8 * MiB, 3, 3), SavedGroup(8 * MiB, 2, 2, recompute_ms=0.01,
                                                    recompute_source=0),
              SavedGroup(8 * MiB, 1, 1), SavedGroup(8 * MiB, 0, 0)]
    profile = StepProfile(groups, 1.0, 2.0, d2h_gbps=0.001, h2d_gbps=0.001, unpacks=4,
                          copy_exposure=0.2, release_margin=0.0)   # released at the next point
    plan = dataclasses.replace(planner._result(profile, (KEEP, OFFLOAD, KEEP, KEEP), 0),
                               target=24 * MiB)
    assert plan.peak <= 24 * MiB
    return profile, plan


def test_polished_takes_changes_the_simulation_finds_faster_within_the_target():
    profile, slow = slow_offload_plan()
    better = planning.polished(profile, slow)
    assert better.modes == (KEEP, RECOMPUTE, KEEP, KEEP)
    assert better.simulated_ms < slow.simulated_ms and better.peak <= 24 * MiB
    assert better.target == 24 * MiB
    # the program's own plan is already the best of its neighbours here; a plan of unknown
    # target is left as it is
    made = plan_offload(profile, budget=24 * MiB)
    assert planning.polished(profile, made) is made
    unknown = dataclasses.replace(slow, target=0)
    assert planning.polished(profile, unknown) is unknown


@pytest.mark.parametrize("seed", range(3))
def test_polished_plans_stay_valid_within_target_and_no_one_change_beats_them(seed):
    profile = dataclasses.replace(chain_profile([MiB * (1 + seed % 3 + g % 4) for g in range(9)],
                                                recompute_every=2, seed=seed), copy_exposure=0.6)
    total = sum(g.nbytes for g in profile.groups)
    made = plan_offload(profile, budget=total * 2 // 3)
    better = planning.polished(profile, made, time_limit_s=None)
    assert valid(profile, better.modes) and better.peak <= made.target
    assert better.simulated_ms <= made.simulated_ms
    for index, group in enumerate(profile.groups):
        for mode in planner.allowed_modes(group):
            modes = list(better.modes)
            modes[index] = mode
            if valid(profile, modes) and planner.peak_memory(profile, modes, 2) <= made.target:
                assert planner.simulate(profile, modes, 2).step_ms >= better.simulated_ms - 1e-6


def test_trial_plans_try_the_plan_made_polished_on_its_simulation(monkeypatch):
    # no plan at the other exposures: the plan made, polished, is the one tried
    profile, slow = slow_offload_plan()

    def infeasible(*args, **kwargs):
        raise InfeasibleError("no plan")
    monkeypatch.setattr(planning, "plan_with_prefetch", infeasible)
    tried = planning.trial_plans(profile, 24 * MiB, slow)
    assert [(label, plan.modes) for label, plan in tried] == [
        ("as made, polished on its simulation", (KEEP, RECOMPUTE, KEEP, KEEP))]


def test_kept_apart_are_the_kept_dense_groups_of_at_most_a_quarter_of_the_largest():
    groups = [SavedGroup(4 * MiB, 3, 3), SavedGroup(MiB, 2, 2), SavedGroup(MiB + 1, 1, 1),
              SavedGroup(MiB // 2, 0, 0, offloadable=False), SavedGroup(MiB // 4, 0, 0)]
    profile = StepProfile(groups, 1.0, 1.0, 10.0, 10.0, 4)
    assert planner.KEEP_APART_SHARE == 0.25
    assert planner.kept_apart(profile, [KEEP] * 5) == [1, 4]
    assert planner.kept_apart(profile, [KEEP, OFFLOAD, KEEP, KEEP, RECOMPUTE]) == []


def test_least_times_takes_each_time_the_least_recorded_and_the_last_recordings_memory():
    # the second recording's host fell behind between points 1 and 2 (its clocks stretched
    # there, and the recipe timed there), the first's between 2 and 3
    first = chain_profile([4 * MiB] * 4, recompute_every=2, seed=1)
    first = dataclasses.replace(
        first, forward_clock=[0.0, 1.0, 2.0, 9.0], backward_clock=[0.0, 2.0, 3.0, 4.0],
        forward_ms=9.5, backward_ms=6.0, d2h_gbps=20.0, h2d_gbps=25.0)
    second = dataclasses.replace(
        first, forward_clock=[0.0, 1.0, 7.0, 8.0], backward_clock=[0.0, 5.0, 6.0, 7.0],
        forward_ms=8.5, backward_ms=9.0, d2h_gbps=22.0, h2d_gbps=24.0,
        baseline_forward=[5 * MiB] * 4, baseline_backward=[6 * MiB] * 4,
        groups=[dataclasses.replace(g, recompute_ms=g.recompute_ms + 3.0)
                if g.recompute_ms is not None else g for g in first.groups])
    least = planner.least_times([first, second])
    assert least.forward_clock == [0.0, 1.0, 2.0, 3.0]
    assert least.backward_clock == [0.0, 2.0, 3.0, 4.0]
    assert (least.forward_ms, least.backward_ms) == (8.5, 6.0)
    assert (least.d2h_gbps, least.h2d_gbps) == (22.0, 25.0)
    assert [g.recompute_ms for g in least.groups] == [g.recompute_ms for g in first.groups]
    assert any(g.recompute_ms is not None for g in least.groups)
    # memory: the last recording's
    assert least.baseline_forward == second.baseline_forward
    assert least.baseline_backward == second.baseline_backward
    assert planner.least_times([second]) == second


def test_least_times_leaves_out_a_recording_of_other_tensors_and_recipes_of_other_sources():
    last = chain_profile([4 * MiB] * 4, recompute_every=2)
    last = dataclasses.replace(last, forward_ms=9.0)
    other_sizes = dataclasses.replace(chain_profile([4 * MiB] * 3 + [2 * MiB]), forward_ms=1.0)
    assert planner.least_times([other_sizes, last]).forward_ms == 9.0
    # the same tensors: its times count, but a recipe's only where it has the same sources;
    # a group it did not time (no recipe there) takes the others' time
    timed = [g for g in last.groups if g.recompute_ms is not None]
    assert timed
    untimed = dataclasses.replace(last, forward_ms=2.0, groups=[
        dataclasses.replace(g, recompute_ms=None, recompute_source=None) for g in last.groups])
    other_source = dataclasses.replace(last, groups=[
        dataclasses.replace(g, recompute_ms=0.001, recompute_source=())
        if g.recompute_ms is not None else g for g in last.groups])
    least = planner.least_times([untimed, other_source, last])
    assert least.forward_ms == 2.0
    assert [g.recompute_ms for g in least.groups] == [g.recompute_ms for g in last.groups]


def test_smaller_headrooms_halve_down_to_the_least_and_leave_out_targets_below_the_least_peak():
    budget = 1000 * 2**20
    assert planner.LEAST_HEADROOM == 0.025
    assert planner.smaller_headrooms(budget, 0.1) == [
        (0.05, planner.planning_target(budget, 0.05)),
        (0.025, planner.planning_target(budget, 0.025))]
    assert planner.smaller_headrooms(budget, 0.04) == []       # half of it is under the least
    least = planner.planning_target(budget, 0.04)
    assert planner.smaller_headrooms(budget, 0.1, least_peak=least) == [
        (0.025, planner.planning_target(budget, 0.025))]


def staged_chain_profile(late_reader: bool = False):
    """A first block, then a pool and one more layer: x (group 0, read last by the first
    convolution), two 8 MiB activations (1, 2) of the block, the pool's 2 MiB output (3, with a
    recipe from 2) and one 2 MiB activation after it (4, with a recipe from 3). ``late_reader``:
    group 4 is also read at the block's first backward point."""
    groups = [SavedGroup(1 * MiB, 5, 5, "Conv2d"),
              SavedGroup(8 * MiB, 3, 4, "ReLU"),
              SavedGroup(8 * MiB, 2, 3, "ReLU"),
              SavedGroup(2 * MiB, 1, 1, "MaxPool2d", recompute_ms=0.1, recompute_source=2),
              SavedGroup(2 * MiB, 0, 2 if late_reader else 0, "ReLU", recompute_ms=0.2,
                         recompute_source=3)]
    return StepProfile(groups, forward_ms=10.0, backward_ms=20.0, d2h_gbps=1.0, h2d_gbps=1.0,
                       unpacks=6, baseline_forward=[1 * MiB, 9 * MiB, 9 * MiB, 3 * MiB, 3 * MiB],
                       baseline_backward=[3 * MiB, 4 * MiB, 12 * MiB, 20 * MiB, 12 * MiB,
                                          10 * MiB],
                       backward_clock=[0.0, 2.0, 4.0, 8.0, 12.0, 16.0],
                       forward_clock=[0.0, 1.0, 2.0, 3.0, 4.0],
                       floor_backward=[2 * MiB, 3 * MiB, 4 * MiB, 10 * MiB, 8 * MiB, 8 * MiB])


def test_a_staged_profile_drops_the_chains_groups_and_backward_points():
    profile = staged_chain_profile()
    stage = planner_stage.Stage(5, 0, 3, 0, 1 * MiB, 4, 3.0)
    staged = planner_stage.staged_profile(profile, stage)
    assert [g.nbytes for g in staged.groups] == [1 * MiB, 2 * MiB, 2 * MiB]
    inputs, pooled, after = staged.groups
    # the input is read once, at the staged backward's one point, the last
    assert (inputs.first_unpack, inputs.last_unpack, inputs.recompute_ms) == (2, 2, None)
    # the pool's recipe read a staged group: gone; the next one's source is renumbered
    assert pooled.recompute_ms is None and pooled.recompute_source is None
    assert after.recompute_source == (1,)
    assert staged.unpacks == 3 and staged.backward_clock == [0.0, 2.0, 4.0]
    assert staged.backward_ms == 23.0      # the chain's forward runs again
    # at its point: the floor there and a quarter of the most above it (point 3: 20 MiB
    # besides groups 1 and 2, both live, 36 MiB in all)
    assert staged.baseline_backward == [3 * MiB, 4 * MiB, 4 * MiB + (36 * MiB - 4 * MiB) // 4]
    assert staged.floor_backward == [2 * MiB, 3 * MiB, 4 * MiB]
    # its forward saves nothing but holds one of its tensors besides what its points held
    assert staged.baseline_forward == [9 * MiB + 8 * MiB, 3 * MiB, 3 * MiB]
    assert staged.forward_clock == [0.0, 3.0, 4.0]
    # a plan on it never sees the block's 16 MiB
    assert peak_memory(staged, [KEEP] * 3, 0) < peak_memory(profile, [KEEP] * 5, 0)


def test_a_staged_profile_has_no_group_for_an_input_autograd_keeps():
    # the chain's input requires grad (a gradient penalty's): no group saved it in the
    # recording (input_group None) and none will in a staged step (input_saved False); the
    # stage's forward memory goes with the next group's point
    profile = staged_chain_profile()
    groups = [g if g.recompute_source is None else dataclasses.replace(
        g, recompute_source=tuple(source - 1 for source in g.recompute_source))
        for g in profile.groups[1:]]
    unsaved = dataclasses.replace(profile, groups=groups, baseline_forward=profile.baseline_forward[1:],
                      forward_clock=profile.forward_clock[1:])
    stage = planner_stage.Stage(5, 0, 2, None, 1 * MiB, 4, 3.0, input_saved=False)
    staged = planner_stage.staged_profile(unsaved, stage)
    assert [g.producer for g in staged.groups] == ["MaxPool2d", "ReLU"]
    # the stage's forward (9 MiB besides its groups, and one 8 MiB tensor) at the pool's point
    assert staged.baseline_forward == [9 * MiB + 8 * MiB, 3 * MiB]
    # saved by the staged step where it can be: the input's group, as ever
    saved = planner_stage.staged_profile(unsaved, dataclasses.replace(stage, input_saved=True))
    assert [g.producer for g in saved.groups] == ["stage input", "MaxPool2d", "ReLU"]


def test_a_stage_extending_the_recordings_counts_its_last_point_at_the_whole_batch():
    # the profile's last point is the recording's own stage (4 chunks): 10 MiB there above its
    # 8 MiB floor is a quarter of what its chain's backward holds for the whole batch
    profile = staged_chain_profile()
    plain = planner_stage.Stage(5, 0, 3, 0, 1 * MiB, 8, 3.0)
    extending = dataclasses.replace(plain, recorded_chunks=4)
    # point 5 at the whole batch: 8 + 4 * (10 - 8) = 16 MiB, below point 3's 36: the same peak
    assert planner_stage.staged_profile(profile, extending) == \
        planner_stage.staged_profile(profile, plain)
    heavy = dataclasses.replace(profile, baseline_backward=profile.baseline_backward[:5]
                                + [18 * MiB])
    # point 5 at the whole batch: 8 + 4 * (18 - 8) = 48 MiB, the peak: an eighth of it above
    # the 4 MiB floor at the stage's first point
    assert planner_stage.staged_profile(heavy, extending).baseline_backward[-1] == \
        4 * MiB + (48 * MiB - 4 * MiB) // 8
    assert planner_stage.staged_profile(heavy, plain).baseline_backward[-1] == \
        4 * MiB + (36 * MiB - 4 * MiB) // 8
    # never fewer micro-batches than the recording's stage ran in
    roomy = dataclasses.replace(profile, baseline_backward=[13 * MiB] + profile.baseline_backward[1:])
    assert planner_stage.stage_chunks(roomy, dataclasses.replace(plain, recorded_chunks=1)) == 4
    assert planner_stage.stage_chunks(roomy, dataclasses.replace(plain, recorded_chunks=8)) == 8


def test_a_chain_whose_backward_is_not_the_last_is_not_staged():
    profile = staged_chain_profile(late_reader=True)
    stage = planner_stage.Stage(5, 0, 3, 0, 1 * MiB, 4, 3.0)
    assert planner_stage.staged_profile(profile, stage) is None
    assert planner_stage.stage_chunks(profile, stage) is None


def test_an_input_the_chain_did_not_save_is_a_new_group():
    recorded = staged_chain_profile()
    # the chain's first layer saved nothing of its input (group 0 left out, as a ReLU first)
    profile = dataclasses.replace(
        recorded, groups=[dataclasses.replace(g, recompute_source=tuple(
            s - 1 for s in g.recompute_source) if g.recompute_source else None)
            for g in recorded.groups[1:]],
        baseline_forward=recorded.baseline_forward[1:], forward_clock=recorded.forward_clock[1:])
    staged = planner_stage.staged_profile(profile, planner_stage.Stage(4, 0, 2, None, 3 * MiB, 2, 3.0))
    assert [g.nbytes for g in staged.groups] == [3 * MiB, 2 * MiB, 2 * MiB]
    assert (staged.groups[0].first_unpack, staged.groups[0].last_unpack) == (2, 2)
    assert staged.groups[2].recompute_source == (1,)


def test_the_fewest_chunks_that_leave_the_stage_below_the_rest_of_the_backward():
    profile = staged_chain_profile()
    stage = planner_stage.Stage(5, 0, 3, 0, 1 * MiB, 4, 3.0)
    # floor 4 MiB, 36 MiB at most: a chunk of 2 holds 20 MiB, of 4 12 MiB, of 8 8 MiB; the rest
    # of the backward holds 4 MiB at most: none fits, so the most
    assert planner_stage.stage_chunks(profile, stage) == planner_stage.STAGE_CHUNKS[-1]
    roomy = dataclasses.replace(profile, baseline_backward=[13 * MiB] + profile.baseline_backward[1:])
    assert planner_stage.stage_chunks(roomy, stage) == 4
