#!/usr/bin/env bash
# Regression (FullThreadPoolPerTest): `make test` ran JOBS entries at once, and each sized ATen's
# thread pool to the whole machine: on 16 cores, 8 entries at a time ran ~10x slower than alone
# and timed out. Each entry now gets cores / JOBS threads, at least one, unless the caller set
# OMP_NUM_THREADS. Checks what `make test` would run for several JOBS, that a caller's value
# wins, and that a bad JOBS is refused.
# Usage: tests/make_test_threads.sh SOURCE_DIR
set -euo pipefail
src=${1:?usage: make_test_threads.sh SOURCE_DIR}
# The machine's cores (GNU nproc reports OMP_NUM_THREADS where it is set, as it is under make test).
cores=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)
# `make -n` as a user's shell would run it: no make of ours above it, no thread count set.
plan() { env -u MAKEFLAGS -u MAKELEVEL -u MFLAGS -u OMP_NUM_THREADS make -s -n -C "$src" test "$@"; }
for jobs in 1 2 3 64; do
  want=$(( cores / jobs )); [ "$want" -gt 0 ] || want=1
  recipe=$(plan JOBS="$jobs" BUILD=/nonexistent)
  line=$(grep 'OMP_NUM_THREADS=' <<<"$recipe" || true)
  got=$(env -u OMP_NUM_THREADS bash -c "echo ${line%%\\*}" 2>/dev/null | sed -n 's/.*OMP_NUM_THREADS=\([0-9]*\).*/\1/p')
  [ "$got" = "$want" ] || { echo "JOBS=$jobs on $cores cores: OMP_NUM_THREADS=$got, want $want ($line)"; exit 1; }
  kept=$(OMP_NUM_THREADS=5 bash -c "echo ${line%%\\*}" | sed -n 's/.*OMP_NUM_THREADS=\([0-9]*\).*/\1/p')
  [ "$kept" = 5 ] || { echo "a caller's OMP_NUM_THREADS=5 became $kept ($line)"; exit 1; }
  grep -q "ctest .* -j $jobs " <<<"$recipe" ||
    { echo "JOBS=$jobs: ctest does not run $jobs entries at once: $recipe"; exit 1; }
  echo "JOBS=$jobs on $cores cores: $got thread(s) per entry, $jobs entries at once"
done
for bad in 0 abc; do
  if out=$(plan JOBS="$bad" 2>&1); then echo "JOBS=$bad was accepted"; exit 1; fi
  grep -q "JOBS=$bad is not a positive number" <<<"$out" || { echo "JOBS=$bad: $out"; exit 1; }
done
echo "a bad JOBS is refused"
