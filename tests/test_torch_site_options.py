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
            "MUCUDNN_OFFLOAD_REPLAY": (hook.offload_replay, True),
            "MUCUDNN_PINNED_REGISTER": (hook.pinned_register, False)}


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


@pytest.mark.parametrize("cpus,threads", [(None, 1), (1, 1), (2, 2), (3, 2), (12, 8), (16, 16),
                                          (128, 16)])
def test_pinned_register_conf_threads_are_a_power_of_two_within_the_cpus_and_the_cap(cpus,
                                                                                      threads):
    assert hook.PINNED_REGISTER_THREADS == 16
    conf = hook.pinned_register_conf("expandable_segments:True", (2, 11), cpus)
    assert conf == ("expandable_segments:True,pinned_use_cuda_host_register:True,"
                    f"pinned_num_register_threads:{threads}")


def test_pinned_register_conf_leaves_a_conf_alone_where_pytorch_may_not_know_the_keys():
    conf = "expandable_segments:True"
    assert hook.pinned_register_conf(conf, (2, 1), 16) is None   # before 2.2: refused
    assert hook.pinned_register_conf(conf, None, 16) is None     # not known
    assert hook.pinned_register_conf(conf, (2, 2), 4).endswith("pinned_num_register_threads:4")
    assert hook.pinned_register_conf(conf, (3, 0), 4) is not None
    # named already (by the user, or by this hook in the parent of a child process): as it is
    named = conf + ",pinned_use_cuda_host_register:False"
    assert hook.pinned_register_conf(named, (2, 11), 16) is None
    assert hook.pinned_register_conf("", (2, 11), 2) == (
        "pinned_use_cuda_host_register:True,pinned_num_register_threads:2")


@pytest.mark.parametrize("switch", [None, "0", "1"])
def test_register_pinned_from_environment_only_where_switched_on(monkeypatch, switch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    if switch is None:
        monkeypatch.delenv("MUCUDNN_PINNED_REGISTER", raising=False)
    else:
        monkeypatch.setenv("MUCUDNN_PINNED_REGISTER", switch)
    monkeypatch.setattr(hook, "torch_release", lambda: (2, 11))
    hook.register_pinned_from_environment()
    hook.register_pinned_from_environment()   # a child process's hook: not twice
    import os
    conf = os.environ["PYTORCH_CUDA_ALLOC_CONF"]
    assert conf.count("pinned_use_cuda_host_register:True") == (switch == "1")
    assert conf.startswith("expandable_segments:True")


def test_torch_release_reads_the_installed_distribution_or_none(monkeypatch):
    import importlib.metadata
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "2.11.0+cu130")
    assert hook.torch_release() == (2, 11)
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "nightly")
    assert hook.torch_release() is None

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)
    monkeypatch.setattr(importlib.metadata, "version", missing)
    assert hook.torch_release() is None
