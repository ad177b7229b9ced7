"""mucudnn.settings: one table of the MUCUDNN_* environment, mirroring shim/src/options.c."""

from __future__ import annotations

import re
from pathlib import Path

from click.testing import CliRunner

from mucudnn import settings
from mucudnn.cli import main

ROOT = Path(__file__).resolve().parent.parent


def _options_c_names() -> list[str]:
    """The names of options.c's table, read from its source text."""
    text = (ROOT / "shim" / "src" / "options.c").read_text()
    table = text[text.index("static option_entry options[MU_OPT_COUNT]"):]
    table = table[:table.index("};")]
    return re.findall(r'\[MU_OPT_[A-Z_]+\]\s*=\s*\{\s*"(MUCUDNN_[A-Z_]+)"', table)


def test_the_shim_rows_are_options_c_table():
    names = _options_c_names()
    assert len(names) >= 9
    assert [s.name for s in settings.SETTINGS if settings.SHIM in s.read_by] == names


def test_every_setting_the_package_reads_is_in_the_table():
    known = {s.name for s in settings.SETTINGS}
    package = ROOT / "mucudnn"
    sources = [p for p in package.rglob("*.py") if "shim_src" not in p.parts]
    used = {name for path in sources for name in re.findall(r"MUCUDNN_[A-Z_]+", path.read_text())}
    assert used - known == set()
    assert len({s.name for s in settings.SETTINGS}) == len(settings.SETTINGS)


def test_env_prints_each_setting_with_its_value_here():
    result = CliRunner().invoke(main, ["env"], env={"MUCUDNN_PLAN": "/tmp/x.plan",
                                                    "MUCUDNN_STORE": None})
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    for row in settings.SETTINGS:
        assert sum(line.startswith(f"{row.name} = ") for line in lines) == 1
        assert row.meaning in result.output
    assert "MUCUDNN_PLAN = /tmp/x.plan" in lines and "MUCUDNN_STORE = (unset)" in lines


def test_user_cache_dir_ignores_a_relative_xdg(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert settings.user_cache_dir() == tmp_path / "mucudnn"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative")
    assert settings.user_cache_dir() == Path("~/.cache/mucudnn").expanduser()
