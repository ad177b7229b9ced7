"""What the optimizer produces: a kernel's mini-batch split into micro-batch pieces.

A :class:`KernelPlan` runs its pieces one after another over consecutive slices of the
mini-batch, all in one workspace buffer, so its time is the sum of the pieces' times and its
workspace the largest piece's workspace, leaving out pieces that borrow the output's unwritten
part as their workspace (``Piece.borrow``).
"""

from __future__ import annotations

import dataclasses
import math

from ..plan import PlanEntry, PlanPiece
from ..policy import Policy  # noqa: F401 (re-exported: mucudnn.optimizer.Policy)


def candidate_sizes(policy: Policy | str, n: int) -> list[int]:
    """The micro-batch sizes ``policy`` needs measured for a mini-batch of ``n``, ascending
    (``fit`` plans may use any other measured size too)."""
    policy = Policy(policy)
    if n < 1:
        raise ValueError(f"mini-batch size n must be >= 1, got {n}")
    if policy is Policy.UNDIVIDED:
        return [n]
    if policy is Policy.ALL:
        return list(range(1, n + 1))
    powers = {1 << i for i in range(n.bit_length()) if 1 << i <= n}
    return sorted(powers | {n})


def largest_fitting_size(workspace_at: dict[int, int], limit: int) -> int | None:
    """The largest batch size whose workspace is within ``limit``, for one configuration measured
    at the sizes of ``workspace_at`` (size -> bytes): between two measured sizes the workspace is
    taken as linear. None if no measured size fits; a measured size if the next one fits too."""
    sizes = sorted(workspace_at)
    best = None
    for small, large in zip(sizes, sizes[1:] + [None]):
        if workspace_at[small] > limit:
            break
        best = small
        if large is None or workspace_at[large] <= limit:
            continue
        per_sample = (workspace_at[large] - workspace_at[small]) / (large - small)
        best = min(large - 1, small + int((limit - workspace_at[small]) // per_sample))
        break
    return best


def fit_sizes(rows, n: int, limit: int, borrow_sample_bytes: int = 0) -> list[int]:
    """The sizes policy ``fit`` adds for a kernel at ``n``: each configuration's (algorithm and
    math type) :func:`largest_fitting_size` from its OK ``rows`` (Measurements), where that is not
    a power of two already, ascending.

    With ``borrow_sample_bytes`` (plans whose pieces may borrow the output after them, see
    ``best_plan``), also the :func:`borrowing_sizes` of the configurations within
    ``BORROW_SPEED_FACTOR`` of the fastest at ``n`` samples: only fast ones are worth borrowing for,
    and each adds a dozen sizes."""
    by_config: dict[tuple, dict[int, int]] = {}
    at_n: dict[tuple, float] = {}
    for row in rows:
        if row.ok and row.batch <= n:
            by_config.setdefault((row.algo, row.math), {})[row.batch] = row.workspace
            if row.batch == n:
                at_n[(row.algo, row.math)] = row.time_ms
    base = set(candidate_sizes(Policy.POWER_OF_TWO, n))
    found = {largest_fitting_size(sizes, limit) for sizes in by_config.values()}
    if borrow_sample_bytes and at_n:
        fastest = min(at_n.values())
        for config, time_ms in at_n.items():
            if time_ms <= BORROW_SPEED_FACTOR * fastest:
                found.update(borrowing_sizes(by_config[config], n, limit, borrow_sample_bytes))
    return sorted(found - base - {None})


#: fit_sizes measures borrowing sizes for configurations at most this much slower than the
#: fastest at the full mini-batch.
BORROW_SPEED_FACTOR = 1.1


def _workspace_between(workspace_at: dict[int, int], size: int) -> float | None:
    """Workspace at ``size``, linear between the measured sizes around it (None outside them)."""
    if size in workspace_at:
        return workspace_at[size]
    below = [b for b in workspace_at if b < size]
    above = [b for b in workspace_at if b > size]
    if not below or not above:
        return None
    small, large = max(below), min(above)
    return workspace_at[small] + (workspace_at[large] - workspace_at[small]) * (size - small) / (large - small)


def borrowing_sizes(workspace_at: dict[int, int], n: int, limit: int, sample_bytes: int) -> list[int]:
    """For one configuration measured at the sizes of ``workspace_at``: the pieces it would run as
    the first of ``n`` samples, then of what is left, and so on, each as large as fits
    ``max(limit, samples after it * sample_bytes)``, while that room is over ``limit``."""
    sizes, left = [], n
    while left > 1:
        for size in range(left - 1, 0, -1):
            workspace = _workspace_between(workspace_at, size)
            if workspace is not None and workspace <= max(limit, (left - size) * sample_bytes):
                break
        else:
            break  # nothing of this configuration fits
        if workspace <= limit:
            break  # from here on the room is the limit: largest_fitting_size's size
        sizes.append(size)
        left -= size
    return sizes


@dataclasses.dataclass(frozen=True)
class Piece(PlanPiece):
    """A plan-file piece (``B:ALGO:MATH``) with what its algorithm measured at micro-batch size
    ``batch``: ``time_ms`` and ``workspace``."""

    time_ms: float
    workspace: int

    def plan_piece(self) -> PlanPiece:
        """The piece as the plan file holds it, without the measurements."""
        return PlanPiece(self.batch, self.algo, self.math, borrow=self.borrow)


@dataclasses.dataclass(frozen=True)
class KernelPlan:
    """How to run kernel ``key`` at mini-batch size ``n``: pieces whose batches add up to ``n``."""

    key: str
    n: int
    pieces: tuple[Piece, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "pieces", tuple(self.pieces))
        if not self.pieces:
            raise ValueError(f"kernel {self.key} n={self.n}: a plan needs at least one piece")
        total = sum(piece.batch for piece in self.pieces)
        if total != self.n:
            raise ValueError(
                f"kernel {self.key} n={self.n}: piece batches add up to {total}, not {self.n}"
            )

    @property
    def time_ms(self) -> float:
        """Predicted time: the pieces run one after another (exactly rounded sum)."""
        return math.fsum(piece.time_ms for piece in self.pieces)

    @property
    def workspace(self) -> int:
        """Bytes of the caller's workspace needed: the pieces share one buffer, so the largest
        workspace of a piece that does not borrow (0 if all borrow)."""
        return max((piece.workspace for piece in self.pieces if not piece.borrow), default=0)


    @property
    def is_divided(self) -> bool:
        return len(self.pieces) > 1

    def plan_entry(self) -> PlanEntry:
        """The plan file's ``kernel`` line for this plan. The optimizer depends on the plan file's
        types, never the other way round."""
        return PlanEntry(key=self.key, n=self.n, workspace=self.workspace, time_ms=self.time_ms,
                         pieces=tuple(piece.plan_piece() for piece in self.pieces))

    def __str__(self) -> str:
        pieces = " ".join(str(piece) for piece in self.pieces)
        return f"{self.key} n={self.n}: {self.time_ms:.4f} ms, {self.workspace} B, {pieces}"
