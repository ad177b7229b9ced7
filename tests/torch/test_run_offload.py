"""`mucudnn run --memory-budget SIZE --offload`: an unmodified script's Python process runs one
OffloadSession (real CPU PyTorch in a child process)."""

import subprocess
import sys
import textwrap

import pytest
from click.testing import CliRunner

torch = pytest.importorskip("torch")
if not hasattr(torch, "autograd") or not hasattr(torch.autograd, "graph"):
    pytest.skip("needs a real PyTorch", allow_module_level=True)

from mucudnn.cli import main  # noqa: E402

SCRIPT = textwrap.dedent("""
    import sys, torch
    hooks = torch.nn.modules.module._global_forward_hooks
    print("hooks", len(hooks))
""")


def run(tmp_path, *options):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    out = tmp_path / "out.txt"
    result = CliRunner().invoke(main, ["run", *options, "--", "sh", "-c",
                                       f"{sys.executable} {script} > {out}"])
    return result, out.read_text() if out.exists() else ""


def test_offload_starts_a_session_in_the_script(tmp_path, monkeypatch):
    monkeypatch.delenv("MUCUDNN_OFFLOAD", raising=False)
    result, out = run(tmp_path, "--memory-budget", "1GiB", "--offload")
    assert result.exit_code == 0, result.output
    assert "hooks 1" in out


def test_without_offload_no_session(tmp_path, monkeypatch):
    monkeypatch.delenv("MUCUDNN_OFFLOAD", raising=False)
    result, out = run(tmp_path, "--memory-budget", "1GiB")
    assert result.exit_code == 0, result.output
    assert "hooks 0" in out


def test_offload_needs_a_budget(tmp_path):
    result, _ = run(tmp_path, "--offload")
    assert result.exit_code != 0 and "--offload needs --memory-budget" in result.output
