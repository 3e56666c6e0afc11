#!/usr/bin/env bash
# One call on the GPU host for the performance work: bench/run.sh on a quiet GPU, then the
# whole test binary (KVPROBE_REQUIRE_GPU=1, Mooncake from the bundle), then the transport path
# kvprobe reports for a VRAM READ with and without cuda_ipc get-zcopy, and for a WRITE.
#   scripts/gpu-check-perf.sh [BUNDLE_DIR]
set -uo pipefail
source "$(dirname "$0")/gpu-lane.sh"
step "bench/run.sh"
BENCH_OUT="$out" bench/run.sh 2>&1 | tee -a "$log"
step "tests"
"$bundle/tests" --test-threads=2 > "$out/tests.txt" 2>&1
grep -E "test result|panicked|FAILED|SKIP" "$out/tests.txt" | tee -a "$log"
for z in n y; do
  step "llama3-8b READ, UCX_CUDA_IPC_ENABLE_GET_ZCOPY=$z: the path kvprobe reports"
  UCX_CUDA_IPC_ENABLE_GET_ZCOPY=$z "$kv" run --memory vram --preset llama3-8b --iterations 3 2>&1 |
    grep -E "^(transfer|path|  |warning|ucx|result)" | tee -a "$log"
done
step "llama3-8b WRITE: the path kvprobe reports"
"$kv" run --memory vram --preset llama3-8b --iterations 3 --op write 2>&1 | grep -E "^(transfer|path|  |warning|ucx|result)" | tee -a "$log"
