#!/bin/bash
# An elastic job (--nnodes 1:2, one worker per node, --node-timeout 4) on two network-namespace
# hosts (scripts/lib/netns.sh, each with a /dev/shm of its own); host a hosts the rendezvous.
# Once the 2-node world has written a checkpoint, host b's link goes down and stays down until
# both launchers have ended. Prints both hosts' logs ("== a ==", "== b ==") and "a exit S",
# "b exit S", and what is left on each host; exits 77 when the sandbox refuses namespaces.
# usage: elastic_link_down.sh SCALETRAIN OUT_DIR
set -u
cli=$1; out=$2
source "$(dirname "$0")/elastic_hosts.sh"
elastic_start ec 29419 4
ip -n "$NETNS_B" link set "${NETNS_TAG}y" down
echo "link of host b down"
wait $b; sb=$?
wait $a; sa=$?
for f in a b; do echo "== $f =="; cat "$out/$f.log"; done
echo "a exit $sa"
echo "b exit $sb"
echo "left on host a: $(ip netns pids "$NETNS_A" | wc -l), on host b: $(ip netns pids "$NETNS_B" | wc -l)"
exit 0
