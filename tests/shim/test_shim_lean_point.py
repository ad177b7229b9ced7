"""The shim's choice of a front point (shim/src/exec.c: mu_plan_point under the limit, then
mu_plan_lean_point under MUCUDNN_WORKSPACE_SLACK) against tests/data/lean_points.txt, through
tests/shim/drivers/point_driver.c (Python: tests/test_slack.py)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import fakebuild
import pytest

from lean_point_vectors import read_lean_point_vectors

REPO = Path(__file__).resolve().parents[2]
DRIVERS = Path(__file__).resolve().parent / "drivers"
VECTORS = read_lean_point_vectors()


def build_command(compiler: str, output: Path) -> list[str]:
    """The driver and every shim source, with the warnings and defines of the shim's own build
    (its functions are hidden in libmucudnn.so, so the driver links the sources themselves)."""
    includes = [REPO / "shim" / "include", REPO / "shim" / "src", fakebuild.find_cudnn_include(),
                fakebuild.find_cuda_include()]
    sources = [DRIVERS / "point_driver.c", *sorted((REPO / "shim" / "src").glob("*.c"))]
    return [compiler, "-std=c11", "-D_GNU_SOURCE", '-DMUCUDNN_VERSION_STRING="test"', "-O1",
            "-Wall", "-Wextra", "-Werror", *(f"-I{path}" for path in includes),
            *map(str, sources), "-o", str(output), "-ldl", "-lpthread", "-lm"]


@pytest.fixture(scope="module")
def point_driver(tmp_path_factory) -> Path:
    from mucudnn.shimlib import find_compiler

    if reason := fakebuild.missing_prerequisite():
        pytest.skip(reason)
    output = tmp_path_factory.mktemp("point_driver") / "point_driver"
    built = subprocess.run(build_command(find_compiler(), output), capture_output=True, text=True)
    assert built.returncode == 0, f"building point_driver failed:\n{built.stderr}"
    return output


@pytest.fixture(scope="module")
def taken(point_driver) -> dict[str, str]:
    """The driver's answer to each vector's line: one run per slack, which the shim reads once."""
    answers = {}
    for slack in sorted({vector.slack for vector in VECTORS}):
        vectors = [vector for vector in VECTORS if vector.slack == slack]
        stdin = "".join(f"{vector.limit} " + " ".join(f"{p.workspace}:{p.time_ms!r}"
                                                      for p in vector.points) + "\n"
                        for vector in vectors)
        result = subprocess.run([str(point_driver)], input=stdin, capture_output=True, text=True,
                                env={"MUCUDNN_WORKSPACE_SLACK": str(slack)}, timeout=60)
        assert result.returncode == 0 and not result.stderr, result.stderr
        lines = result.stdout.splitlines()
        assert len(lines) == len(vectors), result.stdout
        answers.update((vector.line, line) for vector, line in zip(vectors, lines))
    return answers


@pytest.mark.parametrize("vector", VECTORS, ids=lambda v: v.line)
def test_the_shim_takes_the_shared_vectors_points(taken, vector):
    answer = taken[vector.line]
    assert (None if answer == "none" else vector.points[int(answer)]) == vector.expected
