"""The shim's MUCUDNN_WORKSPACE_LIMIT against tests/data/sizes.txt (Python: tests/test_sizes.py)."""

from __future__ import annotations

import pytest

from size_vectors import read_size_vectors

CASE = "op=ws dir=fwd n=2 c=2 in=5x5 k=2 f=3x3"
# What the shim's warning says, besides what a size looks like, for each kind of error.
# A syntax error says neither.
SAYS = {"ambiguous": "a bare K, M, G or T is ambiguous", "range": "more than 2^63-1 bytes"}


def escaped(text: str) -> str:
    """text as the shim's mu_log_escape shows it."""
    named = {"\n": r"\n", "\r": r"\r", "\t": r"\t", "\\": "\\\\"}
    return "".join(named.get(c, f"\\x{ord(c):02x}" if ord(c) < 0x20 or ord(c) == 0x7f else c)
                   for c in text)


@pytest.mark.parametrize("text, expected", read_size_vectors(), ids=repr)
def test_the_shim_reads_the_shared_size_vectors(shim_env, text, expected):
    run = shim_env.run([CASE], env={"MUCUDNN_WORKSPACE_LIMIT": text, "MUCUDNN_LOG_LEVEL": "debug"})
    debug = [line for line in run.shim_lines("debug") if "option MUCUDNN_WORKSPACE_LIMIT" in line]
    warnings = run.shim_lines("warning")
    if isinstance(expected, int):
        assert not warnings, run.stderr
        assert debug[0].startswith(
            f"mucudnn: debug: option MUCUDNN_WORKSPACE_LIMIT = {expected} (environment;"), debug
    else:
        assert len(warnings) == 1 and warnings[0].startswith(
            f"mucudnn: warning: MUCUDNN_WORKSPACE_LIMIT='{escaped(text)}' is not valid ("), run.stderr
        for kind, says in SAYS.items():
            assert (says in warnings[0]) == (kind == expected), warnings[0]
        assert debug[0].startswith("mucudnn: debug: option MUCUDNN_WORKSPACE_LIMIT = none (default;")
