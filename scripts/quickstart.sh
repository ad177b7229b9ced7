#!/usr/bin/env bash
# Install mucudnn into .venv and tune ResNet-50 (fp32, N=256) under a 64 MiB workspace limit.
# On a machine with an NVIDIA GPU and CuPy the kernels are benchmarked first (about a minute);
# elsewhere the plan comes from the measurements shipped with mucudnn (an H200).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh
ensure_venv
.venv/bin/python -m pip install -q --disable-pip-version-check -e .
if .venv/bin/python -c "from mucudnn.bench import gpu_available as g; raise SystemExit(not g())"; then
  .venv/bin/mucudnn bench resnet50
fi
.venv/bin/mucudnn tune resnet50 --workspace-limit 64MiB -o resnet50-64MiB.plan
.venv/bin/mucudnn show resnet50-64MiB.plan
