#!/usr/bin/env bash
# Installs Mooncake Store (master + Python store client) for `--tier mooncake`, idempotently,
# into a project-managed virtual environment: $KVPROBE_HOME/mooncake/venv (default
# ~/.local/share/kvprobe/mooncake/venv), where kvprobe looks for it.
#  - wheel: mooncake-transfer-engine-cuda13 on CUDA 13 hosts (libcudart.so.13 in
#    /usr/local/cuda*/lib64 or where the loader looks), mooncake-transfer-engine-non-cuda
#    elsewhere (override with MOONCAKE_WHEEL=name==version);
#  - Debian's run-time libraries the wheel's libraries and mooncake_master load: libibverbs.so.1
#    (libibverbs1) with a user-space provider (ibverbs-providers), libnuma.so.1 (libnuma1),
#    libcurl.so.4 (libcurl4), and python3-venv when `python3 -m venv` cannot make a venv.
# Each is detected by what consumes it (scripts/deps.sh); after the install the store client is
# imported and mooncake_master's libraries are loader-checked.
# Called by scripts/install-deps.sh; `--check` prints what is missing (exit 1) and installs nothing.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
# shellcheck source=scripts/deps.sh
. "$here/deps.sh"

home="$(deps_home)" || exit 2
dest="$home/mooncake"
cuda13=0
for f in "$deps_root"/usr/local/cuda*/lib64/libcudart.so.13; do [ -e "$f" ] && cuda13=1; done
have_shlib libcudart.so.13 && cuda13=1
if [ "$cuda13" = 1 ]; then
  wheel="${MOONCAKE_WHEEL:-mooncake-transfer-engine-cuda13==0.3.14}"
else
  wheel="${MOONCAKE_WHEEL:-mooncake-transfer-engine-non-cuda==0.3.13.post1}"
fi
stamp="$dest/.installed-${wheel//[^A-Za-z0-9._-]/_}"

need=()
deps_need need "have_shlib libibverbs.so.1" libibverbs1
deps_need need have_ibverbs_providers ibverbs-providers
deps_need need "have_shlib libnuma.so.1" libnuma1
deps_need need "have_shlib libcurl.so.4" libcurl4
deps_need need have_python_venv python3-venv

case "$#:${1:-}" in
  1:--check)
    status=0
    for p in "${need[@]}"; do echo "missing: $p"; status=1; done
    if [ -n "${KVPROBE_MOONCAKE_VENV:-}" ]; then
      # kvprobe then uses that venv.
      [ -x "$KVPROBE_MOONCAKE_VENV/bin/python" ] || { echo "missing: Mooncake venv KVPROBE_MOONCAKE_VENV=$KVPROBE_MOONCAKE_VENV"; status=1; }
    else
      [ -f "$stamp" ] && [ -x "$dest/venv/bin/mooncake_master" ] || { echo "missing: $wheel in $dest"; status=1; }
    fi
    exit "$status" ;;
  0:) ;;
  *) echo "usage: scripts/install-mooncake.sh [--check]" >&2; exit 2 ;;
esac

apt_install install-mooncake "${need[@]}"
# python3 may have come with python3-venv just now.
deps_py="$(command -v python3 || command -v python || true)"

if [ -f "$stamp" ] && [ -x "$dest/venv/bin/mooncake_master" ]; then
  echo "install-mooncake: $wheel already in $dest"
  exit 0
fi
# The venv's scripts name their interpreter by absolute path, so it is built in place; the
# stamp, written last, marks a complete install.
rm -rf "$dest"
mkdir -p "$dest"
"$deps_py" -m venv "$dest/venv"
echo "install-mooncake: installing $wheel"
"$dest/venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps --only-binary=:all: "$wheel"
"$dest/venv/bin/python" -c 'import mooncake.store' # the store client loads (its libraries are present)
master="$("$dest/venv/bin/python" -c 'import mooncake, os; print(os.path.join(os.path.dirname(mooncake.__file__), "mooncake_master"))')"
if [ -e "$master" ]; then
  missing="$(missing_libs_of "$master" | grep -v -E '^lib(cuda|cudart|nvidia-ml)\.so' || true)"
  if [ -n "$missing" ]; then
    echo "install-mooncake: mooncake_master cannot load; missing: $(echo $missing)" >&2
    exit 1
  fi
fi
touch "$stamp"
echo "install-mooncake: $wheel installed in $dest"
