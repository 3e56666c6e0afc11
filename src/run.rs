//! `kvprobe run`: fingerprinted KV blocks → NIXL → per-block verification, iterated.
//!
//! Setup: both pools are allocated and registered, the roles exchange [`PeerInfo`], and
//! the prefill pool gets generation 0. Each iteration `g` (1-based):
//! 1. prefill refills every slice with generation `g` (fill kernel or CPU reference);
//!    injected faults on the prefill side are applied;
//! 2. decode re-poisons every slice with the pattern of (iteration, slot);
//! 3. a seeded random permutation maps prefill blocks to decode blocks (block ids differ
//!    between engines, as in vLLM); one NIXL request moves every block slice;
//! 4. decode verifies every slice in full against the logical block it should hold;
//!    failing slices are classified ([`crate::verify`]) and recorded.

use crate::cuda::{self, Device, Kernels};
use crate::engine::{Progress, ScenarioConfig};
use crate::error::{Error, Exit, Result};
use crate::fingerprint;
use crate::geometry::{Geometry, Preset, SliceCoord};
use crate::inject::{self, Action, Spec};
use crate::pool::{KvPool, MemoryKind, TableEntry};
use crate::report::{Failure, InjectionRecord, IterationTimes, Outcome, PredictedHit, Report, Summary};
use crate::transport::{self, Endpoint, Op, Pair};
use crate::verify::{self, Class};
use rand::SeedableRng;
use rand::seq::SliceRandom;
use rand_chacha::ChaCha8Rng;
use serde::Serialize;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Everything `kvprobe run` needs, resolved (preset expanded).
#[derive(Clone, Debug, Serialize)]
pub struct RunConfig {
    /// VRAM or DRAM pools.
    pub memory: MemoryKind,
    /// GPU of the prefill pool (VRAM).
    pub prefill_device: usize,
    /// GPU of the decode pool (VRAM).
    pub decode_device: usize,
    /// The preset the geometry started from, if any.
    pub preset: Option<Preset>,
    /// KV geometry (the same on both sides).
    pub geometry: Geometry,
    /// READ (decode pulls) or WRITE (prefill pushes).
    pub op: Op,
    /// Iterations (≥ 1).
    pub iterations: u32,
    /// Fingerprint and scheduling seed.
    pub seed: u64,
    /// Faults to plant.
    pub inject: Vec<Spec>,
    /// NIXL backend plugin.
    pub backend: String,
    /// Seconds to wait for each transfer.
    pub timeout_secs: f64,
    /// Minimum acceptable transfer rate (GB/s, 1e9 B/s), if any.
    pub min_gbps: Option<f64>,
    /// Cap on failures listed in the report (counts stay complete).
    pub max_failures: usize,
    /// Request-level load with a tier and race mechanisms (`--scenario`); `None` runs the
    /// whole-pool sweep of `iterations`.
    pub scenario: Option<ScenarioConfig>,
}

/// Callbacks a run reports through.
pub struct Hooks<'a> {
    /// One line per sweep iteration.
    pub line: &'a mut dyn FnMut(&str),
    /// Scenario runs: live counters, about every 100 ms.
    pub progress: &'a mut dyn FnMut(&Progress),
    /// Scenario runs: seconds between checkpoints (0 = none).
    pub checkpoint_secs: f64,
    /// Scenario runs: called with the report so far at each checkpoint.
    pub checkpoint: &'a mut dyn FnMut(&Report),
}

/// Logical block id of prefill slot `i`: a seeded bijection of u32 (so logical ≠ physical).
pub fn logical_block(seed: u64, i: u32) -> u32 {
    i.wrapping_mul(0x9E37_79B1) ^ (seed as u32).rotate_left(7)
}

/// Both roles, set up and connected.
pub(crate) struct Probe {
    cfg: RunConfig,
    pub(crate) prefill: Endpoint,
    pub(crate) decode: Endpoint,
}

fn check_config(cfg: &RunConfig) -> Result<()> {
    cfg.geometry.validate()?;
    inject::check(&cfg.inject, &cfg.geometry)?;
    if cfg.memory == MemoryKind::Dram && (cfg.prefill_device != 0 || cfg.decode_device != 0) {
        return Err(Error::Usage("--prefill-device and --decode-device apply to --memory vram only".into()));
    }
    if cfg.max_failures > 1_000_000 {
        return Err(Error::Usage("--max-failures must be at most 1000000 (each listed failure stays in memory)".into()));
    }
    if cfg.iterations == 0 {
        return Err(Error::Usage("--iterations must be at least 1".into()));
    }
    if cfg.iterations >= 0x00FF_FFFF {
        return Err(Error::Usage("--iterations must be below 16777215 (poison patterns carry 24 bits)".into()));
    }
    if !(cfg.timeout_secs.is_finite() && cfg.timeout_secs > 0.0) {
        return Err(Error::Usage("--timeout must be a positive number of seconds".into()));
    }
    if Duration::try_from_secs_f64(cfg.timeout_secs).is_err() || cfg.timeout_secs > 1e9 {
        return Err(Error::Usage("--timeout must be at most 1e9 seconds".into()));
    }
    if let Some(m) = cfg.min_gbps
        && !(m.is_finite() && m >= 0.0)
    {
        return Err(Error::Usage("--min-gbps must be a non-negative number".into()));
    }
    if let Some(sc) = &cfg.scenario {
        if !cfg.inject.is_empty() {
            return Err(Error::Usage("--inject applies to the whole-pool sweep; scenarios plant faults with --race".into()));
        }
        if cfg.op != Op::Read {
            return Err(Error::Usage(
                "scenarios follow NixlConnector's flow (decode READs); --op write applies to the sweep only".into(),
            ));
        }
        crate::engine::check(sc, cfg.geometry.num_blocks)?;
        if let Some(ext) = &sc.mooncake {
            if sc.tier != crate::engine::TierKind::Mooncake {
                return Err(Error::Usage("--mooncake-master and --mooncake-metadata need --tier mooncake".into()));
            }
            ext.validate()?;
            // Up front, so `ab` does not find out at its first tier row.
            ext.reachable(std::time::Duration::from_secs(5))?;
        }
        if sc.tier == crate::engine::TierKind::Mooncake {
            crate::mooncake::find()?; // refuse up front, not at the first row that needs it
        }
        if cfg.min_gbps.is_some() && !sc.scenario.uses_nixl() {
            return Err(Error::Usage("--min-gbps measures NIXL transfers; tier-only moves nothing over NIXL".into()));
        }
    }
    Ok(())
}

/// Host bytes kvprobe and NIXL keep per block slice (descriptor lists, transfer plans):
/// an upper bound measured on DRAM runs (about 285 B seen), used to refuse runs up front.
pub const HOST_BYTES_PER_SLICE: u64 = 512;

/// Refuses, before allocating, a run whose host memory (DRAM pools plus per-slice
/// bookkeeping) exceeds what this process may allocate ([`crate::hostmem::available_bytes`]).
fn check_host_memory(cfg: &RunConfig) -> Result<()> {
    let g = &cfg.geometry;
    let mut pools = if cfg.memory == MemoryKind::Dram { g.pool_bytes()?.saturating_mul(2) } else { 0 };
    if let Some(sc) = cfg.scenario.as_ref().filter(|s| s.scenario.uses_tier()) {
        let block = g.num_layers as u64 * g.kv_parts() as u64 * g.slice_bytes()?;
        let tier = block.saturating_mul(sc.tier_blocks as u64);
        pools = pools.saturating_add(tier);
        if let Some(avail) = crate::hostmem::available_bytes()
            && tier > avail / 2
        {
            return Err(Error::Usage(format!(
                "the tier of {} blocks x {block} bytes = {tier} bytes of host memory is more than half of the {avail} available; lower --tier-blocks (at least 2 x --concurrency x max --prompt-blocks = {} are needed)",
                sc.tier_blocks,
                2 * sc.concurrency as u64 * sc.workload.max_blocks as u64
            )));
        }
    }
    let need = pools.saturating_add(g.total_slices()?.saturating_mul(HOST_BYTES_PER_SLICE));
    if let Some(avail) = crate::hostmem::available_bytes()
        && need > avail
    {
        return Err(Error::Usage(format!(
            "the run needs about {need} bytes of host memory ({pools} for DRAM pools and the tier + {HOST_BYTES_PER_SLICE} per block slice); {avail} are available (MemAvailable / cgroup limit)"
        )));
    }
    Ok(())
}

fn build_pools(cfg: &RunConfig) -> Result<(KvPool, KvPool)> {
    let g = &cfg.geometry;
    match cfg.memory {
        MemoryKind::Dram => {
            // The Mooncake worker maps both pools: they must be shareable (memfd-backed).
            let mooncake = cfg.scenario.as_ref().is_some_and(|s| s.tier == crate::engine::TierKind::Mooncake);
            let alloc = if mooncake { KvPool::host_shareable } else { KvPool::host };
            Ok((alloc(g, cfg.seed)?, alloc(g, cfg.seed)?))
        }
        MemoryKind::Vram => {
            if cuda::device_count() == 0 {
                return Err(Error::Environment("--memory vram needs a CUDA GPU and none was found (use --memory dram)".into()));
            }
            let pd = Device::open(cfg.prefill_device)?;
            let dd = if cfg.decode_device == cfg.prefill_device { pd.clone() } else { Device::open(cfg.decode_device)? };
            let pk = Arc::new(Kernels::compile(&pd)?);
            let dk = if Arc::ptr_eq(&pd, &dd) { pk.clone() } else { Arc::new(Kernels::compile(&dd)?) };
            let p = KvPool::device(&pd, pk, g, cfg.seed)?;
            let d = KvPool::device(&dd, dk, g, cfg.seed)?;
            Ok((p, d))
        }
    }
}

impl Probe {
    pub(crate) fn setup(cfg: &RunConfig) -> Result<Probe> {
        let (p, d) = build_pools(cfg)?;
        Self::connect(cfg, p, d).map_err(|e| match e {
            // Before any transfer, a NIXL refusal means this backend cannot serve these pools.
            Error::Transport(m) => Error::Environment(format!(
                "NIXL backend {} cannot serve {} pools: {m}",
                cfg.backend,
                if cfg.memory == MemoryKind::Vram { "VRAM" } else { "DRAM" }
            )),
            e => e,
        })
    }

    fn connect(cfg: &RunConfig, p: KvPool, d: KvPool) -> Result<Probe> {
        let mut prefill = Endpoint::new("kvprobe-prefill", &cfg.backend, p)?;
        let mut decode = Endpoint::new("kvprobe-decode", &cfg.backend, d)?;
        let pi = prefill.info()?;
        let di = decode.info()?;
        prefill.connect(di)?;
        decode.connect(pi)?;
        let mut probe = Probe { cfg: cfg.clone(), prefill, decode };
        let t0 = probe.source_table(0);
        probe.prefill.pool.fill(&t0)?;
        Ok(probe)
    }

    fn source_table(&self, generation: u32) -> Vec<TableEntry> {
        (0..self.cfg.geometry.num_blocks).map(|i| TableEntry { block: logical_block(self.cfg.seed, i), generation }).collect()
    }

    /// Applies prefill-side faults after the fill.
    fn apply_source_faults(&mut self, actions: &[Action], generation: u32) -> Result<()> {
        let sb = self.cfg.geometry.slice_bytes()? as usize;
        for a in actions {
            match *a {
                Action::Stale { at } => {
                    let id = fingerprint::BlockIdentity {
                        layer: at.layer,
                        kv: at.kv,
                        block: logical_block(self.cfg.seed, at.block),
                        generation: generation - 1,
                    };
                    let bytes = fingerprint::expected(sb, self.cfg.seed, id);
                    self.prefill.pool.write_slice(at, &bytes)?;
                }
                Action::Bitflip { at, offset, bit } => {
                    let mut buf = vec![0u8; sb];
                    self.prefill.pool.read_slice(at, &mut buf)?;
                    buf[offset as usize] ^= 1 << bit;
                    self.prefill.pool.write_slice(at, &buf)?;
                }
                _ => {}
            }
        }
        Ok(())
    }

    fn pairs(&self, perm: &[u32], actions: &[Action]) -> Result<Vec<Pair>> {
        let g = &self.cfg.geometry;
        let sb = g.slice_bytes()?;
        let dst_of = |c: SliceCoord| SliceCoord { block: perm[c.block as usize], ..c };
        let mut special: HashMap<SliceCoord, Option<Pair>> = HashMap::new();
        for a in actions {
            match *a {
                Action::Drop { at } => {
                    special.insert(at, None);
                }
                Action::Torn { at, len } => {
                    special.insert(at, Some(Pair { src: at, dst: dst_of(at), len }));
                }
                Action::Misroute { from, to } => {
                    special.insert(from, Some(Pair { src: from, dst: dst_of(to), len: sb }));
                    special.insert(to, None);
                }
                Action::Bitflip { .. } | Action::Stale { .. } => {}
            }
        }
        Ok(g.coords()
            .filter_map(|c| match special.get(&c) {
                Some(p) => *p,
                None => Some(Pair { src: c, dst: dst_of(c), len: sb }),
            })
            .collect())
    }
}

/// The report of a run refused before it started (its outcome carries `e`).
pub fn failed_report(cfg: &RunConfig, e: &Error) -> Report {
    let mut r = empty_report(cfg);
    r.finish(e.exit(), Some(e));
    r
}

/// A report with no results yet (status "running").
pub(crate) fn empty_report(cfg: &RunConfig) -> Report {
    Report {
        schema: crate::report::SCHEMA,
        started_unix: std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0),
        config: serde_json::to_value(cfg).unwrap_or(serde_json::Value::Null),
        environment: None,
        summary: Summary::new(),
        failures: Vec::new(),
        injections: Vec::new(),
        scenario: None,
        outcome: Outcome { exit_code: 0, status: "running".into(), error: None },
    }
}

/// Runs the probe: the whole-pool sweep, or one scenario when `cfg.scenario` is set. Never
/// panics on bad input: every outcome, including errors, comes back as a report with its
/// exit code.
pub fn run(cfg: &RunConfig, hooks: &mut Hooks<'_>) -> (Report, Exit) {
    let mut report = empty_report(cfg);
    let result = run_inner(cfg, &mut report, hooks);
    let corrupt = report.summary.blocks_corrupt > 0;
    let (exit, err) = match (&result, corrupt) {
        (_, true) => (Exit::Corrupt, result.as_ref().err()),
        (Err(e), false) => (e.exit(), Some(e)),
        (Ok(()), false) => match cfg.min_gbps {
            Some(m) if report.summary.transfer_gbps < m => (Exit::BelowRate, None),
            _ => (Exit::Clean, None),
        },
    };
    report.finish(exit, err);
    (report, exit)
}

/// Checks the configuration and host memory, loads NIXL and records the environment in
/// `report`; the common start of `run` and `ab`.
pub(crate) fn prepare(cfg: &RunConfig, report: &mut Report) -> Result<()> {
    crate::nixl::prepare_ucx_env(cfg.memory == MemoryKind::Vram && cfg.prefill_device == cfg.decode_device);
    crate::nixl::check_ucx_log_file()?;
    let lib = crate::nixl::load();
    report.environment = Some(crate::envinfo::gather(crate::envinfo::nixl_info()));
    check_config(cfg)?;
    check_host_memory(cfg)?;
    lib?;
    Ok(())
}

fn run_inner(cfg: &RunConfig, report: &mut Report, hooks: &mut Hooks<'_>) -> Result<()> {
    let started = Instant::now();
    prepare(cfg, report)?;
    let ucx_mark = crate::ucx::mark();
    let mut probe = Probe::setup(cfg)?;
    crate::ucx::adopt();
    if let Some(sc) = &cfg.scenario {
        let timeout = Duration::from_secs_f64(cfg.timeout_secs);
        return crate::engine::run_scenario(
            sc,
            cfg.seed,
            &mut probe.prefill,
            &mut probe.decode,
            timeout,
            cfg.max_failures,
            report,
            hooks.progress,
            (hooks.checkpoint_secs, hooks.checkpoint),
        );
    }
    let progress = &mut hooks.line;
    let g = cfg.geometry.clone();
    let sb = g.slice_bytes()? as usize;
    let total = g.total_slices()?;
    let pool_bytes = g.pool_bytes()?;
    let timeout = Duration::from_secs_f64(cfg.timeout_secs);
    let mut buf = vec![0u8; sb];
    let mut copy_gbps = None;
    for it in 1..=cfg.iterations {
        if crate::interrupt::requested() {
            return Err(Error::Interrupted(format!("after {} complete iterations", it - 1)));
        }
        let iteration_start = Instant::now();
        let mut rng = ChaCha8Rng::seed_from_u64(cfg.seed ^ (it as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
        let mut perm: Vec<u32> = (0..g.num_blocks).collect();
        perm.shuffle(&mut rng);
        let actions = inject::plan(&cfg.inject, &g, &mut rng);

        let src_table = probe.source_table(it);
        let mut times = IterationTimes::default();
        let t = Instant::now();
        probe.prefill.pool.fill(&src_table)?;
        times.fill = t.elapsed().as_secs_f64();
        times.kernels.fill = probe.prefill.pool.last_kernel_seconds().unwrap_or(0.0);
        if it == 1 {
            // The ceiling the transfer rate is compared to: one copy of the (fingerprinted)
            // pool, prefill to decode, on the same memory (decode is poisoned next anyway).
            // The second of two copies: the first warms up (page faults on DRAM).
            probe.decode.pool.copy_pool_from(&probe.prefill.pool)?;
            let secs = probe.decode.pool.copy_pool_from(&probe.prefill.pool)?;
            copy_gbps = Some(pool_bytes as f64 / secs.max(1e-12) / 1e9);
        }
        probe.apply_source_faults(&actions, it)?;
        let t = Instant::now();
        probe.decode.pool.poison(it)?;
        times.poison = t.elapsed().as_secs_f64();
        times.kernels.poison = probe.decode.pool.last_kernel_seconds().unwrap_or(0.0);
        let pairs = probe.pairs(&perm, &actions)?;
        if it == 1 {
            report.summary.setup_seconds = started.elapsed().as_secs_f64();
        }
        let xr = transport::transfer(cfg.op, &probe.prefill, &probe.decode, &pairs, &format!("kvprobe:iter={it}"), timeout)?;
        report.summary.bytes_transferred += xr.bytes;
        times.transfer = xr.elapsed.as_secs_f64();
        if it == 1 {
            let op = if cfg.op == Op::Write { "WRITE" } else { "READ" };
            let mut p = crate::ucx::path_since(ucx_mark, &cfg.backend, op, cfg.memory == MemoryKind::Vram);
            p.copy_gbps = copy_gbps;
            report.summary.transport_path = Some(p);
        }

        let mut dst_table = vec![TableEntry::default(); g.num_blocks as usize];
        let mut src_of = vec![0u32; g.num_blocks as usize];
        for (i, &d) in perm.iter().enumerate() {
            dst_table[d as usize] = src_table[i];
            src_of[d as usize] = i as u32;
        }
        let t = Instant::now();
        let fails = probe.decode.pool.verify(&dst_table)?;
        times.kernels.verify = probe.decode.pool.last_kernel_seconds().unwrap_or(0.0);
        report.summary.blocks_checked += total;

        let mut predicted: HashMap<SliceCoord, Class> = HashMap::new();
        for a in &actions {
            for (src, class) in a.predicted() {
                predicted.insert(SliceCoord { block: perm[src.block as usize], ..src }, class);
            }
        }
        let mut seen: HashMap<SliceCoord, Class> = HashMap::new();
        for f in &fails {
            let c = g.coord_of(f.slice);
            let expected = dst_table[c.block as usize].identity(c);
            probe.decode.pool.read_slice(c, &mut buf)?;
            let want = fingerprint::expected(sb, cfg.seed, expected);
            let v = verify::classify_against(&buf, &want, expected, cfg.seed, f.slice, it);
            seen.insert(c, v.class);
            if predicted.get(&c) != Some(&v.class) {
                report.summary.unexpected_failures += 1;
            }
            report.summary.blocks_corrupt += 1;
            *report.summary.by_class.entry(v.class.name().to_string()).or_default() += 1;
            if report.failures.len() < cfg.max_failures {
                report.failures.push(Failure::new(it, c, f, v, &want, &buf, expected, src_of[c.block as usize]));
            } else {
                report.summary.failures_omitted += 1;
            }
        }
        times.verify = t.elapsed().as_secs_f64();
        for a in &actions {
            let hits: Vec<PredictedHit> = a
                .predicted()
                .into_iter()
                .map(|(src, class)| PredictedHit { layer: src.layer, kv: src.kv, block: perm[src.block as usize], class })
                .collect();
            let detected =
                hits.iter().all(|h| seen.get(&SliceCoord { layer: h.layer, kv: h.kv, block: h.block }) == Some(&h.class));
            report.summary.injections_planted += 1;
            report.summary.injections_detected += detected as u64;
            report.injections.push(InjectionRecord { iteration: it, kind: a.kind(), predicted: hits, detected });
        }
        report.summary.iterations = it;
        times.iteration = iteration_start.elapsed().as_secs_f64();
        let s = &mut report.summary;
        s.fill_seconds += times.fill;
        s.poison_seconds += times.poison;
        s.transfer_seconds += times.transfer;
        s.verify_seconds += times.verify;
        s.iteration_seconds += times.iteration;
        s.kernel_seconds.fill += times.kernels.fill;
        s.kernel_seconds.poison += times.kernels.poison;
        s.kernel_seconds.verify += times.kernels.verify;
        if s.per_iteration.len() < crate::report::PER_ITERATION_MAX {
            s.per_iteration.push(times);
        }
        s.verify_gbps = pool_bytes as f64 * it as f64 / s.verify_seconds.max(1e-9) / 1e9;
        let s = &report.summary;
        report.summary.transfer_gbps =
            if s.transfer_seconds > 0.0 { s.bytes_transferred as f64 / s.transfer_seconds / 1e9 } else { 0.0 };
        let gbps = report.summary.transfer_gbps;
        if let Some(p) = report.summary.transport_path.as_mut() {
            p.ratio_to_copy = p.copy_gbps.map(|c| gbps / c.max(1e-12));
        }
        progress(&format!(
            "iteration {it}/{}: {} block slices, {} corrupt, {:.2} GB/s",
            cfg.iterations,
            total,
            fails.len(),
            if xr.elapsed.as_secs_f64() > 0.0 { xr.bytes as f64 / xr.elapsed.as_secs_f64() / 1e9 } else { 0.0 }
        ));
    }
    Ok(())
}
