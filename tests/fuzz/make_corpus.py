"""Seed corpora of the fuzz harnesses from the test data: ``python make_corpus.py DIR`` writes
DIR/plan (tests/data/plans), DIR/key (keys.txt's keys, the algorithm, math and engine names of the
valid plans), DIR/descs (keys.txt's fields as stub cases) and DIR/size (tests/data/sizes.txt)."""

from __future__ import annotations

import hashlib
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
DATA = HERE.parent / "data"
sys.path[:0] = [str(HERE), str(HERE.parent)]

import descs  # noqa: E402
from size_vectors import read_size_vectors  # noqa: E402

HARNESSES = {"plan": "fuzz_plan", "key": "fuzz_key", "descs": "fuzz_descs", "size": "fuzz_size"}


def seeds() -> dict[str, list[bytes]]:
    plans = sorted((DATA / "plans").glob("*.plan"))
    examples = [line.partition(" => ") for line in (DATA / "keys.txt").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    names = {name for plan in plans if plan.stem.startswith("valid")
             for piece in re.findall(r"\b\d+:(\S+)", plan.read_text()) for name in piece.split(":")}
    return {
        "plan": [plan.read_bytes() for plan in plans],
        "key": [key.strip().encode() for _, _, key in examples if key.strip() != "-"]
        + [name.encode() for name in sorted(names)],
        "descs": [descs.as_bytes(descs.encode(fields)) for fields, _, _ in examples],
        "size": [text.encode() for text, _ in read_size_vectors()],
    }


def write(out: Path) -> dict[str, Path]:
    """One file per seed, named by its hash as libFuzzer names corpus files; the directories."""
    dirs = {}
    for corpus, items in seeds().items():
        dirs[corpus] = out / corpus
        dirs[corpus].mkdir(parents=True, exist_ok=True)
        for item in items:
            (dirs[corpus] / hashlib.sha1(item).hexdigest()).write_bytes(item)
    return dirs


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(f"usage: {sys.argv[0]} DIR")
    for corpus, path in write(Path(sys.argv[1])).items():
        print(f"{HARNESSES[corpus]}: {len(list(path.iterdir()))} seeds in {path}")
