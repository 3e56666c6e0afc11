#!/usr/bin/env bash
# The GPU host's lane: runs kvprobe's GPU tests and the main job on VRAM with binaries
# built elsewhere (the GPU host has no cargo). Prepare them with scripts/gpu-bundle.sh,
# then, from the repository root on the GPU host:  scripts/gpu-check.sh [BUNDLE_DIR]
# Logs and reports go to $OUT (default /tmp/kvprobe-gpu).
set -uo pipefail
source "$(dirname "$0")/gpu-lane.sh"

step "env"
"$kv" env 2>&1 | tee -a "$log"
"$kv" env --json > "$out/env.json" 2>>"$log"

step "tests (KVPROBE_REQUIRE_GPU=1)"
run_tests tests "$bundle/tests" --test-threads=1

step "main job: llama3-8b, 1 GiB pool, 20 iterations, READ"
/usr/bin/time -f "wall %e s, max RSS %M KiB" "$kv" run --memory vram --preset llama3-8b --iterations 20 \
  --report "$out/llama3-8b.json" 2>&1 | grep -v "^iteration" | tee -a "$log"
expect 0 "${PIPESTATUS[0]}" main job

step "llama3-8b WRITE, 5 iterations"
"$kv" run --memory vram --preset llama3-8b --iterations 5 --op write 2>&1 | grep -v "^iteration" | tee -a "$log"
expect 0 "${PIPESTATUS[0]}" llama3-8b WRITE

step "deepseek-v3 (MLA), 5 iterations"
"$kv" run --memory vram --preset deepseek-v3 --iterations 5 2>&1 | grep -v "^iteration" | tee -a "$log"
expect 0 "${PIPESTATUS[0]}" deepseek-v3

for k in bitflip drop misroute stale torn; do
  step "inject $k:3 on llama3-8b VRAM"
  "$kv" run --memory vram --preset llama3-8b --iterations 2 --inject "$k:3" 2>&1 | grep -E "corrupt|injections|result" | tee -a "$log"
  expect 1 "${PIPESTATUS[0]}" "inject $k:3"
done

step "inject stray:3 on llama3-8b VRAM, 8 pipeline stages (poison checks, and the re-verify in the last iteration)"
"$kv" run --memory vram --preset llama3-8b --iterations 3 --pipeline-stages 8 --inject stray:3 2>&1 | grep -E "corrupt|injections|result" | tee -a "$log"
expect 1 "${PIPESTATUS[0]}" "inject stray:3"

step "llama3-8b READ with UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y, 20 iterations"
UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y "$kv" run --memory vram --preset llama3-8b --iterations 20 \
  --report "$out/llama3-8b-zcopy.json" 2>&1 | grep -v "^iteration" | tee -a "$log"
expect 0 "${PIPESTATUS[0]}" main job with GET_ZCOPY

step "--dump and --bundle on VRAM (issue 14): torn, bitflip, misroute; then report check of the bundle"
rm -rf "$out/dump-vram" "$out/dump-vram.tar.gz"
"$kv" run --memory vram --preset llama3-8b --iterations 3 --inject torn:2 --inject bitflip:2 --inject misroute:1 \
  --dump "$out/dump-vram" --junit "$out/dump-vram.xml" --report "$out/dump-vram.json" --bundle "$out/dump-vram.tar.gz" \
  2>&1 | grep -E "corrupt|result|bundle" | tee -a "$log"
expect 1 "${PIPESTATUS[0]}" "run --dump --bundle on VRAM"
"$kv" report check "$out/dump-vram.tar.gz" 2>&1 | tail -5 | tee -a "$log"
expect 0 "${PIPESTATUS[0]}" "report check of the VRAM bundle"
