# Sourced by scripts/install-deps.sh and scripts/install-mooncake.sh: how each dependency is
# detected, by exactly what consumes it (never by a look-alike file name: a check once took
# libclang-cpp.so.14 for libclang and skipped the install on a fresh Debian 12 machine).
#
# KVPROBE_DEPS_ROOT (default: empty = /) is prepended to every file-system path searched, so a
# test can run the detection against a machine state made up in a temporary directory
# (tests/setup.rs does). Commands (python3) are still the real ones.

deps_root="${KVPROBE_DEPS_ROOT:-}"

# deps_home: where kvprobe keeps its installs: $KVPROBE_HOME, else $XDG_DATA_HOME/kvprobe,
# else ~/.local/share/kvprobe (as kvprobe looks for them); exit 2 when none can be named.
deps_home() {
  if [ -n "${KVPROBE_HOME:-}" ]; then echo "$KVPROBE_HOME"
  elif [ -n "${XDG_DATA_HOME:-}" ]; then echo "$XDG_DATA_HOME/kvprobe"
  elif [ -n "${HOME:-}" ]; then echo "$HOME/.local/share/kvprobe"
  else echo "neither KVPROBE_HOME, XDG_DATA_HOME nor HOME is set: set KVPROBE_HOME to where kvprobe's dependencies go" >&2; return 2
  fi
}
deps_multiarch="$(gcc -print-multiarch 2>/dev/null || dpkg-architecture -qDEB_HOST_MULTIARCH 2>/dev/null || echo "$(uname -m)-linux-gnu")"

# is_elf64 FILE: the file starts with a 64-bit ELF header (clang-sys rejects other classes).
is_elf64() {
  local head
  head="$(head -c 5 -- "$1" 2>/dev/null | od -An -tx1 | tr -d ' \n')" || return 1
  [ "$head" = "7f454c4602" ]
}

# libclang_dirs: the directories clang-sys 1.9.1 (bindgen's libclang loader, used by the
# nixl-sys build script) searches, in its order (clang-sys build/common.rs,
# search_libclang_directories): only $LIBCLANG_PATH when set; else `llvm-config --prefix`'s
# bin, lib and lib64 ($LLVM_CONFIG_PATH names llvm-config), $LD_LIBRARY_PATH, $LIBRARY_PATH,
# and the globs /usr/local/llvm*/lib*, /usr/local/lib*/*/*, /usr/local/lib*/*, /usr/local/lib*,
# /usr/lib*/*/*, /usr/lib*/*, /usr/lib*.
libclang_dirs() {
  if [ -n "${LIBCLANG_PATH:-}" ]; then
    if [ -f "$deps_root$LIBCLANG_PATH" ]; then dirname -- "$deps_root$LIBCLANG_PATH"; else echo "$deps_root$LIBCLANG_PATH"; fi
    return
  fi
  local prefix d
  prefix="$("${LLVM_CONFIG_PATH:-llvm-config}" --prefix 2>/dev/null | head -n 1)" || true
  if [ -n "$prefix" ]; then
    for d in bin lib lib64; do echo "$deps_root$prefix/$d"; done
  fi
  local IFS=:
  for d in ${LD_LIBRARY_PATH:-} ${LIBRARY_PATH:-}; do [ -n "$d" ] && echo "$deps_root$d"; done
  unset IFS
  for d in "$deps_root"/usr/local/llvm*/lib* "$deps_root"/usr/local/lib*/*/* "$deps_root"/usr/local/lib*/* \
           "$deps_root"/usr/local/lib* "$deps_root"/usr/lib*/*/* "$deps_root"/usr/lib*/* "$deps_root"/usr/lib*; do
    [ -d "$d" ] && echo "$d"
  done
}

# find_libclang: prints the first libclang shared library bindgen can load, exit 1 if none.
# File names as clang-sys matches them at run time on Linux: libclang.so, libclang-*.so,
# libclang.so.*, libclang-*.so.*, except names containing "-cpp." (libclang-cpp is Clang's C++
# library, not the C API bindgen needs), and only 64-bit ELF files.
find_libclang() {
  local dir f base
  while IFS= read -r dir; do
    [ -d "$dir" ] || continue
    for f in "$dir"/libclang.so "$dir"/libclang-*.so "$dir"/libclang.so.* "$dir"/libclang-*.so.*; do
      [ -e "$f" ] || continue
      base="${f##*/}"
      case "$base" in *-cpp.*) continue ;; esac
      is_elf64 "$f" || continue
      echo "$f"
      return 0
    done
  done < <(libclang_dirs)
  return 1
}

# shlib_dirs: where the dynamic loader finds shared libraries: the trusted directories and
# those listed in /etc/ld.so.conf.d/*.conf (what ldconfig puts in its cache).
shlib_dirs() {
  local d conf
  for d in /lib /usr/lib /lib64 /usr/lib64 "/lib/$deps_multiarch" "/usr/lib/$deps_multiarch" /usr/local/lib; do
    echo "$deps_root$d"
  done
  for conf in "$deps_root"/etc/ld.so.conf.d/*.conf; do
    [ -f "$conf" ] || continue
    sed -e 's/#.*//' -e '/^[[:space:]]*$/d' -e '/^include/d' "$conf" | while IFS= read -r d; do echo "$deps_root$d"; done
  done
}

# have_shlib SONAME: the loader can find SONAME (e.g. libnuma.so.1, as the bundled UCX and the
# Mooncake wheel name it in their DT_NEEDED entries).
have_shlib() {
  local d
  while IFS= read -r d; do
    [ -e "$d/$1" ] && return 0
  done < <(shlib_dirs)
  return 1
}

# have_ibverbs_providers: libibverbs can load a user-space provider: a library
# lib<name>-rdmav<N>.so in <libdir>/libibverbs/ (what ibverbs-providers installs; its
# /etc/libibverbs.d/*.driver files are conffiles that stay after a removal, so they prove nothing).
have_ibverbs_providers() {
  local d f
  while IFS= read -r d; do
    for f in "$d"/libibverbs/lib*-rdmav*.so; do [ -e "$f" ] && return 0; done
  done < <(shlib_dirs)
  return 1
}

# have_cxx: the C++ compiler cc-rs runs for nixl-sys's build (its C++ stub API): $CXX when set
# (then only that), else c++ or g++.
have_cxx() {
  if [ -n "${CXX:-}" ]; then command -v "${CXX%% *}"; else command -v c++ || command -v g++; fi
}

# have_pip: python3 has pip (install-deps.sh downloads the NIXL wheel with `pip download`).
have_pip() {
  [ -n "$deps_py" ] && "$deps_py" -m pip --version
}

# have_python_venv: `python3 -m venv` can make an environment with pip (install-mooncake.sh).
have_python_venv() {
  "$deps_py" -c 'import venv, ensurepip' 2>/dev/null
}
deps_py="$(command -v python3 || command -v python || true)"

# missing_libs_of FILE...: the DT_NEEDED libraries the loader cannot resolve (ldd's "not found"),
# one per line; used after an install to prove the libraries load.
missing_libs_of() {
  local f
  for f in "$@"; do
    ldd "$f" 2>/dev/null | awk '/not found/ { print $1 }'
  done | sort -u
}

# deps_need VAR CHECK PACKAGE...: append PACKAGE... to the array VAR when CHECK fails.
deps_need() {
  local var="$1" check="$2"
  shift 2
  # shellcheck disable=SC2294
  eval "$check" >/dev/null 2>&1 && return 0
  eval "$var+=(\"\$@\")"
}

sudo_() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }

# apt_install WHO PACKAGE...: installs Debian packages (after one `apt-get update`).
apt_install() {
  local who="$1"
  shift
  [ "$#" -gt 0 ] || return 0
  echo "$who: apt-get install $*"
  sudo_ apt-get update -qq
  sudo_ env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}
