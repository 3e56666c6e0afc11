//! `kvprobe bench`: the probe's own speed, so it is never the bottleneck it measures.
//!
//! Measured as GPU practice demands: one warm-up pass, then the median of `repeats` passes,
//! GPU work timed with CUDA events on the default stream (the kernels' device time, not host
//! launch time), on fingerprinted (pseudo-random, never zero) data. Every rate is a ratio
//! to a ceiling measured in the same run on the same device:
//!
//! - GPU ceiling: cuMemcpyDtoD of a whole pool (≥ 4 GiB by default, layer region by layer
//!   region), counted as bytes read + bytes written (a copy of N bytes moves 2N); beside it
//!   the same copy in 16 MiB pieces on a non-blocking stream, as UCX's cuda_ipc issues a
//!   transfer (`gpu.copy_stream`);
//! - fill kernel (bytes written / s), poison pass (bytes written / s) and verify kernel
//!   (bytes read / s) over that pool, each as a ratio to the ceiling (goal ≥ 0.95 for fill
//!   and verify);
//! - DRAM: memcpy (read + written) on one thread and on all threads against the CPU
//!   reference's fill (written) and verify (read) on as many threads (goal ≥ 0.5, all
//!   threads);
//! - NIXL request building (`nixl.request.*`): one READ request over every block slice of a
//!   DRAM pool pair (llama3-8b geometry, `--sweep-bytes`), built and released without
//!   posting, from descriptors built for it (`createXferReq`, `--xfer-req create`) and
//!   from indices into lists prepared once (`makeXferReq`, `--xfer-req prepared`, as
//!   vLLM's NixlConnector), with vLLM-shaped per-block descriptors and with runs of 16
//!   blocks per descriptor; rated as bytes described per second against the all-thread
//!   memcpy (how the cost of making a request compares with moving its bytes on this host);
//! - one `kvprobe run` sweep iteration broken down into fill, poison, NIXL transfer, verify
//!   and host work, with the transfer rate as a ratio to the one-way copy rate (the
//!   ceiling / 2, both counting the bytes moved once), and the probe's share of the
//!   iteration (goal ≤ 5 % where the transfer reaches 50 GB/s).
//!
//! GB/s = 1e9 B/s throughout. The goals come from the performance issue (bench/NOTES.md).

use crate::core::fingerprint::{self, BlockIdentity};
use crate::core::geometry::{Geometry, KvPart, Preset};
use crate::drive::run::Hooks;
use crate::error::{Error, Result};
use crate::mem::pool::{KvPool, MemoryKind, TableEntry};
use crate::sweep::RunConfig;
use serde::Serialize;
use std::time::Instant;

/// Schema name of the JSON `kvprobe bench` writes.
pub const SCHEMA: &str = "kvprobe.bench/1";

/// Goal: fill and verify kernel rates as a share of the same-run copy ceiling: 0.95 for the
/// fingerprint by head row (`kvprobe.fingerprint/2`; 0.85 for the byte-offset fingerprint
/// before it).
pub const GOAL_KERNEL_RATIO: f64 = 0.95;
/// Goal: CPU fill and verify (all threads) as a share of memcpy (all threads).
pub const GOAL_CPU_RATIO: f64 = 0.5;
/// Goal: the probe's share of a sweep iteration (everything but the transfer), where the
/// transfer reaches [`OVERHEAD_APPLIES_GBPS`].
pub const GOAL_PROBE_SHARE: f64 = 0.05;
/// Transfer rate (GB/s) from which [`GOAL_PROBE_SHARE`] applies.
pub const OVERHEAD_APPLIES_GBPS: f64 = 50.0;

/// What to measure.
#[derive(Clone, Debug, Serialize, serde::Deserialize)]
pub struct BenchConfig {
    /// Vram: the GPU figures, the DRAM figures and VRAM sweep breakdowns; Dram: the DRAM
    /// figures and a DRAM sweep breakdown.
    pub memory: MemoryKind,
    /// GPU ordinal (VRAM): the prefill pool's, and the one the kernels are measured on.
    pub device: usize,
    /// A second GPU for the decode pool (VRAM): adds the cross-device copy ceiling
    /// (`gpu.peer_copy`) and runs the sweeps across the two GPUs against it.
    pub decode_device: Option<usize>,
    /// Bytes of the GPU pool the kernels and the copy ceiling run over (rounded down to whole
    /// llama3-8b blocks of 2 MiB).
    pub gpu_bytes: u64,
    /// Bytes of the DRAM buffers (rounded down to whole 32 KiB slices).
    pub host_bytes: u64,
    /// Timed passes per figure (after one warm-up); the median is reported.
    pub repeats: u32,
    /// Iterations of each sweep breakdown.
    pub iterations: u32,
    /// Bytes of each pool in the sweep breakdowns (llama3-8b geometry).
    pub sweep_bytes: u64,
    /// Fingerprint seed (written as `seed` and `seed_hex`, [`crate::sweep::serialize_seed`]).
    #[serde(flatten, serialize_with = "crate::sweep::serialize_seed", deserialize_with = "crate::sweep::deserialize_seed")]
    pub seed: u64,
    /// Sweeps with prefill's NIXL agent and pool in a second process (`run --decode-process`).
    pub decode_process: bool,
    /// NIXL backend of the sweep breakdowns.
    pub backend: String,
    /// Parameters set over the backend plugin's defaults (`--backend-param KEY=VALUE`), for
    /// the sweeps and the request rows. Absent in older results.
    #[serde(default)]
    pub backend_params: std::collections::BTreeMap<String, String>,
    /// Seconds to wait for each transfer of the sweep breakdowns.
    pub timeout_secs: f64,
}

/// One measured rate.
#[derive(Clone, Debug, Serialize, serde::Deserialize)]
pub struct Figure {
    /// Stable identifier, e.g. `gpu.fill`.
    pub name: String,
    /// Human label.
    pub what: String,
    /// Bytes counted per pass.
    pub bytes: u64,
    /// How `bytes` counts: "read+written", "written", "read", "moved once", or "described"
    /// (the bytes a NIXL request names, for the request rows).
    pub counted: String,
    /// Median seconds of the timed passes.
    pub seconds_median: f64,
    /// Fastest pass.
    pub seconds_min: f64,
    /// Slowest pass.
    pub seconds_max: f64,
    /// `bytes / seconds_median / 1e9`.
    pub gbps: f64,
    /// Rate as a share of `ratio_to`'s rate.
    pub ratio: Option<f64>,
    /// The figure the ratio is against.
    pub ratio_to: Option<String>,
    /// The goal for `ratio` (at least), if any.
    pub goal: Option<f64>,
    /// Whether `ratio` meets `goal`.
    pub meets: Option<bool>,
}

/// One `kvprobe run` sweep, per iteration: the parts of one representative iteration — of the
/// steady iterations (neither the first, a warm-up, nor the last, which has no next iteration
/// to refill for), the one with the median wall time ([`representative`]) — from the run
/// report's `summary.per_iteration`, so the parts add up:
/// `fill_s + poison_s + transfer_s + verify_s + host_s = iteration_s`.
#[derive(Clone, Debug, Serialize, serde::Deserialize)]
pub struct Breakdown {
    /// What the sweep moves, e.g. "llama3-8b, 32 KiB slices (vLLM-shaped)".
    pub label: String,
    /// Pool memory.
    pub memory: MemoryKind,
    /// Bytes of one block slice.
    pub slice_bytes: u64,
    /// Blocks per NIXL descriptor (`run --descriptor-blocks`).
    pub descriptor_blocks: u32,
    /// Bytes of one NIXL descriptor (`descriptor_blocks` slices).
    pub descriptor_bytes: u64,
    /// Pipeline stages of the sweep.
    pub pipeline_stages: u32,
    /// Bytes of each pool.
    pub pool_bytes: u64,
    /// Iterations run (the first is a warm-up, left out of the medians when there are more).
    pub iterations: u32,
    /// The run's exit code (0 = clean).
    pub exit_code: u8,
    /// The run's error, if any.
    pub error: Option<String>,
    /// Seconds from the run's start to its first transfer.
    pub setup_seconds: f64,
    /// The iteration (1-based index into the run's iterations) the per-iteration seconds
    /// below come from ([`representative`]); 0 when none ran.
    pub representative_iteration: u32,
    /// Per-iteration wall seconds: the whole iteration.
    pub iteration_s: f64,
    /// Per-iteration wall seconds: fill outside the transfer window.
    pub fill_s: f64,
    /// Per-iteration wall seconds: poison outside the transfer window.
    pub poison_s: f64,
    /// Per-iteration wall seconds: the transfer window (every stage's NIXL requests).
    pub transfer_s: f64,
    /// Per-iteration wall seconds: verify outside the transfer window, classification included.
    pub verify_s: f64,
    /// Per-iteration wall seconds of probe work hidden inside the transfer window.
    pub overlapped_s: f64,
    /// Per-iteration wall seconds: everything else (descriptor lists, tables, bookkeeping).
    pub host_s: f64,
    /// VRAM: device seconds of the fill, poison and verify kernels of that iteration.
    pub kernel_s: crate::report::KernelSeconds,
    /// The transfer rate (GB/s).
    pub transfer_gbps: f64,
    /// Transfer rate / one-way copy rate of the same path (one GPU: ceiling / 2; two GPUs:
    /// the peer copy; DRAM: all-thread memcpy / 2).
    pub transfer_ratio: Option<f64>,
    /// (iteration − transfer) / iteration.
    pub probe_share: f64,
    /// Whether `probe_share` ≤ [`GOAL_PROBE_SHARE`]; `None` where the transfer is below
    /// [`OVERHEAD_APPLIES_GBPS`] (the goal does not apply).
    pub meets: Option<bool>,
    /// The UCX path the sweep's READs took, in words ([`crate::xfer::ucx::describe`] of its run's
    /// `summary.transport_path`, with `UCX_CUDA_IPC_ENABLE_GET_ZCOPY` and who set it for VRAM);
    /// `None` when unknown. Absent in results written before it.
    #[serde(default)]
    pub path: Option<String>,
    /// True when UCX moved the sweep's READs by software emulation (its slow fallback):
    /// `transfer_gbps` is then emulation's rate, not the hardware's, and the table says
    /// EMULATED beside it. False in results written before it.
    #[serde(default)]
    pub emulated: bool,
}

/// A sweep's path fields ([`Breakdown::path`], [`Breakdown::emulated`]) from its run's
/// `summary.transport_path`.
pub fn path_of(p: Option<&crate::xfer::ucx::TransportPath>) -> (Option<String>, bool) {
    (p.map(crate::xfer::ucx::describe), p.is_some_and(|p| p.emulated))
}

/// A sweep's transfer rate as the table gives it: "N GB/s", marked when it was measured on
/// UCX's software emulation (not the hardware's rate).
pub fn rate_words(gbps: f64, emulated: bool) -> String {
    if emulated {
        format!("{gbps:.2} GB/s EMULATED (UCX's software emulation, not the hardware's transfer rate)")
    } else {
        format!("{gbps:.2} GB/s")
    }
}

/// The `kvprobe bench` result (`schema` = [`SCHEMA`]).
#[derive(Clone, Debug, Serialize, serde::Deserialize)]
pub struct BenchReport {
    /// Always [`SCHEMA`].
    pub schema: String,
    /// Unix time the bench started.
    pub started_unix: u64,
    /// What was asked.
    pub config: BenchConfig,
    /// Hosts, GPUs, driver, NIXL, UCX settings in effect.
    pub environment: crate::env::envinfo::Environment,
    /// The rates.
    pub figures: Vec<Figure>,
    /// The sweep breakdowns.
    pub breakdowns: Vec<Breakdown>,
    /// How the bench ended: exit 0 when everything was measured; a failing sweep's exit
    /// code (2–4); 3 when a kernel, copy or check failed; 130 when interrupted (the figures
    /// measured until then are kept).
    pub outcome: crate::report::Outcome,
}

fn median(mut v: Vec<f64>) -> (f64, f64, f64) {
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    let med = if n % 2 == 1 { v[n / 2] } else { (v[n / 2 - 1] + v[n / 2]) / 2.0 };
    (med, v[0], v[n - 1])
}

/// Runs `pass` once to warm up, then `repeats` times; `pass` returns its own seconds.
/// Errors: the pass's, or [`Error::Interrupted`] on SIGINT/SIGTERM between passes.
fn timed(repeats: u32, mut pass: impl FnMut() -> Result<f64>) -> Result<(f64, f64, f64)> {
    let mut v = Vec::with_capacity(repeats as usize);
    for i in 0..=repeats.max(1) {
        if crate::sys::interrupt::requested() {
            return Err(Error::Interrupted("during the bench; the figures measured so far are kept".into()));
        }
        let t = pass()?;
        if i > 0 {
            v.push(t);
        }
    }
    Ok(median(v))
}

fn figure(name: &str, what: &str, bytes: u64, counted: &'static str, t: (f64, f64, f64)) -> Figure {
    Figure {
        name: name.into(),
        what: what.into(),
        bytes,
        counted: counted.to_string(),
        seconds_median: t.0,
        seconds_min: t.1,
        seconds_max: t.2,
        gbps: bytes as f64 / t.0.max(1e-12) / 1e9,
        ratio: None,
        ratio_to: None,
        goal: None,
        meets: None,
    }
}

fn rate_against(f: &mut Figure, base: &Figure, goal: Option<f64>) {
    let r = f.gbps / base.gbps.max(1e-12);
    f.ratio = Some(r);
    f.ratio_to = Some(base.name.clone());
    f.goal = goal;
    f.meets = goal.map(|g| r >= g);
}

/// The llama3-8b geometry (32 KiB block slices) with as many blocks as fit in `bytes`.
fn llama_pool_geometry(bytes: u64) -> Result<Geometry> {
    let mut g = Preset::Llama3_8b.geometry();
    g.num_blocks = 1;
    let per_block = g.pool_bytes()?;
    g.num_blocks = (bytes / per_block).clamp(2, u32::MAX as u64) as u32;
    Ok(g)
}

fn gpu_figures(cfg: &BenchConfig, out: &mut Vec<Figure>) -> Result<()> {
    let dev = crate::gpu::cuda::Device::open(cfg.device)?;
    let kernels = std::sync::Arc::new(crate::gpu::cuda::Kernels::compile(&dev)?);
    let g = llama_pool_geometry(cfg.gpu_bytes)?;
    let bytes = g.pool_bytes()?;
    let mut src = KvPool::device(&dev, kernels.clone(), &g, cfg.seed)?;
    let mut dst = KvPool::device(&dev, kernels, &g, cfg.seed)?;
    let table: Vec<TableEntry> =
        (0..g.num_blocks).map(|i| TableEntry::new(crate::drive::run::logical_block(cfg.seed, i), 1)).collect();
    let kernel_secs = |p: &KvPool| p.last_kernel_seconds().ok_or_else(|| Error::Device("no kernel time recorded".into()));
    let m =
        |name: &str| crate::sys::progress::announce(&format!("bench: measuring {name} ({} passes after a warm-up)", cfg.repeats));
    m("gpu.fill");
    let fill = timed(cfg.repeats, || {
        src.fill(&table)?;
        kernel_secs(&src)
    })?;
    m("gpu.copy");
    let copy = timed(cfg.repeats, || dst.copy_pool_from(&src))?;
    // The same copy as UCX's cuda_ipc issues a transfer: 16 MiB pieces, one async copy each,
    // on a non-blocking stream (where a NIXL transfer's rate limit would show without NIXL).
    m("gpu.copy_stream");
    let pieces = timed(cfg.repeats, || dst.copy_pool_in_pieces(&src, 16 << 20))?;
    m("gpu.verify");
    let verify = timed(cfg.repeats, || {
        let fails = dst.verify(&table)?;
        if !fails.is_empty() {
            return Err(Error::Device(format!("bench: {} slices of the copied pool do not verify", fails.len())));
        }
        kernel_secs(&dst)
    })?;
    let mut it = 0;
    m("gpu.poison");
    let poison = timed(cfg.repeats, || {
        it += 1;
        dst.poison(it)?;
        kernel_secs(&dst)
    })?;
    let gib = bytes as f64 / (1u64 << 30) as f64;
    if let Some(d) = cfg.decode_device.filter(|&d| d != cfg.device) {
        // Cross-device ceiling: the pool copied into a pool on the decode GPU (cuMemcpyDtoD
        // with unified addressing, peer access enabled for the copy: NVLink or PCIe P2P).
        let dev2 = crate::gpu::cuda::Device::open(d)?;
        let k2 = std::sync::Arc::new(crate::gpu::cuda::Kernels::compile(&dev2)?);
        let mut far = KvPool::device(&dev2, k2, &g, cfg.seed)?;
        m("gpu.peer_copy");
        let peer = dev2.with_peer_access(&dev, || timed(cfg.repeats, || far.copy_pool_from(&src)))?;
        let fails = far.verify(&table)?;
        if !fails.is_empty() {
            return Err(Error::Device(format!("bench: {} slices of the pool copied to GPU {d} do not verify", fails.len())));
        }
        out.push(figure(
            "gpu.peer_copy",
            &format!("GPU {} -> GPU {d} copy, {gib:.2} GiB", cfg.device),
            bytes,
            "moved once",
            peer,
        ));
    }
    let ceiling = figure("gpu.copy", &format!("GPU copy ceiling, cuMemcpyDtoD {gib:.2} GiB"), 2 * bytes, "read+written", copy);
    let mut f = figure("gpu.fill", "fill kernel", bytes, "written", fill);
    rate_against(&mut f, &ceiling, Some(GOAL_KERNEL_RATIO));
    let mut v = figure("gpu.verify", "verify kernel", bytes, "read", verify);
    rate_against(&mut v, &ceiling, Some(GOAL_KERNEL_RATIO));
    let mut p = figure("gpu.poison", "poison kernel", bytes, "written", poison);
    rate_against(&mut p, &ceiling, None);
    let mut c = figure(
        "gpu.copy_stream",
        &format!("cuMemcpyDtoDAsync {gib:.2} GiB in 16 MiB pieces, non-blocking stream"),
        2 * bytes,
        "read+written",
        pieces,
    );
    rate_against(&mut c, &ceiling, None);
    out.extend([ceiling, f, v, p, c]);
    Ok(())
}

/// Splits `buf` into `threads` runs of whole `sb`-byte slices and runs `f(first slice index,
/// run)` on each in parallel.
fn par_slices(buf: &mut [u8], sb: usize, threads: usize, f: impl Fn(usize, &mut [u8]) + Sync) {
    let slices = buf.len() / sb;
    let per = slices.div_ceil(threads.max(1)).max(1);
    crate::sys::parallel::for_each(buf.chunks_mut(per * sb).enumerate(), threads, |(t, part)| f(t * per, part));
}

/// Slice `i` of the CPU figures: a llama3-8b K slice (16 tokens × 8 heads × 256-byte rows).
fn identity(i: usize) -> fingerprint::SliceRows {
    let shape = fingerprint::RowShape::of(&crate::core::geometry::Preset::Llama3_8b.geometry());
    shape.slice(BlockIdentity::new((i % 32) as u32, KvPart::K, (i / 32) as u32, 1))
}

fn host_figures(cfg: &BenchConfig, out: &mut Vec<Figure>) -> Result<()> {
    const SB: usize = 32 << 10; // one llama3-8b block slice
    let n = (cfg.host_bytes as usize / SB).max(1) * SB;
    let mut src = crate::sys::hostmem::PrivateBuffer::alloc(n)?;
    let mut dst = crate::sys::hostmem::PrivateBuffer::alloc(n)?;
    let all = std::thread::available_parallelism().map(|x| x.get()).unwrap_or(1);
    let seed = cfg.seed;
    let fill_pass = |buf: &mut [u8], threads: usize| {
        let t = Instant::now();
        par_slices(buf, SB, threads, |first, run| {
            for (i, s) in run.chunks_exact_mut(SB).enumerate() {
                fingerprint::fill(s, seed, &identity(first + i));
            }
        });
        t.elapsed().as_secs_f64()
    };
    let copy_pass = |dst: &mut [u8], src: &[u8], threads: usize| {
        let t = Instant::now();
        let per = n.div_ceil(threads).div_ceil(SB) * SB;
        crate::sys::parallel::for_each(dst.chunks_mut(per).zip(src.chunks(per)), threads, |(d, s)| d.copy_from_slice(s));
        t.elapsed().as_secs_f64()
    };
    let verify_pass = |buf: &mut [u8], threads: usize| -> Result<f64> {
        let bad = std::sync::atomic::AtomicU64::new(0);
        let t = Instant::now();
        par_slices(buf, SB, threads, |first, run| {
            let mut b = 0;
            for (i, s) in run.chunks_exact(SB).enumerate() {
                b += fingerprint::check(s, seed, &identity(first + i)).0;
            }
            bad.fetch_add(b, std::sync::atomic::Ordering::Relaxed);
        });
        let secs = t.elapsed().as_secs_f64();
        match bad.into_inner() {
            0 => Ok(secs),
            b => Err(Error::Device(format!("bench: {b} bytes of the copied DRAM buffer do not verify"))),
        }
    };
    // Each figure goes into `out` as soon as it is measured (an interrupt keeps them); the
    // source is filled first so every copy moves fingerprinted bytes.
    let bytes = n as u64;
    let size = if bytes >= 1 << 20 { format!("{} MiB", bytes >> 20) } else { format!("{} KiB", bytes >> 10) };
    let m =
        |name: &str| crate::sys::progress::announce(&format!("bench: measuring {name} ({} passes after a warm-up)", cfg.repeats));
    fill_pass(src.as_mut_slice(), all);
    m("cpu.memcpy.1");
    let c1 = figure(
        "cpu.memcpy.1",
        &format!("memcpy {size}, 1 thread"),
        2 * bytes,
        "read+written",
        timed(cfg.repeats, || Ok(copy_pass(dst.as_mut_slice(), src.as_slice(), 1)))?,
    );
    out.push(c1.clone());
    m("cpu.memcpy.all");
    let cn = figure(
        "cpu.memcpy.all",
        &format!("memcpy {size}, {all} threads"),
        2 * bytes,
        "read+written",
        timed(cfg.repeats, || Ok(copy_pass(dst.as_mut_slice(), src.as_slice(), all)))?,
    );
    out.push(cn.clone());
    // (name, label, what is counted, threads, the memcpy it is rated against, goal)
    type Pass<'a> = (&'a str, String, &'static str, usize, &'a Figure, Option<f64>);
    let passes: [Pass; 4] = [
        ("cpu.fill.1", "CPU fill, 1 thread".into(), "written", 1, &c1, None),
        ("cpu.fill.all", format!("CPU fill, {all} threads"), "written", all, &cn, Some(GOAL_CPU_RATIO)),
        ("cpu.verify.1", "CPU verify, 1 thread".into(), "read", 1, &c1, None),
        ("cpu.verify.all", format!("CPU verify, {all} threads"), "read", all, &cn, Some(GOAL_CPU_RATIO)),
    ];
    for (name, what, counted, threads, base, goal) in passes {
        m(name);
        let t = if counted == "written" {
            timed(cfg.repeats, || Ok(fill_pass(src.as_mut_slice(), threads)))?
        } else {
            timed(cfg.repeats, || verify_pass(dst.as_mut_slice(), threads))?
        };
        let mut f = figure(name, &what, bytes, counted, t);
        rate_against(&mut f, base, goal);
        out.push(f);
    }
    Ok(())
}

/// Blocks per descriptor of the merged request rows (`nixl.request.*.merged`), as the
/// sweep breakdowns' first merged row.
const MERGED_BLOCKS: u32 = 16;

/// The request rows (module docs): two DRAM pools of the llama3-8b geometry in
/// `cfg.sweep_bytes`, decode connected to prefill with prepared lists; one READ of every
/// slice (blocks in a seeded random order, as the sweep's block map) per pass, timed from
/// the descriptor lists (create) or indices (prepared) to the request built. Each row goes
/// into `out` as it is measured. Errors: NIXL (transport, exit 3; environment, exit 2).
fn request_figures(cfg: &BenchConfig, out: &mut Vec<Figure>) -> Result<()> {
    use crate::core::geometry::SliceCoord;
    use crate::xfer::transport::{Endpoint, Op, Pair, TransportOptions, XferReq};
    use rand::SeedableRng;
    use rand::seq::SliceRandom;
    let g = llama_pool_geometry(cfg.sweep_bytes)?;
    let sb = g.slice_bytes()?;
    let bytes = g.pool_bytes()?;
    crate::sys::progress::announce(&format!("bench: NIXL request rows: two DRAM pools of {} MiB", bytes >> 20));
    let opts = TransportOptions { xfer_req: XferReq::Prepared, backend_params: cfg.backend_params.clone() };
    let prefill = Endpoint::with_options("kvprobe-bench-prefill", &cfg.backend, KvPool::host(&g, cfg.seed)?, &opts)?;
    let mut decode = Endpoint::with_options("kvprobe-bench-decode", &cfg.backend, KvPool::host(&g, cfg.seed)?, &opts)?;
    decode.connect(prefill.info()?)?;
    let base = out.iter().find(|f| f.name == "cpu.memcpy.all").cloned();
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(cfg.seed);
    for (shape, n) in [("block", 1), ("merged", MERGED_BLOCKS)] {
        if n > 1 && !g.num_blocks.is_multiple_of(n) {
            continue;
        }
        let mut runs: Vec<u32> = (0..g.num_blocks / n).collect();
        runs.shuffle(&mut rng);
        let pairs: Vec<Pair> = (0..g.num_layers)
            .flat_map(|layer| g.parts().iter().map(move |&kv| (layer, kv)))
            .flat_map(|(layer, kv)| {
                runs.iter().enumerate().map(move |(i, &r)| {
                    Pair::slice(
                        SliceCoord { layer, kv, block: i as u32 * n },
                        SliceCoord { layer, kv, block: r * n },
                        sb * n as u64,
                    )
                })
            })
            .collect();
        for mode in [XferReq::Create, XferReq::Prepared] {
            let name = format!("nixl.request.{}.{shape}", mode.name());
            crate::sys::progress::announce(&format!("bench: measuring {name} ({} passes after a warm-up)", cfg.repeats));
            let t = timed(cfg.repeats, || decode.time_request(Op::Read, &pairs, mode))?;
            let how = match mode {
                XferReq::Create => "createXferReq",
                XferReq::Prepared => "makeXferReq",
            };
            let what = format!("{how} {} x {} KiB", pairs.len(), (sb * n as u64) >> 10);
            let mut f = figure(&name, &what, bytes, "described", t);
            if let Some(b) = &base {
                rate_against(&mut f, b, None);
            }
            out.push(f);
        }
    }
    Ok(())
}

fn breakdown(
    cfg: &BenchConfig,
    label: &str,
    memory: MemoryKind,
    g: Geometry,
    (descriptor_blocks, stages): (u32, Option<u32>),
    one_way_gbps: Option<f64>,
) -> Breakdown {
    let device = if memory == MemoryKind::Vram { cfg.device } else { 0 };
    let decode = if memory == MemoryKind::Vram { cfg.decode_device.unwrap_or(device) } else { 0 };
    let rc = RunConfig {
        memory,
        prefill_device: device,
        decode_device: decode,
        prefill_rank_devices: Vec::new(),
        decode_rank_devices: Vec::new(),
        preset: None,
        model: None,
        geometry: g.clone(),
        decode_geometry: None,
        permute_local_kv: false,
        tp: None,
        fingerprint: Default::default(),
        op: crate::xfer::transport::Op::Read,
        iterations: cfg.iterations,
        seed: cfg.seed,
        inject: Vec::new(),
        region_inject: Vec::new(),
        self_test: false,
        backend: cfg.backend.clone(),
        backend_params: cfg.backend_params.clone(),
        xfer_req: crate::xfer::transport::XferReq::Prepared,
        timeout_secs: cfg.timeout_secs,
        min_gbps: None,
        max_failures: 100,
        descriptor_blocks,
        stages,
        decode_process: cfg.decode_process,
        scenario: None,
        peer: None,
        peer_token: None,
    };
    let (mut line, mut progress, mut ckpt) =
        (|_: &str| {}, |_: &crate::scenario::config::Progress| {}, |_: &crate::report::Report| {});
    let mut hooks = Hooks { line: &mut line, progress: &mut progress, checkpoint_secs: 0.0, checkpoint: &mut ckpt, dump: None };
    let (report, exit) = crate::drive::run::run(&rc, &mut hooks);
    let s = &report.summary;
    // The first iteration warms up (page faults, UCX connections and registration caches).
    // One representative iteration, not per-part medians (which need not add up).
    let (index, rep) =
        representative(&s.per_iteration).map_or((0, Default::default()), |i| (i as u32 + 1, s.per_iteration[i].clone()));
    let (iteration, transfer) = (rep.iteration, rep.transfer);
    let (fill, poison, verify) = (rep.fill, rep.poison, rep.verify);
    let host = (iteration - fill - poison - transfer - verify).max(0.0);
    let warm = s.per_iteration.len() > 1;
    let pool_bytes = g.pool_bytes().unwrap_or(0);
    let transfer_gbps = if transfer > 0.0 { pool_bytes as f64 / transfer / 1e9 } else { 0.0 };
    let probe_share = if iteration > 0.0 { 1.0 - transfer / iteration } else { 0.0 };
    let (path, emulated) = path_of(s.transport_path.as_ref());
    Breakdown {
        path,
        emulated,
        label: label.into(),
        memory,
        slice_bytes: g.slice_bytes().unwrap_or(0),
        descriptor_blocks,
        descriptor_bytes: g.slice_bytes().unwrap_or(0) * descriptor_blocks as u64,
        pipeline_stages: s.pipeline_stages,
        pool_bytes,
        iterations: s.iterations,
        exit_code: exit as u8,
        error: report.outcome.error.as_ref().map(|e| e.message.clone()),
        setup_seconds: s.setup_seconds,
        representative_iteration: index,
        iteration_s: iteration,
        fill_s: fill,
        poison_s: poison,
        transfer_s: transfer,
        verify_s: verify,
        overlapped_s: rep.overlapped,
        host_s: host,
        kernel_s: rep.kernels,
        transfer_gbps,
        transfer_ratio: one_way_gbps.filter(|_| transfer_gbps > 0.0).map(|c| transfer_gbps / c.max(1e-12)),
        probe_share,
        meets: (transfer_gbps >= OVERHEAD_APPLIES_GBPS && warm).then_some(probe_share <= GOAL_PROBE_SHARE),
    }
}

/// Index (0-based) of the representative iteration of a sweep's `per_iteration`: of the steady
/// ones — after the first (the warm-up) and before the last (which refills and re-poisons
/// nothing, there being no next iteration), as far as there are any — the one whose wall time
/// is the median (the lower middle for an even count; the earliest among equal times). With one
/// or two iterations: the last. `None` when the list is empty.
pub fn representative(per_iteration: &[crate::report::IterationTimes]) -> Option<usize> {
    let n = per_iteration.len();
    let (first, end) = if n >= 3 { (1, n - 1) } else { (n.saturating_sub(1), n) };
    let mut idx: Vec<usize> = (first..end).collect();
    idx.sort_by(|&a, &b| per_iteration[a].iteration.total_cmp(&per_iteration[b].iteration).then(a.cmp(&b)));
    idx.get(idx.len().saturating_sub(1) / 2).copied()
}

/// Checks `cfg` before anything is measured. Errors (usage, exit 2): zero repeats or
/// iterations, sizes too small or too large for host memory, `--device` with DRAM, no GPU
/// for VRAM; (environment, exit 2) NIXL not usable (the sweeps need it).
pub fn check(cfg: &BenchConfig) -> Result<()> {
    crate::xfer::nixl::check_ucx_log_file()?;
    if cfg.repeats == 0 || cfg.iterations == 0 {
        return Err(Error::Usage("--repeats and --iterations must be at least 1".into()));
    }
    if cfg.host_bytes < 32 << 10 || cfg.gpu_bytes < 4 << 20 || cfg.sweep_bytes < 4 << 20 {
        return Err(Error::Usage("--host-bytes must be at least 32 KiB, --gpu-bytes and --sweep-bytes at least 4 MiB".into()));
    }
    if let Some(avail) = crate::sys::hostmem::available_bytes()
        && cfg.host_bytes.saturating_mul(2) > avail / 2
    {
        return Err(Error::Usage(format!(
            "--host-bytes {}: the bench needs twice that, and {} are available (use at most a quarter)",
            crate::sys::units::bytes_exact(cfg.host_bytes),
            crate::sys::units::bytes_exact(avail)
        )));
    }
    if let Some(avail) = crate::sys::hostmem::available_bytes()
        && cfg.memory == MemoryKind::Dram
        && cfg.sweep_bytes.saturating_mul(2) > avail / 2
    {
        return Err(Error::Usage(format!(
            "--sweep-bytes {}: the DRAM sweeps need two pools of that, and {} are available (use at most a quarter)",
            crate::sys::units::bytes_exact(cfg.sweep_bytes),
            crate::sys::units::bytes_exact(avail)
        )));
    }
    if cfg.memory == MemoryKind::Dram && (cfg.device != 0 || cfg.decode_device.is_some()) {
        return Err(Error::Usage("--device and --decode-device apply to --memory vram only".into()));
    }
    if cfg.memory == MemoryKind::Vram && crate::gpu::cuda::device_count() == 0 {
        return Err(Error::Usage("--memory vram: no CUDA GPU present (use --memory dram)".into()));
    }
    Ok(())
}

/// An empty report for `cfg`, with the environment (and NIXL loaded, if it can be).
pub fn start(cfg: &BenchConfig) -> BenchReport {
    let _ = crate::xfer::nixl::load();
    BenchReport {
        schema: SCHEMA.to_string(),
        started_unix: std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0),
        config: cfg.clone(),
        environment: crate::env::envinfo::gather(crate::env::envinfo::nixl_info()),
        figures: Vec::new(),
        breakdowns: Vec::new(),
        outcome: crate::report::Outcome { exit_code: 0, status: "clean".into(), error: None },
    }
}

/// Runs the bench into `r` (from [`start`]): the GPU figures (VRAM), the DRAM figures, then
/// the sweep breakdowns; figures measured before an error stay in `r`. Errors: [`check`]'s;
/// NIXL unusable (environment, exit 2); device (exit 3) when a kernel, a copy or a check of
/// the copied data fails; interrupted (130); a sweep that fails ends the bench with its
/// error (its row is kept, with `exit_code` and `error`).
pub fn run(cfg: &BenchConfig, r: &mut BenchReport) -> Result<()> {
    check(cfg)?;
    crate::xfer::nixl::load()?;
    if cfg.memory == MemoryKind::Vram {
        gpu_figures(cfg, &mut r.figures)?;
    }
    host_figures(cfg, &mut r.figures)?;
    let rate = |name: &str| r.figures.iter().find(|f| f.name == name).map(|f| f.gbps / 2.0);
    // vLLM-shaped: block_size 16 (32 KiB slices). Wide: the largest block_size up to 1024
    // (2 MiB slices) that still gives 8 blocks, so descriptors are few and large.
    let llama = llama_pool_geometry(cfg.sweep_bytes)?;
    let mut wide = llama.clone();
    let per_token = llama.slice_bytes()? / llama.block_size as u64; // bytes per token per layer and K/V
    let target = cfg.sweep_bytes / 8 / (llama.num_layers as u64 * 2) / per_token;
    wide.block_size = (1u64 << (63 - target.max(16).leading_zeros())).min(1024) as u32;
    wide.num_blocks = 1;
    wide.num_blocks = (cfg.sweep_bytes / wide.pool_bytes()?).max(2) as u32;
    // The transfer is compared to one copy over the same path: across GPUs the peer copy
    // (bytes moved once), else half the read+written copy rate.
    let peer = r.figures.iter().find(|f| f.name == "gpu.peer_copy").map(|f| f.gbps);
    let one_way = match cfg.memory {
        MemoryKind::Vram => peer.or(rate("gpu.copy")),
        MemoryKind::Dram => rate("cpu.memcpy.all"),
    };
    // vLLM-shaped first; then the same pool with runs of blocks moved as one descriptor
    // (the per-descriptor cost of the path), the largest of them again pipelined in 8 stages
    // (the probe's passes overlapping the transfer); then the wide slices.
    let mut sweeps = vec![(llama.clone(), 1, None)];
    for n in [16, llama.num_blocks] {
        if n > 1 && llama.num_blocks.is_multiple_of(n) && sweeps.iter().all(|(_, m, _)| *m != n) {
            sweeps.push((llama.clone(), n, None));
        }
    }
    let largest = sweeps.last().map(|(_, n, _)| *n).unwrap_or(1);
    sweeps.push((llama.clone(), largest, Some(8)));
    if wide.block_size != llama.block_size {
        sweeps.push((wide, 1, None)); // too small a --sweep-bytes for larger slices: no wide sweep
    }
    let count = sweeps.len();
    for (k, (g, n, stages)) in sweeps.into_iter().enumerate() {
        let mut label = format!("llama3-8b, block_size {}: {} KiB slices", g.block_size, g.slice_bytes()? >> 10);
        if n > 1 {
            label += &format!(", {n} blocks per descriptor ({} KiB)", (g.slice_bytes()? * n as u64) >> 10);
        }
        if let Some(st) = stages {
            label += &format!(", pipelined in {} stages", st.min(g.num_layers));
        }
        if cfg.decode_process {
            label += ", prefill in a second process";
        }
        if let Some(d) = cfg.decode_device.filter(|&d| d != cfg.device && cfg.memory == MemoryKind::Vram) {
            label += &format!(", GPU {} -> GPU {d}", cfg.device);
        }
        crate::sys::progress::announce(&format!("bench: sweep {}/{count}: {label} ({} iterations)", k + 1, cfg.iterations));
        let b = breakdown(cfg, &label, cfg.memory, g, (n, stages), one_way);
        let failed = (b.exit_code != 0).then(|| (b.exit_code, b.error.clone().unwrap_or_default(), b.label.clone()));
        r.breakdowns.push(b);
        if let Some((code, msg, label)) = failed {
            // The sweep's own message without its kind prefix, which the new error adds back.
            let msg = ["transport error: ", "device error: ", "timeout: "]
                .iter()
                .find_map(|p| msg.strip_prefix(p))
                .unwrap_or(&msg)
                .to_string();
            return Err(match code {
                1 => Error::Corrupt(format!("the sweep ({label}) found corrupt block slices")),
                130 => Error::Interrupted(format!("during the sweep ({label})")),
                4 => Error::Timeout(format!("sweep ({label}): {msg}")),
                3 => Error::Transport(format!("sweep ({label}): {msg}")),
                _ => Error::Usage(format!("sweep ({label}): {msg}")),
            });
        }
    }
    // After the sweeps: a backend that cannot start fails the first sweep, which keeps its
    // breakdown (and says why) in the results. DRAM benches only: in a process whose CUDA
    // contexts were opened and closed by the VRAM figures and sweeps, a new NIXL agent over host
    // pools crashed inside libcuda (SIGSEGV, UCX's CUDA memory hooks; H200, driver 580, 2026-12-01).
    if cfg.memory == MemoryKind::Dram {
        request_figures(cfg, &mut r.figures)?;
    } else {
        crate::sys::progress::announce(
            "bench: NIXL request rows: measured by `kvprobe bench --memory dram` (not after VRAM sweeps)",
        );
    }
    Ok(())
}

/// The human table: every figure with its rate, ratio and goal, then each breakdown.
pub fn render(r: &BenchReport) -> String {
    let mut s = format!("{:<44} {:>14} {:>10} {:>10}  {:<16} {}\n", "figure", "bytes", "median s", "GB/s", "ratio", "goal");
    for f in &r.figures {
        let ratio = match (&f.ratio, &f.ratio_to) {
            (Some(x), Some(to)) => format!("{x:.3} of {}", to.rsplit('.').next().unwrap_or(to)),
            _ => "-".into(),
        };
        let goal = match (f.goal, f.meets) {
            (Some(g), Some(true)) => format!(">= {g} met"),
            (Some(g), _) => format!(">= {g} MISSED"),
            _ => String::new(),
        };
        s += &format!(
            "{:<44} {:>14} {:>10.6} {:>10.2}  {:<16} {}\n",
            format!("{} ({})", f.what, f.counted),
            f.bytes,
            f.seconds_median,
            f.gbps,
            ratio,
            goal
        );
    }
    for b in &r.breakdowns {
        s += &format!(
            "\nsweep iteration, {:?} pools, {} (pool {} MiB, {} iterations, exit {}{})\n",
            b.memory,
            b.label,
            b.pool_bytes >> 20,
            b.iterations,
            b.exit_code,
            b.error.as_deref().map(|e| format!(": {e}")).unwrap_or_default()
        );
        if b.representative_iteration > 0 {
            s += &format!(
                "  iteration {} of {}, the median by wall time{}; its parts add up to it\n",
                b.representative_iteration,
                b.iterations,
                if b.iterations > 1 { " of those after the first (a warm-up)" } else { "" }
            );
        }
        let pct = |x: f64| if b.iteration_s > 0.0 { 100.0 * x / b.iteration_s } else { 0.0 };
        for (name, x) in [
            ("fill", b.fill_s),
            ("poison", b.poison_s),
            ("transfer", b.transfer_s),
            ("verify", b.verify_s),
            ("host work", b.host_s),
            ("hidden", b.overlapped_s),
            ("iteration", b.iteration_s),
        ] {
            if name == "hidden" {
                let stages = if b.pipeline_stages == 1 { "1 stage".to_string() } else { format!("{} stages", b.pipeline_stages) };
                s += &format!("  {name:<10} {x:>10.6} s  (probe work inside the transfer window, {stages})\n");
            } else {
                s += &format!("  {name:<10} {x:>10.6} s  {:>5.1} %\n", pct(x));
            }
        }
        if b.memory == MemoryKind::Vram {
            s += &format!(
                "  kernels (device time): fill {:.6} s, poison {:.6} s, verify {:.6} s\n",
                b.kernel_s.fill, b.kernel_s.poison, b.kernel_s.verify
            );
        }
        if let Some(p) = &b.path {
            s += &format!("  path: {p}\n");
        }
        s += &format!(
            "  transfer {}{}; probe share {:.1} % ({}); start to first transfer {:.2} s\n",
            rate_words(b.transfer_gbps, b.emulated),
            b.transfer_ratio.map(|r| format!(" = {r:.3} of the one-way copy rate")).unwrap_or_default(),
            100.0 * b.probe_share,
            match b.meets {
                Some(true) => format!("goal <= {:.0} % met", 100.0 * GOAL_PROBE_SHARE),
                Some(false) => format!("goal <= {:.0} % MISSED", 100.0 * GOAL_PROBE_SHARE),
                None => format!("goal applies from {OVERHEAD_APPLIES_GBPS} GB/s"),
            },
            b.setup_seconds
        );
    }
    s
}
