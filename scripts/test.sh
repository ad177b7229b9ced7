#!/usr/bin/env bash
# Set up .venv (editable install with the test extras) and run the whole test suite.
# GPU tests run where a GPU, CuPy and cuDNN are present and are skipped elsewhere.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh
ensure_venv
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[test]'
ensure_local_torch
ensure_cudnn_headers
exec .venv/bin/python -m pytest -q "$@"
