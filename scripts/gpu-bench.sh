#!/usr/bin/env bash
# The GPU figures of docs/benchmarks.md, on a CUDA machine, once scripts/gpu-check.sh has built
# build-gpu and passed the tests:
#   scripts/gpu-bench.sh OUT_DIR [STEP ...]
# STEP: train (seed 003's ResNet-18 on Fashion-MNIST, 10 epochs, fp32 and bf16 autocast, the data
# on the device, and 3 epochs through the loader), gpt2-small (10 and 100 steps of the 124M GPT
# on the bytes of Python's standard library, bf16: the difference is the steady step), peers
# (PyTorch's Python path on the same models: benchmarks/python/gpu_peer.py), tp-memory (GPT-2
# small's peak memory per rank at --tp 1 and 2, with and without the sequence split), or a
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
  steps=(train gpt2-small tp-memory peers mp-vs-single split-sweep dp-scaling async allreduce pipeline-bubble
    pipeline-memory loader)
tokens() {  # train.bin/val.bin of the standard library's bytes, once
  [ -f "$out/tokens/train.bin" ] && return
  local std
  std=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')
  mkdir -p "$out/text" && cat "$std"/*.py >"$out/text/stdlib.txt"
  "$bin" data text --input "$out/text/stdlib.txt" --out "$out/tokens"
}
failed=()
for step in "${steps[@]}"; do
  start=$(date +%s)
  case $step in
  train)
    # Seed 003: batch 256, plain SGD at lr 0.1, 10 epochs, one GPU.
    r18=(--model resnet18 --batch-size 256 --lr 0.1 --momentum 0 --weight-decay 0 --workers 4
      --resume none --no-progress --overwrite)
    for amp in none bf16; do
      "$bin" train "${r18[@]}" --epochs 10 --amp "$amp" --data-on-device \
        --out "$out/resnet18-$amp" 2>&1 | tee "$out/resnet18-$amp.log"
    done
    "$bin" train "${r18[@]}" --epochs 3 --out "$out/resnet18-loader" 2>&1 |
      tee "$out/resnet18-loader.log"
    ;;
  gpt2-small)
    tokens
    for n in 80 800; do  # 10 and 100 steps of 8 sequences of 1024 tokens
      "$bin" train --model gpt2-small --dataset text --data-dir "$out/tokens" --amp bf16 \
        --optimizer adam --lr 3e-4 --batch-size 8 --epochs 1 --limit-train $n --limit-test 16 \
        --log-every 20 --peak-flops 989e12 --resume none --no-progress --overwrite \
        --out "$out/gpt2-small-$n" 2>&1 | tee "$out/gpt2-small-$n.log"
    done
    ;;
  tp-memory)
    # GPT-2 small (vocabulary padded to 50304, which 2 divides) at --tp 1, --tp 2 and --tp 2
    # --sequence-parallel: two processes share the one GPU over Gloo (NCCL takes one rank per
    # GPU), so the figure is each rank's peak memory in training, and the losses, not speed.
    tokens
    g=(--model gpt2-small --vocab-size 50304 --dataset text --data-dir "$out/tokens" --amp bf16
      --optimizer adam --lr 3e-4 --batch-size 8 --epochs 1 --limit-train 32 --limit-test 1
      --log-every 1 --resume none --no-progress --overwrite)
    "$bin" train "${g[@]}" --out "$out/tp1" 2>&1 | tee "$out/tp1.log"
    tp2=(--nproc-per-node 2 --tp 2 --device cuda --backend gloo)
    "$bin" train "${g[@]}" "${tp2[@]}" --out "$out/tp2" 2>&1 | tee "$out/tp2.log"
    "$bin" train "${g[@]}" "${tp2[@]}" --sequence-parallel --out "$out/tp2sp" 2>&1 |
      tee "$out/tp2sp.log"
    ;;
  peers)
    tokens
    peer=(python3 benchmarks/python/gpu_peer.py)
    for amp in none bf16; do
      "${peer[@]}" resnet18 --loader device --amp $amp --csv "$out/python-resnet18.csv"
    done
    "${peer[@]}" resnet18 --loader dataloader --epochs 2 --csv "$out/python-resnet18.csv"
    "${peer[@]}" resnet50 --loader device --repeats 3 --csv "$out/python-resnet50.csv"
    "${peer[@]}" resnet50 --loader dataloader --repeats 3 --csv "$out/python-resnet50.csv"
    "${peer[@]}" gpt --data "$out/tokens/train.bin" --csv "$out/python-gpt2-small.csv"
    ;;
  *) "$bin" bench "$step" --out "$out/bench" 2>&1 | tee -a "$out/bench.log" ;;
  esac
  rc=$?
  echo "gpu-bench: $step took $(($(date +%s) - start)) s, exit code $rc" | tee -a "$out/steps.log"
  [ $rc -eq 0 ] || failed+=("$step")
done
[ ${#failed[@]} -eq 0 ] || { echo "gpu-bench: failed: ${failed[*]}"; exit 1; }
