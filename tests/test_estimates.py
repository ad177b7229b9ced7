"""mucudnn.estimates: what measuring every size could give, from the measured ones."""

from __future__ import annotations

import math

import pytest

from mucudnn.errors import KeyFormatError
from mucudnn.estimates import every_size, fit_estimate, geometry, per_sample_ms
from mucudnn.measurement import Measurement, Status
from mucudnn.problem import ConvProblem, Direction, MathType


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


def test_per_sample_time_is_not_extrapolated():
    at = {r.batch: r for r in rows()[:2]}
    assert per_sample_ms(at, 2) == 1.0
    with pytest.raises(ValueError, match="size 16 is outside the measured sizes"):
        per_sample_ms(at, 16)


def test_fit_estimate_runs_each_configuration_at_its_largest_fitting_size():
    # "a" needs 100 bytes per sample, so 5 samples fit 500 bytes (about 0.63 ms per sample);
    # "b" needs none and takes 0.25 ms per sample at 4, so 8 samples take 2 ms: the best
    assert fit_estimate(rows(), n=8, limit=500) == 2.0
    only_a = rows()[:2]
    assert math.isclose(fit_estimate(only_a, n=8, limit=500), 8 * per_sample_ms(
        {r.batch: r for r in only_a}, 5))
    assert fit_estimate(only_a, n=8, limit=100) == math.inf  # not even the smallest size fits


def test_geometry_matches_kernels_across_math_types_only():
    base = dict(c=64, input_size=(56, 56), k=64, filter_size=(3, 3), padding=(1, 1),
                stride=(1, 1), dilation=(1, 1))
    fma = ConvProblem(Direction.FORWARD, math=MathType.FMA, **base)
    tf32 = ConvProblem(Direction.FORWARD, math=MathType.DEFAULT, **base)
    other = ConvProblem(Direction.BACKWARD_DATA, math=MathType.FMA, **base)
    assert geometry(fma.key) == geometry(tf32.key) != geometry(other.key)
    assert "math=*" in geometry(fma.key)
    with pytest.raises(KeyFormatError):
        geometry("not a key")
