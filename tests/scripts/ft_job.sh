#!/bin/bash
# A fault-tolerant job of 2 replicas x 2 ranks on this host: a lighthouse on port $3, each
# replica under its own launcher (restarts allowed), and with $4 = KILL or STOP the punisher
# (scripts/punisher) sending that signal to a random worker every 4 s for 16 s (PUNISH_EVERY,
# PUNISH_FOR and PUNISH_SEED in the environment change them). Waits for both
# replicas, stops the lighthouse, and prints every log, then "replica R exit S" for each. A
# worker stopped while its replica starts holds the others in the rendezvous: --rdzv-timeout 20
# bounds that; a replica with a worker stopped for 8 s fails by --stopped-timeout 8 (the
# defaults, 5 minutes each, would outlast the test). A killed worker's replica restarts within
# about a second on an idle machine: the lighthouse's --heartbeat-timeout 0.5 (the default 1.5)
# sees it gone before its new process beats, so the other replica goes on alone meanwhile
# whatever the machine's load.
#   ft_job.sh CLI DIR PORT none|KILL|STOP [train flags...]
# The job's secret (Note [Job secret]): the nodes, replicas and lighthouse of a test share it.
export SCALETRAIN_SECRET=${SCALETRAIN_SECRET:-scaletrain-tests-secret-0123456789}
cli=$1 dir=$2 port=$3 sig=$4
shift 4
here=$(cd "$(dirname "$0")" && pwd)
"$cli" lighthouse --port "$port" --join-timeout 3 --heartbeat-timeout 0.5 --replicas 2 > "$dir/lighthouse.log" 2>&1 &
lighthouse=$!
pids=""
for r in 0 1; do
  "$cli" run --nproc-per-node 2 --master-port 0 --max-restarts 20 --grace-period 3 --rdzv-timeout 20 --stopped-timeout 8 -- \
    "$cli" train --fault-tolerant --lighthouse "127.0.0.1:$port" --replica-id $r \
    --out "$dir/run" "$@" > "$dir/replica-$r.log" 2>&1 &
  pids="$pids $!"
done
if [ "$sig" != none ]; then
  "$here/../../scripts/punisher" --match "--out $dir/run" --every "${PUNISH_EVERY:-4}" \
    --for "${PUNISH_FOR:-16}" --signal "$sig" --seed "${PUNISH_SEED:-7}" > "$dir/punisher.log" 2>&1 &
  punisher=$!
fi
status=""
for p in $pids; do
  wait "$p"
  status="$status $?"
done
[ -n "${punisher:-}" ] && wait "$punisher"
kill -TERM "$lighthouse"
wait "$lighthouse"
echo "lighthouse exit $?"
for f in "$dir"/lighthouse.log "$dir"/punisher.log "$dir"/replica-0.log "$dir"/replica-1.log; do
  [ -f "$f" ] && { echo "== $f"; cat "$f"; }
done
set -- $status
echo "replica 0 exit $1"
echo "replica 1 exit $2"
