//! The prefill engine of a scenario: vLLM's prefill instance with its scheduler, its
//! MultiConnector (NixlConnector as kv_producer, the tier connector as kv_both) and its KV
//! pool. It admits the requests, computes or loads their blocks, saves computed blocks to the
//! tier, hands each request's blocks to decode, and frees them when every connector that
//! touched them has reported done (the NIXL notification of decode's READ, the saves).
//!
//! It talks to the decode engine only by messages ([`crate::peer::steps`]): one
//! [`StepIn`] in, one [`StepOut`] out per step. `kvprobe serve` hosts it (a node pair, the
//! child of `--decode-process`, or a thread of decode's process), driven over the peer
//! protocol by decode ([`super::decode`]).
//!
//! # A step
//! 1. What decode did: READs posted (the notification wait starts), requests finished.
//!    `--lockstep`: the notifications of the READs decode completed are taken first.
//! 2. NIXL: the agent's notifications (a decode READ is done; vLLM's NixlConnector frees
//!    then), each READ's notification bounded by `--timeout`.
//! 3. The three prefill streams run the operations that are due: the compute stream
//!    (fingerprint writes of computed blocks, in order), the load stream (tier loads of prefix
//!    hits into newly allocated blocks) and the put worker (async saves). Each operation is
//!    due a seeded 0–3 steps after it was issued (a quarter of the saves 16–96 steps, a
//!    backlogged store), which is how asynchrony is modelled.
//! 4. Requests move on: a request whose writes are done is handed to decode (tier-only: once
//!    its saves are complete); the multi-connector decides when its blocks are freed; a
//!    request freed here and finished at decode is retired.
//! 5. New requests are admitted up to `--concurrency`: the tier lookup of the prompt's
//!    leading block hashes completes a step later (lookup_async), then hits are loaded and
//!    the rest computed, and computed blocks are saved.
//!
//! Push mode (`--op write`): decode's step names the blocks to WRITE a handed request into;
//! prefill posts the WRITE 0–2 steps later (one in eight `--decode-delay` later) and completes
//! it within its step ([`What::Pushed`]). `--host-staging`: prefill computes into a KV cache
//! of its own, chunked, and stages landed blocks into the pool decode READs each step
//! (partial-staging: only at the first staging call of a request); the shadow then follows
//! the staging copies.
//!
//! Every write into a prefill block is an [`Event`] for decode's shadow, stamped with the
//! unfenced mechanism that allowed it, if one did; so is each time an unfenced mechanism lets
//! a conflicting copy happen (a window).

use super::config::ScenarioConfig;
use super::connectors::multi::{Completions, MultiConnector, Verdict};
use super::connectors::nixl::NixlConnector;
use super::connectors::tier::{TierConnector, TierPlace};
use super::scheduler::{BlockManager, Request, RequestState};
use super::state::StateLane;
use crate::core::fingerprint::{self, SKIP_GEN};
use crate::core::mechanism::{Mechanism, Races};
use crate::core::workload::Workload;
use crate::error::{Error, Result};
use crate::mem::pool::{KvPool, TableEntry};
use crate::mem::tier::{Content, EntryId, Store};
use crate::peer::steps::{EngineId, Event, Handed, PrefillCounters, StepIn, StepOut, TierAccess, TierRef, What};
use crate::sys::deadline::Deadline;
use crate::xfer::transport::Endpoint;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

#[derive(Clone, Copy, Debug)]
enum OpKind {
    Fill { id: TableEntry },
    Load { entry: EntryId },
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

/// The prefill engine of one scenario run.
pub struct PrefillEngine<'a> {
    cfg: ScenarioConfig,
    races: Races,
    ep: &'a mut Endpoint,
    timeout: Duration,
    /// The tier connector (scenarios with a tier).
    tier: Option<TierConnector>,
    /// The NIXL connector: which notification is which request's.
    nixl: NixlConnector,
    /// `--host-staging`: the KV cache prefill computes into (a pool of its own, of the
    /// registered pool's memory); the registered pool is then the staging buffer decode
    /// READs, written only by staging copies.
    device: Option<KvPool>,
    /// `--host-staging`: what each block of the staging buffer holds.
    host: Vec<Content>,
    /// The run's seed (fingerprints).
    seed: u64,
    /// `--inject bitflip|stale` faults still to plant, in order, and the draws of where.
    to_plant: VecDeque<crate::core::inject::Kind>,
    inject_rng: ChaCha8Rng,
    /// Decides when a request's blocks may be freed.
    multi: MultiConnector,
    /// What each prefill block holds, as this engine wrote it (what a save copies).
    contents: Vec<Content>,
    workload: Workload,
    rng: ChaCha8Rng,
    now: u64,
    next_gen: u32,
    blocks: BlockManager,
    reqs: HashMap<u64, Request>,
    order: Vec<u64>,
    compute: VecDeque<Op>,
    pload: VecDeque<Op>,
    puts: VecDeque<Op>,
    counters: PrefillCounters,
    /// Events of this engine so far.
    seq: u64,
    /// This step's events and hand-overs.
    out: StepOut,
    /// Set once decode ended the run or went away ([`crate::peer::Link::ended`]).
    ended: std::sync::Arc<std::sync::atomic::AtomicBool>,
    /// Duplicate completions still to be delivered (duplicate-completion, unfenced): (due
    /// step, request, the blocks it held).
    duplicates: Vec<(u64, u64, Vec<u32>)>,
    /// Test-only (`KVPROBE_TEST_FAULT=early-free:N`): hand-overs left whose blocks are freed at
    /// once, with no mechanism to blame ([`super::fault::TestFault::EarlyFree`]).
    early_frees: u64,
    /// A hybrid model's state lanes ([`super::state`]): each lane's pool and NIXL agent
    /// (connected to decode's agent of it).
    state: Vec<(StateLane, Endpoint)>,
    /// Free state slots (one per request from admission to retirement; taken from the end).
    state_free: Vec<u32>,
}

impl<'a> PrefillEngine<'a> {
    /// Starts the prefill engine of `cfg` on `ep` (prefill's endpoint, connected to decode's):
    /// its tier at `place`, and the genesis fill — every block holds a fingerprint no request
    /// asks for ([`crate::core::fingerprint::logical_block`] of the seed and the block, generation
    /// 0). `tag` is the prefix of decode's READ notifications. `state`: a hybrid model's state
    /// lanes, each with prefill's pool (every slot holding its genesis state) and NIXL agent,
    /// connected to decode's (empty for an attention-only model). Returns the engine, how
    /// decode reaches the tier (`None` without one) and the tier in words.
    ///
    /// Errors: set-up (exit 2) for a broken Mooncake install, transport (exit 3) when the
    /// tier cannot be started or joined, device errors of the fill.
    pub fn start(
        cfg: &ScenarioConfig,
        seed: u64,
        ep: &'a mut Endpoint,
        tag: &str,
        timeout: Duration,
        place: &TierPlace,
        state: Vec<(StateLane, Endpoint)>,
    ) -> Result<(PrefillEngine<'a>, Option<TierAccess>, String)> {
        let n = ep.pool.geometry().num_blocks;
        let device = if cfg.staging { Some(ep.pool.sibling()?) } else { None };
        // The tier saves from and loads into the KV cache prefill computes into.
        let kv = device.as_ref().unwrap_or(&ep.pool);
        let (tier, access) = match cfg.scenario.uses_tier() {
            true => {
                let (t, a) = TierConnector::start(cfg, seed, kv, timeout, place)?;
                (Some(t), Some(a))
            }
            false => (None, None),
        };
        let detail = tier.as_ref().map_or_else(|| "none".to_string(), |t| t.detail());
        let genesis: Vec<TableEntry> = (0..n).map(|i| TableEntry::new(fingerprint::logical_block(seed, i), 0)).collect();
        ep.pool.fill(&genesis)?;
        let mut device = device;
        if let Some(d) = device.as_mut() {
            d.fill(&genesis)?;
        }
        let e = PrefillEngine {
            cfg: cfg.clone(),
            races: cfg.races(),
            ep,
            timeout,
            tier,
            nixl: NixlConnector::with_tag(tag),
            device,
            host: genesis.iter().map(|&id| Content { id, cause: None }).collect(),
            seed,
            to_plant: cfg
                .inject
                .iter()
                .filter(|s| matches!(s.kind, crate::core::inject::Kind::Bitflip | crate::core::inject::Kind::Stale))
                .flat_map(|s| std::iter::repeat_n(s.kind, s.count as usize))
                .collect(),
            inject_rng: ChaCha8Rng::seed_from_u64(seed ^ 0x7072_6566_696C),
            multi: MultiConnector::new(cfg.scenario, cfg.races()),
            contents: genesis.iter().map(|&id| Content { id, cause: None }).collect(),
            workload: Workload::new(cfg.workload, seed),
            rng: ChaCha8Rng::seed_from_u64(seed ^ 0x656E_6769_6E65),
            now: 0,
            next_gen: 0,
            blocks: BlockManager::new(n),
            reqs: HashMap::new(),
            order: Vec::new(),
            compute: VecDeque::new(),
            pload: VecDeque::new(),
            puts: VecDeque::new(),
            counters: PrefillCounters::default(),
            seq: 0,
            out: StepOut::default(),
            ended: place.ended.clone(),
            duplicates: Vec::new(),
            early_frees: match super::fault::TestFault::from_env()? {
                Some((super::fault::TestFault::EarlyFree, n)) => n,
                _ => 0,
            },
            state_free: state.first().map_or_else(Vec::new, |(l, _)| (0..l.slots).rev().collect()),
            state,
        };
        Ok((e, access, detail))
    }

    /// Runs one step after what decode did (`input`); returns what this engine did.
    ///
    /// Errors: transport (exit 3: NIXL, the tier, a master that died, a message naming a
    /// request decode cannot know), timeout (exit 4: a READ's notification missing past
    /// `--timeout`), device errors.
    pub fn step(&mut self, input: StepIn) -> Result<StepOut> {
        self.now += 1;
        if self.now.is_multiple_of(256)
            && let Some(t) = self.tier.as_mut()
        {
            t.check_master()?;
        }
        for &id in &input.posted {
            let deadline = Deadline::after(self.timeout);
            let r = self.handed(id, "a READ posted")?;
            r.read_posted = true;
            r.read_deadline = Some(deadline);
        }
        for &id in &input.read_done {
            if !self.handed(id, "a READ completed")?.read_posted {
                return Err(Error::Transport(format!(
                    "decode reported request {id}'s READ complete without having posted it (a protocol error)"
                )));
            }
        }
        for &id in &input.finished {
            self.handed(id, "a request finished")?.finished = true;
        }
        self.take_pushes(&input.push)?;
        if !input.admit && !self.counters.stopped {
            self.counters.stopped = true;
            if self.cfg.duration_secs.is_some() {
                self.cancel_waiting();
            }
        }
        if self.cfg.scenario.uses_nixl() && !self.cfg.push {
            self.await_notifications(&input.read_done)?;
            let asked = Instant::now();
            self.take_notifications()?;
            self.check_notification_deadlines(asked)?;
            self.deliver_duplicates();
        }
        // Decode's state READs notify the lanes' agents; prefill frees a state slot when decode
        // has verified its request, so the messages are only taken off the queue.
        for (_, ep) in &self.state {
            ep.notifications()?;
        }
        self.run_compute()?;
        self.run_loads()?;
        self.run_puts()?;
        self.run_pushes()?;
        self.advance()?;
        self.admit()?;
        if self.cfg.duration_secs.is_none() && self.counters.admitted >= self.cfg.requests {
            self.counters.stopped = true;
        }
        self.counters.steps = self.now;
        self.counters.evictions = self.tier.as_ref().map_or(0, |t| t.store.evictions);
        let mut out = std::mem::take(&mut self.out);
        out.counters = self.counters.clone();
        out.drained = self.counters.stopped && self.reqs.is_empty() && self.queues_empty();
        Ok(out)
    }

    /// Ends the engine: removes this run's objects from a Mooncake deployment kvprobe did not
    /// start (the tier, a master kvprobe started, and prefill's store client go with it).
    /// Returns the final counts.
    pub fn finish(mut self) -> PrefillCounters {
        if let Some(t) = self.tier.as_mut() {
            t.clean_up();
        }
        self.counters.clone()
    }

    /// The live request `id` that was handed to decode (what decode names must be one).
    /// Errors: transport (exit 3) naming `what` otherwise.
    fn handed(&mut self, id: u64, what: &str) -> Result<&mut Request> {
        match self.reqs.get_mut(&id) {
            Some(r) if r.stage == RequestState::Handed => Ok(r),
            _ => Err(Error::Transport(format!(
                "decode reported {what} for request {id}, which prefill has not handed to it (a protocol error)"
            ))),
        }
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

    fn queues_empty(&self) -> bool {
        self.compute.is_empty() && self.pload.is_empty() && self.puts.is_empty()
    }

    /// Appends an event of this engine for decode's shadow.
    fn event(&mut self, what: What) {
        self.seq += 1;
        self.out.events.push(Event { engine: EngineId::Prefill, step: self.now, seq: self.seq, what });
    }

    /// `--inject bitflip|stale` under request load, at request `id`'s hand-over (its writes
    /// and, with `--host-staging`, its staging done): with faults of those kinds left, one
    /// hand-over in four (seeded) gets the next, in one seeded slice of a block whose tier
    /// save is not queued (a save would carry the fault to later prefix hits): `bitflip`
    /// flips one bit of it, `stale` rewrites it with the block's previous generation. The
    /// pool decode reads is changed (the staging buffer with `--host-staging`), nothing else.
    /// Returns what was planted, for decode. Errors: device errors of the slice copies.
    fn plant_source_fault(&mut self, id: u64) -> Result<Vec<crate::peer::steps::SourceFault>> {
        use crate::core::inject::Kind;
        let Some(&kind) = self.to_plant.front() else { return Ok(Vec::new()) };
        if self.inject_rng.random_range(0..4u32) != 0 || !self.cfg.scenario.uses_nixl() {
            return Ok(Vec::new());
        }
        let r = &self.reqs[&id];
        let free: Vec<usize> = (0..r.pslots.len()).filter(|&i| !self.puts.iter().any(|o| o.slot == r.pslots[i])).collect();
        if free.is_empty() {
            return Ok(Vec::new());
        }
        let g = self.ep.pool.geometry().clone();
        let index = free[self.inject_rng.random_range(0..free.len())];
        let layer = self.inject_rng.random_range(0..g.num_layers);
        let kv = g.parts()[self.inject_rng.random_range(0..g.parts().len())];
        let c = crate::core::geometry::SliceCoord { layer, kv, block: r.pslots[index] };
        let promised = r.promised[index];
        let sb = g.slice_bytes()?;
        let mut buf = vec![0u8; sb as usize];
        let mut flip = None;
        let bytes = match kind {
            Kind::Bitflip => {
                self.ep.pool.read_slice(c, &mut buf)?;
                let at = self.inject_rng.random_range(0..buf.len());
                let bit = self.inject_rng.random_range(0..8u32);
                buf[at] ^= 1 << bit;
                flip = Some((at as u64, bit as u8));
                buf
            }
            Kind::Stale => {
                let old = TableEntry { generation: promised.generation.wrapping_sub(1), ..promised };
                fingerprint::expected(self.seed, &self.ep.pool.rows_of(&old, c))
            }
            _ => unreachable!("prefill plants bitflip and stale only"),
        };
        self.ep.pool.write_slice(c, &bytes)?;
        self.to_plant.pop_front();
        Ok(vec![crate::peer::steps::SourceFault { index: index as u32, layer, kv, kind, flip }])
    }

    /// Unfenced mechanism `m` let a conflicting copy happen once more.
    fn window(&mut self, m: Mechanism) {
        self.event(What::Window { mechanism: m });
    }

    /// Block `block` now holds `content` (a computed fill or a tier load landed there).
    /// With `--host-staging` that is the KV cache, which decode does not READ: its shadow
    /// learns of the staging copies instead ([`PrefillEngine::stage`]).
    fn wrote(&mut self, block: u32, content: Content) {
        self.contents[block as usize] = content;
        if self.device.is_none() {
            self.event(What::Write { block, content });
        }
    }

    /// `--host-staging`: copies request `id`'s blocks whose writes have landed and that are
    /// not staged yet from the KV cache into the staging buffer decode READs (vLLM's
    /// `save_kv_to_host` after each chunk). Unfenced partial-staging stages only at the
    /// first call that finds some (the first chunk's). Errors: device errors of the copy.
    fn stage(&mut self, id: u64) -> Result<()> {
        let unfenced = self.races.unfenced(Mechanism::PartialStaging);
        let r = &self.reqs[&id];
        if unfenced && r.stage_calls > 0 {
            return Ok(());
        }
        let ready: Vec<(usize, u32)> = r
            .pslots
            .iter()
            .enumerate()
            .filter(|&(i, &s)| {
                let b = self.blocks.get(s);
                !r.staged[i] && b.owner == Some(id) && b.owner_wrote && b.pending_compute + b.pending_load == 0
            })
            .map(|(i, &s)| (i, s))
            .collect();
        if ready.is_empty() {
            return Ok(());
        }
        let mut buf = vec![0u8; self.ep.pool.block_bytes() as usize];
        for &(i, s) in &ready {
            self.device.as_ref().expect("staging needs the KV cache").read_block(s, &mut buf)?;
            self.ep.pool.write_block(s, &buf)?;
            let c = self.contents[s as usize];
            self.host[s as usize] = c;
            self.event(What::Write { block: s, content: c });
            self.reqs.get_mut(&id).expect("staged request").staged[i] = true;
        }
        self.reqs.get_mut(&id).expect("staged request").stage_calls += 1;
        Ok(())
    }

    /// `--host-staging`, unfenced partial-staging, at request `id`'s hand-over: the blocks
    /// never staged are READ as the staging buffer holds them (an earlier request's copy),
    /// which that mechanism let happen: the shadow's content of each is stamped with it.
    fn unstaged_at_hand_over(&mut self, id: u64) {
        let r = &self.reqs[&id];
        let left: Vec<u32> = r.pslots.iter().enumerate().filter(|&(i, _)| !r.staged[i]).map(|(_, &s)| s).collect();
        if left.is_empty() {
            return;
        }
        self.window(Mechanism::PartialStaging);
        for s in left {
            let c = Content { cause: Some(Mechanism::PartialStaging), ..self.host[s as usize] };
            self.host[s as usize] = c;
            self.event(What::Write { block: s, content: c });
        }
    }

    /// At the end of a `--duration`: requests still waiting for prefill blocks never
    /// started; they are dropped (not counted as admitted) so the drain only finishes work
    /// in progress.
    fn cancel_waiting(&mut self) {
        let waiting: Vec<u64> = self.order.iter().copied().filter(|id| self.reqs[id].stage == RequestState::Lookup).collect();
        for id in waiting {
            if let Some(r) = self.reqs.remove(&id) {
                self.state_free.extend(r.state_slot);
                if let Some(store) = self.tier.as_mut().map(|t| &mut t.store) {
                    for e in r.hits {
                        store.unpin(e);
                    }
                }
                self.counters.admitted -= 1;
            }
        }
        self.order.retain(|id| self.reqs.contains_key(id));
    }

    // ---- NIXL ----

    /// Push mode: decode's requests to WRITE handed requests into the decode blocks it
    /// names. Each is due a seeded 0–2 steps later; one in eight waits `--decode-delay`
    /// steps more (a prefill instance busy with others; drawn for every push, so that the
    /// rows of a matrix draw alike). Errors: transport (exit 3) for a push outside push mode,
    /// of a request not handed over or already asked for, or with blocks that do not match.
    fn take_pushes(&mut self, pushes: &[crate::peer::steps::Push]) -> Result<()> {
        let n = self.blocks.blocks.len() as u32;
        for p in pushes {
            // A hybrid model's push names decode's state slot (one of its lanes' slots).
            let lanes = self.state.first().map(|(l, _)| l.slots);
            let state_bad = match (p.state_slot, lanes) {
                (None, None) => false,
                (Some(s), Some(n)) => s >= n,
                _ => true,
            };
            let slow = self.rng.random_range(0..8u32) == 0;
            let lag = self.rng.random_range(0..=2u64) + if slow { self.cfg.decode_delay_steps as u64 } else { 0 };
            let push = self.cfg.push;
            let now = self.now;
            let r = self.handed(p.req, "a push")?;
            let bad = if !push {
                Some("outside push mode".to_string())
            } else if r.read_posted {
                Some("a second time".to_string())
            } else if p.blocks.len() != r.pslots.len() || p.blocks.iter().any(|&b| b >= n) {
                Some(format!("with {} decode blocks for {} (pool of {n})", p.blocks.len(), r.pslots.len()))
            } else if state_bad {
                Some(format!("with state slot {:?} ({} slots)", p.state_slot, lanes.unwrap_or(0)))
            } else {
                None
            };
            if let Some(w) = bad {
                return Err(Error::Transport(format!("decode asked for request {}'s WRITE {w} (a protocol error)", p.req)));
            }
            r.read_posted = true;
            r.push_state = p.state_slot;
            r.push_dst = p.blocks.clone();
            r.push_at = Some(now + lag);
        }
        Ok(())
    }

    /// Push mode: posts each WRITE that is due, prefill blocks into decode's, with the
    /// request's notification for decode, and completes it within the step (bounded by
    /// `--timeout`); decode's shadow learns what landed ([`What::Pushed`]). The WRITE's
    /// completion is the NIXL connector's: the request's blocks may go once the others are
    /// done too. A request whose blocks were freed meanwhile (an unfenced mechanism) is
    /// still written: its WRITE reads whatever they hold now.
    /// Errors: transport (exit 3), timeout (exit 4).
    fn run_pushes(&mut self) -> Result<()> {
        if !self.cfg.push {
            return Ok(());
        }
        let due: Vec<u64> =
            self.order.iter().copied().filter(|id| self.reqs[id].push_at.is_some_and(|t| t <= self.now)).collect();
        if due.is_empty() {
            return Ok(());
        }
        let g = self.ep.pool.geometry().clone();
        let t = Instant::now();
        // All posted, then all completed: they overlap one another, never a write of
        // prefill's (two into one decode block land in either order).
        let mut posted = Vec::with_capacity(due.len());
        for id in due {
            let r = self.reqs.get_mut(&id).expect("ordered request");
            r.push_at = None;
            let (blocks, dst, states) = (r.pslots.clone(), r.push_dst.clone(), r.state_slot.zip(r.push_state));
            let pairs = NixlConnector::read_pairs(&g, &blocks, &dst)?;
            let tag = format!("{}{id}", self.nixl.tag());
            let x = self.ep.post_as_initiator(crate::xfer::transport::Op::Write, &pairs, &tag, Deadline::after(self.timeout))?;
            // A hybrid model: the request's state, from its slot into decode's, one WRITE per
            // lane (none for a lane a test hook leaves out).
            let mut sx = Vec::new();
            if let Some((ps, ds)) = states {
                for (k, (lane, ep)) in self.state.iter().enumerate() {
                    if super::state::left_out(lane) {
                        continue;
                    }
                    let pairs = lane.pairs(ps, ds);
                    let d = Deadline::after(self.timeout);
                    sx.push((k, ep.post_as_initiator(crate::xfer::transport::Op::Write, &pairs, &format!("{tag}:state"), d)?));
                }
            }
            posted.push((id, blocks, dst, x, sx));
        }
        for (id, blocks, dst, mut x, sx) in posted {
            // `poll` ends the wait with a timeout past the WRITE's deadline.
            let done = loop {
                if let Some(done) = self.ep.poll(&mut x)? {
                    break done;
                }
                std::thread::yield_now();
            };
            for (k, mut x) in sx {
                while self.state[k].1.poll(&mut x)?.is_none() {
                    std::thread::yield_now();
                }
            }
            self.counters.bytes_written += done.bytes;
            self.event(What::Pushed { req: id, blocks, dst });
            self.notified(id);
        }
        self.counters.write_seconds += t.elapsed().as_secs_f64();
        Ok(())
    }

    /// `--lockstep`: takes the notifications of the READs decode completed in its last step
    /// (`ids`) before the step goes on, so when a block is freed follows from the seed.
    fn await_notifications(&mut self, ids: &[u64]) -> Result<()> {
        while ids.iter().any(|id| self.reqs.get(id).is_some_and(|r| !r.read_notified)) {
            if crate::sys::interrupt::requested() {
                return Err(Error::Interrupted("while waiting for the notifications of decode's READs".into()));
            }
            if self.ended.load(std::sync::atomic::Ordering::SeqCst) {
                return Err(Error::Transport("decode ended the run while its READs' notifications were awaited".into()));
            }
            let asked = Instant::now();
            if self.take_notifications()? == 0 {
                self.check_notification_deadlines(asked)?;
                std::thread::sleep(Duration::from_micros(20));
            }
        }
        Ok(())
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
                    "no notification of request {id}'s READ within --timeout {:.6} s ({:.3} s since prefill learnt it was posted)",
                    d.limit_secs(),
                    d.elapsed_secs()
                )));
            }
        }
        Ok(())
    }

    /// Takes the agent's NIXL notifications (decode's READ of a request is done) and returns
    /// how many were for live requests of this run. A notification query still in progress
    /// when a pending READ's deadline passed is a timeout (exit 4), even if it brings that
    /// notification ([`crate::sys::deadline::crossed`]).
    fn take_notifications(&mut self) -> Result<usize> {
        let mut n = 0;
        let asked = Instant::now();
        let next = self
            .reqs
            .iter()
            .filter(|(_, r)| !r.read_notified)
            .filter_map(|(id, r)| r.read_deadline.filter(|d| !d.passed_at(asked)).map(|d| (*id, d)))
            .min_by_key(|(_, d)| d.at());
        let got = self.ep.notifications()?;
        let returned = Instant::now();
        self.out.notify_query_secs += (returned - asked).as_secs_f64();
        if let Some((id, d)) = next
            && crate::sys::deadline::crossed(&d, asked, returned)
        {
            return Err(Error::Timeout(format!(
                "notification of request {id}'s READ: a notification query begun {:.3} s after prefill learnt it was posted \
                 returned {:.3} s after it, over --timeout {:.6} s",
                (asked - d.start).as_secs_f64(),
                (returned - d.start).as_secs_f64(),
                d.limit_secs()
            )));
        }
        for msg in got {
            if let Some(id) = self.nixl.request_of(&msg) {
                let fresh = self.notified(id);
                n += fresh as usize;
                // One completion in eight is delivered twice, 1-32 steps later (drawn at the
                // hand-over, so neither the order notifications arrive in nor the rows of a
                // matrix change what is drawn).
                if fresh
                    && let Some(after) = self.reqs[&id].duplicate_after
                    && self.races.unfenced(Mechanism::DuplicateCompletion)
                {
                    let blocks = self.reqs[&id].pslots.clone();
                    self.duplicates.push((self.now + after, id, blocks));
                }
            }
        }
        Ok(n)
    }

    /// duplicate-completion, unfenced: the duplicate completions that are due free their
    /// request's old blocks again — blocks that may belong to other requests now, whose READs
    /// then read whatever their next owner writes. (Fenced, a duplicate is dropped: its
    /// request's blocks were freed once.)
    fn deliver_duplicates(&mut self) {
        let now = self.now;
        let (due, later): (Vec<_>, Vec<_>) = std::mem::take(&mut self.duplicates).into_iter().partition(|d| d.0 <= now);
        self.duplicates = later;
        for (_, req, blocks) in due {
            for s in blocks {
                let p = self.blocks.get(s);
                let conflict = match p.owner {
                    None => "already free".to_string(),
                    Some(o) => format!("owned by request {o}"),
                };
                self.violation("double-free", req, s, "free", conflict);
                let p = self.blocks.get_mut(s);
                if let Some(victim) = p.owner.take() {
                    p.in_early_list = false;
                    p.owner_wrote = false;
                    p.early = Some(Mechanism::DuplicateCompletion);
                    p.victims.push(victim);
                    self.blocks.free.push(s);
                }
            }
        }
    }

    /// Records an ownership violation of this step for decode's report.
    fn violation(&mut self, kind: &str, request: u64, block: u32, operation: &str, conflict: String) {
        self.out.violations.push(crate::report::OwnershipViolation::new(kind, request, block, operation, conflict, self.now));
    }

    /// The ownership checker at a write of request `req` into block `slot` (`operation`):
    /// a write into a block another request owns and has written, or one a READ is still
    /// reading, is a foreign write. The owner's write marks the block written.
    fn check_write(&mut self, slot: u32, req: u64, operation: &str) {
        let p = self.blocks.get(slot);
        let conflict = match p.owner {
            Some(o) if o != req && p.owner_wrote => Some(format!("owned by request {o}")),
            _ if p.reading > 0 => Some("a READ in flight".to_string()),
            _ => None,
        };
        if let Some(c) = conflict {
            self.violation("foreign-write", req, slot, operation, c);
        }
        let p = self.blocks.get_mut(slot);
        if p.owner == Some(req) {
            p.owner_wrote = true;
        }
    }

    /// Frees block `slot` of request `req` (the ownership checker first: a free while a READ
    /// reads it, a save of it is queued or a load into it is in flight).
    fn free_block(&mut self, req: u64, slot: u32) {
        let p = self.blocks.get(slot);
        let conflict = if p.reading > 0 {
            Some("a READ in flight")
        } else if self.puts.iter().any(|o| o.slot == slot) {
            Some("a queued save")
        } else if p.pending_load > 0 {
            Some("a load in flight")
        } else {
            None
        };
        if let Some(c) = conflict {
            self.violation("free-in-flight", req, slot, "free", c.into());
        }
        let p = self.blocks.get_mut(slot);
        p.owner = None;
        p.owner_wrote = false;
        p.in_early_list = false;
        self.blocks.free.push(slot);
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

    // ---- prefill streams ----

    fn write_stamp(&mut self, slot: u32, req: u64, id: TableEntry, explicit: Option<Mechanism>) -> Content {
        let p = self.blocks.get(slot);
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
        let n = self.blocks.blocks.len();
        let mut table = vec![TableEntry::new(0, SKIP_GEN); n];
        for op in &due {
            if let OpKind::Fill { id } = op.kind {
                table[op.slot as usize] = id;
            }
        }
        let t = Instant::now();
        match self.device.as_mut() {
            Some(d) => d.fill(&table)?,
            None => self.ep.pool.fill(&table)?,
        }
        self.counters.fill_seconds += t.elapsed().as_secs_f64();
        for op in due {
            let OpKind::Fill { id } = op.kind else {
                continue;
            };
            let b = self.blocks.get(op.slot);
            let stale_landing = b.owner != Some(op.req) && b.hazard;
            if stale_landing {
                self.window(Mechanism::UnfencedLoad);
            }
            let c = self.write_stamp(op.slot, op.req, id, None);
            self.check_write(op.slot, op.req, "compute write");
            self.wrote(op.slot, c);
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

    /// The load stream: tier loads of prefix hits into prefill blocks, in order.
    fn run_loads(&mut self) -> Result<()> {
        while let Some(&op) = self.pload.front() {
            if op.due > self.now {
                break;
            }
            let OpKind::Load { entry } = op.kind else { unreachable!("the load queue holds loads") };
            if self.blocks.get(op.slot).pending_compute > 0 {
                if self.races.unfenced(Mechanism::UnfencedLoad) {
                    self.window(Mechanism::UnfencedLoad);
                    self.blocks.get_mut(op.slot).hazard = true;
                } else {
                    break; // event fence: wait for the previous owner's write
                }
            }
            self.pload.pop_front();
            let content = self.store().content(entry).expect("loads read complete entries");
            let kv = self.device.as_mut().unwrap_or(&mut self.ep.pool);
            self.tier.as_mut().expect("loads need the tier").load(kv, op.slot, entry)?;
            self.counters.loads += 1;
            self.store_mut().unpin(entry);
            // A load an aborted request left queued lands where its block went (load-after-abort).
            if op.cause == Some(Mechanism::LoadAfterAbort) && self.blocks.get(op.slot).owner != Some(op.req) {
                self.window(Mechanism::LoadAfterAbort);
            }
            let stamped = self.write_stamp(op.slot, op.req, content.id, op.cause.or(content.cause));
            self.check_write(op.slot, op.req, "load write");
            self.wrote(op.slot, stamped);
            self.blocks.get_mut(op.slot).pending_load -= 1;
            if let Some(r) = self.reqs.get_mut(&op.req) {
                r.pending_writes = r.pending_writes.saturating_sub(1);
            }
        }
        Ok(())
    }

    fn execute_put(&mut self, op: Op) -> Result<()> {
        let OpKind::Save { entry, promised } = op.kind else { unreachable!("the put queue holds saves") };
        let early = self.blocks.get(op.slot).early;
        let mut content = self.contents[op.slot as usize];
        let kv = self.device.as_mut().unwrap_or(&mut self.ep.pool);
        self.tier.as_mut().expect("saves need the tier").save(kv, op.slot, entry)?;
        if content.id != promised {
            // The copy is not what the key promises: say which missing fence let it happen.
            // (None would be a flaw in kvprobe's own model; the decode side then reports
            // the slice as unexplained.)
            content.cause = op.cause.or(content.cause).or(early);
            if let Some(m) = content.cause {
                self.window(m);
            }
        }
        let nixl = self.cfg.scenario.uses_nixl();
        let store = self.store_mut();
        store.complete(entry, content);
        if nixl {
            store.unpin(entry);
        } // tier-only: the entry stays pinned until decode has loaded it
        self.counters.saves += 1;
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
        self.free_blocks(id, early);
    }

    /// Frees the blocks request `id` still owns (a block lent to a load early has another
    /// owner already: load-into-reading). `early`: the unfenced mechanism that frees them now —
    /// its saves still queued then copy blocks that are no longer its own, and the blocks keep
    /// the mark while an earlier owner's READ of them is pending.
    fn free_blocks(&mut self, id: u64, early: Option<Mechanism>) {
        if let Some(m) = early {
            for op in self.puts.iter_mut().filter(|o| o.req == id) {
                op.cause = op.cause.or(Some(m));
            }
        }
        let slots = self.reqs.get(&id).map(|r| r.pslots.clone()).unwrap_or_default();
        for s in slots {
            if self.blocks.get(s).owner != Some(id) {
                continue;
            }
            // A slot handed on early keeps its taint while an earlier owner's READ of it is
            // still pending (e.g. load-into-reading: the borrower finishes first), or while a
            // request it was taken from still lives (duplicate-completion).
            let reqs = &self.reqs;
            self.blocks.get_mut(s).victims.retain(|v| reqs.contains_key(v));
            let p = self.blocks.get(s);
            let victim_lives = !p.victims.is_empty();
            let keep = if p.reading > 0 || victim_lives { p.early } else { None };
            self.free_block(id, s);
            self.blocks.get_mut(s).early = early.or(keep);
        }
    }

    /// The scheduler preempts request `id` after its prefill writes (block pressure): its
    /// blocks go and it is recomputed later. Fenced, the blocks wait for its queued saves;
    /// unfenced (preempt-save), they go at once and the saves copy what lands there next.
    fn preempt(&mut self, id: u64) {
        let r = self.reqs.get_mut(&id).expect("preempted request");
        r.preempted = true;
        if self.races.unfenced(Mechanism::PreemptSave) {
            self.free_blocks(id, Some(Mechanism::PreemptSave));
            self.requeue(id);
        } else {
            r.preempting = true;
        }
    }

    /// A preempted request goes back to the waiting queue (vLLM recomputes it): its tier
    /// lookup answers next step, then it is prefilled anew. Saves still queued from its first
    /// run keep running (and keep its blocks from being freed before them, fenced).
    fn requeue(&mut self, id: u64) {
        let hashes = self.reqs[&id].spec.hashes.clone();
        let hits = self.tier.as_mut().map(|t| t.store.lookup_prefix(&hashes)).unwrap_or_default();
        let r = self.reqs.get_mut(&id).expect("preempted request");
        r.stage = RequestState::Lookup;
        r.ready_at = self.now + 1;
        r.pslots.clear();
        r.promised.clear();
        r.entries = vec![None; hashes.len()];
        r.hits = hits;
        r.pending_writes = 0;
        r.released = false;
        r.early_listed = false;
        r.preempting = false;
    }

    /// Whether tier-only request `r`'s entries are all saved, so decode can load them.
    fn tier_ready(&self, r: &Request) -> bool {
        let store = self.store();
        r.saves_left == 0 && r.entries.iter().all(|e| e.is_some_and(|e| store.content(e).is_some()))
    }

    /// Hands request `id` to decode: its blocks and what they must hold; tier-only, the
    /// entries decode loads them from, each holding what its key promises (an entry another
    /// request saved under the same hash promises that request's generation).
    fn hand_over(&mut self, id: u64) -> Result<()> {
        let r = &self.reqs[&id];
        let (promised, tier) = if self.cfg.scenario.uses_nixl() {
            (r.promised.clone(), Vec::new())
        } else {
            let store = self.store();
            r.entries
                .iter()
                .map(|e| {
                    let e = e.expect("a tier-only request is handed over once every entry is saved");
                    let (hash, serial) = store.key_of(e);
                    (store.promised(e), TierRef { entry: e, hash, serial, content: store.content(e).expect("saved") })
                })
                .unzip()
        };
        let blocks = r.pslots.clone();
        let state_slot = r.state_slot;
        if let Some(slot) = state_slot {
            self.write_state(id, slot, blocks.len())?;
        }
        let planted = self.plant_source_fault(id)?;
        self.out.handed.push(Handed { req: id, blocks, promised, tier, planted, state_slot });
        // One request in four is reported complete by the NIXL connector as it is handed
        // over, before decode's READ (drawn for every request, so that rows draw alike).
        let phantom = self.rng.random_range(0..4u32) == 0
            && self.cfg.scenario.uses_nixl()
            && self.races.unfenced(Mechanism::PhantomCompletion);
        let twice = self.rng.random_range(0..8u32) == 0;
        let after = self.rng.random_range(1..=32u64);
        let now = self.now;
        let r = self.reqs.get_mut(&id).expect("live request");
        r.duplicate_after = twice.then_some(after);
        r.handed_over = true;
        r.handed_at = now;
        r.phantom = phantom;
        Ok(())
    }

    /// Writes request `id`'s final state (a prompt of `blocks` blocks) into state slot `slot`
    /// of every lane: each layer's page as [`StateLane::state_page`] gives it, counted in the
    /// fill time.
    fn write_state(&mut self, id: u64, slot: u32, blocks: usize) -> Result<()> {
        let t = Instant::now();
        let (state_id, generation) = (StateLane::state_id(self.seed, id), StateLane::generation(blocks));
        for (lane, ep) in &mut self.state {
            for li in 0..lane.layers.len() as u32 {
                ep.pool.write_slice(StateLane::page(li, slot), &lane.state_page(self.seed, li, slot, state_id, generation))?;
            }
        }
        self.counters.fill_seconds += t.elapsed().as_secs_f64();
        Ok(())
    }

    fn advance(&mut self) -> Result<()> {
        if self.device.is_some() {
            let prefilling: Vec<u64> =
                self.order.iter().copied().filter(|id| self.reqs[id].stage == RequestState::Prefill).collect();
            for id in prefilling {
                self.stage(id)?;
            }
        }
        let sc = self.cfg.scenario;
        let lease = self.cfg.lease_steps as u64;
        let mut finished = Vec::new();
        let mut to_release = Vec::new();
        let mut to_hand = Vec::new();
        let mut to_preempt = Vec::new();
        let mut to_requeue = Vec::new();
        let mut to_drop = Vec::new();
        for &id in &self.order {
            let r = &self.reqs[&id];
            if r.aborting {
                // load-after-abort, fenced: freed once its loads have landed.
                if r.pslots.iter().all(|&s| self.blocks.get(s).pending_load == 0) {
                    to_drop.push(id);
                }
                continue;
            }
            if r.preempting {
                // preempt-save, fenced: freed (and requeued) once its saves have run.
                if r.saves_left == 0 {
                    to_requeue.push(id);
                }
                continue;
            }
            if r.stage == RequestState::Prefill && r.pending_writes == 0 {
                // The scheduler may preempt it now instead (drawn for every request here, so
                // that the rows of a matrix draw alike).
                let preempt = self.rng.random_bool(self.cfg.preempt_rate);
                if preempt && !r.preempted && r.saves_left > 0 {
                    to_preempt.push(id);
                    continue;
                }
                let r = self.reqs.get_mut(&id).expect("ordered request");
                r.stage = RequestState::Handed;
                if sc.uses_nixl() {
                    for &s in &r.pslots {
                        self.blocks.get_mut(s).reading += 1;
                    }
                }
            }
            let r = &self.reqs[&id];
            if r.stage == RequestState::Handed && !r.handed_over && (sc.uses_nixl() || self.tier_ready(r)) {
                to_hand.push(id);
            }
            let r = self.reqs.get_mut(&id).expect("ordered request");
            if r.released || r.stage != RequestState::Handed {
                if r.released && r.finished {
                    finished.push(id);
                }
                continue;
            }
            // The lease (abort timeout) of a request whose READ is not notified: kept alive
            // (fenced), or it expires and frees the blocks (abort-timeout-free).
            if sc.uses_nixl()
                && r.handed_over
                && !r.read_notified
                && self.now >= r.handed_at + lease
                && self.races.unfenced(Mechanism::AbortTimeoutFree)
            {
                to_release.push((id, Some(Mechanism::AbortTimeoutFree)));
                continue;
            }
            let done = Completions {
                nixl: !sc.uses_nixl() || r.read_notified || r.phantom,
                tier: r.saves_left == 0,
                had_saves: r.had_saves,
                lent: r.early_listed,
            };
            match self.multi.verdict(done) {
                Verdict::Hold => {}
                // Freed on a completion that was a phantom: that mechanism let it happen.
                Verdict::Free(early) if r.phantom && !r.read_notified => {
                    to_release.push((id, early.or(Some(Mechanism::PhantomCompletion))));
                }
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
        for id in to_hand {
            if self.device.is_some() {
                self.unstaged_at_hand_over(id);
            }
            self.hand_over(id)?;
            if self.early_frees > 0 && sc.uses_nixl() {
                self.early_frees -= 1;
                to_release.push((id, None)); // test-only: freed before decode's READ
            }
        }
        for (id, m) in to_release {
            self.release(id, m);
        }
        for id in to_preempt {
            self.preempt(id);
        }
        for id in to_requeue {
            self.free_blocks(id, None);
            self.requeue(id);
        }
        for id in to_drop {
            self.free_blocks(id, None);
            if let Some(r) = self.reqs.remove(&id) {
                self.state_free.extend(r.state_slot);
            }
            self.order.retain(|&x| x != id);
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
            self.state_free.extend(r.state_slot);
            self.order.retain(|&x| x != id);
            if !self.cfg.scenario.uses_nixl()
                && let Some(store) = self.tier.as_mut().map(|t| &mut t.store)
            {
                for e in r.entries.into_iter().flatten() {
                    store.unpin(e);
                }
            }
        }
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
        while !self.counters.stopped
            && self.reqs.len() < self.cfg.concurrency as usize
            && new < max_new
            && (self.state.is_empty() || !self.state_free.is_empty())
        {
            if self.cfg.duration_secs.is_none() && self.counters.admitted >= self.cfg.requests {
                break;
            }
            let spec = self.workload.next_request();
            let id = spec.id;
            let n = spec.hashes.len();
            // lookup_async: the tier answers now, the request acts on it next step (a request
            // the client aborts later looks up and loads like any other).
            let hits = match self.tier.as_mut() {
                Some(t) => t.store.lookup_prefix(&spec.hashes),
                None => Vec::new(),
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
                    read_posted: false,
                    read_notified: false,
                    read_deadline: None,
                    notify_misses: 0,
                    released: false,
                    early_listed: false,
                    handed_over: false,
                    finished: false,
                    handed_at: 0,
                    phantom: false,
                    duplicate_after: None,
                    preempted: false,
                    preempting: false,
                    aborting: false,
                    push_dst: Vec::new(),
                    push_at: None,
                    staged: Vec::new(),
                    stage_calls: 0,
                    state_slot: if self.state.is_empty() { None } else { self.state_free.pop() },
                    push_state: None,
                },
            );
            self.order.push(id);
            self.counters.admitted += 1;
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
            let b = self.blocks.get_mut(s);
            b.owner = Some(id);
            b.owner_wrote = false;
            if i < k {
                let e = r.hits[i];
                promised.push(self.store().promised(e));
                r.entries[i] = Some(e);
                if !sc.uses_nixl() && !abort {
                    self.store_mut().pin(e); // kept for decode's load
                }
                let due = self.lag(2);
                self.pload.push_back(Op { due, req: id, slot: s, cause: None, kind: OpKind::Load { entry: e } });
                self.blocks.get_mut(s).pending_load += 1;
                self.counters.hit_blocks += 1;
            } else {
                // Generations run 1..SKIP_GEN (exclusive): 0 is never computed and SKIP_GEN marks
                // "neither fill nor verify" in the kernels' tables.
                self.next_gen = fingerprint::next_generation(self.next_gen);
                let t = TableEntry::new(r.spec.hashes[i], self.next_gen);
                promised.push(t);
                let mut due = self.lag(2).max(self.compute.back().map_or(0, |o| o.due));
                // --host-staging: chunked prefill, two computed blocks per chunk, each chunk
                // at least a step after the one before.
                if self.device.is_some() && i > k && (i - k).is_multiple_of(2) {
                    due += 1;
                }
                self.compute.push_back(Op { due, req: id, slot: s, cause: None, kind: OpKind::Fill { id: t } });
                self.blocks.get_mut(s).pending_compute += 1;
            }
            r.pending_writes += 1;
        }
        r.staged = vec![false; slots.len()];
        r.stage_calls = 0;
        r.pslots = slots;
        r.promised = promised;
        r.stage = RequestState::Prefill;
        if abort {
            // The client went away: vLLM frees the blocks at once (the compute stream still
            // runs the issued writes, ordered before the next owner's) — once its tier loads
            // have landed; unfenced (load-after-abort), with the loads still queued.
            self.counters.aborted += 1;
            let unfenced = self.races.unfenced(Mechanism::LoadAfterAbort);
            if k > 0 && !unfenced {
                r.aborting = true;
                self.reqs.insert(id, r);
                return Ok(true);
            }
            if k > 0 {
                for op in self.pload.iter_mut().filter(|o| o.req == id) {
                    op.cause = Some(Mechanism::LoadAfterAbort);
                }
            }
            self.order.retain(|&x| x != id);
            self.reqs.insert(id, r);
            self.free_blocks(id, None);
            if let Some(r) = self.reqs.remove(&id) {
                self.state_free.extend(r.state_slot);
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
}

/// Steps until a save runs: usually 0–3, but one in four waits 16–96 steps behind a
/// backlog (a store's puts are slower than NIXL under sustained load: about 1 GB/s for
/// Mooncake over TCP against hundreds of GB/s for cuda_ipc).
fn put_lag(rng: &mut ChaCha8Rng) -> u64 {
    if rng.random_range(0..4u32) == 0 { rng.random_range(16..=96) } else { rng.random_range(0..=3) }
}
