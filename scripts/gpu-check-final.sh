#!/usr/bin/env bash
# Final GPU lane of a session (best on the two-GPU kind, which also runs the one-GPU tests on
# GPU 0): the whole test binary (KVPROBE_REQUIRE_GPU=1, KVPROBE_REQUIRE_GPUS=2 when two GPUs
# are present, Mooncake from the bundle), `kvprobe env`, and the cross-GPU rate of the
# decode agent in a second process with 64 MiB descriptors under UCX_CUDA_IPC_MAX_STREAMS.
#   scripts/gpu-check-final.sh [BUNDLE_DIR]
set -uo pipefail
source "$(dirname "$0")/gpu-lane.sh"
n=$(nvidia-smi -L | wc -l)
[ "$n" -ge 2 ] && export KVPROBE_REQUIRE_GPUS=2
step "tests ($n GPUs)"
timeout 360 "$bundle/tests" --test-threads=3 > "$out/tests.txt" 2>&1
echo "exit $?" | tee -a "$log"
grep -E "test result|panicked|FAILED|SKIP" "$out/tests.txt" | tee -a "$log"
step "kvprobe env"
"$kv" env 2>&1 | sed -n '/^transport/,$p' | tee -a "$log"
if [ "$n" -ge 2 ]; then
  for s in "" 4 16; do
    step "READ GPU 0 -> GPU 1, decode agent in a second process, 64 MiB descriptors${s:+, UCX_CUDA_IPC_MAX_STREAMS=$s}"
    env ${s:+UCX_CUDA_IPC_MAX_STREAMS=$s} "$kv" run --memory vram --prefill-device 0 --decode-device 1 --decode-process \
      --preset llama3-8b --blocks 2048 --descriptor-blocks 2048 --iterations 10 2>&1 | grep -E "^(transfer|path|  |result)" | grep -v "^  iter" | tee -a "$log"
  done
fi
