# Sourced by scripts/gpu-check*.sh: unpacks the bundle's NIXL and sets up the environment
# of a GPU lane. Expects $1 = bundle dir (default .carry); sets bundle, out, kv, log, step(),
# and the failure bookkeeping below (expect, fail, run_tests, check_tests).
#
# The GPUs the lane requires come from the host kind, never from what the host happens to show:
# KVPROBE_REQUIRE_GPUS (default 1; the two-GPU scripts set 2 themselves, and a caller sets it
# for a script that serves both kinds, e.g. KVPROBE_REQUIRE_GPUS=2 scripts/gpu-check-final.sh).
#
# A lane FAILS (exit 1, after every step ran and was logged) when a test binary exits non-zero,
# when a test prints a SKIP line (GPUs are required here: nothing may skip), when a step checked
# with `expect` exits otherwise than it must, or when `kvprobe env` sees fewer GPUs than required.
bundle="${1:-.carry}"
out="${OUT:-/tmp/kvprobe-gpu}"
log="$out/log.txt"
mkdir -p "$out"
export KVPROBE_REQUIRE_GPU=1 KVPROBE_REQUIRE_GPUS="${KVPROBE_REQUIRE_GPUS:-1}"
lane_failures=()
# fail WHAT: records a failure of the lane (logged now, summed up at exit).
fail() { lane_failures+=("$*"); echo "FAIL: $*" | tee -a "$log"; }
# expect WANT GOT WHAT...: logs "exit GOT" and fails the lane unless GOT is WANT. Give GOT as
# ${PIPESTATUS[0]} (or $?) right after the command: `cmd | tee -a "$log"; expect 0 "${PIPESTATUS[0]}" main job`.
expect() {
  local want=$1 got=$2
  shift 2
  echo "exit $got" | tee -a "$log"
  [ "$got" = "$want" ] || fail "$* exited $got (must be $want)"
}
# check_tests NAME RC: the test binary's output in $out/NAME.txt ended with exit status RC: logs
# its summary lines; fails the lane on a non-zero RC and on any SKIP line.
check_tests() {
  local name=$1 rc=$2
  grep -E "^test .*FAILED|test result|panicked|SKIP|NOT RUN" "$out/$name.txt" | tee -a "$log"
  expect 0 "$rc" "test binary ($name)"
  # "SKIP <test>: why", wherever it lands in lines interleaved by parallel tests (not SKIP_GEN).
  local skips
  skips=$(grep -cE '(^|[^[:alnum:]_])SKIP ' "$out/$name.txt")
  [ "$skips" -eq 0 ] || fail "test binary ($name): $skips SKIP line(s) in a lane that requires $KVPROBE_REQUIRE_GPUS GPU(s)"
}
# expect_file WANT FILE WHAT...: as expect, for a step run in the background that appended
# "exit N" to FILE (a missing line fails too).
expect_file() {
  local want=$1 file=$2
  shift 2
  expect "$want" "$(sed -n 's/^exit //p' "$file" 2>/dev/null | tail -1)" "$@"
}
# run_tests NAME CMD...: runs the test binary command CMD (output in $out/NAME.txt), then check_tests.
run_tests() {
  local name=$1
  shift
  "$@" > "$out/$name.txt" 2>&1
  check_tests "$name" $?
}
lane_finish() {
  local rc=$?
  if [ "${#lane_failures[@]}" -gt 0 ]; then
    echo "LANE FAILED: ${#lane_failures[@]} failure(s):" | tee -a "$log"
    printf '  %s\n' "${lane_failures[@]}" | tee -a "$log"
    exit 1
  fi
  exit "$rc"
}
trap lane_finish EXIT
[ -n "${KVPROBE_LANE_NO_SETUP:-}" ] && return 0   # tests of the bookkeeping above stop here
lane_tmp="${KVPROBE_LANE_TMP:-/tmp}"   # where the lane unpacks (tests of the scripts give their own)
mkdir -p "$lane_tmp/kvprobe-nixl"
tar xJf "$bundle/nixl.tar.xz" -C "$lane_tmp/kvprobe-nixl" || fail "unpacking $bundle/nixl.tar.xz"
export KVPROBE_NIXL_DIR="$lane_tmp/kvprobe-nixl/lib"
export KVPROBE_BIN="$PWD/$bundle/kvprobe" KVPROBE_TEST_TMP="$lane_tmp/kvprobe-test"
# Mooncake from the bundle (scripts/pack-mooncake.py): a venv on the host's python3 (no pip
# needed) with the package unpacked into its site-packages.
if [ -f "$bundle/mooncake.tar.xz" ]; then
  venv="$lane_tmp/kvprobe-mooncake/venv"
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
step() { echo; echo "=== $*" | tee -a "$log"; }
# The host must have the GPUs the lane requires (CUDA's count, through kvprobe env).
have=$("$kv" env --json --no-probe 2>>"$log" | python3 -c 'import json,sys; print(len(json.load(sys.stdin)["gpus"]))' 2>>"$log")
echo "GPUs: $have present, $KVPROBE_REQUIRE_GPUS required (KVPROBE_REQUIRE_GPUS)" | tee -a "$log"
[ "${have:-0}" -ge "$KVPROBE_REQUIRE_GPUS" ] 2>/dev/null || fail "kvprobe env: ${have:-no answer} GPU(s), the lane requires $KVPROBE_REQUIRE_GPUS"
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
