//! Request-level load on the two pools: a prefill engine with a KV tier, a decode engine
//! pulling over NIXL, and the race mechanisms between them (`kvprobe run --scenario`).
//!
//! # The model
//! Time advances in engine steps. Each step:
//! 1. NIXL: the prefill agent takes its notifications (a decode READ is done, vLLM's
//!    NixlConnector frees then); decode polls its posted READs.
//! 2. The three prefill streams run the operations that are due: the compute stream
//!    (fingerprint writes of computed blocks, in order), the load stream (tier loads of
//!    prefix hits into newly allocated blocks) and the put worker (async saves). Decode's
//!    tier loads (tier-only) run on decode's load stream. Each operation is due a seeded
//!    0–3 steps after it was issued (a quarter of the saves 16–96 steps, a backlogged
//!    store), which is how asynchrony is modelled: which copy runs
//!    in which step follows from `--seed`. NIXL transfers are real and asynchronous and
//!    overlap all of this, so when a READ completes (and with it what is freed next) varies
//!    from run to run; `--lockstep` completes each step's READs within the step, and then
//!    the whole run, corrupt counts included, replays exactly from the seed.
//! 3. Requests move on: a request whose prefill writes are done is scheduled on decode a
//!    seeded 0–2 steps later (decode allocates blocks, poisons them, posts one NIXL READ of
//!    every block slice of the request, or loads the blocks from the tier); prefill
//!    blocks are freed when every connector that touched them has reported done.
//! 4. Decode verifies every slice of each request whose READ (or tier load) completed, in
//!    one pass, against the logical block the request expects, then frees its blocks.
//! 5. New requests are admitted up to `--concurrency`: the tier lookup of the prompt's
//!    leading block hashes completes a step later (lookup_async), then hits are loaded and
//!    the rest computed, and computed blocks are saved.
//!
//! # Attribution
//! Every write into a prefill block goes through this engine, so it keeps a shadow of what
//! each block and tier entry holds ([`Content`]), stamped with the unfenced mechanism that
//! allowed a write, if one did, and for each NIXL READ in flight every content written into
//! its blocks until it completes. A corrupt slice at decode is *explained* only when every
//! 4-byte element of it is what one of the contents its block held during the READ window
//! put there ([`attribute`]), and is then attributed to the stamped mechanism. Anything
//! else — poison, a flipped bit, garbage, an identity never written in the window — is a
//! defect of the stack under test (exit 1), as is any corruption in a fenced run.
//!
//! Test-only: `KVPROBE_TEST_FAULT` plants damage no race can produce ([`TestFault`]).

use crate::error::{Error, Result};
use crate::fingerprint::{self, BlockIdentity, SKIP_GEN};
use crate::geometry::SliceCoord;
use crate::nixl::Posted;
use crate::pool::TableEntry;
use crate::race::{Fencing, Mechanism, Races, Scenario};
use crate::report::{Failure, Report};
use crate::tier::{Content, EntryId, Store};
use crate::transport::{Endpoint, Pair};
use crate::verify::{self, Class};
use crate::workload::{RequestSpec, Workload, WorkloadConfig};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::Serialize;
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::time::{Duration, Instant};

/// The KV tier under the connectors.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, serde::Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum TierKind {
    /// The built-in store (src/tier.rs): block-hash keyed entries in host memory.
    Embedded,
    /// A real Mooncake Store (master started by kvprobe, or `--mooncake-master`; Python store
    /// client as a worker) on DRAM or VRAM pools.
    Mooncake,
}

/// Parameters of a scenario run.
#[derive(Clone, Debug, Serialize, serde::Deserialize)]
pub struct ScenarioConfig {
    /// Which connectors move the blocks.
    pub scenario: Scenario,
    /// Mechanisms left unfenced (all others fenced).
    pub unfenced: Vec<Mechanism>,
    /// Stop admitting after this many requests (when no duration is given).
    pub requests: u64,
    /// Stop admitting after this many seconds; `requests` is then unused (the command line
    /// refuses `--duration` with `--requests`).
    pub duration_secs: Option<f64>,
    /// Requests in flight at most.
    pub concurrency: u32,
    /// Prompt lengths, prefix sharing and aborts.
    pub workload: WorkloadConfig,
    /// The tier.
    pub tier: TierKind,
    /// `--tier mooncake` with an existing master and metadata service instead of one kvprobe
    /// starts.
    pub mooncake: Option<crate::mooncake::External>,
    /// Tier entries (blocks).
    pub tier_blocks: u32,
    /// Seconds per error-rate interval in the report.
    pub interval_secs: f64,
    /// Complete each step's READs (and their notifications) within the step: no copy
    /// overlaps a transfer, and the whole run, counts included, follows from the seed.
    pub lockstep: bool,
}

impl ScenarioConfig {
    /// The unfenced set.
    pub fn races(&self) -> Races {
        Races::from_specs(
            &self
                .unfenced
                .iter()
                .map(|&m| crate::race::RaceSpec { mechanism: m, fencing: Fencing::Unfenced })
                .collect::<Vec<_>>(),
        )
    }
}

/// Classes an unfenced mechanism may produce at decode: another block's data (misplaced),
/// the same block's older data (stale), or a mix when the write lands during a READ (torn).
pub const RACE_CLASSES: [Class; 3] = [Class::Misplaced, Class::Stale, Class::Torn];

/// One mechanism's outcome in a run.
#[derive(Clone, Debug, Serialize, serde::Deserialize)]
pub struct RaceOutcome {
    /// The mechanism.
    pub mechanism: Mechanism,
    /// Kept or left out in this run.
    pub fencing: Fencing,
    /// Times the unfenced ordering let a conflicting copy happen.
    pub windows_opened: u64,
    /// Corrupt slices at decode explained by this mechanism.
    pub corrupt_attributed: u64,
    /// Those slices by class.
    pub classes: BTreeMap<String, u64>,
    /// Classes it predicts ([`RACE_CLASSES`]).
    pub predicted_classes: Vec<Class>,
    /// "detected", "not reproduced", or "clean" (fenced).
    pub verdict: String,
    /// Why it was not reproduced, when it was not.
    pub why: Option<String>,
}

/// Counts over one interval of the run (error rate over time).
#[derive(Clone, Debug, Default, Serialize, serde::Deserialize)]
pub struct Interval {
    /// Start, seconds since the run started.
    pub start_s: f64,
    /// End, seconds since the run started.
    pub end_s: f64,
    /// Requests verified at decode.
    pub requests: u64,
    /// Block slices verified.
    pub slices_checked: u64,
    /// Corrupt slices found.
    pub corrupt: u64,
}

/// The scenario part of a report.
#[derive(Clone, Debug, Serialize, serde::Deserialize)]
pub struct ScenarioReport {
    /// Scenario.
    pub scenario: Scenario,
    /// Tier.
    pub tier: TierKind,
    /// Engine steps run.
    pub steps: u64,
    /// Seconds from the first admission to the end of the drain.
    pub seconds: f64,
    /// Requests admitted.
    pub requests_admitted: u64,
    /// Requests verified at decode.
    pub requests_verified: u64,
    /// Requests aborted by the client after their prefill was issued.
    pub requests_aborted: u64,
    /// Prompt blocks served from the tier (prefix hits).
    pub tier_hit_blocks: u64,
    /// Saves executed.
    pub tier_saves: u64,
    /// Loads executed (prefill hits and decode loads).
    pub tier_loads: u64,
    /// Tier entries evicted.
    pub tier_evictions: u64,
    /// The tier in use: for Mooncake its version, protocol and master address.
    pub tier_detail: String,
    /// Corrupt slices the engine's shadow did not predict (a defect of the stack under test).
    pub unexplained_corrupt: u64,
    /// One entry per mechanism: unfenced ones with their detection, fenced ones "clean" or not.
    pub races: Vec<RaceOutcome>,
    /// Error counts per `interval_secs`.
    pub intervals: Vec<Interval>,
}

/// Live counters handed to the progress callback.
#[derive(Clone, Debug, Default)]
pub struct Progress {
    /// Seconds since the start.
    pub elapsed: f64,
    /// Requests verified.
    pub requests: u64,
    /// Admission target (requests), when not running for a duration.
    pub target_requests: Option<u64>,
    /// Duration target (seconds), when given.
    pub target_secs: Option<f64>,
    /// NIXL bytes moved so far.
    pub bytes: u64,
    /// Corrupt slices so far.
    pub corrupt: u64,
    /// True once admission stopped and in-flight requests drain.
    pub draining: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Side {
    Prefill,
    Decode,
}

#[derive(Clone, Copy, Debug)]
enum OpKind {
    Fill { id: TableEntry },
    Load { entry: EntryId, index: usize },
    Save { entry: EntryId, promised: TableEntry },
}

#[derive(Clone, Copy, Debug)]
struct Op {
    due: u64,
    req: u64,
    slot: u32,
    kind: OpKind,
    /// The unfenced mechanism under which this operation runs, once one applies (a save
    /// whose block was freed early, or one issued without waiting for the write).
    cause: Option<Mechanism>,
}

#[derive(Clone, Debug, Default)]
struct PSlot {
    /// One window per NIXL READ of this block still in flight: (request, every content
    /// written into the block since the READ was posted, in order). A window lives only
    /// while its READ does (bounded by `--timeout`), so nothing written during a READ is
    /// ever forgotten and no bound on rewrites is needed.
    reads: Vec<(u64, Vec<Content>)>,
    owner: Option<u64>,
    content: Content,
    pending_compute: u32,
    pending_load: u32,
    /// Requests whose NIXL READ of this block has not been notified.
    reading: u32,
    /// The slot was released early by this unfenced mechanism.
    early: Option<Mechanism>,
    /// An unfenced load overtook a pending compute write here.
    hazard: bool,
    in_early_list: bool,
}

impl PSlot {
    fn record(&mut self, c: Content) {
        self.content = c;
        for (_, w) in self.reads.iter_mut() {
            w.push(c);
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stage {
    Lookup,
    Prefill,
    WaitDecode,
    Decoding,
    Verify,
    Done,
}

struct Req {
    spec: RequestSpec,
    stage: Stage,
    ready_at: u64,
    promised: Vec<TableEntry>,
    pslots: Vec<u32>,
    hits: Vec<EntryId>,
    /// Tier entry per block (tier-only: where decode loads it from).
    entries: Vec<Option<EntryId>>,
    pending_writes: u32,
    saves_left: u32,
    had_saves: bool,
    read_notified: bool,
    /// The READ's deadline (`--timeout` from just before it was posted), until its
    /// notification arrives.
    read_deadline: Option<crate::deadline::Deadline>,
    /// Notification checks begun after `read_deadline` that did not find it.
    notify_misses: u8,
    released: bool,
    early_listed: bool,
    dslots: Vec<u32>,
    xfer: Option<Posted>,
    /// What each prefill block held when the READ was posted.
    at_post: Vec<Content>,
    /// What was written into each prefill block while the READ was in flight (filled when
    /// it completes).
    during: Vec<Vec<Content>>,
    /// Decode-side prediction per block (tier-only loads).
    delivered: Vec<Content>,
    dloads_left: u32,
    poison_iter: u32,
}

/// Runs one scenario on connected endpoints. Fills `report` (summary, failures,
/// scenario section) as it goes; `progress` is called about every 100 ms and
/// `checkpoint` about every `checkpoint` seconds with the report so far.
///
/// Errors: transport (exit 3), timeout (exit 4: a READ or the drain made no progress
/// within `timeout`), device (exit 3), interrupted (130).
#[allow(clippy::too_many_arguments)]
pub fn run_scenario(
    cfg: &ScenarioConfig,
    seed: u64,
    prefill: &mut Endpoint,
    decode: &mut Endpoint,
    timeout: Duration,
    max_failures: usize,
    report: &mut Report,
    progress: &mut dyn FnMut(&Progress),
    checkpoint: (f64, &mut dyn FnMut(&Report)),
    dump: Option<&mut crate::dump::Dumper>,
) -> Result<()> {
    let mut e = Engine::new(cfg, seed, prefill, decode, timeout, max_failures)?;
    e.dump = dump;
    let mut r = e.run(report, progress, checkpoint);
    e.finish(report);
    let compared = e.decode.pool.take_compared();
    report.summary.slices_compared += compared.slices;
    report.summary.bytes_compared += compared.bytes;
    if let (Some(mc), Some(store)) = (e.mooncake.as_mut(), e.store.as_ref()) {
        mc.clean_up(store);
    }
    if r.is_ok() && report.summary.blocks_checked == 0 {
        r = Err(Error::Usage(format!(
            "nothing was verified: {} admitted, {} aborted, none reached decode (raise --requests or --duration, lower --abort-rate)",
            crate::report::plural(e.admitted, "request"),
            e.aborted
        )));
    }
    r
}

struct Engine<'a> {
    cfg: ScenarioConfig,
    races: Races,
    seed: u64,
    prefill: &'a mut Endpoint,
    decode: &'a mut Endpoint,
    timeout: Duration,
    max_failures: usize,
    /// `--dump`: where failing slices go ([`crate::dump`]).
    dump: Option<&'a mut crate::dump::Dumper>,
    store: Option<Store>,
    workload: Workload,
    rng: ChaCha8Rng,
    now: u64,
    next_gen: u32,
    pslots: Vec<PSlot>,
    pfree: Vec<u32>,
    early_list: Vec<u32>,
    dfree: Vec<u32>,
    reqs: HashMap<u64, Req>,
    order: Vec<u64>,
    compute: VecDeque<Op>,
    pload: VecDeque<Op>,
    puts: VecDeque<Op>,
    dload: VecDeque<Op>,
    admitted: u64,
    verified: u64,
    aborted: u64,
    hit_blocks: u64,
    saves: u64,
    loads: u64,
    unexplained: u64,
    windows: BTreeMap<Mechanism, u64>,
    attributed: BTreeMap<Mechanism, BTreeMap<Class, u64>>,
    intervals: Vec<Interval>,
    started: Instant,
    stop_admitting: bool,
    last_progress: Instant,
    busy_secs: f64,
    listed_explained: u64,
    listed_unexplained: u64,
    /// `--tier mooncake`: the master and the store worker (dropped with the engine).
    mooncake: Option<MooncakeTier>,
    fill_secs: f64,
    poison_secs: f64,
    /// Test-only fault (`KVPROBE_TEST_FAULT`) and how many are left to plant.
    fault: Option<(TestFault, u64)>,
    /// Prefix of this run's NIXL notifications (unique per engine, so a late notification
    /// of an earlier scenario in the same process is never taken for this one's).
    tag: String,
}

/// `--tier mooncake`: the master (started by kvprobe, or an existing deployment) and a store
/// worker mapping both pools (prefill = pool 0, decode = pool 1).
struct MooncakeTier {
    master: crate::mooncake::Deployment,
    worker: crate::mooncake::Worker,
    /// Key prefix: the seed and a run nonce (vLLM's keys lead with a config fingerprint).
    fingerprint: String,
    detail: String,
    /// Keys of evicted entries still to remove from the store.
    doomed: Vec<String>,
}

impl MooncakeTier {
    fn start(cfg: &ScenarioConfig, seed: u64, prefill: &Endpoint, decode: &Endpoint, timeout: Duration) -> Result<MooncakeTier> {
        use crate::mooncake::{Deployment, Master, Worker};
        let install = crate::mooncake::find()?;
        // The worker first: its hello imports the store client, so a broken install is a
        // set-up error (exit 2) before anything else starts.
        // Set-up calls (hello, setup, mapping the pools) get at least the set-up floor; the
        // run's calls then --timeout (crate::deadline).
        let shared: Vec<&crate::hostmem::HostBuffer> =
            [&prefill.pool, &decode.pool].into_iter().filter_map(|p| p.host_buffer()).collect();
        let mut worker = Worker::start(&install, timeout.max(crate::deadline::SETUP_FLOOR), &shared)?;
        let mut master = match &cfg.mooncake {
            Some(ext) => {
                ext.reachable(Duration::from_secs(5))?;
                Deployment::External(ext.clone())
            }
            // Start-up has its own window (the master takes about a second), whatever --timeout says.
            None => Deployment::Started(Master::start(&install, Duration::from_secs(30))?),
        };
        // Room for every entry the engine may hold, twice over, so Mooncake itself never evicts one.
        let segment = (cfg.tier_blocks as u64 * prefill.pool.block_bytes()).saturating_mul(2).max(64 << 20);
        let mut connect = || -> Result<&'static str> {
            worker.setup(&master, "tcp", segment)?;
            let mut sharing = "a shared memory mapping (memfd)";
            for pool in [&prefill.pool, &decode.pool] {
                match (pool.host_buffer(), pool.ipc_handles()?) {
                    (Some(buf), _) => worker.map_shared(buf)?,
                    (None, Some((device, handles))) => {
                        worker.map_cuda(device, &handles, pool.geometry().region_bytes()?)?;
                        sharing = "CUDA IPC handles (one per layer region)";
                    }
                    (None, None) => unreachable!("a pool is DRAM or VRAM"),
                }
            }
            Ok(sharing)
        };
        // A master that dies while the worker connects explains the failure best; with an
        // existing deployment, name the two addresses to check. Not answering in time here is
        // a transport failure (exit 3), not a transfer timeout.
        let sharing = connect().map_err(|e| {
            let e = match e {
                Error::Timeout(m) => Error::Transport(m),
                e => e,
            };
            match explain(&mut master, e) {
                Error::Transport(m) if !master.is_started() => Error::Transport(format!(
                    "joining the Mooncake deployment failed ({m}): check that --mooncake-master {} is a mooncake_master's RPC \
                     address and --mooncake-metadata {} its metadata service",
                    master.rpc(),
                    master.metadata_url()
                )),
                e => e,
            }
        })?;
        worker.set_timeout(timeout);
        let fingerprint = format!("{:08x}-{:08x}", crate::fingerprint::seed32(seed), rand::rng().random::<u32>());
        let detail = format!(
            "mooncake {} {}, tcp, master {} ({}), metadata {}, pools shared with the store client by {sharing}",
            install.wheel,
            install.version,
            master.rpc(),
            if master.is_started() { "started by kvprobe" } else { "existing deployment" },
            master.metadata_url()
        );
        Ok(MooncakeTier { master, worker, fingerprint, detail, doomed: Vec::new() })
    }

    /// The error to report for a failed store call `e` (see [`explain`]).
    fn explain(&mut self, e: Error) -> Error {
        explain(&mut self.master, e)
    }

    fn key(&self, (hash, serial): (u32, u64)) -> String {
        crate::mooncake::block_key(&self.fingerprint, hash, serial)
    }

    /// Removes this run's objects from a store kvprobe did not start (best effort: objects
    /// still under a read lease stay until the store evicts them; their keys are unique to
    /// this run).
    fn clean_up(&mut self, store: &Store) {
        if self.master.is_started() {
            return; // the master and everything in it go with the run
        }
        let mut keys = std::mem::take(&mut self.doomed);
        keys.extend(store.live_keys().into_iter().map(|k| self.key(k)));
        for chunk in keys.chunks(1024) {
            if self.worker.remove(chunk).is_err() {
                break;
            }
        }
    }
}

/// The error to report for a failed store call `e`: the master's death (with its log) when
/// that is the cause, else `e`. A killed master is reaped a moment after its client sees the
/// connection drop, so a started master is watched for 300 ms.
fn explain(master: &mut crate::mooncake::Deployment, e: Error) -> Error {
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_millis(300) {
        if let Err(gone) = master.alive() {
            return gone;
        }
        if !master.is_started() {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    e
}

fn ident(t: TableEntry, c: SliceCoord) -> BlockIdentity {
    t.identity(c)
}

/// The attribution of a corrupt slice (README "Attribution"): `actual` is the slice at
/// coordinate `c` as decode holds it, `want` its expected bytes, and `written` what the
/// engine's shadow says its source held during the READ window, in order (first: the
/// content when the READ was posted; then each write made before it completed; for a tier
/// load, the entry loaded).
///
/// Returns the mechanism it is attributed to (`None`: unexplained) and the content the
/// shadow predicts there. The slice is explained only when every 4-byte element of it is
/// what one of `written` put at that offset ([`verify::explained_by`]); this iteration's
/// poison, a flipped bit, garbage or an identity never written in the window make the whole
/// slice unexplained, however often the block was rewritten. It is then attributed to the
/// mechanism stamped on the content that supplies most of the wrong elements (the latest on
/// a tie; when it carries none, the latest other supplier's, else the content at post's),
/// and that content is the prediction.
pub fn attribute(actual: &[u8], want: &[u8], seed: u64, c: SliceCoord, written: &[Content]) -> (Option<Mechanism>, TableEntry) {
    let pre = written.first().copied().unwrap_or_default();
    // One fingerprint per distinct identity (a window may hold the same one several times).
    let mut ids: Vec<TableEntry> = Vec::new();
    for w in written {
        if !ids.contains(&w.id) {
            ids.push(w.id);
        }
    }
    let prints: Vec<Vec<u8>> = ids.iter().map(|&t| fingerprint::expected(actual.len(), seed, ident(t, c))).collect();
    let Some(used) = verify::explained_by(actual, want, &prints) else {
        return (None, pre.id);
    };
    let supplied = |w: &Content| ids.iter().position(|t| *t == w.id).map_or(0, |k| used[k]);
    // The prediction: the content supplying most of the wrong data (`max_by_key` keeps the
    // last of equals: the latest on a tie).
    let Some(best) = written.iter().filter(|w| supplied(w) > 0).max_by_key(|w| supplied(w)) else {
        return (None, pre.id);
    };
    let cause = best.cause.or_else(|| written.iter().rev().filter(|w| supplied(w) > 0).find_map(|w| w.cause)).or(pre.cause);
    (cause, best.id)
}

impl<'a> Engine<'a> {
    fn new(
        cfg: &ScenarioConfig,
        seed: u64,
        prefill: &'a mut Endpoint,
        decode: &'a mut Endpoint,
        timeout: Duration,
        max_failures: usize,
    ) -> Result<Engine<'a>> {
        let g = prefill.pool.geometry().clone();
        let n = g.num_blocks;
        crate::phase::announce(&match (cfg.scenario.uses_tier(), cfg.tier) {
            (false, _) => "setup: filling the prefill pool".to_string(),
            (true, TierKind::Mooncake) => "setup: starting the Mooncake store (worker, master), filling the prefill pool".into(),
            (true, TierKind::Embedded) => format!("setup: the tier ({} blocks), filling the prefill pool", cfg.tier_blocks),
        });
        let mooncake = if cfg.scenario.uses_tier() && cfg.tier == TierKind::Mooncake {
            Some(MooncakeTier::start(cfg, seed, prefill, decode, timeout)?)
        } else {
            None
        };
        let store = match (cfg.scenario.uses_tier(), &mooncake) {
            (false, _) => None,
            (true, Some(_)) => Some(Store::metadata_only(cfg.tier_blocks, prefill.pool.block_bytes())),
            (true, None) => Some(Store::new(cfg.tier_blocks, prefill.pool.block_bytes(), prefill.pool.gpu().as_ref())?),
        };
        // Genesis: every prefill block holds a fingerprint no request will ask for.
        let genesis: Vec<TableEntry> =
            (0..n).map(|i| TableEntry { block: crate::run::logical_block(seed, i), generation: 0 }).collect();
        prefill.pool.fill(&genesis)?;
        let pslots = genesis.iter().map(|&id| PSlot { content: Content { id, cause: None }, ..Default::default() }).collect();
        Ok(Engine {
            cfg: cfg.clone(),
            races: cfg.races(),
            seed,
            prefill,
            decode,
            timeout,
            max_failures,
            dump: None,
            store,
            workload: Workload::new(cfg.workload, seed),
            rng: ChaCha8Rng::seed_from_u64(seed ^ 0x656E_6769_6E65),
            now: 0,
            next_gen: 0,
            pslots,
            pfree: (0..n).rev().collect(),
            early_list: Vec::new(),
            dfree: (0..n).rev().collect(),
            reqs: HashMap::new(),
            order: Vec::new(),
            compute: VecDeque::new(),
            pload: VecDeque::new(),
            puts: VecDeque::new(),
            dload: VecDeque::new(),
            admitted: 0,
            verified: 0,
            aborted: 0,
            hit_blocks: 0,
            saves: 0,
            loads: 0,
            unexplained: 0,
            windows: BTreeMap::new(),
            attributed: BTreeMap::new(),
            intervals: Vec::new(),
            started: Instant::now(),
            stop_admitting: false,
            last_progress: Instant::now(),
            busy_secs: 0.0,
            listed_explained: 0,
            listed_unexplained: 0,
            mooncake,
            fill_secs: 0.0,
            poison_secs: 0.0,
            tag: format!("kvprobe:{:016x}:req=", rand::rng().random::<u64>()),
            fault: TestFault::from_env()?,
        })
    }

    fn lag(&mut self, max: u64) -> u64 {
        self.now + self.rng.random_range(0..=max)
    }

    /// Steps until a save runs: usually 0–3, but one in four waits 16–96 steps behind a
    /// backlog (a store's puts are slower than NIXL under sustained load: about 1 GB/s
    /// for Mooncake over TCP against hundreds of GB/s for cuda_ipc).
    fn window(&mut self, m: Mechanism) {
        *self.windows.entry(m).or_default() += 1;
    }

    fn in_flight(&self) -> usize {
        self.reqs.len()
    }

    fn run(
        &mut self,
        report: &mut Report,
        progress: &mut dyn FnMut(&Progress),
        checkpoint: (f64, &mut dyn FnMut(&Report)),
    ) -> Result<()> {
        let (every, save) = checkpoint;
        self.started = Instant::now();
        let mut last_ckpt = Instant::now();
        let mut last_change = Instant::now();
        let mut last_seen = (0u64, 0u64);
        self.intervals.push(Interval::default());
        self.finish(report);
        crate::run::publish(report);
        loop {
            if crate::interrupt::requested() {
                return Err(Error::Interrupted(format!("after {} verified requests", self.verified)));
            }
            let elapsed = self.started.elapsed().as_secs_f64();
            if !self.stop_admitting {
                self.stop_admitting = match self.cfg.duration_secs {
                    Some(d) => elapsed >= d,
                    None => self.admitted >= self.cfg.requests,
                };
                if self.stop_admitting && self.cfg.duration_secs.is_some() {
                    self.cancel_waiting();
                }
            }
            if self.stop_admitting && self.reqs.is_empty() && self.queues_empty() {
                break;
            }
            let t = Instant::now();
            let busy = self.reqs.values().any(|r| r.xfer.is_some());
            self.step(report)?;
            if busy {
                self.busy_secs += t.elapsed().as_secs_f64();
            }
            // Interval bookkeeping.
            let el = self.started.elapsed().as_secs_f64();
            let cur = self.intervals.last_mut().expect("one interval");
            cur.end_s = el;
            if el - cur.start_s >= self.cfg.interval_secs {
                self.intervals.push(Interval { start_s: el, end_s: el, ..Default::default() });
            }
            // Liveness: something must move within the timeout.
            let seen = (self.verified + self.aborted, self.saves + self.loads);
            if seen != last_seen || self.admitted_recently() {
                last_seen = seen;
                last_change = Instant::now();
            } else if last_change.elapsed() > self.timeout {
                return Err(Error::Timeout(format!(
                    "no request progressed for {:.3} s ({} in flight at step {})",
                    self.timeout.as_secs_f64(),
                    self.in_flight(),
                    self.now
                )));
            }
            if self.last_progress.elapsed() >= Duration::from_millis(100) {
                self.last_progress = Instant::now();
                progress(&self.progress(report));
                // What a call blocked past its deadline would still report.
                self.finish(report);
                crate::run::publish(report);
            }
            if every > 0.0 && last_ckpt.elapsed().as_secs_f64() >= every {
                last_ckpt = Instant::now();
                self.finish(report);
                save(report);
            }
        }
        progress(&self.progress(report));
        Ok(())
    }

    /// At the end of a `--duration`: requests still waiting for prefill blocks never
    /// started; they are dropped (not counted as admitted) so the drain only finishes work
    /// in progress.
    fn cancel_waiting(&mut self) {
        let waiting: Vec<u64> = self.order.iter().copied().filter(|id| self.reqs[id].stage == Stage::Lookup).collect();
        for id in waiting {
            if let Some(r) = self.reqs.remove(&id) {
                if let Some(store) = self.store.as_mut() {
                    for e in r.hits {
                        store.unpin(e);
                    }
                }
                self.admitted -= 1;
            }
        }
        self.order.retain(|id| self.reqs.contains_key(id));
    }

    fn queues_empty(&self) -> bool {
        self.compute.is_empty() && self.pload.is_empty() && self.puts.is_empty() && self.dload.is_empty()
    }

    fn admitted_recently(&self) -> bool {
        self.reqs.values().any(|r| r.stage == Stage::Lookup)
    }

    fn progress(&self, report: &Report) -> Progress {
        Progress {
            elapsed: self.started.elapsed().as_secs_f64(),
            requests: self.verified,
            target_requests: self.cfg.duration_secs.is_none().then_some(self.cfg.requests),
            target_secs: self.cfg.duration_secs,
            bytes: report.summary.bytes_transferred,
            corrupt: report.summary.blocks_corrupt,
            draining: self.stop_admitting,
        }
    }

    fn step(&mut self, report: &mut Report) -> Result<()> {
        self.now += 1;
        if self.now.is_multiple_of(256)
            && let Some(crate::mooncake::Deployment::Started(m)) = self.mooncake.as_mut().map(|mc| &mut mc.master)
        {
            m.alive()?;
        }
        self.poll_nixl(report)?;
        self.run_compute()?;
        self.run_loads(Side::Prefill)?;
        self.run_puts()?;
        self.run_loads(Side::Decode)?;
        self.advance()?;
        self.start_decode(report)?;
        self.verify(report)?;
        self.admit()?;
        if self.reqs.values().all(|r| r.xfer.is_none()) {
            std::thread::yield_now();
        }
        Ok(())
    }

    // ---- NIXL ----

    fn poll_nixl(&mut self, report: &mut Report) -> Result<()> {
        if !self.cfg.scenario.uses_nixl() {
            return Ok(());
        }
        let asked = Instant::now();
        self.take_notifications()?;
        self.check_notification_deadlines(asked)?;
        for id in self.order.clone() {
            let Some(r) = self.reqs.get_mut(&id) else {
                continue;
            };
            let Some(x) = r.xfer.as_mut() else { continue };
            // `poll` ends the run with a timeout past the READ's deadline.
            if let Some(done) = self.decode.poll(x)? {
                report.summary.bytes_transferred += done.bytes;
                r.xfer = None;
                r.stage = Stage::Verify;
                self.read_done(id);
            }
        }
        Ok(())
    }

    /// A READ of request `id` completed: closes its windows on its prefill blocks (what was
    /// written into them while it was in flight, see [`PSlot::reads`]).
    fn read_done(&mut self, id: u64) {
        let Some(r) = self.reqs.get_mut(&id) else { return };
        r.during = r
            .pslots
            .iter()
            .map(|&s| {
                let reads = &mut self.pslots[s as usize].reads;
                match reads.iter().position(|(q, _)| *q == id) {
                    Some(k) => reads.swap_remove(k).1,
                    None => Vec::new(),
                }
            })
            .collect();
    }

    /// After a notification check begun at `asked`: a READ whose notification is still
    /// missing at two checks begun after its deadline has timed out (exit 4).
    fn check_notification_deadlines(&mut self, asked: Instant) -> Result<()> {
        for (id, r) in self.reqs.iter_mut() {
            if r.read_notified {
                continue;
            }
            let Some(d) = r.read_deadline.filter(|d| d.passed_at(asked)) else { continue };
            r.notify_misses += 1;
            if r.notify_misses >= 2 {
                return Err(Error::Timeout(format!(
                    "no notification of request {id}'s READ within --timeout {:.6} s ({:.3} s since it was posted)",
                    d.limit_secs(),
                    d.elapsed_secs()
                )));
            }
        }
        Ok(())
    }

    /// Copies prefill block `slot` into tier entry `entry` (a save).
    fn tier_put(&mut self, slot: u32, entry: EntryId) -> Result<()> {
        let store = self.store.as_mut().expect("saves need the tier");
        match self.mooncake.as_mut() {
            None => self.prefill.pool.read_block(slot, store.bytes_mut(entry)),
            Some(mc) => {
                let key = mc.key(store.key_of(entry));
                let rc = mc.worker.put(0, std::slice::from_ref(&key), &[self.prefill.pool.block_ranges(slot)]);
                match rc {
                    Ok(rc) if rc.first() == Some(&0) => Ok(()),
                    Ok(rc) => Err(mc.explain(Error::Transport(format!("Mooncake put of {key} returned {rc:?}")))),
                    Err(e) => Err(mc.explain(e)),
                }
            }
        }
    }

    /// Copies tier entry `entry` into block `slot` of the prefill or decode pool (a load).
    fn tier_get(&mut self, side: Side, slot: u32, entry: EntryId) -> Result<()> {
        let store = self.store.as_ref().expect("loads need the tier");
        let pool = if side == Side::Prefill { &mut self.prefill.pool } else { &mut self.decode.pool };
        match self.mooncake.as_mut() {
            None => pool.write_block(slot, store.bytes(entry)),
            Some(mc) => {
                let key = mc.key(store.key_of(entry));
                let want = pool.block_bytes() as i64;
                let index = if side == Side::Prefill { 0 } else { 1 };
                match mc.worker.get(index, std::slice::from_ref(&key), &[pool.block_ranges(slot)]) {
                    Ok(rc) if rc.first() == Some(&want) => Ok(()),
                    Ok(rc) => {
                        Err(mc
                            .explain(Error::Transport(format!("Mooncake get of {key} returned {rc:?} (expected {want} bytes)"))))
                    }
                    Err(e) => Err(mc.explain(e)),
                }
            }
        }
    }

    /// Drops the objects of evicted tier entries from Mooncake (best effort: a leftover object
    /// is never read, its key is unique to the evicted reservation).
    fn drop_evicted(&mut self) -> Result<()> {
        if let (Some(store), Some(mc)) = (self.store.as_mut(), self.mooncake.as_mut()) {
            let evicted: Vec<String> = store.take_evicted().into_iter().map(|k| mc.key(k)).collect();
            mc.doomed.extend(evicted);
            if !mc.doomed.is_empty() && (mc.doomed.len() >= 64 || self.now.is_multiple_of(64)) {
                let keys = std::mem::take(&mut mc.doomed);
                let rc = mc.worker.remove(&keys).map_err(|e| mc.explain(e))?;
                // Objects still under a read lease are retried later.
                mc.doomed = keys.into_iter().zip(rc).filter(|(_, rc)| *rc != 0).map(|(k, _)| k).collect();
            }
        }
        Ok(())
    }

    /// Prefill side: takes NIXL notifications (decode's READ of a request is done) and
    /// returns how many were for live requests of this run.
    /// A notification query still in progress when a pending READ's deadline passed is a
    /// timeout (exit 4), even if it brings that notification ([`crate::deadline::crossed`]).
    fn take_notifications(&mut self) -> Result<usize> {
        let mut n = 0;
        let asked = Instant::now();
        let next = self
            .reqs
            .iter()
            .filter(|(_, r)| !r.read_notified)
            .filter_map(|(id, r)| r.read_deadline.filter(|d| !d.passed_at(asked)).map(|d| (*id, d)))
            .min_by_key(|(_, d)| d.at());
        let got = self.prefill.notifications()?;
        let returned = Instant::now();
        if let Some((id, d)) = next
            && crate::deadline::crossed(&d, asked, returned)
        {
            return Err(Error::Timeout(format!(
                "notification of request {id}'s READ: a notification query begun {:.3} s after it was posted returned \
                 {:.3} s after it, over --timeout {:.6} s",
                (asked - d.start).as_secs_f64(),
                (returned - d.start).as_secs_f64(),
                d.limit_secs()
            )));
        }
        for msg in got {
            if let Some(id) = msg.strip_prefix(self.tag.as_str()).and_then(|s| s.parse::<u64>().ok()) {
                n += self.notified(id) as usize;
            }
        }
        Ok(n)
    }

    fn notified(&mut self, id: u64) -> bool {
        let Some(r) = self.reqs.get_mut(&id) else {
            return false;
        };
        if r.read_notified {
            return false;
        }
        r.read_notified = true;
        for &s in &r.pslots {
            let p = &mut self.pslots[s as usize];
            p.reading = p.reading.saturating_sub(1);
        }
        true
    }

    /// `--lockstep`: completes this step's READs and their notifications before the step
    /// goes on, so no copy overlaps a transfer and the whole run follows from the seed.
    fn lockstep(&mut self, ids: &[u64], report: &mut Report) -> Result<()> {
        let t = Instant::now();
        for &id in ids {
            let r = self.reqs.get_mut(&id).expect("posted request");
            let Some(x) = r.xfer.as_mut() else { continue };
            // `poll` ends the wait with a timeout past the READ's deadline.
            loop {
                if let Some(done) = self.decode.poll(x)? {
                    report.summary.bytes_transferred += done.bytes;
                    break;
                }
                std::thread::yield_now();
            }
            r.xfer = None;
            r.stage = Stage::Verify;
            self.read_done(id);
        }
        while ids.iter().any(|id| self.reqs.get(id).is_some_and(|r| !r.read_notified)) {
            let asked = Instant::now();
            if self.take_notifications()? == 0 {
                self.check_notification_deadlines(asked)?;
                std::thread::sleep(Duration::from_micros(20));
            }
        }
        self.busy_secs += t.elapsed().as_secs_f64();
        Ok(())
    }

    // ---- prefill streams ----

    fn write_stamp(&mut self, slot: u32, req: u64, id: TableEntry, explicit: Option<Mechanism>) -> Content {
        let p = &self.pslots[slot as usize];
        let foreign_reader = p.reading > 0 && p.owner == Some(req) && p.early.is_some();
        let cause = explicit.or(if p.owner != Some(req) && p.hazard { Some(Mechanism::UnfencedLoad) } else { None }).or(p.early);
        if foreign_reader && let Some(m) = p.early {
            self.window(m);
        }
        Content { id, cause }
    }

    fn run_compute(&mut self) -> Result<()> {
        let mut due = Vec::new();
        while self.compute.front().is_some_and(|o| o.due <= self.now) {
            due.push(self.compute.pop_front().expect("front"));
        }
        if due.is_empty() {
            return Ok(());
        }
        let n = self.pslots.len();
        let mut table = vec![TableEntry { block: 0, generation: SKIP_GEN }; n];
        for op in &due {
            if let OpKind::Fill { id } = op.kind {
                table[op.slot as usize] = id;
            }
        }
        let t = Instant::now();
        self.prefill.pool.fill(&table)?;
        self.fill_secs += t.elapsed().as_secs_f64();
        for op in due {
            let OpKind::Fill { id } = op.kind else {
                continue;
            };
            let stale_landing = self.pslots[op.slot as usize].owner != Some(op.req) && self.pslots[op.slot as usize].hazard;
            if stale_landing {
                self.window(Mechanism::UnfencedLoad);
            }
            let c = self.write_stamp(op.slot, op.req, id, None);
            let p = &mut self.pslots[op.slot as usize];
            p.record(c);
            p.pending_compute -= 1;
            if p.pending_compute == 0 {
                p.hazard = false;
            }
            if let Some(r) = self.reqs.get_mut(&op.req) {
                r.pending_writes = r.pending_writes.saturating_sub(1);
            }
        }
        Ok(())
    }

    fn run_loads(&mut self, side: Side) -> Result<()> {
        loop {
            let q = if side == Side::Prefill { &self.pload } else { &self.dload };
            let Some(&op) = q.front() else { break };
            if op.due > self.now {
                break;
            }
            let OpKind::Load { entry, index, .. } = op.kind else { unreachable!("load queue holds loads") };
            if side == Side::Prefill && self.pslots[op.slot as usize].pending_compute > 0 {
                if self.races.unfenced(Mechanism::UnfencedLoad) {
                    self.window(Mechanism::UnfencedLoad);
                    self.pslots[op.slot as usize].hazard = true;
                } else {
                    break; // event fence: wait for the previous owner's write
                }
            }
            if side == Side::Prefill {
                self.pload.pop_front()
            } else {
                self.dload.pop_front()
            };
            let content = self.store.as_ref().expect("loads need the tier").content(entry).expect("loads read complete entries");
            self.tier_get(side, op.slot, entry)?;
            let store = self.store.as_mut().expect("loads need the tier");
            self.loads += 1;
            match side {
                Side::Prefill => {
                    store.unpin(entry);
                    let stamped = self.write_stamp(op.slot, op.req, content.id, content.cause);
                    let p = &mut self.pslots[op.slot as usize];
                    p.record(stamped);
                    p.pending_load -= 1;
                    if let Some(r) = self.reqs.get_mut(&op.req) {
                        r.pending_writes = r.pending_writes.saturating_sub(1);
                    }
                }
                Side::Decode => {
                    if let Some(r) = self.reqs.get_mut(&op.req) {
                        r.delivered[index] = content;
                        r.dloads_left -= 1;
                        if r.dloads_left == 0 {
                            r.stage = Stage::Verify;
                        }
                    }
                }
            }
        }
        Ok(())
    }

    fn execute_put(&mut self, op: Op) -> Result<()> {
        let OpKind::Save { entry, promised } = op.kind else { unreachable!("put queue holds saves") };
        let p = self.pslots[op.slot as usize].clone();
        self.tier_put(op.slot, entry)?;
        let store = self.store.as_mut().expect("saves need the tier");
        let mut content = p.content;
        if content.id != promised {
            // The copy is not what the key promises: say which missing fence let it happen.
            // (None would be a flaw in kvprobe's own model; the decode side then reports
            // the slice as unexplained.)
            content.cause = op.cause.or(content.cause).or(p.early);
            if let Some(m) = content.cause {
                *self.windows.entry(m).or_default() += 1;
            }
        }
        store.complete(entry, content);
        if !self.cfg.scenario.uses_nixl() {
            // Tier-only: the entry stays pinned until decode has loaded it.
        } else {
            store.unpin(entry);
        }
        self.saves += 1;
        if let Some(r) = self.reqs.get_mut(&op.req) {
            r.saves_left -= 1;
        }
        Ok(())
    }

    /// The put worker: runs every save that is due and whose block's write has landed (the
    /// event fence); saves complete out of order, as a store's transfer threads do.
    fn run_puts(&mut self) -> Result<()> {
        let mut waiting = VecDeque::with_capacity(self.puts.len());
        while let Some(op) = self.puts.pop_front() {
            let p = &self.pslots[op.slot as usize];
            if op.due > self.now || p.pending_compute + p.pending_load > 0 {
                waiting.push_back(op);
                continue;
            }
            self.execute_put(op)?;
        }
        self.puts = waiting;
        Ok(())
    }

    // ---- request progress ----

    fn release(&mut self, id: u64, early: Option<Mechanism>) {
        let Some(r) = self.reqs.get_mut(&id) else {
            return;
        };
        if r.released {
            return;
        }
        r.released = true;
        if let Some(m) = early {
            // Its saves still queued now copy blocks that are no longer its own.
            for op in self.puts.iter_mut().filter(|o| o.req == id) {
                op.cause = op.cause.or(Some(m));
            }
        }
        for &s in &r.pslots {
            let p = &mut self.pslots[s as usize];
            if p.owner != Some(id) {
                continue; // handed to a load early (load-into-reading)
            }
            p.owner = None;
            p.in_early_list = false;
            // A slot handed on early keeps its taint while an earlier owner's READ of it is
            // still pending (e.g. load-into-reading: the borrower finishes first).
            p.early = early.or(if p.reading > 0 { p.early } else { None });
            self.pfree.push(s);
        }
    }

    fn advance(&mut self) -> Result<()> {
        let sc = self.cfg.scenario;
        let mut finished = Vec::new();
        let mut to_release = Vec::new();
        for &id in &self.order {
            let r = self.reqs.get_mut(&id).expect("ordered request");
            if r.stage == Stage::Prefill && r.pending_writes == 0 {
                r.stage = Stage::WaitDecode;
                r.ready_at = self.now + self.rng.random_range(0..=2);
                if sc.uses_nixl() {
                    for &s in &r.pslots {
                        self.pslots[s as usize].reading += 1;
                    }
                }
            }
            if r.released || r.stage == Stage::Lookup || r.stage == Stage::Prefill {
                if r.released && r.stage == Stage::Done {
                    finished.push(id);
                }
                continue;
            }
            let nixl_done = !sc.uses_nixl() || r.read_notified;
            let tier_done = r.saves_left == 0;
            if nixl_done && tier_done {
                to_release.push((id, None));
            } else if self.races.unfenced(Mechanism::SaveAfterFree) && nixl_done && !tier_done {
                to_release.push((id, Some(Mechanism::SaveAfterFree)));
            } else if self.races.unfenced(Mechanism::FreeOnFirstCompletion)
                && sc == Scenario::Stacked
                && r.had_saves
                && (nixl_done || tier_done)
            {
                to_release.push((id, Some(Mechanism::FreeOnFirstCompletion)));
            } else if self.races.unfenced(Mechanism::LoadIntoReading) && !nixl_done && !r.early_listed {
                r.early_listed = true;
                for &s in &r.pslots {
                    let p = &mut self.pslots[s as usize];
                    if p.owner == Some(id) {
                        p.in_early_list = true;
                        p.early = Some(Mechanism::LoadIntoReading);
                        self.early_list.push(s);
                    }
                }
            }
        }
        for (id, m) in to_release {
            self.release(id, m);
        }
        for id in finished {
            self.retire(id);
        }
        Ok(())
    }

    fn retire(&mut self, id: u64) {
        if self.cfg.scenario.uses_nixl() {
            // Released early and verified before the notification came: its READ is done.
            self.notified(id);
        }
        if let Some(r) = self.reqs.remove(&id) {
            self.order.retain(|&x| x != id);
            for s in r.dslots {
                self.dfree.push(s);
            }
            if !self.cfg.scenario.uses_nixl()
                && let Some(store) = self.store.as_mut()
            {
                for e in r.entries.into_iter().flatten() {
                    store.unpin(e);
                }
            }
        }
    }

    // ---- decode ----

    fn start_decode(&mut self, report: &mut Report) -> Result<()> {
        let sc = self.cfg.scenario;
        let n = self.decode.pool.geometry().num_blocks as usize;
        let mut table = vec![TableEntry { block: 0, generation: SKIP_GEN }; n];
        let mut starting = Vec::new();
        for &id in &self.order {
            let r = &self.reqs[&id];
            if r.stage != Stage::WaitDecode || r.ready_at > self.now || r.spec.abort {
                continue;
            }
            if !sc.uses_nixl() {
                let store = self.store.as_ref().expect("tier");
                let ready = r.saves_left == 0 && r.entries.iter().all(|e| e.is_some_and(|e| store.content(e).is_some()));
                if !ready {
                    continue;
                }
            }
            if self.dfree.len() < r.pslots.len() {
                break; // decode is full; keep order
            }
            let d: Vec<u32> = (0..r.pslots.len()).map(|_| self.dfree.pop().expect("checked")).collect();
            for &s in &d {
                table[s as usize] = TableEntry { block: 1, generation: 1 };
            }
            starting.push((id, d));
        }
        if starting.is_empty() {
            return Ok(());
        }
        let iter = (self.now & 0xFF_FFFF) as u32;
        let t = Instant::now();
        self.decode.pool.poison_blocks(&table, iter)?;
        self.poison_secs += t.elapsed().as_secs_f64();
        let g = self.decode.pool.geometry().clone();
        let sb = g.slice_bytes()?;
        let posted: Vec<u64> = starting.iter().map(|(id, _)| *id).collect();
        for (id, d) in starting {
            let lag = self.rng.random_range(0..=1u64);
            let r = self.reqs.get_mut(&id).expect("starting request");
            r.poison_iter = iter;
            r.dslots = d;
            r.stage = Stage::Decoding;
            if sc.uses_nixl() {
                let mut pairs = Vec::with_capacity(r.pslots.len() * g.num_layers as usize * g.kv_parts() as usize);
                for layer in 0..g.num_layers {
                    for &kv in g.parts() {
                        for (i, &ps) in r.pslots.iter().enumerate() {
                            pairs.push(Pair {
                                src: SliceCoord { layer, kv, block: ps },
                                dst: SliceCoord { layer, kv, block: r.dslots[i] },
                                len: sb,
                            });
                        }
                    }
                }
                r.at_post = r.pslots.iter().map(|&s| self.pslots[s as usize].content).collect();
                for &s in &r.pslots {
                    self.pslots[s as usize].reads.push((id, Vec::new()));
                }
                let x = self.decode.post_read(&pairs, &format!("{}{id}", self.tag), self.timeout)?;
                r.read_deadline = Some(x.deadline());
                r.xfer = Some(x);
            } else {
                r.dloads_left = r.pslots.len() as u32;
                r.delivered = vec![Content::default(); r.pslots.len()];
                let due = self.now + lag;
                for (i, e) in r.entries.iter().enumerate() {
                    self.dload.push_back(Op {
                        due,
                        req: id,
                        slot: r.dslots[i],
                        cause: None,
                        kind: OpKind::Load { entry: e.expect("ready"), index: i },
                    });
                }
            }
        }
        if self.cfg.lockstep && sc.uses_nixl() {
            self.lockstep(&posted, report)?;
        }
        Ok(())
    }

    fn verify(&mut self, report: &mut Report) -> Result<()> {
        let ids: Vec<u64> = self.order.iter().copied().filter(|id| self.reqs[id].stage == Stage::Verify).collect();
        if ids.is_empty() {
            return Ok(());
        }
        let g = self.decode.pool.geometry().clone();
        let n = g.num_blocks as usize;
        let mut table = vec![TableEntry { block: 0, generation: SKIP_GEN }; n];
        // decode slot -> (request, block index)
        let mut owner: HashMap<u32, (u64, usize)> = HashMap::new();
        let sc = self.cfg.scenario;
        for &id in &ids {
            let r = &self.reqs[&id];
            for (i, &d) in r.dslots.iter().enumerate() {
                let expect = if sc.uses_nixl() {
                    r.promised[i]
                } else {
                    self.store.as_ref().expect("tier").promised(r.entries[i].expect("entry"))
                };
                table[d as usize] = expect;
                owner.insert(d, (id, i));
            }
        }
        self.plant_faults(&ids)?;
        let t = Instant::now();
        let fails = self.decode.pool.verify(&table)?;
        let slices: u64 =
            ids.iter().map(|id| self.reqs[id].dslots.len() as u64).sum::<u64>() * g.num_layers as u64 * g.kv_parts() as u64;
        report.summary.blocks_checked += slices;
        let sb = g.slice_bytes()? as usize;
        let mut buf = vec![0u8; sb];
        for f in &fails {
            let c = g.coord_of(f.slice);
            let Some(&(id, i)) = owner.get(&c.block) else {
                continue;
            };
            let r = &self.reqs[&id];
            let expected_t = table[c.block as usize];
            let expected = ident(expected_t, c);
            self.decode.pool.read_slice(c, &mut buf)?;
            let want = fingerprint::expected(sb, self.seed, expected);
            let v = verify::classify_against(&buf, &want, expected, self.seed, f.slice, r.poison_iter);
            // What the source block held during the READ window: its content when the READ
            // was posted, then every write before the READ completed (tier-only: the entry
            // decode loaded).
            let written: Vec<Content> = if sc.uses_nixl() {
                std::iter::once(r.at_post[i]).chain(r.during.get(i).into_iter().flatten().copied()).collect()
            } else {
                vec![r.delivered[i]]
            };
            let (cause, predicted) = attribute(&buf, &want, self.seed, c, &written);
            match cause {
                Some(m) => *self.attributed.entry(m).or_default().entry(v.class).or_default() += 1,
                None => self.unexplained += 1,
            }
            report.summary.blocks_corrupt += 1;
            *report.summary.by_class.entry(v.class.name().to_string()).or_default() += 1;
            if let Some(iv) = self.intervals.last_mut() {
                iv.corrupt += 1;
            }
            // Unexplained slices (defects of the stack under test) have their own budget, so
            // a flood of explained race corruption never hides them.
            let listed = if cause.is_some() { &mut self.listed_explained } else { &mut self.listed_unexplained };
            let list = *listed < self.max_failures as u64;
            if list {
                *listed += 1;
            } else {
                report.summary.failures_omitted += 1;
            }
            let step = self.now.min(u32::MAX as u64) as u32;
            let class = v.class;
            crate::dump::keep(self.dump.as_deref_mut(), list.then_some(&mut report.failures), &buf, class, || {
                let mut failure = Failure::new(step, c, f, v, &want, &buf, expected, r.pslots[i]);
                failure.request = Some(id);
                failure.poison_iteration = r.poison_iter;
                failure.predicted = Some(ident(predicted, c));
                failure.attributed_to = cause;
                failure
            });
        }
        report.summary.verify_seconds += t.elapsed().as_secs_f64();
        for id in ids {
            let r = self.reqs.get_mut(&id).expect("verified request");
            r.stage = Stage::Done;
            self.verified += 1;
            if let Some(iv) = self.intervals.last_mut() {
                iv.requests += 1;
                iv.slices_checked += r.dslots.len() as u64 * g.num_layers as u64 * g.kv_parts() as u64;
            }
        }
        Ok(())
    }

    /// Test-only (`KVPROBE_TEST_FAULT`, see [`TestFault`]): corrupts one decode slice (layer
    /// 0, the first K/V part) in each of the next requests about to be verified, after
    /// their READ or load completed, until the count is spent, and names each on stderr.
    fn plant_faults(&mut self, ids: &[u64]) -> Result<()> {
        let Some((kind, mut left)) = self.fault else { return Ok(()) };
        let g = self.decode.pool.geometry().clone();
        let sb = g.slice_bytes()? as usize;
        for &id in ids {
            if left == 0 {
                break;
            }
            let r = &self.reqs[&id];
            let i = match kind {
                TestFault::Bitflip => 0,
                // A block rewritten while its READ was in flight: the partial delivery a
                // race-excusing attribution would take for a tear.
                TestFault::Poison => match r.during.iter().position(|d| !d.is_empty()) {
                    Some(i) => i,
                    None => continue,
                },
            };
            let c = SliceCoord { layer: 0, kv: g.parts()[0], block: r.dslots[i] };
            let mut buf = vec![0u8; sb];
            self.decode.pool.read_slice(c, &mut buf)?;
            match kind {
                // Bit 0 of sector 0's check word (a 32-bit hash of the identity).
                TestFault::Bitflip => buf[12] ^= 1,
                TestFault::Poison => {
                    let from = sb / 2 / 16 * 16;
                    let mut p = vec![0u8; sb];
                    fingerprint::poison(&mut p, g.global_slice(c), r.poison_iter);
                    buf[from..].copy_from_slice(&p[from..]);
                }
            }
            self.decode.pool.write_slice(c, &buf)?;
            eprintln!("test fault: {} planted in request {id} at layer 0 {} decode block {}", kind.name(), c.kv, c.block);
            left -= 1;
        }
        self.fault = Some((kind, left));
        Ok(())
    }

    // ---- admission ----

    /// Returns blocks an allocation took but could not use to where they came from (blocks
    /// still owned go back to the early list, free ones to the free list).
    fn give_back(&mut self, slots: Vec<u32>) {
        for s in slots.into_iter().rev() {
            if self.pslots[s as usize].owner.is_some() {
                self.pslots[s as usize].in_early_list = true;
                self.early_list.push(s);
            } else {
                self.pfree.push(s);
            }
        }
    }

    fn alloc(&mut self, n: usize, for_loads: bool) -> Option<Vec<u32>> {
        let mut out = Vec::with_capacity(n);
        if for_loads {
            while out.len() < n {
                let Some(s) = self.early_list.pop() else {
                    break;
                };
                if self.pslots[s as usize].in_early_list && self.pslots[s as usize].owner.is_some() {
                    self.pslots[s as usize].in_early_list = false;
                    out.push(s);
                }
            }
        }
        while out.len() < n {
            match self.pfree.pop() {
                Some(s) => out.push(s),
                None => {
                    self.give_back(out);
                    return None;
                }
            }
        }
        Some(out)
    }

    fn admit(&mut self) -> Result<()> {
        // Requests whose lookup completed last step start their prefill now.
        let ready: Vec<u64> = self.order.iter().copied().filter(|id| self.reqs[id].stage == Stage::Lookup).collect();
        for id in ready {
            if !self.issue_prefill(id)? {
                break; // out of blocks: retry next step, keep order
            }
        }
        let max_new = 4;
        let mut new = 0;
        while !self.stop_admitting && self.in_flight() < self.cfg.concurrency as usize && new < max_new {
            if self.cfg.duration_secs.is_none() && self.admitted >= self.cfg.requests {
                break;
            }
            let spec = self.workload.next_request();
            let id = spec.id;
            let n = spec.hashes.len();
            // lookup_async: the tier answers now, the request acts on it next step.
            let hits = match (&mut self.store, spec.abort) {
                (Some(s), false) => s.lookup_prefix(&spec.hashes),
                _ => Vec::new(),
            };
            self.reqs.insert(
                id,
                Req {
                    spec,
                    stage: Stage::Lookup,
                    ready_at: self.now + 1,
                    promised: Vec::new(),
                    pslots: Vec::new(),
                    hits,
                    entries: vec![None; n],
                    pending_writes: 0,
                    saves_left: 0,
                    had_saves: false,
                    read_notified: false,
                    read_deadline: None,
                    notify_misses: 0,
                    released: false,
                    early_listed: false,
                    dslots: Vec::new(),
                    xfer: None,
                    at_post: Vec::new(),
                    during: Vec::new(),
                    delivered: Vec::new(),
                    dloads_left: 0,
                    poison_iter: 0,
                },
            );
            self.order.push(id);
            self.admitted += 1;
            new += 1;
        }
        Ok(())
    }

    /// Allocates, loads hits, computes the rest, saves computed blocks. False when the
    /// prefill pool has too few free blocks this step.
    fn issue_prefill(&mut self, id: u64) -> Result<bool> {
        let (n, k, abort) = {
            let r = &self.reqs[&id];
            if r.ready_at > self.now {
                return Ok(true);
            }
            (r.spec.hashes.len(), r.hits.len(), r.spec.abort)
        };
        let Some(mut slots) = self.alloc(k, true) else {
            return Ok(false);
        };
        let Some(rest) = self.alloc(n - k, false) else {
            self.give_back(slots);
            return Ok(false);
        };
        slots.extend(rest);
        let sc = self.cfg.scenario;
        let mut r = self.reqs.remove(&id).expect("request");
        let mut promised = Vec::with_capacity(n);
        for (i, &s) in slots.iter().enumerate() {
            self.pslots[s as usize].owner = Some(id);
            if i < k {
                let e = r.hits[i];
                let store = self.store.as_ref().expect("hits need the tier");
                promised.push(store.promised(e));
                r.entries[i] = Some(e);
                if !sc.uses_nixl() {
                    self.store.as_mut().expect("tier").pin(e); // kept for decode's load
                }
                let due = self.lag(2);
                self.pload.push_back(Op { due, req: id, slot: s, cause: None, kind: OpKind::Load { entry: e, index: i } });
                self.pslots[s as usize].pending_load += 1;
                self.hit_blocks += 1;
            } else {
                // Generations run 1..SKIP_GEN (exclusive): 0 is never computed and SKIP_GEN marks
                // "neither fill nor verify" in the kernels' tables.
                self.next_gen = fingerprint::next_generation(self.next_gen);
                let t = TableEntry { block: r.spec.hashes[i], generation: self.next_gen };
                promised.push(t);
                let due = self.lag(2).max(self.compute.back().map_or(0, |o| o.due));
                self.compute.push_back(Op { due, req: id, slot: s, cause: None, kind: OpKind::Fill { id: t } });
                self.pslots[s as usize].pending_compute += 1;
            }
            r.pending_writes += 1;
        }
        r.pslots = slots;
        r.promised = promised;
        r.stage = Stage::Prefill;
        if abort {
            // The client went away: vLLM frees the blocks at once; the compute stream
            // still runs the issued writes.
            self.aborted += 1;
            self.reqs.insert(id, r);
            self.order.retain(|&x| x != id);
            let rr = self.reqs.remove(&id).expect("aborted");
            for s in rr.pslots {
                self.pslots[s as usize].owner = None;
                self.pfree.push(s);
            }
            return Ok(true);
        }
        // Saves of computed blocks (keys not yet stored).
        let mut immediate = Vec::new();
        if let Some(store) = self.store.as_mut() {
            for i in k..n {
                let hash = r.spec.hashes[i];
                let s = r.pslots[i];
                match store.reserve(hash, r.promised[i]) {
                    Some(e) => {
                        // The reservation's pin lasts until the put runs (tier-only: until
                        // decode has loaded the entry).
                        r.entries[i] = Some(e);
                        r.saves_left += 1;
                        r.had_saves = true;
                        let due = self.now + put_lag(&mut self.rng);
                        let mut op =
                            Op { due, req: id, slot: s, cause: None, kind: OpKind::Save { entry: e, promised: r.promised[i] } };
                        if self.races.unfenced(Mechanism::SaveBeforeWrite) {
                            // No event wait: the save copies the block before the write lands.
                            op.cause = Some(Mechanism::SaveBeforeWrite);
                            immediate.push(op);
                        } else {
                            self.puts.push_back(op);
                        }
                    }
                    None if !sc.uses_nixl() => {
                        // Already stored (same prefix computed by another request): decode
                        // loads that entry and expects what it promises.
                        if let Some(e) = store.find(hash) {
                            store.pin(e);
                            r.entries[i] = Some(e);
                        }
                    }
                    None => {}
                }
            }
        }
        self.reqs.insert(id, r);
        self.drop_evicted()?;
        for op in immediate {
            self.execute_put(op)?;
        }
        Ok(true)
    }

    fn finish(&self, report: &mut Report) {
        let s = &mut report.summary;
        s.transfer_seconds = self.busy_secs;
        s.transfer_gbps = if s.transfer_seconds > 0.0 { s.bytes_transferred as f64 / s.transfer_seconds / 1e9 } else { 0.0 };
        s.iterations = self.verified.min(u32::MAX as u64) as u32;
        s.fill_seconds = self.fill_secs;
        s.poison_seconds = self.poison_secs;
        let slice = self.decode.pool.geometry().slice_bytes().unwrap_or(0);
        s.verify_gbps =
            if s.verify_seconds > 0.0 { s.blocks_checked as f64 * slice as f64 / s.verify_seconds / 1e9 } else { 0.0 };
        let races = Mechanism::ALL
            .iter()
            .map(|&m| {
                let unf = self.races.unfenced(m);
                let classes: BTreeMap<String, u64> = self
                    .attributed
                    .get(&m)
                    .map(|c| c.iter().map(|(k, v)| (k.name().to_string(), *v)).collect())
                    .unwrap_or_default();
                let n: u64 = classes.values().sum();
                let w = self.windows.get(&m).copied().unwrap_or(0);
                let in_class = self.attributed.get(&m).is_none_or(|c| c.keys().all(|k| RACE_CLASSES.contains(k)));
                let (verdict, why) = match (unf, n > 0 && in_class) {
                    (false, _) => (if n == 0 { "clean" } else { "corrupt" }.to_string(), None),
                    (true, true) => ("detected".to_string(), None),
                    (true, false) if n > 0 => (
                        "not reproduced".to_string(),
                        Some("corruption was attributed but with classes it does not predict".to_string()),
                    ),
                    (true, false) if w == 0 => ("not reproduced".to_string(), Some(window_never(m))),
                    (true, false) => (
                        "not reproduced".to_string(),
                        Some(format!("the window opened {w} times but no affected block reached a verified decode read")),
                    ),
                };
                RaceOutcome {
                    mechanism: m,
                    fencing: if unf { Fencing::Unfenced } else { Fencing::Fenced },
                    windows_opened: w,
                    corrupt_attributed: n,
                    classes,
                    predicted_classes: RACE_CLASSES.to_vec(),
                    verdict,
                    why,
                }
            })
            .collect();
        let store = self.store.as_ref();
        report.scenario = Some(ScenarioReport {
            scenario: self.cfg.scenario,
            tier: self.cfg.tier,
            steps: self.now,
            seconds: self.started.elapsed().as_secs_f64(),
            requests_admitted: self.admitted,
            requests_verified: self.verified,
            requests_aborted: self.aborted,
            tier_hit_blocks: self.hit_blocks,
            tier_saves: self.saves,
            tier_loads: self.loads,
            tier_evictions: store.map_or(0, |s| s.evictions),
            tier_detail: match (&self.mooncake, self.cfg.scenario.uses_tier()) {
                (Some(mc), _) => mc.detail.clone(),
                (None, true) => "embedded".into(),
                (None, false) => "none".into(),
            },
            unexplained_corrupt: self.unexplained,
            races,
            intervals: self.intervals.clone(),
        });
    }
}

/// A test-only fault hook: `KVPROBE_TEST_FAULT=KIND:N` corrupts one decode slice in each of
/// N verified requests of a scenario, after the READ (or tier load) delivered it and before
/// decode verifies it — damage no race of the engine can produce, so each such slice must be
/// reported unexplained (tests/scenario.rs proves it). Never set in normal use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TestFault {
    /// `bitflip`: flips one bit of the slice's first check word.
    Bitflip,
    /// `poison`: overwrites the second half of a slice whose prefill block was rewritten
    /// while its READ was in flight with this iteration's poison (a partial delivery).
    Poison,
}

impl TestFault {
    /// The environment variable.
    pub const VAR: &'static str = "KVPROBE_TEST_FAULT";

    /// The name in `KVPROBE_TEST_FAULT`.
    pub fn name(self) -> &'static str {
        match self {
            TestFault::Bitflip => "bitflip",
            TestFault::Poison => "poison",
        }
    }

    /// Reads `KVPROBE_TEST_FAULT` (`bitflip:N` or `poison:N`); errors (exit 2) on another value.
    pub fn from_env() -> Result<Option<(TestFault, u64)>> {
        let Ok(v) = std::env::var(Self::VAR) else { return Ok(None) };
        let bad = || Error::Usage(format!("{}={v:?}: expected bitflip:N or poison:N (test-only)", Self::VAR));
        let (kind, n) = v.split_once(':').ok_or_else(bad)?;
        let kind = match kind {
            "bitflip" => TestFault::Bitflip,
            "poison" => TestFault::Poison,
            _ => return Err(bad()),
        };
        Ok(Some((kind, n.trim().parse().map_err(|_| bad())?)))
    }
}

/// Steps until a save runs: usually 0–3, but one in four waits 16–96 steps behind a
/// backlog (a store's puts are slower than NIXL under sustained load: about 1 GB/s for
/// Mooncake over TCP against hundreds of GB/s for cuda_ipc).
fn put_lag(rng: &mut ChaCha8Rng) -> u64 {
    if rng.random_range(0..4u32) == 0 { rng.random_range(16..=96) } else { rng.random_range(0..=3) }
}

fn window_never(m: Mechanism) -> String {
    match m {
        Mechanism::LoadIntoReading => "the window never opened: no tier load landed in a block whose READ was pending (needs prefix hits: --prefix-share > 0)".into(),
        Mechanism::SaveAfterFree => "the window never opened: no block was reused before its save ran (more load: --concurrency, --requests)".into(),
        Mechanism::SaveBeforeWrite => "the window never opened: every save found its block already written".into(),
        Mechanism::FreeOnFirstCompletion => "the window never opened: no block was reused while the other connector still used it (more load: --concurrency, --requests)".into(),
        Mechanism::UnfencedLoad => "the window never opened: no load targeted a block with a write still in flight (needs aborts, --abort-rate > 0, and prefix hits)".into(),
    }
}

/// Whether a geometry and load fit: every prompt must fit in each pool.
pub fn check(cfg: &ScenarioConfig, num_blocks: u32) -> Result<()> {
    let w = &cfg.workload;
    if w.min_blocks == 0 || w.min_blocks > w.max_blocks {
        return Err(Error::Usage(format!("--prompt-blocks {}-{}: need 1 <= MIN <= MAX", w.min_blocks, w.max_blocks)));
    }
    if w.max_blocks > num_blocks / 2 {
        return Err(Error::Usage(format!(
            "--prompt-blocks up to {} needs at least {} blocks per pool (--blocks is {num_blocks})",
            w.max_blocks,
            w.max_blocks * 2
        )));
    }
    if !(0.0..=1.0).contains(&w.prefix_share) {
        return Err(Error::Usage(format!("--prefix-share must be between 0 and 1, got {}", w.prefix_share)));
    }
    if !(0.0..1.0).contains(&w.abort_rate) {
        return Err(Error::Usage(format!(
            "--abort-rate must be at least 0 and below 1 (some requests must reach decode), got {}",
            w.abort_rate
        )));
    }
    if cfg.concurrency == 0 || cfg.concurrency > 4096 {
        return Err(Error::Usage("--concurrency must be between 1 and 4096".into()));
    }
    if let Some(d) = cfg.duration_secs
        && !(d.is_finite() && d > 0.0)
    {
        return Err(Error::Usage("--duration must be positive".into()));
    }
    if cfg.duration_secs.is_none() && cfg.requests == 0 {
        return Err(Error::Usage("--requests must be at least 1".into()));
    }
    if !(cfg.interval_secs.is_finite() && cfg.interval_secs >= 0.1) {
        return Err(Error::Usage("--interval must be at least 100ms".into()));
    }
    let need = 2 * cfg.concurrency as u64 * w.max_blocks as u64;
    if cfg.scenario.uses_tier() && (cfg.tier_blocks as u64) < need {
        return Err(Error::Usage(format!(
            "--tier-blocks {} is too small: in-flight requests may pin up to {need} entries (2 x concurrency x max prompt blocks)",
            cfg.tier_blocks
        )));
    }
    Ok(())
}
