#!/usr/bin/env bash
# Final GPU lane of a session (best on the two-GPU kind, which also runs the one-GPU tests on
# GPU 0): the whole test binary (KVPROBE_REQUIRE_GPU=1, KVPROBE_REQUIRE_GPUS=2 when two GPUs
# are present, Mooncake from the bundle), `kvprobe env`, and the cross-GPU rate of the
# decode agent in a second process with 64 MiB descriptors under UCX_CUDA_IPC_MAX_STREAMS; on
# VRAM: the main job, every injection class on the smallest slices (16-64 bytes, 5 seeds), and
# `--report -` giving stdout to the JSON alone.
#   scripts/gpu-check-final.sh [BUNDLE_DIR]
set -uo pipefail
source "$(dirname "$0")/gpu-lane.sh"
n=$(nvidia-smi -L | wc -l)
[ "$n" -ge 2 ] && export KVPROBE_REQUIRE_GPUS=2
step "tests ($n GPUs)"
timeout 420 "$bundle/tests" --test-threads=3 > "$out/tests.txt" 2>&1
echo "exit $?" | tee -a "$log"
grep -E "test result|panicked|FAILED|SKIP" "$out/tests.txt" | tee -a "$log"
step "main job on VRAM: llama3-8b, 20 iterations"
"$kv" run --memory vram --preset llama3-8b --iterations 20 --report "$out/main.json" 2>&1 | grep -v "^iteration" | tee -a "$log"
echo "exit ${PIPESTATUS[0]}" | tee -a "$log"
step "smallest slices on VRAM: every class, 16/32/48/64-byte slices, seeds 1-5"
for head in 16 32 48 64; do
  for seed in 1 2 3 4 5; do
    inj="--inject bitflip:2 --inject drop:2 --inject misroute:2 --inject stale:3"
    [ "$head" -ge 32 ] && inj="$inj --inject torn:2"
    "$kv" run --memory vram --layers 1 --kv-heads 1 --block-size 1 --dtype fp8 --head-size $head --blocks 16 \
      --iterations 6 --seed $seed $inj --report "$out/tiny.json" >/dev/null 2>&1
    python3 -c 'import json,sys; s=json.load(open(sys.argv[1]))["summary"]; ok=s["injections_planted"]==s["injections_detected"] and s["unexpected_failures"]==0; print(sys.argv[2], "planted", s["injections_planted"], "detected", s["injections_detected"], "unexpected", s["unexpected_failures"], "OK" if ok else "MISMATCH")' "$out/tiny.json" "head $head seed $seed" | tee -a "$log"
  done
done
step "--report - on VRAM: stdout is the JSON alone"
"$kv" run --memory vram --iterations 2 --report - 2>/dev/null | python3 -c 'import json,sys; r=json.load(sys.stdin); print("stdout JSON ok:", r["outcome"])' 2>&1 | tee -a "$log"
step "kvprobe env"
"$kv" env 2>&1 | sed -n '/^transport/,$p' | tee -a "$log"
if [ "$n" -ge 2 ]; then
  for s in "" 4 16; do
    step "READ GPU 0 -> GPU 1, decode agent in a second process, 64 MiB descriptors${s:+, UCX_CUDA_IPC_MAX_STREAMS=$s}"
    env ${s:+UCX_CUDA_IPC_MAX_STREAMS=$s} "$kv" run --memory vram --prefill-device 0 --decode-device 1 --decode-process \
      --preset llama3-8b --blocks 2048 --descriptor-blocks 2048 --iterations 10 2>&1 | grep -E "^(transfer|path|  |result)" | grep -v "^  iter" | tee -a "$log"
  done
fi
