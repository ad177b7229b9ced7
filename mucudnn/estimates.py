"""Estimates from stored measurements of what was not measured (used by ``benchmarks/``).

A configuration (algorithm, math type) is measured at a few micro-batch sizes; between two of
them its time per sample is taken as log-linear in the size and its workspace as linear (the
workspace model is the optimizer's: :mod:`mucudnn.optimizer.kernel_plan`). These estimates bound
what measuring every size could give; plans are only ever made from measured rows.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Iterable

from .measurement import Measurement
from .optimizer.kernel_plan import _workspace_between, largest_fitting_size
from .problem import ConvProblem, MathType


def by_config(rows: Iterable[Measurement]) -> dict[tuple[str, MathType], dict[int, Measurement]]:
    """OK rows by configuration (algorithm, math type), then by size."""
    grouped: dict[tuple[str, MathType], dict[int, Measurement]] = collections.defaultdict(dict)
    for row in rows:
        if row.ok:
            grouped[(row.algo, row.math)][row.batch] = row
    return grouped


def per_sample_ms(at: dict[int, Measurement], size: int) -> float:
    """One configuration's time per sample at ``size``: measured, or log-linear between the
    measured sizes around it. ValueError when ``size`` is outside the measured ones (no
    extrapolation)."""
    if size in at:
        return at[size].time_ms / size
    below = [b for b in at if b < size]
    above = [b for b in at if b > size]
    if not below or not above:
        raise ValueError(f"size {size} is outside the measured sizes {sorted(at)}")
    small, large = max(below), min(above)
    f = math.log(size / small) / math.log(large / small)
    return math.exp((1 - f) * math.log(at[small].time_ms / small)
                    + f * math.log(at[large].time_ms / large))


def fit_estimate(rows: Iterable[Measurement], n: int, limit: int) -> float:
    """The best time for ``n`` samples of any configuration run at its largest size whose
    (linearly interpolated) workspace fits ``limit``, its per-sample time interpolated
    (:func:`per_sample_ms`): what policy ``all`` could reach without measuring every size.
    ``inf`` when no configuration fits."""
    best = math.inf
    for at in by_config(rows).values():
        size = largest_fitting_size({b: r.workspace for b, r in at.items()}, limit)
        if size is not None:
            best = min(best, per_sample_ms(at, size) * n)
    return best


def every_size(rows: Iterable[Measurement], n: int) -> list[Measurement]:
    """Policy ``all`` estimated: for every configuration, a row at each size from its smallest
    to its largest measured one (at most ``n``), the measured rows as they are and the others
    with time per sample log-linear and workspace linear between the measured sizes around them.
    """
    out = []
    for (algo, math_type), at in by_config(rows).items():
        sizes = sorted(at)
        workspace_at = {b: r.workspace for b, r in at.items()}
        for size in range(sizes[0], min(sizes[-1], n) + 1):
            out.append(at[size] if size in at else Measurement(
                at[sizes[0]].key, size, algo, math_type, per_sample_ms(at, size) * size,
                int(_workspace_between(workspace_at, size))))
    return out


def geometry(key: str) -> str:
    """A kernel key with its math type left out, so kernels match across math types (shipped
    configs say ``fma``, TF32 recordings ``default``). Raises KeyFormatError for a bad key."""
    problem = ConvProblem.from_key(key)
    return problem.key.replace(f"math={problem.math.value},", "math=*,", 1)
