"""kvprobe's Mooncake Store worker: drives the official Python store client for kvprobe.

Mooncake exports no C API in its released packages, so kvprobe runs this program in the
Mooncake virtual environment and talks to it over stdin/stdout, one JSON object per line
(protocol `kvprobe-mooncake/1`, src/mem/mooncake.rs is the other end):

  request:  {"v": 1, "id": N, "op": OP, ...arguments}
  reply:    {"v": 1, "id": N, "ok": true, ...results}  or  {"v": 1, "id": N, "ok": false, "error": TEXT}

ops:
  hello                                   -> {"protocol", "mooncake": version}
  setup   {local_hostname, metadata_url, master, protocol, global_segment_bytes, local_buffer_bytes}
                                          -> {"rc"}            (MooncakeDistributedStore.setup)
  map_fd  {fd, len}                       -> {"base"}          maps kvprobe's shared DRAM pool (an
                                                               inherited memfd) and registers it (register_buffer)
  map_cuda {device, handles, region_bytes} -> {"bases"}        opens a VRAM pool: one CUDA IPC handle (128 hex
                                                               digits) per layer region of region_bytes, on
                                                               GPU ordinal `device`; registers each region
  put     {keys, ranges, pool}            -> {"rc": [..]}      batch_put_from_multi_buffers; ranges[k] is
                                                               [[offset, length], ...] into mapped pool
                                                               number `pool` (0 = first mapped, default); a
                                                               VRAM pool's offsets run over its regions in
                                                               order (layer * region_bytes + offset)
  get     {keys, ranges, pool}            -> {"rc": [..]}      batch_get_into_multi_buffers (bytes read, or < 0)
  remove  {keys}                          -> {"rc": [..]}      batch_remove
  exists  {keys}                          -> {"rc": [..]}      batch_is_exist (1 yes, 0 no, < 0 error)
  remove_all                              -> {"rc"}
  quit                                    -> {} and exit 0

Diagnostics go to stderr (kvprobe keeps its tail for reports). The worker exits when
stdin closes, so it never outlives kvprobe.
"""

import ctypes
import json
import mmap
import os
import sys

PROTOCOL = "kvprobe-mooncake/1"


def mooncake_version():
    try:
        from importlib import metadata

        for dist in metadata.distributions():
            name = (dist.metadata.get("Name") or "").lower()
            if name.startswith("mooncake-transfer-engine") or name.startswith("mooncake_transfer_engine"):
                return dist.version
    except Exception:  # noqa: BLE001 - a version is informative only
        pass
    return "unknown"


class Pool:
    """A mapped pool: equal regions (one for DRAM, one per layer for VRAM) at `bases`."""

    def __init__(self, bases, region_bytes, keep=None):
        self.bases, self.region, self.keep = bases, region_bytes, keep

    def ptr(self, off, n):
        i, within = divmod(off, self.region)
        if off < 0 or n <= 0 or i >= len(self.bases) or within + n > self.region:
            raise ValueError(f"range [{off}, {off + n}) outside the pool's {len(self.bases)} x {self.region}-byte regions")
        return self.bases[i] + within


class CudaIpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * 64)]


class CudaDriver:
    """The few CUDA driver calls that open kvprobe's VRAM pool (libcuda through ctypes, so the
    worker needs neither torch nor cuda-python)."""

    def __init__(self):
        self.lib = ctypes.CDLL("libcuda.so.1")
        self.check(self.lib.cuInit(0), "cuInit")
        self.open_ipc = getattr(self.lib, "cuIpcOpenMemHandle_v2", None) or self.lib.cuIpcOpenMemHandle
        self.open_ipc.argtypes = [ctypes.POINTER(ctypes.c_uint64), CudaIpcHandle, ctypes.c_uint]

    def check(self, rc, what):
        if rc != 0:
            name = ctypes.c_char_p()
            self.lib.cuGetErrorName(rc, ctypes.byref(name))
            raise RuntimeError(f"{what} failed: {(name.value or b'?').decode()} ({rc})")

    def bind(self, ordinal):
        dev, ctx = ctypes.c_int(), ctypes.c_void_p()
        self.check(self.lib.cuDeviceGet(ctypes.byref(dev), int(ordinal)), f"cuDeviceGet({ordinal})")
        self.check(self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
        self.check(self.lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")

    def open(self, handle_hex):
        raw = bytes.fromhex(handle_hex)
        if len(raw) != 64:
            raise ValueError(f"a CUDA IPC handle is 64 bytes, got {len(raw)}")
        h = CudaIpcHandle()
        ctypes.memmove(ctypes.byref(h), raw, 64)
        ptr = ctypes.c_uint64()
        # CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 1
        self.check(self.open_ipc(ctypes.byref(ptr), h, 1), "cuIpcOpenMemHandle")
        return ptr.value


class Worker:
    def __init__(self):
        self.store = None
        self.cuda = None
        self.maps = []  # mapped pools (Pool), in the order kvprobe mapped them

    def op_hello(self, _req):
        import mooncake.store  # noqa: F401 - a broken install must fail here, at hello

        return {"protocol": PROTOCOL, "mooncake": mooncake_version()}

    def op_setup(self, req):
        from mooncake.store import MooncakeDistributedStore

        # kvprobe's bind() shim (LD_PRELOAD, csrc/bind_host.c) binds the Transfer Engine's
        # listeners to this address instead of 0.0.0.0 / [::].
        os.environ["KVPROBE_BIND_HOST"] = req["local_hostname"]
        self.store = MooncakeDistributedStore()
        rc = self.store.setup(
            req["local_hostname"],
            req["metadata_url"],
            int(req["global_segment_bytes"]),
            int(req["local_buffer_bytes"]),
            req.get("protocol", "tcp"),
            req.get("device_name", ""),
            req["master"],
        )
        if rc != 0:
            raise RuntimeError(f"MooncakeDistributedStore.setup returned {rc}")
        return {"rc": rc}

    def need_store(self):
        if self.store is None:
            raise RuntimeError("setup first")
        return self.store

    def op_map_fd(self, req):
        store = self.need_store()
        fd, length = int(req["fd"]), int(req["len"])
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            target = "nothing"
        if not target.startswith("/memfd:kvprobe-pool"):
            raise ValueError(f"fd {fd} is {target}, not kvprobe's pool: the worker inherits only the pools passed to Worker::start")
        f = os.open(f"/proc/self/fd/{fd}", os.O_RDWR)
        try:
            m = mmap.mmap(f, length, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(f)
        base = ctypes.addressof(ctypes.c_char.from_buffer(m))
        rc = store.register_buffer(base, length)
        if rc != 0:
            raise RuntimeError(f"register_buffer returned {rc}")
        self.maps.append(Pool([base], length, keep=m))
        return {"base": base}

    def op_map_cuda(self, req):
        store = self.need_store()
        region = int(req["region_bytes"])
        if region <= 0 or not req["handles"]:
            raise ValueError("map_cuda needs region_bytes > 0 and at least one handle")
        if self.cuda is None:
            self.cuda = CudaDriver()
        self.cuda.bind(req["device"])
        bases = []
        for h in req["handles"]:
            base = self.cuda.open(h)
            rc = store.register_buffer(base, region)
            if rc != 0:
                raise RuntimeError(f"register_buffer of a VRAM region returned {rc}")
            bases.append(base)
        self.maps.append(Pool(bases, region))
        return {"bases": bases}

    def ptrs(self, ranges, pool=0):
        if not 0 <= pool < len(self.maps):
            raise RuntimeError(f"pool {pool} is not mapped (map_fd / map_cuda first)")
        p = self.maps[pool]
        out_p, out_s = [], []
        for key_ranges in ranges:
            ps, ss = [], []
            for off, n in key_ranges:
                off, n = int(off), int(n)
                ps.append(p.ptr(off, n))
                ss.append(n)
            out_p.append(ps)
            out_s.append(ss)
        return out_p, out_s

    def op_put(self, req):
        p, s = self.ptrs(req["ranges"], int(req.get("pool", 0)))
        return {"rc": list(self.need_store().batch_put_from_multi_buffers(req["keys"], p, s))}

    def op_get(self, req):
        p, s = self.ptrs(req["ranges"], int(req.get("pool", 0)))
        return {"rc": list(self.need_store().batch_get_into_multi_buffers(req["keys"], p, s))}

    def op_exists(self, req):
        return {"rc": list(self.need_store().batch_is_exist(req["keys"]))}

    def op_remove(self, req):
        return {"rc": list(self.need_store().batch_remove(req["keys"]))}

    def op_remove_all(self, _req):
        return {"rc": self.need_store().remove_all()}


def main():
    w = Worker()
    out = sys.stdout
    for line in sys.stdin:
        line = line.strip()
        if not line:
            continue
        rid = None
        try:
            req = json.loads(line)
            rid = req.get("id")
            if req.get("v") != 1:
                raise ValueError(f"unsupported protocol version {req.get('v')!r} (this worker speaks {PROTOCOL})")
            op = req.get("op")
            if op == "quit":
                out.write(json.dumps({"v": 1, "id": rid, "ok": True}) + "\n")
                out.flush()
                return 0
            fn = getattr(w, f"op_{op}", None)
            if fn is None:
                raise ValueError(f"unknown op {op!r}")
            reply = {"v": 1, "id": rid, "ok": True}
            reply.update(fn(req))
        except Exception as e:  # noqa: BLE001 - every failure goes back to kvprobe
            reply = {"v": 1, "id": rid, "ok": False, "error": f"{type(e).__name__}: {e}"}
        out.write(json.dumps(reply) + "\n")
        out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
