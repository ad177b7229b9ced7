"""benchmarks/limit_bound.py: the policy-`all` estimate (every_size)."""

from __future__ import annotations

import math

from benchmarks.limit_bound import every_size
from mucudnn.measurement import Measurement, Status


def rows():
    return [Measurement("k", 2, "a", "fma", 2.0, 200), Measurement("k", 8, "a", "fma", 4.0, 800),
            Measurement("k", 4, "b", "fma", 1.0, 0),
            Measurement("k", 6, "b", "fma", 0.0, 0, Status.FAILED)]


def test_every_size_between_the_measured_ones_and_nothing_outside():
    got = {(r.algo, r.batch): r for r in every_size(rows(), n=8)}
    assert sorted(b for a, b in got if a == "a") == list(range(2, 9))
    assert [b for a, b in got if a == "b"] == [4]  # one OK size: nothing to interpolate
    assert got[("a", 2)].time_ms == 2.0 and got[("a", 8)].time_ms == 4.0  # measured rows kept
    # per-sample time log-linear: 1.0 at 2, 0.5 at 8, so sqrt(0.5) at 4 (halfway in log size)
    assert math.isclose(got[("a", 4)].time_ms, 4 * math.sqrt(0.5))
    assert got[("a", 5)].workspace == 500  # workspace linear in the batch


def test_every_size_stops_at_n():
    assert max(r.batch for r in every_size(rows(), n=5)) == 5
