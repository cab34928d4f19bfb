#!/bin/bash
# Two hosts made with network namespaces (scripts/lib/netns.sh), each running `scaletrain run`
# for one node of a 2 nodes x NPROC world that runs `scaletrain check`. With SHM=private each
# host gets a /dev/shm of its own, as two machines have: then nothing but the veth pair joins
# them. Exit 77 when the sandbox refuses namespaces (the test then skips and says so).
# usage: netns_world.sh SCALETRAIN NPROC [shared|private]
# The job's secret (Note [Job secret]): the nodes, replicas and lighthouse of a test share it.
export SCALETRAIN_SECRET=${SCALETRAIN_SECRET:-scaletrain-tests-secret-0123456789}
set -u
cli=$1; nproc=${2:-1}; shm=${3:-shared}
source "$(dirname "$0")/../../scripts/lib/netns.sh"
trap netns_cleanup EXIT
netns_hosts "st$$" "$shm" || exit 77
common="run --nnodes 2 --nproc-per-node $nproc --master-addr $NETNS_MASTER --master-port 29411 --run-id netns-$$"
out="/tmp/$NETNS_TAG.node1"
on_host "$NETNS_B" "$cli" $common --node-rank 1 -- "$cli" check --numel 1000 > "$out" 2>&1 &
node1=$!
on_host "$NETNS_A" "$cli" $common --node-rank 0 -- "$cli" check --numel 1000
s0=$?
wait $node1; s1=$?
cat "$out"; rm -f "$out"
exit $(( s0 != 0 || s1 != 0 ))
