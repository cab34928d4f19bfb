#!/bin/sh
# Stops (SIGSTOP) one rank of a training, as a hang would: waits until the training whose
# --out is $1 has written a step line, then stops the `scaletrain train` process of rank $2 and
# prints "stopped <pid>".
out=$1
rank=$2
i=0
while [ ! -s "$out/metrics.jsonl" ] && [ $i -lt 600 ]; do
  sleep 0.1
  i=$((i + 1))
done
for p in $(pgrep -f -- "--out $out"); do
  args=$(tr '\0' ' ' < "/proc/$p/cmdline" 2>/dev/null)
  case "$args" in
    *" run "*) continue ;;  # the launcher and its guardians
  esac
  if tr '\0' '\n' < "/proc/$p/environ" 2>/dev/null | grep -qx "RANK=$rank"; then
    kill -STOP "$p" && echo "stopped $p"
  fi
done
