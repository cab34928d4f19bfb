#!/bin/sh
# Worker for launcher tests: fails until TORCHELASTIC_RESTART_COUNT reaches $SUCCEED_AT.
echo "attempt $TORCHELASTIC_RESTART_COUNT rank $RANK"
[ "$TORCHELASTIC_RESTART_COUNT" -ge "$SUCCEED_AT" ] && exit 0
[ "$RANK" = 0 ] && exit 3
exec sleep 60
