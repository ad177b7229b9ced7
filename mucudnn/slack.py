"""The workspace chosen under ``--offload`` (docs/shim.md, "The slack"): the percent
``MUCUDNN_WORKSPACE_SLACK`` a launched command's shim runs with, the workspace limit derived
from front plans (``MUCUDNN_WORKSPACE_LIMIT``) that gives the step its share of that slack, and,
tuning online, the hold (``MUCUDNN_WORKSPACE_HOLD``) that is a share of the memory budget.

:func:`point_within` is the shim's choice of a front point (``mu_plan_point`` then
``mu_plan_lean_point``, shim/src/exec.c); tests/data/lean_points.txt holds the vectors both sides
are tested against.
"""

from __future__ import annotations

from .sizes import describe_size

ENV_WORKSPACE_SLACK = "MUCUDNN_WORKSPACE_SLACK"
#: Percent: under --offload each convolution of a front plan takes its point of least workspace
#: within this much of its fastest (docs/shim.md, "The slack"). The rule: a byte of workspace at
#: the step's peak is a byte of saved tensors offloaded or recomputed, and fronts are flat near
#: their fastest point, so a few percent of a kernel's time buys a large share of its workspace.
#: What it bought on the 3-D models, and the other values tried: benchmarks/results/pressure.
OFFLOAD_WORKSPACE_SLACK = 5


#: Under --offload with online tuning, each convolution's workspace is held to the memory budget
#: divided by this (MUCUDNN_WORKSPACE_HOLD; the shim holds no engine below 8 of its samples'
#: worth, where the hold would cost speed and buy little: a 3-D U-Net at N = 2). The rule:
#: PyTorch sizes a convolution's workspace once, when it first runs the convolution: in the
#: recording step, where the budget is nearly all free, so the engine of the largest workspace is
#: taken (VGG-16: 1.7-3.1 GiB). In the planned steps that workspace is a transient at a point
#: where the plan keeps tensors up to the budget, and the caching allocator, with no free block
#: that large, flushes its cache to map it, every step. Held to a share of the budget, the shim
#: runs the online front's fastest point within it: the fast algorithm on micro-batches
#: (docs/shim.md, "The hold"). What it bought: benchmarks/results/plan-accuracy.
OFFLOAD_WORKSPACE_SHARE = 16


ENV_WORKSPACE_HOLD = "MUCUDNN_WORKSPACE_HOLD"


def offload_workspace_hold(budget: int) -> int:
    """The workspace hold under ``--offload`` with online tuning for a ``budget`` of bytes."""
    return max(budget // OFFLOAD_WORKSPACE_SHARE, 0)


def set_offload_workspace_hold(env: dict, budget: int | None, offload, online: bool, say) -> None:
    """Under ``offload`` with a budget and online tuning, and neither a workspace limit nor a
    hold given: ``MUCUDNN_WORKSPACE_HOLD`` from :func:`offload_workspace_hold`, said in one line."""
    if not (offload and budget and online) or env.get("MUCUDNN_WORKSPACE_LIMIT") \
            or env.get(ENV_WORKSPACE_HOLD):
        return
    hold = offload_workspace_hold(budget)
    env[ENV_WORKSPACE_HOLD] = str(hold)
    say(f"mucudnn: convolution workspaces held to {describe_size(hold)} "
        f"(1/{OFFLOAD_WORKSPACE_SHARE} of the memory budget; {ENV_WORKSPACE_HOLD} sets "
        "another): each runs its fastest measured point within it")


def set_workspace_slack(env: dict, slack: int | str | None, offload: bool | str) -> None:
    """``MUCUDNN_WORKSPACE_SLACK`` in ``env``: ``slack`` percent when given, unset for ``"off"``;
    with neither, under ``offload``, :data:`OFFLOAD_WORKSPACE_SLACK` unless ``env`` has one."""
    if slack == "off":
        env.pop(ENV_WORKSPACE_SLACK, None)
    elif slack is not None:
        env[ENV_WORKSPACE_SLACK] = str(slack)
    elif offload:
        env.setdefault(ENV_WORKSPACE_SLACK, str(OFFLOAD_WORKSPACE_SLACK))


def point_within(front, limit: int, slack: int):
    """The shim's point of ``front`` (entries by workspace ascending) under a workspace limit:
    the fastest within ``limit``, then its point of least workspace within ``slack`` percent of
    it (``mu_plan_lean_point``); None where no point fits."""
    under = [entry for entry in front if entry.workspace <= limit]
    if not under:
        return None
    fastest = min(under, key=lambda entry: entry.time_ms)
    within = fastest.time_ms * (1 + slack / 100)
    return next((entry for entry in under if entry.workspace < fastest.workspace
                 and entry.time_ms <= within), fastest)


def plan_workspace_limit(plans, slack: int) -> int | None:
    """The step's share of the slack: the least workspace limit at which the front plans'
    kernels, each at its point under the limit (:func:`point_within`), take at most ``slack``
    percent more time in total than with no limit; None where no limit binds (none lowers the
    largest point) or a plan is no front.

    Why: the slack alone picks per kernel, and a kernel whose leaner points are more than slack
    percent slower keeps its large workspace, although the step could pay for it elsewhere.
    Under a memory cap the largest workspace requests are what the caching allocator cannot
    place in the holes it has, so it maps more and, at the cap, flushes its cache (measured:
    benchmarks/results/pressure).
    A model whose kernels have no fast lean point gets no limit. Each
    kernel of a plan counts once (a plan does not say how often a step calls it), and its
    fastest point stands for the framework's engine (the shim's point is the fastest within that
    engine's workspace). The limit is the shim's hard one: it holds every convolution."""
    limits = []
    for plan in plans:
        fronts = [plan.front(key, n) for key, n in plan.kernels()]
        if not plan.is_front or not fronts:
            return None
        sizes = sorted({entry.workspace for front in fronts for entry in front})

        def total(limit):
            points = [point_within(front, limit, slack) for front in fronts]
            return None if None in points else sum(point.time_ms for point in points)

        unlimited_points = [point_within(front, sizes[-1], slack) for front in fronts]
        unlimited = sum(point.time_ms for point in unlimited_points)
        largest = max(point.workspace for point in unlimited_points)
        limit = next(size for size in sizes
                     if (t := total(size)) is not None and t <= unlimited * (1 + slack / 100))
        if limit >= largest:
            return None
        limits.append(limit)
    return max(limits) if limits else None


def set_plan_workspace_limit(env: dict, plan_paths, offload, say) -> None:
    """Under ``offload`` with front plans and a slack (``env``'s, after :func:`set_workspace_slack`)
    and no workspace limit given: ``MUCUDNN_WORKSPACE_LIMIT`` from :func:`plan_workspace_limit`,
    said in one line through ``say``."""
    slack = env.get(ENV_WORKSPACE_SLACK, "")
    # ASCII digits only, as the shim reads it: another value is the shim's to warn about
    if not (offload and plan_paths and slack.isascii() and slack.isdigit()) \
            or env.get("MUCUDNN_WORKSPACE_LIMIT"):
        return
    from .plan import read_plan
    limit = plan_workspace_limit([read_plan(path) for path in plan_paths], int(slack))
    if limit is not None:
        env["MUCUDNN_WORKSPACE_LIMIT"] = str(limit)
        say(f"mucudnn: workspace limit {describe_size(limit)} from the plan's fronts: its kernels "
            f"take at most {slack} % more time under it; it holds every convolution, planned or "
            "not (--workspace-limit sets another)")
