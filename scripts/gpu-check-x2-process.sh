#!/usr/bin/env bash
# Two-GPU lane for two processes (run --decode-process: prefill in a child kvprobe serve), one call:
# a traced run first (KVPROBE_TRACE=1: the last line names the step of a crash); when it
# works, the main job across the GPUs (READ/WRITE, 4 GiB per side, 20 iterations), merged
# descriptors, pipelined, each injection class, bench --decode-process and the tests that
# need two GPUs; when it crashes, a backtrace (gdb or cuda-gdb when present) and variants.
#   scripts/gpu-check-x2-process.sh [BUNDLE_DIR]
set -uo pipefail
export KVPROBE_REQUIRE_GPUS=2   # the host kind's count, whatever nvidia-smi shows
source "$(dirname "$0")/gpu-lane.sh"
x2=(--memory vram --prefill-device 0 --decode-device 1 --decode-process)
run() {
  step "$*"
  rm -f "$out/x.json"
  env "$@" --report "$out/x.json" > "$out/run.txt" 2>&1
  expect 0 $? "$*"
  grep -E "^(path|warning|result)|error" "$out/run.txt" | tee -a "$log"
  [ -f "$out/x.json" ] && medians "$out/x.json"
}
step "traced: two processes, decode on GPU 1, READ"
KVPROBE_TRACE=1 "$kv" run "${x2[@]}" --preset llama3-8b --blocks 64 --iterations 2 > "$out/trace.txt" 2>&1
rc=$?
expect 0 "$rc" traced run
tail -25 "$out/trace.txt" | tee -a "$log"
if [ "$rc" -gt 1 ]; then
  for g in gdb /usr/local/cuda/bin/cuda-gdb; do
    if command -v "$g" > /dev/null; then
      step "backtrace ($g)"
      "$g" -batch -ex run -ex "thread apply all bt 12" --args "$kv" run "${x2[@]}" --preset llama3-8b --blocks 64 --iterations 2 2>&1 |
        grep -E "^#|signal|Thread" | head -60 | tee -a "$log"
      break
    fi
  done
  for v in "--prefill-device 1 --decode-device 0" "--op write"; do
    step "variant: $v"
    KVPROBE_TRACE=1 "$kv" run "${x2[@]}" --preset llama3-8b --blocks 64 --iterations 2 $v 2>&1 | tail -4 | tee -a "$log"
  done
  step "variant: UCX_TLS=tcp,self,cuda_copy"
  UCX_TLS=tcp,self,cuda_copy KVPROBE_TRACE=1 "$kv" run "${x2[@]}" --preset llama3-8b --blocks 64 --iterations 2 2>&1 | tail -4 | tee -a "$log"
  exit 1   # the traced run failed (recorded above): the lane fails after the diagnosis
fi
k=(run "$kv" run "${x2[@]}" --preset llama3-8b --blocks 2048 --iterations 20)
"${k[@]}"
"${k[@]}" --op write
"${k[@]}" --descriptor-blocks 2048
"${k[@]}" --descriptor-blocks 2048 --pipeline-stages 8
"${k[@]}" --descriptor-blocks 64
UCX_CUDA_IPC_ENABLE_GET_ZCOPY=n "${k[@]}" --descriptor-blocks 2048
for inj in bitflip drop misroute stale torn; do
  step "inject $inj:3 across devices, two processes (prefill in a child)"
  "$kv" run "${x2[@]}" --preset llama3-8b --iterations 2 --inject "$inj:3" 2>&1 | grep -E "corrupt|injections|result" | tee -a "$log"
  expect 1 "${PIPESTATUS[0]}" "inject $inj:3 across devices, decode process"
done
step "bench/run.sh --device 0 --decode-device 1 --decode-process"
BENCH_OUT="$out" bench/run.sh --device 0 --decode-device 1 --decode-process --repeats 5 2>&1 | sed -n '/^sweep/,$p' | grep -vE "^  (fill|poison|verify|host|hidden|kernels)" | tee -a "$log"
expect 0 "${PIPESTATUS[0]}" bench/run.sh across GPUs, decode process
step "two-GPU tests"
run_tests tests "$bundle/tests" --test-threads=1 cross_device env_describes_the_link two_processes bench::bench_across
