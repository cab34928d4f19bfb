#!/bin/sh
# Worker for launcher tests: leaves 30 short-lived orphans behind (each double-forked), waits
# for them to end, and prints how many zombies its parent (the guardian) still holds.
for i in $(seq 30); do (true &); done
sleep 0.5
zombies=0
for stat in /proc/[0-9]*/stat; do
  line=$(cat "$stat" 2>/dev/null) || continue
  rest=${line##*) }
  set -- $rest
  [ "$1" = Z ] && [ "$2" = "$PPID" ] && zombies=$((zombies + 1))
done
echo "zombies $zombies"
