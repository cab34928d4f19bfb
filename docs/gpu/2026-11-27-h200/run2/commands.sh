#!/usr/bin/env bash
# Second pass: the failures of the first with their output, then the tests not reached, with
# each test's thread pool capped (OMP_NUM_THREADS=2) to see whether 8 tests of 16 threads each
# on 16 cores made them slow.
set -uo pipefail
: "${OUT:?set OUT to the folder for the output}"
exec > >(tee "$OUT/log2.txt") 2>&1
t0=$(date +%s)
say() { echo "== $(( $(date +%s) - t0 )) s: $*"; }
R=$PWD
if [ "$R" != /work/main ]; then mkdir -p /work; rm -rf /work/main; ln -s "$R" /work/main; fi
cd /work/main
if [ ! -x build/scaletrain-tool ]; then
  mkdir -p build && tar -xzf .gpu/build.tar.gz -C build
  SP=$(python3 -c 'import torch, os; print(os.path.dirname(os.path.dirname(torch.__file__)))')
  PYBIN=$(python3 -c 'import sys; print(sys.executable)')
  mkdir -p .venv/lib/python3.11 .venv/bin
  ln -sfn "$SP" .venv/lib/python3.11/site-packages
  ln -sf "$PYBIN" .venv/bin/python; ln -sf "$PYBIN" .venv/bin/python3
  mkdir -p /usr/share/datasets && cp -r .gpu/fashion-mnist /usr/share/datasets/
fi
export LD_LIBRARY_PATH=/work/main/.gpu/lib
say "the first pass's failures, alone, with their output"
ctest --test-dir build -R 'BenchCli.*transformer"|Tokens.TrainCommandTrainsTheGptOnText|Tokens.VocabularyPadded' \
  -j 3 --output-on-failure --timeout 100 >"$OUT/ctest-failed.txt" 2>&1
grep -E "Test +#|tests passed" "$OUT/ctest-failed.txt"
say "the tests not reached, 8 at a time, OMP_NUM_THREADS=2"
ex=$(python3 -c 'import re,sys; print("|".join(re.escape(l.strip()) for l in open(".gpu/done.txt") if l.strip()))')
OMP_NUM_THREADS=2 timeout 190 ctest --test-dir build -E "Cuda|TorchCudaHalf|^Examples|^Install|^isa-|Tokens.TrainCommandTrainsTheGptOnText|Tokens.VocabularyPadded|transformer\"|^($ex)\$" \
  -j 8 --timeout 150 --output-on-failure >"$OUT/ctest-rest2.txt" 2>&1
echo "ctest exit $?"
grep -cE "^ *[0-9]+/[0-9]+ Test" "$OUT/ctest-rest2.txt"
grep -E "^ *[0-9]+/[0-9]+ Test" "$OUT/ctest-rest2.txt" | grep -v Passed | head -30
say "done"
