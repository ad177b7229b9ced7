"""Engine configuration names (docs/plan-format.md), the API a name belongs to, numerical notes."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mucudnn.engines import (
    INT32_MAX, INT64_MAX, INT64_MIN, MAX_KNOBS, TRANSFORM_NOTES, Api, EngineConfig, api_of,
    format_engine_name, format_numerical_notes, numerical_notes, parse_engine_name, select_apis,
)
from mucudnn.errors import EngineNameError, MucudnnError
from mucudnn.problem import ALGORITHMS

knob_values = st.integers(INT64_MIN, INT64_MAX)
engine_configs = st.builds(
    EngineConfig,
    global_index=st.one_of(st.integers(0, 200), st.integers(0, INT64_MAX)),
    knobs=st.dictionaries(st.integers(0, INT32_MAX), knob_values, max_size=MAX_KNOBS)
    .map(lambda knobs: tuple(sorted(knobs.items()))),
)


@given(engine_configs)
def test_names_round_trip(config):
    name = format_engine_name(config)
    assert parse_engine_name(name) == config
    assert str(config) == config.name == name
    assert api_of(name) is Api.GRAPH


@given(st.integers(0, 10**6), st.dictionaries(st.integers(0, 60), knob_values, max_size=8))
def test_knobs_in_any_order_get_one_name(index, knobs):
    shuffled = list(knobs.items())[::-1]
    config = EngineConfig.with_knobs(index, shuffled)
    assert config == EngineConfig(index, tuple(sorted(knobs.items())))
    assert parse_engine_name(config.name) == config


@pytest.mark.parametrize("name, config", [
    ("eng0", EngineConfig(0)),
    ("eng12.k3=1", EngineConfig(12, ((3, 1),))),
    ("eng7.k2=16.k11=-1.k14=3", EngineConfig(7, ((2, 16), (11, -1), (14, 3)))),
    (f"eng3.k0={INT64_MIN}.k1={INT64_MAX}", EngineConfig(3, ((0, INT64_MIN), (1, INT64_MAX)))),
])
def test_documented_names(name, config):
    assert parse_engine_name(name) == config
    assert config.name == name


@pytest.mark.parametrize("name, reason", [
    ("eng", "is not eng<G>"), ("engine3", "is not eng<G>"), ("eng-1", "is not eng<G>"),
    ("eng01", "is not eng<G>"), ("eng+1", "is not eng<G>"), ("eng1.k3", "is not eng<G>"),
    ("eng1.k3=", "is not eng<G>"), ("eng1.k03=1", "is not eng<G>"),
    ("eng1.k3=01", "is not eng<G>"), ("eng1.k3=-0", "is not eng<G>"),
    ("eng1.k-3=1", "is not eng<G>"), ("eng1.k3=1.", "is not eng<G>"), ("eng1.3=1", "is not eng<G>"),
    ("eng1 .k3=1", "is not eng<G>"), ("ENG1", "is not eng<G>"), ("eng1.k3=1:fma", "is not eng<G>"),
    ("eng1.k3=1.k2=5", "not strictly ascending"), ("eng1.k3=1.k3=2", "not strictly ascending"),
    (f"eng{INT64_MAX + 1}", "global index"), (f"eng1.k{INT32_MAX + 1}=0", "knob type"),
    (f"eng1.k1={INT64_MAX + 1}", "not an int64"), (f"eng1.k1={INT64_MIN - 1}", "not an int64"),
])
def test_malformed_names_say_why(name, reason):
    with pytest.raises(EngineNameError) as exc:
        parse_engine_name(name)
    assert repr(name) in str(exc.value) and reason in str(exc.value)


def test_a_name_lists_at_most_max_knobs():
    knobs = "".join(f".k{t}=0" for t in range(MAX_KNOBS))
    assert len(parse_engine_name("eng1" + knobs).knobs) == MAX_KNOBS
    with pytest.raises(EngineNameError, match=f"{MAX_KNOBS + 1} knob choices, at most"):
        parse_engine_name("eng1" + knobs + f".k{MAX_KNOBS}=0")


def test_engine_name_errors_are_value_errors_of_mucudnn():
    with pytest.raises(ValueError):
        parse_engine_name("eng")
    with pytest.raises(MucudnnError):
        EngineConfig(-1)


@pytest.mark.parametrize("name", sorted({n for names in ALGORITHMS.values() for n in names}))
def test_legacy_algorithm_names_are_legacy(name):
    assert api_of(name) is Api.LEGACY


def test_api_choices():
    assert select_apis("both") == {Api.LEGACY, Api.GRAPH}
    assert select_apis("legacy") == {Api.LEGACY}
    assert select_apis("graph") == {Api.GRAPH}
    with pytest.raises(MucudnnError, match="'cudnn' is not one of legacy, graph, both"):
        select_apis("cudnn")


def test_numerical_notes_round_trip_through_a_note():
    note = format_numerical_notes(["TENSOR_CORE", "WINOGRAD_TILE_4x4"])
    assert note == "numerical notes: tensor_core, winograd_tile_4x4"
    assert numerical_notes(note) == {"tensor_core", "winograd_tile_4x4"}
    assert format_numerical_notes([]) == "numerical notes: none"
    assert numerical_notes(format_numerical_notes([])) == frozenset()
    assert numerical_notes("CUDNN_STATUS_NOT_SUPPORTED") == frozenset()
    assert "winograd_tile_4x4" in TRANSFORM_NOTES and "tensor_core" not in TRANSFORM_NOTES


@pytest.mark.parametrize("name", [
    "eng" + "9" * 5000,                       # past int()'s digit limit: was a bare ValueError
    "eng1.k" + "9" * 5000 + "=1",
    "eng1.k1=" + "9" * 5000, "eng1.k1=-" + "9" * 5000,
    "eng" + "1" * 20, "eng1.k1=" + "1" * 20,  # 20 digits: past int64 whatever they are
    "eng²", "eng1.k1=١",                      # digits, to str.isdigit, but not ASCII ones
])
def test_overlong_or_non_ascii_numbers_are_an_engine_name_error(name):
    with pytest.raises(EngineNameError, match="engine name"):
        parse_engine_name(name)
