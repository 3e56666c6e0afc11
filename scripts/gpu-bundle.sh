#!/usr/bin/env bash
# Builds what scripts/gpu-check.sh needs on a GPU host without cargo: the release binary,
# the test binary and the NIXL subset (scripts/pack-nixl.py), into BUNDLE_DIR (default .carry).
set -euo pipefail
dir="${1:-.carry}"
mkdir -p "$dir"
cargo build --release --quiet
tests=$(cargo test --release --no-run --message-format=json 2>/dev/null |
  python3 -c 'import json,sys
for l in sys.stdin:
    m=json.loads(l)
    if m.get("reason")=="compiler-artifact" and m["target"]["name"]=="tests" and m.get("executable"): print(m["executable"])')
cp target/release/kvprobe "$dir/kvprobe"
cp "$tests" "$dir/tests"
[ -f "$dir/nixl.tar.xz" ] || "$(dirname "$0")/pack-nixl.py" "$dir/nixl.tar.xz"
du -sh "$dir"/*
