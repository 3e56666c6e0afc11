//! The engine loop of a scenario: drives the scheduler ([`super::scheduler`]), the
//! connectors ([`super::connectors`]) and both pools step by step, and reports every write
//! and every READ window to the shadow ([`super::shadow`]), which attributes what decode
//! finds corrupt.
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
//! Every write into a prefill block goes through this engine, so the shadow sees each one
//! ([`Content`]), stamped with the unfenced mechanism that allowed it, if one did, and for
//! each NIXL READ in flight every content written into its blocks until it completes. A
//! corrupt slice at decode is *explained* only when every 4-byte element of it is what one
//! of the contents its block held during the READ window put there ([`attribute`]), and is
//! then attributed to the stamped mechanism. Anything else — poison, a flipped bit, garbage,
//! an identity never written in the window — is a defect of the stack under test (exit 1),
//! as is any corruption in a fenced run.
//!
//! Test-only: `KVPROBE_TEST_FAULT` plants damage no race can produce ([`TestFault`]).

use super::config::{Progress, ScenarioConfig};
use super::connectors::multi::{Completions, MultiConnector, Verdict};
use super::connectors::nixl::NixlConnector;
use super::connectors::tier::{PoolSide, TierConnector};
use super::fault::TestFault;
use super::scheduler::{BlockManager, DecodeBlocks, Request, RequestState};
use super::shadow::{Answer, Content, EngineId, Event, Shadow, What, attribute, ident};
use crate::error::{Error, Result};
use crate::fingerprint::{self, SKIP_GEN};
use crate::geometry::SliceCoord;
use crate::pool::TableEntry;
use crate::race::{Mechanism, Races};
use crate::report::{Failure, Interval, Report, ScenarioReport};
use crate::tier::{EntryId, Store, TierKind};
use crate::transport::Endpoint;
use crate::verify;
use crate::workload::Workload;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

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
    if let Some(t) = e.tier.as_mut() {
        t.clean_up();
    }
    if r.is_ok() && report.summary.blocks_checked == 0 {
        r = Err(Error::Usage(format!(
            "nothing was verified: {} admitted, {} aborted, none reached decode (raise --requests or --duration, lower --abort-rate)",
            crate::units::plural(e.admitted, "request"),
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
    /// The tier connector (scenarios with a tier).
    tier: Option<TierConnector>,
    /// The NIXL connector (scenarios that move blocks over NIXL).
    nixl: NixlConnector,
    /// Decides when prefill's blocks of a request may be freed.
    multi: MultiConnector,
    /// What every prefill block holds, and the attribution counts.
    shadow: Shadow,
    workload: Workload,
    rng: ChaCha8Rng,
    now: u64,
    next_gen: u32,
    /// Prefill's block manager.
    blocks: BlockManager,
    /// Decode's free blocks.
    dblocks: DecodeBlocks,
    reqs: HashMap<u64, Request>,
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
    intervals: Vec<Interval>,
    started: Instant,
    stop_admitting: bool,
    last_progress: Instant,
    busy_secs: f64,
    listed_explained: u64,
    listed_unexplained: u64,
    fill_secs: f64,
    poison_secs: f64,
    /// Test-only fault (`KVPROBE_TEST_FAULT`) and how many are left to plant.
    fault: Option<(TestFault, u64)>,
    /// Events told to the shadow so far, by engine (prefill, decode).
    seq: [u64; 2],
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
        let tier = match cfg.scenario.uses_tier() {
            true => Some(TierConnector::start(cfg, seed, &prefill.pool, &decode.pool, timeout)?),
            false => None,
        };
        // Genesis: every prefill block holds a fingerprint no request will ask for.
        let genesis: Vec<TableEntry> =
            (0..n).map(|i| TableEntry { block: crate::fingerprint::logical_block(seed, i), generation: 0 }).collect();
        prefill.pool.fill(&genesis)?;
        let decode_blocks = decode.pool.geometry().num_blocks;
        Ok(Engine {
            cfg: cfg.clone(),
            races: cfg.races(),
            seed,
            prefill,
            decode,
            timeout,
            max_failures,
            dump: None,
            tier,
            nixl: NixlConnector::new(),
            multi: MultiConnector::new(cfg.scenario, cfg.races()),
            shadow: Shadow::new(&genesis),
            workload: Workload::new(cfg.workload, seed),
            rng: ChaCha8Rng::seed_from_u64(seed ^ 0x656E_6769_6E65),
            now: 0,
            next_gen: 0,
            blocks: BlockManager::new(n),
            dblocks: DecodeBlocks::new(decode_blocks),
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
            intervals: Vec::new(),
            started: Instant::now(),
            stop_admitting: false,
            last_progress: Instant::now(),
            busy_secs: 0.0,
            listed_explained: 0,
            listed_unexplained: 0,
            fill_secs: 0.0,
            poison_secs: 0.0,
            fault: TestFault::from_env()?,
            seq: [0, 0],
        })
    }

    fn lag(&mut self, max: u64) -> u64 {
        self.now + self.rng.random_range(0..=max)
    }

    /// The tier's store (scenarios with a tier).
    fn store(&self) -> &Store {
        &self.tier.as_ref().expect("the scenario has a tier").store
    }

    /// The tier's store, to change (scenarios with a tier).
    fn store_mut(&mut self) -> &mut Store {
        &mut self.tier.as_mut().expect("the scenario has a tier").store
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
        crate::report::publish(report);
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
                crate::report::publish(report);
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
        let waiting: Vec<u64> = self.order.iter().copied().filter(|id| self.reqs[id].stage == RequestState::Lookup).collect();
        for id in waiting {
            if let Some(r) = self.reqs.remove(&id) {
                if let Some(store) = self.tier.as_mut().map(|t| &mut t.store) {
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
        self.reqs.values().any(|r| r.stage == RequestState::Lookup)
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
            && let Some(t) = self.tier.as_mut()
        {
            t.check_master()?;
        }
        self.poll_nixl(report)?;
        self.run_compute()?;
        self.run_loads(PoolSide::Prefill)?;
        self.run_puts()?;
        self.run_loads(PoolSide::Decode)?;
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
                r.stage = RequestState::Verify;
                self.read_done(id)?;
            }
        }
        Ok(())
    }

    /// A READ of request `id` completed: closes its windows on its prefill blocks in the
    /// shadow (what was written into them while it was in flight).
    fn read_done(&mut self, id: u64) -> Result<()> {
        let Some(r) = self.reqs.get(&id) else { return Ok(()) };
        let blocks = r.pslots.clone();
        match self.observe(EngineId::Decode, What::ReadDone { req: id, blocks })? {
            Answer::During(d) => self.reqs.get_mut(&id).expect("live request").during = d,
            a => unreachable!("a READ's end is answered with its windows, not {a:?}"),
        }
        Ok(())
    }

    /// Tells the shadow what `engine` did, stamped with the step and the engine's next
    /// sequence number. Errors: as [`Shadow::observe`].
    fn observe(&mut self, engine: EngineId, what: What) -> Result<Answer> {
        let k = engine as usize;
        self.seq[k] += 1;
        self.shadow.observe(Event { engine, step: self.now, seq: self.seq[k], what })
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
            if let Some(id) = self.nixl.request_of(&msg) {
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
            let p = self.blocks.get_mut(s);
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
            r.stage = RequestState::Verify;
            self.read_done(id)?;
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
        let p = self.blocks.get(slot);
        let foreign_reader = p.reading > 0 && p.owner == Some(req) && p.early.is_some();
        let cause = explicit.or(if p.owner != Some(req) && p.hazard { Some(Mechanism::UnfencedLoad) } else { None }).or(p.early);
        if foreign_reader && let Some(m) = p.early {
            self.shadow.window(m);
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
        let n = self.blocks.blocks.len();
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
            let b = self.blocks.get(op.slot);
            let stale_landing = b.owner != Some(op.req) && b.hazard;
            if stale_landing {
                self.shadow.window(Mechanism::UnfencedLoad);
            }
            let c = self.write_stamp(op.slot, op.req, id, None);
            self.observe(EngineId::Prefill, What::Write { block: op.slot, content: c })?;
            let p = self.blocks.get_mut(op.slot);
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

    fn run_loads(&mut self, side: PoolSide) -> Result<()> {
        loop {
            let q = if side == PoolSide::Prefill { &self.pload } else { &self.dload };
            let Some(&op) = q.front() else { break };
            if op.due > self.now {
                break;
            }
            let OpKind::Load { entry, index, .. } = op.kind else { unreachable!("load queue holds loads") };
            if side == PoolSide::Prefill && self.blocks.get(op.slot).pending_compute > 0 {
                if self.races.unfenced(Mechanism::UnfencedLoad) {
                    self.shadow.window(Mechanism::UnfencedLoad);
                    self.blocks.get_mut(op.slot).hazard = true;
                } else {
                    break; // event fence: wait for the previous owner's write
                }
            }
            if side == PoolSide::Prefill {
                self.pload.pop_front()
            } else {
                self.dload.pop_front()
            };
            let content = self.store().content(entry).expect("loads read complete entries");
            let pool = if side == PoolSide::Prefill { &mut self.prefill.pool } else { &mut self.decode.pool };
            self.tier.as_mut().expect("loads need the tier").load(pool, side, op.slot, entry)?;
            self.loads += 1;
            match side {
                PoolSide::Prefill => {
                    self.store_mut().unpin(entry);
                    let stamped = self.write_stamp(op.slot, op.req, content.id, content.cause);
                    self.observe(EngineId::Prefill, What::Write { block: op.slot, content: stamped })?;
                    self.blocks.get_mut(op.slot).pending_load -= 1;
                    if let Some(r) = self.reqs.get_mut(&op.req) {
                        r.pending_writes = r.pending_writes.saturating_sub(1);
                    }
                }
                PoolSide::Decode => {
                    if let Some(r) = self.reqs.get_mut(&op.req) {
                        r.delivered[index] = content;
                        r.dloads_left -= 1;
                        if r.dloads_left == 0 {
                            r.stage = RequestState::Verify;
                        }
                    }
                }
            }
        }
        Ok(())
    }

    fn execute_put(&mut self, op: Op) -> Result<()> {
        let OpKind::Save { entry, promised } = op.kind else { unreachable!("put queue holds saves") };
        let early = self.blocks.get(op.slot).early;
        let mut content = self.shadow.content(op.slot);
        self.tier.as_mut().expect("saves need the tier").save(&mut self.prefill.pool, op.slot, entry)?;
        if content.id != promised {
            // The copy is not what the key promises: say which missing fence let it happen.
            // (None would be a flaw in kvprobe's own model; the decode side then reports
            // the slice as unexplained.)
            content.cause = op.cause.or(content.cause).or(early);
            if let Some(m) = content.cause {
                self.shadow.window(m);
            }
        }
        let nixl = self.cfg.scenario.uses_nixl();
        let store = self.store_mut();
        store.complete(entry, content);
        if !nixl {
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
            let p = self.blocks.get(op.slot);
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
            let p = self.blocks.get_mut(s);
            if p.owner != Some(id) {
                continue; // handed to a load early (load-into-reading)
            }
            p.owner = None;
            p.in_early_list = false;
            // A slot handed on early keeps its taint while an earlier owner's READ of it is
            // still pending (e.g. load-into-reading: the borrower finishes first).
            p.early = early.or(if p.reading > 0 { p.early } else { None });
            self.blocks.free.push(s);
        }
    }

    fn advance(&mut self) -> Result<()> {
        let sc = self.cfg.scenario;
        let mut finished = Vec::new();
        let mut to_release = Vec::new();
        for &id in &self.order {
            let r = self.reqs.get_mut(&id).expect("ordered request");
            if r.stage == RequestState::Prefill && r.pending_writes == 0 {
                r.stage = RequestState::WaitDecode;
                r.ready_at = self.now + self.rng.random_range(0..=2);
                if sc.uses_nixl() {
                    for &s in &r.pslots {
                        self.blocks.get_mut(s).reading += 1;
                    }
                }
            }
            if r.released || r.stage == RequestState::Lookup || r.stage == RequestState::Prefill {
                if r.released && r.stage == RequestState::Done {
                    finished.push(id);
                }
                continue;
            }
            let done = Completions {
                nixl: !sc.uses_nixl() || r.read_notified,
                tier: r.saves_left == 0,
                had_saves: r.had_saves,
                lent: r.early_listed,
            };
            match self.multi.verdict(done) {
                Verdict::Hold => {}
                Verdict::Free(early) => to_release.push((id, early)),
                Verdict::Lend => {
                    r.early_listed = true;
                    for &s in &r.pslots {
                        if self.blocks.get(s).owner == Some(id) {
                            self.blocks.get_mut(s).early = Some(Mechanism::LoadIntoReading);
                            self.blocks.lend_early(s);
                        }
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
                self.dblocks.free(s);
            }
            if !self.cfg.scenario.uses_nixl()
                && let Some(store) = self.tier.as_mut().map(|t| &mut t.store)
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
            if r.stage != RequestState::WaitDecode || r.ready_at > self.now || r.spec.abort {
                continue;
            }
            if !sc.uses_nixl() {
                let store = self.tier.as_ref().map(|t| &t.store).expect("tier");
                let ready = r.saves_left == 0 && r.entries.iter().all(|e| e.is_some_and(|e| store.content(e).is_some()));
                if !ready {
                    continue;
                }
            }
            let Some(d) = self.dblocks.alloc(r.pslots.len()) else {
                break; // decode is full; keep order
            };
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
        let posted: Vec<u64> = starting.iter().map(|(id, _)| *id).collect();
        for (id, d) in starting {
            let lag = self.rng.random_range(0..=1u64);
            let r = self.reqs.get_mut(&id).expect("starting request");
            r.poison_iter = iter;
            r.dslots = d;
            r.stage = RequestState::Decoding;
            if sc.uses_nixl() {
                let pairs = NixlConnector::read_pairs(&g, &r.pslots, &r.dslots)?;
                let blocks = r.pslots.clone();
                let Answer::AtPost(at_post) = self.observe(EngineId::Decode, What::ReadPosted { req: id, blocks })? else {
                    unreachable!("a READ's post is answered with the blocks' contents")
                };
                let r = self.reqs.get_mut(&id).expect("starting request");
                r.at_post = at_post;
                let x = self.nixl.post_read(self.decode, &pairs, id, self.timeout)?;
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
        let ids: Vec<u64> = self.order.iter().copied().filter(|id| self.reqs[id].stage == RequestState::Verify).collect();
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
                let expect = if sc.uses_nixl() { r.promised[i] } else { self.store().promised(r.entries[i].expect("entry")) };
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
            self.shadow.count(cause, v.class);
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
            r.stage = RequestState::Done;
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

    fn admit(&mut self) -> Result<()> {
        // Requests whose lookup completed last step start their prefill now.
        let ready: Vec<u64> = self.order.iter().copied().filter(|id| self.reqs[id].stage == RequestState::Lookup).collect();
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
            let hits = match (self.tier.as_mut(), spec.abort) {
                (Some(t), false) => t.store.lookup_prefix(&spec.hashes),
                _ => Vec::new(),
            };
            self.reqs.insert(
                id,
                Request {
                    spec,
                    stage: RequestState::Lookup,
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
        let Some(mut slots) = self.blocks.alloc(k, true) else {
            return Ok(false);
        };
        let Some(rest) = self.blocks.alloc(n - k, false) else {
            self.blocks.give_back(slots);
            return Ok(false);
        };
        slots.extend(rest);
        let sc = self.cfg.scenario;
        let mut r = self.reqs.remove(&id).expect("request");
        let mut promised = Vec::with_capacity(n);
        for (i, &s) in slots.iter().enumerate() {
            self.blocks.get_mut(s).owner = Some(id);
            if i < k {
                let e = r.hits[i];
                promised.push(self.store().promised(e));
                r.entries[i] = Some(e);
                if !sc.uses_nixl() {
                    self.store_mut().pin(e); // kept for decode's load
                }
                let due = self.lag(2);
                self.pload.push_back(Op { due, req: id, slot: s, cause: None, kind: OpKind::Load { entry: e, index: i } });
                self.blocks.get_mut(s).pending_load += 1;
                self.hit_blocks += 1;
            } else {
                // Generations run 1..SKIP_GEN (exclusive): 0 is never computed and SKIP_GEN marks
                // "neither fill nor verify" in the kernels' tables.
                self.next_gen = fingerprint::next_generation(self.next_gen);
                let t = TableEntry { block: r.spec.hashes[i], generation: self.next_gen };
                promised.push(t);
                let due = self.lag(2).max(self.compute.back().map_or(0, |o| o.due));
                self.compute.push_back(Op { due, req: id, slot: s, cause: None, kind: OpKind::Fill { id: t } });
                self.blocks.get_mut(s).pending_compute += 1;
            }
            r.pending_writes += 1;
        }
        r.pslots = slots;
        r.promised = promised;
        r.stage = RequestState::Prefill;
        if abort {
            // The client went away: vLLM frees the blocks at once; the compute stream
            // still runs the issued writes.
            self.aborted += 1;
            self.reqs.insert(id, r);
            self.order.retain(|&x| x != id);
            let rr = self.reqs.remove(&id).expect("aborted");
            for s in rr.pslots {
                self.blocks.get_mut(s).owner = None;
                self.blocks.free.push(s);
            }
            return Ok(true);
        }
        // Saves of computed blocks (keys not yet stored).
        let mut immediate = Vec::new();
        if let Some(store) = self.tier.as_mut().map(|t| &mut t.store) {
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
        if let Some(t) = self.tier.as_mut() {
            t.drop_evicted(self.now)?;
        }
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
        let races = self.shadow.outcomes(&self.races);
        let store = self.tier.as_ref().map(|t| &t.store);
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
            tier_detail: self.tier.as_ref().map_or_else(|| "none".into(), |t| t.detail()),
            unexplained_corrupt: self.shadow.unexplained,
            races,
            intervals: self.intervals.clone(),
        });
    }
}

/// Steps until a save runs: usually 0–3, but one in four waits 16–96 steps behind a
/// backlog (a store's puts are slower than NIXL under sustained load: about 1 GB/s for
/// Mooncake over TCP against hundreds of GB/s for cuda_ipc).
fn put_lag(rng: &mut ChaCha8Rng) -> u64 {
    if rng.random_range(0..4u32) == 0 { rng.random_range(16..=96) } else { rng.random_range(0..=3) }
}
