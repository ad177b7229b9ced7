"""The site hook's offload options (mucudnn/_torch_site/mucudnn_torch_budget.py) read as
mucudnn's settings table (mucudnn/settings.py) says: the hook cannot import mucudnn, so its
readings of ``MUCUDNN_OFFLOAD_FREEZE_GC``, ``_RESCUE``, ``_LEND``, ``_STAND_ASIDE`` and
``_REPLAY`` are checked here against the table's rule."""

from __future__ import annotations

import pytest

from mucudnn import budget as budget_mod
from mucudnn import settings

hook = budget_mod._hook()
WORDS = ["1", "0", "true", "false", "yes", "no", "on", "off", "TRUE", " On ", "2", "maybe",
         "-1", "y", "n", "enabled"]


SWITCHES = {"MUCUDNN_OFFLOAD_FREEZE_GC": (hook.offload_freeze_gc, True),
            "MUCUDNN_OFFLOAD_LEND": (hook.offload_lend, False),
            "MUCUDNN_OFFLOAD_STAND_ASIDE": (hook.offload_stand_aside, True),
            "MUCUDNN_OFFLOAD_REPLAY": (hook.offload_replay, True)}


@pytest.mark.parametrize("name", SWITCHES)
@pytest.mark.parametrize("text", WORDS)
def test_an_on_off_switch_reads_what_the_settings_table_accepts(name, text, capsys):
    read, default = SWITCHES[name]
    value = read(text)
    accepted = next(s for s in settings.SETTINGS if s.name == name).rule.test(text.strip())
    warned = name in capsys.readouterr().err
    assert warned == (not accepted)
    if accepted:
        assert value == (text.strip().lower() in {"1", "true", "yes", "on"})
    else:
        assert value is default   # the default, after one warning line


def test_freeze_gc_unset_or_empty_is_the_default():
    assert hook.offload_freeze_gc(None) is True
    assert hook.offload_freeze_gc("") is True


RESCUE = next(s for s in settings.SETTINGS if s.name == "MUCUDNN_OFFLOAD_RESCUE")


@pytest.mark.parametrize("text", WORDS + ["always", "ALWAYS", " always "])
def test_rescue_reads_what_the_settings_table_accepts(text, capsys):
    value = hook.offload_rescue(text)
    accepted = RESCUE.rule.test(text)
    warned = "MUCUDNN_OFFLOAD_RESCUE" in capsys.readouterr().err
    assert warned == (not accepted)
    word = text.strip().lower()
    if not accepted or word in {"1", "true", "yes", "on"}:
        assert value is True      # the default (after one warning line where not accepted)
    elif word == "always":
        assert value == "always"
    else:
        assert value is False


def test_rescue_unset_or_empty_is_the_default():
    assert hook.offload_rescue(None) is True and hook.offload_rescue("") is True



def test_lend_unset_or_empty_is_the_default_off():
    assert hook.offload_lend(None) is False and hook.offload_lend("") is False
