#!/usr/bin/env python3
"""Packs the subset of an installed NIXL (scripts/install-deps.sh) that kvprobe needs on
another machine: libnixl_capi.so, the UCX and POSIX plugins, UCX's transport modules,
and the closure of their bundled dependencies. Writes a .tar.xz whose layout matches the
install dir (lib/, nixl_cu13.libs/), ~10 MB, for hosts without network (the GPU host).

usage: scripts/pack-nixl.py [NIXL_ROOT] OUT.tar.xz
"""
import os, subprocess, sys, tarfile

def needed(path):
    out = subprocess.run(["readelf", "-d", path], capture_output=True, text=True, check=True).stdout
    return [l.split("[")[1].split("]")[0] for l in out.splitlines() if "(NEEDED)" in l]

def main():
    args = sys.argv[1:]
    root = args[0] if len(args) == 2 else os.path.expanduser(
        os.environ.get("KVPROBE_HOME", "~/.local/share/kvprobe") + "/nixl")
    out = args[-1]
    dirs = ["lib", "lib/plugins", "nixl_cu13.libs", "nixl_cu13.libs/ucx"]
    index = {}
    for d in dirs:
        p = os.path.join(root, d)
        for f in os.listdir(p):
            if ".so" in f and os.path.isfile(os.path.join(p, f)):
                index.setdefault(f, os.path.join(d, f))
    roots = ["lib/libnixl_capi.so", "lib/plugins/libplugin_UCX.so", "lib/plugins/libplugin_POSIX.so"]
    roots += [os.path.join("nixl_cu13.libs/ucx", f) for f in os.listdir(os.path.join(root, "nixl_cu13.libs/ucx"))
              if f.endswith(".so.0.0.0") and ("perftest" not in f)]
    todo, seen = list(roots), set()
    while todo:
        rel = todo.pop()
        if rel in seen:
            continue
        seen.add(rel)
        for n in needed(os.path.join(root, rel)):
            if n in index:
                todo.append(index[n])
    # install-deps.sh's stamp names the wheel and version (kvprobe env and bundles report it).
    seen |= {f for f in os.listdir(root) if f.startswith(".installed-")}
    with tarfile.open(out, "w:xz") as t:
        for rel in sorted(seen):
            t.add(os.path.join(root, rel), arcname=rel)
    print(f"{out}: {len(seen)} files, {os.path.getsize(out) / 1e6:.1f} MB")

main()
