"""Every test of mucudnn.torch runs with a plan cache of its own (an empty directory): a session
on a GPU looks its plan up in MUCUDNN_PLAN_CACHE's directory, and one test's plan, or an earlier
run's, must not stand in for another's recording."""

import pytest


@pytest.fixture(autouse=True)
def plan_cache_of_its_own(tmp_path, monkeypatch):
    monkeypatch.setenv("MUCUDNN_PLAN_CACHE", str(tmp_path / "plan-cache"))
