#!/bin/bash
# Fault-tolerant replicas on two network-namespace hosts (scripts/lib/netns.sh, each with a
# /dev/shm of its own): the lighthouse and replica 0 on host a, replica 1 on host b, each replica
# 2 ranks under its own launcher. Once replica 1 has logged steps, host b's link goes down for
# 8 s, then comes back. The run is long enough (10 epochs, ~25 s for replica 0 alone) that
# replica 0 cannot finish while the link is down (with 5 epochs it once did, under load, and
# replica 1 came back to a finished run). Prints the lighthouse's and both replicas' output and "replica R exit S";
# exits 77 when the sandbox refuses namespaces.
# usage: ft_netns_link_down.sh SCALETRAIN OUT_DIR
# The job's secret (Note [Job secret]): the nodes, replicas and lighthouse of a test share it.
export SCALETRAIN_SECRET=${SCALETRAIN_SECRET:-scaletrain-tests-secret-0123456789}
set -u
cli=$1; out=$2
source "$(dirname "$0")/../../scripts/lib/netns.sh"
trap netns_cleanup EXIT
netns_hosts "fd$$" private > /dev/null || exit 77
mkdir -p "$out"
on_host "$NETNS_A" "$cli" lighthouse --port 29415 --replicas 2 --join-timeout 3 > "$out/lighthouse.log" 2>&1 &
lighthouse=$!
train="train --device cpu --limit-train 8192 --limit-test 1000 --epochs 10 --batch-size 64 --log-every 1 --no-progress --timeout 20 --ft-timeout 3 --checkpoint-every 40 --fault-tolerant --lighthouse $NETNS_MASTER:29415 --out $out/run"
on_host "$NETNS_A" "$cli" run --nproc-per-node 2 --master-port 0 --max-restarts 5 -- "$cli" $train --replica-id 0 > "$out/replica-0.log" 2>&1 &
r0=$!
on_host "$NETNS_B" "$cli" run --nproc-per-node 2 --master-port 0 --max-restarts 5 -- "$cli" $train --replica-id 1 > "$out/replica-1.log" 2>&1 &
r1=$!
i=0
while [ "$(wc -l < "$out/run/replica-1/metrics.jsonl" 2>/dev/null || echo 0)" -lt 20 ] && [ $i -lt 600 ]; do
  sleep 0.1; i=$((i + 1))
done
ip -n "$NETNS_B" link set "${NETNS_TAG}y" down
echo "link of host b down"
sleep 8
ip -n "$NETNS_B" link set "${NETNS_TAG}y" up
echo "link of host b up"
wait $r0; s0=$?
wait $r1; s1=$?
# `ip netns exec` may leave the lighthouse as its child: stop whatever still runs on host a.
ip netns pids "$NETNS_A" | xargs -r kill -TERM
wait $lighthouse
i=0
while [ -n "$(ip netns pids "$NETNS_A")" ] && [ $i -lt 50 ]; do sleep 0.1; i=$((i + 1)); done
for f in lighthouse replica-0 replica-1; do echo "== $f"; cat "$out/$f.log"; done
echo "replica 0 exit $s0"
echo "replica 1 exit $s1"
exit 0
