#!/usr/bin/env bash
# Final GPU lane of a session (best on the two-GPU kind, which also runs the one-GPU tests on
# GPU 0; say so: KVPROBE_REQUIRE_GPUS=2 scripts/gpu-check-final.sh, the count of the host kind,
# default 1): the whole test binary (KVPROBE_REQUIRE_GPU=1, Mooncake from the bundle), `kvprobe env`, and the cross-GPU rate of the
# two processes (prefill in a child) with 64 MiB descriptors under UCX_CUDA_IPC_MAX_STREAMS; on
# VRAM: the main job, every injection class on the smallest slices (16-64 bytes, 5 seeds), and
# `--report -` giving stdout to the JSON alone.
#   scripts/gpu-check-final.sh [BUNDLE_DIR]
set -uo pipefail
source "$(dirname "$0")/gpu-lane.sh"
n=$KVPROBE_REQUIRE_GPUS   # from the host kind (gpu-lane.sh checked the host has them)
step "tests ($n GPUs required)"
# 4 threads, 480 s: the binary took ~450 s with 3 threads on the H200 host (2026-12-01), and the
# whole lane must end inside one 600 s device call.
run_tests tests timeout 480 "$bundle/tests" --test-threads=4
step "main job on VRAM: llama3-8b, 5 iterations"
"$kv" run --memory vram --preset llama3-8b --iterations 5 --report "$out/main.json" 2>&1 | grep -v "^iteration" | tee -a "$log"
expect 0 "${PIPESTATUS[0]}" main job
step "smallest slices on VRAM: every class, 16/32/48/64-byte slices, seeds 1-5"
for head in 16 32 48 64; do
  for seed in 1 2 3 4 5; do
    inj="--inject bitflip:2 --inject drop:2 --inject misroute:2 --inject stale:3"
    [ "$head" -ge 32 ] && inj="$inj --inject torn:2"
    "$kv" run --memory vram --layers 1 --kv-heads 1 --block-size 1 --dtype fp8 --head-size $head --blocks 16 \
      --iterations 6 --seed $seed $inj --report "$out/tiny.json" >/dev/null 2>&1
    expect 1 $? "smallest slices, head $head seed $seed"
    python3 -c 'import json,sys; s=json.load(open(sys.argv[1]))["summary"]; ok=s["injections_planted"]==s["injections_detected"] and s["unexpected_failures"]==0; print(sys.argv[2], "planted", s["injections_planted"], "detected", s["injections_detected"], "unexpected", s["unexpected_failures"], "OK" if ok else "MISMATCH"); sys.exit(0 if ok else 1)' "$out/tiny.json" "head $head seed $seed" | tee -a "$log"
    expect 0 "${PIPESTATUS[0]}" "smallest slices, head $head seed $seed: planted = detected, nothing unexpected"
  done
done
step "--report - on VRAM: stdout is the JSON alone"
"$kv" run --memory vram --iterations 2 --report - 2>/dev/null | python3 -c 'import json,sys; r=json.load(sys.stdin); print("stdout JSON ok:", r["outcome"])' 2>&1 | tee -a "$log"
st=("${PIPESTATUS[@]}")
expect 0 "${st[0]}" "--report - run"
expect 0 "${st[1]}" "--report -: stdout parses as the JSON alone"
step "kvprobe env"
"$kv" env 2>&1 | sed -n '/^transport/,$p' | tee -a "$log"
if [ "$n" -ge 2 ]; then
  for s in "" 4 16; do
    step "READ GPU 0 -> GPU 1, two processes (prefill in a child), 64 MiB descriptors${s:+, UCX_CUDA_IPC_MAX_STREAMS=$s}"
    env ${s:+UCX_CUDA_IPC_MAX_STREAMS=$s} "$kv" run --memory vram --prefill-device 0 --decode-device 1 --decode-process \
      --preset llama3-8b --blocks 2048 --descriptor-blocks 2048 --iterations 10 2>&1 | grep -E "^(transfer|path|  |result)" | grep -v "^  iter" | tee -a "$log"
    expect 0 "${PIPESTATUS[0]}" "READ GPU 0 -> GPU 1, decode process${s:+, UCX_CUDA_IPC_MAX_STREAMS=$s}"
  done
fi
