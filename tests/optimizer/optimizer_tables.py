"""Random timing tables and brute-force reference answers for the optimizer tests.

Times are multiples of 1/16 ms by default, so every sum of them is exact in floating point and the
tests can compare times (and tie-breaking) exactly.
"""

from __future__ import annotations

import itertools
from typing import Iterable, Sequence

import numpy as np
from hypothesis import strategies as st

from mucudnn.measurement import Measurement, Status
from mucudnn.optimizer import KernelPlan, Piece, Policy, candidate_sizes

KEY = ("dir=fwd,dt=f32,ct=f32,math=fma,layout=nchw,c=64,in=56x56,k=64,f=3x3,pad=1x1,"
       "stride=1x1,dil=1x1,g=1,mode=xcorr")
KIB = 1 << 10
MIB = 1 << 20

# Legacy algorithms and graph-API engine configurations alike: the optimizer sees only names.
ALGOS = (
    ("implicit_gemm", "fma"), ("implicit_precomp_gemm", "fma"), ("gemm", "fma"),
    ("fft_tiling", "fma"), ("winograd_nonfused", "tensor_op"),
    ("implicit_precomp_gemm", "tensor_op"), ("eng0", "fma"), ("eng12.k3=1.k11=-1", "fma"),
)
# Workspace as a function of the micro-batch size b, in KiB; "linear" is IMPLICIT_PRECOMP_GEMM-like.
WORKSPACE_SHAPES = ("none", "constant", "linear", "random")

exact_times = st.integers(1, 4000).map(lambda k: k / 16)
float_times = st.floats(0.001, 250.0, allow_nan=False, allow_infinity=False)


@st.composite
def timing_tables(draw, policy: Policy, max_n: int, times=exact_times):
    """``(n, rows)``: one kernel's measurements, some sizes missing, some rows not OK.

    Failed rows and rows at sizes the policy does not allow are made irresistibly fast and free,
    so an optimizer that does not ignore them gives itself away.
    """
    n = draw(st.integers(1, max_n))
    sizes = candidate_sizes(policy, n)
    stray_sizes = sorted(set(range(1, n + 2)) - set(sizes))
    algos = draw(st.lists(st.sampled_from(ALGOS), min_size=1, max_size=4, unique=True))
    rows = []
    for algo, math in algos:
        shape = draw(st.sampled_from(WORKSPACE_SHAPES))
        scale = draw(st.integers(1, 64)) * KIB
        # Time proportional to b makes split and unsplit plans equally fast: ties to break.
        per_sample = draw(st.one_of(st.none(), times))
        for b in sizes:
            if draw(st.integers(0, 9)) == 0:
                continue  # not measured at this size
            workspace = {"none": 0, "constant": scale, "linear": scale * b,
                         "random": draw(st.integers(0, 64)) * KIB}[shape]
            status = draw(st.sampled_from((Status.OK,) * 5 + (Status.NOT_SUPPORTED, Status.FAILED)))
            if status is Status.OK:
                time_ms = draw(times) if per_sample is None else per_sample * b
                rows.append(Measurement(KEY, b, algo, math, time_ms, workspace))
            else:
                rows.append(Measurement(KEY, b, algo, math, 1 / 1024, 0, status, "bait"))
        if stray_sizes and draw(st.booleans()):
            stray = draw(st.sampled_from(stray_sizes))
            rows.append(Measurement(KEY, stray, algo, math, 1 / 1024, 0))
    return n, draw(st.permutations(rows))


# Small enough for brute force: every partition of n into candidate sizes is enumerated.
SMALL_TABLES = {
    Policy.ALL: timing_tables(Policy.ALL, max_n=12),
    Policy.POWER_OF_TWO: timing_tables(Policy.POWER_OF_TWO, max_n=64),
    Policy.UNDIVIDED: timing_tables(Policy.UNDIVIDED, max_n=64),
}


def workspace_limits(rows: Sequence[Measurement], unlimited: bool = True):
    """A measured workspace (the boundary case), any number of bytes, or (if allowed) None."""
    workspaces = sorted({row.workspace for row in rows}) or [0]
    limits = st.one_of(st.sampled_from(workspaces), st.integers(0, 2 * max(workspaces)))
    return st.one_of(st.none(), limits) if unlimited else limits


def usable_rows(rows: Iterable[Measurement], policy: Policy, n: int,
                limit: int | None = None) -> list[Measurement]:
    """The rows a plan may use: OK, at a candidate size, within ``limit``."""
    sizes = set(candidate_sizes(policy, n))
    return [row for row in rows if row.ok and row.batch in sizes
            and (limit is None or row.workspace <= limit)]


def partitions(n: int, sizes: Sequence[int]) -> list[dict[int, int]]:
    """Every multiset of ``sizes`` adding up to ``n``, as {size: count}."""
    sizes = sorted(set(sizes), reverse=True)
    found: list[dict[int, int]] = []

    def extend(remaining: int, index: int, counts: dict[int, int]) -> None:
        if remaining == 0:
            found.append(dict(counts))
            return
        for i in range(index, len(sizes)):
            size = sizes[i]
            if size <= remaining:
                counts[size] = counts.get(size, 0) + 1
                extend(remaining - size, i, counts)
                counts[size] -= 1
                if not counts[size]:
                    del counts[size]

    extend(n, 0, {})
    return found


def brute_force_points(rows: Iterable[Measurement], policy: Policy, n: int,
                       limit: int | None = None) -> np.ndarray:
    """(time, workspace) points, one row each, that together dominate every plan for ``n``.

    For every partition of ``n`` into measured sizes and every workspace threshold W, each piece
    takes the fastest row with workspace <= W. Any plan is dominated by the point of its own
    partition at W = its workspace, and every point is a real plan. Empty when no plan exists.
    """
    usable = usable_rows(rows, policy, n, limit)
    sizes = sorted({row.batch for row in usable})
    parts = partitions(n, sizes)
    if not parts:
        return np.empty((0, 2))
    counts = np.array([[part.get(size, 0) for size in sizes] for part in parts], dtype=float)
    points = []
    for threshold in sorted({row.workspace for row in usable}):
        best_time = np.full(len(sizes), np.inf)
        best_workspace = np.zeros(len(sizes))
        for row in usable:
            if row.workspace > threshold:
                continue
            i = sizes.index(row.batch)
            if (row.time_ms, row.workspace) < (best_time[i], best_workspace[i]):
                best_time[i], best_workspace[i] = row.time_ms, row.workspace
        present = counts > 0
        feasible = ~(present & np.isinf(best_time)).any(axis=1)
        times = (counts * np.where(np.isinf(best_time), 0, best_time)).sum(axis=1)
        workspaces = np.where(present, best_workspace, -1).max(axis=1)
        points.append(np.column_stack([times, workspaces])[feasible])
    return np.concatenate(points)


def lexicographic_min(points: np.ndarray) -> tuple[float, float]:
    order = np.lexsort((points[:, 1], points[:, 0]))
    return tuple(points[order[0]])


def assert_plan_is_measured(plan: KernelPlan, rows: Iterable[Measurement], policy: Policy,
                            limit: int | None = None) -> None:
    """Every piece is an OK row at a candidate size within ``limit``, with that row's numbers."""
    allowed = {(row.batch, row.algo, row.math, row.time_ms, row.workspace)
               for row in usable_rows(rows, policy, plan.n, limit)}
    assert plan.key == KEY
    assert sum(piece.batch for piece in plan.pieces) == plan.n
    for piece in plan.pieces:
        assert (piece.batch, piece.algo, piece.math, piece.time_ms, piece.workspace) in allowed


def fronts_of(plans_per_kernel: Sequence[Sequence[tuple[float, int]]], n: int = 8
              ) -> dict[str, list[KernelPlan]]:
    """Kernel label -> single-piece plans with the given (time, workspace) pairs."""
    fronts = {}
    for k, options in enumerate(plans_per_kernel):
        key = KEY.replace("c=64", f"c={k + 1}")
        fronts[f"{key} {n}"] = [
            KernelPlan(key, n, (Piece(n, algo, math, time, workspace),))
            for (time, workspace), (algo, math) in zip(options, itertools.cycle(ALGOS))
        ]
    return fronts
