#!/usr/bin/env bash
# Runs binaries built on the Debian machine (against the same PyTorch 2.11.0+cu130 wheel) on the
# GPU machine, with that machine's own copy of LibTorch. Everything lands in $OUT.
set -uo pipefail
: "${OUT:?set OUT to the folder for the output}"
exec > >(tee "$OUT/log.txt") 2>&1
t0=$(date +%s)
say() { echo "== $(( $(date +%s) - t0 )) s: $*"; }
R=$PWD
date; nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader
nproc; lscpu | grep "Model name"
if [ "$R" != /work/main ]; then mkdir -p /work; rm -rf /work/main; ln -s "$R" /work/main; fi
cd /work/main
mkdir -p build && tar -xzf .gpu/build.tar.gz -C build
SP=$(python3 -c 'import torch, os; print(os.path.dirname(os.path.dirname(torch.__file__)))')
PYBIN=$(python3 -c 'import sys; print(sys.executable)')
mkdir -p .venv/lib/python3.11 .venv/bin
ln -sfn "$SP" .venv/lib/python3.11/site-packages
ln -sf "$PYBIN" .venv/bin/python; ln -sf "$PYBIN" .venv/bin/python3
export LD_LIBRARY_PATH=/work/main/.gpu/lib
mkdir -p /usr/share/datasets && cp -r .gpu/fashion-mnist /usr/share/datasets/
python3 -c 'import torch; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0))'
bin=build/scaletrain
say "version"
$bin --version
SCALETRAIN_LOAD_TORCH_CUDA=0 $bin --version
say "CUDA tests, the CUDA half's tests"
ctest --test-dir build -R "Cuda|TorchCudaHalf|GpusCounted|NoCudaHalf" -j 4 --output-on-failure \
  --timeout 300 >"$OUT/ctest-cuda.txt" 2>&1
tail -25 "$OUT/ctest-cuda.txt"
say "seed 003: ResNet-18, fp32, data on the device, 10 epochs; Python with the set on the GPU"
r18=(--model resnet18 --batch-size 256 --lr 0.1 --momentum 0 --weight-decay 0 --workers 4
  --resume none --no-progress --overwrite)
$bin train "${r18[@]}" --epochs 10 --amp none --data-on-device --out /tmp/r18 2>&1 | tail -12
cp /tmp/r18/metrics.jsonl "$OUT/r18-dev-none.jsonl" 2>/dev/null
python3 benchmarks/python/gpu_peer.py resnet18 --loader device --amp none --csv "$OUT/python.csv"
say "GPT-2 small: 10 and 100 steps; Python"
std=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')
mkdir -p /tmp/text && cat "$std"/*.py >/tmp/text/stdlib.txt
$bin data text --input /tmp/text/stdlib.txt --out /tmp/tokens | tail -2
for n in 80 800; do
  $bin train --model gpt2-small --dataset text --data-dir /tmp/tokens --amp bf16 \
    --optimizer adam --lr 3e-4 --batch-size 8 --epochs 1 --limit-train $n --limit-test 16 \
    --log-every 20 --peak-flops 989e12 --resume none --no-progress --overwrite \
    --out /tmp/gpt-$n 2>&1 | tail -6
  cp /tmp/gpt-$n/metrics.jsonl "$OUT/gpt-$n.jsonl" 2>/dev/null
done
python3 benchmarks/python/gpu_peer.py gpt --data /tmp/tokens/train.bin --csv "$OUT/python.csv"
say "every other test, 8 at a time, on the GPU machine"
timeout 230 ctest --test-dir build -E "Cuda|TorchCudaHalf|^Examples|^Install|^isa-" -j 8 \
  --timeout 200 >"$OUT/ctest-rest.txt" 2>&1
echo "ctest exit $?"
grep -E "tests passed|tests failed|\*\*\*|Failed|Timeout|Not Run" "$OUT/ctest-rest.txt" | tail -40
say "done"
