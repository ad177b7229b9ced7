"""Wording shared by the optimizer's error messages."""

from __future__ import annotations

from typing import Iterable

_MIB = 1 << 20


def describe_bytes(nbytes: int | float) -> str:
    """``67108864 bytes (64.0 MiB)``: exact for a machine, readable for a person."""
    return f"{int(nbytes)} bytes ({nbytes / _MIB:.1f} MiB)"


def describe_sizes(sizes: Iterable[int]) -> str:
    """Ascending sizes with runs of three or more collapsed: ``1..12, 16, 32``."""
    ordered = sorted(set(sizes))
    parts: list[str] = []
    start = 0
    while start < len(ordered):
        end = start
        while end + 1 < len(ordered) and ordered[end + 1] == ordered[end] + 1:
            end += 1
        if end - start >= 2:
            parts.append(f"{ordered[start]}..{ordered[end]}")
        else:
            parts.extend(str(size) for size in ordered[start:end + 1])
        start = end + 1
    return ", ".join(parts) if parts else "none"
