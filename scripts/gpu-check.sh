#!/usr/bin/env bash
# Builds scaletrain against this machine's own Python PyTorch (a CUDA build) and runs the whole
# test suite, CUDA tests included. Prints the GPU it ran on.
#   scripts/gpu-check.sh [extra ctest args]
# Needs: python3 with torch, cmake, a C++17 compiler. Debian build dependencies come from the
# system when installed, else from .deps/debs (made by scripts/fetch-debs.sh elsewhere).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
BUILD=${BUILD:-build-gpu}

mapfile -t info < <("$PY" - <<'PY'
import torch
print(torch.__version__)
print(torch.utils.cmake_prefix_path)
print(torch.cuda.is_available())
print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU visible")
print(torch.version.cuda)
import sys; print(sys.prefix)
PY
)
echo "PyTorch ${info[0]} (CUDA ${info[4]}) at ${info[1]}"
echo "GPU: ${info[3]}"
[ "${info[2]}" = "True" ] || echo "warning: torch sees no GPU; CUDA tests will skip"

prefix="${info[1]}"
extra=()
if [ -d .deps/debs ] && ! [ -f /usr/include/gtest/gtest.h -a -f /usr/include/CLI/CLI.hpp -a -f /usr/include/gloo/algorithm.h ]; then
  echo "unpacking build dependencies from .deps/debs"
  mkdir -p .deps/root
  for f in .deps/debs/*.deb; do dpkg -x "$f" .deps/root; done
  prefix="$prefix;$PWD/.deps/root/usr"
  export PATH="$PWD/.deps/root/usr/bin:$PATH"
  export CPATH="$PWD/.deps/root/usr/include${CPATH:+:$CPATH}"
  export LIBRARY_PATH="$PWD/.deps/root/usr/lib/x86_64-linux-gnu${LIBRARY_PATH:+:$LIBRARY_PATH}"
  export LD_LIBRARY_PATH="$PWD/.deps/root/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  extra+=(-DGLOO_INCLUDE_DIR="$PWD/.deps/root/usr/include")
fi
if [ -d .deps/fashion-mnist ] && ! [ -d /usr/share/datasets/fashion-mnist ]; then
  mkdir -p /usr/share/datasets && cp -r .deps/fashion-mnist /usr/share/datasets/ ||
    echo "warning: cannot install Fashion-MNIST into /usr/share/datasets; its tests will skip"
fi
# The machine's cores (GNU nproc reports OMP_NUM_THREADS instead where it is set), and the test
# entries run at once, below.
cores=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)
jobs=${CTEST_JOBS:-8}
[[ $jobs =~ ^[1-9][0-9]*$ ]] || { echo "gpu-check: CTEST_JOBS=$jobs is not a positive number"; exit 2; }
gen=(-G Ninja); command -v ninja >/dev/null || gen=()
# The interop tests use this Python (its torch, safetensors, tensorboard) in place of .venv.
[ -x "${info[5]}/bin/python" ] || ln -sf "$(command -v "$PY")" "${info[5]}/bin/python" 2>/dev/null || true
cmake -S . -B "$BUILD" "${gen[@]}" -DCMAKE_PREFIX_PATH="$prefix" \
  -DSCALETRAIN_PYTHON_ENV="${info[5]}" "${extra[@]}"
cmake --build "$BUILD" -j "$cores"
# Eight tests at a time, each with its share of the cores (a full-size thread pool per test made
# them ~10x slower on 16 cores, and some timed out).
threads=$(( cores / jobs )); [ "$threads" -gt 0 ] || threads=1
OMP_NUM_THREADS=${OMP_NUM_THREADS:-$threads} ctest --test-dir "$BUILD" --output-on-failure -j "$jobs" "$@"
echo "gpu-check: all tests passed on ${info[3]}"
