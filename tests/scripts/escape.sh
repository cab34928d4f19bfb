#!/bin/sh
# Worker for launcher tests: leaves processes behind outside its own process group: a `setsid`
# child (which keeps the worker's output pipes open) and a double-forked `setsid` daemon. Each
# records its pid in $PID_DIR. Then the worker exits with $EXIT, or sleeps when EXIT is unset.
setsid sh -c 'echo $$ > "$PID_DIR/rank_$RANK.setsid.pid"; exec sleep 1000' &
( setsid sh -c 'echo $$ > "$PID_DIR/rank_$RANK.daemon.pid"; exec sleep 1000' \
    > /dev/null 2>&1 < /dev/null & )
while [ ! -s "$PID_DIR/rank_$RANK.setsid.pid" ] || [ ! -s "$PID_DIR/rank_$RANK.daemon.pid" ]; do
  sleep 0.01
done
echo "rank $RANK left two processes behind"
[ -n "$EXIT" ] && exit "$EXIT"
echo $$ > "$PID_DIR/rank_$RANK.pid"
exec sleep 60
