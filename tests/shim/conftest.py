"""Fixtures of the cuDNN double's self-tests (test_fake_cudnn.py, test_fake_backend.py).

Each of those modules defines its own session fixture ``lib`` (the double loaded with ctypes, with
the argument types that module declares); ``handle`` uses the requesting module's ``lib``.
"""

from __future__ import annotations

import ctypes

import pytest

SUCCESS = 0


@pytest.fixture
def handle(lib):
    """A cuDNN handle of the double, destroyed after the test."""
    created = ctypes.c_void_p()
    assert lib.cudnnCreate(ctypes.byref(created)) == SUCCESS
    yield created
    assert lib.cudnnDestroy(created) == SUCCESS


@pytest.fixture
def log_path(tmp_path, monkeypatch):
    """The double's call log of this test (``$FAKE_CUDNN_LOG``)."""
    path = tmp_path / "fake_cudnn.log"
    monkeypatch.setenv("FAKE_CUDNN_LOG", str(path))
    return path
