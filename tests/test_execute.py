"""mucudnn.execute.PlanExecutor refuses what it cannot run as the shim does."""

from __future__ import annotations

import pytest

from mucudnn.errors import MucudnnError
from mucudnn.execute import PlanExecutor
from mucudnn.plan import PlanEntry, PlanPiece
from mucudnn.problem import ConvProblem, Direction, MathType


class _NoCudnn:
    """Fails the test if the executor reaches the bindings: the refusal comes first."""

    def __getattr__(self, name):
        raise AssertionError(f"cudnn.{name} used before the borrowing pieces were refused")


def test_borrowing_pieces_are_refused_by_name():
    key = ConvProblem(Direction.FORWARD, n=4, c=8, input_size=(8, 8), k=8, filter_size=(3, 3),
                      padding=(1, 1), stride=(1, 1), dilation=(1, 1)).key
    entry = PlanEntry(key, 4, 0, 1.0, (PlanPiece(2, "gemm", MathType.FMA, borrow=True),
                                       PlanPiece(2, "gemm", MathType.FMA)))
    with pytest.raises(MucudnnError, match=r"N=4: piece 1 \(2:gemm:fma:out\) borrows the output"):
        PlanExecutor(_NoCudnn(), None, entry)
