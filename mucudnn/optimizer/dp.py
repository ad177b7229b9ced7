"""Per-kernel planning: the workspace-reuse (WR) dynamic program and the Pareto fronts WD needs.

Both work on one kernel's measurements: for each candidate micro-batch size (see
:func:`candidate_sizes`), the successful rows say how long each (algorithm, math type) takes and
how much workspace it needs. A plan for ``n`` is a multiset of pieces whose sizes add up to ``n``;
its time is the sum of the pieces' times and its workspace the largest piece's.

Both programs use the same recursion over ``b = 1..n``: a plan for ``b`` is a first piece of some
candidate size ``s <= b`` followed by a plan for ``b - s``. Both enumerate sizes largest first and
break ties the same way, so in exact arithmetic the fastest plan of :func:`pareto_plans` *is*
:func:`best_plan` with no limit. (Measured times are floats: sums that differ only in rounding may
order differently from their exact values.)
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from typing import Iterable, NamedTuple, Sequence

from ..errors import InfeasibleError, MissingMeasurementsError
from ..measurement import Measurement
from ._text import describe_bytes, describe_sizes
from .kernel_plan import KernelPlan, Piece, Policy, candidate_sizes


class _Chain(NamedTuple):
    """A partial plan as a linked list: ``piece`` then the plan ``rest`` (``None`` ends it)."""

    time_ms: float
    workspace: int
    count: int
    piece: Piece | None
    rest: "_Chain | None"

    def prepend(self, piece: Piece) -> "_Chain":
        """``piece`` then this plan; a borrowing piece leaves the caller's workspace as it is."""
        workspace = self.workspace if piece.borrow else max(piece.workspace, self.workspace)
        return _Chain(piece.time_ms + self.time_ms, workspace, self.count + 1, piece, self)

    def pieces(self) -> list[Piece]:
        chain: _Chain | None = self
        pieces = []
        while chain is not None and chain.piece is not None:
            pieces.append(chain.piece)
            chain = chain.rest
        return pieces


_EMPTY = _Chain(0.0, 0, 0, None, None)


def _rank(chain: _Chain) -> tuple[float, int, int]:
    """Plans compare by time, then workspace, then piece count (fewer launches)."""
    return chain.time_ms, chain.workspace, chain.count


def _option_order(piece: Piece) -> tuple:
    """Order of the pieces measured at one size: fastest first, names settle exact ties."""
    return piece.time_ms, piece.workspace, piece.algo, piece.math.value


def _plan_order(piece: Piece) -> tuple:
    """Order of the pieces inside a plan: largest first, then by name."""
    return -piece.batch, piece.algo, piece.math.value, piece.time_ms, piece.workspace


@dataclasses.dataclass(frozen=True)
class _Table:
    """One kernel's usable measurements at the candidate sizes of ``policy`` for ``n``."""

    key: str
    n: int
    policy: Policy
    options: dict[int, list[Piece]]  # candidate size -> its pieces in _option_order (non-empty)

    def fitting(self, limit: int | None) -> dict[int, list[Piece]]:
        """Sizes that have pieces needing at most ``limit`` bytes, with just those pieces."""
        if limit is None:
            return self.options
        fitting = {}
        for size, pieces in self.options.items():
            within = [piece for piece in pieces if piece.workspace <= limit]
            if within:
                fitting[size] = within
        return fitting

    def plan(self, chain: _Chain) -> KernelPlan:
        pieces = chain.pieces()
        if not any(piece.borrow for piece in pieces):  # else the chain's order is the run order
            pieces.sort(key=_plan_order)
        return KernelPlan(self.key, self.n, tuple(pieces))

    def infeasible(self, limit: int | None) -> InfeasibleError:
        smallest = min(piece.workspace for pieces in self.options.values() for piece in pieces)
        fitting_sizes = sorted(self.fitting(limit))
        if limit is None:
            bound = "at all"
            why = f"the measured sizes ({describe_sizes(fitting_sizes)}) cannot add up to {self.n}"
        else:
            bound = f"within the workspace limit of {describe_bytes(limit)}"
            why = (f"the sizes that fit ({describe_sizes(fitting_sizes)}) cannot add up to {self.n}"
                   if fitting_sizes else "no measured candidate size fits it")
        return InfeasibleError(
            f"kernel {self.key}, n={self.n}, policy {self.policy.value}: no plan {bound}: {why}; "
            f"the smallest workspace measured at a candidate size is {describe_bytes(smallest)}"
        )


def _read_table(measurements: Iterable[Measurement], n: int, policy: Policy | str) -> _Table:
    """Validate one kernel's rows and keep the successful ones at candidate sizes."""
    policy = Policy(policy)
    sizes = set(candidate_sizes(policy, n))
    rows = list(measurements)
    if policy is Policy.FIT:  # its extra sizes are whatever fit_sizes had measured
        sizes |= {row.batch for row in rows if row.batch <= n}
    if not rows:
        raise MissingMeasurementsError(f"no measurements given to plan n={n}")
    keys = sorted({row.key for row in rows})
    if len(keys) > 1:
        raise ValueError(f"measurements of {len(keys)} kernels given, one expected: "
                         + "; ".join(keys))
    key = keys[0]
    options: dict[int, list[Piece]] = {}
    for row in rows:
        if not row.ok or row.batch not in sizes:
            continue
        if not (math.isfinite(row.time_ms) and row.time_ms >= 0 and row.workspace >= 0):
            raise ValueError(f"kernel {key}: measurement {row.algo}:{row.math.value} at batch "
                             f"{row.batch} has time {row.time_ms} ms and workspace "
                             f"{row.workspace} bytes; both must be finite and >= 0")
        piece = Piece(row.batch, row.algo, row.math, float(row.time_ms), int(row.workspace))
        options.setdefault(row.batch, []).append(piece)
    if not options:
        raise MissingMeasurementsError(
            f"kernel {key}, n={n}: no successful measurement at any candidate size of policy "
            f"{policy.value} ({describe_sizes(sizes)})"
        )
    for pieces in options.values():
        pieces.sort(key=_option_order)
    return _Table(key, n, policy, options)


def _check_limit(name: str, limit: int | None) -> None:
    if limit is not None and limit < 0:
        raise ValueError(f"{name} must be >= 0 bytes or None, got {limit}")


def best_plan(measurements: Iterable[Measurement], n: int, limit: int | None = None,
              policy: Policy | str = Policy.POWER_OF_TWO, borrow_sample_bytes: int = 0) -> KernelPlan:
    """The fastest plan for ``n`` samples whose every piece needs at most ``limit`` bytes (WR).

    ``measurements`` are one kernel's rows; only successful rows at candidate sizes of ``policy``
    count. ``limit=None`` means no limit. Of the fastest plans it returns one with the smallest
    workspace; ties beyond that are broken deterministically, whatever the order of the rows
    (fewer pieces at each step of the recursion, then larger pieces, then algorithm names).
    Pieces are listed largest first.

    ``borrow_sample_bytes`` > 0 (forward and backward-data: the output's bytes per sample) lets a
    piece over ``limit`` borrow the part of the output that the pieces after it will write: a
    piece of ``s`` samples with ``r`` samples after it may use ``r * borrow_sample_bytes`` bytes
    there. Such pieces are marked ``borrow``, leave the plan's workspace, and the pieces are then
    listed in the order they must run.

    Raises ``ValueError`` if the rows belong to several kernels, :class:`MissingMeasurementsError`
    if no usable row is at a candidate size, :class:`InfeasibleError` if no plan fits ``limit``.
    """
    _check_limit("limit", limit)
    if borrow_sample_bytes < 0:
        raise ValueError(f"borrow_sample_bytes must be >= 0, got {borrow_sample_bytes}")
    table = _read_table(measurements, n, policy)
    borrowing = borrow_sample_bytes > 0 and limit is not None
    # Without borrowing what fits does not depend on the samples still to run: pick once per size.
    fastest = {size: pieces[0] for size, pieces in table.fitting(limit).items()}
    sizes = sorted(table.options if borrowing else fastest, reverse=True)
    best: list[_Chain | None] = [None] * (n + 1)
    best[0] = _EMPTY
    for b in range(1, n + 1):
        for size in sizes:
            rest = best[b - size] if size <= b else None
            if rest is None:
                continue
            piece = (_borrowing_piece(table.options[size], limit, (b - size) * borrow_sample_bytes)
                     if borrowing else fastest[size])
            if piece is None:
                continue
            chain = rest.prepend(piece)
            current = best[b]
            if current is None or _rank(chain) < _rank(current):
                best[b] = chain
    if best[n] is None:
        raise table.infeasible(limit)
    return table.plan(best[n])


def _borrowing_piece(pieces: Sequence[Piece], limit: int, after: int) -> Piece | None:
    """The fastest of one size's ``pieces`` (fastest first) within ``max(limit, after)`` bytes,
    ``after`` being what the output after it holds; marked ``borrow`` if it needs more than
    ``limit``."""
    piece = next((p for p in pieces if p.workspace <= max(limit, after)), None)
    if piece is not None and piece.workspace > limit:
        piece = dataclasses.replace(piece, borrow=True)
    return piece


# A candidate plan while building a front: (time_ms, workspace, count, order, piece, rest). Plain
# tuples sort fast, and the unique ``order`` (enumeration order) means piece and rest are never
# compared: ties go to fewer pieces, then to the earlier candidate, as in best_plan.
_Candidate = tuple


def _extend(piece: Piece, rests: Sequence[_Chain], order: int) -> list[_Candidate]:
    """Candidates ``piece`` followed by each of ``rests``, numbered from ``order`` on."""
    return [(piece.time_ms + rest.time_ms, max(piece.workspace, rest.workspace), rest.count + 1,
             order + i, piece, rest) for i, rest in enumerate(rests)]


def _prune(candidates: list[_Candidate]) -> list[_Chain]:
    """The Pareto front of ``candidates`` by (time, workspace), as chains by workspace ascending."""
    candidates.sort()
    front: list[_Chain] = []
    for time_ms, workspace, count, _, piece, rest in candidates:
        if not front or workspace < front[-1].workspace:
            front.append(_Chain(time_ms, workspace, count, piece, rest))
    front.reverse()
    return front


def pareto_plans(measurements: Iterable[Measurement], n: int,
                 policy: Policy | str = Policy.POWER_OF_TWO,
                 max_workspace: int | None = None) -> list[KernelPlan]:
    """Every plan for ``n`` that no other plan beats on both time and workspace.

    Sorted by workspace ascending, so time strictly decreases along the list: the last plan is
    :func:`best_plan` with no limit, and the fastest plan with workspace <= L is as fast as
    ``best_plan(limit=L)``. ``max_workspace`` drops plans above that many bytes (and speeds the
    search up). Errors as :func:`best_plan`.
    """
    _check_limit("max_workspace", max_workspace)
    table = _read_table(measurements, n, policy)
    singles = {size: _prune([_extend(piece, [_EMPTY], order)[0]
                             for order, piece in enumerate(pieces)])
               for size, pieces in table.fitting(max_workspace).items()}
    sizes = sorted(singles, reverse=True)
    fronts: list[list[_Chain]] = [[] for _ in range(n + 1)]
    fronts[0] = [_EMPTY]
    for b in range(1, n + 1):
        candidates: list[_Candidate] = []
        for size in sizes:
            rests = fronts[b - size] if size <= b else []
            if not rests:
                continue
            rest_workspaces = [rest.workspace for rest in rests]
            for single in singles[size]:
                piece = single.piece
                # Rests no larger than this piece all give the piece's workspace, so of those only
                # the fastest (the last of them) can be on the front.
                hidden = bisect.bisect_right(rest_workspaces, piece.workspace)
                candidates += _extend(piece, rests[max(hidden - 1, 0):], len(candidates))
        fronts[b] = _prune(candidates)
    if not fronts[n]:
        raise table.infeasible(max_workspace)
    return [table.plan(chain) for chain in fronts[n]]


#: What a front plan keeps of a kernel's Pareto front (:func:`thin_front`): a point must be at
#: least this much faster (relative) than the best kept point with less workspace ...
FRONT_MIN_GAIN = 0.02
#: ... and a kernel keeps at most this many points.
FRONT_MAX_POINTS = 6


def thin_front(front: Sequence[KernelPlan], min_gain: float = FRONT_MIN_GAIN,
               max_points: int = FRONT_MAX_POINTS) -> list[KernelPlan]:
    """The points of a Pareto front (workspace ascending, as :func:`pareto_plans` gives) worth a
    plan file's line: what a framework's fallback on a smaller workspace can use.

    A call with workspace ``w`` runs the fastest kept point within ``w``, so a dropped point costs
    the calls between its workspace and the next kept point's the time of the best kept point
    with less workspace. The rule:

    - the fastest point (the last) is kept, and so is the smallest (a call with less workspace has
      no point at all);
    - going up from the smallest, a point is kept only if it is at least ``min_gain`` faster than
      the best kept point with less workspace (the last kept one): a call never loses more than
      ``min_gain`` to a dropped point;
    - while more than ``max_points`` are kept, the kept point between the two ends that gains
      least over the kept point below it is dropped (the first such on a tie).

    Returns the kept points, workspace ascending (so time strictly decreasing).
    """
    if max_points < 2:
        raise ValueError(f"max_points must be >= 2 (the smallest and the fastest), got {max_points}")
    if len(front) <= 1:
        return list(front)
    kept = [front[0]]
    for plan in front[1:-1]:
        if plan.time_ms <= (1.0 - min_gain) * kept[-1].time_ms:
            kept.append(plan)
    kept.append(front[-1])
    while len(kept) > max_points:
        # Least gain = largest time / time of the point below (> 0: times strictly decrease).
        weakest = max(range(1, len(kept) - 1),
                      key=lambda i: (kept[i].time_ms / kept[i - 1].time_ms, -i))
        del kept[weakest]
    return kept
