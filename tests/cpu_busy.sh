#!/usr/bin/env bash
# How busy the machine's CPUs were between two moments, from /proc/stat's first line:
#   ticks=$(tests/cpu_busy.sh)            # now: "busy total"
#   tests/cpu_busy.sh "$ticks"            # since then: "87" (percent of all CPUs' time)
# Why: whether a test stage is bound by the CPU or by waits (engines loading, autoscaling windows)
# decides what makes it faster; running more processes side by side only helps the second kind.
set -euo pipefail
now=$(awk '/^cpu / {busy = $2 + $3 + $4 + $7 + $8; print busy, busy + $5 + $6}' /proc/stat)
if [[ $# -eq 0 ]]; then
  echo "$now"
else
  echo "$1 $now" | awk '{d = $4 - $2; printf "%d\n", (d > 0 ? 100 * ($3 - $1) / d : 0)}'
fi
