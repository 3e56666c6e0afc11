#!/usr/bin/env bash
# Two-GPU lane (issue 6) in one call: `kvprobe env` (GPUs, link, probe transfers), bench/run.sh
# across the GPUs with decode's agent in this process and in a second process, the main job
# across the GPUs (READ and WRITE, 4 GiB per side, 20 iterations) in a second process, each
# injection class across devices, pipelined against unpipelined, the two-GPU tests, and `ab`
# across the GPUs (embedded tier; Mooncake when the bundle carries it).
#   scripts/gpu-check-x2-bench.sh [BUNDLE_DIR]
set -uo pipefail
export KVPROBE_REQUIRE_GPUS=2   # the host kind's count, whatever nvidia-smi shows
source "$(dirname "$0")/gpu-lane.sh"
x2=(--memory vram --prefill-device 0 --decode-device 1)
run() {
  step "$*"
  env "$@" --report "$out/x.json" 2>&1 | grep -E "^(path|warning|result)|error" | tee -a "$log"
  expect 0 "${PIPESTATUS[0]}" "$*"
  medians "$out/x.json"
}
step "env: GPUs, link, probe transfers"
"$kv" env 2>&1 | grep -vE "^(NIXL|UCX_|NIXL_|Mooncake|driver|CUDA|NVRTC)" | tee -a "$log"
step "bench/run.sh --device 0 --decode-device 1 (both agents in this process)"
BENCH_OUT="$out" bench/run.sh --device 0 --decode-device 1 --repeats 5 2>&1 | sed -n '/^figure/,$p' | grep -vE "^cpu|CPU|memcpy" | tee -a "$log"
expect 0 "${PIPESTATUS[0]}" bench/run.sh across GPUs
step "bench/run.sh --device 0 --decode-device 1 --decode-process"
BENCH_OUT="$out" bench/run.sh --device 0 --decode-device 1 --decode-process --repeats 5 2>&1 | sed -n '/^sweep/,$p' | tee -a "$log"
expect 0 "${PIPESTATUS[0]}" bench/run.sh across GPUs, decode process
k=(run "$kv" run "${x2[@]}" --preset llama3-8b)
"${k[@]}" --blocks 2048 --iterations 20 --decode-process
"${k[@]}" --blocks 2048 --iterations 20 --decode-process --op write
"${k[@]}" --blocks 2048 --iterations 20
"${k[@]}" --blocks 2048 --iterations 20 --decode-process --descriptor-blocks 2048
"${k[@]}" --blocks 2048 --iterations 20 --decode-process --descriptor-blocks 2048 --pipeline-stages 8
"${k[@]}" --blocks 2048 --iterations 20 --decode-process --descriptor-blocks 64
for inj in bitflip drop misroute stale torn; do
  step "inject $inj:3 across devices, two processes (prefill in a child)"
  "$kv" run "${x2[@]}" --preset llama3-8b --iterations 2 --decode-process --inject "$inj:3" 2>&1 |
    grep -E "corrupt|injections|result" | tee -a "$log"
  expect 1 "${PIPESTATUS[0]}" "inject $inj:3 across devices"
done
step "two-GPU tests"
run_tests tests "$bundle/tests" --test-threads=1 cross_device env_describes_the_link two_processes bench::bench_across
step "ab across GPUs, embedded tier"
"$kv" ab "${x2[@]}" --requests 1000 2>&1 | grep -v "requests verified\|^row " | tee -a "$log"
expect 0 "${PIPESTATUS[0]}" ab across GPUs
if [ -n "${KVPROBE_MOONCAKE_VENV:-}" ]; then
  step "ab across GPUs, Mooncake tier"
  "$kv" ab "${x2[@]}" --tier mooncake --requests 500 2>&1 | grep -v "requests verified\|^row " | tee -a "$log"
  expect 0 "${PIPESTATUS[0]}" ab across GPUs, Mooncake
fi
