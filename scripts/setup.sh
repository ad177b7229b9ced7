# Shared set-up of scripts/test.sh and scripts/quickstart.sh (sourced, run from the repository
# root): a .venv of the Python asked for, cuDNN headers where none are installed, and whether an
# NVIDIA GPU is here.

# $PYTHON (default python3) must be >= 3.11 (pyproject.toml's requires-python). A .venv made by
# another Python (another version or installation) is replaced, not reused.
ensure_venv() {
  local python=${PYTHON:-python3} probe='import sys; print("%d.%d" % sys.version_info[:2], sys.base_prefix)'
  local want have
  if ! want=$("$python" -c "$probe" 2>/dev/null); then
    echo "setup: cannot run $python: set PYTHON to a Python >= 3.11" >&2; return 1
  fi
  if ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
    echo "setup: mucudnn needs Python >= 3.11; $python is ${want%% *}: set PYTHON to another" >&2
    return 1
  fi
  if [ -e .venv ]; then
    have=$(.venv/bin/python -c "$probe" 2>/dev/null || echo "unusable")
    if [ "$have" != "$want" ]; then
      echo "setup: .venv is Python $have, not $python's $want: recreating it" >&2
      rm -rf .venv
    fi
  fi
  [ -x .venv/bin/python ] || "$python" -m venv .venv
}

# The shim and the cuDNN test double compile against cudnn.h. Where the environment has none
# (PyTorch's nvidia-cudnn wheel, $MUCUDNN_CUDNN_INCLUDE, /usr/include, an earlier unpack), download
# the pinned nvidia-cudnn wheel once (mucudnn.shimlib.CUDNN_HEADERS_WHEEL), unpack only its headers
# into the user's cache, where every mucudnn command finds them, and delete the wheel. Needs the
# package installed in .venv.
ensure_cudnn_headers() {
  local py=.venv/bin/python spec dest scratch
  if "$py" -c "from mucudnn.shimlib import find_cudnn_include as f; f()" 2>/dev/null; then
    return 0
  fi
  read -r spec dest < <("$py" -c "from mucudnn import shimlib as s; print(s.CUDNN_HEADERS_WHEEL, s.cudnn_headers_cache())")
  [ -n "${dest:-}" ] || { echo "setup: mucudnn.shimlib is not importable from .venv" >&2; return 1; }
  echo "setup: no cudnn.h found; downloading $spec (about 500 MB, once) to unpack its headers into $dest" >&2
  scratch=$(mktemp -d)
  if ! "$py" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
      -d "$scratch" "$spec"; then
    rm -rf "$scratch"; echo "setup: downloading $spec failed" >&2; return 1
  fi
  "$py" -c "import glob, sys; from mucudnn.shimlib import unpack_cudnn_headers as u; u(glob.glob(sys.argv[1] + '/*.whl')[0])" "$scratch" \
    || { rm -rf "$scratch"; return 1; }
  rm -rf "$scratch"
}

# tests/torch run against a CPU PyTorch 2.13.0, installed into .venv only where a torch-2.13.0
# wheel file already lies in $PIP_FIND_LINKS (a local directory): CI machines with that file run
# those tests, every other machine skips them and never downloads PyTorch (gigabytes).
ensure_local_torch() {
  # Only the CPU wheel that lies in $PIP_FIND_LINKS, for this venv's Python, by its path (its small
  # pure-Python dependencies come from the index): never a download of torch's GB-sized builds.
  local dir=${PIP_FIND_LINKS:-} tag wheel
  [ -n "$dir" ] && [ -d "$dir" ] || return 0
  tag=$(.venv/bin/python -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
  wheel=$(ls "$dir"/torch-2.13.0[+-]*-"$tag"-*.whl 2>/dev/null | head -1)
  [ -n "$wheel" ] || return 0
  .venv/bin/python -c 'import torch, sys; sys.exit(torch.__version__.split("+")[0] != "2.13.0")' \
    2>/dev/null && return 0
  echo "setup: installing $wheel (for tests/torch)" >&2
  .venv/bin/python -m pip install -q --disable-pip-version-check "$wheel" \
    || echo "setup: $wheel failed to install: tests/torch skip" >&2
}

# True where the NVIDIA driver lists a GPU (nvidia-smi -L). Asked before CuPy is installed, so it
# does not import anything from .venv.
has_nvidia_gpu() {
  command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU '
}
