# Sourced by scripts/gpu-check*.sh: unpacks the bundle's NIXL and sets up the environment
# of a GPU lane. Expects $1 = bundle dir (default .carry); sets bundle, out, kv, log, step().
bundle="${1:-.carry}"
out="${OUT:-/tmp/kvprobe-gpu}"
mkdir -p "$out" /tmp/kvprobe-nixl
tar xJf "$bundle/nixl.tar.xz" -C /tmp/kvprobe-nixl
export KVPROBE_NIXL_DIR=/tmp/kvprobe-nixl/lib
export KVPROBE_BIN="$PWD/$bundle/kvprobe" KVPROBE_REQUIRE_GPU=1 KVPROBE_TEST_TMP=/tmp/kvprobe-test
# The bundle carries no Mooncake (issue 4 brings its wheel to the GPU host).
export KVPROBE_SKIP_MOONCAKE="${KVPROBE_SKIP_MOONCAKE-Mooncake is not in the GPU bundle}"
export LD_LIBRARY_PATH="/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
kv="$KVPROBE_BIN"
log="$out/log.txt"
step() { echo; echo "=== $*" | tee -a "$log"; }
