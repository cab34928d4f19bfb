#!/usr/bin/env bash
# The examples as a user builds them: scaletrain installed from BUILD into a prefix, each example
# a CMake project of its own configured against it (find_package(scaletrain)), built and run,
# and its result checked. CTest runs it (tests/CMakeLists.txt: Examples.*).
#   scripts/check-examples.sh BUILD install          install into BUILD/examples/prefix
#   scripts/check-examples.sh BUILD ddp|pipeline|data_parallel|trainer|tensor_parallel|python_model|experts
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
build=$(realpath "${1:-build}")
what=${2:?install, ddp, pipeline, data_parallel, trainer, tensor_parallel, python_model or experts}
prefix=$build/examples/prefix
say() { printf '[examples] %s\n' "$*"; }

if [ "$what" = install ]; then
  rm -rf "$prefix"
  cmake --install "$build" --prefix "$prefix" > /dev/null
  # The installed front (bin/scaletrain) needs no LibTorch and hands every subcommand but `run`
  # to the full tool in libexec/scaletrain/, which finds its library (RUNPATH
  # $ORIGIN/../../lib), with no LD_LIBRARY_PATH and whatever folder the prefix is in
  # (regression: a first configure once left the RUNPATH at $ORIGIN/../ and every installed tool
  # failed to start).
  tool=$prefix/bin/scaletrain
  if [ -x "$tool" ]; then
    full=$(find "$prefix" -path '*/scaletrain/scaletrain-tool' -type f | head -1)
    [ -n "$full" ] || { say "the full tool (libexec/scaletrain/scaletrain-tool) was not installed"; exit 1; }
    runpath=$(readelf -d "$full" | sed -n 's/.*R\(UN\)\?PATH.*\[\(.*\)\]/\2/p')
    case ":$runpath:" in
      *':$ORIGIN/../../lib:'* | *':$ORIGIN/../../lib64:'* | *':$ORIGIN/../../lib/'*) ;;
      *) say "the installed full tool's RUNPATH does not name its library folder: $runpath"; exit 1 ;;
    esac
    if readelf -d "$tool" | grep -q 'libtorch\|libscaletrain\|libc10'; then
      say "the installed front links LibTorch or libscaletrain"; exit 1
    fi
    moved=$(mktemp -d)
    cp -a "$prefix" "$moved/p"
    env -u LD_LIBRARY_PATH "$moved/p/bin/scaletrain" --version > /dev/null ||
      { rm -rf "$moved"; say "the installed tool does not start where it is moved"; exit 1; }
    rm -rf "$moved"
  fi
  say "installed into $prefix: $(find "$prefix" -type f | wc -l) files"
  exit 0
fi

# Configure and build the example against the installed package only, with the commands its
# CMakeLists.txt gives a user (no build type: the program's own code is glue around the library's
# calls, and compiles in 14 s instead of 20 at -O3).
launcher=()
command -v ccache > /dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
dir=$build/examples/$what
start=$(date +%s)
cmake -S "$root/examples/$what" -B "$dir" -G Ninja \
  -DCMAKE_PREFIX_PATH="$prefix" "${launcher[@]}" > "$dir.configure.log" 2>&1 ||
  { cat "$dir.configure.log"; exit 1; }
# --clean-first: an install keeps the headers' own times, so an example built before against
# older headers would not be recompiled (and would run against a library of another layout).
cmake --build "$dir" --clean-first > "$dir.build.log" 2>&1 || { cat "$dir.build.log"; exit 1; }
say "$what: configured and built against $prefix in $(( $(date +%s) - start )) s"
bin=$dir/${what}_example
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# A misused example exits 2 with one line saying what to change, never with an abort
# (regression: the examples let UsageError reach std::terminate, SIGABRT).
misuse() {
  local out status
  set +e
  out=$("$@" 2>&1)
  status=$?
  set -e
  if [ "$status" != 2 ] || [ "$(printf '%s\n' "$out" | wc -l)" != 1 ]; then
    say "misused ($*): exit $status, expected 2 and one line:"
    printf '%s\n' "$out"
    exit 1
  fi
  say "$what misused: $out"
}

case $what in
  ddp)
    st=$prefix/bin/scaletrain
    weights() { grep -o 'weights .*' "$1" | head -1; }
    "$st" run --nproc-per-node 2 --master-port 0 -- "$bin" "$work/straight" | tee "$work/a.log"
    # Interrupted at step 40 (in epoch 2), then the same command again: it resumes, exactly.
    if "$st" run --nproc-per-node 2 --master-port 0 -- "$bin" "$work/resumed" 40 > "$work/b0.log" 2>&1; then
      say "the interrupted run did not stop"; exit 1
    fi
    "$st" run --nproc-per-node 2 --master-port 0 -- "$bin" "$work/resumed" > "$work/b.log"
    # PyTorch's own launcher starts the same binary.
    port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    "$root/.venv/bin/torchrun" --no-python --nproc-per-node 2 --master-port "$port" \
      "$bin" "$work/torchrun" > "$work/c.log" 2>&1 || { cat "$work/c.log"; exit 1; }
    a=$(weights "$work/a.log") b=$(weights "$work/b.log") c=$(weights "$work/c.log")
    say "straight: $a; interrupted and resumed: $b; under torchrun: $c"
    [ -n "$a" ] && [ "$a" = "$b" ] && [ "$a" = "$c" ] || { say "the weights differ"; exit 1; }
    misuse env RANK=5 WORLD_SIZE=2 "$bin" "$work/misused"
    ;;
  trainer)
    "$prefix/bin/scaletrain" run --nproc-per-node 2 --master-port 0 -- "$bin" "$work/ddp" ddp
    "$bin" "$work/pipeline" pipeline
    misuse "$bin" "$work/misused" tp
    ;;
  tensor_parallel)
    # Split over 2 ranks, and the same program unsplit on one; a degree the world cannot take.
    "$prefix/bin/scaletrain" run --nproc-per-node 2 --master-port 0 -- "$bin" "$work/tp2" 2
    "$bin" "$work/tp1" 1
    misuse "$bin" "$work/misused" 2
    misuse "$bin" "$work/misused" two
    ;;
  experts)
    # The experts over 2 ranks, and the same program with every expert on one; a degree the
    # world cannot take.
    "$prefix/bin/scaletrain" run --nproc-per-node 2 --master-port 0 -- "$bin" "$work/ep2" 2
    "$bin" "$work/ep1" 1
    misuse "$bin" "$work/misused" 2
    ;;
  python_model)
    # A model Python defines and saves; trained here under fsdp; Python takes its weights back.
    py=$root/.venv/bin/python
    "$py" "$root/examples/python_model/make_model.py" "$work/spirals.pt"
    "$prefix/bin/scaletrain" run --nproc-per-node 2 --master-port 0 -- "$bin" "$work/spirals.pt" "$work/out"
    "$py" -c 'import sys, torch; m = torch.jit.load(sys.argv[1]); m.load_state_dict(torch.load(sys.argv[2])); print("[examples] Python loaded", sys.argv[2], "by name")' "$work/spirals.pt" "$work/out/model.pt"
    misuse "$bin" "$work/none.pt" "$work/misused"
    ;;
  pipeline) "$bin" cpu,cpu 8 && misuse "$bin" cpu,cpu,cpu 8 ;;
  data_parallel) "$bin" cpu,cpu && misuse "$bin" "" ;;
  *) say "unknown example '$what'"; exit 2 ;;
esac
say "$what: ok"
