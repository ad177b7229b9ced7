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


@pytest.fixture(scope="module")
def point_driver(tmp_path_factory) -> Path:
    """point_driver built with every shim source, as the shim's own build compiles them."""
    from mucudnn.shimlib import find_compiler

    reason = fakebuild.missing_prerequisite()
    if reason:
        pytest.skip(reason)
    output = tmp_path_factory.mktemp("point_driver") / "point_driver"
    sources = sorted(str(path) for path in (REPO / "shim" / "src").glob("*.c"))
    command = [find_compiler(), "-std=c11", "-D_GNU_SOURCE", "-O1", "-Wall", "-Wextra", "-Werror",
               "-DMUCUDNN_VERSION_STRING=\"test\"", f"-I{REPO / 'shim' / 'include'}",
               f"-I{REPO / 'shim' / 'src'}", f"-I{fakebuild.find_cudnn_include()}",
               f"-I{fakebuild.find_cuda_include()}", str(DRIVERS / "point_driver.c"), *sources,
               "-o", str(output), "-ldl", "-lpthread", "-lm"]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        pytest.fail(f"building point_driver failed:\n$ {' '.join(command)}\n{result.stderr}")
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
