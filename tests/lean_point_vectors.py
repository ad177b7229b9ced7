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


def read_lean_point_vectors() -> list[LeanPointVector]:
    """Each vector of the file, in file order."""
    vectors = []
    for number, line in enumerate(LEAN_POINTS.read_text().splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        match = _LINE.fullmatch(line)
        assert match, f"{LEAN_POINTS}:{number}: not 'slack P limit B: W:T ... -> W:T | none'"
        points = tuple(Point.parse(text) for text in match.group(3).split())
        assert [p.workspace for p in points] == sorted(p.workspace for p in points), \
            f"{LEAN_POINTS}:{number}: points not by workspace ascending"
        expected = None if match.group(4) == "none" else Point.parse(match.group(4))
        assert expected is None or expected in points, f"{LEAN_POINTS}:{number}: not a point"
        vectors.append(LeanPointVector(int(match.group(1)), int(match.group(2)), points, expected,
                                       line))
    return vectors
