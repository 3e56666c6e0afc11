//! The versioned JSON report (`schema` = [`SCHEMA`]) and the human summary.
//!
//! Reports are written atomically: to a temporary file in the target's directory, flushed
//! to disk, then renamed over the target — a reader never sees a partial report, and a
//! failed run still leaves one. When the report cannot be written (disk full, `ulimit -f`,
//! an I/O error) the temporary file is removed and the report goes to stderr instead
//! ([`print_fallback`]).

use crate::core::fingerprint::BlockIdentity;
use crate::core::geometry::KvPart;
use crate::core::verify::{Class, SectorRun, WrongRow};
use crate::env::envinfo::Environment;
use crate::error::{Error, Exit, Result};
use serde::Serialize;
use std::collections::BTreeMap;
use std::io::Write;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

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
    /// Scenario runs: the slice is an `--inject` fault found as predicted (see `injections`),
    /// neither attributed nor unexplained. Written only when set.
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
    /// How it ended.
    pub outcome: Outcome,
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
            outcome: Outcome { exit_code: 0, status: "running".into(), error: None },
        }
    }

    /// Sets the outcome from the final exit code and error.
    pub fn finish(&mut self, exit: Exit, error: Option<&Error>) {
        self.outcome = Outcome::of(exit, error);
    }
}

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

/// Longest file name most Linux filesystems accept (NAME_MAX).
const NAME_MAX: usize = 255;

/// Resolves where a report at `path` goes: a symlink is followed to its target; an
/// existing target must be a regular file (never a device, FIFO or directory — as root,
/// renaming over /dev/null would replace it). Returns (target, its directory).
fn resolve_target(path: &Path, flag: &str) -> Result<(PathBuf, PathBuf)> {
    let bad = |why: String| Error::Io(format!("{flag} {}: {why}", path.display()));
    if path.as_os_str().as_encoded_bytes().ends_with(b"/") {
        return Err(bad("names a directory (trailing /)".into()));
    }
    let target = match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_symlink() => {
            std::fs::canonicalize(path).map_err(|e| bad(format!("cannot resolve the symlink: {e}")))?
        }
        _ => path.to_path_buf(),
    };
    match std::fs::metadata(&target) {
        Ok(m) if m.is_dir() => return Err(bad("is a directory".into())),
        Ok(m) if !m.is_file() => {
            return Err(bad("is not a regular file (device, FIFO or socket)".into()));
        }
        _ => {}
    }
    let name = target.file_name().ok_or_else(|| bad("is not a file path".into()))?;
    if name.len() > NAME_MAX {
        return Err(bad(format!("the file name is longer than {NAME_MAX} bytes")));
    }
    let dir = match target.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    Ok((target, dir))
}

/// Checks, before a run, that a report can be written at `path`: not a directory or
/// special file, an existing report can be opened for writing (not immutable), and its
/// directory accepts a new file (an anonymous temporary file is created there).
/// Errors: [`Error::Io`] (exit 2).
pub fn check_writable(path: &Path) -> Result<()> {
    check_writable_for(path, "--report")
}

/// [`check_writable`] for a file named by `flag` (e.g. "--json"), which errors name.
pub fn check_writable_for(path: &Path, flag: &str) -> Result<()> {
    let (target, dir) = resolve_target(path, flag)?;
    if target.exists() {
        std::fs::OpenOptions::new()
            .write(true)
            .open(&target)
            .map_err(|e| Error::Io(format!("{flag} {}: cannot replace it: {e}", path.display())))?;
    }
    tempfile::tempfile_in(&dir)
        .map_err(|e| Error::Io(format!("{flag} {}: cannot create files in {}: {e}", path.display(), dir.display())))?;
    Ok(())
}

/// Name prefix of a report being written (beside its target).
const TMP_PREFIX: &str = ".kvprobe-report.";
/// Name suffix of a report being written.
const TMP_SUFFIX: &str = ".tmp";
/// A temporary report is removed by a later write into its directory once it is older than
/// this and nobody holds its lock: its writer locks it right after creating it and holds the
/// lock until the rename, so only a writer killed mid-write (SIGKILL) leaves one; the age
/// covers the instant between creating and locking.
pub const STALE_TMP_AGE: std::time::Duration = std::time::Duration::from_secs(60);

/// Removes the temporary reports (`.kvprobe-report.*.tmp`) in `dir` that killed writers left
/// (see [`STALE_TMP_AGE`]); only this user's regular files. Best effort.
fn sweep_stale_temps(dir: &Path) {
    use std::os::unix::fs::MetadataExt;
    let (Ok(entries), Some(me)) = (std::fs::read_dir(dir), crate::sys::tempdir::own_uid()) else { return };
    for e in entries.flatten() {
        let name = e.file_name();
        let Some(name) = name.to_str() else { continue };
        if !(name.starts_with(TMP_PREFIX) && name.ends_with(TMP_SUFFIX)) {
            continue;
        }
        let path = e.path();
        let Ok(m) = std::fs::symlink_metadata(&path) else { continue };
        let old = m.modified().ok().and_then(|t| t.elapsed().ok()).is_some_and(|age| age > STALE_TMP_AGE);
        if m.is_file() && m.uid() == me && old && std::fs::File::open(&path).is_ok_and(|f| f.try_lock().is_ok()) {
            let _ = std::fs::remove_file(&path);
        }
    }
}

/// The report of the run in progress as last published ([`publish`]), for the watchdog.
static SHADOW: std::sync::Mutex<Option<Report>> = std::sync::Mutex::new(None);

/// Publishes the report so far, so that a call that blocks past its deadline still ends the
/// run with it (`run::expired_report`, the watchdog of `deadline`). Called after set-up steps, after
/// each sweep iteration and with each scenario progress update. Cheap: listed failures and
/// injections are appended, not copied again (a run only ever appends to them).
pub fn publish(r: &Report) {
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

/// The report last [`publish`]ed in this process, if any.
pub fn last_published() -> Option<Report> {
    SHADOW.lock().unwrap_or_else(|p| p.into_inner()).clone()
}

/// Writes `value` as pretty JSON to `path` atomically: a new temporary file with a random
/// name in the target's directory (created exclusively, never through a symlink), given the
/// replaced report's mode and owner, synced, then renamed over the target; removed again when
/// any step fails. Temporary reports that killed writers left in that directory are removed
/// first ([`STALE_TMP_AGE`]). Symlinks at `path` are followed to their target; special files
/// are refused. Errors: [`Error::Io`] (exit 2).
pub fn write_atomic<T: Serialize>(path: &Path, value: &T) -> Result<()> {
    let mut body = serde_json::to_vec_pretty(value).map_err(|e| Error::Io(format!("report: serialise: {e}")))?;
    body.push(b'\n');
    write_bytes_atomic(path, &body, "--report")
}

/// Writes `body` to `path` atomically, exactly as [`write_atomic`] writes a report; `flag`
/// names the option in errors ("--junit"). Errors: [`Error::Io`] (exit 2).
pub fn write_bytes_atomic(path: &Path, body: &[u8], flag: &str) -> Result<()> {
    write_atomic_with(path, flag, |f| f.write_all(body))
}

/// [`write_bytes_atomic`] streaming: `fill` writes the body into the temporary file (a
/// bundle's archive), which is then synced and renamed over `path`; removed when any step
/// fails. Errors: [`Error::Io`] (exit 2).
pub fn write_atomic_with(path: &Path, flag: &str, fill: impl FnOnce(&mut std::fs::File) -> std::io::Result<()>) -> Result<()> {
    use std::os::unix::fs::MetadataExt;
    let label = flag.trim_start_matches('-');
    let io = |what: &str, e: std::io::Error| Error::Io(format!("{label}: {what} {}: {e}", path.display()));
    let (target, dir) = resolve_target(path, flag)?;
    sweep_stale_temps(&dir);
    let mut tmp = tempfile::Builder::new()
        .prefix(TMP_PREFIX)
        .suffix(TMP_SUFFIX)
        .tempfile_in(&dir)
        .map_err(|e| io("create temp file for", e))?;
    // Marks the file as being written, for [`sweep_stale_temps`] (released when it closes).
    let _ = tmp.as_file().try_lock();
    let f = tmp.as_file_mut();
    match std::fs::metadata(&target) {
        Ok(m) => {
            // Keep the replaced report's owner and mode (without set-id bits).
            let _ = std::os::unix::fs::fchown(&*f, Some(m.uid()), Some(m.gid()));
            let _ = f.set_permissions(std::fs::Permissions::from_mode(m.mode() & 0o777));
        }
        Err(_) => {
            let _ = f.set_permissions(std::fs::Permissions::from_mode(0o644));
        }
    }
    fill(f).map_err(|e| io("write", e))?;
    f.sync_all().map_err(|e| io("sync", e))?;
    tmp.persist(&target).map_err(|e| io("rename into", e.error))?;
    if let Ok(d) = std::fs::File::open(&dir) {
        let _ = d.sync_all();
    }
    Ok(())
}

/// The line before a report printed on stderr because it could not be written ([`print_fallback`]).
pub const FALLBACK_BEGIN: &str = "-----BEGIN KVPROBE REPORT-----";
/// The line after it.
pub const FALLBACK_END: &str = "-----END KVPROBE REPORT-----";

/// Puts a report that could not be written (`why`: [`write_atomic`]'s error) on stderr
/// instead, so a finished run's result is never lost: a message naming the error and where
/// the report went, then the JSON exactly as the file would have held it, alone on the lines
/// between [`FALLBACK_BEGIN`] and [`FALLBACK_END`]. `what` names the file for the message
/// ("--report r.json"). Returns false when stderr did not take it either (then nothing more
/// can be done: the human summary on stdout is all that is left).
pub fn print_fallback<T: Serialize>(what: &str, value: &T, why: &Error) -> bool {
    let Ok(body) = serde_json::to_string_pretty(value) else { return false };
    let text = format!(
        "kvprobe: {what} was not written ({why}); the report follows on stderr, between the lines {FALLBACK_BEGIN} and {FALLBACK_END}\n{FALLBACK_BEGIN}\n{body}\n{FALLBACK_END}\n"
    );
    let mut e = std::io::stderr().lock();
    e.write_all(text.as_bytes()).and_then(|_| e.flush()).is_ok()
}

/// Bytes in decimal units (B, kB, MB, GB; 1 GB = 1e9 B), three decimals.
fn human_bytes(b: u64) -> String {
    let x = b as f64;
    match b {
        0..1_000 => format!("{b} B"),
        1_000..1_000_000 => format!("{:.3} kB", x / 1e3),
        1_000_000..1_000_000_000 => format!("{:.3} MB", x / 1e6),
        _ => format!("{:.3} GB", x / 1e9),
    }
}

/// Bytes per second of wall time in GB/s (1e9 B/s); 0 for no time.
fn wall_gbps(bytes: u64, secs: f64) -> f64 {
    if secs > 0.0 { bytes as f64 / secs / 1e9 } else { 0.0 }
}

/// The human summary printed on stdout, for a run that wrote no JSON report
/// ([`render_with`]`(r, None)`).
pub fn render(r: &Report) -> String {
    render_with(r, None)
}

/// The human summary printed on stdout. `json` names where the run's JSON report is (e.g.
/// "kvprobe-report.json", "report.json in the bundle"): the summary shows at most 5 failures
/// and points there for the rest; `None` when there is none (it says `--report FILE` would
/// list them).
pub fn render_with(r: &Report, json: Option<&str>) -> String {
    let s = &r.summary;
    let mut out = String::new();
    if let Some(lib) = r.environment.as_ref().and_then(|e| e.nixl.library.as_ref()) {
        let backend = r.config.get("backend").and_then(|b| b.as_str()).unwrap_or("?");
        // How requests were made and the backend's parameters (reports before the flags
        // have neither).
        let mut how = String::new();
        if let Some(x) = r.config.get("xfer_req").and_then(|x| x.as_str()) {
            how += &format!(", {x} requests");
        }
        if let Some(p) = r.config.get("backend_params").and_then(|p| p.as_object()) {
            for (k, v) in p {
                how += &format!(", {k}={}", v.as_str().unwrap_or("?"));
            }
        }
        out += &format!("nixl:              {} (backend {backend}{how})\n", lib.display());
    }
    if let Some(m) = r.config.get("model").filter(|m| m.is_object()) {
        // `config.model` (--model-config): read as JSON, the report depends on nothing above it.
        let groups = m["layer_groups"].as_array().map(Vec::len).unwrap_or(0);
        out += &format!(
            "model:             {} ({}), tp {} ({} KV head(s) per rank), --kv-cache-dtype {}{}\n",
            m["path"].as_str().unwrap_or("?"),
            m["model_type"].as_str().unwrap_or("model_type not given"),
            m["tp"]["tp"],
            m["tp"]["kv_heads_per_rank"],
            m["kv_cache_dtype"].as_str().unwrap_or("?"),
            if groups > 1 { format!(", {groups} layer groups (every layer moved)") } else { String::new() }
        );
    }
    if let Ok(g) = serde_json::from_value::<crate::core::geometry::Geometry>(r.config["geometry"].clone()) {
        out += &format!(
            "pool:              {} per side, {} layers x {} x {} blocks, {}-byte block slices ({}){}\n",
            r.config["memory"].as_str().unwrap_or("?"),
            g.num_layers,
            if g.mla { "latent" } else { "K/V" },
            g.num_blocks,
            g.slice_bytes().unwrap_or(0),
            g.pool_bytes().map(|b| format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64)).unwrap_or_default(),
            if r.config["decode_process"] == true { "; prefill in a second process (--decode-process)" } else { "" }
        );
        if let Ok(d) = serde_json::from_value::<crate::core::geometry::Geometry>(r.config["decode_geometry"].clone()) {
            let lay = |g: &crate::core::geometry::Geometry| {
                if g.mla {
                    "MLA"
                } else if g.layout == crate::core::geometry::Layout::Hnd {
                    "HND"
                } else {
                    "NHD"
                }
            };
            out += &format!(
                "sides:             prefill {} blocks of {} tokens {}, decode {} blocks of {} tokens {}{}\n",
                g.num_blocks,
                g.block_size,
                lay(&g),
                d.num_blocks,
                d.block_size,
                lay(&d),
                {
                    // What decode's conversion on receive did, when it did anything (recorded
                    // by the run: `decode_converts`; vLLM's kv_postprocess_*_on_receive).
                    let converts = r.decode_converts == Some(true);
                    let chunks = (g.block_size < d.block_size)
                        .then(|| format!("chunks of {} tokens into blocks of {}", g.block_size, d.block_size));
                    match (converts, lay(&g) != lay(&d), chunks) {
                        (false, ..) => String::new(),
                        (true, true, c) => format!(
                            ", decode converts on receive (--permute-local-kv: {} into {}{})",
                            lay(&g),
                            lay(&d),
                            c.map(|c| format!(", {c}")).unwrap_or_default()
                        ),
                        (true, false, c) => {
                            format!(", decode converts on receive ({} {})", lay(&g), c.unwrap_or_else(|| "rows".into()))
                        }
                    }
                }
            );
        }
        if let Ok(t) = serde_json::from_value::<crate::core::pairing::tp::Tp>(r.config["tp"].clone()) {
            let side = |n: u32| {
                let per = t.heads_per_rank(n);
                let copies = if t.mla || n <= t.total_kv_heads {
                    String::new()
                } else {
                    format!(", each head on {} ranks", n / t.total_kv_heads)
                };
                if t.mla {
                    return format!("{n} rank{} (the MLA latent on each)", if n == 1 { "" } else { "s" });
                }
                format!(
                    "{n} rank{} ({per} KV head{} each{copies})",
                    if n == 1 { "" } else { "s" },
                    if per == 1 { "" } else { "s" }
                )
            };
            // Ranks on their own GPUs (`--prefill-device A,B`, `--decode-device A,B`).
            let gpus = |k: &str| {
                r.config[k].as_array().map(|v| {
                    let l: Vec<String> = v.iter().map(|x| x.to_string()).collect();
                    l.join(",")
                })
            };
            let placed = match (gpus("prefill_rank_devices"), gpus("decode_rank_devices")) {
                (None, None) => String::new(),
                (p, d) => format!(
                    "; GPUs by rank: prefill {}, decode {}",
                    p.unwrap_or_else(|| r.config["prefill_device"].to_string()),
                    d.unwrap_or_else(|| r.config["decode_device"].to_string())
                ),
            };
            let heads = if t.mla { "MLA".to_string() } else { format!("{} KV heads in all", t.total_kv_heads) };
            out += &format!(
                "tensor parallel:   prefill {}, decode {}; {heads}, one NIXL agent per rank{placed}\n",
                side(t.prefill),
                side(t.decode),
            );
        }
    }
    if let Some(p) = &r.peer {
        let mem = match p.memory {
            Some(crate::mem::pool::MemoryKind::Vram) => format!("VRAM on GPU {}", p.device),
            Some(crate::mem::pool::MemoryKind::Dram) => "DRAM".into(),
            None => "?".into(),
        };
        out += &format!(
            "pair:              {} on {} ({}, {mem}), run {}{}\n",
            p.role,
            if p.host.is_empty() { "?" } else { &p.host },
            p.address,
            p.run_id,
            if p.bye_missing { "; it sent no report at the end" } else { "" }
        );
        if let Some(t) = &p.transport_path {
            out += &format!("                   its UCX path: {}\n", crate::xfer::ucx::describe(t));
        }
    }
    match &r.scenario {
        None => out += &format!("iterations:        {}\n", s.iterations),
        Some(sc) => {
            let unf: Vec<&str> = sc
                .races
                .iter()
                .filter(|o| o.fencing == crate::core::mechanism::Fencing::Unfenced)
                .map(|o| o.mechanism.name())
                .collect();
            let tier = if sc.scenario.uses_tier() {
                format!(
                    "tier {}",
                    serde_json::to_value(sc.tier).ok().and_then(|v| v.as_str().map(str::to_string)).unwrap_or_default()
                )
            } else {
                "no tier".to_string()
            };
            out += &format!(
                "scenario:          {}, {tier}, {}\n",
                sc.scenario.name(),
                if unf.is_empty() { "every race mechanism fenced".to_string() } else { format!("unfenced: {}", unf.join(", ")) }
            );
            out += &format!(
                "requests:          {} verified, {} aborted by the client; {} steps in {:.3} s\n",
                sc.requests_verified, sc.requests_aborted, sc.steps, sc.seconds
            );
            if sc.scenario.uses_tier() {
                out += &format!(
                    "tier:              {} prefix-hit blocks, {} saves, {} loads, {} evictions\n",
                    sc.tier_hit_blocks, sc.tier_saves, sc.tier_loads, sc.tier_evictions
                );
                if sc.tier_detail != "embedded" && !sc.tier_detail.is_empty() {
                    out += &format!("                   {}\n", sc.tier_detail);
                }
            }
            if let Some(n) = sc.transfers_failed.filter(|&n| n > 0) {
                let fenced = !sc.races.iter().any(|o| {
                    o.mechanism == crate::core::mechanism::Mechanism::FailedAsComplete
                        && o.fencing == crate::core::mechanism::Fencing::Unfenced
                });
                out += &format!(
                    "failed transfers:  {n} moved only some blocks (--fail-rate); {}\n",
                    if fenced {
                        "their failed blocks were read again"
                    } else {
                        "counted delivered (failed-as-complete unfenced)"
                    }
                );
            }
            if let Some(n) = sc.ownership_violations {
                let mut kinds: BTreeMap<&str, u64> = BTreeMap::new();
                for v in &sc.violations {
                    *kinds.entry(v.kind.as_str()).or_default() += 1;
                }
                let listed: Vec<String> = kinds.iter().map(|(k, c)| format!("{k} {c}")).collect();
                out += &format!(
                    "ownership:         {n} block-ownership violations{}\n",
                    if listed.is_empty() { String::new() } else { format!(" (listed: {})", listed.join(", ")) }
                );
            }
        }
    }
    out += &format!("block slices:      {} checked, {} corrupt\n", s.blocks_checked, s.blocks_corrupt);
    if s.blocks_corrupt > 0 {
        let parts: Vec<String> = s.by_class.iter().filter(|(_, n)| **n > 0).map(|(k, n)| format!("{k} {n}")).collect();
        out += &format!("corrupt by class:  {}\n", parts.join(", "));
    }
    if let Some(sc) = &r.scenario {
        for o in sc.races.iter().filter(|o| o.fencing == crate::core::mechanism::Fencing::Unfenced || o.corrupt_attributed > 0) {
            let classes: Vec<String> = o.classes.iter().map(|(k, n)| format!("{k} {n}")).collect();
            out += &format!(
                "race:              {}: {} ({} windows opened, {} corrupt slices attributed{}){}\n",
                o.mechanism,
                o.verdict,
                o.windows_opened,
                o.corrupt_attributed,
                if classes.is_empty() { String::new() } else { format!(": {}", classes.join(", ")) },
                o.why.as_ref().map(|w| format!(" - {w}")).unwrap_or_default()
            );
        }
        if sc.unexplained_corrupt > 0 {
            out += &format!(
                "UNEXPLAINED:       {} corrupt slices no kvprobe operation explains: a defect of the stack under test\n",
                sc.unexplained_corrupt
            );
        }
        if sc.intervals.len() > 1 && sc.intervals.iter().all(|i| i.corrupt == 0) {
            out += &format!("error rate:        {} intervals, 0 corrupt in each\n", sc.intervals.len());
        } else if sc.intervals.len() > 1 {
            let worst = sc.intervals.iter().max_by_key(|i| i.corrupt).expect("non-empty");
            out += &format!(
                "error rate:        {} intervals; worst {:.1}-{:.1} s with {} corrupt of {} slices\n",
                sc.intervals.len(),
                worst.start_s,
                worst.end_s,
                worst.corrupt,
                worst.slices_checked
            );
        }
        out += &format!(
            "transfer:          {} over NIXL: {:.3} GB/s while {} were in flight ({:.3} s), {:.3} GB/s over the wall time ({:.3} s)\n",
            human_bytes(s.bytes_transferred),
            s.transfer_gbps,
            if r.config["scenario"]["push"] == true { "prefill's WRITEs" } else { "READs" },
            s.transfer_seconds,
            wall_gbps(s.bytes_transferred, sc.seconds),
            sc.seconds
        );
    }
    if r.scenario.is_none() {
        out += &format!(
            "transfer:          {} in {:.3} s = {:.3} GB/s\n",
            human_bytes(s.bytes_transferred),
            s.transfer_seconds,
            s.transfer_gbps
        );
    }
    if let Some(p) = &s.transport_path {
        out += &format!("path:              {}\n", crate::xfer::ucx::describe(p));
        if let (Some(c), Some(r)) = (p.copy_gbps, p.ratio_to_copy) {
            let r = if r < 0.01 { format!("{r:.5}") } else { format!("{r:.3}") };
            out += &format!("                   transfer = {r} of a same-run copy of the pool ({c:.1} GB/s)\n");
        } else if r.scenario.is_none() && p.copy_gbps.is_none() && r.config["peer"].is_string() {
            out += "                   transfer not rated against a copy: the pools are on the two sides of a node pair (no copy between them to time)\n";
        } else if r.scenario.is_none()
            && p.copy_gbps.is_none()
            && r.config["decode_geometry"].is_object()
            && r.config["decode_geometry"]["num_kv_heads"] != r.config["geometry"]["num_kv_heads"]
        {
            out += "                   transfer not rated against a copy: a prefill rank's pool and a decode rank's differ in size (TP ranks hold different KV heads): no whole-pool copy to time\n";
        } else if r.scenario.is_none() && p.copy_gbps.is_none() {
            let pool = serde_json::from_value::<crate::core::geometry::Geometry>(r.config["geometry"].clone())
                .ok()
                .and_then(|g| g.pool_bytes().ok());
            out += &format!(
                "                   transfer not rated against a copy: a pool of {} is too small to time one (at least {} MiB per side)\n",
                pool.map(bytes_exact).unwrap_or_else(|| "this size".into()),
                crate::mem::pool::MIN_CEILING_BYTES >> 20
            );
        }
        if let Some(w) = &p.warning {
            out += &format!("warning:           {w}\n");
        }
        for f in &p.flags {
            out += &format!("path flag:         {f}\n");
        }
    }
    {
        out += &format!(
            "probe passes:      fill {:.3} s, poison {:.3} s, verify {:.3} s outside the transfers ({:.1} GB/s verified)\n",
            s.fill_seconds, s.poison_seconds, s.verify_seconds, s.verify_gbps
        );
        if r.scenario.is_none() && s.iterations > 0 {
            // The sweep fills and poisons for iteration 1 before it starts, and the last
            // iteration refills nothing: with one iteration both read 0.
            out += &format!(
                "set-up:            {:.3} s to the first transfer (NIXL, pools, agents, the copy ceiling if measured, and iteration 1's fill and poison, which the figures above leave out)\n",
                s.setup_seconds
            );
        }
        if s.pipeline_stages > 1 {
            out += &format!(
                "pipeline:          {} stages; {:.3} s of probe work hidden inside the transfers\n",
                s.pipeline_stages, s.overlapped_seconds
            );
        }
        // Sweeps check for stray and late writes whatever the stage count.
        if s.pipeline_stages > 0 {
            out += &format!(
                "stray writes:      {} found; {} block slices checked for their poison before their post, {} verified again before their re-poison or at the end ({:.3} s outside the transfers)\n",
                s.by_class.get(crate::core::verify::Class::Stray.name()).copied().unwrap_or(0),
                s.stray_poison_checked_slices,
                s.stray_reverified_slices,
                s.stray_check_seconds
            );
        }
        if let Some(b) = s.host_peak_bytes {
            out += &format!("host memory:       {:.1} MiB peak resident\n", b as f64 / (1u64 << 20) as f64);
        }
    }
    if s.injections_planted > 0 {
        out += &format!(
            "injections:        {} planted, {} detected as predicted, {} unexpected failures\n",
            s.injections_planted, s.injections_detected, s.unexpected_failures
        );
    }
    for f in r.failures.iter().take(5) {
        let at = match (f.request, f.tp_rank) {
            (Some(req), _) => format!("step {} request {req}", f.iteration),
            (None, Some(r)) => format!("iter {} decode TP rank {r}", f.iteration),
            (None, None) => format!("iter {}", f.iteration),
        };
        out += &format!(
            "  {at} layer {} {} block {}: {} (first bad byte {}, {} bad byte{}){}{}{}\n",
            f.layer,
            f.kv,
            f.block,
            f.class,
            f.first_bad_offset,
            f.bad_bytes,
            if f.bad_bytes == 1 { "" } else { "s" },
            // A layout slice: how its rows are displaced and the first wrong row.
            match (&f.displacement, f.rows.as_ref().and_then(|r| r.first())) {
                (d, Some(w)) => format!(
                    ", {}row {} holds token {} head {} (due token {} head {})",
                    d.as_ref().map(|d| format!("{d}; ")).unwrap_or_default(),
                    w.row,
                    w.token,
                    w.head,
                    w.due_token,
                    w.due_head
                ),
                (Some(d), None) => format!(", {d}"),
                (None, None) => String::new(),
            },
            // The identity its tags name, when it is another one than it should hold (a bit flip
            // still names its own).
            f.observed
                .filter(|o| *o != f.expected)
                .map(|o| format!(", holds layer {} {} block {} gen {}", o.layer, o.kv, o.block, o.generation))
                .unwrap_or_default(),
            match (f.request, f.attributed_to, f.injected) {
                (Some(_), Some(m), _) => format!(", attributed to {m}"),
                (Some(_), None, true) => ", injected (--inject), as predicted".to_string(),
                (Some(_), None, false) => ", UNEXPLAINED".to_string(),
                _ => String::new(),
            }
        );
    }
    let shown = r.failures.len().min(5) as u64;
    if s.blocks_corrupt > 0 && r.failures.is_empty() && r.peer.as_ref().is_some_and(|p| p.role == "decode") {
        // serve's report: decode verified, and its report lists the slices.
        out += &format!("  {} corrupt slices, listed in decode's report (run --peer --report)\n", s.blocks_corrupt);
    } else if s.blocks_corrupt > shown {
        let n = s.blocks_corrupt - shown;
        out += &format!(
            "  {} corrupt slice{}{}; {} {}{}\n",
            if shown == 0 { n.to_string() } else { format!("... {n} more") },
            if n == 1 { "" } else { "s" },
            if shown == 0 { " not listed" } else { "" },
            match json {
                Some(at) => format!("the JSON report ({at}) lists"),
                None => "--report FILE would list".to_string(),
            },
            r.failures.len(),
            if s.failures_omitted > 0 { format!(" ({} left out by --max-failures)", s.failures_omitted) } else { String::new() }
        );
    }
    if let (Some(m), 5) = (r.config.get("min_gbps").and_then(|v| v.as_f64()), r.outcome.exit_code) {
        out += &format!("min rate:          {m} GB/s required, {:.3} GB/s measured\n", s.transfer_gbps);
    }
    out += &format!("result:            {} (exit {})\n", r.outcome.status, r.outcome.exit_code);
    out
}

pub mod dump;
pub mod junit;
