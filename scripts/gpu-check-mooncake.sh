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
  echo "exit $?" >> "$out/ab.txt"   # checked by expect_file after the fact (this may run in the background)
}
if [ "$mode" = quick ]; then
  step "env"
  "$kv" env 2>&1 | grep -iE "mooncake|GPU|nixl" | tee -a "$log"
  step "stacked, --tier mooncake, VRAM, 300 requests"
  "$kv" run --memory vram --scenario stacked --tier mooncake --requests 300 --report "$out/quick.json" 2>&1 | tail -15 | tee -a "$log"
  expect 0 "${PIPESTATUS[0]}" stacked --tier mooncake
  step "the Mooncake GPU test"
  run_tests tests "$bundle/tests" mooncake_tier_on_vram
  step "ab --memory vram --tier mooncake --requests 400"
  ab 400
  grep -v "requests verified\|^row " "$out/ab.txt" | tee -a "$log"
  expect_file 0 "$out/ab.txt" ab --tier mooncake
  exit 0   # the EXIT trap makes it 1 when anything above failed
fi
(
  "$bundle/tests" --test-threads=2 > "$out/tests.txt" 2>&1
  echo $? > "$out/tests.rc"
  ab 2000
) &
side=$!
step "stacked, --tier mooncake, llama3-8b VRAM (1 GiB per side), $mode, UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y"
UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y /usr/bin/time -f "wall %e s, max RSS %M KiB" "$kv" run --memory vram --preset llama3-8b \
  --scenario stacked --tier mooncake --duration "$mode" --interval 60s --report "$out/stacked-mooncake.json" \
  2> "$out/progress.txt" | tee -a "$log"
expect 0 "${PIPESTATUS[0]}" stacked --tier mooncake, $mode
tail -3 "$out/progress.txt" | tee -a "$log"
wait "$side"
step "alongside"
check_tests tests "$(cat "$out/tests.rc" 2>/dev/null)"
grep -v "requests verified\|^row " "$out/ab.txt" | tee -a "$log"
expect_file 0 "$out/ab.txt" ab --tier mooncake
rm -f "$out/ab.txt" "$out/progress.txt" "$out/tests.rc"
