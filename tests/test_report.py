"""The words of mucudnn.report's tables that no end-to-end test pins down."""

from __future__ import annotations

import pytest

from mucudnn.report import _faster


@pytest.mark.parametrize("baseline, plan, said", [
    (2.0, 1.0, "2.00x faster"),
    (1.0, 1.5, "1.50x slower"),
    (1.0, 1.0, "same time"),
    (1.0, 1.004, "same time"),   # 1.00x either way at two decimals
    (1.004, 1.0, "same time"),
    (1.0, 1.006, "1.01x slower"),
])
def test_plan_against_a_baseline_is_a_ratio_over_one_or_the_same(baseline, plan, said):
    assert _faster(baseline, plan) == said
