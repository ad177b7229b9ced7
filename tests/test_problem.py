"""Convolution problems: kernel key build/parse (docs/kernel-key.md), geometry, algorithm names."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mucudnn.errors import KeyFormatError
from mucudnn.problem import (
    ALGORITHMS, ConvMode, ConvProblem, DataType, Direction, Layout, MathType, algorithm_value,
)

ROOT = Path(__file__).resolve().parents[1]
KEYS_FILE = ROOT / "tests" / "data" / "keys.txt"
PLAN_FORMAT_DOC = ROOT / "docs" / "plan-format.md"

# docs/kernel-key.md: "always all of them, always in this order".
KEY_FIELDS = ("dir", "dt", "ct", "math", "layout", "c", "in", "k", "f", "pad", "stride", "dil",
              "g", "mode")
# The ConvProblem attribute behind each enum-valued key field.
ENUM_FIELDS = {"dir": "direction", "dt": "dtype", "ct": "compute_type", "math": "math",
               "layout": "layout", "mode": "mode"}

BASE = ConvProblem(Direction.FORWARD, c=64, input_size=(56, 56), k=64, filter_size=(3, 3),
                   padding=(1, 1), stride=(1, 1), dilation=(1, 1))
BASE_KEY = ("dir=fwd,dt=f32,ct=f32,math=fma,layout=nchw,c=64,in=56x56,k=64,f=3x3,pad=1x1,"
            "stride=1x1,dil=1x1,g=1,mode=xcorr")


def replace_field(key: str, field: str, value: str) -> str:
    """``key`` with the value of ``field`` replaced (the field keeps its place)."""
    parts = key.split(",")
    names = [part.split("=", 1)[0] for part in parts]
    assert field in names, f"no field {field} in {key}"
    parts[names.index(field)] = f"{field}={value}"
    return ",".join(parts)


# -- random valid problems -------------------------------------------------------------------------

@st.composite
def spatial_dim(draw) -> tuple[int, int, int, int, int]:
    """(input, filter, padding, stride, dilation) of one dimension with a non-empty output."""
    filter_size = draw(st.integers(1, 7))
    dilation = draw(st.integers(1, 3))
    padding = draw(st.integers(0, 4))
    stride = draw(st.integers(1, 4))
    span = dilation * (filter_size - 1) + 1
    input_size = draw(st.integers(max(1, span - 2 * padding), 300))
    return input_size, filter_size, padding, stride, dilation


@st.composite
def problems(draw, spatial_dims=st.sampled_from((2, 3))) -> ConvProblem:
    dims = [draw(spatial_dim()) for _ in range(draw(spatial_dims))]
    groups = draw(st.integers(1, 8))
    input_size, filter_size, padding, stride, dilation = zip(*dims)
    return ConvProblem(
        direction=draw(st.sampled_from(Direction)),
        c=groups * draw(st.integers(1, 64)), input_size=input_size,
        k=groups * draw(st.integers(1, 64)), filter_size=filter_size, padding=padding,
        stride=stride, dilation=dilation, groups=groups,
        dtype=draw(st.sampled_from(DataType)), compute_type=draw(st.sampled_from(DataType)),
        math=draw(st.sampled_from(MathType)), layout=draw(st.sampled_from(Layout)),
        mode=draw(st.sampled_from(ConvMode)), n=draw(st.integers(1, 1024)),
    )


# -- build and parse -------------------------------------------------------------------------------

def test_key_of_a_known_problem_matches_the_documented_example():
    assert BASE.key == BASE_KEY


@pytest.mark.parametrize("spatial_dims", [2, 3])
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_key_round_trips(spatial_dims, data):
    problem = data.draw(problems(spatial_dims=st.just(spatial_dims)))
    parsed = ConvProblem.from_key(problem.key, problem.n)
    assert parsed == problem
    assert parsed.key == problem.key
    assert parsed.spatial_dims == spatial_dims


@settings(max_examples=50, deadline=None)
@given(problem=problems())
def test_key_has_every_field_in_the_documented_order_and_no_n(problem):
    names = [part.split("=", 1)[0] for part in problem.key.split(",")]
    assert tuple(names) == KEY_FIELDS
    assert " " not in problem.key
    assert problem.with_n(problem.n + 1).key == problem.key  # N travels beside the key


@pytest.mark.parametrize("field, member", [
    (field, member)
    for field, attribute in ENUM_FIELDS.items()
    for member in type(getattr(BASE, attribute))
])
def test_every_enum_value_is_written_and_read(field, member):
    problem = dataclasses.replace(BASE, **{ENUM_FIELDS[field]: member})
    assert f"{field}={member.value}" in problem.key.split(",")
    assert getattr(ConvProblem.from_key(problem.key), ENUM_FIELDS[field]) is member


def test_from_key_takes_n_and_defaults_it_to_one():
    assert ConvProblem.from_key(BASE_KEY, 256).n == 256
    assert ConvProblem.from_key(BASE_KEY).n == 1


def key_examples() -> list[tuple[int, str]]:
    """(line number, expected key) of every example in tests/data/keys.txt that has a key."""
    examples = []
    for lineno, line in enumerate(KEYS_FILE.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        fields, arrow, key = line.partition(" => ")
        assert arrow, f"{KEYS_FILE.name}:{lineno}: no ' => ' in {line!r}"
        if key.strip() != "-":
            examples.append((lineno, key.strip()))
    return examples


def test_keys_file_has_examples_with_and_without_a_key():
    lines = [line for line in KEYS_FILE.read_text(encoding="utf-8").splitlines()
             if line.strip() and not line.lstrip().startswith("#")]
    assert len(key_examples()) >= 5
    assert len(key_examples()) < len(lines)  # the '-' examples are skipped, not misread


@pytest.mark.parametrize("lineno, key", [
    pytest.param(lineno, key, id=f"line{lineno}") for lineno, key in key_examples()
])
def test_every_key_in_keys_file_parses_and_reserialises_identically(lineno, key):
    assert ConvProblem.from_key(key).key == key, f"{KEYS_FILE.name}:{lineno}"


def test_keys_file_fields_describe_the_same_problem_as_the_key():
    """The descriptor fields left of '=>' (minus n and layout=padded) say what the key parses to."""
    for lineno, line in enumerate(KEYS_FILE.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#") or line.rstrip().endswith("=> -"):
            continue
        described, _, key = line.partition(" => ")
        fields = dict(pair.split("=", 1) for pair in described.split())
        parsed = ConvProblem.from_key(key.strip(), int(fields["n"]))
        assert parsed.key == ",".join(f"{name}={fields[name]}" for name in KEY_FIELDS), \
            f"{KEYS_FILE.name}:{lineno}"


# -- malformed keys --------------------------------------------------------------------------------

def message_without_key(exc: pytest.ExceptionInfo, key: str) -> str:
    """The error text minus the echoed key, so a check cannot pass by matching the key itself."""
    text = str(exc.value)
    assert text.count(repr(key)) == 1, f"the message should quote the key once: {text}"
    return text.replace(repr(key), "<key>")


@pytest.mark.parametrize("key, expected", [
    (BASE_KEY.rsplit(",", 1)[0], "expected 14 fields"),
    (BASE_KEY + ",n=4", "expected 14 fields"),
    ("", "expected 14 fields"),
    (BASE_KEY.replace(",", ";"), "expected 14 fields"),
], ids=["one missing", "one extra", "empty", "wrong separator"])
def test_wrong_field_count_is_refused(key, expected):
    with pytest.raises(KeyFormatError) as exc:
        ConvProblem.from_key(key)
    assert expected in message_without_key(exc, key)
    assert ",".join(KEY_FIELDS) in str(exc.value)  # says which fields it wants


@pytest.mark.parametrize("first, second", [(0, 1), (5, 7), (8, 9), (12, 13)])
def test_fields_out_of_order_are_refused_naming_the_expected_field(first, second):
    parts = BASE_KEY.split(",")
    parts[first], parts[second] = parts[second], parts[first]
    key = ",".join(parts)
    with pytest.raises(KeyFormatError) as exc:
        ConvProblem.from_key(key)
    assert f"field {KEY_FIELDS[first]}= expected" in message_without_key(exc, key)


@pytest.mark.parametrize("part", ["c64", "c=", "C=64", "=64"])
def test_field_without_name_or_value_is_refused(part):
    key = BASE_KEY.replace("c=64,", part + ",", 1)
    with pytest.raises(KeyFormatError) as exc:
        ConvProblem.from_key(key)
    assert "field c= expected" in message_without_key(exc, key)


@pytest.mark.parametrize("field, value", [
    ("c", "abc"), ("c", "4x4"), ("c", "1_0"), ("c", "+4"), ("k", "6.0"), ("in", "56xa"),
    ("in", "56x"), ("in", "056x56"), ("f", "3X3"), ("pad", "1x 1"), ("stride", "x"),
    ("dil", "1x1x"), ("g", "1x1"),
])
def test_bad_integers_are_refused_naming_the_field(field, value):
    key = replace_field(BASE_KEY, field, value)
    with pytest.raises(KeyFormatError) as exc:
        ConvProblem.from_key(key)
    assert f"{field}={value!r}" in message_without_key(exc, key)


@pytest.mark.parametrize("field, value", [
    ("dir", "backward"), ("dt", "f8"), ("ct", "F32"), ("math", "tf32"), ("layout", "chwn"),
    ("mode", "corr"),
])
def test_bad_enum_values_are_refused_naming_the_field(field, value):
    key = replace_field(BASE_KEY, field, value)
    with pytest.raises(KeyFormatError) as exc:
        ConvProblem.from_key(key)
    message = message_without_key(exc, key)
    assert f"{field}={value!r}" in message
    member = type(getattr(BASE, ENUM_FIELDS[field]))
    assert all(m.value in message for m in member), "the message lists the valid values"


@pytest.mark.parametrize("field, value, attribute", [
    ("f", "3x3x3", "filter_size"), ("pad", "1", "padding"), ("stride", "1x1x1", "stride"),
    ("dil", "1", "dilation"), ("in", "56", "input_size"), ("in", "2x2x2x2", "input_size"),
])
def test_inconsistent_spatial_dims_are_refused(field, value, attribute):
    key = replace_field(BASE_KEY, field, value)
    with pytest.raises(KeyFormatError) as exc:
        ConvProblem.from_key(key)
    assert attribute in message_without_key(exc, key)


@pytest.mark.parametrize("c, k, groups", [(64, 64, 3), (6, 4, 4), (4, 6, 4)])
def test_groups_not_dividing_channels_are_refused(c, k, groups):
    key = replace_field(replace_field(replace_field(BASE_KEY, "c", str(c)), "k", str(k)),
                        "g", str(groups))
    with pytest.raises(KeyFormatError) as exc:
        ConvProblem.from_key(key)
    assert f"groups={groups}" in message_without_key(exc, key)


@pytest.mark.parametrize("overrides", [
    {"c": "0"}, {"k": "0"}, {"g": "0"}, {"in": "0x56"}, {"stride": "0x1"}, {"dil": "1x0"},
    {"pad": "-1x1"}, {"in": "1x1", "pad": "0x0"},  # a 3x3 filter over 1x1 unpadded: no output
], ids=lambda overrides: ",".join(f"{k}={v}" for k, v in overrides.items()))
def test_out_of_range_values_are_refused(overrides):
    key = BASE_KEY
    for field, value in overrides.items():
        key = replace_field(key, field, value)
    with pytest.raises(KeyFormatError):
        ConvProblem.from_key(key)


def test_key_format_error_is_a_value_error():
    with pytest.raises(ValueError):
        ConvProblem.from_key("dir=fwd")


# -- geometry --------------------------------------------------------------------------------------

def sliding_window_count(size: int, filter_size: int, padding: int, stride: int,
                         dilation: int) -> int:
    """Positions of a dilated filter that fit in the zero-padded input, counted one by one."""
    last_tap = dilation * (filter_size - 1)
    return sum(1 for start in range(-padding, size + padding, stride)
               if start + last_tap <= size - 1 + padding)


@settings(max_examples=200, deadline=None)
@given(problem=problems())
def test_output_size_matches_counting_window_positions(problem):
    expected = tuple(
        sliding_window_count(*dim) for dim in zip(problem.input_size, problem.filter_size,
                                                  problem.padding, problem.stride,
                                                  problem.dilation))
    assert problem.output_size == expected
    assert problem.y_shape == (problem.n, problem.k, *expected)


def test_output_size_of_known_layers():
    assert BASE.output_size == (56, 56)
    conv1 = ConvProblem(Direction.FORWARD, c=3, input_size=(224, 224), k=64, filter_size=(7, 7),
                        padding=(3, 3), stride=(2, 2), dilation=(1, 1))
    assert conv1.output_size == (112, 112)


# -- algorithm names -------------------------------------------------------------------------------

def documented_algorithms() -> dict[Direction, tuple[str, ...]]:
    """The algorithm table of docs/plan-format.md: ``| `fwd` | `a`, `b`, ... |`` rows."""
    table = {}
    for line in PLAN_FORMAT_DOC.read_text(encoding="utf-8").splitlines():
        match = re.fullmatch(r"\|\s*`(fwd|bwd_data|bwd_filter)`\s*\|(.*)\|\s*", line)
        if match:
            table[Direction(match.group(1))] = tuple(re.findall(r"`([a-z0-9_]+)`", match.group(2)))
    return table


def test_algorithm_table_matches_the_documentation():
    assert documented_algorithms() == ALGORITHMS


def cudnn_enumerators(header: Path, prefix: str) -> dict[str, int]:
    """``NAME = value`` enumerators starting with ``prefix`` (minus the prefix), except COUNT."""
    found = re.findall(rf"\b{prefix}(\w+)\s*=\s*(\d+)", header.read_text(encoding="utf-8"))
    return {name: int(value) for name, value in found if name != "COUNT"}


@pytest.mark.parametrize("direction, prefix", [
    (Direction.FORWARD, "CUDNN_CONVOLUTION_FWD_ALGO_"),
    (Direction.BACKWARD_DATA, "CUDNN_CONVOLUTION_BWD_DATA_ALGO_"),
    (Direction.BACKWARD_FILTER, "CUDNN_CONVOLUTION_BWD_FILTER_ALGO_"),
])
def test_algorithm_values_match_the_cudnn_header(direction, prefix):
    from mucudnn.errors import LibraryNotFoundError
    from mucudnn.shimlib import find_cudnn_include
    try:
        header = find_cudnn_include() / "cudnn_ops.h"
    except LibraryNotFoundError as exc:
        pytest.skip(str(exc))
    if not header.is_file():
        pytest.skip(f"{header} not found")
    # docs/plan-format.md: lower-cased suffix, 'algo_' before a bare number.
    expected = {("algo_" + name if name.isdigit() else name.lower()): value
                for name, value in cudnn_enumerators(header, prefix).items()}
    assert {name: algorithm_value(direction, name) for name in ALGORITHMS[direction]} == expected


@pytest.mark.parametrize("direction", list(Direction))
def test_algorithm_value_is_the_position_in_the_table(direction):
    names = ALGORITHMS[direction]
    assert len(set(names)) == len(names)
    assert [algorithm_value(direction, name) for name in names] == list(range(len(names)))


@pytest.mark.parametrize("direction, name", [
    (Direction.FORWARD, "algo_0"), (Direction.BACKWARD_DATA, "implicit_gemm"),
    (Direction.BACKWARD_FILTER, "FFT"), (Direction.FORWARD, ""),
])
def test_unknown_algorithm_names_the_choices(direction, name):
    with pytest.raises(KeyError) as exc:
        algorithm_value(direction, name)
    message = str(exc.value)
    assert repr(name) in message and direction.value in message
    assert all(choice in message for choice in ALGORITHMS[direction])
