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
# medians REPORT: one line from a sweep report: exit, corrupt slices, medians after the warm-up
# iteration (iteration, transfer, rate and its share of the same-run copy, share outside the
# transfer, stages).
medians() {
  python3 - "$1" <<'PY' | tee -a "$log"
import json, statistics as st, sys
r = json.load(open(sys.argv[1])); s = r["summary"]; it = s["per_iteration"][1:] or s["per_iteration"]
if not it:
    print(f"  exit {r['outcome']['exit_code']}: no iteration ({(r['outcome'].get('error') or {}).get('message', '')})"); sys.exit()
m = lambda k: st.median(x[k] for x in it)
p = s.get("transport_path") or {}
cp = p.get("copy_gbps") or 0
gbps = s["bytes_transferred"] / max(1, s["iterations"]) / m("transfer") / 1e9
vs = f"{gbps/cp:.3f} of the same-run copy {cp:.0f} GB/s" if cp else "no copy ceiling: pool under 64 MiB"
print(f"  exit {r['outcome']['exit_code']}, corrupt {s['blocks_corrupt']}; medians: iteration {m('iteration')*1e3:.3f} ms, "
      f"transfer {m('transfer')*1e3:.3f} ms = {gbps:.1f} GB/s ({vs}), "
      f"outside {100*(1-m('transfer')/m('iteration')):.2f} %, hidden {m('overlapped')*1e3:.3f} ms, stages {s['pipeline_stages']}")
PY
}
