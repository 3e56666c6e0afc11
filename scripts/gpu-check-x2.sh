#!/usr/bin/env bash
# The two-GPU host's lane: prefill on GPU 0, decode on GPU 1. Bundle as for
# scripts/gpu-check.sh (scripts/gpu-bundle.sh), then from the repository root on the host:
#   scripts/gpu-check-x2.sh [BUNDLE_DIR]      (logs and reports in $OUT, default /tmp/kvprobe-gpu)
set -uo pipefail
export KVPROBE_REQUIRE_GPUS=2   # the host kind's count, whatever nvidia-smi shows
source "$(dirname "$0")/gpu-lane.sh"
x2=(--memory vram --prefill-device 0 --decode-device 1)

step "env"
nvidia-smi topo -m 2>&1 | tee -a "$log"
"$kv" env 2>&1 | tee -a "$log"

step "tests (KVPROBE_REQUIRE_GPU=1 KVPROBE_REQUIRE_GPUS=2)"
run_tests tests "$bundle/tests" --test-threads=1

step "UCX path for VRAM GPU0 -> GPU1 (UCX_PROTO_INFO=y), READ default and with GET_ZCOPY, WRITE"
for mode in "read" "read zcopy" "write"; do
  set -- $mode
  env ${2:+UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y} UCX_PROTO_INFO=y "$kv" run "${x2[@]}" --preset llama3-8b --iterations 1 --op "$1" 2>&1 |
    grep -E "cuda|emulation|tcp|transfer:|result" | sort | uniq -c | sort -rn | head -10 | sed "s/^/[$mode] /" | tee -a "$log"
  expect 0 "${PIPESTATUS[0]}" "UCX path [$mode]"
done

step "main job across devices: llama3-8b, 4 GiB per side, 20 iterations, READ"
"$kv" run "${x2[@]}" --preset llama3-8b --blocks 2048 --iterations 20 \
  --report "$out/x2-read.json" 2>&1 | grep -v "^iteration" | tee -a "$log"
expect 0 "${PIPESTATUS[0]}" main job across devices, READ

step "main job across devices: llama3-8b, 4 GiB per side, 20 iterations, WRITE"
"$kv" run "${x2[@]}" --preset llama3-8b --blocks 2048 --iterations 20 --op write \
  --report "$out/x2-write.json" 2>&1 | grep -v "^iteration" | tee -a "$log"
expect 0 "${PIPESTATUS[0]}" main job across devices, WRITE

for k in bitflip drop misroute stale torn; do
  step "inject $k:3 across devices"
  "$kv" run "${x2[@]}" --preset llama3-8b --iterations 2 --inject "$k:3" 2>&1 |
    grep -E "corrupt|injections|result" | tee -a "$log"
  expect 1 "${PIPESTATUS[0]}" "inject $k:3 across devices"
done
