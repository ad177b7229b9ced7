"""mucudnn.settings: one table of the MUCUDNN_* environment, mirroring shim/src/options.c."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
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


# -- invalid values: marked by `env`, refused by the commands that pass the environment on ---------

INVALID = {"MUCUDNN_LOG_LEVEL": "banana", "MUCUDNN_WORKSPACE_LIMIT": "abc",
           "MUCUDNN_MEMORY_BUDGET": "-3"}


def test_env_marks_each_invalid_value_with_what_is_accepted():
    valid = {"MUCUDNN_SUMMARY": "yes", "MUCUDNN_ROOM_MARGIN": "128MiB", "MUCUDNN_OFFLOAD": "cheap"}
    result = CliRunner().invoke(main, ["env"], env={**INVALID, **valid})
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    for name, value in INVALID.items():
        [line] = [line for line in lines if line.startswith(f"{name} = ")]
        rule = settings.setting(name).rule
        assert line == f"{name} = {value}  (invalid: expected {rule.accepted})"
    for name, value in valid.items():
        assert f"{name} = {value}" in lines


def test_run_refuses_invalid_settings_in_one_line(fake_exec, monkeypatch):
    from test_cli import assert_one_error_line
    for name, value in INVALID.items():
        monkeypatch.setenv(name, value)
    result = CliRunner().invoke(main, ["run", "--", "python", "train.py"])
    line = assert_one_error_line(result, *(f"{name}='{value}'" for name, value in INVALID.items()))
    assert "error, warning, info, debug or 0-3" in line and "mucudnn env" in line
    assert fake_exec[1] == []  # nothing ran


def test_a_valid_setting_in_the_environment_is_passed_on(fake_exec, monkeypatch):
    monkeypatch.setenv("MUCUDNN_LOG_LEVEL", "Debug")
    monkeypatch.setenv("MUCUDNN_MEMORY_BUDGET", "6GiB")
    result = CliRunner().invoke(main, ["run", "--", "python", "train.py"])
    assert result.exit_code == 0, result.output
    [(_, env)] = fake_exec[1]
    assert env["MUCUDNN_LOG_LEVEL"] == "Debug" and env["MUCUDNN_MEMORY_BUDGET"] == "6GiB"


def _options_c_kinds() -> dict[str, str]:
    text = (ROOT / "shim" / "src" / "options.c").read_text()
    return dict(re.findall(r'\{\s*"(MUCUDNN_[A-Z_]+)",\s*(KIND_[A-Z]+)', text))


def _options_c_forms() -> dict[str, str]:
    """options.c's expected_form: what the shim says each kind accepts."""
    text = (ROOT / "shim" / "src" / "options.c").read_text()
    return dict(re.findall(r'case (KIND_[A-Z]+): return "([^"]+)";', text))


def test_each_shim_setting_accepts_what_the_shim_reads():
    kinds, forms = _options_c_kinds(), _options_c_forms()
    assert len(kinds) >= 9 and len(forms) == 5
    for row in settings.SETTINGS:
        if settings.SHIM in row.read_by:
            if row.name == "MUCUDNN_MEMORY_BUDGET":  # also read by Python, which needs over 0
                assert row.rule is settings.BUDGET
                continue
            assert row.rule.accepted == forms[kinds[row.name]], row.name


@pytest.mark.parametrize("rule, good, bad", [
    (settings.BOOL, ["1", "0", "TRUE", "no", "On"], ["", "2", "yes please"]),
    (settings.SIZE, ["0", "64MiB", "1.5 GiB", "4096"], ["", "abc", "-3", "64M"]),
    (settings.BUDGET, ["6GiB", "1"], ["0", "-3", "6G", ""]),
    (settings.LEVEL, ["error", "WARNING", "0", "3"], ["banana", "4", ""]),
    (settings.COUNT, ["0", "20000"], ["-1", "1e3", "", " 5", str(1 << 63)]),
    (settings.PATH, ["/tmp/x", "x.plan"], [""]),
    (settings.PLAN_CACHE, ["/tmp/plans", "~/plans", "off", "OFF", ""], ["plans", "./x", "0"]),
])
def test_rules_accept_and_refuse(rule, good, bad):
    assert [rule.test(value) for value in good] == [True] * len(good)
    assert [rule.test(value) for value in bad] == [False] * len(bad)
