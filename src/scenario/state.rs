//! A hybrid model's recurrent state under request load (`kvprobe run --scenario nixl-only|
//! stacked` on a Mamba, gated DeltaNet or KDA hybrid): every request owns one state slot on
//! each engine, as vLLM's hybrid KV cache manager gives a request one block of each Mamba KV
//! cache group (`MambaSpec`, the slot its running state lives in), and the NixlConnector
//! moves that slot with the request's attention blocks.
//!
//! A *lane* is one state region (one TP rank's pages of every state layer) on both engines:
//! a pool of `slots` units per side, one page per (layer, slot) `page_stride_bytes` apart,
//! and a NIXL agent each. On prefill a request takes a slot at admission and keeps it until
//! it is retired (decode verified it); when its prefill writes are done (the prompt's last
//! chunk computed) prefill writes the request's final state into its slot: every row run of
//! every layer as region rows ([`crate::core::hybrid::run_rows`], docs/fingerprint.md
//! "Region rows") naming the request's state id ([`StateLane::state_id`]) and generation =
//! the prompt's blocks (the state advances once per block of prompt). Decode takes a slot of
//! its own when it starts the request, poisons its pages, READs prefill's slot into it with
//! the descriptors vLLM's NixlConnector builds for a state page (`_build_mamba_local`: one per
//! conv sub-projection, then the ssm / temporal / recurrent state; the padding left out; push
//! mode: prefill WRITEs its slot into the one decode names, and decode waits for each lane's
//! notification), and verifies every run when the request's attention blocks are verified: a run of another
//! request or slot is `misplaced`, an older generation `stale`, poison `unwritten`.
//!
//! What a tier saves (vLLM 0.34): MooncakeStoreConnector and the OffloadingConnector save a
//! Mamba group's state only at block-aligned boundaries (`mamba_cache_mode` "align": the
//! checkpoint block under the boundary's block hash, `_boundary_puts`) and load the tail one
//! on a prefix hit, which prefill then advances over the rest of the prompt; LMCacheConnectorV1
//! does not support hybrid KV cache groups at all. So the state decode READs is always the one
//! prefill computed last, which is what this module moves. kvprobe's tier does not save the
//! boundary states yet, and tier-only on a hybrid model (decode loading its state from the
//! tier) is refused. The race mechanisms act on attention blocks: a state slot is freed only
//! once decode has verified its request, so no
//! mechanism can reach it, and a wrong state run is always unexplained (exit 1).

use crate::core::fingerprint::{self, logical_block};
use crate::core::geometry::{Geometry, KvPart, SliceCoord};
use crate::core::hybrid::{RowRun, run_rows};
use crate::core::verify;
use crate::report::{RegionFailure, RegionReport};
use crate::xfer::transport::Pair;

/// Most bytes all state lanes of a scenario take on each side (256 MiB): the slot count is
/// cut to fit, down to [`MIN_STATE_SLOTS`] (the engines then admit fewer requests at once).
pub const MAX_STATE_POOL_BYTES: u64 = 256 << 20;

/// Fewest state slots a lane has: two, so that a page of the wrong slot is seen as
/// `misplaced`.
pub const MIN_STATE_SLOTS: u32 = 2;

/// Salt of a request's state id ([`StateLane::state_id`]).
const STATE_SALT: u64 = 0x5354_4154_4500_0000;

/// Salt of the id prefill's unused slots hold ([`StateLane::genesis_page`]).
const GENESIS_SALT: u64 = 0x4745_4e45_5349_5300;

/// One state region of one TP rank as both engines of a scenario move it (equal TP sizes:
/// prefill's rank and decode's hold the same rows).
#[derive(Clone, Debug, PartialEq)]
pub struct StateLane {
    /// The region's name (`KDA state`, `Mamba2 state`, `gated DeltaNet state`, ...).
    pub name: String,
    /// The TP rank whose rows the pages hold.
    pub rank: u32,
    /// The model layers of the region, in page order.
    pub layers: Vec<u32>,
    /// The row runs of one page, in page order.
    pub runs: Vec<RowRun>,
    /// Each run's name (a conv sub-projection, the ssm / temporal / recurrent state).
    pub run_names: Vec<String>,
    /// Payload bytes of one page (layer and slot).
    pub page_bytes: u64,
    /// Bytes from one page to the next (the state page padded to the attention page).
    pub page_stride_bytes: u64,
    /// The descriptors of one page: (prefill byte offset, decode byte offset, bytes).
    pub descriptors: Vec<(u64, u64, u64)>,
    /// Slots of each side's pool.
    pub slots: u32,
    /// Each side's pool: one MLA-like slice of `page_stride_bytes` per (layer, slot)
    /// (`crate::sweep::regions::RegionPlan::pool_geometry`).
    pub geometry: Geometry,
}

impl StateLane {
    /// The state id of request `req` (what its state rows name): a seeded bijection of the
    /// request's low 32 bits ([`logical_block`]), salted apart from block ids.
    pub fn state_id(seed: u64, req: u64) -> u32 {
        logical_block(seed ^ STATE_SALT, req as u32)
    }

    /// The state generation of a request whose prompt is `blocks` blocks: the state after
    /// that many chunks (at least 1; 0 is the genesis of unused slots).
    pub fn generation(blocks: usize) -> u32 {
        (blocks as u32).max(1)
    }

    /// The pool slice of (layer index `li`, slot `s`).
    pub fn page(li: u32, s: u32) -> SliceCoord {
        SliceCoord { layer: li, kv: KvPart::Latent, block: s }
    }

    /// The global page index of (layer index `li`, slot `s`) in a side's pool (the poison's
    /// slot): `li × slots + s`.
    pub fn page_slot(&self, li: u32, s: u32) -> u32 {
        li * self.slots + s
    }

    /// Prefill's page of layer index `li` holding state `id` at `generation`:
    /// `page_stride_bytes` bytes, every run's rows filled, the padding poison of `slot`.
    pub fn state_page(&self, seed: u64, li: u32, slot: u32, id: u32, generation: u32) -> Vec<u8> {
        let mut page = vec![0u8; self.page_stride_bytes as usize];
        fingerprint::poison(&mut page, self.page_slot(li, slot), 0);
        let layer = self.layers[li as usize];
        for run in &self.runs {
            let rows = run_rows(run, layer, id, generation);
            let at = run.offset as usize;
            fingerprint::fill(&mut page[at..at + rows.len() as usize], seed, &rows);
        }
        page
    }

    /// What prefill's slot `slot` holds before any request used it: its genesis state (an id
    /// of the slot's own, generation 0).
    pub fn genesis_page(&self, seed: u64, li: u32, slot: u32) -> Vec<u8> {
        self.state_page(seed, li, slot, logical_block(seed ^ GENESIS_SALT, slot), 0)
    }

    /// The descriptors of one request's state READ: every layer's page of prefill slot
    /// `src` into decode slot `dst`, a descriptor per section of the page.
    pub fn pairs(&self, src: u32, dst: u32) -> Vec<Pair> {
        let mut out = Vec::with_capacity(self.layers.len() * self.descriptors.len());
        for li in 0..self.layers.len() as u32 {
            for &(src_off, dst_off, len) in &self.descriptors {
                out.push(Pair { src: Self::page(li, src), dst: Self::page(li, dst), len, src_off, dst_off });
            }
        }
        out
    }

    /// Bytes one request's state READ moves (every layer's descriptors).
    pub fn bytes_per_request(&self) -> u64 {
        self.layers.len() as u64 * self.descriptors.iter().map(|d| d.2).sum::<u64>()
    }

    /// The region's report entry before anything moved (`unit` = `slot`, `units` = slots).
    pub fn report(&self) -> RegionReport {
        RegionReport {
            kind: "state".into(),
            name: self.name.clone(),
            rank: self.rank,
            layers: self.layers.len() as u32,
            unit: "slot".into(),
            units: self.slots,
            page_bytes: self.page_bytes,
            page_stride_bytes: self.page_stride_bytes,
            descriptors_per_page: self.descriptors.len() as u32,
            prefill_ranks: vec![self.rank],
            bytes_moved: 0,
            seconds: 0.0,
            pages_compared: 0,
            pages_corrupt: 0,
            runs_compared: 0,
            injections_planted: 0,
            injections_detected: 0,
            unexpected_failures: 0,
            injections: Vec::new(),
            failures: Vec::new(),
        }
    }

    /// Verifies decode's page `page` (layer index `li`, decode slot `slot`, poisoned at
    /// `iteration`) against request `request`'s state at `generation`: counts it in `out` and lists each
    /// wrong run (at most `max_failures` in all), classified from exactly these bytes. Returns
    /// true when the page is clean.
    #[allow(clippy::too_many_arguments)]
    pub fn verify_page(
        &self,
        seed: u64,
        page: &[u8],
        li: u32,
        slot: u32,
        iteration: u32,
        request: u64,
        generation: u32,
        max_failures: usize,
        out: &mut RegionReport,
    ) -> bool {
        let layer = self.layers[li as usize];
        let id = Self::state_id(seed, request);
        out.pages_compared += 1;
        out.runs_compared += self.runs.len() as u64;
        let wrong = crate::core::hybrid::wrong_runs(&self.runs, page, layer, id, generation, seed);
        let clean = wrong.is_empty();
        for (k, rows, at) in wrong {
            let run = &self.runs[k];
            out.unexpected_failures += 1;
            let v = verify::classify(&page[at], &rows, seed, self.page_slot(li, slot), iteration);
            if out.failures.len() < max_failures {
                out.failures.push(RegionFailure {
                    injected: false,
                    layer,
                    part: self.run_names.get(k).cloned().unwrap_or_else(|| format!("part {}", run.part)),
                    unit: slot,
                    id,
                    class: v.class,
                    observed: v.observed,
                    bit_flips: v.bit_flips,
                    request: Some(request),
                });
            }
        }
        out.pages_corrupt += !clean as u64;
        clean
    }
}

/// What is wrong with each lane of `reports` (a scenario's `regions`) that has a corrupt page,
/// in words: a lane none of whose bytes arrived (left out of the transfer) as such, else its
/// corrupt pages; empty when every lane is clean.
pub fn corrupt_lanes(reports: &[RegionReport]) -> Vec<String> {
    reports
        .iter()
        .filter(|r| r.pages_corrupt > 0)
        .map(|r| {
            if r.bytes_moved == 0 && r.pages_corrupt == r.pages_compared {
                format!(
                    "region {} ({}, TP rank {}) was not moved: none of its bytes arrived in {} request(s), and decode would compute its {} layer(s) from zeros",
                    r.name,
                    r.kind,
                    r.rank,
                    r.pages_compared / r.layers.max(1) as u64,
                    r.layers
                )
            } else {
                format!("region {} ({}, TP rank {}): {} of {} state page(s) corrupt", r.name, r.kind, r.rank, r.pages_corrupt, r.pages_compared)
            }
        })
        .collect()
}

/// True when `KVPROBE_TEST_LEAVE_OUT_REGION` ([`crate::sys::test_hooks::LEAVE_OUT_REGION`])
/// names `lane` (its kind, `state`, or its name): decode never READs it, as a connector that
/// never registered the state pool.
pub fn left_out(lane: &StateLane) -> bool {
    std::env::var(crate::sys::test_hooks::LEAVE_OUT_REGION).is_ok_and(|v| v == "state" || v == lane.name)
}
