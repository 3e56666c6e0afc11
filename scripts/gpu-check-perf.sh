#!/usr/bin/env bash
# One call on the GPU host for the performance work (issue 5):
#   scripts/gpu-check-perf.sh [BUNDLE_DIR] [bench|tests|all]   (default: bench)
# bench: bench/run.sh on a quiet GPU; `kvprobe env` (probe transfers) with and without cuda_ipc
# get-zcopy; the pipelined sweep against one stage; descriptor sizes; host memory of a 1 GiB
# and of a 100 GiB (2 x 50 GiB) VRAM pool. ucx: the cuda_ipc settings tried on large
# descriptors (streams, descriptor size, stages). tests: the whole test binary
# (KVPROBE_REQUIRE_GPU=1, Mooncake from the bundle).
set -uo pipefail
source "$(dirname "$0")/gpu-lane.sh"
what="${2:-bench}"
summary() { grep -E "^(pool|transfer|path|  |warning|ucx|result|probe passes|pipeline|host memory)" | grep -v "^  iter" | tee -a "$log"; }
if [ "$what" = bench ] || [ "$what" = all ]; then
  step "bench/run.sh"
  BENCH_OUT="$out" bench/run.sh 2>&1 | tee -a "$log"
  expect 0 "${PIPESTATUS[0]}" bench/run.sh
  for z in n y; do
    step "kvprobe env, UCX_CUDA_IPC_ENABLE_GET_ZCOPY=$z"
    UCX_CUDA_IPC_ENABLE_GET_ZCOPY=$z "$kv" env 2>&1 | sed -n '/^transport/,$p' | tee -a "$log"
    expect 0 "${PIPESTATUS[0]}" "kvprobe env, GET_ZCOPY=$z"
  done
  export UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y
  for args in "--descriptor-blocks 512" "--descriptor-blocks 512 --pipeline-stages 8" \
              "--descriptor-blocks 512 --pipeline-stages 32" "--descriptor-blocks 64" "--descriptor-blocks 4"; do
    step "llama3-8b 1 GiB, 20 iterations, $args"
    "$kv" run --memory vram --preset llama3-8b --iterations 20 $args --report "$out/r.json" 2>&1 | summary
    expect 0 "${PIPESTATUS[0]}" "llama3-8b $args"
    medians "$out/r.json"
  done
  step "host memory: llama3-8b VRAM 1 GiB per side vs 50 GiB per side (100 GiB of pools), 32 KiB descriptors"
  for blocks in 512 25600; do
    /usr/bin/time -f "  max RSS %M KiB, %e s wall" "$kv" run --memory vram --preset llama3-8b --blocks $blocks --iterations 2 \
      --report "$out/mem-$blocks.json" 2>&1 | summary
    expect 0 "${PIPESTATUS[0]}" "host memory, $blocks blocks"
    python3 -c "import json,sys; s=json.load(open(sys.argv[1]))['summary']; print('  blocks', sys.argv[2], 'slices', s['blocks_checked']//2, 'host_peak_bytes', s['host_peak_bytes'])" "$out/mem-$blocks.json" $blocks | tee -a "$log"
  done
  step "100 GiB of pools with a bitflip and a misroute planted: found"
  "$kv" run --memory vram --preset llama3-8b --blocks 25600 --iterations 2 --descriptor-blocks 512 --inject bitflip --inject misroute \
    --report "$out/mem-inject.json" 2>&1 | summary
  expect 1 "${PIPESTATUS[0]}" "100 GiB of pools with a bitflip and a misroute"
fi
if [ "$what" = ucx ] || [ "$what" = all ]; then
  export UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y
  for env in "" "UCX_CUDA_IPC_MAX_STREAMS=1" "UCX_CUDA_IPC_MAX_STREAMS=4" "UCX_CUDA_IPC_MAX_STREAMS=64" \
             "UCX_CUDA_IPC_CACHE=n" "UCX_PROTO_ENABLE=n" "UCX_TLS=cuda_ipc,cuda_copy,tcp,self"; do
    for args in "--descriptor-blocks 512 --pipeline-stages 1" "--descriptor-blocks 512" "--blocks 2048 --descriptor-blocks 2048 --pipeline-stages 1"; do
      step "READ llama3-8b, 10 iterations, $args; ${env:-defaults}"
      env $env "$kv" run --memory vram --preset llama3-8b --iterations 10 $args --report "$out/u.json" 2>&1 | grep -E "^(path|result|ucx)" | tee -a "$log"
      expect 0 "${PIPESTATUS[0]}" "READ $args; ${env:-defaults}"
      medians "$out/u.json"
    done
  done
  step "WRITE llama3-8b, 10 iterations, 16 MiB descriptors"
  "$kv" run --memory vram --preset llama3-8b --iterations 10 --descriptor-blocks 512 --op write --report "$out/u.json" 2>&1 | grep -E "^(path|result)" | tee -a "$log"
  expect 0 "${PIPESTATUS[0]}" "WRITE, 16 MiB descriptors"
  medians "$out/u.json"
fi
if [ "$what" = procs ] || [ "$what" = all ]; then
  # Two processes (run --decode-process: prefill in a child) on this GPU, and the thread-block
  # cap of the probe's kernels while transfers are in flight (KVPROBE_OVERLAP_GRID).
  run() {
    step "$*"
    env "$@" --report "$out/p.json" 2>&1 | grep -E "^(path|result|ucx|warning)|error" | tee -a "$log"
    expect 0 "${PIPESTATUS[0]}" "$*"
    medians "$out/p.json"
  }
  z="UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y"
  base="$kv run --memory vram --preset llama3-8b --iterations 10"
  run UCX_CUDA_IPC_ENABLE_GET_ZCOPY=n $base --decode-process
  run $z $base --decode-process
  run $z $base --decode-process --descriptor-blocks 16
  run $z $base --decode-process --descriptor-blocks 512 --pipeline-stages 1
  run $z $base --decode-process --descriptor-blocks 512
  run $z $base --decode-process --descriptor-blocks 512 --op write --pipeline-stages 1
  run $z $base --decode-process --blocks 2048 --descriptor-blocks 2048 --pipeline-stages 1
  for g in 0 66 132 264 528; do
    run $z KVPROBE_OVERLAP_GRID=$g $base --descriptor-blocks 512
  done
  run $z KVPROBE_OVERLAP_GRID=132 $base --blocks 8 --block-size 1024
  run $z KVPROBE_OVERLAP_GRID=0 $base --blocks 8 --block-size 1024
  run $z $base --blocks 8 --block-size 1024 --pipeline-stages 1
fi
if [ "$what" = tests ] || [ "$what" = all ]; then
  step "tests"
  run_tests tests "$bundle/tests" --test-threads=2
fi
