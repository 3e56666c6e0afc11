#!/usr/bin/env python3
"""Times variants of kvprobe's fill and verify kernels against the device copy ceiling, on a
GPU host with only the CUDA driver and NVRTC (ctypes; no cargo, no pip). Used to choose the
kernels' shape (bench/NOTES.md); kvprobe's own figures come from `kvprobe bench`.

usage: bench/kernel_variants.py [GIB]     (default 4: one region of GIB GiB, llama3-8b slices)
       bench/kernel_variants.py --compile   (NVRTC only, for compute_90: no GPU needed)

Each variant is csrc/fingerprint.h + csrc/kernels.cu with textual changes (VARIANTS below),
compiled by NVRTC for the device. For each: fill, then verify (must report no failure), then
one flipped byte (must be found), then the median of 7 timed passes (CUDA events) of fill and
of verify, as GB/s (1e9 B/s) and as a ratio of cuMemcpyDtoD of the region (read + written).
"""
import ctypes, os, statistics, sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
COMPILE_ONLY = sys.argv[1:] == ["--compile"]
GIB = int(sys.argv[1]) if len(sys.argv) > 1 and not COMPILE_ONLY else 4

nvrtc = None
for name in (os.environ.get("NVRTC_LIB", "libnvrtc.so"), "libnvrtc.so.13", "/usr/local/cuda/lib64/libnvrtc.so"):
    try:
        nvrtc = ctypes.CDLL(name)
        break
    except OSError:
        pass
if nvrtc is None:
    sys.exit("kernel_variants.py: NVRTC not found (LD_LIBRARY_PATH=/usr/local/cuda/lib64)")


def ck(r, what):
    if r != 0:
        raise RuntimeError("%s failed: %d" % (what, r))


def compile_ptx(src, arch):
    prog = ctypes.c_void_p()
    ck(nvrtc.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), b"k.cu", 0, None, None), "nvrtcCreateProgram")
    opts = [("--gpu-architecture=" + arch).encode(), b"-default-device"]
    r = nvrtc.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    n = ctypes.c_size_t()
    nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
    log = ctypes.create_string_buffer(n.value)
    nvrtc.nvrtcGetProgramLog(prog, log)
    if r != 0:
        raise RuntimeError("NVRTC: " + log.value.decode())
    nvrtc.nvrtcGetPTXSize(prog, ctypes.byref(n))
    ptx = ctypes.create_string_buffer(n.value)
    nvrtc.nvrtcGetPTX(prog, ptx)
    return ptx.value


class Rows(ctypes.Structure):
    _fields_ = [("rc", ctypes.c_uint), ("heads", ctypes.c_uint), ("block_size", ctypes.c_uint),
                ("head_base", ctypes.c_uint), ("order", ctypes.c_uint)]


def base_source():
    h = open(os.path.join(ROOT, "csrc/fingerprint.h")).read()
    k = open(os.path.join(ROOT, "csrc/kernels.cu")).read()
    return "#define KVP_NVRTC 1\n" + h + "\n" + k


def replace(src, old, new):
    assert old in src, old[:60]
    return src.replace(old, new)


def part(n):
    return lambda s: replace(s, "#define KVP_PART_CHUNKS 2048u", "#define KVP_PART_CHUNKS %du" % n)


def cached_loads(s):
    return replace(s, "got[k] = __ldcs(s + c);", "got[k] = __ldg(s + c);")


# (name, edits, chunks per part). The kernels as kept first; bench/NOTES.md v8 has the variants
# that chose them (the other definitions of the body were made by editing fingerprint.h too).
VARIANTS = [
    ("as kept (32 KiB parts)", [], 2048),
    ("16 KiB parts", [part(1024)], 1024),
    ("cached loads (__ldg)", [cached_loads], 2048),
    ("as kept (again)", [], 2048),
]


def main():
    if COMPILE_ONLY:
        for name, edits, _ in VARIANTS:
            src = base_source()
            for e in edits:
                src = e(src)
            print("%-28s %d bytes of PTX" % (name, len(compile_ptx(src, "compute_90"))))
        return
    global cuda
    cuda = ctypes.CDLL("libcuda.so.1")
    ck(cuda.cuInit(0), "cuInit")
    dev = ctypes.c_int()
    ck(cuda.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
    ma, mi = ctypes.c_int(), ctypes.c_int()
    cuda.cuDeviceGetAttribute(ctypes.byref(ma), 75, dev)
    cuda.cuDeviceGetAttribute(ctypes.byref(mi), 76, dev)
    arch = "compute_%d%d" % (ma.value, mi.value)
    ctx = ctypes.c_void_p()
    ck(cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
    ck(cuda.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    size = GIB << 30
    sb = 32 << 10  # llama3-8b: 16 tokens x 8 heads x 256-byte rows
    nslices = size // sb
    nblocks = nslices // 2
    region, other, table, fails, counters, bases = (ctypes.c_ulonglong() for _ in range(6))
    for p, n in ((region, size), (other, size), (table, 16 * nblocks), (fails, 16 * nslices * 4), (counters, 16 + 256 * 16),
                 (bases, 8)):
        ck(cuda.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(n)), "cuMemAlloc")
    # The kernels run over a range of layers (region bases in a device array): here one layer.
    ck(cuda.cuMemcpyHtoD_v2(bases, ctypes.byref(ctypes.c_ulonglong(region.value)), ctypes.c_size_t(8)), "bases")
    tab = (ctypes.c_uint * (4 * nblocks))()
    for b in range(nblocks):
        tab[4 * b], tab[4 * b + 1] = (b * 2654435761) & 0xFFFFFFFF, 1
    ck(cuda.cuMemcpyHtoD_v2(table, tab, ctypes.c_size_t(16 * nblocks)), "table")
    start, end = ctypes.c_void_p(), ctypes.c_void_p()
    cuda.cuEventCreate(ctypes.byref(start), 0)
    cuda.cuEventCreate(ctypes.byref(end), 0)

    def timed(fn, n=7):
        fn()
        out = []
        for _ in range(n):
            cuda.cuEventRecord(start, None)
            fn()
            cuda.cuEventRecord(end, None)
            ck(cuda.cuEventSynchronize(end), "sync")
            ms = ctypes.c_float()
            cuda.cuEventElapsedTime(ctypes.byref(ms), start, end)
            out.append(ms.value / 1e3)
        return statistics.median(out)

    copy = timed(lambda: ck(cuda.cuMemcpyDtoD_v2(other, region, ctypes.c_size_t(size)), "copy"))
    copy_gbps = 2 * size / copy / 1e9
    print("copy ceiling (read+written): %.0f GB/s" % copy_gbps)
    print("%-28s %10s %7s %10s %7s  %s" % ("variant", "fill GB/s", "ratio", "verify GB/s", "ratio", "check"))
    for name, edits, part_chunks in VARIANTS:
        src = base_source()
        for e in edits:
            src = e(src)
        ptx = compile_ptx(src, arch)
        mod = ctypes.c_void_p()
        ck(cuda.cuModuleLoadData(ctypes.byref(mod), ptx), "cuModuleLoadData")
        f_fill, f_verify = ctypes.c_void_p(), ctypes.c_void_p()
        ck(cuda.cuModuleGetFunction(ctypes.byref(f_fill), mod, b"kvp_fill"), "kvp_fill")
        ck(cuda.cuModuleGetFunction(ctypes.byref(f_verify), mod, b"kvp_verify"), "kvp_verify")
        parts = (sb // 16 + part_chunks - 1) // part_chunks
        grid = min(nslices * parts, 1 << 20)
        rows = Rows(16, 8, 16, 0, 0)
        u = ctypes.c_uint

        def launch(f, args):
            arr = (ctypes.c_void_p * len(args))(*[ctypes.cast(ctypes.pointer(a), ctypes.c_void_p) for a in args])
            ck(cuda.cuLaunchKernel(f, grid, 1, 1, 256, 1, 1, 0, None, arr, None), "cuLaunchKernel")

        fill_args = [bases, u(0), u(1), u(sb), u(0), u(nblocks), u(0x1234567), table, u(nslices), rows]
        verify_args = [bases, u(0), u(1), u(sb), u(0), u(nblocks), u(0x1234567), table, u(nslices), fails, counters,
                       u(nslices * 4), ctypes.c_ulonglong(counters.value + 16), rows]
        count = ctypes.c_uint()

        def verify_count():
            ck(cuda.cuMemsetD8_v2(counters, 0, ctypes.c_size_t(16 + 256 * 16)), "memset")
            launch(f_verify, verify_args)
            ck(cuda.cuCtxSynchronize(), "sync")
            ck(cuda.cuMemcpyDtoH_v2(ctypes.byref(count), counters, ctypes.c_size_t(4)), "count")
            return count.value

        launch(f_fill, fill_args)
        ck(cuda.cuCtxSynchronize(), "sync")
        clean = verify_count()
        one = ctypes.c_ubyte()
        at = ctypes.c_ulonglong(region.value + size // 3 + 5)
        ck(cuda.cuMemcpyDtoH_v2(ctypes.byref(one), at, ctypes.c_size_t(1)), "read")
        one.value ^= 0x10
        ck(cuda.cuMemcpyHtoD_v2(at, ctypes.byref(one), ctypes.c_size_t(1)), "write")
        found = verify_count()
        one.value ^= 0x10
        ck(cuda.cuMemcpyHtoD_v2(at, ctypes.byref(one), ctypes.c_size_t(1)), "restore")
        check = "ok" if clean == 0 and found == 1 else "WRONG (clean %d, flipped %d)" % (clean, found)
        t_fill = timed(lambda: launch(f_fill, fill_args))
        t_verify = timed(lambda: launch(f_verify, verify_args))
        fg, vg = size / t_fill / 1e9, size / t_verify / 1e9
        print("%-28s %10.0f %7.3f %10.0f %7.3f  %s" % (name, fg, fg / copy_gbps, vg, vg / copy_gbps, check))
        cuda.cuModuleUnload(mod)


main()
