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
//! What is not moved here yet: a pair (`--peer`), `--decode-process`, scenarios, and unequal
//! TP sizes on the two sides (refused where the run is configured).

use crate::core::fingerprint::{self, logical_block};
use crate::core::geometry::{Dtype, Geometry, KvPart, Layout, SliceCoord};
use crate::core::hybrid::{Region, RegionUnit, RowRun, run_rows};
use crate::core::verify::{self, Class};
use crate::error::{Error, Result};
use crate::mem::pool::{KvPool, MemoryKind};
use crate::report::{RegionFailure, RegionReport, Report};
use crate::sweep::RunConfig;
use crate::xfer::transport::{self, Endpoint, Pair, TransportOptions, XferReq};
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

/// The generation the region pass's rows carry (its one pass).
pub const REGION_GENERATION: u32 = 1;

/// The poison iteration of decode's region pages (the one pass).
pub const REGION_POISON_ITERATION: u32 = 1;

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
}

impl RegionPlan {
    /// The pool geometry of this region: one MLA-like slice of `page_stride_bytes` per (layer,
    /// unit), in 1-byte elements cut into rows kvprobe's pools accept (the pool's own
    /// fingerprint is never used for it). Errors: usage (exit 2) when the page stride is not a
    /// multiple of 16 bytes or the pool would exceed [`MAX_REGION_POOL_HARD_BYTES`].
    pub fn pool_geometry(&self) -> Result<Geometry> {
        let stride = self.region.page_stride_bytes;
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

    /// The NIXL descriptors of the whole region: per layer, per prefill unit, the page's
    /// descriptors ([`Region::descriptors`]) from prefill's unit to [`RegionPlan::decode_unit`].
    pub fn pairs(&self) -> Vec<Pair> {
        let mut out = Vec::new();
        for li in 0..self.region.layers.len() as u32 {
            for i in 0..self.units {
                let src = SliceCoord { layer: li, kv: KvPart::Latent, block: i };
                let dst = SliceCoord { layer: li, kv: KvPart::Latent, block: self.decode_unit(i) };
                for d in &self.region.descriptors {
                    out.push(Pair { src, dst, len: d.bytes, src_off: d.offset, dst_off: d.offset });
                }
            }
        }
        out
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
    let (tp, ranks) = match cfg.tp {
        Some(t) if t.prefill != t.decode => {
            return Err(Error::Usage(format!(
                "a hybrid model's state and indexer regions are moved between equal TP sizes only (--prefill-tp {} --decode-tp {}): not built yet",
                t.prefill, t.decode
            )));
        }
        Some(t) => (t.prefill, t.prefill),
        None => (model.tp.tp, 1),
    };
    let regions = model.kv.rank_regions(&cfg.geometry, tp).map_err(|e| Error::Usage(format!("model config: {e}")))?;
    let mut out = Vec::new();
    for rank in 0..ranks {
        for r in regions.iter().filter(|r| r.kind != "attention") {
            let (runs, run_names) = match (r.kind.as_str(), &hy.state, &hy.indexer) {
                ("state", Some(s), _) => (s.rank_row_runs(tp, rank), s.section_names().iter().map(|n| n.to_string()).collect()),
                ("indexer", _, Some(i)) => (i.block_row_runs(cfg.geometry.block_size), vec!["k".into(), "scale".into()]),
                _ => return Err(Error::Usage(format!("region {}: no model part lays it out", r.name))),
            };
            let runs = runs.map_err(|e| Error::Usage(format!("model config: {e}")))?;
            out.push(RegionPlan { region: r.clone(), rank, runs, run_names, units: units_for(r) });
        }
    }
    Ok(out)
}

/// `KVPROBE_TEST_LEAVE_OUT_REGION=KIND|NAME` ([`crate::sys::test_hooks::LEAVE_OUT_REGION`]):
/// the region whose kind (`state`, `indexer`) or name it gives is left out of the transfer, as
/// a connector that never registered it.
fn left_out(r: &Region) -> bool {
    std::env::var(crate::sys::test_hooks::LEAVE_OUT_REGION).is_ok_and(|v| v == r.kind || v == r.name)
}

fn pool(cfg: &RunConfig, g: &Geometry, device: usize) -> Result<KvPool> {
    match cfg.memory {
        MemoryKind::Dram => KvPool::host(g, cfg.seed),
        MemoryKind::Vram => crate::sweep::vram_pool_on(device, g, cfg.seed),
    }
}

/// Moves and verifies every region of `plans` (one after another), adding a
/// [`RegionReport`] each to `report.regions`. Errors: corrupt (exit 1) naming each region with
/// corrupt pages, and the region none of whose bytes arrived; transport (exit 3); timeout
/// (exit 4); environment (exit 2) as the attention pools'.
pub fn run(cfg: &RunConfig, plans: &[RegionPlan], report: &mut Report) -> Result<()> {
    let mut bad = Vec::new();
    for p in plans {
        crate::sys::progress::announce(&format!(
            "regions: {} ({}), TP rank {}: {} layer(s) x {} {}s",
            p.region.name,
            p.region.kind,
            p.rank,
            p.region.layers.len(),
            p.units,
            unit_name(p.region.unit)
        ));
        let r = move_one(cfg, p)?;
        if r.pages_corrupt > 0 {
            let whole = r.pages_corrupt == r.pages_compared && r.failures.iter().all(|f| f.class == Class::Unwritten);
            bad.push(if whole {
                format!(
                    "region {} ({}, TP rank {}) was not moved: none of its {} bytes arrived, and decode would compute its {} layer(s) from zeros",
                    r.name,
                    r.kind,
                    r.rank,
                    p.pairs().iter().map(|x| x.len).sum::<u64>(),
                    r.layers
                )
            } else {
                format!("region {} ({}, TP rank {}): {} of {} page(s) corrupt", r.name, r.kind, r.rank, r.pages_corrupt, r.pages_compared)
            });
        }
        report.regions.push(r);
    }
    if bad.is_empty() { Ok(()) } else { Err(Error::Corrupt(bad.join("; "))) }
}

fn unit_name(u: RegionUnit) -> &'static str {
    match u {
        RegionUnit::Block => "block",
        RegionUnit::Slot => "slot",
    }
}

fn move_one(cfg: &RunConfig, p: &RegionPlan) -> Result<RegionReport> {
    let g = p.pool_geometry()?;
    let stride = p.region.page_stride_bytes as usize;
    let seed = cfg.seed;
    let layers = p.region.layers.len() as u32;
    let mut src = pool(cfg, &g, cfg.prefill_device)?;
    let mut dst = pool(cfg, &g, cfg.decode_device)?;
    let mut page = vec![0u8; stride];
    for li in 0..layers {
        let layer = p.region.layers[li as usize];
        for i in 0..p.units {
            // Prefill's padding holds its own poison: never moved, never read.
            fingerprint::poison(&mut page, p.page_slot(li, i), 0);
            for run in &p.runs {
                let rows = run_rows(run, layer, p.id_of(seed, i), REGION_GENERATION);
                let at = run.offset as usize;
                fingerprint::fill(&mut page[at..at + rows.len() as usize], seed, &rows);
            }
            src.write_slice(SliceCoord { layer: li, kv: KvPart::Latent, block: i }, &page)?;
            fingerprint::poison(&mut page, p.page_slot(li, i), REGION_POISON_ITERATION);
            dst.write_slice(SliceCoord { layer: li, kv: KvPart::Latent, block: i }, &page)?;
        }
    }
    let opts = TransportOptions { xfer_req: XferReq::Create, backend_params: cfg.backend_params.clone() };
    let tag = format!("kvprobe-region-{}-tp{}", p.region.kind, p.rank);
    let mut prefill = Endpoint::with_options(&format!("{tag}-prefill"), &cfg.backend, src, &opts)?;
    let mut decode = Endpoint::with_options(&format!("{tag}-decode"), &cfg.backend, dst, &opts)?;
    decode.connect(prefill.info()?)?;
    prefill.connect(decode.info()?)?;
    let pairs = if left_out(&p.region) { Vec::new() } else { p.pairs() };
    let moved: u64 = pairs.iter().map(|x| x.len).sum();
    let mut seconds = 0.0;
    if !pairs.is_empty() {
        let timeout = Duration::from_secs_f64(cfg.timeout_secs);
        let t0 = Instant::now();
        let mut posted = transport::post(cfg.op, &prefill, &decode, &pairs, &tag, timeout)?;
        loop {
            if transport::poll(cfg.op, &prefill, &decode, &mut posted)?.is_some() {
                break;
            }
            std::thread::sleep(Duration::from_micros(20));
        }
        let mut tags = std::collections::HashMap::from([(tag.clone(), crate::sys::deadline::Deadline::after(timeout))]);
        transport::await_notifications(cfg.op, &prefill, &decode, &mut tags)?;
        seconds = t0.elapsed().as_secs_f64();
    }
    let mut out = RegionReport {
        kind: p.region.kind.clone(),
        name: p.region.name.clone(),
        rank: p.rank,
        layers,
        unit: unit_name(p.region.unit).into(),
        units: p.units,
        page_bytes: p.region.page_bytes,
        page_stride_bytes: p.region.page_stride_bytes,
        descriptors_per_page: p.region.descriptors.len() as u32,
        bytes_moved: moved,
        seconds,
        pages_compared: 0,
        pages_corrupt: 0,
        runs_compared: 0,
        failures: Vec::new(),
    };
    let dst = &decode.pool;
    for li in 0..layers {
        let layer = p.region.layers[li as usize];
        for i in 0..p.units {
            let u = p.decode_unit(i);
            dst.read_slice(SliceCoord { layer: li, kv: KvPart::Latent, block: u }, &mut page)?;
            out.pages_compared += 1;
            let mut corrupt = false;
            for (k, run) in p.runs.iter().enumerate() {
                let rows = run_rows(run, layer, p.id_of(seed, i), REGION_GENERATION);
                let at = run.offset as usize;
                let got = &page[at..at + rows.len() as usize];
                out.runs_compared += 1;
                if fingerprint::check(got, seed, &rows).0 == 0 {
                    continue;
                }
                corrupt = true;
                if out.failures.len() < cfg.max_failures {
                    let v = verify::classify(got, &rows, seed, p.page_slot(li, u), REGION_POISON_ITERATION);
                    out.failures.push(RegionFailure {
                        layer,
                        part: p.run_names.get(k).cloned().unwrap_or_else(|| format!("part {}", run.part)),
                        unit: u,
                        id: p.id_of(seed, i),
                        class: v.class,
                        observed: v.observed,
                        bit_flips: v.bit_flips,
                    });
                }
            }
            out.pages_corrupt += corrupt as u64;
        }
    }
    Ok(out)
}
