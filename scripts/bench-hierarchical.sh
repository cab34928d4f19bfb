#!/bin/bash
# Flat Gloo against the hierarchical all-reduce (Note [Hierarchical reduce]) on a 2 x 2 world:
# two network-namespace hosts (scripts/lib/netns.sh), each with a /dev/shm of its own, 2 ranks
# each. For each message size and path: time per all-reduce (rank 0, after a barrier; mean of
# the repetitions) and the bytes that crossed the link per all-reduce, from the veth counters of
# two runs of different lengths (their difference divided by the extra all-reduces, so that
# set-up traffic cancels). Writes OUT/hierarchical.csv: path,bytes,seconds,link_bytes.
# usage: scripts/bench-hierarchical.sh SCALETRAIN OUT [REPEATS]
set -u
cli=$(realpath "$1"); out=$2; repeats=${3:-20}
source "$(dirname "$0")/lib/netns.sh"
trap netns_cleanup EXIT
netns_hosts "sb$$" private || exit 77
mkdir -p "$out"
echo "path,bytes,seconds,link_bytes" > "$out/hierarchical.csv"
port=29511
run_world() {  # path bytes repeats csv: the link bytes it took
  local before after
  port=$((port + 1))
  local common="run --nnodes 2 --nproc-per-node 2 --master-addr $NETNS_MASTER --master-port $port --run-id hb-$port --quiet"
  local w="bench-worker allreduce --csv $4 --repeats $3 --only $1 --bytes $2"
  before=$(netns_link_bytes)
  on_host "$NETNS_B" "$cli" $common --node-rank 1 -- "$cli" $w > /dev/null 2>&1 &
  local node1=$!
  on_host "$NETNS_A" "$cli" $common --node-rank 0 -- "$cli" $w > /dev/null 2>&1 || { echo "run failed: $1 $2" >&2; exit 1; }
  wait $node1 || { echo "node 1 failed: $1 $2" >&2; exit 1; }
  after=$(netns_link_bytes)
  echo $((after - before))
}
short=2
for bytes in 65536 1048576 16777216; do
  for path in gloo hier; do
    b1=$(run_world $path $bytes $short "$out/short.csv")
    b2=$(run_world $path $bytes "$repeats" "$out/long_${path}_${bytes}.csv")
    secs=$(awk -F, '{s += $2; n++} END {printf "%.6f", s / n}' "$out/long_${path}_${bytes}.csv")
    per=$(( (b2 - b1) / (repeats - short) ))
    echo "$path,$bytes,$secs,$per" | tee -a "$out/hierarchical.csv"
  done
done
