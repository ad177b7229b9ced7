"""The byte-size vectors of tests/data/sizes.txt, read once for the Python and the shim tests."""

from __future__ import annotations

import re
from pathlib import Path

SIZES = Path(__file__).resolve().parent / "data" / "sizes.txt"
ERRORS = ("syntax", "ambiguous", "range")
_LINE = re.compile(r'"((?:[^"\\]|\\.)*)" -> (?:(\d+)|error: (\w+))')
_ESCAPES = {"t": "\t", "n": "\n", "r": "\r", '"': '"', "\\": "\\"}


def read_size_vectors() -> list[tuple[str, int | str]]:
    """(input, bytes) or (input, error kind) for each vector, in file order."""
    vectors = []
    for number, line in enumerate(SIZES.read_text().splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        match = _LINE.fullmatch(line)
        assert match, f"{SIZES}:{number}: not '\"INPUT\" -> BYTES' or '\"INPUT\" -> error: KIND'"
        text = re.sub(r"\\(.)", lambda m: _ESCAPES[m.group(1)], match.group(1))
        expected: int | str = int(match.group(2)) if match.group(2) else match.group(3)
        assert expected in ERRORS or isinstance(expected, int), f"{SIZES}:{number}: {expected}"
        vectors.append((text, expected))
    return vectors
