"""The shim's choice of a front point under a limit and a slack, as mucudnn.slack.point_within
makes it, against the shared vectors of tests/data/lean_points.txt (the shim:
tests/shim/test_shim_lean_point.py)."""

from __future__ import annotations

import pytest

from lean_point_vectors import read_lean_point_vectors
from mucudnn.slack import point_within


@pytest.mark.parametrize("vector", read_lean_point_vectors(), ids=lambda v: v.line)
def test_point_within_takes_the_shared_vectors_points(vector):
    assert point_within(vector.points, vector.limit, vector.slack) == vector.expected
