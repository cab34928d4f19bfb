#!/usr/bin/env bash
# Regression (FullThreadPoolPerTest): `make test` runs JOBS entries at once, and each sized ATen's
# thread pool to the whole machine: on 16 cores, 8 entries at a time ran ~10x slower than alone
# and timed out. Each entry now gets cores / JOBS threads, at least one, unless the caller set
# OMP_NUM_THREADS. Checks what `make test` would run for several JOBS, and that a caller's value
# wins. Usage: tests/make_test_threads.sh SOURCE_DIR
set -euo pipefail
src=${1:?usage: make_test_threads.sh SOURCE_DIR}
cores=$(nproc)
for jobs in 1 2 3 64; do
  want=$(( cores / jobs )); [ "$want" -gt 0 ] || want=1
  line=$(make -s -n -C "$src" test JOBS="$jobs" BUILD=/nonexistent | grep 'OMP_NUM_THREADS=' || true)
  got=$(env -u OMP_NUM_THREADS bash -c "echo ${line%%\\*}" 2>/dev/null | sed -n 's/.*OMP_NUM_THREADS=\([0-9]*\).*/\1/p')
  [ "$got" = "$want" ] || { echo "JOBS=$jobs on $cores cores: OMP_NUM_THREADS=$got, want $want ($line)"; exit 1; }
  kept=$(OMP_NUM_THREADS=5 bash -c "echo ${line%%\\*}" | sed -n 's/.*OMP_NUM_THREADS=\([0-9]*\).*/\1/p')
  [ "$kept" = 5 ] || { echo "a caller's OMP_NUM_THREADS=5 became $kept ($line)"; exit 1; }
  echo "JOBS=$jobs on $cores cores: $got thread(s) per test"
done
