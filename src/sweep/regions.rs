//! A hybrid model's regions beside its attention layers — the recurrent state of its Mamba,
//! gated DeltaNet or KDA layers, the sparse-attention indexer K cache — moved with NIXL and
//! verified row by row after the attention sweep (`kvprobe run --model-config` on a hybrid
//! model, one process).
//!
//! Each region gets a pool per side: one page per (layer, unit) — a request's state slot, or an
//! indexer block — `page_stride_bytes` apart (a state page padded to the attention page, as
//! vLLM's hybrid KV cache manager pads it: [`crate::core::hybrid::rank_regions`]). Prefill's
//! pages hold region rows ([`crate::core::hybrid::run_rows`], docs/fingerprint.md "Region
//! rows") of `units` logical ids; decode's are poisoned. One NIXL request (READ by decode, or
//! WRITE by prefill, as the run's `--op`) moves every page to a decode unit of another index,
//! with the page's descriptors as vLLM 0.34's NixlConnector builds them (a state slot: one per
//! conv sub-projection, then the ssm / temporal / recurrent state, the padding left out,
//! `_build_mamba_local`; an indexer block whole). Decode then checks every row run and
//! classifies a wrong one ([`crate::core::verify::classify`]): a row of another request or
//! block is `misplaced`, poison is `unwritten`, and a region none of whose bytes arrived is a
//! failure of its own that names it (a region left out of the transfer: decode would compute
//! those layers from zeros).
//!
//! Prefill's pages live with prefill wherever it is (a thread of this process, the child of
//! `--decode-process`, `kvprobe serve` on another host): decode asks for them plan by plan over
//! the peer protocol (`RegionOpen`, [`prefill_sources`] on prefill's side), so that the region
//! pass crosses the same link the attention sweep does.
//!
//! Faults planted in region pages (`--inject CLASS@REGION`) hit one prefill rank's page and
//! descriptors ([`RegionFault::source`]); between unequal TP sizes a decode run may hold rows
//! of several prefill ranks, and its predicted bytes are built from every source's pages.
//!
//! Under request load (`--scenario`) the state moves per request instead: [`scenario_lanes`],
//! [`crate::scenario::state`].

use crate::core::fingerprint::{self, logical_block};
use crate::core::geometry::{Dtype, Geometry, KvPart, Layout, SliceCoord};
use crate::core::hybrid::{Region, RegionUnit, RowRun, run_rows};
use crate::core::inject::Kind;
use crate::core::verify::{self, Class};
use crate::error::{Error, Result};
use crate::mem::pool::{KvPool, MemoryKind};
use crate::peer::client::PrefillPeer;
use crate::report::{RegionFailure, RegionInjection, RegionReport, Report};
use crate::sweep::RunConfig;
use crate::xfer::transport::{self, Endpoint, Pair, TransportOptions, XferReq};
use rand::{Rng, SeedableRng};
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// Most bytes one region's pool takes on each side (64 MiB): the unit count is cut to fit,
/// down to [`MIN_UNITS`].
pub const MAX_REGION_POOL_BYTES: u64 = 64 << 20;

/// Fewest units (state slots, indexer blocks) a region's pool has: two, so that a page of the
/// wrong request or block is seen as `misplaced`.
pub const MIN_UNITS: u32 = 2;

/// Most units a region's pool has (16).
pub const MAX_UNITS: u32 = 16;

/// Most bytes one region's pool may take on each side even at [`MIN_UNITS`] (4 GiB): a larger
/// one is refused by name.
pub const MAX_REGION_POOL_HARD_BYTES: u64 = 4 << 30;

/// The generation the region pass's rows carry (its one pass; `--inject stale@REGION` leaves a
/// page at the generation before it).
pub const REGION_GENERATION: u32 = 2;

/// The poison iteration of decode's region pages (the one pass).
pub const REGION_POISON_ITERATION: u32 = 1;

/// The last model layer a region may have (4095): a region row's layer field holds 12 bits
/// ([`crate::core::hybrid::region_layer`]).
pub const MAX_REGION_LAYER: u32 = 0xFFF;

/// One region of one TP rank, as the pass moves it.
#[derive(Clone, Debug)]
pub struct RegionPlan {
    /// The region (layout, descriptors).
    pub region: Region,
    /// The TP rank whose rows the pages hold.
    pub rank: u32,
    /// The row runs of one page on that rank, in page order.
    pub runs: Vec<RowRun>,
    /// Each run's name (a conv sub-projection, the ssm state, the indexer's values or scales).
    pub run_names: Vec<String>,
    /// Units (state slots or indexer blocks) of each side's pool.
    pub units: u32,
    /// The prefill TP ranks this decode rank reads the region from, each with its pages'
    /// layout and the descriptors of one page (one source between equal TP sizes: the same
    /// rank, vLLM's descriptors).
    pub sources: Vec<RegionSource>,
}

/// One prefill TP rank a decode rank's region pages come from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RegionSource {
    /// The prefill rank.
    pub rank: u32,
    /// Bytes from one of its pages to the next.
    pub page_stride_bytes: u64,
    /// Its pages' row runs (cut in rows of the larger TP size's chunks, so that global rows
    /// name the same bytes on both sides).
    pub runs: Vec<RowRun>,
    /// The descriptors of one page: (prefill byte offset, decode byte offset, bytes).
    pub descriptors: Vec<(u64, u64, u64)>,
}

/// The descriptors moving what decode's `runs` need from each of the prefill ranks' `sources`
/// (their runs): per part, each overlap of global rows a decode run has with a source run not
/// taken from an earlier source (a section every rank holds whole is read once, from the
/// first). Errors: usage when two overlapping runs are cut in rows of different sizes.
fn overlaps(runs: &[RowRun], sources: &mut [RegionSource]) -> Result<()> {
    let mut covered: Vec<(u32, u64, u64)> = Vec::new();
    for src in sources.iter_mut() {
        for d in runs {
            for s in src.runs.iter().filter(|s| s.part == d.part) {
                let (a, b) = (d.first_row as u64, d.first_row as u64 + d.rows as u64);
                let (c, e) = (s.first_row as u64, s.first_row as u64 + s.rows as u64);
                let (lo, hi) = (a.max(c), b.min(e));
                if lo >= hi || covered.iter().any(|&(part, x, y)| part == d.part && x < hi && lo < y) {
                    continue;
                }
                if s.row_bytes != d.row_bytes {
                    return Err(Error::Usage(format!(
                        "region rows of part {} are {} bytes on prefill rank {} and {} on decode: they cannot be matched",
                        d.part, s.row_bytes, src.rank, d.row_bytes
                    )));
                }
                let r = d.row_bytes as u64;
                src.descriptors.push((s.offset + (lo - c) * r, d.offset + (lo - a) * r, (hi - lo) * r));
                covered.push((d.part, lo, hi));
            }
        }
    }
    Ok(())
}

impl RegionPlan {
    /// The pool geometry of this region: one MLA-like slice of `page_stride_bytes` per (layer,
    /// unit), in 1-byte elements cut into rows kvprobe's pools accept (the pool's own
    /// fingerprint is never used for it). Errors: usage (exit 2) when the page stride is not a
    /// multiple of 16 bytes or the pool would exceed [`MAX_REGION_POOL_HARD_BYTES`].
    pub fn pool_geometry(&self) -> Result<Geometry> {
        self.pool_geometry_of(self.region.page_stride_bytes)
    }

    /// [`RegionPlan::pool_geometry`] for pages `stride` bytes apart (a prefill rank's, between
    /// unequal TP sizes).
    pub fn pool_geometry_of(&self, stride: u64) -> Result<Geometry> {
        let head = (2..=2048u64)
            .rev()
            .map(|k| k * 16)
            .find(|h| stride.is_multiple_of(*h) && h % 512 != 16 && stride / h <= crate::core::geometry::MAX_POSITION as u64)
            .ok_or_else(|| {
                Error::Usage(format!(
                    "region {}: a page stride of {stride} bytes cannot be laid out as a pool (it must be a multiple of 16 bytes)",
                    self.region.name
                ))
            })?;
        let g = Geometry {
            num_layers: self.region.layers.len() as u32,
            num_kv_heads: 1,
            head_size: head as u32,
            block_size: (stride / head) as u32,
            num_blocks: self.units,
            dtype: Dtype::Fp8,
            layout: Layout::Nhd,
            mla: true,
        };
        g.validate().map_err(|e| Error::Usage(format!("region {}: {e}", self.region.name)))?;
        let bytes = g.pool_bytes().map_err(|e| Error::Usage(e.to_string()))?;
        if bytes > MAX_REGION_POOL_HARD_BYTES {
            return Err(Error::Usage(format!(
                "region {}: {} layer(s) × {} units × {stride} bytes a page is {bytes} bytes a side, more than kvprobe allocates for a region ({MAX_REGION_POOL_HARD_BYTES})",
                self.region.name,
                self.region.layers.len(),
                self.units
            )));
        }
        Ok(g)
    }

    /// The logical id unit `i` of prefill's pool holds (a request's state, or a logical
    /// block): [`logical_block`] of the run's seed, salted by the region's first layer so that
    /// two regions hold different ids.
    pub fn id_of(&self, seed: u64, i: u32) -> u32 {
        logical_block(seed ^ ((self.region.layers.first().copied().unwrap_or(0) as u64 + 1) << 40), i)
    }

    /// The decode unit prefill's unit `i` moves to: the units in reverse order (never the same
    /// index, so that a descriptor built from prefill's index lands in the wrong unit).
    pub fn decode_unit(&self, i: u32) -> u32 {
        self.units - 1 - i
    }

    /// The global page index of (layer index `li`, unit `u`) in a side's pool (the poison's
    /// slot): `li × units + u`.
    pub fn page_slot(&self, li: u32, u: u32) -> u32 {
        li * self.units + u
    }

    /// The NIXL descriptors of the whole region from source `k`
    /// ([`RegionPlan::sources`]): per layer, per prefill unit, the page's descriptors from
    /// prefill's unit to [`RegionPlan::decode_unit`].
    pub fn pairs_of(&self, k: usize) -> Vec<Pair> {
        let mut out = Vec::new();
        let Some(src) = self.sources.get(k) else { return out };
        for li in 0..self.region.layers.len() as u32 {
            for i in 0..self.units {
                let s = SliceCoord { layer: li, kv: KvPart::Latent, block: i };
                let d = SliceCoord { layer: li, kv: KvPart::Latent, block: self.decode_unit(i) };
                for &(src_off, dst_off, len) in &src.descriptors {
                    out.push(Pair { src: s, dst: d, len, src_off, dst_off });
                }
            }
        }
        out
    }

    /// True when decode's pages are prefill's (equal TP sizes: one source, the same row runs,
    /// so a fault's run and offset mean the same bytes on both sides).
    pub fn same_pages(&self) -> bool {
        self.sources.len() == 1 && self.sources[0].runs == self.runs
    }

    /// [`RegionPlan::pairs_of`] the first source (the only one between equal TP sizes).
    pub fn pairs(&self) -> Vec<Pair> {
        self.pairs_of(0)
    }

    /// NIXL descriptors one decode page takes, over every source (vLLM's per-section ones
    /// between equal TP sizes).
    pub fn descriptors_per_page(&self) -> u32 {
        self.sources.iter().map(|s| s.descriptors.len() as u32).sum()
    }

    /// Bytes the whole region moves from every source.
    pub fn bytes(&self) -> u64 {
        (0..self.sources.len()).flat_map(|k| self.pairs_of(k)).map(|x| x.len).sum()
    }
}

/// The units of a region's pool: as many as fit [`MAX_REGION_POOL_BYTES`] a side, from
/// [`MIN_UNITS`] to [`MAX_UNITS`].
pub fn units_for(r: &Region) -> u32 {
    let per_unit = (r.layers.len() as u64).saturating_mul(r.page_stride_bytes).max(1);
    (MAX_REGION_POOL_BYTES / per_unit).clamp(MIN_UNITS as u64, MAX_UNITS as u64) as u32
}

/// The regions of `cfg`'s model the attention sweep does not move, for each TP rank the run
/// moves: empty without a model config or for a model without state or indexer. With
/// `--prefill-tp`/`--decode-tp` (equal) every rank; with `--tp` rank 0 (the run's geometry is
/// one rank's). Errors: usage (exit 2) for unequal TP sizes, and the layout's own errors.
pub fn plans(cfg: &RunConfig) -> Result<Vec<RegionPlan>> {
    let Some(model) = &cfg.model else { return Ok(Vec::new()) };
    let Some(hy) = model.kv.hybrid.as_ref().filter(|h| h.any()) else { return Ok(Vec::new()) };
    let (ptp, dtp, ranks) = match cfg.tp {
        Some(t) => (t.prefill, t.decode, t.decode),
        None => (model.tp.tp, model.tp.tp, 1),
    };
    let row_tp = ptp.max(dtp);
    let usage = |e: crate::core::model_config::ModelConfigError| Error::Usage(e.to_string());
    let prefill_regions = model.kv.rank_regions(&cfg.geometry, ptp).map_err(usage)?;
    let decode_regions = model.kv.rank_regions(cfg.decode_geom(), dtp).map_err(usage)?;
    let runs_of = |r: &Region, tp: u32, rank: u32, block_size: u32| -> Result<(Vec<RowRun>, Vec<String>)> {
        let (runs, names) = match (r.kind.as_str(), &hy.state, &hy.indexer) {
            ("state", Some(s), _) => {
                (s.rank_row_runs_with(tp, rank, row_tp), s.section_names().iter().map(|n| n.to_string()).collect())
            }
            ("indexer", _, Some(i)) => (i.block_row_runs(block_size), vec!["k".into(), "scale".into()]),
            _ => return Err(Error::Usage(format!("region {}: no model part lays it out", r.name))),
        };
        Ok((runs.map_err(|e| Error::Usage(format!("model config: {e}")))?, names))
    };
    if let Some(r) = decode_regions.iter().find(|r| r.kind != "attention" && r.layers.iter().any(|&l| l > MAX_REGION_LAYER)) {
        return Err(Error::Usage(format!(
            "region {}: layer {} is beyond the {} a region row's 12-bit layer field names (docs/fingerprint.md \"Region rows\")",
            r.name,
            r.layers.iter().max().copied().unwrap_or(0),
            MAX_REGION_LAYER
        )));
    }
    let mut out = Vec::new();
    for rank in 0..ranks {
        for (r, pr) in decode_regions.iter().zip(&prefill_regions).filter(|(r, _)| r.kind != "attention") {
            let (runs, run_names) = runs_of(r, dtp, rank, cfg.decode_geom().block_size)?;
            let mut sources = Vec::new();
            if ptp == dtp {
                // Equal TP: the same rank, with vLLM's descriptors for the page.
                sources.push(RegionSource {
                    rank,
                    page_stride_bytes: pr.page_stride_bytes,
                    runs: runs.clone(),
                    descriptors: r.descriptors.iter().map(|d| (d.offset, d.offset, d.bytes)).collect(),
                });
            } else {
                for p in 0..ptp {
                    let (pruns, _) = runs_of(pr, ptp, p, cfg.geometry.block_size)?;
                    sources.push(RegionSource {
                        rank: p,
                        page_stride_bytes: pr.page_stride_bytes,
                        runs: pruns,
                        descriptors: Vec::new(),
                    });
                }
                overlaps(&runs, &mut sources)?;
                sources.retain(|s| !s.descriptors.is_empty());
            }
            let units = units_for(r).min(units_for(pr));
            out.push(RegionPlan { region: r.clone(), rank, runs, run_names, units, sources });
        }
    }
    Ok(out)
}

/// The state lanes of a scenario on `cfg`'s hybrid model ([`crate::scenario::state`]): one per
/// state region of rank 0 (a scenario moves one rank, `--tp`), each with as many slots as
/// `--concurrency` asks for while every lane's pool fits
/// [`crate::scenario::state::MAX_STATE_POOL_BYTES`] a side (at least
/// [`crate::scenario::state::MIN_STATE_SLOTS`]). Empty without a scenario or a state region.
/// Errors: usage (exit 2) for a model with an indexer region (not moved under request load
/// yet), and a pool kvprobe cannot lay out ([`RegionPlan::pool_geometry`]).
pub fn scenario_lanes(cfg: &RunConfig) -> Result<Vec<crate::scenario::state::StateLane>> {
    use crate::scenario::state::{MAX_STATE_POOL_BYTES, MIN_STATE_SLOTS, StateLane};
    let Some(sc) = &cfg.scenario else { return Ok(Vec::new()) };
    let plans: Vec<RegionPlan> = plans(cfg)?.into_iter().filter(|p| p.rank == 0).collect();
    if let Some(p) = plans.iter().find(|p| p.region.kind != "state") {
        return Err(Error::Usage(format!(
            "model config: region {} ({}, {} layers) is not moved under request load yet (--scenario, --race): a run \
             that moved the attention pages alone would pass while decode computed from zeros; `kvprobe run` without \
             --scenario moves it",
            p.region.name,
            p.region.kind,
            p.region.layers.len()
        )));
    }
    let per_slot: u64 = plans.iter().map(|p| p.region.layers.len() as u64 * p.region.page_stride_bytes).sum();
    let slots = (MAX_STATE_POOL_BYTES / per_slot.max(1)).min(sc.concurrency as u64).max(MIN_STATE_SLOTS as u64) as u32;
    let mut out = Vec::new();
    for mut p in plans {
        p.units = slots;
        let geometry = p.pool_geometry()?;
        let src = p.sources.first().ok_or_else(|| Error::Usage(format!("region {}: no prefill rank holds it", p.region.name)))?;
        out.push(StateLane {
            name: p.region.name.clone(),
            rank: p.rank,
            layers: p.region.layers.clone(),
            runs: p.runs.clone(),
            run_names: p.run_names.clone(),
            page_bytes: p.region.page_bytes,
            page_stride_bytes: p.region.page_stride_bytes,
            descriptors: src.descriptors.clone(),
            slots,
            geometry,
        });
    }
    Ok(out)
}

/// One side's pool and NIXL agent of scenario lane `lane` on `memory` (GPU `device` for VRAM),
/// named `agent`; prefill's pages hold each slot's genesis state
/// ([`crate::scenario::state::StateLane::genesis_page`]), decode's are poisoned by the
/// scenario as it starts each request. Errors: environment (allocation, a backend that cannot
/// serve the pool, exit 2).
pub fn lane_endpoint(
    cfg: &RunConfig,
    lane: &crate::scenario::state::StateLane,
    memory: MemoryKind,
    device: usize,
    agent: &str,
    prefill: bool,
) -> Result<Endpoint> {
    let mut pool = pool(cfg, memory, &lane.geometry, device)?;
    if prefill {
        for li in 0..lane.layers.len() as u32 {
            for s in 0..lane.slots {
                pool.write_slice(crate::scenario::state::StateLane::page(li, s), &lane.genesis_page(cfg.seed, li, s))?;
            }
        }
    }
    let opts = TransportOptions { xfer_req: XferReq::Create, backend_params: cfg.backend_params.clone() };
    Endpoint::with_options(agent, &cfg.backend, pool, &opts).map_err(|e| crate::sweep::backend_refusal(&cfg.backend, memory, e))
}

/// `KVPROBE_TEST_LEAVE_OUT_REGION=KIND|NAME` ([`crate::sys::test_hooks::LEAVE_OUT_REGION`]):
/// the region whose kind (`state`, `indexer`) or name it gives is left out of the transfer, as
/// a connector that never registered it.
/// Checks `KVPROBE_TEST_LEAVE_OUT_REGION` against the run's `plans`: a value that names no
/// region (a typo) would leave every region in and let a negative test pass vacuously.
/// Errors: usage (exit 2).
pub fn check_hooks(plans: &[RegionPlan]) -> Result<()> {
    match std::env::var(crate::sys::test_hooks::LEAVE_OUT_REGION) {
        Ok(v) if !plans.iter().any(|p| left_out(&p.region)) => Err(Error::Usage(format!(
            "{}={v:?} names no region of this run (its regions: {})",
            crate::sys::test_hooks::LEAVE_OUT_REGION,
            if plans.is_empty() {
                "none".to_string()
            } else {
                plans.iter().map(|p| format!("{} ({})", p.region.name, p.region.kind)).collect::<Vec<_>>().join(", ")
            }
        ))),
        _ => Ok(()),
    }
}

fn left_out(r: &Region) -> bool {
    std::env::var(crate::sys::test_hooks::LEAVE_OUT_REGION).is_ok_and(|v| v == r.kind || v == r.name)
}

/// One fault planted in a region's pages (`--inject CLASS[:N]@REGION`), by prefill's
/// coordinates: source `source` (the prefill rank [`RegionPlan::sources`] names; 0 between
/// equal TP sizes), layer index `li`, prefill unit `unit`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RegionFault {
    /// What is planted.
    pub kind: Kind,
    /// The source (index in [`RegionPlan::sources`]) whose page and descriptors it hits.
    pub source: usize,
    /// Layer index in the region.
    pub li: u32,
    /// Prefill's unit.
    pub unit: u32,
    /// Misroute: the prefill unit whose decode unit receives `unit`'s page (neither page's own
    /// descriptors are sent).
    pub other: u32,
    /// Bitflip and torn: the row run hit (of the source's runs).
    pub run: usize,
    /// Bitflip: the byte offset in the run; torn: the bytes of the run that still arrive (a
    /// multiple of 16, at least 16, less than the run; between unequal TP sizes, counted
    /// from the start of the descriptor cut, which lies in the run).
    pub offset: u64,
    /// Bitflip: the bit flipped (0..8).
    pub bit: u8,
}

/// The faults `cfg`'s `--inject CLASS[:N]@REGION` plant in region `p`: N of each class named
/// for `p`'s kind, each on pages no other fault touches (a misroute takes two of one layer),
/// drawn from a generator seeded by the run's seed, the rank and the region; fewer when the
/// region has too few pages (the self-test then says how many were never planted). Between
/// unequal TP sizes (several sources) each fault also draws the source it hits, among those
/// with descriptors, and a bitflip or a tear falls in the bytes that source's descriptors
/// move (a fault in rows decode never reads would reach nothing).
pub fn plan_faults(cfg: &RunConfig, p: &RegionPlan) -> Vec<RegionFault> {
    use rand::seq::IndexedRandom;
    let salt = ((p.rank as u64) << 32) ^ p.region.layers.first().copied().unwrap_or(0) as u64 ^ 0x5245_4749_4f4e;
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(cfg.seed ^ salt);
    let layers = p.region.layers.len() as u32;
    // The pages no fault has taken yet, per layer index.
    let mut free: Vec<Vec<u32>> = (0..layers).map(|_| (0..p.units).collect()).collect();
    let mut out = Vec::new();
    for spec in cfg.region_inject.iter().filter(|s| s.region == p.region.kind) {
        let need = if spec.kind == Kind::Misroute { 2 } else { 1 };
        for _ in 0..spec.count {
            // A layer with enough free pages, then the pages among them; a region too small
            // for more keeps what it has (the self-test says how many were never planted).
            let open: Vec<u32> = (0..layers).filter(|&li| free[li as usize].len() >= need).collect();
            let Some(&li) = open.choose(&mut rng) else { break };
            let pages = &mut free[li as usize];
            let unit = pages.swap_remove(rng.random_range(0..pages.len()));
            let other = if need == 2 { pages.swap_remove(rng.random_range(0..pages.len())) } else { unit };
            if p.same_pages() {
                let run = rng.random_range(0..p.runs.len());
                let bytes = p.runs[run].rows as u64 * p.runs[run].row_bytes as u64;
                let (offset, bit) = match spec.kind {
                    Kind::Bitflip => (rng.random_range(0..bytes), rng.random_range(0..8u8)),
                    Kind::Torn => (16 * rng.random_range(1..bytes / 16), 0),
                    _ => (0, 0),
                };
                out.push(RegionFault { kind: spec.kind, source: 0, li, unit, other, run, offset, bit });
                continue;
            }
            // Several sources: a source with descriptors, then (bitflip, torn) one of its
            // descriptors (a tear needs one of 32 bytes or more) and a place in it.
            let with: Vec<usize> = (0..p.sources.len())
                .filter(|&k| {
                    let d = &p.sources[k].descriptors;
                    if spec.kind == Kind::Torn { d.iter().any(|x| x.2 >= 32) } else { !d.is_empty() }
                })
                .collect();
            let Some(&source) = with.choose(&mut rng) else { break };
            let src = &p.sources[source];
            let (mut run, mut offset, mut bit) = (0, 0, 0);
            if matches!(spec.kind, Kind::Bitflip | Kind::Torn) {
                let ds: Vec<&(u64, u64, u64)> = src.descriptors.iter().filter(|x| spec.kind != Kind::Torn || x.2 >= 32).collect();
                let &&(at, _, len) = ds.choose(&mut rng).expect("a source with descriptors");
                run = src
                    .runs
                    .iter()
                    .position(|r| r.offset <= at && at < r.offset + r.rows as u64 * r.row_bytes as u64)
                    .unwrap_or(0);
                if spec.kind == Kind::Bitflip {
                    offset = at + rng.random_range(0..len) - src.runs[run].offset;
                    bit = rng.random_range(0..8u8);
                } else {
                    offset = 16 * rng.random_range(1..len / 16);
                }
            }
            out.push(RegionFault { kind: spec.kind, source, li, unit, other, run, offset, bit });
        }
    }
    out
}

/// Refuses `--inject CLASS[:N]@REGION` asking for more faults than a region of `plans` has
/// room for (one page each, two of one layer for a misroute, no page hit twice: what
/// [`plan_faults`] plants). Errors: usage (exit 2) naming the region, its TP rank, what was
/// asked and what fits — before anything moves, instead of a self-test that fails after.
pub fn check_room(cfg: &RunConfig, plans: &[RegionPlan]) -> Result<()> {
    for p in plans {
        let asked: u64 = cfg.region_inject.iter().filter(|s| s.region == p.region.kind).map(|s| s.count as u64).sum();
        let fits = plan_faults(cfg, p).len() as u64;
        if fits < asked {
            return Err(Error::Usage(format!(
                "--inject …@{}: region {} (TP rank {}) has {} layer(s) × {} page(s), room for {fits} of the {asked} fault(s) asked for \
                 (one page each, a misroute two of one layer): ask for fewer",
                p.region.kind,
                p.region.name,
                p.rank,
                p.region.layers.len(),
                p.units
            )));
        }
    }
    Ok(())
}

impl RegionPlan {
    /// Prefill's page (layer index `li`, unit `i`) as the run writes it, `faults` applied
    /// (a stale page at the generation before; a flipped bit): `page_stride_bytes` bytes, the
    /// padding holding prefill's own poison.
    pub fn prefill_page(&self, seed: u64, li: u32, i: u32, faults: &[RegionFault]) -> Vec<u8> {
        self.source_page(0, seed, li, i, faults)
    }

    /// [`RegionPlan::prefill_page`] of source `k`: its stride and row runs.
    pub fn source_page(&self, k: usize, seed: u64, li: u32, i: u32, faults: &[RegionFault]) -> Vec<u8> {
        let src = &self.sources[k];
        let mut page = vec![0u8; src.page_stride_bytes as usize];
        fingerprint::poison(&mut page, self.page_slot(li, i), 0);
        let here = |kind: Kind| faults.iter().find(|f| f.kind == kind && f.source == k && f.li == li && f.unit == i);
        let generation = if here(Kind::Stale).is_some() { REGION_GENERATION - 1 } else { REGION_GENERATION };
        let layer = self.region.layers[li as usize];
        for run in &src.runs {
            let rows = run_rows(run, layer, self.id_of(seed, i), generation);
            let at = run.offset as usize;
            fingerprint::fill(&mut page[at..at + rows.len() as usize], seed, &rows);
        }
        if let Some(f) = here(Kind::Bitflip) {
            page[(src.runs[f.run].offset + f.offset) as usize] ^= 1 << f.bit;
        }
        page
    }

    /// The descriptors of the whole region from every source with `faults` applied
    /// ([`RegionPlan::faulted_pairs_of`] each source, in order).
    pub fn faulted_pairs(&self, faults: &[RegionFault]) -> Vec<Pair> {
        (0..self.sources.len()).flat_map(|k| self.faulted_pairs_of(k, faults)).collect()
    }

    /// The descriptors of the region from source `k` with the faults that hit it applied: a
    /// dropped page's left out, a misrouted page sent to the other unit's decode unit (both
    /// pages' own left out), a torn run's descriptor cut to end `offset` bytes into the run
    /// (one source) or into the descriptor (several).
    pub fn faulted_pairs_of(&self, k: usize, faults: &[RegionFault]) -> Vec<Pair> {
        let mut pairs = self.pairs_of(k);
        for f in faults.iter().filter(|f| f.source == k) {
            let page = |u: u32| SliceCoord { layer: f.li, kv: KvPart::Latent, block: u };
            match f.kind {
                Kind::Drop => pairs.retain(|x| x.src != page(f.unit)),
                Kind::Misroute => {
                    let moved: Vec<Pair> = pairs
                        .iter()
                        .filter(|x| x.src == page(f.unit))
                        .map(|x| Pair { dst: page(self.decode_unit(f.other)), ..*x })
                        .collect();
                    pairs.retain(|x| x.src != page(f.unit) && x.src != page(f.other));
                    pairs.extend(moved);
                }
                Kind::Torn if self.same_pages() => {
                    let at = self.runs[f.run].offset;
                    if let Some(x) = pairs.iter_mut().find(|x| x.src == page(f.unit) && x.src_off <= at && at < x.src_off + x.len)
                    {
                        x.len = at + f.offset - x.src_off;
                    }
                }
                Kind::Torn => {
                    // The descriptor of run `run` of the source that offset `offset` is in (the
                    // first of the page's descriptors starting in the run and long enough).
                    let r = &self.sources[k].runs[f.run];
                    let end = r.offset + r.rows as u64 * r.row_bytes as u64;
                    if let Some(x) = pairs
                        .iter_mut()
                        .find(|x| x.src == page(f.unit) && r.offset <= x.src_off && x.src_off < end && f.offset < x.len)
                    {
                        x.len = f.offset;
                    }
                }
                _ => {}
            }
        }
        pairs
    }
}

/// Per (layer index, decode unit, run index): the fault's index, the class and the exact bytes
/// predicted.
type Predictions = BTreeMap<(u32, u32, usize), (usize, Class, Vec<u8>)>;

/// What each fault predicts, per (layer index, decode unit, run): the class and the exact
/// bytes the run must hold — decode's poison where nothing of the run was written, the bytes of
/// the (faulted) prefill pages the pairs move where something was — for every run of a page a
/// fault reaches that differs from its expected rows. Keyed with the fault's index.
fn predict(cfg: &RunConfig, p: &RegionPlan, faults: &[RegionFault], pairs: &[Vec<Pair>]) -> Predictions {
    let mut out = BTreeMap::new();
    let stride = p.region.page_stride_bytes as usize;
    for (n, f) in faults.iter().enumerate() {
        let units = if f.kind == Kind::Misroute { vec![f.unit, f.other] } else { vec![f.unit] };
        for i in units {
            let u = p.decode_unit(i);
            let mut page = vec![0u8; stride];
            fingerprint::poison(&mut page, p.page_slot(f.li, u), REGION_POISON_ITERATION);
            // A source page is built once, however many descriptors read it.
            let mut built: BTreeMap<(usize, u32), Vec<u8>> = BTreeMap::new();
            let landing = pairs.iter().enumerate().flat_map(|(k, ps)| ps.iter().map(move |x| (k, x)));
            for (k, x) in landing.filter(|(_, x)| x.dst.layer == f.li && x.dst.block == u) {
                let src = built.entry((k, x.src.block)).or_insert_with(|| p.source_page(k, cfg.seed, f.li, x.src.block, faults));
                let (s, d, l) = (x.src_off as usize, x.dst_off as usize, x.len as usize);
                page[d..d + l].copy_from_slice(&src[s..s + l]);
            }
            let mut poison = vec![0u8; stride];
            fingerprint::poison(&mut poison, p.page_slot(f.li, u), REGION_POISON_ITERATION);
            let layer = p.region.layers[f.li as usize];
            for (k, run) in p.runs.iter().enumerate() {
                let rows = run_rows(run, layer, p.id_of(cfg.seed, i), REGION_GENERATION);
                let at = run.offset as usize;
                let got = &page[at..at + rows.len() as usize];
                if fingerprint::check(got, cfg.seed, &rows).0 == 0 {
                    continue;
                }
                let class = if got == &poison[at..at + rows.len() as usize] {
                    Class::Unwritten
                } else if !p.same_pages() {
                    // Between unequal TP sizes a run may hold rows of several prefill ranks,
                    // of which the fault hit one: its class is what those exact bytes are.
                    verify::classify(got, &rows, cfg.seed, p.page_slot(f.li, u), REGION_POISON_ITERATION).class
                } else {
                    match f.kind {
                        Kind::Bitflip => Class::Bitflip,
                        Kind::Stale => Class::Stale,
                        Kind::Misroute => Class::Misplaced,
                        _ => Class::Torn,
                    }
                };
                out.insert((f.li, u, k), (n, class, got.to_vec()));
            }
        }
    }
    out
}

/// What each fault [`plan_faults`] plants in `p` leaves wrong, as the run predicts it (the same
/// computation, from the configuration alone): per fault, in the order planted, the runs
/// (model layer, decode unit, run name, class) sorted by unit and run name — what the report's
/// `regions[].injections[].predicted` lists. For `report check`.
pub fn predicted_runs(cfg: &RunConfig, p: &RegionPlan) -> Vec<Vec<(u32, u32, String, Class)>> {
    let faults = plan_faults(cfg, p);
    let pairs: Vec<Vec<Pair>> = (0..p.sources.len()).map(|k| source_pairs(p, &faults, k)).collect();
    let predicted = predict(cfg, p, &faults, &pairs);
    (0..faults.len()).map(|n| runs_of_fault(p, &predicted, n)).collect()
}

/// Fault `n`'s predicted runs as the report lists them: (model layer, decode unit, run name,
/// class), sorted by unit and run name.
fn runs_of_fault(p: &RegionPlan, predicted: &Predictions, n: usize) -> Vec<(u32, u32, String, Class)> {
    let mut runs: Vec<(u32, u32, String, Class)> = predicted
        .iter()
        .filter(|(_, (m, _, _))| *m == n)
        .map(|((li, u, k), (_, class, _))| (p.region.layers[*li as usize], *u, p.run_names[*k].clone(), *class))
        .collect();
    runs.sort_by_key(|r| (r.1, r.2.clone()));
    runs
}

fn pool(cfg: &RunConfig, memory: MemoryKind, g: &Geometry, device: usize) -> Result<KvPool> {
    match memory {
        MemoryKind::Dram => KvPool::host(g, cfg.seed),
        MemoryKind::Vram => crate::sweep::vram_pool_on(device, g, cfg.seed),
    }
}

/// The descriptors source `k` of `p` moves: every page's ([`RegionPlan::pairs_of`]), or with
/// planted `faults` (one source) the faulted ones ([`RegionPlan::faulted_pairs`]).
pub fn source_pairs(p: &RegionPlan, faults: &[RegionFault], k: usize) -> Vec<Pair> {
    if faults.is_empty() { p.pairs_of(k) } else { p.faulted_pairs_of(k, faults) }
}

/// The NIXL agent name of source `k` of `p` (prefill's side).
fn source_agent(p: &RegionPlan, k: usize) -> String {
    format!("kvprobe-region-{}-tp{}-prefill-tp{}", p.region.kind, p.rank, p.sources[k].rank)
}

/// Prefill's side of plan `p`: a pool per source on `memory` (source rank `r`'s on GPU
/// `device_of(r)`), every page
/// written as [`RegionPlan::source_page`] writes it (the run's planted region faults
/// applied), each with a NIXL agent that has loaded decode's agent `decode` (the name is the
/// plan's: `kvprobe-region-KIND-tpR-prefill-tpS`). Errors: environment (allocation, a
/// backend that cannot serve the pool, exit 2), transport (decode's metadata, exit 3).
pub fn prefill_sources(
    cfg: &RunConfig,
    p: &RegionPlan,
    memory: MemoryKind,
    device_of: &dyn Fn(u32) -> usize,
    decode: &transport::PeerInfo,
) -> Result<Vec<Endpoint>> {
    let faults = plan_faults(cfg, p);
    let opts = TransportOptions { xfer_req: XferReq::Create, backend_params: cfg.backend_params.clone() };
    let layers = p.region.layers.len() as u32;
    let mut out = Vec::new();
    for (k, src) in p.sources.iter().enumerate() {
        let mut pool = pool(cfg, memory, &p.pool_geometry_of(src.page_stride_bytes)?, device_of(src.rank))?;
        for li in 0..layers {
            for i in 0..p.units {
                pool.write_slice(
                    SliceCoord { layer: li, kv: KvPart::Latent, block: i },
                    &p.source_page(k, cfg.seed, li, i, &faults),
                )?;
            }
        }
        let mut e = Endpoint::with_options(&source_agent(p, k), &cfg.backend, pool, &opts)
            .map_err(|e| crate::sweep::backend_refusal(&cfg.backend, memory, e))?;
        e.connect(decode.clone())?;
        out.push(e);
    }
    Ok(out)
}

/// Moves and verifies every region of `plans` (one after another), adding a
/// [`RegionReport`] each to `report.regions`. Errors: corrupt (exit 1) naming each region with
/// corrupt pages, and the region none of whose bytes arrived; transport (exit 3); timeout
/// (exit 4); environment (exit 2) as the attention pools'.
pub fn run(cfg: &RunConfig, plans: &[RegionPlan], prefill: &PrefillPeer, report: &mut Report) -> Result<()> {
    let mut bad = Vec::new();
    for (index, p) in plans.iter().enumerate() {
        crate::sys::progress::announce(&format!(
            "regions: {} ({}), TP rank {}: {} layer(s) x {} {}s",
            p.region.name,
            p.region.kind,
            p.rank,
            p.region.layers.len(),
            p.units,
            unit_name(p.region.unit)
        ));
        let r = move_one(cfg, index as u32, p, prefill).map_err(|e| prefill.cause_of(e))?;
        if r.pages_corrupt > 0 {
            let whole = r.pages_corrupt == r.pages_compared && r.failures.iter().all(|f| f.class == Class::Unwritten);
            bad.push(if whole {
                format!(
                    "region {} ({}, TP rank {}) was not moved: none of its {} bytes arrived, and decode would compute its {} layer(s) from zeros",
                    r.name,
                    r.kind,
                    r.rank,
                    p.bytes(),
                    r.layers
                )
            } else {
                format!("region {} ({}, TP rank {}): {} of {} page(s) corrupt", r.name, r.kind, r.rank, r.pages_corrupt, r.pages_compared)
            });
        }
        report.regions.push(r);
    }
    // A self-test's planted faults are judged by its verdict (crate::drive::run::self_test_verdict).
    if bad.is_empty() || cfg.self_test { Ok(()) } else { Err(Error::Corrupt(bad.join("; "))) }
}

/// `block` or `slot`, as reports write a region's unit.
pub fn unit_name(u: RegionUnit) -> &'static str {
    match u {
        RegionUnit::Block => "block",
        RegionUnit::Slot => "slot",
    }
}

fn move_one(cfg: &RunConfig, index: u32, p: &RegionPlan, prefill: &PrefillPeer) -> Result<RegionReport> {
    let g = p.pool_geometry()?;
    let stride = p.region.page_stride_bytes as usize;
    let seed = cfg.seed;
    let layers = p.region.layers.len() as u32;
    let faults = plan_faults(cfg, p);
    let mut dst = pool(cfg, cfg.memory, &g, cfg.decode_device)?;
    let mut page = vec![0u8; stride];
    for li in 0..layers {
        for i in 0..p.units {
            fingerprint::poison(&mut page, p.page_slot(li, i), REGION_POISON_ITERATION);
            dst.write_slice(SliceCoord { layer: li, kv: KvPart::Latent, block: i }, &page)?;
        }
    }
    let opts = TransportOptions { xfer_req: XferReq::Create, backend_params: cfg.backend_params.clone() };
    let tag = format!("kvprobe-region-{}-tp{}", p.region.kind, p.rank);
    let mut decode = Endpoint::with_options(&format!("{tag}-decode"), &cfg.backend, dst, &opts)
        .map_err(|e| crate::sweep::backend_refusal(&cfg.backend, cfg.memory, e))?;
    // Prefill sets up the plan's pages and agents on its side; decode loads each.
    let sources = prefill.region_open(index, decode.info()?)?;
    if sources.len() != p.sources.len() {
        return Err(Error::Transport(format!(
            "{} sent {} NIXL agents for region {} of TP rank {}, which reads {} prefill rank(s) (a protocol error)",
            prefill.who(),
            sources.len(),
            p.region.name,
            p.rank,
            p.sources.len()
        )));
    }
    for (k, info) in sources.into_iter().enumerate() {
        let want = p.pool_geometry_of(p.sources[k].page_stride_bytes)?;
        if info.geometry.as_ref().is_some_and(|g| *g != want) {
            return Err(Error::Transport(format!(
                "{}'s NIXL agent {} announced a region pool other than region {}'s pages of prefill rank {} (a protocol error)",
                prefill.who(),
                crate::sys::text::escape_control(&info.agent),
                p.region.name,
                p.sources[k].rank
            )));
        }
        decode.connect(info)?;
    }
    let out_of = |k: usize| if left_out(&p.region) { Vec::new() } else { source_pairs(p, &faults, k) };
    let pairs: Vec<Vec<Pair>> = (0..p.sources.len()).map(out_of).collect();
    let predicted = predict(cfg, p, &faults, &pairs);
    let mut met = vec![0usize; faults.len()];
    let mut due = vec![0usize; faults.len()];
    predicted.values().for_each(|(n, _, _)| due[*n] += 1);
    let moved: u64 = pairs.iter().flatten().map(|x| x.len).sum();
    let timeout = Duration::from_secs_f64(cfg.timeout_secs);
    let t0 = Instant::now();
    // One request per source, all in flight together; then every completion and notification.
    let live: Vec<(usize, String)> = pairs
        .iter()
        .enumerate()
        .filter(|(_, pk)| !pk.is_empty())
        .map(|(k, _)| (k, format!("{tag}-from-tp{}", p.sources[k].rank)))
        .collect();
    let deadline = crate::sys::deadline::Deadline::after(timeout);
    match cfg.op {
        transport::Op::Read => {
            let mut posted = Vec::new();
            for (k, tag_k) in &live {
                posted.push(decode.post_to(*k, transport::Op::Read, &pairs[*k], tag_k, deadline)?);
            }
            for x in &mut posted {
                while decode.poll(x)?.is_none() {
                    prefill.pump(Duration::ZERO)?;
                    std::thread::sleep(Duration::from_micros(20));
                }
            }
            // Prefill's agents forward the notifications of decode's READs.
            let mut tags: std::collections::HashMap<String, crate::sys::deadline::Deadline> =
                live.iter().map(|(_, t)| (t.clone(), deadline)).collect();
            prefill.await_notifications(&mut tags)?;
        }
        transport::Op::Write => {
            prefill.region_write(index, live.iter().map(|(k, t)| (*k as u32, t.clone())).collect())?;
            for (_, tag_k) in &live {
                let mut misses = 0u8;
                while prefill.poll_written(tag_k, deadline, &mut misses)?.is_none() {
                    std::thread::sleep(Duration::from_micros(20));
                }
            }
            let from: Vec<String> = (0..p.sources.len()).map(|k| source_agent(p, k)).collect();
            let mut inbox = transport::Inbox::default();
            for (_, tag_k) in &live {
                while !transport::poll_notification_from(&decode, &from, &mut inbox, tag_k, deadline)? {
                    prefill.pump(Duration::ZERO)?;
                    std::thread::sleep(Duration::from_micros(20));
                }
            }
        }
    }
    let posted = live;
    let seconds = if posted.is_empty() { 0.0 } else { t0.elapsed().as_secs_f64() };
    // Every request is complete: prefill gives the plan's pools up before decode verifies.
    prefill.region_close(index)?;
    let mut out = RegionReport {
        kind: p.region.kind.clone(),
        name: p.region.name.clone(),
        rank: p.rank,
        layers,
        unit: unit_name(p.region.unit).into(),
        units: p.units,
        page_bytes: p.region.page_bytes,
        page_stride_bytes: p.region.page_stride_bytes,
        descriptors_per_page: p.descriptors_per_page(),
        prefill_ranks: p.sources.iter().map(|s| s.rank).collect(),
        bytes_moved: moved,
        seconds,
        pages_compared: 0,
        pages_corrupt: 0,
        runs_compared: 0,
        injections_planted: faults.len() as u64,
        injections_detected: 0,
        unexpected_failures: 0,
        injections: Vec::new(),
        failures: Vec::new(),
    };
    let dst = &decode.pool;
    for li in 0..layers {
        let layer = p.region.layers[li as usize];
        for i in 0..p.units {
            let u = p.decode_unit(i);
            dst.read_slice(SliceCoord { layer: li, kv: KvPart::Latent, block: u }, &mut page)?;
            out.pages_compared += 1;
            out.runs_compared += p.runs.len() as u64;
            let wrong = crate::core::hybrid::wrong_runs(&p.runs, &page, layer, p.id_of(seed, i), REGION_GENERATION, seed);
            let corrupt = !wrong.is_empty();
            for (k, rows, at) in wrong {
                let run = &p.runs[k];
                let got = &page[at];
                let v = verify::classify(got, &rows, seed, p.page_slot(li, u), REGION_POISON_ITERATION);
                // A planted fault's run counts as predicted only with its class and exactly its
                // predicted bytes.
                let injected = match predicted.get(&(li, u, k)) {
                    Some((n, class, bytes)) if *class == v.class && bytes.as_slice() == got => {
                        met[*n] += 1;
                        true
                    }
                    _ => false,
                };
                out.unexpected_failures += !injected as u64;
                if out.failures.len() < cfg.max_failures {
                    out.failures.push(RegionFailure {
                        injected,
                        layer,
                        part: p.run_names.get(k).cloned().unwrap_or_else(|| format!("part {}", run.part)),
                        unit: u,
                        id: p.id_of(seed, i),
                        class: v.class,
                        observed: v.observed,
                        bit_flips: v.bit_flips,
                        request: None,
                    });
                }
            }
            out.pages_corrupt += corrupt as u64;
        }
    }
    for (n, f) in faults.iter().enumerate() {
        let detected = met[n] == due[n] && due[n] > 0;
        out.injections_detected += detected as u64;
        let predicted_runs = runs_of_fault(p, &predicted, n);
        out.injections.push(RegionInjection {
            kind: f.kind.name().into(),
            layer: p.region.layers[f.li as usize],
            unit: f.unit,
            predicted: predicted_runs
                .into_iter()
                .map(|(layer, unit, part, class)| crate::report::RegionPredicted { layer, unit, part, class })
                .collect(),
            detected,
        });
    }
    Ok(out)
}
