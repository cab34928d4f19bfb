# Two "hosts" made with network namespaces, joined by a veth pair: sourced by
# tests/scripts/netns_world.sh and scripts/bench-hierarchical.sh.
#   netns_hosts TAG [shared|private]  makes hosts ${TAG}a (10.77.N.1) and ${TAG}b (10.77.N.2);
#                                     returns 77 when namespaces or veth are refused here
#   on_host NS CMD...                 runs CMD on a host; with "private", in a mount namespace
#                                     of its own with its own /dev/shm (as a second machine has)
#   netns_link_bytes                  bytes that crossed the link so far (tx + rx on host a)
#   netns_cleanup                     removes both hosts
netns_hosts() {
  NETNS_TAG=$1; NETNS_SHM=${2:-shared}
  NETNS_A="${NETNS_TAG}a"; NETNS_B="${NETNS_TAG}b"; NETNS_NET=$(( $$ % 200 + 20 ))
  NETNS_MASTER="10.77.$NETNS_NET.1"
  if ! ip netns add "$NETNS_A" 2>/dev/null || ! ip netns add "$NETNS_B" 2>/dev/null; then
    echo "network namespaces are not permitted here"; return 77
  fi
  ip link add "${NETNS_TAG}x" type veth peer name "${NETNS_TAG}y" || { echo "veth not permitted"; return 77; }
  ip link set "${NETNS_TAG}x" netns "$NETNS_A" && ip link set "${NETNS_TAG}y" netns "$NETNS_B" || return 77
  ip -n "$NETNS_A" addr add "10.77.$NETNS_NET.1/24" dev "${NETNS_TAG}x"
  ip -n "$NETNS_B" addr add "10.77.$NETNS_NET.2/24" dev "${NETNS_TAG}y"
  for ns in "$NETNS_A" "$NETNS_B"; do ip -n "$ns" link set lo up; done
  ip -n "$NETNS_A" link set "${NETNS_TAG}x" up
  ip -n "$NETNS_B" link set "${NETNS_TAG}y" up
}

on_host() {
  local ns=$1; shift
  if [ "$NETNS_SHM" = private ]; then
    ip netns exec "$ns" sh -c 'mount -t tmpfs -o size=512m tmpfs /dev/shm && exec "$@"' sh "$@"
  else
    ip netns exec "$ns" "$@"
  fi
}

netns_link_bytes() {
  local d=/sys/class/net/${NETNS_TAG}x/statistics
  ip netns exec "$NETNS_A" sh -c "echo \$(( \$(cat $d/tx_bytes) + \$(cat $d/rx_bytes) ))"
}

netns_cleanup() {
  ip netns del "$NETNS_A" 2>/dev/null; ip netns del "$NETNS_B" 2>/dev/null
}
