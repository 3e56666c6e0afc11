#!/usr/bin/env bash
# kvprobe's benchmark in one command, on the CPU machine or a GPU host:
#   bench/run.sh [kvprobe bench flags...]
# Prints the table and writes the JSON (schema kvprobe.bench/1) to
# ${BENCH_OUT:-$KVPROBE_HOME/bench-results}/<host>-<UTC time>.json — outside the clone, so
# results never show up in `git status` (KVPROBE_HOME defaults to
# ${XDG_DATA_HOME:-~/.local/share}/kvprobe, as for the NIXL install). The results quoted in
# bench/NOTES.md were copied into bench/results by hand. Uses $KVPROBE_BIN when set (a GPU host
# without cargo, see scripts/gpu-bundle.sh), else builds the release binary.
# On a GPU host NIXL's UCX READ VRAM->VRAM on one GPU falls back to software emulation over
# TCP unless UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y (docs/gpu-hosts.md "Running on a GPU host"); the bench
# measures the probe, so it sets that unless the caller chose otherwise.
set -euo pipefail
cd "$(dirname "$0")/.."
kv="${KVPROBE_BIN:-}"
if [ -z "$kv" ]; then
  echo "bench/run.sh: building the release binary (cargo build --release)..." >&2
  cargo build --release --quiet
  kv="${CARGO_TARGET_DIR:-target}/release/kvprobe"
fi
home="${KVPROBE_HOME:-${XDG_DATA_HOME:-$HOME/.local/share}/kvprobe}"
out="${BENCH_OUT:-$home/bench-results}"
mkdir -p "$out"
# Only where a GPU is present (UCX warns about unused variables elsewhere).
if [ -e /dev/nvidiactl ] && [ -z "${UCX_CUDA_IPC_ENABLE_GET_ZCOPY:-}" ]; then
  export UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y
fi
json="$out/$(hostname)-$(date -u +%Y%m%dT%H%M%SZ).json"
echo "bench/run.sh: measuring; each step is named below, the JSON goes to $json" >&2
exec "$kv" bench --json "$json" "$@"
