//! `kvprobe run`: fingerprinted KV blocks → NIXL → per-block verification, iterated.
//!
//! Setup: both pools are allocated and registered, the roles exchange [`crate::xfer::transport::PeerInfo`], and
//! the prefill pool gets generation 0. Each iteration `g` (1-based):
//! 1. prefill refills every slice with generation `g` (fill kernel or CPU reference);
//!    injected faults on the prefill side are applied;
//! 2. decode re-poisons every slice with the pattern of (iteration, slot);
//! 3. a seeded random permutation maps prefill blocks to decode blocks (block ids differ
//!    between engines, as in vLLM); one NIXL request moves every block slice;
//! 4. decode verifies every slice in full against the logical block it should hold;
//!    failing slices are classified ([`crate::core::verify`]) and recorded.

use crate::core::fingerprint;
use crate::core::geometry::SliceCoord;
use crate::core::verify::{self, Class};
use crate::error::{Error, Exit, Result};
use crate::mem::pool::{KvPool, MemoryKind};
use crate::report::{Budget, Failure, InjectionRecord, IterationTimes, PredictedHit, Report, Tally};
use crate::scenario::config::Progress;
use crate::sweep::{
    Plan, RunConfig, backend_refusal, build_decode_pool, build_pools, build_prefill_pool, check_config, check_host_memory, plan,
    stage_requests, sweep_stages,
};
use crate::xfer::transport::{self, Endpoint, Op, Pair};
use std::collections::HashMap;
use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

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
    /// `--dump DIR`: where failing slices go as they are classified ([`crate::report::dump`]).
    pub dump: Option<&'a mut crate::report::dump::Dumper>,
}

pub use crate::core::fingerprint::{logical_block, seed_hex};

/// A sweep stage's request, as decode tracks it.
pub(crate) enum SweepRequest {
    /// A NIXL request of this process.
    Nixl(crate::xfer::nixl::Posted),
    /// A WRITE the prefill peer posted under `tag` (`run --peer`, `run --decode-process`).
    PeerWrite {
        /// Notification tag.
        tag: String,
        /// `--timeout` from just before the request was sent to prefill.
        deadline: crate::sys::deadline::Deadline,
        /// Checks begun after the deadline that found it incomplete.
        late_misses: u8,
    },
}

impl SweepRequest {
    fn deadline(&self) -> crate::sys::deadline::Deadline {
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
    /// The prefill side, over the peer protocol ([`crate::peer`]): a `kvprobe serve` session
    /// on another host (`run --peer`), in a child process (`run --decode-process`) or on a
    /// thread of this process. Sweeps and scenarios drive all three with the same code.
    pub(crate) prefill: Box<crate::peer::client::PrefillPeer>,
    pub(crate) decode: Endpoint,
    /// With `--decode-tp` > 1: decode's TP ranks 1.. (a pool and a NIXL agent each).
    pub(crate) decode_ranks: Vec<Endpoint>,
    /// The copy ceiling (GB/s) timed at set-up (the plain sweep: on prefill's pool before it
    /// went to its thread); `None` when timed later or not at all.
    copy_gbps: Option<f64>,
    /// Scenarios with the embedded tier and prefill on a thread of this process: the tier's
    /// arena, which decode's tier-only loads copy from.
    pub(crate) tier_arena: Option<Arc<crate::mem::tier::TierArena>>,
}

impl Probe {
    /// Sets up a run's two roles (a sweep, a scenario, `ab`'s matrix) over the peer protocol.
    /// Node pair (`--peer`): connects to `serve`, agrees on the configuration, allocates and
    /// registers decode's pool here, and exchanges NIXL agents with prefill there.
    /// `--decode-process`: the same, with a child `kvprobe serve` on a Unix socket pair as
    /// prefill ([`crate::peer::client::start_child`]). Otherwise: the same with a serve
    /// session on a thread of this process ([`crate::peer::client::start_thread`]), handed
    /// prefill's pool (a sweep's after the copy ceiling was timed on it; a scenario's embedded
    /// tier arena comes back, for decode's tier-only loads). `environment` is this
    /// side's (sent to prefill for its report; not to a child or thread, which write none).
    /// Errors: environment (cannot connect or start the child), usage (refused: version, token,
    /// configuration), transport, timeout (a child not ready within its start bound too).
    pub(crate) fn setup_peer(cfg: &RunConfig, environment: Option<crate::env::envinfo::Environment>) -> Result<Probe> {
        use crate::peer::client::Holder;
        let timeout = Duration::from_secs_f64(cfg.timeout_secs);
        let run_id = crate::peer::random_hex(8)?;
        let mut holder = None;
        let mut environment = environment;
        let mut decode_pool = None;
        let mut copy_gbps = None;
        let handoff = Arc::new(crate::drive::serve::Handoff::default());
        let (link, addr) = if cfg.peer.is_none() && !cfg.decode_process {
            crate::sys::progress::announce(&format!(
                "setup: allocating pools ({} {} per side)",
                cfg.geometry.pool_bytes().map(crate::sys::units::bytes_binary).unwrap_or_default(),
                if cfg.memory == MemoryKind::Vram { "VRAM" } else { "DRAM" }
            ));
            let (mut p, mut d) = build_pools(cfg)?;
            if cfg.scenario.is_none() && cfg.geometry.pool_bytes()? >= crate::mem::pool::MIN_CEILING_BYTES && same_regions(cfg)? {
                crate::sys::progress::announce("setup: timing a copy of the prefill pool to the decode pool (the ceiling)");
                copy_gbps = Some(time_copy(cfg, &mut p, &mut d, &plan(cfg, 1)?)?);
            }
            *handoff.pool.lock().unwrap_or_else(|p| p.into_inner()) = Some(p);
            decode_pool = Some(d);
            let vram = cfg.memory == MemoryKind::Vram;
            let serve = crate::drive::serve::ServeConfig {
                listen: "in-process".into(),
                token: String::new(),
                memory: cfg.memory,
                device: if vram { cfg.prefill_device } else { 0 },
                backend: Some(cfg.backend.clone()),
                // The model's geometry (with TP, the run's is one rank's).
                geometry: Some(crate::core::geometry::Geometry {
                    num_kv_heads: cfg.tp.map_or(cfg.geometry.num_kv_heads, |t| t.total_kv_heads),
                    ..cfg.geometry.clone()
                }),
                block_size_follows_tp: false,
                num_blocks_follow_run: false,
                hybrid: None, // the run's own model
                tp: None,
                keep_serving: false,
                idle_timeout: timeout,
                mode: crate::drive::serve::SessionMode::InProcess,
            };
            let h = handoff.clone();
            let (link, thread) = crate::peer::client::start_thread(timeout, &run_id, move |stream, token| {
                crate::drive::serve::serve_in_process(&crate::drive::serve::ServeConfig { token, ..serve }, stream, &h)
            })?;
            link.bound_setup(timeout);
            holder = Some(Holder::Thread(thread));
            environment = None;
            (link, "in-process".to_string())
        } else if cfg.decode_process {
            crate::sys::progress::announce(&format!(
                "setup: starting the prefill process (kvprobe serve holding prefill's NIXL agent and pool, {})",
                if cfg.memory == MemoryKind::Vram { format!("VRAM on GPU {}", cfg.prefill_device) } else { "DRAM".into() }
            ));
            let spec = crate::peer::client::ChildSpec {
                memory: cfg.memory,
                device: cfg.prefill_device,
                backend: &cfg.backend,
                timeout_secs: cfg.timeout_secs,
            };
            let (link, c) = crate::peer::client::start_child(&spec, timeout, &run_id)?;
            let addr = format!("child process {}", c.id());
            holder = Some(Holder::Child(c));
            environment = None;
            (link, addr)
        } else {
            let addr = cfg.peer.clone().unwrap_or_default();
            crate::sys::progress::announce(&format!("setup: connecting to the prefill peer at {addr}"));
            let token = cfg.peer_token.clone().unwrap_or_default();
            let link = crate::peer::client::connect(&addr, &token, &run_id, timeout)?;
            link.bound_setup(timeout);
            (link, addr)
        };
        let decode_side = crate::peer::Side {
            geometry: cfg.decode_geom().clone(),
            memory: cfg.memory,
            device: if cfg.memory == MemoryKind::Vram { cfg.decode_device } else { 0 },
            host: crate::peer::host_name(),
        };
        let config = serde_json::to_value(cfg).map_err(|e| Error::Io(e.to_string()))?;
        let (link, side, section) =
            crate::peer::client::PrefillPeer::configure(link, config, decode_side, environment, &addr, &run_id)?;
        // Each side announces its geometry (as vLLM's NixlAgentMetadata carries block_size,
        // block_lens and kv_cache_layout): prefill's must be the run's.
        if side.geometry != cfg.geometry {
            return Err(Error::Transport(format!(
                "prefill at {addr} announced a geometry other than the run's (prefill {}, run {})",
                serde_json::to_string(&side.geometry).unwrap_or_default(),
                serde_json::to_string(&cfg.geometry).unwrap_or_default()
            )));
        }
        let pool = match decode_pool {
            Some(d) => {
                crate::sys::progress::announce(&format!("setup: registering the pools with NIXL (backend {})", cfg.backend));
                d
            }
            None => {
                crate::sys::progress::announce(&format!(
                    "setup: allocating decode's pool ({} {}), registering it with NIXL (backend {}); prefill on {} ({})",
                    cfg.decode_geom().pool_bytes().map(crate::sys::units::bytes_binary).unwrap_or_default(),
                    if cfg.memory == MemoryKind::Vram { "VRAM" } else { "DRAM" },
                    cfg.backend,
                    side.host,
                    if side.memory == MemoryKind::Vram { format!("VRAM on GPU {}", side.device) } else { "DRAM".into() }
                ));
                build_decode_pool(cfg)?
            }
        };
        let opts =
            crate::xfer::transport::TransportOptions { xfer_req: cfg.xfer_req, backend_params: cfg.backend_params.clone() };
        let refusal = |e| backend_refusal(&cfg.backend, cfg.memory, e);
        crate::sys::trace::trace!("decode NIXL agent");
        let sides = cfg.sides()?;
        let tp = sides.tp;
        // Decode's TP ranks 1.. (`--decode-tp`): pools like rank 0's, holding their heads.
        let mut rank_pools = Vec::new();
        for d in 1..tp.decode {
            let dev = cfg.decode_device_of(d);
            let mut p = match cfg.memory {
                MemoryKind::Vram if dev != cfg.decode_device => crate::sweep::vram_pool_on(dev, cfg.decode_geom(), cfg.seed)?,
                _ => pool.sibling()?,
            };
            p.set_head_base(tp.heads_of(tp.decode, d).start);
            rank_pools.push(p);
        }
        let mut decode = Endpoint::with_options("kvprobe-decode", &cfg.backend, pool, &opts).map_err(refusal)?;
        let mut decode_ranks = Vec::new();
        for (d, p) in rank_pools.into_iter().enumerate() {
            decode_ranks
                .push(Endpoint::with_options(&format!("kvprobe-decode-tp{}", d + 1), &cfg.backend, p, &opts).map_err(refusal)?);
        }
        let info = decode.info().map_err(refusal)?;
        let rank_infos = decode_ranks.iter().map(|e| e.info()).collect::<Result<Vec<_>>>().map_err(refusal)?;
        // In process, prefill's requests hold shares of decode's registrations and decode's of
        // prefill's (as between two agents of one process): neither pool is freed under them.
        let mut lease = info.lease.clone();
        rank_infos.iter().for_each(|r| lease.join(&r.lease));
        *handoff.decode_lease.lock().unwrap_or_else(|p| p.into_inner()) = Some(lease);
        let mut peer = crate::peer::client::PrefillPeer::connect_ranks(link, info, rank_infos, side, section)?;
        if peer.ranks_info.len() + 1 != tp.prefill as usize {
            return Err(Error::Transport(format!(
                "prefill sent {} NIXL agents for prefill TP {} (a protocol error)",
                peer.ranks_info.len() + 1,
                tp.prefill
            )));
        }
        if let Some(l) = handoff.prefill_lease.lock().unwrap_or_else(|p| p.into_inner()).take() {
            peer.ranks_info.iter_mut().for_each(|r| r.lease = l.clone());
            peer.info.lease = l;
        }
        let prefill_infos: Vec<crate::xfer::transport::PeerInfo> =
            std::iter::once(peer.info.clone()).chain(peer.ranks_info.iter().cloned()).collect();
        if let Some(i) = prefill_infos.iter().find(|i| i.geometry.as_ref().is_some_and(|g| *g != cfg.geometry)) {
            return Err(Error::Transport(format!(
                "prefill's NIXL agent {} announced a pool geometry other than the run's",
                i.agent
            )));
        }
        // A peer whose metadata NIXL cannot load is the peer's fault (transport, exit 3), not a
        // backend that cannot serve this side's pools. Each decode rank loads the prefill
        // ranks it reads, in vLLM's get_target_remote_ranks order.
        crate::sys::trace::trace!("decode loads prefill's metadata");
        for (d, e) in std::iter::once(&mut decode).chain(decode_ranks.iter_mut()).enumerate() {
            for p in tp.targets(d as u32) {
                e.connect_link(
                    prefill_infos[p as usize].clone(),
                    crate::xfer::transport::Cuts::of_link(&sides, p, d as u32).swapped(),
                )?;
            }
        }
        if matches!(holder, Some(Holder::Thread(_))) {
            peer.region_leases = Some(handoff.regions.clone());
        }
        match holder {
            Some(h) => peer.adopt(h),
            None => peer.set_up(),
        }
        crate::sys::trace::trace!("connected to the prefill peer");
        let tier_arena = handoff.tier_arena.lock().unwrap_or_else(|p| p.into_inner()).take();
        Ok(Probe { cfg: cfg.clone(), prefill: Box::new(peer), decode, decode_ranks, copy_gbps, tier_arena })
    }

    fn plan(&self, it: u32) -> Result<Plan> {
        plan(&self.cfg, it)
    }

    /// Decode's TP rank `d` (0: [`Probe::decode`]).
    pub(crate) fn rank(&self, d: u32) -> &Endpoint {
        if d == 0 { &self.decode } else { &self.decode_ranks[d as usize - 1] }
    }

    /// Decode's TP rank `d`, mutably.
    pub(crate) fn rank_mut(&mut self, d: u32) -> &mut Endpoint {
        if d == 0 { &mut self.decode } else { &mut self.decode_ranks[d as usize - 1] }
    }

    /// Decode's TP ranks.
    pub(crate) fn ranks(&self) -> u32 {
        1 + self.decode_ranks.len() as u32
    }

    /// Prefill refills `stage` (every layer: `None`) with `plan`'s generation and plants its
    /// faults there: asked for, not waited for ([`PrefillPeer::await_filled`] before a READ of
    /// it).
    ///
    /// [`PrefillPeer::await_filled`]: crate::peer::client::PrefillPeer::await_filled
    fn fill_source(&mut self, plan: &Plan, stage: Option<usize>) -> Result<()> {
        self.prefill.fill(plan.it, stage.map(|k| k as u32))
    }

    /// Waits until every fill asked of prefill is complete.
    fn finish_source(&mut self) -> Result<()> {
        self.prefill.await_all_filled()
    }

    /// Posts stage `k` of iteration `it` (`pairs`, notification `tag`) for `op`: READ, decode
    /// posts once prefill has filled the stage; WRITE, prefill is asked to post.
    /// `link`: (prefill rank, decode rank, decode rank's peer index of that prefill rank); READ
    /// only for TP ranks other than (0, 0).
    #[allow(clippy::too_many_arguments)]
    fn post(
        &self,
        op: Op,
        it: u32,
        k: usize,
        link: (u32, u32, usize),
        pairs: &[Pair],
        tag: &str,
        timeout: Duration,
    ) -> Result<SweepRequest> {
        let p = &self.prefill;
        match op {
            Op::Read => {
                p.await_filled(it, Some(k as u32))?;
                let d = crate::sys::deadline::Deadline::after(timeout);
                // A failed post with prefill gone is prefill's death (as a failed poll).
                let e = self.rank(link.1);
                Ok(SweepRequest::Nixl(e.post_to(link.2, Op::Read, pairs, tag, d).map_err(|e| p.cause_of(e))?))
            }
            Op::Write => {
                let deadline = crate::sys::deadline::Deadline::after(timeout);
                p.post_write(it, k as u32, tag)?;
                Ok(SweepRequest::PeerWrite { tag: tag.into(), deadline, late_misses: 0 })
            }
        }
    }

    /// Checks a stage's request once: `Some` when complete. A peer's liveness is checked too
    /// (a dead peer: transport, exit 3; a silent one: timeout, exit 4).
    fn poll(&self, d: u32, r: &mut SweepRequest) -> Result<Option<crate::xfer::nixl::XferResult>> {
        let p = &self.prefill;
        match r {
            SweepRequest::Nixl(r) => {
                p.pump(Duration::ZERO)?;
                self.rank(d).poll(r).map_err(|e| p.cause_of(e))
            }
            SweepRequest::PeerWrite { tag, deadline, late_misses } => {
                p.poll_written(tag, *deadline, late_misses).map_err(|e| p.cause_of(e))
            }
        }
    }

    /// WRITE: checks once whether decode's TP rank `rank` has notification `tag` from a
    /// prefill rank (`inbox`: that rank's).
    fn poll_notification(
        &self,
        inbox: &mut transport::Inbox,
        rank: u32,
        tag: &str,
        d: crate::sys::deadline::Deadline,
    ) -> Result<bool> {
        let p = &self.prefill;
        p.pump(Duration::ZERO)?;
        let from: Vec<String> =
            std::iter::once(p.info.agent.clone()).chain(p.ranks_info.iter().map(|r| r.agent.clone())).collect();
        transport::poll_notification_from(self.rank(rank), &from, inbox, tag, d).map_err(|e| match p.cause_of(e) {
            // Name where prefill is, not only its agent.
            Error::Timeout(m) => Error::Timeout(format!("{m}; prefill is {}", p.who())),
            e => e,
        })
    }

    /// READ: waits until prefill has every notification in `tags`.
    fn await_notifications(&self, tags: &mut HashMap<String, crate::sys::deadline::Deadline>) -> Result<()> {
        let p = &self.prefill;
        p.await_notifications(tags).map_err(|e| p.cause_of(e))
    }

    /// The test-only early-notification fault: prefill sends `tag` alone.
    fn notify_decode(&self, tag: &str) -> Result<()> {
        self.prefill.notify(tag)
    }
}

pub use crate::report::StrayCheck;

/// The slices of a sweep iteration found corrupt, by (decode TP rank, slice): the class found
/// and whether the slice is exactly as an injection predicts it
/// ([`crate::core::inject::matches_prediction`]).
type Seen = HashMap<(u32, SliceCoord), (Class, bool)>;

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
    d: u32,
    plan: &Plan,
    fails: &[crate::mem::pool::RawFailure],
    check: StrayCheck,
    seen: &mut Seen,
    report: &mut Report,
    dump: &mut Option<&mut crate::report::dump::Dumper>,
) -> Result<u64> {
    let g = cfg.decode_geom();
    let sb = g.slice_bytes()? as usize;
    let mut buf = vec![0u8; sb];
    let mut n = 0;
    for f in fails {
        let c = g.coord_of(f.slice);
        if check == StrayCheck::Reverify && seen.contains_key(&(d, c)) {
            continue;
        }
        let expected = plan.dst_table[c.block as usize].identity(c);
        let pool = &probe.rank(d).pool;
        match check {
            // The bytes the re-verify judged (its snapshot on DRAM; on VRAM read before the
            // re-poison, [`KvPool::verify_layers_then_poison`]).
            StrayCheck::Reverify => pool.judged_slice(c, f.slice, &mut buf).map(|_| ())?,
            StrayCheck::Poison => pool.read_slice(c, &mut buf)?,
        }
        let want = match check {
            StrayCheck::Poison => {
                let mut p = vec![0u8; sb];
                fingerprint::poison(&mut p, f.slice, plan.it);
                p
            }
            StrayCheck::Reverify => fingerprint::expected(cfg.seed, &pool.shape().slice(expected)),
        };
        let observed = fingerprint::observed_identity(&buf, cfg.seed, pool.shape(), f.first_bad);
        let v = verify::Verdict { class: Class::Stray, observed, bit_flips: None, sectors: None, displacement: None, rows: None };
        let as_predicted = crate::core::inject::matches_prediction(plan.predicted.get(&(d, c)), Class::Stray, cfg.seed, &buf);
        seen.insert((d, c), (Class::Stray, as_predicted));
        if !as_predicted {
            report.summary.unexpected_failures += 1;
        }
        n += 1;
        Tally::new(cfg.max_failures).record(report, dump.as_deref_mut(), Budget::Shared, Class::Stray, &buf, None, || {
            let mut rec = Failure::new(plan.it, c, f, v, &want, &buf, expected, plan.src_of[c.block as usize]);
            rec.stray_check = Some(check);
            rec.tp_rank = (probe.ranks() > 1).then_some(d);
            rec.injected = as_predicted;
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
    seen: &mut Seen,
    report: &mut Report,
    dump: &mut Option<&mut crate::report::dump::Dumper>,
) -> Result<u64> {
    let mut n = 0;
    for d in 0..probe.ranks() {
        let pool = &mut probe.rank_mut(d).pool;
        pool.check_poison_layers(layers.clone(), plan.it)?;
        let (fails, slices) = pool.take_poison_failures()?;
        report.summary.stray_poison_checked_slices += slices;
        n += record_strays(cfg, probe, d, plan, &fails, StrayCheck::Poison, seen, report, dump)?;
    }
    Ok(n)
}

/// The report of a run refused before it started (its outcome carries `e`).
pub fn failed_report(cfg: &RunConfig, e: &Error) -> Report {
    let mut r = empty_report(cfg);
    r.finish(e.exit(), Some(e));
    r
}

/// A report with no results yet (status "running").
pub(crate) fn empty_report(cfg: &RunConfig) -> Report {
    let mut r = Report::start(serde_json::to_value(cfg).unwrap_or(serde_json::Value::Null));
    // What decode's conversion on receive does, recorded once here for every reader.
    r.decode_converts = cfg.sides().ok().map(|s| s.converts());
    r
}

/// The report to write when a call blocked past its deadline (`e`, a timeout) and the run
/// cannot end normally: the last published report of `cfg`'s run (or an empty one), its
/// outcome `e` — exit 4, or 1 when corruption was already found. A dump in progress (`--dump`)
/// is finished against it ([`crate::report::dump::finish_active`]).
pub fn expired_report(cfg: &RunConfig, e: &Error) -> (Report, Exit) {
    let mut r = empty_report(cfg);
    if let Some(s) = crate::report::last_published().filter(|s| s.config == r.config) {
        r = s;
    }
    // The dump in progress (--dump) ends with this report: the slices it counts.
    r.dump = crate::report::dump::finish_active(r.summary.by_class.values().sum());
    r.summary.host_peak_bytes = crate::sys::hostmem::peak_resident_bytes();
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
    let mut result = run_inner(cfg, &mut report, hooks, &mut probe);
    // What prefill said last before the run's end: a failure it sent after its last answer
    // ends the pair as its failure, not as decode's clean.
    if let (Ok(()), Some(p)) = (&result, &probe) {
        result = p.prefill.last_word();
    }
    report.summary.host_peak_bytes = crate::sys::hostmem::peak_resident_bytes();
    // A fenced run breaks no block's ownership: a violation there is a defect of the stack
    // under test, as corruption is, even where the bytes survived.
    if let (Ok(()), Some(n)) = (&result, fenced_violations(&report)) {
        result = Err(Error::Corrupt(format!(
            "{} block-ownership violation(s) in a run with every race mechanism fenced (scenario.violations)",
            n
        )));
    }
    // --self-test: planted faults found as predicted are the pass; anything else is the
    // failure (exit 1, the reason as the run's error).
    let mut passed = false;
    if let (true, Ok(())) = (cfg.self_test, &result) {
        match self_test_verdict(cfg, &report) {
            Ok(()) => passed = true,
            Err(why) => result = Err(Error::Corrupt(format!("self-test failed: {why}"))),
        }
    }
    let corrupt = (report.summary.blocks_corrupt > 0 && !passed) || matches!(result, Err(Error::Corrupt(_)));
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
    if passed && exit == Exit::Clean {
        report.outcome.status = crate::report::SELF_TEST_PASSED.into();
    }
    if let Some(Probe { prefill: p, .. }) = &probe {
        // The pair ends together: prefill takes this outcome and sends its side of the report.
        let results = crate::peer::Results {
            summary: serde_json::to_value(&report.summary).ok(),
            scenario: report.scenario.as_ref().and_then(|s| {
                // Serve's copy keeps the last intervals that fit one frame of a running link
                // (a --duration of hours at --interval 100ms has more); decode's report has all.
                let mut s = s.clone();
                let n = s.intervals.len();
                s.intervals.drain(..n.saturating_sub(crate::peer::MAX_DONE_INTERVALS));
                serde_json::to_value(s).ok()
            }),
            rows: None,
        };
        let side = p.finish(exit as u8, err.map(|e| e.to_string()), results, PEER_BYE_BOUND);
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
/// True when a prefill rank's pool and a decode rank's have layer regions of one size, so
/// that one can be copied whole into the other (the copy ceiling, [`time_copy`]): not when TP
/// gives the two sides' ranks different numbers of KV heads.
fn same_regions(cfg: &RunConfig) -> Result<bool> {
    Ok(cfg.geometry.region_bytes()? == cfg.decode_geom().region_bytes()?)
}

fn copy_ceiling_from_scratch(cfg: &RunConfig, decode: &mut Endpoint, plan: &Plan) -> Result<f64> {
    crate::sys::trace::trace!("copy ceiling from a scratch pool on prefill's side");
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

/// Decode's conversion on receive ([`crate::core::pairing::Sides::row_permutation`]: vLLM's
/// `kv_postprocess_*_on_receive`) of every slice of `layers` in `pool` after a transfer:
/// on the GPU for VRAM pools, on the host threads for DRAM ([`KvPool::permute_rows`]); what
/// still holds the iteration's poison stays poison. Errors: a CUDA error (VRAM pools, exit
/// 3); any other failure of the conversion (a DRAM slice it could not read or write back) is
/// internal (exit 3): the bytes the verify would judge are not the conversion of what arrived.
fn convert_received(sides: &crate::core::pairing::Sides, pool: &mut KvPool, layers: Range<u32>) -> Result<()> {
    let what = format!("decode's conversion on receive of layers {}..{}", layers.start, layers.end);
    pool.permute_rows(layers, &sides.row_permutation()).map_err(|e| match e {
        Error::Device(_) | Error::Interrupted(_) | Error::Timeout(_) => e,
        e => Error::Internal(format!("{what} failed: {e}")),
    })
}

/// How long `run --peer` waits for prefill's side of the report after telling it the outcome.
pub const PEER_BYE_BOUND: Duration = Duration::from_secs(5);

/// The block-ownership violations of a scenario run with every race mechanism fenced, when
/// there are any (`None` for sweeps, unfenced runs and clean ones).
pub fn fenced_violations(report: &Report) -> Option<u64> {
    let sc = report.scenario.as_ref()?;
    let fenced = sc.races.iter().all(|o| o.fencing == crate::core::mechanism::Fencing::Fenced);
    let n = sc.ownership_violations.unwrap_or(0);
    (fenced && n > 0).then_some(n)
}

/// The `--self-test` verdict of a finished run (`cfg.self_test`; the run itself ended
/// without an error): `Ok` when something was planted (an `--inject` fault, or an unfenced
/// race mechanism of a scenario), every fault asked for was planted, every planted fault
/// was detected as predicted (`summary.injections_detected == injections_planted`: each
/// slice it reaches found with its predicted class and bytes), every unfenced mechanism was
/// detected, and no corrupt slice is left that no planted fault predicts
/// (`summary.unexpected_failures == 0`; a scenario's unexplained slices). Otherwise `Err`
/// with every reason, joined by "; ".
pub fn self_test_verdict(cfg: &RunConfig, report: &Report) -> std::result::Result<(), String> {
    let s = &report.summary;
    let unfenced = cfg.scenario.as_ref().map_or(0, |sc| sc.unfenced.len());
    let mut why = Vec::new();
    // A hybrid model's regions (--inject CLASS[:N]@REGION): each region's own counts.
    let region_planted: u64 = report.regions.iter().map(|r| r.injections_planted).sum();
    let region_detected: u64 = report.regions.iter().map(|r| r.injections_detected).sum();
    let region_unexpected: u64 = report.regions.iter().map(|r| r.unexpected_failures).sum();
    let region_asked: u64 = cfg
        .region_inject
        .iter()
        .map(|spec| spec.count as u64 * report.regions.iter().filter(|r| r.kind == spec.region).count() as u64)
        .sum();
    if region_planted < region_asked {
        why.push(format!(
            "{} of the {region_asked} region faults asked for were never planted (the region has too few pages)",
            region_asked - region_planted
        ));
    }
    if region_detected < region_planted {
        why.push(format!(
            "{} of {region_planted} faults planted in regions not detected as predicted (regions[].injections[].detected)",
            region_planted - region_detected
        ));
    }
    if region_unexpected > 0 {
        why.push(format!("{region_unexpected} corrupt region row runs that no planted fault predicts"));
    }
    if s.injections_planted == 0 && unfenced == 0 && region_planted == 0 {
        why.push("nothing was planted (give --inject, or an unfenced --race with --scenario stacked)".to_string());
    }
    // A scenario plants one fault in a request that carries one; a short run may carry fewer
    // than asked for. A sweep plants every count in every iteration.
    let asked: u64 =
        cfg.inject.iter().map(|i| i.count as u64).sum::<u64>() * if cfg.scenario.is_some() { 1 } else { s.iterations as u64 };
    if s.injections_planted < asked {
        why.push(format!(
            "{} of the {asked} faults asked for were never planted (too few requests: raise --requests)",
            asked - s.injections_planted
        ));
    }
    if s.injections_detected < s.injections_planted {
        why.push(format!(
            "{} of {} planted faults not detected as predicted (injections[].detected)",
            s.injections_planted - s.injections_detected,
            s.injections_planted
        ));
    }
    if s.unexpected_failures > 0 {
        why.push(format!("{} corrupt block slices that no planted fault predicts", s.unexpected_failures));
    }
    let missed = unfenced_not_reproduced(report);
    if !missed.is_empty() {
        why.push(format!(
            "unfenced race mechanism(s) not reproduced: {}",
            missed.iter().map(|m| m.to_string()).collect::<Vec<_>>().join(", ")
        ));
    }
    if why.is_empty() { Ok(()) } else { Err(why.join("; ")) }
}

/// The unfenced race mechanisms of a scenario run whose verdict is not `detected` (empty
/// for sweeps and fenced runs).
pub fn unfenced_not_reproduced(report: &Report) -> Vec<crate::core::mechanism::Mechanism> {
    report.scenario.as_ref().map_or_else(Vec::new, |sc| {
        sc.races
            .iter()
            .filter(|o| o.fencing == crate::core::mechanism::Fencing::Unfenced && o.verdict != "detected")
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
        crate::sys::progress::announce("setup: loading NIXL, checking the environment");
    }
    crate::xfer::nixl::check_ucx_log_file()?;
    let lib = crate::xfer::nixl::load();
    report.environment = Some(crate::env::envinfo::gather(crate::env::envinfo::nixl_info()));
    config?;
    check_host_memory(cfg)?;
    lib?;
    Ok(())
}

fn run_inner(cfg: &RunConfig, report: &mut Report, hooks: &mut Hooks<'_>, slot: &mut Option<Probe>) -> Result<()> {
    let started = Instant::now();
    crate::report::publish(report);
    prepare(cfg, report)?;
    crate::sys::deadline::set_limit(Some(Duration::from_secs_f64(cfg.timeout_secs)));
    crate::report::publish(report);
    let ucx_mark = crate::xfer::ucx::mark();
    // Prefill is a peer wherever it is (another host, a child, a thread of this process).
    let probe = slot.insert(Probe::setup_peer(cfg, report.environment.clone())?);
    if !in_process(cfg) {
        report.peer = Some(probe.prefill.section.clone());
    }
    crate::xfer::ucx::adopt();
    // The agents have started their UCX backends: the UCX library is loaded now.
    if let Some(e) = report.environment.as_mut() {
        e.nixl.ucx_version = crate::xfer::nixl::loaded_ucx_version();
    }
    if let Some(sc) = &cfg.scenario {
        let timeout = Duration::from_secs_f64(cfg.timeout_secs);
        // A hybrid model's state lanes: decode's pool and agent of each (prefill makes its own).
        let mut lanes = Vec::new();
        for (k, lane) in crate::sweep::regions::scenario_lanes(cfg)?.into_iter().enumerate() {
            let agent = format!("kvprobe-state{k}-decode-{:016x}", rand::random::<u64>());
            let ep = crate::sweep::regions::lane_endpoint(cfg, &lane, cfg.memory, cfg.decode_device, &agent, false)?;
            lanes.push((lane, ep));
        }
        let sides = crate::scenario::decode::Sides {
            prefill: &probe.prefill,
            decode: &mut probe.decode,
            arena: probe.tier_arena.clone(),
            lanes,
        };
        report.summary.setup_seconds = started.elapsed().as_secs_f64(); // the prefill engine's start is added
        let r = crate::scenario::decode::run_scenario(
            sc,
            cfg.seed,
            0,
            sides,
            timeout,
            cfg.max_failures,
            report,
            hooks.progress,
            (hooks.checkpoint_secs, hooks.checkpoint),
            hooks.dump.as_deref_mut(),
        );
        report.summary.transport_path = Some(scenario_path(cfg, probe, ucx_mark, report.environment.as_ref()));
        r?;
        // A hybrid model's state: a wrong run is always a failure (no race reaches a state slot).
        let bad = crate::scenario::state::corrupt_lanes(&report.regions);
        return if bad.is_empty() || cfg.self_test { Ok(()) } else { Err(Error::Corrupt(bad.join("; "))) };
    }
    // A hybrid model's state and indexer regions: planned (and refused) before anything moves.
    let regions = crate::sweep::regions::plans(cfg)?;
    sweep(cfg, probe, report, hooks.line, hooks.dump.as_deref_mut(), started, ucx_mark)?;
    if !regions.is_empty() {
        crate::sweep::regions::run(cfg, &regions, &probe.prefill, report)?;
    }
    Ok(())
}

/// Adds what this host's facts say of a sweep's UCX path `p` (this side's, or in process the
/// prefill thread's): the warning for emulated VRAM transfers between two GPUs of one process,
/// and the flags of a TCP path where an RDMA NIC exists, no GPUDirect RDMA, a NIC that is not
/// the GPU's nearest ([`crate::xfer::ucx::flag_path`]; a peer on another host or process flags its
/// own path).
fn judge_path(cfg: &RunConfig, p: &mut crate::xfer::ucx::TransportPath, env: Option<&crate::env::envinfo::Environment>) {
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
        crate::xfer::ucx::flag_path(p, &env.rdma, gpu);
    }
    // A node pair whose bytes stayed on one host says so: its link was not tested.
    if cfg.peer.is_some()
        && let Some(f) = crate::xfer::ucx::same_host_flag(p)
        && !p.flags.iter().any(|x| x.code == f.code)
    {
        p.flags.push(f);
    }
}

/// The UCX path of a scenario's READs, as decode's agent (their initiator) logged it since
/// `mark` ([`crate::xfer::ucx::path_since`]), judged as a sweep's ([`judge_path`]).
pub(crate) fn scenario_path(
    cfg: &RunConfig,
    probe: &Probe,
    mark: u64,
    env: Option<&crate::env::envinfo::Environment>,
) -> crate::xfer::ucx::TransportPath {
    let mut p = probe.decode.transport_path(mark, Op::Read, cfg.memory == MemoryKind::Vram);
    judge_path(cfg, &mut p, env);
    p
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
    /// READ, posted with the stage's notification: one request per link (TP ranks), each
    /// with the decode rank that polls it.
    Posted(Vec<(u32, SweepRequest)>),
    /// WRITE: prefill was asked to post the stage (one request per link, on its side); decode
    /// waits for each link's notification (decode rank, tag).
    /// `bytes`: what decode's own plan moves in the stage (the rate decode reports is its own
    /// measurement, not prefill's word).
    Written { request: SweepRequest, notes: Vec<(u32, String)>, bytes: u64 },
    /// Test-only ([`EARLY_NOTIFY_VAR`]): the stage's notification was sent alone; the transfer
    /// is posted after decode verified the stage.
    Deferred { pairs: Vec<Pair>, deadline: crate::sys::deadline::Deadline },
}

/// Test-only fault hook: `KVPROBE_TEST_EARLY_NOTIFY=N` makes prefill deliver each stage's
/// notification of sweep iteration N before the stage's data (a bare NIXL notification, the
/// WRITE posted only after decode verified the stage), as a transport that notifies before
/// the data has landed would. Decode verifies on the notification, so every slice of
/// iteration N must be reported `unwritten` (exit 1). WRITE only.
pub const EARLY_NOTIFY_VAR: &str = crate::sys::test_hooks::EARLY_NOTIFY;

/// Test-only fault hook: `KVPROBE_TEST_LATE_WRITE=WHEN:N` writes into decode's pool (TP
/// rank 0) in sweep iteration N, as data landing after the verify pass judged it would:
/// `classify` — into each slice stage 0's verify found failing, its expected fingerprint,
/// between the verify and the classification (the slice must come out `late`, its
/// `judged_class` what the verify judged); `repoison` — into the first slice of stage 0
/// (layer 0, K or latent, slot 0) the fingerprint another block's slot is due, between the
/// verify (and classification) and the re-poison, or after the last iteration's verify (the
/// slice must come out `stray`, `stray_check` `reverify`). Errors (usage, exit 2): a value
/// of another form.
pub const LATE_WRITE_VAR: &str = crate::sys::test_hooks::LATE_WRITE;

/// Where [`LATE_WRITE_VAR`] writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum LateWrite {
    Classify(u32),
    Repoison(u32),
}

/// Reads [`LATE_WRITE_VAR`].
fn late_write_fault() -> Result<Option<LateWrite>> {
    let Some(v) = std::env::var_os(LATE_WRITE_VAR) else { return Ok(None) };
    let bad = || Error::Usage(format!("{LATE_WRITE_VAR} must be classify:N or repoison:N (N ≥ 1); got {v:?}"));
    let s = v.to_str().ok_or_else(bad)?;
    let (when, n) = s.split_once(':').ok_or_else(bad)?;
    let n = n.parse::<u32>().ok().filter(|n| *n >= 1).ok_or_else(bad)?;
    let f = match when {
        "classify" => LateWrite::Classify(n),
        "repoison" => LateWrite::Repoison(n),
        _ => return Err(bad()),
    };
    eprintln!("test fault: a late write into decode's pool ({s})");
    Ok(Some(f))
}

/// The compared-counts check (docs/guide.md "What an iteration does"): the verify passes of
/// decode rank `d` in iteration `it` compared `got`; the plan is every slice of the rank's
/// pool (`slices` of `slice_bytes`). Errors (internal, exit 3): they differ.
fn check_compared(it: u32, d: u32, got: crate::mem::pool::Compared, slices: u64, slice_bytes: u64) -> Result<()> {
    let bytes = slices * slice_bytes;
    if got.slices != slices || got.bytes != bytes {
        return Err(Error::Internal(format!(
            "iteration {it}: decode rank {d}'s verify passes compared {} block slices and {} bytes, but the plan is {slices} \
             block slices and {bytes} bytes: the verdict would rest on slices never compared",
            got.slices, got.bytes
        )));
    }
    Ok(())
}

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

/// Test-only fault hook: `KVPROBE_TEST_DAMAGE_TORN=tail|prefix|foreign` adds damage to every
/// decode slice an `--inject torn` tears, after its stage's transfer and before decode
/// verifies it, as a stack defect hitting an injected slice would: `tail` writes 16 bytes of
/// garbage where the tear left the poison, `prefix` flips a bit of the delivered prefix,
/// `foreign` replaces the delivered bytes with another block's rows. The slice stays `torn`,
/// but not the predicted bytes: each must count as an unexpected failure and its injection
/// as not detected as predicted (exit 1).
pub const DAMAGE_TORN_VAR: &str = crate::sys::test_hooks::DAMAGE_TORN;

/// The damage of [`DAMAGE_TORN_VAR`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum TornDamage {
    Tail,
    Prefix,
    Foreign,
}

/// Reads [`DAMAGE_TORN_VAR`]. Errors (usage, exit 2): another value.
fn torn_damage() -> Result<Option<TornDamage>> {
    let Some(v) = std::env::var_os(DAMAGE_TORN_VAR) else { return Ok(None) };
    let d = match v.to_str() {
        Some("tail") => TornDamage::Tail,
        Some("prefix") => TornDamage::Prefix,
        Some("foreign") => TornDamage::Foreign,
        _ => return Err(Error::Usage(format!("{DAMAGE_TORN_VAR} must be tail, prefix or foreign; got {v:?}"))),
    };
    eprintln!("test fault: torn slices get extra damage ({d:?})");
    Ok(Some(d))
}

/// Plants [`DAMAGE_TORN_VAR`]'s damage in the torn slices of `plan` in `layers`, on every
/// decode rank, as received (before any conversion).
fn damage_torn(cfg: &RunConfig, probe: &mut Probe, plan: &Plan, layers: Range<u32>, how: TornDamage) -> Result<()> {
    let sb = cfg.decode_geom().slice_bytes()? as usize;
    let mut buf = vec![0u8; sb];
    for (&(r, c), pred) in &plan.predicted {
        let Some(first) = pred.landed.first().filter(|_| pred.class == Class::Torn && layers.contains(&c.layer)) else {
            continue;
        };
        let pool = &mut probe.rank_mut(r).pool;
        pool.read_slice(c, &mut buf)?;
        match how {
            TornDamage::Tail => {
                // The last 16 bytes nothing lands on (torn: a multiple of 16 is missing).
                let hit =
                    |o: usize| pred.landed.iter().any(|l| (l.dst_off as usize) < o + 16 && o < (l.dst_off + l.len) as usize);
                let Some(o) = (0..sb / 16).rev().map(|k| k * 16).find(|&o| !hit(o)) else { continue };
                for (i, b) in buf[o..o + 16].iter_mut().enumerate() {
                    *b = 0xC3 ^ i as u8;
                }
            }
            TornDamage::Prefix => buf[first.dst_off as usize] ^= 0x10,
            TornDamage::Foreign => {
                let mut rows = first.rows;
                rows.slice.block ^= 0x5555;
                let other = fingerprint::expected(cfg.seed, &rows);
                for l in &pred.landed {
                    let (s, d, n) = (l.src_off as usize, l.dst_off as usize, l.len as usize);
                    buf[d..d + n].copy_from_slice(&other[s..s + n]);
                }
            }
        }
        pool.write_slice(c, &buf)?;
    }
    Ok(())
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
        if crate::sys::interrupt::since_requested().is_some_and(|d| d > crate::sys::interrupt::GRACE) {
            return Err(Error::Interrupted(format!(
                "in iteration {it} while stage {k}'s {what} was awaited (incomplete {} s after the signal; \
                 this iteration is not verified)",
                crate::sys::interrupt::GRACE.as_secs()
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
    mut dump: Option<&mut crate::report::dump::Dumper>,
    started: Instant,
    ucx_mark: u64,
) -> Result<()> {
    let g = cfg.decode_geom().clone();
    let sides = cfg.sides()?;
    for why in sides.vllm_refuses() {
        crate::sys::progress::announce(&format!("note: {why}"));
    }
    let sb = g.slice_bytes()? as usize;
    let ranks = probe.ranks();
    let tp = sides.tp;
    // Every decode rank's slices.
    let total = g.total_slices()? * ranks as u64;
    let pool_bytes = g.pool_bytes()?;
    let timeout = Duration::from_secs_f64(cfg.timeout_secs);
    let stages = sweep_stages(cfg);
    let all = 0..g.num_layers;
    let mut buf = vec![0u8; sb];
    let mut verify_all = 0.0;
    let early_notify = early_notify_fault(cfg.op)?;
    let late_write = late_write_fault()?;
    let mut now = vec![0u8; sb];
    let damage = torn_damage()?;

    // Setup: iteration 1's fill and faults, the copy ceiling, iteration 1's poison.
    let scratch_ceiling = cfg.decode_process && pool_bytes >= crate::mem::pool::MIN_CEILING_BYTES && same_regions(cfg)?;
    crate::sys::progress::announce(&format!(
        "setup: filling the prefill pool{}, poisoning the decode pool",
        if scratch_ceiling { ", timing a copy of it (the ceiling)" } else { "" }
    ));
    let mut cur = probe.plan(1)?;
    probe.fill_source(&cur, None)?;
    probe.finish_source()?;
    // The ceiling the transfer rate is compared to ([`time_copy`]). A pool below
    // crate::mem::pool::MIN_CEILING_BYTES copies in the time of the copy's fixed costs (threads, launches): no
    // ceiling is measured, and the summary says so instead of a ratio. In process it was timed
    // at set-up, on prefill's own pool. Across a node pair the pools are on two hosts: no copy
    // between them to time. With --decode-process both are on this host, prefill's in the
    // child: the copy comes from a scratch pool of the same geometry on prefill's memory and GPU.
    let copy_gbps = if scratch_ceiling {
        crate::sys::trace::trace!("copy ceiling");
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
    for d in 0..probe.ranks() {
        let pool = &mut probe.rank_mut(d).pool;
        pool.poison_layers(all.clone(), 1, false)?;
        pool.finish()?;
        pool.take_kernel_seconds();
    }
    probe.prefill.take_fill_kernel_seconds();
    report.summary.setup_seconds = started.elapsed().as_secs_f64();
    report.summary.pipeline_stages = stages.len() as u32;
    crate::report::publish(report);

    for it in 1..=cfg.iterations {
        if crate::sys::interrupt::requested() {
            return Err(Error::Interrupted(format!("after {} complete iterations", it - 1)));
        }
        crate::sys::deadline::set_position(it, 0);
        let iteration_start = Instant::now();
        let mut times = IterationTimes { index: it, ..Default::default() };
        let classes_before = report.summary.by_class.clone();
        let unexpected_before = report.summary.unexpected_failures;
        let more = it < cfg.iterations;
        for d in 0..probe.ranks() {
            probe.rank_mut(d).pool.load_table(&cur.dst_table)?;
        }
        let mut next: Option<Plan> = None;
        let mut seen: Seen = HashMap::new();
        let mut corrupt = 0u64;
        let mut bytes = 0u64;
        // What each decode rank's verify passes compared in this iteration (item: counts).
        let mut compared = vec![crate::mem::pool::Compared::default(); ranks as usize];
        let tag = |k: usize| format!("kvprobe:iter={it}:stage={k}");
        // READ: the notifications prefill must get (awaited after the last stage); WRITE:
        // each stage is verified when decode has its notification ([`Staged`]).
        let mut tags = HashMap::new();
        let early = early_notify == Some(it);
        let mut inflight = std::collections::VecDeque::new();
        let mut post = |probe: &Probe, k: usize, inflight: &mut std::collections::VecDeque<Staged>| -> Result<()> {
            let mut per_link = stage_requests(cfg, &cur, &stages, k)?;
            let staged = if per_link.iter().all(|p| p.is_empty()) {
                Staged::Empty
            } else if cfg.op == Op::Write && !early {
                // Prefill posts every link's WRITE (its TP ranks to decode's); decode waits for
                // each link's notification on the decode rank it lands in.
                let p = probe.post(cfg.op, it, k, (0, 0, 0), &[], &tag(k), timeout)?;
                let notes = (0..per_link.len())
                    .filter(|&l| !per_link[l].is_empty())
                    .map(|l| (cur.links[l].1, crate::sweep::link_tag(&tag(k), &cur, l)))
                    .collect();
                let bytes = per_link.iter().flatten().map(|p| p.len).sum();
                Staged::Written { request: p, notes, bytes }
            } else if early {
                // Test-only: the notification now, the transfer after decode verified (WRITE:
                // one rank each side).
                let deadline = crate::sys::deadline::Deadline::after(timeout);
                probe.notify_decode(&tag(k))?;
                Staged::Deferred { pairs: per_link.swap_remove(0), deadline }
            } else {
                let mut posted = Vec::new();
                for (l, pairs) in per_link.iter().enumerate() {
                    let (pr, dr) = cur.links[l];
                    if pairs.is_empty() {
                        continue;
                    }
                    // One request per (prefill rank, decode rank), tagged with both when TP.
                    let t = crate::sweep::link_tag(&tag(k), &cur, l);
                    let peer = tp.targets(dr).iter().position(|&x| x == pr).expect("a link's prefill rank is a target");
                    let p = probe.post(cfg.op, it, k, (pr, dr, peer), pairs, &t, timeout)?;
                    tags.insert(t, p.deadline());
                    posted.push((dr, p));
                }
                Staged::Posted(posted)
            };
            inflight.push_back(staged);
            Ok(())
        };
        // Stray-write check of the stages posted first, before the window (nothing in flight):
        // whatever the stage count, a write that landed after the re-poison is found here.
        {
            let t = Instant::now();
            for layers in stages.iter().take(2) {
                corrupt += poison_check(cfg, probe, &cur, layers.clone(), &mut seen, report, &mut dump)?;
            }
            report.summary.stray_check_seconds += t.elapsed().as_secs_f64();
        }
        // The transfer window: from building the first request's descriptors to the last
        // request's completion.
        let mut inboxes: Vec<transport::Inbox> = (0..ranks).map(|_| transport::Inbox::default()).collect();
        let window_start = Instant::now();
        crate::sys::trace::trace!("iteration {it}: posting");
        for k in 0..stages.len().min(2) {
            post(probe, k, &mut inflight)?;
        }
        let mut window_end = window_start;
        for (k, layers) in stages.iter().enumerate() {
            // Wait for stage k: READ, decode's own request complete (decode initiated it);
            // WRITE, decode's notification of it, as decode knows nothing else of a push (the
            // initiator's completion is waited for after the verify, before prefill refills
            // the source) — so a notification that comes before the data is caught.
            crate::sys::deadline::set_position(it, k as u32);
            let mut staged = inflight.pop_front().expect("one request per stage");
            let mut written = None;
            match (&mut staged, cfg.op) {
                (Staged::Empty, _) => {}
                (Staged::Posted(ps), Op::Read) => {
                    for (d, p) in ps.iter_mut() {
                        let r = wait(it, k, "transfer", || probe.poll(*d, p))?;
                        bytes += r.bytes;
                    }
                }
                (Staged::Posted(_), Op::Write) => unreachable!("a WRITE stage is Staged::Written"),
                (Staged::Written { request, notes, .. }, _) => {
                    // Prefill's status queries drive its progress (UCX sends the data and then
                    // the notification from the initiator's worker); its completion is kept
                    // but is not what the verify waits for.
                    let d = request.deadline();
                    for (dr, t) in notes.iter() {
                        wait(it, k, "notification", || {
                            if written.is_none() {
                                written = probe.poll(0, request)?;
                            }
                            Ok(probe.poll_notification(&mut inboxes[*dr as usize], *dr, t, d)?.then_some(()))
                        })?;
                    }
                }
                (Staged::Deferred { deadline, .. }, _) => {
                    let d = *deadline;
                    wait(it, k, "notification", || Ok(probe.poll_notification(&mut inboxes[0], 0, &tag(k), d)?.then_some(())))?;
                }
            }
            if k + 2 < stages.len() {
                // Stray-write check right before the post (later stages are in flight).
                let t = Instant::now();
                corrupt += poison_check(cfg, probe, &cur, stages[k + 2].clone(), &mut seen, report, &mut dump)?;
                times.overlapped += t.elapsed().as_secs_f64();
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
            crate::sys::trace::trace!("iteration {it}: stage {k} complete");
            if let Some(how) = damage {
                damage_torn(cfg, probe, &cur, layers.clone(), how)?;
            }
            // Stage k's probe passes: decode's conversion on receive, verify, classify, then
            // refill and re-poison for it + 1.
            let t = Instant::now();
            for d in 0..ranks {
                let pool = &mut probe.rank_mut(d).pool;
                if sides.converts() {
                    convert_received(&sides, pool, layers.clone())?;
                }
                pool.verify_layers(layers.clone())?;
                let fails = pool.take_failures()?;
                let done = pool.take_compared();
                compared[d as usize].slices += done.slices;
                compared[d as usize].bytes += done.bytes;
                if late_write == Some(LateWrite::Classify(it)) && k == 0 && d == 0 {
                    // Test-only: the right data lands after the verify judged these slices.
                    for f in &fails {
                        let c = g.coord_of(f.slice);
                        let due = pool.shape().slice(cur.dst_table[c.block as usize].identity(c));
                        pool.write_slice(c, &fingerprint::expected(cfg.seed, &due))?;
                    }
                }
                for f in &fails {
                    let c = g.coord_of(f.slice);
                    let expected = cur.dst_table[c.block as usize].identity(c);
                    // Classified: the bytes the verify pass judged (its snapshot on DRAM).
                    // Then the slice is read again: bytes that changed after the verdict make
                    // it `late`, the judged bytes' class kept in `judged_class`.
                    let kept = pool.judged_slice(c, f.slice, &mut buf)?;
                    let due = pool.shape().slice(expected);
                    let want = fingerprint::expected(cfg.seed, &due);
                    // Not kept (VRAM): the record describes the bytes read again.
                    let f = &if kept { *f } else { crate::mem::pool::RawFailure::recount(f.slice, &buf, &want) };
                    let judged = verify::classify_against(&buf, &want, &due, cfg.seed, f.slice, it);
                    pool.read_slice(c, &mut now)?;
                    let (v, judged_class) = if now != buf {
                        let j = judged.class;
                        (verify::Verdict { class: Class::Late, ..judged }, Some(j))
                    } else {
                        (judged, None)
                    };
                    let as_predicted =
                        crate::core::inject::matches_prediction(cur.predicted.get(&(d, c)), v.class, cfg.seed, &buf);
                    seen.insert((d, c), (v.class, as_predicted));
                    if !as_predicted {
                        report.summary.unexpected_failures += 1;
                    }
                    corrupt += 1;
                    let class = v.class;
                    // A converting run's dump keeps what NIXL delivered beside the converted bytes.
                    let received = (dump.is_some() && sides.converts()).then(|| {
                        let mut r = vec![0u8; buf.len()];
                        sides.unconvert(&buf, &mut r);
                        r
                    });
                    let mut tally = Tally::new(cfg.max_failures);
                    tally.record(report, dump.as_deref_mut(), Budget::Shared, class, &buf, received.as_deref(), || {
                        let mut rec = Failure::new(it, c, f, v, &want, &buf, expected, cur.src_of[c.block as usize]);
                        rec.tp_rank = (ranks > 1).then_some(d);
                        rec.judged_class = judged_class;
                        rec.injected = as_predicted;
                        rec
                    });
                }
            }
            let verify_s = t.elapsed().as_secs_f64();
            verify_all += verify_s;
            // WRITE: prefill's request must be complete before its source is refilled (and a
            // deferred one, of the test-only fault, is posted now and waited for).
            match staged {
                Staged::Written { mut request, bytes: planned, .. } => {
                    if written.is_none() {
                        wait(it, k, "transfer", || probe.poll(0, &mut request))?;
                    }
                    // Decode's own count: prefill's `written` report of its bytes is not
                    // what the rate rests on.
                    bytes += planned;
                }
                Staged::Deferred { pairs, .. } => {
                    let late = format!("{}:late", tag(k));
                    let mut p = probe.post(cfg.op, it, k, (0, 0, 0), &pairs, &late, timeout)?;
                    wait(it, k, "transfer", || probe.poll(0, &mut p))?;
                    bytes += pairs.iter().map(|p| p.len).sum::<u64>();
                }
                _ => {}
            }
            let t = Instant::now();
            let mut fill_s = 0.0; // the last iteration refills nothing
            if let Some(n) = &next {
                probe.fill_source(n, Some(k))?;
                fill_s = t.elapsed().as_secs_f64();
            }
            if late_write == Some(LateWrite::Repoison(it)) && k == 0 {
                // Test-only: a write after the verdict, into a slice that verified clean.
                let c = SliceCoord { layer: layers.start, kv: g.parts()[0], block: 0 };
                let other = cur.dst_table[1 % cur.dst_table.len()].identity(c);
                let pool = &mut probe.rank_mut(0).pool;
                let bytes = fingerprint::expected(cfg.seed, &pool.shape().slice(other));
                pool.write_slice(c, &bytes)?;
            }
            let t = Instant::now();
            if more {
                // Before the re-poison, whatever the stage count: each slice must still hold
                // what its verify judged (a slice that verified clean, its fingerprint; one
                // already failing is not judged again). One that changed took a write after
                // the verdict (a late or stray write): class `stray`, check `reverify`.
                for d in 0..ranks {
                    // Slices already recorded corrupt in this iteration are not judged again.
                    let before = |slice: u32| seen.contains_key(&(d, g.coord_of(slice)));
                    let fails = probe.rank_mut(d).pool.verify_layers_then_poison(layers.clone(), it + 1, &before)?;
                    report.summary.stray_reverified_slices += probe.rank_mut(d).pool.take_compared().slices;
                    corrupt += record_strays(cfg, probe, d, &cur, &fails, StrayCheck::Reverify, &mut seen, report, &mut dump)?;
                }
            }
            let mut poison_s = t.elapsed().as_secs_f64();
            if last {
                // Outside the window: the last stage's passes, waited for.
                let t = Instant::now();
                probe.finish_source()?;
                for d in 0..ranks {
                    probe.rank_mut(d).pool.finish()?;
                }
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
        let fill_kernels = probe.prefill.take_fill_kernel_seconds();
        let (mut poison_k, mut verify_k) = (0.0, 0.0);
        for d in 0..ranks {
            let kd = probe.rank_mut(d).pool.take_kernel_seconds();
            poison_k += kd.poison;
            verify_k += kd.verify;
        }
        times.kernels = crate::report::KernelSeconds { fill: fill_kernels, poison: poison_k, verify: verify_k };
        report.summary.bytes_transferred += bytes;
        report.summary.blocks_checked += total;
        // What the verdict rests on is what the verify passes compared: every slice of every
        // rank, every byte, or the run is an internal error (exit 3).
        for (d, done) in compared.iter().enumerate() {
            check_compared(it, d as u32, *done, g.total_slices()?, sb as u64)?;
            report.summary.slices_compared += done.slices;
            report.summary.bytes_compared += done.bytes;
        }
        if !more {
            // The last iteration re-poisons nothing: verify every stage again now that nothing
            // is in flight (earlier stages were verified while later ones were in flight, the
            // last one may take a late write after its verify). A slice that changed after it
            // verified clean took a stray or late write.
            let t = Instant::now();
            for d in 0..ranks {
                let pool = &mut probe.rank_mut(d).pool;
                pool.verify_layers(all.clone())?;
                let fails = pool.take_failures()?;
                report.summary.stray_reverified_slices += pool.take_compared().slices;
                corrupt += record_strays(cfg, probe, d, &cur, &fails, StrayCheck::Reverify, &mut seen, report, &mut dump)?;
            }
            report.summary.stray_check_seconds += t.elapsed().as_secs_f64();
        }
        // (Each corrupt slice was counted into the summary by the tally as it was found.)
        if it == 1 {
            let mut p = match cfg.op {
                // Replaced by prefill's own table when its report part arrives ([`run`]).
                Op::Write => crate::xfer::ucx::TransportPath {
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
        for (((a, hits), &l), &torn_bytes) in cur.actions.iter().zip(&cur.hits).zip(&cur.action_links).zip(&cur.torn_bytes) {
            // Detected as predicted: every slice it reaches found with its class and exactly
            // the predicted bytes.
            // An injection that reached no slice is not detected (`all` of nothing is true).
            let detected = crate::core::inject::detected_as_predicted(
                hits.iter().map(|(r, c, class)| seen.get(&(*r, *c)) == Some(&(*class, true))),
            );
            let tp_rank = |r: u32| (ranks > 1).then_some(r);
            let hits: Vec<PredictedHit> = hits
                .iter()
                .map(|&(r, d, class)| {
                    let pred = cur.predicted.get(&(r, d));
                    PredictedHit {
                        layer: d.layer,
                        kv: d.kv,
                        block: d.block,
                        class,
                        tp_rank: tp_rank(r),
                        digest: pred.map(|x| x.digest(cfg.seed)),
                        written: pred.and_then(|x| x.written()),
                    }
                })
                .collect();
            let link =
                (!tp.is_single()).then(|| crate::report::TpLink { prefill_rank: cur.links[l].0, decode_rank: cur.links[l].1 });
            report.summary.injections_planted += 1;
            report.summary.injections_detected += detected as u64;
            report.injections.push(InjectionRecord {
                iteration: it,
                kind: a.kind(),
                predicted: hits,
                detected,
                link,
                torn_bytes,
            });
        }
        report.summary.iterations = it;
        times.corrupt = corrupt;
        times.unexpected = report.summary.unexpected_failures - unexpected_before;
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
        s.verify_gbps = pool_bytes as f64 * ranks as f64 * it as f64 / verify_all.max(1e-9) / 1e9;
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
        probe.prefill.verified(
            it,
            total,
            corrupt,
            if times.transfer > 0.0 { bytes as f64 / times.transfer / 1e9 } else { 0.0 },
        )?;
        if let Some(n) = next {
            cur = n;
        }
        crate::report::publish(report);
    }
    Ok(())
}
