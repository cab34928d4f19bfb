#!/bin/bash
# A host cut off mid-training: two network-namespace hosts (scripts/lib/netns.sh, each with a
# /dev/shm of its own) train one ddp job of 2 nodes x 1 rank; once a step is logged, host b's
# link goes down. Prints each node's output ("== node0 ==", "== node1 ==") and exits 0 once both
# launchers ended (with whatever status), 77 when the sandbox refuses namespaces.
# usage: netns_link_down.sh SCALETRAIN OUT_DIR
# The job's secret (Note [Job secret]): the nodes, replicas and lighthouse of a test share it.
export SCALETRAIN_SECRET=${SCALETRAIN_SECRET:-scaletrain-tests-secret-0123456789}
set -u
cli=$1; out=$2
source "$(dirname "$0")/../../scripts/lib/netns.sh"
trap netns_cleanup EXIT
netns_hosts "sd$$" private > /dev/null || exit 77
common="run --nnodes 2 --nproc-per-node 1 --master-addr $NETNS_MASTER --master-port 29413 --run-id cut-$$ --grace-period 3"
train="train --device cpu --dataset synthetic --limit-train 20000 --limit-test 64 --epochs 50 --batch-size 16 --log-every 1 --no-progress --timeout 5 --out $out"
on_host "$NETNS_B" "$cli" $common --node-rank 1 -- "$cli" $train > "$out.node1" 2>&1 &
node1=$!
on_host "$NETNS_A" "$cli" $common --node-rank 0 -- "$cli" $train > "$out.node0" 2>&1 &
node0=$!
i=0
while [ ! -s "$out/metrics.jsonl" ] && [ $i -lt 600 ]; do sleep 0.1; i=$((i + 1)); done
ip -n "$NETNS_B" link set "${NETNS_TAG}y" down
echo "link of host b down"
wait $node0; wait $node1
echo "== node0 =="; cat "$out.node0"
echo "== node1 =="; cat "$out.node1"
rm -f "$out.node0" "$out.node1"
exit 0
