"""Byte sizes as people write them: parse_size (against tests/data/sizes.txt too), format_size,
describe_size."""

from __future__ import annotations

import re

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from mucudnn.errors import MucudnnError, SizeError
from mucudnn.sizes import SIZE_MAX, describe_size, format_size, parse_size
from size_vectors import read_size_vectors

KiB, MiB, GiB, TiB = 1 << 10, 1 << 20, 1 << 30, 1 << 40
UNITS = {
    "": 1, "B": 1,
    "KiB": KiB, "MiB": MiB, "GiB": GiB, "TiB": TiB,
    "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
}


# -- parse_size ------------------------------------------------------------------------------------

ERROR_WORDS = {"syntax": "cannot read", "ambiguous": "is ambiguous", "range": "out of range"}


@pytest.mark.parametrize("text, expected", read_size_vectors(), ids=repr)
def test_the_shared_size_vectors(text, expected):
    """tests/data/sizes.txt: the shim reads the same (tests/shim/test_shim_sizes.py)."""
    if isinstance(expected, int):
        assert parse_size(text) == expected
    else:
        with pytest.raises(SizeError) as exc:
            parse_size(text)
        assert ERROR_WORDS[expected] in str(exc.value) and repr(text) in str(exc.value)


def test_the_vectors_cover_every_unit_and_error():
    vectors = read_size_vectors()
    texts = " ".join(text for text, _ in vectors)
    assert all(unit in texts for unit in UNITS if unit)
    assert {e for _, e in vectors if isinstance(e, str)} == set(ERROR_WORDS)

@pytest.mark.parametrize("unit, factor", UNITS.items())
def test_each_unit(unit, factor):
    assert parse_size(f"3{unit}") == 3 * factor


@pytest.mark.parametrize("text", ["64mib", "64MIB", "64MiB", "64Mib", "64mIb"])
def test_units_ignore_case(text):
    assert parse_size(text) == 64 * MiB


@pytest.mark.parametrize("text", [" 64MiB", "64 MiB", "64MiB  ", "\t64\tMiB\n"])
def test_blanks_around_and_between_are_allowed(text):
    assert parse_size(text) == 64 * MiB


@pytest.mark.parametrize("text, expected", [
    ("1.5KiB", 1536), ("0.5MiB", 512 * KiB), ("0.25GiB", 256 * MiB), ("1.0", 1),
    ("2.5KB", 2500), ("4.1GB", 4_100_000_000), ("0.001KB", 1), ("1.000", 1),
])
def test_decimals_that_make_whole_bytes(text, expected):
    assert parse_size(text) == expected


@settings(max_examples=300, deadline=None)
@given(whole=st.integers(0, 10**6), fraction=st.text("0123456789", min_size=1, max_size=40),
       unit=st.sampled_from(sorted(UNITS)))
def test_decimal_sizes_are_exact_and_floored(whole, fraction, unit):
    """A decimal gives exactly its whole number of bytes, rounded down, never float noise."""
    numerator = (whole * 10 ** len(fraction) + int(fraction)) * UNITS[unit]
    assert parse_size(f"{whole}.{fraction}{unit}") == numerator // 10 ** len(fraction)


@settings(max_examples=200, deadline=None)
@given(value=st.integers(0, 10**20), unit=st.sampled_from(sorted(UNITS)))
def test_integers_with_units_up_to_the_largest_size(value, unit):
    if value * UNITS[unit] <= SIZE_MAX:
        assert parse_size(f"{value}{unit}") == value * UNITS[unit]
    else:
        with pytest.raises(SizeError, match="out of range"):
            parse_size(f"{value}{unit}")


@pytest.mark.parametrize("value", [0, 1, 64 * MiB, 10**15])
def test_ints_pass_through(value):
    assert parse_size(value) == value
    assert parse_size(str(value)) == value


@pytest.mark.parametrize("text", [
    "64XB", "64 MiBs", "", "   ", "MiB", "-1MiB", "-5", "1e3", "1,024", "1.5.2MiB", ".5MiB",
    "64 Mi B", "0x40", "64MiB extra", "True",
])
def test_unreadable_sizes_name_the_text(text):
    with pytest.raises(SizeError) as exc:
        parse_size(text)
    message = str(exc.value)
    assert repr(text) in message
    assert "MiB" in message and "GiB" in message  # says what it accepts


@pytest.mark.parametrize("text, number", [("64M", "64"), ("512k", "512"), ("1.5G", "1.5"), ("2T", "2")])
def test_a_bare_letter_is_ambiguous_and_says_what_to_write(text, number):
    letter = text[-1].upper()
    with pytest.raises(SizeError, match="ambiguous") as exc:
        parse_size(text)
    assert f"{number}{letter}iB" in str(exc.value) and f"{number}{letter}B" in str(exc.value)


@pytest.mark.parametrize("value", [-7, SIZE_MAX + 1, 1 << 64])
def test_ints_out_of_range_are_refused(value):
    with pytest.raises(SizeError, match=rf"{value}\b.*out of range"):
        parse_size(value)


def test_the_largest_size():
    assert SIZE_MAX == (1 << 63) - 1 and parse_size(SIZE_MAX) == SIZE_MAX


def test_size_error_is_a_mucudnn_error_and_a_value_error():
    with pytest.raises(MucudnnError):
        parse_size("64XB")
    with pytest.raises(ValueError):
        parse_size("64XB")


# -- format_size / describe_size -------------------------------------------------------------------

@pytest.mark.parametrize("nbytes, expected", [
    (0, "0 B"), (1, "1 B"), (1023, "1023 B"), (1024, "1.0 KiB"), (1536, "1.5 KiB"),
    (64 * MiB, "64.0 MiB"), (MiB - 1, "1.0 MiB"), (3 * GiB, "3.0 GiB"),
    (2 * TiB, "2048.0 GiB"),  # GiB is the largest unit shown
])
def test_format_size(nbytes, expected):
    assert format_size(nbytes) == expected


@settings(max_examples=300, deadline=None)
@given(nbytes=st.integers(0, 1 << 50))
def test_format_size_is_within_rounding_of_the_value(nbytes):
    match = re.fullmatch(r"(\d+(?:\.\d)?) (B|KiB|MiB|GiB)", format_size(nbytes))
    assert match, format_size(nbytes)
    number, unit = float(match.group(1)), UNITS[match.group(2)]
    assert abs(number * unit - nbytes) <= 0.05 * unit * (1 + 1e-9)  # half a last digit (ties even)
    assert number < 1024 or unit == GiB  # the largest unit that keeps the number below 1024
    assert unit == 1 or number >= 1


def test_format_size_of_negative_and_float_values():
    assert format_size(-2048) == "-2.0 KiB"
    assert format_size(1.5 * MiB) == "1.5 MiB"


@pytest.mark.parametrize("nbytes", [0, 1000, 64 * MiB, 5 * GiB + 7])
def test_describe_size_gives_exact_bytes_and_readable_size(nbytes):
    assert describe_size(nbytes) == f"{nbytes} bytes ({format_size(nbytes)})"


def test_describe_size_example():
    assert describe_size(64 * MiB) == "67108864 bytes (64.0 MiB)"
