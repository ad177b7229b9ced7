import pytest

from mucudnn.torch import planner


@pytest.fixture(autouse=True)
def two_recording_steps(monkeypatch):
    """A session's default recording steps are two here: these tests count their steps from the
    two a session recorded before planner.RECORD_STEPS was measured (its default is tested in
    tests/torch/test_runtime.py, test_a_session_records_planner_record_steps_by_default)."""
    monkeypatch.setattr(planner, "RECORD_STEPS", 2)
