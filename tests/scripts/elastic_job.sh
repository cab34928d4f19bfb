#!/bin/bash
# An elastic job (--nnodes 1:2, one worker per node, --max-restarts 0) on two network-namespace
# hosts (scripts/lib/netns.sh, each with a /dev/shm of its own); host a hosts the rendezvous.
# Once the 2-node world has written a checkpoint, every process of host b is killed: the job goes
# on at a world of 1. Once that world has written two checkpoints, host b's launcher is started
# again: the world grows back to 2 and the job ends. Then a fixed 2-node job (`--nnodes 2` on
# loopback) resumes from the checkpoint the elastic job's last world resumed from, into OUT/ref.
# With "attack", an outsider on host b's network without the job's secret
# (tests/scripts/attacker.py) attacks the rendezvous before host b is killed: DONE, a phantom
# JOIN, guessed proofs, a flood and slow connections ("attacker exit S", "rounds that ended
# during the attacks: N", and its log as "== attacker =="); the job trains 12 epochs instead of
# 3, as the attacks take from 10 s on an idle machine to some 40 s on a loaded one and the job
# must still be at world 2 when they end (regression AttackedJobEndedFirstOnAFastMachine: at 5
# epochs, 1.2 s each on an idle 2-core Xeon, the job had written all its checkpoints before the
# attacks ended); no fixed job follows ("ref exit skipped"): the attacks
# reach the rendezvous alone, whose worlds the calm run's fixed job already checks. Where the
# job is (nearly) over by the time the attacks end, it says so ("too late to shrink and grow")
# and stops everything rather than wait for a world that will not come.
# Prints both hosts' logs ("== a ==", "== b ==", "== b again ==", "== ref ==") and
# "a exit S", "b exit S", "ref exit S"; exits 77 when the sandbox refuses namespaces.
# usage: elastic_job.sh SCALETRAIN OUT_DIR [attack]
# The job's secret (Note [Job secret]): the nodes, replicas and lighthouse of a test share it.
export SCALETRAIN_SECRET=${SCALETRAIN_SECRET:-scaletrain-tests-secret-0123456789}
set -u
cli=$1; out=$2; attack=${3:-}
# The attacks come before the kill, while the 2-node world trains (see above).
[ "$attack" = attack ] && export ELASTIC_EPOCHS=12
# Checkpoints the job writes in all: 4096 samples / 32 a batch = 128 steps an epoch, one every 8.
all=$(( ${ELASTIC_EPOCHS:-3} * 16 ))
logs() {
  for f in a b b2 ref attacker; do [ -f "$out/$f.log" ] && { echo "== $f =="; cat "$out/$f.log"; }; done
}
source "$(dirname "$0")/elastic_hosts.sh"
elastic_start el 29417 5
if [ "$attack" = attack ]; then
  # From host b's namespace: another machine, which reaches the port over the network. (The
  # kill below would end it too; it is done by then.)
  before=$(grep -c ' ends: ' "$out/a.log")
  ip netns exec "$NETNS_B" python3 "$(dirname "$0")/attacker.py" rendezvous \
    "$NETNS_MASTER:29417" > "$out/attacker.log" 2>&1
  echo "attacker exit $?"
  echo "rounds that ended during the attacks: $(( $(grep -c ' ends: ' "$out/a.log") - before ))"
  # Shrinking and growing take 2 checkpoints at world 1 and some at world 2 again.
  if ! kill -0 $a 2>/dev/null || [ "$(checkpoints)" -gt $(( all - 8 )) ]; then
    echo "too late to shrink and grow: the job had written $(checkpoints) of its $all checkpoints when the attacks ended"
    for ns in "$NETNS_A" "$NETNS_B"; do ip netns pids "$ns" | xargs -r kill -KILL; done
    logs
    exit 0
  fi
fi
ip netns pids "$NETNS_B" | xargs -r kill -KILL
wait $b; sb=$?
echo "host b killed after $(checkpoints) checkpoint(s)"
wait_for 'grep -A1000 " left: " "$out/a.log" | grep -q "world 1,"'
n=$(checkpoints)
wait_for '[ "$(checkpoints)" -ge $((n + 2)) ]'
echo "host b starts again after $(checkpoints) checkpoint(s)"
elastic_node "$NETNS_B" "$out/b2.log"
b2=$!
wait $a; sa=$?
# b's launcher ends with the job; one that waits on for a world that will not come is stopped.
wait_for '! kill -0 $b2 2>/dev/null'
kill -KILL $b2 2>/dev/null && echo "host b's second launcher was still running 120 s after host a's ended"
wait $b2; sb2=$?
from=$(grep -h "resumed from" "$out/a.log" | tail -1 | sed 's/.*resumed from \([^ ]*\) .*/\1/')
echo "the last world resumed from $from"
sr="skipped"
if [ "$attack" != attack ]; then
  port=$(( 29500 + $$ % 400 ))
  fixed="run --nnodes 2 --nproc-per-node 1 --master-port $port --run-id ref-$$"
  "$cli" $fixed --node-rank 1 -- "$cli" $train --resume "$from" --out "$out/ref" > "$out/ref1.log" 2>&1 &
  r1=$!
  "$cli" $fixed --node-rank 0 -- "$cli" $train --resume "$from" --out "$out/ref" > "$out/ref.log" 2>&1
  sr=$?
  wait $r1
fi
logs
echo "a exit $sa"
echo "b exit $sb"
echo "b again exit $sb2"
echo "ref exit $sr"
echo "left on host a: $(ip netns pids "$NETNS_A" | wc -l), on host b: $(ip netns pids "$NETNS_B" | wc -l)"
exit 0
