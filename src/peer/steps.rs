//! The scenario's messages between the prefill engine and the decode engine
//! (`kvprobe run --scenario`, `kvprobe ab`): what crosses the peer protocol once both NIXL
//! agents are connected, whether prefill is a thread of this process, a child or `kvprobe
//! serve` on another host.
//!
//! The two engines advance in steps, coupled one step at a time: decode sends
//! [`super::Msg::Step`] with a [`StepIn`] (what decode did in its last step), prefill runs
//! its step and answers [`super::Msg::Stepped`] with a [`StepOut`] (what it did: its shadow
//! events, the requests it hands to decode, its counters), then decode runs the same step.
//! So every prefill event of step k happened before decode's events of step k, and every one
//! of step k + 1 after them: the shadow's READ windows ([`Event`]) mean the same on one host
//! and across two. NIXL moves every byte; these messages carry control, identities and the
//! events the shadow needs.

use crate::core::mechanism::{Mechanism, Scenario};
use crate::mem::pool::TableEntry;
use crate::mem::tier::Content;
use serde::{Deserialize, Serialize};

/// The engine an [`Event`] comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EngineId {
    /// The prefill engine (its blocks are written and read).
    Prefill,
    /// The decode engine (it posts and completes the READs).
    Decode,
}

/// What an engine tells the shadow.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "what", rename_all = "snake_case")]
pub enum What {
    /// Prefill wrote `content` into its block `block` (a computed fill or a tier load).
    Write {
        /// Prefill block id.
        block: u32,
        /// The identity written and the mechanism that allowed it, if one did.
        content: Content,
    },
    /// Prefill: unfenced mechanism `mechanism` let a conflicting copy happen once more (a
    /// write into a block another request still reads, a save of a block that is no longer
    /// its request's, a load that overtook a write).
    Window {
        /// The mechanism.
        mechanism: Mechanism,
    },
    /// Decode posted request `req`'s NIXL READ of prefill blocks `blocks`: their windows open.
    ReadPosted {
        /// Request id.
        req: u64,
        /// Prefill block ids, in the request's order.
        blocks: Vec<u32>,
    },
    /// Request `req`'s READ of prefill blocks `blocks` completed at decode: their windows close.
    ReadDone {
        /// Request id.
        req: u64,
        /// Prefill block ids, in the request's order.
        blocks: Vec<u32>,
    },
    /// Push mode (`--op write`): prefill's NIXL WRITE of request `req`'s blocks `blocks` into
    /// decode's blocks `dst` (the ones decode asked for, [`Push`]) was posted and completed
    /// within prefill's step, which writes nothing meanwhile: each decode block got what its
    /// source block holds now.
    Pushed {
        /// Request id.
        req: u64,
        /// Prefill block ids, in the request's order.
        blocks: Vec<u32>,
        /// Decode block ids the WRITE landed in, in the same order.
        dst: Vec<u32>,
    },
}

/// Push mode (`--op write`, vLLM's push flow and SGLang's): decode allocated `blocks` for
/// request `req` and asks prefill to WRITE the request's blocks into them.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Push {
    /// Request id (one prefill handed over).
    pub req: u64,
    /// Decode block ids, one per prefill block of the request, in order.
    pub blocks: Vec<u32>,
    /// A hybrid model: decode's state slot prefill WRITEs the request's state into
    /// (`crate::scenario::state`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state_slot: Option<u32>,
}

/// An event, stamped with its engine, that engine's step and its sequence number among that
/// engine's events (1, 2, 3, ... with no gap).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Event {
    /// Where it happened.
    pub engine: EngineId,
    /// The engine's step.
    pub step: u64,
    /// The engine's count of events so far, this one included.
    pub seq: u64,
    /// What happened.
    pub what: What,
}

/// What decode tells prefill before prefill's next step.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct StepIn {
    /// Keep admitting requests. False once `--duration` has passed: prefill stops admitting,
    /// drops the requests still waiting for blocks, and drains.
    pub admit: bool,
    /// Requests whose NIXL READ decode posted in its last step: prefill's wait for their
    /// notifications (`--timeout`) starts now.
    pub posted: Vec<u64>,
    /// `--lockstep`: requests whose READ completed in decode's last step. Prefill takes their
    /// notifications before anything else in its step (bounded by `--timeout`).
    pub read_done: Vec<u64>,
    /// Requests decode has verified and whose decode blocks it freed: prefill retires each
    /// once its own blocks are released. Push mode: also requests decode aborted.
    pub finished: Vec<u64>,
    /// Push mode: the requests decode asked prefill to WRITE, with their decode blocks.
    #[serde(default)]
    pub push: Vec<Push>,
}

/// Where decode loads one block of a tier-only request from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TierRef {
    /// The tier entry (its slot in the embedded store's arena).
    pub entry: u32,
    /// Block hash of the entry's key.
    pub hash: u32,
    /// Reservation serial of the entry's key (a hash saved again after an eviction gets a
    /// new one): with the hash and the run's key prefix, the Mooncake key.
    pub serial: u64,
    /// What the shadow says the entry holds (the copy its save made).
    pub content: Content,
}

/// A request whose prefill writes are complete, handed to decode: as vLLM's request
/// finishing on the prefill engine hands its block ids to decode (`kv_transfer_params`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Handed {
    /// Request id.
    pub req: u64,
    /// Prefill block ids holding the prompt, in order.
    pub blocks: Vec<u32>,
    /// What each block must hold: the logical block (prefix-cache hash) and generation decode
    /// verifies against.
    pub promised: Vec<TableEntry>,
    /// tier-only: the tier entry of each block, in order (empty when decode READs over NIXL).
    pub tier: Vec<TierRef>,
    /// `--inject bitflip|stale` under request load: faults prefill planted in the request's
    /// source blocks after their writes, for decode to find.
    #[serde(default)]
    pub planted: Vec<SourceFault>,
    /// A hybrid model: prefill's state slot holding the request's final state
    /// (`crate::scenario::state`), which decode READs with its blocks.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state_slot: Option<u32>,
}

/// A fault prefill planted in one source slice of a handed request (`--inject bitflip` or
/// `stale` under request load): the block's index in the request, the slice's layer and K/V
/// part, and the kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SourceFault {
    /// Index of the block in the request's blocks.
    pub index: u32,
    /// Layer.
    pub layer: u32,
    /// K/V part.
    pub kv: crate::core::geometry::KvPart,
    /// `bitflip` (one bit of the slice flipped) or `stale` (the slice holds the block's
    /// previous generation).
    pub kind: crate::core::inject::Kind,
    /// `bitflip`: the flipped bit, as (byte offset in the slice, bit 0..8), so that decode
    /// predicts the slice's bytes exactly ([`crate::core::inject::Prediction`]). Decode refuses a
    /// bitflip without it, or outside the slice, as a protocol error.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub flip: Option<(u64, u8)>,
}

/// Prefill's running counts, sent with every step.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct PrefillCounters {
    /// Prefill's steps so far.
    pub steps: u64,
    /// Requests admitted.
    pub admitted: u64,
    /// Requests the client aborted after their prefill was issued.
    pub aborted: u64,
    /// Prompt blocks served from the tier (prefix hits).
    pub hit_blocks: u64,
    /// Tier saves executed.
    pub saves: u64,
    /// Tier loads executed on prefill (prefix hits).
    pub loads: u64,
    /// Tier entries evicted.
    pub evictions: u64,
    /// Seconds prefill's fills (computed blocks, the genesis fill) took, on prefill's clock.
    pub fill_seconds: f64,
    /// Push mode: bytes prefill's NIXL WRITEs moved into decode's pool.
    #[serde(default)]
    pub bytes_written: u64,
    /// Push mode: seconds prefill's WRITEs were in flight, on prefill's clock.
    #[serde(default)]
    pub write_seconds: f64,
    /// Admission has stopped (`--requests` reached, or decode said so).
    pub stopped: bool,
}

/// What prefill did in one step.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct StepOut {
    /// Prefill's shadow events of the step, in order.
    pub events: Vec<Event>,
    /// Requests handed to decode in the step.
    pub handed: Vec<Handed>,
    /// Counts so far.
    pub counters: PrefillCounters,
    /// Admission has stopped and every request has left prefill (retired or dropped): once
    /// decode has nothing in flight either, the scenario is over.
    pub drained: bool,
    /// Block-ownership violations prefill saw in the step (its block manager's checker).
    #[serde(default)]
    pub violations: Vec<crate::report::OwnershipViolation>,
    /// Seconds (prefill's clock) the step spent inside NIXL notification queries: decode
    /// names them when a step that made no progress outlasts `--timeout`.
    #[serde(default)]
    pub notify_query_secs: f64,
}

/// How decode reaches the tier prefill saves into, for tier-only loads.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum TierAccess {
    /// The embedded store lives in this process (prefill on a thread): decode copies an
    /// entry from its arena.
    InProcess,
    /// The embedded store on prefill's host: its arena is registered with prefill's NIXL
    /// agent (`transport::PeerInfo::tier_region`) and decode READs an entry's slices over
    /// NIXL, as a host-memory KV tier on the prefill node is reached from decode.
    Nixl,
    /// A Mooncake Store: decode's own store client joins the deployment and gets the entry's
    /// object.
    Mooncake {
        /// The master's RPC address as decode reaches it (`HOST:PORT`).
        master: String,
        /// Its metadata service.
        metadata_url: String,
        /// The key prefix of this run's objects (`kvprobe/<this>/<hash>/<serial>`).
        key_prefix: String,
    },
}

/// What decode asks prefill to start: one scenario run (a `kvprobe ab` row, or the run).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Begin {
    /// Row number from 0 (`kvprobe ab`; 0 for `run --scenario`).
    pub row: u32,
    /// Which connectors move the blocks.
    pub scenario: Scenario,
    /// The mechanisms left unfenced.
    pub unfenced: Vec<Mechanism>,
    /// Prefix of the NIXL notification decode's READ of request N carries (`PREFIX` + N);
    /// in push mode, prefill's WRITE.
    pub tag: String,
    /// Push mode (`--op write`): prefill WRITEs each request's blocks into the decode blocks
    /// decode names ([`StepIn::push`]) instead of decode READing them.
    #[serde(default)]
    pub push: bool,
    /// Host-buffer staging (`--host-staging`): prefill computes into its own KV cache and
    /// stages into the pool decode READs.
    #[serde(default)]
    pub staging: bool,
}
