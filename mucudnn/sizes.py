"""Byte sizes as people write them: ``64MiB``, ``1GiB``, ``512KiB``, ``2GB``, ``1048576``."""

from __future__ import annotations

import re
from fractions import Fraction

from .errors import SizeError

_UNITS = {
    "": 1, "b": 1,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "k": 1 << 10, "m": 1 << 20, "g": 1 << 30,  # bare letters: binary, like most GPU tools
}
_PATTERN = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int) -> int:
    """Bytes for ``text``; :class:`SizeError` names the text and the accepted units."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise SizeError(f"size {text} is negative")
        return text
    match = _PATTERN.match(str(text))
    unit = match.group(2).lower() if match else None
    if not match or unit not in _UNITS:
        raise SizeError(
            f"cannot read {text!r} as a size: use bytes or a number with KiB, MiB, GiB, TiB "
            "(or KB, MB, GB, TB), e.g. 64MiB"
        )
    # Exact arithmetic: through a float, 4.1GB would be 4099999999.9999995 bytes.
    value = Fraction(match.group(1)) * _UNITS[unit]
    if value.denominator != 1:
        raise SizeError(f"size {text!r} is not a whole number of bytes")
    return int(value)


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
