"""Scripts that answer questions about mucudnn, on a GPU or from stored measurements.

benchmarks/README.md maps each to its question and the command that reproduces its results. Run
them from the repository root as modules (``python -m benchmarks.limit_bound ...``); what they
share with each other or with tests lives in the ``mucudnn`` package.
"""
