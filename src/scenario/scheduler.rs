//! The scheduler's state of a scenario (vLLM's `Scheduler` and `KVCacheManager`): the
//! requests and their states on each engine, and the prefill block manager — the free list, which request
//! owns each block, the writes still pending on it, the READs still reading it, and the early
//! list of blocks lent out before their READ completed (load-into-reading). It never moves
//! bytes; the engine does, through the connectors.

use crate::core::mechanism::Mechanism;
use crate::core::workload::RequestSpec;
use crate::mem::pool::TableEntry;
use crate::mem::tier::{Content, EntryId};
use crate::sys::deadline::Deadline;
use crate::xfer::nixl::Posted;

/// Where a request is on prefill (vLLM's request states, with the connector's waits made
/// explicit).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum RequestState {
    /// Admitted; the tier lookup of its prompt's block hashes answers next step.
    Lookup,
    /// Its prefill writes (computed fills, tier loads of hits) are in flight.
    Prefill,
    /// Written and handed to decode ([`crate::peer::steps::Handed`]); prefill holds its
    /// blocks until the connectors report done, and retires it once decode has finished it.
    Handed,
}

/// One request as prefill's scheduler tracks it, from admission to retirement.
pub(crate) struct Request {
    pub(crate) spec: RequestSpec,
    pub(crate) stage: RequestState,
    pub(crate) ready_at: u64,
    pub(crate) promised: Vec<TableEntry>,
    pub(crate) pslots: Vec<u32>,
    pub(crate) hits: Vec<EntryId>,
    /// Tier entry per block (tier-only: where decode loads it from).
    pub(crate) entries: Vec<Option<EntryId>>,
    pub(crate) pending_writes: u32,
    pub(crate) saves_left: u32,
    pub(crate) had_saves: bool,
    /// Decode posted its NIXL READ (prefill's wait for the notification runs).
    pub(crate) read_posted: bool,
    pub(crate) read_notified: bool,
    /// The wait for the READ's notification (`--timeout` from when prefill learnt the READ
    /// was posted), until it arrives.
    pub(crate) read_deadline: Option<Deadline>,
    /// Notification checks begun after `read_deadline` that did not find it.
    pub(crate) notify_misses: u8,
    pub(crate) released: bool,
    pub(crate) early_listed: bool,
    /// Handed to decode ([`crate::peer::steps::Handed`]; tier-only: once its saves are done).
    pub(crate) handed_over: bool,
    /// Decode verified it and freed its own blocks.
    pub(crate) finished: bool,
    /// The step it was handed to decode (its lease runs from there).
    pub(crate) handed_at: u64,
    /// The NIXL connector reported it complete at its hand-over (phantom-completion, unfenced).
    pub(crate) phantom: bool,
    /// Drawn at its hand-over: its completion is delivered twice, the duplicate this many
    /// steps after the first (duplicate-completion, unfenced).
    pub(crate) duplicate_after: Option<u64>,
    /// Preempted once already (a request is preempted at most once).
    pub(crate) preempted: bool,
    /// Preempted, its blocks held until its queued saves have run (preempt-save, fenced).
    pub(crate) preempting: bool,
    /// Aborted, its blocks held until its tier loads have landed (load-after-abort, fenced).
    pub(crate) aborting: bool,
    /// Push mode: the decode blocks decode asked prefill to WRITE into, and the step the
    /// WRITE is due (`None`: not asked yet, or done).
    pub(crate) push_dst: Vec<u32>,
    pub(crate) push_at: Option<u64>,
    /// `--host-staging`: which of its blocks have been staged into the pool NIXL reads, and
    /// how many staging calls staged some.
    pub(crate) staged: Vec<bool>,
    pub(crate) stage_calls: u32,
    /// A hybrid model: the state slot it holds on prefill from admission to retirement
    /// ([`super::state`]).
    pub(crate) state_slot: Option<u32>,
    /// Push mode, a hybrid model: decode's state slot the WRITE targets.
    pub(crate) push_state: Option<u32>,
}

/// Where a request is on decode.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum PullState {
    /// Handed over by prefill; decode schedules it a seeded 0-2 steps later.
    Waiting,
    /// Decode's NIXL READ (or tier loads, tier-only) is in flight.
    Pulling,
    /// Delivered to decode; verified in this step's pass.
    Verify,
}

/// One request as decode tracks it, from prefill's hand-over to its verification.
pub(crate) struct Pull {
    pub(crate) stage: PullState,
    pub(crate) ready_at: u64,
    /// Prefill's blocks (the READ's source), in prompt order.
    pub(crate) pslots: Vec<u32>,
    /// What each block must hold.
    pub(crate) promised: Vec<TableEntry>,
    /// tier-only: the entry each block is loaded from.
    pub(crate) tier: Vec<crate::peer::steps::TierRef>,
    /// Decode's blocks.
    pub(crate) dslots: Vec<u32>,
    pub(crate) xfer: Option<Posted>,
    /// What each prefill block held when the READ was posted.
    pub(crate) at_post: Vec<Content>,
    /// What was written into each prefill block while the READ was in flight (filled when
    /// it completes).
    pub(crate) during: Vec<Vec<Content>>,
    /// Decode-side prediction per block (tier-only loads).
    pub(crate) delivered: Vec<Content>,
    pub(crate) dloads_left: u32,
    pub(crate) poison_iter: u32,
    /// Indices (into `pslots`) of the blocks the request's transfer fails to move
    /// (`--fail-rate`): for a READ, the descriptors left out of its first post; for
    /// tier-only, the loads that fail once.
    pub(crate) failed: Vec<usize>,
    /// The READ in flight is the retry of the failed blocks (fenced `failed-as-complete`).
    pub(crate) retrying: bool,
    /// Indices of the blocks counted delivered although their transfer failed (unfenced
    /// `failed-as-complete`): they still hold this pull's poison.
    pub(crate) unwritten: Vec<usize>,
    /// `--inject` faults planted on the request's READ.
    pub(crate) planted: Vec<Planted>,
    /// `--inject bitflip|stale`: what prefill planted in the source slices, until decode
    /// knows the request's blocks.
    pub(crate) source_faults: Vec<crate::peer::steps::SourceFault>,
    /// Push mode: the step decode asked prefill for the WRITE, the step it landed (`None`:
    /// not yet) and whether its notification arrived.
    pub(crate) asked_at: u64,
    pub(crate) landed_at: Option<u64>,
    /// Push mode: the step decoding ends and the request is verified (after it landed).
    pub(crate) decode_until: Option<u64>,
    /// Push mode, fenced decode-abort-free: decode aborted the request; its blocks wait for
    /// the WRITE's notification.
    pub(crate) aborting: bool,
    /// A hybrid model ([`super::state`]): prefill's state slot of the request, decode's, and
    /// the state READ of each lane while in flight.
    pub(crate) pstate: Option<u32>,
    pub(crate) dstate: Option<u32>,
    pub(crate) state_xfers: Vec<Option<Posted>>,
}

/// One `--inject` fault planted on a request's READ (`--inject` under request load): what
/// it is, the engine step its READ was posted in, and where it must show at decode.
#[derive(Clone, Debug)]
pub(crate) struct Planted {
    pub(crate) kind: crate::core::inject::Kind,
    pub(crate) step: u64,
    /// (decode slice, predicted class), as `inject::Action::predicted` says for the sweep.
    pub(crate) hits: Vec<(crate::core::geometry::SliceCoord, crate::core::verify::Class)>,
    /// The exact bytes of each of `hits`, in its order.
    pub(crate) predictions: Vec<crate::core::inject::Prediction>,
    /// `torn`: the bytes of the slice its READ moved (the report's `torn_bytes`).
    pub(crate) torn_bytes: Option<u64>,
}

/// One prefill block as the block manager tracks it.
#[derive(Clone, Debug, Default)]
pub(crate) struct BlockState {
    /// The request the block is allocated to.
    pub(crate) owner: Option<u64>,
    /// Computed fills issued into it and not yet run.
    pub(crate) pending_compute: u32,
    /// Tier loads issued into it and not yet run.
    pub(crate) pending_load: u32,
    /// Requests whose NIXL READ of this block has not been notified.
    pub(crate) reading: u32,
    /// The block was released early by this unfenced mechanism.
    pub(crate) early: Option<Mechanism>,
    /// An unfenced load overtook a pending compute write here.
    pub(crate) hazard: bool,
    /// On the early list (lent to loads before its READ completed).
    pub(crate) in_early_list: bool,
    /// The owner's own write has landed here (a later write of another request's is then a
    /// foreign write: the ownership checker).
    pub(crate) owner_wrote: bool,
    /// The requests the block was taken from without their knowing (duplicate completions
    /// freed it, each from its owner then): while any of them lives it still uses the block,
    /// so the block keeps its `early` mark. Every one is kept (a second duplicate must not
    /// make the block forget the first victim, whose READ may still be to come).
    pub(crate) victims: Vec<u64>,
}

/// The prefill pool's block manager: every block's state, the free list and the early list.
pub(crate) struct BlockManager {
    /// By prefill block id.
    pub(crate) blocks: Vec<BlockState>,
    /// Free blocks (taken from the end).
    pub(crate) free: Vec<u32>,
    /// Blocks lent out before their READ completed (load-into-reading), taken from the end;
    /// an entry whose block left the list since is skipped.
    pub(crate) early: Vec<u32>,
}

impl BlockManager {
    /// `n` free blocks, handed out from block 0 up.
    pub(crate) fn new(n: u32) -> BlockManager {
        BlockManager { blocks: vec![BlockState::default(); n as usize], free: (0..n).rev().collect(), early: Vec::new() }
    }

    /// Block `b`'s state.
    pub(crate) fn get(&self, b: u32) -> &BlockState {
        &self.blocks[b as usize]
    }

    /// Block `b`'s state, to change.
    pub(crate) fn get_mut(&mut self, b: u32) -> &mut BlockState {
        &mut self.blocks[b as usize]
    }

    /// Lends block `b`, still owned and still being read, to the next loads
    /// (load-into-reading).
    pub(crate) fn lend_early(&mut self, b: u32) {
        self.blocks[b as usize].in_early_list = true;
        self.early.push(b);
    }

    /// Returns blocks an allocation took but could not use to where they came from (blocks
    /// still owned go back to the early list, free ones to the free list).
    pub(crate) fn give_back(&mut self, slots: Vec<u32>) {
        for s in slots.into_iter().rev() {
            if self.blocks[s as usize].owner.is_some() {
                self.lend_early(s);
            } else {
                self.free.push(s);
            }
        }
    }

    /// Takes `n` blocks for a request: with `for_loads` (blocks a tier load will fill) first
    /// blocks lent early from the early list (load-into-reading), then free ones. `None`, with
    /// nothing taken, when too few are free.
    pub(crate) fn alloc(&mut self, n: usize, for_loads: bool) -> Option<Vec<u32>> {
        let mut out = Vec::with_capacity(n);
        if for_loads {
            while out.len() < n {
                let Some(s) = self.early.pop() else {
                    break;
                };
                if self.blocks[s as usize].in_early_list && self.blocks[s as usize].owner.is_some() {
                    self.blocks[s as usize].in_early_list = false;
                    out.push(s);
                }
            }
        }
        while out.len() < n {
            match self.free.pop() {
                Some(s) => out.push(s),
                None => {
                    self.give_back(out);
                    return None;
                }
            }
        }
        Some(out)
    }
}

/// Decode's free list: blocks decode can poison and receive into (taken from the end).
pub(crate) struct DecodeBlocks {
    free: Vec<u32>,
}

impl DecodeBlocks {
    /// `n` free blocks, handed out from block 0 up.
    pub(crate) fn new(n: u32) -> DecodeBlocks {
        DecodeBlocks { free: (0..n).rev().collect() }
    }

    /// `n` blocks, or `None` (nothing taken) when fewer are free.
    pub(crate) fn alloc(&mut self, n: usize) -> Option<Vec<u32>> {
        if self.free.len() < n {
            return None;
        }
        Some((0..n).map(|_| self.free.pop().expect("checked")).collect())
    }

    /// Frees block `b`.
    pub(crate) fn free(&mut self, b: u32) {
        self.free.push(b);
    }
}
