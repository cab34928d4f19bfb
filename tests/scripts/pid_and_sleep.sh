#!/bin/sh
# Worker for launcher tests: records its pid and sleeps (a shell child too, to test groups).
echo $$ > "$PID_DIR/rank_$RANK.pid"
sleep 60 &
echo $! > "$PID_DIR/rank_$RANK.child.pid"
wait
