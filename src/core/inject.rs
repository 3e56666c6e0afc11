//! Fault injection through the real transfer path (`--inject CLASS[:COUNT]`).
//!
//! Each injection damages COUNT block slices (default 1) in every iteration, at seeded
//! random coordinates, by changing what the prefill side writes or what the NIXL request
//! carries — never by touching the decode side directly:
//!
//! | injection | what is done | predicted class at the decode slot |
//! |-----------|--------------|------------------------------------|
//! | `bitflip`  | flip one bit of a source slice after the fill | `bitflip` |
//! | `drop`     | leave the slice's descriptor out of the request | `unwritten` |
//! | `misroute` | pair source slice a with b's destination slot (a's and b's own descriptors dropped) | `misplaced` at b's slot, `unwritten` at a's |
//! | `stale`    | leave the source slice at the previous generation | `stale` |
//! | `torn`     | transfer only a prefix of the slice (a multiple of 16 bytes) | `torn` |
//! | `head-offset` | move the slice's rows with a wrong head offset: every row but the last head's takes the next head's row of the same slice (a TP rank's wrong head offset) | `layout` (displacement head offset +1) |
//! | `token-offset` | the same with a token offset: every row but the last token's takes the next token's row (a block-size conversion cut one token off) | `layout` (displacement token offset +1) |
//! | `stray`    | one request carries an extra descriptor into another stage's decode slot (needs ≥ 3 pipeline stages): stage 0's, into a slot of stage ≥ 2 before that stage is posted; in the last iteration with ≥ 4 stages, the last stage's, into a slot of stage 0 after it verified | `stray` (found by the poison check before the post; by the re-verify after the last iteration) |
//!
//! Beyond the class, each slice an injection reaches has exact predicted bytes
//! ([`Prediction`], made by the sweep's plan and by a scenario's decode engine): a failure
//! counts as predicted only when its bytes are those ([`matches_prediction`]).

use crate::core::geometry::{Geometry, SliceCoord};
use crate::core::verify::Class;
use crate::error::{Error, Result};
use rand::Rng;
use serde::{Deserialize, Serialize};
use std::collections::{HashMap, HashSet};
use std::ops::Range;

/// An injection kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Kind {
    /// Flip a bit in a source slice after the fill.
    Bitflip,
    /// Leave descriptors out of the request.
    Drop,
    /// Pair a source block with another destination slot.
    Misroute,
    /// Skip refilling a source slice this generation.
    Stale,
    /// Transfer part of a slice.
    Torn,
    /// Write a slice into a decode slot of a later pipeline stage, outside its transfer.
    Stray,
    /// Move a slice's rows with a wrong head offset ([`crate::core::pairing::Plant::HeadOffset`]).
    HeadOffset,
    /// Move a slice's rows with a wrong token offset ([`crate::core::pairing::Plant::TokenOffset`]).
    TokenOffset,
}

impl Kind {
    /// Name as written on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Kind::Bitflip => "bitflip",
            Kind::Drop => "drop",
            Kind::Misroute => "misroute",
            Kind::Stale => "stale",
            Kind::Torn => "torn",
            Kind::Stray => "stray",
            Kind::HeadOffset => "head-offset",
            Kind::TokenOffset => "token-offset",
        }
    }
}

/// One `--inject CLASS[:COUNT]` flag.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Spec {
    /// What to inject.
    pub kind: Kind,
    /// How many per iteration (≥ 1).
    pub count: u32,
}

impl std::str::FromStr for Spec {
    type Err = String;
    /// Parses `CLASS` or `CLASS:COUNT`, CLASS one of bitflip, drop, misroute, stale, torn, stray,
    /// head-offset, token-offset.
    fn from_str(s: &str) -> std::result::Result<Spec, String> {
        let (name, count) = match s.split_once(':') {
            Some((n, c)) => {
                let c: u32 = c.parse().map_err(|_| format!("COUNT in {s:?} must be an integer from 1 to {}", u32::MAX))?;
                (n, c)
            }
            None => (s, 1),
        };
        if count == 0 {
            return Err(format!("COUNT in {s:?} must be at least 1"));
        }
        let kind = match name {
            "bitflip" => Kind::Bitflip,
            "drop" => Kind::Drop,
            "misroute" => Kind::Misroute,
            "stale" => Kind::Stale,
            "torn" => Kind::Torn,
            "stray" => Kind::Stray,
            "head-offset" => Kind::HeadOffset,
            "token-offset" => Kind::TokenOffset,
            _ => {
                return Err(format!(
                    "unknown injection {name:?} (expected bitflip, drop, misroute, stale, torn, stray, head-offset or token-offset)"
                ));
            }
        };
        Ok(Spec { kind, count })
    }
}

/// One `--inject CLASS[:COUNT]@REGION` flag: faults planted in a hybrid model's state or
/// indexer region (`REGION` = `state` or `indexer`, a region's kind) rather than in the
/// attention sweep ([`crate::sweep::regions`]). The classes that apply to a region's pages:
/// bitflip, drop, misroute, stale, torn; COUNT faults in each region of that kind on each TP
/// rank the run moves.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegionSpec {
    /// What to inject.
    pub kind: Kind,
    /// How many in each region of that kind, per TP rank (≥ 1).
    pub count: u32,
    /// The region kind (`state`, `indexer`).
    pub region: String,
}

/// The region kinds `@REGION` names.
pub const REGION_KINDS: &[&str] = &["state", "indexer"];

/// One `--inject` value: a fault of the attention sweep ([`Spec`]) or of a region
/// ([`RegionSpec`], written with `@REGION`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum InjectArg {
    /// `CLASS[:COUNT]`.
    Sweep(Spec),
    /// `CLASS[:COUNT]@REGION`.
    Region(RegionSpec),
}

impl std::str::FromStr for InjectArg {
    type Err = String;
    /// Parses `CLASS[:COUNT]` ([`Spec`]) or `CLASS[:COUNT]@REGION` (REGION `state` or `indexer`,
    /// CLASS one of bitflip, drop, misroute, stale, torn).
    fn from_str(s: &str) -> std::result::Result<InjectArg, String> {
        let Some((spec, region)) = s.split_once('@') else { return s.parse().map(InjectArg::Sweep) };
        let Spec { kind, count } = spec.parse()?;
        if !REGION_KINDS.contains(&region) {
            return Err(format!("REGION in {s:?} must be state or indexer (a hybrid model's region kind)"));
        }
        if !matches!(kind, Kind::Bitflip | Kind::Drop | Kind::Misroute | Kind::Stale | Kind::Torn) {
            return Err(format!(
                "{} does not apply to a region's pages (its rows have no heads, tokens or pipeline stages): give bitflip, drop, misroute, stale or torn with @{region}",
                kind.name()
            ));
        }
        Ok(InjectArg::Region(RegionSpec { kind, count, region: region.to_string() }))
    }
}

/// One planned injection in one iteration, by source-side coordinates.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    /// Flip `bit` (0..8) of byte `offset` in source slice `at`.
    Bitflip {
        /// Source slice.
        at: SliceCoord,
        /// Byte offset.
        offset: u64,
        /// Bit index.
        bit: u8,
    },
    /// Omit source slice `at` from the request.
    Drop {
        /// Source slice.
        at: SliceCoord,
    },
    /// Send source slice `from` to the destination slot of source slice `to`; neither
    /// slice's own descriptor is sent.
    Misroute {
        /// Source slice whose bytes travel.
        from: SliceCoord,
        /// Source slice whose destination slot receives them.
        to: SliceCoord,
    },
    /// Leave source slice `at` at the previous generation.
    Stale {
        /// Source slice.
        at: SliceCoord,
    },
    /// Send only the first `len` bytes of source slice `at`.
    Torn {
        /// Source slice.
        at: SliceCoord,
        /// Bytes sent.
        len: u64,
    },
    /// The request of pipeline stage `carrier` also carries source slice `from` (a layer of
    /// that stage) to the destination slot of source slice `at` (another stage's layer),
    /// whose own descriptor travels as usual with its stage. `carrier` 0, `at` in stage 2 or
    /// later: the slot's poison is overwritten after stage 0 completed and before the slot's
    /// stage is posted (the poison check finds it). `carrier` the last of ≥ 4 stages in the
    /// last iteration, `at` in stage 0: the slot is overwritten after stage 0 verified, and
    /// nothing re-poisons it (the re-verify after the last iteration finds it).
    Stray {
        /// Source slice whose bytes land in the wrong slot.
        from: SliceCoord,
        /// Source slice whose destination slot is hit.
        at: SliceCoord,
        /// The pipeline stage whose request carries the stray descriptor.
        carrier: u32,
    },
    /// Move source slice `at`'s rows with a wrong head offset.
    HeadOffset {
        /// Source slice.
        at: SliceCoord,
    },
    /// Move source slice `at`'s rows with a wrong token offset.
    TokenOffset {
        /// Source slice.
        at: SliceCoord,
    },
}

/// Checks that the injections fit the geometry and the sweep's pipeline `stages` (the layer
/// ranges of `sweep::stages`). Errors (exit 2): torn needs slices of at least 32
/// bytes; stray needs at least 3 stages (its slot must lie in a stage posted after stage 0
/// completed) and at most as many as the slices of stages 2 and later (and, with 4 stages or
/// more, of stage 0, where the last iteration's strays land); misroute pairs two
/// slices of one (layer, K/V), so each needs a group with two free blocks (a stray takes
/// one); head-offset needs two KV heads (not MLA); all injections need distinct slices.
/// (token-offset's need of two tokens per prefill block is checked with the sides:
/// `g` here may be a group of several prefill blocks, [`crate::core::pairing::Sides::planning`].)
pub fn check(specs: &[Spec], g: &Geometry, stages: &[Range<u32>]) -> Result<()> {
    let sb = g.slice_bytes()?;
    let (mut pairs, mut singles, mut strays): (u64, u64, u64) = (0, 0, 0);
    for s in specs {
        if s.kind == Kind::Torn && sb < 32 {
            return Err(Error::Usage(format!("--inject torn needs block slices of at least 32 bytes (they are {sb})")));
        }
        if s.kind == Kind::HeadOffset && (g.mla || g.num_kv_heads < 2) {
            return Err(Error::Usage(
                "--inject head-offset needs at least 2 KV heads in a block slice (MLA and one head have no head to shift by)"
                    .into(),
            ));
        }
        match s.kind {
            Kind::Misroute => pairs += s.count as u64,
            Kind::Stray => strays += s.count as u64,
            _ => singles += s.count as u64,
        }
    }
    if strays > 0 {
        if stages.len() < 3 {
            return Err(Error::Usage(format!(
                "--inject stray needs at least 3 pipeline stages (this sweep has {}; --pipeline-stages 3 or more, with at \
                 least 3 layers): the stray write travels with stage 0 and must land in a stage posted after stage 0 \
                 completed, whose poison is checked right before that post",
                stages.len()
            )));
        }
        let mut room = (g.num_layers - stages[2].start) as u64 * g.slices_per_layer();
        if stages.len() >= 4 {
            room = room.min(stages[0].len() as u64 * g.slices_per_layer());
        }
        if strays > room {
            return Err(Error::Usage(format!(
                "--inject stray needs {strays} distinct block slices per iteration in pipeline stages 2 and later (and in stage 0 \
                 with 4 stages or more); there are {room}"
            )));
        }
        singles += strays;
    }
    if pairs > 0 && g.num_blocks < 2 {
        return Err(Error::Usage("--inject misroute needs at least 2 blocks".into()));
    }
    let groups = g.num_layers as u64 * g.kv_parts() as u64;
    let max_pairs = (groups * (g.num_blocks as u64 / 2)).saturating_sub(strays);
    if pairs > max_pairs {
        return Err(Error::Usage(format!(
            "--inject misroute needs {pairs} pairs of blocks in one layer and K/V per iteration; the pool has room for {max_pairs}"
        )));
    }
    let have = g.total_slices()?;
    if 2 * pairs + singles > have {
        return Err(Error::Usage(format!(
            "the injections need {} distinct block slices per iteration; the pool has {have}",
            2 * pairs + singles
        )));
    }
    Ok(())
}

/// Distinct random slices, drawn group by group (a group is one layer's K, V or latent).
struct Picker<'a> {
    g: &'a Geometry,
    used: HashSet<SliceCoord>,
    used_in: HashMap<u64, u32>,
}

impl Picker<'_> {
    fn groups(&self) -> u64 {
        self.g.num_layers as u64 * self.g.kv_parts() as u64
    }

    fn free_in(&self, gi: u64) -> u32 {
        self.g.num_blocks - self.used_in.get(&gi).copied().unwrap_or(0)
    }

    /// The first group, from a random start, with at least `n` free blocks.
    fn group_with(&self, n: u32, rng: &mut impl Rng) -> u64 {
        let groups = self.groups();
        let start = rng.random_range(0..groups);
        (0..groups).map(|k| (start + k) % groups).find(|&gi| self.free_in(gi) >= n).expect("check() bounds the injections")
    }

    /// A random unused block of group `gi` (which has a free one).
    fn take(&mut self, gi: u64, rng: &mut impl Rng) -> SliceCoord {
        let parts = self.g.parts();
        let (layer, kv) = ((gi / parts.len() as u64) as u32, parts[(gi % parts.len() as u64) as usize]);
        loop {
            let c = SliceCoord { layer, kv, block: rng.random_range(0..self.g.num_blocks) };
            if self.used.insert(c) {
                *self.used_in.entry(gi).or_default() += 1;
                return c;
            }
        }
    }
}

/// Plans one iteration's injections at distinct random source slices (strays first, then
/// misroute pairs, so [`check`]'s capacity bounds hold; a run without strays draws exactly as
/// before they existed). `stages` are the sweep's pipeline stages; `last` says this is its
/// last iteration (strays then land after their slot verified, when there are ≥ 4 stages:
/// see [`Action::Stray`]). Call [`check`] first.
pub fn plan(specs: &[Spec], g: &Geometry, stages: &[Range<u32>], last: bool, rng: &mut impl Rng) -> Vec<Action> {
    let sb = g.slice_bytes().unwrap_or(0);
    let mut p = Picker { g, used: HashSet::new(), used_in: HashMap::new() };
    let mut out = Vec::new();
    let (strays, rest): (Vec<&Spec>, Vec<&Spec>) = specs.iter().partition(|s| s.kind == Kind::Stray);
    if stages.len() >= 3 && !strays.is_empty() {
        let parts = g.parts().len() as u64;
        let n = stages.len();
        // (the stage carrying the stray, its layers, the layers of the slots it hits)
        let (carrier, from_layers, at_layers) = if last && n >= 4 {
            (n - 1, stages[n - 1].clone(), stages[0].clone())
        } else {
            (0, stages[0].clone(), stages[2].start..g.num_layers)
        };
        let groups = (at_layers.start as u64 * parts)..(at_layers.end as u64 * parts);
        for s in strays {
            for _ in 0..s.count {
                let count = groups.end - groups.start;
                let start = rng.random_range(0..count);
                let gi = (0..count)
                    .map(|k| groups.start + (start + k) % count)
                    .find(|&gi| p.free_in(gi) >= 1)
                    .expect("check() bounds the strays");
                let at = p.take(gi, rng);
                let from = SliceCoord {
                    layer: rng.random_range(from_layers.clone()),
                    kv: g.parts()[rng.random_range(0..g.parts().len())],
                    block: rng.random_range(0..g.num_blocks),
                };
                out.push(Action::Stray { from, at, carrier: carrier as u32 });
            }
        }
    }
    let (pairs, singles): (Vec<&Spec>, Vec<&Spec>) = rest.into_iter().partition(|s| s.kind == Kind::Misroute);
    for s in pairs {
        for _ in 0..s.count {
            let gi = p.group_with(2, rng);
            let from = p.take(gi, rng);
            let to = p.take(gi, rng);
            out.push(Action::Misroute { from, to });
        }
    }
    for s in singles {
        for _ in 0..s.count {
            let gi = p.group_with(1, rng);
            let a = p.take(gi, rng);
            out.push(match s.kind {
                Kind::Bitflip => Action::Bitflip { at: a, offset: rng.random_range(0..sb), bit: rng.random_range(0..8) },
                Kind::Drop => Action::Drop { at: a },
                Kind::Stale => Action::Stale { at: a },
                Kind::Torn => Action::Torn { at: a, len: 16 * rng.random_range(1..sb / 16) },
                Kind::HeadOffset => Action::HeadOffset { at: a },
                Kind::TokenOffset => Action::TokenOffset { at: a },
                Kind::Misroute | Kind::Stray => unreachable!("partitioned above"),
            });
        }
    }
    out
}

impl Action {
    /// The injection kind.
    pub fn kind(&self) -> Kind {
        match self {
            Action::Bitflip { .. } => Kind::Bitflip,
            Action::Drop { .. } => Kind::Drop,
            Action::Misroute { .. } => Kind::Misroute,
            Action::Stale { .. } => Kind::Stale,
            Action::Torn { .. } => Kind::Torn,
            Action::Stray { .. } => Kind::Stray,
            Action::HeadOffset { .. } => Kind::HeadOffset,
            Action::TokenOffset { .. } => Kind::TokenOffset,
        }
    }

    /// Predicted damage as `(source slice whose destination slot is hit, class)`.
    pub fn predicted(&self) -> Vec<(SliceCoord, Class)> {
        match *self {
            Action::Bitflip { at, .. } => vec![(at, Class::Bitflip)],
            Action::Drop { at } => vec![(at, Class::Unwritten)],
            Action::Misroute { from, to } => vec![(to, Class::Misplaced), (from, Class::Unwritten)],
            Action::Stale { at } => vec![(at, Class::Stale)],
            Action::Torn { at, .. } => vec![(at, Class::Torn)],
            Action::Stray { at, .. } => vec![(at, Class::Stray)],
            Action::HeadOffset { at } | Action::TokenOffset { at } => vec![(at, Class::Layout)],
        }
    }
}

/// Bytes that land in a decode slice an injection reaches ([`Prediction`]): `len` bytes from
/// `src_off` of a source slice — the fingerprint of `rows` ([`crate::core::fingerprint::expected`]),
/// with bit `flip.1` of byte `flip.0` flipped when set (a planted bitflip) — to `dst_off` of
/// the decode slice, before decode's conversion on receive.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Landing {
    /// The source slice's rows (its identity — which block, which generation — and its side's
    /// row shape, a TP rank's heads included).
    pub rows: crate::core::fingerprint::SliceRows,
    /// A flipped bit of the source slice: (byte offset in the slice, bit 0..8).
    pub flip: Option<(u64, u8)>,
    /// Byte offset in the source slice.
    pub src_off: u64,
    /// Byte offset in the decode slice (received order: before any conversion).
    pub dst_off: u64,
    /// Bytes.
    pub len: u64,
}

/// What a decode slice holds before an injection's bytes land on it ([`Prediction`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Under {
    /// The poison of (slot, iteration) ([`crate::core::fingerprint::poison`]): what the transfer
    /// writes over, and what a stray write finds before the slot's own stage is posted.
    Poison {
        /// The slot's global slice index in decode's pool.
        slot: u32,
        /// The poison's iteration.
        iteration: u32,
    },
    /// The fingerprint of these rows: the slice as it verified, which a stray write of the
    /// last iteration overwrites after the verify.
    Due(crate::core::fingerprint::SliceRows),
}

/// Exactly what an injected decode slice must hold, described rather than stored: `under`,
/// then every `landed` run copied over it in order, then (with `convert`) decode's conversion
/// on receive ([`crate::core::pairing::Sides::convert`]: row `r` of the result is row `perm[r]` of
/// the received slice, rows of `row_bytes`). A slice the injection reached is "as
/// predicted" only when its bytes equal these byte for byte ([`matches_prediction`]): the
/// class alone (`torn`, `misplaced`, `stale` are broad) would excuse real damage inside it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Prediction {
    /// The class the verifier must report.
    pub class: Class,
    /// Bytes of the decode slice.
    pub slice_bytes: u64,
    /// What the slice holds before anything lands.
    pub under: Under,
    /// What lands, in order (a later run overwrites an earlier one where they overlap).
    pub landed: Vec<Landing>,
    /// Decode's conversion on receive: (row permutation, row bytes); `None`: none.
    pub convert: Option<(std::sync::Arc<[u32]>, u32)>,
}

impl Prediction {
    /// The predicted bytes of the slice (`slice_bytes` of them), fingerprints generated with
    /// `seed`.
    pub fn bytes(&self, seed: u64) -> Vec<u8> {
        let n = self.slice_bytes as usize;
        let mut out = vec![0u8; n];
        match self.under {
            Under::Poison { slot, iteration } => crate::core::fingerprint::poison(&mut out, slot, iteration),
            Under::Due(rows) => crate::core::fingerprint::fill(&mut out, seed, &rows),
        }
        // Source slices, generated once each (a slice cut by head lands in several runs).
        let mut sources: Vec<(Landing, Vec<u8>)> = Vec::new();
        for l in &self.landed {
            let k = match sources.iter().position(|(x, _)| x.rows == l.rows && x.flip == l.flip) {
                Some(k) => k,
                None => {
                    let mut b = crate::core::fingerprint::expected(seed, &l.rows);
                    if let Some((at, bit)) = l.flip
                        && let Some(x) = b.get_mut(at as usize)
                    {
                        *x ^= 1 << bit;
                    }
                    sources.push((*l, b));
                    sources.len() - 1
                }
            };
            let src = &sources[k].1;
            let (s, d, len) = (l.src_off as usize, l.dst_off as usize, l.len as usize);
            out[d..d + len].copy_from_slice(&src[s..s + len]);
        }
        self.permute(out)
    }

    fn permute(&self, received: Vec<u8>) -> Vec<u8> {
        let Some((perm, rb)) = &self.convert else { return received };
        let rb = *rb as usize;
        let mut out = vec![0u8; received.len()];
        for (to, &from) in perm.iter().enumerate() {
            let from = from as usize * rb;
            out[to * rb..(to + 1) * rb].copy_from_slice(&received[from..from + rb]);
        }
        out
    }

    /// SHA-256 of [`Prediction::bytes`] ([`crate::core::fingerprint::digest`]): what the failure's
    /// `actual_digest` must be.
    pub fn digest(&self, seed: u64) -> String {
        crate::core::fingerprint::digest(&self.bytes(seed))
    }

    /// The byte ranges `[offset, bytes]` of the slice (decode's layout, after any conversion)
    /// that its transfer wrote, sorted and merged, when that is not the whole slice: the rest
    /// holds the slot's poison. `None` for a whole slice written, and for a stray write
    /// (which lands on a slice its transfer wrote or will write).
    pub fn written(&self) -> Option<Vec<[u64; 2]>> {
        if self.class == Class::Stray || !matches!(self.under, Under::Poison { .. }) {
            return None;
        }
        let mut mask = vec![0u8; self.slice_bytes as usize];
        for l in &self.landed {
            mask[l.dst_off as usize..(l.dst_off + l.len) as usize].fill(1);
        }
        let mask = self.permute(mask);
        if mask.iter().all(|&m| m == 1) {
            return None;
        }
        let mut out: Vec<[u64; 2]> = Vec::new();
        for (i, &m) in mask.iter().enumerate() {
            if m == 0 {
                continue;
            }
            match out.last_mut() {
                Some(r) if r[0] + r[1] == i as u64 => r[1] += 1,
                _ => out.push([i as u64, 1]),
            }
        }
        Some(out)
    }
}

/// Whether an injection counts as detected as predicted, from `found`: per slice it reached,
/// whether that slice was found with its predicted class and exactly its predicted bytes
/// ([`matches_prediction`]). It must have reached a slice and every one must be found so: an
/// injection that reached nothing is not detected (`all` over nothing would say it was).
pub fn detected_as_predicted(found: impl IntoIterator<Item = bool>) -> bool {
    let mut reached = false;
    for f in found {
        if !f {
            return false;
        }
        reached = true;
    }
    reached
}

/// True when a failing slice was found as an injection predicts it: there is a prediction
/// (`pred`), the verifier's class is its class, and the slice's `bytes` (the bytes that were
/// classified) are exactly the predicted ones ([`Prediction::bytes`] with `seed`). Anything
/// else is an unexpected failure, and the injection is then not detected as predicted.
pub fn matches_prediction(pred: Option<&Prediction>, class: Class, seed: u64, bytes: &[u8]) -> bool {
    pred.is_some_and(|p| p.class == class && p.slice_bytes == bytes.len() as u64 && p.bytes(seed) == bytes)
}
