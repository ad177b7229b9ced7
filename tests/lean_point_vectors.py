"""The lean-point vectors of tests/data/lean_points.txt, read once for the Python and the shim tests."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

LEAN_POINTS = Path(__file__).resolve().parent / "data" / "lean_points.txt"
_LINE = re.compile(r"slack (\d+) limit (\d+):((?: \d+:[0-9.]+)+) -> (none|\d+:[0-9.]+)")


@dataclasses.dataclass(frozen=True)
class Point:
    workspace: int
    time_ms: float

    @classmethod
    def parse(cls, text: str) -> Point:
        workspace, time_ms = text.split(":")
        return cls(int(workspace), float(time_ms))


@dataclasses.dataclass(frozen=True)
class LeanPointVector:
    slack: int
    limit: int
    points: tuple[Point, ...]
    expected: Point | None
    line: str


def _vector(number: int, line: str) -> LeanPointVector:
    match = _LINE.fullmatch(line)
    assert match, f"{LEAN_POINTS}:{number}: not 'slack P limit B: W:T ... -> W:T | none'"
    slack, limit, points, answer = match.groups()
    front = tuple(map(Point.parse, points.split()))
    assert list(front) == sorted(front, key=lambda p: p.workspace), \
        f"{LEAN_POINTS}:{number}: points not by workspace ascending"
    expected = None if answer == "none" else Point.parse(answer)
    assert expected is None or expected in front, f"{LEAN_POINTS}:{number}: not a point"
    return LeanPointVector(int(slack), int(limit), front, expected, line)


def read_lean_point_vectors() -> list[LeanPointVector]:
    """Each vector of the file, in file order (blank lines and # comments skipped)."""
    lines = enumerate(LEAN_POINTS.read_text().splitlines(), 1)
    return [_vector(number, line) for number, line in lines
            if line.strip() and not line.startswith("#")]
