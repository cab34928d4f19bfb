#!/bin/bash
# Two hosts made with network namespaces, joined by a veth pair (10.77.<n>.1 and .2), each
# running `scaletrain run` for one node of a 2 nodes x NPROC world that runs `scaletrain check`.
# With SHM=private each host gets a /dev/shm of its own (a tmpfs in its mount namespace), as
# two machines have: then nothing but the veth pair joins them. Exit 77 when the sandbox
# refuses namespaces (the test then skips and says so).
# usage: netns_world.sh SCALETRAIN NPROC [shared|private]
set -u
cli=$1; nproc=${2:-1}; shm=${3:-shared}
tag="st$$"; a="${tag}a"; b="${tag}b"; net=$(( $$ % 200 + 20 ))
cleanup() { ip netns del "$a" 2>/dev/null; ip netns del "$b" 2>/dev/null; }
trap cleanup EXIT
if ! ip netns add "$a" 2>/dev/null || ! ip netns add "$b" 2>/dev/null; then
  echo "network namespaces are not permitted here"; exit 77
fi
ip link add "${tag}x" type veth peer name "${tag}y" || { echo "veth not permitted"; exit 77; }
ip link set "${tag}x" netns "$a" && ip link set "${tag}y" netns "$b" || exit 77
ip -n "$a" addr add "10.77.$net.1/24" dev "${tag}x"
ip -n "$b" addr add "10.77.$net.2/24" dev "${tag}y"
for ns in "$a" "$b"; do ip -n "$ns" link set lo up; done
ip -n "$a" link set "${tag}x" up
ip -n "$b" link set "${tag}y" up
master="10.77.$net.1"
# Runs a command on host $1, in its own mount namespace with a private /dev/shm if asked.
on_host() {
  local ns=$1; shift
  if [ "$shm" = private ]; then
    ip netns exec "$ns" sh -c 'mount -t tmpfs -o size=256m tmpfs /dev/shm && exec "$@"' sh "$@"
  else
    ip netns exec "$ns" "$@"
  fi
}
common="run --nnodes 2 --nproc-per-node $nproc --master-addr $master --master-port 29411 --run-id netns-$$"
on_host "$b" "$cli" $common --node-rank 1 -- "$cli" check --numel 1000 > "/tmp/$tag.node1" 2>&1 &
node1=$!
on_host "$a" "$cli" $common --node-rank 0 -- "$cli" check --numel 1000
s0=$?
wait $node1; s1=$?
cat "/tmp/$tag.node1"; rm -f "/tmp/$tag.node1"
exit $(( s0 != 0 || s1 != 0 ))
