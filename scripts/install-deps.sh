#!/usr/bin/env bash
# Installs what kvprobe needs on a fresh Debian/Ubuntu machine, idempotently:
#  - libclang (bindgen, used by the nixl-sys build);
#  - the NIXL libraries and plugins (bundling UCX) from the PyPI wheel nixl-cu13,
#    unpacked under $KVPROBE_HOME/nixl (default ~/.local/share/kvprobe/nixl), where
#    kvprobe looks for them (override with KVPROBE_NIXL_DIR);
#  - Mooncake Store in a venv under $KVPROBE_HOME/mooncake (scripts/install-mooncake.sh).
# CUDA is not installed: kvprobe loads it at run time when present (VRAM runs).
set -euo pipefail

NIXL_WHEEL="nixl-cu13"
NIXL_VERSION="1.5.1"
home="${KVPROBE_HOME:-${XDG_DATA_HOME:-$HOME/.local/share}/kvprobe}"
dest="$home/nixl"
stamp="$dest/.installed-$NIXL_WHEEL-$NIXL_VERSION"

sudo_() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }

# Debian's libclang-dev, plus the run-time libraries the bundled UCX/NIXL link against.
need=()
ls /usr/lib/llvm-*/lib/libclang*.so* >/dev/null 2>&1 || need+=(libclang-dev)
for pkg in libnuma1 unzip; do
  dpkg -s "$pkg" >/dev/null 2>&1 || need+=("$pkg")
done
if [ "${#need[@]}" -gt 0 ]; then
  echo "install-deps: apt-get install ${need[*]}"
  sudo_ apt-get update -qq
  sudo_ env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
fi

# Mooncake Store (--tier mooncake): its own venv under $home/mooncake.
"$(dirname "$0")/install-mooncake.sh"

if [ -f "$stamp" ] && [ -f "$dest/lib/libnixl_capi.so" ]; then
  echo "install-deps: NIXL $NIXL_VERSION already in $dest"
  exit 0
fi

py="$(command -v python3 || command -v python)"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
echo "install-deps: downloading $NIXL_WHEEL==$NIXL_VERSION"
"$py" -m pip download --quiet --no-deps --only-binary=:all: -d "$tmp" "$NIXL_WHEEL==$NIXL_VERSION"
whl="$(ls "$tmp"/*.whl | head -n 1)"
mkdir -p "$tmp/x"
unzip -q "$whl" '.nixl_cu13.mesonpy.libs/*' 'nixl_cu13.libs/*' -d "$tmp/x"
rm -rf "$dest.new"
mkdir -p "$dest.new"
# Keep the wheel's relative layout: the libraries' RPATH is $ORIGIN/../nixl_cu13.libs.
mv "$tmp/x/.nixl_cu13.mesonpy.libs" "$dest.new/lib"
mv "$tmp/x/nixl_cu13.libs" "$dest.new/nixl_cu13.libs"
touch "$dest.new/.installed-$NIXL_WHEEL-$NIXL_VERSION"
rm -rf "$dest"
mv "$dest.new" "$dest"
echo "install-deps: NIXL $NIXL_VERSION installed in $dest"
