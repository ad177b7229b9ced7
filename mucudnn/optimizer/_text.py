"""Wording shared by the optimizer's error messages."""

from __future__ import annotations

from typing import Iterable

from ..sizes import describe_size as describe_bytes  # noqa: F401 - one wording for sizes


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
