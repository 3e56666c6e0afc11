//! The versioned JSON report (`schema` = [`SCHEMA`]): its schema and the failure tally here,
//! how it is written in [`write`] (atomically, with a fallback to stderr), the human summary
//! in [`render`], JUnit in [`junit`], the dump of failing slices in [`dump`].

pub mod dump;
pub mod junit;
pub mod render;
pub mod write;

pub use render::{render, render_with};
pub use write::{
    FALLBACK_BEGIN, FALLBACK_END, STALE_TMP_AGE, check_writable, check_writable_for, last_published, print_fallback, publish,
    write_atomic, write_atomic_with, write_bytes_atomic,
};

use crate::core::fingerprint::BlockIdentity;
use crate::core::geometry::KvPart;
use crate::core::verify::{Class, SectorRun, WrongRow};
use crate::env::envinfo::Environment;
use crate::error::{Error, Exit};
use serde::Serialize;
use std::collections::BTreeMap;

/// Report schema identifier; bumped on incompatible changes.
pub const SCHEMA: &str = "kvprobe.report/1";

/// What a stray-write check compared a slot against.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum StrayCheck {
    /// The poison of (iteration, slot), right before the slot's stage was posted.
    Poison,
    /// The fingerprint the slot had verified clean against, after the last iteration.
    Reverify,
}

/// One corrupt block slice.
#[derive(Clone, Debug, Serialize, serde::Deserialize)]
pub struct Failure {
    /// Sweep iteration, counted from 1 (scenarios: the engine step of the verify, from 0).
    pub iteration: u32,
    /// Layer.
    pub layer: u32,
    /// "K", "V" or "latent".
    pub kv: KvPart,
    /// Decode-side block id (the physical slot that was checked).
    pub block: u32,
    /// With `--decode-tp` > 1: the decode TP rank whose pool holds the slot (absent: rank 0
    /// of one).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tp_rank: Option<u32>,
    /// The failure class.
    pub class: Class,
    /// The slot's global slice index in the decode pool (`layer * slices_per_layer +` the
    /// slice's index in its layer region; [`crate::core::geometry::Geometry::global_slice`]): the
    /// `slot` of its poison.
    pub slot: u32,
    /// The iteration number the slot's poison was written with before the transfer (sweeps:
    /// `iteration`; scenarios: the engine step at which decode poisoned the block, mod 2^24).
    pub poison_iteration: u32,
    /// Smallest byte offset `i` within the slice where the received byte differs from the
    /// expected fingerprint's byte `i`.
    pub first_bad_offset: u64,
    /// Number of byte offsets `i` in `[0, slice_bytes)` where the received byte differs from
    /// the expected one (bytes, not bits or elements).
    pub bad_bytes: u64,
    /// SHA-256 of the expected slice bytes.
    pub expected_digest: String,
    /// SHA-256 of the received slice bytes.
    pub actual_digest: String,
    /// Identity the slice actually holds (decoded from its tags), when any.
    pub observed: Option<BlockIdentity>,
    /// Identity the slot should hold.
    pub expected: BlockIdentity,
    /// Prefill-side block id the slot was to receive from.
    pub prefill_block: u32,
    /// Flipped bits (bitflip only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bit_flips: Option<u64>,
    /// Source of each tagged unit (a head row, or 512 bytes of a longer row), in runs (torn
    /// only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sectors: Option<Vec<SectorRun>>,
    /// How the wrong rows are displaced, when they share one displacement (layout only):
    /// `transposed (NHD rows read as HND, or HND as NHD)`, `head offset +N` or
    /// `token offset +N`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub displacement: Option<String>,
    /// The first wrong rows (layout only, at most [`crate::core::verify::MAX_LISTED_ROWS`]): the
    /// row index, the token and head due there and the token and head it holds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rows: Option<Vec<WrongRow>>,
    /// Scenario runs: the request whose block this is (`iteration` is then the engine step).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request: Option<u64>,
    /// Scenario runs: what the engine's shadow of its own copies says the slot should hold
    /// at this point (differs from `expected` when an unfenced mechanism acted).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub predicted: Option<BlockIdentity>,
    /// Scenario runs: the unfenced mechanism that explains this slice; absent when nothing
    /// the engine did explains it (a defect of the stack under test).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attributed_to: Option<crate::core::mechanism::Mechanism>,
    /// The slice is an `--inject` fault found as predicted (see `injections`): its class and
    /// exactly the predicted bytes. In a scenario such a slice is neither attributed nor
    /// unexplained; in a sweep it is not counted in `summary.unexpected_failures`. Written
    /// only when set.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub injected: bool,
    /// Class `stray` only: what the slot was compared against — `poison` (the poison of
    /// (`poison_iteration`, `slot`), right before its stage was posted; `expected_digest` is
    /// that poison's) or `reverify` (the fingerprint of `expected`, which the slot had
    /// verified clean; checked after the last iteration).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stray_check: Option<StrayCheck>,
    /// Class `late` only: the class of the bytes the verify pass judged (the slice's bytes
    /// changed after the verdict; `actual_digest`, `bad_bytes`, `first_bad_offset` and a
    /// dump's slice are those judged bytes). Absent when the judged bytes were not kept (past
    /// [`crate::mem::pool::JUDGED_MAX_BYTES`] on DRAM or [`crate::mem::pool::CAPTURE_MAX_BYTES`] on
    /// VRAM): the slice was then read again and found intact.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub judged_class: Option<Class>,
}

impl Failure {
    /// A failure from the verify pass's finding and its classification: `want` and
    /// `actual` are the expected and received slice bytes (digested here); the scenario
    /// fields are left empty and `poison_iteration` is `iteration` (a scenario sets its own).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        iteration: u32,
        c: crate::core::geometry::SliceCoord,
        raw: &crate::mem::pool::RawFailure,
        v: crate::core::verify::Verdict,
        want: &[u8],
        actual: &[u8],
        expected: BlockIdentity,
        prefill_block: u32,
    ) -> Failure {
        Failure {
            iteration,
            layer: c.layer,
            kv: c.kv,
            block: c.block,
            tp_rank: None,
            class: v.class,
            slot: raw.slice,
            poison_iteration: iteration,
            first_bad_offset: raw.first_bad,
            bad_bytes: raw.bad_bytes,
            expected_digest: crate::core::fingerprint::digest(want),
            actual_digest: crate::core::fingerprint::digest(actual),
            observed: v.observed,
            expected,
            prefill_block,
            bit_flips: v.bit_flips,
            sectors: v.sectors,
            displacement: v.displacement.map(|d| d.to_string()),
            rows: v.rows,
            request: None,
            predicted: None,
            attributed_to: None,
            injected: false,
            stray_check: None,
            judged_class: None,
        }
    }
}

/// One planted fault and whether it came back as predicted.
#[derive(Clone, Debug, Serialize, serde::Deserialize)]
pub struct InjectionRecord {
    /// Iteration.
    pub iteration: u32,
    /// Injection kind.
    pub kind: crate::core::inject::Kind,
    /// Predicted `(layer, kv, decode block, class)` outcomes.
    pub predicted: Vec<PredictedHit>,
    /// True when every predicted outcome was reported with its class.
    pub detected: bool,
    /// With TP ranks (`--prefill-tp`/`--decode-tp`): the link the fault acted on (a sweep
    /// draws one per injection with the seed; stale and bitflip are planted in its prefill
    /// rank's pool, so every decode rank reading those rows sees them). Absent with one rank
    /// each side.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub link: Option<TpLink>,
    /// `torn`: the planted tear, in bytes sent of the group's prefill slices back to back in
    /// source order (a group: [`crate::core::pairing::Sides::planning`]; equal sides: the slice's
    /// prefix; with TP: of the bytes the fault's link moves). Absent for other kinds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub torn_bytes: Option<u64>,
}

/// A (prefill TP rank, decode TP rank) pair that blocks move between.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct TpLink {
    /// The prefill rank (source of the rows).
    pub prefill_rank: u32,
    /// The decode rank (destination).
    pub decode_rank: u32,
}

/// One predicted outcome of an injection.
#[derive(Clone, Debug, Serialize, serde::Deserialize)]
pub struct PredictedHit {
    /// Layer.
    pub layer: u32,
    /// K/V/latent.
    pub kv: KvPart,
    /// Decode-side block id.
    pub block: u32,
    /// Predicted class.
    pub class: Class,
    /// With TP: the decode rank whose slice it is (absent with one decode rank).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tp_rank: Option<u32>,
    /// SHA-256 of the exact bytes the injection must leave in the slice
    /// ([`crate::core::inject::Prediction`]): a failure there is "as predicted" only when its
    /// `actual_digest` equals it (and its class is `class`). Absent in older reports.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub digest: Option<String>,
    /// The byte ranges `[offset, bytes]` of the slice (decode's layout, after any conversion
    /// on receive) that its transfer wrote, when not the whole slice (a tear, a drop: `[]`):
    /// there the fingerprint due, everywhere else the slot's poison of the iteration. Absent
    /// for a slice written whole, a stray write and in older reports.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub written: Option<Vec<[u64; 2]>>,
}

/// Totals over the run.
#[derive(Clone, Debug, Default, Serialize, serde::Deserialize)]
pub struct Summary {
    /// Iterations completed.
    pub iterations: u32,
    /// Block slices verified (all iterations).
    pub blocks_checked: u64,
    /// Block slices the verify passes actually compared against their fingerprint, counted
    /// by the passes themselves (the verify kernel on VRAM, the CPU pass on DRAM; see
    /// [`crate::mem::pool::Compared`]), all iterations. Equals `blocks_checked` when every
    /// checked slice was compared.
    pub slices_compared: u64,
    /// Bytes those passes compared (all iterations): `slices_compared * slice bytes` when
    /// every slice was compared whole.
    pub bytes_compared: u64,
    /// Block slices found corrupt (all iterations).
    pub blocks_corrupt: u64,
    /// Corrupt slices per class (every class listed, zeros included).
    pub by_class: BTreeMap<String, u64>,
    /// Bytes moved by NIXL (all iterations).
    pub bytes_transferred: u64,
    /// Seconds spent in transfers (post to completion).
    pub transfer_seconds: f64,
    /// bytes_transferred / transfer_seconds / 1e9.
    pub transfer_gbps: f64,
    /// Wall seconds (synchronised) spent filling prefill slices outside the transfers, all
    /// iterations (sweep: the last pipeline stage's refill; scenarios: every fill).
    pub fill_seconds: f64,
    /// Wall seconds spent poisoning decode slices outside the transfers.
    pub poison_seconds: f64,
    /// Wall seconds spent verifying decode slices outside the transfers (kernel or CPU
    /// pass, plus classification).
    pub verify_seconds: f64,
    /// Sweep: wall seconds of probe work done while transfers were in flight (the pipelined
    /// stages' verify, refill, re-poison and planning; see [`IterationTimes::overlapped`]).
    pub overlapped_seconds: f64,
    /// Peak resident host memory of the kvprobe process at the end of the run (bytes,
    /// VmHWM): DRAM pools included; with VRAM pools it stays O(failures + blocks), not
    /// O(pool bytes) — the host never holds a copy of the pool. With `--decode-process` the
    /// prefill process's own memory (its pool, on DRAM) is not included. `None` where /proc is missing or
    /// the run was refused before it started.
    pub host_peak_bytes: Option<u64>,
    /// Pipeline stages of the sweep (consecutive layer ranges, one NIXL request each).
    pub pipeline_stages: u32,
    /// Pipelined sweeps (more than one stage): block slices the stray-write checks compared
    /// against their poison right before their stage was posted (every slice, every
    /// iteration), counted by the check passes; not part of `slices_compared`.
    pub stray_poison_checked_slices: u64,
    /// Pipelined sweeps: block slices verified again after the last iteration (the layers of
    /// every stage but the last), counted by the verify pass; not part of `slices_compared`.
    pub stray_reverified_slices: u64,
    /// Pipelined sweeps: wall seconds of the stray-write checks outside the transfer window
    /// (the first two stages' poison checks, the final re-verify); the checks made while
    /// transfers were in flight are in `overlapped_seconds`.
    pub stray_check_seconds: f64,
    /// Pool bytes verified per second of verify passes (all stages, classification
    /// included) / 1e9 (GB/s).
    pub verify_gbps: f64,
    /// Failures left out of `failures` by `--max-failures`.
    pub failures_omitted: u64,
    /// Injections planted.
    pub injections_planted: u64,
    /// Injections whose predicted outcomes were all reported.
    pub injections_detected: u64,
    /// Corrupt slices not predicted by any injection.
    pub unexpected_failures: u64,
    /// Sweep: wall seconds of the iterations (fill, poison, transfer, verify and the host
    /// work between them); the host work is this minus the four parts (`overlapped` lies
    /// inside `transfer`).
    pub iteration_seconds: f64,
    /// Seconds from the start of the run (NIXL load, environment, pools, kernels, agents) to
    /// the first transfer being posted.
    pub setup_seconds: f64,
    /// VRAM pools: device seconds of the fill, poison and verify kernels alone (CUDA events),
    /// all iterations; 0 on DRAM.
    pub kernel_seconds: KernelSeconds,
    /// What carried the transfers: NIXL backend, UCX's protocol selection for the run's
    /// memory types, and the transfer rate against a same-run copy of the pool (sweeps).
    pub transport_path: Option<crate::xfer::ucx::TransportPath>,
    /// Sweep: the times of each iteration, in order, for the first [`PER_ITERATION_MAX`]
    /// (`kvprobe bench` takes medians over all but the first, which warms up: page faults, UCX
    /// connection and registration caches). The totals above cover every iteration.
    pub per_iteration: Vec<IterationTimes>,
}

/// Iterations listed in `summary.per_iteration` at most (the report stays small on long runs).
pub const PER_ITERATION_MAX: usize = 1000;

/// Wall seconds of one sweep iteration and its parts (every field but `index`, `corrupt` and
/// `by_class` is in seconds), and what it found corrupt.
#[derive(Clone, Debug, Default, Serialize, serde::Deserialize)]
pub struct IterationTimes {
    /// Which iteration this is: 1-based, as in `failures[].iteration`.
    pub index: u32,
    /// Seconds: the whole iteration, wall time (a duration, not an index; the name is kept
    /// for existing readers of the report).
    pub iteration: f64,
    /// Fill outside the transfer window (the pipelined sweep: the last stage's refill).
    pub fill: f64,
    /// Poison outside the transfer window (the last stage's, and waiting for the queued
    /// passes to finish).
    pub poison: f64,
    /// The transfer window: from building the first request's descriptors to the last
    /// request's completion (every stage's NIXL requests).
    pub transfer: f64,
    /// Verify, classification included.
    pub verify: f64,
    /// Probe work done while a transfer was in flight (the pipelined sweep's verify,
    /// classification, refill and re-poison of finished stages, and the next plan); it
    /// overlaps `transfer` and is not part of the probe's share.
    pub overlapped: f64,
    /// VRAM: device seconds of the kernels alone.
    pub kernels: KernelSeconds,
    /// Block slices found corrupt in this iteration (every class, strays included).
    pub corrupt: u64,
    /// Of those, the slices no `--inject` fault predicts (`summary.unexpected_failures` of
    /// this iteration; all of `corrupt` when nothing was planted). Absent in older reports
    /// (read as 0).
    #[serde(default)]
    pub unexpected: u64,
    /// Those slices per class (classes with none left out).
    pub by_class: BTreeMap<String, u64>,
}

impl Summary {
    /// An empty summary with every class at zero.
    pub fn new() -> Summary {
        Summary { by_class: Class::ALL.iter().map(|c| (c.name().to_string(), 0)).collect(), ..Default::default() }
    }
}

/// The error that ended a run, if any.
#[derive(Clone, Debug, Serialize, serde::Deserialize)]
pub struct RunError {
    /// "usage", "environment", "transport", "device", "timeout" or "io".
    pub kind: String,
    /// The message.
    pub message: String,
}

/// How the run ended.
#[derive(Clone, Debug, Serialize, serde::Deserialize)]
pub struct Outcome {
    /// Process exit code (see README "Exit codes").
    pub exit_code: u8,
    /// "clean", "corrupt", "error", "timeout", "below-min-gbps", "not-reproduced" (an
    /// unfenced `--race` mechanism, or an ab row, not detected) or "interrupted".
    pub status: String,
    /// The error, when the run stopped early.
    pub error: Option<RunError>,
}

/// What the report says about its dump (`dump` in the report; written by `dump`).
#[derive(Clone, Debug, Serialize, serde::Deserialize, PartialEq)]
pub struct DumpSummary {
    /// The dump directory as given.
    pub dir: String,
    /// Slices written.
    pub slices_written: u64,
    /// Slices left out (cap or truncation).
    pub slices_omitted: u64,
    /// Bytes of slice files written.
    pub bytes_written: u64,
    /// The cap (bytes).
    pub max_bytes: u64,
    /// Why the dump stopped early, or why `index.json` could not be written (`dump_truncated`).
    pub dump_truncated: Option<String>,
}

/// The whole report.
#[derive(Clone, Debug, Serialize, serde::Deserialize)]
pub struct Report {
    /// Always [`SCHEMA`].
    pub schema: String,
    /// Unix time (seconds) the run started.
    pub started_unix: u64,
    /// Run parameters as resolved (preset expanded).
    pub config: serde_json::Value,
    /// Whether decode converted the slices it received into its own layout and block size
    /// (the run's [`crate::core::pairing::Sides::converts`], recorded when the run starts, so
    /// rendering re-derives no pairing; vLLM's `kv_postprocess_*_on_receive`). Absent in
    /// reports of older kvprobes and of runs refused before their sides were known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decode_converts: Option<bool>,
    /// Machine, GPUs, NIXL.
    pub environment: Option<Environment>,
    /// Totals.
    pub summary: Summary,
    /// Corrupt slices, at most `--max-failures`.
    pub failures: Vec<Failure>,
    /// Planted faults.
    pub injections: Vec<InjectionRecord>,
    /// Scenario runs (`--scenario`): load, tier, race outcomes, error rate over time.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scenario: Option<ScenarioReport>,
    /// `--dump DIR`: what was dumped (docs/report.md "Dumps").
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dump: Option<DumpSummary>,
    /// Node-pair runs (`run --peer`, `serve`): the other side — its environment, the UCX
    /// path its process saw, its timings (docs/two-hosts.md "Two hosts").
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peer: Option<PeerSide>,
    /// Serve's report of an `ab --peer` session: the matrix's rows as decode's `kvprobe.ab/1`
    /// report has them (`summary` then holds the rows' totals).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub matrix: Option<serde_json::Value>,
    /// A hybrid model's regions beside its attention layers (state, indexer), each as the run
    /// moved and verified it (`crate::sweep::regions`); absent for other models.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub regions: Vec<RegionReport>,
    /// How it ended.
    pub outcome: Outcome,
}

/// One region of a hybrid model's KV cache on one TP rank (recurrent state, indexer K cache),
/// as the run moved and verified it: its layout (docs/geometry.md "Hybrid KV caches"), what
/// moved, what was compared, what was wrong.
#[derive(Clone, Debug, PartialEq, Serialize, serde::Deserialize)]
pub struct RegionReport {
    /// `state` or `indexer`.
    pub kind: String,
    /// `KDA state`, `Mamba2 state`, `indexer K cache`, ...
    pub name: String,
    /// The TP rank whose pages moved.
    pub rank: u32,
    /// The region's layers.
    pub layers: u32,
    /// `slot` (a request's state) or `block`.
    pub unit: String,
    /// Units of each side's pool.
    pub units: u32,
    /// Payload bytes of one page (one layer and unit, this rank).
    pub page_bytes: u64,
    /// Bytes from one page to the next (a state page padded to the attention page).
    pub page_stride_bytes: u64,
    /// NIXL descriptors per decode page, over every prefill rank read (a state slot between
    /// equal TP sizes: one per conv sub-projection, then the state).
    pub descriptors_per_page: u32,
    /// The prefill TP ranks the pages were read from (the same rank between equal TP sizes;
    /// each rank holding part of the page's rows otherwise).
    #[serde(default)]
    pub prefill_ranks: Vec<u32>,
    /// Bytes the transfer moved (the descriptors' sum; 0 for a region left out).
    pub bytes_moved: u64,
    /// Seconds from the request's post to its notification.
    pub seconds: f64,
    /// Pages decode compared.
    pub pages_compared: u64,
    /// Pages with at least one wrong row run.
    pub pages_corrupt: u64,
    /// Row runs compared (a page's conv sub-projections and state, or an indexer block's
    /// values and scales).
    pub runs_compared: u64,
    /// Faults planted in the region (`--inject CLASS[:N]@REGION`).
    #[serde(default)]
    pub injections_planted: u64,
    /// Of those, the ones whose every predicted run was found with its class and exactly its
    /// predicted bytes.
    #[serde(default)]
    pub injections_detected: u64,
    /// Wrong row runs no planted fault predicts (all of them when nothing was planted).
    #[serde(default)]
    pub unexpected_failures: u64,
    /// The faults planted, each with the runs it predicts.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub injections: Vec<RegionInjection>,
    /// Wrong row runs, at most `--max-failures`.
    pub failures: Vec<RegionFailure>,
}

/// One fault planted in a region's pages (`--inject CLASS[:N]@REGION`).
#[derive(Clone, Debug, PartialEq, Serialize, serde::Deserialize)]
pub struct RegionInjection {
    /// `bitflip`, `drop`, `misroute`, `stale`, `torn`.
    pub kind: String,
    /// The model layer.
    pub layer: u32,
    /// Prefill's unit it acted on.
    pub unit: u32,
    /// The runs it must leave wrong, each with its class (their exact bytes are checked too).
    pub predicted: Vec<RegionPredicted>,
    /// Every predicted run found with its class and exactly its predicted bytes.
    pub detected: bool,
}

/// One row run a region fault predicts.
#[derive(Clone, Debug, PartialEq, Serialize, serde::Deserialize)]
pub struct RegionPredicted {
    /// The model layer.
    pub layer: u32,
    /// Decode's unit.
    pub unit: u32,
    /// The run (`conv q`, `recurrent`, `k`, ...).
    pub part: String,
    /// The class it must have.
    pub class: crate::core::verify::Class,
}

/// One wrong row run of a region page.
#[derive(Clone, Debug, PartialEq, Serialize, serde::Deserialize)]
pub struct RegionFailure {
    /// The model layer.
    pub layer: u32,
    /// The run (`conv q`, `recurrent`, `ssm`, `k`, `scale`, ...).
    pub part: String,
    /// Decode's unit (state slot or block) that held it.
    pub unit: u32,
    /// The logical id due there (a request's state, or a logical block).
    pub id: u32,
    /// Its class ([`crate::core::verify::Class`]).
    pub class: crate::core::verify::Class,
    /// What the run held instead, when its rows decode.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed: Option<crate::core::fingerprint::BlockIdentity>,
    /// Flipped bits (bitflip only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bit_flips: Option<u64>,
    /// A planted fault found as predicted (its class and exactly its predicted bytes); written
    /// only when true.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub injected: bool,
    /// Under request load (`--scenario`): the request whose state slot it was (`id` is that
    /// request's state id).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request: Option<u64>,
}

pub use crate::mem::pool::KernelSeconds;
pub use crate::sys::units::{bytes_binary, bytes_exact, plural};

/// One side of a node pair as the other side's report records it (`run --peer` records
/// prefill's, `serve` records decode's).
#[derive(Clone, Debug, Default, Serialize, serde::Deserialize)]
pub struct PeerSide {
    /// `prefill` or `decode`.
    pub role: String,
    /// The address the run connected to (`--peer`), or the client's address (serve).
    pub address: String,
    /// The side's host name.
    pub host: String,
    /// The run's id (16 hex digits), the same in both reports.
    pub run_id: String,
    /// The side's pool memory.
    pub memory: Option<crate::mem::pool::MemoryKind>,
    /// The side's GPU (VRAM).
    pub device: usize,
    /// The side's machine, GPUs, driver, NIXL and UCX versions.
    pub environment: Option<crate::env::envinfo::Environment>,
    /// UCX's protocol selections as the side's process logged them for this run (READ or
    /// WRITE, whichever it initiated or served).
    pub transport_path: Option<crate::xfer::ucx::TransportPath>,
    /// Seconds the side spent setting up (pool, NIXL agent), filling (prefill: every fill and
    /// planted fault, its clock) and, for WRITE, with its requests in flight.
    pub setup_seconds: f64,
    /// See `setup_seconds`.
    pub fill_seconds: f64,
    /// Fills the side completed (stages or whole pools).
    pub fills: u64,
    /// WRITE requests the side posted and bytes they moved.
    pub writes: u64,
    /// See `writes`.
    pub bytes_written: u64,
    /// The side's exit code, when it said.
    pub exit_code: Option<u8>,
    /// True when the side did not send its part at the end (it had died, stopped, or the
    /// link dropped): the fields are what was known from the start of the run.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub bye_missing: bool,
}

/// One mechanism's outcome in a run.
#[derive(Clone, Debug, Serialize, serde::Deserialize)]
pub struct RaceOutcome {
    /// The mechanism.
    pub mechanism: crate::core::mechanism::Mechanism,
    /// Kept or left out in this run.
    pub fencing: crate::core::mechanism::Fencing,
    /// Times the unfenced ordering let a conflicting copy happen.
    pub windows_opened: u64,
    /// Corrupt slices at decode explained by this mechanism.
    pub corrupt_attributed: u64,
    /// Those slices by class.
    pub classes: BTreeMap<String, u64>,
    /// Classes it predicts (`scenario::shadow::predicted_classes`: misplaced, stale, overwritten, torn; unwritten for failed-as-complete; stray too for decode-abort-free).
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
    /// Of those, the slices neither a race mechanism nor an `--inject` fault explains
    /// (`scenario.unexplained_corrupt` of this interval). Absent in older reports (read as 0).
    #[serde(default)]
    pub unexplained: u64,
}

/// One block-ownership violation of a scenario (docs/scenarios.md "Block ownership").
#[derive(Clone, Debug, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct OwnershipViolation {
    /// `double-free`, `free-in-flight` or `foreign-write`.
    pub kind: String,
    /// The request whose operation it was.
    pub request: u64,
    /// Prefill block id; a decode block id for decode's own checks (push mode).
    pub block: u32,
    /// The operation: `free`, `compute write` or `load write` (prefill); `decode free` or
    /// `WRITE landing` (decode, push mode).
    pub operation: String,
    /// What it conflicted with: `a READ in flight`, `a queued save`, `a load in flight`,
    /// `owned by request N`, `already free`, `a WRITE into it pending`.
    pub conflict: String,
    /// The engine step (the engines step together).
    pub step: u64,
}

impl OwnershipViolation {
    /// A violation of `kind` by request `request`'s `operation` on `block` at engine step
    /// `step`, which met `conflict`.
    pub fn new(kind: &str, request: u64, block: u32, operation: &str, conflict: String, step: u64) -> OwnershipViolation {
        OwnershipViolation { kind: kind.into(), request, block, operation: operation.into(), conflict, step }
    }
}

/// The scenario part of a report.
#[derive(Clone, Debug, Serialize, serde::Deserialize)]
pub struct ScenarioReport {
    /// Scenario.
    pub scenario: crate::core::mechanism::Scenario,
    /// Tier.
    pub tier: crate::mem::tier::TierKind,
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
    /// Block-ownership violations the prefill engine saw (a double free, a free while a
    /// transfer, save or load touches the block, a write into a block another request owns or
    /// reads), whether or not the bytes survived: 0 in every fenced run. Absent (`None`) from
    /// reports written before the checker.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ownership_violations: Option<u64>,
    /// The first violations (at most `--max-failures`), in the order they happened.
    #[serde(default)]
    pub violations: Vec<OwnershipViolation>,
    /// Decode's transfers (a request's NIXL READ, its tier-only loads) in which some blocks
    /// failed to move (`--fail-rate`): read again when failed-as-complete is fenced, counted
    /// delivered when unfenced. Absent from reports written before the fault model.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub transfers_failed: Option<u64>,
    /// One entry per mechanism: unfenced ones with their detection, fenced ones "clean" or not.
    pub races: Vec<RaceOutcome>,
    /// Error counts per `interval_secs`.
    pub intervals: Vec<Interval>,
}

/// Which listing budget a failing block slice draws on ([`Tally`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Budget {
    /// One budget for every slice: `--max-failures` listed in all (sweeps).
    Shared,
    /// Slices explained by a race mechanism or planted by `--inject` as predicted
    /// (scenarios: `--max-failures` of them).
    Explained,
    /// Slices nothing explains, defects of the stack under test (scenarios: another
    /// `--max-failures`, so a flood of explained corruption never hides them).
    Unexplained,
}

/// The failure tally of a run, the one place a failing block slice is counted and kept:
/// `summary.blocks_corrupt` and `summary.by_class` count every slice once; the record is
/// listed in `failures` within its [`Budget`] (else counted in `summary.failures_omitted`)
/// and offered to the dump, which keeps it within its own cap whether listed or not
/// ([`dump::keep_converted`]). Counts stay complete whatever is listed.
#[derive(Clone, Debug)]
pub struct Tally {
    max: u64,
    explained: u64,
    unexplained: u64,
}

impl Tally {
    /// A tally listing at most `max_failures` slices per budget (`--max-failures`).
    pub fn new(max_failures: usize) -> Tally {
        Tally { max: max_failures as u64, explained: 0, unexplained: 0 }
    }

    /// Counts one failing block slice of `class` into `report` and keeps its record (made by
    /// `make` only when listed or dumped). `actual`: the bytes classified; `received`: with
    /// a conversion on receive, the slice as NIXL delivered it (dumped beside `actual`).
    /// Returns whether the record was listed.
    #[allow(clippy::too_many_arguments)]
    pub fn record(
        &mut self,
        report: &mut Report,
        dump: Option<&mut dump::Dumper>,
        budget: Budget,
        class: Class,
        actual: &[u8],
        received: Option<&[u8]>,
        make: impl FnOnce() -> Failure,
    ) -> bool {
        report.summary.blocks_corrupt += 1;
        *report.summary.by_class.entry(class.name().to_string()).or_default() += 1;
        let listed = match budget {
            Budget::Shared => (report.failures.len() as u64) < self.max,
            Budget::Explained | Budget::Unexplained => {
                let n = if budget == Budget::Explained { &mut self.explained } else { &mut self.unexplained };
                let listed = *n < self.max;
                *n += listed as u64;
                listed
            }
        };
        if !listed {
            report.summary.failures_omitted += 1;
        }
        dump::keep_converted(dump, listed.then_some(&mut report.failures), actual, received, class, make);
        listed
    }
}

impl Report {
    /// A report with no results yet, started now: `config` as the run resolved it (JSON;
    /// `Null` for a session refused before its configuration was known), status `running`,
    /// exit code 0 until [`Report::finish`].
    pub fn start(config: serde_json::Value) -> Report {
        Report {
            schema: SCHEMA.to_string(),
            started_unix: std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0),
            config,
            decode_converts: None,
            environment: None,
            summary: Summary::new(),
            failures: Vec::new(),
            injections: Vec::new(),
            scenario: None,
            dump: None,
            peer: None,
            matrix: None,
            regions: Vec::new(),
            outcome: Outcome { exit_code: 0, status: "running".into(), error: None },
        }
    }

    /// Sets the outcome from the final exit code and error.
    pub fn finish(&mut self, exit: Exit, error: Option<&Error>) {
        self.outcome = Outcome::of(exit, error);
    }
}

/// `outcome.status` of a `run --self-test` that passed (exit 0): every planted fault was
/// found as predicted and nothing else was corrupt, so `summary.blocks_corrupt` counts only
/// planted faults.
pub const SELF_TEST_PASSED: &str = "self-test-passed";

impl Outcome {
    /// The outcome of exit code `exit` with `error`.
    pub fn of(exit: Exit, error: Option<&Error>) -> Outcome {
        let status = match exit {
            Exit::Clean => "clean",
            Exit::Corrupt => "corrupt",
            Exit::Timeout => "timeout",
            Exit::BelowRate => "below-min-gbps",
            Exit::NotReproduced => "not-reproduced",
            Exit::ReportNotWritten => "report-not-written",
            Exit::Interrupted => "interrupted",
            Exit::Usage | Exit::Transport => "error",
        };
        Outcome {
            exit_code: exit as u8,
            status: status.into(),
            error: error.map(|e| RunError { kind: e.kind().into(), message: e.to_string() }),
        }
    }
}
