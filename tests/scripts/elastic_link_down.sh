#!/bin/bash
# An elastic job (--nnodes 1:2, one worker per node, --node-timeout 4, --rdzv-timeout 15) on two
# network-namespace hosts (scripts/lib/netns.sh, each with a /dev/shm of its own); host a hosts
# the rendezvous. Once the 2-node world has written a checkpoint, host b's link goes down: for
# DOWN seconds, then up again, or (no DOWN) until both launchers have ended. Prints both hosts'
# logs ("== a ==", "== b =="), "a exit S", "b exit S" and what is left on each host; exits 77
# when the sandbox refuses namespaces.
# usage: elastic_link_down.sh SCALETRAIN OUT_DIR [DOWN]
# The job's secret (Note [Job secret]): the nodes, replicas and lighthouse of a test share it.
export SCALETRAIN_SECRET=${SCALETRAIN_SECRET:-scaletrain-tests-secret-0123456789}
set -u
cli=$1; out=$2; down=${3:-}
# Long enough to outlast a link that comes back: b rejoins a running job.
[ -n "$down" ] && export ELASTIC_EPOCHS=6
source "$(dirname "$0")/elastic_hosts.sh"
elastic_start ec 29419 4 15
ip -n "$NETNS_B" link set "${NETNS_TAG}y" down
echo "link of host b down"
if [ -n "$down" ]; then
  sleep "$down"
  ip -n "$NETNS_B" link set "${NETNS_TAG}y" up
  echo "link of host b up"
fi
wait $b; sb=$?
wait $a; sa=$?
for f in a b; do echo "== $f =="; cat "$out/$f.log"; done
echo "a exit $sa"
echo "b exit $sb"
echo "left on host a: $(ip netns pids "$NETNS_A" | wc -l), on host b: $(ip netns pids "$NETNS_B" | wc -l)"
exit 0
