# Sourced by elastic_job.sh and elastic_link_down.sh (needs $cli and $out): two network-namespace
# hosts (scripts/lib/netns.sh, each with a /dev/shm of its own) and an elastic job of --nnodes
# 1:2, one worker per node, host a hosting the rendezvous; the job writes $out/run.
#   elastic_start TAG PORT NODE_TIMEOUT [RDZV_TIMEOUT]  makes the hosts (exit 77 when the sandbox
#                                        refuses namespaces), starts a launcher on each (pids $a,
#                                        $b; --rdzv-timeout RDZV_TIMEOUT, 300 by default) and
#                                        returns once the 2-node world has written a checkpoint
#   elastic_node HOST LOG                starts one more launcher of the job on HOST
#   wait_for 'CONDITION'                 evaluated again every 0.1 s, for up to 120 s
#   checkpoints                          how many checkpoints $out/run holds
# The job trains $ELASTIC_EPOCHS epochs (3 by default).
# The job's secret (Note [Job secret]): the nodes, replicas and lighthouse of a test share it.
export SCALETRAIN_SECRET=${SCALETRAIN_SECRET:-scaletrain-tests-secret-0123456789}
source "$(dirname "${BASH_SOURCE[0]}")/../../scripts/lib/netns.sh"
train="train --device cpu --dataset synthetic --limit-train 4096 --limit-test 256 --epochs ${ELASTIC_EPOCHS:-3} --batch-size 32 --log-every 1 --no-progress --timeout 20 --checkpoint-every 8 --keep 1000"

wait_for() {
  local i=0
  while ! eval "$1" && [ $i -lt 1200 ]; do sleep 0.1; i=$((i + 1)); done
}

# (a folder ckpt-<step>/ by default, a file ckpt-<step>.st with --checkpoint-format full)
checkpoints() { ls "$out/run" 2>/dev/null | grep -cE '^ckpt-[0-9]+(\.st)?$'; }

elastic_node() {
  on_host "$1" "$cli" $elastic -- "$cli" $train --out "$out/run" > "$2" 2>&1 &
}

elastic_start() {
  trap netns_cleanup EXIT
  netns_hosts "$1$$" private > /dev/null || exit 77
  mkdir -p "$out"
  elastic="run --nnodes 1:2 --nproc-per-node 1 --master-addr $NETNS_MASTER --master-port $2 --rdzv-last-call 2 --node-timeout $3 --rdzv-timeout ${4:-300} --max-restarts 0 --grace-period 3"
  elastic_node "$NETNS_A" "$out/a.log"
  a=$!
  elastic_node "$NETNS_B" "$out/b.log"
  b=$!
  wait_for 'grep -q "world 2," "$out/a.log"'
  wait_for '[ "$(checkpoints)" -ge 1 ]'
}
