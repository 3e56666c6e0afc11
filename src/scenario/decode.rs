//! The decode engine of a scenario, and the loop that couples it to the prefill engine
//! ([`super::prefill`]) one step at a time over the peer protocol ([`crate::peer::steps`]):
//! prefill is a thread of this process, a child, or `kvprobe serve` on another host, and the
//! code here is the same for all three.
//!
//! # The model
//! Time advances in engine steps. In step k, prefill runs its step first (what decode did in
//! step k − 1 is its input: READs posted, requests finished), then decode runs its own with
//! what prefill did (its shadow events, the requests it handed over):
//! 1. decode polls its posted READs; each that completed closes its windows in the shadow;
//! 2. decode's tier loads that are due run (tier-only: decode loads the entries prefill saved);
//! 3. a request handed over is scheduled a seeded 0–2 steps later: decode allocates blocks,
//!    poisons them, and posts **one NIXL READ** of every block slice of the request
//!    (NixlConnector's flow), or queues the tier loads (tier-only); `--lockstep` completes
//!    the step's READs within the step, and prefill takes their notifications first thing in
//!    its next step, so the whole run, corrupt counts included, follows from the seed;
//! 4. decode verifies every slice of each request whose READ (or tier load) completed, in
//!    one pass, against the logical block prefill promised, frees its blocks and tells prefill.
//!
//! NIXL transfers are real and asynchronous and overlap all of this (unless `--lockstep`), so
//! when a READ completes — and with it what prefill frees next — varies from run to run.
//!
//! Push mode (`--op write`): in 3. decode asks prefill to WRITE the request into the blocks
//! it allocated ([`crate::peer::steps::Push`]); prefill's WRITE lands within a later prefill
//! step ([`What::Pushed`]), decode waits for its notification, lets the request decode a
//! seeded 2–8 steps and then verifies it in 4., so a late WRITE into its blocks meanwhile is
//! found; a request whose WRITE has not landed `--lease` steps after decode asked is aborted
//! (decode-abort-free). Decode keeps its own record of what landed in each of its blocks.
//! With `--fail-rate` a READ may leave some blocks unmoved (failed-as-complete); with
//! `--inject` decode plants faults on its READ descriptors and learns those prefill planted
//! in the source at the hand-over.
//!
//! # Attribution
//! Every write into a prefill block reaches decode's shadow as an event of prefill's step,
//! stamped with the unfenced mechanism that allowed it, if one did; decode's READ posts and
//! completions are events of decode's. Prefill's events of step k precede decode's of step k
//! and follow decode's of step k − 1, so a READ's window holds exactly the writes made
//! between its post and the step decode saw it complete, on one host or across two. A
//! corrupt slice at decode is *explained* only when every 4-byte element of it is what one of
//! the contents its block held during the READ window put there ([`attribute`]), and is then
//! attributed to the stamped mechanism. Anything else — poison, a flipped bit, garbage, an
//! identity never written in the window — is a defect of the stack under test (exit 1), as is
//! any corruption in a fenced run.
//!
//! Test-only: `KVPROBE_TEST_FAULT` plants damage no race can produce ([`TestFault`]).

use super::config::{Progress, ScenarioConfig};
use super::connectors::nixl::NixlConnector;
use super::connectors::tier::TierReader;
use super::fault::TestFault;
use super::scheduler::{DecodeBlocks, Planted, Pull, PullState};
use super::shadow::{Answer, Content, EngineId, Event, Shadow, What, attribute, ident};
use super::state::StateLane;
use crate::core::fingerprint::{self, SKIP_GEN};
use crate::core::geometry::SliceCoord;
use crate::core::mechanism::{Mechanism, Races};
use crate::core::verify;
use crate::error::{Error, Result};
use crate::mem::pool::TableEntry;
use crate::mem::tier::TierArena;
use crate::peer::client::PrefillPeer;
use crate::peer::steps::{Begin, Handed, PrefillCounters, StepIn, StepOut};
use crate::report::{Budget, Failure, Interval, Report, ScenarioReport, Tally};
use crate::xfer::transport::Endpoint;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What a scenario run needs besides its configuration: the prefill side, decode's endpoint
/// and the bounds and outputs of the run.
pub struct Sides<'a> {
    /// The prefill side, over the peer protocol.
    pub prefill: &'a PrefillPeer,
    /// Decode's endpoint (its NIXL agent and pool), connected to prefill's.
    pub decode: &'a mut Endpoint,
    /// The embedded tier's arena when prefill is a thread of this process (tier-only loads
    /// copy from it directly).
    pub arena: Option<Arc<TierArena>>,
    /// A hybrid model's state lanes ([`super::state`]), each with decode's pool and NIXL
    /// agent (empty for an attention-only model); connected to prefill's agents at the begin.
    pub lanes: Vec<(StateLane, Endpoint)>,
}

/// Runs scenario run `row` (a `kvprobe ab` row, or 0) of `cfg` with `seed` on `sides`. Fills
/// `report` (summary, failures, scenario section) as it goes; `progress` is called about
/// every 100 ms and `checkpoint` about every `checkpoint` seconds with the report so far.
///
/// Errors: transport (exit 3: NIXL, the tier, prefill gone or out of protocol), timeout
/// (exit 4: a READ, a step's answer, or no request progressing within `timeout`), device
/// (exit 3), interrupted (130), usage (exit 2) when nothing was verified.
#[allow(clippy::too_many_arguments)]
pub fn run_scenario(
    cfg: &ScenarioConfig,
    seed: u64,
    row: u32,
    sides: Sides<'_>,
    timeout: Duration,
    max_failures: usize,
    report: &mut Report,
    progress: &mut dyn FnMut(&Progress),
    checkpoint: (f64, &mut dyn FnMut(&Report)),
    dump: Option<&mut crate::report::dump::Dumper>,
) -> Result<()> {
    let nixl = NixlConnector::new();
    crate::sys::progress::announce(&match (cfg.scenario.uses_tier(), cfg.tier) {
        (false, _) => "setup: prefill fills its pool".to_string(),
        (true, crate::mem::tier::TierKind::Mooncake) => {
            "setup: prefill starts the Mooncake store (master, store client) and fills its pool".into()
        }
        (true, crate::mem::tier::TierKind::Embedded) => {
            format!("setup: the tier ({} blocks), prefill fills its pool", cfg.tier_blocks)
        }
    });
    let begin = Begin {
        row,
        scenario: cfg.scenario,
        unfenced: cfg.unfenced.clone(),
        tag: nixl.tag().to_string(),
        push: cfg.push,
        staging: cfg.staging,
    };
    let t = Instant::now();
    let mut sides = sides;
    let infos = sides.lanes.iter().map(|(_, e)| e.info()).collect::<Result<Vec<_>>>()?;
    let (access, detail, lanes) = sides.prefill.begin(begin, infos)?;
    for ((lane, ep), info) in sides.lanes.iter_mut().zip(lanes) {
        if info.geometry.as_ref().is_some_and(|g| *g != lane.geometry) {
            return Err(Error::Transport(format!(
                "prefill's NIXL agent {} announced a pool other than state lane {}'s (a protocol error)",
                crate::sys::text::escape_control(&info.agent),
                lane.name
            )));
        }
        ep.connect(info)?;
    }
    report.summary.setup_seconds += t.elapsed().as_secs_f64();
    let tier = match (cfg.scenario.uses_nixl(), access) {
        (false, Some(a)) => Some(
            TierReader::start(&a, sides.arena.clone(), &sides.decode.pool, timeout, sides.prefill.ended())
                .map_err(|e| sides.prefill.cause_of(e))?,
        ),
        (false, None) => {
            return Err(Error::Transport("prefill started a tier-only run without a tier (a protocol error)".into()));
        }
        (true, _) => None,
    };
    let detail = match &tier {
        Some(TierReader::Mooncake { .. }) => format!("{detail}; decode's own store client (no segment) gets the entries"),
        _ => detail,
    };
    let mut e = Decode::new(cfg, seed, row, sides, nixl, tier, detail, timeout, max_failures);
    e.dump = dump;
    let mut r = e.run(report, progress, checkpoint);
    e.finish(report);
    let compared = e.ep.pool.take_compared();
    report.summary.slices_compared += compared.slices;
    report.summary.bytes_compared += compared.bytes;
    if r.is_ok() {
        let line = match &report.scenario {
            Some(s) => {
                // The verdict decode's own table shows: each unfenced mechanism's, else clean or corrupt.
                let verdicts: Vec<String> = s
                    .races
                    .iter()
                    .filter(|o| cfg.unfenced.contains(&o.mechanism))
                    .map(|o| format!("{} {}", o.mechanism, o.verdict))
                    .collect();
                let verdict = match (verdicts.is_empty(), report.summary.blocks_corrupt) {
                    (true, 0) => "clean".to_string(),
                    (true, _) => "corrupt".to_string(),
                    (false, _) => verdicts.join(", "),
                };
                format!("{verdict}: {} requests verified, {} corrupt", s.requests_verified, report.summary.blocks_corrupt)
            }
            None => String::new(),
        };
        match e.prefill.end(row, &line).and_then(|c| e.check_counters(&c, true).map(|_| c)) {
            Ok(c) => {
                e.counters = c;
                e.finish(report);
            }
            Err(x) => r = Err(x),
        }
    }
    if r.is_ok() && report.summary.blocks_checked == 0 {
        r = Err(Error::Usage(format!(
            "nothing was verified: {} admitted, {} aborted, none reached decode (raise --requests or --duration, lower --abort-rate)",
            crate::sys::units::plural(e.counters.admitted, "request"),
            e.counters.aborted
        )));
    }
    r
}

/// What a decode block held when its request was verified: the expected table entry of its
/// slices, and where the verdict came from (for the failure record of a write after it).
#[derive(Clone, Copy, Debug)]
struct Held {
    /// The table entry the block's slices verified against.
    entry: TableEntry,
    /// The request verified.
    req: u64,
    /// The request's pull poison iteration (its step mod 2^24).
    poison_iter: u32,
    /// The prefill block the request moved into it.
    pslot: u32,
    /// Push mode: how many writes had landed in the block by the verify (`dland`'s length);
    /// those after it came after the verdict.
    landed: usize,
}

/// A tier load on decode's load stream (tier-only).
#[derive(Clone, Copy, Debug)]
struct Load {
    due: u64,
    req: u64,
    index: usize,
}

/// The decode engine of one scenario run.
struct Decode<'a> {
    cfg: ScenarioConfig,
    races: Races,
    seed: u64,
    row: u32,
    prefill: &'a PrefillPeer,
    ep: &'a mut Endpoint,
    timeout: Duration,
    max_failures: usize,
    /// `--dump`: where failing slices go ([`crate::report::dump`]).
    dump: Option<&'a mut crate::report::dump::Dumper>,
    /// tier-only: how decode loads the entries prefill saved.
    tier: Option<TierReader>,
    /// The tier in words (from prefill).
    tier_detail: String,
    /// Which notification is which request's (prefill learns the prefix from `Begin`).
    nixl: NixlConnector,
    /// What every prefill block holds, and the attribution counts.
    shadow: Shadow,
    rng: ChaCha8Rng,
    /// Draws which transfers fail (`--fail-rate`), apart from `rng` so that the other draws
    /// of a seed stay what they were.
    fail_rng: ChaCha8Rng,
    /// Transfers in which some blocks failed (`--fail-rate`).
    transfers_failed: u64,
    /// `--inject` faults still to plant, in order (one per request's READ), and the draws
    /// of where.
    to_plant: VecDeque<crate::core::inject::Kind>,
    inject_rng: ChaCha8Rng,
    /// Push mode: what landed in each decode block since it was last allocated, with the
    /// step (a WRITE of its request, or a late one of an aborted request's).
    dland: Vec<Vec<(u64, Content)>>,
    /// Push mode: which request each decode block is allocated to.
    downer: Vec<Option<u64>>,
    /// What each decode block held when its request was verified, until the block is
    /// allocated again (re-verified right before its re-poison) or the run ends (re-verified
    /// then): a write after the verdict must not be overwritten unseen.
    held: Vec<Option<Held>>,
    /// Slices of blocks in `held` that the verify already found corrupt (not judged again).
    judged_corrupt: std::collections::HashSet<SliceCoord>,
    /// Push mode: requests decode aborted and freed before their WRITE landed (unfenced
    /// decode-abort-free), with the decode blocks the WRITE still targets.
    orphans: HashMap<u64, Vec<u32>>,
    /// Push mode: requests whose WRITE notification arrived.
    arrived: std::collections::HashSet<u64>,
    /// Push mode: requests decode aborted (their data did not arrive within `--lease` steps).
    daborted: u64,
    /// Push mode: draws of how long each request decodes.
    push_rng: ChaCha8Rng,
    now: u64,
    /// Decode's free blocks.
    dblocks: DecodeBlocks,
    pulls: HashMap<u64, Pull>,
    order: Vec<u64>,
    loads: VecDeque<Load>,
    /// Prefill's counts, as of its last step.
    counters: PrefillCounters,
    /// Tier loads decode ran.
    dloads: u64,
    verified: u64,
    intervals: Vec<Interval>,
    started: Instant,
    last_progress: Instant,
    busy_secs: f64,
    /// The failure tally: explained and unexplained slices listed on budgets of their own.
    tally: Tally,
    poison_secs: f64,
    /// Test-only fault (`KVPROBE_TEST_FAULT`) and how many are left to plant.
    fault: Option<(TestFault, u64)>,
    /// Decode's events told to the shadow so far.
    seq: u64,
    /// What decode did in this step, for prefill's next.
    next: StepIn,
    /// Decode told prefill to stop admitting (`--duration` passed).
    stop_sent: bool,
    /// Requests verified (a hand-over of one again is a protocol error).
    done_ids: std::collections::HashSet<u64>,
    /// Block-ownership violations prefill reported, and the first of them.
    violation_count: u64,
    violations: Vec<crate::report::OwnershipViolation>,
    /// A hybrid model's state lanes (decode's pool and agent of each), their free slots and
    /// their report entries.
    state: Vec<(StateLane, Endpoint)>,
    state_free: Vec<u32>,
    state_reports: Vec<crate::report::RegionReport>,
    /// Push mode: state WRITE notifications that arrived, per request (one per lane).
    state_arrived: HashMap<u64, u32>,
    /// Push mode, unfenced decode-abort-free: the state slots of requests decode aborted
    /// before their WRITE landed, held until it has (a state slot is never a race's).
    state_orphans: HashMap<u64, u32>,
}

impl<'a> Decode<'a> {
    #[allow(clippy::too_many_arguments)]
    fn new(
        cfg: &ScenarioConfig,
        seed: u64,
        row: u32,
        sides: Sides<'a>,
        nixl: NixlConnector,
        tier: Option<TierReader>,
        tier_detail: String,
        timeout: Duration,
        max_failures: usize,
    ) -> Decode<'a> {
        let n = sides.decode.pool.geometry().num_blocks;
        let state_free = sides.lanes.first().map_or_else(Vec::new, |(l, _)| (0..l.slots).rev().collect());
        let state_reports = sides.lanes.iter().map(|(l, _)| l.report()).collect();
        // Genesis: every prefill block holds a fingerprint no request asks for (prefill's
        // first fill, `PrefillEngine::start`).
        let genesis: Vec<TableEntry> = (0..n).map(|i| TableEntry::new(fingerprint::logical_block(seed, i), 0)).collect();
        Decode {
            cfg: cfg.clone(),
            races: cfg.races(),
            seed,
            row,
            prefill: sides.prefill,
            ep: sides.decode,
            timeout,
            max_failures,
            dump: None,
            tier,
            tier_detail,
            nixl,
            shadow: Shadow::new(&genesis, cfg.races()),
            rng: ChaCha8Rng::seed_from_u64(seed ^ 0x6465_636F_6465),
            fail_rng: ChaCha8Rng::seed_from_u64(seed ^ 0x6661_696C_6564),
            transfers_failed: 0,
            // Decode plants the faults of the READ descriptors; prefill those of the source.
            to_plant: cfg
                .inject
                .iter()
                .filter(|s| {
                    matches!(
                        s.kind,
                        crate::core::inject::Kind::Drop | crate::core::inject::Kind::Misroute | crate::core::inject::Kind::Torn
                    )
                })
                .flat_map(|s| std::iter::repeat_n(s.kind, s.count as usize))
                .collect(),
            inject_rng: ChaCha8Rng::seed_from_u64(seed ^ 0x696E_6A65_6374),
            dland: vec![Vec::new(); n as usize],
            downer: vec![None; n as usize],
            held: vec![None; n as usize],
            judged_corrupt: std::collections::HashSet::new(),
            orphans: HashMap::new(),
            arrived: std::collections::HashSet::new(),
            daborted: 0,
            push_rng: ChaCha8Rng::seed_from_u64(seed ^ 0x7075_7368),
            now: 0,
            dblocks: DecodeBlocks::new(n),
            pulls: HashMap::new(),
            order: Vec::new(),
            loads: VecDeque::new(),
            counters: PrefillCounters::default(),
            dloads: 0,
            verified: 0,
            intervals: Vec::new(),
            started: Instant::now(),
            last_progress: Instant::now(),
            busy_secs: 0.0,
            tally: Tally::new(max_failures),
            poison_secs: 0.0,
            fault: None,
            seq: 0,
            next: StepIn { admit: true, ..Default::default() },
            stop_sent: false,
            done_ids: std::collections::HashSet::new(),
            violation_count: 0,
            violations: Vec::new(),
            state: sides.lanes,
            state_free,
            state_reports,
            state_arrived: HashMap::new(),
            state_orphans: HashMap::new(),
        }
    }

    fn run(
        &mut self,
        report: &mut Report,
        progress: &mut dyn FnMut(&Progress),
        checkpoint: (f64, &mut dyn FnMut(&Report)),
    ) -> Result<()> {
        self.fault = TestFault::from_env()?;
        let (every, save) = checkpoint;
        self.started = Instant::now();
        let mut last_ckpt = Instant::now();
        let mut last_change = Instant::now();
        let mut last_seen = (0u64, 0u64, 0u64);
        self.intervals.push(Interval::default());
        self.finish(report);
        crate::report::publish(report);
        loop {
            if crate::sys::interrupt::requested() {
                return Err(Error::Interrupted(format!("after {} verified requests", self.verified)));
            }
            if let Some(d) = self.cfg.duration_secs
                && self.started.elapsed().as_secs_f64() >= d
            {
                self.next.admit = false;
            }
            let t = Instant::now();
            let busy = self.pulls.values().any(|p| p.xfer.is_some());
            self.now += 1;
            let admit = self.next.admit;
            self.stop_sent |= !admit;
            let input = std::mem::replace(&mut self.next, StepIn { admit, ..Default::default() });
            let asked = Instant::now();
            let out = self.prefill.step(self.row, self.now, input)?;
            let prefill_step = (asked.elapsed().as_secs_f64(), out.notify_query_secs);
            let drained = out.drained;
            self.apply(out)?;
            if drained {
                let c = &self.counters;
                if !self.pulls.is_empty()
                    || !self.orphans.is_empty()
                    || !c.stopped
                    || self.verified + self.daborted + c.aborted != c.admitted
                {
                    return Err(Error::Transport(format!(
                        "prefill says it has drained with admission {} and {} admitted, {} aborted, while decode verified {} \
                         and still holds {} (a protocol error)",
                        if c.stopped { "stopped" } else { "going on" },
                        c.admitted,
                        c.aborted,
                        self.verified,
                        self.pulls.len()
                    )));
                }
                break;
            }
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
            let c = &self.counters;
            let seen = (self.verified + self.daborted + c.aborted, c.saves + c.loads + self.dloads, c.admitted);
            if seen != last_seen {
                last_seen = seen;
                last_change = Instant::now();
            } else if last_change.elapsed() > self.timeout {
                // A prefill step that alone outlasted the bound is what held the run.
                let (took, queries) = prefill_step;
                let held = if took > self.timeout.as_secs_f64() {
                    format!(
                        "; prefill's step {} took {took:.3} s, {queries:.3} s of it inside NIXL notification query calls",
                        self.now
                    )
                } else {
                    String::new()
                };
                return Err(Error::Timeout(format!(
                    "no request progressed for {:.3} s ({} in flight at decode at step {}{held})",
                    self.timeout.as_secs_f64(),
                    self.pulls.len(),
                    self.now
                )));
            }
            if self.last_progress.elapsed() >= Duration::from_millis(100) {
                self.last_progress = Instant::now();
                progress(&self.progress(report));
                // What a call blocked past its deadline would still report.
                self.finish(report);
                crate::report::publish(report);
            }
            if every > 0.0 && last_ckpt.elapsed().as_secs_f64() >= every {
                last_ckpt = Instant::now();
                self.finish(report);
                save(report);
            }
        }
        // Nothing is in flight any more: every block still holding a verified request's data
        // is judged again (a write after the last verdict shows now or never).
        let all: Vec<u32> = (0..self.held.len() as u32).collect();
        self.reverify_held(&all, report)?;
        self.finish(report);
        progress(&self.progress(report));
        let asked: u64 = self.cfg.inject.iter().map(|s| s.count as u64).sum();
        let left = asked
            .saturating_sub(report.summary.injections_planted + self.pulls.values().map(|p| p.planted.len() as u64).sum::<u64>());
        if left > 0 {
            eprintln!(
                "inject: {left} fault(s) not planted: the run had too few requests (one in four carries one; raise --requests)"
            );
        }
        Ok(())
    }

    fn progress(&self, report: &Report) -> Progress {
        Progress {
            elapsed: self.started.elapsed().as_secs_f64(),
            requests: self.verified,
            target_requests: self.cfg.duration_secs.is_none().then_some(self.cfg.requests),
            target_secs: self.cfg.duration_secs,
            bytes: report.summary.bytes_transferred,
            corrupt: report.summary.blocks_corrupt,
            draining: self.counters.stopped,
        }
    }

    /// Takes in what prefill did in this step: its events go to the shadow (in order), the
    /// requests it handed over are scheduled. Errors: transport (exit 3) for an event out of
    /// sequence or a hand-over decode cannot use (a protocol error).
    fn apply(&mut self, out: StepOut) -> Result<()> {
        for e in out.events {
            if e.engine != EngineId::Prefill || e.step != self.now {
                return Err(Error::Transport(format!(
                    "prefill sent an event of {:?} step {} in its step {} (a protocol error)",
                    e.engine, e.step, self.now
                )));
            }
            let pushed = match &e.what {
                What::Pushed { req, dst, .. } => Some((*req, dst.clone())),
                _ => None,
            };
            let answer = self.shadow.observe(e)?;
            if let (Some((req, dst)), Answer::AtPost(contents)) = (pushed, answer) {
                self.landed(req, &dst, contents)?;
            }
        }
        let n = self.ep.pool.geometry().num_blocks;
        for v in out.violations {
            self.record_violation(v);
        }
        for h in out.handed {
            self.check_handed(&h, n)?;
            // Decode pulls 0-2 steps later; one request in eight waits --decode-delay steps
            // more (a decode instance busy with others).
            let slow = self.rng.random_range(0..8u32) == 0;
            let delay = if slow { self.cfg.decode_delay_steps as u64 } else { 0 };
            let ready_at = self.now + self.rng.random_range(0..=2) + delay;
            self.order.push(h.req);
            self.pulls.insert(
                h.req,
                Pull {
                    stage: PullState::Waiting,
                    ready_at,
                    pslots: h.blocks,
                    promised: h.promised,
                    tier: h.tier,
                    dslots: Vec::new(),
                    xfer: None,
                    at_post: Vec::new(),
                    during: Vec::new(),
                    delivered: Vec::new(),
                    dloads_left: 0,
                    poison_iter: 0,
                    failed: Vec::new(),
                    retrying: false,
                    unwritten: Vec::new(),
                    planted: Vec::new(),
                    source_faults: h.planted,
                    asked_at: 0,
                    landed_at: None,
                    decode_until: None,
                    aborting: false,
                    pstate: h.state_slot,
                    dstate: None,
                    state_xfers: Vec::new(),
                },
            );
        }
        self.check_counters(&out.counters, false)?;
        self.counters = out.counters;
        if self.pulls.len() > self.cfg.concurrency as usize {
            return Err(Error::Transport(format!(
                "prefill handed over more requests than --concurrency {} lets be in flight (a protocol error)",
                self.cfg.concurrency
            )));
        }
        Ok(())
    }

    /// Prefill's counts `c` (after a step, or its final ones with `last`) are ones a prefill
    /// engine of this run can report: its step is decode's, no count goes back, admission stays
    /// within `--requests` and stops only as the run says. Errors: transport (exit 3), naming
    /// what does not hold (a protocol error).
    fn check_counters(&self, c: &PrefillCounters, last: bool) -> Result<()> {
        let p = &self.counters;
        let dur = self.cfg.duration_secs.is_some();
        let bad = if c.steps != self.now {
            Some(format!("step {} in decode's step {}", c.steps, self.now))
        } else if c.aborted < p.aborted
            || c.hit_blocks < p.hit_blocks
            || c.saves < p.saves
            || c.loads < p.loads
            || c.evictions < p.evictions
            || !(c.fill_seconds.is_finite() && c.fill_seconds >= p.fill_seconds)
            || (p.stopped && !c.stopped)
        {
            Some("counts that went back".to_string())
        } else if c.aborted > c.admitted || (!dur && c.admitted > self.cfg.requests) {
            Some(format!("{} admitted and {} aborted, with --requests {}", c.admitted, c.aborted, self.cfg.requests))
        } else if c.admitted < p.admitted && !(dur && c.stopped) {
            Some(format!("{} admitted after {}", c.admitted, p.admitted))
        } else if c.stopped && (if dur { !self.stop_sent } else { c.admitted != self.cfg.requests }) {
            Some("admission stopped before the run said so".to_string())
        } else if last && (!c.stopped || self.verified + self.daborted + c.aborted != c.admitted) {
            Some(format!(
                "final counts of {} admitted and {} aborted, with {} verified and {} aborted at decode",
                c.admitted, c.aborted, self.verified, self.daborted
            ))
        } else {
            None
        };
        match bad {
            Some(w) => Err(Error::Transport(format!("prefill reported {w} (a protocol error)"))),
            None => Ok(()),
        }
    }

    /// A hand-over decode can act on: a new request, 1 to half the pool's blocks (a prompt
    /// fits twice in a pool), each a block of the pool with a computed identity, and one tier
    /// entry per block exactly when the scenario loads from the tier.
    fn check_handed(&self, h: &Handed, n: u32) -> Result<()> {
        let k = h.blocks.len();
        let tier_want = if self.cfg.scenario.uses_nixl() { 0 } else { k };
        let bad = if self.pulls.contains_key(&h.req) || self.done_ids.contains(&h.req) {
            Some("a request decode already holds or verified".to_string())
        } else if k == 0 || k > (n / 2).max(1) as usize || h.promised.len() != k || h.tier.len() != tier_want {
            Some(format!("{k} blocks, {} identities and {} tier entries", h.promised.len(), h.tier.len()))
        } else if let Some(b) = h.blocks.iter().find(|&&b| b >= n) {
            Some(format!("block {b} of a pool of {n}"))
        } else if h.state_slot.is_some() == self.state.is_empty()
            || h.state_slot.zip(self.state.first()).is_some_and(|(s, (l, _))| s >= l.slots)
        {
            Some(format!(
                "state slot {:?} ({} state lane(s) of {} slots)",
                h.state_slot,
                self.state.len(),
                self.state.first().map_or(0, |(l, _)| l.slots)
            ))
        } else if let Some(f) = h.planted.iter().find(|f| {
            let g = self.ep.pool.geometry();
            f.index as usize >= k
                || f.layer >= g.num_layers
                || !g.parts().contains(&f.kv)
                || !self.cfg.inject.iter().any(|s| s.kind == f.kind)
                || !matches!(f.kind, crate::core::inject::Kind::Bitflip | crate::core::inject::Kind::Stale)
                || (f.kind == crate::core::inject::Kind::Bitflip)
                    != f.flip.is_some_and(|(at, bit)| at < g.slice_bytes().unwrap_or(0) && bit < 8)
        }) {
            Some(format!("a planted {} fault it was not asked for or outside the request ({f:?})", f.kind.name()))
        } else {
            h.promised.iter().find(|t| t.generation == SKIP_GEN).map(|_| "a block promised with the skip generation".to_string())
        };
        match bad {
            Some(w) => Err(Error::Transport(format!("prefill handed over request {} with {w} (a protocol error)", h.req))),
            None => Ok(()),
        }
    }

    fn step(&mut self, report: &mut Report) -> Result<()> {
        if self.cfg.push {
            self.advance_pushes()?;
        }
        self.poll_reads(report)?;
        self.run_loads(report)?;
        self.start_decode(report)?;
        self.verify(report)?;
        if self.pulls.values().all(|p| p.xfer.is_none()) {
            std::thread::yield_now();
        }
        Ok(())
    }

    /// Tells the shadow what decode did, stamped with the step and decode's next sequence
    /// number. Errors: as [`Shadow::observe`].
    fn observe(&mut self, what: What) -> Result<Answer> {
        self.seq += 1;
        self.shadow.observe(Event { engine: EngineId::Decode, step: self.now, seq: self.seq, what })
    }

    // ---- NIXL ----

    fn poll_reads(&mut self, report: &mut Report) -> Result<()> {
        for id in self.order.clone() {
            self.poll_state(id)?;
            let Some(p) = self.pulls.get_mut(&id) else { continue };
            let Some(x) = p.xfer.as_mut() else { continue };
            // `poll` ends the run with a timeout past the READ's deadline.
            let done = self.ep.poll(x).map_err(|e| self.prefill.cause_of(e))?;
            if let Some(done) = done {
                report.summary.bytes_transferred += done.bytes;
                self.read_done(id)?;
            }
        }
        Ok(())
    }

    /// Polls request `id`'s state READs (one per lane still in flight); each that completed
    /// counts its bytes in its lane's report. Errors: transport (exit 3), timeout (exit 4) past
    /// the READ's deadline.
    fn poll_state(&mut self, id: u64) -> Result<()> {
        let Some(p) = self.pulls.get_mut(&id) else { return Ok(()) };
        for (k, x) in p.state_xfers.iter_mut().enumerate() {
            let Some(posted) = x.as_mut() else { continue };
            let done = self.state[k].1.poll(posted).map_err(|e| self.prefill.cause_of(e))?;
            if let Some(done) = done {
                self.state_reports[k].bytes_moved += done.bytes;
                self.state_reports[k].seconds += done.elapsed.as_secs_f64();
                *x = None;
            }
        }
        Ok(())
    }

    /// Request `id`'s READ completed: closes its windows on its prefill blocks in the shadow
    /// (what was written into them while it was in flight). When some of its blocks failed
    /// to move (`--fail-rate`), fenced `failed-as-complete` posts a READ of those again (with
    /// the request's notification) and returns true; unfenced, the request is counted
    /// delivered with them unwritten.
    /// Errors: as [`Shadow::observe`], and the retry's post (exit 3 or 4).
    fn read_done(&mut self, id: u64) -> Result<bool> {
        let p = self.pulls.get_mut(&id).expect("a posted request");
        p.xfer = None;
        let moved: Vec<usize> = if p.retrying { p.failed.clone() } else { (0..p.pslots.len()).collect() };
        let blocks = moved.iter().map(|&i| p.pslots[i]).collect();
        let during = match self.observe(What::ReadDone { req: id, blocks })? {
            Answer::During(d) => d,
            a => unreachable!("a READ's end is answered with its windows, not {a:?}"),
        };
        let p = self.pulls.get_mut(&id).expect("live request");
        if p.during.len() != p.pslots.len() {
            p.during = vec![Vec::new(); p.pslots.len()];
        }
        for (&i, d) in moved.iter().zip(during) {
            p.during[i] = d;
        }
        if p.retrying || p.failed.is_empty() {
            p.failed.clear();
            p.retrying = false;
            p.stage = PullState::Verify;
            return Ok(false);
        }
        if self.races.unfenced(Mechanism::FailedAsComplete) {
            p.unwritten = std::mem::take(&mut p.failed);
            p.stage = PullState::Verify;
            self.observe(What::Window { mechanism: Mechanism::FailedAsComplete })?;
            return Ok(false);
        }
        // Fenced: the failed blocks are reported and READ again.
        let (src, dst): (Vec<u32>, Vec<u32>) = p.failed.iter().map(|&i| (p.pslots[i], p.dslots[i])).unzip();
        let g = self.ep.pool.geometry().clone();
        let pairs = NixlConnector::read_pairs(&g, &src, &dst)?;
        let Answer::AtPost(at_post) = self.observe(What::ReadPosted { req: id, blocks: src })? else {
            unreachable!("a READ's post is answered with the blocks' contents")
        };
        let x = self.nixl.post_read(self.ep, &pairs, id, true, self.timeout).map_err(|e| self.prefill.cause_of(e))?;
        let p = self.pulls.get_mut(&id).expect("live request");
        for (&i, c) in p.failed.iter().zip(at_post) {
            p.at_post[i] = c;
        }
        p.retrying = true;
        p.xfer = Some(x);
        self.next.posted.push(id);
        Ok(true)
    }

    /// `--inject` under request load: with faults left to plant, one request's READ in four
    /// (seeded) gets the next, on a seeded slice of its blocks that move (`moved`, indices
    /// into the request's blocks): `drop` leaves the slice's descriptor out, `torn` moves
    /// only a prefix of it (a multiple of 16 bytes), `misroute` sends one block's slice to
    /// another block's decode slot of the same layer and K/V, both own descriptors left out
    /// (the sweep's injections, `crate::core::inject`). Changes `pairs` (from
    /// [`NixlConnector::read_pairs`]) and returns where the fault must show at decode.
    /// Errors: a geometry whose slice size does not fit (usage).
    fn plant(&mut self, pairs: &mut Vec<crate::xfer::transport::Pair>, moved: &[usize], id: u64) -> Result<Option<Planted>> {
        use crate::core::inject::Kind;
        use crate::core::verify::Class;
        let Some(&kind) = self.to_plant.front() else { return Ok(None) };
        if self.inject_rng.random_range(0..4u32) != 0 || moved.is_empty() || kind == Kind::Misroute && moved.len() < 2 {
            return Ok(None);
        }
        self.to_plant.pop_front();
        let g = self.ep.pool.geometry().clone();
        let sb = g.slice_bytes()?;
        let p = &self.pulls[&id];
        let layer = self.inject_rng.random_range(0..g.num_layers);
        let kv = g.parts()[self.inject_rng.random_range(0..g.parts().len())];
        let pick = |rng: &mut ChaCha8Rng| moved[rng.random_range(0..moved.len())];
        let i = pick(&mut self.inject_rng);
        let at = |i: usize| SliceCoord { layer, kv, block: p.pslots[i] };
        let dst = |i: usize| SliceCoord { layer, kv, block: p.dslots[i] };
        let k = pairs.iter().position(|x| x.src == at(i)).expect("a moved block has its descriptors");
        // What decode slice `d` must hold: its poison, then (`from`: the request block index,
        // and the pair moving it) the source block's promised rows as the pair moves them.
        let shape = *self.ep.pool.shape();
        let predict =
            |class: Class, d: SliceCoord, from: Option<(usize, crate::xfer::transport::Pair)>| crate::core::inject::Prediction {
                class,
                slice_bytes: sb,
                under: crate::core::inject::Under::Poison { slot: g.global_slice(d), iteration: p.poison_iter },
                landed: from
                    .map(|(j, x)| crate::core::inject::Landing {
                        rows: shape.slice(ident(p.promised[j], x.src)),
                        flip: None,
                        src_off: x.src_off,
                        dst_off: x.dst_off,
                        len: x.len,
                    })
                    .into_iter()
                    .collect(),
                convert: None,
            };
        let mut torn_bytes = None;
        let (hits, predictions) = match kind {
            Kind::Drop => {
                pairs.remove(k);
                (vec![(dst(i), Class::Unwritten)], vec![predict(Class::Unwritten, dst(i), None)])
            }
            Kind::Torn => {
                pairs[k].len = 16 * self.inject_rng.random_range(1..sb / 16);
                torn_bytes = Some(pairs[k].len);
                (vec![(dst(i), Class::Torn)], vec![predict(Class::Torn, dst(i), Some((i, pairs[k])))])
            }
            Kind::Misroute => {
                let j = loop {
                    let j = pick(&mut self.inject_rng);
                    if j != i {
                        break j;
                    }
                };
                pairs[k].dst = dst(j);
                let moved = pairs[k];
                let kj = pairs.iter().position(|x| x.src == at(j)).expect("a moved block has its descriptors");
                pairs.remove(kj);
                (
                    vec![(dst(j), Class::Misplaced), (dst(i), Class::Unwritten)],
                    vec![predict(Class::Misplaced, dst(j), Some((i, moved))), predict(Class::Unwritten, dst(i), None)],
                )
            }
            Kind::Bitflip | Kind::Stale | Kind::Stray | Kind::HeadOffset | Kind::TokenOffset => {
                unreachable!("refused by scenario::config::check")
            }
        };
        eprintln!("inject: {} planted on request {id}'s READ at layer {layer} {kv}", kind.name());
        Ok(Some(Planted { kind, step: self.now, hits, predictions, torn_bytes }))
    }

    /// Which of a request's `n` blocks its transfer fails to move: none, or (in a share
    /// `--fail-rate` of the transfers of two or more blocks) a seeded 1 to `n - 1` of them.
    fn draw_failed(&mut self, n: usize) -> Vec<usize> {
        let hit = self.fail_rng.random::<f64>() < self.cfg.fail_rate;
        if !hit || n < 2 {
            return Vec::new();
        }
        let k = self.fail_rng.random_range(1..n);
        let mut v = rand::seq::index::sample(&mut self.fail_rng, n, k).into_vec();
        v.sort_unstable();
        self.transfers_failed += 1;
        v
    }

    /// `--lockstep`: completes this step's READs before the step goes on (prefill takes their
    /// notifications first thing in its next step), so no copy overlaps a transfer and the
    /// whole run follows from the seed.
    fn lockstep(&mut self, ids: &[u64], report: &mut Report) -> Result<()> {
        let t = Instant::now();
        for &id in ids {
            // Its state READs first (they complete within the step too).
            while self.pulls[&id].state_xfers.iter().any(Option::is_some) {
                self.poll_state(id)?;
                std::thread::yield_now();
            }
            if self.pulls[&id].xfer.is_none() {
                continue;
            }
            // `poll` ends the wait with a timeout past the READ's deadline.
            loop {
                let p = self.pulls.get_mut(&id).expect("posted request");
                let x = p.xfer.as_mut().expect("a READ in flight");
                if let Some(done) = self.ep.poll(x).map_err(|e| self.prefill.cause_of(e))? {
                    report.summary.bytes_transferred += done.bytes;
                    // A fenced failure's retry is completed within the step too.
                    if !self.read_done(id)? {
                        break;
                    }
                }
                std::thread::yield_now();
            }
            self.next.read_done.push(id);
        }
        self.busy_secs += t.elapsed().as_secs_f64();
        Ok(())
    }

    // ---- push mode ----

    /// Push mode: prefill's WRITE of request `req` landed in decode blocks `dst` with
    /// `contents` (what its source blocks held). Into a block still the request's own it is
    /// the request's data, and decode waits for the WRITE's notification (bounded by
    /// `--timeout`); into a block decode freed and gave to another request (unfenced
    /// decode-abort-free) it is a late write: stamped with the mechanism for the shadow, a
    /// window, and a foreign write for the ownership checker.
    /// Errors: transport (exit 3) for a WRITE decode never asked for or into other blocks;
    /// timeout (exit 4) when its notification does not come.
    fn landed(&mut self, req: u64, dst: &[u32], contents: Vec<Content>) -> Result<()> {
        let own = self.pulls.get(&req).filter(|p| p.landed_at.is_none() && p.dslots.as_slice() == dst).is_some();
        let orphan = self.orphans.get(&req).is_some_and(|d| d.as_slice() == dst);
        if !own && !orphan || contents.len() != dst.len() {
            return Err(Error::Transport(format!(
                "prefill WRITE request {req} into decode blocks decode did not ask it for (a protocol error)"
            )));
        }
        let now = self.now;
        let mut late = false;
        for (&d, mut c) in dst.iter().zip(contents) {
            if !own {
                c.cause = Some(Mechanism::DecodeAbortFree);
                if let Some(o) = self.downer[d as usize] {
                    late = true;
                    self.decode_violation("foreign-write", req, d, "WRITE landing", format!("owned by request {o}"));
                }
            }
            self.dland[d as usize].push((now, c));
        }
        if late {
            self.observe(What::Window { mechanism: Mechanism::DecodeAbortFree })?;
        }
        let d = crate::sys::deadline::Deadline::after(self.timeout);
        if orphan {
            self.orphans.remove(&req);
            self.arrived.remove(&req);
            // Its state slot, held since the abort, is free once its state WRITE landed.
            self.await_state(req, d)?;
            self.state_free.extend(self.state_orphans.remove(&req));
            return Ok(());
        }
        self.pulls.get_mut(&req).expect("own request").landed_at = Some(now);
        // Prefill's WRITE is complete: its notification follows at once.
        while !self.arrived.contains(&req) {
            let asked = Instant::now();
            self.take_push_notifications()?;
            if !self.arrived.contains(&req) && d.passed_at(asked) {
                return Err(Error::Timeout(format!(
                    "no notification of request {req}'s WRITE within --timeout {:.6} s of prefill reporting it complete",
                    d.limit_secs()
                )));
            }
            std::thread::yield_now();
        }
        self.await_state(req, d)
    }

    /// Push mode, a hybrid model: waits (until `d`) for the notification of request `req`'s
    /// state WRITE on every lane not left out (prefill completed them before reporting the
    /// request's WRITE landed). Errors: timeout (exit 4), transport (exit 3).
    fn await_state(&mut self, req: u64, d: crate::sys::deadline::Deadline) -> Result<()> {
        let want = self.state.iter().filter(|(l, _)| !super::state::left_out(l)).count() as u32;
        if want == 0 {
            return Ok(());
        }
        loop {
            let asked = Instant::now();
            for (_, ep) in &self.state {
                for msg in ep.notifications()? {
                    let of = msg.strip_prefix(self.nixl.tag()).and_then(|s| s.strip_suffix(":state"));
                    if let Some(id) = of.and_then(|s| s.parse::<u64>().ok()) {
                        *self.state_arrived.entry(id).or_default() += 1;
                    }
                }
            }
            if self.state_arrived.get(&req).is_some_and(|n| *n >= want) {
                self.state_arrived.remove(&req);
                return Ok(());
            }
            if d.passed_at(asked) {
                return Err(Error::Timeout(format!(
                    "no notification of request {req}'s state WRITE within --timeout {:.6} s of prefill reporting it complete",
                    d.limit_secs()
                )));
            }
            std::thread::yield_now();
        }
    }

    /// Push mode: takes the agent's notifications (prefill's WRITE of a request is done).
    fn take_push_notifications(&mut self) -> Result<()> {
        for msg in self.ep.notifications()? {
            if let Some(id) = self.nixl.request_of(&msg) {
                self.arrived.insert(id);
            }
        }
        Ok(())
    }

    /// Push mode, each step: a request whose WRITE landed decodes a seeded 2–8 steps and is
    /// then verified (a late write into its blocks meanwhile is found); one whose data did
    /// not arrive `--lease` steps after decode asked is aborted (the client gave up):
    /// fenced decode-abort-free, its blocks wait for the WRITE's notification; unfenced, they
    /// are freed at once (free-in-flight for the ownership checker) and the WRITE, when it
    /// comes, lands in their next owner.
    fn advance_pushes(&mut self) -> Result<()> {
        let lease = self.cfg.lease_steps as u64;
        let unfenced = self.races.unfenced(Mechanism::DecodeAbortFree);
        let mut gone = Vec::new();
        for id in self.order.clone() {
            let p = self.pulls.get_mut(&id).expect("ordered request");
            if p.stage != PullState::Pulling {
                continue;
            }
            match (p.landed_at.is_some(), p.decode_until) {
                (true, _) if p.aborting => gone.push(id),
                (true, None) => p.decode_until = Some(self.now + self.push_rng.random_range(2..=8u64)),
                (true, Some(t)) if t <= self.now => p.stage = PullState::Verify,
                (false, _) if !p.aborting && self.now >= p.asked_at + lease => {
                    if unfenced {
                        for &d in &p.dslots.clone() {
                            self.decode_violation("free-in-flight", id, d, "decode free", "a WRITE into it pending".into());
                        }
                        let p = self.pulls.get(&id).expect("ordered request");
                        self.orphans.insert(id, p.dslots.clone());
                        if let Some(s) = self.pulls.get_mut(&id).and_then(|p| p.dstate.take()) {
                            self.state_orphans.insert(id, s);
                        }
                        gone.push(id);
                    } else {
                        p.aborting = true;
                    }
                }
                _ => {}
            }
        }
        for id in gone {
            self.release_pull(id);
            self.daborted += 1;
        }
        Ok(())
    }

    /// Records a block-ownership violation decode's own checker saw (push mode: `block` is
    /// a decode block).
    fn decode_violation(&mut self, kind: &str, request: u64, block: u32, operation: &str, conflict: String) {
        self.record_violation(crate::report::OwnershipViolation::new(kind, request, block, operation, conflict, self.now));
    }

    /// Counts a block-ownership violation (prefill's or decode's) and lists it while fewer
    /// than `--max-failures` are listed.
    fn record_violation(&mut self, v: crate::report::OwnershipViolation) {
        self.violation_count += 1;
        if self.violations.len() < self.max_failures {
            self.violations.push(v);
        }
    }

    /// Request `id` leaves decode (verified, or aborted in push mode): its decode blocks are
    /// freed, prefill is told, and a hand-over of it again is a protocol error. Returns it.
    fn release_pull(&mut self, id: u64) -> Pull {
        let p = self.pulls.remove(&id).expect("a request decode holds");
        self.order.retain(|&x| x != id);
        for &d in &p.dslots {
            self.downer[d as usize] = None;
            self.dblocks.free(d);
        }
        self.state_free.extend(p.dstate);
        self.done_ids.insert(id);
        self.next.finished.push(id);
        p
    }

    // ---- tier-only loads ----

    /// Decode's load stream: the tier loads that are due, in order, together (across a pair
    /// the embedded tier's are one NIXL READ, counted with the bytes moved over NIXL).
    fn run_loads(&mut self, report: &mut Report) -> Result<()> {
        let mut due = Vec::new();
        while self.loads.front().is_some_and(|l| l.due <= self.now) {
            due.push(self.loads.pop_front().expect("front"));
        }
        // A load that fails (`--fail-rate`) moves nothing: fenced, it is reported and runs
        // again a step later; unfenced (failed-as-complete), it is counted delivered.
        let unfenced = self.races.unfenced(Mechanism::FailedAsComplete);
        let mut run = Vec::with_capacity(due.len());
        for l in due {
            let p = self.pulls.get_mut(&l.req).expect("loading request");
            let Some(k) = p.failed.iter().position(|&i| i == l.index) else {
                run.push(l);
                continue;
            };
            p.failed.swap_remove(k);
            if !unfenced {
                self.loads.push_back(Load { due: self.now + 1, ..l });
                continue;
            }
            let first = p.unwritten.is_empty();
            p.unwritten.push(l.index);
            p.dloads_left -= 1;
            if p.dloads_left == 0 {
                p.stage = PullState::Verify;
            }
            if first {
                self.observe(What::Window { mechanism: Mechanism::FailedAsComplete })?;
            }
        }
        let due = run;
        if due.is_empty() {
            return Ok(());
        }
        let loads: Vec<(u32, crate::peer::steps::TierRef)> = due
            .iter()
            .map(|l| {
                let p = &self.pulls[&l.req];
                (p.dslots[l.index], p.tier[l.index])
            })
            .collect();
        let t = Instant::now();
        let bytes = self
            .tier
            .as_mut()
            .expect("tier-only loads need the tier")
            .load(self.ep, &loads, self.timeout)
            .map_err(|e| self.prefill.cause_of(e))?;
        if bytes > 0 {
            report.summary.bytes_transferred += bytes;
            self.busy_secs += t.elapsed().as_secs_f64();
        }
        for (l, (_, entry)) in due.iter().zip(&loads) {
            self.dloads += 1;
            let p = self.pulls.get_mut(&l.req).expect("loading request");
            p.delivered[l.index] = entry.content;
            p.dloads_left -= 1;
            if p.dloads_left == 0 {
                p.stage = PullState::Verify;
            }
        }
        Ok(())
    }

    // ---- decode ----

    fn start_decode(&mut self, report: &mut Report) -> Result<()> {
        let sc = self.cfg.scenario;
        let n = self.ep.pool.geometry().num_blocks as usize;
        let mut table = vec![TableEntry::new(0, SKIP_GEN); n];
        let mut starting = Vec::new();
        for &id in &self.order {
            let p = &self.pulls[&id];
            if p.stage != PullState::Waiting || p.ready_at > self.now {
                continue;
            }
            // A hybrid model's request takes a state slot as well.
            if !self.state.is_empty() && self.state_free.len() <= starting.len() {
                break;
            }
            let Some(d) = self.dblocks.alloc(p.pslots.len()) else {
                break; // decode is full; keep order
            };
            for &s in &d {
                table[s as usize] = TableEntry::new(1, 1);
            }
            starting.push((id, d));
        }
        if starting.is_empty() {
            return Ok(());
        }
        // Before the re-poison: each block still holds what its last request verified (a
        // write after that verdict would otherwise be overwritten unseen).
        let reused: Vec<u32> = starting.iter().flat_map(|(_, d)| d.iter().copied()).collect();
        self.reverify_held(&reused, report)?;
        let iter = (self.now & 0xFF_FFFF) as u32;
        let t = Instant::now();
        self.ep.pool.poison_blocks(&table, iter)?;
        self.poison_secs += t.elapsed().as_secs_f64();
        let g = self.ep.pool.geometry().clone();
        let posted: Vec<u64> = starting.iter().map(|(id, _)| *id).collect();
        for (id, d) in starting {
            let lag = self.rng.random_range(0..=1u64);
            for &b in &d {
                self.dland[b as usize].clear();
                self.downer[b as usize] = Some(id);
            }
            let p = self.pulls.get_mut(&id).expect("starting request");
            p.poison_iter = iter;
            p.dslots = d;
            p.stage = PullState::Pulling;
            if self.cfg.push {
                // Push mode: prefill WRITEs the blocks into these (failed-as-complete and
                // --inject act on READs), and a hybrid model's state into decode's slot.
                p.asked_at = self.now;
                self.start_state(id, false)?;
                let p = &self.pulls[&id];
                self.next.push.push(crate::peer::steps::Push { req: id, blocks: p.dslots.clone(), state_slot: p.dstate });
                continue;
            }
            let n = p.pslots.len();
            let failed = self.draw_failed(n);
            let p = self.pulls.get_mut(&id).expect("starting request");
            p.failed = failed;
            // Faults prefill planted in the source slices (bitflip, stale) must show as
            // planted: their blocks move, and no other fault is planted on them.
            let sourced: Vec<usize> = p.source_faults.iter().map(|f| f.index as usize).collect();
            p.failed.retain(|i| !sourced.contains(i));
            let sb = g.slice_bytes()?;
            for f in std::mem::take(&mut p.source_faults) {
                let i = f.index as usize;
                let (class, promised) = match f.kind {
                    crate::core::inject::Kind::Stale => (
                        crate::core::verify::Class::Stale,
                        TableEntry { generation: p.promised[i].generation.wrapping_sub(1), ..p.promised[i] },
                    ),
                    _ => (crate::core::verify::Class::Bitflip, p.promised[i]),
                };
                let at = SliceCoord { layer: f.layer, kv: f.kv, block: p.dslots[i] };
                // The source slice as prefill left it (the previous generation, or the bit
                // flipped), moved whole.
                let prediction = crate::core::inject::Prediction {
                    class,
                    slice_bytes: sb,
                    under: crate::core::inject::Under::Poison { slot: g.global_slice(at), iteration: p.poison_iter },
                    landed: vec![crate::core::inject::Landing {
                        rows: self.ep.pool.shape().slice(ident(promised, at)),
                        flip: f.flip,
                        src_off: 0,
                        dst_off: 0,
                        len: sb,
                    }],
                    convert: None,
                };
                p.planted.push(Planted {
                    kind: f.kind,
                    step: self.now,
                    hits: vec![(at, class)],
                    predictions: vec![prediction],
                    torn_bytes: None,
                });
            }
            if sc.uses_nixl() {
                // The failed blocks' descriptors are left out of the READ, as the backend
                // failing them would leave them unwritten; a fenced connector knows it
                // failed, so the READ then notifies no one until the retry.
                let moved: Vec<usize> = (0..n).filter(|i| !p.failed.contains(i)).collect();
                let src: Vec<u32> = moved.iter().map(|&i| p.pslots[i]).collect();
                let dst: Vec<u32> = moved.iter().map(|&i| p.dslots[i]).collect();
                let mut pairs = NixlConnector::read_pairs(&g, &src, &dst)?;
                let free: Vec<usize> = moved.iter().copied().filter(|i| !sourced.contains(i)).collect();
                if let Some(planted) = self.plant(&mut pairs, &free, id)? {
                    self.pulls.get_mut(&id).expect("starting request").planted.push(planted);
                }
                let p = &self.pulls[&id];
                let notify = p.failed.is_empty() || self.races.unfenced(Mechanism::FailedAsComplete);
                let blocks = p.pslots.clone();
                let Answer::AtPost(at_post) = self.observe(What::ReadPosted { req: id, blocks })? else {
                    unreachable!("a READ's post is answered with the blocks' contents")
                };
                let x = self.nixl.post_read(self.ep, &pairs, id, notify, self.timeout).map_err(|e| self.prefill.cause_of(e))?;
                let p = self.pulls.get_mut(&id).expect("starting request");
                p.at_post = at_post;
                p.xfer = Some(x);
                self.next.posted.push(id);
                self.start_state(id, true)?;
            } else {
                p.dloads_left = p.pslots.len() as u32;
                p.delivered = vec![Content::default(); p.pslots.len()];
                let due = self.now + lag;
                for index in 0..p.pslots.len() {
                    self.loads.push_back(Load { due, req: id, index });
                }
            }
        }
        if self.cfg.lockstep && sc.uses_nixl() {
            self.lockstep(&posted, report)?;
        }
        Ok(())
    }

    /// A hybrid model: request `id` takes a decode state slot, whose pages are poisoned with
    /// the request's poison iteration, and with `read` decode posts one READ per lane of
    /// prefill's slot into it ([`StateLane::pairs`]; none for a lane a test hook leaves out;
    /// push mode: prefill WRITEs it). Errors: device errors of the poison, transport (exit 3)
    /// of the post.
    fn start_state(&mut self, id: u64, read: bool) -> Result<()> {
        if self.state.is_empty() {
            return Ok(());
        }
        let slot = self.state_free.pop().ok_or_else(|| Error::Internal("no free decode state slot".into()))?;
        let p = self.pulls.get_mut(&id).expect("starting request");
        let (src, iter) = (p.pstate, p.poison_iter);
        let mut src = src.ok_or_else(|| Error::Internal(format!("request {id} has no prefill state slot")))?;
        p.dstate = Some(slot);
        // Test-only: the READ names prefill's next slot instead.
        if let Some((TestFault::StateMisroute, left)) = self.fault.as_mut().filter(|(_, n)| *n > 0) {
            *left -= 1;
            src = (src + 1) % self.state[0].0.slots;
        }
        let t = Instant::now();
        let mut xfers = Vec::with_capacity(self.state.len());
        for (lane, ep) in &mut self.state {
            // The slot's page of every layer (the pool's slice (layer, slot) is global slice
            // `lane.page_slot`), poisoned where the pool lives.
            let mut table = vec![TableEntry::new(0, SKIP_GEN); lane.slots as usize];
            table[slot as usize] = TableEntry::new(1, 1);
            ep.pool.poison_blocks(&table, iter)?;
            if !read || super::state::left_out(lane) {
                xfers.push(None);
                continue;
            }
            let msg = format!("{}{id}:state", self.nixl.tag());
            xfers.push(Some(ep.post_read(&lane.pairs(src, slot), &msg, self.timeout).map_err(|e| self.prefill.cause_of(e))?));
        }
        self.poison_secs += t.elapsed().as_secs_f64();
        self.pulls.get_mut(&id).expect("starting request").state_xfers = xfers;
        Ok(())
    }

    /// A hybrid model: verifies the state slot of each of `ids` (verified requests whose state
    /// READs completed) in every lane: each page against the request's state id and
    /// generation ([`StateLane::verify_page`]), from the bytes read once.
    fn verify_state(&mut self, ids: &[u64]) -> Result<()> {
        for &id in ids {
            let p = &self.pulls[&id];
            let Some(slot) = p.dstate else { continue };
            let generation = StateLane::generation(p.pslots.len());
            for (k, (lane, ep)) in self.state.iter().enumerate() {
                // Push mode: the state WRITE of a verified request landed (its notification
                // came before the request could be verified).
                if self.cfg.push && !super::state::left_out(lane) {
                    self.state_reports[k].bytes_moved += lane.bytes_per_request();
                }
                let mut page = vec![0u8; lane.page_stride_bytes as usize];
                for li in 0..lane.layers.len() as u32 {
                    ep.pool.read_slice(StateLane::page(li, slot), &mut page)?;
                    lane.verify_page(
                        self.seed,
                        &page,
                        li,
                        slot,
                        p.poison_iter,
                        id,
                        generation,
                        self.max_failures,
                        &mut self.state_reports[k],
                    );
                }
            }
        }
        Ok(())
    }

    fn verify(&mut self, report: &mut Report) -> Result<()> {
        let ids: Vec<u64> = self
            .order
            .iter()
            .copied()
            .filter(|id| self.pulls[id].stage == PullState::Verify && self.pulls[id].state_xfers.iter().all(Option::is_none))
            .collect();
        if ids.is_empty() {
            return Ok(());
        }
        let g = self.ep.pool.geometry().clone();
        let n = g.num_blocks as usize;
        let mut table = vec![TableEntry::new(0, SKIP_GEN); n];
        // decode slot -> (request, block index)
        let mut owner: HashMap<u32, (u64, usize)> = HashMap::new();
        for &id in &ids {
            let p = &self.pulls[&id];
            for (i, &d) in p.dslots.iter().enumerate() {
                table[d as usize] = p.promised[i];
                owner.insert(d, (id, i));
            }
        }
        self.plant_faults(&ids)?;
        // The `--inject` slices found corrupt, with the class found and whether their bytes
        // are exactly the predicted ones.
        let mut seen: HashMap<SliceCoord, (crate::core::verify::Class, bool)> = HashMap::new();
        let t = Instant::now();
        let fails = self.ep.pool.verify(&table)?;
        let slices: u64 =
            ids.iter().map(|id| self.pulls[id].dslots.len() as u64).sum::<u64>() * g.num_layers as u64 * g.kv_parts() as u64;
        report.summary.blocks_checked += slices;
        let sb = g.slice_bytes()? as usize;
        // The verdict rests on what the pass compared: the slices of every verified request,
        // every byte, or the run is an internal error (exit 3).
        let done = self.ep.pool.take_compared();
        report.summary.slices_compared += done.slices;
        report.summary.bytes_compared += done.bytes;
        if done.slices != slices || done.bytes != slices * sb as u64 {
            return Err(Error::Internal(format!(
                "step {}: the verify pass compared {} block slices and {} bytes, but the plan is {slices} block slices and {} \
                 bytes: the verdict would rest on slices never compared",
                self.now,
                done.slices,
                done.bytes,
                slices * sb as u64
            )));
        }
        self.plant_late_data(&fails, &owner, &table)?;
        let mut buf = vec![0u8; sb];
        let mut now = vec![0u8; sb];
        let nixl = self.cfg.scenario.uses_nixl();
        for f in &fails {
            let c = g.coord_of(f.slice);
            let Some(&(id, i)) = owner.get(&c.block) else {
                continue;
            };
            let p = &self.pulls[&id];
            let expected_t = table[c.block as usize];
            let expected = ident(expected_t, c);
            // The bytes the verify pass judged (its snapshot on DRAM), then the slice again:
            // bytes that changed after the verdict make it `late` (as the sweep's).
            let kept = self.ep.pool.judged_slice(c, f.slice, &mut buf)?;
            let due = self.ep.pool.shape().slice(expected);
            let want = fingerprint::expected(self.seed, &due);
            // Not kept (VRAM): the record describes the bytes read again.
            let f = &if kept { *f } else { crate::mem::pool::RawFailure::recount(f.slice, &buf, &want) };
            let judged = verify::classify_against(&buf, &want, &due, self.seed, f.slice, p.poison_iter);
            self.ep.pool.read_slice(c, &mut now)?;
            let (v, judged_class) = if now != buf {
                let j = judged.class;
                (verify::Verdict { class: verify::Class::Late, ..judged }, Some(j))
            } else {
                (judged, None)
            };
            // What the source block held during the READ window: its content when the READ
            // was posted, then every write before the READ completed (tier-only: the entry
            // decode loaded).
            let written: Vec<Content> = if self.cfg.push {
                // Push mode: the request's own WRITE and whatever landed after it.
                let from = p.landed_at.unwrap_or(0);
                self.dland[c.block as usize].iter().filter(|(t, _)| *t >= from).map(|(_, c)| *c).collect()
            } else if nixl {
                std::iter::once(p.at_post[i]).chain(p.during.get(i).into_iter().flatten().copied()).collect()
            } else {
                vec![p.delivered[i]]
            };
            // An `--inject` fault planted on this slice, found with the class it predicts and
            // exactly the bytes it predicts, is planted damage: neither attributed nor
            // unexplained. Anything else in it (a garbage tail, flipped bits in a delivered
            // prefix, another block's rows) is not.
            let plant = p.planted.iter().flat_map(|x| x.hits.iter().zip(&x.predictions)).find(|((at, _), _)| *at == c);
            let planted = plant.map(|((_, class), _)| *class);
            let as_predicted = crate::core::inject::matches_prediction(plant.map(|(_, x)| x), v.class, self.seed, &buf);
            if planted.is_some() {
                seen.insert(c, (v.class, as_predicted));
            }
            // A block counted delivered although its transfer failed still holds this
            // pull's poison: failed-as-complete's, and only that.
            let (cause, predicted) = if as_predicted {
                (None, expected_t)
            } else if p.unwritten.contains(&i) && v.class == crate::core::verify::Class::Unwritten {
                (Some(Mechanism::FailedAsComplete), expected_t)
            } else {
                attribute(&buf, &want, self.seed, self.ep.pool.shape(), c, &written)
            };
            if !as_predicted {
                self.shadow.count(cause, v.class);
            }
            if let Some(iv) = self.intervals.last_mut() {
                iv.corrupt += 1;
                iv.unexplained += (!as_predicted && cause.is_none()) as u64;
            }
            // Unexplained slices (defects of the stack under test) have their own budget, so
            // a flood of explained race corruption never hides them.
            let budget = if cause.is_some() || as_predicted { Budget::Explained } else { Budget::Unexplained };
            let step = self.now.min(u32::MAX as u64) as u32;
            let class = v.class;
            let pslot = p.pslots[i];
            self.tally.record(report, self.dump.as_deref_mut(), budget, class, &buf, None, || {
                let mut failure = Failure::new(step, c, f, v, &want, &buf, expected, pslot);
                failure.request = Some(id);
                failure.poison_iteration = p.poison_iter;
                failure.predicted = Some(ident(predicted, c));
                failure.attributed_to = cause;
                failure.injected = as_predicted;
                failure.judged_class = judged_class;
                failure
            });
        }
        report.summary.verify_seconds += t.elapsed().as_secs_f64();
        // What each verified block now holds, until it is re-poisoned; slices found corrupt
        // are not judged again.
        for f in &fails {
            let c = g.coord_of(f.slice);
            if owner.contains_key(&c.block) {
                self.judged_corrupt.insert(c);
            }
        }
        for &id in &ids {
            let p = &self.pulls[&id];
            for (i, &d) in p.dslots.iter().enumerate() {
                self.held[d as usize] = Some(Held {
                    entry: table[d as usize],
                    req: id,
                    poison_iter: p.poison_iter,
                    pslot: p.pslots[i],
                    landed: self.dland[d as usize].len(),
                });
            }
        }
        self.verify_state(&ids)?;
        self.plant_late_writes(&ids)?;
        for id in ids {
            let p = self.release_pull(id);
            // Each planted fault is detected when every slice it predicts was found with its
            // class (as the sweep's injections).
            for x in &p.planted {
                // An injection that reached no slice is not detected (`all` of nothing is true).
                let detected = crate::core::inject::detected_as_predicted(
                    x.hits.iter().map(|(at, class)| seen.get(at) == Some(&(*class, true))),
                );
                report.summary.injections_planted += 1;
                report.summary.injections_detected += detected as u64;
                report.injections.push(crate::report::InjectionRecord {
                    iteration: x.step.min(u32::MAX as u64) as u32,
                    kind: x.kind,
                    predicted: x
                        .hits
                        .iter()
                        .zip(&x.predictions)
                        .map(|((at, class), pred)| crate::report::PredictedHit {
                            layer: at.layer,
                            kv: at.kv,
                            block: at.block,
                            class: *class,
                            tp_rank: None,
                            digest: Some(pred.digest(self.seed)),
                            written: pred.written(),
                        })
                        .collect(),
                    detected,
                    link: None,
                    torn_bytes: x.torn_bytes,
                });
            }
            self.verified += 1;
            if let Some(iv) = self.intervals.last_mut() {
                iv.requests += 1;
                iv.slices_checked += p.dslots.len() as u64 * g.num_layers as u64 * g.kv_parts() as u64;
            }
        }
        Ok(())
    }

    /// Judges again the blocks of `blocks` that hold a verified request's data ([`Held`]):
    /// every slice must still be the fingerprint it verified clean against (slices the verify
    /// found corrupt are not judged again). A slice that changed took a write after the
    /// verdict — a late WRITE of an aborted request (unfenced decode-abort-free: attributed
    /// when the writes that landed after the verdict explain it) or a defect of the stack
    /// under test (unexplained) — and is recorded as class `stray`, `stray_check`
    /// `reverify`, with the step of this check as its `iteration`. The blocks are then no
    /// longer held. Counted in `summary.stray_reverified_slices` (not `slices_compared`).
    /// Errors: internal (exit 3) when the pass compared other than every slice of them.
    fn reverify_held(&mut self, blocks: &[u32], report: &mut Report) -> Result<()> {
        let g = self.ep.pool.geometry().clone();
        let mut table = vec![TableEntry::new(0, SKIP_GEN); g.num_blocks as usize];
        let mut n = 0u64;
        for &b in blocks {
            if let Some(h) = self.held[b as usize] {
                table[b as usize] = h.entry;
                n += 1;
            }
        }
        if n == 0 {
            return Ok(());
        }
        let t = Instant::now();
        let fails = self.ep.pool.verify(&table)?;
        let sb = g.slice_bytes()? as usize;
        let slices = n * g.num_layers as u64 * g.kv_parts() as u64;
        let done = self.ep.pool.take_compared();
        report.summary.stray_reverified_slices += done.slices;
        if done.slices != slices || done.bytes != slices * sb as u64 {
            return Err(Error::Internal(format!(
                "step {}: the re-verify of {n} freed blocks compared {} block slices and {} bytes, but the plan is {slices} \
                 block slices and {} bytes",
                self.now,
                done.slices,
                done.bytes,
                slices * sb as u64
            )));
        }
        let mut buf = vec![0u8; sb];
        for f in &fails {
            let c = g.coord_of(f.slice);
            let Some(h) = self.held[c.block as usize] else { continue };
            if self.judged_corrupt.contains(&c) {
                continue;
            }
            let expected = ident(h.entry, c);
            let kept = self.ep.pool.judged_slice(c, f.slice, &mut buf)?;
            let want = fingerprint::expected(self.seed, &self.ep.pool.shape().slice(expected));
            let f = &if kept { *f } else { crate::mem::pool::RawFailure::recount(f.slice, &buf, &want) };
            // What landed after the verdict (push mode: late WRITEs of aborted requests).
            let written: Vec<Content> = self.dland[c.block as usize].iter().skip(h.landed).map(|(_, c)| *c).collect();
            let (cause, predicted) = if written.is_empty() {
                (None, h.entry)
            } else {
                attribute(&buf, &want, self.seed, self.ep.pool.shape(), c, &written)
            };
            self.shadow.count(cause, verify::Class::Stray);
            if let Some(iv) = self.intervals.last_mut() {
                iv.corrupt += 1;
                iv.unexplained += cause.is_none() as u64;
            }
            let budget = if cause.is_some() { Budget::Explained } else { Budget::Unexplained };
            let observed = fingerprint::observed_identity(&buf, self.seed, self.ep.pool.shape(), f.first_bad);
            let v = verify::Verdict {
                class: verify::Class::Stray,
                observed,
                bit_flips: None,
                sectors: None,
                displacement: None,
                rows: None,
            };
            let step = self.now.min(u32::MAX as u64) as u32;
            self.tally.record(report, self.dump.as_deref_mut(), budget, v.class, &buf, None, || {
                let mut failure = Failure::new(step, c, f, v, &want, &buf, expected, h.pslot);
                failure.request = Some(h.req);
                failure.poison_iteration = h.poison_iter;
                failure.predicted = Some(ident(predicted, c));
                failure.attributed_to = cause;
                failure.stray_check = Some(crate::report::StrayCheck::Reverify);
                failure
            });
        }
        for &b in blocks {
            if self.held[b as usize].take().is_some() {
                for layer in 0..g.num_layers {
                    for &kv in g.parts() {
                        self.judged_corrupt.remove(&SliceCoord { layer, kv, block: b });
                    }
                }
            }
        }
        report.summary.stray_check_seconds += t.elapsed().as_secs_f64();
        Ok(())
    }

    /// Test-only (`KVPROBE_TEST_FAULT=late-data:N`): right after a verify pass judged, writes
    /// the expected fingerprint into the next N failing slices of the requests verified, as
    /// data landing after the verdict would: each must be classified `late` from the bytes the
    /// pass judged.
    fn plant_late_data(
        &mut self,
        fails: &[crate::mem::pool::RawFailure],
        owner: &HashMap<u32, (u64, usize)>,
        table: &[TableEntry],
    ) -> Result<()> {
        let Some((TestFault::LateData, mut left)) = self.fault else { return Ok(()) };
        let g = self.ep.pool.geometry().clone();
        for f in fails {
            if left == 0 {
                break;
            }
            let c = g.coord_of(f.slice);
            let Some(&(id, _)) = owner.get(&c.block) else { continue };
            let bytes = fingerprint::expected(self.seed, &self.ep.pool.shape().slice(ident(table[c.block as usize], c)));
            self.ep.pool.write_slice(c, &bytes)?;
            eprintln!(
                "test fault: late-data planted in request {id} after the verdict at layer {} {} decode block {}",
                c.layer, c.kv, c.block
            );
            left -= 1;
        }
        self.fault = Some((TestFault::LateData, left));
        Ok(())
    }

    /// Test-only (`KVPROBE_TEST_FAULT=late-write:N`): after the verify of the next N requests
    /// whose first block verified clean, writes another block's fingerprint into that block's
    /// first slice (layer 0, the first K/V part): a write after the verdict, which no
    /// mechanism explains, so the re-verify before the block's re-poison (or at the end) must
    /// report it unexplained, class `stray`.
    fn plant_late_writes(&mut self, ids: &[u64]) -> Result<()> {
        let Some((TestFault::LateWrite, mut left)) = self.fault else { return Ok(()) };
        let g = self.ep.pool.geometry().clone();
        for &id in ids {
            if left == 0 {
                break;
            }
            let Some(&d) = self.pulls[&id].dslots.first() else { continue };
            let c = SliceCoord { layer: 0, kv: g.parts()[0], block: d };
            if self.judged_corrupt.contains(&c) {
                continue;
            }
            let Some(h) = self.held[d as usize] else { continue };
            let other = TableEntry { block: h.entry.block ^ 0x5A5A, ..h.entry };
            let bytes = fingerprint::expected(self.seed, &self.ep.pool.shape().slice(ident(other, c)));
            self.ep.pool.write_slice(c, &bytes)?;
            eprintln!("test fault: late-write planted in request {id} after its verify at layer 0 {} decode block {d}", c.kv);
            left -= 1;
        }
        self.fault = Some((TestFault::LateWrite, left));
        Ok(())
    }

    /// Test-only (`KVPROBE_TEST_FAULT`, see [`TestFault`]): corrupts one decode slice (layer
    /// 0, the first K/V part) in each of the next requests about to be verified, after
    /// their READ or load completed, until the count is spent, and names each on stderr.
    fn plant_faults(&mut self, ids: &[u64]) -> Result<()> {
        let Some((kind, mut left)) = self.fault.filter(|(k, _)| {
            !matches!(k, TestFault::EarlyFree | TestFault::LateWrite | TestFault::LateData | TestFault::StateMisroute)
        }) else {
            return Ok(());
        };
        let g = self.ep.pool.geometry().clone();
        let sb = g.slice_bytes()? as usize;
        for &id in ids {
            if left == 0 {
                break;
            }
            let p = &self.pulls[&id];
            let i = match kind {
                TestFault::Bitflip => 0,
                // A block rewritten while its READ was in flight: the partial delivery a
                // race-excusing attribution would take for a tear.
                TestFault::Poison => match p.during.iter().position(|d| !d.is_empty()) {
                    Some(i) => i,
                    None => continue,
                },
                TestFault::EarlyFree | TestFault::LateWrite | TestFault::LateData | TestFault::StateMisroute => {
                    unreachable!("filtered above: planted elsewhere")
                }
                // A slice an `--inject torn` tore.
                TestFault::TornTail => usize::MAX,
            };
            let torn = p
                .planted
                .iter()
                .flat_map(|x| x.hits.iter().zip(&x.predictions))
                .find(|((_, class), _)| *class == crate::core::verify::Class::Torn)
                .map(|((at, _), x)| (*at, x.landed.iter().map(|l| l.dst_off + l.len).max().unwrap_or(0) as usize));
            let c = match (kind, torn) {
                (TestFault::TornTail, Some((at, _))) => at,
                (TestFault::TornTail, None) => continue,
                _ => SliceCoord { layer: 0, kv: g.parts()[0], block: p.dslots[i] },
            };
            let mut buf = vec![0u8; sb];
            self.ep.pool.read_slice(c, &mut buf)?;
            match kind {
                // Bit 0 of sector 0's check word (a 32-bit hash of the identity).
                TestFault::Bitflip => buf[12] ^= 1,
                TestFault::EarlyFree | TestFault::LateWrite | TestFault::LateData | TestFault::StateMisroute => {
                    unreachable!("filtered above: planted elsewhere")
                }
                // The last 16 bytes: the tear (a multiple of 16 bytes short) left poison there.
                TestFault::TornTail => {
                    debug_assert!(torn.is_some_and(|(_, end)| end <= sb - 16));
                    for (k, b) in buf[sb - 16..].iter_mut().enumerate() {
                        *b = 0xC3 ^ k as u8;
                    }
                }
                TestFault::Poison => {
                    let from = sb / 2 / 16 * 16;
                    let mut q = vec![0u8; sb];
                    fingerprint::poison(&mut q, g.global_slice(c), p.poison_iter);
                    buf[from..].copy_from_slice(&q[from..]);
                }
            }
            self.ep.pool.write_slice(c, &buf)?;
            eprintln!(
                "test fault: {} planted in request {id} at layer {} {} decode block {}",
                kind.name(),
                c.layer,
                c.kv,
                c.block
            );
            left -= 1;
        }
        self.fault = Some((kind, left));
        Ok(())
    }

    fn finish(&self, report: &mut Report) {
        let s = &mut report.summary;
        s.transfer_seconds = self.busy_secs;
        if self.cfg.push {
            // Prefill's WRITEs moved the bytes, on its clock.
            s.bytes_transferred = self.counters.bytes_written;
            s.transfer_seconds = self.counters.write_seconds;
        }
        s.transfer_gbps = if s.transfer_seconds > 0.0 { s.bytes_transferred as f64 / s.transfer_seconds / 1e9 } else { 0.0 };
        s.iterations = self.verified.min(u32::MAX as u64) as u32;
        // What neither an injection nor a mechanism explains.
        s.unexpected_failures = self.shadow.unexplained;
        s.fill_seconds = self.counters.fill_seconds;
        s.poison_seconds = self.poison_secs;
        let slice = self.ep.pool.geometry().slice_bytes().unwrap_or(0);
        s.verify_gbps =
            if s.verify_seconds > 0.0 { s.blocks_checked as f64 * slice as f64 / s.verify_seconds / 1e9 } else { 0.0 };
        let c = &self.counters;
        report.scenario = Some(ScenarioReport {
            scenario: self.cfg.scenario,
            tier: self.cfg.tier,
            steps: self.now,
            seconds: self.started.elapsed().as_secs_f64(),
            requests_admitted: c.admitted,
            requests_verified: self.verified,
            requests_aborted: c.aborted + self.daborted,
            tier_hit_blocks: c.hit_blocks,
            tier_saves: c.saves,
            tier_loads: c.loads + self.dloads,
            tier_evictions: c.evictions,
            tier_detail: self.tier_detail.clone(),
            unexplained_corrupt: self.shadow.unexplained,
            ownership_violations: Some(self.violation_count),
            transfers_failed: Some(self.transfers_failed),
            violations: self.violations.clone(),
            races: self.shadow.outcomes(&self.races),
            intervals: self.intervals.clone(),
        });
        if !self.state_reports.is_empty() {
            report.regions = self.state_reports.clone();
        }
    }
}
