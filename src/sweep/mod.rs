//! The whole-pool sweep's plan, shared by both roles: the run's configuration
//! ([`RunConfig`]) and its checks, the pools it allocates, each iteration's block map and
//! injections (`plan`), prefill's fill of a stage (`fill_stage`) and the transfer pairs of
//! a stage (`stage_requests`). Everything here is a function of the configuration alone, so
//! decode (`kvprobe run`, crate `run`) and prefill (`kvprobe serve`, crate `serve`, on this
//! host or another) plan the same iteration without sending it to each other.

pub mod regions;

use crate::core::fingerprint::{self, logical_block, seed_hex};
use crate::core::geometry::{Geometry, Preset, SliceCoord};
use crate::core::inject::{self, Action, Spec};
use crate::core::pairing::{Plant, Sides};
use crate::core::verify::Class;
use crate::error::{Error, Result};
use crate::gpu::cuda::{self, Device, Kernels};
use crate::mem::pool::{KvPool, MemoryKind, TableEntry};
use crate::scenario::config::ScenarioConfig;
use crate::xfer::transport::{Op, Pair};
use rand::SeedableRng;
use rand::seq::{IndexedRandom, SliceRandom};
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
    /// With `--prefill-tp`: the GPU of each prefill rank, rank 0 first (`--prefill-device
    /// A,B,...`; `prefill_device` is rank 0's). Empty: every rank on `prefill_device`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub prefill_rank_devices: Vec<usize>,
    /// With `--decode-tp`: the GPU of each decode rank, as `prefill_rank_devices`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub decode_rank_devices: Vec<usize>,
    /// The preset the geometry started from, if any.
    pub preset: Option<Preset>,
    /// What `--model-config` resolved to (the model, `--tp`'s split, `--kv-cache-dtype`);
    /// absent without it. The geometry below is one TP rank's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<crate::core::model_config::ModelInfo>,
    /// Prefill's KV geometry (decode's too unless `decode_geometry` is set); reports add its
    /// `slice_bytes`.
    #[serde(serialize_with = "crate::core::geometry::serialize_with_slice_bytes")]
    pub geometry: Geometry,
    /// Decode's KV geometry when it differs from prefill's (`--decode-layout`,
    /// `--decode-block-size`; [`crate::core::pairing`]): layout, block size and the number of
    /// blocks holding prefill's tokens. Absent: both sides have `geometry`.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        serialize_with = "crate::core::geometry::serialize_opt_with_slice_bytes"
    )]
    pub decode_geometry: Option<Geometry>,
    /// `--permute-local-kv`: decode converts received slices from prefill's layout into its
    /// own, as vLLM's `enable_permute_local_kv` ([`crate::core::pairing::Sides::convert`]).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub permute_local_kv: bool,
    /// Tensor parallelism of the two sides (`--prefill-tp`, `--decode-tp`): one NIXL agent and
    /// pool per rank; `geometry` and `decode_geometry` are then one rank's. Absent: one rank
    /// each.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tp: Option<crate::core::pairing::tp::Tp>,
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
    /// Faults to plant in a hybrid model's state or indexer regions (`--inject CLASS[:N]@REGION`,
    /// [`regions`]). Written only when given.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub region_inject: Vec<crate::core::inject::RegionSpec>,
    /// `--self-test`: the run judges the probe itself, not the stack: exit 0 when every
    /// planted fault (`inject`; a scenario's unfenced race mechanisms) was detected as
    /// predicted and nothing else was found corrupt ([`self_test_verdict`]). Written only
    /// when set.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub self_test: bool,
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
    #[serde(default = "crate::xfer::transport::XferReq::before_the_flag")]
    pub xfer_req: crate::xfer::transport::XferReq,
    /// Bound of every wait, in seconds (`--timeout`): each transfer from just before it is
    /// posted to its completion and notification, each other blocking call ([`crate::sys::deadline`]).
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

/// `--seed` when not given.
pub const DEFAULT_SEED: u64 = 1;
/// `--backend` when not given: NIXL's UCX plugin.
pub const DEFAULT_BACKEND: &str = "UCX";
/// `--timeout` when not given (seconds).
pub const DEFAULT_TIMEOUT_SECS: f64 = 60.0;
/// `--max-failures` when not given (failures listed; counts stay complete).
pub const DEFAULT_MAX_FAILURES: usize = 1000;

impl RunConfig {
    /// A one-iteration READ sweep of `geometry` on `memory` (GPU 0 on both sides with VRAM),
    /// with kvprobe's defaults: seed [`DEFAULT_SEED`], backend [`DEFAULT_BACKEND`] with its
    /// own parameters, prepared requests (as vLLM's NixlConnector), timeout
    /// [`DEFAULT_TIMEOUT_SECS`], [`DEFAULT_MAX_FAILURES`] listed, one block per descriptor,
    /// automatic pipeline stages, both sides equal and in this process, no injection, no
    /// scenario, no peer. The command line starts from this and sets what its flags give.
    pub fn new(memory: MemoryKind, geometry: Geometry) -> RunConfig {
        RunConfig {
            memory,
            prefill_device: 0,
            decode_device: 0,
            prefill_rank_devices: Vec::new(),
            decode_rank_devices: Vec::new(),
            preset: None,
            model: None,
            geometry,
            decode_geometry: None,
            permute_local_kv: false,
            tp: None,
            op: Op::Read,
            iterations: 1,
            fingerprint: Default::default(),
            seed: DEFAULT_SEED,
            inject: Vec::new(),
            region_inject: Vec::new(),
            self_test: false,
            backend: DEFAULT_BACKEND.to_string(),
            backend_params: Default::default(),
            xfer_req: crate::xfer::transport::XferReq::Prepared,
            timeout_secs: DEFAULT_TIMEOUT_SECS,
            min_gbps: None,
            max_failures: DEFAULT_MAX_FAILURES,
            descriptor_blocks: 1,
            stages: None,
            decode_process: false,
            scenario: None,
            peer: None,
            peer_token: None,
        }
    }

    /// The GPU of prefill TP rank `rank` (VRAM): its entry of `prefill_rank_devices`, else
    /// `prefill_device`.
    pub fn prefill_device_of(&self, rank: u32) -> usize {
        self.prefill_rank_devices.get(rank as usize).copied().unwrap_or(self.prefill_device)
    }

    /// The GPU of decode TP rank `rank` (VRAM), as [`RunConfig::prefill_device_of`].
    pub fn decode_device_of(&self, rank: u32) -> usize {
        self.decode_rank_devices.get(rank as usize).copied().unwrap_or(self.decode_device)
    }

    /// Decode's geometry: `decode_geometry`, or prefill's.
    pub fn decode_geom(&self) -> &Geometry {
        self.decode_geometry.as_ref().unwrap_or(&self.geometry)
    }

    /// The two sides ([`crate::core::pairing::Sides`]). Errors: usage (exit 2) when decode's
    /// geometry differs from prefill's in more than layout and block size.
    pub fn sides(&self) -> Result<crate::core::pairing::Sides> {
        crate::core::pairing::Sides::check(&self.geometry, self.decode_geom(), self.permute_local_kv, self.tp)
            .map_err(Error::Usage)
    }
}

/// What decode's side is asked to be beside prefill's geometry: `--decode-layout`,
/// `--decode-block-size`, `--permute-local-kv`, `--prefill-tp`, `--decode-tp` (`None`: as
/// prefill, one rank).
#[derive(Clone, Copy, Debug, Default)]
pub struct DecodeSide {
    /// Decode's layout (NHD/HND); `None`: prefill's.
    pub layout: Option<crate::core::geometry::Layout>,
    /// Decode's block_size in tokens; `None`: prefill's.
    pub block_size: Option<u32>,
    /// Decode converts received slices into its own layout (vLLM's `enable_permute_local_kv`).
    pub permute_local_kv: bool,
    /// Prefill's TP size; `None`: 1.
    pub prefill_tp: Option<u32>,
    /// Decode's TP size; `None`: 1.
    pub decode_tp: Option<u32>,
}

impl RunConfig {
    /// Sets decode's geometry (`decode_geometry`), the TP split (`tp`) and `permute_local_kv`
    /// from `d`, with `geometry` as prefill's: with a TP size given, `geometry` holds the
    /// model's whole KV cache (all `num_kv_heads`) and becomes one prefill rank's. The rules
    /// are vLLM's, in [`crate::core::pairing::Sides::derive`] (decode's `num_blocks` holds
    /// prefill's tokens: `num_blocks x Bp / Bd`) and [`crate::core::pairing::Sides::with_tp`]
    /// (heads per rank, `get_target_remote_ranks`). Returns notes on flags that change nothing
    /// here (said to the user, not dropped). Errors: usage (exit 2) for sides vLLM cannot pair
    /// (block sizes that do not divide, TP sizes that do not split the heads, ...).
    pub fn set_decode_side(&mut self, d: DecodeSide) -> Result<Vec<String>> {
        let mut notes = Vec::new();
        let mut sides = crate::core::pairing::Sides::derive(&self.geometry, d.layout, d.block_size, d.permute_local_kv)
            .map_err(Error::Usage)?;
        let mla = self.geometry.mla;
        if mla && d.layout.is_some_and(|l| l != self.geometry.layout) {
            notes.push("--decode-layout changes nothing with --mla (one latent row per token: no layout to differ in)".into());
        }
        if d.permute_local_kv && mla {
            notes.push("--permute-local-kv changes nothing with --mla (one latent row per token: no layout to convert)".into());
        } else if d.permute_local_kv && sides.prefill.layout == sides.decode.layout {
            notes.push(
                "--permute-local-kv changes nothing here: both sides have one layout (it converts between NHD and HND)".into(),
            );
        }
        if d.prefill_tp.is_some() || d.decode_tp.is_some() {
            let tp = crate::core::pairing::tp::Tp {
                prefill: d.prefill_tp.unwrap_or(1),
                decode: d.decode_tp.unwrap_or(1),
                total_kv_heads: if mla { 1 } else { self.geometry.num_kv_heads },
                mla,
                state: self.model.as_ref().and_then(|m| m.kv.hybrid.as_ref()).is_some_and(|h| h.state.is_some()),
            };
            sides = sides.with_tp(tp).map_err(Error::Usage)?;
            self.tp = (!tp.is_single()).then_some(tp);
            self.geometry = sides.prefill.clone();
        }
        self.decode_geometry = (sides.decode != sides.prefill).then_some(sides.decode);
        self.permute_local_kv = d.permute_local_kv;
        Ok(notes)
    }
}

/// Checks a run's two sides: what kvprobe refuses of unequal geometries (the scenarios,
/// `--descriptor-blocks`, injections into a pair that corrupts every slice already).
fn check_sides(cfg: &RunConfig) -> Result<crate::core::pairing::Sides> {
    let s = cfg.sides()?;
    if cfg.geometry.block_size < 2 && cfg.inject.iter().any(|i| i.kind == inject::Kind::TokenOffset) {
        return Err(Error::Usage("--inject token-offset needs prefill blocks of at least 2 tokens (--block-size)".into()));
    }
    if s.equal() {
        return Ok(s);
    }
    if cfg.scenario.is_some() {
        return Err(Error::Usage(
            "--decode-layout and --decode-block-size apply to the whole-pool sweep (scenarios move blocks between equal geometries)".into(),
        ));
    }
    if cfg.descriptor_blocks != 1 {
        return Err(Error::Usage(
            "--descriptor-blocks applies to equal sides: with --decode-layout, --decode-block-size or --prefill-tp/--decode-tp the descriptors follow vLLM's per-block rules".into(),
        ));
    }
    if s.mismatched() && !cfg.inject.is_empty() {
        return Err(Error::Usage(
            "--inject needs a pair that is clean without it: prefill's and decode's layouts differ and nothing converts (add --permute-local-kv)".into(),
        ));
    }
    Ok(s)
}

/// Checks a run's configuration (flags, geometry, injections). Errors: usage (exit 2).
pub(crate) fn check_config(cfg: &RunConfig) -> Result<()> {
    cfg.geometry.validate()?;
    let sides = check_sides(cfg)?;
    // A sweep plants COUNT per iteration into the pool; a scenario COUNT in all, one per
    // request's READ ([`crate::scenario::config::check`]).
    if cfg.scenario.is_none() {
        inject::check(&cfg.inject, &sides.planning(), &sweep_stages(cfg)).map_err(|e| match e {
            // Planned on groups ([`crate::core::pairing::Sides::planning`]): its "blocks" are groups.
            Error::Usage(m) if sides.prefill.block_size != sides.decode.block_size => Error::Usage(format!(
                "{} (between unequal sides an injection takes a group of {} tokens, whole blocks on both sides: the pool has {} group{} per layer and K/V)",
                m.replace("block slices", "group slices").replace("blocks", "groups"),
                sides.group_tokens(),
                sides.groups(),
                if sides.groups() == 1 { "" } else { "s" }
            )),
            Error::Usage(m) if !sides.tp.is_single() && !sides.prefill.mla && m.contains("KV heads") => Error::Usage(format!(
                "{m}: with TP an injection acts on one prefill rank's slice, and a prefill rank holds {} of the model's {} KV heads (--prefill-tp {})",
                sides.prefill.num_kv_heads, sides.tp.total_kv_heads, sides.tp.prefill
            )),
            e => e,
        })?;
    } else if cfg.inject.iter().any(|s| s.kind == inject::Kind::Torn) && cfg.geometry.slice_bytes()? < 32 {
        return Err(Error::Usage(format!(
            "--inject torn needs block slices of at least 32 bytes (they are {})",
            cfg.geometry.slice_bytes()?
        )));
    }
    for (side, list, n) in
        [("prefill", &cfg.prefill_rank_devices, sides.tp.prefill), ("decode", &cfg.decode_rank_devices, sides.tp.decode)]
    {
        if !list.is_empty() && list.len() != n as usize {
            return Err(Error::Usage(format!(
                "--{side}-device lists {} GPUs for {side} TP {n}: give one GPU (every rank shares it) or one per rank",
                list.len()
            )));
        }
        if !list.is_empty() && cfg.scenario.is_some() {
            return Err(Error::Usage(format!("--{side}-device takes one GPU with --scenario")));
        }
    }
    if cfg.memory == MemoryKind::Dram
        && (cfg.prefill_device != 0
            || cfg.decode_device != 0
            || !cfg.prefill_rank_devices.is_empty()
            || !cfg.decode_rank_devices.is_empty())
    {
        return Err(Error::Usage("--prefill-device and --decode-device apply to --memory vram only".into()));
    }
    if cfg.max_failures > 1_000_000 {
        return Err(Error::Usage("--max-failures must be at most 1000000 (each listed failure stays in memory)".into()));
    }
    if cfg.iterations == 0 {
        return Err(Error::Usage("--iterations must be at least 1".into()));
    }
    if cfg.xfer_req == crate::xfer::transport::XferReq::Prepared
        && cfg.geometry.total_slices()? > crate::xfer::transport::MAX_PREPARED_SLICES
    {
        return Err(Error::Usage(format!(
            "--xfer-req prepared: the pool has {} block slices, and NIXL's makeXferReq indexes at most {}; use --xfer-req create",
            cfg.geometry.total_slices()?,
            crate::xfer::transport::MAX_PREPARED_SLICES
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
            if sc.tier != crate::mem::tier::TierKind::Mooncake {
                return Err(Error::Usage("--mooncake-master and --mooncake-metadata need --tier mooncake".into()));
            }
            ext.validate()?;
            // Up front, so `ab` does not find out at its first tier row.
            ext.reachable(std::time::Duration::from_secs(5))?;
        }
        if sc.tier == crate::mem::tier::TierKind::Mooncake {
            crate::mem::mooncake::find()?; // refuse up front, not at the first row that needs it
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
/// bookkeeping) exceeds what this process may allocate ([`crate::sys::hostmem::available_bytes`]).
pub(crate) fn check_host_memory(cfg: &RunConfig) -> Result<()> {
    let g = &cfg.geometry;
    // DRAM: both pools on this host, or decode's alone across a node pair (`--peer`); with
    // --decode-process prefill's is in the child, and this process holds a scratch pool of the
    // same size while it times the copy ceiling ([`copy_ceiling_from_scratch`]).
    // With TP, each side holds one pool per rank.
    let (p_ranks, d_ranks) = cfg.tp.map_or((1, 1), |t| (t.prefill as u64, t.decode as u64));
    let decode_bytes = cfg.decode_geom().pool_bytes()?.saturating_mul(d_ranks);
    let prefill_bytes = if cfg.peer.is_some() { 0 } else { g.pool_bytes()?.saturating_mul(p_ranks) };
    let mut pools = if cfg.memory == MemoryKind::Dram { decode_bytes.saturating_add(prefill_bytes) } else { 0 };
    if let Some(sc) = cfg.scenario.as_ref().filter(|s| s.scenario.uses_tier()) {
        let block = g.num_layers as u64 * g.kv_parts() as u64 * g.slice_bytes()?;
        let tier = block.saturating_mul(sc.tier_blocks as u64);
        pools = pools.saturating_add(tier);
        if let Some(avail) = crate::sys::hostmem::available_bytes()
            && tier > avail / 2
        {
            return Err(Error::Usage(format!(
                "the tier of {} blocks x {} = {} of host memory is more than half of the {} available; lower --tier-blocks (at least 2 x --concurrency x max --prompt-blocks = {} are needed)",
                sc.tier_blocks,
                crate::sys::units::bytes_exact(block),
                crate::sys::units::bytes_exact(tier),
                crate::sys::units::bytes_exact(avail),
                2 * sc.concurrency as u64 * sc.workload.max_blocks as u64
            )));
        }
    }
    let need = pools.saturating_add(g.total_slices()?.saturating_mul(HOST_BYTES_PER_SLICE));
    if let Some(avail) = crate::sys::hostmem::available_bytes()
        && need > avail
    {
        return Err(Error::Usage(format!(
            "the run needs about {} of host memory ({} for {} + {HOST_BYTES_PER_SLICE} bytes per block slice); {} are available (MemAvailable / cgroup limit)",
            crate::sys::units::bytes_exact(need),
            crate::sys::units::bytes_exact(pools),
            match (cfg.memory == MemoryKind::Dram, cfg.scenario.as_ref().is_some_and(|s| s.scenario.uses_tier())) {
                (true, true) => "the DRAM pools and the tier",
                (true, false) if cfg.peer.is_some() => "decode's DRAM pool",
                (true, false) => "the DRAM pools",
                (false, true) => "the tier",
                (false, false) => "host buffers",
            },
            crate::sys::units::bytes_exact(avail)
        )));
    }
    Ok(())
}

/// A DRAM pool of geometry `g` for `cfg`: shareable (memfd-backed) when a scenario's
/// Mooncake store client maps it, else private.
fn host_pool(cfg: &RunConfig, g: &Geometry) -> Result<KvPool> {
    match cfg.scenario.as_ref().is_some_and(|s| s.tier == crate::mem::tier::TierKind::Mooncake) {
        true => KvPool::host_shareable(g, cfg.seed),
        false => KvPool::host(g, cfg.seed),
    }
}

/// Decode's pool alone (`run --peer`, `run --decode-process`: prefill's is on the other side).
pub(crate) fn build_decode_pool(cfg: &RunConfig) -> Result<KvPool> {
    match cfg.memory {
        MemoryKind::Dram => host_pool(cfg, cfg.decode_geom()),
        MemoryKind::Vram => {
            if cuda::device_count() == 0 {
                return Err(Error::Environment("--memory vram needs a CUDA GPU and none was found (use --memory dram)".into()));
            }
            let d = Device::open(cfg.decode_device)?;
            let k = Arc::new(Kernels::compile(&d)?);
            KvPool::device(&d, k, cfg.decode_geom(), cfg.seed)
        }
    }
}

/// Prefill's pool alone, on `memory` and `device` (`serve`).
pub(crate) fn build_prefill_pool(cfg: &RunConfig, memory: MemoryKind, device: usize) -> Result<KvPool> {
    match memory {
        MemoryKind::Dram => host_pool(cfg, &cfg.geometry),
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

/// A VRAM pool of geometry `g` on GPU `device`, with its own kernels: a TP rank placed on its
/// own GPU (`--prefill-device A,B`, `--decode-device A,B`). Errors: environment (no GPU), as
/// [`KvPool::device`].
pub(crate) fn vram_pool_on(device: usize, g: &Geometry, seed: u64) -> Result<KvPool> {
    if cuda::device_count() == 0 {
        return Err(Error::Environment("--memory vram needs a CUDA GPU and none was found (use --memory dram)".into()));
    }
    let d = Device::open(device)?;
    let k = Arc::new(Kernels::compile(&d)?);
    KvPool::device(&d, k, g, seed)
}

/// Both pools, in this process.
pub(crate) fn build_pools(cfg: &RunConfig) -> Result<(KvPool, KvPool)> {
    let g = &cfg.geometry;
    match cfg.memory {
        // Each engine's Mooncake store client maps its pool: with that tier, shareable.
        MemoryKind::Dram => Ok((host_pool(cfg, g)?, host_pool(cfg, cfg.decode_geom())?)),
        MemoryKind::Vram => {
            if cuda::device_count() == 0 {
                return Err(Error::Environment("--memory vram needs a CUDA GPU and none was found (use --memory dram)".into()));
            }
            let pd = Device::open(cfg.prefill_device)?;
            let pk = Arc::new(Kernels::compile(&pd)?);
            let p = KvPool::device(&pd, pk.clone(), g, cfg.seed)?;
            let dd = if cfg.decode_device == cfg.prefill_device { pd.clone() } else { Device::open(cfg.decode_device)? };
            let dk = if Arc::ptr_eq(&pd, &dd) { pk } else { Arc::new(Kernels::compile(&dd)?) };
            let d = KvPool::device(&dd, dk, cfg.decode_geom(), cfg.seed)?;
            Ok((p, d))
        }
    }
}

/// What prefill slot `i` holds in generation `generation`: a part of group `i / (G / Bp)`'s
/// logical block [`logical_block`]`(seed, group)`, from token `(i mod G / Bp) × Bp`
/// ([`crate::core::pairing`]; equal sides: block `i` is its own group).
fn source_table(cfg: &RunConfig, sides: &Sides, generation: u32) -> Vec<TableEntry> {
    let (kp, bp) = (sides.prefill_per_group(), sides.prefill.block_size);
    (0..cfg.geometry.num_blocks)
        .map(|i| TableEntry { token_base: (i % kp) * bp, ..TableEntry::new(logical_block(cfg.seed, i / kp), generation) })
        .collect()
}

/// Plans sweep iteration `it`: the block map (a seeded random permutation of groups —
/// blocks between equal sides — in runs of `descriptor_blocks`; runs of one block for vLLM's
/// per-block descriptors), the injections (on groups: [`Sides::planning`]), the transfer
/// pairs they change, the tables both sides check against and the class each injection
/// must show at each decode slice it reaches. A function of the configuration alone, so that
/// both sides of a node pair plan the same iteration.
pub(crate) fn plan(cfg: &RunConfig, it: u32) -> Result<Plan> {
    let sides = cfg.sides()?;
    let pg = sides.planning();
    let (kp, kd) = (sides.prefill_per_group(), sides.decode_per_group());
    let n = cfg.descriptor_blocks.max(1);
    let mut rng = ChaCha8Rng::seed_from_u64(cfg.seed ^ (it as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
    let mut runs: Vec<u32> = (0..pg.num_blocks / n).collect();
    runs.shuffle(&mut rng);
    let perm: Vec<u32> = (0..pg.num_blocks).map(|b| runs[(b / n) as usize] * n + b % n).collect();
    let actions = inject::plan(&cfg.inject, &pg, &sweep_stages(cfg), it == cfg.iterations, &mut rng);
    let src_table = source_table(cfg, &sides, it);
    let nd = sides.decode.num_blocks as usize;
    let mut dst_table = vec![TableEntry::default(); nd];
    let mut src_of = vec![0u32; nd];
    let bd = sides.decode.block_size;
    for (group, &to) in perm.iter().enumerate() {
        for j in 0..kd {
            let d = (to * kd + j) as usize;
            dst_table[d] = TableEntry { token_base: j * bd, ..TableEntry::new(logical_block(cfg.seed, group as u32), it) };
            src_of[d] = group as u32 * kp + j * bd / sides.prefill.block_size;
        }
    }
    let links = sides.tp.links();
    let action_links = pick_links(cfg, &sides, &links, &actions, it)?;
    let mut p = Plan {
        it,
        perm,
        kp,
        kd,
        templates: links
            .iter()
            .map(|&(pr, dr)| (0..kp).map(|q| sides.chunks_between(pr, dr, q, Plant::None)).collect())
            .collect(),
        links,
        actions,
        action_links,
        src_table,
        dst_table,
        src_of,
        special: HashMap::new(),
        predicted: HashMap::new(),
        torn_bytes: Vec::new(),
        hits: Vec::new(),
        strays: Vec::new(),
    };
    let prefill_slices = |g: SliceCoord| (0..kp).map(move |q| SliceCoord { block: g.block * kp + q, ..g });
    let mut special = HashMap::new();
    let mut strays = Vec::new();
    let mut displaced = std::collections::HashSet::new();
    let mut torn_bytes = vec![None; p.actions.len()];
    for (i, (a, &l)) in p.actions.iter().zip(&p.action_links).enumerate() {
        match *a {
            Action::Drop { at } => prefill_slices(at).for_each(|c| drop(special.insert((l, c), Vec::new()))),
            Action::Torn { at, len } if p.links.len() > 1 => {
                // With TP a link moves part of the group's bytes (its decode rank's heads):
                // the tear keeps the same share of what the link moves (a multiple of 16
                // bytes, at least 16, at most all but 16), in source order.
                let group = sides.prefill.slice_bytes()? * kp as u64;
                let moved: Vec<(SliceCoord, Vec<Pair>)> = prefill_slices(at).map(|c| (c, p.link_pairs(l, c))).collect();
                let total: u64 = moved.iter().flat_map(|(_, v)| v.iter().map(|x| x.len)).sum();
                let mut keep = match total {
                    t if t >= 32 => ((len as u128 * t as u128 / group as u128) as u64 / 16 * 16).clamp(16, t - 16),
                    t => t / 2,
                };
                torn_bytes[i] = Some(keep);
                for (c, mut pairs) in moved {
                    pairs.sort_by_key(|x| x.src_off);
                    let mut cut = Vec::new();
                    for x in pairs {
                        if keep == 0 {
                            break;
                        }
                        cut.push(Pair { len: x.len.min(keep), ..x });
                        keep -= x.len.min(keep);
                    }
                    special.insert((l, c), cut);
                }
            }
            Action::Torn { at, len } => {
                torn_bytes[i] = Some(len);
                let sb = sides.prefill.slice_bytes()?;
                for (q, c) in prefill_slices(at).enumerate() {
                    let keep = len.saturating_sub(q as u64 * sb).min(sb);
                    let cut = p
                        .link_pairs(l, c)
                        .into_iter()
                        .filter(|x| x.src_off < keep)
                        .map(|x| Pair { len: x.len.min(keep - x.src_off), ..x });
                    special.insert((l, c), cut.collect());
                }
            }
            Action::Misroute { from, to } => {
                for (f, t) in prefill_slices(from).zip(prefill_slices(to)) {
                    special.insert((l, f), p.redirect(l, f, t));
                    special.insert((l, t), Vec::new());
                }
            }
            Action::Stray { from, at, carrier } => {
                for (f, t) in prefill_slices(from).zip(prefill_slices(at)) {
                    strays.extend(p.redirect(l, f, t).into_iter().map(|x| (carrier as usize, l, x)));
                }
            }
            Action::HeadOffset { at } | Action::TokenOffset { at } => {
                let plant = if matches!(a, Action::HeadOffset { .. }) { Plant::HeadOffset } else { Plant::TokenOffset };
                let (pr, dr) = p.links[l];
                for (q, c) in prefill_slices(at).enumerate() {
                    let chunks = sides.chunks_between(pr, dr, q as u32, plant);
                    displaced.extend(chunks.iter().filter(|ch| ch.displaced).map(|ch| {
                        let x = p.pair(c, ch);
                        (l, x.src, x.dst, x.dst_off)
                    }));
                    special.insert((l, c), chunks.iter().map(|ch| p.pair(c, ch)).collect());
                }
            }
            Action::Bitflip { .. } | Action::Stale { .. } => {}
        }
    }
    p.special = special;
    p.strays = strays;
    p.torn_bytes = torn_bytes;
    predict(&sides, &mut p, &displaced)?;
    Ok(p)
}

/// The link ([`Plan::links`]) each of `actions` acts on: with one rank each side, link 0;
/// with TP, one drawn per action with the seed (its own stream, so the block map and the
/// injections' places are those of the same run without TP), among the links where the
/// fault changes something (a head offset needs a decode rank reading a prefill head that
/// has a next head in its rank's slice; a bitflip, a decode rank whose link moves the flipped
/// byte). Errors (internal, exit 3): no link where an action changes anything (the
/// injection checks refuse such runs; no silent fallback to link 0).
fn pick_links(cfg: &RunConfig, sides: &Sides, links: &[(u32, u32)], actions: &[Action], it: u32) -> Result<Vec<usize>> {
    if links.len() == 1 {
        return Ok(vec![0; actions.len()]);
    }
    let mut rng = ChaCha8Rng::seed_from_u64(cfg.seed ^ 0x4C49_4E4B_5F54_5021 ^ (it as u64).wrapping_mul(0xD1B5_4A32_D192_ED03));
    let shifts = |l: usize| {
        let (pr, dr) = links[l];
        (0..sides.prefill_per_group()).any(|q| sides.chunks_between(pr, dr, q, Plant::HeadOffset).iter().any(|c| c.displaced))
    };
    // A bitflip at `offset` of the group's prefill slices (back to back) is seen by the
    // decode ranks whose links move that byte.
    let sbp = sides.prefill.slice_bytes().unwrap_or(1).max(1);
    let moves = |l: usize, offset: u64| {
        let (pr, dr) = links[l];
        let (q, at) = ((offset / sbp) as u32, offset % sbp);
        sides.chunks_between(pr, dr, q, Plant::None).iter().any(|c| (c.src_off..c.src_off + c.len).contains(&at))
    };
    actions
        .iter()
        .map(|a| {
            let ok: Vec<usize> = (0..links.len())
                .filter(|&l| match *a {
                    Action::HeadOffset { .. } => shifts(l),
                    Action::Bitflip { offset, .. } => moves(l, offset),
                    _ => true,
                })
                .collect();
            ok.choose(&mut rng).copied().ok_or_else(|| {
                Error::Internal(format!("iteration {it}: no TP link where the injection {} changes anything", a.kind().name()))
            })
        })
        .collect()
}

/// A pair landing in a decode slice, for [`predict`]: the pair, its link, and, for an
/// injected stray write, the pipeline stage whose request carries it.
type Landed = (Pair, usize, Option<usize>);

/// What arrives in a decode slice, by source, for [`predict`].
#[derive(Clone, Copy, PartialEq, Eq)]
enum Piece {
    /// The rows due, intact.
    Expected,
    /// Rows of the right block at other positions (a planted offset).
    Displaced,
    /// The rows due with a flipped bit.
    Flipped,
    /// The right rows of the previous generation.
    Stale,
    /// Another group's rows (a misroute).
    Foreign(SliceCoord),
}

/// Fills `p.predicted` and `p.hits` (`displaced`: the planted offsets' pairs, by link,
/// source slice, destination slice and destination offset): for every decode slice (on its
/// TP rank) an injection reaches, the class the verifier must report, from what lands there
/// over every link into that rank (docs/fingerprint.md "Failure classes"): nothing → `unwritten`; part of the
/// slice → `torn`; a stray write → `stray`; the rows due with a flipped bit → `bitflip`,
/// displaced → `layout`, of the previous generation → `stale`; one other group's rows →
/// `misplaced`; any other mix → `torn`. A slice whose rows all arrive intact is not listed.
/// Stale and bitflip are planted in the pool of their link's prefill rank, so every decode
/// rank reading those rows sees them.
///
/// With the class, the slice's exact bytes ([`inject::Prediction`]):
/// the slot's poison of this iteration, then every pair that lands there copied from its
/// source slice as prefill's rank holds it (this iteration's generation, the previous one
/// where stale was planted, the planted bit flipped), then decode's conversion on receive. A
/// stray write lands on the poison when its carrier is stage 0 (the poison check before the
/// slot's post finds it) and on the slice as it verified otherwise (the last iteration's
/// re-verify), unconverted.
fn predict(
    sides: &Sides,
    p: &mut Plan,
    displaced: &std::collections::HashSet<(usize, SliceCoord, SliceCoord, u64)>,
) -> Result<()> {
    let (kp, kd) = (p.kp, p.kd);
    let sbd = sides.decode.slice_bytes()?;
    let sbp = sides.prefill.slice_bytes()?;
    let group_of = |c: SliceCoord| SliceCoord { block: c.block / kp, ..c };
    let decode_slices = |g: SliceCoord, perm: &[u32]| -> Vec<SliceCoord> {
        (0..kd).map(|j| SliceCoord { block: perm[g.block as usize] * kd + j, ..g }).collect()
    };
    let ranks = sides.tp.decode;
    let mut groups: Vec<SliceCoord> = Vec::new();
    // (prefill rank, group) and (prefill rank, prefill slice, byte offset, bit).
    let (mut stale, mut flip) = (Vec::new(), Vec::new());
    for (a, &l) in p.actions.iter().zip(&p.action_links) {
        let pr = p.links[l].0;
        match *a {
            Action::Misroute { from, to } => groups.extend([from, to]),
            Action::Stray { at, .. } => groups.push(at),
            Action::Stale { at } => {
                groups.push(at);
                stale.push((pr, at));
            }
            Action::Bitflip { at, offset, bit } => {
                groups.push(at);
                flip.push((pr, SliceCoord { block: at.block * kp + (offset / sbp) as u32, ..at }, offset % sbp, bit));
            }
            Action::Drop { at } | Action::Torn { at, .. } | Action::HeadOffset { at } | Action::TokenOffset { at } => {
                groups.push(at)
            }
        }
    }
    // Every pair that lands in a decode slice of these groups, on any decode rank, with its link.
    let mut landing: HashMap<(u32, SliceCoord), Vec<Landed>> = HashMap::new();
    for g in &groups {
        for d in decode_slices(*g, &p.perm) {
            for r in 0..ranks {
                landing.entry((r, d)).or_default();
            }
        }
    }
    // The prefill slices whose pairs may land there: the groups' own over every link, and
    // every injected one.
    let sources: std::collections::HashSet<(usize, SliceCoord)> = groups
        .iter()
        .flat_map(|g| (0..kp).map(move |q| SliceCoord { block: g.block * kp + q, ..*g }))
        .flat_map(|c| (0..p.links.len()).map(move |l| (l, c)))
        .chain(p.special.keys().copied())
        .collect();
    for &(l, c) in &sources {
        for x in p.pairs_of(l, c) {
            if let Some(v) = landing.get_mut(&(p.links[l].1, x.dst)) {
                v.push((x, l, None));
            }
        }
    }
    for &(carrier, l, x) in &p.strays {
        if let Some(v) = landing.get_mut(&(p.links[l].1, x.dst)) {
            v.push((x, l, Some(carrier)));
        }
    }
    // The rows a prefill rank's slice holds, and a decode rank's slice must hold (their
    // shapes: a TP rank's heads), and decode's conversion on receive.
    let prefill_rows = |pr: u32, e: TableEntry, c: SliceCoord| {
        let mut shape = fingerprint::RowShape::of(&sides.prefill);
        shape.head_base = sides.tp.heads_of(sides.tp.prefill, pr).start;
        shape.slice(e.identity(c))
    };
    let decode_rows = |r: u32, c: SliceCoord| {
        let mut shape = fingerprint::RowShape::of(&sides.decode);
        shape.head_base = sides.tp.heads_of(sides.tp.decode, r).start;
        shape.slice(p.dst_table[c.block as usize].identity(c))
    };
    let convert: Option<(Arc<[u32]>, u32)> =
        sides.converts().then(|| (sides.row_permutation().into(), fingerprint::RowShape::of(&sides.decode).row_bytes));
    // What prefill rank `pr`'s slice `c` holds when it is sent, by landing run.
    let landed = |pr: u32, x: &Pair| {
        let g = group_of(x.src);
        let e = p.src_table[x.src.block as usize];
        let e = if stale.contains(&(pr, g)) { TableEntry { generation: p.it - 1, ..e } } else { e };
        inject::Landing {
            rows: prefill_rows(pr, e, x.src),
            flip: flip.iter().find(|&&(fr, c, _, _)| fr == pr && c == x.src).map(|&(_, _, o, b)| (o, b)),
            src_off: x.src_off,
            dst_off: x.dst_off,
            len: x.len,
        }
    };
    let mut predicted = HashMap::new();
    for (&(r, d), pieces) in &landing {
        let due = group_of(SliceCoord { block: p.src_of[d.block as usize], ..d });
        let mut covered = 0;
        let mut kinds = Vec::new();
        let mut stray = None;
        let (mut runs, mut stray_runs) = (Vec::new(), Vec::new());
        for &(x, l, carrier) in pieces {
            if let Some(k) = carrier {
                stray = Some(k);
                stray_runs.push(landed(p.links[l].0, &x));
                continue;
            }
            runs.push(landed(p.links[l].0, &x));
            covered += x.len;
            let g = group_of(x.src);
            let pr = p.links[l].0;
            let shifted = displaced.contains(&(l, x.src, x.dst, x.dst_off));
            kinds.push(if g != due {
                Piece::Foreign(g)
            } else if stale.contains(&(pr, g)) {
                Piece::Stale
            } else if shifted {
                Piece::Displaced
            } else if flip.iter().any(|&(fr, c, o, _)| fr == pr && c == x.src && (x.src_off..x.src_off + x.len).contains(&o)) {
                Piece::Flipped
            } else {
                Piece::Expected
            });
        }
        let all = |k: Piece| kinds.iter().all(|x| *x == k || *x == Piece::Expected);
        let class = if stray.is_some() {
            Some(Class::Stray)
        } else if covered == 0 {
            Some(Class::Unwritten)
        } else if covered < sbd {
            Some(Class::Torn)
        } else if kinds.iter().all(|k| *k == Piece::Expected) {
            None
        } else if all(Piece::Flipped) {
            Some(Class::Bitflip)
        } else if all(Piece::Displaced) {
            Some(Class::Layout)
        } else if kinds.iter().all(|k| *k == Piece::Stale) {
            Some(Class::Stale)
        } else if let Some(Piece::Foreign(g)) = kinds.first().copied()
            && kinds.iter().all(|k| *k == Piece::Foreign(g))
        {
            Some(Class::Misplaced)
        } else {
            Some(Class::Torn)
        };
        let Some(class) = class else { continue };
        let poison = inject::Under::Poison { slot: sides.decode.global_slice(d), iteration: p.it };
        let prediction = match stray {
            // Before the slot's own transfer (stage 0 carried it), or after its verify.
            Some(carrier) => inject::Prediction {
                class,
                slice_bytes: sbd,
                under: if carrier == 0 { poison } else { inject::Under::Due(decode_rows(r, d)) },
                landed: stray_runs,
                convert: None,
            },
            None => inject::Prediction { class, slice_bytes: sbd, under: poison, landed: runs, convert: convert.clone() },
        };
        predicted.insert((r, d), prediction);
    }
    p.hits = p
        .actions
        .iter()
        .map(|a| {
            let gs = match *a {
                Action::Misroute { from, to } => vec![to, from],
                Action::Stray { at, .. }
                | Action::Stale { at }
                | Action::Bitflip { at, .. }
                | Action::Drop { at }
                | Action::Torn { at, .. }
                | Action::HeadOffset { at }
                | Action::TokenOffset { at } => vec![at],
            };
            gs.into_iter()
                .flat_map(|g| decode_slices(g, &p.perm))
                .flat_map(|d| (0..ranks).filter_map(|r| predicted.get(&(r, d)).map(|x| (r, d, x.class))).collect::<Vec<_>>())
                .collect()
        })
        .collect();
    p.predicted = predicted;
    Ok(())
}

/// Prefill's part of a sweep iteration on `pool`, prefill TP rank `rank`'s: fills `stage` of
/// `stages` (every layer: `None`) with `plan`'s generation — loading `plan`'s table first when
/// the stage is the iteration's first — waits for the fill when `wait`, and plants `plan`'s
/// prefill-side faults of that rank there. The in-process sweep and `serve` both fill through it.
pub(crate) fn fill_stage(
    cfg: &RunConfig,
    pool: &mut KvPool,
    rank: u32,
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
    apply_source_faults(cfg, pool, rank, plan, &layers)
}

/// Applies the prefill-side faults of `plan` (stale, bitflip) that fall in `layers` to
/// prefill TP rank `rank`'s `pool`, after their fill: the side that owns a fault plants it,
/// in the prefill rank of the fault's link. A fault names a group ([`Sides::planning`]):
/// stale rewrites each of its prefill slices with the previous generation; bitflip's offset
/// counts the group's prefill slices back to back.
fn apply_source_faults(cfg: &RunConfig, pool: &mut KvPool, rank: u32, plan: &Plan, layers: &Range<u32>) -> Result<()> {
    let sb = cfg.geometry.slice_bytes()? as usize;
    let kp = plan.kp;
    for (a, &l) in plan.actions.iter().zip(&plan.action_links) {
        if plan.links[l].0 != rank {
            continue;
        }
        match *a {
            Action::Stale { at } if layers.contains(&at.layer) => {
                for q in 0..kp {
                    let c = SliceCoord { block: at.block * kp + q, ..at };
                    let e = TableEntry { generation: plan.it - 1, ..plan.src_table[c.block as usize] };
                    let bytes = fingerprint::expected(cfg.seed, &pool.rows_of(&e, c));
                    pool.write_slice(c, &bytes)?;
                }
            }
            Action::Bitflip { at, offset, bit } if layers.contains(&at.layer) => {
                let c = SliceCoord { block: at.block * kp + (offset / sb as u64) as u32, ..at };
                let mut buf = vec![0u8; sb];
                pool.read_slice(c, &mut buf)?;
                buf[(offset % sb as u64) as usize] ^= 1 << bit;
                pool.write_slice(c, &buf)?;
            }
            _ => {}
        }
    }
    Ok(())
}

/// The transfer pairs of `layers` over link `l` under `plan` (injected drops, tears,
/// misroutes and planted offsets applied), in descriptor order: each prefill slice's chunks
/// ([`Plan::pairs_of`]); with `descriptor_blocks` > 1, the slices of each run that are
/// contiguous on both sides become one descriptor ([`coalesce`]).
fn stage_pairs(cfg: &RunConfig, plan: &Plan, l: usize, layers: Range<u32>) -> Result<Vec<Pair>> {
    let g = &cfg.geometry;
    let mut pairs: Vec<Pair> = layers
        .flat_map(|layer| {
            g.parts().iter().flat_map(move |&kv| (0..g.num_blocks).map(move |block| SliceCoord { layer, kv, block }))
        })
        .flat_map(|c| plan.pairs_of(l, c))
        .collect();
    if cfg.descriptor_blocks > 1 {
        pairs = coalesce(g, pairs, cfg.descriptor_blocks);
    }
    Ok(pairs)
}

/// Stage `k`'s pairs of `plan`, one list per link ([`Plan::links`]; one rank each side: one
/// list), each with its link's injected stray writes (`--inject stray`: after coalescing,
/// so never merged with the stage's own pairs).
pub(crate) fn stage_requests(cfg: &RunConfig, plan: &Plan, stages: &[Range<u32>], k: usize) -> Result<Vec<Vec<Pair>>> {
    (0..plan.links.len())
        .map(|l| {
            let mut pairs = stage_pairs(cfg, plan, l, stages[k].clone())?;
            pairs.extend(plan.strays.iter().filter(|(c, sl, _)| *c == k && *sl == l).map(|(_, _, p)| *p));
            Ok(pairs)
        })
        .collect()
}

/// The notification tag of link `l`'s request of a stage tagged `tag`: `tag` with one rank
/// each side, else `tag:tp=P>D` (prefill rank P, decode rank D), so that each TP rank's
/// request is notified on its own.
pub(crate) fn link_tag(tag: &str, plan: &Plan, l: usize) -> String {
    match plan.links.len() {
        1 => tag.to_string(),
        _ => format!("{tag}:tp={}>{}", plan.links[l].0, plan.links[l].1),
    }
}

/// One sweep iteration's plan, made before its fill (which the pipeline runs while the
/// previous iteration's transfer is in flight).
pub(crate) struct Plan {
    pub(crate) it: u32,
    /// Prefill group → decode group ([`crate::core::pairing`]; equal sides: block → block).
    pub(crate) perm: Vec<u32>,
    /// Prefill blocks per group.
    pub(crate) kp: u32,
    /// Decode blocks per group.
    pub(crate) kd: u32,
    /// The chunks of a prefill slice, by link and by the slice's position in its group
    /// ([`Sides::chunks_between`]).
    templates: Vec<Vec<Vec<crate::core::pairing::Chunk>>>,
    /// The (prefill rank, decode rank) pairs blocks move between ([`crate::core::pairing::tp::Tp::links`];
    /// one rank each: `[(0, 0)]`).
    pub(crate) links: Vec<(u32, u32)>,
    /// The injections, on groups ([`Sides::planning`]).
    pub(crate) actions: Vec<Action>,
    /// The link each injection acts on (index into `links`, in `actions` order; [`pick_links`]).
    pub(crate) action_links: Vec<usize>,
    /// What each prefill slot holds.
    pub(crate) src_table: Vec<TableEntry>,
    /// What each decode slot must hold after the transfer.
    pub(crate) dst_table: Vec<TableEntry>,
    /// Decode slot → the first prefill slot it takes rows from.
    pub(crate) src_of: Vec<u32>,
    /// Injected pairs by link and source slice (empty: nothing of it is sent over that link).
    pub(crate) special: HashMap<(usize, SliceCoord), Vec<Pair>>,
    /// Decode slices (by decode TP rank) where an injection must show: the class and the
    /// exact bytes ([`inject::Prediction`]).
    pub(crate) predicted: HashMap<(u32, SliceCoord), inject::Prediction>,
    /// Per action (in `actions` order), a tear's planted length: the bytes sent of the
    /// group's prefill slices back to back, in source order (with TP, of the bytes its link
    /// moves); `None` for other kinds.
    pub(crate) torn_bytes: Vec<Option<u64>>,
    /// Per action (in `actions` order), the decode slices (decode TP rank, slice) it reaches
    /// and their classes.
    pub(crate) hits: Vec<Vec<(u32, SliceCoord, Class)>>,
    /// Injected stray writes (`--inject stray`): extra pairs, by the stage whose request
    /// carries them and the link.
    pub(crate) strays: Vec<(usize, usize, Pair)>,
}

impl Plan {
    /// The pair of prefill slice `c` moved by chunk `ch` under this plan's block map.
    fn pair(&self, c: SliceCoord, ch: &crate::core::pairing::Chunk) -> Pair {
        let dst = SliceCoord { block: self.perm[(c.block / self.kp) as usize] * self.kd + ch.dst_block, ..c };
        Pair { src: c, dst, len: ch.len, src_off: ch.src_off, dst_off: ch.dst_off }
    }

    /// The pairs prefill slice `c` travels in over link `l`: the injected ones, or its chunks.
    pub(crate) fn pairs_of(&self, l: usize, c: SliceCoord) -> Vec<Pair> {
        match self.special.get(&(l, c)) {
            Some(v) => v.clone(),
            None => self.link_pairs(l, c),
        }
    }

    /// Prefill slice `c`'s chunks over link `l` (no injection).
    fn link_pairs(&self, l: usize, c: SliceCoord) -> Vec<Pair> {
        self.templates[l][(c.block % self.kp) as usize].iter().map(|ch| self.pair(c, ch)).collect()
    }

    /// Prefill slice `from`'s chunks over link `l` into the decode places of prefill slice
    /// `to` (the same position in another group).
    fn redirect(&self, l: usize, from: SliceCoord, to: SliceCoord) -> Vec<Pair> {
        self.templates[l][(to.block % self.kp) as usize].iter().map(|ch| Pair { src: from, ..self.pair(to, ch) }).collect()
    }
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
            && (q.src.kv == p.src.kv || (g.layout == crate::core::geometry::Layout::Hnd && !g.mla))
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
