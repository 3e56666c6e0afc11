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
use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

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
    /// KV geometry (the same on both sides); reports add its `slice_bytes`.
    #[serde(serialize_with = "crate::geometry::serialize_with_slice_bytes")]
    pub geometry: Geometry,
    /// READ (decode pulls) or WRITE (prefill pushes).
    pub op: Op,
    /// Iterations (≥ 1).
    pub iterations: u32,
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
    /// `--dump DIR`: where failing slices go as they are classified ([`crate::dump`]).
    pub dump: Option<&'a mut crate::dump::Dumper>,
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

pub use crate::fingerprint::seed_hex;

/// Logical block id of prefill slot `i`: a seeded bijection of u32 (so logical ≠ physical).
pub fn logical_block(seed: u64, i: u32) -> u32 {
    i.wrapping_mul(0x9E37_79B1) ^ (seed as u32).rotate_left(7)
}

/// The prefill role as decode's side of a run sees it.
#[allow(clippy::large_enum_variant)] // one per run
pub(crate) enum Prefill {
    /// In this process, driven by direct calls: the scenario engine and `kvprobe ab` (issue 16
    /// moves them onto the protocol).
    Local(Endpoint),
    /// Over the peer protocol ([`crate::peer`]): a `kvprobe serve` session on another host
    /// (`run --peer`), in a child process (`run --decode-process`) or on a thread of this
    /// process (the plain sweep). The sweep drives all three with the same code.
    Peer(Box<crate::peer::client::PrefillPeer>),
}

impl Prefill {
    /// The endpoint in this process. Errors: usage for a peer (what needs it runs only with
    /// both roles in one process so far).
    pub(crate) fn local_mut(&mut self) -> Result<&mut Endpoint> {
        match self {
            Prefill::Local(e) => Ok(e),
            Prefill::Peer(_) => {
                Err(Error::Usage("--peer runs the whole-pool sweep (scenarios and ab across a node pair come later)".into()))
            }
        }
    }

}

/// A sweep stage's request, as decode tracks it.
pub(crate) enum SweepRequest {
    /// A NIXL request of this process.
    Nixl(crate::nixl::Posted),
    /// A WRITE the prefill peer posted under `tag` (`run --peer`, `run --decode-process`).
    PeerWrite {
        /// Notification tag.
        tag: String,
        /// `--timeout` from just before the request was sent to prefill.
        deadline: crate::deadline::Deadline,
        /// Checks begun after the deadline that found it incomplete.
        late_misses: u8,
    },
}

impl SweepRequest {
    fn deadline(&self) -> crate::deadline::Deadline {
        match self {
            SweepRequest::Nixl(r) => r.deadline(),
            SweepRequest::PeerWrite { deadline, .. } => *deadline,
        }
    }
}

/// Both roles, set up and connected.
pub(crate) struct Probe {
    cfg: RunConfig,
    // Field order is drop order: prefill first, so that a prefill process (`--decode-process`)
    // has exited — its WRITEs into decode's pool over — before decode's pool is freed. (In one
    // process the order does not matter: each request holds shares of both registrations.)
    pub(crate) prefill: Prefill,
    pub(crate) decode: Endpoint,
    /// The copy ceiling (GB/s) timed at set-up (the plain sweep: on prefill's pool before it
    /// went to its thread); `None` when timed later or not at all.
    copy_gbps: Option<f64>,
}

/// Checks a run's configuration (flags, geometry, injections). Errors: usage (exit 2).
pub(crate) fn check_config(cfg: &RunConfig) -> Result<()> {
    cfg.geometry.validate()?;
    inject::check(&cfg.inject, &cfg.geometry, &sweep_stages(cfg))?;
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

/// The most iterations a sweep accepts (`--iterations`, 16777214 = 2^24 − 2): poison patterns
/// carry the iteration in 24 bits, and a sweep's generations (1..=iterations, the prefill
/// refill of iteration `it + 1` included) stay below [`fingerprint::SKIP_GEN`] — checked at compile time.
pub const MAX_ITERATIONS: u32 = 0x00FF_FFFE;
const _: () = assert!(MAX_ITERATIONS < 0x00FF_FFFF && MAX_ITERATIONS < fingerprint::SKIP_GEN - 1);

/// Smallest pool (bytes per side) whose copy a sweep times as the transfer's ceiling
/// (`summary.transport_path.copy_gbps`): below it the copy takes about as long as its fixed
/// costs (thread start, kernel launch), so the rate would be noise, not a ceiling.
pub const MIN_CEILING_BYTES: u64 = 64 << 20;

/// Host bytes kvprobe and NIXL keep per block slice (descriptor lists, transfer plans):
/// an upper bound measured on DRAM runs (about 285 B seen), used to refuse runs up front.
pub const HOST_BYTES_PER_SLICE: u64 = 512;

/// Refuses, before allocating, a run whose host memory (DRAM pools plus per-slice
/// bookkeeping) exceeds what this process may allocate ([`crate::hostmem::available_bytes`]).
fn check_host_memory(cfg: &RunConfig) -> Result<()> {
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
                crate::report::bytes_exact(block),
                crate::report::bytes_exact(tier),
                crate::report::bytes_exact(avail),
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
            crate::report::bytes_exact(need),
            crate::report::bytes_exact(pools),
            match (cfg.memory == MemoryKind::Dram, cfg.scenario.as_ref().is_some_and(|s| s.scenario.uses_tier())) {
                (true, true) => "the DRAM pools and the tier",
                (true, false) if cfg.peer.is_some() => "decode's DRAM pool",
                (true, false) => "the DRAM pools",
                (false, true) => "the tier",
                (false, false) => "host buffers",
            },
            crate::report::bytes_exact(avail)
        )));
    }
    Ok(())
}

/// Decode's pool alone (`run --peer`, `run --decode-process`: prefill's is on the other side).
fn build_decode_pool(cfg: &RunConfig) -> Result<KvPool> {
    match cfg.memory {
        MemoryKind::Dram => KvPool::host(&cfg.geometry, cfg.seed),
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
        MemoryKind::Dram => KvPool::host(&cfg.geometry, cfg.seed),
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
            let pk = Arc::new(Kernels::compile(&pd)?);
            let p = KvPool::device(&pd, pk.clone(), g, cfg.seed)?;
            let dd = if cfg.decode_device == cfg.prefill_device { pd.clone() } else { Device::open(cfg.decode_device)? };
            let dk = if Arc::ptr_eq(&pd, &dd) { pk } else { Arc::new(Kernels::compile(&dd)?) };
            let d = KvPool::device(&dd, dk, g, cfg.seed)?;
            Ok((p, d))
        }
    }
}

impl Probe {
    pub(crate) fn setup(cfg: &RunConfig) -> Result<Probe> {
        crate::phase::announce(&format!(
            "setup: allocating pools ({} {} per side)",
            cfg.geometry.pool_bytes().map(crate::report::bytes_binary).unwrap_or_default(),
            if cfg.memory == MemoryKind::Vram { "VRAM" } else { "DRAM" }
        ));
        let (p, d) = build_pools(cfg)?;
        Self::connect(cfg, p, d).map_err(|e| backend_refusal(&cfg.backend, cfg.memory, e))
    }

    fn connect(cfg: &RunConfig, p: KvPool, d: KvPool) -> Result<Probe> {
        crate::phase::announce(&format!("setup: registering the pools with NIXL (backend {})", cfg.backend));
        crate::trace!("prefill NIXL agent");
        let opts = crate::transport::TransportOptions { xfer_req: cfg.xfer_req, backend_params: cfg.backend_params.clone() };
        let mut prefill = Endpoint::with_options("kvprobe-prefill", &cfg.backend, p, &opts)?;
        let pi = prefill.info()?;
        crate::trace!("decode NIXL agent");
        let mut decode = Endpoint::with_options("kvprobe-decode", &cfg.backend, d, &opts)?;
        decode.connect(pi)?;
        crate::trace!("prefill loads decode's metadata");
        prefill.connect(decode.info()?)?;
        crate::trace!("connected");
        // The sweep and the scenario engine each fill the prefill pool themselves.
        Ok(Probe { cfg: cfg.clone(), prefill: Prefill::Local(prefill), decode, copy_gbps: None })
    }

    /// Sets up a sweep's two roles over the peer protocol. Node pair (`run --peer`): connects
    /// to `serve`, agrees on the configuration, allocates and registers decode's pool here, and
    /// exchanges NIXL agents with prefill there. `--decode-process`: the same, with a child
    /// `kvprobe serve` on a Unix socket pair as prefill
    /// ([`crate::peer::client::start_child`]). Otherwise (the plain sweep): the same with a
    /// serve session on a thread of this process ([`crate::peer::client::start_thread`]),
    /// handed prefill's pool after the copy ceiling was timed on it. `environment` is this
    /// side's (sent to prefill for its report; not to a child or thread, which write none).
    /// Errors: environment (cannot connect or start the child), usage (refused: version, token,
    /// configuration), transport, timeout (a child not ready within its start bound too).
    pub(crate) fn setup_peer(cfg: &RunConfig, environment: Option<crate::envinfo::Environment>) -> Result<Probe> {
        use crate::peer::client::Holder;
        let timeout = Duration::from_secs_f64(cfg.timeout_secs);
        let run_id = crate::peer::random_hex(8)?;
        let mut holder = None;
        let mut environment = environment;
        let mut decode_pool = None;
        let mut copy_gbps = None;
        let handoff = Arc::new(crate::serve::Handoff::default());
        let set_up_bound = |link: &crate::peer::Link| {
            // Set-up waits (acceptance, prefill's agent) are bounded whatever the heartbeats say.
            let bound = timeout.max(crate::deadline::SETUP_FLOOR);
            link.set_deadline(Some((
                Instant::now() + bound,
                format!(
                    "{} did not set up its side within {:.0} s (--timeout, at least 60 s for set-up)",
                    link.who(),
                    bound.as_secs_f64()
                ),
            )));
        };
        let (link, addr) = if cfg.peer.is_none() && !cfg.decode_process {
            crate::phase::announce(&format!(
                "setup: allocating pools ({} {} per side)",
                cfg.geometry.pool_bytes().map(crate::report::bytes_binary).unwrap_or_default(),
                if cfg.memory == MemoryKind::Vram { "VRAM" } else { "DRAM" }
            ));
            let (mut p, mut d) = build_pools(cfg)?;
            if cfg.geometry.pool_bytes()? >= MIN_CEILING_BYTES {
                crate::phase::announce("setup: timing a copy of the prefill pool to the decode pool (the ceiling)");
                copy_gbps = Some(time_copy(cfg, &mut p, &mut d, &plan(cfg, 1)?)?);
            }
            *handoff.pool.lock().unwrap_or_else(|p| p.into_inner()) = Some(p);
            decode_pool = Some(d);
            let vram = cfg.memory == MemoryKind::Vram;
            let serve = crate::serve::ServeConfig {
                listen: "in-process".into(),
                token: String::new(),
                memory: cfg.memory,
                device: if vram { cfg.prefill_device } else { 0 },
                backend: Some(cfg.backend.clone()),
                geometry: Some(cfg.geometry.clone()),
                keep_serving: false,
                idle_timeout: timeout,
                mode: crate::serve::SessionMode::InProcess,
            };
            let h = handoff.clone();
            let (link, thread) = crate::peer::client::start_thread(timeout, &run_id, move |stream, token| {
                crate::serve::serve_in_process(&crate::serve::ServeConfig { token, ..serve }, stream, &h)
            })?;
            set_up_bound(&link);
            holder = Some(Holder::Thread(thread));
            environment = None;
            (link, "in-process".to_string())
        } else if cfg.decode_process {
            crate::phase::announce(&format!(
                "setup: starting the prefill process (kvprobe serve holding prefill's NIXL agent and pool, {})",
                if cfg.memory == MemoryKind::Vram { format!("VRAM on GPU {}", cfg.prefill_device) } else { "DRAM".into() }
            ));
            let (link, c) = crate::peer::client::start_child(cfg, timeout, &run_id)?;
            let addr = format!("child process {}", c.id());
            holder = Some(Holder::Child(c));
            environment = None;
            (link, addr)
        } else {
            let addr = cfg.peer.clone().unwrap_or_default();
            crate::phase::announce(&format!("setup: connecting to the prefill peer at {addr}"));
            let token = cfg.peer_token.clone().unwrap_or_default();
            let link = crate::peer::client::connect(&addr, &token, &run_id, timeout)?;
            set_up_bound(&link);
            (link, addr)
        };
        let decode_side = crate::peer::Side {
            geometry: cfg.geometry.clone(),
            memory: cfg.memory,
            device: if cfg.memory == MemoryKind::Vram { cfg.decode_device } else { 0 },
            host: crate::peer::host_name(),
        };
        let config = serde_json::to_value(cfg).map_err(|e| Error::Io(e.to_string()))?;
        let (link, side, section) =
            crate::peer::client::PrefillPeer::configure(link, config, decode_side, environment, &addr, &run_id)?;
        let pool = match decode_pool {
            Some(d) => {
                crate::phase::announce(&format!("setup: registering the pools with NIXL (backend {})", cfg.backend));
                d
            }
            None => {
                crate::phase::announce(&format!(
                    "setup: allocating decode's pool ({} {}), registering it with NIXL (backend {}); prefill on {} ({})",
                    cfg.geometry.pool_bytes().map(crate::report::bytes_binary).unwrap_or_default(),
                    if cfg.memory == MemoryKind::Vram { "VRAM" } else { "DRAM" },
                    cfg.backend,
                    side.host,
                    if side.memory == MemoryKind::Vram { format!("VRAM on GPU {}", side.device) } else { "DRAM".into() }
                ));
                build_decode_pool(cfg)?
            }
        };
        let opts = crate::transport::TransportOptions { xfer_req: cfg.xfer_req, backend_params: cfg.backend_params.clone() };
        let refusal = |e| backend_refusal(&cfg.backend, cfg.memory, e);
        crate::trace!("decode NIXL agent");
        let mut decode = Endpoint::with_options("kvprobe-decode", &cfg.backend, pool, &opts).map_err(refusal)?;
        let info = decode.info().map_err(refusal)?;
        // In process, prefill's requests hold shares of decode's registrations and decode's of
        // prefill's (as between two agents of one process): neither pool is freed under them.
        *handoff.decode_lease.lock().unwrap_or_else(|p| p.into_inner()) = Some(info.lease.clone());
        let mut peer = crate::peer::client::PrefillPeer::connect_agents(link, info, side, section)?;
        if let Some(l) = handoff.prefill_lease.lock().unwrap_or_else(|p| p.into_inner()).take() {
            peer.info.lease = l;
        }
        // A peer whose metadata NIXL cannot load is the peer's fault (transport, exit 3), not a
        // backend that cannot serve this side's pools.
        crate::trace!("decode loads prefill's metadata");
        decode.connect(peer.info.clone())?;
        match holder {
            Some(h) => peer.adopt(h),
            None => peer.set_up(),
        }
        crate::trace!("connected to the prefill peer");
        Ok(Probe { cfg: cfg.clone(), prefill: Prefill::Peer(Box::new(peer)), decode, copy_gbps })
    }

    /// The sweep's prefill, over the protocol. Errors: usage for an in-process endpoint (only
    /// the scenario engine and `ab` drive one).
    fn peer(&self) -> Result<&crate::peer::client::PrefillPeer> {
        match &self.prefill {
            Prefill::Peer(p) => Ok(p),
            Prefill::Local(_) => Err(Error::Usage("the sweep drives prefill over the peer protocol".into())),
        }
    }

    fn plan(&self, it: u32) -> Result<Plan> {
        plan(&self.cfg, it)
    }

    /// Prefill refills `stage` (every layer: `None`) with `plan`'s generation and plants its
    /// faults there: asked for, not waited for ([`PrefillPeer::await_filled`] before a READ of
    /// it).
    ///
    /// [`PrefillPeer::await_filled`]: crate::peer::client::PrefillPeer::await_filled
    fn fill_source(&mut self, plan: &Plan, stage: Option<usize>) -> Result<()> {
        self.peer()?.fill(plan.it, stage.map(|k| k as u32))
    }

    /// Waits until every fill asked of prefill is complete.
    fn finish_source(&mut self) -> Result<()> {
        self.peer()?.await_all_filled()
    }

    /// Posts stage `k` of iteration `it` (`pairs`, notification `tag`) for `op`: READ, decode
    /// posts once prefill has filled the stage; WRITE, prefill is asked to post.
    fn post(&self, op: Op, it: u32, k: usize, pairs: &[Pair], tag: &str, timeout: Duration) -> Result<SweepRequest> {
        let p = self.peer()?;
        match op {
            Op::Read => {
                p.await_filled(it, Some(k as u32))?;
                let d = crate::deadline::Deadline::after(timeout);
                // A failed post with prefill gone is prefill's death (as a failed poll).
                Ok(SweepRequest::Nixl(self.decode.post_as_initiator(Op::Read, pairs, tag, d).map_err(|e| p.cause_of(e))?))
            }
            Op::Write => {
                let deadline = crate::deadline::Deadline::after(timeout);
                p.post_write(it, k as u32, tag)?;
                Ok(SweepRequest::PeerWrite { tag: tag.into(), deadline, late_misses: 0 })
            }
        }
    }

    /// Checks a stage's request once: `Some` when complete. A peer's liveness is checked too
    /// (a dead peer: transport, exit 3; a silent one: timeout, exit 4).
    fn poll(&self, r: &mut SweepRequest) -> Result<Option<crate::nixl::XferResult>> {
        let p = self.peer()?;
        match r {
            SweepRequest::Nixl(r) => {
                p.pump(Duration::ZERO)?;
                self.decode.poll(r).map_err(|e| p.cause_of(e))
            }
            SweepRequest::PeerWrite { tag, deadline, late_misses } => {
                let asked = Instant::now();
                let timeout = |why: String| {
                    Error::Timeout(format!(
                        "WRITE {tag} by {}: {why}, over --timeout {:.6} s ({:.3} s since it was sent)",
                        p.who(),
                        deadline.limit_secs(),
                        deadline.elapsed_secs()
                    ))
                };
                match p.take_written(tag)? {
                    Some(done) if done.elapsed > deadline.limit => {
                        Err(timeout(format!("it took {:.3} s from post to completion", done.elapsed.as_secs_f64())))
                    }
                    Some(done) => Ok(Some(done)),
                    None if deadline.passed_at(asked) => {
                        *late_misses += 1;
                        if *late_misses >= 2 { Err(timeout("still not complete".into())) } else { Ok(None) }
                    }
                    None => Ok(None),
                }
                .map_err(|e| p.cause_of(e))
            }
        }
    }

    /// WRITE: checks once whether decode has stage `tag`'s notification from prefill.
    fn poll_notification(&self, inbox: &mut transport::Inbox, tag: &str, d: crate::deadline::Deadline) -> Result<bool> {
        let p = self.peer()?;
        p.pump(Duration::ZERO)?;
        transport::poll_notification_from(&self.decode, &p.info.agent, inbox, tag, d).map_err(|e| match p.cause_of(e) {
            // Name where prefill is, not only its agent.
            Error::Timeout(m) => Error::Timeout(format!("{m}; prefill is {}", p.who())),
            e => e,
        })
    }

    /// READ: waits until prefill has every notification in `tags`.
    fn await_notifications(&self, tags: &mut HashMap<String, crate::deadline::Deadline>) -> Result<()> {
        let p = self.peer()?;
        p.await_notifications(tags).map_err(|e| p.cause_of(e))
    }

    /// The test-only early-notification fault: prefill sends `tag` alone.
    fn notify_decode(&self, tag: &str) -> Result<()> {
        self.peer()?.notify(tag)
    }
}

/// What each prefill slot holds in generation `generation`: slot `i` holds logical block
/// [`logical_block`]`(seed, i)`.
fn source_table(cfg: &RunConfig, generation: u32) -> Vec<TableEntry> {
    (0..cfg.geometry.num_blocks).map(|i| TableEntry { block: logical_block(cfg.seed, i), generation }).collect()
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
                let id = fingerprint::BlockIdentity {
                    layer: at.layer,
                    kv: at.kv,
                    block: logical_block(cfg.seed, at.block),
                    generation: plan.it - 1,
                };
                let bytes = fingerprint::expected(sb, cfg.seed, id);
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
    perm: Vec<u32>,
    actions: Vec<Action>,
    /// What each prefill slot holds.
    pub(crate) src_table: Vec<TableEntry>,
    /// What each decode slot must hold after the transfer.
    dst_table: Vec<TableEntry>,
    /// Decode slot → prefill slot.
    src_of: Vec<u32>,
    /// Injected pairs by source slice (`None`: not sent).
    special: HashMap<SliceCoord, Option<Pair>>,
    /// Decode slices where an injection must show, with its class.
    predicted: HashMap<SliceCoord, Class>,
    /// Injected stray writes (`--inject stray`): extra pairs, by the stage whose request
    /// carries them.
    strays: Vec<(usize, Pair)>,
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

pub use crate::report::StrayCheck;

/// Records the slices a stray-write check of iteration `plan.it` found changed (`fails`,
/// from [`KvPool::take_poison_failures`] or a re-verify's [`KvPool::take_failures`]) as
/// class `stray` failures: what the slot should have held (its poison, or `plan`'s expected
/// fingerprint), the bad bytes and first bad offset the check counted, and the identity
/// the slot holds when a sector's tag decodes (which block landed there). Re-verify
/// failures of slices already corrupt in this iteration (in `seen`) are not recorded again.
/// Returns how many were recorded.
#[allow(clippy::too_many_arguments)]
fn record_strays(
    cfg: &RunConfig,
    probe: &Probe,
    plan: &Plan,
    fails: &[crate::pool::RawFailure],
    check: StrayCheck,
    seen: &mut HashMap<SliceCoord, Class>,
    report: &mut Report,
    dump: &mut Option<&mut crate::dump::Dumper>,
) -> Result<u64> {
    let g = &cfg.geometry;
    let sb = g.slice_bytes()? as usize;
    let mut buf = vec![0u8; sb];
    let mut n = 0;
    for f in fails {
        let c = g.coord_of(f.slice);
        if check == StrayCheck::Reverify && seen.contains_key(&c) {
            continue;
        }
        let expected = plan.dst_table[c.block as usize].identity(c);
        probe.decode.pool.read_slice(c, &mut buf)?;
        let want = match check {
            StrayCheck::Poison => {
                let mut p = vec![0u8; sb];
                fingerprint::poison(&mut p, f.slice, plan.it);
                p
            }
            StrayCheck::Reverify => fingerprint::expected(sb, cfg.seed, expected),
        };
        let observed = fingerprint::observed_identity(&buf, cfg.seed, f.first_bad);
        let v = verify::Verdict { class: Class::Stray, observed, bit_flips: None, sectors: None };
        seen.insert(c, Class::Stray);
        if plan.predicted.get(&c) != Some(&Class::Stray) {
            report.summary.unexpected_failures += 1;
        }
        n += 1;
        *report.summary.by_class.entry(Class::Stray.name().to_string()).or_default() += 1;
        let listed = report.failures.len() < cfg.max_failures;
        if !listed {
            report.summary.failures_omitted += 1;
        }
        crate::dump::keep(dump.as_deref_mut(), listed.then_some(&mut report.failures), &buf, Class::Stray, || {
            let mut rec = Failure::new(plan.it, c, f, v, &want, &buf, expected, plan.src_of[c.block as usize]);
            rec.stray_check = Some(check);
            rec
        });
    }
    Ok(n)
}

/// The stray-write check of a pipelined sweep before `layers` of iteration `plan.it` are
/// posted: every slice must still hold the poison of (`plan.it`, slot); one that does not
/// was written by something other than its own transfer since its re-poison (a stray write,
/// [`record_strays`]). Waits for the check (VRAM: its kernel) to finish, so the post cannot
/// overwrite what it reads. Returns the strays recorded.
fn poison_check(
    cfg: &RunConfig,
    probe: &mut Probe,
    plan: &Plan,
    layers: Range<u32>,
    seen: &mut HashMap<SliceCoord, Class>,
    report: &mut Report,
    dump: &mut Option<&mut crate::dump::Dumper>,
) -> Result<u64> {
    probe.decode.pool.check_poison_layers(layers, plan.it)?;
    let (fails, slices) = probe.decode.pool.take_poison_failures()?;
    report.summary.stray_poison_checked_slices += slices;
    record_strays(cfg, probe, plan, &fails, StrayCheck::Poison, seen, report, dump)
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
        schema: crate::report::SCHEMA.to_string(),
        started_unix: std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0),
        config: serde_json::to_value(cfg).unwrap_or(serde_json::Value::Null),
        environment: None,
        summary: Summary::new(),
        failures: Vec::new(),
        injections: Vec::new(),
        scenario: None,
        dump: None,
        peer: None,
        outcome: Outcome { exit_code: 0, status: "running".into(), error: None },
    }
}

/// The report of the run in progress as last published ([`publish`]), for the watchdog.
static SHADOW: std::sync::Mutex<Option<Report>> = std::sync::Mutex::new(None);

/// Publishes the report so far, so that a call that blocks past its deadline still ends the
/// run with it ([`expired_report`], [`crate::deadline`]). Called after set-up steps, after
/// each sweep iteration and with each scenario progress update. Cheap: listed failures and
/// injections are appended, not copied again (a run only ever appends to them).
pub(crate) fn publish(r: &Report) {
    let mut s = SHADOW.lock().unwrap_or_else(|p| p.into_inner());
    match s.as_mut() {
        Some(sh)
            if sh.started_unix == r.started_unix
                && sh.config == r.config
                && sh.failures.len() <= r.failures.len()
                && sh.injections.len() <= r.injections.len() =>
        {
            sh.failures.extend_from_slice(&r.failures[sh.failures.len()..]);
            sh.injections.extend_from_slice(&r.injections[sh.injections.len()..]);
            sh.summary = r.summary.clone();
            sh.scenario = r.scenario.clone();
            if sh.environment.is_none() {
                sh.environment = r.environment.clone();
            }
        }
        _ => *s = Some(r.clone()),
    }
}

/// The report to write when a call blocked past its deadline (`e`, a timeout) and the run
/// cannot end normally: the last published report of `cfg`'s run (or an empty one), its
/// outcome `e` — exit 4, or 1 when corruption was already found. A dump in progress (`--dump`)
/// is finished against it ([`crate::dump::finish_active`]).
pub fn expired_report(cfg: &RunConfig, e: &Error) -> (Report, Exit) {
    let mut r = empty_report(cfg);
    let shadow = SHADOW.lock().unwrap_or_else(|p| p.into_inner()).clone();
    if let Some(s) = shadow.filter(|s| s.config == r.config) {
        r = s;
    }
    // The dump in progress (--dump) ends with this report: the slices it counts.
    r.dump = crate::dump::finish_active(r.summary.by_class.values().sum());
    r.summary.host_peak_bytes = crate::hostmem::peak_resident_bytes();
    let exit = if r.summary.blocks_corrupt > 0 { Exit::Corrupt } else { e.exit() };
    r.finish(exit, Some(e));
    (r, exit)
}

/// Runs the probe: the whole-pool sweep, or one scenario when `cfg.scenario` is set. Never
/// panics on bad input: every outcome, including errors, comes back as a report with its
/// exit code.
pub fn run(cfg: &RunConfig, hooks: &mut Hooks<'_>) -> (Report, Exit) {
    let mut report = empty_report(cfg);
    let mut probe = None;
    let result = run_inner(cfg, &mut report, hooks, &mut probe);
    report.summary.host_peak_bytes = crate::hostmem::peak_resident_bytes();
    let corrupt = report.summary.blocks_corrupt > 0;
    let (exit, err) = match (&result, corrupt) {
        (_, true) => (Exit::Corrupt, result.as_ref().err()),
        (Err(e), false) => (e.exit(), Some(e)),
        // An unfenced mechanism that never corrupted anything is not a pass: the run could
        // not have seen that bug (exit 6, as `kvprobe ab` gives for the same verdict).
        (Ok(()), false) if !unfenced_not_reproduced(&report).is_empty() => (Exit::NotReproduced, None),
        (Ok(()), false) => match cfg.min_gbps {
            Some(m) if report.summary.transfer_gbps < m => (Exit::BelowRate, None),
            _ => (Exit::Clean, None),
        },
    };
    report.finish(exit, err);
    if let Some(Probe { prefill: Prefill::Peer(p), .. }) = &probe {
        // The pair ends together: prefill takes this outcome and sends its side of the report.
        let summary = serde_json::to_value(&report.summary).ok();
        let side = p.finish(exit as u8, err.map(|e| e.to_string()), summary, PEER_BYE_BOUND);
        if cfg.op == Op::Write
            && let Some(mut theirs) = side.transport_path.clone()
        {
            // WRITE: the initiator's table is prefill's. The copy ceiling and any warning
            // were this side's (--decode-process: both pools on this host).
            if let Some(ours) = report.summary.transport_path.take() {
                theirs.copy_gbps = ours.copy_gbps;
                theirs.ratio_to_copy = ours.copy_gbps.map(|c| report.summary.transfer_gbps / c.max(1e-12));
                if theirs.warning.is_none() {
                    theirs.warning = ours.warning;
                }
            }
            if in_process(cfg) {
                // Prefill's thread has no environment of its own to judge its path by.
                judge_path(cfg, &mut theirs, report.environment.as_ref());
            }
            report.summary.transport_path = Some(theirs);
        }
        if !in_process(cfg) {
            report.peer = Some(side);
        }
    }
    drop(probe);
    (report, exit)
}

/// `--decode-process`: times the copy ceiling of `decode`'s pool from a scratch pool of the
/// same geometry that this process allocates on prefill's memory and GPU (the child holds
/// prefill's own pool) ([`time_copy`]: GB/s); the scratch pool is freed on return. Errors: the
/// scratch pool cannot be allocated (e.g. prefill's GPU has no room for a second pool), a CUDA
/// error.
fn copy_ceiling_from_scratch(cfg: &RunConfig, decode: &mut Endpoint, plan: &Plan) -> Result<f64> {
    crate::trace!("copy ceiling from a scratch pool on prefill's side");
    let mut src = build_prefill_pool(cfg, cfg.memory, cfg.prefill_device)?;
    time_copy(cfg, &mut src, &mut decode.pool, plan)
}

/// The copy ceiling the transfer rate is compared to: fills `src` (prefill's memory) with
/// `plan`'s generation (fingerprinted bytes, no faults) and copies it whole into `dst`
/// (decode's, poisoned afterwards anyway) twice; returns the pool's bytes over the seconds of
/// the second copy, in GB/s = 1e9 B/s (the first copy warms up: page faults on DRAM). Across two GPUs the copy runs with peer access
/// enabled, as cuMemcpyPeer over NVLink would (without it the driver stages through the host
/// at a tenth of the rate). Errors: a CUDA error.
fn time_copy(cfg: &RunConfig, src: &mut KvPool, dst: &mut KvPool, plan: &Plan) -> Result<f64> {
    src.load_table(&plan.src_table)?;
    src.fill_layers(0..cfg.geometry.num_layers)?;
    src.finish()?;
    src.take_kernel_seconds();
    let gpus = (dst.gpu(), src.gpu());
    let mut copy = || {
        dst.copy_pool_from(src)?;
        dst.copy_pool_from(src)
    };
    let secs = match gpus {
        (Some(d), Some(p)) if d.ordinal() != p.ordinal() => d.with_peer_access(&p, copy)?,
        _ => copy()?,
    };
    Ok(cfg.geometry.pool_bytes()? as f64 / secs.max(1e-12) / 1e9)
}

/// How long `run --peer` waits for prefill's side of the report after telling it the outcome.
pub const PEER_BYE_BOUND: Duration = Duration::from_secs(5);

/// The unfenced race mechanisms of a scenario run whose verdict is not `detected` (empty
/// for sweeps and fenced runs).
pub fn unfenced_not_reproduced(report: &Report) -> Vec<crate::race::Mechanism> {
    report.scenario.as_ref().map_or_else(Vec::new, |sc| {
        sc.races
            .iter()
            .filter(|o| o.fencing == crate::race::Fencing::Unfenced && o.verdict != "detected")
            .map(|o| o.mechanism)
            .collect()
    })
}

/// Checks the configuration and host memory, loads NIXL and records the environment in
/// `report`; the common start of `run` and `ab`.
pub(crate) fn prepare(cfg: &RunConfig, report: &mut Report) -> Result<()> {
    // A refused configuration is said before any set-up line (its report still records the
    // environment).
    let config = check_config(cfg);
    if config.is_ok() {
        crate::phase::announce("setup: loading NIXL, checking the environment");
    }
    crate::nixl::prepare_ucx_env(
        cfg.memory == MemoryKind::Vram && cfg.prefill_device == cfg.decode_device && !cfg.decode_process,
    );
    crate::nixl::check_ucx_log_file()?;
    let lib = crate::nixl::load();
    report.environment = Some(crate::envinfo::gather(crate::envinfo::nixl_info()));
    config?;
    check_host_memory(cfg)?;
    lib?;
    Ok(())
}

fn run_inner(cfg: &RunConfig, report: &mut Report, hooks: &mut Hooks<'_>, slot: &mut Option<Probe>) -> Result<()> {
    let started = Instant::now();
    publish(report);
    prepare(cfg, report)?;
    crate::deadline::set_limit(Some(Duration::from_secs_f64(cfg.timeout_secs)));
    publish(report);
    let ucx_mark = crate::ucx::mark();
    // The sweep's prefill is a peer wherever it is (another host, a child, a thread of this
    // process); the scenario engine still drives an in-process endpoint directly.
    let probe = slot.insert(if cfg.scenario.is_none() || cfg.peer.is_some() || cfg.decode_process {
        Probe::setup_peer(cfg, report.environment.clone())?
    } else {
        Probe::setup(cfg)?
    });
    if let Prefill::Peer(p) = &probe.prefill
        && !in_process(cfg)
    {
        report.peer = Some(p.section.clone());
    }
    crate::ucx::adopt();
    // The agents have started their UCX backends: the UCX library is loaded now.
    if let Some(e) = report.environment.as_mut() {
        e.nixl.ucx_version = crate::nixl::loaded_ucx_version();
    }
    if let Some(sc) = &cfg.scenario {
        let timeout = Duration::from_secs_f64(cfg.timeout_secs);
        return crate::engine::run_scenario(
            sc,
            cfg.seed,
            probe.prefill.local_mut()?,
            &mut probe.decode,
            timeout,
            cfg.max_failures,
            report,
            hooks.progress,
            (hooks.checkpoint_secs, hooks.checkpoint),
            hooks.dump.as_deref_mut(),
        );
    }
    sweep(cfg, probe, report, hooks.line, hooks.dump.as_deref_mut(), started, ucx_mark)
}

/// Adds what this host's facts say of a sweep's UCX path `p` (this side's, or in process the
/// prefill thread's): the warning for emulated VRAM transfers between two GPUs of one process,
/// and the flags of a TCP path where an RDMA NIC exists, no GPUDirect RDMA, a NIC that is not
/// the GPU's nearest ([`crate::ucx::flag_path`]; a peer on another host or process flags its
/// own path).
fn judge_path(cfg: &RunConfig, p: &mut crate::ucx::TransportPath, env: Option<&crate::envinfo::Environment>) {
    if p.emulated && cfg.memory == MemoryKind::Vram && cfg.prefill_device != cfg.decode_device && in_process(cfg) {
        p.warning = Some(
            "UCX does not use cuda_ipc between two GPUs of one process (cuda_ipc reaches other processes \
             only): add --decode-process to run the two agents in two processes"
                .into(),
        );
    }
    if let Some(env) = env {
        let initiator = if cfg.op == Op::Write && cfg.peer.is_none() { cfg.prefill_device } else { cfg.decode_device };
        let gpu = (cfg.memory == MemoryKind::Vram).then_some(initiator);
        crate::ucx::flag_path(p, &env.rdma, gpu);
    }
}

/// True when the sweep's prefill is a thread of this process (neither `--peer` nor
/// `--decode-process`): the report then has no `peer` section (one process, one environment).
pub(crate) fn in_process(cfg: &RunConfig) -> bool {
    cfg.peer.is_none() && !cfg.decode_process
}

/// A sweep stage's request.
enum Staged {
    /// The stage moves nothing (every pair dropped by an injection).
    Empty,
    /// Posted with the stage's notification.
    Posted(SweepRequest),
    /// Test-only ([`EARLY_NOTIFY_VAR`]): the stage's notification was sent alone; the transfer
    /// is posted after decode verified the stage.
    Deferred { pairs: Vec<Pair>, deadline: crate::deadline::Deadline },
}

/// Test-only fault hook: `KVPROBE_TEST_EARLY_NOTIFY=N` makes prefill deliver each stage's
/// notification of sweep iteration N before the stage's data (a bare NIXL notification, the
/// WRITE posted only after decode verified the stage), as a transport that notifies before
/// the data has landed would. Decode verifies on the notification, so every slice of
/// iteration N must be reported `unwritten` (exit 1). WRITE only.
pub const EARLY_NOTIFY_VAR: &str = "KVPROBE_TEST_EARLY_NOTIFY";

/// Reads [`EARLY_NOTIFY_VAR`]. Errors (usage, exit 2): not a positive iteration number, or
/// set with `--op read` (READ completes at decode, its initiator).
fn early_notify_fault(op: Op) -> Result<Option<u32>> {
    let Some(v) = std::env::var_os(EARLY_NOTIFY_VAR) else { return Ok(None) };
    let n = v
        .to_str()
        .and_then(|s| s.parse::<u32>().ok())
        .filter(|n| *n >= 1)
        .ok_or_else(|| Error::Usage(format!("{EARLY_NOTIFY_VAR} must be an iteration number (1 or more); got {v:?}")))?;
    if op != Op::Write {
        return Err(Error::Usage(format!("{EARLY_NOTIFY_VAR} needs --op write (a READ completes at decode)")));
    }
    eprintln!("test fault: iteration {n}'s notifications are sent before their data");
    Ok(Some(n))
}

/// Spins on `check` until it yields a value (stage `k` of iteration `it` waiting for its
/// `what`). A signal lets the wait go on for up to `interrupt::GRACE` after it (then the
/// report says interrupted rather than waiting out --timeout on a stalled transfer); `check`
/// ends the wait with a timeout past the request's deadline.
fn wait<T>(it: u32, k: usize, what: &str, mut check: impl FnMut() -> Result<Option<T>>) -> Result<T> {
    loop {
        if let Some(v) = check()? {
            return Ok(v);
        }
        if crate::interrupt::since_requested().is_some_and(|d| d > crate::interrupt::GRACE) {
            return Err(Error::Interrupted(format!(
                "in iteration {it} while stage {k}'s {what} was awaited (incomplete {} s after the signal; \
                 this iteration is not verified)",
                crate::interrupt::GRACE.as_secs()
            )));
        }
        std::hint::spin_loop();
    }
}

/// The whole-pool sweep, pipelined by layer stages ([`stages`]): while stage k+1 (and
/// k+2) of iteration `it` are in flight, decode verifies stage k (failures classified at
/// once, before the slices are reused), re-poisons it for `it + 1`, and prefill refills it
/// with generation `it + 1` — so only the last stage's passes stay outside the transfer.
/// The first fill and poison run before iteration 1 (part of setup).
fn sweep(
    cfg: &RunConfig,
    probe: &mut Probe,
    report: &mut Report,
    progress: &mut dyn FnMut(&str),
    mut dump: Option<&mut crate::dump::Dumper>,
    started: Instant,
    ucx_mark: u64,
) -> Result<()> {
    let g = cfg.geometry.clone();
    let sb = g.slice_bytes()? as usize;
    let total = g.total_slices()?;
    let pool_bytes = g.pool_bytes()?;
    let timeout = Duration::from_secs_f64(cfg.timeout_secs);
    let stages = sweep_stages(cfg);
    // With one stage nothing is in flight between a stage's re-poison and its next post.
    let stray_checks = stages.len() > 1;
    let all = 0..g.num_layers;
    let mut buf = vec![0u8; sb];
    let mut verify_all = 0.0;
    let early_notify = early_notify_fault(cfg.op)?;

    // Setup: iteration 1's fill and faults, the copy ceiling, iteration 1's poison.
    let scratch_ceiling = cfg.decode_process && pool_bytes >= MIN_CEILING_BYTES;
    crate::phase::announce(&format!(
        "setup: filling the prefill pool{}, poisoning the decode pool",
        if scratch_ceiling { ", timing a copy of it (the ceiling)" } else { "" }
    ));
    let mut cur = probe.plan(1)?;
    probe.fill_source(&cur, None)?;
    probe.finish_source()?;
    // The ceiling the transfer rate is compared to ([`time_copy`]). A pool below
    // MIN_CEILING_BYTES copies in the time of the copy's fixed costs (threads, launches): no
    // ceiling is measured, and the summary says so instead of a ratio. In process it was timed
    // at set-up, on prefill's own pool. Across a node pair the pools are on two hosts: no copy
    // between them to time. With --decode-process both are on this host, prefill's in the
    // child: the copy comes from a scratch pool of the same geometry on prefill's memory and GPU.
    let copy_gbps = if scratch_ceiling {
        crate::trace!("copy ceiling");
        match copy_ceiling_from_scratch(cfg, &mut probe.decode, &cur) {
            Ok(gbps) => Some(gbps),
            // Not the run's failure: the run goes on without a ceiling, and says why.
            Err(e) => {
                eprintln!("kvprobe: no copy ceiling (a scratch pool on prefill's side for the copy: {e})");
                None
            }
        }
    } else {
        probe.copy_gbps
    };
    probe.decode.pool.poison_layers(all.clone(), 1, false)?;
    probe.decode.pool.finish()?;
    probe.peer()?.take_fill_kernel_seconds();
    probe.decode.pool.take_kernel_seconds();
    report.summary.setup_seconds = started.elapsed().as_secs_f64();
    report.summary.pipeline_stages = stages.len() as u32;
    publish(report);

    for it in 1..=cfg.iterations {
        if crate::interrupt::requested() {
            return Err(Error::Interrupted(format!("after {} complete iterations", it - 1)));
        }
        crate::deadline::set_position(it, 0);
        let iteration_start = Instant::now();
        let mut times = IterationTimes { index: it, ..Default::default() };
        let classes_before = report.summary.by_class.clone();
        let more = it < cfg.iterations;
        probe.decode.pool.load_table(&cur.dst_table)?;
        let mut next: Option<Plan> = None;
        let mut seen: HashMap<SliceCoord, Class> = HashMap::new();
        let mut corrupt = 0u64;
        let mut bytes = 0u64;
        let tag = |k: usize| format!("kvprobe:iter={it}:stage={k}");
        // READ: the notifications prefill must get (awaited after the last stage); WRITE:
        // each stage is verified when decode has its notification ([`Staged`]).
        let mut tags = HashMap::new();
        let early = early_notify == Some(it);
        let mut inflight = std::collections::VecDeque::new();
        let mut post = |probe: &Probe, k: usize, inflight: &mut std::collections::VecDeque<Staged>| -> Result<()> {
            let pairs = stage_request(cfg, &cur, &stages, k)?;
            let staged = if pairs.is_empty() {
                Staged::Empty
            } else if early {
                // Test-only: the notification now, the transfer after decode verified.
                let deadline = crate::deadline::Deadline::after(timeout);
                probe.notify_decode(&tag(k))?;
                Staged::Deferred { pairs, deadline }
            } else {
                let p = probe.post(cfg.op, it, k, &pairs, &tag(k), timeout)?;
                if cfg.op == Op::Read {
                    tags.insert(tag(k), p.deadline());
                }
                Staged::Posted(p)
            };
            inflight.push_back(staged);
            Ok(())
        };
        // Stray-write check of the stages posted first, before the window (nothing in flight).
        if stray_checks {
            let t = Instant::now();
            for layers in stages.iter().take(2) {
                corrupt += poison_check(cfg, probe, &cur, layers.clone(), &mut seen, report, &mut dump)?;
            }
            report.summary.stray_check_seconds += t.elapsed().as_secs_f64();
        }
        // The transfer window: from building the first request's descriptors to the last
        // request's completion.
        let mut inbox = transport::Inbox::default();
        let window_start = Instant::now();
        crate::trace!("iteration {it}: posting");
        for k in 0..stages.len().min(2) {
            post(probe, k, &mut inflight)?;
        }
        let mut window_end = window_start;
        for (k, layers) in stages.iter().enumerate() {
            // Wait for stage k: READ, decode's own request complete (decode initiated it);
            // WRITE, decode's notification of it, as decode knows nothing else of a push (the
            // initiator's completion is waited for after the verify, before prefill refills
            // the source) — so a notification that comes before the data is caught.
            crate::deadline::set_position(it, k as u32);
            let mut staged = inflight.pop_front().expect("one request per stage");
            let mut written = None;
            match (&mut staged, cfg.op) {
                (Staged::Empty, _) => {}
                (Staged::Posted(p), Op::Read) => {
                    let r = wait(it, k, "transfer", || probe.poll(p))?;
                    bytes += r.bytes;
                }
                (Staged::Posted(p), Op::Write) => {
                    // Prefill's status queries drive its progress (UCX sends the data and then
                    // the notification from the initiator's worker); its completion is kept
                    // but is not what the verify waits for.
                    let d = p.deadline();
                    wait(it, k, "notification", || {
                        if written.is_none() {
                            written = probe.poll(p)?;
                        }
                        Ok(probe.poll_notification(&mut inbox, &tag(k), d)?.then_some(()))
                    })?;
                }
                (Staged::Deferred { deadline, .. }, _) => {
                    let d = *deadline;
                    wait(it, k, "notification", || Ok(probe.poll_notification(&mut inbox, &tag(k), d)?.then_some(())))?;
                }
            }
            if k + 2 < stages.len() {
                if stray_checks {
                    // Stray-write check right before the post (later stages are in flight).
                    let t = Instant::now();
                    corrupt += poison_check(cfg, probe, &cur, stages[k + 2].clone(), &mut seen, report, &mut dump)?;
                    times.overlapped += t.elapsed().as_secs_f64();
                }
                post(probe, k + 2, &mut inflight)?;
            }
            let last = k + 1 == stages.len();
            if last {
                window_end = Instant::now();
            }
            if k == 0 && more {
                // Inside the window: the next iteration's plan.
                let t = Instant::now();
                next = Some(probe.plan(it + 1)?);
                if !last {
                    times.overlapped += t.elapsed().as_secs_f64(); // else it is host work after the window
                }
            }
            crate::trace!("iteration {it}: stage {k} complete");
            // Stage k's probe passes: verify, classify, then refill and re-poison for it + 1.
            let t = Instant::now();
            probe.decode.pool.verify_layers(layers.clone())?;
            let fails = probe.decode.pool.take_failures()?;
            for f in &fails {
                let c = g.coord_of(f.slice);
                let expected = cur.dst_table[c.block as usize].identity(c);
                probe.decode.pool.read_slice(c, &mut buf)?;
                let want = fingerprint::expected(sb, cfg.seed, expected);
                let v = verify::classify_against(&buf, &want, expected, cfg.seed, f.slice, it);
                seen.insert(c, v.class);
                if cur.predicted.get(&c) != Some(&v.class) {
                    report.summary.unexpected_failures += 1;
                }
                corrupt += 1;
                *report.summary.by_class.entry(v.class.name().to_string()).or_default() += 1;
                let listed = report.failures.len() < cfg.max_failures;
                if !listed {
                    report.summary.failures_omitted += 1;
                }
                let class = v.class;
                crate::dump::keep(dump.as_deref_mut(), listed.then_some(&mut report.failures), &buf, class, || {
                    Failure::new(it, c, f, v, &want, &buf, expected, cur.src_of[c.block as usize])
                });
            }
            let verify_s = t.elapsed().as_secs_f64();
            verify_all += verify_s;
            // WRITE: prefill's request must be complete before its source is refilled (and a
            // deferred one, of the test-only fault, is posted now and waited for).
            match staged {
                Staged::Posted(mut p) if cfg.op == Op::Write => {
                    let r = match written {
                        Some(r) => r,
                        None => wait(it, k, "transfer", || probe.poll(&mut p))?,
                    };
                    bytes += r.bytes;
                }
                Staged::Deferred { pairs, .. } => {
                    let late = format!("{}:late", tag(k));
                    let mut p = probe.post(cfg.op, it, k, &pairs, &late, timeout)?;
                    let r = wait(it, k, "transfer", || probe.poll(&mut p))?;
                    bytes += r.bytes;
                }
                _ => {}
            }
            let t = Instant::now();
            let mut fill_s = 0.0; // the last iteration refills nothing
            if let Some(n) = &next {
                probe.fill_source(n, Some(k))?;
                fill_s = t.elapsed().as_secs_f64();
            }
            let t = Instant::now();
            if more {
                probe.decode.pool.poison_layers(layers.clone(), it + 1, false)?;
            }
            let mut poison_s = t.elapsed().as_secs_f64();
            if last {
                // Outside the window: the last stage's passes, waited for.
                let t = Instant::now();
                probe.finish_source()?;
                probe.decode.pool.finish()?;
                poison_s += t.elapsed().as_secs_f64();
                times.verify += verify_s;
                times.fill += fill_s;
                times.poison += poison_s;
            } else {
                times.overlapped += verify_s + fill_s + poison_s;
            }
        }
        probe.await_notifications(&mut tags)?;
        times.transfer = (window_end - window_start).as_secs_f64();
        let fill_kernels = probe.peer()?.take_fill_kernel_seconds();
        let kd = probe.decode.pool.take_kernel_seconds();
        times.kernels = crate::report::KernelSeconds { fill: fill_kernels, poison: kd.poison, verify: kd.verify };
        report.summary.bytes_transferred += bytes;
        report.summary.blocks_checked += total;
        let compared = probe.decode.pool.take_compared();
        report.summary.slices_compared += compared.slices;
        report.summary.bytes_compared += compared.bytes;
        if stray_checks && !more {
            // Stages 0..n-2 were verified while later stages were in flight, and the last
            // iteration re-poisons nothing: verify them again now that nothing is in flight. A
            // slice that changed after it verified clean took a stray write.
            let t = Instant::now();
            probe.decode.pool.verify_layers(0..stages[stages.len() - 1].start)?;
            let fails = probe.decode.pool.take_failures()?;
            report.summary.stray_reverified_slices += probe.decode.pool.take_compared().slices;
            corrupt += record_strays(cfg, probe, &cur, &fails, StrayCheck::Reverify, &mut seen, report, &mut dump)?;
            report.summary.stray_check_seconds += t.elapsed().as_secs_f64();
        }
        report.summary.blocks_corrupt += corrupt;
        if it == 1 {
            let mut p = match cfg.op {
                // Replaced by prefill's own table when its report part arrives ([`run`]).
                Op::Write => crate::ucx::TransportPath {
                    backend: cfg.backend.clone(),
                    unknown_because: Some(if in_process(cfg) {
                        "prefill initiates WRITEs on its thread, which sent no report part at the end".into()
                    } else if cfg.decode_process {
                        "prefill initiates WRITEs in the prefill process, which sent no report part at the end".into()
                    } else {
                        "prefill initiates WRITEs on the other host: its path is under peer.transport_path".into()
                    }),
                    ..Default::default()
                },
                Op::Read => probe.decode.transport_path(ucx_mark, cfg.op, cfg.memory == MemoryKind::Vram),
            };
            p.copy_gbps = copy_gbps;
            judge_path(cfg, &mut p, report.environment.as_ref());
            report.summary.transport_path = Some(p);
        }
        for a in &cur.actions {
            let hits: Vec<PredictedHit> = a
                .predicted()
                .into_iter()
                .map(|(src, class)| PredictedHit { layer: src.layer, kv: src.kv, block: cur.perm[src.block as usize], class })
                .collect();
            let detected =
                hits.iter().all(|h| seen.get(&SliceCoord { layer: h.layer, kv: h.kv, block: h.block }) == Some(&h.class));
            report.summary.injections_planted += 1;
            report.summary.injections_detected += detected as u64;
            report.injections.push(InjectionRecord { iteration: it, kind: a.kind(), predicted: hits, detected });
        }
        report.summary.iterations = it;
        times.corrupt = corrupt;
        times.by_class = report
            .summary
            .by_class
            .iter()
            .map(|(k, n)| (k.clone(), n - classes_before.get(k).copied().unwrap_or(0)))
            .filter(|(_, n)| *n > 0)
            .collect();
        times.iteration = iteration_start.elapsed().as_secs_f64();
        let s = &mut report.summary;
        s.fill_seconds += times.fill;
        s.poison_seconds += times.poison;
        s.transfer_seconds += times.transfer;
        s.verify_seconds += times.verify;
        s.overlapped_seconds += times.overlapped;
        s.verify_gbps = pool_bytes as f64 * it as f64 / verify_all.max(1e-9) / 1e9;
        s.iteration_seconds += times.iteration;
        s.kernel_seconds.fill += times.kernels.fill;
        s.kernel_seconds.poison += times.kernels.poison;
        s.kernel_seconds.verify += times.kernels.verify;
        if s.per_iteration.len() < crate::report::PER_ITERATION_MAX {
            s.per_iteration.push(times.clone());
        }
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
            corrupt,
            if times.transfer > 0.0 { bytes as f64 / times.transfer / 1e9 } else { 0.0 }
        ));
        if let Prefill::Peer(p) = &probe.prefill {
            p.verified(it, total, corrupt, if times.transfer > 0.0 { bytes as f64 / times.transfer / 1e9 } else { 0.0 })?;
        }
        if let Some(n) = next {
            cur = n;
        }
        publish(report);
    }
    Ok(())
}
