#!/usr/bin/env bash
# The GPU host's lane for request-level scenarios (issue 3), in one call: starts a 10-minute
# stacked run on VRAM in the background (it outlives this call; collect it with
# scripts/gpu-collect.sh), then runs the GPU tests and `kvprobe ab` on VRAM.
#   scripts/gpu-check-scenarios.sh [BUNDLE_DIR]      (bundle from scripts/gpu-bundle.sh)
# Background output goes to target/kvprobe-bg/ (kept between calls on a warm machine).
set -uo pipefail
source "$(dirname "$0")/gpu-lane.sh"
bg="$PWD/target/kvprobe-bg"
rm -rf "$bg"; mkdir -p "$bg"
cp "$kv" "$bg/kvprobe"

step "background: stacked, llama3-8b VRAM (1 GiB per side), 10 minutes, UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y"
( cd "$bg" && UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y setsid nohup /usr/bin/time -f "wall %e s, max RSS %M KiB" \
    ./kvprobe run --memory vram --preset llama3-8b --scenario stacked --duration 10m --interval 60s \
    --report "$bg/stacked-10m.json" > "$bg/stacked-10m.txt" 2>&1 < /dev/null & echo $! > "$bg/pid" )
ngpu=$(nvidia-smi -L 2>/dev/null | grep -c "^GPU")
if [ "$ngpu" -ge 2 ]; then
  export KVPROBE_REQUIRE_GPUS=2
  step "background (two GPUs): sweep across devices, llama3-8b 4 GiB per side, 20 iterations, WRITE"
  ( cd "$bg" && setsid nohup ./kvprobe run --memory vram --prefill-device 0 --decode-device 1 --preset llama3-8b \
      --blocks 2048 --iterations 20 --op write --report "$bg/x2-write.json" > "$bg/x2-write.txt" 2>&1 < /dev/null &
    echo $! > "$bg/pid2" )
fi
sleep 20; tail -c 400 "$bg/stacked-10m.txt" | tr '\r' '\n' | tail -2 | tee -a "$log"

step "tests (KVPROBE_REQUIRE_GPU=1)"
"$bundle/tests" --test-threads=2 2>&1 | tee "$out/tests.txt" | grep -E "^test |test result|panicked|SKIP" | tee -a "$log"

step "ab on VRAM, small preset, 2000 requests per row"
"$kv" ab --memory vram --report "$out/ab-vram.json" 2>>"$log" | tee -a "$log"
echo "exit ${PIPESTATUS[0]}" | tee -a "$log"

step "ab on VRAM, llama3-8b (1 GiB per side), 500 requests per row, GET_ZCOPY"
UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y "$kv" ab --memory vram --preset llama3-8b --requests 500 \
  --report "$out/ab-llama3.json" 2>>"$log" | tee -a "$log"
echo "exit ${PIPESTATUS[0]}" | tee -a "$log"

if [ "$ngpu" -ge 2 ]; then
  step "ab across devices: prefill GPU 0, decode GPU 1, small preset, 1000 requests per row"
  "$kv" ab --memory vram --prefill-device 0 --decode-device 1 --requests 1000 --report "$out/ab-x2.json" 2>>"$log" | tee -a "$log"
  echo "exit ${PIPESTATUS[0]}" | tee -a "$log"
fi

step "lockstep replay on VRAM: the same seed twice"
for i in 1 2; do
  "$kv" run --memory vram --race save-after-free --lockstep --requests 600 --seed 7 2>/dev/null | grep -E "block slices|race:" | tee -a "$log"
done

step "background run so far"
tail -c 400 "$bg/stacked-10m.txt" | tr '\r' '\n' | tail -2 | tee -a "$log"
