#!/usr/bin/env python3
"""Packs the part of a Mooncake wheel that `--tier mooncake` needs, for a host without network
(the GPU host): the Python package (its .py files), the store client `_store*.so`,
`mooncake_master`, and the closure of their bundled libraries. The wheel's other programs and
libraries (mooncake_client, the EP / process-group extensions, benches) are left out, which
keeps the cuda13 wheel's 50 MB under ~25 MB of xz.

The archive holds site-packages-relative paths (mooncake/, *.libs/, *.dist-info/); unpack
it into a venv's site-packages (scripts/gpu-lane.sh does) and kvprobe finds it as an install.

usage: scripts/pack-mooncake.py WHEEL OUT.tar.xz
"""
import io, os, subprocess, sys, tarfile, tempfile, zipfile


def needed(data):
    with tempfile.NamedTemporaryFile() as f:
        f.write(data)
        f.flush()
        out = subprocess.run(["readelf", "-d", f.name], capture_output=True, text=True, check=True).stdout
    return [l.split("[")[1].split("]")[0] for l in out.splitlines() if "(NEEDED)" in l]


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    wheel, out = sys.argv[1:]
    z = zipfile.ZipFile(wheel)
    names = [i.filename for i in z.infolist() if not i.is_dir()]
    libs = {os.path.basename(n): n for n in names if ".so" in os.path.basename(n)}
    roots = [n for n in names if n.startswith("mooncake/_store") or n == "mooncake/mooncake_master"]
    if len(roots) != 2:
        sys.exit(f"{wheel}: expected mooncake/_store*.so and mooncake/mooncake_master, found {roots}")
    todo, native = list(roots), set()
    while todo:
        n = todo.pop()
        if n in native:
            continue
        native.add(n)
        todo += [libs[d] for d in needed(z.read(n)) if d in libs]
    keep = sorted(native | {n for n in names if n.endswith(".py") or ".dist-info/" in n})
    with tarfile.open(out, "w:xz") as t:
        for n in keep:
            data = z.read(n)
            info = tarfile.TarInfo(n)
            info.size = len(data)
            info.mode = 0o755 if n in native else 0o644
            t.addfile(info, io.BytesIO(data))
    print(f"{out}: {len(keep)} files ({len(native)} native), {os.path.getsize(out) / 1e6:.1f} MB")


main()
