//! The whole-pool sweep's plan, shared by both roles: the run's configuration
//! ([`RunConfig`]) and its checks, the pools it allocates, each iteration's block map and
//! injections (`plan`), prefill's fill of a stage (`fill_stage`) and the transfer pairs of
//! a stage (`stage_request`). Everything here is a function of the configuration alone, so
//! decode (`kvprobe run`, crate `run`) and prefill (`kvprobe serve`, crate `serve`, on this
//! host or another) plan the same iteration without sending it to each other.

use crate::cuda::{self, Device, Kernels};
use crate::error::{Error, Result};
use crate::fingerprint::{self, logical_block, seed_hex};
use crate::geometry::{Geometry, Preset, SliceCoord};
use crate::inject::{self, Action, Spec};
use crate::pool::{KvPool, MemoryKind, TableEntry};
use crate::scenario::config::ScenarioConfig;
use crate::transport::{Op, Pair};
use crate::verify::Class;
use rand::SeedableRng;
use rand::seq::SliceRandom;
use rand_chacha::ChaCha8Rng;
use serde::Serialize;
use std::collections::HashMap;
use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

/// Everything `kvprobe run` needs, resolved (preset expanded).
#[derive(Clone, Debug, Serialize, serde::Deserialize)]
pub struct RunConfig {
    /// VRAM or DRAM pools.
    pub memory: MemoryKind,
    /// GPU of the prefill pool (VRAM).
    pub prefill_device: usize,
    /// GPU of the decode pool (VRAM).
    pub decode_device: usize,
    /// The preset the geometry started from, if any.
    pub preset: Option<Preset>,
    /// What `--model-config` resolved to (the model, `--tp`'s split, `--kv-cache-dtype`);
    /// absent without it. The geometry below is one TP rank's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<crate::model_config::ModelInfo>,
    /// KV geometry (the same on both sides); reports add its `slice_bytes`.
    #[serde(serialize_with = "crate::geometry::serialize_with_slice_bytes")]
    pub geometry: Geometry,
    /// READ (decode pulls) or WRITE (prefill pushes).
    pub op: Op,
    /// Iterations (≥ 1).
    pub iterations: u32,
    /// The fingerprint definition of the run's slices ([`fingerprint::FORMAT`]).
    #[serde(default = "fingerprint::Format::before_version_2")]
    pub fingerprint: fingerprint::Format,
    /// Fingerprint and scheduling seed; reports write it as `seed` (an integer) and
    /// `seed_hex` ([`serialize_seed`]).
    #[serde(flatten, serialize_with = "serialize_seed", deserialize_with = "deserialize_seed")]
    pub seed: u64,
    /// Faults to plant.
    pub inject: Vec<Spec>,
    /// NIXL backend plugin.
    pub backend: String,
    /// Parameters set over the backend plugin's defaults when it is created
    /// (`--backend-param KEY=VALUE`; empty: the defaults). Absent in older reports.
    #[serde(default)]
    pub backend_params: std::collections::BTreeMap<String, String>,
    /// How each NIXL request is made (`--xfer-req`): `prepared` (descriptor lists prepared
    /// once per side, requests from slice indices, as vLLM's NixlConnector) or `create` (a
    /// descriptor list built per request). Absent in reports of kvprobes before the flag,
    /// which built every request with `createXferReq`: read as create.
    #[serde(default = "crate::transport::XferReq::before_the_flag")]
    pub xfer_req: crate::transport::XferReq,
    /// Bound of every wait, in seconds (`--timeout`): each transfer from just before it is
    /// posted to its completion and notification, each other blocking call ([`crate::deadline`]).
    pub timeout_secs: f64,
    /// Minimum acceptable transfer rate (GB/s, 1e9 B/s), if any.
    pub min_gbps: Option<f64>,
    /// Cap on failures listed in the report (counts stay complete).
    pub max_failures: usize,
    /// Sweep: blocks per NIXL descriptor (`--descriptor-blocks`, ≥ 1, divides num_blocks):
    /// the block map moves runs of this many consecutive blocks together and each run's
    /// contiguous slices travel as one descriptor. 1 = vLLM NixlConnector's per-block
    /// descriptors.
    pub descriptor_blocks: u32,
    /// Sweep: pipeline stages (`--pipeline-stages`; `None` = automatic, see [`stages`]).
    pub stages: Option<u32>,
    /// Sweep: prefill's NIXL agent and pool in a second kvprobe process (`--decode-process`:
    /// a child `kvprobe serve` on a socket pair, driven over the peer protocol as `--peer`
    /// drives a serve on another host), so the two agents live in two processes, as vLLM runs
    /// its engines.
    pub decode_process: bool,
    /// Request-level load with a tier and race mechanisms (`--scenario`); `None` runs the
    /// whole-pool sweep of `iterations`.
    pub scenario: Option<ScenarioConfig>,
    /// Node pair (`--peer HOST:PORT`): prefill is `kvprobe serve` there; this process is
    /// decode and drives the run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peer: Option<String>,
    /// `--token` / `KVPROBE_TOKEN` for `--peer` (never written to a report).
    #[serde(skip)]
    pub peer_token: Option<String>,
}

/// The seed as `seed` (a JSON integer, as before) and `seed_hex` (`"0x"` and 16 lowercase
/// hex digits): common JSON tools read integers as doubles and round seeds above 2^53 (jq
/// prints 18446744073709551615 as 18446744073709552000), a string keeps every bit. For
/// `#[serde(flatten, serialize_with = "serialize_seed")]` on a `u64` field named `seed`.
pub fn serialize_seed<S: serde::Serializer>(seed: &u64, s: S) -> std::result::Result<S::Ok, S::Error> {
    use serde::ser::SerializeMap;
    let mut m = s.serialize_map(Some(2))?;
    m.serialize_entry("seed", seed)?;
    m.serialize_entry("seed_hex", &seed_hex(*seed))?;
    m.end()
}

/// Reads back what [`serialize_seed`] wrote: the `seed` integer (for
/// `#[serde(flatten, deserialize_with = "deserialize_seed")]`; `seed_hex` is ignored).
pub fn deserialize_seed<'de, D: serde::Deserializer<'de>>(d: D) -> std::result::Result<u64, D::Error> {
    #[derive(serde::Deserialize)]
    struct Seed {
        seed: u64,
    }
    Ok(<Seed as serde::Deserialize>::deserialize(d)?.seed)
}

/// Checks a run's configuration (flags, geometry, injections). Errors: usage (exit 2).
pub(crate) fn check_config(cfg: &RunConfig) -> Result<()> {
    cfg.geometry.validate()?;
    // A sweep plants COUNT per iteration into the pool; a scenario COUNT in all, one per
    // request's READ ([`crate::scenario::config::check`]).
    if cfg.scenario.is_none() {
        inject::check(&cfg.inject, &cfg.geometry, &sweep_stages(cfg))?;
    } else if cfg.inject.iter().any(|s| s.kind == inject::Kind::Torn) && cfg.geometry.slice_bytes()? < 32 {
        return Err(Error::Usage(format!(
            "--inject torn needs block slices of at least 32 bytes (they are {})",
            cfg.geometry.slice_bytes()?
        )));
    }
    if cfg.memory == MemoryKind::Dram && (cfg.prefill_device != 0 || cfg.decode_device != 0) {
        return Err(Error::Usage("--prefill-device and --decode-device apply to --memory vram only".into()));
    }
    if cfg.max_failures > 1_000_000 {
        return Err(Error::Usage("--max-failures must be at most 1000000 (each listed failure stays in memory)".into()));
    }
    if cfg.iterations == 0 {
        return Err(Error::Usage("--iterations must be at least 1".into()));
    }
    if cfg.xfer_req == crate::transport::XferReq::Prepared && cfg.geometry.total_slices()? > crate::transport::MAX_PREPARED_SLICES
    {
        return Err(Error::Usage(format!(
            "--xfer-req prepared: the pool has {} block slices, and NIXL's makeXferReq indexes at most {}; use --xfer-req create",
            cfg.geometry.total_slices()?,
            crate::transport::MAX_PREPARED_SLICES
        )));
    }
    let n = cfg.descriptor_blocks;
    if n == 0 || !cfg.geometry.num_blocks.is_multiple_of(n) {
        return Err(Error::Usage(format!(
            "--descriptor-blocks must be at least 1 and divide --blocks ({}); got {n}",
            cfg.geometry.num_blocks
        )));
    }
    if cfg.decode_process && cfg.scenario.is_some() {
        return Err(Error::Usage("--decode-process applies to the whole-pool sweep".into()));
    }
    if let Some(st) = cfg.stages
        && (st == 0 || st > cfg.geometry.num_layers)
    {
        return Err(Error::Usage(format!(
            "--pipeline-stages must be between 1 and the number of layers ({}); got {st}",
            cfg.geometry.num_layers
        )));
    }
    if cfg.iterations > MAX_ITERATIONS {
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
        crate::scenario::config::check(sc, cfg.geometry.num_blocks)?;
        if let Some(ext) = &sc.mooncake {
            if sc.tier != crate::tier::TierKind::Mooncake {
                return Err(Error::Usage("--mooncake-master and --mooncake-metadata need --tier mooncake".into()));
            }
            ext.validate()?;
            // Up front, so `ab` does not find out at its first tier row.
            ext.reachable(std::time::Duration::from_secs(5))?;
        }
        if sc.tier == crate::tier::TierKind::Mooncake {
            crate::mooncake::find()?; // refuse up front, not at the first row that needs it
        }
        if cfg.min_gbps.is_some() && !sc.scenario.uses_nixl() {
            return Err(Error::Usage("--min-gbps measures NIXL transfers; tier-only moves nothing over NIXL".into()));
        }
    }
    Ok(())
}

/// The most iterations a sweep accepts (`--iterations`, 16777214 = 2^24 − 2): poison patterns
/// carry the iteration in 24 bits, and a sweep's generations (1..=iterations, the prefill
/// refill of iteration `it + 1` included) stay below [`fingerprint::SKIP_GEN`] — checked at compile time.
pub const MAX_ITERATIONS: u32 = 0x00FF_FFFE;
const _: () = assert!(MAX_ITERATIONS < 0x00FF_FFFF && MAX_ITERATIONS < fingerprint::SKIP_GEN - 1);

/// Host bytes kvprobe and NIXL keep per block slice (descriptor lists, transfer plans):
/// an upper bound measured on DRAM runs (about 285 B seen), used to refuse runs up front.
pub const HOST_BYTES_PER_SLICE: u64 = 512;

/// Refuses, before allocating, a run whose host memory (DRAM pools plus per-slice
/// bookkeeping) exceeds what this process may allocate ([`crate::hostmem::available_bytes`]).
pub(crate) fn check_host_memory(cfg: &RunConfig) -> Result<()> {
    let g = &cfg.geometry;
    // DRAM: both pools on this host, or decode's alone across a node pair (`--peer`); with
    // --decode-process prefill's is in the child, and this process holds a scratch pool of the
    // same size while it times the copy ceiling ([`copy_ceiling_from_scratch`]).
    let here = if cfg.peer.is_some() { 1 } else { 2 };
    let mut pools = if cfg.memory == MemoryKind::Dram { g.pool_bytes()?.saturating_mul(here) } else { 0 };
    if let Some(sc) = cfg.scenario.as_ref().filter(|s| s.scenario.uses_tier()) {
        let block = g.num_layers as u64 * g.kv_parts() as u64 * g.slice_bytes()?;
        let tier = block.saturating_mul(sc.tier_blocks as u64);
        pools = pools.saturating_add(tier);
        if let Some(avail) = crate::hostmem::available_bytes()
            && tier > avail / 2
        {
            return Err(Error::Usage(format!(
                "the tier of {} blocks x {} = {} of host memory is more than half of the {} available; lower --tier-blocks (at least 2 x --concurrency x max --prompt-blocks = {} are needed)",
                sc.tier_blocks,
                crate::units::bytes_exact(block),
                crate::units::bytes_exact(tier),
                crate::units::bytes_exact(avail),
                2 * sc.concurrency as u64 * sc.workload.max_blocks as u64
            )));
        }
    }
    let need = pools.saturating_add(g.total_slices()?.saturating_mul(HOST_BYTES_PER_SLICE));
    if let Some(avail) = crate::hostmem::available_bytes()
        && need > avail
    {
        return Err(Error::Usage(format!(
            "the run needs about {} of host memory ({} for {} + {HOST_BYTES_PER_SLICE} bytes per block slice); {} are available (MemAvailable / cgroup limit)",
            crate::units::bytes_exact(need),
            crate::units::bytes_exact(pools),
            match (cfg.memory == MemoryKind::Dram, cfg.scenario.as_ref().is_some_and(|s| s.scenario.uses_tier())) {
                (true, true) => "the DRAM pools and the tier",
                (true, false) if cfg.peer.is_some() => "decode's DRAM pool",
                (true, false) => "the DRAM pools",
                (false, true) => "the tier",
                (false, false) => "host buffers",
            },
            crate::units::bytes_exact(avail)
        )));
    }
    Ok(())
}

/// A DRAM pool of `cfg`: shareable (memfd-backed) when a scenario's Mooncake store client
/// maps it, else private.
fn host_pool(cfg: &RunConfig) -> Result<KvPool> {
    match cfg.scenario.as_ref().is_some_and(|s| s.tier == crate::tier::TierKind::Mooncake) {
        true => KvPool::host_shareable(&cfg.geometry, cfg.seed),
        false => KvPool::host(&cfg.geometry, cfg.seed),
    }
}

/// Decode's pool alone (`run --peer`, `run --decode-process`: prefill's is on the other side).
pub(crate) fn build_decode_pool(cfg: &RunConfig) -> Result<KvPool> {
    match cfg.memory {
        MemoryKind::Dram => host_pool(cfg),
        MemoryKind::Vram => {
            if cuda::device_count() == 0 {
                return Err(Error::Environment("--memory vram needs a CUDA GPU and none was found (use --memory dram)".into()));
            }
            let d = Device::open(cfg.decode_device)?;
            let k = Arc::new(Kernels::compile(&d)?);
            KvPool::device(&d, k, &cfg.geometry, cfg.seed)
        }
    }
}

/// Prefill's pool alone, on `memory` and `device` (`serve`).
pub(crate) fn build_prefill_pool(cfg: &RunConfig, memory: MemoryKind, device: usize) -> Result<KvPool> {
    match memory {
        MemoryKind::Dram => host_pool(cfg),
        MemoryKind::Vram => {
            if cuda::device_count() == 0 {
                return Err(Error::Environment("serve --memory vram needs a CUDA GPU and none was found".into()));
            }
            let d = Device::open(device)?;
            let k = Arc::new(Kernels::compile(&d)?);
            KvPool::device(&d, k, &cfg.geometry, cfg.seed)
        }
    }
}

/// Before any transfer, a NIXL refusal (transport, exit 3) to create an agent, register a
/// pool or load a peer's metadata means `backend` cannot serve `memory` pools: environment
/// (exit 2), the message saying so. Other errors are returned as they are.
pub(crate) fn backend_refusal(backend: &str, memory: MemoryKind, e: Error) -> Error {
    match e {
        // Two agents that disagree on the peer's regions (checkRemoteMD, region lengths) are
        // not a backend that cannot serve the pools.
        Error::Transport(m) if !["checkRemoteMD", " announced "].iter().any(|w| m.contains(w)) => Error::Environment(format!(
            "NIXL backend {backend} cannot serve {} pools: {m}",
            if memory == MemoryKind::Vram { "VRAM" } else { "DRAM" }
        )),
        e => e,
    }
}

/// Both pools, in this process.
pub(crate) fn build_pools(cfg: &RunConfig) -> Result<(KvPool, KvPool)> {
    let g = &cfg.geometry;
    match cfg.memory {
        // Each engine's Mooncake store client maps its pool: with that tier, shareable.
        MemoryKind::Dram => Ok((host_pool(cfg)?, host_pool(cfg)?)),
        MemoryKind::Vram => {
            if cuda::device_count() == 0 {
                return Err(Error::Environment("--memory vram needs a CUDA GPU and none was found (use --memory dram)".into()));
            }
            let pd = Device::open(cfg.prefill_device)?;
            let pk = Arc::new(Kernels::compile(&pd)?);
            let p = KvPool::device(&pd, pk.clone(), g, cfg.seed)?;
            let dd = if cfg.decode_device == cfg.prefill_device { pd.clone() } else { Device::open(cfg.decode_device)? };
            let dk = if Arc::ptr_eq(&pd, &dd) { pk } else { Arc::new(Kernels::compile(&dd)?) };
            let d = KvPool::device(&dd, dk, g, cfg.seed)?;
            Ok((p, d))
        }
    }
}

/// What each prefill slot holds in generation `generation`: slot `i` holds logical block
/// [`logical_block`]`(seed, i)`.
fn source_table(cfg: &RunConfig, generation: u32) -> Vec<TableEntry> {
    (0..cfg.geometry.num_blocks).map(|i| TableEntry::new(logical_block(cfg.seed, i), generation)).collect()
}

/// Plans sweep iteration `it`: the block map (a seeded random permutation of runs of
/// `descriptor_blocks` consecutive blocks; runs of one block for vLLM's per-block
/// descriptors), the injections, and the tables both sides check against. A function of
/// the configuration alone, so that both sides of a node pair plan the same iteration.
pub(crate) fn plan(cfg: &RunConfig, it: u32) -> Result<Plan> {
    let g = &cfg.geometry;
    let n = cfg.descriptor_blocks.max(1);
    let mut rng = ChaCha8Rng::seed_from_u64(cfg.seed ^ (it as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
    let mut runs: Vec<u32> = (0..g.num_blocks / n).collect();
    runs.shuffle(&mut rng);
    let perm: Vec<u32> = (0..g.num_blocks).map(|b| runs[(b / n) as usize] * n + b % n).collect();
    let actions = inject::plan(&cfg.inject, g, &sweep_stages(cfg), it == cfg.iterations, &mut rng);
    let src_table = source_table(cfg, it);
    let mut dst_table = vec![TableEntry::default(); g.num_blocks as usize];
    let mut src_of = vec![0u32; g.num_blocks as usize];
    for (i, &d) in perm.iter().enumerate() {
        dst_table[d as usize] = src_table[i];
        src_of[d as usize] = i as u32;
    }
    let sb = g.slice_bytes()?;
    let dst_of = |c: SliceCoord| SliceCoord { block: perm[c.block as usize], ..c };
    let mut special: HashMap<SliceCoord, Option<Pair>> = HashMap::new();
    for a in &actions {
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
            Action::Bitflip { .. } | Action::Stale { .. } | Action::Stray { .. } => {}
        }
    }
    let strays = actions
        .iter()
        .filter_map(|a| match *a {
            Action::Stray { from, at, carrier } => Some((carrier as usize, Pair { src: from, dst: dst_of(at), len: sb })),
            _ => None,
        })
        .collect();
    let mut predicted = HashMap::new();
    for a in &actions {
        for (src, class) in a.predicted() {
            predicted.insert(dst_of(src), class);
        }
    }
    Ok(Plan { it, perm, actions, src_table, dst_table, src_of, special, predicted, strays })
}

/// Prefill's part of a sweep iteration on `pool`: fills `stage` of `stages` (every layer:
/// `None`) with `plan`'s generation — loading `plan`'s table first when the stage is the
/// iteration's first — waits for the fill when `wait`, and plants `plan`'s prefill-side faults
/// there. The in-process sweep and `serve` both fill through it.
pub(crate) fn fill_stage(
    cfg: &RunConfig,
    pool: &mut KvPool,
    plan: &Plan,
    stages: &[Range<u32>],
    stage: Option<usize>,
    wait: bool,
) -> Result<()> {
    if stage.is_none_or(|k| k == 0) {
        pool.load_table(&plan.src_table)?;
    }
    let layers = stage.map_or(0..cfg.geometry.num_layers, |k| stages[k].clone());
    pool.fill_layers(layers.clone())?;
    if wait {
        pool.finish()?;
    }
    apply_source_faults(cfg, pool, plan, &layers)
}

/// Applies the prefill-side faults of `plan` (stale, bitflip) that fall in `layers` to
/// prefill's `pool`, after their fill: the side that owns a fault plants it.
fn apply_source_faults(cfg: &RunConfig, pool: &mut KvPool, plan: &Plan, layers: &Range<u32>) -> Result<()> {
    let sb = cfg.geometry.slice_bytes()? as usize;
    for a in &plan.actions {
        match *a {
            Action::Stale { at } if layers.contains(&at.layer) => {
                let id = fingerprint::BlockIdentity::new(at.layer, at.kv, logical_block(cfg.seed, at.block), plan.it - 1);
                let bytes = fingerprint::expected(cfg.seed, &pool.shape().slice(id));
                pool.write_slice(at, &bytes)?;
            }
            Action::Bitflip { at, offset, bit } if layers.contains(&at.layer) => {
                let mut buf = vec![0u8; sb];
                pool.read_slice(at, &mut buf)?;
                buf[offset as usize] ^= 1 << bit;
                pool.write_slice(at, &buf)?;
            }
            _ => {}
        }
    }
    Ok(())
}

/// The transfer pairs of `layers` under `plan` (injected drops, tears and misroutes
/// applied), in descriptor order; with `descriptor_blocks` > 1, the slices of each run
/// that are contiguous on both sides become one descriptor ([`coalesce`]).
pub(crate) fn stage_pairs(cfg: &RunConfig, plan: &Plan, layers: Range<u32>) -> Result<Vec<Pair>> {
    let g = &cfg.geometry;
    let sb = g.slice_bytes()?;
    let mut pairs: Vec<Pair> = layers
        .flat_map(|layer| {
            g.parts().iter().flat_map(move |&kv| (0..g.num_blocks).map(move |block| SliceCoord { layer, kv, block }))
        })
        .filter_map(|c| match plan.special.get(&c) {
            Some(p) => *p,
            None => Some(Pair { src: c, dst: SliceCoord { block: plan.perm[c.block as usize], ..c }, len: sb }),
        })
        .collect();
    if cfg.descriptor_blocks > 1 {
        pairs = coalesce(g, pairs, cfg.descriptor_blocks);
    }
    Ok(pairs)
}

/// Stage `k`'s pairs of `plan` with its injected stray writes (`--inject stray`: after
/// coalescing, so never merged with the stage's own pairs).
pub(crate) fn stage_request(cfg: &RunConfig, plan: &Plan, stages: &[Range<u32>], k: usize) -> Result<Vec<Pair>> {
    let mut pairs = stage_pairs(cfg, plan, stages[k].clone())?;
    pairs.extend(plan.strays.iter().filter(|(c, _)| *c == k).map(|(_, p)| *p));
    Ok(pairs)
}

/// One sweep iteration's plan, made before its fill (which the pipeline runs while the
/// previous iteration's transfer is in flight).
pub(crate) struct Plan {
    pub(crate) it: u32,
    /// Prefill slot → decode slot.
    pub(crate) perm: Vec<u32>,
    pub(crate) actions: Vec<Action>,
    /// What each prefill slot holds.
    pub(crate) src_table: Vec<TableEntry>,
    /// What each decode slot must hold after the transfer.
    pub(crate) dst_table: Vec<TableEntry>,
    /// Decode slot → prefill slot.
    pub(crate) src_of: Vec<u32>,
    /// Injected pairs by source slice (`None`: not sent).
    pub(crate) special: HashMap<SliceCoord, Option<Pair>>,
    /// Decode slices where an injection must show, with its class.
    pub(crate) predicted: HashMap<SliceCoord, Class>,
    /// Injected stray writes (`--inject stray`): extra pairs, by the stage whose request
    /// carries them.
    pub(crate) strays: Vec<(usize, Pair)>,
}

/// Merges full-slice pairs that are contiguous on both sides, within one layer and one run
/// of `run_blocks` blocks, into one pair (one NIXL descriptor): sorted by source offset,
/// a pair joins the previous one when both its source and destination slices start where
/// the previous ones end. NHD: one descriptor per (layer, K/V, run); HND: per (layer, run),
/// K and V interleaved. Torn pairs (shorter than a slice) stay alone.
pub fn coalesce(g: &Geometry, mut pairs: Vec<Pair>, run_blocks: u32) -> Vec<Pair> {
    let sb = g.slice_bytes().unwrap_or(0);
    let off = |c: SliceCoord| g.slice_offset(c.kv, c.block);
    pairs.sort_by_key(|p| (p.src.layer, off(p.src)));
    let mut out: Vec<Pair> = Vec::with_capacity(pairs.len() / run_blocks.max(1) as usize + 1);
    for p in pairs {
        if let Some(q) = out.last_mut()
            && p.len == sb
            && q.len.is_multiple_of(sb)
            && q.src.layer == p.src.layer
            && q.dst.layer == p.dst.layer
            && (q.src.kv == p.src.kv || (g.layout == crate::geometry::Layout::Hnd && !g.mla))
            && off(q.src) + q.len == off(p.src)
            && off(q.dst) + q.len == off(p.dst)
            && q.src.block / run_blocks == p.src.block / run_blocks
            && q.dst.block / run_blocks == p.dst.block / run_blocks
        {
            q.len += sb;
            continue;
        }
        out.push(p);
    }
    out
}

/// Most descriptors one sweep request carries when the stage count is chosen
/// automatically (bounds the host memory of descriptor lists, which NIXL copies).
pub const MAX_DESCRIPTORS_PER_REQUEST: u64 = 1 << 16;

/// The sweep's pipeline stages: the layers split into `stages` near-equal consecutive
/// ranges, at most one per layer. `None` (automatic): with `cross_gpu` (VRAM pools on two
/// GPUs) 8 stages — the transfer runs over the GPUs' link while the probe's passes use each
/// GPU's own memory, so overlapping them hides the passes (two NVLinked H200s, 1 GiB, 16 MiB
/// descriptors: outside share 12 % → 3 %, iteration 7.4 → 5.6 ms); otherwise one stage, so
/// the transfer is measured alone (on one H200 the passes share HBM with the copy engines and
/// slow a 300 GB/s transfer by more than they hide; on DRAM they take the transfer's cores).
/// Either way more stages where one would carry over [`MAX_DESCRIPTORS_PER_REQUEST`] slices
/// (host memory of the descriptor lists). bench/NOTES.md v3 has the measurements.
pub fn stages(g: &Geometry, stages: Option<u32>, cross_gpu: bool) -> Vec<Range<u32>> {
    let l = g.num_layers.max(1);
    let auto = || {
        let by_size = g.total_slices().unwrap_or(0).div_ceil(MAX_DESCRIPTORS_PER_REQUEST).max(1) as u32;
        by_size.max(if cross_gpu { 8 } else { 1 })
    };
    let s = stages.unwrap_or_else(auto).clamp(1, l);
    let at = |i: u32| (i as u64 * l as u64 / s as u64) as u32;
    (0..s).map(|i| at(i)..at(i + 1)).collect()
}

/// The pipeline stages of `cfg`'s sweep ([`stages`]: `--pipeline-stages`, or automatic).
pub fn sweep_stages(cfg: &RunConfig) -> Vec<Range<u32>> {
    stages(&cfg.geometry, cfg.stages, cfg.memory == MemoryKind::Vram && cfg.prefill_device != cfg.decode_device)
}
