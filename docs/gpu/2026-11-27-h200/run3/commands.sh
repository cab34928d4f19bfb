#!/usr/bin/env bash
# Third pass: every test but the installed-package ones (no compiler toolchain for them there) and
# the ISA repeats, 8 at a time with OMP_NUM_THREADS=2 (16 cores / 8), the Python environment whole.
set -uo pipefail
: "${OUT:?set OUT to the folder for the output}"
exec > >(tee "$OUT/log3.txt") 2>&1
t0=$(date +%s)
say() { echo "== $(( $(date +%s) - t0 )) s: $*"; }
R=$PWD
if [ "$R" != /work/main ]; then mkdir -p /work; rm -rf /work/main; ln -s "$R" /work/main; fi
cd /work/main
mkdir -p build && tar -xzf .gpu/build.tar.gz -C build
SP=$(python3 -c 'import torch, os; print(os.path.dirname(os.path.dirname(torch.__file__)))')
PYBIN=$(python3 -c 'import sys; print(sys.executable)')
VENV=$(python3 -c 'import sys; print(sys.prefix)')
rm -rf .venv; mkdir -p .venv/lib/python3.11 .venv/lib/python3.12 .venv/bin
cp "$VENV/pyvenv.cfg" .venv/ 2>/dev/null || printf 'home = %s\ninclude-system-site-packages = false\n' "$(dirname "$(readlink -f "$PYBIN")")" > .venv/pyvenv.cfg
ln -sfn "$SP" .venv/lib/python3.11/site-packages; ln -sfn "$SP" .venv/lib/python3.12/site-packages
ln -sf "$(readlink -f "$PYBIN")" .venv/bin/python; ln -sf "$(readlink -f "$PYBIN")" .venv/bin/python3
.venv/bin/python -c 'import torch, tensorboard, safetensors; print("venv ok", torch.__version__)'
mkdir -p /usr/share/datasets && cp -r .gpu/fashion-mnist /usr/share/datasets/
export LD_LIBRARY_PATH=/work/main/.gpu/lib
command -v ctags || echo "no ctags: the Structure tests are left out"
say "every test but Examples, Install, Structure (ctags) and isa-*, 8 at a time, OMP_NUM_THREADS=2"
OMP_NUM_THREADS=2 timeout 260 ctest --test-dir build -E "^Examples|^Install|^isa-|^Structure" \
  -j 8 --timeout 200 --output-on-failure >"$OUT/ctest-all.txt" 2>&1
echo "ctest exit $?"
grep -E "tests passed|tests failed|Total Test" "$OUT/ctest-all.txt"
grep -E "^ *[0-9]+/[0-9]+ Test" "$OUT/ctest-all.txt" | grep -v "Passed\|Skipped" | head -30
grep -E "^ *[0-9]+/[0-9]+ Test" "$OUT/ctest-all.txt" | sort -t' ' -k1 | awk '{print $(NF-1), $0}' | sort -rn | head -8
say "done"
