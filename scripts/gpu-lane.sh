# Sourced by scripts/gpu-check*.sh: unpacks the bundle's NIXL and sets up the environment
# of a GPU lane. Expects $1 = bundle dir (default .carry); sets bundle, out, kv, log, step().
bundle="${1:-.carry}"
out="${OUT:-/tmp/kvprobe-gpu}"
mkdir -p "$out" /tmp/kvprobe-nixl
tar xJf "$bundle/nixl.tar.xz" -C /tmp/kvprobe-nixl
export KVPROBE_NIXL_DIR=/tmp/kvprobe-nixl/lib
export KVPROBE_BIN="$PWD/$bundle/kvprobe" KVPROBE_REQUIRE_GPU=1 KVPROBE_TEST_TMP=/tmp/kvprobe-test
# Mooncake from the bundle (scripts/pack-mooncake.py): a venv on the host's python3 (no pip
# needed) with the package unpacked into its site-packages.
if [ -f "$bundle/mooncake.tar.xz" ]; then
  venv=/tmp/kvprobe-mooncake/venv
  if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv --without-pip "$venv"
    site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    tar xJf "$bundle/mooncake.tar.xz" -C "$site"
  fi
  export KVPROBE_MOONCAKE_VENV="$venv"
else
  export KVPROBE_SKIP_MOONCAKE="${KVPROBE_SKIP_MOONCAKE-Mooncake is not in the GPU bundle}"
fi
export LD_LIBRARY_PATH="/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
kv="$KVPROBE_BIN"
log="$out/log.txt"
step() { echo; echo "=== $*" | tee -a "$log"; }
