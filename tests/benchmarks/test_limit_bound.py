"""benchmarks/limit_bound.py's estimates on small hand-made kernels."""

import sys
from pathlib import Path

import pytest

from mucudnn.measurement import Measurement
from mucudnn.problem import ConvProblem, Direction, MathType

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import limit_bound  # noqa: E402

PROBLEM = ConvProblem(Direction.FORWARD, c=8, input_size=(10, 10), k=16, filter_size=(3, 3),
                      padding=(1, 1), stride=(1, 1), dilation=(1, 1), n=4)


def row(batch, algo, time_ms, workspace):
    return Measurement(key=PROBLEM.key, batch=batch, algo=algo, math=MathType.FMA,
                       time_ms=time_ms, workspace=workspace)


ROWS = [row(2, "big", 0.6, 100), row(1, "small", 0.5, 0)]


def test_borrowing_lets_an_early_piece_use_the_unwritten_output():
    # 2 samples first, with 2 samples of output (100 bytes) still unwritten after it: "big" fits
    assert limit_bound.borrow_estimate(ROWS, 4, limit=10, per_sample=50) == pytest.approx(1.6)
    # ...but not with only 1 sample left, so at most one "big" piece, and never without borrowing
    assert limit_bound.borrow_estimate(ROWS, 3, limit=10, per_sample=50) == pytest.approx(1.5)
    assert limit_bound.borrow_estimate(ROWS, 4, limit=10, per_sample=0) == pytest.approx(2.0)
    assert limit_bound.borrow_estimate(ROWS, 4, limit=100, per_sample=0) == pytest.approx(1.2)


def test_only_forward_and_backward_data_write_a_tensor_they_can_borrow():
    y_bytes = 16 * 10 * 10 * 4
    assert limit_bound.output_bytes_per_sample(PROBLEM) == y_bytes
    x_bytes = 8 * 10 * 10 * 4
    assert limit_bound.output_bytes_per_sample(PROBLEM.with_direction(Direction.BACKWARD_DATA)) == x_bytes
    assert limit_bound.output_bytes_per_sample(PROBLEM.with_direction(Direction.BACKWARD_FILTER)) == 0
