#!/bin/bash
# An elastic job (--nnodes 1:2, one worker per node, --node-timeout 4) on two network-namespace
# hosts (scripts/lib/netns.sh, each with a /dev/shm of its own); host a hosts the rendezvous.
# Once the 2-node world has written a checkpoint, host b's link goes down and stays down until
# both launchers have ended. Prints both hosts' logs ("== a ==", "== b ==") and "a exit S",
# "b exit S", and what is left on each host; exits 77 when the sandbox refuses namespaces.
# usage: elastic_link_down.sh SCALETRAIN OUT_DIR
set -u
cli=$1; out=$2
source "$(dirname "$0")/../../scripts/lib/netns.sh"
trap netns_cleanup EXIT
netns_hosts "ec$$" private > /dev/null || exit 77
mkdir -p "$out"
train="train --device cpu --dataset synthetic --limit-train 4096 --limit-test 256 --epochs 3 --batch-size 32 --log-every 1 --no-progress --timeout 20 --checkpoint-every 8"
elastic="run --nnodes 1:2 --nproc-per-node 1 --master-addr $NETNS_MASTER --master-port 29419 --rdzv-last-call 2 --node-timeout 4 --max-restarts 0 --grace-period 3"
wait_for() {  # 'CONDITION': evaluated again every 0.1 s, for up to 120 s
  local i=0
  while ! eval "$1" && [ $i -lt 1200 ]; do sleep 0.1; i=$((i + 1)); done
}
on_host "$NETNS_A" "$cli" $elastic -- "$cli" $train --out "$out/run" > "$out/a.log" 2>&1 &
a=$!
on_host "$NETNS_B" "$cli" $elastic -- "$cli" $train --out "$out/run" > "$out/b.log" 2>&1 &
b=$!
wait_for 'grep -q "world 2," "$out/a.log"'
wait_for 'ls "$out/run"/ckpt-*.st > /dev/null 2>&1'
ip -n "$NETNS_B" link set "${NETNS_TAG}y" down
echo "link of host b down"
wait $b; sb=$?
wait $a; sa=$?
for f in a b; do echo "== $f =="; cat "$out/$f.log"; done
echo "a exit $sa"
echo "b exit $sb"
echo "left on host a: $(ip netns pids "$NETNS_A" | wc -l), on host b: $(ip netns pids "$NETNS_B" | wc -l)"
exit 0
