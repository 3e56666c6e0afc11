#!/usr/bin/env bash
# The GPU host's lane for issue 3's sustained run, in one call of at most 10 minutes: a
# stacked run on VRAM in the foreground for DURATION (default 575s: the device's per-command
# limit is 10 minutes, start and drain included), with, alongside it, the GPU tests, `kvprobe ab`
# on VRAM (and across two GPUs, plus the 4 GiB cross-device WRITE sweep, when KVPROBE_REQUIRE_GPUS=2).
#   scripts/gpu-check-sustained.sh [BUNDLE_DIR] [DURATION] [quick]
# `quick` leaves out the llama3-8b ab and the cross-device WRITE sweep.
set -uo pipefail
source "$(dirname "$0")/gpu-lane.sh"
dur="${2:-575s}"
quick="${3:-}"
ngpu=$KVPROBE_REQUIRE_GPUS   # the host kind's count (KVPROBE_REQUIRE_GPUS=2 on the two-GPU kind), checked by gpu-lane.sh
(
  "$bundle/tests" --test-threads=2 > "$out/tests.txt" 2>&1
  echo $? > "$out/tests.rc"
  "$kv" ab --memory vram --report "$out/ab-vram.json" > "$out/ab-vram.txt" 2>&1; echo "exit $?" >> "$out/ab-vram.txt"
  if [ -z "$quick" ]; then
    UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y "$kv" ab --memory vram --preset llama3-8b --requests 500 \
      --report "$out/ab-llama3.json" > "$out/ab-llama3.txt" 2>&1; echo "exit $?" >> "$out/ab-llama3.txt"
  fi
  if [ "$ngpu" -ge 2 ]; then
    "$kv" ab --memory vram --prefill-device 0 --decode-device 1 --requests 1000 > "$out/ab-x2.txt" 2>&1; echo "exit $?" >> "$out/ab-x2.txt"
    [ -z "$quick" ] && { "$kv" run --memory vram --prefill-device 0 --decode-device 1 --preset llama3-8b --blocks 2048 \
      --iterations 20 --op write 2>&1 | grep -v "^iteration" > "$out/x2-write.txt"; echo "exit ${PIPESTATUS[0]}" >> "$out/x2-write.txt"; }
  fi
) &
side=$!

step "stacked, llama3-8b VRAM (1 GiB per side), $dur, UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y"
UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y /usr/bin/time -f "wall %e s, max RSS %M KiB" "$kv" run --memory vram --preset llama3-8b \
  --scenario stacked --duration "$dur" --interval 60s --report "$out/stacked.json" 2> "$out/stacked-progress.txt" | tee -a "$log"
expect 0 "${PIPESTATUS[0]}" stacked, $dur
tail -3 "$out/stacked-progress.txt" | tee -a "$log"
wait "$side"
step "alongside"
check_tests tests "$(cat "$out/tests.rc" 2>/dev/null)"
rm -f "$out/tests.rc"
for f in ab-vram ab-llama3 ab-x2 x2-write; do
  if [ -f "$out/$f.txt" ]; then
    { echo "--- $f"; grep -v "requests verified\|^row " "$out/$f.txt"; } | tee -a "$log"
    expect_file 0 "$out/$f.txt" "$f"
  fi
  rm -f "$out/$f.txt"   # in the log now ($OUT returns at most 8 files)
done
