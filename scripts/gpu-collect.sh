#!/usr/bin/env bash
# Waits for the background run started by scripts/gpu-check-scenarios.sh and copies its
# output to $OUT.
set -uo pipefail
bg="$PWD/target/kvprobe-bg"
out="${OUT:-/tmp/kvprobe-gpu}"; mkdir -p "$out"
for f in pid pid2; do
  pid=$(cat "$bg/$f" 2>/dev/null || echo 0)
  while [ "$pid" != 0 ] && kill -0 "$pid" 2>/dev/null; do sleep 5; done
done
for name in stacked-10m x2-write; do
  [ -f "$bg/$name.txt" ] || continue
  cp "$bg/$name".* "$out/" 2>/dev/null
  echo "=== $name"
  tr '\r' '\n' < "$bg/$name.txt" | grep -v "requests verified\|^iteration" | tail -30
done
