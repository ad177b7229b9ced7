#!/usr/bin/env bash
# Set up .venv so that every command of the README works, then run the main job: tune ResNet-50
# (fp32, N=256) under a 64 MiB workspace limit and print the plan.
#   - always: mucudnn installed in .venv, cuDNN headers found or fetched (scripts/setup.sh), the
#     shim (libmucudnn.so) built for `mucudnn run`;
#   - with an NVIDIA GPU (nvidia-smi lists one): the [gpu] extra (CuPy) too, and ResNet-50's
#     kernels benchmarked on this GPU before tuning (about a minute);
#   - without one: the plan comes from the measurements shipped with mucudnn (an H200).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh
ensure_venv
pip_install() { .venv/bin/python -m pip install -q --disable-pip-version-check "$@"; }
gpu=0
if has_nvidia_gpu; then gpu=1; fi
if [ "$gpu" = 1 ]; then pip_install -e '.[gpu]'; else pip_install -e .; fi
ensure_cudnn_headers
if [ "$gpu" = 1 ]; then
  echo "quickstart: shim built: $(.venv/bin/mucudnn build-shim)"
  if .venv/bin/python -c "from mucudnn.environment import gpu_available as g; raise SystemExit(not g())"; then
    .venv/bin/mucudnn bench resnet50
  else
    echo "quickstart: nvidia-smi lists a GPU but CuPy cannot use it: tuning from the shipped measurements" >&2
  fi
elif shim=$(.venv/bin/mucudnn build-shim 2>/dev/null); then
  echo "quickstart: shim built: $shim"
else
  echo "quickstart: the shim did not build here (\`mucudnn build-shim\` says why); tune and show need no shim" >&2
fi
.venv/bin/mucudnn tune resnet50 --workspace-limit 64MiB -o resnet50-64MiB.plan
.venv/bin/mucudnn show resnet50-64MiB.plan
echo
echo "quickstart: done. In a new shell: source .venv/bin/activate, then e.g. mucudnn show resnet50-64MiB.plan"
