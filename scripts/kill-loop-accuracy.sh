#!/bin/bash
# Does a kill loop cost accuracy? For each seed, the fault-tolerant job of the kill-loop test (2
# replicas x 2 ranks, LeNet on Fashion-MNIST, tests/scripts/ft_job.sh) trains once calm and once
# under the punisher (SIGKILL to a random worker every PUNISH_EVERY s for PUNISH_FOR s), on the
# whole data set. Prints each pair's final test accuracy, their difference, and the mean and
# spread of the differences and of the calm runs themselves (the seed-to-seed noise the
# difference is measured against), over every seed in DIR/accuracy.csv (a later call with other
# seeds and the same --out adds to it).
#
#   scripts/kill-loop-accuracy.sh [--cli build/scaletrain] [--seeds "1 2 3"] [--out DIR]
#                                 [-- extra train flags]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cli=$here/../build/scaletrain seeds="1 2 3" out=${TMPDIR:-/tmp}/kill-loop-accuracy
while [ $# -gt 0 ]; do
  case "$1" in
    --cli) cli=$2; shift 2 ;;
    --seeds) seeds=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --) shift; break ;;
    -h|--help) sed -n 2,10p "$0"; exit 0 ;;
    *) echo "kill-loop-accuracy: unknown option '$1' (see --help)" >&2; exit 2 ;;
  esac
done
flags="--device cpu --epochs 4 --batch-size 64 --checkpoint-every 200 --keep 3 --no-progress \
--log-every 100 --timeout 5 --ft-timeout 3 $*"
export PUNISH_EVERY=${PUNISH_EVERY:-6} PUNISH_FOR=${PUNISH_FOR:-60}
accuracy() {  # the last test accuracy any replica reported
  grep -o 'test accuracy *[0-9.]*' "$1" | tail -1 | awk '{print $3}'
}
mkdir -p "$out"
# Appends, so that seeds run one after another into one folder add up (one run at a time).
[ -s "$out/accuracy.csv" ] || echo "seed,calm,killed,kills,calm_s,killed_s" > "$out/accuracy.csv"
for seed in $seeds; do
  row=$seed
  for sig in none KILL; do
    dir=$out/seed$seed-$sig
    rm -rf "$dir" && mkdir -p "$dir"
    port=$(( 20000 + RANDOM % 9000 ))
    t0=$(date +%s)
    PUNISH_SEED=$seed "$here/../tests/scripts/ft_job.sh" "$cli" "$dir" "$port" "$sig" \
      $flags --seed "$seed" > "$dir/out.txt" 2>&1
    secs=$(( $(date +%s) - t0 ))
    grep -q "replica 0 exit 0" "$dir/out.txt" && grep -q "replica 1 exit 0" "$dir/out.txt" ||
      { echo "kill-loop-accuracy: seed $seed ($sig) failed: $dir/out.txt" >&2; exit 1; }
    acc=$(accuracy "$dir/out.txt" || true)
    [ -n "$acc" ] || { echo "kill-loop-accuracy: no test accuracy in $dir/out.txt" >&2; exit 1; }
    row="$row,$acc"
    [ "$sig" = none ] && calm_s=$secs || { killed_s=$secs; kills=$(grep -c "punisher: SIG" "$dir/out.txt" || true); }
  done
  echo "$row,$kills,$calm_s,$killed_s" | tee -a "$out/accuracy.csv"
done
python3 - "$out/accuracy.csv" <<'PY'
import csv, statistics, sys
rows = list(csv.DictReader(open(sys.argv[1])))
calm = [100 * float(r["calm"]) for r in rows]
killed = [100 * float(r["killed"]) for r in rows]
diff = [k - c for k, c in zip(killed, calm)]
sd = lambda v: statistics.stdev(v) if len(v) > 1 else float("nan")
print(f"calm accuracy   mean {statistics.mean(calm):.2f} %, spread over seeds (sd) {sd(calm):.2f} points")
print(f"killed accuracy mean {statistics.mean(killed):.2f} %, sd {sd(killed):.2f} points")
print(f"killed - calm   mean {statistics.mean(diff):+.2f} points, sd {sd(diff):.2f}, "
      f"largest {max(diff, key=abs):+.2f} ({len(rows)} seeds)")
PY
