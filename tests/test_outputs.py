"""Output files: the input check and the atomic writer every command's output goes through."""

from __future__ import annotations

import os

import pytest

from mucudnn import outputs
from mucudnn.errors import MucudnnError
from mucudnn.plan import Plan, write_plan


def test_same_file_sees_through_links_and_relative_paths(tmp_path, monkeypatch):
    target = tmp_path / "store.sqlite"
    target.write_text("x")
    (tmp_path / "link.sqlite").symlink_to(target)
    os.link(target, tmp_path / "hard.sqlite")
    monkeypatch.chdir(tmp_path)
    assert outputs.same_file("link.sqlite", target)
    assert outputs.same_file("hard.sqlite", target)
    assert outputs.same_file("./sub/../missing.plan", tmp_path / "missing.plan")
    assert not outputs.same_file("other.plan", target)


def test_refuse_inputs_as_output_names_the_input(tmp_path):
    config = tmp_path / "r50.yaml"
    config.write_text("name: r50\n")
    outputs.refuse_inputs_as_output(tmp_path / "r50.plan", [("config", config), ("store", None)])
    with pytest.raises(MucudnnError, match=r"-o .*r50.yaml is the config this command reads"):
        outputs.refuse_inputs_as_output(config, [("store", None), ("config", config)])


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "p.plan"
    path.write_text("old\n")

    def broken_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OSError, match="disk full"):
        write_plan(Plan("GPU", 91900, "wr", 1 << 20, "powerOfTwo"), path)
    assert path.read_text() == "old\n"
    assert [p.name for p in tmp_path.iterdir()] == ["p.plan"]


def test_the_written_file_has_the_usual_mode(tmp_path):
    path = tmp_path / "p.plan"
    old = os.umask(0o022)
    try:
        outputs.write_text_atomically(path, "text\n")
    finally:
        os.umask(old)
    assert path.read_text() == "text\n" and path.stat().st_mode & 0o777 == 0o644
