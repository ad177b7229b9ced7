"""The benchmarker's bookkeeping without a GPU: which sizes and APIs are still to be timed, and the
beta micro-batches are timed with."""

from __future__ import annotations

import pytest

from mucudnn.bench import backward_filter_beta, missing_apis
from mucudnn.engines import Api
from mucudnn.measurement import Measurement, Status
from mucudnn.problem import ConvProblem, Direction

FWD = ConvProblem(Direction.FORWARD, c=8, input_size=(9, 9), k=8, filter_size=(3, 3),
                  padding=(1, 1), stride=(1, 1), dilation=(1, 1), n=8)
BOTH = frozenset(Api)


def row(batch: int, algo: str, status: Status = Status.OK) -> Measurement:
    return Measurement(FWD.key, batch, algo, "fma", 1.0, 0, status)


def test_a_size_counts_as_measured_per_api():
    rows = [row(1, "gemm"), row(1, "eng0"), row(2, "gemm"), row(4, "eng3.k2=1")]
    assert missing_apis(rows, [1, 2, 4, 8], BOTH) == {
        2: {Api.GRAPH}, 4: {Api.LEGACY}, 8: BOTH}
    assert missing_apis(rows, [1, 2, 4, 8], {Api.LEGACY}) == {4: {Api.LEGACY}, 8: {Api.LEGACY}}
    assert missing_apis(rows, [1, 4], {Api.GRAPH}) == {}


def test_refused_rows_count_as_measured():
    rows = [row(2, "fft", Status.NOT_SUPPORTED), row(2, "eng9", Status.FAILED)]
    assert missing_apis(rows, [2], BOTH) == {}


@pytest.mark.parametrize("direction, n, beta", [
    (Direction.BACKWARD_FILTER, 4, 1.0), (Direction.BACKWARD_FILTER, 8, 0.0),
    (Direction.FORWARD, 4, 0.0), (Direction.BACKWARD_DATA, 1, 0.0),
])
def test_backward_filter_micro_batches_are_timed_accumulating(direction, n, beta):
    assert backward_filter_beta(FWD.with_direction(direction).with_n(n), full_n=8) == beta
