#!/usr/bin/env bash
# Installs whatever scaletrain needs and is missing: the Debian packages listed in
# scripts/debian-packages.txt, and a project-local Python virtual environment (.venv) holding
# PyTorch 2.11.0 (its LibTorch is what we build against) and its Python dependencies.
# Safe to run again: it does nothing when everything is in place.
set -euo pipefail
cd "$(dirname "$0")/.."

TORCH_VERSION=2.11.0
VENV=${SCALETRAIN_VENV:-.venv}
PYTHON=${PYTHON:-python3}

say() { printf '[setup] %s\n' "$*"; }

# --- Debian packages -------------------------------------------------------------------------
mapfile -t wanted < <(sed -e 's/#.*//' -e 's/[[:space:]]//g' scripts/debian-packages.txt | grep -v '^$')
missing=()
for p in "${wanted[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
if ((${#missing[@]})); then
  say "installing Debian packages: ${missing[*]}"
  sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -q
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

# --- Python environment with PyTorch -----------------------------------------------------------
# The stamp records what was installed; when the requirement files change, the venv is updated.
stamp="$VENV/.scaletrain-stamp"
want_stamp=$(cat scripts/setup.sh scripts/requirements*.txt | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want_stamp" ]; then
  exit 0
fi
start=$(date +%s)
[ -x "$VENV/bin/python" ] || { say "creating $VENV"; "$PYTHON" -m venv "$VENV"; }
pip=("$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-cache-dir --no-warn-conflicts)
say "installing torch==$TORCH_VERSION (wheel only, CUDA 13 build) into $VENV"
"${pip[@]}" --no-deps "torch==$TORCH_VERSION"
"${pip[@]}" -r scripts/requirements.txt
"${pip[@]}" -r scripts/requirements-tools.txt
# The wheel's CUDA libraries: a machine with the CUDA 13 toolkit (as ours) already has cudart,
# cuBLAS, cuDNN, NCCL...; only three libraries are then missing. Elsewhere take them all from PyPI.
cuda_lib=""
for d in /usr/local/cuda/lib64 /usr/local/cuda-13*/lib64; do
  [ -e "$d/libcudart.so.13" ] && [ -e "$d/libcudnn.so.9" ] && [ -e "$d/libnccl.so.2" ] && { cuda_lib=$d; break; }
done
if [ -n "$cuda_lib" ]; then
  say "system CUDA 13 libraries found in $cuda_lib; adding the three it lacks"
  "${pip[@]}" --no-deps -r scripts/requirements-cuda-extra.txt
else
  say "no system CUDA 13 toolkit; installing the CUDA runtime libraries from PyPI"
  "${pip[@]}" -r scripts/requirements-cuda-full.txt -r scripts/requirements-cuda-extra.txt
fi
"$VENV/bin/python" -c "import torch; assert torch.__version__.startswith('$TORCH_VERSION'), torch.__version__"
echo "$want_stamp" > "$stamp"
say "python environment ready in $(( $(date +%s) - start )) s"
