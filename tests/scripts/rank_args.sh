#!/bin/sh
# rank_args.sh "ARGS OF RANK 0" "ARGS OF RANK 1" PROGRAM [ARGS...]: runs PROGRAM ARGS with the
# extra arguments of this rank ($RANK) appended, for tests that give ranks different options.
r0=$1 r1=$2
shift 2
if [ "${RANK:-0}" = 0 ]; then extra=$r0; else extra=$r1; fi
# shellcheck disable=SC2086  # the extra arguments are word-split on purpose
exec "$@" $extra
