#!/usr/bin/env bash
# Runs the numeric tests (every test that compares float results: transparency, kernels, models,
# data, mixed precision, training) once per CPU dispatch level this machine offers. ATen picks
# its kernels by ATEN_CPU_CAPABILITY, oneDNN by ONEDNN_MAX_CPU_ISA, MKL by
# MKL_ENABLE_INSTRUCTIONS: each level caps all three, so that a tolerance fitted to one kind of
# core fails here rather than on the next machine (Note [Tolerances] in
# tests/support/tolerance.h).
#   scripts/test-isa.sh [--below-native] [BUILD_DIR] [extra ctest flags...]
# --below-native skips the machine's own level (the one a plain `ctest` run already used).
set -euo pipefail
cd "$(dirname "$0")/.."
below_native=0
if [ "${1:-}" = "--below-native" ]; then below_native=1; shift; fi
build=${1:-build}
shift || true

flags=$(grep -m1 '^flags' /proc/cpuinfo || true)
has() { [[ " $flags " == *" $1 "* ]]; }
levels=(default)
has avx2 && has fma && levels+=(avx2)
has avx512f && has avx512bw && has avx512vl && has avx512dq && levels+=(avx512)
((below_native)) && unset 'levels[-1]'

# The numeric entries and those left out of them: tests/numeric_tests.txt.
numeric=$(sed -n 's/^include //p' tests/numeric_tests.txt)
not_numeric=$(sed -n 's/^exclude //p' tests/numeric_tests.txt)

declare -A onednn=([default]=SSE41 [avx2]=AVX2 [avx512]=AVX512_CORE)
declare -A mkl=([default]=SSE4_2 [avx2]=AVX2 [avx512]=AVX512)
status=0
for level in "${levels[@]}"; do
  echo "== numeric tests under ATEN_CPU_CAPABILITY=$level (oneDNN ${onednn[$level]}, MKL ${mkl[$level]})"
  ATEN_CPU_CAPABILITY=$level ONEDNN_MAX_CPU_ISA=${onednn[$level]} \
    MKL_ENABLE_INSTRUCTIONS=${mkl[$level]} \
    ctest --test-dir "$build" -R "$numeric" -E "$not_numeric" --output-on-failure -j "$(nproc)" \
    --timeout 600 "$@" || status=1
done
exit $status
