"""What the optimizer produces: a kernel's mini-batch split into micro-batch pieces.

A :class:`KernelPlan` runs its pieces one after another over consecutive slices of the
mini-batch, all in one workspace buffer, so its time is the sum of the pieces' times and its
workspace the largest piece's workspace.
"""

from __future__ import annotations

import dataclasses
import enum
import math

from ..plan import PlanPiece


class Policy(str, enum.Enum):
    """Which micro-batch sizes a plan for a mini-batch of ``n`` may use."""

    UNDIVIDED = "undivided"       # {n}: what cuDNN does on its own
    POWER_OF_TWO = "powerOfTwo"   # {1, 2, 4, ...} up to n, and n itself
    ALL = "all"                   # {1, ..., n}


def candidate_sizes(policy: Policy | str, n: int) -> list[int]:
    """The micro-batch sizes ``policy`` allows for a mini-batch of ``n``, ascending."""
    policy = Policy(policy)
    if n < 1:
        raise ValueError(f"mini-batch size n must be >= 1, got {n}")
    if policy is Policy.UNDIVIDED:
        return [n]
    if policy is Policy.ALL:
        return list(range(1, n + 1))
    powers = {1 << i for i in range(n.bit_length()) if 1 << i <= n}
    return sorted(powers | {n})


@dataclasses.dataclass(frozen=True)
class Piece(PlanPiece):
    """A plan-file piece (``B:ALGO:MATH``) with what its algorithm measured at micro-batch size
    ``batch``: ``time_ms`` and ``workspace``."""

    time_ms: float
    workspace: int


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
        """Bytes needed: the pieces share one buffer, so the largest piece's workspace."""
        return max(piece.workspace for piece in self.pieces)

    @property
    def is_divided(self) -> bool:
        return len(self.pieces) > 1

    def __str__(self) -> str:
        pieces = " ".join(str(piece) for piece in self.pieces)
        return f"{self.key} n={self.n}: {self.time_ms:.4f} ms, {self.workspace} B, {pieces}"
