#!/bin/sh
# Worker for launcher tests: rank 1 fails on its own (a corrupt input in its share of the data);
# rank 0, which sees its peer go, fails a moment *earlier* with an error that reads as a
# consequence, as a real job's rank does when the process group is torn down under it. The
# others sleep. $MARK is a folder the ranks meet in; with PRINT_FIRST=1 rank 1 prints its error
# before rank 0 reacts, else only after rank 0 has exited.
if [ "$RANK" = 1 ]; then
  if [ "$PRINT_FIRST" = 1 ]; then
    echo "reading shard 3 of the training data" >&2
    echo "error: corrupt input in shard 3 at record 1207" >&2
  fi
  touch "$MARK/rank1_failing"
  sleep 0.3
  if [ "$PRINT_FIRST" != 1 ]; then
    echo "reading shard 3 of the training data" >&2
    echo "error: corrupt input in shard 3 at record 1207" >&2
  fi
  exit 3
fi
if [ "$RANK" = 0 ]; then
  while [ ! -e "$MARK/rank1_failing" ]; do sleep 0.01; done
  echo "all-reduce of bucket 0 failed: rank 1 left the group (its DistributedDataParallel was" \
    "destroyed, e.g. by an error) before joining it. Its own error, above or in its log, says why." >&2
  exit 1
fi
exec sleep 60
