#!/usr/bin/env bash
# Builds what scripts/gpu-lane.sh needs on a GPU host without cargo or network: the release
# binary, the test binary, the NIXL subset (scripts/pack-nixl.py) and the Mooncake subset of
# the cuda13 wheel for Python 3.12 (scripts/pack-mooncake.py), into BUNDLE_DIR (default .carry).
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
if [ ! -f "$dir/mooncake.tar.xz" ]; then
  wheels=$(mktemp -d)
  pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
    -d "$wheels" "${MOONCAKE_GPU_WHEEL:-mooncake-transfer-engine-cuda13==0.3.14}"
  "$(dirname "$0")/pack-mooncake.py" "$wheels"/*.whl "$dir/mooncake.tar.xz"
  rm -rf "$wheels"
fi
du -sh "$dir"/*
