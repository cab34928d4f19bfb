#!/bin/bash
# A fault-tolerant job of 2 replicas x 2 ranks on this host: a lighthouse on port $3, each
# replica under its own launcher (restarts allowed), and with $4 = KILL or STOP the punisher
# (scripts/punisher) sending that signal to a random worker every 4 s for 16 s (PUNISH_EVERY,
# PUNISH_FOR and PUNISH_SEED in the environment change them); with $4 = ATTACK an outsider
# without the job's secret (tests/scripts/attacker.py) attacks the lighthouse once the first
# quorum has formed, and its log says how many model.pt files existed once every attack was sent
# ("model.pt files then: 0": the job still trained meanwhile). Waits for both replicas, stops
# the lighthouse with SIGTERM (SIGKILL when it has not stopped within 10 s), and prints every
# log, then "job took S s", "lighthouse stopped in M ms", "replica R exit S".
# A worker stopped while its replica starts holds the others in the rendezvous: --rdzv-timeout
# 20 bounds that; a replica with a worker stopped for 8 s fails by --stopped-timeout 8 (the
# defaults, 5 minutes each, would outlast the test). A killed worker's replica restarts within
# about a second on an idle machine: the lighthouse's --heartbeat-timeout 0.5 (the default 1.5)
# sees it gone before its new process beats, so the other replica goes on alone meanwhile
# whatever the machine's load.
#   ft_job.sh CLI DIR PORT none|KILL|STOP|ATTACK [train flags...]
# The job's secret (Note [Job secret]): the nodes, replicas and lighthouse of a test share it.
export SCALETRAIN_SECRET=${SCALETRAIN_SECRET:-scaletrain-tests-secret-0123456789}
set -u
cli=$1 dir=$2 port=$3 sig=$4
shift 4
here=$(cd "$(dirname "$0")" && pwd)
lighthouse="" pids="" punisher="" attacker=""
# Whatever ends this script (a test's time limit among them) ends what it started and has not
# waited for yet.
trap 'kill $lighthouse $pids $punisher $attacker 2> /dev/null' EXIT
trap 'exit 143' TERM INT
now() { date +%s%N; }
start=$(now)
"$cli" lighthouse --port "$port" --join-timeout 3 --heartbeat-timeout 0.5 --replicas 2 > "$dir/lighthouse.log" 2>&1 &
lighthouse=$!
for r in 0 1; do
  "$cli" run --nproc-per-node 2 --master-port 0 --max-restarts 20 --grace-period 3 --rdzv-timeout 20 --stopped-timeout 8 -- \
    "$cli" train --fault-tolerant --lighthouse "127.0.0.1:$port" --replica-id $r \
    --out "$dir/run" "$@" > "$dir/replica-$r.log" 2>&1 &
  pids="$pids $!"
done
if [ "$sig" = ATTACK ]; then
  (
    for i in $(seq 1200); do grep -q ': quorum ' "$dir/lighthouse.log" && break; sleep 0.1; done
    python3 "$here/attacker.py" lighthouse "127.0.0.1:$port" | while IFS= read -r line; do
      echo "$line"
      [ "$line" = "every attack sent" ] &&
        echo "model.pt files then: $(ls "$dir"/run/replica-*/model.pt 2> /dev/null | wc -l)"
    done
    echo "attacker exit ${PIPESTATUS[0]}"
  ) > "$dir/attacker.log" 2>&1 &
  attacker=$!
elif [ "$sig" != none ]; then
  "$here/../../scripts/punisher" --match "--out $dir/run" --every "${PUNISH_EVERY:-4}" \
    --for "${PUNISH_FOR:-16}" --signal "$sig" --seed "${PUNISH_SEED:-7}" > "$dir/punisher.log" 2>&1 &
  punisher=$!
fi
status=""
for p in $pids; do
  wait "$p"
  status="$status $?"
done
took=$(( ($(now) - start) / 1000000 ))
pids=""
[ -n "$punisher" ] && wait "$punisher"
[ -n "$attacker" ] && wait "$attacker"
punisher="" attacker=""
# The lighthouse must answer SIGTERM (it once ignored it after a flood): 10 s, then SIGKILL.
gone() { case "$(ps -o stat= -p "$1" 2> /dev/null)" in "" | Z*) return 0 ;; esac; return 1; }
stop=$(now)
kill -TERM "$lighthouse"
for i in $(seq 200); do gone "$lighthouse" && break; sleep 0.05; done
stopped=$(( ($(now) - stop) / 1000000 ))
gone "$lighthouse" || kill -KILL "$lighthouse"
wait "$lighthouse"
echo "lighthouse exit $?"
lighthouse=""
echo "lighthouse stopped in $stopped ms"
for f in "$dir"/{lighthouse,punisher,attacker,replica-0,replica-1}.log; do
  [ -f "$f" ] && { echo "== $f"; cat "$f"; }
done
echo "job took $(( took / 1000 )).$(printf %03d $(( took % 1000 ))) s"
set -- $status
echo "replica 0 exit $1"
echo "replica 1 exit $2"
