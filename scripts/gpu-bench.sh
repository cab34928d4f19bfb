#!/usr/bin/env bash
# The GPU figures of docs/benchmarks.md, on a CUDA machine, once scripts/gpu-check.sh has built
# build-gpu and passed the tests:
#   scripts/gpu-bench.sh OUT_DIR [STEP ...]
# STEP: train (seed 003's ResNet-18 on Fashion-MNIST, 10 epochs, fp32 and bf16 autocast), or a
# `scaletrain bench` suite (full sizes). No STEP: all of them but ddp-vs-python (a CPU suite).
# Everything lands in OUT_DIR: logs, the runs' metrics, the suites' CSV/JSON/report (and their
# plots, or the gnuplot scripts to draw them where gnuplot is missing).
set -uo pipefail  # a failing step is reported and the next one runs
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build-gpu}
out=${1:?usage: scripts/gpu-bench.sh OUT_DIR [STEP ...]}
shift
mkdir -p "$out"
bin="$BUILD/scaletrain"
# Libraries that gpu-check.sh unpacked from .deps/debs, where the system lacks them.
if [ -d .deps/root ]; then
  export LD_LIBRARY_PATH="$PWD/.deps/root/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
steps=("$@")
[ ${#steps[@]} -gt 0 ] ||
  steps=(train mp-vs-single split-sweep dp-scaling async allreduce pipeline-bubble pipeline-memory loader)
failed=()
for step in "${steps[@]}"; do
  start=$(date +%s)
  case $step in
  train)
    # Seed 003: batch 256, plain SGD at lr 0.1, 10 epochs, one GPU.
    for amp in none bf16; do
      "$bin" train --model resnet18 --epochs 10 --batch-size 256 --lr 0.1 --momentum 0 \
        --weight-decay 0 --amp "$amp" --workers 4 --resume none --no-progress \
        --out "$out/resnet18-$amp" 2>&1 | tee "$out/resnet18-$amp.log"
    done
    ;;
  *) "$bin" bench "$step" --out "$out/bench" 2>&1 | tee -a "$out/bench.log" ;;
  esac
  rc=$?
  echo "gpu-bench: $step took $(($(date +%s) - start)) s, exit code $rc" | tee -a "$out/steps.log"
  [ $rc -eq 0 ] || failed+=("$step")
done
[ ${#failed[@]} -eq 0 ] || { echo "gpu-bench: failed: ${failed[*]}"; exit 1; }
