"""Imported by Python's ``site`` at start-up because ``mucudnn run --memory-budget`` puts this
directory first on PYTHONPATH: installs the memory-budget hook (mucudnn_torch_budget.py, beside
this file), then runs the ``sitecustomize`` this file hides, if the interpreter has one further
down ``sys.path``, as ``sitecustomize`` itself: a site's own customisation keeps working.

Invariant: nothing here imports torch or initialises CUDA; a failure of the hook is one warning
line, never a start-up error of the program.
"""

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))

try:
    import mucudnn_torch_budget
    mucudnn_torch_budget.install_from_environment()
except Exception as _exc:  # noqa: BLE001
    sys.stderr.write(f"mucudnn: warning: memory budget hook not installed: {_exc}; "
                     "PyTorch's memory is not limited\n")


def _run_hidden_sitecustomize() -> None:
    import importlib.machinery
    import importlib.util
    rest = [entry for entry in sys.path if os.path.abspath(entry or os.curdir) != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)  # its errors reach `site` as they would without us


_run_hidden_sitecustomize()
