"""benchmarks/: a package of scripts run as modules, each mapped in benchmarks/README.md."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
SCRIPTS = sorted(p.stem for p in BENCHMARKS.glob("*.py") if p.stem != "__init__")


def test_the_readme_maps_every_script():
    readme = (BENCHMARKS / "README.md").read_text()
    rows = {line.split("|")[1].strip(" `") for line in readme.splitlines()
            if line.startswith("| `")}
    assert rows == set(SCRIPTS)


@pytest.mark.parametrize("script", SCRIPTS)
def test_scripts_import_each_other_as_modules_not_through_sys_path(script):
    tree = ast.parse((BENCHMARKS / f"{script}.py").read_text())
    siblings = set(SCRIPTS)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            assert not {a.name for a in node.names} & siblings, f"{script}: import a sibling"
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            assert node.module not in siblings, f"{script}: from {node.module} import (bare)"


@pytest.mark.parametrize("script", ["limit_bound", "never_slower", "shim_bisect", "pressure",
                                    "models", "grads_sensitivity", "tuning_cost", "engine_census"])
def test_scripts_that_share_code_import_as_modules(script):
    module = importlib.import_module(f"benchmarks.{script}")
    assert callable(module.main)
