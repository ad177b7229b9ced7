"""The fast planner against the ILP (issue 39, item 1): on every committed profile and the shared
one, the plan an ``OffloadSession`` makes for its recorded budget (its target, and the larger
targets its trial plans for), by CBC (the reference) and by the fast method, and the time the
session's whole planning takes.

    # the reference: CBC at each target (slow: minutes a ResNet-50 profile); resumable
    nice .venv/bin/python benchmarks/planner_gap.py ilp --time-limit 60
    # the fast plans against it, and the planning wall time with trials, as a markdown table
    .venv/bin/python benchmarks/planner_gap.py table > benchmarks/results/planner-gap.md

The reference (``tests/data/planner_ilp_reference.json``) keeps, per profile and target, the
ILP's :func:`planning.plan_with_prefetch` plan: its predicted step (``OffloadPlan.step_ms``, the
program's objective), the prefetch rung it met the target at, and whether CBC proved it optimal
(it stopped before its time limit). tests/torch/test_planner_fast.py holds the fast plan within
:data:`GAP` of it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from mucudnn.errors import MucudnnError  # noqa: E402
from mucudnn.torch import planner, planner_ilp, profiles  # noqa: E402
from mucudnn.torch import planning  # noqa: E402

#: the profile beside the repository that issue 39 measures against (read in place)
SHARED = "../shared/profiles/resnet50-n184-5GiB-h100.json"
REFERENCE = ROOT / "tests" / "data" / "planner_ilp_reference.json"
#: the most the fast plan's predicted step may exceed the ILP's (a share of it)
GAP = 0.02


def committed_profiles(root: Path = ROOT, shared: bool = True) -> list[tuple[str, int | None]]:
    """(path relative to ``root``, row or None) of every committed profile (a session's document,
    or each row of offload.json with one), the shared one first where ``shared`` and present."""
    files = subprocess.run(["git", "ls-files", "benchmarks/results/**/*.json"], cwd=root,
                           capture_output=True, text=True, check=True).stdout.split()
    found = [(SHARED, None)] if shared and (root / SHARED).exists() else []
    for name in files:
        try:
            data = json.loads((root / name).read_text())
        except (OSError, ValueError):
            continue
        if isinstance(data, list):
            rows = [r for r in data if isinstance(r, dict) and r.get("profile")]
            found += [(name, index) for index in range(len(rows))]
        elif isinstance(data, dict) and isinstance(data.get("profile"), dict):
            found.append((name, None))
    return found


def load(root: Path, name: str, row: int | None):
    """The recorded profile, or None where the file's profile is not one this version reads (a
    one-line reason printed)."""
    try:
        recorded = profiles.load_profile(root / name, row)
    except MucudnnError as exc:
        print(f"skipped: {exc}", file=sys.stderr)
        return None
    return recorded if recorded.budget else None


def targets(budget: int) -> list[tuple[str, int]]:
    """(kind, target) the session plans for under ``budget`` at the default headroom: its own
    target, and each larger one its trial plans for (each smaller headroom's, where no plan
    meets the session's, are :func:`lower_targets`)."""
    return [("session", planner.planning_target(budget, profiles.HEADROOM))] + [
        ("trial", target) for target in planner.trial_budgets(budget, profiles.HEADROOM)]


def lower_targets(budget: int) -> list[tuple[str, int]]:
    """(kind, target) of the smaller headrooms the session plans with where no plan meets its
    own target, in its order (:func:`planner.smaller_headrooms`)."""
    return [("less headroom", target)
            for _, target in planner.smaller_headrooms(budget, profiles.HEADROOM)]


def fast_plans(recorded) -> dict[int, object]:
    """target -> the fast plan the session makes there (None: none) for each of
    :func:`targets` of ``recorded``'s budget, and of :func:`lower_targets` where the session's
    target has no plan: the session's plan (:func:`profiles.replay`), each trial target's from
    it (the warm start :func:`planning.trial_plans` gives), each smaller headroom's as the
    session makes it."""
    profile, budget = recorded.profile, recorded.budget
    made = profiles.replay(profile, budget)
    start = made.plan.modes if made.plan is not None else None
    found = {}
    # the smaller headrooms' only where the session's target has none (as the session plans)
    for kind, target in targets(budget) + lower_targets(budget) * (made.error is not None):
        if kind == "session" and made.error is None:
            found[target] = made.plan
            continue
        try:
            found[target] = planning.plan_with_prefetch(
                profile, target, profiles.LOOKAHEAD, explain=False,
                start=start if kind == "trial" else None)
        except MucudnnError:
            found[target] = None
    return found


def key(name: str, row: int | None, target: int) -> str:
    return f"{name}#{'' if row is None else row}@{target}"


def plan_or_none(profile, target, method, time_limit_s=None):
    """(plan or None, wall s) of :func:`planning.plan_with_prefetch` by ``method``."""
    start = time.perf_counter()
    try:
        plan = planning.plan_with_prefetch(profile, target, profiles.LOOKAHEAD, time_limit_s,
                                          explain=False, method=method)
    except MucudnnError:
        plan = None
    return plan, time.perf_counter() - start


def rung(plan) -> dict:
    return {"lookahead": plan.lookahead, "prefetch_margin": plan.prefetch_margin,
            "release_margin": plan.release_margin}


def run_ilp(time_limit_s: float, only: str | None) -> None:
    reference = json.loads(REFERENCE.read_text()) if REFERENCE.exists() else {
        "time_limit_s": time_limit_s, "gap": GAP, "entries": {}}
    entries = reference["entries"]
    loaded = [(name, row, load(ROOT, name, row)) for name, row in committed_profiles()
              if not only or only in name]
    # the smaller programs first: their entries come in minutes, ResNet-50's in an hour
    loaded = sorted(((n, r, p) for n, r, p in loaded if p is not None),
                    key=lambda entry: len(entry[2].profile.groups))
    for name, row, recorded in loaded:
        wanted = targets(recorded.budget)
        for kind, target in wanted + lower_targets(recorded.budget):
            if kind == "less headroom":
                # only where the session's target has no plan: then each smaller headroom's
                # in turn, down to the first with one (as the session plans)
                session = entries.get(key(name, row, wanted[0][1]))
                if session is None or session["ilp_step_ms"] is not None or any(
                        e["ilp_step_ms"] is not None for e in entries.values()
                        if e["profile"] == name and e["row"] == row
                        and e["kind"] == "less headroom"):
                    continue
            if key(name, row, target) in entries:
                continue
            plan, wall = plan_or_none(recorded.profile, target, planning.ILP, time_limit_s)
            entry = {"profile": name, "row": row, "kind": kind, "target": target,
                     "groups": len(recorded.profile.groups), "wall_s": round(wall, 2)}
            if plan is None:
                entry.update(ilp_step_ms=None, proven=wall < time_limit_s)
            else:
                # CBC stops before its limit only where it proved each solve optimal
                entry.update(ilp_step_ms=plan.step_ms, peak=plan.peak, proven=wall < time_limit_s,
                             **rung(plan))
            entries[key(name, row, target)] = entry
            REFERENCE.parent.mkdir(parents=True, exist_ok=True)
            REFERENCE.write_text(json.dumps(reference, indent=1, sort_keys=True) + "\n")
            print(f"{name} row {row} {kind} {target / 2**30:.3f} GiB: "
                  f"{entry['ilp_step_ms']} ms, {wall:.1f} s", file=sys.stderr, flush=True)


def session_wall(profile, budget: int) -> tuple[float, object]:
    """(wall s, :class:`profiles.Replayed`) of the session's planning after recording: its plan
    and its trial plans (:func:`profiles.replay` with trials), by the fast method."""
    start = time.perf_counter()
    done = profiles.replay(profile, budget, trials=True)
    return time.perf_counter() - start, done


def repeated_profile(profile: planner.StepProfile, times: int) -> planner.StepProfile:
    """A step of ``times`` copies of ``profile``'s model one after another: the forward of the
    first copy to the last, then the backward from the last to the first (each copy's groups,
    points, baselines and clocks as recorded): a larger profile of the same kind."""
    g, u = len(profile.groups), profile.unpacks
    forward_span = max([profile.forward_ms] + profile.forward_clock[-1:])
    backward_span = max([profile.backward_ms] + profile.backward_clock[-1:])
    groups = []
    for copy in range(times):
        later = (times - 1 - copy) * u    # its backward runs after those of later copies
        for group in profile.groups:
            sources = group.recompute_source
            groups.append(dataclasses.replace(
                group, first_unpack=group.first_unpack + later,
                last_unpack=group.last_unpack + later,
                recompute_source=None if sources is None else tuple(s + copy * g for s in sources)))
    return dataclasses.replace(
        profile, groups=groups, unpacks=u * times, forward_ms=profile.forward_ms * times,
        backward_ms=profile.backward_ms * times,
        baseline_forward=profile.baseline_forward * times,
        baseline_backward=profile.baseline_backward * times,
        floor_backward=profile.floor_backward * times,
        forward_clock=[t + copy * forward_span for copy in range(times)
                       for t in profile.forward_clock],
        backward_clock=[t + copy * backward_span for copy in range(times)
                        for t in profile.backward_clock])


def table(only: str | None = None) -> None:
    """The table's rows (``only``: of the profiles whose path contains it)."""
    reference = json.loads(REFERENCE.read_text())["entries"]
    print("| profile | groups | budget GiB | target GiB | fast plan (kept/offloaded/recomputed) "
          "| fast step ms | ILP step ms (proven) | gap | session planning wall s (fast, with "
          "trials) |")
    print("|---|---|---|---|---|---|---|---|---|")
    worst = 0.0
    for name, row in committed_profiles():
        if only and only not in name:
            continue
        recorded = load(ROOT, name, row)
        if recorded is None:
            continue
        wall, _ = session_wall(recorded.profile, recorded.budget)
        label = name.replace("benchmarks/results/", "") + ("" if row is None else f" row {row}")
        plans = fast_plans(recorded)
        shown = set()
        for kind, target in targets(recorded.budget) + lower_targets(recorded.budget):
            entry = reference.get(key(name, row, target))
            if target not in plans or target in shown or (
                    entry is None and kind == "less headroom"):
                continue
            shown.add(target)
            plan = plans[target]
            fast = (f"{plan.count('keep')}/{plan.count('offload')}/{plan.count('recompute')}"
                    if plan else "none")
            fast_ms = f"{plan.step_ms:.2f}" if plan else "-"
            if entry is None:
                ilp, gap = "not computed", "-"
            elif entry["ilp_step_ms"] is None:
                ilp, gap = "none" + (" (proven)" if entry["proven"] else " (time limit)"), "-"
            else:
                ilp = f"{entry['ilp_step_ms']:.2f}" + (" (proven)" if entry["proven"] else "")
                gap = "-" if plan is None else \
                    f"{(plan.step_ms / entry['ilp_step_ms'] - 1) * 100:+.2f} %"
                if plan is not None:
                    worst = max(worst, plan.step_ms / entry["ilp_step_ms"] - 1)
            print(f"| {label} ({kind}) | {len(recorded.profile.groups)} | "
                  f"{recorded.budget / 2**30:.2f} | {target / 2**30:.3f} | {fast} | {fast_ms} | "
                  f"{ilp} | {gap} | {wall:.2f} |", flush=True)
    print(f"\nlargest gap: {worst * 100:+.2f} %")


def synthetic(path: str, row: int | None, times: int, share: float) -> None:
    """A row of the session's planning wall time on ``times`` copies of a profile
    (:func:`repeated_profile`) at a budget of ``share`` of its peak with everything kept."""
    recorded = profiles.load_profile(ROOT / path, row)
    profile = repeated_profile(recorded.profile, times)
    full = planner.peak_memory(profile, [planner.KEEP] * len(profile.groups), 2)
    budget = int(full * share)
    wall, done = session_wall(profile, budget)
    plan = done.plan
    label = path.replace("benchmarks/results/", "") + ("" if row is None else f" row {row}")
    print(f"| {label} x{times} | {len(profile.groups)} | {budget / 2**30:.2f} | "
          f"{done.target / 2**30:.3f} | "
          + (f"{plan.count('keep')}/{plan.count('offload')}/{plan.count('recompute')}, "
             f"{plan.step_ms:.1f} ms" if plan else f"none: {done.error}")
          + f" | {len(done.trials or [])} | {wall:.2f} |", flush=True)


def least_peaks(time_limit_s: float) -> None:
    """The least peak the fast method finds (what :class:`InfeasibleError` says) against the
    ILP's, at the last rung of the prefetch ladder (fetched when first unpacked, released at the
    next point: the least of all), for each committed profile whose session target has no
    plan."""
    reference = json.loads(REFERENCE.read_text())["entries"]
    print("| profile | groups | fast least peak GiB (s) | ILP least peak GiB (s) | fast above |")
    print("|---|---|---|---|---|")
    for name, row in committed_profiles():
        recorded = load(ROOT, name, row)
        if recorded is None:
            continue
        entry = reference.get(key(name, row, targets(recorded.budget)[0][1]))
        if entry is None or entry["ilp_step_ms"] is not None:
            continue
        profile = dataclasses.replace(recorded.profile, release_margin=0.0)
        found = {}
        for method in (planning.FAST, planning.ILP):
            start = time.perf_counter()
            least = planning.least_peak(profile, 0, 0.0, method=method) \
                if method == planning.FAST else planner.peak_memory(
                    profile, planner_ilp.least_peak_modes(profile, 0, 0.0, time_limit_s), 0, 0.0)
            found[method] = (least, time.perf_counter() - start)
        (fast, fast_s), (ilp, ilp_s) = found[planning.FAST], found[planning.ILP]
        label = name.replace("benchmarks/results/", "") + ("" if row is None else f" row {row}")
        print(f"| {label} | {len(profile.groups)} | {fast / 2**30:.3f} ({fast_s:.2f}) | "
              f"{ilp / 2**30:.3f} ({ilp_s:.2f}) | {(fast / ilp - 1) * 100:+.2f} % |", flush=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    ilp = sub.add_parser("ilp", help="compute the ILP reference (resumable)")
    ilp.add_argument("--time-limit", type=float, default=60.0)
    ilp.add_argument("--only", help="profiles whose path contains this")
    tab = sub.add_parser("table", help="the fast plans against the reference, as markdown")
    tab.add_argument("--only", help="profiles whose path contains this")
    syn = sub.add_parser("synthetic", help="the session's planning on a repeated profile")
    syn.add_argument("--profile", default=SHARED)
    syn.add_argument("--row", type=int)
    syn.add_argument("--times", type=int, default=4)
    syn.add_argument("--share", type=float, default=0.5,
                     help="the budget as a share of the all-kept peak")
    least = sub.add_parser("least", help="the fast least peak against the ILP's")
    least.add_argument("--time-limit", type=float, default=60.0)
    args = parser.parse_args(argv)
    if args.command == "ilp":
        run_ilp(args.time_limit, args.only)
    elif args.command == "table":
        table(args.only)
    elif args.command == "least":
        least_peaks(args.time_limit)
    else:
        synthetic(args.profile, args.row, args.times, args.share)


if __name__ == "__main__":
    main()
