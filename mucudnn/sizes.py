"""Byte sizes as people write them: ``64MiB``, ``1GiB``, ``512KiB``, ``2GB``, ``1048576``."""

from __future__ import annotations

import re

from .errors import SizeError

_UNITS = {
    "": 1, "b": 1,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
}
# docs/sizes.md; the shim's mu_parse_size (shim/src/options.c) reads the same grammar, and both are
# checked against tests/data/sizes.txt. ASCII only: "٣MiB" is no size, whatever str.isdigit says.
_BLANKS = "[ \t\n\r\f\v]*"
_PATTERN = re.compile(f"{_BLANKS}([0-9]+)(?:\\.([0-9]+))?{_BLANKS}([A-Za-z]*){_BLANKS}")
SIZE_MAX = (1 << 63) - 1
_FORM = "use bytes or a number with B, KiB, MiB, GiB, TiB, KB, MB, GB or TB, e.g. 64MiB"


def parse_size(text: str | int) -> int:
    """Bytes for ``text`` (docs/sizes.md): a fraction is floored to whole bytes, 0 to 2**63 - 1.

    :class:`SizeError` names the text and what was wrong with it.
    """
    if isinstance(text, int) and not isinstance(text, bool):
        if not 0 <= text <= SIZE_MAX:
            raise SizeError(f"size {text} is out of range: 0 to 2^63-1 bytes")
        return text
    match = _PATTERN.fullmatch(str(text))
    if not match:
        raise SizeError(f"cannot read {text!r} as a size: {_FORM}")
    whole, fraction, unit = match.group(1), match.group(2) or "", match.group(3)
    if unit.lower() not in _UNITS:
        if unit.lower() in ("k", "m", "g", "t"):
            number, u = match.group(1) + (f".{fraction}" if fraction else ""), unit.upper()
            raise SizeError(f"size {text!r}: a bare {unit} is ambiguous: write {number}{u}iB "
                            f"(powers of 2) or {number}{u}B (powers of 10)")
        raise SizeError(f"cannot read {text!r} as a size: {_FORM}")
    factor = _UNITS[unit.lower()]
    # Exact integer arithmetic: through a float, 4.1GB would be 4099999999.9999995 bytes.
    value = _int(whole) * factor + _int(fraction or "0") * factor // 10 ** len(fraction)
    if value > SIZE_MAX:
        raise SizeError(f"size {text!r} is out of range: more than 2^63-1 bytes")
    return value


def _int(digits: str) -> int:
    """``int(digits)`` for any number of ASCII digits: Python refuses to convert more than 4300
    at once (``sys.get_int_max_str_digits``), and a size may have more (leading zeros, a long
    fraction)."""
    value = 0
    for start in range(0, len(digits), 4000):
        chunk = digits[start:start + 4000]
        value = value * 10 ** len(chunk) + int(chunk)
    return value


def format_size(nbytes: int | float) -> str:
    """Short human form: ``64.0 MiB``, ``0 B``; the largest unit whose rounded value stays < 1024."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        shown = round(value) if unit == "B" else round(value, 1)
        if abs(shown) < 1024 or unit == "GiB":
            return f"{int(shown)} B" if unit == "B" else f"{shown:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def describe_size(nbytes: int | float) -> str:
    """``67108864 bytes (64.0 MiB)``: exact for a machine, readable for a person."""
    return f"{int(nbytes)} bytes ({format_size(nbytes)})"
