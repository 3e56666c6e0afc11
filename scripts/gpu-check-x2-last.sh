#!/usr/bin/env bash
# Two-GPU lane, short: bench across the GPUs with decode's agent in a second process (the
# default-stream and piecewise-stream copy ceilings, sweeps pipelined by default across GPUs),
# the tests that involve pipelining, two GPUs or the second process, and each injection
# class across the GPUs with the default (pipelined) sweep.
#   scripts/gpu-check-x2-last.sh [BUNDLE_DIR]
set -uo pipefail
export KVPROBE_REQUIRE_GPUS=2   # the host kind's count, whatever nvidia-smi shows
source "$(dirname "$0")/gpu-lane.sh"
step "bench/run.sh --device 0 --decode-device 1 --decode-process"
BENCH_OUT="$out" bench/run.sh --device 0 --decode-device 1 --decode-process --repeats 5 2>&1 |
  grep -vE "^  (fill|poison|verify|host|hidden|kernels) |^cpu|CPU|memcpy" | tee -a "$log"
expect 0 "${PIPESTATUS[0]}" bench/run.sh across GPUs
step "tests: pipelined, cross-device, two processes, bench across GPUs, VRAM bench"
run_tests tests "$bundle/tests" --test-threads=2 pipelined cross_device two_processes bench_across bench_on_vram
for inj in bitflip drop misroute stale torn; do
  step "inject $inj:3 across devices (default stages), two processes"
  "$kv" run --memory vram --prefill-device 0 --decode-device 1 --decode-process --preset llama3-8b --iterations 3 \
    --inject "$inj:3" 2>&1 | grep -E "^(block slices|corrupt by|injections|result|pipeline)" | tee -a "$log"
  expect 1 "${PIPESTATUS[0]}" "inject $inj:3 across devices"
done
