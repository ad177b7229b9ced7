"""``import mucudnn.torch`` loads neither PyTorch nor the tuner stack (PEP 562 lazy names in
mucudnn/__init__.py): a training process pays only for what it uses."""

from __future__ import annotations

import subprocess
import sys

import pytest

import mucudnn

HEAVY = ("torch", "sqlite3", "yaml", "pulp", "mucudnn.store", "mucudnn.tuner")


@pytest.mark.parametrize("statement", ["import mucudnn.torch", "import mucudnn.torch.profiles",
                                       "import mucudnn.torch.planner", "import mucudnn"])
def test_importing_the_torch_package_loads_no_heavy_module(statement):
    # the check, as a user runs it: a fresh interpreter
    code = f"{statement}, sys; print([m for m in {HEAVY!r} if m in sys.modules])"
    done = subprocess.run([sys.executable, "-c", code],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_every_public_name_resolves_and_is_listed():
    assert mucudnn.__all__ == sorted(mucudnn.__all__)
    for name in mucudnn.__all__:
        assert getattr(mucudnn, name) is not None
        assert name in dir(mucudnn)
    from mucudnn import ConvProblem, MucudnnError, load_config, optimize  # noqa: F401
    from mucudnn.problem import ConvProblem as defined
    assert ConvProblem is defined


def test_an_unknown_name_is_an_attribute_error_and_submodules_still_import():
    with pytest.raises(AttributeError, match="no_such_name"):
        mucudnn.no_such_name  # noqa: B018
    from mucudnn import sizes
    assert sizes.parse_size("1KiB") == 1024
