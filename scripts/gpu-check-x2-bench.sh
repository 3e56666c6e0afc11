#!/usr/bin/env bash
# Two-GPU lane for the cross-device benchmark, in one call: bench/run.sh with the decode pool
# on GPU 1 (the peer-copy ceiling and the NIXL sweeps across the GPUs), the two-GPU tests, and
# `kvprobe ab` across the GPUs with the embedded tier and, when the bundle carries it, Mooncake.
#   scripts/gpu-check-x2-bench.sh [BUNDLE_DIR]
set -uo pipefail
source "$(dirname "$0")/gpu-lane.sh"
export KVPROBE_REQUIRE_GPUS=2
step "env: GPUs and their link"
"$kv" env 2>&1 | grep -iE "GPU|link|peer|nvlink|NV[0-9]" | tee -a "$log"
step "bench/run.sh --decode-device 1"
BENCH_OUT="$out" bench/run.sh --device 0 --decode-device 1 2>&1 | tee -a "$log"
step "two-GPU tests"
"$bundle/tests" bench:: cross_device env_describes_the_link 2>&1 | grep -E "^test |test result|panicked|SKIP" | tee -a "$log"
step "ab across GPUs, embedded tier"
"$kv" ab --memory vram --prefill-device 0 --decode-device 1 --requests 1000 2>&1 | grep -v "requests verified\|^row " | tee -a "$log"
echo "exit ${PIPESTATUS[0]}" | tee -a "$log"
if [ -n "${KVPROBE_MOONCAKE_VENV:-}" ]; then
  step "ab across GPUs, Mooncake tier"
  "$kv" ab --memory vram --prefill-device 0 --decode-device 1 --tier mooncake --requests 1000 \
    --report "$out/ab-x2-mooncake.json" 2>&1 | grep -v "requests verified\|^row " | tee -a "$log"
  echo "exit ${PIPESTATUS[0]}" | tee -a "$log"
fi
