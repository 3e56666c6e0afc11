//! A KV block pool on one side (prefill or decode): one region per layer (VRAM: one
//! cuMemAlloc each; DRAM: consecutive ranges of one mapping), in VRAM or DRAM,
//! with the fill, poison and verify passes of the probe.
//!
//! VRAM pools run the CUDA kernels (csrc/kernels.cu) and bring only failing slices to the
//! host; DRAM pools run the CPU reference on all threads. Both honour the same
//! per-block table of `{logical block, generation, token_base}` ([`TableEntry`]) and the
//! pool's [`RowShape`] (how its slices are cut into head rows).

use crate::core::fingerprint::{self, BlockIdentity, RowShape, SKIP_GEN};
use crate::core::geometry::{Geometry, SliceCoord};
use crate::error::{Error, Result};
use crate::gpu::cuda::{Device, DeviceBuffer, GpuTimer, Kernels, PendingTime, RegionArgs};
use crate::sys::hostmem::{HostBuffer, Span, SpanMut};
use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

/// Device seconds of the probe's kernels (CUDA events around the launches).
#[derive(Clone, Copy, Debug, Default, serde::Serialize, serde::Deserialize)]
pub struct KernelSeconds {
    /// Fill kernels (prefill pool).
    pub fill: f64,
    /// Poison kernels (decode pool).
    pub poison: f64,
    /// Verify kernels (decode pool).
    pub verify: f64,
}

/// Smallest pool (bytes per side) whose copy a sweep times as the transfer's ceiling
/// (`summary.transport_path.copy_gbps`): below it the copy takes about as long as its fixed
/// costs (thread start, kernel launch), so the rate would be noise, not a ceiling.
pub const MIN_CEILING_BYTES: u64 = 64 << 20;

/// Where a pool lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum MemoryKind {
    /// GPU memory (cuMemAlloc), registered with NIXL as VRAM.
    Vram,
    /// Host memory (mmap), registered with NIXL as DRAM.
    Dram,
}

impl MemoryKind {
    /// The pools' memory when `--memory` is not given: VRAM when CUDA sees a GPU here
    /// ([`crate::gpu::cuda::device_count`]), else DRAM.
    pub fn default_here() -> MemoryKind {
        if crate::gpu::cuda::device_count() > 0 { MemoryKind::Vram } else { MemoryKind::Dram }
    }
}

/// What a physical block slot holds (or must hold): the same for all its layers and K/V.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct TableEntry {
    /// Logical block id.
    pub block: u32,
    /// Generation; [`SKIP_GEN`] leaves the slot alone.
    pub generation: u32,
    /// Token of the logical block at the slot's first token position (0 unless the slot
    /// holds part of a larger logical block: [`BlockIdentity::token_base`]).
    #[serde(default)]
    pub token_base: u32,
}

impl TableEntry {
    /// A slot holding the whole logical block `block` of `generation`.
    pub fn new(block: u32, generation: u32) -> TableEntry {
        TableEntry { block, generation, token_base: 0 }
    }

    /// The identity of this slot's slice at `c`.
    pub fn identity(&self, c: SliceCoord) -> BlockIdentity {
        BlockIdentity { layer: c.layer, kv: c.kv, block: self.block, generation: self.generation, token_base: self.token_base }
    }
}

/// A slice whose bytes differ from what the table says (before classification).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RawFailure {
    /// Global slice index.
    pub slice: u32,
    /// Bytes that differ.
    pub bad_bytes: u64,
    /// Offset of the first differing byte.
    pub first_bad: u64,
}

impl RawFailure {
    /// The failure record of slice `slice` recounted from bytes at hand: `actual` against
    /// `want` (same length) — for a slice whose judged bytes were not kept and was read again
    /// ([`KvPool::judged_slice`]), so the record describes the bytes classified and dumped.
    pub fn recount(slice: u32, actual: &[u8], want: &[u8]) -> RawFailure {
        let bad_bytes = actual.iter().zip(want).filter(|(a, b)| a != b).count() as u64;
        let first_bad = actual.iter().zip(want).position(|(a, b)| a != b).unwrap_or(actual.len()) as u64;
        RawFailure { slice, bad_bytes, first_bad }
    }
}

/// Decodes and checks the verify kernel's failure list (csrc/kernels.cu `kvp_fail`: four
/// little-endian u32 — slice, bad bytes, first bad byte, pad — per failing slice part): `raw`
/// holds the first `min(n, capacity)` records of the `n` the kernel counted. Returns the
/// failing slices of `geom`, a slice's parts merged (bytes summed, first offset kept), sorted
/// by global index. Errors (device, exit 3): `n` above the list's capacity (`raw` is short:
/// failures were lost), or a record that cannot come from a correct kernel (slice id not
/// below the pool's slice count, no bad bytes, more bad bytes than a slice holds, first bad
/// byte outside the slice) — never a panic on what the device returned.
pub fn decode_device_failures(raw: &[u8], n: u32, geom: &Geometry) -> Result<Vec<RawFailure>> {
    let slices = geom.total_slices()?;
    let sb = geom.slice_bytes()?;
    if raw.len() != n as usize * 16 {
        return Err(Error::Device(format!(
            "the verify kernel counted {n} failing slice parts but its list holds {}: failures were lost \
             (a stale counter or a kernel fault)",
            raw.len() / 16
        )));
    }
    let mut parts = Vec::with_capacity(n as usize);
    for c in raw.chunks_exact(16) {
        let w = |i: usize| u32::from_le_bytes([c[4 * i], c[4 * i + 1], c[4 * i + 2], c[4 * i + 3]]);
        let f = RawFailure { slice: w(0), bad_bytes: w(1) as u64, first_bad: w(2) as u64 };
        if f.slice as u64 >= slices || f.bad_bytes == 0 || f.bad_bytes > sb || f.first_bad >= sb {
            return Err(Error::Device(format!(
                "the verify kernel returned an impossible failure record (slice {} of {slices}, {} bad bytes, first at \
                 {} of a {sb}-byte slice)",
                f.slice, f.bad_bytes, f.first_bad
            )));
        }
        parts.push(f);
    }
    parts.sort_by_key(|f| (f.slice, f.first_bad));
    let mut merged: Vec<RawFailure> = Vec::with_capacity(parts.len());
    for f in parts {
        match merged.last_mut() {
            Some(m) if m.slice == f.slice => m.bad_bytes += f.bad_bytes,
            _ => merged.push(f),
        }
    }
    Ok(merged)
}

/// The poison-check kernel's failure list (as long as the verify kernel's) and counters
/// ([`crate::gpu::cuda::CHECK_COUNTERS_BYTES`]).
struct CheckBuffers {
    fails: DeviceBuffer,
    counters: DeviceBuffer,
}

enum Backing {
    /// One mapping for the whole pool (one per layer would hit vm.max_map_count on deep
    /// geometries); layer l's region starts at l * region_bytes.
    Host(HostBuffer),
    Device {
        kernels: Arc<Kernels>,
        regions: Vec<DeviceBuffer>,
        /// The regions' base addresses (a u64 per layer): the kernels run over several layers
        /// in one launch.
        bases: DeviceBuffer,
        table: DeviceBuffer,
        fails: DeviceBuffer,
        /// The verify kernel's failure count and compared-work counters
        /// ([`crate::gpu::cuda::VERIFY_COUNTERS_BYTES`]).
        counters: DeviceBuffer,
        /// The poison-check kernel's buffers (boxed: a pool's backing stays small).
        check: Box<CheckBuffers>,
        /// The verify kernel's capture of failing parts' judged bytes ([`CAPTURE_MAX_BYTES`]
        /// at most: one [`crate::gpu::cuda::PART_BYTES`] slot per failure record; boxed as `check`).
        capture: Box<DeviceBuffer>,
    },
}

/// What verify passes actually compared against the fingerprint, counted by the pass as
/// it compares (the verify kernel on VRAM, the CPU pass on DRAM), not derived from the
/// geometry: slices whose table entry is [`SKIP_GEN`] are not compared and not counted.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Compared {
    /// Block slices compared.
    pub slices: u64,
    /// Bytes compared.
    pub bytes: u64,
}

/// One side's KV pool.
pub struct KvPool {
    geom: Geometry,
    /// How the pool's slices are cut into head rows (the fingerprint's unit).
    shape: RowShape,
    seed: u64,
    backing: Backing,
    /// VRAM pools: device seconds of the kernels waited for by the last [`KvPool::finish`].
    last_kernel_secs: Option<f64>,
    /// The per-block table of the next passes ([`KvPool::load_table`]).
    table: Vec<TableEntry>,
    /// VRAM: timers of the passes queued since the last [`KvPool::finish`].
    timers: Vec<(Pass, PendingTime)>,
    /// DRAM: failures found since the last [`KvPool::take_failures`].
    host_fails: Vec<RawFailure>,
    /// Kernel seconds waited for since the last [`KvPool::take_kernel_seconds`].
    kernel_acc: KernelSeconds,
    /// Work compared by the verify passes whose failures were taken, since the last
    /// [`KvPool::take_compared`].
    compared_acc: Compared,
    /// DRAM: work compared since the last [`KvPool::take_failures`].
    host_compared: Compared,
    /// Poison checks ([`KvPool::check_poison_layers`]): DRAM failures and slices checked
    /// since the last [`KvPool::take_poison_failures`].
    check: CheckState,
    /// The bytes the verify passes judged of failing slices ([`KvPool::judged_slice`]).
    judged: Judged,
}

/// At most this many bytes of failing slices' judged bytes are kept per
/// [`KvPool::take_failures`] (DRAM: the verify pass's snapshots); past it a failing slice's
/// bytes are read again when asked for ([`KvPool::judged_slice`] says so), so a pass where
/// every slice fails does not double the pool's memory.
pub const JUDGED_MAX_BYTES: u64 = 256 << 20;

/// Bytes of a VRAM pool's capture buffer, at most: the verify kernel copies the bytes each
/// failing slice part (32 KiB) was judged on into it, for the first 512 failing parts of a
/// pass; a slice with a part past them is read again when classified
/// ([`KvPool::judged_slice`]).
pub const CAPTURE_MAX_BYTES: u64 = 16 << 20;

/// The judged bytes of the failing slices the verify kernel captured in full: `raw` is its
/// failure list (checked by [`decode_device_failures`]), `capture` its capture buffer. A
/// slice's bytes are its expected fingerprint (what the kernel judged every part without a
/// record equal to) with each failing part's captured bytes over it; a slice with a part
/// past the capture is left out.
fn captured_slices(
    raw: &[u8],
    capture: &DeviceBuffer,
    geom: &Geometry,
    shape: &RowShape,
    seed: u64,
    table: &[TableEntry],
) -> Result<std::collections::HashMap<u32, Vec<u8>>> {
    let mut out = std::collections::HashMap::new();
    let (sb, pb) = (geom.slice_bytes()? as usize, crate::gpu::cuda::PART_BYTES as usize);
    let used = (raw.len() / 16).min(capture.len() / pb);
    if used == 0 {
        return Ok(out);
    }
    let mut bytes = vec![0u8; used * pb];
    capture.read(0, &mut bytes)?;
    // slice -> (its records, its captured parts (offset in the slice, record index))
    let mut parts: std::collections::HashMap<u32, (usize, Vec<(usize, usize)>)> = std::collections::HashMap::new();
    for (i, c) in raw.chunks_exact(16).enumerate() {
        let w = |k: usize| u32::from_le_bytes([c[4 * k], c[4 * k + 1], c[4 * k + 2], c[4 * k + 3]]);
        let e = parts.entry(w(0)).or_default();
        e.0 += 1;
        if i < used {
            e.1.push((w(2) as usize / pb * pb, i));
        }
    }
    for (slice, (records, got)) in parts {
        let c = geom.coord_of(slice);
        let Some(entry) = table.get(c.block as usize) else { continue };
        if got.len() != records || entry.generation == SKIP_GEN {
            continue;
        }
        let mut b = fingerprint::expected(seed, &shape.slice(entry.identity(c)));
        for (off, i) in got {
            let len = pb.min(sb.saturating_sub(off));
            b[off..off + len].copy_from_slice(&bytes[i * pb..i * pb + len]);
        }
        out.insert(slice, b);
    }
    Ok(out)
}

/// Failing slices' bytes as the verify pass judged them: `pending` since the last
/// [`KvPool::take_failures`], `taken` those of the failures it returned last.
#[derive(Default)]
struct Judged {
    pending: Vec<(u32, Vec<u8>)>,
    pending_bytes: u64,
    taken: std::collections::HashMap<u32, Vec<u8>>,
}

/// Test-only fault hook: `KVPROBE_TEST_VERIFY_SKIP=N` makes every verify pass of a DRAM pool
/// skip global slice `N` (neither compared nor counted), so a test can show that the run
/// refuses a verdict whose compared counts fall short of its plan (exit 3).
pub const VERIFY_SKIP_VAR: &str = crate::sys::test_hooks::VERIFY_SKIP;

fn verify_skip() -> Option<u32> {
    static V: std::sync::OnceLock<Option<u32>> = std::sync::OnceLock::new();
    *V.get_or_init(|| std::env::var(VERIFY_SKIP_VAR).ok().and_then(|v| v.parse().ok()))
}

/// Verifies one DRAM slice from a copy taken first (`snap`, resized to the slice): the
/// bytes compared are exactly the copy's, so a failing slice's judged bytes are known even
/// when the slice changes afterwards. Returns (bad bytes, first bad offset).
fn check_snapshot(s: crate::sys::hostmem::Span<'_>, snap: &mut Vec<u8>, seed: u64, rows: &fingerprint::SliceRows) -> (u64, u64) {
    snap.resize(s.len(), 0);
    if s.read_at(0, snap).is_err() {
        // Cannot happen (the copy is the span's length); judged as entirely bad rather than
        // passed.
        return (s.len() as u64, 0);
    }
    fingerprint::check(snap, seed, rows)
}

/// DRAM poison checks' findings until [`KvPool::take_poison_failures`] (kept apart from the
/// verify passes' failures and [`Compared`] counts).
#[derive(Default)]
struct CheckState {
    fails: Vec<RawFailure>,
    slices: u64,
}

/// Kinds of pass, for the kernel seconds [`KvPool::finish`] returns.
#[derive(Clone, Copy, Debug)]
enum Pass {
    Fill,
    Poison,
    Verify,
    /// Poison checks: waited for, not counted in [`KernelSeconds`].
    Check,
}

/// Bytes of the scratch buffer [`KvPool::permute_rows`] rearranges VRAM slices into, at
/// most (whole slices; at least one).
pub const PERMUTE_SPAN_BYTES: u64 = 64 << 20;

/// The device table: per block `{logical block, generation, token_base, 0}` as little-endian
/// u32 (a `uint4` in csrc/kernels.cu).
fn table_bytes(table: &[TableEntry]) -> Vec<u8> {
    table.iter().flat_map(|e| [e.block, e.generation, e.token_base, 0].into_iter().flat_map(u32::to_le_bytes)).collect()
}

fn threads() -> usize {
    std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1)
}

impl KvPool {
    /// Maps a DRAM pool. Errors: the geometry is invalid, or larger than the host memory this
    /// process may allocate (checked before mapping).
    pub fn host(geom: &Geometry, seed: u64) -> Result<KvPool> {
        let pool = Self::host_bytes(geom)?;
        Ok(KvPool {
            geom: geom.clone(),
            shape: RowShape::of(geom),
            seed,
            backing: Backing::Host(HostBuffer::alloc(pool)?),
            last_kernel_secs: None,
            table: Vec::new(),
            timers: Vec::new(),
            host_fails: Vec::new(),
            kernel_acc: KernelSeconds::default(),
            compared_acc: Compared::default(),
            host_compared: Compared::default(),
            check: CheckState::default(),
            judged: Judged::default(),
        })
    }

    /// The bytes of a DRAM pool of `geom`, checked against the host memory available.
    fn host_bytes(geom: &Geometry) -> Result<usize> {
        geom.validate()?;
        let pool = geom.pool_bytes()?;
        if let Some(avail) = crate::sys::hostmem::available_bytes()
            && pool > avail
        {
            return Err(Error::Usage(format!(
                "a DRAM pool of {} exceeds the {} of available host memory",
                crate::sys::units::bytes_exact(pool),
                crate::sys::units::bytes_exact(avail)
            )));
        }
        Ok(pool as usize)
    }

    /// Maps a DRAM pool that a helper process can map too (memfd-backed, see
    /// [`HostBuffer::alloc_shareable`]): for the Mooncake worker. Errors as [`KvPool::host`].
    pub fn host_shareable(geom: &Geometry, seed: u64) -> Result<KvPool> {
        let pool = Self::host_bytes(geom)?;
        Ok(KvPool {
            geom: geom.clone(),
            shape: RowShape::of(geom),
            seed,
            backing: Backing::Host(HostBuffer::alloc_shareable(pool)?),
            last_kernel_secs: None,
            table: Vec::new(),
            timers: Vec::new(),
            host_fails: Vec::new(),
            kernel_acc: KernelSeconds::default(),
            compared_acc: Compared::default(),
            host_compared: Compared::default(),
            check: CheckState::default(),
            judged: Judged::default(),
        })
    }

    /// A second pool of this one's geometry, seed and memory (VRAM: on the same GPU, with the
    /// same kernels; DRAM: shareable with a helper process, as [`KvPool::host_shareable`]),
    /// for an engine that computes into one pool and stages into another (`--host-staging`).
    /// Errors: as [`KvPool::host`] and [`KvPool::device`].
    pub fn sibling(&self) -> Result<KvPool> {
        match &self.backing {
            Backing::Host(_) => KvPool::host_shareable(&self.geom, self.seed),
            Backing::Device { kernels, regions, .. } => {
                KvPool::device(regions[0].device(), kernels.clone(), &self.geom, self.seed)
            }
        }
    }

    /// The host mapping of a DRAM pool (None for VRAM).
    pub fn host_buffer(&self) -> Option<&HostBuffer> {
        match &self.backing {
            Backing::Host(b) => Some(b),
            Backing::Device { .. } => None,
        }
    }

    /// Byte ranges `(offset, length)` of block `slot`'s slices within the pool mapping, in
    /// (layer, K/V) order (DRAM pools: slices are in global-index order).
    pub fn block_ranges(&self, slot: u32) -> Vec<(u64, u64)> {
        let sb = self.geom.slice_bytes().unwrap_or(0);
        self.block_slices(slot).map(|c| (self.geom.global_slice(c) as u64 * sb, sb)).collect()
    }

    /// Allocates a VRAM pool on `dev` (one cuMemAlloc per layer). Errors: invalid geometry,
    /// or the pool (plus bookkeeping) exceeds the device's free memory — checked before
    /// allocating.
    pub fn device(dev: &Arc<Device>, kernels: Arc<Kernels>, geom: &Geometry, seed: u64) -> Result<KvPool> {
        geom.validate()?;
        let region = geom.region_bytes()?;
        let pool = geom.pool_bytes()?;
        let slices = geom.total_slices()?;
        // One 16-byte failure record per slice part (csrc/kernels.cu): one verify pass over
        // every layer cannot overflow the list; more passes before take_failures can, and that
        // is an error there (decode_device_failures), never a write past the list.
        let fails_len = slices
            .checked_mul(crate::gpu::cuda::parts_per_slice(geom.slice_bytes()?))
            .and_then(|n| n.checked_mul(16))
            .ok_or(Error::Usage("slice count overflows".into()))?;
        // Two lists: the verify kernel's and the poison check's.
        let need = pool + 2 * fails_len + 16 * geom.num_blocks as u64 + (64 << 20);
        let (free, _) = dev.mem_info()?;
        if need > free {
            return Err(Error::Usage(format!(
                "a VRAM pool of {} (+ bookkeeping) exceeds the {} free on GPU {}",
                crate::sys::units::bytes_exact(pool),
                crate::sys::units::bytes_exact(free),
                dev.ordinal()
            )));
        }
        let regions = (0..geom.num_layers).map(|_| DeviceBuffer::alloc(dev, region as usize)).collect::<Result<Vec<_>>>()?;
        Self::with_regions(dev, kernels, geom, seed, regions)
    }

    fn with_regions(
        dev: &Arc<Device>,
        kernels: Arc<Kernels>,
        geom: &Geometry,
        seed: u64,
        regions: Vec<DeviceBuffer>,
    ) -> Result<KvPool> {
        let fails_len = geom.total_slices()? * crate::gpu::cuda::parts_per_slice(geom.slice_bytes()?) * 16;
        let table = DeviceBuffer::alloc(dev, 16 * geom.num_blocks as usize)?;
        let bases = DeviceBuffer::alloc(dev, 8 * regions.len())?;
        bases.write(0, &regions.iter().flat_map(|r| r.ptr().to_le_bytes()).collect::<Vec<u8>>())?;
        let fails = DeviceBuffer::alloc(dev, fails_len as usize)?;
        let counters = DeviceBuffer::alloc(dev, crate::gpu::cuda::VERIFY_COUNTERS_BYTES)?;
        // cuMemAlloc may hand back a freed buffer's bytes (seen on an H200): a stale count
        // would report phantom failures. The list is zeroed too, so nothing stale is ever read.
        counters.zero()?;
        fails.zero()?;
        let parts = geom.total_slices()? * crate::gpu::cuda::parts_per_slice(geom.slice_bytes()?);
        let capture = DeviceBuffer::alloc(
            dev,
            (parts.min(CAPTURE_MAX_BYTES / crate::gpu::cuda::PART_BYTES) * crate::gpu::cuda::PART_BYTES) as usize,
        )?;
        let check_fails = DeviceBuffer::alloc(dev, fails_len as usize)?;
        let check_counters = DeviceBuffer::alloc(dev, crate::gpu::cuda::CHECK_COUNTERS_BYTES)?;
        check_counters.zero()?;
        check_fails.zero()?;
        Ok(KvPool {
            geom: geom.clone(),
            shape: RowShape::of(geom),
            seed,
            backing: Backing::Device {
                kernels,
                regions,
                bases,
                table,
                fails,
                counters,
                check: Box::new(CheckBuffers { fails: check_fails, counters: check_counters }),
                capture: Box::new(capture),
            },
            last_kernel_secs: None,
            table: Vec::new(),
            timers: Vec::new(),
            host_fails: Vec::new(),
            kernel_acc: KernelSeconds::default(),
            compared_acc: Compared::default(),
            host_compared: Compared::default(),
            check: CheckState::default(),
            judged: Judged::default(),
        })
    }

    /// How the pool's slices are cut into head rows.
    pub fn shape(&self) -> &RowShape {
        &self.shape
    }

    /// Makes this pool a TP rank's whose first KV head is global head `head_base`
    /// ([`RowShape::head_base`]): its rows carry heads `head_base ..` in fills and verifies.
    pub fn set_head_base(&mut self, head_base: u32) {
        self.shape.head_base = head_base;
    }

    /// The expected rows of the slice at `c` when the slot holds `e` (the fingerprint's input
    /// for this pool: its [`RowShape`] and the entry's identity).
    pub fn rows_of(&self, e: &TableEntry, c: SliceCoord) -> fingerprint::SliceRows {
        self.shape.slice(e.identity(c))
    }

    /// The pool's geometry.
    pub fn geometry(&self) -> &Geometry {
        &self.geom
    }

    /// VRAM or DRAM.
    pub fn memory(&self) -> MemoryKind {
        match self.backing {
            Backing::Host(_) => MemoryKind::Dram,
            Backing::Device { .. } => MemoryKind::Vram,
        }
    }

    /// NIXL device id: the GPU ordinal for VRAM, 0 for DRAM.
    pub fn device_id(&self) -> u64 {
        match &self.backing {
            Backing::Host(_) => 0,
            Backing::Device { regions, .. } => regions[0].device().ordinal() as u64,
        }
    }

    /// The GPU holding a VRAM pool (None for DRAM).
    pub fn gpu(&self) -> Option<Arc<Device>> {
        match &self.backing {
            Backing::Host(_) => None,
            Backing::Device { regions, .. } => Some(regions[0].device().clone()),
        }
    }

    /// VRAM pools: the GPU ordinal and the CUDA IPC handle of each layer's region (layer
    /// order; each region is `Geometry::region_bytes` long), so another process can map the
    /// pool. `None` for DRAM pools. Errors: the driver refuses a handle.
    pub fn ipc_handles(&self) -> Result<Option<(usize, Vec<[u8; 64]>)>> {
        match &self.backing {
            Backing::Host(_) => Ok(None),
            Backing::Device { regions, .. } => {
                let handles = regions.iter().map(|r| r.ipc_handle()).collect::<Result<Vec<_>>>()?;
                Ok(Some((regions[0].device().ordinal(), handles)))
            }
        }
    }

    /// Makes this pool's GPU context current on the calling thread (no-op for DRAM), so
    /// NIXL/UCX calls made next (which open CUDA IPC handles) see the right device.
    pub fn bind(&self) -> Result<()> {
        match &self.backing {
            Backing::Host(_) => Ok(()),
            Backing::Device { regions, .. } => regions[0].device().bind(),
        }
    }

    /// Base address of each layer's region.
    pub fn region_addrs(&self) -> Vec<u64> {
        match &self.backing {
            Backing::Host(b) => {
                let region = self.geom.region_bytes().unwrap_or(0);
                (0..self.geom.num_layers as u64).map(|l| b.addr() + l * region).collect()
            }
            Backing::Device { regions, .. } => regions.iter().map(|b| b.ptr()).collect(),
        }
    }

    fn check_table(&self, table: &[TableEntry]) -> Result<()> {
        if table.len() != self.geom.num_blocks as usize {
            return Err(Error::Usage(format!("table has {} entries for {} blocks", table.len(), self.geom.num_blocks)));
        }
        Ok(())
    }

    /// Runs `f(coord, slice span)` over the slices of layers `layers` of a DRAM pool: all
    /// of them, or only those of blocks whose `table` entry is not [`SKIP_GEN`]. Work above
    /// 8 MiB is split over all threads (contiguous runs of global slice indices; the pool is
    /// slices in global-index order, layer-major); smaller work runs on the calling thread.
    /// `f` gets one slice's [`SpanMut`] (raw pointer and length, never a reference into the
    /// pool: transfers may be writing other slices meanwhile) and must touch only it; the
    /// caller guarantees no transfer is in flight into the slices `f` is run on (see
    /// [`crate::sys::hostmem`]). Errors (usage): the layers lie outside the mapping.
    fn host_each<F>(geom: &Geometry, buf: &mut HostBuffer, layers: Range<u32>, table: Option<&[TableEntry]>, f: F) -> Result<()>
    where
        F: Fn(SliceCoord, &mut SpanMut<'_>) + Sync,
    {
        let sb = geom.slice_bytes().unwrap_or(0) as usize;
        let per_layer = geom.slices_per_layer() as usize;
        let first = layers.start as usize * per_layer;
        let slices = layers.len() * per_layer;
        let selected: Option<Vec<bool>> = table.map(|t| t.iter().map(|e| e.generation != SKIP_GEN).collect());
        let wanted = match &selected {
            Some(sel) => sel.iter().filter(|x| **x).count() * layers.len() * geom.kv_parts() as usize,
            None => slices,
        };
        let keep = |c: SliceCoord| selected.as_ref().is_none_or(|s| s[c.block as usize]);
        let mut bytes = buf.span_mut(first * sb, slices * sb)?;
        if wanted.saturating_mul(sb) < 8 << 20
            && let Some(sel) = &selected
        {
            // Visit only the selected blocks' slices.
            for (block, _) in sel.iter().enumerate().filter(|(_, x)| **x) {
                for layer in layers.clone() {
                    for &kv in geom.parts() {
                        let c = SliceCoord { layer, kv, block: block as u32 };
                        let at = geom.global_slice(c) as usize * sb - first * sb;
                        f(c, &mut bytes.sub_mut(at, sb)?);
                    }
                }
            }
            return Ok(());
        }
        let per = slices.div_ceil(threads()).max(1);
        crate::sys::parallel::for_each(bytes.into_chunks(per * sb).enumerate(), threads(), |(t, part)| {
            for (i, mut s) in part.into_chunks(sb).enumerate() {
                let c = geom.coord_of((first + t * per + i) as u32);
                if keep(c) {
                    f(c, &mut s);
                }
            }
        });
        Ok(())
    }

    /// Every layer of the pool.
    fn all_layers(&self) -> Range<u32> {
        0..self.geom.num_layers
    }

    fn check_layers(&self, layers: &Range<u32>) -> Result<()> {
        if layers.start > layers.end || layers.end > self.geom.num_layers {
            return Err(Error::Usage(format!("layers {layers:?} outside the pool's {}", self.geom.num_layers)));
        }
        Ok(())
    }

    /// Sets the per-block table (one entry per block) that the next fill, table-restricted
    /// poison and verify passes use. VRAM: uploaded to the device after every pass queued
    /// before it has finished (the upload is ordered on the default stream).
    pub fn load_table(&mut self, table: &[TableEntry]) -> Result<()> {
        self.check_table(table)?;
        self.table.clear();
        self.table.extend_from_slice(table);
        if let Backing::Device { table: t, .. } = &self.backing {
            t.write(0, &table_bytes(table))?;
        }
        Ok(())
    }

    /// Writes the fingerprint of the loaded table's entry into every slice of `layers`
    /// ([`SKIP_GEN`] entries are left alone). DRAM: synchronous; VRAM: queued on the default
    /// stream (see [`KvPool::finish`]).
    pub fn fill_layers(&mut self, layers: Range<u32>) -> Result<()> {
        self.check_layers(&layers)?;
        let seed = self.seed;
        let table = &self.table;
        let shape = self.shape;
        match &mut self.backing {
            Backing::Host(buf) => Self::host_each(&self.geom, buf, layers, Some(table), |c, s| {
                let e = table[c.block as usize];
                if e.generation != SKIP_GEN {
                    fingerprint::fill_span(s, seed, &shape.slice(e.identity(c)));
                }
            }),
            Backing::Device { kernels, regions, bases, table: t, .. } => {
                let s32 = fingerprint::seed32(seed);
                let timer = GpuTimer::start(regions[0].device())?;
                if !layers.is_empty() {
                    kernels.fill(Self::region_args_of(&self.geom, &shape, layers, bases.ptr()), s32, t)?;
                }
                self.timers.push((Pass::Fill, timer.end()?));
                Ok(())
            }
        }
    }

    /// Writes the poison of (slot, `iteration`) into the slices of `layers`: all of them, or
    /// (`by_table`) only those of blocks whose loaded table entry is not [`SKIP_GEN`]. DRAM:
    /// synchronous; VRAM: queued.
    pub fn poison_layers(&mut self, layers: Range<u32>, iteration: u32, by_table: bool) -> Result<()> {
        self.check_layers(&layers)?;
        let table = by_table.then_some(&self.table[..]);
        let keep = |block: u32| table.is_some_and(|t| t[block as usize].generation == SKIP_GEN);
        match &mut self.backing {
            Backing::Host(buf) => {
                let g = &self.geom;
                Self::host_each(g, buf, layers, table, |c, s| {
                    if !keep(c.block) {
                        fingerprint::poison_span(s, g.global_slice(c), iteration)
                    }
                })
            }
            Backing::Device { kernels, regions, bases, table: t, .. } => {
                let timer = GpuTimer::start(regions[0].device())?;
                if !layers.is_empty() {
                    let args = Self::region_args_of(&self.geom, &self.shape, layers, bases.ptr());
                    kernels.poison(args, iteration, by_table.then_some(&*t))?;
                }
                self.timers.push((Pass::Poison, timer.end()?));
                Ok(())
            }
        }
    }

    /// Verifies every slice of `layers` against the loaded table; failures are kept until
    /// [`KvPool::take_failures`]. Host memory is O(failures): VRAM pools are checked by the
    /// verify kernel, which appends only failing slice parts to a device-side list (room for
    /// every part of the pool once: verify each layer at most once between two
    /// [`KvPool::take_failures`], which reports an overflow as a device error). DRAM:
    /// synchronous; VRAM: queued.
    pub fn verify_layers(&mut self, layers: Range<u32>) -> Result<()> {
        self.check_layers(&layers)?;
        let seed = self.seed;
        let table = &self.table;
        let shape = self.shape;
        match &mut self.backing {
            Backing::Host(buf) => {
                let found = std::sync::Mutex::new(Vec::new());
                let (n_slices, n_bytes) = (AtomicU64::new(0), AtomicU64::new(0));
                let kept = AtomicU64::new(self.judged.pending_bytes);
                let g = &self.geom;
                let skip = verify_skip();
                Self::host_each(g, buf, layers, Some(table), |c, s| {
                    let e = table[c.block as usize];
                    if e.generation == SKIP_GEN || skip == Some(g.global_slice(c)) {
                        return;
                    }
                    // The slice is judged from a copy (one read of decode's memory), so the
                    // bytes classified later are those judged here.
                    thread_local! { static SNAP: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) }; }
                    SNAP.with_borrow_mut(|snap| {
                        let (bad, first) = check_snapshot(s.as_span(), snap, seed, &shape.slice(e.identity(c)));
                        n_slices.fetch_add(1, Ordering::Relaxed);
                        n_bytes.fetch_add(s.len() as u64, Ordering::Relaxed);
                        if bad > 0 {
                            let f = RawFailure { slice: g.global_slice(c), bad_bytes: bad, first_bad: first };
                            let keep =
                                kept.fetch_add(snap.len() as u64, Ordering::Relaxed) + snap.len() as u64 <= JUDGED_MAX_BYTES;
                            found.lock().unwrap_or_else(|p| p.into_inner()).push((f, keep.then(|| snap.clone())));
                        }
                    });
                })?;
                for (f, snap) in found.into_inner().unwrap_or_else(|p| p.into_inner()) {
                    if let Some(b) = snap {
                        self.judged.pending_bytes += b.len() as u64;
                        self.judged.pending.push((f.slice, b));
                    }
                    self.host_fails.push(f);
                }
                self.host_compared.slices += n_slices.into_inner();
                self.host_compared.bytes += n_bytes.into_inner();
                Ok(())
            }
            Backing::Device { kernels, regions, bases, table: t, fails, counters, capture, .. } => {
                let s32 = fingerprint::seed32(seed);
                let timer = GpuTimer::start(regions[0].device())?;
                if !layers.is_empty() {
                    let args = Self::region_args_of(&self.geom, &self.shape, layers, bases.ptr());
                    kernels.verify(args, s32, t, fails, counters, capture)?;
                }
                self.timers.push((Pass::Verify, timer.end()?));
                Ok(())
            }
        }
    }

    /// Waits for every queued pass (VRAM: each pass's end event, so transfers in flight on
    /// other streams are not waited for; DRAM passes are already done) and returns the
    /// device seconds of the kernels of each kind since the last call (CUDA events around
    /// each pass's launches; zero for DRAM). Errors: a kernel failed (device, exit 3).
    pub fn finish(&mut self) -> Result<KernelSeconds> {
        // Each pass's end event is waited for (not the whole context: cuCtxSynchronize would
        // also wait for the NIXL/UCX copies in flight on UCX's streams and drain the pipeline).
        let mut k = KernelSeconds::default();
        for (pass, t) in self.timers.drain(..) {
            let s = t.seconds()?;
            match pass {
                Pass::Fill => k.fill += s,
                Pass::Poison => k.poison += s,
                Pass::Verify => k.verify += s,
                Pass::Check => {}
            }
        }
        self.last_kernel_secs = match self.backing {
            Backing::Device { .. } => Some(k.fill + k.poison + k.verify),
            Backing::Host(_) => None,
        };
        self.kernel_acc.fill += k.fill;
        self.kernel_acc.poison += k.poison;
        self.kernel_acc.verify += k.verify;
        Ok(k)
    }

    /// The kernel seconds of every pass [`KvPool::finish`] waited for since the last call
    /// (zero for DRAM pools).
    pub fn take_kernel_seconds(&mut self) -> KernelSeconds {
        std::mem::take(&mut self.kernel_acc)
    }

    /// Waits for every queued pass ([`KvPool::finish`]) and returns the failing slices the
    /// verify passes since the last call found, sorted by global index (a slice's failing
    /// parts merged: bytes summed, first offset kept). Errors (device, exit 3): a kernel
    /// failed, or the verify kernel's list overflowed or holds an impossible record (see
    /// `decode_device_failures`); the device counter is reset either way.
    pub fn take_failures(&mut self) -> Result<Vec<RawFailure>> {
        self.finish()?;
        self.judged.taken = std::mem::take(&mut self.judged.pending).into_iter().collect();
        self.judged.pending_bytes = 0;
        let mut out = match &mut self.backing {
            Backing::Host(_) => {
                let c = std::mem::take(&mut self.host_compared);
                self.compared_acc.slices += c.slices;
                self.compared_acc.bytes += c.bytes;
                std::mem::take(&mut self.host_fails)
            }
            Backing::Device { fails, counters, capture, .. } => {
                let mut head = vec![0u8; crate::gpu::cuda::VERIFY_COUNTERS_BYTES];
                counters.read(0, &mut head)?;
                // Zeroed before the list is checked, so an error leaves the next pass clean.
                counters.zero()?;
                let n = u32::from_le_bytes([head[0], head[1], head[2], head[3]]);
                for pair in head[16..].chunks_exact(16) {
                    let w = |i: usize| u64::from_le_bytes(pair[8 * i..8 * i + 8].try_into().unwrap_or([0; 8]));
                    self.compared_acc.slices += w(0);
                    self.compared_acc.bytes += w(1);
                }
                let cap = fails.len() / 16;
                let mut raw = vec![0u8; (n as usize).min(cap) * 16];
                fails.read(0, &mut raw)?;
                let out = decode_device_failures(&raw, n, &self.geom)?;
                self.judged.taken = captured_slices(&raw, capture, &self.geom, &self.shape, self.seed, &self.table)?;
                out
            }
        };
        out.sort_by_key(|f| f.slice);
        Ok(out)
    }

    /// Checks that every slice of `layers` still holds the poison of (slot, `iteration`)
    /// ([`fingerprint::poison`]; all slices, whatever the table says): the sweep's stray-write
    /// check, run on a stage right before it is posted again. Failures (bytes that differ from
    /// the poison, as verify's records) and the slices checked are kept until
    /// [`KvPool::take_poison_failures`], apart from the verify passes' failures and
    /// [`Compared`] counts. DRAM: synchronous, all threads; VRAM: queued (the
    /// `kvp_check_poison` kernel) — take its failures before anything may write the slices.
    pub fn check_poison_layers(&mut self, layers: Range<u32>, iteration: u32) -> Result<()> {
        self.check_layers(&layers)?;
        match &mut self.backing {
            Backing::Host(buf) => {
                let found = std::sync::Mutex::new(Vec::new());
                let n_slices = AtomicU64::new(0);
                let g = &self.geom;
                Self::host_each(g, buf, layers, None, |c, s| {
                    let slot = g.global_slice(c);
                    let (bad, first) = fingerprint::check_poison_span(s.as_span(), slot, iteration);
                    n_slices.fetch_add(1, Ordering::Relaxed);
                    if bad > 0 {
                        found.lock().unwrap_or_else(|p| p.into_inner()).push(RawFailure {
                            slice: slot,
                            bad_bytes: bad,
                            first_bad: first,
                        });
                    }
                })?;
                self.check.fails.append(&mut found.into_inner().unwrap_or_else(|p| p.into_inner()));
                self.check.slices += n_slices.into_inner();
                Ok(())
            }
            Backing::Device { kernels, regions, bases, check, .. } => {
                let timer = GpuTimer::start(regions[0].device())?;
                if !layers.is_empty() {
                    let args = Self::region_args_of(&self.geom, &self.shape, layers, bases.ptr());
                    kernels.check_poison(args, iteration, &check.fails, &check.counters)?;
                }
                self.timers.push((Pass::Check, timer.end()?));
                Ok(())
            }
        }
    }

    /// Waits for every queued pass ([`KvPool::finish`]) and returns the slices the poison
    /// checks since the last call found not holding their poison (sorted by global index, a
    /// slice's parts merged) and the number of slices those checks compared, counted by the
    /// passes (the kernel on VRAM). Errors (device, exit 3): a kernel failed, the list
    /// overflowed or holds an impossible record; the device counters are reset either way.
    pub fn take_poison_failures(&mut self) -> Result<(Vec<RawFailure>, u64)> {
        self.finish()?;
        let (mut out, slices) = match &mut self.backing {
            Backing::Host(_) => {
                let c = std::mem::take(&mut self.check);
                (c.fails, c.slices)
            }
            Backing::Device { check, .. } => {
                let (check_fails, check_counters) = (&check.fails, &check.counters);
                let mut head = vec![0u8; crate::gpu::cuda::CHECK_COUNTERS_BYTES];
                check_counters.read(0, &mut head)?;
                check_counters.zero()?;
                let n = u32::from_le_bytes([head[0], head[1], head[2], head[3]]);
                let slices = u64::from_le_bytes(head[8..16].try_into().unwrap_or([0; 8]));
                let cap = check_fails.len() / 16;
                let mut raw = vec![0u8; (n as usize).min(cap) * 16];
                check_fails.read(0, &mut raw)?;
                let fails = decode_device_failures(&raw, n, &self.geom)
                    .map_err(|e| Error::Device(format!("poison check: {}", e.to_string().replace("verify kernel", "kernel"))))?;
                (fails, slices)
            }
        };
        out.sort_by_key(|f| f.slice);
        Ok((out, slices))
    }

    /// The slices and bytes the verify passes compared, counted by the passes themselves
    /// (see [`Compared`]), over every [`KvPool::take_failures`] since the last call; resets
    /// the sum. A pass whose failures were not yet taken is not included.
    pub fn take_compared(&mut self) -> Compared {
        std::mem::take(&mut self.compared_acc)
    }

    /// Copies into `buf` (slice-sized) the bytes the verify pass judged of slice `c` (global
    /// index `slice`), one of the failures the last [`KvPool::take_failures`] returned.
    /// Returns true when they are exactly the judged bytes: DRAM, the copy the pass compared
    /// (up to [`JUDGED_MAX_BYTES`] per pass); VRAM, the expected bytes with the failing parts'
    /// bytes the verify kernel captured from its own loads over them (the first
    /// [`CAPTURE_MAX_BYTES`] of failing parts per pass). Otherwise (past those bounds) the
    /// slice is read now and false is returned: data that landed between the verify and this
    /// read is then classified, not what the verify judged (a failure of
    /// [`KvPool::verify_layers_then_poison`] on VRAM past the capture: the slice read right
    /// after its verify kernel and before its poison, true).
    /// Errors: as [`KvPool::read_slice`].
    pub fn judged_slice(&self, c: SliceCoord, slice: u32, buf: &mut [u8]) -> Result<bool> {
        match self.judged.taken.get(&slice) {
            Some(b) if b.len() == buf.len() => {
                buf.copy_from_slice(b);
                Ok(true)
            }
            _ => self.read_slice(c, buf).map(|_| false),
        }
    }

    /// The check before a re-poison (docs/guide.md "Stray and late writes"): verifies every slice of `layers`
    /// against the loaded table, as [`KvPool::verify_layers`], and then writes the poison of
    /// (slot, `iteration`) into all of them; returns the failing slices (their judged bytes
    /// through [`KvPool::judged_slice`]). DRAM: one pass, each slice checked from its copy
    /// and poisoned right after; VRAM: the verify kernel, waited for, the failing slices read
    /// to the host, then the poison kernel (queued). The compared work goes to
    /// [`KvPool::take_compared`] as a verify pass's does: take it apart. Errors: as
    /// [`KvPool::verify_layers`] and [`KvPool::take_failures`]. `judged_before(slice)` (global
    /// slice index) is true for slices whose failure the caller already recorded: they are
    /// still returned, but their bytes are neither kept nor read back, so host memory stays
    /// bounded however many slices failed (VRAM: one slice read per new failure only).
    pub fn verify_layers_then_poison(
        &mut self,
        layers: Range<u32>,
        iteration: u32,
        judged_before: &(dyn Fn(u32) -> bool + Sync),
    ) -> Result<Vec<RawFailure>> {
        self.check_layers(&layers)?;
        if let Backing::Device { .. } = self.backing {
            self.verify_layers(layers.clone())?;
            let fails = self.take_failures()?;
            let sb = self.geom.slice_bytes()? as usize;
            for f in &fails {
                if judged_before(f.slice) || self.judged.taken.contains_key(&f.slice) {
                    continue;
                }
                // Not captured by the kernel: read before the poison overwrites it.
                let mut b = vec![0u8; sb];
                self.read_slice(self.geom.coord_of(f.slice), &mut b)?;
                self.judged.taken.insert(f.slice, b);
            }
            self.poison_layers(layers, iteration, false)?;
            return Ok(fails);
        }
        let seed = self.seed;
        let table = &self.table;
        let shape = self.shape;
        let Backing::Host(buf) = &mut self.backing else { unreachable!("device pools returned above") };
        let found = std::sync::Mutex::new(Vec::new());
        let (n_slices, n_bytes, kept) = (AtomicU64::new(0), AtomicU64::new(0), AtomicU64::new(0));
        let g = &self.geom;
        Self::host_each(g, buf, layers, None, |c, s| {
            let e = table[c.block as usize];
            let slot = g.global_slice(c);
            if e.generation != SKIP_GEN {
                thread_local! { static SNAP: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) }; }
                SNAP.with_borrow_mut(|snap| {
                    let (bad, first) = check_snapshot(s.as_span(), snap, seed, &shape.slice(e.identity(c)));
                    n_slices.fetch_add(1, Ordering::Relaxed);
                    n_bytes.fetch_add(s.len() as u64, Ordering::Relaxed);
                    if bad > 0 {
                        let f = RawFailure { slice: slot, bad_bytes: bad, first_bad: first };
                        let keep = !judged_before(slot)
                            && kept.fetch_add(snap.len() as u64, Ordering::Relaxed) + snap.len() as u64 <= JUDGED_MAX_BYTES;
                        found.lock().unwrap_or_else(|p| p.into_inner()).push((f, keep.then(|| snap.clone())));
                    }
                });
            }
            fingerprint::poison_span(s, slot, iteration);
        })?;
        self.compared_acc.slices += n_slices.into_inner();
        self.compared_acc.bytes += n_bytes.into_inner();
        let mut fails = Vec::new();
        self.judged.taken.clear();
        for (f, snap) in found.into_inner().unwrap_or_else(|p| p.into_inner()) {
            if let Some(b) = snap {
                self.judged.taken.insert(f.slice, b);
            }
            fails.push(f);
        }
        fails.sort_by_key(|f| f.slice);
        Ok(fails)
    }

    /// Writes the fingerprint of `table[block]` into every slice (table has one entry per
    /// block; [`SKIP_GEN`] entries are left alone). Synchronous.
    pub fn fill(&mut self, table: &[TableEntry]) -> Result<()> {
        self.load_table(table)?;
        self.fill_layers(self.all_layers())?;
        self.finish().map(|_| ())
    }

    /// The kernels' arguments for one launch over `layers` (`bases`: the device array of the
    /// regions' base addresses).
    fn region_args_of(geom: &Geometry, shape: &RowShape, layers: Range<u32>, bases: u64) -> RegionArgs {
        RegionArgs {
            row_bytes: shape.row_bytes,
            heads: shape.heads,
            block_size: shape.block_size,
            head_base: shape.head_base,
            bases,
            layer0: layers.start,
            num_layers: layers.end - layers.start,
            slice_bytes: geom.slice_bytes().unwrap_or(0) as u32,
            layout: geom.layout_code(),
            num_blocks: geom.num_blocks,
            num_slices: geom.slices_per_layer() as u32,
        }
    }

    /// Writes the poison of (slot, `iteration`) into every slice. Synchronous.
    pub fn poison(&mut self, iteration: u32) -> Result<()> {
        self.poison_layers(self.all_layers(), iteration, false)?;
        self.finish().map(|_| ())
    }

    /// Writes the poison of (slot, `iteration`) into the slices of every block whose
    /// `table` entry is not [`SKIP_GEN`] (one entry per block). Synchronous.
    pub fn poison_blocks(&mut self, table: &[TableEntry], iteration: u32) -> Result<()> {
        self.load_table(table)?;
        self.poison_layers(self.all_layers(), iteration, true)?;
        self.finish().map(|_| ())
    }

    /// Copies all of `src` (same geometry, same memory kind) into this pool and returns the
    /// seconds it took: VRAM, cuMemcpyDtoD of every layer region on the default stream, device
    /// time (CUDA events); DRAM, memcpy on all threads, wall time. The copy ceiling that
    /// `kvprobe bench` rates the kernels against and `run` the transfer. Errors: usage when the
    /// geometries or memory kinds differ; device when a copy fails.
    pub fn copy_pool_from(&mut self, src: &KvPool) -> Result<f64> {
        // Two sides that differ in layout or block size hold the same bytes per layer region.
        if self.geom.num_layers != src.geom.num_layers || self.geom.region_bytes()? != src.geom.region_bytes()? {
            return Err(Error::Usage("copy_pool_from needs two pools of equal layer regions".into()));
        }
        match (&mut self.backing, &src.backing) {
            (Backing::Device { regions: d, .. }, Backing::Device { regions: s, .. }) => {
                let timer = crate::gpu::cuda::GpuTimer::start(d[0].device())?;
                for (d, s) in d.iter().zip(s) {
                    d.copy_from(s)?;
                }
                timer.stop()
            }
            (Backing::Host(d), Backing::Host(s)) => {
                // Raw spans, never slices: see crate::sys::hostmem (no transfer may be in flight
                // into either pool meanwhile; run and bench copy before any transfer).
                let t = std::time::Instant::now();
                let per = d.len().div_ceil(threads()).max(1);
                let (dst, src) = (d.span_mut(0, d.len())?, s.span(0, s.len())?);
                let failed = std::sync::Mutex::new(None);
                crate::sys::parallel::for_each(dst.into_chunks(per).zip(src.chunks(per)), threads(), |(mut d, s)| {
                    if let Err(e) = d.copy_from(s) {
                        *failed.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
                    }
                });
                match failed.into_inner().unwrap_or_else(|p| p.into_inner()) {
                    Some(e) => Err(e),
                    None => Ok(t.elapsed().as_secs_f64()),
                }
            }
            _ => Err(Error::Usage("copy_pool_from needs two pools of the same memory kind".into())),
        }
    }

    /// Like [`KvPool::copy_pool_from`] on VRAM, but in pieces of `piece` bytes on a
    /// non-blocking stream (see [`crate::gpu::cuda::copy_pieces_on_stream`]): the copy as UCX's
    /// cuda_ipc issues it. Errors: DRAM pools or other geometries (usage), the driver (device).
    pub fn copy_pool_in_pieces(&mut self, src: &KvPool, piece: usize) -> Result<f64> {
        match (&self.backing, &src.backing) {
            (Backing::Device { regions: d, .. }, Backing::Device { regions: s, .. }) if self.geom == src.geom => {
                let pairs: Vec<(&DeviceBuffer, &DeviceBuffer)> = d.iter().zip(s.iter()).collect();
                crate::gpu::cuda::copy_pieces_on_stream(d[0].device(), &pairs, piece)
            }
            _ => Err(Error::Usage("copy_pool_in_pieces needs two VRAM pools of one geometry".into())),
        }
    }

    /// VRAM pools: the device seconds (CUDA events around the launches) of the kernels of the
    /// passes the last [`KvPool::finish`] waited for (one [`KvPool::fill`], poison or
    /// [`KvPool::verify`] pass when called after one); `None` for DRAM pools.
    pub fn last_kernel_seconds(&self) -> Option<f64> {
        self.last_kernel_secs
    }

    /// Bytes of one block across all its slices: `num_layers * kv_parts * slice_bytes`.
    pub fn block_bytes(&self) -> u64 {
        self.geom.num_layers as u64 * self.geom.kv_parts() as u64 * self.geom.slice_bytes().unwrap_or(0)
    }

    /// The slices of block `slot`, in (layer, K/V) order: what [`KvPool::read_block`] and
    /// [`KvPool::write_block`] copy (a tier entry is these slices back to back).
    fn block_slices(&self, slot: u32) -> impl Iterator<Item = SliceCoord> + '_ {
        (0..self.geom.num_layers)
            .flat_map(move |layer| self.geom.parts().iter().map(move |&kv| SliceCoord { layer, kv, block: slot }))
    }

    /// Copies every slice of block `slot` into `dst` (length [`KvPool::block_bytes`]),
    /// slices in (layer, K/V) order. Synchronous.
    pub fn read_block(&self, slot: u32, dst: &mut [u8]) -> Result<()> {
        let sb = self.geom.slice_bytes()? as usize;
        if dst.len() as u64 != self.block_bytes() || slot >= self.geom.num_blocks {
            return Err(Error::Usage(format!("read_block: block {slot} into {} bytes", dst.len())));
        }
        for (c, chunk) in self.block_slices(slot).zip(dst.chunks_exact_mut(sb)) {
            self.read_slice(c, chunk)?;
        }
        Ok(())
    }

    /// [`KvPool::read_block`] into host memory a transfer engine may read (the tier arena,
    /// [`crate::mem::tier::TierArena`]): written through the span's raw pointer, never a `&mut
    /// [u8]` over it. Synchronous. Errors: as `read_block`; CUDA errors.
    pub fn read_block_into(&self, slot: u32, mut dst: SpanMut<'_>) -> Result<()> {
        let sb = self.geom.slice_bytes()? as usize;
        if dst.len() as u64 != self.block_bytes() || slot >= self.geom.num_blocks {
            return Err(Error::Usage(format!("read_block: block {slot} into {} bytes", dst.len())));
        }
        for (k, c) in self.block_slices(slot).enumerate() {
            let (layer, off, _) = self.locate(c);
            let mut piece = dst.sub_mut(k * sb, sb)?;
            match &self.backing {
                Backing::Host(b) => piece.copy_from(b.span(layer * self.geom.region_bytes()? as usize + off, sb)?)?,
                Backing::Device { regions, .. } => regions[layer].read_into(off, piece)?,
            }
        }
        Ok(())
    }

    /// [`KvPool::write_block`] from host memory a transfer engine may read (the tier arena),
    /// read through the span's raw pointer. Synchronous. Errors: as `write_block`; CUDA errors.
    pub fn write_block_from(&mut self, slot: u32, src: Span<'_>) -> Result<()> {
        let sb = self.geom.slice_bytes()? as usize;
        if src.len() as u64 != self.block_bytes() || slot >= self.geom.num_blocks {
            return Err(Error::Usage(format!("write_block: block {slot} from {} bytes", src.len())));
        }
        let region = self.geom.region_bytes()? as usize;
        let coords: Vec<SliceCoord> = self.block_slices(slot).collect();
        for (k, c) in coords.into_iter().enumerate() {
            let (layer, off, _) = self.locate(c);
            let piece = src.sub(k * sb, sb)?;
            match &mut self.backing {
                Backing::Host(b) => b.span_mut(layer * region + off, sb)?.copy_from(piece)?,
                Backing::Device { regions, .. } => regions[layer].write_from(off, piece)?,
            }
        }
        Ok(())
    }

    /// Overwrites every slice of block `slot` with `src` (as laid out by
    /// [`KvPool::read_block`]). Synchronous.
    pub fn write_block(&mut self, slot: u32, src: &[u8]) -> Result<()> {
        let sb = self.geom.slice_bytes()? as usize;
        if src.len() as u64 != self.block_bytes() || slot >= self.geom.num_blocks {
            return Err(Error::Usage(format!("write_block: block {slot} from {} bytes", src.len())));
        }
        let coords: Vec<SliceCoord> = self.block_slices(slot).collect();
        for (c, chunk) in coords.into_iter().zip(src.chunks_exact(sb)) {
            self.write_slice(c, chunk)?;
        }
        Ok(())
    }

    /// Verifies every slice against `table`; returns the failing slices sorted by global
    /// index. Host memory is O(failures) (see [`KvPool::verify_layers`]). Synchronous.
    pub fn verify(&mut self, table: &[TableEntry]) -> Result<Vec<RawFailure>> {
        self.load_table(table)?;
        self.verify_layers(self.all_layers())?;
        self.take_failures()
    }

    fn locate(&self, c: SliceCoord) -> (usize, usize, usize) {
        let sb = self.geom.slice_bytes().unwrap_or(0) as usize;
        (c.layer as usize, self.geom.slice_offset(c.kv, c.block) as usize, sb)
    }

    /// Rearranges the head rows of every slice of `layers` by `perm` (one u32 per row of
    /// `slice_bytes / perm.len()` bytes: row `r` of a slice becomes what row `perm[r]` of it
    /// held): decode's conversion on receive ([`crate::core::pairing::Sides::row_permutation`], vLLM's
    /// `kv_postprocess_*_on_receive`). VRAM: on the GPU (`kvp_permute_rows` into a scratch
    /// buffer of up to [`PERMUTE_SPAN_BYTES`] of whole slices, copied back; waited for);
    /// DRAM: on the host threads, slice by slice. No transfer may be writing the slices.
    /// Errors: usage for a permutation that does not fit the slices (rows not a whole number
    /// of 16-byte chunks, an entry out of range) or is not a bijection (a row taken twice,
    /// another never: checked before any slice is touched), or layers out of range; the first
    /// read or write of a DRAM slice that fails (the pass stops early then; slices already
    /// rearranged stay so); CUDA errors.
    pub fn permute_rows(&mut self, layers: Range<u32>, perm: &[u32]) -> Result<()> {
        self.check_layers(&layers)?;
        let sb = self.geom.slice_bytes()? as usize;
        let rows = perm.len();
        if rows == 0 || !sb.is_multiple_of(rows) || !(sb / rows).is_multiple_of(16) || perm.iter().any(|&p| p as usize >= rows) {
            return Err(Error::Usage(format!(
                "a row permutation of {rows} entries does not fit slices of {sb} bytes (rows of whole 16-byte chunks, entries below {rows})"
            )));
        }
        let mut taken = vec![false; rows];
        for (to, &from) in perm.iter().enumerate() {
            if std::mem::replace(&mut taken[from as usize], true) {
                return Err(Error::Usage(format!(
                    "a row permutation of {rows} entries is not a bijection: row {from} is taken twice (again for row {to})"
                )));
            }
        }
        let rb = sb / rows;
        let per_layer = self.geom.slices_per_layer() as usize;
        match &mut self.backing {
            Backing::Host(buf) => {
                let (stop, failed) = (std::sync::atomic::AtomicBool::new(false), std::sync::Mutex::new(None));
                // Test-only: the write of one slice (block 0 of the first layer) fails as a
                // write out of its span does.
                let fail_at = std::env::var_os(crate::sys::test_hooks::CONVERT_FAIL).map(|_| SliceCoord {
                    layer: layers.start,
                    kv: self.geom.parts()[0],
                    block: 0,
                });
                Self::host_each(&self.geom, buf, layers, None, |c, s| {
                    if stop.load(std::sync::atomic::Ordering::Relaxed) {
                        return;
                    }
                    let mut got = vec![0u8; sb];
                    let mut out = vec![0u8; sb];
                    let r = s.as_span().read_at(0, &mut got).and_then(|()| {
                        for (to, &from) in perm.iter().enumerate() {
                            let from = from as usize * rb;
                            out[to * rb..(to + 1) * rb].copy_from_slice(&got[from..from + rb]);
                        }
                        s.write_at(usize::from(fail_at == Some(c)), &out)
                    });
                    if let Err(e) = r {
                        failed.lock().unwrap_or_else(|p| p.into_inner()).get_or_insert(e);
                        stop.store(true, std::sync::atomic::Ordering::Relaxed);
                    }
                })?;
                match failed.into_inner().unwrap_or_else(|p| p.into_inner()) {
                    Some(e) => Err(e),
                    None => Ok(()),
                }
            }
            Backing::Device { kernels, regions, .. } => {
                let dev = regions[0].device().clone();
                let per_span = (PERMUTE_SPAN_BYTES as usize / sb).clamp(1, per_layer);
                let scratch = crate::gpu::cuda::DeviceBuffer::alloc(&dev, per_span * sb)?;
                let p = crate::gpu::cuda::DeviceBuffer::alloc(&dev, rows * 4)?;
                p.write(0, &perm.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>())?;
                for layer in layers {
                    let region = &regions[layer as usize];
                    let mut first = 0;
                    while first < per_layer {
                        let n = per_span.min(per_layer - first);
                        let src = region.ptr() + (first * sb) as u64;
                        kernels.permute_rows(src, &scratch, n as u32, sb as u32, rb as u32, &p)?;
                        region.copy_range_from(first * sb, &scratch, n * sb)?;
                        first += n;
                    }
                }
                // The scratch and the permutation are freed on return: the queued work ends first.
                dev.synchronize()
            }
        }
    }

    /// Copies one slice to `buf` (which must be slice-sized).
    pub fn read_slice(&self, c: SliceCoord, buf: &mut [u8]) -> Result<()> {
        let (layer, off, sb) = self.locate(c);
        if buf.len() != sb {
            return Err(Error::Usage(format!("read_slice needs {sb} bytes, got {}", buf.len())));
        }
        match &self.backing {
            Backing::Host(b) => {
                let at = layer * self.geom.region_bytes().unwrap_or(0) as usize + off;
                b.read_at(at, buf)
            }
            Backing::Device { regions, .. } => regions[layer].read(off, buf),
        }
    }

    /// Overwrites one slice with `bytes` (slice-sized).
    pub fn write_slice(&mut self, c: SliceCoord, bytes: &[u8]) -> Result<()> {
        let (layer, off, sb) = self.locate(c);
        if bytes.len() != sb {
            return Err(Error::Usage(format!("write_slice needs {sb} bytes, got {}", bytes.len())));
        }
        match &mut self.backing {
            Backing::Host(b) => {
                let at = layer * self.geom.region_bytes().unwrap_or(0) as usize + off;
                b.write_at(at, bytes)
            }
            Backing::Device { regions, .. } => regions[layer].write(off, bytes),
        }
    }
}
