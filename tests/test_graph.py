"""The graph-API bindings without a GPU: enum values against cuDNN's header, alignment, and which
engine configurations the benchmarker times."""

from __future__ import annotations

import dataclasses
import re

import pytest

from mucudnn.cudnn.graph import (
    Attribute, AttributeType, DescriptorType, EngineCandidate, HeurMode, NumericalNote,
    byte_alignment, candidate_configs, is_usable,
)
from mucudnn.engines import EngineConfig
from mucudnn.errors import CudnnNotSupportedError
from mucudnn.problem import ConvProblem, DataType, Direction, MathType

PROBLEM = ConvProblem(Direction.FORWARD, c=16, input_size=(12, 12), k=24, filter_size=(3, 3),
                      padding=(1, 1), stride=(1, 1), dilation=(1, 1), n=8)


def graph_header_text() -> str:
    from mucudnn.errors import LibraryNotFoundError
    from mucudnn.shimlib import find_cudnn_include
    try:
        header = find_cudnn_include() / "cudnn_graph.h"
    except LibraryNotFoundError as exc:
        pytest.skip(str(exc))
    if not header.is_file():
        pytest.skip(f"{header} not found")
    return header.read_text(encoding="utf-8")


@pytest.mark.parametrize("enum_type, pattern", [
    (DescriptorType, "CUDNN_BACKEND_{}_DESCRIPTOR"), (AttributeType, "CUDNN_TYPE_{}"),
    (Attribute, "CUDNN_ATTR_{}"), (HeurMode, "CUDNN_HEUR_MODE_{}"),
    (NumericalNote, "CUDNN_NUMERICAL_NOTE_{}"),
])
def test_enum_values_match_the_cudnn_header(enum_type, pattern):
    text = graph_header_text()
    for member in enum_type:
        name = pattern.format(member.name)
        # deprecated enumerators carry a CUDNN_DEPRECATED_ENUM marker before the '='
        found = re.search(rf"\b{name}\s*(?:CUDNN_DEPRECATED_ENUM\s*)?=\s*(\d+)", text)
        assert found, f"{name} is not in cudnn_graph.h"
        assert int(found.group(1)) == member.value, name


@pytest.mark.parametrize("addresses, alignment", [
    ((), 16), ((0x7f0000000000,), 16), ((4096, 4100), 4), ((4096 + 8,), 8), ((2,), 2),
    ((1,), 1), ((32, 48, 64), 16), ((24,), 8),
])
def test_byte_alignment_is_the_largest_power_of_two_dividing_all(addresses, alignment):
    assert byte_alignment(*addresses) == alignment


# -- which configurations are timed ----------------------------------------------------------------

def candidate(index: int, *notes: NumericalNote, knobs=()) -> EngineCandidate:
    return EngineCandidate(EngineConfig.with_knobs(index, knobs), frozenset(notes), descriptor=None)


class StubGraph:
    """What candidate_configs uses of a ConvolutionGraph: the problem and heuristics per mode."""

    def __init__(self, problem: ConvProblem, results: dict) -> None:
        self.problem, self.results = problem, results

    def heuristics(self, mode: HeurMode) -> list[EngineCandidate]:
        found = self.results[mode]
        if isinstance(found, Exception):
            raise found
        return found


def names(candidates) -> list[str]:
    return [c.name for c in candidates]


def test_down_converting_engines_are_never_used():
    assert not is_usable(candidate(1, NumericalNote.DOWN_CONVERT_INPUTS), PROBLEM)
    assert is_usable(candidate(1, NumericalNote.FFT, NumericalNote.NONDETERMINISTIC), PROBLEM)


@pytest.mark.parametrize("dtype, math, usable", [
    (DataType.FLOAT, MathType.FMA, False), (DataType.FLOAT, MathType.TENSOR_OP, True),
    (DataType.FLOAT, MathType.DEFAULT, True), (DataType.HALF, MathType.FMA, True),
])
def test_tensor_core_engines_only_where_the_math_type_allows(dtype, math, usable):
    problem = dataclasses.replace(PROBLEM, dtype=dtype, math=math)
    assert is_usable(candidate(5, NumericalNote.TENSOR_CORE), problem) is usable


def test_heuristics_a_is_capped_and_fallback_adds_new_names():
    heuristic = [candidate(i, knobs=((3, i),)) for i in range(12)]
    fallback = [candidate(0, knobs=((3, 0),)), candidate(40), candidate(41)]
    graph = StubGraph(PROBLEM, {HeurMode.A: heuristic, HeurMode.FALLBACK: fallback})
    chosen = candidate_configs(graph, max_heuristic=4)
    assert names(chosen) == ["eng0.k3=0", "eng1.k3=1", "eng2.k3=2", "eng3.k3=3", "eng40", "eng41"]


def test_the_cap_counts_usable_configurations_only():
    heuristic = [candidate(1, NumericalNote.TENSOR_CORE), candidate(2),
                 candidate(3, NumericalNote.DOWN_CONVERT_INPUTS), candidate(4)]
    graph = StubGraph(PROBLEM, {HeurMode.A: heuristic,
                                HeurMode.FALLBACK: [candidate(9, NumericalNote.TENSOR_CORE)]})
    assert names(candidate_configs(graph, max_heuristic=2)) == ["eng2", "eng4"]


def test_a_refused_mode_contributes_nothing():
    refused = CudnnNotSupportedError("cudnnBackendFinalize", 3000, "CUDNN_STATUS_NOT_SUPPORTED")
    graph = StubGraph(PROBLEM, {HeurMode.A: refused, HeurMode.FALLBACK: [candidate(7)]})
    assert names(candidate_configs(graph)) == ["eng7"]


def test_both_modes_refused_raises_the_first_refusal():
    first = CudnnNotSupportedError("cudnnBackendFinalize", 3000, "first")
    second = CudnnNotSupportedError("cudnnBackendFinalize", 3000, "second")
    graph = StubGraph(PROBLEM, {HeurMode.A: first, HeurMode.FALLBACK: second})
    with pytest.raises(CudnnNotSupportedError, match="first"):
        candidate_configs(graph)


def test_candidate_note_text_names_each_note():
    found = candidate(3, NumericalNote.WINOGRAD_TILE_4x4, NumericalNote.TENSOR_CORE)
    assert found.note_text == "numerical notes: tensor_core, winograd_tile_4x4"
    assert candidate(3).note_text == "numerical notes: none"
