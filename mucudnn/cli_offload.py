"""``mucudnn offload-plan``: the offload planner replayed on a recorded step, off the GPU.
Registered on the ``mucudnn`` group by :mod:`mucudnn.cli`, whose errors are one line each."""

from __future__ import annotations

import sys

import click

from .errors import MucudnnError


def _percent(text: str, what: str) -> float:
    """A share from ``text`` in percent (10, 2.5), 0 up to 100 exclusive; one line otherwise."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 <= value < 100:   # NaN fails it too
        raise MucudnnError(f"{what} {text!r} is not a percent from 0 up to 100 (e.g. 10)")
    return value / 100


@click.command("offload-plan")
@click.argument("profile_path", metavar="PROFILE")
@click.option("--budget", metavar="SIZE",
              help="the memory budget to plan for (e.g. 8GiB; default: the one it was recorded "
                   "under)")
@click.option("--row", type=int, help="offload.json: the K-th row with a profile (0: the first)")
@click.option("--headroom", default="10", show_default=True, metavar="PERCENT",
              help="plan for the budget less this much (the session's: room for the caching "
                   "allocator's fragmentation)")
@click.option("--lookahead", type=click.IntRange(min=0), default=2, show_default=True,
              help="prefetch an offloaded tensor this many backward points ahead (the session's)")
@click.option("--time-limit", type=click.FloatRange(min=0, min_open=True), default=20,
              show_default=True, metavar="SECONDS",
              help="CBC's limit per solve (--method ilp)")
@click.option("--method", type=click.Choice(["fast", "ilp"]), default="fast", show_default=True,
              help="the planner: fast (the session's) or ilp (CBC: the reference, slower)")
@click.option("--groups", is_flag=True, help="also a table of each saved group's mode")
@click.option("--trials", is_flag=True,
              help="also make the plans the session tries against it (planning.trial_plans), "
                   "timed apart")
def offload_plan(profile_path, budget, row, headroom, lookahead, time_limit, method, groups,
                 trials):
    """Replay the offload planner on PROFILE, a recorded step (MUCUDNN_OFFLOAD_PROFILE's file,
    or benchmarks/offload.py's offload.json), off the GPU: print the plan an OffloadSession makes
    for --budget (kept, offloaded, recomputed, staged; predicted step and peak) and the wall
    time planning took. Where no plan meets the budget less its headroom, the session's smaller
    headrooms are tried, as it does; exit status 1 where none meets even those (the session
    then offloads every saved tensor). Reads every profile format up to this version's; a bad
    file or budget is one line and exit status 2."""
    from .budget import parse_budget
    from .torch import profiles

    def gib(size: int) -> str:
        return f"{size / 2**30:.2f} GiB"

    share = _percent(headroom, "--headroom")
    budget_bytes = parse_budget(budget) if budget is not None else None
    recorded = profiles.load_profile(profile_path, row)
    if budget_bytes is None:
        if recorded.budget is None:
            raise MucudnnError(f"{profile_path}: no budget recorded in it; give --budget")
        budget_bytes = recorded.budget
    profile = recorded.profile
    click.echo(f"{recorded.source}: {len(profile.groups)} saved groups, {profile.unpacks} "
               f"backward points, format {recorded.format}; recorded under "
               + (gib(recorded.budget) if recorded.budget else "an unknown budget")
               + (f" (target {gib(recorded.target)})" if recorded.target else "")
               + f", plan: {recorded.plan or '-'}")
    done = profiles.replay(profile, budget_bytes, share, lookahead, time_limit, trials=trials,
                           method=method)
    if done.error is not None:
        click.echo(f"no plan for {gib(budget_bytes)} less its headroom ({share:.0%}): "
                   f"{done.error}")
    plan = done.plan
    if plan is None:
        click.echo(f"no plan for {gib(budget_bytes)} (the session offloads every saved "
                   f"tensor); planning took {done.plan_s:.2f} s (wall)")
        sys.exit(1)
    click.echo(f"budget {gib(budget_bytes)}, headroom {share * 100:g}%: plan for "
               f"{gib(done.target)}"
               + (f" ({1 - done.target / budget_bytes:.1%} less than the budget)"
                  if done.error is not None else ""))
    click.echo(f"plan: {plan.describe()}")
    staged = recorded.stage.describe() if recorded.stage is not None else "none"
    click.echo(f"  kept {plan.count('keep')}, offloaded {plan.count('offload')}, recomputed "
               f"{plan.count('recompute')}, staged: {staged}; predicted step "
               f"{plan.predicted_ms:.1f} ms, peak {gib(plan.peak)}")
    click.echo(f"planning took {done.plan_s:.2f} s (wall; "
               + (f"CBC at most {time_limit:g} s a solve)" if method == "ilp"
                  else "the fast planner)"))
    if trials:
        for label, other in done.trials:
            click.echo(f"  trial {label}: {other.describe()}")
        click.echo(f"trial plans: {len(done.trials)}, took {done.trials_s:.2f} s (wall)")
    if groups:
        for line in [profiles.GROUPS_HEADER] + profiles.group_lines(profile, plan.modes):
            click.echo(line)
