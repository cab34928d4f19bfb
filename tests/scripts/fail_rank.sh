#!/bin/sh
# Worker for launcher tests: rank $FAIL_RANK fails after a moment in the way $FAIL_HOW says
# (an exit code, or "SEGV"); the others write their pid to $PID_DIR and sleep.
[ -n "$PID_DIR" ] && echo $$ > "$PID_DIR/rank_$RANK.pid"
if [ "$RANK" = "$FAIL_RANK" ]; then
  sleep 0.5
  echo "rank $RANK is about to fail" >&2
  echo "the reason is a test" >&2
  if [ "$FAIL_HOW" = "SEGV" ]; then kill -SEGV $$; fi
  exit "$FAIL_HOW"
fi
exec sleep 60
