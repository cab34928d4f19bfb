#!/bin/sh
# Worker for launcher tests: draws a progress bar of $MB megabytes on stderr ('\r', never '\n'),
# then writes a line of $MB megabytes with no end, then an error line, and fails. On stdout it
# reports its launcher's peak resident memory (VmHWM, kB) before and after ("hwm BEFORE AFTER").
launcher=$(sed 's/.*) [A-Za-z] \([0-9]*\).*/\1/' "/proc/$PPID/stat")  # the guardian's parent
hwm() { sed -n 's/^VmHWM:[^0-9]*\([0-9]*\).*/\1/p' "/proc/$launcher/status"; }
before=$(hwm)
yes 'epoch 1:  42%|####      | 420/1000 [00:12<00:17, 34.1it/s]' | head -c "${MB}000000" |
  tr '\n' '\r' >&2
head -c "${MB}000000" /dev/zero | tr '\0' x >&2
printf '\nerror: the bar broke\n' >&2
sleep 0.2  # the launcher has read all but the last pipeful when the writes returned
echo "hwm $before $(hwm)"
exit 5
