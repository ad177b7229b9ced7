"""The benchmarker's bookkeeping without a GPU: which sizes and APIs are still to be timed, the
beta micro-batches are timed with, and which configurations a probe is enough for."""

from __future__ import annotations

import types

import pytest

from mucudnn.bench import Frontier, backward_filter_beta, missing_apis
from mucudnn.engines import Api, format_numerical_notes, is_transform_based, numerical_notes
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


# -- pruning dominated configurations ---------------------------------------------------------------

FULL, CUT = types.SimpleNamespace(cut_short=False), types.SimpleNamespace(cut_short=True)


def timed_row(algo: str, time_ms: float, workspace: int, note: str = "") -> Measurement:
    return Measurement(FWD.key, 4, algo, "fma", time_ms, workspace, Status.OK, note)


def test_a_configuration_is_dominated_by_a_faster_one_with_no_more_workspace():
    frontier = Frontier(2.0)
    assert frontier.cutoff_ms(1 << 30) is None  # nothing timed yet: time fully
    frontier.add(timed_row("implicit_gemm", 3.0, 0), FULL)
    frontier.add(timed_row("implicit_precomp_gemm", 1.0, 1000), FULL)
    assert frontier.cutoff_ms(0) == 6.0
    assert frontier.cutoff_ms(999) == 6.0  # the 1 ms one needs more workspace: no help
    assert frontier.cutoff_ms(1000) == 2.0
    assert Frontier(None).cutoff_ms(0) is None


def test_cut_short_and_transform_rows_set_no_cutoff():
    frontier = Frontier(2.0)
    frontier.add(timed_row("fft", 0.5, 0), FULL)  # `tune --precise` may drop it
    frontier.add(timed_row("eng7", 0.5, 0, format_numerical_notes(["fft"])), FULL)
    frontier.add(timed_row("gemm", 0.8, 0), CUT)  # a probe only
    assert frontier.cutoff_ms(0) is None
    frontier.add(timed_row("eng3", 0.9, 0, format_numerical_notes(["tensor_core"])), FULL)
    assert frontier.cutoff_ms(0) == 1.8


def test_cut_short_rows_say_so_and_keep_their_numerical_notes():
    frontier = Frontier(2.0)
    assert frontier.note(FULL, "numerical notes: fft") == "numerical notes: fft"
    legacy = frontier.note(CUT)
    assert legacy.startswith("timed once: over 2x")
    engine = frontier.note(CUT, format_numerical_notes(["fft", "tensor_core"]))
    assert engine.endswith(legacy)
    assert is_transform_based(timed_row("eng7", 9.0, 0, engine))
    assert numerical_notes(engine) == {"fft", "tensor_core"}
