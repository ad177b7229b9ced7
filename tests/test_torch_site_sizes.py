"""The site hook's sizes (mucudnn/_torch_site/mucudnn_torch_budget.py): ``MUCUDNN_MEMORY_BUDGET``
set by hand is read in the one grammar of docs/sizes.md, as the shim and mucudnn.sizes read it.
The hook cannot import mucudnn (it runs in the program's interpreter at start-up), so it has its
own parser: checked here against the shared vectors (tests/data/sizes.txt) and against
:func:`mucudnn.sizes.parse_size` on generated text."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mucudnn import budget as budget_mod
from mucudnn.errors import SizeError
from mucudnn.launch import SITE_DIR
from mucudnn.sizes import parse_size
from size_vectors import read_size_vectors

hook = budget_mod._hook()
FAKE_TORCH = Path(__file__).resolve().parent / "faketorch"
GIB = 1 << 30


@pytest.mark.parametrize("text, expected", read_size_vectors(), ids=repr)
def test_the_hook_reads_the_shared_size_vectors(text, expected):
    if isinstance(expected, int):
        assert hook.parse_size(text) == expected
    else:
        with pytest.raises(hook.SizeProblem) as exc:
            hook.parse_size(text)
        assert exc.value.kind == expected


@pytest.mark.parametrize("text, expected", read_size_vectors(), ids=repr)
def test_a_budget_is_any_size_above_zero_else_one_warning_line(text, expected, capsys,
                                                               monkeypatch):
    monkeypatch.delenv("MUCUDNN_LOG_LEVEL", raising=False)
    monkeypatch.delenv("MUCUDNN_BUDGET_REPORT", raising=False)
    budget = hook.read_budget(text)
    err = capsys.readouterr().err
    if not text.strip(" \t\n\r\f\v"):
        assert budget is None and err == ""          # unset, in effect
    elif isinstance(expected, int) and expected > 0:
        assert budget == expected and err == ""
    else:
        assert budget is None
        (line,) = err.splitlines()
        assert line.startswith(f"mucudnn: warning: MUCUDNN_MEMORY_BUDGET={text!r} is not ")
        assert line.endswith("; PyTorch's memory is not limited")


@pytest.mark.parametrize("text, expected", [
    ("0" * 5000 + "1", 1),                                   # Python converts 4300 digits at most
    ("0" * 9000 + "1." + "9" * 9000 + "KiB", 2047),
    ("0." + "0" * 5000 + "1TiB", 0),
    ("1" * 5000, "range"),
    ("0." + "9" * 5000 + "B", 0),
])
def test_a_size_of_thousands_of_digits_is_read_exactly(text, expected):
    if isinstance(expected, int):
        assert hook.parse_size(text) == parse_size(text) == expected
        return
    with pytest.raises(hook.SizeProblem) as exc:
        hook.parse_size(text)
    assert exc.value.kind == expected
    with pytest.raises(SizeError, match="out of range"):
        parse_size(text)


SIZE_TEXT = st.text(alphabet=" \t\n0123456789.-+eEbBkKmMgGtTiIx\u00a0\u0663", max_size=14)


@given(st.one_of(SIZE_TEXT, st.from_regex(
    r"\A[ \t]?[0-9]{1,22}(\.[0-9]{1,22})?[ \t]?([kKmMgGtT][iI]?)?[bB]?[ \t]?\Z")))
def test_the_hook_and_mucudnn_sizes_agree_on_any_text(text):
    try:
        expected = parse_size(text)
    except SizeError:
        expected = None
    try:
        got = hook.parse_size(text)
    except hook.SizeProblem:
        got = None
    assert got == expected


PROGRAM = textwrap.dedent("""
    import torch
    torch.cuda._lazy_init()
    print("ran")
""")


def run_with_budget(value, tmp_path, monkeypatch):
    log = tmp_path / "torch.log"
    monkeypatch.setenv("PYTHONPATH", f"{SITE_DIR}:{FAKE_TORCH}")
    monkeypatch.setenv("FAKE_TORCH_LOG", str(log))
    monkeypatch.setenv("FAKE_TORCH_DEVICES", f"{80 * GIB},{40 * GIB}")
    monkeypatch.setenv("MUCUDNN_MEMORY_BUDGET", value)
    for name in ("MUCUDNN_LOG_LEVEL", "MUCUDNN_BUDGET_REPORT", "MUCUDNN_OFFLOAD"):
        monkeypatch.delenv(name, raising=False)
    done = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True)
    events = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return done, [e["fraction"] for e in events if e["event"] == "fraction"]


@pytest.mark.parametrize("value", ["6GiB", " 6 gib\n", "6442450944", "6.0GiB"])
def test_a_budget_set_by_hand_as_a_size_limits_pytorch(value, tmp_path, monkeypatch):
    done, fractions = run_with_budget(value, tmp_path, monkeypatch)
    assert (done.returncode, done.stdout, done.stderr) == (0, "ran\n", "")
    assert fractions == [6 / 80, 6 / 40]


@pytest.mark.parametrize("value, problem", [
    ("6G", "is not a size (a bare G is ambiguous: write 6GiB (powers of 2) or 6GB (powers of "
           "10))"),
    ("6 parsecs", "is not a size (expected bytes, or a number with B, KiB, MiB, GiB, TiB, KB, "
                  "MB, GB or TB, e.g. 6GiB)"),
    ("99999999999TiB", "is not a size (more than 2^63-1 bytes)"),
    ("0.1", "is not more than 0 bytes"),
])
def test_a_bad_budget_set_by_hand_is_one_warning_line_and_no_limit(value, problem, tmp_path,
                                                                   monkeypatch):
    done, fractions = run_with_budget(value, tmp_path, monkeypatch)
    assert (done.returncode, done.stdout, fractions) == (0, "ran\n", [])
    assert done.stderr.splitlines() == [
        f"mucudnn: warning: MUCUDNN_MEMORY_BUDGET={value!r} {problem}; PyTorch's memory is "
        "not limited"]
