#!/usr/bin/env bash
# kvprobe's benchmark in one command, on the CPU machine or a GPU host:
#   bench/run.sh [kvprobe bench flags...]
# Prints the table and writes the JSON (schema kvprobe.bench/1) to
# ${BENCH_OUT:-bench/results}/<host>-<UTC time>.json. Uses $KVPROBE_BIN when set (a GPU host
# without cargo, see scripts/gpu-bundle.sh), else builds the release binary.
# On a GPU host NIXL's UCX READ VRAM->VRAM on one GPU falls back to software emulation over
# TCP unless UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y (README "Running on a GPU host"); the bench
# measures the probe, so it sets that unless the caller chose otherwise.
set -euo pipefail
cd "$(dirname "$0")/.."
kv="${KVPROBE_BIN:-}"
if [ -z "$kv" ]; then
  cargo build --release --quiet
  kv=target/release/kvprobe
fi
out="${BENCH_OUT:-bench/results}"
mkdir -p "$out"
# Only where a GPU is present (UCX warns about unused variables elsewhere).
if [ -e /dev/nvidiactl ] && [ -z "${UCX_CUDA_IPC_ENABLE_GET_ZCOPY:-}" ]; then
  export UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y
fi
exec "$kv" bench --json "$out/$(hostname)-$(date -u +%Y%m%dT%H%M%SZ).json" "$@"
