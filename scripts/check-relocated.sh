#!/usr/bin/env bash
# The installed package is relocatable: installed into one prefix, moved to another folder, with
# the LibTorch it was built against out of reach, a project of its own still finds it
# (find_package(scaletrain)) through its own CMAKE_PREFIX_PATH, builds, links and runs; and no
# installed file names the build tree. CTest runs it (Install.RelocatedPrefixWithBuildTreeGone).
#   scripts/check-relocated.sh BUILD
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
build=$(realpath "${1:-build}")
say() { printf '[relocated] %s\n' "$*"; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

cmake --install "$build" --prefix "$work/installed" > /dev/null
mv "$work/installed" "$work/moved"
prefix=$work/moved
if grep -rl --binary-files=without-match "$build" "$prefix/lib/cmake" "$prefix/include"; then
  say "the files above name the build tree $build"
  exit 1
fi
# The LibTorch it was built against is a hint only: make it unreachable, as on a machine where
# that folder does not exist; the consumer's own path must find one.
config=$prefix/lib/cmake/scaletrain/scaletrainConfig.cmake
[ -f "$config" ] || config=$(find "$prefix" -name scaletrainConfig.cmake | head -1)
sed -i 's|^set(_scaletrain_built_torch_dir ".*")|set(_scaletrain_built_torch_dir "/nonexistent/torch")|' "$config"
grep -q '/nonexistent/torch' "$config" || { say "no build-time LibTorch hint to take away in $config"; exit 1; }
# Nothing else may name the build's LibTorch (its libraries by absolute path broke the link of
# every consumer on a machine without that folder).
if grep -rn --binary-files=without-match "$root/.venv" "$prefix/lib/cmake"; then
  say "the lines above name the build's LibTorch"
  exit 1
fi
torch_prefix=$("$root/.venv/bin/python" -c 'import torch.utils; print(torch.utils.cmake_prefix_path)')

mkdir -p "$work/consumer"
cat > "$work/consumer/CMakeLists.txt" <<'CMAKE'
cmake_minimum_required(VERSION 3.18)
project(consumer LANGUAGES CXX)
find_package(scaletrain 0.1 REQUIRED)
add_executable(consumer main.cpp)
target_link_libraries(consumer PRIVATE scaletrain::scaletrain)
CMAKE
cat > "$work/consumer/main.cpp" <<'CPP'
#include <scaletrain/sampler.h>
#include <scaletrain/version.h>

#include <iostream>

int main() {
  scaletrain::DistributedSampler s({10, 2, 1, true, 0, false});
  std::cout << "scaletrain " << scaletrain::version() << " (LibTorch "
            << scaletrain::libtorch_version() << "): rank 1 of 2 reads " << s.num_samples()
            << " samples\n";
  return s.num_samples() == 5 ? 0 : 1;
}
CPP
launcher=()
command -v ccache > /dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
cmake -S "$work/consumer" -B "$work/consumer/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$prefix;$torch_prefix" "${launcher[@]}" > "$work/configure.log" 2>&1 ||
  { cat "$work/configure.log"; exit 1; }
cmake --build "$work/consumer/build" > "$work/build.log" 2>&1 || { cat "$work/build.log"; exit 1; }
if grep -q "$build" "$work/consumer/build/build.ninja"; then
  say "the consumer's build names the build tree $build:"
  grep -o "[^ ]*$build[^ ]*" "$work/consumer/build/build.ninja" | sort -u | head
  exit 1
fi
env -u LD_LIBRARY_PATH "$work/consumer/build/consumer"
say "found, built and run from a moved prefix, LibTorch from the consumer's own path: ok"
