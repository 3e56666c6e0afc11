#!/usr/bin/env bash
# Installs Mooncake Store (master + Python store client) for `--tier mooncake`, idempotently,
# into a project-managed virtual environment: $KVPROBE_HOME/mooncake/venv (default
# ~/.local/share/kvprobe/mooncake/venv), where kvprobe looks for it.
#  - wheel: mooncake-transfer-engine-cuda13 on CUDA 13 hosts, mooncake-transfer-engine-non-cuda
#    elsewhere (override with MOONCAKE_WHEEL=name==version);
#  - Debian's run-time libraries the wheel links against: libibverbs1, ibverbs-providers,
#    libnuma1, libcurl4.
# Called by scripts/install-deps.sh.
set -euo pipefail

home="${KVPROBE_HOME:-${XDG_DATA_HOME:-$HOME/.local/share}/kvprobe}"
dest="$home/mooncake"
if [ -e /usr/local/cuda/lib64/libcudart.so.13 ] || ls /usr/local/cuda-13*/lib64/libcudart.so.13 >/dev/null 2>&1; then
  wheel="${MOONCAKE_WHEEL:-mooncake-transfer-engine-cuda13==0.3.14}"
else
  wheel="${MOONCAKE_WHEEL:-mooncake-transfer-engine-non-cuda==0.3.13.post1}"
fi
stamp="$dest/.installed-${wheel//[^A-Za-z0-9._-]/_}"

sudo_() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }
need=()
for pkg in libibverbs1 ibverbs-providers libnuma1 libcurl4; do
  dpkg -s "$pkg" >/dev/null 2>&1 || need+=("$pkg")
done
py="$(command -v python3 || command -v python)"
"$py" -c 'import venv, ensurepip' 2>/dev/null || need+=(python3-venv)
if [ "${#need[@]}" -gt 0 ]; then
  echo "install-mooncake: apt-get install ${need[*]}"
  sudo_ apt-get update -qq
  sudo_ env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
fi

if [ -f "$stamp" ] && [ -x "$dest/venv/bin/mooncake_master" ]; then
  echo "install-mooncake: $wheel already in $dest"
  exit 0
fi
# The venv's scripts name their interpreter by absolute path, so it is built in place; the
# stamp, written last, marks a complete install.
rm -rf "$dest"
mkdir -p "$dest"
"$py" -m venv "$dest/venv"
echo "install-mooncake: installing $wheel"
"$dest/venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps --only-binary=:all: "$wheel"
"$dest/venv/bin/python" -c 'import mooncake.store' # the client loads (its libraries are present)
touch "$stamp"
echo "install-mooncake: $wheel installed in $dest"
