#!/usr/bin/env bash
# Waits for the background run started by scripts/gpu-check-scenarios.sh and copies its
# output to $OUT.
set -uo pipefail
bg="$PWD/target/kvprobe-bg"
out="${OUT:-/tmp/kvprobe-gpu}"; mkdir -p "$out"
pid=$(cat "$bg/pid" 2>/dev/null || echo 0)
while [ "$pid" != 0 ] && kill -0 "$pid" 2>/dev/null; do sleep 5; done
cp "$bg"/stacked-10m.* "$out/" 2>/dev/null
tr '\r' '\n' < "$bg/stacked-10m.txt" | grep -v "requests verified" | tail -30
