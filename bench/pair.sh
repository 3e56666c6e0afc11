#!/usr/bin/env bash
# The node pair's transfer rate, request by request as vLLM makes them, in one command:
#   bench/pair.sh [--peer HOST:PORT] [kvprobe run flags...]
# Without --peer it starts `kvprobe serve --keep-serving` on 127.0.0.1 (prefill on the same
# memory as decode: --memory and, for VRAM, GPU 0 — or KVPROBE_PAIR_SERVE_FLAGS) and stops it
# at the end; with --peer it drives a serve already running there (give its token in
# KVPROBE_TOKEN; start it with --keep-serving). For READ and WRITE it runs one sweep per row:
#   requests: prepared (vLLM's prepare_xfer_dlist + make_xfer_req) or create (createXferReq)
#   descriptors: vLLM-shaped (one per block slice) or merged (--descriptor-blocks = --blocks)
#   backend: default parameters, or --backend-param num_threads=4 (the UCX backend's threads)
# and prints GB/s (1e9 B/s), each row's ratio to the peer copy (x copy) and to the vLLM
# default row (prepared, per block, default parameters) of the same op (x vllm), all measured
# in the same invocation. The peer copy: without --peer, one `kvprobe run --iterations 1` with
# your flags first times a copy of a prefill pool into a decode pool on this host (the copy
# ceiling of its report: cuMemcpy between the GPUs' pools, memcpy on DRAM; for a serve on
# another GPU give --prefill-device N as well as KVPROBE_PAIR_SERVE_FLAGS="--device N"). Across
# two hosts (--peer) there is no copy between the pools to time: x copy is "-" (null in JSON).
# The JSON (one object per row) goes to ${BENCH_OUT:-$KVPROBE_HOME/bench-results}/pair-<host>-<UTC>.json.
# Uses $KVPROBE_BIN when set, else builds the release binary.
set -euo pipefail
cd "$(dirname "$0")/.."
kv="${KVPROBE_BIN:-}"
if [ -z "$kv" ]; then
  cargo build --release --quiet
  kv="${CARGO_TARGET_DIR:-target}/release/kvprobe"
fi
peer=""
peer_given=0
if [ "${1:-}" = "--peer" ]; then
  peer=$2
  peer_given=1
  shift 2
fi
home="${KVPROBE_HOME:-${XDG_DATA_HOME:-$HOME/.local/share}/kvprobe}"
out="${BENCH_OUT:-$home/bench-results}"
mkdir -p "$out"
json="$out/pair-$(hostname)-$(date -u +%Y%m%dT%H%M%SZ).json"
work=$(mktemp -d)
serve_pid=""
cleanup() {
  local rc=$?
  if [ -n "$serve_pid" ]; then
    kill "$serve_pid" 2>/dev/null || true
    wait "$serve_pid" 2>/dev/null || true
  fi
  rm -rf "$work"
  exit "$rc"
}
trap cleanup EXIT
if [ -e /dev/nvidiactl ]; then mem=vram; else mem=dram; fi
prev=""
defaults=(--preset llama3-8b --iterations 10)
for a in "$@"; do
  [ "$prev" = "--memory" ] && mem=$a
  case "$a" in --preset | --iterations | --layers | --blocks) defaults=() ;; esac
  prev=$a
done
if [ -z "$peer" ]; then
  export KVPROBE_TOKEN="${KVPROBE_TOKEN:-$(head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n')}"
  # shellcheck disable=SC2086
  "$kv" serve --listen 127.0.0.1:0 --keep-serving --memory "$mem" ${KVPROBE_PAIR_SERVE_FLAGS:-} > "$work/serve.log" 2>&1 &
  serve_pid=$!
  for _ in $(seq 100); do grep -q "listening on" "$work/serve.log" && break; sleep 0.1; done
  peer=$(sed -n 's/.*listening on \([^ ]*\).*/\1/p' "$work/serve.log" | head -1)
  [ -n "$peer" ] || { cat "$work/serve.log" >&2; exit 2; }
fi
# Blocks per pool (merged rows move each layer's whole run as one descriptor): --blocks, else
# llama3-8b's 512; with another --preset give --blocks too.
blocks=$(python3 - "$@" <<'EOF'
import sys
a = sys.argv[1:]
print(a[a.index("--blocks") + 1] if "--blocks" in a else "512" if "--preset" not in a else "")
EOF
)
[ -n "$blocks" ] || { echo "bench/pair.sh: with --preset, give --blocks too (merged rows use it)" >&2; exit 2; }
echo "bench/pair.sh: prefill at $peer; a sweep per row (llama3-8b and 10 iterations unless your flags set the geometry or iterations)" >&2
copy=""
if [ "$peer_given" = 0 ]; then
  # Your flags less --iterations (one iteration times the copy; clap refuses a flag twice).
  copy_args=()
  skip=0
  for a in "${defaults[@]}" "$@"; do
    if [ "$skip" = 1 ]; then skip=0; continue; fi
    case "$a" in --iterations) skip=1; continue ;; --iterations=*) continue ;; esac
    copy_args+=("$a")
  done
  "$kv" run "${copy_args[@]}" --iterations 1 --report "$work/copy.json" > "$work/copy.log" 2>&1 || {
    echo "bench/pair.sh: the copy-ceiling run failed:" >&2; tail -5 "$work/copy.log" >&2; exit 1; }
  copy=$(python3 -c 'import json,sys; p=json.load(open(sys.argv[1]))["summary"].get("transport_path") or {}; c=p.get("copy_gbps"); print("" if c is None else c)' "$work/copy.json")
  [ -n "$copy" ] || echo "bench/pair.sh: no copy ceiling (a pool under 64 MiB is not timed): x copy is -" >&2
fi
[ -n "$copy" ] && echo "bench/pair.sh: peer copy on this host: $copy GB/s" >&2
printf '%-6s %-9s %-9s %-16s %10s %8s %8s\n' op requests descs backend GB/s "x copy" "x vllm"
echo "[" > "$json"
first=1
for op in read write; do
  base=""
  for req in prepared create; do
    for desc in block merged; do
      for bp in default num_threads=4; do
        [ "$desc" = merged ] && d=$blocks || d=1
        extra=()
        [ "$bp" != default ] && extra=(--backend-param "$bp")
        r="$work/r.json"
        "$kv" run --peer "$peer" "${defaults[@]}" --op "$op" --xfer-req "$req" \
          --descriptor-blocks "$d" "${extra[@]}" "$@" --report "$r" > "$work/run.log" 2>&1 || {
          echo "row $op $req $desc $bp failed:" >&2; tail -5 "$work/run.log" >&2; exit 1; }
        g=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["summary"]["transfer_gbps"])' "$r")
        [ -z "$base" ] && base=$g
        ratio=$(python3 -c "print(f'{$g / $base:.3f}')")
        if [ -n "$copy" ]; then xc=$(python3 -c "print(f'{$g / $copy:.3f}')"); else xc=-; fi
        printf '%-6s %-9s %-9s %-16s %10.2f %8s %8s\n' "$op" "$req" "$desc" "$bp" "$g" "$xc" "$ratio"
        [ $first = 1 ] || echo "," >> "$json"
        first=0
        printf '{"op":"%s","requests":"%s","descriptors":"%s","backend":"%s","gbps":%s,"copy_gbps":%s,"ratio_to_copy":%s,"ratio_to_vllm_default":%s}' \
          "$op" "$req" "$desc" "$bp" "$g" "${copy:-null}" "$( [ "$xc" = - ] && echo null || echo "$xc")" "$ratio" >> "$json"
      done
    done
  done
done
echo "]" >> "$json"
echo "bench/pair.sh: JSON in $json" >&2
