//! CUDA driver and NVRTC access: the only module with CUDA `unsafe`.
//!
//! Built on cudarc's raw `result` layer with dynamic loading, so kvprobe builds and runs
//! (on DRAM) where no CUDA is installed; [`driver_present`] tells before anything loads.
//! Device memory is allocated with plain `cuMemAlloc` (never stream-ordered pools), so
//! NIXL/UCX can register it and share it by CUDA IPC. All work goes to the legacy default
//! stream of the device's primary context and is synchronised before results are read.

use crate::error::{Error, Result};
use cudarc::driver::{result, sys};
use std::ffi::{CString, c_void};
use std::path::PathBuf;
use std::sync::Arc;

fn derr(what: &str, e: impl std::fmt::Debug) -> Error {
    Error::Device(format!("{what}: {e:?}"))
}

/// True when the CUDA driver library (libcuda.so.1) can be loaded.
pub fn driver_present() -> bool {
    // SAFETY: only attempts to dlopen candidate library names; nothing is called.
    unsafe { sys::is_culib_present() }
}

/// True when NVRTC (libnvrtc.so.N) can be loaded.
pub fn nvrtc_present() -> bool {
    // SAFETY: only attempts to dlopen candidate library names.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// Initialises the driver. Errors: no driver library, or `cuInit` failed (no GPU).
pub fn init() -> Result<()> {
    if !driver_present() {
        return Err(Error::Environment("CUDA driver library (libcuda.so.1) not found".into()));
    }
    result::init().map_err(|e| Error::Environment(format!("cuInit failed (no usable GPU?): {e:?}")))
}

/// Number of CUDA devices (0 when the driver is absent or cannot initialise; see
/// [`try_device_count`] to tell those apart).
pub fn device_count() -> usize {
    try_device_count().unwrap_or(0)
}

/// Number of CUDA devices, with the reason when there is no answer. Errors:
/// [`Error::Environment`] when libcuda.so.1 is not found or `cuInit` fails (its CUDA error
/// named: e.g. `CUDA_ERROR_NO_DEVICE`, a driver/library mismatch), [`Error::Device`] when
/// `cuDeviceGetCount` fails. `Ok(0)` only when the driver initialised and reports no device.
pub fn try_device_count() -> Result<usize> {
    init()?;
    result::device::get_count().map(|n| n.max(0) as usize).map_err(|e| derr("cuDeviceGetCount", e))
}

/// Driver API version as `major.minor` (e.g. "13.0").
pub fn driver_version() -> Result<String> {
    init()?;
    let mut v = 0i32;
    // SAFETY: valid out-pointer; the driver is initialised.
    unsafe { sys::cuDriverGetVersion(&mut v) }.result().map_err(|e| derr("cuDriverGetVersion", e))?;
    Ok(format!("{}.{}", v / 1000, (v % 1000) / 10))
}

/// NVRTC version as `major.minor`, when NVRTC loads.
pub fn nvrtc_version() -> Option<String> {
    if !nvrtc_present() {
        return None;
    }
    let (mut major, mut minor) = (0i32, 0i32);
    // SAFETY: valid out-pointers; the library was found above.
    let r = unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
    (r == cudarc::nvrtc::sys::nvrtcResult::NVRTC_SUCCESS).then(|| format!("{major}.{minor}"))
}

/// Static facts about one GPU.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct GpuInfo {
    /// CUDA ordinal.
    pub ordinal: usize,
    /// Marketing name, e.g. "NVIDIA H200".
    pub name: String,
    /// UUID as `GPU-xxxxxxxx-xxxx-...` (nvidia-smi's form).
    pub uuid: String,
    /// PCI bus id, e.g. "0000:19:00.0".
    pub pci_bus_id: String,
    /// Total device memory in bytes.
    pub total_bytes: u64,
    /// Compute capability `(major, minor)`.
    pub compute_capability: (i32, i32),
}

fn attr(dev: sys::CUdevice, a: sys::CUdevice_attribute) -> Result<i32> {
    // SAFETY: `dev` came from cuDeviceGet; the attribute enum is valid.
    unsafe { result::device::get_attribute(dev, a) }.map_err(|e| derr("cuDeviceGetAttribute", e))
}

/// Reads the facts of GPU `ordinal`. Errors: no such device.
pub fn gpu_info(ordinal: usize) -> Result<GpuInfo> {
    init()?;
    let dev = result::device::get(ordinal as i32).map_err(|e| derr("cuDeviceGet", e))?;
    let name = result::device::get_name(dev).map_err(|e| derr("cuDeviceGetName", e))?;
    let u = result::device::get_uuid(dev).map_err(|e| derr("cuDeviceGetUuid", e))?;
    let b: Vec<u8> = u.bytes.iter().map(|&c| c as u8).collect();
    let hex = |r: std::ops::Range<usize>| b[r].iter().map(|x| format!("{x:02x}")).collect::<String>();
    let uuid = format!("GPU-{}-{}-{}-{}-{}", hex(0..4), hex(4..6), hex(6..8), hex(8..10), hex(10..16));
    let mut bus = [0 as std::ffi::c_char; 32];
    // SAFETY: the buffer is 32 bytes and its length is passed; the driver NUL-terminates.
    unsafe { sys::cuDeviceGetPCIBusId(bus.as_mut_ptr(), bus.len() as i32, dev) }
        .result()
        .map_err(|e| derr("cuDeviceGetPCIBusId", e))?;
    // SAFETY: NUL-terminated by the driver within the buffer.
    let pci_bus_id = unsafe { std::ffi::CStr::from_ptr(bus.as_ptr()) }.to_string_lossy().into_owned();
    // SAFETY: `dev` is a valid device handle.
    let total_bytes = unsafe { result::device::total_mem(dev) }.map_err(|e| derr("cuDeviceTotalMem", e))? as u64;
    let major = attr(dev, sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
    let minor = attr(dev, sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
    Ok(GpuInfo { ordinal, name, uuid, pci_bus_id, total_bytes, compute_capability: (major, minor) })
}

/// GPUDirect RDMA support of GPU `ordinal` as the driver reports it:
/// `(CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED, CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED)`.
/// The first says the device can do GPUDirect RDMA at all (a NIC still needs nvidia_peermem or
/// dma-buf to reach it); the second that its memory can be exported as a dma-buf, which
/// ib_core (Linux 5.12+) registers without nvidia_peermem. Errors: no driver or no such device.
pub fn gpudirect_attrs(ordinal: usize) -> Result<(bool, bool)> {
    init()?;
    let dev = result::device::get(ordinal as i32).map_err(|e| derr("cuDeviceGet", e))?;
    let gdr = attr(dev, sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED)?;
    let dmabuf = attr(dev, sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED)?;
    Ok((gdr != 0, dmabuf != 0))
}

/// How two GPUs reach each other (CUDA's peer-to-peer attributes).
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct PeerLink {
    /// Source GPU ordinal.
    pub from: usize,
    /// Destination GPU ordinal.
    pub to: usize,
    /// `from` can map and access `to`'s memory (cuDeviceGetP2PAttribute ACCESS_SUPPORTED).
    pub access_supported: bool,
    /// Native atomics over the link (true over NVLink, usually false over PCIe).
    pub native_atomics: bool,
    /// Relative performance rank of the link (lower is faster).
    pub performance_rank: i32,
}

/// Peer-to-peer attributes from GPU `from` to GPU `to`. Errors: no such devices.
pub fn peer_link(from: usize, to: usize) -> Result<PeerLink> {
    init()?;
    let a = result::device::get(from as i32).map_err(|e| derr("cuDeviceGet", e))?;
    let b = result::device::get(to as i32).map_err(|e| derr("cuDeviceGet", e))?;
    let get = |attr: sys::CUdevice_P2PAttribute| -> Result<i32> {
        let mut v = 0i32;
        // SAFETY: valid out-pointer and device handles from cuDeviceGet.
        unsafe { sys::cuDeviceGetP2PAttribute(&mut v, attr, a, b) }.result().map_err(|e| derr("cuDeviceGetP2PAttribute", e))?;
        Ok(v)
    };
    use sys::CUdevice_P2PAttribute as A;
    Ok(PeerLink {
        from,
        to,
        access_supported: get(A::CU_DEVICE_P2P_ATTRIBUTE_ACCESS_SUPPORTED)? != 0,
        native_atomics: get(A::CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED)? != 0,
        performance_rank: get(A::CU_DEVICE_P2P_ATTRIBUTE_PERFORMANCE_RANK)?,
    })
}

/// A GPU with its retained primary context.
#[derive(Debug)]
pub struct Device {
    ordinal: usize,
    dev: sys::CUdevice,
    ctx: sys::CUcontext,
}

// SAFETY: a CUcontext may be made current on any thread; Device only hands it to the driver.
unsafe impl Send for Device {}
// SAFETY: as above; no interior state is mutated through &Device.
unsafe impl Sync for Device {}

impl Device {
    /// Retains GPU `ordinal`'s primary context. Errors: no such device.
    pub fn open(ordinal: usize) -> Result<Arc<Device>> {
        init()?;
        let n = device_count();
        if ordinal >= n {
            return Err(Error::Usage(format!("GPU {ordinal} does not exist ({n} found)")));
        }
        let dev = result::device::get(ordinal as i32).map_err(|e| derr("cuDeviceGet", e))?;
        // SAFETY: `dev` is valid; the retain is balanced by the release in Drop.
        let ctx = unsafe { result::primary_ctx::retain(dev) }.map_err(|e| derr("cuDevicePrimaryCtxRetain", e))?;
        let d = Device { ordinal, dev, ctx };
        d.bind()?;
        Ok(Arc::new(d))
    }

    /// CUDA ordinal.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// Makes this device's context current on the calling thread.
    pub fn bind(&self) -> Result<()> {
        // SAFETY: `ctx` is a retained primary context, alive until Drop.
        unsafe { result::ctx::set_current(self.ctx) }.map_err(|e| derr("cuCtxSetCurrent", e))
    }

    /// Runs `f` with peer access enabled both ways between this device and `peer` (so copies
    /// between them go over NVLink/PCIe peer-to-peer instead of through host memory), then
    /// disables what it enabled. Errors: the devices cannot access each other, or the driver
    /// refuses.
    pub fn with_peer_access<T>(&self, peer: &Device, f: impl FnOnce() -> Result<T>) -> Result<T> {
        let enable = |from: &Device, to: &Device| -> Result<bool> {
            from.bind()?;
            // SAFETY: both are retained primary contexts, alive while `self`/`peer` are.
            match unsafe { sys::cuCtxEnablePeerAccess(to.ctx, 0) } {
                sys::CUresult::CUDA_SUCCESS => Ok(true),
                sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED => Ok(false),
                e => Err(derr(&format!("cuCtxEnablePeerAccess(GPU {} -> GPU {})", from.ordinal, to.ordinal), e)),
            }
        };
        let disable = |from: &Device, to: &Device| {
            if from.bind().is_ok() {
                // SAFETY: as above; undoes an enable made here.
                let _ = unsafe { sys::cuCtxDisablePeerAccess(to.ctx) };
            }
        };
        let a = enable(self, peer)?;
        let b = match enable(peer, self) {
            Ok(b) => b,
            Err(e) => {
                if a {
                    disable(self, peer);
                }
                return Err(e);
            }
        };
        let r = f();
        if a {
            disable(self, peer);
        }
        if b {
            disable(peer, self);
        }
        r
    }

    /// `(free, total)` device memory in bytes.
    pub fn mem_info(&self) -> Result<(u64, u64)> {
        self.bind()?;
        let (f, t) = result::mem_get_info().map_err(|e| derr("cuMemGetInfo", e))?;
        Ok((f as u64, t as u64))
    }

    /// Waits for all work queued on this device; in a run, bounded by `--timeout`
    /// ([`crate::sys::deadline::watch`]).
    pub fn synchronize(&self) -> Result<()> {
        self.bind()?;
        let w = crate::sys::deadline::watch(|| format!("CUDA synchronisation of GPU {}", self.ordinal()).into());
        crate::sys::deadline::Stall::Sync.here();
        result::ctx::synchronize().map_err(|e| derr("kernel or copy failed (cuCtxSynchronize)", e))?;
        w.check()
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        // SAFETY: balances the retain in `open`; buffers hold an Arc<Device>, so none outlive it.
        let _ = unsafe { result::primary_ctx::release(self.dev) };
    }
}

/// Times GPU work queued on the legacy default stream (where kvprobe's kernels and copies
/// run) with a pair of CUDA events, as GPU benchmarks do: the time the device spent between
/// the two records, not host launch time.
pub struct GpuTimer {
    dev: Arc<Device>,
    start: sys::CUevent,
    end: sys::CUevent,
}

// SAFETY: CUDA events may be recorded, waited for and destroyed from any thread once their
// context is made current there; every method binds `dev`'s context first.
unsafe impl Send for GpuTimer {}

impl GpuTimer {
    /// Records the start event on `dev`'s default stream. Errors: the driver refuses events.
    pub fn start(dev: &Arc<Device>) -> Result<GpuTimer> {
        dev.bind()?;
        let create = || result::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT).map_err(|e| derr("cuEventCreate", e));
        let t = GpuTimer { dev: dev.clone(), start: create()?, end: create()? };
        // SAFETY: a live event of the bound context, recorded on the default stream.
        unsafe { result::event::record(t.start, std::ptr::null_mut()) }.map_err(|e| derr("cuEventRecord", e))?;
        Ok(t)
    }

    /// Records the end event, waits for it and returns the seconds between the two.
    pub fn stop(self) -> Result<f64> {
        self.end()?.seconds()
    }

    /// Records the end event without waiting: read the seconds later with
    /// [`PendingTime::seconds`] (after the work is known to be done, it does not block).
    pub fn end(self) -> Result<PendingTime> {
        self.dev.bind()?;
        // SAFETY: a live event of this context (destroyed only in Drop), recorded on the
        // default stream.
        unsafe { result::event::record(self.end, std::ptr::null_mut()) }.map_err(|e| derr("cuEventRecord", e))?;
        Ok(PendingTime(self))
    }
}

/// A [`GpuTimer`] whose end event is recorded: the device seconds of the work between the
/// two records, once it is done.
pub struct PendingTime(GpuTimer);

impl PendingTime {
    /// Waits for the end event and returns the seconds between the two events. Errors: the
    /// work failed (device, exit 3).
    pub fn seconds(&self) -> Result<f64> {
        let t = &self.0;
        t.dev.bind()?;
        let w = crate::sys::deadline::watch(|| format!("CUDA event wait on GPU {}", t.dev.ordinal()).into());
        crate::sys::deadline::Stall::Sync.here();
        // SAFETY: both events are live events of this context, both recorded.
        let ms = unsafe {
            sys::cuEventSynchronize(t.end).result().map_err(|e| derr("kernel or copy failed (cuEventSynchronize)", e))?;
            result::event::elapsed(t.start, t.end).map_err(|e| derr("cuEventElapsedTime", e))?
        };
        w.check()?;
        Ok(ms as f64 / 1e3)
    }
}

impl Drop for GpuTimer {
    fn drop(&mut self) {
        if self.dev.bind().is_ok() {
            // SAFETY: created in `start`, destroyed once here.
            unsafe {
                let _ = sys::cuEventDestroy_v2(self.start);
                let _ = sys::cuEventDestroy_v2(self.end);
            }
        }
    }
}

/// Device memory from `cuMemAlloc`, freed on drop — or another process's allocation opened
/// by its CUDA IPC handle ([`DeviceBuffer::import`]), closed on drop.
pub struct DeviceBuffer {
    dev: Arc<Device>,
    ptr: sys::CUdeviceptr,
    len: usize,
    /// Imported: what keeps the exporting process alive until the mapping is closed.
    exporter: Option<Arc<dyn std::any::Any + Send + Sync>>,
}

impl std::fmt::Debug for DeviceBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DeviceBuffer({:#x}, {} bytes{})", self.ptr, self.len, if self.exporter.is_some() { ", imported" } else { "" })
    }
}

impl DeviceBuffer {
    /// Allocates `len` bytes on `dev` (plain cuMemAlloc). Errors: out of memory.
    pub fn alloc(dev: &Arc<Device>, len: usize) -> Result<DeviceBuffer> {
        dev.bind()?;
        // SAFETY: allocation has no preconditions beyond a current context (bound above).
        let ptr = unsafe { result::malloc_sync(len.max(1)) }.map_err(|e| derr(&format!("cuMemAlloc({len})"), e))?;
        Ok(DeviceBuffer { dev: dev.clone(), ptr, len, exporter: None })
    }

    /// Opens another process's allocation of `len` bytes by its CUDA IPC `handle`
    /// (`cuIpcOpenMemHandle`, peer access enabled lazily) in `dev`'s context. `exporter` is
    /// kept until the mapping is closed (on drop), so the exporting process outlives it.
    /// `len` is what the peer claims; it is checked against the allocation the handle opens
    /// (`cuMemGetAddressRange`: the bytes from the returned address to the allocation's end),
    /// so no copy or kernel can run past the peer's memory on a wrong or hostile length.
    /// Errors (device, exit 3): the driver refuses the handle, or the allocation is shorter
    /// than `len` (the message names both lengths; the handle is closed again).
    pub fn import(
        dev: &Arc<Device>,
        handle: &[u8; 64],
        len: usize,
        exporter: Arc<dyn std::any::Any + Send + Sync>,
    ) -> Result<DeviceBuffer> {
        dev.bind()?;
        let mut h = sys::CUipcMemHandle_st { reserved: [0; 64] };
        for (d, s) in h.reserved.iter_mut().zip(handle) {
            *d = *s as _;
        }
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: `ptr` is a valid out-pointer and `h` a handle by value; flag 1 is
        // CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS. The mapping is closed once, in Drop.
        unsafe { sys::cuIpcOpenMemHandle_v2(&mut ptr, h, 1) }
            .result()
            .map_err(|e| derr("cuIpcOpenMemHandle (another process's allocation)", e))?;
        // From here on, dropping `buf` closes the handle (Drop), on every error path below.
        let buf = DeviceBuffer { dev: dev.clone(), ptr, len, exporter: Some(exporter) };
        let (mut base, mut size): (sys::CUdeviceptr, usize) = (0, 0);
        // SAFETY: `base` and `size` are valid out-pointers; `ptr` is the address the driver
        // just returned, in the context bound above.
        unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, ptr) }
            .result()
            .map_err(|e| derr("cuMemGetAddressRange (the imported allocation)", e))?;
        let available = base.saturating_add(size as u64).saturating_sub(ptr);
        if available < len as u64 {
            return Err(Error::Device(format!(
                "the CUDA IPC handle opens an allocation of {available} bytes, but the peer claimed {len}: refusing to \
                 use it (a wrong geometry or a corrupt handle)"
            )));
        }
        Ok(buf)
    }

    /// Device address.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when zero-length.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The device this buffer lives on.
    pub fn device(&self) -> &Arc<Device> {
        &self.dev
    }

    /// The CUDA IPC handle of this allocation (`cuIpcGetMemHandle`, 64 opaque bytes): another
    /// process opens it with `cuIpcOpenMemHandle` to read and write this memory (the Mooncake
    /// store worker does). Valid while this buffer lives. Errors: the driver refuses (e.g. the
    /// platform has no IPC support).
    pub fn ipc_handle(&self) -> Result<[u8; 64]> {
        self.dev.bind()?;
        let mut h = sys::CUipcMemHandle_st { reserved: [0; 64] };
        // SAFETY: `h` is a valid out-pointer; `ptr` is the base of a live cuMemAlloc allocation
        // in the bound context.
        unsafe { sys::cuIpcGetMemHandle(&mut h, self.ptr) }.result().map_err(|e| derr("cuIpcGetMemHandle", e))?;
        Ok(h.reserved.map(|b| b as u8))
    }

    fn check(&self, off: usize, n: usize) -> Result<()> {
        if off.checked_add(n).is_none_or(|end| end > self.len) {
            return Err(Error::Device(format!("copy of {n} bytes at {off} outside a {}-byte buffer", self.len)));
        }
        Ok(())
    }

    /// Copies `dst.len()` bytes from offset `off` to the host (synchronous).
    pub fn read(&self, off: usize, dst: &mut [u8]) -> Result<()> {
        self.check(off, dst.len())?;
        self.dev.bind()?;
        let w = crate::sys::deadline::watch(|| format!("CUDA copy of {} bytes to the host", dst.len()).into());
        // SAFETY: the range was bounds-checked against this live allocation.
        unsafe { result::memcpy_dtoh_sync(dst, self.ptr + off as u64) }.map_err(|e| derr("cuMemcpyDtoH", e))?;
        w.check()
    }

    /// Copies `src` to offset `off` (synchronous).
    pub fn write(&self, off: usize, src: &[u8]) -> Result<()> {
        self.check(off, src.len())?;
        self.dev.bind()?;
        let w = crate::sys::deadline::watch(|| format!("CUDA copy of {} bytes to the device", src.len()).into());
        // SAFETY: the range was bounds-checked against this live allocation.
        unsafe { result::memcpy_htod_sync(self.ptr + off as u64, src) }.map_err(|e| derr("cuMemcpyHtoD", e))?;
        w.check()
    }

    /// Copies `dst.len()` bytes from offset `off` into the host span `dst` (synchronous):
    /// through its raw pointer, so `dst` may lie in memory a transfer engine reads (the tier
    /// arena, [`crate::mem::tier::TierArena`]), which a `&mut [u8]` must not cover.
    pub fn read_into(&self, off: usize, mut dst: crate::sys::hostmem::SpanMut<'_>) -> Result<()> {
        self.check(off, dst.len())?;
        self.dev.bind()?;
        let w = crate::sys::deadline::watch(|| format!("CUDA copy of {} bytes to the host", dst.len()).into());
        // SAFETY: the device range was bounds-checked against this live allocation; `dst`
        // points at `dst.len()` writable host bytes that the span holds exclusively on the
        // Rust side (no transfer writes them: the hostmem contract).
        unsafe { sys::cuMemcpyDtoH_v2(dst.as_mut_ptr() as *mut c_void, self.ptr + off as u64, dst.len()) }
            .result()
            .map_err(|e| derr("cuMemcpyDtoH", e))?;
        w.check()
    }

    /// Copies the host span `src` to offset `off` (synchronous), reading it through its raw
    /// pointer (see [`DeviceBuffer::read_into`]).
    pub fn write_from(&self, off: usize, src: crate::sys::hostmem::Span<'_>) -> Result<()> {
        self.check(off, src.len())?;
        self.dev.bind()?;
        let w = crate::sys::deadline::watch(|| format!("CUDA copy of {} bytes to the device", src.len()).into());
        // SAFETY: the device range was bounds-checked against this live allocation; `src`
        // points at `src.len()` readable host bytes, valid while the span's borrow lives.
        unsafe { sys::cuMemcpyHtoD_v2(self.ptr + off as u64, src.as_ptr() as *const c_void, src.len()) }
            .result()
            .map_err(|e| derr("cuMemcpyHtoD", e))?;
        w.check()
    }

    /// Queues a copy of `src` (same length, any device: unified addressing) into this buffer
    /// on the default stream (cuMemcpyDtoDAsync; asynchronous — time it with [`GpuTimer`]).
    /// Errors: lengths differ, or the driver refuses.
    pub fn copy_from(&self, src: &DeviceBuffer) -> Result<()> {
        if src.len != self.len {
            return Err(Error::Device(format!("copy of {} bytes into a {}-byte buffer", src.len, self.len)));
        }
        self.dev.bind()?;
        // SAFETY: both are live allocations of `len` bytes; the default stream orders the copy
        // after earlier work on it.
        unsafe { result::memcpy_dtod_async(self.ptr, src.ptr, self.len, std::ptr::null_mut()) }
            .map_err(|e| derr("cuMemcpyDtoDAsync", e))
    }

    /// Queues a copy of the first `len` bytes of `src` to offset `off` of this buffer on the
    /// default stream (cuMemcpyDtoDAsync; asynchronous). Errors: a range outside either
    /// buffer, or the driver refuses (device).
    pub fn copy_range_from(&self, off: usize, src: &DeviceBuffer, len: usize) -> Result<()> {
        self.check(off, len)?;
        src.check(0, len)?;
        self.dev.bind()?;
        // SAFETY: both ranges were bounds-checked against live allocations; the default
        // stream orders the copy after earlier work on it.
        unsafe { result::memcpy_dtod_async(self.ptr + off as u64, src.ptr, len, std::ptr::null_mut()) }
            .map_err(|e| derr("cuMemcpyDtoDAsync", e))
    }

    /// Sets every byte to zero (synchronous).
    pub fn zero(&self) -> Result<()> {
        self.dev.bind()?;
        // SAFETY: the whole live allocation.
        unsafe { result::memset_d8_sync(self.ptr, 0, self.len) }.map_err(|e| derr("cuMemsetD8", e))
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        if self.dev.bind().is_ok() {
            if self.exporter.is_some() {
                // SAFETY: `ptr` came from cuIpcOpenMemHandle and is closed once; the exporter
                // (dropped after this) still holds the allocation.
                let _ = unsafe { sys::cuIpcCloseMemHandle(self.ptr) };
            } else {
                // SAFETY: `ptr` came from cuMemAlloc and is freed once.
                let _ = unsafe { result::free_sync(self.ptr) };
            }
        }
    }
}

/// Copies each `(dst, src)` pair (equal lengths) in pieces of `piece` bytes, one
/// cuMemcpyDtoDAsync per piece on one new `CU_STREAM_NON_BLOCKING` stream — as UCX's cuda_ipc
/// transport issues a transfer: one async copy per descriptor on its own stream — and returns
/// the device seconds between events recorded on that stream around the copies. The bench
/// compares it with the default-stream copy of whole regions. Errors: the driver refuses
/// (device, exit 3); lengths differ (device).
pub fn copy_pieces_on_stream(dev: &Arc<Device>, pairs: &[(&DeviceBuffer, &DeviceBuffer)], piece: usize) -> Result<f64> {
    dev.bind()?;
    let stream = result::stream::create(result::stream::StreamKind::NonBlocking).map_err(|e| derr("cuStreamCreate", e))?;
    let create = || result::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT).map_err(|e| derr("cuEventCreate", e));
    let run = || -> Result<f64> {
        let (start, end) = (create()?, create()?);
        let r = (|| {
            // SAFETY: live events and stream of the bound context; every copy stays inside the
            // two live allocations of a pair (lengths checked); the stream orders them.
            unsafe {
                result::event::record(start, stream).map_err(|e| derr("cuEventRecord", e))?;
                for (d, s) in pairs {
                    if d.len != s.len {
                        return Err(Error::Device(format!("copy of {} bytes into {}", s.len, d.len)));
                    }
                    let mut off = 0;
                    while off < d.len {
                        let n = piece.max(1).min(d.len - off);
                        result::memcpy_dtod_async(d.ptr + off as u64, s.ptr + off as u64, n, stream)
                            .map_err(|e| derr("cuMemcpyDtoDAsync", e))?;
                        off += n;
                    }
                }
                result::event::record(end, stream).map_err(|e| derr("cuEventRecord", e))?;
                sys::cuEventSynchronize(end).result().map_err(|e| derr("copy failed (cuEventSynchronize)", e))?;
                let ms = result::event::elapsed(start, end).map_err(|e| derr("cuEventElapsedTime", e))?;
                Ok(ms as f64 / 1e3)
            }
        })();
        // SAFETY: created above, destroyed once.
        unsafe {
            let _ = sys::cuEventDestroy_v2(start);
            let _ = sys::cuEventDestroy_v2(end);
        }
        r
    };
    let r = run();
    // SAFETY: created above; every copy on it has completed (or failed) — synchronise first.
    unsafe {
        let _ = result::stream::synchronize(stream);
        let _ = result::stream::destroy(stream);
    }
    r
}

/// Region parameters shared by the kernels (see csrc/kernels.cu): one launch runs over the
/// regions of layers `layer0 .. layer0 + num_layers`.
#[derive(Clone, Copy, Debug)]
pub struct RegionArgs {
    /// Device address of the pool's array of region base addresses (a u64 per layer, in layer
    /// order).
    pub bases: u64,
    /// First layer of the launch.
    pub layer0: u32,
    /// Layers of the launch.
    pub num_layers: u32,
    /// Bytes per block slice (multiple of 16).
    pub slice_bytes: u32,
    /// `KVP_LAYOUT_*` code.
    pub layout: u32,
    /// Blocks per layer.
    pub num_blocks: u32,
    /// Slices in a layer's region (global slice index = layer × num_slices + index in the region).
    pub num_slices: u32,
    /// Bytes per head row (`head_size × dtype bytes`; [`crate::core::fingerprint::RowShape`]).
    pub row_bytes: u32,
    /// Head positions per slice.
    pub heads: u32,
    /// Token positions per slice.
    pub block_size: u32,
    /// Global head of a slice's first head position.
    pub head_base: u32,
}

/// `struct kvp_rows` of csrc/kernels.cu, passed by value.
#[derive(Clone, Copy)]
#[repr(C)]
struct KvpRows {
    rc: u32,
    heads: u32,
    block_size: u32,
    head_base: u32,
    order: u32,
}

impl RegionArgs {
    fn rows(&self) -> KvpRows {
        KvpRows {
            rc: self.row_bytes / 16,
            heads: self.heads,
            block_size: self.block_size,
            head_base: self.head_base,
            order: self.layout,
        }
    }
}

/// One failing slice as the verify kernel reports it (16 bytes, `struct kvp_fail`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(C)]
pub struct KernelFail {
    /// Global slice index.
    pub slice: u32,
    /// Bytes that differ.
    pub bad_bytes: u32,
    /// Offset of the first differing byte.
    pub first_bad: u32,
    /// Unused.
    pub pad: u32,
}

/// The fill, poison, verify, poison-check and row-permutation kernels, compiled by NVRTC for
/// one device.
#[derive(Debug)]
pub struct Kernels {
    dev: Arc<Device>,
    module: sys::CUmodule,
    fill: sys::CUfunction,
    poison: sys::CUfunction,
    verify: sys::CUfunction,
    check_poison: sys::CUfunction,
    permute_rows: sys::CUfunction,
}

// SAFETY: module and function handles are context-bound, not thread-bound; every launch
// binds the context first.
unsafe impl Send for Kernels {}
// SAFETY: as above.
unsafe impl Sync for Kernels {}

/// Threads per block: `KVP_THREADS` in csrc/kernels.cu (its loops assume exactly this many).
const THREADS: u32 = 256;

/// Binds each `name = value` to a local and builds `$params`, the array of pointers to
/// them that cuLaunchKernel takes (values must have the kernel parameters' exact types).
macro_rules! kernel_params {
    ($params:ident; $($name:ident = $v:expr),+ $(,)?) => {
        $(let mut $name = $v;)+
        let mut $params = [$(&mut $name as *mut _ as *mut c_void),+];
    };
}

/// Chunks of 16 bytes per work item of the kernels (`KVP_PART_CHUNKS` in csrc/kernels.cu):
/// each thread block handles 32 KiB of one slice at a time.
pub const PART_CHUNKS: u64 = 2048;

/// Bytes of one work item (a slice part): [`PART_CHUNKS`] × 16.
pub const PART_BYTES: u64 = PART_CHUNKS * 16;

/// Slots of the verify kernel's compared-work counters (`KVP_CMP_SLOTS` in csrc/kernels.cu):
/// the kernel adds to this many {slices, bytes} u64 pairs (16 bytes each), which the host sums.
pub const CMP_SLOTS: usize = 256;

/// Bytes of the verify kernel's counter buffer: the failure count (a u32 at offset 0,
/// padded to 16 bytes), then [`CMP_SLOTS`] little-endian {slices, bytes} u64 pairs.
pub const VERIFY_COUNTERS_BYTES: usize = 16 + CMP_SLOTS * 16;

/// Work items (slice parts) of one slice of `slice_bytes`.
pub fn parts_per_slice(slice_bytes: u64) -> u64 {
    (slice_bytes / 16).div_ceil(PART_CHUNKS).max(1)
}

fn grid(r: &RegionArgs) -> u32 {
    (r.num_layers as u64 * r.num_slices as u64 * parts_per_slice(r.slice_bytes as u64)).clamp(1, 1 << 20) as u32
}

/// Where the PTX NVRTC made for `arch` is kept between runs:
/// `$KVPROBE_HOME/kernels/<sha256 of source, arch, NVRTC version>.ptx`, so a warm start skips
/// NVRTC (the driver's own JIT cache then skips ptxas).
fn ptx_cache_path(arch: &str) -> PathBuf {
    let nvrtc = nvrtc_version().unwrap_or_default();
    let key =
        crate::core::fingerprint::digest(format!("{}\0{arch}\0{nvrtc}", crate::core::fingerprint::KERNEL_SOURCE).as_bytes());
    crate::sys::tempdir::kvprobe_home().join("kernels").join(format!("{}-{arch}.ptx", &key[..32]))
}

fn cached_ptx(arch: &str) -> Option<String> {
    std::fs::read_to_string(ptx_cache_path(arch)).ok().filter(|p| p.contains(".entry kvp_verify"))
}

/// Best effort: a cache that cannot be written costs the next run a compile, nothing else.
fn store_ptx(arch: &str, ptx: &str) {
    let path = ptx_cache_path(arch);
    let Some(dir) = path.parent() else { return };
    if std::fs::create_dir_all(dir).is_err() {
        return;
    }
    if let Ok(mut tmp) = tempfile::NamedTempFile::new_in(dir) {
        use std::io::Write;
        if tmp.write_all(ptx.as_bytes()).is_ok() {
            let _ = tmp.persist(&path);
        }
    }
}

impl Kernels {
    /// Compiles [`crate::core::fingerprint::KERNEL_SOURCE`] with NVRTC for `dev`'s architecture
    /// and loads it. Errors: NVRTC missing, compile or load failure.
    pub fn compile(dev: &Arc<Device>) -> Result<Kernels> {
        if !nvrtc_present() {
            return Err(Error::Environment(
                "NVRTC (libnvrtc.so) not found: install the CUDA toolkit or add its lib64 to LD_LIBRARY_PATH".into(),
            ));
        }
        let info = gpu_info(dev.ordinal())?;
        let (ma, mi) = info.compute_capability;
        let arch = format!("compute_{ma}{mi}");
        let ptx = match cached_ptx(&arch) {
            Some(p) => p,
            None => {
                let opts = cudarc::nvrtc::CompileOptions {
                    options: vec![format!("--gpu-architecture={arch}"), "-default-device".into()],
                    name: Some("kvprobe_kernels.cu".into()),
                    ..Default::default()
                };
                let ptx = cudarc::nvrtc::compile_ptx_with_opts(crate::core::fingerprint::KERNEL_SOURCE, opts)
                    .map_err(|e| Error::Device(format!("NVRTC compile failed: {e:?}")))?
                    .to_src();
                store_ptx(&arch, &ptx);
                ptx
            }
        };
        let image = CString::new(ptx).map_err(|e| derr("PTX", e))?;
        dev.bind()?;
        // SAFETY: `image` is a NUL-terminated PTX string produced by NVRTC.
        let module =
            unsafe { result::module::load_data(image.as_ptr() as *const c_void) }.map_err(|e| derr("cuModuleLoadData", e))?;
        let get = |n: &str| {
            // SAFETY: `module` was just loaded and is unloaded only in Drop.
            unsafe { result::module::get_function(module, CString::new(n).unwrap()) }
                .map_err(|e| derr(&format!("cuModuleGetFunction({n})"), e))
        };
        Ok(Kernels {
            dev: dev.clone(),
            module,
            fill: get("kvp_fill")?,
            poison: get("kvp_poison")?,
            verify: get("kvp_verify")?,
            check_poison: get("kvp_check_poison")?,
            permute_rows: get("kvp_permute_rows")?,
        })
    }

    fn launch(&self, f: sys::CUfunction, r: &RegionArgs, params: &mut [*mut c_void]) -> Result<()> {
        self.dev.bind()?;
        // SAFETY: `f` belongs to this loaded module; `params` points at locals of the caller
        // that match the kernel's signature in csrc/kernels.cu and outlive this call
        // (cuLaunchKernel copies the values before returning).
        unsafe { result::launch_kernel(f, (grid(r), 1, 1), (THREADS, 1, 1), 0, std::ptr::null_mut(), params) }
            .map_err(|e| derr("cuLaunchKernel", e))
    }

    /// Fills every slice of the layers of `r` with the fingerprint of `table[block]` (asynchronous).
    /// `table` holds `num_blocks` `{logical block, generation, token_base, 0}` u32 quadruples.
    pub fn fill(&self, r: RegionArgs, seed32: u32, table: &DeviceBuffer) -> Result<()> {
        kernel_params!(
            params;
            b = r.bases, l0 = r.layer0, nl = r.num_layers, sb = r.slice_bytes, lo = r.layout, nb = r.num_blocks,
            s = seed32, t = table.ptr(), n = r.num_slices, rows = r.rows()
        );
        self.launch(self.fill, &r, &mut params)
    }

    /// Writes the poison of (slot, iteration) into every slice of the layers of `r`, or only into
    /// the slices of blocks whose `table` entry is not SKIP_GEN (asynchronous).
    pub fn poison(&self, r: RegionArgs, iteration: u32, table: Option<&DeviceBuffer>) -> Result<()> {
        kernel_params!(
            params;
            b = r.bases, l0 = r.layer0, nl = r.num_layers, sb = r.slice_bytes, lo = r.layout, nb = r.num_blocks,
            n = r.num_slices, it = iteration, t = table.map_or(0u64, |t| t.ptr())
        );
        self.launch(self.poison, &r, &mut params)
    }

    /// Verifies every slice of the layers of `r` against `table`; each failing part of a slice
    /// ([`PART_CHUNKS`] chunks) appends one 16-byte record {slice, bad bytes, first bad
    /// byte, 0} to `fails` and counts it in the u32 at offset 0 of `counters`
    /// ([`VERIFY_COUNTERS_BYTES`], zeroed by the caller); the caller merges a slice's parts.
    /// Records past `fails.len() / 16` are not written but still counted, so a count above
    /// that capacity reveals an overflow. The kernel also adds the slices and bytes it
    /// compared to the [`CMP_SLOTS`] pairs at offset 16 of `counters` (sum them). The bytes a
    /// failing part was judged on (the kernel's own loads) go to `capture`: record i's part
    /// at byte `i * PART_BYTES`, for the records below `capture.len() / PART_BYTES`; past it
    /// nothing is captured. Errors: a counter buffer too short (device). Asynchronous.
    pub fn verify(
        &self,
        r: RegionArgs,
        seed32: u32,
        table: &DeviceBuffer,
        fails: &DeviceBuffer,
        counters: &DeviceBuffer,
        capture: &DeviceBuffer,
    ) -> Result<()> {
        if counters.len() < VERIFY_COUNTERS_BYTES {
            return Err(Error::Device(format!(
                "a {}-byte verify counter buffer (needs {VERIFY_COUNTERS_BYTES})",
                counters.len()
            )));
        }
        kernel_params!(
            params;
            b = r.bases, l0 = r.layer0, nl = r.num_layers, sb = r.slice_bytes, lo = r.layout, nb = r.num_blocks,
            s = seed32, t = table.ptr(), n = r.num_slices, f = fails.ptr(), c = counters.ptr(),
            cap = u32::try_from(fails.len() / 16).unwrap_or(u32::MAX), cmp = counters.ptr() + 16, rows = r.rows(),
            cb = capture.ptr(), cn = u32::try_from(capture.len() as u64 / PART_BYTES).unwrap_or(u32::MAX)
        );
        self.launch(self.verify, &r, &mut params)
    }
}

/// Bytes of the poison-check kernel's counter buffer: the failure count (a u32 at offset 0),
/// then at offset 8 the slices it checked (a little-endian u64).
pub const CHECK_COUNTERS_BYTES: usize = 16;

impl Kernels {
    /// Checks that every slice of the layers of `r` still holds the poison of (slot, `iteration`)
    /// (csrc/kernels.cu `kvp_check_poison`): each failing part of a slice appends one 16-byte
    /// record {slice, bad bytes, first bad byte, 0} to `fails`, as [`Kernels::verify`] does,
    /// counted in the u32 at offset 0 of `counters` ([`CHECK_COUNTERS_BYTES`], zeroed by the
    /// caller); the slices checked are added to the u64 at offset 8. Errors: a counter buffer
    /// too short (device). Asynchronous.
    pub fn check_poison(&self, r: RegionArgs, iteration: u32, fails: &DeviceBuffer, counters: &DeviceBuffer) -> Result<()> {
        if counters.len() < CHECK_COUNTERS_BYTES {
            return Err(Error::Device(format!(
                "a {}-byte poison-check counter buffer (needs {CHECK_COUNTERS_BYTES})",
                counters.len()
            )));
        }
        kernel_params!(
            params;
            b = r.bases, l0 = r.layer0, nl = r.num_layers, sb = r.slice_bytes, n = r.num_slices, it = iteration,
            f = fails.ptr(), c = counters.ptr(), cap = u32::try_from(fails.len() / 16).unwrap_or(u32::MAX),
            chk = counters.ptr() + 8
        );
        self.launch(self.check_poison, &r, &mut params)
    }
}

impl Kernels {
    /// Writes into `dst` the `num_slices` slices of `slice_bytes` that start at device address
    /// `src`, each slice's head rows of `row_bytes` rearranged by `perm` (a u32 per row: row
    /// `r` of a slice comes from row `perm[r]`; csrc/kernels.cu `kvp_permute_rows`). `src`
    /// and `dst` must not overlap; `perm` holds `slice_bytes / row_bytes` entries, each below
    /// that. Errors: sizes that are not whole 16-byte chunks and rows, a `dst` too short
    /// (device). Asynchronous, on the default stream.
    pub fn permute_rows(
        &self,
        src: u64,
        dst: &DeviceBuffer,
        num_slices: u32,
        slice_bytes: u32,
        row_bytes: u32,
        perm: &DeviceBuffer,
    ) -> Result<()> {
        let rows = slice_bytes.checked_div(row_bytes).unwrap_or(0);
        if row_bytes == 0
            || !row_bytes.is_multiple_of(16)
            || !slice_bytes.is_multiple_of(row_bytes)
            || perm.len() < rows as usize * 4
            || (dst.len() as u64) < num_slices as u64 * slice_bytes as u64
        {
            return Err(Error::Device(format!(
                "row permutation of {num_slices} slices of {slice_bytes} bytes in rows of {row_bytes} (permutation of {} bytes, destination of {} bytes)",
                perm.len(),
                dst.len()
            )));
        }
        let n = num_slices as u64 * (slice_bytes / 16) as u64;
        kernel_params!(
            params;
            s = src, d = dst.ptr(), ns = num_slices, sc = slice_bytes / 16, rc = row_bytes / 16, p = perm.ptr()
        );
        self.dev.bind()?;
        let blocks = n.div_ceil(THREADS as u64).clamp(1, 1 << 20) as u32;
        // SAFETY: `permute_rows` belongs to this loaded module; `params` points at locals that
        // match kvp_permute_rows's signature and outlive this call; the kernel reads
        // `num_slices × slice_bytes` bytes from `src` (the caller's live region) and writes as
        // many into `dst`, checked above to hold them, and reads `rows` entries of `perm`.
        unsafe { result::launch_kernel(self.permute_rows, (blocks, 1, 1), (THREADS, 1, 1), 0, std::ptr::null_mut(), &mut params) }
            .map_err(|e| derr("cuLaunchKernel(kvp_permute_rows)", e))
    }
}

impl Drop for Kernels {
    fn drop(&mut self) {
        if self.dev.bind().is_ok() {
            // SAFETY: the module was loaded in `compile` and is unloaded once.
            let _ = unsafe { result::module::unload(self.module) };
        }
    }
}

/// A host buffer page-locked for the GPU (`cuMemHostRegister`), so copies between it and
/// device memory run as DMA at full PCIe/C2C rate. Unregistered before the buffer is freed.
/// A [`crate::sys::hostmem::HostBuffer`] (no Rust references into it): the tier arena it holds is
/// also registered with NIXL and read by remote READs.
pub struct PinnedHost {
    dev: Arc<Device>,
    buf: crate::sys::hostmem::HostBuffer,
}

impl PinnedHost {
    /// Page-locks `buf` for `dev`'s context. Errors: the driver refuses (e.g. the
    /// memlock limit).
    pub fn new(dev: &Arc<Device>, buf: crate::sys::hostmem::HostBuffer) -> Result<PinnedHost> {
        dev.bind()?;
        // SAFETY: `buf` is a live mapping of `buf.len()` bytes that this struct owns and
        // keeps until Drop unregisters it.
        unsafe { sys::cuMemHostRegister_v2(buf.addr() as *mut c_void, buf.len().max(1), 0) }
            .result()
            .map_err(|e| derr(&format!("cuMemHostRegister({} bytes)", buf.len()), e))?;
        Ok(PinnedHost { dev: dev.clone(), buf })
    }

    /// The buffer.
    pub fn buffer(&self) -> &crate::sys::hostmem::HostBuffer {
        &self.buf
    }

    /// The buffer, mutably.
    pub fn buffer_mut(&mut self) -> &mut crate::sys::hostmem::HostBuffer {
        &mut self.buf
    }
}

impl Drop for PinnedHost {
    fn drop(&mut self) {
        if self.dev.bind().is_ok() {
            // SAFETY: registered in `new`; the mapping is still alive (dropped after this).
            let _ = unsafe { sys::cuMemHostUnregister(self.buf.addr() as *mut c_void) };
        }
    }
}
