#!/usr/bin/env bash
# Downloads (does not install) the Debian packages scaletrain needs to *build*, into .deps/debs,
# for a machine that has CUDA and PyTorch but no package manager access (a GPU node).
# scripts/gpu-check.sh unpacks them there with `dpkg -x` when the system lacks them.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .deps/debs
cd .deps/debs
apt-get download googletest libgtest-dev libgmock-dev libcli11-dev nlohmann-json3-dev \
  libspdlog-dev libspdlog1.10 libfmt-dev libfmt9 libgloo-dev libstb-dev libstb0 zlib1g-dev \
  ninja-build
ls -1 "$PWD"
