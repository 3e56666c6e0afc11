#!/usr/bin/env bash
# Installs what kvprobe needs on a fresh Debian/Ubuntu machine, idempotently:
#  - libclang (Debian's libclang-dev), which bindgen loads in the nixl-sys build script, and
#    a C++ compiler (g++) for that build script's stub library;
#  - the NIXL libraries and plugins (bundling UCX) from the PyPI wheel nixl-cu13, unpacked
#    under $KVPROBE_HOME/nixl (default ~/.local/share/kvprobe/nixl), where kvprobe looks for
#    them (override with KVPROBE_NIXL_DIR), and the shared libraries they load (libnuma1);
#  - Mooncake Store in a venv under $KVPROBE_HOME/mooncake (scripts/install-mooncake.sh).
# CUDA is not installed: kvprobe loads it at run time when present (VRAM runs).
#
# Each dependency is detected by what consumes it (scripts/deps.sh). After installing, the
# NIXL libraries are loaded-checked (ldd): a library still missing is an error naming it.
#
#   scripts/install-deps.sh           install what is missing
#   scripts/install-deps.sh --check   print what is missing, one line each, install nothing:
#                                     exit 0 when nothing is, 1 when something is
#   --build     only what `cargo build` needs (libclang, g++), e.g. a container's build stage
#   --runtime   only what `kvprobe` needs to run (NIXL, Mooncake, their libraries, pip to fetch
#               them), e.g. a container's runtime stage; either combines with --check
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
# shellcheck source=scripts/deps.sh
. "$here/deps.sh"

usage() { echo "usage: scripts/install-deps.sh [--check] [--build | --runtime]" >&2; exit 2; }
check=0
part=all
for a in "$@"; do
  case "$a" in
    --check) [ "$check" = 0 ] || usage; check=1 ;;
    --build | --runtime) [ "$part" = all ] || usage; part="${a#--}" ;;
    *) usage ;;
  esac
done
build=0 runtime=0
[ "$part" = runtime ] || build=1
[ "$part" = build ] || runtime=1

NIXL_WHEEL="nixl-cu13"
NIXL_VERSION="1.5.1"
home="$(deps_home)" || exit 2
dest="$home/nixl"
stamp="$dest/.installed-$NIXL_WHEEL-$NIXL_VERSION"

# Debian packages: libclang-dev for bindgen and g++ for nixl-sys's C++ stub (build); libnuma1 for the bundled UCX (libucs needs
# libnuma.so.1) and python3-pip to fetch the wheel (run time; Debian's and Ubuntu's python3
# come without pip). python3 unpacks the wheel (zipfile), so no unzip is needed.
need=()
if [ "$build" = 1 ]; then
  deps_need need find_libclang libclang-dev
  deps_need need have_cxx g++
fi
if [ "$runtime" = 1 ]; then
  deps_need need "have_shlib libnuma.so.1" libnuma1
  deps_need need have_pip python3-pip
fi

if [ "$check" = 1 ]; then
  status=0
  for p in "${need[@]}"; do echo "missing: $p"; status=1; done
  [ "$runtime" = 1 ] || exit "$status"
  if [ -n "${KVPROBE_NIXL_DIR:-}" ]; then
    # kvprobe then loads NIXL from there and only there.
    [ -f "$KVPROBE_NIXL_DIR/libnixl_capi.so" ] || { echo "missing: NIXL in KVPROBE_NIXL_DIR=$KVPROBE_NIXL_DIR"; status=1; }
  else
    [ -f "$stamp" ] && [ -f "$dest/lib/libnixl_capi.so" ] || { echo "missing: NIXL $NIXL_VERSION in $dest"; status=1; }
  fi
  "$here/install-mooncake.sh" --check || status=1
  exit "$status"
fi

apt_install install-deps "${need[@]}"
if [ "$build" = 1 ]; then
  if ! lib="$(find_libclang)"; then
    echo "install-deps: libclang-dev is installed but no libclang shared library is where bindgen looks (set LIBCLANG_PATH)" >&2
    exit 1
  fi
  echo "install-deps: libclang for bindgen: $lib"
fi
[ "$runtime" = 1 ] || exit 0
# python3 may have come with python3-pip just now.
deps_py="$(command -v python3 || command -v python || true)"

# Mooncake Store (--tier mooncake): its own venv under $home/mooncake.
"$here/install-mooncake.sh"

if [ -f "$stamp" ] && [ -f "$dest/lib/libnixl_capi.so" ]; then
  echo "install-deps: NIXL $NIXL_VERSION already in $dest"
else
  py="$deps_py"
  tmp="$(mktemp -d)"
  trap 'rm -rf "$tmp"' EXIT
  echo "install-deps: downloading $NIXL_WHEEL==$NIXL_VERSION"
  "$py" -m pip download --quiet --no-deps --only-binary=:all: -d "$tmp" "$NIXL_WHEEL==$NIXL_VERSION"
  whl="$(ls "$tmp"/*.whl | head -n 1)"
  mkdir -p "$tmp/x"
  "$py" - "$whl" "$tmp/x" <<'PY'
import sys, zipfile
whl, out = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(whl) as z:
    z.extractall(out, [n for n in z.namelist()
                       if n.startswith((".nixl_cu13.mesonpy.libs/", "nixl_cu13.libs/"))])
PY
  rm -rf "$dest.new"
  mkdir -p "$dest.new"
  # Keep the wheel's relative layout: the libraries' RPATH is $ORIGIN/../nixl_cu13.libs.
  mv "$tmp/x/.nixl_cu13.mesonpy.libs" "$dest.new/lib"
  mv "$tmp/x/nixl_cu13.libs" "$dest.new/nixl_cu13.libs"
  touch "$dest.new/.installed-$NIXL_WHEEL-$NIXL_VERSION"
  rm -rf "$dest"
  mv "$dest.new" "$dest"
  echo "install-deps: NIXL $NIXL_VERSION installed in $dest"
fi

# The loader's word: what kvprobe loads (libnixl_capi.so, libnixl.so and the default UCX
# backend plugin, with the bundled UCX) resolves its shared libraries. The wheel's other
# plugins (GDS, GPUNETIO, LIBFABRIC, ...) need vendor libraries kvprobe never uses; NIXL skips
# a plugin that does not load.
missing="$(missing_libs_of "$dest"/lib/libnixl*.so "$dest"/lib/plugins/libplugin_UCX.so)"
if [ -n "$missing" ]; then
  echo "install-deps: NIXL libraries in $dest cannot load; missing: $(echo $missing)" >&2
  exit 1
fi
