#!/usr/bin/env bash
# The GPU host's lane for `--tier mooncake` on VRAM (pools shared with the store worker by CUDA
# IPC), with the Mooncake subset the bundle carries (scripts/gpu-bundle.sh):
#   scripts/gpu-check-mooncake.sh [BUNDLE_DIR] quick        env, a short run, the Mooncake GPU test, ab
#   scripts/gpu-check-mooncake.sh [BUNDLE_DIR] [DURATION]   a stacked llama3-8b run on the real store for
#       DURATION (default 330s) in the foreground; alongside it the whole test binary and
#       `kvprobe ab --memory vram --tier mooncake`.
set -uo pipefail
source "$(dirname "$0")/gpu-lane.sh"
mode="${2:-330s}"
ab() {
  "$kv" ab --memory vram --tier mooncake --requests "$1" --report "$out/ab-mooncake-vram.json" > "$out/ab.txt" 2>&1
  echo "exit $?" >> "$out/ab.txt"
}
if [ "$mode" = quick ]; then
  step "env"
  "$kv" env 2>&1 | grep -iE "mooncake|GPU|nixl" | tee -a "$log"
  step "stacked, --tier mooncake, VRAM, 300 requests"
  "$kv" run --memory vram --scenario stacked --tier mooncake --requests 300 --report "$out/quick.json" 2>&1 | tail -15 | tee -a "$log"
  echo "exit ${PIPESTATUS[0]}" | tee -a "$log"
  step "the Mooncake GPU test"
  "$bundle/tests" mooncake_tier_on_vram 2>&1 | grep -E "^test |test result|panicked|SKIP|assert" | tee -a "$log"
  step "ab --memory vram --tier mooncake --requests 400"
  ab 400
  grep -v "requests verified\|^row " "$out/ab.txt" | tee -a "$log"
  exit 0
fi
(
  "$bundle/tests" --test-threads=2 > "$out/tests.txt" 2>&1
  ab 2000
) &
side=$!
step "stacked, --tier mooncake, llama3-8b VRAM (1 GiB per side), $mode, UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y"
UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y /usr/bin/time -f "wall %e s, max RSS %M KiB" "$kv" run --memory vram --preset llama3-8b \
  --scenario stacked --tier mooncake --duration "$mode" --interval 60s --report "$out/stacked-mooncake.json" \
  2> "$out/progress.txt" | tee -a "$log"
echo "exit ${PIPESTATUS[0]}" | tee -a "$log"
tail -3 "$out/progress.txt" | tee -a "$log"
wait "$side"
step "alongside"
grep -E "test result|panicked|FAILED|SKIP" "$out/tests.txt" | tee -a "$log"
grep -v "requests verified\|^row " "$out/ab.txt" | tee -a "$log"
rm -f "$out/ab.txt" "$out/progress.txt"
