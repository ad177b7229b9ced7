"""A stand-in for PyTorch in tests/test_budget.py: only what the memory budget touches, with
PyTorch's lazy CUDA initialisation (torch/cuda/__init__.py) and a log of every call to the
allocator's limit. No GPU, no real torch."""

from . import cuda  # noqa: F401 - as the real torch/__init__.py does
