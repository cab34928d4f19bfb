#!/usr/bin/env bash
# Downloads (does not install) the Debian packages scaletrain needs to *build*, into .deps/debs,
# for a machine that has CUDA and PyTorch but no package manager access (a GPU node).
# scripts/gpu-check.sh unpacks them there with `dpkg -x` when the system lacks them, and puts
# .deps/fashion-mnist where the tests look for it when that machine has no copy.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .deps/debs
cd .deps/debs
apt-get download googletest libgtest-dev libgmock-dev libcli11-dev nlohmann-json3-dev \
  libspdlog-dev libspdlog1.10 libfmt-dev libfmt9 libgloo-dev libstb-dev libstb0 zlib1g-dev \
  ninja-build
ls -1 "$PWD"
# The Fashion-MNIST files too, for the trainer tests and the GPU figures (scripts/gpu-bench.sh).
if [ -d /usr/share/datasets/fashion-mnist ]; then
  mkdir -p ../fashion-mnist && cp /usr/share/datasets/fashion-mnist/*.gz ../fashion-mnist/
fi
