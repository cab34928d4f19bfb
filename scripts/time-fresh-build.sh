#!/usr/bin/env bash
# Times a build from nothing: configure and build SOURCE into a new BUILD folder with the compiler
# cache off, as on a fresh machine (the Python environment and the Debian packages are taken as
# installed: scripts/setup.sh times those). Prints one line: configure and build seconds, steps.
#   scripts/time-fresh-build.sh [SOURCE] [BUILD] [JOBS]
# To compare two revisions side by side on one machine (nothing else running):
#   git worktree add /tmp/old <rev> && ln -s "$PWD/.venv" /tmp/old/.venv
#   scripts/time-fresh-build.sh /tmp/old /tmp/build-old && scripts/time-fresh-build.sh . /tmp/build-new
set -euo pipefail
src=$(realpath "${1:-.}")
build=${2:-/tmp/scaletrain-fresh-build}
jobs=${3:-$(nproc)}
[ -f "$src/CMakeLists.txt" ] || { echo "time-fresh-build: $src has no CMakeLists.txt" >&2; exit 2; }
rm -rf "$build"
export CCACHE_DISABLE=1
start=$(date +%s)
cmake -S "$src" -B "$build" -G Ninja > "$build.configure.log" 2>&1 ||
  { cat "$build.configure.log" >&2; exit 1; }
mid=$(date +%s)
cmake --build "$build" -j "$jobs" > "$build.build.log" 2>&1 || { tail -50 "$build.build.log" >&2; exit 1; }
end=$(date +%s)
steps=$(grep -c '^\[' "$build.build.log" || true)
echo "$(git -C "$src" rev-parse --short HEAD 2>/dev/null || echo "$src"): configure $((mid - start)) s," \
  "build $((end - mid)) s ($steps steps, -j $jobs, no compiler cache) on $(nproc) cores:" \
  "$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //')"
