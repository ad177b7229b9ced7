#!/usr/bin/env bash
# Set up .venv (editable install with the test extras) and run the whole test suite.
# GPU tests run where a GPU, CuPy and cuDNN are present and are skipped elsewhere.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[test]'

# The shim and the cuDNN test double compile against cudnn.h. Use the environment's (PyTorch's
# nvidia-cudnn wheel, $MUCUDNN_CUDNN_INCLUDE, /usr/include); where there is none, unpack only the
# headers of the nvidia-cudnn-cu13 wheel into build/ (no second cuDNN library gets installed).
if ! .venv/bin/python -c "from mucudnn.shimlib import find_cudnn_include as f; f()" 2>/dev/null; then
  headers=build/cudnn-headers
  if [ ! -f "$headers/nvidia/cudnn/include/cudnn.h" ]; then
    mkdir -p build/wheels
    .venv/bin/python -m pip download -q --disable-pip-version-check --no-deps \
      --only-binary=:all: -d build/wheels 'nvidia-cudnn-cu13>=9,<10'
    .venv/bin/python - "$headers" <<'PY'
import glob, sys, zipfile
wheel = sorted(glob.glob("build/wheels/nvidia_cudnn_cu13-*.whl"))[-1]
with zipfile.ZipFile(wheel) as archive:
    for name in archive.namelist():
        if name.startswith("nvidia/cudnn/include/"):
            archive.extract(name, sys.argv[1])
PY
    rm -rf build/wheels
  fi
  export MUCUDNN_CUDNN_INCLUDE="$PWD/$headers/nvidia/cudnn/include"
fi

exec .venv/bin/python -m pytest -q "$@"
